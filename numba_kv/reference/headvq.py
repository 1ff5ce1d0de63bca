"""NumPy reference of the whole-head rotation and the head VQ code (spec oracle, float64).

Written from the math of :mod:`numba_kv.ops.headvq`'s docstring, not from its kernels: the
sign vector from SplitMix64 (or the llama.cpp mask at ``d = 32``), the rotation as a dense
Hadamard matrix product, the nearest point by brute force over all points, the EDEN scale
``‖x‖·‖y‖²/⟨y, ĉ⟩`` (the norm kept for ``‖x‖ <= 1e-10``) — all in float64.  The op computes
in float32, so its codes agree with these except where two points are (nearly) equally far
from a group, and its binary16 norms agree up to one unit in the last place.
"""

from __future__ import annotations

import numpy as np

from .polarquant import hadamard_apply, sign_vector

__all__ = ["head_sign_vector", "headvq_dequantize", "headvq_quantize", "headvq_table"]

_M64 = (1 << 64) - 1


def head_sign_vector(d: int, seed: int = 42) -> np.ndarray:
    """The head rotation's ±1 signs: the llama.cpp mask at ``d = 32``, else ``−1`` where bit 63
    of the ``j``-th SplitMix64 output (state ``seed``) is set; float64 ``[d]``."""
    if d == 32:
        return sign_vector().astype(np.float64)
    out = np.empty(d)
    state = seed
    for j in range(d):
        state = (state + 0x9E3779B97F4A7C15) & _M64
        z = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
        z ^= z >> 31
        out[j] = -1.0 if z >> 63 else 1.0
    return out


def headvq_table(points: np.ndarray, d: int) -> np.ndarray:
    """The kernels' table: ``points`` ``[K, m]`` (``√d·u`` units) divided by ``√d`` and rounded
    to float32; float64 values ``[K, m]``."""
    return (np.asarray(points, np.float64) / np.sqrt(d)).astype(np.float32).astype(np.float64)


def headvq_quantize(x: np.ndarray, points: np.ndarray, unbiased: bool = False
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Head VQ code of the rows of ``x`` ``[n, d]`` on ``points`` ``[K, m]`` (``√d·u`` units).

    Returns ``(codes uint8 [n, d/m], norms uint16 [n, 1] (binary16 bits), gap float64
    [n, d/m])``; ``gap`` is the squared-distance margin between the nearest and the second
    nearest point of every group (a near tie where it is tiny).
    """
    x = np.asarray(x, np.float64)
    n_vec, d = x.shape
    k_size, m = np.asarray(points).shape
    c = headvq_table(points, d)
    nrm = np.maximum(np.sqrt((x * x).sum(-1, keepdims=True)), 1e-10)
    y = hadamard_apply((x / nrm) * head_sign_vector(d))
    groups = y.reshape(n_vec, d // m, 1, m)
    dist = ((groups - c[None, None, :, :]) ** 2).sum(-1)  # [n, G, K]
    codes = np.argmin(dist, axis=-1)
    part = np.partition(dist, 1, axis=-1)
    gap = part[..., 1] - part[..., 0]
    chat = c[codes].reshape(n_vec, d)
    scale = nrm[:, 0].copy()
    if unbiased:
        yc = (y * chat).sum(-1)
        ok = (yc > 0) & (nrm[:, 0] > 1e-10)  # at the norm floor y is no unit vector: n is kept
        scale[ok] = nrm[ok, 0] * (y[ok] * y[ok]).sum(-1) / yc[ok]
    norms = np.minimum(scale, 65504.0).astype(np.float16).view(np.uint16)[:, None]
    return codes.astype(np.uint8), norms, gap


def headvq_dequantize(codes: np.ndarray, norms: np.ndarray, points: np.ndarray) -> np.ndarray:
    """Reconstruct ``[n, d]`` from :func:`headvq_quantize`'s codes ``[n, d/m]`` and norms
    ``[n, 1]``: ``|α| · D_s H_d ĉ`` in float64."""
    codes = np.asarray(codes)
    n_vec, g = codes.shape
    m = np.asarray(points).shape[1]
    d = g * m
    chat = headvq_table(points, d)[codes.astype(np.int64)].reshape(n_vec, d)
    alpha = np.abs(np.asarray(norms, np.uint16).view(np.float16).astype(np.float64))
    return hadamard_apply(chat) * head_sign_vector(d) * alpha
