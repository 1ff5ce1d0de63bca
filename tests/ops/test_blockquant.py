"""Block quantizer: golden vectors (bit-exact), reference NMSE tables, error bounds."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from numba_kv import reference
from numba_kv.ops.bitpack import unpack_bits
from numba_kv.ops.blockquant import dequantize_blocks, quantize_blocks
from numba_kv.ops.codebook import get_codebook

GOLD_IDX3 = [4, 2, 3, 5, 3, 5, 5, 3, 3, 5, 5, 3, 2, 4, 4, 0, 4, 5, 2, 4, 2, 4, 4, 7, 2, 4, 3, 7, 3, 7, 7, 2]
GOLD_IDX4 = [8, 5, 7, 10, 7, 10, 10, 7, 7, 10, 10, 7, 5, 8, 8, 1, 8, 9, 5, 8, 5, 8, 8, 15, 5, 8, 7, 14, 7, 15,
             15, 5]


def golden_block():
    j = np.arange(32)
    return (np.sin(2.1 * j + 0.6) + 0.1 * np.cos(3.1 * j)).astype(np.float32)[None]


def nmse(x, xh):
    """Normalized MSE as in algorithms.md §6.5: mean over vectors of ‖x − x̂‖² / ‖x‖²."""
    x = np.atleast_2d(np.asarray(x, np.float64))
    err = ((np.atleast_2d(xh).astype(np.float64) - x) ** 2).sum(1)
    return float((err / (x ** 2).sum(1)).mean())


# --- algorithms.md §2.10 golden vector, bit-exact ---------------------------------------
def test_golden_pqo3_maxnorm():
    codes, scales = quantize_blocks(golden_block(), 3, "maxnorm")
    assert codes.tobytes().hex() == "d4ba766b2712ac28f2e2be5f"
    assert unpack_bits(codes, 3)[0].tolist() == GOLD_IDX3
    assert int(scales[0, 0]) == 0xBA3A
    x = golden_block()
    assert nmse(x, dequantize_blocks(codes, scales, 3, "maxnorm")) ** 0.5 == pytest.approx(0.1357, abs=2e-4)


def test_golden_pqo3_l2():
    codes, scales = quantize_blocks(golden_block(), 3, "l2")
    assert codes.tobytes().hex() == "d4ba766b2712ac28f2e2be5f"
    assert int(scales[0, 0]) == 0xC3E8
    x = golden_block()
    assert nmse(x, dequantize_blocks(codes, scales, 3, "l2")) ** 0.5 == pytest.approx(0.1137, abs=2e-4)


def test_golden_pqo4_maxnorm():
    codes, scales = quantize_blocks(golden_block(), 4, "maxnorm")
    assert unpack_bits(codes, 4)[0].tolist() == GOLD_IDX4
    assert codes.tobytes().hex() == "58a7a77aa77a8518988585f885e7f75f"
    assert int(scales[0, 0]) == 0xBA3A  # same scale as PQO3: amax / 2.1573


def test_golden_pqo4_l2():
    """§2.10 lists no PQO4-L2 indices: the norm is the PQO3-L2 one and the codes equal the
    NumPy oracle bit for bit (every coordinate is >= 0.0058 from a boundary)."""
    cb = get_codebook(4, "l2")
    codes, scales = quantize_blocks(golden_block(), 4, "l2")
    rc, rs = reference.quantize(golden_block(), cb.centroids, cb.boundaries, 4, "l2", cb.ref, True)
    assert codes.tobytes() == rc.tobytes()
    assert int(scales[0, 0]) == 0xC3E8


def test_pq_flag_is_positive_scale():
    _, s_pqo = quantize_blocks(golden_block(), 2, "maxnorm", outlier=True)
    _, s_pq = quantize_blocks(golden_block(), 2, "maxnorm", outlier=False)
    assert s_pqo.view(np.float16)[0, 0] < 0 < s_pq.view(np.float16)[0, 0]
    assert s_pqo.view(np.float16)[0, 0] == -s_pq.view(np.float16)[0, 0]


# --- algorithms.md §6.5: NMSE on 20 000 vectors, d=128, ±5 % ---------------------------
def _gauss(outliers):
    x = np.random.default_rng(42).standard_normal((20_000, 128)).astype(np.float32)
    if outliers:
        x[:, [3, 17, 64, 100]] *= 20
    return x


@pytest.mark.parametrize("outliers, bits, mode, expected", [
    (False, 3, "maxnorm", 0.0316), (False, 4, "maxnorm", 0.0082),
    (False, 3, "l2", 0.0322), (False, 4, "l2", 0.0088), (False, 2, "l2", 0.112),
    (True, 3, "maxnorm", 0.0233), (True, 4, "maxnorm", 0.0039),
    (True, 3, "l2", 0.0282), (True, 4, "l2", 0.0075), (True, 2, "l2", 0.109),
])
def test_nmse_table(outliers, bits, mode, expected):
    x = _gauss(outliers)
    c, s = quantize_blocks(x, bits, mode)
    assert nmse(x, dequantize_blocks(c, s, bits, mode)) == pytest.approx(expected, rel=0.05)


@pytest.mark.parametrize("mode", ["maxnorm", "l2"])
def test_2bit_does_not_copy_the_maxnorm_defect(mode):
    """Our 2-bit tables reach NMSE <= 0.12 on Gaussian data (the anchor's MaxNorm 2-bit: 0.32)."""
    x = _gauss(False)
    c, s = quantize_blocks(x, 2, mode)
    assert nmse(x, dequantize_blocks(c, s, 2, mode)) <= 0.12


# --- algorithms.md §6.2: unit-vector MSE per 32-block at the Lloyd–Max values (L2 mode) -
@pytest.mark.parametrize("bits, expected", [(2, 0.1116), (3, 0.0323), (4, 0.00877)])
def test_unit_vector_mse_l2(bits, expected):
    x = np.random.default_rng(7).standard_normal((20_000, 32))
    x = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    c, s = quantize_blocks(x, bits, "l2")
    mse = float(((dequantize_blocks(c, s, bits, "l2") - x) ** 2).sum(1).mean())
    assert mse == pytest.approx(expected, rel=0.05)


# --- reference parity -------------------------------------------------------------------
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("mode", ["maxnorm", "l2"])
@pytest.mark.parametrize("outlier", [True, False])
def test_matches_numpy_reference(bits, mode, outlier):
    cb = get_codebook(bits, mode)
    x = np.random.default_rng(bits).standard_normal((500, 96)).astype(np.float32) * 3
    c, s = quantize_blocks(x, bits, mode, outlier)
    rc, rs = reference.quantize(x, cb.centroids, cb.boundaries, bits, mode, cb.ref, outlier)
    idx, ridx = unpack_bits(c, bits), reference.unpack_bits(rc, bits)
    # codes come from float arithmetic: allow a few near-tie flips by one level, never more
    diff = np.abs(idx.astype(int) - ridx.astype(int))
    assert diff.max() <= 1 and (diff > 0).mean() < 1e-3
    assert np.all(np.abs(s.view(np.float16).astype(np.float64) - rs.view(np.float16)) <=
                  2.0 ** -10 * np.abs(rs.view(np.float16).astype(np.float64)))
    np.testing.assert_allclose(dequantize_blocks(c, s, bits, mode),
                               reference.dequantize(c, s, cb.centroids, bits), rtol=1e-5, atol=1e-5)


def test_zero_block_reconstructs_to_zero():
    x = np.zeros((2, 64), np.float32)
    x[1, 32:] = 1.0
    for mode in ("maxnorm", "l2"):
        c, s = quantize_blocks(x, 3, mode)
        xh = dequantize_blocks(c, s, 3, mode)
        assert np.all(xh[0] == 0) and np.all(xh[1, :32] == 0)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_accepts_float_dtypes(dtype):
    x = np.random.default_rng(0).standard_normal((3, 64)).astype(dtype)
    c, s = quantize_blocks(x, 3)
    c32, s32 = quantize_blocks(x.astype(np.float32), 3)
    assert np.array_equal(c, c32) and np.array_equal(s, s32)


# --- hypothesis: per-block error bound ---------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(bits=st.integers(2, 4), mode=st.sampled_from(["maxnorm", "l2"]), nb=st.integers(1, 4),
       n=st.integers(1, 20), log_scale=st.floats(-3, 3), seed=st.integers(0, 2**31))
def test_error_bound_per_block(bits, mode, nb, n, log_scale, seed):
    """|r_j − r̂_j| <= scale·(half the widest bin + outer slack) + f16 rounding, per coordinate."""
    cb = get_codebook(bits, mode)
    x = (np.random.default_rng(seed).standard_normal((n, nb * 32)) * 10.0 ** log_scale).astype(np.float32)
    c, s = quantize_blocks(x, bits, mode)
    xh = dequantize_blocks(c, s, bits, mode)
    r = reference.rotate_forward(x).reshape(n, nb, 32)
    rh = reference.rotate_forward(xh).reshape(n, nb, 32)
    cents = cb.centroids.astype(np.float64)
    lo = -cb.ref if mode == "maxnorm" else -1.0
    half_gap = max(np.diff(cents).max() / 2, cents[0] - lo)
    scale = np.abs(s.view(np.float16).astype(np.float64))
    bound = scale * (half_gap * (1 + 2.0 ** -10) + np.abs(cents).max() * 2.0 ** -10) + 1e-5 * scale + 1e-6
    assert np.all(np.abs(r - rh) <= bound[..., None])


# --- bad input ---------------------------------------------------------------------------
@pytest.mark.parametrize("x, kwargs, exc, word", [
    (np.zeros((2, 40), np.float32), {}, ValueError, "x"),
    (np.full((1, 32), np.nan, np.float32), {}, ValueError, "x"),
    (np.full((1, 32), np.inf, np.float32), {}, ValueError, "x"),
    (np.zeros((1, 32), np.int32), {}, TypeError, "x"),
    (np.zeros((1, 32), np.float32), {"bits": 5}, ValueError, "bits"),
    (np.zeros((1, 32), np.float32), {"norm_mode": "max"}, ValueError, "norm_mode"),
])
def test_bad_input(x, kwargs, exc, word):
    with pytest.raises(exc, match=word):
        quantize_blocks(x, **kwargs)


def test_dequantize_bad_input():
    c, s = quantize_blocks(np.ones((2, 64), np.float32), 3)
    with pytest.raises(ValueError, match="codes"):
        dequantize_blocks(c[:, :10], s, 3)
    with pytest.raises(TypeError, match="scales"):
        dequantize_blocks(c, s.astype(np.int32), 3)


#: binary16 patterns with all exponent bits set: +-Inf, quiet and signalling NaNs of either sign
#: (the sign bit is the PQO outlier flag, so negative patterns are as common as positive ones)
INF_NAN_PATTERNS = [0x7C00, 0xFC00, 0x7E00, 0xFE00, 0x7C01, 0xFFFF]


@pytest.mark.parametrize("pattern", INF_NAN_PATTERNS)
@pytest.mark.parametrize("n", [3, 600])  # 600 vectors of d = 1024: more scales than one serial range pass
def test_dequantize_rejects_inf_nan_scale_patterns(pattern, n):
    """An Inf/NaN scale pattern used to decode as a finite number (0x7C00 as 65536, 0x7E00 as
    98304) where the NumPy oracle gives inf/NaN: it is rejected, naming ``scales``."""
    d = 64 if n == 3 else 1024
    c, s = quantize_blocks(np.random.default_rng(0).standard_normal((n, d)).astype(np.float32), 3)
    for where in ((0, 0), (n - 1, d // 32 - 1)):
        bad = s.copy()
        bad[where] = pattern
        with pytest.raises(ValueError, match="scales: expected finite binary16 patterns"):
            dequantize_blocks(c, bad, 3)


@pytest.mark.parametrize("pattern", [0x7BFF, 0xFBFF, 0x0001, 0x8000])
def test_dequantize_accepts_extreme_finite_scale_patterns(pattern):
    """The largest finite scale (65504, either sign) and the subnormal / zero edge still decode,
    like the NumPy oracle."""
    c, s = quantize_blocks(np.random.default_rng(1).standard_normal((2, 64)).astype(np.float32), 3)
    s[1, 1] = pattern
    want = reference.dequantize(c, s, get_codebook(3, "maxnorm").centroids, 3)
    np.testing.assert_allclose(dequantize_blocks(c, s, 3), want, rtol=1e-5, atol=1e-6)
    assert np.isfinite(dequantize_blocks(c, s, 3)).all()


# --- unbiased (EDEN-style) rescale: scale · ‖y‖² / ⟨y, c⟩ per block --------------------
@pytest.fixture(scope="module")
def unit_pairs():
    """20 000 pairs of independent random unit vectors, d = 128 (x quantized, q the query)."""
    rng = np.random.default_rng(2024)
    x = rng.standard_normal((20_000, 128))
    q = rng.standard_normal((20_000, 128))
    x = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    q = q / np.linalg.norm(q, axis=1, keepdims=True)
    return x, q


def _ip_stats(x, q, bits, mode, unbiased):
    """(slope Σ est·true / Σ true², mean error / its standard error, NMSE) of ⟨q, x̂⟩."""
    c, s = quantize_blocks(x, bits, mode, unbiased=unbiased)
    xh = dequantize_blocks(c, s, bits, mode).astype(np.float64)
    true = (q * x).sum(1)
    est = (q * xh).sum(1)
    err = est - true
    z = err.mean() / (err.std(ddof=1) / np.sqrt(len(err)))
    return float((est * true).sum() / (true * true).sum()), float(z), nmse(x, xh)


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("mode", ["maxnorm", "l2"])
def test_unbiased_inner_product_slope_is_one(unit_pairs, bits, mode):
    """Measured (seed 2024), slope plain → unbiased, NMSE plain → unbiased:
    2 MaxNorm 0.894 → 1.000, 0.1131 → 0.1241 (+9.7 %); 2 L2 0.889 → 1.001, 0.1116 → 0.1229 (+10.1 %);
    3 MaxNorm 0.996 → 1.001, 0.0315 → 0.0307; 3 L2 0.967 → 0.999, 0.0322 → 0.0316;
    4 MaxNorm 1.000 → 1.000, 0.0082 → 0.0080; 4 L2 0.990 → 0.999, 0.0088 → 0.0083."""
    x, q = unit_pairs
    slope, z, nm_unb = _ip_stats(x, q, bits, mode, True)
    assert 0.99 <= slope <= 1.01
    assert abs(z) < 4.0
    _, _, nm_plain = _ip_stats(x, q, bits, mode, False)
    assert nm_unb <= 1.15 * nm_plain


def test_plain_2bit_l2_slope_is_biased(unit_pairs):
    """algorithms.md §3.4: plain 2-bit L2 shrinks inner products (slope 0.892); the slope
    test above would catch that."""
    x, q = unit_pairs
    slope, _, _ = _ip_stats(x, q, 2, "l2", False)
    assert slope == pytest.approx(0.892, abs=0.01)
    assert not 0.99 <= slope <= 1.01


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("mode", ["maxnorm", "l2"])
@pytest.mark.parametrize("outlier", [True, False])
def test_unbiased_block_inner_product_equals_norm(bits, mode, outlier):
    """⟨x̂_b, x_b⟩ = ‖x_b‖² per block up to the binary16 rounding of the stored scale
    (relative 2⁻¹¹) and float32 arithmetic; codes and the outlier flag are unchanged."""
    x = np.random.default_rng(bits).standard_normal((500, 96)).astype(np.float32) * 3
    x[:, 5] *= 20
    c, s = quantize_blocks(x, bits, mode, outlier, unbiased=True)
    c0, s0 = quantize_blocks(x, bits, mode, outlier)
    assert np.array_equal(c, c0)
    assert np.array_equal(np.signbit(s.view(np.float16)), np.signbit(s0.view(np.float16)))
    xh = dequantize_blocks(c, s, bits, mode).astype(np.float64).reshape(500, 3, 32)
    xb = x.astype(np.float64).reshape(500, 3, 32)
    ip, nn = (xh * xb).sum(2), (xb * xb).sum(2)
    assert np.all(np.abs(ip - nn) <= (2.0 ** -11 + 1e-5) * nn)


def test_unbiased_matches_float64_formula():
    """Stored |scale| = f16(scale · ‖y‖² / ⟨y, c⟩) with y, c recomputed in float64."""
    for mode in ("maxnorm", "l2"):
        cb = get_codebook(3, mode)
        x = np.random.default_rng(5).standard_normal((300, 64)).astype(np.float32)
        c, s = quantize_blocks(x, 3, mode, unbiased=True)
        _, s0 = quantize_blocks(x, 3, mode)
        plain = np.abs(s0.view(np.float16).astype(np.float64))
        r = reference.rotate_forward(x.astype(np.float64)).reshape(300, 2, 32)
        cent = cb.centroids.astype(np.float64)[unpack_bits(c, 3).reshape(300, 2, 32)]
        # y = r / scale with scale = amax / ref (MaxNorm) or ‖x_b‖ (L2)
        scale = np.linalg.norm(x.astype(np.float64).reshape(300, 2, 32), axis=2) if mode == "l2" else \
            np.abs(r).max(2) / cb.ref
        y = r / scale[..., None]
        alpha = scale * (y * y).sum(2) / (y * cent).sum(2)
        got = np.abs(s.view(np.float16).astype(np.float64))
        assert np.all(np.abs(got - alpha) <= 2.0 ** -11 * alpha * (1 + 1e-4))
        assert np.mean(got != plain) > 0.9  # the rescale moves almost every block's scale


def test_unbiased_zero_block_keeps_plain_scale():
    x = np.zeros((2, 64), np.float32)
    x[1, 32:] = 1.0
    for mode in ("maxnorm", "l2"):
        c, s = quantize_blocks(x, 3, mode, unbiased=True)
        c0, s0 = quantize_blocks(x, 3, mode)
        assert np.array_equal(c, c0)
        assert s[0, 0] == s0[0, 0] and s[1, 0] == s0[1, 0]  # all-zero blocks: plain (f16 −0)
        xh = dequantize_blocks(c, s, 3, mode)
        assert np.all(xh[0] == 0) and np.all(xh[1, :32] == 0)
        assert np.isfinite(xh).all()


# --- Numba device arrays (simulator or GPU) ----------------------------------------------
@pytest.mark.cuda
def test_dequantize_rejects_inf_nan_scale_patterns_on_device():
    """The scale pattern check covers Numba device arrays too (one reduction launch)."""
    from numba_kv._backend import to_host

    from ..conftest import to_device

    c, s = quantize_blocks(np.random.default_rng(2).standard_normal((3, 64)).astype(np.float32), 3)
    np.testing.assert_allclose(to_host(dequantize_blocks(to_device(c), to_device(s), 3)), dequantize_blocks(c, s, 3),
                               rtol=1e-6, atol=1e-7)
    for pattern in INF_NAN_PATTERNS:
        bad = s.copy()
        bad[2, 1] = pattern
        with pytest.raises(ValueError, match="scales: expected finite binary16 patterns"):
            dequantize_blocks(to_device(c), to_device(bad), 3)
