"""Per-vector int8 absmax codec of the caches' exact window, as twins.

A vector ``x`` (``head_dim`` float32 values in the cache's stored domain, rotated or not) is
stored as int8 codes ``q_j = clamp(rint(x_j / s), −127, 127)`` with one binary16 scale
``s = fp16(max_j |x_j| / 127)``, and read back as ``q_j · s``: the symmetric, vector-wise
absmax quantization of LLM.int8() (arXiv:2208.07339, §3.1), with the scale rounded to
binary16 before it divides so that the reader's ``q · s`` uses the stored scale itself.

Small vectors.  Below ``max |x| = 127·2**-14`` (about 7.8e-3) the scale is a subnormal
binary16, a multiple of ``2**-24``, so round-to-nearest can leave it up to a third below
``max|x|/127``; the scale then goes up one step when ``max|x| > 127.5·s`` (which a normal
scale never meets: there ``max|x|/s <= 127·(1 + 2**-11)``), so no code clips by more than
half a step.  A scale that rounds to 0 becomes the smallest subnormal ``2**-24`` (``1`` for
an all-zero vector, stored exactly).  Every value therefore comes back within half a step,
``s/2``: at most ``max|x|/254`` (to binary16's rounding) for a normal scale, at most
``max|x|/254 + 2**-25`` (``2**-25`` is about 3e-8) for a subnormal one.

The cores reproduce the NumPy formula of ``tests/ops/test_absmax8.py`` (``(abs(x).max() /
127).astype(float16)``, the two small-vector rules, ``rint(x / s)``, ``clip`` and
``astype(int8)``) bit for bit, round-to-nearest-even everywhere; one decode step stores one
token per KV row, and a kernel launch replaced eight NumPy calls and their temporaries.
"""

from __future__ import annotations

from typing import Any

from numba import cuda, float32, int8, prange, uint16

from .. import _backend
from .._jit import cpu_kernel, cuda_kernel, twin
from ._registry import register
from .half import f16_bits_to_f32, f32_to_f16_bits_sat

__all__ = ["absmax8_dequantize_into", "absmax8_quantize_into"]

#: ``1.5·2**23``: for ``|v| < 2**22``, ``v + RNE_MAGIC`` lies in ``[2**23, 2**24)``, where
#: float32 has no fraction bits, so the addition rounds ``v`` to an integer (to even on a
#: tie) and subtracting it back is exact
RNE_MAGIC = float32(12582912.0)
ONE_F16 = 0x3C00  # binary16 1.0


def _rint(v):
    """``v`` rounded to the nearest integer, ties to even (``numpy.rint``), for float32
    ``|v| < 2**22``; two float32 additions, no library call and no branch (kernels are
    compiled without fast-math, so the pair is not folded away)."""
    return (v + RNE_MAGIC) - RNE_MAGIC


def _scale_bits(amax):
    """The binary16 scale (bits) of a vector whose largest ``|x_j|`` is ``amax`` (finite,
    ``>= 0``): ``fp16(amax / 127)``, raised to the smallest subnormal when it rounds to 0 and
    one step when ``amax > 127.5·s`` (subnormal scales only); ``1.0`` for ``amax = 0``."""
    h = uint16(max(f32_to_f16_bits_sat(amax / float32(127.0)), uint16(1)))
    h = uint16(h + uint16(amax > float32(127.5) * f16_bits_to_f32(h)))
    return uint16(ONE_F16) if amax == float32(0.0) else h


scale_bits_cpu, scale_bits_dev = twin(_scale_bits, inline=True)


def _quantize_vector(x, r, t, codes, scales, d0):
    """Vector ``x[r, t]`` into ``codes[r, d0 + t]`` and ``scales[r, d0 + t, 0]``.

    ``|x_j / s| <= 127.5`` (:func:`_scale_bits`), far inside :func:`_rint`'s range."""
    d = x.shape[2]
    amax = float32(0.0)
    for j in range(d):
        amax = max(amax, abs(x[r, t, j]))
    h = _scale_bits(amax)
    s = f16_bits_to_f32(h)
    for j in range(d):
        v = _rint(x[r, t, j] / s)
        codes[r, d0 + t, j] = int8(min(max(v, float32(-127.0)), float32(127.0)))
    scales[r, d0 + t, 0] = h


def _dequantize_vector(codes, scales, r, t, s0, out, d0):
    """``out[r, d0 + t] = codes[r, s0 + t] · scale`` (float32)."""
    d = out.shape[2]
    s = f16_bits_to_f32(scales[r, s0 + t, 0])
    for j in range(d):
        out[r, d0 + t, j] = float32(codes[r, s0 + t, j]) * s


rint_cpu, rint_dev = twin(_rint, inline=True)
quantize_vector_cpu, quantize_vector_dev = twin(_quantize_vector)
dequantize_vector_cpu, dequantize_vector_dev = twin(_dequantize_vector)


# --- CPU twins: prange over the (row, token) vectors ------------------------------------------
@cpu_kernel
def _absmax8_quantize_cpu(x, codes, scales, d0):
    """CPU twin: one ``prange`` iteration stores one (row, token) vector."""
    rows, n = x.shape[0], x.shape[1]
    for i in prange(rows * n):
        r = i // n
        quantize_vector_cpu(x, r, i - r * n, codes, scales, d0)


@cpu_kernel
def _absmax8_dequantize_cpu(codes, scales, s0, n, out, d0):
    """CPU twin: one ``prange`` iteration decodes one (row, token) vector."""
    rows = out.shape[0]
    for i in prange(rows * n):
        r = i // n
        dequantize_vector_cpu(codes, scales, r, i - r * n, s0, out, d0)


# --- CUDA kernels: one thread per vector, grid-stride ------------------------------------------
@cuda_kernel
def _absmax8_quantize_cuda(x, codes, scales, d0):
    """Launch contract: 1-D grid, any size; thread ``i`` (grid-stride) stores vector
    ``(i // n, i % n)`` of ``x`` ``[rows, n, d]``."""
    rows, n = x.shape[0], x.shape[1]
    for i in range(cuda.grid(1), rows * n, cuda.gridsize(1)):
        r = i // n
        quantize_vector_dev(x, r, i - r * n, codes, scales, d0)


@cuda_kernel
def _absmax8_dequantize_cuda(codes, scales, s0, n, out, d0):
    """Launch contract: 1-D grid, any size; thread ``i`` (grid-stride) decodes vector
    ``(i // n, i % n)`` of the ``n`` read."""
    rows = out.shape[0]
    for i in range(cuda.grid(1), rows * n, cuda.gridsize(1)):
        r = i // n
        dequantize_vector_dev(codes, scales, r, i - r * n, s0, out, d0)


_QUANTIZE = register("absmax8_quantize", _absmax8_quantize_cpu, _absmax8_quantize_cuda,
                     ["void(float32[:, :, ::1], int8[:, :, ::1], uint16[:, :, ::1], int64)"])
_DEQUANTIZE = register("absmax8_dequantize", _absmax8_dequantize_cpu, _absmax8_dequantize_cuda,
                       ["void(int8[:, :, ::1], uint16[:, :, ::1], int64, int64, float32[:, :, ::1], int64)"])


def absmax8_quantize_into(x3: Any, codes: Any, scales: Any, d0: int) -> None:
    """Store the vectors of ``x3`` as int8 codes with binary16 scales (no validation).

    Parameters
    ----------
    x3 : float32 array, shape ``(rows, n, d)``, C-contiguous
        Finite vectors whose ``max |x| / 127`` is within binary16 (larger ones store a
        saturated scale of 65504).
    codes : int8 array, shape ``(rows, capacity, d)``
    scales : uint16 array, shape ``(rows, capacity, 1)``
        Binary16 bit patterns; tokens ``d0 … d0 + n − 1`` of both are written.
    d0 : int
        First destination token.
    """
    rows, n, d = (int(s) for s in x3.shape)
    if rows * n:
        _QUANTIZE.launch(_backend.device_of("x", x3), rows * n, x3, codes, scales, int(d0), work=rows * n * d)


def absmax8_dequantize_into(codes: Any, scales: Any, s0: int, n: int, out: Any, d0: int = 0) -> None:
    """``out[:, d0 : d0 + n] = codes[:, s0 : s0 + n] · scale`` (float32; no validation).

    Parameters
    ----------
    codes : int8 array, shape ``(rows, capacity, d)``
    scales : uint16 array, shape ``(rows, capacity, 1)``
    s0, n : int
        First source token and token count.
    out : float32 array, shape ``(rows, >= d0 + n, d)``, C-contiguous
    d0 : int
        First destination token.
    """
    rows, d = int(out.shape[0]), int(out.shape[2])
    if rows * n > 0:
        _DEQUANTIZE.launch(_backend.device_of("out", out), rows * n, codes, scales, int(s0), int(n), out, int(d0),
                           work=rows * n * d)
