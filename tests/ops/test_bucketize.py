"""The branch-free bucketize cores (``ops/codebook.py``) against NumPy ``searchsorted``.

The quantizers assign ``idx = #{i : y > t_i}`` by adding comparisons as integers (no
conditional store, so the loop vectorizes on AVX2 as well as AVX-512).  These tests pin
the counting rule on inputs where a wrong form would show: values exactly on a boundary
(ties go to the lower bin), one ulp either side of it, signed zeros, ``±FLT_MAX`` and
``±inf``, all-zero rows, and lengths that leave vector-loop remainders.  The oracle is
``numpy.searchsorted(boundaries, y, side="left")`` (the number of boundaries strictly below
``y``), independent of the kernels.  No timing here: speed is the benchmarks' business.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from numba import njit

from numba_kv import reference
from numba_kv.ops.bitpack import unpack_bits
from numba_kv.ops.blockquant import quantize_blocks
from numba_kv.ops.codebook import bucketize_cpu, bucketize_select_cpu, get_codebook
from numba_kv.ops.headquant import head_codebook, quantize_head

_F32_MAX = np.finfo(np.float32).max
CODEBOOKS = [(b, "maxnorm", 32) for b in (1, 2, 3, 4)] + [(b, "l2", 32) for b in (1, 2, 3, 4, 8)] + [
    (b, "l2", 128) for b in (1, 3, 4)]


@njit(cache=False)
def bucketize(y, bounds):
    ib = np.full(y.size, 77, np.uint8)  # garbage in: the core must overwrite it
    bucketize_cpu(y, y.size, bounds, ib)
    return ib


@njit(cache=False)
def bucketize_select(y, bounds, centroids):
    ib = np.full(y.size, 77, np.uint8)
    cv = np.full(y.size, np.float32(123.0))
    bucketize_select_cpu(y, y.size, bounds, centroids, ib, cv)
    return ib, cv


def _oracle(y: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    return np.searchsorted(bounds, y, side="left").astype(np.uint8)


def _adversarial(bounds: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    """Every boundary, one float32 ulp below and above it, centroids, zeros, extremes."""
    up = np.nextafter(bounds, np.float32(np.inf))
    down = np.nextafter(bounds, np.float32(-np.inf))
    special = np.array([0.0, -0.0, 1e-45, -1e-45, _F32_MAX, -_F32_MAX, np.inf, -np.inf], np.float32)
    return np.concatenate([bounds, up, down, centroids, special]).astype(np.float32)


def _codebook(bits, mode, block):
    return head_codebook(bits, block) if block != 32 else get_codebook(bits, mode)


@pytest.mark.parametrize("bits, mode, block", CODEBOOKS)
def test_ties_ulps_zeros_and_extremes(bits, mode, block):
    cb = _codebook(bits, mode, block)
    y = _adversarial(cb.boundaries, cb.centroids)
    rng = np.random.default_rng(bits)
    for n in (1, 7, 31, 33, y.size, 2053):  # vector remainders of every width
        yy = np.resize(rng.permutation(y), n)
        ib = bucketize(yy, cb.boundaries)
        assert np.array_equal(ib, _oracle(yy, cb.boundaries))
        ib2, cv = bucketize_select(yy, cb.boundaries, cb.centroids)
        assert np.array_equal(ib2, ib)
        assert np.array_equal(cv.view(np.uint32), cb.centroids[ib].view(np.uint32))
    # a tie goes to the lower bin: y == t_i is not counted
    assert np.array_equal(bucketize(cb.boundaries.copy(), cb.boundaries), np.arange(cb.boundaries.size))


@pytest.mark.parametrize("bits, mode, block", CODEBOOKS)
def test_all_zero_and_constant_rows(bits, mode, block):
    cb = _codebook(bits, mode, block)
    for v in (0.0, -0.0, float(cb.boundaries[0]), float(cb.boundaries[-1]), 1e30, -1e30):
        y = np.full(2048, v, np.float32)
        assert np.array_equal(bucketize(y, cb.boundaries), _oracle(y, cb.boundaries))


@settings(max_examples=60, deadline=None)
@given(data=st.data(), which=st.integers(0, len(CODEBOOKS) - 1))
def test_random_values_with_boundary_draws(data, which):
    bits, mode, block = CODEBOOKS[which]
    cb = _codebook(bits, mode, block)
    pool = _adversarial(cb.boundaries, cb.centroids)
    n = data.draw(st.integers(1, 300))
    floats = st.one_of(st.floats(-4.0, 4.0, width=32), st.sampled_from(pool.tolist()))
    y = data.draw(hnp.arrays(np.float32, n, elements=floats))
    ib, cv = bucketize_select(y, cb.boundaries, cb.centroids)
    assert np.array_equal(ib, _oracle(y, cb.boundaries))
    assert np.array_equal(bucketize(y, cb.boundaries), ib)
    assert np.array_equal(cv.view(np.uint32), cb.centroids[ib].view(np.uint32))


# --- through the vectorized quantizer kernels -------------------------------------------
def _structured_rows(d: int) -> np.ndarray:
    """Rows whose rotated, normalized values are exactly predictable: zero rows, one-hot
    spikes of either sign and size (up to the binary16 range; larger values are rejected),
    and their mixtures per block."""
    rows = [np.zeros(d, np.float32)]
    for j, v in [(0, 1.0), (5, -3.0), (d - 1, 30000.0), (d // 2, -1e-3), (17, -2e4)]:
        r = np.zeros(d, np.float32)
        r[j] = v
        rows.append(r)
    mix = np.zeros(d, np.float32)
    mix[::32] = np.float32(2.5)  # one spike per 32-block
    rows.append(mix)
    return np.stack(rows * 50)  # > one 64-lane tile, so the kernels' full-width loops run


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("mode", ["maxnorm", "l2"])
@pytest.mark.parametrize("unbiased", [False, True])
def test_block_quantizer_codes_match_reference_on_structured_rows(bits, mode, unbiased):
    # a one-hot block rotates to ±v/√32 in every coordinate (the same magnitude), so the
    # normalized values sit far from every boundary and the float32 oracle is exact here
    cb = get_codebook(bits, mode)
    x = _structured_rows(128)
    c, _ = quantize_blocks(x, bits, mode, unbiased=unbiased)
    rc, _ = reference.quantize(x, cb.centroids, cb.boundaries, bits, mode, cb.ref, True)
    assert np.array_equal(unpack_bits(c, bits), reference.unpack_bits(rc, bits))


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("mode", ["maxnorm", "l2"])
def test_block_quantizer_codes_on_the_tie_at_zero_match_the_reference(bits, mode):
    # a constant block (or a row of the Hadamard matrix) rotates to exact zeros in 31 of its
    # coordinates: on 0, a boundary of every symmetric codebook, ties go to the lower bin. The
    # oracle rotated with the normalized matrix (±1/√32, inexact) and flipped some of them
    # with its ±1e-15 rounding noise
    from numba_kv.reference import hadamard32

    cb = get_codebook(bits, mode)
    rows = [np.full(32, 300.0), np.ones(32), np.full(32, -2.5), np.round(hadamard32()[5] * np.sqrt(32.0)) * 7]
    x = np.tile(np.stack(rows).astype(np.float32), (1, 4))  # 4 blocks a row
    c, _ = quantize_blocks(x, bits, mode)
    rc, _ = reference.quantize(x, cb.centroids, cb.boundaries, bits, mode, cb.ref, True)
    codes, want = unpack_bits(c, bits), reference.unpack_bits(rc, bits)
    assert np.array_equal(codes, want)
    lower = int(np.count_nonzero(cb.boundaries < 0))  # #{t_i < 0}: the code of an exact 0
    assert np.count_nonzero(want == lower) >= 4 * 4 * 31  # (every coordinate but the one nonzero of a block)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("unbiased", [False, True])
def test_head_quantizer_codes_match_searchsorted_on_structured_rows(bits, unbiased):
    d = 128
    cb = head_codebook(bits, d)
    x = _structured_rows(d)
    codes, _ = quantize_head(x, bits, unbiased=unbiased)
    # oracle: y = H_d D_s x / ‖x‖ in float64 (a one-hot row maps to ±1/√d in every
    # coordinate, far from every boundary), bucketized by searchsorted
    h = np.array([[(-1.0) ** (i & j).bit_count() for j in range(d)] for i in range(d)]) / np.sqrt(d)
    xs = x.astype(np.float64) * reference.head_sign_vector(d)
    nrm = np.maximum(np.linalg.norm(x.astype(np.float64), axis=1, keepdims=True), 1e-10)
    y = (xs / nrm) @ h.T
    want = np.searchsorted(cb.boundaries.astype(np.float64), y, side="left").astype(np.uint8)
    assert np.array_equal(unpack_bits(codes, bits), want)
