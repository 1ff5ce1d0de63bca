"""Tests for numba_kv.ops.codebook (reference numbers: design/algorithms.md §2.4, §6.2, §6.5)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from numba_kv.ops.codebook import (
    MAXNORM_REF,
    Codebook,
    assign,
    fit_maxnorm_lloyd,
    get_codebook,
    lloyd_max_sphere,
    maxnorm_table,
    sphere_coordinate_pdf,
    sphere_distortion,
)

# §2.4.1: positive halves of the turboquant-rs tables (symmetric codebooks).
L2_TABLES = {
    (2, 32): [0.07980195923950, 0.26331946904865],
    (3, 32): [0.04285157006670, 0.13175624361005, 0.23246076086352, 0.36626841971500],
    (4, 32): [0.02235501645566, 0.06749924527967, 0.11401417528619, 0.16307095286110,
              0.21636213129702, 0.27674237157641, 0.35009192924057, 0.45356484406404],
    (2, 128): [0.03999160906336, 0.13304154846077],
    (3, 128): [0.02160433847350, 0.06658568378325, 0.11813986946554, 0.18839728518004],
    (4, 128): [0.01132093590150, 0.03420549908335, 0.05785765497831, 0.08293881469007,
               0.11041538921899, 0.14193912272806, 0.18096588552769, 0.23777655506959],
}
# Positive interior boundaries (0 is the middle one).
L2_BOUNDARIES_32 = {
    2: [0.17156071414408],
    3: [0.08730390683837, 0.18210850223678, 0.29936459028926],
    4: [0.04492713086766, 0.09075671028293, 0.13854256407364, 0.18971654207906,
        0.24655225143672, 0.31341715040849, 0.40182838665230],
}
# §6.2: m · D for the Lloyd–Max solution.
SPHERE_DISTORTION = {
    32: [0.3534, 0.1116, 0.0323, 0.00877],
    128: [0.3609, 0.1160, 0.0340, 0.00931],
}

LIBRARY_TABLES = [("maxnorm", b) for b in range(1, 5)] + [("l2", b) for b in range(1, 9)]


def _full_symmetric(pos):
    pos = np.asarray(pos, dtype=np.float64)
    return np.concatenate((-pos[::-1], pos))


# ------------------------------------------------------------------------------------
# L2 mode
# ------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits,m", sorted(L2_TABLES))
def test_lloyd_max_sphere_matches_reference_tables(bits, m):
    cb = lloyd_max_sphere(bits, m)
    k = 2**bits
    c = cb.centroids.astype(np.float64)
    # 6 significant digits (float32 storage keeps ~7).
    np.testing.assert_allclose(c[k // 2:], L2_TABLES[(bits, m)], rtol=1e-6)
    np.testing.assert_allclose(c, _full_symmetric(L2_TABLES[(bits, m)]), rtol=1e-6)
    np.testing.assert_array_equal(c, -c[::-1])  # exactly symmetric
    assert cb.norm_mode == "l2" and cb.ref == 1.0 and cb.bits == bits


@pytest.mark.parametrize("bits", sorted(L2_BOUNDARIES_32))
def test_lloyd_max_sphere_reference_boundaries(bits):
    b = lloyd_max_sphere(bits, 32).boundaries.astype(np.float64)
    pos = np.asarray(L2_BOUNDARIES_32[bits])
    expected = np.concatenate((-pos[::-1], [0.0], pos))
    np.testing.assert_allclose(b, expected, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("m", sorted(SPHERE_DISTORTION))
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_sphere_distortion_matches_reference(bits, m):
    d = sphere_distortion(lloyd_max_sphere(bits, m), m)
    assert d == pytest.approx(SPHERE_DISTORTION[m][bits - 1], rel=5e-3)


def test_sphere_distortion_decreases_with_bits():
    d = [sphere_distortion(lloyd_max_sphere(b, 32), 32) for b in range(1, 9)]
    assert all(a > b for a, b in zip(d, d[1:]))
    # Near the high-resolution rate: each extra bit divides the error by about 4.
    assert all(3.5 < a / b < 4.1 for a, b in zip(d[3:], d[4:]))


# m · D of fully converged Lloyd–Max tables (thousands of iterations), m = 32.
CONVERGED_DISTORTION_32 = {5: 2.297675e-3, 6: 5.888057e-4, 7: 1.491128e-4, 8: 3.7527e-5}


@pytest.mark.parametrize("bits", sorted(CONVERGED_DISTORTION_32))
def test_high_bit_l2_tables_are_near_optimal(bits):
    # Above 4 bits the table starts from the companding init (see lloyd_max_sphere);
    # 200 steps from the uniform init would be 2-4x worse at 6-8 bits.
    d = sphere_distortion(lloyd_max_sphere(bits, 32), 32)
    assert CONVERGED_DISTORTION_32[bits] <= d * (1 + 1e-4)
    assert d <= CONVERGED_DISTORTION_32[bits] * 1.002


def test_one_bit_l2_is_conditional_mean_of_half():
    # 1-bit Lloyd–Max on a symmetric density: boundary 0, centroids ±E|x|.
    x = np.linspace(-1.0, 1.0, 400_001)
    f = sphere_coordinate_pdf(x, 32)
    e_abs = np.trapezoid(np.abs(x) * f, x)
    cb = lloyd_max_sphere(1, 32)
    np.testing.assert_allclose(cb.centroids, [-e_abs, e_abs], rtol=1e-6)
    np.testing.assert_array_equal(cb.boundaries, [0.0])


@pytest.mark.parametrize("m", [3, 4, 5, 32, 128, 1024])
def test_pdf_is_normalized_with_variance_1_over_m(m):
    x = np.linspace(-1.0, 1.0, 400_001)
    f = sphere_coordinate_pdf(x, m)
    assert f.dtype == np.float64 and f.shape == x.shape
    assert np.trapezoid(f, x) == pytest.approx(1.0, abs=1e-5)
    assert np.trapezoid(x * f, x) == pytest.approx(0.0, abs=1e-12)
    assert np.trapezoid(x * x * f, x) == pytest.approx(1.0 / m, rel=1e-4)


def test_pdf_zero_outside_support_and_shape_preserved():
    x = np.array([[-2.0, -1.0, 0.0], [0.5, 1.0, 3.0]])
    f = sphere_coordinate_pdf(x, 32)
    assert f.shape == (2, 3)
    assert f[0, 0] == f[0, 1] == f[1, 1] == f[1, 2] == 0.0
    assert f[0, 2] > f[1, 0] > 0.0


def test_lloyd_max_sphere_is_cached():
    assert lloyd_max_sphere(3, 32) is lloyd_max_sphere(3, 32)
    assert get_codebook(3, "l2") is lloyd_max_sphere(3, 32)
    assert get_codebook(2, "l2", block=128) is lloyd_max_sphere(2, 128)


# ------------------------------------------------------------------------------------
# MaxNorm mode
# ------------------------------------------------------------------------------------


def test_maxnorm_3bit_exact():
    cb = maxnorm_table(3)
    expected = [-2.1573, -1.3336, -0.7434, -0.2428, 0.2428, 0.7434, 1.3336, 2.1573]
    np.testing.assert_array_equal(cb.centroids, np.asarray(expected, dtype=np.float32))
    np.testing.assert_allclose(cb.boundaries, [-1.7455, -1.0385, -0.4931, 0, 0.4931, 1.0385, 1.7455],
                               atol=6e-5)


def test_maxnorm_4bit_exact():
    cb = maxnorm_table(4)
    i = np.arange(16)
    np.testing.assert_array_equal(cb.centroids, (-2.1573 + i * (4.3146 / 15)).astype(np.float32))
    np.testing.assert_allclose(cb.boundaries, -2.1573 + (np.arange(15) + 0.5) * (4.3146 / 15),
                               rtol=0, atol=3e-7)


@pytest.mark.parametrize("bits", [3, 4])
def test_maxnorm_outer_centroid_is_ref(bits):
    c = maxnorm_table(bits).centroids
    assert c[-1] == np.float32(MAXNORM_REF) and c[0] == -np.float32(MAXNORM_REF)


@pytest.mark.parametrize("mode,bits", LIBRARY_TABLES)
def test_library_tables_wellformed(mode, bits):
    cb = get_codebook(bits, mode)
    k = 2**bits
    assert cb.bits == bits and cb.norm_mode == mode and cb.size == k
    assert cb.centroids.dtype == np.float32 and cb.centroids.shape == (k,)
    assert cb.boundaries.dtype == np.float32 and cb.boundaries.shape == (k - 1,)
    assert not cb.centroids.flags.writeable and not cb.boundaries.flags.writeable
    assert np.all(np.diff(cb.centroids) > 0)
    np.testing.assert_array_equal(cb.centroids, -cb.centroids[::-1])
    # Boundaries are midpoints (up to the final float32 rounding).
    c = cb.centroids.astype(np.float64)
    mid = 0.5 * (c[:-1] + c[1:])
    np.testing.assert_allclose(cb.boundaries, mid, rtol=0, atol=np.spacing(np.float32(max(1.0, cb.ref))))
    assert cb.ref == (MAXNORM_REF if mode == "maxnorm" else 1.0)
    assert isinstance(cb.source, str) and cb.source and "\n" not in cb.source
    assert np.all(np.abs(cb.centroids) <= (np.float32(MAXNORM_REF) if mode == "maxnorm" else 1.0))


def test_codebook_is_immutable():
    cb = get_codebook(3, "maxnorm")
    with pytest.raises(ValueError):
        cb.centroids[0] = 0.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        cb.bits = 2  # type: ignore[misc]
    assert get_codebook(3, "maxnorm") is cb


@pytest.mark.parametrize("bits", [1, 2])
def test_fitted_maxnorm_constants_reproduced(bits):
    # The constants come from fit_maxnorm_lloyd(bits) with 8 M blocks; a 200 k-block
    # re-fit (same seed) has a sampling std of ~4e-4 on each centroid.
    refit = fit_maxnorm_lloyd(bits, n_blocks=200_000)
    assert refit.shape == (2**bits,) and refit.dtype == np.float64
    np.testing.assert_array_equal(refit, -refit[::-1])
    np.testing.assert_allclose(maxnorm_table(bits).centroids, refit, rtol=0, atol=2e-3)


def test_fit_maxnorm_is_deterministic():
    a = fit_maxnorm_lloyd(2, n_blocks=5_000, seed=7)
    b = fit_maxnorm_lloyd(2, n_blocks=5_000, seed=7)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, fit_maxnorm_lloyd(2, n_blocks=5_000, seed=8))


# ------------------------------------------------------------------------------------
# End-to-end normalized MSE (§6.5), NumPy only
# ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gaussian_vectors():
    """20 000 i.i.d. N(0, 1) vectors of dimension 128 and their 32-blocks.

    The block rotation is orthogonal and maps an i.i.d. Gaussian block to an i.i.d.
    Gaussian block, so quantizing unrotated Gaussian blocks gives the same NMSE.
    """
    x = np.random.default_rng(2024).standard_normal((20_000, 128))
    return x, x.reshape(-1, 32)


def _nmse(x, blocks_hat):
    err = ((x - blocks_hat.reshape(x.shape)) ** 2).sum(axis=1)
    return float(np.mean(err / (x * x).sum(axis=1)))


def _maxnorm_nmse(data, cb):
    x, blocks = data
    scale = np.abs(blocks).max(axis=1, keepdims=True) / MAXNORM_REF
    idx = assign(blocks / scale, cb)
    return _nmse(x, cb.centroids[idx].astype(np.float64) * scale)


def _l2_nmse(data, cb):
    x, blocks = data
    scale = np.linalg.norm(blocks, axis=1, keepdims=True)
    idx = assign(blocks / scale, cb)
    return _nmse(x, cb.centroids[idx].astype(np.float64) * scale)


# The turboquant-rs 2-bit MaxNorm table: every other 3-bit centroid, boundaries not midpoints.
ANCHOR_DEFECTIVE_2BIT = Codebook(
    bits=2, norm_mode="maxnorm",
    centroids=np.array([-2.1573, -0.7434, 0.7434, 2.1573]),
    boundaries=np.array([-1.0385, 0.0, 1.0385]),
    ref=MAXNORM_REF, source="turboquant-rs 2-bit MaxNorm table (defective)",
)


def test_fitted_2bit_maxnorm_fixes_anchor_defect(gaussian_vectors):
    fitted = _maxnorm_nmse(gaussian_vectors, maxnorm_table(2))
    anchor = _maxnorm_nmse(gaussian_vectors, ANCHOR_DEFECTIVE_2BIT)
    l2 = _l2_nmse(gaussian_vectors, lloyd_max_sphere(2, 32))
    assert fitted <= 0.12
    assert anchor == pytest.approx(0.319, rel=0.05)
    assert l2 == pytest.approx(0.112, rel=0.05)
    assert fitted < anchor / 2.5


@pytest.mark.parametrize("mode,bits,expected", [
    ("maxnorm", 3, 0.0316), ("maxnorm", 4, 0.0082), ("l2", 3, 0.0322), ("l2", 4, 0.0088),
])
def test_block_nmse_matches_reference(gaussian_vectors, mode, bits, expected):
    cb = get_codebook(bits, mode)
    nmse = (_maxnorm_nmse if mode == "maxnorm" else _l2_nmse)(gaussian_vectors, cb)
    assert nmse == pytest.approx(expected, rel=0.05)


def test_l2_block_nmse_matches_sphere_distortion(gaussian_vectors):
    # A normalized Gaussian block is uniform on the sphere: the Monte Carlo NMSE of the
    # L2 quantizer must agree with the exact integral.
    for bits in (1, 2):
        cb = lloyd_max_sphere(bits, 32)
        assert _l2_nmse(gaussian_vectors, cb) == pytest.approx(sphere_distortion(cb, 32), rel=0.01)


def test_maxnorm_reproduces_block_maximum_exactly_for_3_and_4_bits(gaussian_vectors):
    # Outer-centroid trick: the largest |value| of each block is reconstructed exactly.
    _, blocks = gaussian_vectors
    blocks = blocks[:1000]
    amax = np.abs(blocks).max(axis=1, keepdims=True)
    scale = amax / MAXNORM_REF
    for bits in (3, 4):
        cb = maxnorm_table(bits)
        rec = cb.centroids[assign(blocks / scale, cb)].astype(np.float64) * scale
        j = np.abs(blocks).argmax(axis=1)
        rows = np.arange(len(blocks))
        np.testing.assert_allclose(rec[rows, j], blocks[rows, j], rtol=1e-6)


# ------------------------------------------------------------------------------------
# Argument validation
# ------------------------------------------------------------------------------------


@pytest.mark.parametrize("call,pattern", [
    (lambda: get_codebook(5, "maxnorm"), r"^bits: expected an integer in 1\.\.4 for norm_mode='maxnorm', got 5$"),
    (lambda: get_codebook(0, "maxnorm"), r"^bits: .*1\.\.4.*got 0"),
    (lambda: get_codebook(9, "l2"), r"^bits: .*1\.\.8 for norm_mode='l2'.*got 9"),
    (lambda: get_codebook(3, "L2"), r"^norm_mode: .*'maxnorm', 'l2'.*got 'L2'"),
    (lambda: get_codebook(3, None), r"^norm_mode: .*got None"),
    (lambda: get_codebook(3, "maxnorm", block=64), r"^block: .*32.*got 64"),
    (lambda: get_codebook(3, "l2", block=2), r"^block: .*>= 3.*got 2"),
    (lambda: lloyd_max_sphere(0, 32), r"^bits: .*got 0"),
    (lambda: lloyd_max_sphere(2, 2), r"^m: .*>= 3.*got 2"),
    (lambda: maxnorm_table(5), r"^bits: .*1\.\.4.*got 5"),
    (lambda: sphere_distortion(maxnorm_table(2), 32), r"^cb: .*L2"),
    (lambda: fit_maxnorm_lloyd(3, 1000), r"^bits: .*1\.\.2.*got 3"),
    (lambda: fit_maxnorm_lloyd(2, 0), r"^n_blocks: .*got 0"),
    (lambda: Codebook(2, "l2", np.zeros(4), np.zeros(3), 1.0, "x"), r"^centroids: "),
    (lambda: Codebook(2, "l2", np.arange(3.0), np.arange(2.0), 1.0, "x"), r"^centroids: .*shape"),
    (lambda: Codebook(2, "l2", np.arange(4.0), [0.5, 3.0, 2.5], 1.0, "x"), r"^boundaries: "),
])
def test_bad_arguments_raise_valueerror_naming_argument(call, pattern):
    with pytest.raises(ValueError, match=pattern):
        call()


@pytest.mark.parametrize("call,pattern", [
    (lambda: get_codebook(2.0, "l2"), r"^bits: .*got float 2\.0$"),
    (lambda: get_codebook(True, "l2"), r"^bits: .*got bool True$"),
    (lambda: get_codebook("3", "maxnorm"), r"^bits: .*got str '3'$"),
    (lambda: sphere_coordinate_pdf(np.zeros(3), 2.5), r"^m: .*got float 2\.5$"),
])
def test_arguments_of_the_wrong_type_raise_typeerror_naming_argument(call, pattern):
    """A value that is not an integer is a ``TypeError`` (the library's convention: it was a
    ``ValueError``, as an out-of-range integer is)."""
    with pytest.raises(TypeError, match=pattern):
        call()


# ------------------------------------------------------------------------------------
# assign()
# ------------------------------------------------------------------------------------


def test_assign_ties_go_to_lower_bin():
    cb = maxnorm_table(3)
    b = cb.boundaries
    np.testing.assert_array_equal(assign(b, cb), np.arange(len(b)))
    np.testing.assert_array_equal(assign(np.nextafter(b, np.float32(np.inf)), cb), np.arange(1, len(b) + 1))
    assert assign(np.float32(0.0), cb) == 3  # 0 is a boundary of the symmetric 8-level table
    np.testing.assert_array_equal(assign(np.array([-np.inf, np.inf]), cb), [0, 7])


def test_assign_dtype_and_shape():
    cb = lloyd_max_sphere(8, 32)
    y = np.linspace(-1.0, 1.0, 24, dtype=np.float32).reshape(2, 3, 4)
    idx = assign(y, cb)
    assert idx.dtype == np.uint8 and idx.shape == (2, 3, 4)
    assert idx.min() == 0 and idx.max() == 255


_tables = st.sampled_from(LIBRARY_TABLES + [("anchor", 2)])
_values = hnp.arrays(
    dtype=st.sampled_from([np.float32, np.float64]),
    shape=hnp.array_shapes(min_dims=1, max_dims=1, min_side=1, max_side=64),
    elements=st.floats(-4.0, 4.0, allow_nan=False, width=32),
)


def _table(spec):
    mode, bits = spec
    return ANCHOR_DEFECTIVE_2BIT if mode == "anchor" else get_codebook(bits, mode)


@settings(max_examples=200, deadline=None)
@given(spec=_tables, y=_values)
def test_assign_monotone_and_in_range(spec, y):
    cb = _table(spec)
    idx = assign(y, cb)
    assert idx.dtype == np.uint8 and idx.shape == y.shape
    assert np.all(idx < 2**cb.bits)
    order = np.argsort(y, kind="stable")
    assert np.all(np.diff(idx[order].astype(np.int64)) >= 0)
    # Definition (§2.4.3): number of boundaries strictly below the value.
    brute = (y.astype(np.float64)[:, None] > cb.boundaries.astype(np.float64)[None, :]).sum(axis=1)
    np.testing.assert_array_equal(idx, brute)


@settings(max_examples=100, deadline=None)
@given(spec=st.sampled_from(LIBRARY_TABLES), y=_values)
def test_assign_picks_nearest_centroid_for_midpoint_tables(spec, y):
    cb = _table(spec)
    c = cb.centroids.astype(np.float64)
    yv = y.astype(np.float64)
    chosen = np.abs(yv - c[assign(y, cb)])
    best = np.abs(yv[:, None] - c[None, :]).min(axis=1)
    # Equal up to the float32 rounding of the stored midpoints.
    np.testing.assert_array_less(chosen - best, 1e-6 * max(1.0, cb.ref) + 1e-12)
