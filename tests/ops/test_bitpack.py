"""Bit packing: llama.cpp tq3_0 test vectors, round trips for every width, reference parity."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from numba_kv import reference
from numba_kv.ops.bitpack import pack_bits, unpack_bits


@pytest.mark.parametrize("vals, hexstr", [
    ([0, 1, 2, 3, 4, 5, 6, 7], "88c6fa"),
    ([7] * 8, "ffffff"),
    ([1, 0, 0, 0, 0, 0, 0, 0], "010000"),
    ([0, 0, 5, 0, 0, 0, 0, 0], "400100"),
])
def test_3bit_matches_llama_cpp_tq3_0(vals, hexstr):
    assert pack_bits(np.array(vals, np.uint8), 3).tobytes().hex() == hexstr


def test_2bit_and_4bit_layouts():
    # 2-bit: element 4i+k in bits [2k, 2k+1]; 4-bit: low nibble first
    assert pack_bits(np.array([1, 2, 3, 0, 0, 0, 0, 3], np.uint8), 2).tobytes() == bytes([0b00111001, 0b11000000])
    assert pack_bits(np.array([1, 2, 3, 4, 5, 6, 7, 15], np.uint8), 4).tobytes() == bytes([0x21, 0x43, 0x65, 0xF7])
    x = np.arange(16, dtype=np.uint8) % 4
    for bits in (2, 3, 4):
        assert np.array_equal(unpack_bits(pack_bits(x, bits), bits), x)


def test_1bit_is_lsb_first_sign_layout():
    bits = np.zeros(16, np.uint8)
    bits[[0, 9]] = 1
    assert pack_bits(bits, 1).tobytes() == bytes([0x01, 0x02])


@settings(max_examples=60, deadline=None)
@given(bits=st.integers(1, 8), rows=st.integers(0, 5), groups=st.integers(1, 8), seed=st.integers(0, 2**31))
def test_round_trip_and_reference(bits, rows, groups, seed):
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, 1 << bits, size=(rows, groups * 8), dtype=np.uint16).astype(np.uint8)
    packed = pack_bits(idx, bits)
    assert packed.shape == (rows, groups * bits)
    assert np.array_equal(packed, reference.pack_bits(idx, bits))
    assert np.array_equal(unpack_bits(packed, bits), idx)


def test_leading_axes_kept():
    idx = np.random.default_rng(0).integers(0, 8, size=(2, 3, 4, 32)).astype(np.uint8)
    p = pack_bits(idx, 3)
    assert p.shape == (2, 3, 4, 12)
    assert np.array_equal(unpack_bits(p, 3), idx)


@pytest.mark.parametrize("kwargs, exc, word", [
    (dict(idx=np.zeros(8, np.uint8), bits=0), ValueError, "bits"),
    (dict(idx=np.zeros(8, np.uint8), bits=9), ValueError, "bits"),
    (dict(idx=np.zeros(7, np.uint8), bits=3), ValueError, "idx"),
    (dict(idx=np.full(8, 8, np.uint8), bits=3), ValueError, "idx"),
    (dict(idx=np.zeros(8, np.int32), bits=3), TypeError, "idx"),
    (dict(idx=[0] * 8, bits=3), TypeError, "idx"),
])
def test_bad_input(kwargs, exc, word):
    with pytest.raises(exc, match=word):
        pack_bits(**kwargs)


def test_unpack_bad_input():
    with pytest.raises(ValueError, match="packed"):
        unpack_bits(np.zeros(4, np.uint8), 3)
