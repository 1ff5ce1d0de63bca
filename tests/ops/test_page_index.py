"""Device-side page-table bookkeeping (``numba_kv.ops.page_index``) on the CPU twin: the pool
rows of a one-page run against the pool's own row numbering, ``add_at``, bad arguments."""

import numpy as np
import pytest

from numba_kv.ops.page_index import add_at, page_run_rows_into


@pytest.mark.parametrize("page, slot, n, hkv, ps", [(0, 0, 1, 1, 16), (5, 3, 4, 2, 8), (9, 15, 1, 4, 16),
                                                     (2, 0, 16, 3, 16)])
def test_page_run_rows_are_the_pools_rows(page, slot, n, hkv, ps):
    out = np.full(hkv * n + 2, -7, np.int32)
    rows = page_run_rows_into(out, page, slot, n, hkv, ps)
    # the rows of a [num_pages, hkv, page_size] pool holding tokens slot..slot+n-1 of page, head-major
    pool = np.arange((page + 1) * hkv * ps).reshape(page + 1, hkv, ps)
    assert np.array_equal(rows, pool[page, :, slot:slot + n].reshape(-1))
    assert np.array_equal(out[hkv * n:], [-7, -7])  # nothing past the run is written


def test_page_run_rows_rejects_bad_arguments():
    out = np.zeros(8, np.int32)
    with pytest.raises(ValueError, match="slot: expected"):
        page_run_rows_into(out, 0, 6, 3, 1, 8)  # beyond the page
    with pytest.raises(ValueError, match="slot: expected"):
        page_run_rows_into(out, -1, 0, 1, 1, 8)
    with pytest.raises(ValueError, match="out: expected a 1-D int32 array of length >= 9"):
        page_run_rows_into(out, 0, 0, 3, 3, 8)
    with pytest.raises(ValueError, match="out: expected a 1-D int32"):
        page_run_rows_into(np.zeros(8, np.int64), 0, 0, 1, 1, 8)
    with pytest.raises(ValueError, match="page: pool rows beyond int32"):
        page_run_rows_into(out, 2 ** 28, 0, 1, 4, 16)


def test_add_at():
    a = np.array([1, 2, 3], np.int32)
    assert add_at(a, 1, 5) is a and a.tolist() == [1, 7, 3]
    add_at(a, 2, -3)
    assert a.tolist() == [1, 7, 0]
    with pytest.raises(ValueError, match="a: expected a 1-D int32 array of length >= 4"):
        add_at(a, 3, 1)
    with pytest.raises(ValueError, match="i: expected an index >= 0"):
        add_at(a, -1, 1)
