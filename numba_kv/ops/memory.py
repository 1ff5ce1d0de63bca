"""Device-agnostic token copies between per-layer buffers.

NumPy and CuPy can copy a slice with ``dst[:, a:b] = src[:, c:d]``, but Numba device
arrays (and the simulator's) cannot assign strided slices, so storage growth, the
full-precision window and history assembly go through this small twin on every device.
"""

from __future__ import annotations

from typing import Any

from numba import cuda, prange

from .. import _backend
from .._jit import cpu_kernel, cuda_kernel
from ._index import unravel3_dev
from ._registry import register


@cpu_kernel
def _copy_tokens_cpu(src, s0, n, dst, d0):
    """CPU twin of :func:`_copy_tokens_cuda`: ``prange`` over the rows."""
    rows = src.shape[0]
    width = src.shape[2]
    for r in prange(rows):
        for t in range(n):
            for w in range(width):
                dst[r, d0 + t, w] = src[r, s0 + t, w]


@cuda_kernel
def _copy_tokens_cuda(src, s0, n, dst, d0):
    """1-D grid over the ``rows·n·width`` copied elements; one thread copies one."""
    width = src.shape[2]
    for i in range(cuda.grid(1), src.shape[0] * n * width, cuda.gridsize(1)):
        r, t, w = unravel3_dev(i, n, width)
        dst[r, d0 + t, w] = src[r, s0 + t, w]


_COPY_TOKENS = register("copy_tokens", _copy_tokens_cpu, _copy_tokens_cuda,
         ["void(uint8[:, :, ::1], int64, int64, uint8[:, :, ::1], int64)",
          "void(uint16[:, :, ::1], int64, int64, uint16[:, :, ::1], int64)",
          "void(float32[:, :, ::1], int64, int64, float32[:, :, ::1], int64)"])


def copy_tokens(src: Any, s0: int, n: int, dst: Any, d0: int = 0) -> None:
    """``dst[:, d0:d0+n, :] = src[:, s0:s0+n, :]`` for 3-D token buffers.

    Parameters
    ----------
    src, dst : array, shape ``(rows, capacity, width)``
        C-contiguous, same dtype, same rows and width, same device; must not be the same
        buffer when the ranges overlap.
    s0, n, d0 : int
        Source start, token count, destination start.
    """
    dev = _backend.resolve_device("auto", src=src, dst=dst)
    if src.dtype != dst.dtype or src.shape[0] != dst.shape[0] or src.shape[2] != dst.shape[2]:
        raise ValueError(f"dst: expected dtype {src.dtype} and shape ({src.shape[0]}, ·, {src.shape[2]}), "
                         f"got {dst.dtype} {tuple(dst.shape)}")
    if s0 < 0 or d0 < 0 or s0 + n > src.shape[1] or d0 + n > dst.shape[1]:
        raise ValueError(f"n: token range out of bounds (src {s0}+{n} of {src.shape[1]}, "
                         f"dst {d0}+{n} of {dst.shape[1]})")
    if n <= 0 or src.shape[0] == 0:
        return
    _COPY_TOKENS.launch(dev, src.shape[0] * n * src.shape[2], src, int(s0), int(n), dst, int(d0))


def copy_prefix(src: Any, n: int, dst: Any) -> None:
    """``dst[:, :n] = src[:, :n]`` (storage growth)."""
    copy_tokens(src, 0, n, dst, 0)
