"""Device-agnostic buffer copies used when per-layer storage grows.

NumPy and CuPy can copy a slice with ``dst[:, :n] = src[:, :n]``, but Numba device
arrays (and the simulator's) cannot assign strided slices, so growth goes through this
small twin on every device.
"""

from __future__ import annotations

from typing import Any

from numba import cuda, prange

from .. import _backend
from .._jit import cpu_kernel, cuda_kernel
from ._registry import register


@cpu_kernel
def _copy_prefix_cpu(src, n, dst):
    rows = src.shape[0]
    width = src.shape[2]
    for r in prange(rows):
        for t in range(n):
            for w in range(width):
                dst[r, t, w] = src[r, t, w]


@cuda_kernel
def _copy_prefix_cuda(src, n, dst):
    rows = src.shape[0]
    width = src.shape[2]
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    for i in range(start, rows * n * width, stride):
        r = i // (n * width)
        rem = i - r * n * width
        t = rem // width
        w = rem - t * width
        dst[r, t, w] = src[r, t, w]


register("copy_prefix", _copy_prefix_cpu, _copy_prefix_cuda,
         ["void(uint8[:, :, ::1], int64, uint8[:, :, ::1])",
          "void(uint16[:, :, ::1], int64, uint16[:, :, ::1])",
          "void(float32[:, :, ::1], int64, float32[:, :, ::1])"])


def copy_prefix(src: Any, n: int, dst: Any) -> None:
    """Copy ``src[:, :n, :]`` into ``dst[:, :n, :]`` (3-D, same dtype, same device).

    Parameters
    ----------
    src, dst : array, shape ``(rows, capacity, width)``
        C-contiguous; ``dst`` capacity ``>= n``.
    n : int
        Number of leading tokens to copy.
    """
    dev = _backend.resolve_device("auto", src=src, dst=dst)
    if src.dtype != dst.dtype or src.shape[0] != dst.shape[0] or src.shape[2] != dst.shape[2]:
        raise ValueError(f"dst: expected dtype {src.dtype} and shape ({src.shape[0]}, >= {n}, {src.shape[2]}), "
                         f"got {dst.dtype} {tuple(dst.shape)}")
    if n <= 0 or src.shape[0] == 0:
        return
    if dev == _backend.CPU:
        _copy_prefix_cpu(src, int(n), dst)
    else:
        blocks, threads = _backend.cuda_grid(src.shape[0] * n * src.shape[2])
        _copy_prefix_cuda[blocks, threads](src, int(n), dst)
