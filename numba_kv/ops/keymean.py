"""The per-channel key mean of key centering, as twins (for arrays without array arithmetic).

A cache with ``key_center`` stores keys as ``x − m``, ``m`` the per-channel mean of the
layer's first chunk (KIVI's per-channel key statistics, arXiv:2402.02750, §3; the mean taken
out before rotation and quantization).  NumPy and CuPy compute it with their own array
operations; Numba device arrays have none, so the mean and the centering go through these
twins there.  The mean is NumPy's ``x.astype(float64).mean(axis=1).astype(float32)``: a
float64 sum over the tokens in order (NumPy's order for a reduction over a non-contiguous
axis), divided by the count, rounded once to float32.  The centering is one float32
addition per value: ``x + (−1)·m`` is ``x − m`` exactly (IEEE 754 defines the difference as the
sum with the negation), and ``x + m`` undoes it as NumPy's ``flat + m`` does.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import cuda, float32, float64, prange

from .. import _backend
from .._jit import cpu_kernel, cuda_kernel, twin
from ._exact import mul_rn
from ._registry import F32_3D, register

__all__ = ["add_channel_into", "channel_mean_into"]


def _column_mean(x, r, j, out):
    """``out[r, 0, j]`` ← the mean of ``x[r, :, j]``: a float64 sum in token order, divided by
    the count, rounded once to float32."""
    n = x.shape[1]
    acc = float64(0.0)
    for t in range(n):
        acc += float64(x[r, t, j])
    out[r, 0, j] = float32(acc / n)


def _add_vector(x, m, s, r, t, out):
    """``out[r, t] = x[r, t] + s·m[r, 0]`` (``s = ±1``: ``±m`` exactly, then one rounding)."""
    for j in range(x.shape[2]):
        out[r, t, j] = x[r, t, j] + mul_rn(s, m[r, 0, j])


column_mean_cpu, column_mean_dev = twin(_column_mean, inline=True)
add_vector_cpu, add_vector_dev = twin(_add_vector, inline=True)


@cpu_kernel
def _channel_mean_cpu(x, out):
    """CPU twin: ``prange`` over the (row, channel) columns."""
    rows, d = x.shape[0], x.shape[2]
    for i in prange(rows * d):
        r = i // d
        column_mean_cpu(x, r, i - r * d, out)


@cuda_kernel
def _channel_mean_cuda(x, out):
    """Launch contract: 1-D grid, any size; thread ``i`` (grid-stride) sums column
    ``(i // d, i % d)`` over the tokens, in order."""
    rows, d = x.shape[0], x.shape[2]
    for i in range(cuda.grid(1), rows * d, cuda.gridsize(1)):
        r = i // d
        column_mean_dev(x, r, i - r * d, out)


@cpu_kernel
def _add_channel_cpu(x, m, sign, out):
    """CPU twin: ``prange`` over the (row, token) vectors."""
    rows, n = x.shape[0], x.shape[1]
    for i in prange(rows * n):
        r = i // n
        add_vector_cpu(x, m, float32(sign), r, i - r * n, out)


@cuda_kernel
def _add_channel_cuda(x, m, sign, out):
    """Launch contract: 1-D grid, any size; thread ``i`` (grid-stride) writes vector
    ``(i // n, i % n)``."""
    rows, n = x.shape[0], x.shape[1]
    for i in range(cuda.grid(1), rows * n, cuda.gridsize(1)):
        r = i // n
        add_vector_dev(x, m, float32(sign), r, i - r * n, out)


_MEAN = register("channel_mean", _channel_mean_cpu, _channel_mean_cuda, [f"void({F32_3D}, {F32_3D})"],
                 float32_only=False)
_ADD = register("add_channel", _add_channel_cpu, _add_channel_cuda, [f"void({F32_3D}, {F32_3D}, int64, {F32_3D})"])


def _check_x3(x3: Any) -> None:
    """``ValueError`` unless ``x3`` is a 3-D float32 array (the kernels' only signature: a
    float16 array failed inside the dispatch, a 2-D one at the shape unpacking)."""
    if len(x3.shape) != 3 or np.dtype(x3.dtype) != np.float32:
        raise ValueError(f"x3: expected a float32 array of shape (rows, n, d), got {x3.dtype} {tuple(x3.shape)}")


def channel_mean_into(x3: Any, out: Any) -> None:
    """``out[r, 0, j]`` ← the mean of ``x3[r, :, j]`` (float64 sum in token order, rounded
    once to float32), on the arrays' device.

    Parameters
    ----------
    x3 : float32 array, shape ``(rows, n, d)``, C-contiguous, ``n >= 1``
    out : float32 array, shape ``(rows, 1, d)``, C-contiguous
    """
    _check_x3(x3)
    rows, n, d = (int(s) for s in x3.shape)
    if n < 1 or tuple(int(s) for s in out.shape) != (rows, 1, d) or np.dtype(out.dtype) != np.float32:
        raise ValueError(f"out: expected float32 ({rows}, 1, {d}) for x3 of shape {(rows, n, d)} (n >= 1), got "
                         f"{out.dtype} {tuple(out.shape)}")
    dev = _backend.resolve_device("auto", x3=x3, out=out)
    _MEAN.launch(dev, rows * d, x3, out, work=rows * n * d)


def add_channel_into(x3: Any, m: Any, sign: int, out: Any) -> Any:
    """``out`` ← ``x3 + sign·m`` (``sign`` ±1: ``x3 − m`` or ``x3 + m`` exactly, in float32),
    ``m`` broadcast over the tokens, on the arrays' device; returns ``out``.

    Parameters
    ----------
    x3, out : float32 arrays, shape ``(rows, n, d)``, C-contiguous (``out`` may be ``x3``)
    m : float32 array, shape ``(rows, 1, d)``, C-contiguous
    sign : {1, -1}
    """
    _check_x3(x3)
    rows, n, d = (int(s) for s in x3.shape)
    if sign not in (1, -1):
        raise ValueError(f"sign: expected 1 or -1, got {sign!r}")
    for name, a, shape in (("m", m, (rows, 1, d)), ("out", out, (rows, n, d))):
        if tuple(int(s) for s in a.shape) != shape or np.dtype(a.dtype) != np.float32:
            raise ValueError(f"{name}: expected float32 {shape}, got {a.dtype} {tuple(a.shape)}")
    dev = _backend.resolve_device("auto", x3=x3, m=m, out=out)
    _ADD.launch(dev, rows * n, x3, m, int(sign), out, work=rows * n * d)
    return out
