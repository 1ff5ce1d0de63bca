"""Head VQ code: the whole-head rotation of :mod:`numba_kv.ops.headquant`, then groups of
rotated coordinates quantized jointly on 256-point codebooks (one byte per group).

Per vector ``x`` of ``d`` values (``d`` a power of two, ``32 <= d <= 512``), in float32:

* ``n = max(‖x‖₂, 1e-10)``; ``y = H_d D_s (x / n)`` — bit for bit the rotation of
  :func:`numba_kv.ops.headquant.quantize_head` (signs :func:`~numba_kv.ops.headquant.head_signs`
  first, then the normalized Sylvester Hadamard);
* the ``d`` coordinates are cut into ``G = d / m`` groups of ``m`` consecutive ones: pairs
  at 4 bits (``m = 2``), quads at 2 bits (``m = 4``); group ``g`` (coordinates ``g·m ..
  g·m+m−1``) is coded by the index of the nearest of the 256 points ``c[k]`` of
  :func:`headvq_centroids` (squared distance ``((y₀−c₀)² + (y₁−c₁)²) + …`` summed in float32
  in coordinate order, products rounded before the sum; ties → the lowest index);
* byte ``g`` of the ``G = d·bits/8`` code bytes is that index (the same bytes per vector as
  the scalar 4- or 2-bit head code; only the meaning of a byte changes);
* one binary16 scalar per vector (bits in a ``uint16``): ``n`` (clamped to 65504), or with
  ``unbiased=True`` the EDEN scale ``α = n·‖y‖²/⟨y, ĉ⟩`` (``ĉ`` the concatenated chosen
  points; both sums in float32 in coordinate order), which makes ``⟨x̂, x⟩ = ‖x‖²`` and
  the inner-product estimate ``⟨q, x̂⟩`` unbiased (Vargaftik et al., EDEN, arXiv:2108.08842);
  with ``⟨y, ĉ⟩ <= 0`` (``x = 0``) or ``‖x‖ <= 1e-10`` (``y`` is then shorter than a unit
  vector, and the groups' terms of ``⟨y, ĉ⟩`` can cancel: no bound of ``α/‖x‖``) ``n`` is
  kept, which stores as 0.

Dequantization: ``x̂ = |α| · D_s H_d ĉ``.  Storage ``bits + 16/d`` bits per value.

Codebooks (:func:`headvq_codebook`, shipped in ``ops/data/headvq.npz``, fitted by
:mod:`numba_kv.ops.headvq_fit`): for every ``d``, 256 points in ``√d·u`` units
(``u = y/‖y‖``), k-means (Lloyd's algorithm) fitted to the ``m``-coordinate marginal of
``√d·u`` for ``u`` uniform on the sphere, started from the ``m``-fold product of the scalar
head codebook — the gain of vector over scalar quantization at the same rate (space-filling
and shape advantages; Gersho & Gray, *Vector Quantization and Signal Compression*, 1992).
QuIP# (Tseng et al., arXiv:2402.04396) quantizes Hadamard-rotated weights on the E8 lattice
for the same reason; the scalar code is TurboQuant-MSE (Zandieh et al., arXiv:2504.19874).
The kernels use ``headvq_centroids(bits, d) = float32(float64(points) / √d)``, the points in
the units of ``y``.  Measured (fresh sample of uniform unit vectors, per coordinate of
``√d·u``, ``d = 128``): MSE 0.00776 against 0.00931 for the scalar 4-bit code (0.79 dB
lower) and 0.0961 against 0.1159 at 2 bits (0.81 dB lower); ``docs/api/ops.md`` lists every
``d``.

The nearest-point search looks only at the points its grid cell lists
(:mod:`numba_kv.ops.headvq_grid`: about 2 for pairs and 8 for quads instead of 256), in
index order with the same float32 distances, so it returns the full search's point.

Twins: the CPU twins work on tiles of ``LANES`` vectors interleaved lane by lane like the
head code's (the search runs lane by lane, its selects branch-free); the CUDA kernels run
one vector per thread block (vector, indices and codebook in shared memory, one thread per
group for the search).  Per value both do the same float32 operations in the same order, so
codes and norms agree bit for bit.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
from numba import cuda, float32, int64, prange, uint8, uint16

from .. import _backend
from .._config import MAX_HEAD_DIM
from .._jit import cpu_kernel, cuda_device, cuda_kernel, twin
from .._validate import check_bool, check_f16_result, check_float_array, check_span
from ._borrow import borrowed, keep_alive
from ._coop import coop_butterflies
from ._exact import mul_rn, mul_rn_dev
from ._headquant_lanes import (
    LANES,
    TILES,
    head_scale_dev,
    rotate_head_forward_lanes,
    rotate_head_inverse_lanes,
)
from ._index import unravel2
from ._registry import F32_2D, F32_3D, U8_3D, register
from .finite import check_finite, range_stats
from .half import f16_bits_abs_to_f32, f16_bits_abs_to_f32_dev, f32_to_f16_bits, f32_to_f16_bits_sat_dev
from .headquant import HEAD_DIMS, head_signs
from .headvq_fit import DATA_PATH, codebook_key
from .headvq_grid import grid_nearest_dev, nearest_lanes, search_grid

__all__ = ["CB_SHARED", "GROUP_SIZE", "LOAD_CODEBOOK_DEV", "POINTS", "QUANTIZE_HEADVQ", "QUANTIZE_HEADVQ_VEC_DEV",
           "quantize_headvq", "dequantize_headvq", "quantize_headvq_into", "dequantize_headvq_into",
           "headvq_codebook", "headvq_centroids", "packed_dim"]

#: coordinates per group (codebook dimension ``m``) at each supported width
GROUP_SIZE = {4: 2, 2: 4}
#: points per codebook (one byte per group)
POINTS = 256
_CB_SHARED = 1024  # floats of the CUDA kernels' shared codebook: POINTS * max(m)
_IB_SHARED = MAX_HEAD_DIM // 2  # bytes of the shared indices: d / min(m)
#: slots per grid cell of the search (:data:`~numba_kv.ops.headvq_grid.GRID_PARAMS`), pairs and quads
#: scalar operations per value of a quantize call (normalize, rotate, a few candidates per
#: group), for the CPU's serial/parallel choice (``cpu_parallel_min_work``)
_SEARCH_WORK = 24
#: the norm floor ``n = max(‖x‖, 1e-10)`` (float32): a norm at it is no unit vector's
_NORM_FLOOR = np.float32(1e-10)


def _check_bits(bits: Any) -> int:
    if isinstance(bits, (bool, np.bool_)) or not isinstance(bits, (int, np.integer)) or int(bits) not in GROUP_SIZE:
        raise ValueError(f"bits: expected 2 or 4 (the head VQ widths), got {bits!r}")
    return int(bits)


def _check_head_dim(name: str, d: Any) -> int:
    if isinstance(d, (bool, np.bool_)) or not isinstance(d, (int, np.integer)) or int(d) not in HEAD_DIMS:
        raise ValueError(f"{name}: expected a power of two in 32..512 ({', '.join(map(str, HEAD_DIMS))}), "
                         f"got {d!r}")
    return int(d)


@functools.cache
def _codebook_file() -> dict[str, np.ndarray]:
    if not DATA_PATH.is_file():
        raise FileNotFoundError(f"{DATA_PATH}: the head VQ codebooks are missing; "
                                "regenerate them with `python -m numba_kv.ops.headvq_fit`")
    with np.load(DATA_PATH, allow_pickle=False) as z:
        return {k: np.array(z[k]) for k in z.files}


@functools.cache
def headvq_codebook(bits: int, d: int) -> np.ndarray:
    """The 256-point codebook of the head VQ code in ``√d·u`` units (``u = y/‖y‖`` the rotated
    unit vector): the shipped k-means fit (:mod:`numba_kv.ops.headvq_fit`), points sorted
    lexicographically.

    Parameters
    ----------
    bits : {4, 2}
        Bits per value: groups of ``m = 2`` (4 bits) or ``m = 4`` (2 bits) coordinates.
    d : int
        Head dimension, a power of two in 32..512.

    Returns
    -------
    numpy.ndarray
        float32, shape ``(256, m)``, read-only, cached (the same object per ``(bits, d)``).
    """
    bits, d = _check_bits(bits), _check_head_dim("d", d)
    cb = _codebook_file()[codebook_key(bits, GROUP_SIZE[bits], d)].astype(np.float32)
    if cb.shape != (POINTS, GROUP_SIZE[bits]) or not np.isfinite(cb).all():
        raise ValueError(f"{DATA_PATH}: codebook {codebook_key(bits, GROUP_SIZE[bits], d)} has shape {cb.shape}")
    cb.flags.writeable = False
    return cb


@functools.cache
def headvq_centroids(bits: int, d: int) -> np.ndarray:
    """The codebook in the units of the rotated vector ``y`` (the table the kernels use):
    ``float32(float64(headvq_codebook(bits, d)) / √d)``, float32 ``(256, m)``, read-only, cached."""
    c = (headvq_codebook(bits, d).astype(np.float64) / math.sqrt(_check_head_dim("d", d))).astype(np.float32)
    c.flags.writeable = False
    return c


def packed_dim(d: int, bits: int) -> int:
    """Code bytes per vector: ``d * bits // 8`` (one byte per group of ``8 / bits`` values)."""
    return d * bits // 8


# --- single-source CPU cores ------------------------------------------------------------
def _load_normalize_lanes(x, v0, nl, d, L, t):
    """Copy vectors ``v0 .. v0+nl-1`` of ``x`` into the lanes of ``t`` and divide each by its
    norm ``max(‖x‖, 1e-10)``, kept in row ``d`` of ``t`` (as the head code's lanes)."""
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
            tn[l] += mul_rn(u, u)
    for l in range(L):
        tn[l] = max(float32(math.sqrt(tn[l])), _NORM_FLOOR)
    for j in range(d):
        tj = t[j * L:(j + 1) * L]
        for l in range(L):
            tj[l] = np.divide(tj[l], tn[l])  # np.divide: IEEE division, no ZeroDivisionError branch


def quantize_headvq_lanes(x, v0, nl, d, signs, cents, cf, gpar, slots, goff, gcand, unbiased, t0, codes, norms,
                          L, t, ib, w):
    """Quantize flattened vectors ``v0 .. v0+nl-1`` of ``x`` (``nl <= L``) into ``codes`` /
    ``norms`` at token ``t0 + s``; ``cf`` is ``cents`` flat, ``gpar``, ``slots``, ``goff``,
    ``gcand`` its candidate grid (:func:`nearest_lanes`).

    Scratch: ``t`` float32[(d+3)·L] (rows ``d .. d+2``: the norms, ``‖y‖²`` and ``⟨y, ĉ⟩``),
    ``ib`` uint8[(d/m)·L] (the indices), ``w`` int64[L] (the binary16 norm bits).
    """
    seq = x.shape[1]
    m = cents.shape[1]
    S = d * L
    _load_normalize_lanes(x, v0, nl, d, L, t)
    rotate_head_forward_lanes(t, d, L, signs)
    # (scratch of the search: w, the cells; row d + 1 of t, the distances — both free until below)
    nearest_lanes(t, d, L, nl, m, cf, gpar, slots, goff, gcand, ib, w, t[S + L:S + 2 * L])
    tn = t[S:S + L]
    if unbiased:
        tyy = t[S + L:S + 2 * L]
        tyc = t[S + 2 * L:S + 3 * L]
        for l in range(L):
            tyy[l] = float32(0.0)
            tyc[l] = float32(0.0)
        for j in range(d):
            g = j // m
            i = j - g * m
            tj = t[j * L:(j + 1) * L]
            ibg = ib[g * L:(g + 1) * L]
            for l in range(L):
                y = tj[l]
                tyy[l] += mul_rn(y, y)
                tyc[l] += mul_rn(y, cents[ibg[l], i])
        for l in range(L):
            # a norm at the 1e-10 floor left y short of the unit sphere, where α/‖x‖ has no
            # bound (groups' terms can cancel): keep n, which stores as 0, as for x = 0
            if tyc[l] > float32(0.0) and tn[l] > _NORM_FLOOR:
                tn[l] = np.divide(tn[l] * tyy[l], tyc[l])
    for l in range(L):  # binary16 bits of every lane, branch-free
        a = tn[l]
        a = a if a < float32(65504.0) else float32(65504.0)  # noqa: FURB136 - NaN -> 65504 too
        w[l] = int64(f32_to_f16_bits(a))
    G = d // m
    for l in range(nl):
        r, s = unravel2(v0 + l, seq)
        cb = codes[r, t0 + s]
        for g in range(G):
            cb[g] = ib[g * L + l]
        norms[r, t0 + s, 0] = uint16(w[l])


def dequantize_headvq_lanes(codes, norms, v0, nl, d, signs, cents, t0, out, L, t):
    """Reconstruct flattened vectors ``v0 .. v0+nl-1`` of ``out`` (``nl <= L``) from ``codes`` /
    ``norms`` at token ``t0 + s``.  Scratch: ``t`` float32[(d+1)·L] (row ``d``: the scales)."""
    seq = out.shape[1]
    m = cents.shape[1]
    S = d * L
    for l in range(nl):
        r, s = unravel2(v0 + l, seq)
        cb = codes[r, t0 + s]
        for g in range(d // m):
            k = int64(cb[g])
            for i in range(m):
                t[(g * m + i) * L + l] = cents[k, i]
        t[S + l] = f16_bits_abs_to_f32(int64(norms[r, t0 + s, 0]))
    rotate_head_inverse_lanes(t, d, L, signs)
    for l in range(nl):
        r, s = unravel2(v0 + l, seq)
        orow = out[r, s]
        sc = t[S + l]
        for j in range(d):
            orow[j] = t[j * L + l] * sc


twin(_load_normalize_lanes)
quantize_headvq_lanes_cpu, _ = twin(quantize_headvq_lanes)
dequantize_headvq_lanes_cpu, _ = twin(dequantize_headvq_lanes)


# --- CPU twins ------------------------------------------------------------------------------
@cpu_kernel
def _quantize_headvq_cpu(x, signs, cents, gpar, slots, goff, gcand, unbiased, t0, codes, norms):
    """One ``prange`` iteration quantizes ``TILES`` tiles of ``LANES`` flattened vectors of ``x``
    ``[rows, seq, d]`` (tiles as wide as the vectors when there are fewer) into ``codes[:, t0 +
    s]`` / ``norms[:, t0 + s]``, with its own scratch."""
    rows, seq, d = x.shape
    m = cents.shape[1]
    nv = rows * seq
    L = min(LANES, nv)
    ntiles = (nv + L - 1) // L
    cf = cents.reshape(cents.size)
    x, signs, cents, cf, codes, norms = borrowed(x), borrowed(signs), borrowed(cents), borrowed(cf), \
        borrowed(codes), borrowed(norms)
    gpar, slots, goff, gcand = borrowed(gpar), borrowed(slots), borrowed(goff), borrowed(gcand)
    for c in prange((ntiles + TILES - 1) // TILES):
        t_own = np.zeros((d + 3) * L, dtype=np.float32)
        ib_own = np.zeros((d // m) * L, dtype=np.uint8)
        w_own = np.zeros(L, dtype=np.int64)
        t, ib, w = borrowed(t_own), borrowed(ib_own), borrowed(w_own)
        for tile in range(c * TILES, min(ntiles, (c + 1) * TILES)):
            v0 = tile * L
            quantize_headvq_lanes_cpu(x, v0, min(L, nv - v0), d, signs, cents, cf, gpar, slots, goff, gcand, unbiased,
                                      t0, codes, norms, L, t, ib, w)
        keep_alive(t_own)
        keep_alive(ib_own)
        keep_alive(w_own)


@cpu_kernel
def _dequantize_headvq_cpu(codes, norms, signs, cents, t0, out):
    """One ``prange`` iteration reconstructs ``TILES`` tiles of ``LANES`` flattened vectors of
    ``out`` ``[rows, seq, d]`` from ``codes[:, t0 + s]`` / ``norms[:, t0 + s]``."""
    rows, seq, d = out.shape
    nv = rows * seq
    L = min(LANES, nv)
    ntiles = (nv + L - 1) // L
    codes, norms, signs, cents, out = borrowed(codes), borrowed(norms), borrowed(signs), borrowed(cents), \
        borrowed(out)
    for c in prange((ntiles + TILES - 1) // TILES):
        t_own = np.zeros((d + 1) * L, dtype=np.float32)
        t = borrowed(t_own)
        for tile in range(c * TILES, min(ntiles, (c + 1) * TILES)):
            v0 = tile * L
            dequantize_headvq_lanes_cpu(codes, norms, v0, min(L, nv - v0), d, signs, cents, t0, out, L, t)
        keep_alive(t_own)


# --- CUDA kernels: one block per vector ------------------------------------------------------
@cuda_device
def _load_codebook_dev(cents, cbs):
    """Copy ``cents`` ``[K, m]`` into the shared ``cbs`` (flat, ``k·m + i``); block-wide, ends
    with a barrier."""
    k_size, m = cents.shape
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    for e in range(tid, k_size * m, nt):
        k = e // m
        cbs[e] = cents[k, e - k * m]
    cuda.syncthreads()


@cuda_device
def _quantize_headvq_vec_dev(xr, signs, cbs, m, gpar, slots, goff, gcand, unbiased, cb, norms, r, ts, t, ib, red):
    """Block-cooperative: quantize the vector ``xr`` into the code bytes ``cb`` and
    ``norms[r, ts, 0]`` with the shared codebook ``cbs`` (its candidate grid ``gpar``,
    ``slots``, ``goff``, ``gcand``) and scratch ``t`` (float32[d]), ``ib`` (uint8[d/m]), ``red``
    (float32[1]); every thread of the block calls it."""
    d = xr.shape[0]
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    sc = head_scale_dev(d)
    for j in range(tid, d, nt):
        t[j] = xr[j]
    cuda.syncthreads()
    if tid == 0:
        acc = float32(0.0)
        for j in range(d):
            u = t[j]
            acc += mul_rn_dev(u, u)
        red[0] = max(float32(math.sqrt(acc)), _NORM_FLOOR)
    cuda.syncthreads()
    nrm = red[0]
    for j in range(tid, d, nt):
        t[j] = mul_rn_dev(np.divide(t[j], nrm), signs[j])
    coop_butterflies(t, d, tid, nt)
    for j in range(tid, d, nt):
        t[j] = mul_rn_dev(t[j], sc)
    cuda.syncthreads()
    for g in range(tid, d // m, nt):
        k = grid_nearest_dev(t, g * m, 1, m, cbs, gpar, slots, goff, gcand)
        ib[g] = uint8(k)
        cb[g] = uint8(k)
    cuda.syncthreads()
    if unbiased and tid == 0:
        tyy = float32(0.0)
        tyc = float32(0.0)
        for j in range(d):
            y = t[j]
            g = j // m
            tyy += mul_rn_dev(y, y)
            tyc += mul_rn_dev(y, cbs[int64(ib[g]) * m + (j - g * m)])
        if tyc > float32(0.0) and nrm > _NORM_FLOOR:  # (the CPU twin's rule)
            red[0] = np.divide(nrm * tyy, tyc)
    if tid == 0:
        norms[r, ts, 0] = uint16(f32_to_f16_bits_sat_dev(red[0]))  # inputs validated finite
    cuda.syncthreads()  # the next vector overwrites t, ib and red


@cuda_kernel
def _quantize_headvq_cuda(x, signs, cents, gpar, slots, goff, gcand, unbiased, t0, codes, norms):
    """Quantize vectors ``x[r, s]`` into ``codes[r, t0 + s]`` / ``norms[r, t0 + s, 0]``.

    Launch: ``(blocks, threads)`` from :func:`numba_kv._backend.coop_grid` over ``(rows·seq,
    d/m)``: the block first copies the codebook ``cents`` ``[256, m]`` into shared memory,
    then quantizes flattened vectors ``v = b, b + blocks, …`` (``v = r·seq + s``); thread
    ``tid`` handles values ``tid, tid + threads, …`` and its share of every butterfly stage,
    and searches the nearest point of groups ``tid, tid + threads, …`` among its grid cell's
    candidates (``gpar``, ``slots``, ``goff``, ``gcand``: :mod:`numba_kv.ops.headvq_grid`); thread 0 computes
    the sums and the binary16 norm.
    """
    rows, seq, d = x.shape
    m = cents.shape[1]
    t = cuda.shared.array(MAX_HEAD_DIM, dtype=float32)
    ib = cuda.shared.array(_IB_SHARED, dtype=uint8)
    cbs = cuda.shared.array(_CB_SHARED, dtype=float32)
    red = cuda.shared.array(1, dtype=float32)
    _load_codebook_dev(cents, cbs)
    for v in range(cuda.blockIdx.x, rows * seq, cuda.gridDim.x):
        r = v // seq
        s = v - r * seq
        _quantize_headvq_vec_dev(x[r, s], signs, cbs, m, gpar, slots, goff, gcand, unbiased, codes[r, t0 + s],
                                 norms, r, t0 + s, t, ib, red)


@cuda_kernel
def _dequantize_headvq_cuda(codes, norms, signs, cents, t0, out):
    """Reconstruct vectors ``out[r, s]`` from ``codes[r, t0 + s]`` / ``norms[r, t0 + s, 0]``.

    Launch: ``(blocks, threads)`` from :func:`numba_kv._backend.coop_grid` over ``(rows·seq,
    d/2)``: the block copies the codebook into shared memory, then decodes flattened vectors
    ``v = b, b + blocks, …``; thread ``tid`` looks up values ``tid, tid + threads, …``, takes
    its share of every butterfly stage and scales/stores its values.
    """
    rows, seq, d = out.shape
    k_size, m = cents.shape
    t = cuda.shared.array(MAX_HEAD_DIM, dtype=float32)
    cbs = cuda.shared.array(_CB_SHARED, dtype=float32)
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    sc = head_scale_dev(d)
    _load_codebook_dev(cents, cbs)
    for v in range(cuda.blockIdx.x, rows * seq, cuda.gridDim.x):
        r = v // seq
        s = v - r * seq
        cb = codes[r, t0 + s]
        for j in range(tid, d, nt):
            g = j // m
            t[j] = cbs[int64(cb[g]) * m + (j - g * m)]
        nv = f16_bits_abs_to_f32_dev(int64(norms[r, t0 + s, 0]))
        coop_butterflies(t, d, tid, nt)
        orow = out[r, s]
        for j in range(tid, d, nt):
            orow[j] = (t[j] * (sc * signs[j])) * nv  # as the CPU: v·(sc·s_j), then the scale
        cuda.syncthreads()  # the next vector overwrites t


_QSIG = (f"void({F32_3D}, float32[::1], {F32_2D}, float32[::1], uint8[::1], int32[::1], uint8[::1], boolean, int64, "
         f"{U8_3D}, uint16[:, :, ::1])")
_DQSIG = f"void({U8_3D}, uint16[:, :, ::1], float32[::1], {F32_2D}, int64, {F32_3D})"
_QUANTIZE = register("quantize_headvq", _quantize_headvq_cpu, _quantize_headvq_cuda, [_QSIG])
_DEQUANTIZE = register("dequantize_headvq", _dequantize_headvq_cpu, _dequantize_headvq_cuda, [_DQSIG])
#: the registered quantizer (its ``.cpu.serial`` runs inside other serial CPU cores), its
#: block-cooperative per-vector device core and codebook load (for fused kernels such as
#: :mod:`numba_kv.ops.headpair`'s; the codebook in ``CB_SHARED`` shared floats)
QUANTIZE_HEADVQ = _QUANTIZE
QUANTIZE_HEADVQ_VEC_DEV, LOAD_CODEBOOK_DEV, CB_SHARED = _quantize_headvq_vec_dev, _load_codebook_dev, _CB_SHARED


# --- internal entry points (no validation: callers validated) ---------------------------
def quantize_headvq_into(x3: Any, codes: Any, norms: Any, t0: int, cents: np.ndarray, unbiased: bool) -> None:
    """Quantize ``x3`` ``[rows, seq, d]`` (float32, C-contiguous) into ``codes[:, t0:t0+seq]``
    (uint8 ``[rows, capacity, d*bits/8]``) and ``norms[:, t0:t0+seq]`` (uint16
    ``[rows, capacity, 1]``), all on one device; ``cents`` is ``headvq_centroids(bits, d)``."""
    rows, seq, d = x3.shape
    if rows == 0 or seq == 0:
        return
    t0 = check_span(t0, x3.shape[1], codes.shape[1], "codes")
    m = cents.shape[1]
    c = _backend.constant
    gpar, goff, gcand, slots = search_grid(cents, d)
    _QUANTIZE.launch(_backend.device_of("x3", x3), rows * seq, x3, c(x3, head_signs(d)), c(x3, cents), c(x3, gpar),
                     c(x3, slots), c(x3, goff), c(x3, gcand), bool(unbiased), int(t0), codes, norms,
                     work=rows * seq * d * _SEARCH_WORK, coop=(rows * seq, d // m))


def dequantize_headvq_into(codes: Any, norms: Any, t0: int, cents: np.ndarray, out: Any) -> None:
    """Reconstruct tokens ``t0 : t0 + out.shape[1]`` of ``codes`` / ``norms`` into ``out``
    ``[rows, seq, d]`` float32 (same device); ``cents`` is ``headvq_centroids(bits, d)``."""
    rows, seq, d = out.shape
    if rows == 0 or seq == 0:
        return
    t0 = check_span(t0, out.shape[1], codes.shape[1], "codes")
    c = _backend.constant
    _DEQUANTIZE.launch(_backend.device_of("out", out), rows * seq, codes, norms, c(out, head_signs(d)),
                       c(out, cents), int(t0), out, work=rows * seq * d, coop=(rows * seq, d // 2))


# --- public API ------------------------------------------------------------------------
def quantize_headvq(x: Any, bits: int, unbiased: bool = False, *, backend: str = "auto") -> tuple[Any, Any]:
    """Quantize whole head vectors with the head VQ code: normalize → ``d``-point rotation →
    nearest of 256 points per group of ``m`` rotated coordinates → one byte per group.

    Parameters
    ----------
    x : float16/32/64 array, shape ``(..., d)``
        ``d`` a power of two in 32..512; finite values.  NumPy → CPU twin; CUDA array →
        CUDA kernel.
    bits : {4, 2}
        Bits per value: pairs on :func:`headvq_codebook` ``(4, d)`` or quads on ``(2, d)``.
    unbiased : bool
        Store the EDEN scale ``‖x‖·‖y‖²/⟨y, ĉ⟩`` instead of ``‖x‖``, so ``⟨x̂, x⟩ = ‖x‖²`` and
        inner products with ``x̂`` are unbiased (arXiv:2108.08842).
    backend : {"auto", "cpu", "cuda"}
        Check that the data lives where expected (never moves it).

    Returns
    -------
    codes : uint8 array, shape ``(..., d * bits // 8)``
        Byte ``g``: the codebook index of coordinates ``g·m .. g·m+m−1`` of the rotated vector.
    norms : uint16 array, shape ``(..., 1)``
        binary16 bit patterns of the stored scale (``norms.view(numpy.float16)`` on the host).

    Raises
    ------
    TypeError
        ``x`` not a float array, ``unbiased`` not a bool.
    ValueError
        ``bits`` not 2 or 4, last axis not a power of two in 32..512, NaN/Inf in ``x``, a
        norm beyond binary16.

    Examples
    --------
    >>> import numpy as np
    >>> x = np.random.default_rng(0).standard_normal((3, 128)).astype(np.float32)
    >>> codes, norms = quantize_headvq(x, 4)
    >>> codes.shape, codes.dtype, norms.shape
    ((3, 64), dtype('uint8'), (3, 1))
    """
    bits = _check_bits(bits)
    check_bool("unbiased", unbiased)
    _backend.resolve_device(backend, x=x)
    check_float_array("x", x)
    shape = tuple(x.shape)
    if len(shape) < 1 or shape[-1] not in HEAD_DIMS:
        raise ValueError(f"x: expected a last axis that is a power of two in 32..512, got shape {shape}")
    d = shape[-1]
    check_finite("x", x)
    x3 = _backend.ascontiguous_f32("x", x).reshape(1, -1, d)
    n = x3.shape[1]
    codes = _backend.empty(x, (1, n, packed_dim(d, bits)), np.uint8)
    norms = _backend.empty(x, (1, n, 1), np.uint16)
    quantize_headvq_into(x3, codes, norms, 0, headvq_centroids(bits, d), bool(unbiased))
    check_f16_result("x", norms)  # a saturated binary16 norm: x is out of range for this format
    return codes.reshape(shape[:-1] + (packed_dim(d, bits),)), norms.reshape(shape[:-1] + (1,))


def dequantize_headvq(codes: Any, norms: Any, bits: int, *, backend: str = "auto",
                      check_values: bool = True) -> Any:
    """Reconstruct vectors from :func:`quantize_headvq` output: ``x̂ = |α| · D_s H_d ĉ``.

    Parameters
    ----------
    codes : uint8 array, shape ``(..., d * bits // 8)``
        ``d`` (inferred) a power of two in 32..512.
    norms : uint16 array, shape ``(..., 1)``
        binary16 bit patterns (finite; the sign is ignored).
    bits : {4, 2}
        As given to :func:`quantize_headvq` (either norm mode decodes the same way).
    backend : {"auto", "cpu", "cuda"}
        Check that the data lives where expected (never moves it).
    check_values : bool
        Check the norms for Inf/NaN patterns (default; on a GPU one number is read back to the
        host); ``False`` when the caller vouches for them, as in :func:`~numba_kv.ops.headquant.dequantize_head`.

    Returns
    -------
    x_hat : float32 array, shape ``(..., d)``, on the device of ``codes``.

    Raises
    ------
    TypeError
        ``codes`` not uint8, ``norms`` not uint16, ``check_values`` not a bool.
    ValueError
        ``bits`` not 2 or 4, mismatching shapes, a ``d`` outside 32..512, Inf/NaN norm
        patterns (checked for every array kind by one integer max over ``norms``, which reads
        one number back to the host; skipped with ``check_values=False``).
    """
    bits = _check_bits(bits)
    _backend.resolve_device(backend, codes=codes, norms=norms)
    if np.dtype(codes.dtype) != np.uint8:
        raise TypeError(f"codes: expected dtype uint8, got {codes.dtype}")
    if np.dtype(norms.dtype) != np.uint16:
        raise TypeError(f"norms: expected dtype uint16 (binary16 bits), got {norms.dtype}")
    cshape, nshape = tuple(codes.shape), tuple(norms.shape)
    if len(nshape) < 1 or nshape[-1] != 1:
        raise ValueError(f"norms: expected a last axis of length 1, got shape {nshape}")
    if len(cshape) < 1 or (cshape[-1] * 8 // bits) not in HEAD_DIMS:
        raise ValueError(f"codes: expected a last axis of d*bits/8 bytes with d a power of two in 32..512 "
                         f"at bits={bits}, got shape {cshape}")
    if cshape[:-1] != nshape[:-1]:
        raise ValueError(f"norms: expected shape {cshape[:-1] + (1,)} to match codes {cshape}, got {nshape}")
    d = cshape[-1] * 8 // bits
    xp = _backend.xp_of(codes)
    if xp is not None:
        codes = xp.ascontiguousarray(codes)
        norms = xp.ascontiguousarray(norms)
    c3 = codes.reshape(1, -1, cshape[-1])
    n3 = norms.reshape(1, -1, 1)
    # every array kind, Numba device arrays included (they decoded an Inf/NaN norm without an
    # error before): one integer max over the binary16 view, as dequantize_head
    if check_bool("check_values", check_values) and range_stats(n3.view(np.float16)).nonfinite:
        raise ValueError("norms: expected finite binary16 patterns, got Inf or NaN")
    out = _backend.empty(codes, (1, c3.shape[1], d), np.float32)
    dequantize_headvq_into(c3, n3, 0, headvq_centroids(bits, d), out)
    return out.reshape(nshape[:-1] + (d,))
