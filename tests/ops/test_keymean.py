"""The key mean and centering twins (key centering on arrays without array arithmetic)
against NumPy's own formulas, bit for bit."""

import numpy as np
import pytest

from numba_kv.ops.keymean import add_channel_into, channel_mean_into


@pytest.mark.parametrize("n", [1, 7, 300])
def test_channel_mean_is_numpys_float64_mean(n):
    rng = np.random.default_rng(n)
    x = (rng.standard_normal((3, n, 64)) * 10.0 ** rng.uniform(-3, 3, (3, n, 64))).astype(np.float32)
    out = np.full((3, 1, 64), np.nan, np.float32)
    channel_mean_into(x, out)
    np.testing.assert_array_equal(out, x.astype(np.float64).mean(axis=1, keepdims=True).astype(np.float32))


def test_add_channel_is_numpys_subtraction_and_addition():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 5, 32)).astype(np.float32)
    x[0, 0, :3] = [-0.0, 1e-45, 3e38]
    m = rng.standard_normal((2, 1, 32)).astype(np.float32)
    m[0, 0, :3] = [0.0, 1e-45, -3e37]
    out = np.empty_like(x)
    assert add_channel_into(x, m, -1, out) is out
    np.testing.assert_array_equal(out.view(np.uint32), (x - m).view(np.uint32))  # -0.0 - 0.0 stays -0.0
    np.testing.assert_array_equal(add_channel_into(x, m, 1, np.empty_like(x)), x + m)


def test_key_mean_ops_reject_bad_arguments():
    x = np.zeros((2, 3, 32), np.float32)
    with pytest.raises(ValueError, match=r"out: expected float32 \(2, 1, 32\)"):
        channel_mean_into(x, np.zeros((2, 3, 32), np.float32))
    with pytest.raises(ValueError, match=r"n >= 1"):
        channel_mean_into(np.zeros((2, 0, 32), np.float32), np.zeros((2, 1, 32), np.float32))
    with pytest.raises(ValueError, match="sign: expected 1 or -1, got 2"):
        add_channel_into(x, np.zeros((2, 1, 32), np.float32), 2, x)
    with pytest.raises(ValueError, match=r"m: expected float32 \(2, 1, 32\)"):
        add_channel_into(x, np.zeros((2, 1, 32), np.float64), 1, x)
    with pytest.raises(ValueError, match=r"out: expected float32 \(2, 3, 32\)"):
        add_channel_into(x, np.zeros((2, 1, 32), np.float32), 1, np.zeros((2, 3, 16), np.float32))
