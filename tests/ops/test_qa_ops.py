"""Adversarial checks of the public array ops: what their docstrings promise at the edges.

Expected values come from independent sources: the float64 NumPy oracles of
``numba_kv.reference``, exact power-of-two scaling, the Lloyd–Max Gaussian distortions of
Max (1960), the TurboQuant figures (arXiv:2504.19874).
"""

import decimal
import fractions
import warnings

import numpy as np
import pytest

import numba_kv
from numba_kv import _config, reference
from numba_kv._backend import to_host
from numba_kv.ops.codebook import Codebook, get_codebook, sphere_distortion
from numba_kv.ops.headquant import head_signs

from ..conftest import to_device

F32_MAX = float(np.finfo(np.float32).max)


def _rel_err(got: np.ndarray, want: np.ndarray) -> float:
    assert np.isfinite(got).all(), "finite input came back as inf/NaN"
    return float(np.abs(got.astype(np.float64) - want).max() / np.abs(want).max())


# --- rotations near the float32 maximum -----------------------------------------------------
# The butterflies sum before their final 1/√n multiply: an intermediate value reaches √n times
# the block norm.  All 32 values 3e37: rotated 1.7e38 (a float32), summed 9.6e38 (not one).
@pytest.mark.parametrize("inverse", [False, True])
def test_rotate32_near_float32_max_is_finite_and_exact(inverse, rng):
    x = np.full((2, 64), 3e37, np.float32)
    x[1, 32:] = (rng.standard_normal(32) * 2.5e37).astype(np.float32)
    want = (reference.rotate_inverse if inverse else reference.rotate_forward)(x)
    assert np.abs(want).max() < F32_MAX  # representable: it must be returned, not inf
    assert _rel_err(numba_kv.rotate32(x, inverse), want) < 1e-6


@pytest.mark.parametrize("d", [32, 128, 512])
@pytest.mark.parametrize("inverse", [False, True])
def test_rotate_head_near_float32_max_is_finite_and_exact(d, inverse, rng):
    x = rng.standard_normal((3, d))
    x = (x / np.linalg.norm(x, axis=1, keepdims=True) * 1.2e38).astype(np.float32)
    s = reference.head_sign_vector(d)
    want = (x.astype(np.float64) @ reference.hadamard(d)) * s if inverse else reference.rotate_head_forward(x, s)
    assert _rel_err(numba_kv.rotate_head(x, inverse), want) < 1e-6


@pytest.mark.parametrize("op", [numba_kv.rotate32, numba_kv.rotate_head])
def test_rescaled_rotation_is_the_float32_rotation(op, rng):
    """Power-of-two scaling is exact: the large-input path gives the bits of the scaled one.
    Blocks that the butterflies sum coherently (a constant block for the Hadamard-first
    ``rotate32``, the sign pattern for the signs-first ``rotate_head``): sum ``n·c``, well
    above float32, rotated ``√n·c`` within it."""
    base = np.ones(128) if op is numba_kv.rotate32 else head_signs(128).astype(np.float64)
    c = 2.0 ** 124 if op is numba_kv.rotate32 else 2.0 ** 123
    x = ((base + 0.1 * rng.standard_normal((4, 128))) * c).astype(np.float32)
    k = np.float32(2.0 ** 8)
    y = op(x)
    assert np.isfinite(y).all()
    assert np.array_equal(y, op(x / k) * k)


def test_rotations_still_refuse_blocks_beyond_float32():
    with pytest.raises(ValueError, match=r"^x: a 32-value block has L2 norm"):
        numba_kv.rotate32(np.full((1, 32), 1e38, np.float32))


# --- flags: a truthy string must not switch a mode on --------------------------------------
@pytest.mark.parametrize("bad", ["no", 1, None])
def test_bool_flags_are_type_checked(bad):
    x = np.ones((2, 64), np.float32)
    with pytest.raises(TypeError, match="^inverse: expected a bool"):
        numba_kv.rotate32(x, bad)
    with pytest.raises(TypeError, match="^inverse: expected a bool"):
        numba_kv.rotate_head(x, bad)
    with pytest.raises(TypeError, match="^outlier: expected a bool"):
        numba_kv.quantize_blocks(x, 3, outlier=bad)
    with pytest.raises(TypeError, match="^unbiased: expected a bool"):
        numba_kv.quantize_blocks(x, 3, unbiased=bad)


def test_bool_flags_accept_numpy_bools(rng):
    x = rng.standard_normal((2, 64)).astype(np.float32)
    assert np.array_equal(numba_kv.rotate32(x, np.bool_(True)), numba_kv.rotate32(x, True))
    a = numba_kv.quantize_blocks(x, 3, outlier=np.bool_(False), unbiased=np.bool_(True))
    b = numba_kv.quantize_blocks(x, 3, outlier=False, unbiased=True)
    assert all(np.array_equal(p, q) for p, q in zip(a, b))


# --- rotate32's sign vector ------------------------------------------------------------------
def test_rotate32_custom_signs_match_the_formula(rng):
    s = np.where(rng.random(32) < 0.5, -1.0, 1.0)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    want = ((x.astype(np.float64).reshape(3, 2, 32) @ reference.hadamard32().T) * s).reshape(3, 64)  # D_s H x
    assert _rel_err(numba_kv.rotate32(x, signs=s), want) < 1e-6  # float64 signs: converted


@pytest.mark.parametrize("value", [2.0, 0.0, np.nan, 1e38])
def test_rotate32_refuses_signs_that_are_not_pm1(value):
    signs = np.ones(32, np.float32)
    signs[5] = value
    with pytest.raises(ValueError, match=r"^signs: expected 32 values \+1 or -1"):
        numba_kv.rotate32(np.ones((1, 32), np.float32), signs=signs)


def test_rotate32_refuses_complex_signs_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # NumPy's ComplexWarning would fail here
        with pytest.raises(TypeError, match="^signs: expected a real"):
            numba_kv.rotate32(np.ones((1, 32), np.float32), signs=np.ones(32, np.complex64))


# --- QJL: finite input never comes back as inf/NaN, nor as arbitrary sign bits ---------------
def test_qjl_inner_product_overflow_is_an_error(rng):
    r = rng.standard_normal((4, 64)).astype(np.float32)
    signs, norms = numba_kv.qjl_quantize(r)
    y = rng.standard_normal((3, 64)).astype(np.float32)
    ok = numba_kv.qjl_inner_product(y * np.float32(1e30), signs, norms)  # large, still finite
    assert np.isfinite(ok).all()
    with pytest.raises(ValueError, match=r"^y: an estimate exceeds"):
        numba_kv.qjl_inner_product(y * np.float32(3e37), signs, norms)


def test_qjl_refuses_a_sketch_whose_projections_overflow(rng):
    r = rng.standard_normal((4, 64)).astype(np.float32)
    with pytest.raises(ValueError, match=r"^sketch: max \|sketch\|"):
        numba_kv.qjl_quantize(r, np.full((8, 64), 1e38, np.float32))
    # sign(S r) does not change under positive scaling of S (2**20: exact in float32)
    s = numba_kv.make_sketch(64)
    big = numba_kv.qjl_quantize(r, s * np.float32(2.0 ** 20))
    assert all(np.array_equal(a, b) for a, b in zip(big, numba_kv.qjl_quantize(r, s)))


def test_qjl_inner_product_refuses_negative_norms(rng):
    r = rng.standard_normal((4, 64)).astype(np.float32)
    signs, norms = numba_kv.qjl_quantize(r)
    neg = (-norms.view(np.float16)).view(np.uint16)
    with pytest.raises(ValueError, match="^norms: expected non-negative"):
        numba_kv.qjl_inner_product(r, signs, neg)
    zero = np.full_like(norms, 0x8000)  # -0.0 is a zero norm: accepted, estimates 0
    assert not np.any(numba_kv.qjl_inner_product(r, signs, zero))


# --- codebooks -----------------------------------------------------------------------------
#: m·E[(x − Q(x))²] of the Lloyd–Max quantizer of N(0, 1) (Max 1960), the m → ∞ limit of the
#: sphere-coordinate tables
GAUSS_LM = {2: 0.1175, 3: 0.03454, 4: 0.009497}


@pytest.mark.parametrize(("bits", "m"), [(2, 1024), (3, 1024), (4, 1024), (3, 16384)])
def test_l2_codebooks_of_wide_blocks_are_near_optimal(bits, m):
    """The uniform start on [−1, 1] left bins empty for m > 512 (2 bits, m = 1024: 3.1x)."""
    d = sphere_distortion(get_codebook(bits, "l2", block=m), m)
    assert d < 1.01 * GAUSS_LM[bits]


@pytest.mark.parametrize("ref", [0.0, -2.1573, float("nan"), float("inf"), True, "2"])
def test_codebook_refuses_a_bad_scale_reference(ref):
    cb = get_codebook(3, "maxnorm")
    with pytest.raises(ValueError, match="^ref: expected a finite positive"):
        Codebook(3, "maxnorm", cb.centroids, cb.boundaries, ref, "test")


@pytest.mark.parametrize(("bits", "want"), [(2, 0.117), (3, 0.034), (4, 0.0095)])
def test_quantize_head_mse_matches_turboquant(bits, want, rng):
    """TurboQuant (arXiv:2504.19874): MSE of unit vectors about 0.117 / 0.034 / 0.0095."""
    x = rng.standard_normal((4000, 256))
    x = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    codes, norms = numba_kv.quantize_head(x, bits)
    mse = float(((numba_kv.dequantize_head(codes, norms, bits) - x) ** 2).sum(1).mean())
    assert mse == pytest.approx(want, rel=0.04)


# --- knobs -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "value"), [
    ("cuda_threads", np.float32(64.5)), ("cuda_threads", decimal.Decimal("64.5")),
    ("cuda_threads", fractions.Fraction(129, 2)), ("cuda_threads", np.float32("inf")),
    ("cuda_warp_attention", np.bool_(True)), ("growth_fraction", True),
])
def test_knobs_refuse_inexact_and_bool_values(name, value):
    before = _config.get(name)
    with pytest.raises(TypeError if isinstance(value, (bool, np.bool_)) else ValueError, match=f"^{name}: expected"):
        with numba_kv.knobs(**{name: value}):
            pass
    assert _config.get(name) == before


def test_knobs_take_integral_values_of_any_type():
    with numba_kv.knobs(cuda_threads=np.float32(64.0), growth_min_extra=decimal.Decimal(7)):
        assert _config.get("cuda_threads") == 64 and type(_config.get("cuda_threads")) is int
        assert _config.get("growth_min_extra") == 7


# --- device arrays ---------------------------------------------------------------------------
@pytest.mark.cuda
def test_dequantize_head_refuses_nonfinite_norms_on_the_device(rng):
    codes, norms = numba_kv.quantize_head(rng.standard_normal((2, 32)).astype(np.float32), 2)
    bad = norms.copy()
    bad[1, 0] = 0x7E00  # NaN
    with pytest.raises(ValueError, match="^norms: expected finite"):
        numba_kv.dequantize_head(to_device(codes), to_device(bad), 2)
    got = to_host(numba_kv.dequantize_head(to_device(codes), to_device(norms), 2))
    assert np.array_equal(got, numba_kv.dequantize_head(codes, norms, 2))


def test_dequantize_check_values_false_skips_only_the_value_pass():
    """``check_values=False`` (the caller vouches for its scales / norms) decodes the same bits as
    the checked call and skips the pass that refuses an Inf pattern (the other vectors decode as
    before); the flag itself must be a bool."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    codes, scales = numba_kv.quantize_blocks(x, 3)
    np.testing.assert_array_equal(numba_kv.dequantize_blocks(codes, scales, 3, check_values=False),
                                  numba_kv.dequantize_blocks(codes, scales, 3))
    bad = scales.copy()
    bad[1, 0] = 0x7C00  # +Inf
    with pytest.raises(ValueError, match="scales: expected finite binary16"):
        numba_kv.dequantize_blocks(codes, bad, 3)
    unchecked = numba_kv.dequantize_blocks(codes, bad, 3, check_values=False)
    np.testing.assert_array_equal(unchecked[[0, 2]], numba_kv.dequantize_blocks(codes, scales, 3)[[0, 2]])
    hc, hn = numba_kv.quantize_head(x, 3)
    np.testing.assert_array_equal(numba_kv.dequantize_head(hc, hn, 3, check_values=False),
                                  numba_kv.dequantize_head(hc, hn, 3))
    hbad = hn.copy()
    hbad[2, 0] = 0x7C00
    with pytest.raises(ValueError, match="norms: expected finite binary16"):
        numba_kv.dequantize_head(hc, hbad, 3)
    unchecked = numba_kv.dequantize_head(hc, hbad, 3, check_values=False)
    np.testing.assert_array_equal(unchecked[:2], numba_kv.dequantize_head(hc, hn, 3)[:2])
    with pytest.raises(TypeError, match="check_values: expected a bool"):
        numba_kv.dequantize_blocks(codes, scales, 3, check_values="no")
    with pytest.raises(TypeError, match="check_values: expected a bool"):
        numba_kv.dequantize_head(hc, hn, 3, check_values="no")


def test_attention_check_values_must_be_a_bool():
    """A truthy string must not stand for a flag (``check_values="no"`` kept the checks on
    silently)."""
    rng = np.random.default_rng(4)
    k = rng.standard_normal((1, 1, 8, 64)).astype(np.float32)
    kc, ks = numba_kv.quantize_blocks(k, 3)
    q = rng.standard_normal((1, 2, 1, 64)).astype(np.float32)
    with pytest.raises(TypeError, match="check_values: expected a bool"):
        numba_kv.decode_attention(q, kc, ks, kc, ks, bits=3, check_values="no")
    out = numba_kv.decode_attention(q, kc, ks, kc, ks, bits=3, check_values=np.bool_(False))
    np.testing.assert_array_equal(out, numba_kv.decode_attention(q, kc, ks, kc, ks, bits=3))
