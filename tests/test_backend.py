"""``numba_kv._backend.same_view``: the same view object for the same device array, so that a
launch keyed by its arrays' identity repeats (prepared launches, ``StepGraph``); and what a
memo may keep alive.  And the public helpers of ``numba_kv.backend``: their argument check."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from numba_kv import _backend


class DevArray:
    """A device array as ``same_view`` sees it: shape, dtype, size; weakly referable."""

    def __init__(self, shape: tuple, dtype=np.float32) -> None:
        self.shape, self.dtype = shape, np.dtype(dtype)
        self.size = int(np.prod(shape))

    def reshape(self, *shape):
        return ("view of", id(self), shape)


def test_the_same_array_gets_the_same_view_object():
    memo: dict = {}
    a = DevArray((1, 2, 1, 64))
    made = []

    def make(x):
        made.append(x)
        return x.reshape(2, 64) + ("#", len(made))  # a new object every call

    first = _backend.same_view(memo, "q", a, make)
    assert _backend.same_view(memo, "q", a, make) is first and len(made) == 1
    a.shape = (2, 1, 64)  # changed in place (CuPy allows it): a new view
    assert _backend.same_view(memo, "q", a, make) is not first and len(made) == 2
    b = DevArray((2, 1, 64))  # another array under the same role: a new view
    assert _backend.same_view(memo, "q", b, make)[-1] == 3


def test_a_freed_array_is_never_matched_and_numpy_is_not_memoized():
    memo: dict = {}
    a = DevArray((4,))
    _backend.same_view(memo, ("k", id(a)), a, lambda x: ["view"])
    key = ("k", id(a))
    del a
    gc.collect()
    assert memo[key][0]() is None  # the memo holds its array weakly: freed arrays never match
    host = np.zeros(4, np.float32)
    assert _backend.same_view(memo, "h", host, lambda x: x.reshape(2, 2)) is not \
        _backend.same_view(memo, "h", host, lambda x: x.reshape(2, 2))
    assert "h" not in memo


def test_large_arrays_are_not_kept_unless_owned_and_the_memo_is_bounded():
    memo: dict = {}
    big = DevArray((_backend.VIEW_MEMO_MAX_BYTES // 4 + 1,))
    _backend.same_view(memo, "big", big, lambda x: ["view"])
    assert "big" not in memo  # a caller's large array (a prefill's): its view would pin it
    view = _backend.same_view(memo, "pool", big, lambda x: ["view"], owned=True)
    assert _backend.same_view(memo, "pool", big, lambda x: ["other"], owned=True) is view
    arrays = [DevArray((8,)) for _ in range(_backend.VIEW_MEMO_LIMIT + 10)]
    for i, a in enumerate(arrays):
        _backend.same_view(memo, i, a, lambda x: ["view"])
    assert len(memo) == _backend.VIEW_MEMO_LIMIT and "pool" not in memo and 0 not in memo


def test_numpy_without_row_stack_gets_the_alias_numba_cuda_needs(monkeypatch):
    """numpy 2.5 removed ``np.row_stack``, which numba-cuda 0.30 overloads when its CUDA target
    loads (every kernel compilation failed on numpy 2.5.2): the backend puts the alias back,
    as ``np.vstack``, and leaves a numpy that has it alone."""
    from numba_kv import _backend

    original = getattr(np, "row_stack", None)
    monkeypatch.delattr(np, "row_stack", raising=False)
    assert not hasattr(np, "row_stack")
    _backend._numpy_compat()
    assert np.row_stack is np.vstack
    if original is not None:
        monkeypatch.setattr(np, "row_stack", original)
        _backend._numpy_compat()
        assert np.row_stack is original


def test_the_public_helpers_name_what_is_not_an_array():
    """``numba_kv.backend.to_host`` / ``xp_of`` on a list: a ``TypeError`` naming the argument
    (``to_host`` raised an ``AttributeError`` from inside, ``xp_of`` answered ``None``, which
    means a Numba device array)."""
    from numba_kv import backend

    a = np.arange(3, dtype=np.float32)
    assert backend.to_host(a) is a and backend.xp_of(a) is np
    for bad in ([1, 2], 3.0, None):
        for fn in (backend.to_host, backend.xp_of):
            with pytest.raises(TypeError, match=r"^a: expected a numpy\.ndarray or a CUDA array"):
                fn(bad)
