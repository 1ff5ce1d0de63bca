"""Block quantizer ("PolarQuant" of turboquant-rs): normalize → rotate → bucketize → pack.

Per 32-value block of a head vector (the tq3_0 block format of turboquant-rs):

* **MaxNorm** (default): ``r = D_s H x``; ``scale = max(max|r| / ref, 1e-10)``;
  ``y = r / scale`` so the block's extreme lands on the outer centroid ``±ref``.
* **L2**: ``n = max(‖x‖, 1e-10)``; ``y = D_s H (x / n)`` (a unit vector); ``scale = n``.

``idx_j = #{i : y_j > t_i}`` against the codebook boundaries, packed LSB-first with the
``bits``-wide layout of :mod:`numba_kv.ops.bitpack` (block ``q`` at bytes
``[q·4·bits, (q+1)·4·bits)``), and ``flag · scale`` stored as IEEE binary16 bits
(``flag = −1`` marks an outlier-codebook block — PQO —, ``+1`` a normal block — PQ).
Indices are computed from the float32 scale before its binary16 rounding.  Scales are
clamped to the binary16 range (``≤ 65504``): blocks beyond that saturate.

**Unbiased rescale** (``unbiased=True``, EDEN-style as in FAISS 1.15): with the chosen
centroids ``c = c[idx]`` each block stores ``α = scale · ‖y‖² / ⟨y, c⟩`` instead of
``scale`` (same bytes, same indices).  Then ``⟨x̂_b, x_b⟩ = ‖x_b‖²`` per block (up to the
binary16 rounding of ``α``), the error is orthogonal to ``x_b``, and the inner product
with an independent query is unbiased (regression slope 1).  On random unit vectors
(d = 128) the MSE grows by about 10 % at 2 bits and drops by 2-6 % at 3-4 bits.  The
same formula covers both norm modes; a block with ``⟨y, c⟩ <= 1e-30`` (e.g. all zeros)
keeps the plain scale.  ``⟨y, c⟩`` and ``‖y‖²`` are float32 sums over ``j = 0 .. 31`` in
order on both twins.

Dequantization: ``x̂ = |scale| · H D_s c[idx]`` (unchanged by ``unbiased``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import cuda, float32, int32, int64, prange, uint8, uint16

from .. import _backend
from .._jit import cpu_kernel, cuda_kernel, twin
from .._validate import check_bool, check_f16_result, check_float_array, check_span
from ._exact import mul_rn
from ._index import unravel3
from ._registry import register
from .bitpack import group8_word, load_word, store_word, word_index
from .codebook import DEQUANTIZE_SIGNATURE, Codebook, bucketize, bucketize_select, get_codebook
from .finite import FOLD_SIG, check_finite, fold_absbits_cpu, fold_absbits_dev, no_fold, range_stats
from .hadamard import SIGNS32, rotate32_forward_lanes, rotate32_inverse_lanes
from .half import f16_bits_abs_to_f32, f32_to_f16_bits_sat

NORM_MODES = ("maxnorm", "l2")


# --- single-source cores -------------------------------------------------------------
# The cores work on ``L`` blocks side by side (the lane layout of :mod:`.hadamard`: value
# ``j`` of lane ``l`` at ``t[j*L + l]``).  The CPU twins run tiles of ``_LANES`` blocks so
# every inner loop is a contiguous, vectorizable loop over lanes; the CUDA kernels run one
# block per thread with ``L = 1`` (all scratch then lives in registers).  Per value, both
# do the same float32 operations in the same order as the one-block formulation
# described in the module docstring, so the twins agree bit for bit.  Scratch per tile:
# ``t`` float32[35*L] (row 32 holds the lane scales, rows 33/34 the unbiased mode's
# ``⟨y, c⟩`` / ``‖y‖²``: one array, so LLVM can prove scale reads never alias value
# writes; the dequantizer uses rows 0..32 only), ``ib`` uint8[32*L] (indices; quantizer
# only), ``w`` int64[5*L] (the ``8*bits``-bit packed word of each group of 8 indices, and a
# fifth row for the binary16 scale bits, converted for all lanes in one branch-free loop),
# ``cv`` float32[32*L] (unbiased quantizer only: the chosen centroid values, selected
# while bucketizing; a gather ``centroids[ib]`` made the unbiased pass ~1.6x as costly on
# the CPU).  Blocks are read and written through per-block views indexed from 0 (no
# negative-index wraparound code in the loops).
def _next_block(r, s, b, seq, nb):
    """(row, token, block) after ``(r, s, b)`` in flattened order."""
    b += 1
    if b == nb:
        b = 0
        s += 1
        if s == seq:
            s = 0
            r += 1
    return r, s, b


twin(_next_block)


def _quantize_lanes(x, q0, nl, signs, bounds, centroids, l2, unbiased, ref, flag, bits, t0, codes, scales,
                    L, t, ib, w, cv):
    """Quantize flattened blocks ``q0 .. q0+nl-1`` of ``x`` (``nl <= L``) into ``codes``/``scales``.

    ``unbiased``: store ``scale · ‖y‖² / ⟨y, c[idx]⟩`` (module docstring); ``centroids``
    and ``cv`` are only used then.
    """
    seq = x.shape[1]
    nb = x.shape[2] // 32
    r0, s0, b0 = unravel3(q0, seq, nb)
    r, s, b = r0, s0, b0
    for l in range(nl):
        xb = x[r, s, b * 32:b * 32 + 32]
        for j in range(32):
            t[j * L + l] = xb[j]
        r, s, b = _next_block(r, s, b, seq, nb)
    S = 32 * L  # row S of t: the lane scales
    # np.divide: IEEE division without the ZeroDivisionError branch of ``/`` (which stops
    # vectorization); divisors are >= 1e-10 here.
    if l2:
        for l in range(L):
            t[S + l] = float32(0.0)
        for j in range(32):
            for l in range(L):
                v = t[j * L + l]
                t[S + l] += mul_rn(v, v)  # never an FMA (ops/_exact.py)
        for l in range(L):
            t[S + l] = max(float32(math.sqrt(t[S + l])), float32(1e-10))
        for j in range(32):
            for l in range(L):
                t[j * L + l] = np.divide(t[j * L + l], t[S + l])
        rotate32_forward_lanes(t, L, signs)
    else:
        rotate32_forward_lanes(t, L, signs)
        for l in range(L):
            t[S + l] = float32(0.0)
        for j in range(32):
            for l in range(L):
                t[S + l] = max(t[S + l], abs(t[j * L + l]))
        for l in range(L):
            t[S + l] = max(np.divide(t[S + l], ref), float32(1e-10))
        for j in range(32):
            for l in range(L):
                t[j * L + l] = np.divide(t[j * L + l], t[S + l])
    # idx = #{i : y > t_i}, counted boundary by boundary over the whole tile (unbiased:
    # cv = centroids[idx] alongside, by selection — ascending boundaries, so the last hit wins)
    if unbiased:
        bucketize_select(t, S, bounds, centroids, ib, cv)
    else:
        bucketize(t, S, bounds, ib)
    if unbiased:
        # EDEN rescale: scale *= ‖y‖² / ⟨y, c⟩, float32 sums over j = 0..31 in order
        D = S + L
        N = S + 2 * L
        for l in range(L):
            t[D + l] = float32(0.0)
            t[N + l] = float32(0.0)
        for j in range(32):
            for l in range(L):
                y = t[j * L + l]
                t[D + l] += mul_rn(y, cv[j * L + l])
                t[N + l] += mul_rn(y, y)
        for l in range(L):
            dot = t[D + l]
            sc = t[S + l]
            t[S + l] = sc * np.divide(t[N + l], dot) if dot > float32(1e-30) else sc
    # group g of 8 indices -> the ``8*bits``-bit word w[g*L + l] (bitpack layout)
    for g in range(4):
        for l in range(L):
            w[g * L + l] = group8_word(ib, g * 8 * L + l, L, bits)
    # binary16 scale bits of every lane in one branch-free (vectorizable) loop: w[4L + l]
    for l in range(L):
        w[4 * L + l] = int64(f32_to_f16_bits_sat(flag * t[S + l]))
    r, s, b = r0, s0, b0
    for l in range(nl):
        cb = codes[r, t0 + s, b * 4 * bits:(b + 1) * 4 * bits]
        for g in range(4):
            store_word(w[g * L + l], bits, cb, g * bits)
        scales[r, t0 + s, b] = uint16(w[4 * L + l])
        r, s, b = _next_block(r, s, b, seq, nb)


def _dequantize_lanes(codes, scales, q0, nl, signs, centroids, bits, t0, out, L, t, w):
    """Reconstruct flattened blocks ``q0 .. q0+nl-1`` of ``out`` (``nl <= L``)."""
    seq = out.shape[1]
    nb = out.shape[2] // 32
    r0, s0, b0 = unravel3(q0, seq, nb)
    r, s, b = r0, s0, b0
    for l in range(nl):
        cb = codes[r, t0 + s, b * 4 * bits:(b + 1) * 4 * bits]
        for g in range(4):
            w[g * L + l] = load_word(cb, g * bits, bits)
        w[4 * L + l] = int64(scales[r, t0 + s, b])
        r, s, b = _next_block(r, s, b, seq, nb)
    # the scales of every lane in one branch-free (vectorizable) loop (lanes >= nl: junk, unused)
    S = 32 * L
    for l in range(L):
        t[S + l] = f16_bits_abs_to_f32(w[4 * L + l])
    for g in range(4):
        for l in range(L):
            wl = w[g * L + l]
            for k in range(8):
                t[(g * 8 + k) * L + l] = centroids[word_index(wl, bits, k)]
    rotate32_inverse_lanes(t, L, signs)
    r, s, b = r0, s0, b0
    for l in range(nl):
        ob = out[r, s, b * 32:b * 32 + 32]
        sc = t[S + l]
        for j in range(32):
            ob[j] = t[j * L + l] * sc
        r, s, b = _next_block(r, s, b, seq, nb)


quantize_lanes_cpu, quantize_lanes_dev = twin(_quantize_lanes)
dequantize_lanes_cpu, dequantize_lanes_dev = twin(_dequantize_lanes)

_LANES = 64  # blocks per CPU tile (inner loops of 64 float32 = four 512-bit vectors)
_TILES = 4  # tiles per CPU work item (scratch buffers are allocated once per item)
_CHUNK = _TILES * _LANES  # blocks per CPU work item


# --- CPU twins --------------------------------------------------------------------------
@cpu_kernel
def _quantize_cpu(x, signs, bounds, centroids, l2, unbiased, ref, flag, bits, t0, codes, scales):
    """CPU twin of :func:`_quantize_cuda`: ``prange`` over runs of ``_TILES`` tiles of ``_LANES`` blocks."""
    rows, seq, d = x.shape
    nq = rows * seq * (d // 32)
    for c in prange((nq + _CHUNK - 1) // _CHUNK):
        t = np.zeros(35 * _LANES, dtype=np.float32)
        ib = np.zeros(32 * _LANES, dtype=np.uint8)
        w = np.zeros(5 * _LANES, dtype=np.int64)
        cv = np.zeros(32 * _LANES if unbiased else 0, dtype=np.float32)
        for q0 in range(c * _CHUNK, min(nq, (c + 1) * _CHUNK), _LANES):  # the item's tiles
            quantize_lanes_cpu(x, q0, min(_LANES, nq - q0), signs, bounds, centroids, l2, unbiased, ref, flag,
                               bits, t0, codes, scales, _LANES, t, ib, w, cv)


@cpu_kernel
def _quantize_pair_cpu(xk, xv, signs, kbounds, kcents, kbits, vbounds, vcents, vbits, l2, unbiased, ref, flag, t0,
                       kcodes, kscales, vcodes, vscales, u0, m0, o0, u1, m1, o1, u2, m2, o2, lens, li, delta, ri):
    """CPU twin of :func:`_quantize_pair_cuda`: the two sides one after the other (on the CPU
    the pair saves nothing; the twin exists for the bit-for-bit comparison), then the folded
    range records and the length update."""
    base = int64(lens[ri]) if ri >= 0 else int64(0)
    t0 = t0 + base
    _quantize_cpu(xk, signs, kbounds, kcents, l2, unbiased, ref, flag, kbits, t0, kcodes, kscales)
    _quantize_cpu(xv, signs, vbounds, vcents, l2, unbiased, ref, flag, vbits, t0, vcodes, vscales)
    fold_absbits_cpu(u0, m0, o0)
    fold_absbits_cpu(u1, m1, o1)
    fold_absbits_cpu(u2, m2, o2)
    if li >= 0:
        lens[li] = int32((base if ri >= 0 else lens[li]) + delta)


@cpu_kernel
def _dequantize_cpu(codes, scales, signs, centroids, bits, t0, out):
    """CPU twin of :func:`_dequantize_cuda`: ``prange`` over runs of ``_TILES`` tiles of ``_LANES`` blocks."""
    rows, seq, d = out.shape
    nq = rows * seq * (d // 32)
    for c in prange((nq + _CHUNK - 1) // _CHUNK):
        t = np.zeros(33 * _LANES, dtype=np.float32)
        w = np.zeros(5 * _LANES, dtype=np.int64)
        for q0 in range(c * _CHUNK, min(nq, (c + 1) * _CHUNK), _LANES):  # the item's tiles
            dequantize_lanes_cpu(codes, scales, q0, min(_LANES, nq - q0), signs, centroids, bits, t0, out,
                                 _LANES, t, w)


# --- CUDA kernels: one thread per (vector, 32-block), grid-stride -----------------------
@cuda_kernel
def _quantize_cuda(x, signs, bounds, centroids, l2, unbiased, ref, flag, bits, t0, codes, scales):
    """1-D grid over the ``rows·seq·d/32`` blocks; one thread quantizes one 32-value block."""
    rows, seq, d = x.shape
    t = cuda.local.array(35, dtype=float32)
    ib = cuda.local.array(32, dtype=uint8)
    w = cuda.local.array(5, dtype=int64)
    cv = cuda.local.array(32, dtype=float32)
    for q in range(cuda.grid(1), rows * seq * (d // 32), cuda.gridsize(1)):
        quantize_lanes_dev(x, q, 1, signs, bounds, centroids, l2, unbiased, ref, flag, bits, t0, codes,
                           scales, 1, t, ib, w, cv)


@cuda_kernel
def _quantize_pair_cuda(xk, xv, signs, kbounds, kcents, kbits, vbounds, vcents, vbits, l2, unbiased, ref, flag, t0,
                        kcodes, kscales, vcodes, vscales, u0, m0, o0, u1, m1, o1, u2, m2, o2, lens, li, delta, ri):
    """Both sides of a store in one launch (a decode step's evicted tokens, a paged append):
    1-D grid over the ``2·rows·seq·d/32`` blocks of ``xk`` then ``xv`` (one shape), one
    thread per 32-value block, each side with its codebook and width; same bytes as two
    :func:`_quantize_cuda`.  Also folded in, so that a paged decode step needs no launch of
    its own for them (issue 27): up to three deferred range records
    (:func:`~numba_kv.ops.finite.fold_absbits_dev`; mask 0: none) and, when ``li >= 0``,
    ``lens[li] += delta`` by thread 0 (a page table's last-page length).  When ``ri >= 0``
    the write offset is ``t0 + lens[ri]`` and thread 0 writes ``lens[li] = lens[ri] + delta``
    (a layer's device count of compressed tokens, before and after the step: no offset
    argument that changes every step, issue 27; ``ri != li``, so no thread reads what the
    launch writes).  ``ri == li`` (a paged append's write slot, its last-page length, read and
    advanced in place) needs a launch of one block: a barrier orders every thread's read
    before thread 0's write."""
    rows, seq, d = xk.shape
    base = int64(lens[ri]) if ri >= 0 else int64(0)
    t0 = t0 + base
    nq = rows * seq * (d // 32)
    t = cuda.local.array(35, dtype=float32)
    ib = cuda.local.array(32, dtype=uint8)
    w = cuda.local.array(5, dtype=int64)
    cv = cuda.local.array(32, dtype=float32)
    start = cuda.grid(1)
    nt = cuda.gridsize(1)
    for q in range(start, 2 * nq, nt):
        if q < nq:
            quantize_lanes_dev(xk, q, 1, signs, kbounds, kcents, l2, unbiased, ref, flag, kbits, t0, kcodes,
                               kscales, 1, t, ib, w, cv)
        else:
            quantize_lanes_dev(xv, q - nq, 1, signs, vbounds, vcents, l2, unbiased, ref, flag, vbits, t0, vcodes,
                               vscales, 1, t, ib, w, cv)
    fold_absbits_dev(u0, m0, o0, start, nt)
    fold_absbits_dev(u1, m1, o1, start, nt)
    fold_absbits_dev(u2, m2, o2, start, nt)
    if li >= 0 and ri == li:  # uniform: the launch is then one block (quantize_pair_into)
        cuda.syncthreads()  # every thread has read lens[ri] before thread 0 advances it
    if li >= 0 and start == 0:
        lens[li] = int32((base if ri >= 0 else lens[li]) + delta)


@cuda_kernel
def _dequantize_cuda(codes, scales, signs, centroids, bits, t0, out):
    """1-D grid over the ``rows·seq·d/32`` blocks; one thread reconstructs one 32-value block."""
    rows, seq, d = out.shape
    t = cuda.local.array(33, dtype=float32)
    w = cuda.local.array(5, dtype=int64)
    for q in range(cuda.grid(1), rows * seq * (d // 32), cuda.gridsize(1)):
        dequantize_lanes_dev(codes, scales, q, 1, signs, centroids, bits, t0, out, 1, t, w)


#: the length array of a pair quantization without a length update (``li = -1``: never touched)
_NO_LENS = np.zeros(1, np.int32)
_QSIG = ("void(float32[:, :, ::1], float32[::1], float32[::1], float32[::1], boolean, boolean, float32, "
         "float32, int64, int64, uint8[:, :, ::1], uint16[:, :, ::1])")
_QUANTIZE_BLOCKS = register("quantize_blocks", _quantize_cpu, _quantize_cuda, [_QSIG])
_QPAIR_SIG = ("void(float32[:, :, ::1], float32[:, :, ::1], float32[::1], float32[::1], float32[::1], int64, "
              "float32[::1], float32[::1], int64, boolean, boolean, float32, float32, int64, uint8[:, :, ::1], "
              f"uint16[:, :, ::1], uint8[:, :, ::1], uint16[:, :, ::1], {FOLD_SIG}, int32[::1], int64, int64, int64)")
_QUANTIZE_PAIR = register("quantize_blocks_pair", _quantize_pair_cpu, _quantize_pair_cuda, [_QPAIR_SIG])
_DEQUANTIZE_BLOCKS = register("dequantize_blocks", _dequantize_cpu, _dequantize_cuda, [DEQUANTIZE_SIGNATURE])


# --- internal entry points used by caches (no validation: callers validated) -----------
def quantize_into(x3: Any, codes: Any, scales: Any, t0: int, cb: Codebook, outlier: bool,
                  unbiased: bool = False) -> None:
    """Quantize ``x3`` ``[rows, seq, d]`` (float32, C-contiguous, on one device) into
    ``codes[:, t0:t0+seq]`` and ``scales[:, t0:t0+seq]``; ``unbiased`` selects the EDEN
    rescale of the stored scales (module docstring)."""
    rows, seq, d = x3.shape
    if rows == 0 or seq == 0:
        return
    t0 = check_span(t0, x3.shape[1], codes.shape[1], "codes")
    signs = _backend.constant(x3, SIGNS32)
    bounds = _backend.constant(x3, cb.boundaries)
    cents = _backend.constant(x3, cb.centroids)
    l2 = cb.norm_mode == "l2"
    unbiased = bool(unbiased)
    ref = np.float32(cb.ref)
    flag = np.float32(-1.0 if outlier else 1.0)
    args = (x3, signs, bounds, cents, l2, unbiased, ref, flag, cb.bits, int(t0), codes, scales)
    _QUANTIZE_BLOCKS.launch(_backend.device_of("x3", x3), rows * seq * (d // 32), *args, work=rows * seq * d)


def quantize_pair_into(xk3: Any, xv3: Any, kcodes: Any, kscales: Any, vcodes: Any, vscales: Any, t0: int,
                       kcb: Codebook, vcb: Codebook, outlier: bool, unbiased: bool = False, *,
                       ranges: tuple | None = None, add_at: tuple | None = None) -> None:
    """:func:`quantize_into` of keys ``xk3`` and values ``xv3`` (one shape ``[rows, seq, d]``,
    float32, C-contiguous, on one device) in one launch, each side with its codebook (one norm
    mode); same bytes as two calls.  Folded into the same launch (a paged decode step's
    bookkeeping): ``ranges``, deferred range records as
    :meth:`~numba_kv.ops.finite.DeferredRange.folded` gives them, and ``add_at``
    ``(lens, i, delta)``: ``lens[i] += delta`` (int32, on the device), or ``(lens, i, delta,
    r)``: the offset is ``t0 + lens[r]`` and ``lens[i] = lens[r] + delta``.  With ``r == i``
    (a paged append's slot, read from the last-page length it advances: no offset that
    changes every step, issue 27) the CUDA launch is one block, so that a barrier can order
    the reads before the write (a decode step's few tokens: a block's threads cover them)."""
    rows, seq, d = xk3.shape
    if rows == 0 or seq == 0:
        return
    t0 = check_span(t0, xk3.shape[1], kcodes.shape[1], "kcodes")
    if kcb.norm_mode != vcb.norm_mode or kcb.ref != vcb.ref:
        raise ValueError(f"vcb: expected the keys' norm mode {kcb.norm_mode!r} (scale reference {kcb.ref}), got "
                         f"{vcb.norm_mode!r} ({vcb.ref})")
    c = _backend.constant
    args = (xk3, xv3, c(xk3, SIGNS32), c(xk3, kcb.boundaries), c(xk3, kcb.centroids), kcb.bits,
            c(xk3, vcb.boundaries), c(xk3, vcb.centroids), vcb.bits, kcb.norm_mode == "l2", bool(unbiased),
            np.float32(kcb.ref), np.float32(-1.0 if outlier else 1.0), int(t0), kcodes, kscales, vcodes, vscales,
            *(no_fold(xk3) if ranges is None else ranges),
            *count_args(xk3, add_at, same_slot=True))
    n_items = 2 * rows * seq * (d // 32)
    one_block = args[-1] >= 0 and args[-1] == args[-3]  # ri == li: read and advanced in one launch
    _QUANTIZE_PAIR.launch(_backend.device_of("xk3", xk3), n_items, *args, work=2 * rows * seq * d,
                          coop=(1, n_items) if one_block else None)


def count_args(like: Any, add_at: tuple | None, same_slot: bool = False) -> tuple:
    """A pair quantization's ``(lens, li, delta, ri)`` arguments from ``add_at`` (``None``,
    ``(lens, i, delta)`` or ``(lens, i, delta, r)``; see :func:`quantize_pair_into`);
    ``same_slot``: the kernel may read and write one slot (``r == i``)."""
    if add_at is None:
        return _backend.constant(like, _NO_LENS), -1, 0, -1
    lens, i, delta, *r = add_at
    ri = int(r[0]) if r else -1
    if ri == int(i) and not same_slot:
        raise ValueError(f"add_at: the slot read must differ from the slot written ({ri})")
    return lens, int(i), int(delta), ri


def dequantize_into(codes: Any, scales: Any, t0: int, cb: Codebook, out: Any) -> None:
    """Reconstruct tokens ``t0 : t0 + out.shape[1]`` of ``codes``/``scales`` into ``out``
    ``[rows, seq, d]`` float32."""
    rows, seq, d = out.shape
    if rows == 0 or seq == 0:
        return
    t0 = check_span(t0, out.shape[1], codes.shape[1], "codes")
    signs = _backend.constant(out, SIGNS32)
    cents = _backend.constant(out, cb.centroids)
    _DEQUANTIZE_BLOCKS.launch(_backend.device_of("out", out), rows * seq * (d // 32), codes, scales, signs, cents,
                              cb.bits, int(t0), out, work=rows * seq * d)


def packed_dim(head_dim: int, bits: int) -> int:
    """Bytes of packed indices per vector: ``head_dim * bits // 8``."""
    return head_dim * bits // 8


# --- public API ------------------------------------------------------------------------
def _codebook_arg(bits: Any, norm_mode: Any, codebook: Codebook | None) -> Codebook:
    if codebook is not None:
        if not isinstance(codebook, Codebook):
            raise TypeError(f"codebook: expected a numba_kv.ops.codebook.Codebook, got {type(codebook).__name__}")
        return codebook
    if norm_mode not in NORM_MODES:
        raise ValueError(f"norm_mode: expected one of {list(NORM_MODES)}, got {norm_mode!r}")
    if isinstance(bits, (bool, np.bool_)) or not isinstance(bits, (int, np.integer)):
        raise TypeError(f"bits: expected an int in 1..4, got {type(bits).__name__} {bits!r}")
    if not 1 <= int(bits) <= 4:
        raise ValueError(f"bits: expected an int in 1..4, got {bits!r}")
    return get_codebook(int(bits), norm_mode)


def quantize_blocks(x: Any, bits: int = 3, norm_mode: str = "maxnorm", outlier: bool = True, *,
                    codebook: Codebook | None = None, backend: str = "auto",
                    unbiased: bool = False) -> tuple[Any, Any]:
    """Quantize vectors block-wise (normalize → rotate → bucketize → pack).

    Parameters
    ----------
    x : float16/32/64 array, shape ``(..., d)``
        ``d`` a positive multiple of 32; finite values.  NumPy → CPU twin; CUDA array →
        CUDA kernel.
    bits : int
        Codebook width 1..4 (ignored when ``codebook`` is given).
    norm_mode : {"maxnorm", "l2"}
        Block normalization (see module docstring).
    outlier : bool
        Store scales negative (the PQO outlier-block flag); ``False`` for PQ blocks.
    codebook : Codebook, optional
        Explicit codebook (from :func:`numba_kv.ops.codebook.get_codebook`).
    backend : {"auto", "cpu", "cuda"}
        Device check (the device follows ``x``).
    unbiased : bool
        EDEN-style rescale: store ``scale · ‖y‖² / ⟨y, c[idx]⟩`` per block instead of
        ``scale`` (``y`` the rotated normalized block, ``c`` the codebook centroids).
        Same codes and bytes; ``⟨x̂_b, x_b⟩ = ‖x_b‖²`` per block up to the binary16
        rounding of the scale, so inner products with independent queries are unbiased
        (slope 1).  MSE on random unit vectors: about +10 % at 2 bits, about 2-6 % lower
        at 3-4 bits.  Blocks with ``⟨y, c⟩ <= 1e-30`` keep the plain scale.
        :func:`dequantize_blocks` is unchanged.

    Returns
    -------
    codes : uint8 array, shape ``(..., d * bits // 8)``
    scales : uint16 array, shape ``(..., d // 32)``
        binary16 bit patterns of ``±scale`` (``±α`` when ``unbiased``);
        ``scales.view(numpy.float16)`` on the host.

    Raises
    ------
    TypeError
        ``x`` not a float array, ``codebook`` not a :class:`~numba_kv.ops.codebook.Codebook`,
        ``outlier`` or ``unbiased`` not a bool.
    ValueError
        Bad ``bits``/``norm_mode``, ``d`` not a multiple of 32, NaN/Inf in ``x``, a block
        scale beyond binary16.

    Examples
    --------
    >>> import numpy as np
    >>> codes, scales = quantize_blocks(np.ones((2, 64), np.float32), bits=3)
    >>> codes.shape, scales.shape
    ((2, 24), (2, 2))
    """
    cb = _codebook_arg(bits, norm_mode, codebook)
    check_bool("outlier", outlier)  # (a truthy "no" must not switch them on)
    check_bool("unbiased", unbiased)
    dev = _backend.resolve_device(backend, x=x)
    check_float_array("x", x)
    shape = tuple(x.shape)  # a tuple: the simulator's shapes reject negative indices
    if len(shape) < 1 or shape[-1] % 32 or shape[-1] == 0:
        raise ValueError(f"x: expected a last axis that is a positive multiple of 32, got shape {shape}")
    check_finite("x", x)
    d = shape[-1]
    x3 = _backend.ascontiguous_f32("x", x).reshape(1, -1, d)
    n = x3.shape[1]
    codes = _backend.empty(x, (1, n, packed_dim(d, cb.bits)), np.uint8)
    scales = _backend.empty(x, (1, n, d // 32), np.uint16)
    quantize_into(x3, codes, scales, 0, cb, bool(outlier), bool(unbiased))
    # a binary16 scale that reached 65504 saturated: x is out of range for this format
    check_f16_result("x", scales)
    del dev
    return codes.reshape(shape[:-1] + (packed_dim(d, cb.bits),)), scales.reshape(shape[:-1] + (d // 32,))


def dequantize_blocks(codes: Any, scales: Any, bits: int = 3, norm_mode: str = "maxnorm", *,
                      codebook: Codebook | None = None, backend: str = "auto", check_values: bool = True) -> Any:
    """Reconstruct vectors from :func:`quantize_blocks` output.

    Parameters
    ----------
    codes : uint8 array, shape ``(..., d * bits // 8)``
    scales : uint16 array, shape ``(..., d // 32)``
    bits, norm_mode, codebook
        As given to :func:`quantize_blocks`.
    check_values : bool
        Read ``scales`` for Inf/NaN patterns (below; on a GPU a pass over the scales and a
        device-to-host read).  ``False`` when the caller vouches for them (scales from
        :func:`quantize_blocks`): the kernel then reads what it is given (an Inf/NaN pattern
        is no scale: its vector's output is unspecified).  Shapes and dtypes are checked
        either way.
    backend : {"auto", "cpu", "cuda"}
        Check that the data lives where expected (never moves it).

    Returns
    -------
    x_hat : float32 array, shape ``(..., d)``, on the device of ``codes``.

    Raises
    ------
    TypeError
        ``codes`` not uint8, ``scales`` not uint16.
    ValueError
        Bad ``bits``/``norm_mode``, mismatching shapes, Inf/NaN scale patterns (exponent
        bits all ones, either sign: the sign is the PQO flag), checked for NumPy, CuPy and
        Numba device arrays by one integer max over ``scales``
        (:func:`~numba_kv.ops.finite.range_stats` of their binary16 view), which reads one
        number back to the host.
    """
    cb = _codebook_arg(bits, norm_mode, codebook)
    _backend.resolve_device(backend, codes=codes, scales=scales)
    if np.dtype(codes.dtype) != np.uint8:
        raise TypeError(f"codes: expected dtype uint8, got {codes.dtype}")
    if np.dtype(scales.dtype) != np.uint16:
        raise TypeError(f"scales: expected dtype uint16 (binary16 bits), got {scales.dtype}")
    cshape, sshape = tuple(codes.shape), tuple(scales.shape)  # tuples: simulator shapes
    nb = sshape[-1] if len(sshape) else 0
    d = nb * 32
    if nb == 0 or cshape[:-1] != sshape[:-1] or cshape[-1] != packed_dim(d, cb.bits):
        raise ValueError(f"codes: expected shape {sshape[:-1] + (packed_dim(d, cb.bits),)} to match "
                         f"scales {sshape} at bits={cb.bits}, got {cshape}")
    lead = sshape[:-1]
    xp = _backend.xp_of(codes)
    if xp is not None:
        codes = xp.ascontiguousarray(codes)
        scales = xp.ascontiguousarray(scales)
    c3 = codes.reshape(1, -1, cshape[-1])
    s3 = scales.reshape(1, -1, nb)
    # |pattern| >= 0x7C00: Inf or NaN
    if check_bool("check_values", check_values) and range_stats(s3.view(np.float16)).nonfinite:
        raise ValueError("scales: expected finite binary16 patterns, got Inf or NaN")
    out = _backend.empty(codes, (1, c3.shape[1], d), np.float32)
    dequantize_into(c3, s3, 0, cb, out)
    return out.reshape(lead + (d,))
