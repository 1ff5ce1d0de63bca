"""QJL 1-bit residual sketch: layout and norms vs NumPy, scores vs NumPy, unbiasedness,
TurboQuant_prod inner-product distortion vs ``algorithms.md`` §3.4, bad inputs."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from numba_kv.ops.blockquant import dequantize_blocks, quantize_blocks
from numba_kv.ops.qjl import (
    SKETCH_SEED,
    make_sketch,
    qjl_constant,
    qjl_inner_product,
    qjl_quantize,
    qjl_scores_into,
    qjl_signs_into,
)


def unit(rng, n, d):
    x = rng.standard_normal((n, d))
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def proj_f32(r2, S):
    """``S r`` summed in the kernels' order (i = 0..d-1, float32 product then float32 add)."""
    acc = np.zeros((r2.shape[0], S.shape[0]), np.float32)
    for i in range(r2.shape[1]):
        acc += S[:, i][None, :] * r2[:, i][:, None]
    return acc


def norm_f32(r2):
    s = np.zeros(r2.shape[0], np.float32)
    for i in range(r2.shape[1]):
        s += r2[:, i] * r2[:, i]
    return np.minimum(np.sqrt(s), np.float32(65504.0))


def pm_of(signs):
    """Packed sign bytes → ±1 float64, LSB-first."""
    return np.unpackbits(signs, axis=-1, bitorder="little").astype(np.float64) * 2.0 - 1.0


def paired(y, signs, norms, S):
    """Estimates for N (query, vector) pairs."""
    return qjl_inner_product(y[:, None], signs[:, None], norms[:, None], S)[:, 0, 0].astype(np.float64)


# --- sketch and constant ---------------------------------------------------------------------
def test_make_sketch_is_seeded_cached_and_read_only():
    S = make_sketch(128)
    assert S.shape == (128, 128) and S.dtype == np.float32
    assert make_sketch(128) is S and make_sketch(128, 128, SKETCH_SEED) is S
    assert not S.flags.writeable
    want = np.random.default_rng(SKETCH_SEED).standard_normal((128, 128)).astype(np.float32)
    np.testing.assert_array_equal(S, want)
    assert not np.array_equal(make_sketch(128, seed=1), S)
    assert make_sketch(40, 16).shape == (16, 40)
    assert abs(float(S.std()) - 1.0) < 0.02 and abs(float(S.mean())) < 0.02


def test_constant():
    assert qjl_constant(128) == pytest.approx(math.sqrt(math.pi / 2) / 128, rel=1e-15)
    with pytest.raises(ValueError, match="m"):
        qjl_constant(0)


# --- qjl_signs: packing layout and norms ------------------------------------------------------
def test_packing_layout_lsb_first():
    """Identity sketch: bit j of the packed row is the sign of r_j (byte j//8, bit j%8)."""
    r = np.array([[1, -1, 2, 0, -3, 5, -0.5, 7, -1, -1, -1, -1, 1, 1, 1, 1]], np.float32)
    signs, norms = qjl_quantize(r, np.eye(16, dtype=np.float32))
    bits = [1, 0, 1, 1, 0, 1, 0, 1, 0, 0, 0, 0, 1, 1, 1, 1]  # 0 counts as >= 0
    assert signs[0].tolist() == [sum(b << k for k, b in enumerate(bits[:8])),
                                 sum(b << k for k, b in enumerate(bits[8:]))] == [0xAD, 0xF0]
    assert float(norms.view(np.float16)[0]) == pytest.approx(np.linalg.norm(r), rel=1e-3)


@pytest.mark.parametrize("d, m", [(128, 128), (64, 32), (40, 24), (3, 8)])
def test_signs_and_norms_match_numpy(d, m):
    rng = np.random.default_rng(d + m)
    r = (rng.standard_normal((3, 7, d)) * rng.uniform(0.01, 10, (3, 7, 1))).astype(np.float32)
    S = make_sketch(d, m, seed=7)
    signs, norms = qjl_quantize(r, S)
    assert signs.shape == (3, 7, m // 8) and signs.dtype == np.uint8
    assert norms.shape == (3, 7) and norms.dtype == np.uint16
    r2 = r.reshape(-1, d)
    # bit-exact against the same float32 summation order
    want = np.packbits(proj_f32(r2, S) >= 0, axis=-1, bitorder="little").reshape(3, 7, m // 8)
    np.testing.assert_array_equal(signs, want)
    np.testing.assert_array_equal(norms, norm_f32(r2).astype(np.float16).view(np.uint16).reshape(3, 7))
    # and against float64 math: signs agree wherever the projection is not within rounding of 0
    p64 = r2.astype(np.float64) @ S.T.astype(np.float64)
    clear = np.abs(p64) > 1e-4 * np.linalg.norm(r2, axis=1, keepdims=True) * math.sqrt(d)
    got = pm_of(signs.reshape(-1, m // 8)) > 0
    assert np.array_equal(got[clear], (p64 >= 0)[clear]) and clear.mean() > 0.99
    nrm = np.linalg.norm(r2.astype(np.float64), axis=1)
    np.testing.assert_allclose(norms.view(np.float16).astype(np.float64).ravel(), nrm, rtol=2 ** -11)


def test_norms_out_of_range_raise_and_zero_vector():
    r = np.zeros((3, 16), np.float32)
    r[2, 5] = -2.5
    signs, norms = qjl_quantize(r, make_sketch(16))
    assert norms.view(np.float16).tolist() == [0.0, 0.0, 2.5]
    assert signs[0].tolist() == [0xFF, 0xFF]  # S·0 = 0 >= 0
    r[1, 0] = 1e5  # ‖r‖ beyond binary16: rejected, not saturated at 65504
    with pytest.raises(ValueError, match=r"^r: .*65504"):
        qjl_quantize(r, make_sketch(16))


def test_signs_into_writes_only_its_token_window():
    rng = np.random.default_rng(2)
    r3 = rng.standard_normal((2, 5, 32)).astype(np.float32)
    S = make_sketch(32, 16, seed=3)
    signs = np.full((2, 11, 2), 0x5A, np.uint8)
    norms = np.full((2, 11), 0x1234, np.uint16)
    qjl_signs_into(r3, S, signs, norms, 4)
    s_ref, n_ref = qjl_quantize(r3, S)
    np.testing.assert_array_equal(signs[:, 4:9], s_ref)
    np.testing.assert_array_equal(norms[:, 4:9], n_ref)
    assert (signs[:, :4] == 0x5A).all() and (signs[:, 9:] == 0x5A).all()
    assert (norms[:, :4] == 0x1234).all() and (norms[:, 9:] == 0x1234).all()


# --- qjl_scores -------------------------------------------------------------------------------
def test_scores_into_matches_numpy_bit_exact():
    rng = np.random.default_rng(4)
    g, rows, cap, n, m = 3, 4, 150, 131, 24  # n > 2 CPU lane tiles, with a remainder
    sq = rng.standard_normal((g, rows, m)).astype(np.float32)
    signs = rng.integers(0, 256, (g, cap, m // 8), dtype=np.uint8)
    norms = rng.uniform(0, 3, (g, cap)).astype(np.float16).view(np.uint16)
    out = np.full((g, rows, n), np.nan, np.float32)
    qjl_scores_into(sq, signs, norms, n, m, out)
    pm = pm_of(signs[:, :n]).astype(np.float32)  # [g, n, m]
    acc = np.zeros((g, rows, n), np.float32)
    for j in range(m):  # same order, float32: (c·γ) · Σ_j sq_j·(±1)_j
        acc += sq[:, :, j][:, :, None] * pm[:, :, j][:, None, :]
    scale = np.float32(qjl_constant(m)) * norms[:, :n].view(np.float16).astype(np.float32)
    np.testing.assert_array_equal(out, scale[:, None, :] * acc)


def test_inner_product_matches_numpy():
    rng = np.random.default_rng(5)
    d, m, T, Q = 96, 64, 37, 5
    S = make_sketch(d, m, seed=11)
    r = rng.standard_normal((T, d)).astype(np.float32)
    y = rng.standard_normal((Q, d)).astype(np.float32)
    signs, norms = qjl_quantize(r, S)
    out = qjl_inner_product(y, signs, norms, S)
    assert out.shape == (Q, T) and out.dtype == np.float32
    ref = (qjl_constant(m) * norms.view(np.float16).astype(np.float64)[None, :]
           * ((y.astype(np.float64) @ S.T.astype(np.float64)) @ pm_of(signs).T))
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-4)
    one = qjl_inner_product(y[:1], signs[None], norms[None], S)  # (..., d) form: batch of 1, one query
    assert one.shape == (1, T)
    np.testing.assert_allclose(one[0], out[0], rtol=1e-6, atol=1e-6)


def test_default_sketch():
    rng = np.random.default_rng(6)
    r = rng.standard_normal((4, 64)).astype(np.float32)
    s0, n0 = qjl_quantize(r)
    s1, n1 = qjl_quantize(r, make_sketch(64))
    np.testing.assert_array_equal(s0, s1)
    np.testing.assert_array_equal(n0, n1)
    np.testing.assert_array_equal(qjl_inner_product(r, s0, n0), qjl_inner_product(r, s1, n1, make_sketch(64)))


@settings(max_examples=30, deadline=None)
@given(lead=st.lists(st.integers(0, 3), max_size=2), T=st.integers(0, 5), Q=st.integers(0, 3),
       d=st.integers(1, 40), mb=st.integers(1, 4), seed=st.integers(0, 2 ** 31))
def test_shape_round_trip(lead, T, Q, d, mb, seed):
    lead = tuple(lead)
    rng = np.random.default_rng(seed)
    S = make_sketch(d, 8 * mb, seed=seed % 5)
    r = rng.standard_normal(lead + (T, d)).astype(np.float32)
    signs, norms = qjl_quantize(r, S)
    assert signs.shape == lead + (T, mb) and norms.shape == lead + (T,)
    y = rng.standard_normal(lead + (Q, d))
    out = qjl_inner_product(y, signs, norms, S)
    assert out.shape == lead + (Q, T) and out.dtype == np.float32
    ref = (qjl_constant(8 * mb) * norms.view(np.float16).astype(np.float64)[..., None, :]
           * np.einsum("...qm,...tm->...qt", y @ S.T.astype(np.float64), pm_of(signs)))
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4 * max(1.0, float(np.abs(ref).max(initial=0))))


# --- statistics ---------------------------------------------------------------------------------
def test_unbiased_over_fresh_sketches():
    """E[est] = ⟨y, r⟩ over 200 sketch seeds × 100 unit-vector pairs (d = m = 128).

    ``y = c·x + √(1−c²)·z⊥`` with ``c ~ U(−1, 1)`` spreads the true inner product over
    [−1, 1] (independent pairs would concentrate it at ±1/√d and weaken the slope test)."""
    rng = np.random.default_rng(0)
    d, seeds, per = 128, 200, 100
    err, true, var = [], [], []
    for s in range(seeds):
        x = unit(rng, per, d)
        z = rng.standard_normal((per, d))
        z -= (z * x).sum(1, keepdims=True) * x
        z /= np.linalg.norm(z, axis=1, keepdims=True)
        c = rng.uniform(-1, 1, (per, 1))
        y = c * x + np.sqrt(1 - c ** 2) * z
        S = make_sketch(d, seed=10_000 + s)
        signs, norms = qjl_quantize(x.astype(np.float32), S)
        est = paired(y.astype(np.float32), signs, norms, S)
        t = (x * y).sum(1)
        err.append(est - t)
        true.append(t)
        var.append((math.pi / 2 - t ** 2) / d)  # ((π/2)‖r‖²‖y‖² − ⟨r,y⟩²) / m
    err, true, var = np.concatenate(err), np.concatenate(true), np.concatenate(var)
    n = err.size
    se = err.std() / math.sqrt(n)
    assert abs(err.mean()) < 4 * se, (err.mean(), se)
    slope = ((err + true) * true).sum() / (true ** 2).sum()
    assert 0.97 < slope < 1.03, slope
    # the Gaussian-sketch variance formula of the module docstring (mean squared error)
    assert (err ** 2).mean() == pytest.approx(var.mean(), rel=0.05)


# algorithms.md §3.4 ([V], d = 128, 20 000 unit-vector pairs, Gaussian S for the QJL rows)
DPROD_TABLE = [  # (bits of the L2 block quantizer, QJL?, d·D_prod, slope)
    (2, False, 0.111, 0.892),
    (2, True, 0.173, 1.001),  # TQ3, L2
    (3, True, 0.051, 1.001),  # TQ4, L2
]


@pytest.mark.parametrize("bits, use_qjl, dprod, slope_ref", DPROD_TABLE)
def test_turboquant_prod_distortion(bits, use_qjl, dprod, slope_ref):
    """d·E[(est − ⟨x, y⟩)²] and the regression slope of TurboQuant_prod built from our block
    quantizer (L2 mode) plus QJL on the whole residual, y an independent unit vector."""
    rng = np.random.default_rng(bits)
    d, n, nseeds = 128, 20_000, 20
    x = unit(rng, n, d).astype(np.float32)
    y = unit(rng, n, d).astype(np.float32)
    codes, scales = quantize_blocks(x, bits, "l2", outlier=False)
    xh = dequantize_blocks(codes, scales, bits, "l2")
    est = (y.astype(np.float64) * xh).sum(1)
    if use_qjl:
        r = x - xh
        per = n // nseeds
        for s in range(nseeds):  # a few sketches, so the figure is not one sketch's luck
            sl = slice(s * per, (s + 1) * per)
            S = make_sketch(d, seed=SKETCH_SEED + s)
            signs, norms = qjl_quantize(r[sl], S)
            est[sl] += paired(y[sl], signs, norms, S)
    true = (x.astype(np.float64) * y).sum(1)
    got = d * ((est - true) ** 2).mean()
    slope = (est * true).sum() / (true ** 2).sum()
    assert got == pytest.approx(dprod, rel=0.10), got
    if use_qjl:
        assert 0.97 < slope < 1.03, slope
    else:
        assert slope == pytest.approx(slope_ref, abs=0.03), slope


# --- bad inputs -----------------------------------------------------------------------------------
def test_bad_sketch_arguments():
    with pytest.raises(ValueError, match="m: .*multiple of 8"):
        make_sketch(100)  # m defaults to d, not a multiple of 8
    with pytest.raises(ValueError, match="m: .*multiple of 8"):
        make_sketch(64, 12)
    with pytest.raises(ValueError, match="d: "):
        make_sketch(0)
    with pytest.raises(ValueError, match="seed: "):
        make_sketch(64, seed=-1)
    r = np.ones((2, 64), np.float32)
    with pytest.raises(ValueError, match="sketch: .*multiple of 8"):
        qjl_quantize(r, np.ones((12, 64), np.float32))
    with pytest.raises(ValueError, match="sketch: .*d=64"):
        qjl_quantize(r, np.ones((16, 32), np.float32))
    with pytest.raises(ValueError, match="sketch: "):
        qjl_quantize(np.ones((2, 100), np.float32))  # default sketch needs d % 8 == 0
    with pytest.raises(TypeError, match="sketch: "):
        qjl_quantize(r, np.ones((16, 64), np.int32))
    bad = np.ones((16, 64), np.float32)
    bad[3, 3] = np.nan
    with pytest.raises(ValueError, match="sketch: .*finite"):
        qjl_quantize(r, bad)


def test_bad_quantize_inputs():
    S = make_sketch(64)
    with pytest.raises(TypeError, match="r: "):
        qjl_quantize(np.ones((2, 64), np.int32), S)
    with pytest.raises(TypeError, match="r: "):
        qjl_quantize([[1.0] * 64], S)
    r = np.ones((2, 64), np.float32)
    r[1, 7] = np.nan
    with pytest.raises(ValueError, match="r: .*finite"):
        qjl_quantize(r, S)
    r[1, 7] = np.inf
    with pytest.raises(ValueError, match="r: .*finite"):
        qjl_quantize(r, S)
    with pytest.raises(ValueError, match="r: "):
        qjl_quantize(np.ones((2, 0), np.float32), S)


def test_bad_inner_product_inputs():
    rng = np.random.default_rng(9)
    S = make_sketch(64, 32)
    signs, norms = qjl_quantize(rng.standard_normal((6, 64)).astype(np.float32), S)
    y = rng.standard_normal((3, 64)).astype(np.float32)
    with pytest.raises(TypeError, match="signs: "):
        qjl_inner_product(y, signs.astype(np.int16), norms, S)
    with pytest.raises(TypeError, match="norms: "):
        qjl_inner_product(y, signs, norms.view(np.float16), S)
    with pytest.raises(TypeError, match="y: "):
        qjl_inner_product(y.astype(np.int64), signs, norms, S)
    with pytest.raises(ValueError, match="norms: "):
        qjl_inner_product(y, signs, norms[:5], S)
    with pytest.raises(ValueError, match="y: "):
        qjl_inner_product(y[None], signs, norms, S)  # batch axes of y and signs differ
    with pytest.raises(ValueError, match="sketch: "):
        qjl_inner_product(y, signs, norms, make_sketch(64))  # 64 rows but signs hold 32 bits
    with pytest.raises(ValueError, match="sketch: "):
        qjl_inner_product(y[:, :32], signs, norms, S)
    with pytest.raises(ValueError, match="signs: "):
        qjl_inner_product(y, signs[0], norms[:1], S)
    bad = y.copy()
    bad[0, 0] = np.nan
    with pytest.raises(ValueError, match="y: .*finite"):
        qjl_inner_product(bad, signs, norms, S)
    nb = norms.copy()
    nb[2] = 0x7E00  # binary16 NaN
    with pytest.raises(ValueError, match="norms: .*finite"):
        qjl_inner_product(y, signs, nb, S)
