"""Issue 29, item 3 (``kv3``): token-level precision.  Does keeping the tokens that attention
keeps returning to exact ("pinned", as H2O, arXiv 2306.14048, and MiKV, arXiv 2402.18096,
keep heavy hitters) buy more than the same number of exact slots spent on a longer window?

Run through a copy of the one-pass engine's block
(:mod:`numba_kv.toolkit.evaluation.simulate`) whose masks differ per KV head: pair ``(i, j)``
reads the exact (float16) key and value when ``j`` is a sink, in the newest ``--window``
stored tokens, or pinned at query ``i``; otherwise the library's head code
(``quantize_head``: randomized Hadamard, binary16 norm, sphere Lloyd–Max, EDEN scale).

The pinned set is causal, as a cache could keep it.  A token leaves the window at query
``exit_j`` (the prompt's at its end); while in the window it is exact, so a cache sees its
attention probability ``p_ij`` (summed over the KV head's query heads) for the ``--window``
queries before ``exit_j`` (the prompt's last ``--window`` queries for prompt tokens: an
observation window, as SnapKV, arXiv 2404.14469).  Its score is the sum (``--score sum``) or
the maximum (``max``) of those probabilities.  Each KV head keeps the ``--pinned`` best
scores among the tokens that have left its window (a min-heap in exit order); a token pushed
out is quantized from then on (from its exact copy: the same reconstruction).  Probabilities
come from the block's exact-key attention of the current (already perturbed) hidden states.

Usage::

    OPENBLAS_NUM_THREADS=1 python benchmarks/kv3_pinning.py --tokens 1024 --prefill 128 \\
        --arms 40:0,20:20,10:30 --k-bits 4 --v-bits 2 --json out.jsonl

An arm ``W:H`` is a window of W tokens and H pinned tokens per KV head (4 sinks on top).
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from numba_kv.metrics import compare_logits
from numba_kv.toolkit import models
from numba_kv.toolkit.evaluation import evaluate as ev
from numba_kv.toolkit.evaluation.simulate import _masks, _window_rounding, simulate_logits
from numba_kv.toolkit.models.llama import apply_rope, rms_norm, rope_tables

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kv3_transform import head_quantizer  # noqa: E402


def pin_mask(p: np.ndarray, exact_after: np.ndarray, n_prefill: int, window: int, pinned: int,
             score: str) -> np.ndarray:
    """Pairs ``(i, j)`` where ``j`` is pinned at query ``i`` ([n, n] bool).

    ``p``: attention probabilities [n, n] (summed over a KV head's query heads);
    ``exact_after[j]``: the first query at which ``j`` is read from the codes (n: never)."""
    n = p.shape[0]
    out = np.zeros((n, n), dtype=bool)
    if pinned <= 0:
        return out
    i = np.arange(n)[:, None]
    ex = exact_after[None, :]
    obs = (i >= np.arange(n)[None, :]) & (i < ex) & (i >= ex - window) & (i >= n_prefill - window)
    pm = np.where(obs, p, 0.0)
    if score == "oracle":  # not a cache: the attention each token will receive once coded
        sc = np.where(i >= ex, p, 0.0).sum(0)
    else:
        sc = pm.sum(0) if score == "sum" else pm.max(0)
    order = np.argsort(exact_after, kind="stable")
    heap: list[tuple[float, int]] = []
    start = np.full(n, n, dtype=np.int64)
    stop = np.full(n, n, dtype=np.int64)
    for j in order:
        t = int(exact_after[j])
        if t >= n:
            break
        start[j] = t
        heapq.heappush(heap, (float(sc[j]), int(j)))
        if len(heap) > pinned:
            _, jj = heapq.heappop(heap)
            stop[jj] = t
    live = start < stop
    rows = np.arange(n)[:, None]
    out[:, live] = (rows >= start[None, live]) & (rows < stop[None, live])
    return out


class PinnedEngine:
    """The one-pass engine's block with per-KV-head pinning (see the module docstring)."""

    def __init__(self, model: Any, ids: np.ndarray, n_prefill: int, window: int, sinks: int, pinned: int,
                 score: str) -> None:
        self.model, self.ids, self.P = model, ids, int(n_prefill)
        self.window, self.sinks, self.pinned, self.score = window, sinks, pinned, score
        n = ids.size
        self.m = _masks(n, self.P, 256, window, sinks)
        q = self.m["quant"]
        self.exact_after = np.where(q.any(0), q.argmax(0), n)
        self.quant_input = _window_rounding(n, self.P, 256, window, sinks, "float16")
        self.pinned_pairs = 0

    def logits(self, kq: list[Any], vq: list[Any]) -> np.ndarray:
        model, c = self.model, self.model.config
        n = self.ids.size
        cos, sin = rope_tables(np.arange(n), c.rope_dim, c.rope_theta, model.freq_factors)
        x = model.tok_embd[self.ids].astype(np.float32)
        for li in range(c.n_layers):
            self._block(li, x, cos, sin, kq[li], vq[li])
        return model.output_logits(x[self.P - 1:], "all")

    def _block(self, li: int, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, kq: Any, vq: Any) -> None:
        model, c = self.model, self.model.config
        L = model.layers[li]
        n = x.shape[0]
        hd, nh, nkv, g = c.head_dim, c.n_heads, c.n_kv_heads, c.n_kv_groups
        h = rms_norm(x, L.attn_norm, c.rms_eps)
        q = apply_rope((h @ L.wq.T).reshape(n, nh, hd).transpose(1, 0, 2)[None], cos, sin)[0]
        k = apply_rope((h @ L.wk.T).reshape(n, nkv, hd).transpose(1, 0, 2)[None], cos, sin)
        v = np.ascontiguousarray((h @ L.wv.T).reshape(n, nkv, hd).transpose(1, 0, 2)[None])
        k_hat = kq(self.quant_input(k))[0]
        v_hat = vq(self.quant_input(v))[0]
        k, v = k[0], v[0]
        m = self.m
        causal = m["causal"]
        out = np.empty((nh, n, hd), dtype=np.float32)
        for kh in range(nkv):
            qg = np.ascontiguousarray(q[kh * g:(kh + 1) * g]).reshape(g * n, hd)
            kw = k[kh].astype(np.float16).astype(np.float32)
            vw = v[kh].astype(np.float16).astype(np.float32)
            s = (qg @ k[kh].T).reshape(g, n, n) * np.float32(model.softmax_scale)
            s[:, ~causal] = -np.inf
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            pin = pin_mask(p.sum(0), self.exact_after, self.P, self.window, self.pinned, self.score)
            self.pinned_pairs += int(pin.sum())
            quant = m["quant"] & ~pin
            win = m["win"] | (pin & m["quant"])
            sq = (qg @ k_hat[kh].T).reshape(g, n, n)
            sw = (qg @ kw.T).reshape(g, n, n)
            s0 = (qg @ k[kh].T).reshape(g, n, n)
            s = np.where(quant, sq, np.where(win, sw, s0)) * np.float32(model.softmax_scale)
            s[:, ~causal] = -np.inf
            s -= s.max(-1, keepdims=True)
            np.exp(s, out=s)
            s /= s.sum(-1, keepdims=True)
            out[kh * g:(kh + 1) * g] = (s * quant) @ v_hat[kh] + (s * m["orig"]) @ v[kh] + (s * win) @ vw
        x += out.transpose(1, 0, 2).reshape(n, nh * hd) @ L.wo.T
        h = rms_norm(x, L.ffn_norm, c.rms_eps)
        gt = h @ L.w_gate.T
        u = h @ L.w_up.T
        sg = np.tanh(gt * np.float32(0.5))
        sg += 1.0
        sg *= np.float32(0.5)
        gt *= sg
        gt *= u
        x += gt @ L.w_down.T


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--prefill", type=int, default=128)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--arms", default="40:0,20:20")
    ap.add_argument("--k-bits", type=int, default=4)
    ap.add_argument("--v-bits", type=int, default=2)
    ap.add_argument("--score", choices=("sum", "max", "oracle"), default="sum")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    model, tok = models.load_model(a.model)
    c = model.config
    text = ev.resolve_text(None).read_text(encoding="utf-8", errors="replace")
    ids = np.asarray(tok.encode(text)[:a.tokens], dtype=np.int64)
    ref = simulate_logits(model, ids, a.prefill)
    rows = []
    for arm in a.arms.split(","):
        w, hp = (int(t) for t in arm.split(":"))
        t0 = time.perf_counter()
        eng = PinnedEngine(model, ids, a.prefill, w, a.sinks, hp, a.score)
        kq = [_centered_head(a.k_bits, a.prefill) for _ in range(c.n_layers)]
        vq = [head_quantizer(a.v_bits, None) for _ in range(c.n_layers)]
        logits = eng.logits(kq, vq)
        m = compare_logits(ref[1:-1], logits[1:-1], ids[a.prefill + 1:])
        row = {"arm": arm, "k_bits": a.k_bits, "v_bits": a.v_bits, "score": a.score, "window": w, "pinned": hp,
               "sinks": a.sinks, "tokens": a.tokens, "prefill": a.prefill,
               "ppl_change_pct": m["ppl_change_pct"], "ppl_change_se": m["ppl_change_pct_se"],
               "top1": m["top1_agreement"], "kl_mean": m["kl_mean"], "s": time.perf_counter() - t0}
        rows.append(row)
        print(f"W{w:>4} H{hp:>4} k{a.k_bits}v{a.v_bits} {a.score}: ΔPPL {row['ppl_change_pct']:+.2f}% ± "
              f"{row['ppl_change_se']:.2f}  top-1 {row['top1']:.3f}  KL {row['kl_mean']:.4f}  ({row['s']:.0f} s)",
              flush=True)
    if a.json:
        with open(a.json, "a") as fh:
            for r in rows:
                fh.write(json.dumps(r) + "\n")
    return 0


def _centered_head(bits: int, n_prefill: int) -> Any:
    """The head code of keys centered on the prompt's per-channel mean (as the caches'
    ``center_keys``; softmax is invariant to a constant added to every key)."""
    base = head_quantizer(bits, None)

    def f(x: np.ndarray) -> np.ndarray:
        mu = x[:, :, :n_prefill].mean(axis=2, keepdims=True)
        return base(x - mu) + mu
    return f


if __name__ == "__main__":
    sys.exit(main())
