"""Token positions of a cache's exact (sink + window) tokens, written on the device.

A windowed cache keeps ``n_sink`` sink tokens (positions ``0 .. n_sink-1``) and ``n_win``
window tokens that follow the compressed ones (positions ``base .. base+n_win-1``); the
fused decode kernel needs them as an int32 array.  Building that array on the host and
uploading it would cost a host-to-device copy per decode step; this twin writes it in place
on the array's own device.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import cuda, int32, prange

from .. import _backend
from .._jit import cpu_kernel, cuda_kernel
from ._registry import register

__all__ = ["exact_positions_into"]

_INT32_END = 2**31  # positions are int32: every one must stay below this


@cpu_kernel
def _exact_positions_cpu(out, n, n_sink, base):
    """CPU twin of :func:`_exact_positions_cuda` (``prange`` over the ``n`` positions)."""
    for i in prange(n):
        out[i] = int32(i if i < n_sink else base + (i - n_sink))


@cuda_kernel
def _exact_positions_cuda(out, n, n_sink, base):
    """``out[i]`` = position of exact token ``i`` for ``i < n``.

    Launch: 1-D grid over ``n`` (grid-stride), one position per thread.
    """
    for i in range(cuda.grid(1), n, cuda.gridsize(1)):
        out[i] = int32(i if i < n_sink else base + (i - n_sink))


_POSITIONS = register("exact_positions", _exact_positions_cpu, _exact_positions_cuda,
                      ["void(int32[::1], int64, int64, int64)"])


def exact_positions_into(out: Any, n_sink: int, base: int, n_win: int) -> Any:
    """Write ``[0, …, n_sink-1, base, …, base+n_win-1]`` (int32) into ``out`` and return
    the view ``out[:max(n, 1)]`` (``n = n_sink + n_win``; the kernels never read an entry
    when ``n = 0``).

    Parameters
    ----------
    out : int32 array, shape ``(>= max(n, 1),)``
        C-contiguous, NumPy or CUDA; written on its own device (no host copy).
    n_sink, base, n_win : int
        Sink tokens, position of the first window token, window tokens (all ``>= 0``, every
        position below ``2**31``).

    Raises
    ------
    ValueError
        A negative count, a position beyond int32, ``out`` not a long enough 1-D int32 array.
    """
    n_sink, base, n_win = int(n_sink), int(base), int(n_win)
    # negative counts wrote nothing (the view held stale entries); positions past int32 wrapped
    if min(n_sink, base, n_win) < 0 or base + n_win > _INT32_END or n_sink > _INT32_END:
        raise ValueError(f"n_sink, base, n_win: expected counts >= 0 with positions below 2**31, got "
                         f"{(n_sink, base, n_win)}")
    n = n_sink + n_win
    if len(out.shape) != 1 or int(out.shape[0]) < max(n, 1) or np.dtype(out.dtype) != np.int32:
        raise ValueError(f"out: expected a 1-D int32 array of length >= {max(n, 1)}, got {out.dtype} "
                         f"{tuple(out.shape)}")
    _POSITIONS.launch(_backend.device_of("out", out), n, out, n, n_sink, base)
    return out[:max(n, 1)]
