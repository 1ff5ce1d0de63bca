"""Row gather / scatter through an int32 index: the data movement of paged storage and
of sparse outlier side tables, on every device.

* ``gather_rows``: ``out[i, :] = src[idx[i], :]``;
* ``scatter_rows``: ``out[idx[i], :] = src[i, :]`` (indices must be distinct).

NumPy and CuPy could do both with fancy indexing, but Numba device arrays (and the
simulator's) cannot, so paged caches and the compressor move rows through these twins on
every device.  A paged write is a scatter into the page pool viewed as
``[num_pages·num_kv_heads·page_size, width]`` rows; a read is the matching gather.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import cuda, prange

from .. import _backend
from .._jit import cpu_kernel, cuda_kernel
from ._registry import register

__all__ = ["gather_rows", "scatter_rows", "to_like"]


# --- CPU twins ---------------------------------------------------------------------------
@cpu_kernel
def _gather_rows_cpu(src, idx, out):
    """CPU twin of :func:`_gather_rows_cuda`: ``prange`` over the ``m`` output rows."""
    m, w = out.shape
    for i in prange(m):
        s = idx[i]
        for j in range(w):
            out[i, j] = src[s, j]


@cpu_kernel
def _scatter_rows_cpu(src, idx, out):
    """CPU twin of :func:`_scatter_rows_cuda`: ``prange`` over the ``m`` source rows."""
    m, w = src.shape
    for i in prange(m):  # distinct idx: no two iterations write one row
        d = idx[i]
        for j in range(w):
            out[d, j] = src[i, j]


# --- CUDA kernels: one thread per element, grid-stride ---------------------------------
@cuda_kernel
def _gather_rows_cuda(src, idx, out):
    """1-D grid over the ``m·width`` outputs; one thread copies one element."""
    m, w = out.shape
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    for e in range(start, m * w, stride):
        i = e // w
        j = e - i * w
        out[i, j] = src[idx[i], j]


@cuda_kernel
def _scatter_rows_cuda(src, idx, out):
    """1-D grid over the ``m·width`` source elements; one thread copies one element."""
    m, w = src.shape
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    for e in range(start, m * w, stride):
        i = e // w
        j = e - i * w
        out[idx[i], j] = src[i, j]


_SIGS = [f"void({t}[:, ::1], int32[::1], {t}[:, ::1])" for t in ("uint8", "uint16", "float32")]
_GATHER_ROWS = register("gather_rows", _gather_rows_cpu, _gather_rows_cuda, _SIGS)
_SCATTER_ROWS = register("scatter_rows", _scatter_rows_cpu, _scatter_rows_cuda, _SIGS)


# --- public API ------------------------------------------------------------------------
def to_like(like: Any, host: np.ndarray) -> Any:
    """Copy host array ``host`` to the device (and namespace) of ``like``: an explicit copy
    for small index tables and fitted parameters (NumPy ``like`` → ``host`` itself)."""
    host = np.ascontiguousarray(host)
    if isinstance(like, np.ndarray):
        return host
    xp = _backend.xp_of(like)
    if xp is not None:
        return xp.asarray(host)
    return cuda.to_device(host)


def _check(src: Any, idx: Any, out: Any, n_idx_rows: int, what: str) -> str:
    dev = _backend.resolve_device("auto", src=src, idx=idx, out=out)
    if np.dtype(idx.dtype) != np.int32 or len(idx.shape) != 1:
        raise TypeError(f"idx: expected a 1-D int32 array, got {np.dtype(idx.dtype)} "
                        f"shape {tuple(idx.shape)}")
    if len(src.shape) != 2 or len(out.shape) != 2:
        raise ValueError(f"src/out: expected 2-D arrays, got {tuple(src.shape)} and {tuple(out.shape)}")
    if np.dtype(src.dtype) != np.dtype(out.dtype) or src.shape[1] != out.shape[1]:
        raise ValueError(f"out: expected dtype {np.dtype(src.dtype)} and width {src.shape[1]}, "
                         f"got {np.dtype(out.dtype)} shape {tuple(out.shape)}")
    if idx.shape[0] != n_idx_rows:
        raise ValueError(f"idx: expected {n_idx_rows} entries (one per {what} row), got {idx.shape[0]}")
    return dev


def gather_rows(src: Any, idx: Any, out: Any) -> Any:
    """``out[i] = src[idx[i]]`` on the device of the arrays.

    Parameters
    ----------
    src : array, shape ``(n, width)``
        uint8, uint16 or float32, C-contiguous.
    idx : int32 array, shape ``(m,)``
        Row indices into ``src`` (``0 <= idx < n``; not checked on the device).
    out : array, shape ``(m, width)``
        Same dtype as ``src``; written in place and returned.

    Returns
    -------
    out : the array passed in.
    """
    dev = _check(src, idx, out, out.shape[0], "out")
    m, w = out.shape
    if m and w:
        _GATHER_ROWS.launch(dev, m * w, src, idx, out)
    return out


def scatter_rows(src: Any, idx: Any, out: Any) -> Any:
    """``out[idx[i]] = src[i]`` on the device of the arrays (indices distinct).

    Parameters
    ----------
    src : array, shape ``(m, width)``
        uint8, uint16 or float32, C-contiguous.
    idx : int32 array, shape ``(m,)``
        Distinct destination rows (``0 <= idx < n``; not checked on the device).
    out : array, shape ``(n, width)``
        Same dtype as ``src``; written in place and returned.

    Returns
    -------
    out : the array passed in.
    """
    dev = _check(src, idx, out, src.shape[0], "src")
    m, w = src.shape
    if m and w:
        _SCATTER_ROWS.launch(dev, m * w, src, idx, out)
    return out
