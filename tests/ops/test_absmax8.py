"""The int8 absmax window codec equals its NumPy formula bit for bit."""

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from numba_kv.ops.absmax8 import absmax8_dequantize_into, absmax8_quantize_into


def numpy_absmax8(x):
    """The formula (module docstring): binary16 scale of max|x|/127, raised to the smallest
    subnormal 2**-24 if it rounds to 0 and one binary16 step if max|x| > 127.5·s (1 for an
    all-zero vector), codes rint(x / s) clipped to ±127."""
    amax = np.abs(x).max(axis=2, keepdims=True)
    s16 = (amax / np.float32(127.0)).astype(np.float16)
    s16[s16 == 0] = np.float16(2.0 ** -24)
    up = amax > np.float32(127.5) * s16.astype(np.float32)
    s16[up] = np.nextafter(s16[up], np.float16(np.inf))
    s16[amax == 0] = 1.0
    q = np.clip(np.rint(x / s16.astype(np.float32)), -127, 127).astype(np.int8)
    return q, s16.view(np.uint16)


def vectors(rng):
    x = rng.standard_normal((4, 9, 64)).astype(np.float32)
    x[0, 0] = 0.0  # all zero: scale 1
    x[0, 1] *= np.float32(1e-9)  # max/127 below binary16's subnormals: the smallest one, 2**-24
    x[0, 2] *= np.float32(3e-6)  # subnormal binary16 scale
    x[0, 3] *= np.float32(1e5)  # large scale
    x[1, 0] = (np.arange(64, dtype=np.float32) - 32) * np.float32(0.125)  # x/s = k/2: ties ...
    x[1, 0, 0] = 31.75  # ... with s = 31.75/127 = 0.25 exactly
    x[2, 0, 5] = -np.abs(x[2, 0]).max() * 2  # negative extreme: code -127
    return x


def test_quantize_matches_numpy_formula(rng):
    x = vectors(rng)
    codes = np.zeros((4, 12, 64), np.int8)
    scales = np.zeros((4, 12, 1), np.uint16)
    absmax8_quantize_into(x, codes, scales, 2)
    q, s = numpy_absmax8(x)
    np.testing.assert_array_equal(codes[:, 2:11], q)
    np.testing.assert_array_equal(scales[:, 2:11], s)
    assert not codes[:, [0, 1, 11]].any() and not scales[:, [0, 1, 11]].any()  # nothing else written
    assert scales[1, 2, 0] == np.float16(0.25).view(np.uint16)
    assert (codes[1, 2, 1:] == np.rint((np.arange(1, 64) - 32) / 2)).all()  # ties to even: 1.5 -> 2, 2.5 -> 2
    assert codes[1, 2, 35] == 2 and codes[1, 2, 37] == 2  # x/s = 1.5 and 2.5
    assert codes[2, 2, 5] == -127


def test_dequantize_is_codes_times_scale(rng):
    codes = rng.integers(-127, 128, (3, 10, 32)).astype(np.int8)
    scales = rng.uniform(1e-3, 10, (3, 10, 1)).astype(np.float16).view(np.uint16)
    out = np.full((3, 6, 32), np.float32(7.0))
    absmax8_dequantize_into(codes, scales, 4, 5, out, 1)
    np.testing.assert_array_equal(out[:, 1:6], codes[:, 4:9].astype(np.float32) * scales[:, 4:9].view(np.float16))
    assert (out[:, 0] == 7.0).all()


@pytest.mark.parametrize("seed", range(4))
def test_round_trip_error_is_half_a_step(seed):
    """|x − q·s| <= s/2 (+ the float32 rounding of x/s): the codec's accuracy bound."""
    x = np.random.default_rng(seed).standard_normal((2, 50, 128)).astype(np.float32) * 3
    codes = np.empty((2, 50, 128), np.int8)
    scales = np.empty((2, 50, 1), np.uint16)
    absmax8_quantize_into(x, codes, scales, 0)
    back = np.empty_like(x)
    absmax8_dequantize_into(codes, scales, 0, 50, back, 0)
    s = scales.view(np.float16).astype(np.float32)
    assert (np.abs(back - x) <= s * np.float32(0.5 + 1e-5)).all()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2 ** 32 - 1), d=st.sampled_from([32, 64, 96, 128, 256]),
       mags=st.lists(st.sampled_from([0.0, 1e-45, 1e-38, 1e-9, 3e-6, 1e-3, 1.0, 127.0, 6.5e4, 1e6]),
                     min_size=1, max_size=6),
       grid=st.booleans())
def test_quantize_matches_numpy_formula_fuzz(seed, d, mags, grid):
    """Any finite float32 vectors whose max|x|/127 fits binary16 (every magnitude from 0 and
    subnormals to millions), optionally on a coarse grid: the NumPy formula's bytes (the
    rounding ties themselves are pinned by test_quantize_matches_numpy_formula)."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((2, len(mags), d)) * np.array(mags)[None, :, None]).astype(np.float32)
    if grid:  # coarse power-of-two grids: repeated magnitudes, exact ties of |x| for the max
        s = np.float32(2.0) ** rng.integers(-10, 10)
        x = (np.round(x / (s / 2)) * (s / 2)).astype(np.float32)
    assume(np.abs(x).max() / 127 <= 65504)  # beyond: a saturated scale here, inf in NumPy (refused upstream)
    codes = np.zeros(x.shape, np.int8)
    scales = np.zeros(x.shape[:2] + (1,), np.uint16)
    absmax8_quantize_into(x, codes, scales, 0)
    q, sc = numpy_absmax8(x)
    np.testing.assert_array_equal(scales, sc)
    np.testing.assert_array_equal(codes, q)


@pytest.mark.parametrize("amax", [1e-9, 1e-7, 2.5e-6, 3.7e-6, 1e-5, 1.1e-5, 4e-4, 7.7e-3, 7.8e-3, 0.5])
def test_small_vectors_come_back_within_half_a_step(amax):
    """The module docstring's bound, by formula: every value within half a step ``s/2``, and
    ``s <= max|x|/127·(1 + 2**-10)`` for a normal scale, ``+ 2**-24`` for a subnormal one (a
    vector below 3.8e-6 came back as zeros, a subnormal scale clipped codes by up to a third)."""
    rng = np.random.default_rng(int(amax * 1e9) % 2 ** 32)
    x = rng.uniform(-1, 1, (1, 64, 128)).astype(np.float32)
    x *= np.float32(amax) / np.abs(x).max(axis=2, keepdims=True)
    codes = np.empty(x.shape, np.int8)
    scales = np.empty((1, 64, 1), np.uint16)
    absmax8_quantize_into(x, codes, scales, 0)
    back = np.empty_like(x)
    absmax8_dequantize_into(codes, scales, 0, 64, back, 0)
    s = scales.view(np.float16).astype(np.float64)
    subnormal = 2.0 ** -24 if amax < 127 * 2.0 ** -14 else 0.0
    assert (s <= np.abs(x).max(axis=2, keepdims=True) / 127 * (1 + 2 ** -10) + subnormal).all()
    err = np.abs(back.astype(np.float64) - x)
    assert (err <= s * (0.5 + 1e-6)).all()
    assert err.max() <= (amax / 254 * (1 + 2 ** -10) + subnormal / 2) * (1 + 1e-6)
