"""``numba_kv._validate``: the argument checks every entry point shares."""

from __future__ import annotations

import numpy as np
import pytest

from numba_kv._validate import check_float_at_least, check_out, check_real, check_span, is_c_contiguous


class _NumbaLike:
    """The contiguity interface of Numba's ``DeviceNDArray``: ``flags`` is a plain dict keyed
    ``"C_CONTIGUOUS"`` (not NumPy's flags object), next to ``is_c_contiguous()``."""

    def __init__(self, c: bool) -> None:
        self.flags = {"C_CONTIGUOUS": c, "F_CONTIGUOUS": not c}
        self._c = c

    def is_c_contiguous(self) -> bool:
        return self._c


class _MethodOnly:
    def __init__(self, c: bool) -> None:
        self._c = c

    def is_c_contiguous(self) -> bool:
        return self._c


@pytest.mark.parametrize("c", [True, False])
def test_is_c_contiguous_reads_every_array_kind(c):
    a = np.zeros((4, 6), np.float32)
    assert is_c_contiguous(a if c else a[:, ::2]) is c
    assert is_c_contiguous(_NumbaLike(c)) is c
    assert is_c_contiguous(_MethodOnly(c)) is c
    assert is_c_contiguous(object()) is False


def test_check_out_names_a_strided_out():
    a = np.zeros((2, 8), np.float32)
    check_out(a, (2, 8), np.float32, "cpu", "the result")
    with pytest.raises(ValueError, match=r"out: expected a C-contiguous array for the result"):
        check_out(np.zeros((2, 16), np.float32)[:, ::2], (2, 8), np.float32, "cpu", "the result")
    a.flags.writeable = False
    with pytest.raises(ValueError, match=r"out: expected a writable array"):
        check_out(a, (2, 8), np.float32, "cpu", "the result")


def test_real_and_span_checks():
    """``check_real``: numbers (NumPy's too) pass as floats, bools and strings are TypeErrors
    naming the argument; ``check_float_at_least`` refuses NaN; ``check_span``: an int ``t0``
    with ``t0 + n`` inside the buffer."""
    assert check_real("x", np.float32(2.5), "a float") == 2.5
    for bad in (True, "1", None):
        with pytest.raises(TypeError, match=r"^x: expected a float, got "):
            check_real("x", bad, "a float")
    assert check_float_at_least("tol", 0) == 0.0
    with pytest.raises(ValueError, match=r"^tol: expected a float >= 0, got nan"):
        check_float_at_least("tol", float("nan"))
    assert check_span(np.int64(2), 3, 5, "codes") == 2
    with pytest.raises(ValueError, match=r"^t0: tokens 3\.\.5 do not fit codes's 5 tokens"):
        check_span(3, 3, 5, "codes")
    with pytest.raises(ValueError, match=r"^t0: expected an int >= 0, got -1"):
        check_span(-1, 0, 5, "codes")
