"""Page-table bookkeeping written on the device: pool rows of a run of tokens in one page,
and the in-place growth of a sequence's last page.

A paged cache (:class:`numba_kv.caches.paged.PagedKVCache`) appends a decode step's token to
the page that holds the sequence's last tokens; its pool rows and the page table's
``kv_last_page_len`` entry are a function of a few integers.  Building those arrays on the
host costs one host-to-device copy each per layer and step; these twins write them on the
array's own device from kernel arguments (no copy), as :mod:`numba_kv.ops.positions` does
for a window's token positions.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import cuda, int32, prange

from .. import _backend
from .._jit import cpu_kernel, cuda_kernel
from ._registry import register

__all__ = ["page_run_rows_into", "add_at"]


# --- CPU twins ---------------------------------------------------------------------------
@cpu_kernel
def _page_run_rows_cpu(out, n, page, slot, num_kv_heads, page_size):
    """CPU twin of :func:`_page_run_rows_cuda` (``prange`` over the ``num_kv_heads·n`` rows)."""
    for e in prange(num_kv_heads * n):
        h = e // n
        out[e] = int32((page * num_kv_heads + h) * page_size + slot + (e - h * n))


@cpu_kernel
def _add_at_cpu(a, i, delta):
    """CPU twin of :func:`_add_at_cuda`."""
    a[i] = int32(a[i] + delta)


# --- CUDA kernels ------------------------------------------------------------------------
@cuda_kernel
def _page_run_rows_cuda(out, n, page, slot, num_kv_heads, page_size):
    """``out[h·n + j]`` = pool row of token slot ``slot + j`` of ``page``, head ``h``
    (``[num_pages, num_kv_heads, page_size]`` pool flattened to rows).

    Launch: 1-D grid over ``num_kv_heads·n`` (grid-stride), one row index per thread.
    """
    for e in range(cuda.grid(1), num_kv_heads * n, cuda.gridsize(1)):
        h = e // n
        out[e] = int32((page * num_kv_heads + h) * page_size + slot + (e - h * n))


@cuda_kernel
def _add_at_cuda(a, i, delta):
    """``a[i] += delta``.  Launch: any grid; thread 0 of the grid writes (one element)."""
    if cuda.grid(1) == 0:
        a[i] = int32(a[i] + delta)


_ROWS = register("page_run_rows", _page_run_rows_cpu, _page_run_rows_cuda,
                 ["void(int32[::1], int64, int64, int64, int64, int64)"])
_ADD_AT = register("add_at", _add_at_cpu, _add_at_cuda, ["void(int32[::1], int64, int64)"])


def _check_int32(name: str, a: Any, length: int) -> str:
    if np.dtype(a.dtype) != np.int32 or len(a.shape) != 1 or int(a.shape[0]) < length:
        raise ValueError(f"{name}: expected a 1-D int32 array of length >= {length}, got "
                         f"{np.dtype(a.dtype)} {tuple(a.shape)}")
    return _backend.device_of(name, a)


def page_run_rows_into(out: Any, page: int, slot: int, n: int, num_kv_heads: int, page_size: int) -> Any:
    """Pool rows of tokens ``slot .. slot+n-1`` of ``page``, every KV head, head-major.

    Row ``(page·num_kv_heads + h)·page_size + slot + j`` goes to ``out[h·n + j]``: the rows
    of a ``[num_pages, num_kv_heads, page_size, width]`` pool seen as ``[-1, width]``, in the
    order of a ``[num_kv_heads, n, width]`` source (see :func:`numba_kv.ops.gather.scatter_rows`).

    Parameters
    ----------
    out : int32 array, shape ``(>= num_kv_heads·n,)``
        C-contiguous, NumPy or CUDA; written on its own device (no host copy).
    page, slot, n : int
        Page id, first slot, tokens (``slot + n <= page_size``).
    num_kv_heads, page_size : int
        The pool's geometry.

    Returns
    -------
    rows : the view ``out[:num_kv_heads·n]``.
    """
    page, slot, n, hkv, ps = (int(x) for x in (page, slot, n, num_kv_heads, page_size))
    if min(page, slot) < 0 or n < 1 or hkv < 1 or slot + n > ps:
        raise ValueError(f"slot: expected 0 <= page, 0 <= slot, n >= 1 and slot + n <= page_size={ps}, got "
                         f"page={page}, slot={slot}, n={n}")
    if (page + 1) * hkv * ps > 2 ** 31 - 1:
        raise ValueError(f"page: pool rows beyond int32 ({(page + 1) * hkv * ps})")
    dev = _check_int32("out", out, hkv * n)
    _ROWS.launch(dev, hkv * n, out, n, page, slot, hkv, ps)
    return out[:hkv * n]


def add_at(a: Any, i: int, delta: int) -> Any:
    """``a[i] += delta`` on the device of ``a`` (no host copy).

    Parameters
    ----------
    a : int32 array, shape ``(n,)``
        C-contiguous, NumPy or CUDA; written in place on its own device.
    i : int
        Index, ``0 <= i < n``.
    delta : int
        Added to ``a[i]`` (the result wraps as int32).

    Returns
    -------
    a : the array passed in.
    """
    i = int(i)
    if i < 0:
        raise ValueError(f"i: expected an index >= 0, got {i}")
    dev = _check_int32("a", a, i + 1)
    _ADD_AT.launch(dev, 1, a, i, int(delta))
    return a
