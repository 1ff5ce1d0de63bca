"""The 8-bit log-domain norm codec (``numba_kv.ops.norm8``) against its NumPy oracle
(:mod:`numba_kv.reference.norm8`, float64 ``log2``) and its error bound."""

import numpy as np
import pytest

from numba_kv.ops.attention.layout import F16_ABS_TABLE, NORM8_SLOT0
from numba_kv.ops.norm8 import (
    LOG16,
    norm8_base16,
    norm8_codes,
    norm8_decode_table,
    norm8_scale_rows_into,
    norm8_scale_table,
    norm8_store_into,
    norm8_top,
)
from numba_kv.reference import norm8 as ref

#: half a grid step in the log domain: the largest relative error of an in-range norm
HALF_STEP = 2.0 ** (1 / 32) - 1


def f16_norms(rng, shape, lo=-6.0, hi=6.0):
    """Binary16 norms (uint16 bits) log-uniform over ``[2**lo, 2**hi]``."""
    return (2.0 ** rng.uniform(lo, hi, shape)).astype(np.float16).view(np.uint16)


def f16_values(h):
    return np.asarray(h, np.uint16).view(np.float16).astype(np.float64)


@pytest.mark.parametrize("base16", [-160, -37, 0, 5])
def test_store_matches_oracle(rng, base16):
    h = f16_norms(rng, (3, 40, 1), lo=-16, hi=15.9)
    h[0, 0, 0] = 0  # a zero norm: code 0
    h[0, 1, 0] = 1  # the smallest subnormal: clamped up to code 1
    src_codes = rng.integers(0, 256, (3, 40, 24)).astype(np.uint8)
    codes = np.zeros((3, 50, 24), np.uint8)
    norms8 = np.full((3, 50, 1), 7, np.uint8)
    norm8_store_into(src_codes, h, base16, 5, codes, norms8)
    np.testing.assert_array_equal(norms8[:, 5:45], ref.norm8_encode(f16_values(h), base16))
    np.testing.assert_array_equal(codes[:, 5:45], src_codes)
    assert (norms8[:, :5] == 7).all() and (norms8[:, 45:] == 7).all()  # nothing else written
    assert not codes[:, :5].any() and not codes[:, 45:].any()
    assert norms8[0, 5, 0] == 0 and norms8[0, 6, 0] == 1


def test_store_of_a_source_span(rng):
    """``s0``, ``n``: tokens ``s0 : s0 + n`` of the scratch planes (a first store's compressed
    tokens), against the oracle; a span past the source raises and writes nothing."""
    h = f16_norms(rng, (2, 30, 1), lo=-8, hi=8)
    src_codes = rng.integers(0, 256, (2, 30, 16)).astype(np.uint8)
    codes, norms8 = np.zeros((2, 20, 16), np.uint8), np.zeros((2, 20, 1), np.uint8)
    norm8_store_into(src_codes, h, -20, 4, codes, norms8, s0=11, n=9)
    np.testing.assert_array_equal(codes[:, 4:13], src_codes[:, 11:20])
    np.testing.assert_array_equal(norms8[:, 4:13], ref.norm8_encode(f16_values(h[:, 11:20]), -20))
    assert not codes[:, :4].any() and not codes[:, 13:].any() and not norms8[:, 13:].any()
    for s0, n in ((25, 9), (-1, 3)):
        with pytest.raises(ValueError, match="s0, n: tokens"):
            norm8_store_into(src_codes, h, -20, 0, codes, norms8, s0=s0, n=n)
    assert not codes[:, 13:].any()


def test_log16_table_is_the_rounded_log():
    """Every finite nonzero binary16 magnitude: LOG16 = round(16·log2 h), and no value sits
    within 1e-6 of a rounding tie (so float64 decides every entry)."""
    h = np.arange(1, 0x7C00, dtype=np.uint16)
    exact = 16.0 * np.log2(f16_values(h))
    np.testing.assert_array_equal(LOG16[h], np.round(exact))
    assert np.abs(np.abs(exact - np.floor(exact)) - 0.5).min() > 1e-6


@pytest.mark.parametrize("base16", [-300, -64, 0, 17])
def test_decode_table_matches_oracle(base16):
    np.testing.assert_array_equal(norm8_decode_table(base16), ref.norm8_decode(np.arange(256), base16))
    full = norm8_scale_table(base16)
    assert full.shape == (NORM8_SLOT0 + 256,) and full.dtype == np.float32
    np.testing.assert_array_equal(full[:NORM8_SLOT0], F16_ABS_TABLE)
    np.testing.assert_array_equal(full[NORM8_SLOT0:], norm8_decode_table(base16))
    assert norm8_top(base16) == pytest.approx(float(ref.norm8_decode(np.array([255]), base16)[0]), rel=1e-7)


def test_in_range_error_is_half_a_step(rng):
    """|n̂/n − 1| <= 2**(1/32) − 1 for every norm inside the grid (relative to the binary16
    norm; plus float32's rounding of the decoded value)."""
    base16 = -100
    h = f16_norms(rng, (4, 500, 1), lo=(base16 + 1) / 16, hi=(base16 + 255) / 16)
    codes = np.zeros((4, 500, 1), np.uint8)
    norm8_store_into(np.zeros((4, 500, 1), np.uint8), h, base16, 0, np.zeros((4, 500, 1), np.uint8), codes)
    rel = norm8_decode_table(base16)[codes].astype(np.float64) / f16_values(h) - 1
    assert np.abs(rel).max() <= HALF_STEP + 2.0 ** -23
    assert np.abs(rel).max() > 0.9 * HALF_STEP  # the bound is reached, not loose


def test_codes_and_top():
    base16 = -20
    top = norm8_top(base16)
    just_in = np.array([top * 2 ** (0.4 / 16), top * 2 ** (0.6 / 16)]).astype(np.float16).view(np.uint16)
    np.testing.assert_array_equal(norm8_codes(just_in, base16), [255, 256])
    assert norm8_codes(np.array([0], np.uint16), base16)[0] < 0  # zero norms never exceed the top


def test_first_store_base_matches_oracle(rng):
    for trial in range(20):
        h = f16_norms(rng, (2, 37), lo=-10 + trial % 5, hi=-10 + trial)
        h[0, :3] = 0  # zeros are ignored
        assert norm8_base16(h) == ref.norm8_base16(f16_values(h)), trial
    assert norm8_base16(np.zeros(5, np.uint16)) == 0


def test_first_store_grid_keeps_four_octaves_above_its_largest(rng):
    h = f16_norms(rng, (500,), lo=-2, hi=2)
    h[0] = np.float16(3000.0).view(np.uint16)  # an outlier 10 octaves above the median
    base16 = norm8_base16(h)
    assert LOG16[h].max() - base16 == 191
    median_only = ref.norm8_base16(f16_values(h[1:]))
    assert median_only == int(np.round(16 * np.log2(np.median(f16_values(h[1:]))))) - 128


def test_scale_rows(rng):
    base16 = -50
    codes = rng.integers(0, 256, (3, 20, 1)).astype(np.uint8)
    out = rng.standard_normal((3, 8, 32)).astype(np.float32)
    expect = out * ref.norm8_decode(codes[:, 4:12], base16)
    norm8_scale_rows_into(codes, base16, 4, out)
    np.testing.assert_array_equal(out, expect)
