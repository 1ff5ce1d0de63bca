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


# --- Numba device arrays (simulator or GPU) ----------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7])
def test_device_rejects_an_index_too_wide(bits):
    """``idx < 2**bits`` is checked for Numba device arrays too: an index 7 at bits=2 used to
    spill into its neighbour (packed [7, 0, ...] unpacked as [3, 1, ...])."""
    from numba import cuda

    from numba_kv._backend import to_host

    rng = np.random.default_rng(bits)
    idx = rng.integers(0, 1 << bits, size=(3, 24), dtype=np.uint16).astype(np.uint8)
    idx[1, 5] = (1 << bits) - 1  # the largest valid index passes
    assert np.array_equal(to_host(pack_bits(cuda.to_device(idx), bits)), pack_bits(idx, bits))
    for r, c in ((0, 0), (1, 13), (2, 23)):  # first, middle (odd byte of a word), last index
        bad = idx.copy()
        bad[r, c] = 1 << bits
        with pytest.raises(ValueError, match=rf"idx: expected values < 2\*\*bits = {1 << bits}, got max {1 << bits}"):
            pack_bits(cuda.to_device(bad), bits)
    # a view at an odd byte offset (its words are read as they come on the simulator)
    flat = np.zeros(33, np.uint8)
    flat[32] = 1 << bits
    with pytest.raises(ValueError, match="idx: expected values"):
        pack_bits(cuda.to_device(flat)[25:33], bits)
    assert to_host(pack_bits(cuda.to_device(flat)[1:9], bits)).tolist() == [0] * bits


@pytest.mark.cuda
def test_device_index_check_at_every_word_alignment():
    """The device check reads the indices as the widest words the address allows (8, 4, 2
    bytes, each with its own mask) and declines (``None``: the caller reads them on the host)
    at an odd address.  The simulator's arrays have no device address, so the addresses here
    are stated by a wrapper."""
    from numba import cuda

    from numba_kv.ops.bitpack import _device_has_wide_index

    class At:
        def __init__(self, a, ptr):
            self._a, self.__cuda_array_interface__ = a, {"data": (ptr, False)}

        def __getattr__(self, name):
            return getattr(self._a, name)

    for bits in range(1, 8):
        for ptr in (64, 36, 18):
            for pos in range(16):
                idx = np.full(16, (1 << bits) - 1, np.uint8)
                assert _device_has_wide_index(At(cuda.to_device(idx), ptr), bits) is False
                idx[pos] = 1 << bits
                assert _device_has_wide_index(At(cuda.to_device(idx), ptr), bits) is True, (bits, ptr, pos)
        assert _device_has_wide_index(At(cuda.to_device(np.zeros(16, np.uint8)), 9), bits) is None
