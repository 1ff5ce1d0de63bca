"""Argument checks before any work: a complex array is refused by its dtype before any value
is read (``ops/finite.py``), and float64 beyond float32 is a ValueError without NumPy's
overflow warning on the way (``_backend.ascontiguous_f32``)."""

import warnings

import numpy as np
import pytest

from numba_kv import quantize_blocks, rotate32, rotate_head
from numba_kv.ops.finite import DeferredRange, check_finite_stats


@pytest.mark.parametrize("op", [rotate32, rotate_head])
@pytest.mark.parametrize("dtype", [np.complex64, np.complex128, object])
def test_rotations_refuse_non_real_dtypes_before_reading_values(op, dtype):
    x = (np.arange(64, dtype=np.float64).reshape(2, 32) + (1j if dtype is not object else 0)).astype(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a ComplexWarning would turn into an error here
        with pytest.raises(TypeError, match=r"^x: expected .*(complex|object)"):
            op(x)


def test_check_finite_stats_names_the_argument_and_keeps_real_dtypes():
    with pytest.raises(TypeError, match="q: expected a real"):
        check_finite_stats("q", np.zeros((2, 32), np.complex64))
    for dt in (np.float16, np.float32, np.float64, np.int32, np.bool_):
        st = check_finite_stats("q", np.ones((2, 32), dt))
        assert st.nonfinite == 0 and st.amax == 1.0
    with pytest.raises(ValueError, match="q: expected finite values"):
        check_finite_stats("q", np.array([[1.0, np.nan]], np.float32))


def test_float64_beyond_float32_is_a_value_error_without_a_warning():
    x = np.full((2, 32), 1e300)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # NumPy's "overflow encountered in cast" would fail here
        with pytest.raises(ValueError, match=r"x: max \|x\| = 1e\+300 exceeds 3.40282e\+38"):
            quantize_blocks(x, 3)


def test_deferred_state_token_changes_only_when_read():
    """What numba_kv.DecodeStep compares: the same object until a read replaces the accumulators."""
    rec = DeferredRange()
    token = rec.state_token()
    assert rec.state_token() is token
    rec.read()
    assert rec.state_token() is not token


@pytest.mark.parametrize(("a", "want"), [(np.array([-2**31, 5], np.int32), 2.0**31),
                                         (np.array([-2**63], np.int64), 2.0**63),
                                         (np.array([3, 200], np.uint8), 200.0)])
def test_range_stats_of_the_most_negative_integer(a, want):
    # abs(-2**31) overflows back to -2**31 in int32: amax came back 5.0 (and -9.2e18 for int64)
    from numba_kv.ops.finite import range_stats

    assert range_stats(a).amax == want
