"""Block quantizer ("PolarQuant" of turboquant-rs): normalize → rotate → bucketize → pack.

Per 32-value block of a head vector (``algorithms.md`` §2.3–§2.7):

* **MaxNorm** (default): ``r = D_s H x``; ``scale = max(max|r| / ref, 1e-10)``;
  ``y = r / scale`` so the block's extreme lands on the outer centroid ``±ref``.
* **L2**: ``n = max(‖x‖, 1e-10)``; ``y = D_s H (x / n)`` (a unit vector); ``scale = n``.

``idx_j = #{i : y_j > t_i}`` against the codebook boundaries, packed LSB-first with the
``bits``-wide layout of :mod:`numba_kv.ops.bitpack` (block ``q`` at bytes
``[q·4·bits, (q+1)·4·bits)``), and ``flag · scale`` stored as IEEE binary16 bits
(``flag = −1`` marks an outlier-codebook block — PQO —, ``+1`` a normal block — PQ).
Indices are computed from the float32 scale before its binary16 rounding.  Scales are
clamped to the binary16 range (``≤ 65504``): blocks beyond that saturate.

Dequantization: ``x̂ = |scale| · H D_s c[idx]``.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Tuple

import numpy as np
from numba import cuda, float32, int64, prange, uint8

from .. import _backend
from .._jit import cpu_kernel, cuda_kernel, twin
from ._registry import register
from .bitpack import _pack_group8, _unpack_group8
from .codebook import Codebook, get_codebook
from .half import F16_MAX, _f16_bits_abs_to_f32, _f32_to_f16_bits
from .hadamard import SIGNS32, _rotate32_forward, _rotate32_inverse

NORM_MODES = ("maxnorm", "l2")


# --- single-source cores -------------------------------------------------------------
def _quantize_block(xrow, b, signs, bounds, l2, ref, flag, bits, buf, ibuf, crow, srow):
    """Quantize block ``b`` of vector ``xrow`` into packed ``crow`` and f16 ``srow[b]``."""
    o = b * 32
    if l2:
        ss = float32(0.0)
        for j in range(32):
            v = float32(xrow[o + j])
            buf[j] = v
            ss += v * v
        scale = max(float32(math.sqrt(ss)), float32(1e-10))
        for j in range(32):
            buf[j] = buf[j] / scale
        _rotate32_forward(buf, signs)
    else:
        for j in range(32):
            buf[j] = float32(xrow[o + j])
        _rotate32_forward(buf, signs)
        amax = float32(0.0)
        for j in range(32):
            amax = max(amax, abs(buf[j]))
        scale = max(amax / ref, float32(1e-10))
        for j in range(32):
            buf[j] = buf[j] / scale
    nbound = bounds.shape[0]
    for j in range(32):
        y = buf[j]
        c = 0
        for i in range(nbound):
            if y > bounds[i]:
                c += 1
        ibuf[j] = uint8(c)
    for g in range(4):
        _pack_group8(ibuf, g * 8, bits, crow, b * 4 * bits + g * bits)
    srow[b] = _f32_to_f16_bits(flag * min(scale, float32(65504.0)))


def _dequantize_block(crow, srow, b, signs, centroids, bits, buf, ibuf, orow):
    """Reconstruct block ``b`` of one vector into ``orow[32b:32b+32]`` (float32)."""
    for g in range(4):
        _unpack_group8(crow, b * 4 * bits + g * bits, bits, ibuf, g * 8)
    for j in range(32):
        buf[j] = centroids[ibuf[j]]
    _rotate32_inverse(buf, signs)
    s = _f16_bits_abs_to_f32(srow[b])
    o = b * 32
    for j in range(32):
        orow[o + j] = buf[j] * s


quantize_block_cpu, quantize_block_dev = twin(_quantize_block)
dequantize_block_cpu, dequantize_block_dev = twin(_dequantize_block)

_CHUNK = 64  # vectors per CPU work item (scratch buffers are allocated once per item)


# --- CPU twins --------------------------------------------------------------------------
@cpu_kernel
def _quantize_cpu(x, signs, bounds, l2, ref, flag, bits, t0, codes, scales):
    rows, seq, d = x.shape
    nb = d // 32
    total = rows * seq
    nchunks = (total + _CHUNK - 1) // _CHUNK
    for c in prange(nchunks):
        buf = np.empty(32, dtype=np.float32)
        ibuf = np.empty(32, dtype=np.uint8)
        for t in range(c * _CHUNK, min(total, (c + 1) * _CHUNK)):
            r = t // seq
            s = t - r * seq
            xrow = x[r, s]
            crow = codes[r, t0 + s]
            srow = scales[r, t0 + s]
            for b in range(nb):
                quantize_block_cpu(xrow, b, signs, bounds, l2, ref, flag, bits, buf, ibuf, crow, srow)


@cpu_kernel
def _dequantize_cpu(codes, scales, signs, centroids, bits, t0, out):
    rows, seq, d = out.shape
    nb = d // 32
    total = rows * seq
    nchunks = (total + _CHUNK - 1) // _CHUNK
    for c in prange(nchunks):
        buf = np.empty(32, dtype=np.float32)
        ibuf = np.empty(32, dtype=np.uint8)
        for t in range(c * _CHUNK, min(total, (c + 1) * _CHUNK)):
            r = t // seq
            s = t - r * seq
            crow = codes[r, t0 + s]
            srow = scales[r, t0 + s]
            orow = out[r, s]
            for b in range(nb):
                dequantize_block_cpu(crow, srow, b, signs, centroids, bits, buf, ibuf, orow)


# --- CUDA kernels: one thread per (vector, 32-block), grid-stride -----------------------
@cuda_kernel
def _quantize_cuda(x, signs, bounds, l2, ref, flag, bits, t0, codes, scales):
    rows, seq, d = x.shape
    nb = d // 32
    buf = cuda.local.array(32, dtype=float32)
    ibuf = cuda.local.array(32, dtype=uint8)
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    for t in range(start, rows * seq * nb, stride):
        v = t // nb
        b = t - v * nb
        r = v // seq
        s = v - r * seq
        quantize_block_dev(x[r, s], b, signs, bounds, l2, ref, flag, bits, buf, ibuf,
                           codes[r, t0 + s], scales[r, t0 + s])


@cuda_kernel
def _dequantize_cuda(codes, scales, signs, centroids, bits, t0, out):
    rows, seq, d = out.shape
    nb = d // 32
    buf = cuda.local.array(32, dtype=float32)
    ibuf = cuda.local.array(32, dtype=uint8)
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    for t in range(start, rows * seq * nb, stride):
        v = t // nb
        b = t - v * nb
        r = v // seq
        s = v - r * seq
        dequantize_block_dev(codes[r, t0 + s], scales[r, t0 + s], b, signs, centroids, bits, buf, ibuf,
                             out[r, s])


_QSIG = ("void(float32[:, :, ::1], float32[::1], float32[::1], boolean, float32, float32, int64, int64, "
         "uint8[:, :, ::1], uint16[:, :, ::1])")
_DSIG = ("void(uint8[:, :, ::1], uint16[:, :, ::1], float32[::1], float32[::1], int64, int64, "
         "float32[:, :, ::1])")
register("quantize_blocks", _quantize_cpu, _quantize_cuda, [_QSIG])
register("dequantize_blocks", _dequantize_cpu, _dequantize_cuda, [_DSIG])


# --- internal entry points used by caches (no validation: callers validated) -----------
def quantize_into(x3: Any, codes: Any, scales: Any, t0: int, cb: Codebook, outlier: bool) -> None:
    """Quantize ``x3`` ``[rows, seq, d]`` (float32, C-contiguous, on one device) into
    ``codes[:, t0:t0+seq]`` and ``scales[:, t0:t0+seq]``."""
    rows, seq, d = x3.shape
    if rows == 0 or seq == 0:
        return
    signs = _backend.constant(x3, SIGNS32)
    bounds = _backend.constant(x3, cb.boundaries)
    l2 = cb.norm_mode == "l2"
    ref = np.float32(cb.ref)
    flag = np.float32(-1.0 if outlier else 1.0)
    if isinstance(x3, np.ndarray):
        _quantize_cpu(x3, signs, bounds, l2, ref, flag, cb.bits, int(t0), codes, scales)
    else:
        blocks, threads = _backend.cuda_grid(rows * seq * (d // 32))
        _quantize_cuda[blocks, threads](x3, signs, bounds, l2, ref, flag, cb.bits, int(t0), codes, scales)


def dequantize_into(codes: Any, scales: Any, t0: int, cb: Codebook, out: Any) -> None:
    """Reconstruct tokens ``t0 : t0 + out.shape[1]`` of ``codes``/``scales`` into ``out``
    ``[rows, seq, d]`` float32."""
    rows, seq, d = out.shape
    if rows == 0 or seq == 0:
        return
    signs = _backend.constant(out, SIGNS32)
    cents = _backend.constant(out, cb.centroids)
    if isinstance(out, np.ndarray):
        _dequantize_cpu(codes, scales, signs, cents, cb.bits, int(t0), out)
    else:
        blocks, threads = _backend.cuda_grid(rows * seq * (d // 32))
        _dequantize_cuda[blocks, threads](codes, scales, signs, cents, cb.bits, int(t0), out)


def packed_dim(head_dim: int, bits: int) -> int:
    """Bytes of packed indices per vector: ``head_dim * bits // 8``."""
    return head_dim * bits // 8


# --- public API ------------------------------------------------------------------------
def _codebook_arg(bits: Any, norm_mode: Any, codebook: Optional[Codebook]) -> Codebook:
    if codebook is not None:
        if not isinstance(codebook, Codebook):
            raise TypeError(f"codebook: expected a numba_kv.ops.codebook.Codebook, got {type(codebook).__name__}")
        return codebook
    if norm_mode not in NORM_MODES:
        raise ValueError(f"norm_mode: expected one of {list(NORM_MODES)}, got {norm_mode!r}")
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or not 1 <= int(bits) <= 4:
        raise ValueError(f"bits: expected an int in 1..4, got {bits!r}")
    return get_codebook(int(bits), norm_mode)


def quantize_blocks(x: Any, bits: int = 3, norm_mode: str = "maxnorm", outlier: bool = True, *,
                    codebook: Optional[Codebook] = None, backend: str = "auto") -> Tuple[Any, Any]:
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

    Returns
    -------
    codes : uint8 array, shape ``(..., d * bits // 8)``
    scales : uint16 array, shape ``(..., d // 32)``
        binary16 bit patterns of ``±scale``; ``scales.view(numpy.float16)`` on the host.

    Raises
    ------
    ValueError
        Bad ``bits``/``norm_mode``, ``d`` not a multiple of 32, NaN/Inf in ``x``.

    Examples
    --------
    >>> import numpy as np
    >>> codes, scales = quantize_blocks(np.ones((2, 64), np.float32), bits=3)
    >>> codes.shape, scales.shape
    ((2, 24), (2, 2))
    """
    from .._validate import check_finite, check_float_array  # noqa: PLC0415

    cb = _codebook_arg(bits, norm_mode, codebook)
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
    quantize_into(x3, codes, scales, 0, cb, bool(outlier))
    del dev
    return codes.reshape(shape[:-1] + (packed_dim(d, cb.bits),)), scales.reshape(shape[:-1] + (d // 32,))


def dequantize_blocks(codes: Any, scales: Any, bits: int = 3, norm_mode: str = "maxnorm", *,
                      codebook: Optional[Codebook] = None, backend: str = "auto") -> Any:
    """Reconstruct vectors from :func:`quantize_blocks` output.

    Parameters
    ----------
    codes : uint8 array, shape ``(..., d * bits // 8)``
    scales : uint16 array, shape ``(..., d // 32)``
    bits, norm_mode, codebook
        As given to :func:`quantize_blocks`.

    Returns
    -------
    x_hat : float32 array, shape ``(..., d)``, on the device of ``codes``.
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
    out = _backend.empty(codes, (1, c3.shape[1], d), np.float32)
    dequantize_into(c3, s3, 0, cb, out)
    return out.reshape(lead + (d,))
