"""NumPy reference of the block quantizer, bit packing and attention (spec oracles)."""

from __future__ import annotations

import numpy as np

SIGN_MASK = 0xB1A6D4B2


def sign_vector() -> np.ndarray:
    """The llama.cpp 32-entry sign pattern as float32 (bit j of 0xB1A6D4B2 set ⇔ −1)."""
    return np.array([-1.0 if (SIGN_MASK >> j) & 1 else 1.0 for j in range(32)], np.float32)


def hadamard32() -> np.ndarray:
    """Normalized 32×32 Sylvester Hadamard matrix, ``H[i, j] = (−1)^popcount(i & j) / √32``."""
    i = np.arange(32)
    pc = np.vectorize(lambda z: bin(int(z)).count("1"))(i[:, None] & i[None, :])
    return ((-1.0) ** pc / np.sqrt(32.0)).astype(np.float64)


def hadamard(d: int) -> np.ndarray:
    """Normalized ``d``×``d`` Sylvester Hadamard matrix (``d`` a power of two)."""
    i = np.arange(d)
    pc = np.vectorize(lambda z: bin(int(z)).count("1"))(i[:, None] & i[None, :])
    return ((-1.0) ** pc / np.sqrt(float(d))).astype(np.float64)


def hadamard_apply(x: np.ndarray) -> np.ndarray:
    """``x @ Hᵀ`` over the last axis (``d`` a power of two): the ±1 matrix first, then the
    ``1/√d`` factor.  With the normalized matrix (entries ±1/√d, inexact) a coordinate that is
    exactly 0 — every coordinate but the first of a constant block — came out as ±1e-15
    rounding noise, and a code on the tie at 0 (a boundary of every symmetric codebook) flipped
    against the rule ``idx = #{t_i < y}``.  float64 sums of ±float32 values cancel exactly."""
    d = x.shape[-1]
    return (x @ np.round(hadamard(d) * np.sqrt(float(d))).T) / np.sqrt(float(d))


def rotate_head_forward(x: np.ndarray, signs: np.ndarray) -> np.ndarray:
    """Whole-head rotation ``H_d D_s x`` of the last axis (signs first; float64), ``signs``
    the ±1 diagonal."""
    return hadamard_apply(np.asarray(x, np.float64) * np.asarray(signs, np.float64))


def rotate_forward(x: np.ndarray) -> np.ndarray:
    """``D_s H x`` on every 32-block of the last axis (float64)."""
    s = sign_vector().astype(np.float64)
    xb = np.asarray(x, np.float64).reshape(*x.shape[:-1], -1, 32)
    return (hadamard_apply(xb) * s).reshape(x.shape)


def rotate_inverse(y: np.ndarray) -> np.ndarray:
    """``H D_s y`` on every 32-block of the last axis."""
    s = sign_vector().astype(np.float64)
    yb = np.asarray(y, np.float64).reshape(*y.shape[:-1], -1, 32)
    return hadamard_apply(yb * s).reshape(y.shape)


def pack_bits(idx: np.ndarray, bits: int) -> np.ndarray:
    """Pack groups of 8 ``bits``-wide values into ``bits`` bytes, LSB first (bit by bit)."""
    idx = np.asarray(idx, np.uint8)
    n = idx.shape[-1]
    bitarr = ((idx[..., :, None] >> np.arange(bits)) & 1).astype(np.uint8).reshape(*idx.shape[:-1], n * bits)
    return np.packbits(bitarr, axis=-1, bitorder="little")


def unpack_bits(packed: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of :func:`pack_bits`."""
    bitarr = np.unpackbits(np.asarray(packed, np.uint8), axis=-1, bitorder="little")
    n = bitarr.shape[-1] // bits
    b = bitarr.reshape(*bitarr.shape[:-1], n, bits).astype(np.uint16)
    return (b << np.arange(bits, dtype=np.uint16)).sum(-1).astype(np.uint8)


def quantize(x: np.ndarray, centroids: np.ndarray, boundaries: np.ndarray, bits: int, norm_mode: str,
             ref: float, outlier: bool) -> tuple[np.ndarray, np.ndarray]:
    """Reference block quantizer.

    The block norm (``l2``) is summed in float64 and rounded to float32, the rotation is
    applied in float64 and rounded to float32, and the codes are searched in float32.  The
    library's kernels do all of it in float32, so a scale can differ by one binary16 unit in
    the last place (about 1 block in 8,000 on Gaussian input) and a code on a near-tie by one
    level; tests compare scales to a relative ``2**-10`` and allow those one-level flips.

    Returns packed codes ``(..., d·bits/8)`` uint8 and binary16 scale bits ``(..., d/32)``.
    """
    x = np.asarray(x, np.float32)
    xb = x.reshape(*x.shape[:-1], -1, 32)
    if norm_mode == "l2":
        n = np.maximum(np.sqrt((xb.astype(np.float64) ** 2).sum(-1)), 1e-10).astype(np.float32)
        y = rotate_forward((xb / n[..., None]).reshape(x.shape)).astype(np.float32).reshape(xb.shape)
        scale = n
    else:
        r = rotate_forward(x).astype(np.float32).reshape(xb.shape)
        scale = np.maximum(np.abs(r).max(-1) / np.float32(ref), np.float32(1e-10)).astype(np.float32)
        y = r / scale[..., None]
    idx = np.searchsorted(np.asarray(boundaries, np.float32), y, side="left").astype(np.uint8)
    codes = pack_bits(idx.reshape(x.shape), bits)
    flag = np.float32(-1.0 if outlier else 1.0)
    scales = (flag * np.minimum(scale, np.float32(65504.0))).astype(np.float16).view(np.uint16)
    return codes, scales


def dequantize(codes: np.ndarray, scales: np.ndarray, centroids: np.ndarray, bits: int) -> np.ndarray:
    """Reference reconstruction ``|scale| · H D_s c[idx]`` (float64)."""
    idx = unpack_bits(codes, bits)
    c = np.asarray(centroids, np.float64)[idx]
    s = np.abs(np.asarray(scales, np.uint16).view(np.float16).astype(np.float64))
    xb = rotate_inverse(c).reshape(*c.shape[:-1], -1, 32) * s[..., None]
    return xb.reshape(c.shape)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, softmax_scale: float,
              logit_bias: np.ndarray | None = None, causal_offset: int | None = None) -> np.ndarray:
    """Softmax attention in float64 with contiguous GQA grouping.

    Parameters
    ----------
    q : ``[batch, num_heads, q_len, d]``; k, v : ``[batch, num_kv_heads, T, d]``.
    logit_bias : ``[batch, num_heads, q_len, T]`` added to the scaled logits.
    causal_offset : if given, query ``i`` sees keys ``t <= causal_offset + i``.
    """
    q = np.asarray(q, np.float64)
    k = np.asarray(k, np.float64)
    v = np.asarray(v, np.float64)
    b, hq, ql, d = q.shape
    hkv, T = k.shape[1], k.shape[2]
    g = hq // hkv
    kk = np.repeat(k, g, axis=1)
    vv = np.repeat(v, g, axis=1)
    logits = softmax_scale * np.einsum("bhqd,bhtd->bhqt", q, kk)
    if logit_bias is not None:
        logits = logits + np.asarray(logit_bias, np.float64)
    if causal_offset is not None:
        mask = np.arange(T)[None, :] > (causal_offset + np.arange(ql))[:, None]
        logits = np.where(mask, -np.inf, logits)
    logits -= logits.max(-1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhqt,bhtd->bhqd", p, vv)
