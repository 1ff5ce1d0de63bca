"""Row gather / scatter through an int32 index: the data movement of paged storage and
of sparse outlier side tables, on every device.

* ``gather_rows``: ``out[i, :] = src[idx[i], :]``;
* ``scatter_rows``: ``out[idx[i], :] = src[i, :]`` (indices must be distinct);

both through the one twin ``move_rows`` (the direction is an argument).

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
from .._jit import cpu_kernel, cuda_kernel, twin
from ._index import unravel2
from ._registry import register

__all__ = ["gather_rows", "scatter_rows", "to_like"]


# --- single-source core: one row move, either direction ----------------------------------
def _move_span(src, idx, e, span, out, scatter):
    """Copy elements ``j0 .. j0 + span − 1`` of indexed row ``i`` (``(i, j0)`` the element
    ``e·span`` of ``[m, width]``): ``out[i] = src[idx[i]]`` (gather) or ``out[idx[i]] = src[i]``
    (``scatter``)."""
    i, j0 = unravel2(e * span, src.shape[1])
    k = idx[i]
    s = i if scatter else k
    d = k if scatter else i
    for j in range(j0, j0 + span):
        out[d, j] = src[s, j]


move_span_cpu, move_span_dev = twin(_move_span, inline=True)


# --- CPU twin: prange over the indexed rows; CUDA kernel: one thread per element ----------
@cpu_kernel
def _move_rows_cpu(src, idx, out, scatter):
    """CPU twin of :func:`_move_rows_cuda`: ``prange`` over the ``m`` indexed rows (distinct
    indices when scattering: no two iterations write one row)."""
    for i in prange(idx.shape[0]):
        move_span_cpu(src, idx, i, src.shape[1], out, scatter)


@cuda_kernel
def _move_rows_cuda(src, idx, out, scatter):
    """1-D grid over the ``m·width`` moved elements, grid-stride; one thread copies one."""
    for e in range(cuda.grid(1), idx.shape[0] * src.shape[1], cuda.gridsize(1)):
        move_span_dev(src, idx, e, 1, out, scatter)


_MOVE_ROWS = register("move_rows", _move_rows_cpu, _move_rows_cuda,
                      [f"void({t}[:, ::1], int32[::1], {t}[:, ::1], boolean)" for t in ("uint8", "uint16", "float32")])


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


def _move_rows(src: Any, idx: Any, out: Any, scatter: bool) -> Any:
    """Validate, then move the ``m·width`` elements of :func:`gather_rows` /
    :func:`scatter_rows`; returns ``out``."""
    dev = _backend.resolve_device("auto", src=src, idx=idx, out=out)
    if np.dtype(idx.dtype) != np.int32 or len(idx.shape) != 1:
        raise TypeError(f"idx: expected a 1-D int32 array, got {np.dtype(idx.dtype)} "
                        f"shape {tuple(idx.shape)}")
    if len(src.shape) != 2 or len(out.shape) != 2:
        raise ValueError(f"src/out: expected 2-D arrays, got {tuple(src.shape)} and {tuple(out.shape)}")
    if np.dtype(src.dtype) != np.dtype(out.dtype) or src.shape[1] != out.shape[1]:
        raise ValueError(f"out: expected dtype {np.dtype(src.dtype)} and width {src.shape[1]}, "
                         f"got {np.dtype(out.dtype)} shape {tuple(out.shape)}")
    what, indexed = ("src", src) if scatter else ("out", out)  # the array with one row per index
    if idx.shape[0] != indexed.shape[0]:
        raise ValueError(f"idx: expected {indexed.shape[0]} entries (one per {what} row), got {idx.shape[0]}")
    m, w = indexed.shape
    n = (out if scatter else src).shape[0]  # rows that idx points into
    # host indices are cheap to check, and an unchecked one reads or writes outside the
    # array (the twins run without bounds checks); device indices would cost a sync
    if isinstance(idx, np.ndarray) and idx.size and (int(idx.min()) < 0 or int(idx.max()) >= n):
        raise ValueError(f"idx: expected row indices in [0, {n}), got min {int(idx.min())} max {int(idx.max())}")
    if m and w:
        _MOVE_ROWS.launch(dev, m * w, src, idx, out, bool(scatter))
    return out


def gather_rows(src: Any, idx: Any, out: Any) -> Any:
    """``out[i] = src[idx[i]]`` on the device of the arrays.

    Parameters
    ----------
    src : array, shape ``(n, width)``
        uint8, uint16 or float32, C-contiguous.
    idx : int32 array, shape ``(m,)``
        Row indices into ``src`` (``0 <= idx < n``; checked for NumPy ``idx``, not for
        device arrays).
    out : array, shape ``(m, width)``
        Same dtype as ``src``; written in place and returned.

    Returns
    -------
    out : the array passed in.
    """
    return _move_rows(src, idx, out, False)


def scatter_rows(src: Any, idx: Any, out: Any) -> Any:
    """``out[idx[i]] = src[i]`` on the device of the arrays: the inverse of
    :func:`gather_rows`, with ``src`` ``(m, width)`` and ``out`` ``(n, width)`` (same dtype,
    written in place and returned) and ``idx`` the ``m`` *distinct* destination rows
    (``0 <= idx < n``; checked for NumPy ``idx``, not for device arrays).

    Raises
    ------
    ValueError
        A NumPy ``idx`` outside ``[0, n)``, ``src``/``out`` shapes or dtypes that do not match.
    """
    return _move_rows(src, idx, out, True)
