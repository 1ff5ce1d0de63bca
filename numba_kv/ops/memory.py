"""Device-agnostic token copies between per-layer buffers.

NumPy and CuPy can copy a slice with ``dst[:, a:b] = src[:, c:d]``, but Numba device
arrays (and the simulator's) cannot assign strided slices, so storage growth, the
full-precision window and history assembly go through this small twin on every device.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import numpy as np
from numba import cuda, float32, int32, int64, prange, uint16

from .. import _backend
from .._jit import CORES, cpu_kernel, cpu_serial, cuda_device, cuda_kernel, specialize, twin
from ._index import unravel3_dev
from ._registry import register
from .finite import FOLD_SIG, fold_absbits_cpu, fold_absbits_dev, no_fold
from .half import f16_bits_to_f32, f32_to_f16_bits_sat


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


# -- the window store of a decode step in one launch -----------------------------------------
# One store of new tokens into a sinks-and-window buffer (caches/_window.py, ``StorePlan``) is
# five token copies per side: new sinks, the evicted window tokens and the new tokens that skip
# the window into the eviction buffer, the surviving window tokens slid to the window's front
# (an overlapping move), the new window tokens behind them; then the exact tokens' positions
# for the attention.  Op by op on a device that is up to eight launches and two temporaries
# per side plus one launch for the positions; here it is one launch for both sides and the
# positions, and the move needs no temporary: each thread owns one (side, row, channel) column
# and copies its tokens in ascending order, and a slide only moves tokens towards the front
# (destination < source), so no token is overwritten before it is read.  Copies only (float32
# windows), or the rounding of an array assignment to float16 (float16 windows, held as their
# uint16 bit patterns): bit for bit the op-by-op result.


def _as_is(v):
    """A float32 window stores a float32 token as it is."""
    return v


def _f32_to_f16_store(v):
    """binary16 bits of float32 ``v`` as NumPy's ``astype(float16)`` stores them: round to
    nearest even (``(65504, 65520)`` rounds down to 65504), ``±inf`` from ``|v| >= 65520``;
    NaN (an input the range checks report) as ``0x7E00`` with ``v``'s sign."""
    a = abs(float32(v))
    if a < float32(65520.0):
        return f32_to_f16_bits_sat(v)
    sign = int32(0x8000) if math.copysign(float32(1.0), float32(v)) < float32(0.0) else int32(0)
    return uint16(sign | (int32(0x7C00) if a == a else int32(0x7E00)))


twin(_as_is, inline=True)
twin(_f32_to_f16_store, inline=True)

#: tokens a window slide moves per batch (:func:`_shift_column`): loads in flight per thread
SHIFT_BATCH = 16


def _shift_column(ex, r, w, dst, src, n):
    """``ex[r, dst + i, w] = ex[r, src + i, w]`` for ``i = 0 … n − 1`` in place, ``src > dst``
    (a window's survivors sliding to its front), :data:`SHIFT_BATCH` tokens at a time, all of
    a batch read before any is written: a write lands below every token not read yet, and on
    a GPU the batch's loads are in flight together.  The last batch reads past ``n`` at the
    last source token (its loads stay in bounds and in flight together) and stores only what
    is below ``n``: ``ceil(n / 16)`` round trips.  One at a time, each load waited for the
    store before it (it may alias): about 40 µs of a step for a window of 128 on an H200;
    sixteen at a time with the rest one by one, a window of 32 (31 survivors) took 16 round
    trips, now 2."""
    last = src + n - 1
    t = 0
    while t < n:
        o = src + t
        m = n - t  # (stores below it: all 16 but in the last batch)
        y0 = ex[r, min(o, last), w]
        y1 = ex[r, min(o + 1, last), w]
        y2 = ex[r, min(o + 2, last), w]
        y3 = ex[r, min(o + 3, last), w]
        y4 = ex[r, min(o + 4, last), w]
        y5 = ex[r, min(o + 5, last), w]
        y6 = ex[r, min(o + 6, last), w]
        y7 = ex[r, min(o + 7, last), w]
        y8 = ex[r, min(o + 8, last), w]
        y9 = ex[r, min(o + 9, last), w]
        y10 = ex[r, min(o + 10, last), w]
        y11 = ex[r, min(o + 11, last), w]
        y12 = ex[r, min(o + 12, last), w]
        y13 = ex[r, min(o + 13, last), w]
        y14 = ex[r, min(o + 14, last), w]
        y15 = ex[r, min(o + 15, last), w]
        o = dst + t
        ex[r, o, w] = y0
        if 1 < m:
            ex[r, o + 1, w] = y1
        if 2 < m:
            ex[r, o + 2, w] = y2
        if 3 < m:
            ex[r, o + 3, w] = y3
        if 4 < m:
            ex[r, o + 4, w] = y4
        if 5 < m:
            ex[r, o + 5, w] = y5
        if 6 < m:
            ex[r, o + 6, w] = y6
        if 7 < m:
            ex[r, o + 7, w] = y7
        if 8 < m:
            ex[r, o + 8, w] = y8
        if 9 < m:
            ex[r, o + 9, w] = y9
        if 10 < m:
            ex[r, o + 10, w] = y10
        if 11 < m:
            ex[r, o + 11, w] = y11
        if 12 < m:
            ex[r, o + 12, w] = y12
        if 13 < m:
            ex[r, o + 13, w] = y13
        if 14 < m:
            ex[r, o + 14, w] = y14
        if 15 < m:
            ex[r, o + 15, w] = y15
        t += SHIFT_BATCH


shift_column_cpu, shift_column_dev = twin(_shift_column, inline=True)


# the window's conversions and the column core of a variant: bound by ``specialize`` (these
# placeholders are never compiled)
TO_EX = FROM_EX = SLIDE_COLUMNS = SHIFT_COLUMN = None


def _slide_columns(x, ex, ev, r, w, m, a, s_at, e_new, sinks, e_old, keep_old, keep_new):
    """One column ``(r, w)`` of one side's store, tokens in ascending order (the in-place slide
    needs that order), new tokens stored as ``x − m`` (``m``: the column's key mean, or 0,
    and ``v − 0 == v`` exactly).  ``TO_EX`` / ``FROM_EX``: the window's conversions (bound per
    variant)."""
    for t in range(a):
        ex[r, s_at + t, w] = TO_EX(x[r, t, w] - m)
    for t in range(e_old):
        ev[r, t, w] = FROM_EX(ex[r, sinks + t, w])
    for t in range(e_new):
        ev[r, e_old + t, w] = x[r, a + t, w] - m
    if e_old:
        SHIFT_COLUMN(ex, r, w, sinks, sinks + e_old, keep_old)
    for t in range(keep_new):
        ex[r, sinks + keep_old + t, w] = TO_EX(x[r, a + e_new + t, w] - m)


def _store_tail_cpu(pos, n_pos, pos_sinks, pos_base, u0, m0, o0, u1, m1, o1, u2, m2, o2, cnt, cr, cw):
    """The end of a window store's launch on the CPU: the exact tokens' positions (the window
    from ``pos_base``), the three folded range records and the count copy ``cnt[cw] = cnt[cr]``."""
    for i in range(n_pos):
        pos[i] = int32(i if i < pos_sinks else pos_base + (i - pos_sinks))
    fold_absbits_cpu(u0, m0, o0)
    fold_absbits_cpu(u1, m1, o1)
    fold_absbits_cpu(u2, m2, o2)
    if cw >= 0:
        cnt[cw] = cnt[cr] if cr >= 0 else int32(0)


def _store_tail_dev(pos, n_pos, pos_sinks, pos_base, u0, m0, o0, u1, m1, o1, u2, m2, o2, cnt, cr, cw, start, nt):
    """:func:`store_tail_cpu` on a device: thread ``start`` of ``nt`` (grid-stride) writes its
    positions and folds its share of the records (:func:`~numba_kv.ops.finite.fold_absbits_dev`);
    thread 0 copies the count (``cr != cw``: no thread reads what the launch writes)."""
    for i in range(start, n_pos, nt):
        pos[i] = int32(i if i < pos_sinks else pos_base + (i - pos_sinks))
    fold_absbits_dev(u0, m0, o0, start, nt)
    fold_absbits_dev(u1, m1, o1, start, nt)
    fold_absbits_dev(u2, m2, o2, start, nt)
    if cw >= 0 and start == 0:
        cnt[cw] = cnt[cr] if cr >= 0 else int32(0)


store_tail_cpu = cpu_serial(_store_tail_cpu, inline=True)
store_tail_dev = cuda_device(_store_tail_dev)


def _slide_cpu_body(xk, xv, kmean, center, exk, exv, evk, evv, a, s_at, e_new, sinks, e_old, keep_old, keep_new, pos,
                    n_pos, pos_sinks, pos_base, u0, m0, o0, u1, m1, o1, u2, m2, o2, cnt, cr, cw):
    """CPU twin of the ``slide_windows`` kernels: ``prange`` over (side, row), then the
    folded range records and the count copy serially."""
    rows = exk.shape[0]
    pos_base = pos_base + (int64(cnt[cr]) if cr >= 0 else int64(0))
    for j in prange(2 * rows):
        r = j % rows
        x, ex, ev = (xk, exk, evk) if j < rows else (xv, exv, evv)
        cen = center != 0 and j < rows
        for w in range(ex.shape[2]):
            m = kmean[r, 0, w] if cen else float32(0.0)
            SLIDE_COLUMNS(x, ex, ev, r, w, m, a, s_at, e_new, sinks, e_old, keep_old, keep_new)
    store_tail_cpu(pos, n_pos, pos_sinks, pos_base, u0, m0, o0, u1, m1, o1, u2, m2, o2, cnt, cr, cw)


def _slide_cuda_body(xk, xv, kmean, center, exk, exv, evk, evv, a, s_at, e_new, sinks, e_old, keep_old, keep_new, pos,
                     n_pos, pos_sinks, pos_base, u0, m0, o0, u1, m1, o1, u2, m2, o2, cnt, cr, cw):
    """1-D grid over the ``2·rows·width`` columns (k, then v) and the ``n_pos`` positions
    (grid-stride): one thread stores one column's tokens and writes the position of its index;
    the first ``ceil(size / 256)`` threads fold each recorded array's range
    (:func:`~numba_kv.ops.finite.fold_absbits_dev`); thread 0 copies ``cnt[cr]`` into
    ``cnt[cw]`` (``cw >= 0``; ``cr != cw``, so no thread reads what the launch writes).  The
    window's first position is ``pos_base + cnt[cr]`` (``cr >= 0``; every thread reads it)."""
    width = exk.shape[2]
    pos_base = pos_base + (int64(cnt[cr]) if cr >= 0 else int64(0))
    rows = exk.shape[0]
    start = cuda.grid(1)
    nt = cuda.gridsize(1)
    for i in range(start, 2 * rows * width, nt):
        j = i // width
        r = j % rows
        x, ex, ev = (xk, exk, evk) if j < rows else (xv, exv, evv)
        w = i - j * width
        m = kmean[r, 0, w] if center != 0 and j < rows else float32(0.0)
        SLIDE_COLUMNS(x, ex, ev, r, w, m, a, s_at, e_new, sinks, e_old, keep_old, keep_new)
    store_tail_dev(pos, n_pos, pos_sinks, pos_base, u0, m0, o0, u1, m1, o1, u2, m2, o2, cnt, cr, cw, start, nt)


def _slide_variant(op: str, to_ex: Callable, from_ex: Callable, ex_type: str) -> Any:
    """Register twin ``op``: the store with the window's conversions ``to_ex`` / ``from_ex``
    (plain functions of :func:`~numba_kv._jit.twin` cores) for windows of Numba type ``ex_type``."""
    def core(i: int, deco: Callable) -> Callable:
        return deco(specialize(_slide_columns, f"_{op}{('_cpu', '_dev')[i]}", TO_EX=CORES[to_ex][i],
                               FROM_EX=CORES[from_ex][i], SHIFT_COLUMN=(shift_column_cpu, shift_column_dev)[i]))

    cores = {"_cpu": core(0, functools.partial(cpu_serial, inline=True)), "_dev": core(1, cuda_device)}
    cpu = cpu_kernel(specialize(_slide_cpu_body, "", name=f"_{op}_cpu", SLIDE_COLUMNS=cores["_cpu"]))
    gpu = cuda_kernel(specialize(_slide_cuda_body, "", name=f"_{op}_cuda", SLIDE_COLUMNS=cores["_dev"]))
    f3, e3 = "float32[:, :, ::1]", f"{ex_type}[:, :, ::1]"
    return register(op, cpu, gpu, [f"void({f3}, {f3}, {f3}, int64, {e3}, {e3}, {f3}, {f3}, int64, int64, int64, int64, "
                                   "int64, "
                                   f"int64, int64, int32[::1], int64, int64, int64, {FOLD_SIG}, int32[::1], int64, "
                                   "int64)"])


#: the count array of a store without a count copy (``cw = -1``: never touched)
_NO_COUNT = np.zeros(1, np.int32)
#: the key mean of a store without key centering (``center = 0``: never read)
_NO_MEAN = np.zeros((1, 1, 1), np.float32)


_SLIDE = {np.dtype(np.float32): _slide_variant("slide_windows", _as_is, _as_is, "float32"),
          np.dtype(np.uint16): _slide_variant("slide_windows_f16", _f32_to_f16_store, f16_bits_to_f32, "uint16")}


def slide_windows(xk: Any, xv: Any, exk: Any, exv: Any, evk: Any, evv: Any, a: int, s_at: int, e_new: int,
                  sinks: int, e_old: int, keep_old: int, keep_new: int, pos: Any, pos_sinks: int, pos_base: int,
                  pos_win: int, ranges: tuple | None = None, count: tuple[Any, int, int] | None = None,
                  kmean: Any = None) -> None:
    """The store of new tokens into the exact-token buffers of both sides (keys centered on
    ``kmean`` first, when given), and the exact
    tokens' positions (one launch; with the deferred range records of the call's inputs
    folded in when ``ranges`` is given).

    Per side ``(x, ex, ev)`` and row, in this order: ``ex[s_at : s_at+a] = x[0 : a]`` (new
    sinks); ``ev[0 : e_old] = ex[sinks : sinks+e_old]`` (evicted window tokens) and
    ``ev[e_old : e_old+e_new] = x[a : a+e_new]`` (new tokens that skip the window); when
    ``e_old``: ``ex[sinks : sinks+keep_old] = ex[sinks+e_old : sinks+e_old+keep_old]`` (the
    survivors slide to the front); ``ex[sinks+keep_old : +keep_new] = x[a+e_new : +keep_new]``.
    Then ``pos[:n]`` = ``[0, …, pos_sinks-1, b, …, b+pos_win-1]`` (``b = pos_base``, plus
    ``cnt[read]`` with ``count``)
    (``n = pos_sinks + pos_win``, as :func:`~numba_kv.ops.positions.exact_positions_into`).

    Parameters
    ----------
    xk, xv : arrays ``[rows, n, width]`` float32, C-contiguous
        The new tokens, ``n >= a + e_new + keep_new``.
    exk, exv : arrays ``[rows, capacity, width]``, C-contiguous
        Sinks ``[0, sinks)`` then the window: float32, or float16 as its ``uint16`` bit
        patterns (stored as ``astype(float16)`` rounds; read back exactly).
    evk, evv : arrays ``[rows, >= e_old + e_new, width]`` float32, C-contiguous
        The eviction buffers (only their first ``e_old + e_new`` tokens are written).
    a, s_at, e_new, sinks, e_old, keep_old, keep_new : int
        As in :class:`~numba_kv.caches._window.StorePlan` (``s_at``: where the new sinks go,
        ``sinks``: the window's start).
    pos : int32 array ``[>= pos_sinks + pos_win]``
    pos_sinks, pos_base, pos_win : int
    ranges : tuple, optional
        ``(bits, mask, accumulator) × 3`` from
        :meth:`~numba_kv.ops.finite.DeferredRange.folded` (on the same device): the deferred
        range checks of a decode step's ``k``, ``v`` and ``q`` in this launch instead of a
        ``range_stats3`` launch of their own (issue 27).  Default: none.
    count : tuple ``(cnt, read, write)``, optional
        A layer's device step state (int32, on the same device): ``cnt[write] = cnt[read]``
        by one thread (``read != write``), so that the pair quantization that follows reads
        the compressed-token count before this step from ``cnt[write]`` while it writes the
        new count to ``cnt[read]`` (no value both read and written in one launch), and the
        window's first position is ``pos_base + cnt[read]`` (``pos_base`` then relative to the
        count: the same every steady step; issue 27).  Default: none.
    kmean : float32 array ``[rows, 1, width]``, optional
        The frozen per-channel key mean (key centering, in float32 as NumPy's ``xk − kmean``):
        the keys are stored and evicted as ``xk − kmean``, so that a step on a device does no
        array arithmetic of its own between launches (issue 27).  Default: none.

    Each thread loops over its column's tokens: for a decode step (a few tokens), not for a
    prefill of thousands.
    """
    dev = _backend.resolve_device("auto", xk=xk, xv=xv, exk=exk, exv=exv, evk=evk, evv=evv, pos=pos)
    rows, cap, width = (int(s) for s in exk.shape)
    n, n_ev = int(xk.shape[1]), int(evk.shape[1])
    ex_dt = np.dtype(exk.dtype)
    if ex_dt not in _SLIDE or np.dtype(exv.dtype) != ex_dt:
        raise ValueError(f"exk, exv: expected float32 or uint16 (float16 bits), got {exk.dtype} and {exv.dtype}")
    for name, arr, length in (("xk", xk, n), ("xv", xv, n), ("exv", exv, cap), ("evk", evk, n_ev), ("evv", evv, n_ev)):
        want = ex_dt if name == "exv" else np.dtype(np.float32)
        if np.dtype(arr.dtype) != want or tuple(int(s) for s in arr.shape) != (rows, length, width):
            raise ValueError(f"{name}: expected {want} ({rows}, {length}, {width}), got {arr.dtype} "
                             f"{tuple(arr.shape)}")
    counts = (a, s_at, e_new, sinks, e_old, keep_old, keep_new)
    check_store_plan("a, e_new, e_old, keep_old, keep_new", counts, n, n_ev, cap)
    mean, tail = store_launch_args(xk, rows, width, kmean, pos, (pos_sinks, pos_base, pos_win), ranges, count)
    work = 2 * rows * width * (a + e_new + keep_new + e_old + keep_old) + tail[1]
    _SLIDE[ex_dt].launch(dev, max(2 * rows * width, tail[1], 1), xk, xv, *mean, exk, exv, evk, evv,
                         *(int(c) for c in counts), *tail, work=work)


def check_store_plan(name: str, counts: tuple[int, ...], n: int, n_ev: int, cap: int) -> None:
    """``ValueError`` naming ``name`` unless the token ranges ``counts = (a, s_at, e_new, sinks,
    e_old, keep_old, keep_new)`` of a window store fit ``n`` new tokens, an eviction buffer of
    ``n_ev`` and windows of ``cap`` tokens (:func:`slide_windows`)."""
    a, s_at, e_new, sinks, e_old, keep_old, keep_new = counts
    if min(counts) < 0 or a + e_new + keep_new > n or e_old + e_new > n_ev \
            or (a and s_at + a > sinks) or sinks + max(e_old + keep_old, keep_old + keep_new) > cap:
        raise ValueError(f"{name}: token ranges out of bounds ({counts}, x {n}, ex {cap}, ev {n_ev})")


def store_launch_args(xk: Any, rows: int, width: int, kmean: Any, pos: Any, pos_counts: tuple[int, int, int],
                      ranges: tuple | None, count: tuple | None) -> tuple[tuple, tuple]:
    """The checked arguments a window store's launch shares with :func:`slide_windows`:
    ``(kmean, center)`` (a placeholder and 0 without key centering) and ``(pos, n_pos,
    pos_sinks, pos_base, *ranges, cnt, read, write)`` (nothing folded and no count copy by
    default), on the device of ``xk``; ``ValueError`` naming the bad argument."""
    if kmean is not None and (np.dtype(kmean.dtype) != np.float32
                              or tuple(int(s) for s in kmean.shape) != (rows, 1, width)):
        raise ValueError(f"kmean: expected float32 ({rows}, 1, {width}), got {kmean.dtype} {tuple(kmean.shape)}")
    pos_sinks, pos_base, pos_win = (int(c) for c in pos_counts)
    n_pos = pos_sinks + pos_win
    if min(pos_sinks, pos_base, pos_win) < 0:
        raise ValueError(f"pos_counts: expected three counts >= 0, got {tuple(pos_counts)}")
    if np.dtype(pos.dtype) != np.int32 or int(pos.shape[0]) < n_pos:
        raise ValueError(f"pos: expected int32 of length >= {n_pos}, got {pos.dtype} {tuple(pos.shape)}")
    if ranges is None:
        ranges = no_fold(xk)
    elif len(ranges) != 9:
        raise ValueError(f"ranges: expected (bits, mask, accumulator) x 3, got {len(ranges)} items")
    if count is None:
        count = (_backend.constant(xk, _NO_COUNT), -1, -1)
    elif int(count[1]) == int(count[2]) or min(int(count[1]), int(count[2])) < 0:
        raise ValueError(f"count: expected two different slots, got {count[1]} and {count[2]}")
    mean = (kmean, 1) if kmean is not None else (_backend.constant(xk, _NO_MEAN), 0)
    return mean, (pos, n_pos, pos_sinks, pos_base, *ranges, count[0], int(count[1]), int(count[2]))
