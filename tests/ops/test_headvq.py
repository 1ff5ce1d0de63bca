"""Head VQ code: against the NumPy oracle, the shipped codebooks (Lloyd conditions, gain over
the scalar code), the fitting's determinism, EDEN, layout and errors."""

import math

import numpy as np
import pytest

from numba_kv import reference
from numba_kv.ops import headquant as hq
from numba_kv.ops import headvq as hv
from numba_kv.ops import headvq_fit as fit

CONFIGS = [(4, 2), (2, 4)]


def nmse(x, xh):
    x = np.asarray(x, np.float64)
    return float(((np.asarray(xh, np.float64) - x) ** 2).sum() / (x ** 2).sum())


def db(ratio):
    return 10.0 * math.log10(ratio)


# --- codebooks ------------------------------------------------------------------------------
@pytest.mark.parametrize("bits, m", CONFIGS)
def test_codebook_shape_order_cache(bits, m):
    for d in hq.HEAD_DIMS:
        cb = hv.headvq_codebook(bits, d)
        assert cb.shape == (256, m) and cb.dtype == np.float32 and not cb.flags.writeable
        assert cb is hv.headvq_codebook(bits, d)
        assert np.all(np.isfinite(cb)) and len(np.unique(cb, axis=0)) == 256
        order = np.lexsort(cb.T[::-1])
        assert np.array_equal(order, np.arange(256)), "points sorted lexicographically"
        c = hv.headvq_centroids(bits, d)
        assert c.dtype == np.float32 and not c.flags.writeable and c is hv.headvq_centroids(bits, d)
        assert np.array_equal(c, reference.headvq_table(cb, d).astype(np.float32))
        # roughly symmetric: the sphere's marginal is symmetric under sign flips
        assert np.abs(cb.astype(np.float64).mean(axis=0)).max() < 0.02


@pytest.mark.parametrize("bits, m", CONFIGS)
@pytest.mark.parametrize("d", [32, 128, 512])
def test_shipped_codebook_lloyd_conditions_and_gain(bits, m, d):
    """On a fresh sample: every point is the mean of its cell (to the sampling error) and
    the code beats the scalar head code (its product codebook) by more than 0.6 dB."""
    x = fit.sphere_groups(d, m, 1 << 17, [7, d, m])
    cb = hv.headvq_codebook(bits, d).astype(np.float64)
    idx, dist = fit.nearest(x, cb)
    cnt = np.bincount(idx, minlength=256)
    assert cnt.min() > 10  # no dead cell
    for j in range(m):
        mean = np.bincount(idx, weights=x[:, j], minlength=256) / cnt
        var = np.bincount(idx, weights=x[:, j] ** 2, minlength=256) / cnt - mean ** 2
        # sampling error of the cell mean here and of the point in its fit (a sample 4x as
        # large), 5 sigma, plus what Lloyd's last iterations would still move
        tol = 5 * np.sqrt(np.maximum(var, 0) * 1.25 / cnt) + 0.01
        assert (np.abs(mean - cb[:, j]) < tol).all(), (j, float(np.abs(mean - cb[:, j]).max()))
    mse_vq = dist.mean() / m
    mse_sq = fit.nearest(x, fit.product_codebook(bits, m, d))[1].mean() / m
    assert db(mse_sq / mse_vq) > 0.6, (mse_sq, mse_vq)


def test_scalar_two_bit_code_is_max_1960():
    """The baseline: the scalar 2-bit code on one coordinate of √d·u at d = 512 (nearly N(0, 1))
    has Max's (1960) MSE 0.1175."""
    x = fit.sphere_groups(512, 1, 1 << 17, [3, 512, 1])
    c = fit.product_codebook(2, 1, 512)
    mse = fit.nearest(x, c)[1].mean()
    assert abs(mse - 0.1175) < 0.004, mse


def test_nearest_is_numpys_element_wise_search_bit_for_bit(rng):
    """The search against NumPy's element-wise float64 distances and ``argmin`` (ties: the
    lowest index; a duplicated point is never chosen over its first copy)."""
    x = rng.standard_normal((3001, 4)) * 2.0
    cb = rng.standard_normal((256, 4))
    cb[200] = cb[17]  # an exact tie everywhere
    x[:5] = cb[[17, 3, 255, 0, 99]]  # distance 0
    acc = np.zeros((x.shape[0], cb.shape[0]))
    for j in range(4):
        acc += (x[:, j:j + 1] - cb[None, :, j]) ** 2
    want = np.argmin(acc, axis=1)
    idx, dist = fit.nearest(x, cb)
    assert idx.dtype == np.int64 and dist.dtype == np.float64
    np.testing.assert_array_equal(idx, want)
    np.testing.assert_array_equal(dist, acc[np.arange(x.shape[0]), want])
    assert idx[:5].tolist() == [17, 3, 255, 0, 99] and not dist[:5].any() and (idx != 200).all()
    with pytest.raises(ValueError, match=r"x \[n, m\] and cb \[k >= 1, m\]"):
        fit.nearest(x, cb[:, :2])
    for bad_x, name in ((np.where(np.arange(4) == 2, np.nan, x[:1]), "x"), (x[:1], "cb")):
        bad_cb = cb.copy()
        if name == "cb":
            bad_cb[7, 1] = np.inf
        with pytest.raises(ValueError, match=f"{name}: expected finite values"):
            fit.nearest(bad_x, bad_cb)


def test_fitting_is_deterministic_and_descends():
    a = fit.fit_codebook(4, 2, 32, n_points=4096, iters=3)
    b = fit.fit_codebook(4, 2, 32, n_points=4096, iters=3)
    assert a.dtype == np.float32 and a.shape == (256, 2) and np.array_equal(a, b)
    assert np.array_equal(np.lexsort(a.T[::-1]), np.arange(256))
    x = fit.sphere_groups(64, 4, 8192, [fit.SEED, 64, 4])
    _, hist = fit.lloyd(x, fit.product_codebook(2, 4, 64), 4)
    assert all(h1 <= h0 * (1 + 1e-12) for h0, h1 in zip(hist, hist[1:])) and hist[-1] < hist[0]
    with pytest.raises(ValueError, match="bits, m, d"):
        fit.fit_codebook(3, 2, 64)


def test_npz_writer_is_reproducible(tmp_path):
    arrays = {"b": np.arange(6, dtype=np.float32).reshape(3, 2), "a": np.ones((2, 4), np.float32)}
    fit.write_npz(tmp_path / "1.npz", arrays)
    fit.write_npz(tmp_path / "2.npz", dict(reversed(arrays.items())))
    assert (tmp_path / "1.npz").read_bytes() == (tmp_path / "2.npz").read_bytes()
    with np.load(tmp_path / "1.npz") as z:
        assert sorted(z.files) == ["a", "b"] and np.array_equal(z["b"], arrays["b"])


@pytest.mark.slow
def test_shipped_codebook_regenerates():
    """The documented command's fit of one codebook gives the shipped points bit for bit (one
    full fit, ~40 s)."""
    assert np.array_equal(fit.fit_codebook(4, 2, 32), hv.headvq_codebook(4, 32))


# --- the op against the oracle -------------------------------------------------------------
def _check_against_oracle(x, bits, unbiased):
    d = x.shape[-1]
    m = hv.GROUP_SIZE[bits]
    codes, norms = hv.quantize_headvq(x, bits, unbiased)
    assert codes.shape == x.shape[:-1] + (d * bits // 8,) and codes.dtype == np.uint8
    assert norms.shape == x.shape[:-1] + (1,) and norms.dtype == np.uint16
    pts = hv.headvq_codebook(bits, d)
    rc, rn, gap = reference.headvq_quantize(x.reshape(-1, d), pts, unbiased)
    c2, n2 = codes.reshape(-1, d // m), norms.reshape(-1, 1)
    diff = c2 != rc
    assert (gap[diff] < 1e-7).all(), f"codes differ away from a tie: gaps {gap[diff][:5]}"
    assert diff.mean() < 1e-3
    same = ~diff.any(axis=1)
    assert np.abs(n2[same].astype(np.int32) - rn[same].astype(np.int32)).max(initial=0) <= 1
    xh = hv.dequantize_headvq(codes, norms, bits)
    assert xh.shape == x.shape and xh.dtype == np.float32
    want = reference.headvq_dequantize(c2, n2, pts).reshape(x.shape)
    scale = np.abs(np.asarray(norms.view(np.float16), np.float64))
    np.testing.assert_allclose(xh, want, atol=float(scale.max()) * 2e-6, rtol=1e-5)
    return codes, norms, xh


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("d", [32, 64, 128, 256])
@pytest.mark.parametrize("unbiased", [False, True])
def test_matches_oracle(rng, bits, d, unbiased):
    x = (rng.standard_normal((37, d)) * rng.uniform(0.1, 10.0, (37, 1))).astype(np.float32)
    x[3] += 2.0  # an offset common to every channel
    x[5, 7] = 60.0  # an outlier channel
    _check_against_oracle(x, bits, unbiased)


@pytest.mark.parametrize("bits", [4, 2])
def test_gqa_shapes_match_oracle(rng, bits):
    """[batch, kv_heads, seq, d] keys with per-head scales; float16 and float64 inputs."""
    x = rng.standard_normal((2, 4, 33, 128)) * np.array([0.5, 1.0, 4.0, 20.0])[None, :, None, None]
    codes, norms, _ = _check_against_oracle(x.astype(np.float32), bits, True)
    for dt in (np.float16, np.float64):
        xc = x.astype(dt)
        c2, n2 = hv.quantize_headvq(xc, bits, True)
        c3, n3 = hv.quantize_headvq(xc.astype(np.float32), bits, True)
        assert np.array_equal(c2, c3) and np.array_equal(n2, n3)


def test_lanes_are_independent(rng):
    """One vector at a time (serial compilation, one-lane tiles) gives the batch's bytes."""
    x = rng.standard_normal((150, 64)).astype(np.float32)
    for bits in (4, 2):
        codes, norms = hv.quantize_headvq(x, bits, True)
        for i in (0, 63, 64, 149):
            c1, n1 = hv.quantize_headvq(x[i:i + 1], bits, True)
            assert np.array_equal(c1[0], codes[i]) and np.array_equal(n1[0], norms[i])
        xh = hv.dequantize_headvq(codes, norms, bits)
        np.testing.assert_array_equal(hv.dequantize_headvq(codes[5:6], norms[5:6], bits)[0], xh[5])


def test_zero_vector_and_norm_mode(rng):
    x = rng.standard_normal((4, 128)).astype(np.float32)
    x[2] = 0.0
    for bits in (4, 2):
        c, n = hv.quantize_headvq(x, bits)
        cu, nu = hv.quantize_headvq(x, bits, unbiased=True)
        assert np.array_equal(c, cu)  # the codes do not depend on the norm mode
        assert n[2, 0] == 0 and nu[2, 0] == 0 and not hv.dequantize_headvq(cu, nu, bits)[2].any()
        np.testing.assert_allclose(n.view(np.float16)[:, 0], np.linalg.norm(x, axis=1), rtol=1e-3)


# --- quality -------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [4, 2])
def test_eden_scale_is_unbiased(rng, bits):
    x = rng.standard_normal((400, 128)).astype(np.float32) * 3
    c, n = hv.quantize_headvq(x, bits, unbiased=True)
    xh = hv.dequantize_headvq(c, n, bits).astype(np.float64)
    xd = x.astype(np.float64)
    # <x̂, x> = ‖x‖² up to the binary16 rounding of the scale
    np.testing.assert_allclose((xh * xd).sum(1), (xd * xd).sum(1), rtol=1e-3)
    q = rng.standard_normal((64, 128))
    est, true = (q @ xh.T).ravel(), (q @ xd.T).ravel()
    slope = float((est * true).sum() / (true * true).sum())
    assert abs(slope - 1.0) < 0.01
    c0, n0 = hv.quantize_headvq(x, bits)
    x0 = hv.dequantize_headvq(c0, n0, bits).astype(np.float64)
    assert float((x0 * xd).sum() / (xd * xd).sum()) < 1 - 0.3 * nmse(x, x0)  # the plain norm shrinks


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("unbiased", [False, True])
def test_round_trip_beats_scalar_head_code(rng, bits, unbiased):
    x = rng.standard_normal((3000, 128)).astype(np.float32)
    e_vq = nmse(x, hv.dequantize_headvq(*hv.quantize_headvq(x, bits, unbiased), bits))
    e_sq = nmse(x, hq.dequantize_head(*hq.quantize_head(x, bits, unbiased), bits))
    assert db(e_sq / e_vq) > 0.5, (e_sq, e_vq)


# --- the internal entry points ----------------------------------------------------------------
def test_into_writes_at_token_offset(rng):
    d, bits, t0, cap = 64, 4, 2, 7
    x3 = rng.standard_normal((3, 4, d)).astype(np.float32)
    cents = hv.headvq_centroids(bits, d)
    codes = np.zeros((3, cap, hv.packed_dim(d, bits)), np.uint8)
    norms = np.zeros((3, cap, 1), np.uint16)
    hv.quantize_headvq_into(x3, codes, norms, t0, cents, True)
    c, n = hv.quantize_headvq(x3, bits, True)
    assert np.array_equal(codes[:, t0:t0 + 4], c) and np.array_equal(norms[:, t0:t0 + 4], n)
    assert not codes[:, :t0].any() and not codes[:, t0 + 4:].any() and not norms[:, t0 + 4:].any()
    out = np.empty((3, 3, d), np.float32)
    hv.dequantize_headvq_into(codes, norms, t0 + 1, cents, out)
    np.testing.assert_array_equal(out, hv.dequantize_headvq(c, n, bits)[:, 1:])
    hv.quantize_headvq_into(x3[:, :0], codes, norms, 0, cents, True)  # empty: a no-op


# --- errors ---------------------------------------------------------------------------------
def test_bad_inputs():
    x = np.ones((2, 64), np.float32)
    for bits in (3, 1, 8, True, 4.0):
        with pytest.raises(ValueError, match="bits"):
            hv.quantize_headvq(x, bits)
    with pytest.raises(ValueError, match="bits"):
        hv.headvq_codebook(3, 64)
    with pytest.raises(ValueError, match="d:"):
        hv.headvq_codebook(4, 48)
    with pytest.raises(ValueError, match="x: expected a last axis"):
        hv.quantize_headvq(np.ones((2, 48), np.float32), 4)
    with pytest.raises(ValueError, match="x: expected a last axis"):
        hv.quantize_headvq(np.ones((2, 1024), np.float32), 4)
    with pytest.raises(TypeError, match="x"):
        hv.quantize_headvq(np.ones((2, 64), np.int32), 4)
    with pytest.raises(TypeError, match="unbiased"):
        hv.quantize_headvq(x, 4, unbiased=1)
    for bad in (np.nan, np.inf):
        y = x.copy()
        y[1, 3] = bad
        with pytest.raises(ValueError, match="x: expected finite"):
            hv.quantize_headvq(y, 2)
    with pytest.raises(ValueError, match="x"):
        hv.quantize_headvq(np.full((1, 64), 1e4, np.float32), 4)  # norm 80000 > binary16
    c, n = hv.quantize_headvq(x, 4)
    with pytest.raises(TypeError, match="codes"):
        hv.dequantize_headvq(c.astype(np.int16), n, 4)
    with pytest.raises(TypeError, match="norms"):
        hv.dequantize_headvq(c, n.astype(np.int32), 4)
    with pytest.raises(ValueError, match="codes"):
        hv.dequantize_headvq(c[:, :24], n, 4)  # d = 48
    with pytest.raises(ValueError, match="norms"):
        hv.dequantize_headvq(c, n[:1], 4)
    with pytest.raises(ValueError, match="norms"):
        hv.dequantize_headvq(c, np.zeros((2, 2), np.uint16), 4)
    with pytest.raises(ValueError, match="norms: expected finite"):
        hv.dequantize_headvq(c, np.full((2, 1), 0x7C00, np.uint16), 4)
    with pytest.raises(ValueError, match="bits"):
        hv.dequantize_headvq(c, n, 3)
