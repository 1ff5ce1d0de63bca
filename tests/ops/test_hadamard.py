"""32-block rotation: golden values, inverse, orthogonality, reference parity."""

import numpy as np
import pytest

from numba_kv import reference
from numba_kv.ops.hadamard import SIGNS32, rotate32


def golden_block():
    j = np.arange(32)
    return (np.sin(2.1 * j + 0.6) + 0.1 * np.cos(3.1 * j)).astype(np.float32)


def test_sign_pattern():
    s = "+-++--+-++-+-+--+--++-+--+++--+-"
    assert "".join("+" if v > 0 else "-" for v in SIGNS32) == s
    assert np.array_equal(SIGNS32, reference.sign_vector())


def test_golden_forward_values():
    y = rotate32(golden_block()[None])[0]
    np.testing.assert_allclose(y[:8], [0.171001, -0.466761, -0.046684, 0.503291, -0.047433, 0.483339,
                                       0.499831, -0.142103], atol=2e-6)


def test_hadamard_reference_is_orthogonal_involution():
    H = reference.hadamard32()
    np.testing.assert_allclose(H @ H, np.eye(32), atol=1e-12)
    np.testing.assert_allclose(H, H.T)


@pytest.mark.parametrize("d", [32, 64, 96, 128, 256])
def test_matches_reference_and_inverts(d, rng):
    x = rng.standard_normal((7, d)).astype(np.float32)
    y = rotate32(x)
    np.testing.assert_allclose(y, reference.rotate_forward(x), atol=2e-6)
    np.testing.assert_allclose(rotate32(x, inverse=True), reference.rotate_inverse(x), atol=2e-6)
    np.testing.assert_allclose(rotate32(y, inverse=True), x, atol=2e-6)
    np.testing.assert_allclose(np.linalg.norm(y, axis=1), np.linalg.norm(x, axis=1), rtol=1e-6)


def test_bad_input():
    with pytest.raises(ValueError, match="x"):
        rotate32(np.zeros((2, 40), np.float32))
    with pytest.raises(TypeError, match="x"):
        rotate32([1.0] * 32)


@pytest.mark.parametrize("dtype", [np.int64, np.int8, np.bool_, np.complex64])
def test_rotate32_refuses_non_float_input(dtype):
    """As ``rotate_head`` and the quantizers do: an integer array is no vector to rotate."""
    with pytest.raises(TypeError, match="x: expected dtype float16, float32 or float64"):
        rotate32(np.ones((2, 32), dtype))
