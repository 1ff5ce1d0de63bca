"""Adversarial checks of the less-covered ops (intquant, gather, headquant, absmax8): what their
docstrings promise at the edges.

Expected values are independent of the code under test: plain NumPy formulas written from the
docstrings and hand-checked constants.
"""

from __future__ import annotations

import numpy as np
import pytest

from numba_kv import dequantize_head, get_codebook, quantize_head, reference
from numba_kv.ops.absmax8 import absmax8_dequantize_into, absmax8_quantize_into
from numba_kv.ops.gather import gather_rows, scatter_rows
from numba_kv.ops.intquant import IntQuantized, int_dequantize, int_quantize, mad_threshold


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_mad_threshold_refuses_nonfinite_input(bad):
    # int_quantize refuses NaN/Inf; mad_threshold returned a NaN threshold for the same x
    x = np.ones((1, 3, 2), np.float32)
    x[0, 1, 1] = bad
    with pytest.raises(ValueError, match="^x: expected finite"):
        mad_threshold(x)


def test_mad_threshold_matches_the_docstring_formula():
    # upper median of |x| and MAD (element n//2 of the sorted deviations), as the docstring says
    x = np.array([0.1, 0.2, 0.15, 10.0], np.float32).reshape(1, 4, 1)
    a = np.abs(x[0, :, 0])
    med = np.sort(a)[2]
    mad = np.sort(np.abs(a - med))[2]
    assert float(mad_threshold(x)[0, 0]) == pytest.approx(float(med + np.float32(6) * mad), rel=1e-7)


_F32_MAX = np.finfo(np.float32).max


def test_mad_threshold_median_of_values_above_half_the_float32_maximum():
    # the bisection's midpoint (lo + hi) / 2 overflowed to inf once lo + hi passed the maximum;
    # it stopped at once and took 0.70·max as the median of [0.70 … 0.74]·max
    a = (np.array([0.70, 0.71, 0.72, 0.73, 0.74]) * _F32_MAX).astype(np.float32)
    med = np.sort(a)[2]
    mad = np.sort(np.abs(a - med))[2]
    want = np.float32(med + np.float32(6) * mad)  # 0.78·max, finite
    assert float(mad_threshold(a.reshape(1, 5, 1))[0, 0]) == pytest.approx(float(want), rel=1e-6)


@pytest.mark.parametrize("fracs", [[0.9, 0.5, 0.1, -0.95, 0.2],  # median + 6·MAD = 2.3·max
                                   [0.9, 0.9, 0.9, 0.9, 0.2]])  # MAD 0: mean + 3·std path
def test_mad_threshold_stays_finite_near_the_float32_maximum(fracs):
    # both formulas overflowed to an inf threshold on finite input; no finite value lies above
    # the float32 maximum, so clamping to it keeps the same outliers (none)
    x = (np.array(fracs) * _F32_MAX).astype(np.float32).reshape(1, 5, 1)
    assert mad_threshold(x)[0, 0] == _F32_MAX
    q = int_quantize(x, 8)
    assert q.outlier_idx.shape[0] == 0
    y = int_dequantize(q)
    assert np.isfinite(y).all()
    np.testing.assert_allclose(y, x, rtol=0, atol=0.5 / 127 * 0.95 * _F32_MAX)  # half a level


def test_mad_threshold_median_of_a_channel_mixing_huge_and_subnormal_values():
    # the bisection halves its bracket from max|x| = 3e38 down to the 1e-30 gaps: more than
    # the 200 steps it had, so it stopped with three values in the bracket and took the
    # smallest (1e-30, threshold 7e-30) as the median
    a = np.array([3e38, 1e-30, 2e-30, 3e-30, 0.0], np.float32)
    med = np.sort(a)[2]
    mad = np.sort(np.abs(a - med))[2]
    want = np.float32(med + np.float32(6) * mad)  # 8e-30
    assert float(mad_threshold(a.reshape(1, 5, 1))[0, 0]) == pytest.approx(float(want), rel=1e-6)


def test_int_quantize_of_no_tokens_is_defined():
    # mad_threshold and the scales of a 0-token int_quantize were np.empty memory
    x = np.zeros((2, 0, 3), np.float32)
    np.testing.assert_array_equal(mad_threshold(x), np.zeros((2, 3), np.float32))
    q = int_quantize(x, 4)
    np.testing.assert_array_equal(q.scales, np.ones((2, 3, 1), np.float32))
    assert int_dequantize(q).shape == (2, 0, 3)


@pytest.mark.parametrize("bits", [4, 8])
def test_int_quantize_rounds_just_below_a_half_down(bits):
    # |y| + 0.5 was rounded in float32 before the floor: 0.5 − 2**-25 came back as 1 (an error
    # of more than half a step; round half away from zero gives 0)
    lim = 7 if bits == 4 else 127
    below = np.float32(0.5) - np.float32(2.0**-25)
    grid = np.arange(-lim, lim + 1, dtype=np.float32)  # spread evenly: no outliers, scale lim / lim
    vals = np.concatenate([grid, np.array([below, -below, 2.5, -2.5, 1.5], np.float32)])
    q = int_quantize(vals.reshape(1, -1, 1), bits)
    assert q.num_outliers == 0 and float(q.scales[0, 0, 0]) == 1.0  # the codes are the rounded values
    want = np.concatenate([grid, np.array([0, 0, 3, -3, 2], np.float32)])  # half away from zero
    np.testing.assert_array_equal(int_dequantize(q).ravel(), want)


@pytest.mark.parametrize("op", [gather_rows, scatter_rows])
@pytest.mark.parametrize("bad", [-1, 4, 1000])
def test_host_row_moves_refuse_out_of_range_indices(op, bad):
    # the CPU twin has no bounds checks: index 1000 read (or wrote) memory outside the array
    src = np.arange(32, dtype=np.float32).reshape(4, 8)
    out = np.zeros((2, 8), np.float32)
    a, b = (src, out) if op is gather_rows else (out, src)
    before = b.copy()
    with pytest.raises(ValueError, match=r"^idx: expected row indices in \[0, 4\)"):
        op(a, np.array([3, bad], np.int32), b)
    np.testing.assert_array_equal(b, before)


def test_row_moves_still_work_in_range():
    src = np.arange(32, dtype=np.float32).reshape(4, 8)
    idx = np.array([3, 0], np.int32)
    np.testing.assert_array_equal(gather_rows(src, idx, np.zeros((2, 8), np.float32)), src[[3, 0]])
    out = np.zeros((4, 8), np.float32)
    scatter_rows(src[:2].copy(), idx, out)
    np.testing.assert_array_equal(out[[3, 0]], src[:2])
    np.testing.assert_array_equal(out[[1, 2]], 0)


def test_int_dequantize_refuses_a_corrupt_outlier_index():
    q = int_quantize(np.array([0.1, 0.2, 0.15, 10.0], np.float32).reshape(1, 4, 1), 4)
    bad = IntQuantized(q.packed, q.scales, np.array([4], np.int32), q.outlier_vals, q.bits, q.group, q.shape)
    with pytest.raises(ValueError, match=r"^q\.outlier_idx: expected flat indices in \[0, 4\), got \[4, 4\]"):
        int_dequantize(bad)


def test_dequantize_head_is_signs_after_hadamard():
    # x̂ = |s| · D_s H_d c[idx] (the docstring said H_d D_s): all indices 0 give c0·1, whose
    # Hadamard transform is c0·√d·e_0, so only x̂_0 = c0·√d·s_0 is nonzero
    d, bits = 64, 1
    c0 = float(get_codebook(bits, "l2", block=d).centroids[0])
    codes = np.zeros((1, d * bits // 8), np.uint8)
    norms = np.array([[0x3C00]], np.uint16)  # binary16 1.0
    want = np.zeros(d)
    want[0] = c0 * np.sqrt(d) * reference.head_sign_vector(d)[0]
    np.testing.assert_allclose(dequantize_head(codes, norms, bits)[0], want, atol=1e-6)


def test_quantize_head_round_trip_matches_a_numpy_formula(rng):
    x = rng.standard_normal((3, 128)).astype(np.float32)
    codes, norms = quantize_head(x, 4)
    xh = dequantize_head(codes, norms, 4)
    nmse = np.sum((xh - x) ** 2, -1) / np.sum(x ** 2, -1)
    assert nmse.mean() < 0.012  # TurboQuant-MSE 4-bit: 0.009 (arXiv:2504.19874, Table 1)


def test_absmax8_tiny_vectors_keep_the_smallest_subnormal_scale_as_documented():
    # max |x| below 127·2**-25: the scale rounds to 0 and becomes the smallest subnormal
    # 2**-24 (it was 1, and the vector came back as zeros): 1e-7 is code 2, back within 2**-25
    x = np.full((1, 1, 32), 1e-7, np.float32)
    codes = np.ones((1, 1, 32), np.int8)
    scales = np.zeros((1, 1, 1), np.uint16)
    absmax8_quantize_into(x, codes, scales, 0)
    out = np.ones((1, 1, 32), np.float32)
    absmax8_dequantize_into(codes, scales, 0, 1, out)
    assert int(scales[0, 0, 0]) == 1 and (codes == 2).all()
    np.testing.assert_array_equal(out, np.float32(2 * 2.0 ** -24))
    assert np.abs(out - x).max() <= 2.0 ** -25
    zero = np.zeros((1, 1, 32), np.float32)  # an all-zero vector keeps scale 1, stored exactly
    absmax8_quantize_into(zero, codes, scales, 0)
    assert int(scales[0, 0, 0]) == 0x3C00 and not codes.any()


def test_vq_assign_refuses_values_whose_distances_overflow():
    # both squared distances were inf, `inf < inf` is false, and codeword 0 won: the nearer
    # codeword 1 (distance 4e38 against 3.6e39 in float64) was never chosen
    from numba_kv.ops.vq import assign

    x = np.array([[[3e19]]], np.float32)
    cb = np.array([[[-3e19], [1e19]]], np.float32)
    with pytest.raises(ValueError, match=r"^x, codebooks: expected \|values\| <= 9.22e\+18 for sub-vectors of 1"):
        assign(x, cb)
    codes, dist = assign(x / 8, cb / 8)  # inside the limit: the nearer codeword, finite distance
    assert int(codes[0, 0, 0]) == 1 and np.isfinite(dist).all()


@pytest.mark.parametrize("which", ["x", "codebooks"])
def test_vq_assign_refuses_nan(which):
    from numba_kv.ops.vq import assign

    x = np.zeros((1, 1, 2), np.float32)
    cb = np.array([[[1.0, 0.0], [0.0, 0.0]]], np.float32)
    (x if which == "x" else cb)[..., 0] = np.nan
    with pytest.raises(ValueError, match=rf"^{which}: expected finite values"):
        assign(x, cb)


@pytest.mark.parametrize(("kwargs", "match"), [({"codebook_size": 300}, r"^codebook_size: expected an int in 1\.\.256"),
                                               ({"codebook_size": 0}, r"^codebook_size: expected an int in 1\.\.256"),
                                               ({"ds": 3}, r"^ds: expected a sub-vector width dividing d=4")])
def test_kmeans_refuses_sizes_uint8_codes_cannot_hold(kwargs, match):
    # K = 300 returned a (1, 300, 1) codebook: indices >= 256 wrapped inside Lloyd (uint8)
    from numba_kv.ops.vq import kmeans

    x = np.random.default_rng(3).standard_normal((1, 400, 4)).astype(np.float32)
    args = {"codebook_size": 4, "ds": 4, **kwargs}
    with pytest.raises(ValueError, match=match):
        kmeans(x, args["codebook_size"], args["ds"], False)


def test_f16_encode_refuses_nan_and_saturates_inf():
    # a NaN came back as ±0.0 (the core's precondition is "not NaN")
    from numba_kv.ops.lowrank import f16_encode

    with pytest.raises(ValueError, match="^x: expected no NaN"):
        f16_encode(np.array([1.0, np.nan], np.float32))
    got = f16_encode(np.array([np.inf, -np.inf, 1e6, 0.5], np.float32)).view(np.float16)
    np.testing.assert_array_equal(got, np.array([65504, -65504, 65504, 0.5], np.float16))


def _q8():
    x = np.random.default_rng(5).standard_normal((2, 64, 4)).astype(np.float32)
    return int_quantize(x, 8)


@pytest.mark.parametrize(("edit", "match"), [
    (lambda q: {"packed": q.packed[:, :, :2].copy()}, r"^q\.packed: expected uint8 of shape \(2, 4, 64\)"),
    (lambda q: {"bits": 4}, r"^q\.packed: expected uint8 of shape \(2, 4, 32\)"),
    (lambda q: {"bits": 5}, r"^q\.bits: expected 4 or 8"),
    (lambda q: {"shape": (2, 64000, 4)}, r"^q\.packed: expected uint8 of shape \(2, 4, 64000\)"),
    (lambda q: {"group": 3}, r"^q\.group: expected an even int >= 2"),
    (lambda q: {"scales": q.scales[:, :1].copy()}, r"^q\.scales: expected float32 of shape \(2, 4, 1\)"),
    (lambda q: {"scales": np.full_like(q.scales, np.nan)}, r"^q\.scales: expected finite values"),
    (lambda q: {"outlier_idx": np.array([0, 512], np.int32), "outlier_vals": np.zeros(2, np.float32)},
     r"^q\.outlier_idx: expected flat indices in \[0, 512\)"),
    (lambda q: {"outlier_idx": np.zeros(1, np.int32), "outlier_vals": np.zeros(2, np.float32)},
     r"^q\.outlier_idx, q\.outlier_vals: expected int32 and float32 of one shape"),
])
def test_int_dequantize_refuses_a_container_int_quantize_cannot_make(edit, match):
    # only the type was checked: a short packed was read past its end, a longer shape came
    # back as uninitialized rows, bits=5 was decoded as INT4
    import dataclasses

    q = _q8()
    with pytest.raises(ValueError, match=match):
        int_dequantize(dataclasses.replace(q, **edit(q)))


_F = np.finfo(np.float32).max


@pytest.mark.parametrize("op", ["project", "reconstruct", "channel_stats"])
def test_lowrank_ops_refuse_nan_by_name(op):
    # project and reconstruct passed a NaN through; channel_stats reported it as a Gram matrix
    # "beyond the float32 range (max |x| = 1)"
    from numba_kv.ops import lowrank

    bad = np.ones((1, 2, 2), np.float32)
    bad[0, 1, 0] = np.nan
    mean, comp = np.zeros((1, 2), np.float32), np.eye(2, dtype=np.float32)[None]
    name = "coef" if op == "reconstruct" else "x"
    call = {"project": lambda: lowrank.project(bad, mean, comp),
            "reconstruct": lambda: lowrank.reconstruct(bad, mean, comp),
            "channel_stats": lambda: lowrank.channel_stats(bad)}[op]
    with pytest.raises(ValueError, match=f"^{name}: expected finite values"):
        call()


def test_lowrank_project_and_reconstruct_refuse_an_overflowing_result():
    # x − mean = max − (−max) is inf in float32: a finite input came back as inf
    from numba_kv.ops import lowrank

    one = np.ones((1, 1, 1), np.float32)
    with pytest.raises(ValueError, match="^x, mean, components: .*overflows to inf"):
        lowrank.project(np.full((1, 1, 1), _F, np.float32), np.full((1, 1), -_F, np.float32), one)
    with pytest.raises(ValueError, match="^coef, mean, components: .*overflows to inf"):
        lowrank.reconstruct(np.full((1, 1, 1), _F, np.float32), np.full((1, 1), _F, np.float32), one)
