"""Issue 29, round 8: where does a compressed cache lose a needle?  Keep chosen tokens exact.

A diagnosis, not a cache: the compressed cache stores everything as usual, and every
attention the model runs over it (prefill chunks and decode steps, through the dequantized
history) sees the chosen positions' *original* keys and values instead of their codes.  The
originals come from a dense cache run alongside.  If keeping the needle exact brings a lost
needle back, the needle's own codes lost it; if it does not, the error comes from elsewhere.

``--keep``:

* ``none``: nothing exact.  This is the evaluation's run, through the dequantized history.
* ``needle:PAD``: the needle's tokens, and ``PAD`` tokens each side.
* ``question:W:K:POOL``: a SnapKV-style choice (arXiv 2404.14469), an oracle because it
  reads exact keys.  At the prompt's last prefill chunk, the last ``W`` queries' softmax
  attention is summed per KV head (over its query heads and the ``W`` queries) and
  smoothed over ``POOL`` positions.  The ``K`` positions with the most mass per KV head,
  united over the layer's KV heads, are then exact for the answer.

``--chunk none`` prefills the prompt in one chunk: it attends over its own originals, as
``numba-kv eval --mode needle --prefill-attention exact`` does in chunks.

Usage (round 8's table, ``benchmarks/results/kv3-2026-11-29-round8.md``)::

    NUMBA_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 python benchmarks/needle_exact_tokens.py \\
        --cache kv3 --points 3072@25,5120@60,5120@85 --keep needle:0 --out keep.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np

from numba_kv.caches.protocol import Dequantized, DequantResult
from numba_kv.toolkit import models
from numba_kv.toolkit.evaluation.evaluate import model_cache_options
from numba_kv.toolkit.evaluation.needle import answer_found, build_prompt, essays_text
from numba_kv.toolkit.models import generate
from numba_kv.toolkit.specs import parse_cache_specs


class ExactTokens:
    """Stores into ``inner`` (and into ``dense``), returns ``inner``'s dequantized history
    with the positions ``keep`` (or those ``choose(layer, q)`` returns at the prompt's
    last chunk) replaced by ``dense``'s originals.  Decode steps are stored through
    ``prefill`` and returned as :class:`Dequantized` so that the model attends itself."""

    def __init__(self, inner: Any, dense: Any, keep: Any = (), choose: Any = None, n_prompt: int = 0) -> None:
        self.inner, self.dense = inner, dense
        self.keep = {None: np.asarray(keep, dtype=np.int64)}
        self.choose, self.n_prompt = choose, n_prompt

    def seq_len(self, layer: int) -> int:
        return self.inner.seq_len(layer)

    def memory_usage(self) -> int:
        return self.inner.memory_usage()

    def prefill(self, layer: int, k: Any, v: Any, q: Any = None) -> DequantResult:
        d = self.dense.prefill(layer, k, v, q)
        r = self.inner.prefill(layer, k, v, q)
        if self.choose is not None and self.dense.seq_len(layer) == self.n_prompt:
            self.keep[layer] = self.choose(np.asarray(d.k), np.asarray(q))
        keep = self.keep.get(layer, self.keep[None])
        keep = keep[keep < r.k.shape[2]]
        if keep.size == 0:
            return r
        out_k, out_v = np.array(r.k), np.array(r.v)
        out_k[:, :, keep] = np.asarray(d.k)[:, :, keep]
        out_v[:, :, keep] = np.asarray(d.v)[:, :, keep]
        return DequantResult(out_k, out_v, r.logit_bias)

    def decode(self, layer: int, k: Any, v: Any, q: Any, config: Any, *, out: Any = None) -> Dequantized:
        return Dequantized(self.prefill(layer, k, v, q))


def question_choice(window: int, top: int, pool: int):
    """``choose(k, q)`` of ``--keep question:W:K:POOL`` (see the module docstring)."""

    def choose(k: np.ndarray, q: np.ndarray) -> np.ndarray:
        keys = k[0].astype(np.float64)                        # [kv_heads, S, d]
        qs = q[0, :, -window:].astype(np.float64)             # [heads, W, d]
        hkv, s, d = keys.shape
        g, w = qs.shape[0] // hkv, qs.shape[1]
        visible = np.arange(s)[None, :] <= (s - w + np.arange(w))[:, None]   # causal, [W, S]
        chosen: set[int] = set()
        for h in range(hkv):
            logits = np.einsum("gwd,sd->gws", qs[h * g:(h + 1) * g], keys[h]) / np.sqrt(d)
            logits = np.where(visible, logits, -np.inf)
            p = np.exp(logits - logits.max(-1, keepdims=True))
            mass = (p / p.sum(-1, keepdims=True)).sum((0, 1))[: s - w]
            if pool > 1:
                mass = np.convolve(mass, np.ones(pool) / pool, mode="same")
            chosen.update(int(i) for i in np.argsort(mass)[::-1][:top])
        return np.array(sorted(chosen), dtype=np.int64)

    return choose


def keep_rule(text: str, start: int, n_needle: int, n_prompt: int) -> tuple[list[int], Any]:
    """``(keep, choose)`` of a ``--keep`` value for a needle at ``start`` (``n_needle`` tokens)."""
    kind, _, rest = text.partition(":")
    if kind == "none" and not rest:
        return [], None
    if kind == "needle":
        pad = int(rest or 0)
        return list(range(max(0, start - pad), min(n_prompt, start + n_needle + pad))), None
    if kind == "question":
        w, k, pool = (int(x) for x in rest.split(":"))
        return [], question_choice(w, k, pool)
    raise ValueError(f"--keep: expected none, needle:PAD or question:W:K:POOL, got {text!r}")


def run(cache: str, points: list[tuple[int, int]], keep: str, chunk: int | None, model: Any = None,
        tokenizer: Any = None, haystack: str | None = None, gen_tokens: int = 12) -> list[dict]:
    """One greedy answer per ``(length, depth)`` point; rows as written to ``--out``."""
    if model is None:
        model, tokenizer = models.load_model("smollm2")
    c = model.config
    spec = parse_cache_specs(cache)[0]
    dense_spec = parse_cache_specs("dense")[0]
    hay = tokenizer.encode(essays_text() if haystack is None else haystack, add_bos=False)
    rows = []
    for n, depth in points:
        ids, start, n_needle = build_prompt(tokenizer, hay, n, depth / 100)
        kept, choose = keep_rule(keep, start, n_needle, len(ids))
        opts = model_cache_options(model)
        wrapped = ExactTokens(spec.make(c.n_layers, c.n_kv_heads, c.head_dim, **opts),
                              dense_spec.make(c.n_layers, c.n_kv_heads, c.head_dim, **opts),
                              kept, choose, len(ids))
        t0 = time.perf_counter()
        g = generate(model, tokenizer, ids, gen_tokens, cache=wrapped, stop_at_eos=False, chunk_size=chunk)
        rows.append({"cache": cache, "length": n, "depth": depth, "keep": keep, "chunk": chunk,
                     "found": answer_found(g.text)[0], "text": g.text, "s": round(time.perf_counter() - t0, 1)})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", default="kv3", help="cache spec (the library's grammar)")
    ap.add_argument("--points", required=True, help="LENGTH@DEPTH,... e.g. 3072@25,5120@60")
    ap.add_argument("--keep", default="none", help="none | needle:PAD | question:W:K:POOL")
    ap.add_argument("--chunk", default="512", help="prefill chunk, or 'none' for one chunk")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--out", default=None, help="append JSON lines here")
    a = ap.parse_args(argv)
    points = [tuple(int(x) for x in p.split("@")) for p in a.points.split(",")]
    model, tok = models.load_model(a.model)
    chunk = None if a.chunk == "none" else int(a.chunk)
    for row in run(a.cache, points, a.keep, chunk, model, tok):
        line = json.dumps(row)
        print(line, flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
