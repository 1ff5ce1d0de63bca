"""Borrowed array views (:mod:`numba_kv.ops._borrow`): the same memory, shape and strides as
the owner, without a reference — the compiled call that receives one gets null meminfo
pointers, so it makes no atomic reference-count updates."""

import re

import numpy as np
import pytest
from numba import njit

from numba_kv.ops._borrow import borrowed, keep_alive


@njit
def _fill_through_view(a, value):
    """Write ``value`` through a borrowed view of ``a``'s rows; return the view's sum."""
    b = borrowed(a)
    total = 0.0
    for i in range(b.shape[0]):
        row = b[i]  # a view of a borrowed view
        for j in range(row.shape[0]):
            row[j] = value + i
            total += row[j]
    return total


@njit
def _scratch_sum(n):
    """An allocated owner, used only through its borrowed view, kept alive to the end."""
    own = np.empty(n, dtype=np.float64)
    b = borrowed(own)
    for i in range(n):
        b[i] = i
    s = 0.0
    for i in range(n):
        s += b[i]
    keep_alive(own)
    return s


@njit
def _shape_strides(a):
    b = borrowed(a)
    return b.shape, b.strides


@njit
def _row_sum(row, w):
    """A callee with a raising path, as the kernels' helpers have: Numba's pruning leaves the
    reference counts of views passed to it in place."""
    s = 0.0
    for j in range(row.shape[0]):
        if row[j] < 0:
            raise ValueError("negative")
        s += row[j] * w[j]
    return s


@njit
def _sum_rows_plain(a, w):
    s = 0.0
    for i in range(a.shape[0]):
        s += _row_sum(a[i], w)
    return s


@njit
def _sum_rows_borrowed(a, w):
    b, wb = borrowed(a), borrowed(w)
    s = 0.0
    for i in range(b.shape[0]):
        s += _row_sum(b[i], wb)
    return s


def test_borrowed_view_writes_through_to_the_owner():
    a = np.zeros((3, 5), np.float32)
    total = _fill_through_view(a, 2.0)
    want = np.repeat(np.arange(3, dtype=np.float32)[:, None] + 2, 5, axis=1)
    assert np.array_equal(a, want)
    assert total == pytest.approx(float(want.sum()))


def test_borrowed_view_keeps_shape_and_strides_of_a_strided_view():
    base = np.arange(60, dtype=np.float64).reshape(6, 10)
    v = base[::2, 1::3]
    shape, strides = _shape_strides(v)
    assert shape == v.shape and strides == v.strides


def test_scratch_kept_alive_while_borrowed():
    for n in (1, 17, 4096):
        assert _scratch_sum(n) == n * (n - 1) / 2


def _counted_increfs(fn) -> int:
    """Calls of ``NRT_incref`` on a (non-constant) meminfo in ``fn``'s LLVM IR."""
    llvm = next(iter(fn.inspect_llvm().values()))
    return len(re.findall(r"call void @NRT_incref\(ptr %", llvm))


def test_borrowed_views_make_no_reference_counting():
    """Row views of an array argument passed to a compiled call take a reference each (the
    plain version's IR increfs a meminfo); through a borrowed view the meminfo is the null
    constant and no incref of a real meminfo remains."""
    a = np.arange(12.0).reshape(3, 4)
    w = np.arange(4.0)
    assert _sum_rows_plain(a, w) == _sum_rows_borrowed(a, w) == float((a @ w).sum())
    assert _counted_increfs(_sum_rows_plain) > 0  # the test can see what borrowing removes
    assert _counted_increfs(_sum_rows_borrowed) == 0


def test_borrowed_rejects_non_arrays():
    from numba.core.errors import TypingError

    @njit
    def bad(x):
        return borrowed(x)

    with pytest.raises(TypingError):
        bad(1.0)
