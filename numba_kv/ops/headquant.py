"""Whole-head rotation quantizer: one ``d``-point rotation and one binary16 norm per vector.

This is TurboQuant-MSE over the whole head vector, the way FAISS ``HR,SQtqmse{b}``
stores it (Zandieh et al., arXiv:2504.19874; Lloyd–Max codebook for ``m = d``; the block
quantizer of
:mod:`numba_kv.ops.blockquant` is the same algorithm on 32-value blocks).  Per vector
``x`` of ``d`` values (``d`` a power of two, ``32 <= d <= 512``), in float32:

* ``n = max(‖x‖₂, 1e-10)``; ``y = H_d D_s (x / n)`` (a unit vector in ``d`` dimensions);
* ``idx_j = #{i : y_j > t_i}`` against the boundaries of ``get_codebook(bits, "l2",
  block=d)`` — the Lloyd–Max table for one coordinate of a uniform unit vector in ``d``
  dimensions;
* the indices of the whole vector are packed LSB-first in groups of 8 with the layout of
  :mod:`numba_kv.ops.bitpack` (``d * bits / 8`` bytes; the 32 coordinates ``32q ..
  32q+31`` at bytes ``[q·4·bits, (q+1)·4·bits)``, as in the block quantizer);
* one binary16 scalar is stored per vector (bits in a ``uint16``): ``n`` (below 65504:
  :func:`quantize_head` refuses a vector whose scalar would reach it), or, with
  ``unbiased=True``, the EDEN-style rescaled norm ``α = n · ‖y‖² / ⟨y, c[idx]⟩``, which
  makes ``⟨x̂, x⟩ = ‖x‖²`` and the inner-product estimate ``⟨q, x̂⟩`` unbiased (slope 1) at
  almost the same MSE.  The indices are the same
  in both modes.

Dequantization: ``x̂ = |s| · D_s H_d c[idx]``.  Storage is ``bits + 16/d`` bits per value
(3.125 at ``d = 128``, 3 bits) against ``bits + 0.5`` for the block quantizer.

Rotation: ``H_d`` is the normalized ``d × d`` Sylvester Hadamard matrix
(``H[i, j] = (−1)^popcount(i & j) / √d``, symmetric, ``H·H = I``), applied in place by a
``log2(d)``-stage radix-2 butterfly (strides ``1, 2, 4, …, d/2``, then one multiply by
``1/√d``); forward ``y = H_d D_s x`` (signs first, then Hadamard: the randomized Hadamard
transform), inverse ``x = D_s H_d y``.  The sign vector ``s = head_signs(d)`` is fixed
(see :func:`head_signs`).

Why signs first (unlike the 32-block rotation, whose Hadamard-first order is fixed by
bit compatibility with llama.cpp ``tq3_0``): with the Hadamard first, an input component
along a Hadamard row — above all an offset common to every channel, which ``H_d`` maps
onto ``y_0`` alone — is not spread by the signs and saturates the outer centroid
(Gaussian vectors plus a constant offset of 1.0, d = 128, 3 bits: NMSE 0.30).  Signs
first turn that offset into a ±1 pattern that ``H_d`` spreads over all coordinates
(NMSE 0.033, as without the offset).

Twins: the CPU twins work on tiles of ``LANES`` vectors interleaved lane by lane (value
``j`` of lane ``l`` at ``t[j*L + l]``) so every inner loop is a contiguous loop over lanes;
the CUDA kernels run one vector per thread block, the vector in shared memory and the
butterfly stages shared by the block's threads (:mod:`numba_kv.ops._coop`).  Per value both
do the same float32 operations in the same order, so their codes and norms agree bit for bit.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
from numba import cuda, float32, int64, prange, uint8, uint16

from .. import _backend
from .._config import MAX_HEAD_DIM
from .._jit import cpu_kernel, cuda_device, cuda_kernel
from .._validate import check_bool, check_f16_result, check_float_array, check_span
from ._borrow import borrowed, keep_alive
from ._coop import coop_butterflies
from ._exact import mul_rn_dev
from ._headquant_lanes import (
    LANES,
    TILES,
    dequantize_head_lanes_cpu,
    head_scale_dev,
    quantize_head_lanes_cpu,
    rotate_head_row_cpu,
)
from ._registry import register
from .codebook import DEQUANTIZE_SIGNATURE, Codebook, bucketize_dev, get_codebook
from .finite import check_finite, range_stats
from .hadamard import ROTATE_SIGNATURE, SIGNS32, rotate_prescaled, rotation_prescale
from .half import f16_bits_abs_to_f32_dev, f32_to_f16_bits_sat_dev

__all__ = ["HEAD_DIMS", "QUANTIZE_HEAD", "SIGN_SEED", "head_signs", "rotate_head", "quantize_head", "dequantize_head",
           "QUANTIZE_HEAD_VEC_DEV", "quantize_head_into", "dequantize_head_into", "rotate_head_rows",
           "head_codebook", "packed_dim", "bits_per_value"]

#: supported head dimensions (powers of two; 512 is the size of the CUDA kernels' shared row)
HEAD_DIMS = tuple(32 << i for i in range(MAX_HEAD_DIM.bit_length() - 5))  # 32 … MAX_HEAD_DIM
#: SplitMix64 seed of the sign vectors for ``d >= 64`` ([TQR]'s default rotation seed)
SIGN_SEED = 42
_M64 = (1 << 64) - 1


def _check_head_dim(name: str, d: Any) -> int:
    if isinstance(d, (bool, np.bool_)) or not isinstance(d, (int, np.integer)) or int(d) not in HEAD_DIMS:
        raise ValueError(f"{name}: expected a power of two in 32..512 ({', '.join(map(str, HEAD_DIMS))}), "
                         f"got {d!r}")
    return int(d)


def _check_bits(bits: Any) -> int:
    if isinstance(bits, (bool, np.bool_)) or not isinstance(bits, (int, np.integer)):
        raise TypeError(f"bits: expected an int in 1..5, got {type(bits).__name__} {bits!r}")
    if not 1 <= int(bits) <= 5:
        raise ValueError(f"bits: expected an int in 1..5, got {bits!r}")
    return int(bits)


def _splitmix64_signs(d: int, seed: int) -> np.ndarray:
    """``s_j = −1`` iff the top bit of the ``j``-th SplitMix64 output (state ``seed``) is set."""
    out = np.empty(d, dtype=np.float32)
    state = seed & _M64
    for j in range(d):
        state = (state + 0x9E3779B97F4A7C15) & _M64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
        z ^= z >> 31
        out[j] = -1.0 if z >> 63 else 1.0
    return out


@functools.cache
def head_signs(d: int) -> np.ndarray:
    """The fixed ±1 sign vector ``s`` of the ``d``-point head rotation.

    * ``d = 32``: :data:`numba_kv.ops.hadamard.SIGNS32` (llama.cpp mask ``0xB1A6D4B2``),
      the block rotation's signs (applied first here, last there);
    * ``d >= 64``: ``s_j = −1`` iff bit 63 of the ``j``-th output of SplitMix64 seeded with
      :data:`SIGN_SEED` (= 42) is set (``state += 0x9E3779B97F4A7C15``; ``z = state``;
      ``z = (z ^ z>>30)·0xBF58476D1CE4E5B9``; ``z = (z ^ z>>27)·0x94D049BB133111EB``;
      ``z ^= z>>31``, all mod 2⁶⁴) — a real PRNG, never the alternating "golden-ratio hash"
      that turboquant-rs uses.

    Parameters
    ----------
    d : int
        Head dimension, a power of two in 32..512.

    Returns
    -------
    numpy.ndarray
        float32, shape ``(d,)``, values ±1, read-only, cached (the same object per ``d``).
    """
    d = _check_head_dim("d", d)
    s = SIGNS32.copy() if d == 32 else _splitmix64_signs(d, SIGN_SEED)
    s.flags.writeable = False
    return s


def head_codebook(bits: int, d: int) -> Codebook:
    """The L2-mode Lloyd–Max codebook for coordinates of a unit vector in ``d`` dimensions,
    ``get_codebook(bits, "l2", block=d)`` (cached)."""
    return get_codebook(_check_bits(bits), "l2", block=_check_head_dim("d", d))


def packed_dim(d: int, bits: int) -> int:
    """Bytes of packed indices per vector: ``d * bits // 8``."""
    return d * bits // 8


def bits_per_value(d: int, bits: int) -> float:
    """Storage per value: ``bits + 16 / d`` (packed indices plus one binary16 norm)."""
    return bits + 16.0 / d




# --- CPU twins --------------------------------------------------------------------------
@cpu_kernel
def _rotate_head_cpu(x, signs, inverse, out):
    n, d = x.shape
    # borrowed views (numba_kv.ops._borrow): the rotation makes ~190 slice views of its buffer
    xb, sb, ob = borrowed(x), borrowed(signs), borrowed(out)
    for r in prange(n):
        own = np.empty(d, dtype=np.float32)
        rotate_head_row_cpu(xb, r, d, sb, inverse, borrowed(own), ob)
        keep_alive(own)


@cpu_kernel
def _quantize_head_cpu(x, signs, bounds, centroids, unbiased, bits, t0, codes, norms):
    rows, seq, d = x.shape
    nv = rows * seq
    ntiles = (nv + LANES - 1) // LANES
    # tiles as wide as the vectors when there are fewer than LANES (one decode step stores
    # one token per KV row): lanes are independent, so a narrower tile changes no bit, and
    # a full tile would spend 64/rows times the work on empty lanes
    L = min(LANES, nv)
    # borrowed views (numba_kv.ops._borrow): the cores make hundreds of row views per tile
    x, signs, bounds, centroids = borrowed(x), borrowed(signs), borrowed(bounds), borrowed(centroids)
    codes, norms = borrowed(codes), borrowed(norms)
    for c in prange((ntiles + TILES - 1) // TILES):
        t_own = np.zeros((d + 3) * L, dtype=np.float32)
        ib_own = np.zeros(d * L, dtype=np.uint8)
        w_own = np.zeros((d // 8 + 1) * L, dtype=np.int64)
        t, ib, w = borrowed(t_own), borrowed(ib_own), borrowed(w_own)
        for tile in range(c * TILES, min(ntiles, (c + 1) * TILES)):
            v0 = tile * L
            quantize_head_lanes_cpu(x, v0, min(L, nv - v0), d, signs, bounds, centroids, unbiased, bits,
                                    t0, codes, norms, L, t, ib, w)
        keep_alive(t_own)
        keep_alive(ib_own)
        keep_alive(w_own)


@cpu_kernel
def _dequantize_head_cpu(codes, norms, signs, centroids, bits, t0, out):
    rows, seq, d = out.shape
    nv = rows * seq
    ntiles = (nv + LANES - 1) // LANES
    L = min(LANES, nv)  # as in _quantize_head_cpu
    codes, norms, signs, centroids, out = borrowed(codes), borrowed(norms), borrowed(signs), borrowed(centroids), \
        borrowed(out)  # (borrowed views: as in _quantize_head_cpu)
    for c in prange((ntiles + TILES - 1) // TILES):
        t_own = np.zeros((d + 1) * L, dtype=np.float32)
        w_own = np.zeros((d // 8 + 1) * L, dtype=np.int64)
        t, w = borrowed(t_own), borrowed(w_own)
        for tile in range(c * TILES, min(ntiles, (c + 1) * TILES)):
            v0 = tile * L
            dequantize_head_lanes_cpu(codes, norms, v0, min(L, nv - v0), d, signs, centroids, bits, t0,
                                      out, L, t, w)
        keep_alive(t_own)
        keep_alive(w_own)


# --- CUDA kernels: one block per vector, the vector in shared memory ----------------------
# A thread per vector needs d floats of scratch per thread, which live in local memory
# (2-3 KB per thread at d = 512).  Here one block holds its vector once in shared memory and
# its threads share the element-wise steps and every butterfly stage (ops._coop).  Sums
# whose float32 rounding the CPU twin fixes by its order (the norm, ‖y‖², ⟨y, c⟩) are done
# by thread 0 in that order, so codes and norms stay bit-identical to the CPU twin.
@cuda_kernel
def _rotate_head_cuda(x, signs, inverse, out):
    """Rotate rows ``x[r]`` (``d`` values, a power of two <= 512) into ``out[r]``.

    Launch: ``(blocks, threads)`` from :func:`numba_kv._backend.coop_grid`: block ``b``
    rotates rows ``b, b + blocks, …`` (grid-stride); its threads share the row in shared
    memory, thread ``tid`` loading/scaling/storing values ``tid, tid + threads, …`` and
    taking its share of the pairs of every butterfly stage.
    """
    n, d = x.shape
    t = cuda.shared.array(MAX_HEAD_DIM, dtype=float32)
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    sc = head_scale_dev(d)
    for r in range(cuda.blockIdx.x, n, cuda.gridDim.x):
        xr = x[r]
        if inverse:
            for j in range(tid, d, nt):
                t[j] = xr[j]
            coop_butterflies(t, d, tid, nt)
            orow = out[r]
            for j in range(tid, d, nt):
                orow[j] = t[j] * (sc * signs[j])  # as _rotate_head_inverse_lanes: v·(sc·s_j)
        else:
            for j in range(tid, d, nt):
                t[j] = xr[j] * signs[j]
            coop_butterflies(t, d, tid, nt)
            orow = out[r]
            for j in range(tid, d, nt):
                orow[j] = t[j] * sc
        cuda.syncthreads()  # the next row overwrites t


@cuda_device
def _quantize_head_vec_dev(xr, signs, bounds, centroids, unbiased, bits, cb, norms, r, ts, t, ib, red):
    """Block-cooperative: quantize the vector ``xr`` (``d`` values) into the packed codes
    ``cb`` and ``norms[r, ts, 0]``, with the block's shared scratch ``t`` (float32[d]), ``ib``
    (uint8[d]) and ``red`` (float32[1]); every thread of the block calls it."""
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
            acc += mul_rn_dev(u, u)  # no FMA: the CPU twin rounds the product first
        red[0] = max(float32(math.sqrt(acc)), float32(1e-10))
    cuda.syncthreads()
    nrm = red[0]
    for j in range(tid, d, nt):
        t[j] = np.divide(t[j], nrm) * signs[j]
    coop_butterflies(t, d, tid, nt)
    for j in range(tid, d, nt):
        y = t[j] * sc
        t[j] = y
        bucketize_dev(t[j:], 1, bounds, ib[j:])  # this thread's one value: ib[j] = #{i : y > t_i}
    cuda.syncthreads()
    if unbiased and tid == 0:
        tyy = float32(0.0)
        tyc = float32(0.0)
        for j in range(d):
            y = t[j]
            tyy += mul_rn_dev(y, y)
            tyc += mul_rn_dev(y, centroids[ib[j]])
        if tyc > float32(0.0):  # else y = 0 (x = 0): keep n, which stores as 0
            red[0] = np.divide(nrm * tyy, tyc)
    for g in range(tid, d // 8, nt):
        w = int64(0)
        for k8 in range(8):
            w |= int64(ib[g * 8 + k8]) << (bits * k8)
        for jb in range(bits):
            cb[g * bits + jb] = uint8((w >> (8 * jb)) & 0xFF)
    if tid == 0:
        # inputs are validated finite, so the norm is too: the saturating conversion's
        # NaN behaviour does not matter here
        norms[r, ts, 0] = uint16(f32_to_f16_bits_sat_dev(red[0]))
    cuda.syncthreads()  # the next vector overwrites t, ib and red


@cuda_kernel
def _quantize_head_cuda(x, signs, bounds, centroids, unbiased, bits, t0, codes, norms):
    """Quantize vectors ``x[r, s]`` into ``codes[r, t0 + s]`` / ``norms[r, t0 + s, 0]``.

    Launch: ``(blocks, threads)`` from :func:`numba_kv._backend.coop_grid`: block ``b``
    quantizes flattened vectors ``v = b, b + blocks, …`` (``v = r·seq + s``); thread ``tid``
    handles values ``tid, tid + threads, …``, its share of every butterfly stage and the
    packed groups of 8 values ``tid, tid + threads, …``; thread 0 computes the sums and
    the binary16 norm.
    """
    rows, seq, d = x.shape
    t = cuda.shared.array(MAX_HEAD_DIM, dtype=float32)
    ib = cuda.shared.array(MAX_HEAD_DIM, dtype=uint8)
    red = cuda.shared.array(1, dtype=float32)
    for v in range(cuda.blockIdx.x, rows * seq, cuda.gridDim.x):
        r = v // seq
        s = v - r * seq
        _quantize_head_vec_dev(x[r, s], signs, bounds, centroids, unbiased, bits, codes[r, t0 + s], norms, r,
                               t0 + s, t, ib, red)


@cuda_kernel
def _dequantize_head_cuda(codes, norms, signs, centroids, bits, t0, out):
    """Reconstruct vectors ``out[r, s]`` from ``codes[r, t0 + s]`` / ``norms[r, t0 + s, 0]``.

    Launch: ``(blocks, threads)`` from :func:`numba_kv._backend.coop_grid`: block ``b``
    decodes flattened vectors ``v = b, b + blocks, …``; thread ``tid`` unpacks the groups of
    8 values ``tid, tid + threads, …`` into shared memory, takes its share of every
    butterfly stage and scales/stores values ``tid, tid + threads, …``.
    """
    rows, seq, d = out.shape
    t = cuda.shared.array(MAX_HEAD_DIM, dtype=float32)
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    sc = head_scale_dev(d)
    mask = (int64(1) << bits) - 1
    for v in range(cuda.blockIdx.x, rows * seq, cuda.gridDim.x):
        r = v // seq
        s = v - r * seq
        cb = codes[r, t0 + s]
        for g in range(tid, d // 8, nt):
            w = int64(0)
            for jb in range(bits):
                w |= int64(cb[g * bits + jb]) << (8 * jb)
            for k8 in range(8):
                t[g * 8 + k8] = centroids[(w >> (bits * k8)) & mask]
        nv = f16_bits_abs_to_f32_dev(int64(norms[r, t0 + s, 0]))
        coop_butterflies(t, d, tid, nt)
        orow = out[r, s]
        for j in range(tid, d, nt):
            orow[j] = (t[j] * (sc * signs[j])) * nv  # as dequantize_head_lanes
        cuda.syncthreads()  # the next vector overwrites t


_QSIG = ("void(float32[:, :, ::1], float32[::1], float32[::1], float32[::1], boolean, int64, int64, "
         "uint8[:, :, ::1], uint16[:, :, ::1])")
_ROTATE = register("rotate_head", _rotate_head_cpu, _rotate_head_cuda, [ROTATE_SIGNATURE])
_QUANTIZE = register("quantize_head", _quantize_head_cpu, _quantize_head_cuda, [_QSIG])
#: the head quantizer's twin (for fused serial callers such as :mod:`numba_kv.ops.window8`)
QUANTIZE_HEAD = _QUANTIZE
#: its block-cooperative per-vector device core (for fused kernels such as
#: :mod:`numba_kv.ops.headpair`'s)
QUANTIZE_HEAD_VEC_DEV = _quantize_head_vec_dev
_DEQUANTIZE = register("dequantize_head", _dequantize_head_cpu, _dequantize_head_cuda, [DEQUANTIZE_SIGNATURE])


# --- internal entry points (no validation: callers validated) ---------------------------
def quantize_head_into(x3: Any, codes: Any, norms: Any, t0: int, cb: Codebook, unbiased: bool) -> None:
    """Quantize ``x3`` ``[rows, seq, d]`` (float32, C-contiguous) into ``codes[:, t0:t0+seq]``
    (uint8 ``[rows, capacity, d*bits/8]``) and ``norms[:, t0:t0+seq]`` (uint16
    ``[rows, capacity, 1]``), all on one device; ``cb`` is ``head_codebook(bits, d)``."""
    rows, seq, d = x3.shape
    if rows == 0 or seq == 0:
        return
    t0 = check_span(t0, x3.shape[1], codes.shape[1], "codes")
    signs = _backend.constant(x3, head_signs(d))
    bounds = _backend.constant(x3, cb.boundaries)
    cents = _backend.constant(x3, cb.centroids)
    _QUANTIZE.launch(_backend.device_of("x3", x3), rows * seq, x3, signs, bounds, cents, bool(unbiased), cb.bits,
                     int(t0), codes, norms, work=rows * seq * d, coop=(rows * seq, d // 2))


def rotate_head_rows(x2: Any, inverse: bool = False, out: Any = None) -> Any:
    """Rotate the rows of ``x2`` ``[n, d]`` (float32, C-contiguous, ``d`` in :data:`HEAD_DIMS`,
    finite with row norms within float32) into ``out`` (float32 ``[n, d]``, C-contiguous, on
    the device of ``x2``; a new array when ``None``) and return it; no validation and no host
    round trip (the fused decode path validated its query already)."""
    n, d = int(x2.shape[0]), int(x2.shape[1])
    if out is None:
        out = _backend.empty(x2, (n, d), np.float32)
    if n:
        _ROTATE.launch(_backend.device_of("x", x2), n, x2, _backend.constant(x2, head_signs(d)), bool(inverse), out,
                       work=n * d, coop=(n, d // 2))
    return out


def dequantize_head_into(codes: Any, norms: Any, t0: int, cb: Codebook, out: Any) -> None:
    """Reconstruct tokens ``t0 : t0 + out.shape[1]`` of ``codes``/``norms`` into ``out``
    ``[rows, seq, d]`` float32 (same device)."""
    rows, seq, d = out.shape
    if rows == 0 or seq == 0:
        return
    t0 = check_span(t0, out.shape[1], codes.shape[1], "codes")
    signs = _backend.constant(out, head_signs(d))
    cents = _backend.constant(out, cb.centroids)
    _DEQUANTIZE.launch(_backend.device_of("out", out), rows * seq, codes, norms, signs, cents, cb.bits, int(t0), out,
                       work=rows * seq * d, coop=(rows * seq, d // 2))


# --- public API ------------------------------------------------------------------------
def _last_axis_head_dim(name: str, shape: tuple[int, ...]) -> int:
    if len(shape) < 1 or shape[-1] not in HEAD_DIMS:
        raise ValueError(f"{name}: expected a last axis that is a power of two in 32..512, got shape {shape}")
    return shape[-1]


def rotate_head(x: Any, inverse: bool = False, *, backend: str = "auto") -> Any:
    """Rotate whole head vectors: forward ``y = H_d D_s x`` (signs first) or inverse ``x = D_s H_d y``.

    Parameters
    ----------
    x : float16/32/64 array, shape ``(..., d)``
        ``d`` a power of two in 32..512; finite.  Computed in float32 (a vector whose norm is
        within a factor ``2·√d`` of the float32 maximum is rotated scaled by a power of two,
        so its butterfly sums stay finite; NumPy and CuPy arrays only).  NumPy → CPU twin;
        CUDA array → CUDA kernel.
    inverse : bool
        Apply the inverse rotation.
    backend : {"auto", "cpu", "cuda"}
        Check that the data lives where expected (never moves it).

    Returns
    -------
    y : float32 array, shape of ``x``, on the device of ``x``.

    Raises
    ------
    TypeError
        ``x`` not a float array, ``inverse`` not a bool.
    ValueError
        Last axis not a power of two in 32..512, NaN/Inf in ``x``, a vector whose rotation
        leaves float32.

    Examples
    --------
    >>> import numpy as np
    >>> x = np.random.default_rng(0).standard_normal((4, 128)).astype(np.float32)
    >>> bool(np.allclose(rotate_head(rotate_head(x), inverse=True), x, atol=1e-6))
    True
    """
    check_bool("inverse", inverse)  # (a truthy "no" must not select the inverse)
    _backend.resolve_device(backend, x=x)
    check_float_array("x", x)
    shape = tuple(x.shape)  # a tuple: the simulator's shapes reject negative indices
    d = _last_axis_head_dim("x", shape)
    scale = rotation_prescale("x", x, d)  # finite; 1.0 unless a butterfly sum would overflow
    rows = _backend.ascontiguous_f32("x", x).reshape(-1, d)
    out = rotate_prescaled("x", rows, scale, lambda r: rotate_head_rows(r, bool(inverse)))
    return out.reshape(shape)


def quantize_head(x: Any, bits: int = 3, unbiased: bool = False, *, backend: str = "auto") -> tuple[Any, Any]:
    """Quantize whole head vectors: normalize → ``d``-point rotation → bucketize → pack.

    Parameters
    ----------
    x : float16/32/64 array, shape ``(..., d)``
        ``d`` a power of two in 32..512; finite values.  NumPy → CPU twin; CUDA array →
        CUDA kernel.
    bits : int
        Index width 1..5 (codebook ``get_codebook(bits, "l2", block=d)``).
    unbiased : bool
        Store the EDEN-style rescaled norm ``‖x‖·‖y‖²/⟨y, c[idx]⟩`` instead of ``‖x‖``, so
        ``⟨x̂, x⟩ = ‖x‖²`` and inner products with ``x̂`` are unbiased (slope 1).
    backend : {"auto", "cpu", "cuda"}
        Check that the data lives where expected (never moves it).

    Returns
    -------
    codes : uint8 array, shape ``(..., d * bits // 8)``
        Packed indices (:mod:`numba_kv.ops.bitpack` layout over the whole vector).
    norms : uint16 array, shape ``(..., 1)``
        binary16 bit patterns of the stored scale (``norms.view(numpy.float16)`` on the
        host), below 65504.

    Raises
    ------
    TypeError
        ``x`` not a float array, ``unbiased`` not a bool.
    ValueError
        Bad ``bits``, last axis not a power of two in 32..512, NaN/Inf in ``x``, a stored
        scale (a norm, or the rescaled norm) that would reach 65504, binary16's largest
        value (it would be saturated, not stored).

    Examples
    --------
    >>> import numpy as np
    >>> codes, norms = quantize_head(np.ones((2, 128), np.float32), bits=3)
    >>> codes.shape, norms.shape, float(norms.view(np.float16)[0, 0])
    ((2, 48), (2, 1), 11.3125)
    """
    bits = _check_bits(bits)
    check_bool("unbiased", unbiased)
    _backend.resolve_device(backend, x=x)
    check_float_array("x", x)
    shape = tuple(x.shape)
    d = _last_axis_head_dim("x", shape)
    check_finite("x", x)
    cb = head_codebook(bits, d)
    x3 = _backend.ascontiguous_f32("x", x).reshape(1, -1, d)
    n = x3.shape[1]
    codes = _backend.empty(x, (1, n, packed_dim(d, bits)), np.uint8)
    norms = _backend.empty(x, (1, n, 1), np.uint16)
    quantize_head_into(x3, codes, norms, 0, cb, bool(unbiased))
    check_f16_result("x", norms)  # a saturated binary16 norm: x is out of range for this format
    return codes.reshape(shape[:-1] + (packed_dim(d, bits),)), norms.reshape(shape[:-1] + (1,))


def dequantize_head(codes: Any, norms: Any, bits: int = 3, *, backend: str = "auto",
                    check_values: bool = True) -> Any:
    """Reconstruct vectors from :func:`quantize_head` output: ``x̂ = |s| · D_s H_d c[idx]``.

    Parameters
    ----------
    codes : uint8 array, shape ``(..., d * bits // 8)``
        ``d`` (inferred) a power of two in 32..512.
    norms : uint16 array, shape ``(..., 1)``
        binary16 bit patterns (finite; the sign is ignored).
    bits : int
        As given to :func:`quantize_head` (either mode decodes the same way).
    backend : {"auto", "cpu", "cuda"}
        Check that the data lives where expected (never moves it).
    check_values : bool
        Read ``norms`` for Inf/NaN patterns (below).  ``False`` when the caller vouches for
        them (norms from :func:`quantize_head`): no pass over them and, on a GPU, no
        device-to-host read; the kernel then reads what it is given (an Inf/NaN pattern is no
        norm: its vector's output is unspecified).

    Returns
    -------
    x_hat : float32 array, shape ``(..., d)``, on the device of ``codes``.

    Raises
    ------
    TypeError
        ``codes`` not uint8, ``norms`` not uint16.
    ValueError
        Bad ``bits``, mismatching shapes, a ``d`` outside 32..512, Inf/NaN norm patterns
        (checked for every array kind by one integer max over ``norms``, which reads one
        number back to the host).
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
    if len(cshape) < 1 or (cshape[-1] * 8) % bits or (cshape[-1] * 8 // bits) not in HEAD_DIMS:
        raise ValueError(f"codes: expected a last axis of d*bits/8 bytes with d a power of two in 32..512 "
                         f"at bits={bits}, got shape {cshape}")
    if cshape[:-1] != nshape[:-1]:
        raise ValueError(f"norms: expected shape {cshape[:-1] + (1,)} to match codes {cshape}, got {nshape}")
    d = cshape[-1] * 8 // bits
    xp = _backend.xp_of(codes)
    if xp is not None:
        codes = xp.ascontiguousarray(codes)
        norms = xp.ascontiguousarray(norms)
    lead = nshape[:-1]
    c3 = codes.reshape(1, -1, cshape[-1])
    n3 = norms.reshape(1, -1, 1)
    # every array kind, Numba device arrays included (they decoded an Inf/NaN norm into
    # Inf/NaN output before): one integer max over the binary16 view, as dequantize_blocks
    if check_bool("check_values", check_values) and range_stats(n3.view(np.float16)).nonfinite:
        raise ValueError("norms: expected finite binary16 patterns, got Inf or NaN")
    out = _backend.empty(codes, (1, c3.shape[1], d), np.float32)
    dequantize_head_into(c3, n3, 0, head_codebook(bits, d), out)
    return out.reshape(lead + (d,))
