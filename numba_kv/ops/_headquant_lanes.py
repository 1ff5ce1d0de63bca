"""Single-source cores of the whole-head quantizer (:mod:`numba_kv.ops.headquant`).

The CPU twins work on tiles of :data:`LANES` vectors interleaved lane by lane (value ``j``
of lane ``l`` at ``t[j*L + l]``), so every inner loop is a contiguous loop over lanes that
vectorizes; the cores are compiled for both targets with :func:`numba_kv._jit.twin`.  The
whole-head rotation is ``y = H_d D_s x / sqrt(d)``: a fast Walsh-Hadamard transform after
the random signs (QuaRot / TurboQuant, arXiv:2404.00456, arXiv:2504.19874).
"""

from __future__ import annotations

import math

import numpy as np
from numba import float32, int64, uint16

from .._jit import twin
from ._index import unravel2
from .bitpack import load_word, store_word
from .codebook import bucketize
from .half import f16_bits_abs_to_f32, f32_to_f16_bits


# --- single-source cores -------------------------------------------------------------
def head_scale(d):
    """``1/√d`` in float32 for a power of two ``d`` (a power of two times float32(1/√2): exact)."""
    sc = float32(1.0)
    m = d
    while m >= 4:
        sc = sc * float32(0.5)
        m = m >> 2
    if m == 2:
        sc = sc * float32(0.7071067811865476)
    return sc


def _butterflies_head_lanes(t, d, L):
    """The ``log2(d)`` unnormalized radix-2 stages (strides ``1, 2, …, d/2``) on ``L``
    interleaved vectors, in place.  Stage ``h`` pairs the contiguous runs
    ``[2ih·L, (2i+1)h·L)`` and ``[(2i+1)h·L, (2i+2)h·L)`` value by value: ``(a, b) → (a+b, a−b)``."""
    # stage order h = 1, 2, 4, ..., d/2 is part of the float32 result: keep it
    h = 1
    while h < d:
        hl = h * L
        for i in range(d // (2 * h)):
            o = 2 * i * hl
            ta = t[o:o + hl]  # views indexed from 0: no wraparound checks, the loop vectorizes
            tb = t[o + hl:o + 2 * hl]
            for m in range(hl):
                a = ta[m]
                b = tb[m]
                ta[m] = a + b
                tb[m] = a - b
        h = h * 2


def _wht_head_lanes(t, d, L):
    """In-place normalized ``d``-point Walsh–Hadamard transform of ``L`` interleaved vectors."""
    _butterflies_head_lanes(t, d, L)
    sc = head_scale(d)
    for m in range(d * L):
        t[m] = t[m] * sc


_, head_scale_dev = twin(head_scale)
twin(_butterflies_head_lanes)
twin(_wht_head_lanes)


def _rotate_head_forward_lanes(t, d, L, signs):
    """``H_d D_s`` on ``L`` interleaved vectors (in place): signs first, then the Hadamard."""
    for j in range(d):
        sj = signs[j]
        tj = t[j * L:(j + 1) * L]
        for l in range(L):
            tj[l] = tj[l] * sj
    _wht_head_lanes(t, d, L)


def _rotate_head_inverse_lanes(t, d, L, signs):
    """``D_s H_d`` on ``L`` interleaved vectors (in place): the Hadamard, then the signs."""
    _butterflies_head_lanes(t, d, L)
    sc = head_scale(d)
    for j in range(d):
        f = sc * signs[j]  # (v·sc)·s_j == v·(sc·s_j) exactly: s_j = ±1
        tj = t[j * L:(j + 1) * L]
        for l in range(L):
            tj[l] = tj[l] * f


twin(_rotate_head_forward_lanes)
twin(_rotate_head_inverse_lanes)


def rotate_head_forward(buf, d, signs):
    """``buf[0:d] <- H_d D_s buf[0:d]`` (forward head rotation, in place, float32 ``buf``)."""
    _rotate_head_forward_lanes(buf, d, 1, signs)


def rotate_head_inverse(buf, d, signs):
    """``buf[0:d] <- D_s H_d buf[0:d]`` (inverse head rotation, in place, float32 ``buf``)."""
    _rotate_head_inverse_lanes(buf, d, 1, signs)


rotate_head_forward_cpu, rotate_head_forward_dev = twin(rotate_head_forward)
rotate_head_inverse_cpu, rotate_head_inverse_dev = twin(rotate_head_inverse)


def rotate_head_row(x, r, d, signs, inverse, buf, out):
    """``out[r] = rotation of x[r]`` (forward or inverse) through the scratch ``buf``."""
    for j in range(d):
        buf[j] = x[r, j]
    if inverse:
        rotate_head_inverse(buf, d, signs)
    else:
        rotate_head_forward(buf, d, signs)
    for j in range(d):
        out[r, j] = buf[j]


rotate_head_row_cpu, _ = twin(rotate_head_row)


def quantize_head_lanes(x, v0, nl, d, signs, bounds, centroids, unbiased, bits, t0, codes, norms,
                         L, t, ib, w):
    """Quantize flattened vectors ``v0 .. v0+nl-1`` of ``x`` (``nl <= L``, ``d = x.shape[2]``)
    into ``codes``/``norms``.

    Scratch: ``t`` float32[(d+3)*L] (rows ``d``, ``d+1``, ``d+2`` hold the lane norms,
    ``‖y‖²`` and ``⟨y, c[idx]⟩``), ``ib`` uint8[d*L], ``w`` int64[(d//8+1)*L] (packed
    words, then the binary16 norm bits).  Rows of ``t``
    are read and written through per-row views indexed from 0 (no wraparound checks).
    """
    seq = x.shape[1]
    S = d * L
    for l in range(nl):
        r, s = unravel2(v0 + l, seq)
        xr = x[r, s]
        for j in range(d):
            t[j * L + l] = xr[j]
    tn = t[S:S + L]
    for l in range(L):
        tn[l] = float32(0.0)
    for j in range(d):
        tj = t[j * L:(j + 1) * L]
        for l in range(L):
            u = tj[l]
            tn[l] += u * u
    for l in range(L):
        tn[l] = max(float32(math.sqrt(tn[l])), float32(1e-10))
    # np.divide: IEEE division without the ZeroDivisionError branch of ``/``
    for j in range(d):
        tj = t[j * L:(j + 1) * L]
        for l in range(L):
            tj[l] = np.divide(tj[l], tn[l])
    _rotate_head_forward_lanes(t, d, L, signs)
    bucketize(t, S, bounds, ib)
    if unbiased:
        tyy = t[S + L:S + 2 * L]
        tyc = t[S + 2 * L:S + 3 * L]
        for l in range(L):
            tyy[l] = float32(0.0)
            tyc[l] = float32(0.0)
        for j in range(d):
            tj = t[j * L:(j + 1) * L]
            ibj = ib[j * L:(j + 1) * L]
            for l in range(L):
                y = tj[l]
                tyy[l] += y * y
                tyc[l] += y * centroids[ibj[l]]
        for l in range(L):
            if tyc[l] > float32(0.0):  # else y = 0 (x = 0): keep n, which stores as 0
                tn[l] = np.divide(tn[l] * tyy[l], tyc[l])
    G = d // 8
    for g in range(G):
        wg = w[g * L:(g + 1) * L]
        for l in range(L):
            wg[l] = int64(0)
        for k in range(8):
            ibk = ib[(g * 8 + k) * L:(g * 8 + k + 1) * L]
            sh = bits * k
            for l in range(L):
                wg[l] |= int64(ibk[l]) << sh
    # binary16 norm bits of every lane in one branch-free (vectorizable) loop: w[G*L + l]
    wn = w[G * L:(G + 1) * L]
    for l in range(L):
        a = tn[l]
        a = a if a < float32(65504.0) else float32(65504.0)  # noqa: FURB136 - NaN -> 65504 too
        wn[l] = int64(f32_to_f16_bits(a))
    for l in range(nl):
        r, s = unravel2(v0 + l, seq)
        cb = codes[r, t0 + s]
        for g in range(G):
            store_word(w[g * L + l], bits, cb, g * bits)
        norms[r, t0 + s, 0] = uint16(wn[l])


def dequantize_head_lanes(codes, norms, v0, nl, d, signs, centroids, bits, t0, out, L, t, w):
    """Reconstruct flattened vectors ``v0 .. v0+nl-1`` of ``out`` (``nl <= L``, ``d = out.shape[2]``).

    Scratch: ``t`` float32[(d+1)*L] (row ``d`` holds the lane norms), ``w`` int64[(d//8+1)*L]
    (packed words, then the binary16 norm bits).
    """
    seq = out.shape[1]
    S = d * L
    G = d // 8
    for l in range(nl):
        r, s = unravel2(v0 + l, seq)
        cb = codes[r, t0 + s]
        for g in range(G):
            w[g * L + l] = load_word(cb, g * bits, bits)
        w[G * L + l] = int64(norms[r, t0 + s, 0])
    # the norms of every lane in one branch-free (vectorizable) loop (lanes >= nl: junk, unused)
    wn = w[G * L:(G + 1) * L]
    for l in range(L):
        t[S + l] = f16_bits_abs_to_f32(wn[l])
    mask = (int64(1) << bits) - 1
    for g in range(G):
        wg = w[g * L:(g + 1) * L]
        for k in range(8):
            tk = t[(g * 8 + k) * L:(g * 8 + k + 1) * L]
            sh = bits * k
            for l in range(L):
                tk[l] = centroids[(wg[l] >> sh) & mask]
    _rotate_head_inverse_lanes(t, d, L, signs)
    for l in range(nl):
        r, s = unravel2(v0 + l, seq)
        orow = out[r, s]
        sc = t[S + l]
        for j in range(d):
            orow[j] = t[j * L + l] * sc


quantize_head_lanes_cpu, _ = twin(quantize_head_lanes)
dequantize_head_lanes_cpu, _ = twin(dequantize_head_lanes)

LANES = 64  # vectors per CPU tile (inner loops of 64 float32 = four 512-bit vectors)
TILES = 2  # tiles per CPU work item (scratch buffers are allocated once per item)

#: the lane rotations under public names, for the cores of other modules (numba_kv.ops.headvq);
#: the same functions, so :func:`numba_kv._jit.twin` rebinds them like the private names
rotate_head_forward_lanes = _rotate_head_forward_lanes
rotate_head_inverse_lanes = _rotate_head_inverse_lanes
