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
