"""CPU twins of the compressor ops against NumPy oracles: gather/scatter, low-rank
statistics and projection, binary16 storage, VQ assignment/accumulation/k-means,
INT4/INT8 quantization with MAD outliers."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from numba_kv.ops import intquant, lowrank, vq
from numba_kv.ops.gather import gather_rows, scatter_rows

from . import seed_reference as seed
from .synth import nmse, synth_kv


# --- gather / scatter -----------------------------------------------------------------------
@pytest.mark.parametrize("dt", [np.uint8, np.uint16, np.float32])
def test_gather_scatter_rows(rng, dt):
    src = (rng.standard_normal((11, 5)) * 100).astype(dt)
    idx = rng.permutation(11)[:7].astype(np.int32)
    out = np.zeros((7, 5), dt)
    gather_rows(src, idx, out)
    assert np.array_equal(out, src[idx])
    dst = np.zeros((11, 5), dt)
    scatter_rows(out, idx, dst)
    want = np.zeros_like(dst)
    want[idx] = src[idx]
    assert np.array_equal(dst, want)


def test_gather_rejects_bad_index_dtype():
    src = np.zeros((4, 2), np.float32)
    with pytest.raises(TypeError, match="idx: expected a 1-D int32"):
        gather_rows(src, np.zeros(2, np.int64), np.zeros((2, 2), np.float32))
    with pytest.raises(ValueError, match="out: expected dtype float32"):
        gather_rows(src, np.zeros(2, np.int32), np.zeros((2, 2), np.float64))


# --- low rank ------------------------------------------------------------------------------------
def test_channel_stats_match_numpy(rng):
    x = (rng.standard_normal((3, 40, 12)) * 2 + 30).astype(np.float32)  # large mean: centring matters
    mean, gram = lowrank.channel_stats(x)
    xc = x.astype(np.float64) - x.astype(np.float64).mean(1, keepdims=True)
    np.testing.assert_allclose(mean, x.mean(1), rtol=1e-6)
    np.testing.assert_allclose(gram, np.einsum("rti,rtj->rij", xc, xc), rtol=2e-4, atol=2e-3)


def test_full_rank_projection_is_lossless(rng):
    x = rng.standard_normal((2, 30, 16)).astype(np.float32)
    mean, gram = lowrank.channel_stats(x)
    comp, r = lowrank.fit_components(mean, gram, 30, 16, None)
    assert r == 16 and comp.shape == (2, 16, 16)
    gram = np.einsum("rcd,red->rce", comp, comp)
    np.testing.assert_allclose(gram, np.broadcast_to(np.eye(16), (2, 16, 16)), atol=1e-5)  # orthonormal
    xh = lowrank.reconstruct(lowrank.project(x, mean, comp), mean, comp)
    np.testing.assert_allclose(xh, x, atol=2e-5)


def test_pca_beats_channel_selection_at_equal_rank(rng):
    x = synth_kv(rng, 2, 200, 32, "k")
    mean, gram = lowrank.channel_stats(x)
    for rank in (2, 4, 8):
        comp, r = lowrank.fit_components(mean, gram, 200, rank, None)
        ours = lowrank.reconstruct(lowrank.project(x, mean, comp), mean, comp)
        base, _ = seed.lowrank(x, rank, energy=False)
        assert nmse(x, ours) < nmse(x, base)


def test_energy_rule_picks_smallest_rank_reaching_the_fraction(rng):
    # variances 100, 10, 1, 0.1 ... along the axes: 90 % of the variance needs 1 axis (100/111.1 = 0.9)
    s = np.array([10.0, 10 ** 0.5, 1.0, 0.1 ** 0.5, 0.1, 0.1, 0.1, 0.1])
    z = rng.standard_normal((4000, 8))
    z = (z - z.mean(0)) / z.std(0)
    x = (z * s).astype(np.float32)[None] + 5.0
    mean, gram = lowrank.channel_stats(x)
    assert lowrank.fit_components(mean, gram, 4000, 8, 0.85)[1] == 1
    assert lowrank.fit_components(mean, gram, 4000, 8, 0.95)[1] == 2
    assert lowrank.fit_components(mean, gram, 4000, 1, 0.95)[1] == 1  # capped by rank
    assert lowrank.fit_components(mean, gram, 4000, 99, None)[1] == 8  # capped by head_dim


def test_broadcast_basis_and_coef(rng):
    x = rng.standard_normal((3, 5, 8)).astype(np.float32)
    comp = rng.standard_normal((1, 4, 8)).astype(np.float32)
    mean = np.zeros((1, 8), np.float32)
    coef = lowrank.project(x, mean, comp)
    np.testing.assert_allclose(coef, x @ comp[0].T, rtol=1e-5, atol=1e-5)
    shared = coef[:1]
    out = lowrank.reconstruct(shared, mean, rng.standard_normal((3, 4, 8)).astype(np.float32))
    assert out.shape == (3, 5, 8)


def test_projection_rejects_mismatched_shapes(rng):
    x = np.zeros((2, 3, 8), np.float32)
    with pytest.raises(ValueError, match="components: expected a leading axis of 1 or 2"):
        lowrank.project(x, np.zeros((2, 8), np.float32), np.zeros((3, 2, 8), np.float32))
    with pytest.raises(ValueError, match="mean/components: expected last axis d=8"):
        lowrank.project(x, np.zeros((2, 7), np.float32), np.zeros((2, 2, 8), np.float32))


def test_f16_encode_matches_numpy_and_saturates(rng):
    x = np.concatenate([rng.standard_normal(500) * 10 ** rng.uniform(-8, 4, 500),
                        [0.0, -0.0, 65504.0, 1e6, -1e6, 6e-8, 1e-9]]).astype(np.float32)
    h = lowrank.f16_encode(x)
    want = np.clip(x, -65504, 65504).astype(np.float16)
    assert np.array_equal(h, want.view(np.uint16))
    assert np.array_equal(lowrank.f16_decode(h), want.astype(np.float32))


# --- vector quantization ----------------------------------------------------------------------------
def _brute_assign(x, cbs, per_row):
    rows, n, d = x.shape
    ds = cbs.shape[2]
    m_sub = d // ds
    codes = np.zeros((rows, n, m_sub), np.uint8)
    dist = np.zeros((rows, n, m_sub), np.float32)
    for r in range(rows):
        for m in range(m_sub):
            cb = cbs[r * m_sub + m if per_row else m]
            sub = x[r, :, m * ds:(m + 1) * ds]
            d2 = ((sub[:, None, :] - cb[None]) ** 2).sum(-1)
            codes[r, :, m] = d2.argmin(1)
            dist[r, :, m] = d2.min(1)
    return codes, dist


@pytest.mark.parametrize("per_row, ds", [(False, 8), (True, 4), (False, 2)])
def test_assign_matches_brute_force(rng, per_row, ds):
    x = rng.standard_normal((3, 17, 8)).astype(np.float32)
    ng = (3 if per_row else 1) * (8 // ds)
    cbs = rng.standard_normal((ng, 5, ds)).astype(np.float32)
    cbs[:, 3] = cbs[:, 1]  # duplicated codeword: ties go to the lowest index
    codes, dist = vq.assign(x, cbs)
    want_c, want_d = _brute_assign(x, cbs, per_row)
    assert np.array_equal(codes, want_c)
    np.testing.assert_allclose(dist, want_d, rtol=1e-5, atol=1e-6)
    assert not (codes == 3).any()
    dec = vq.decode(codes, cbs)
    m_sub = 8 // ds
    for r in range(3):
        for m in range(m_sub):
            cb = cbs[r * m_sub + m if per_row else m]
            assert np.array_equal(dec[r, :, m * ds:(m + 1) * ds], cb[codes[r, :, m]])


def test_accumulate_matches_numpy(rng):
    x = rng.standard_normal((2, 13, 6)).astype(np.float32)
    codes = rng.integers(0, 4, size=(2, 13, 3)).astype(np.uint8)
    sums = np.zeros((3, 4, 2), np.float64)
    counts = np.zeros((3, 4), np.int32)
    vq.accumulate_into(x, codes, sums, counts)
    for m in range(3):
        for k in range(4):
            sel = codes[:, :, m] == k
            assert counts[m, k] == sel.sum()
            np.testing.assert_allclose(sums[m, k], x[:, :, 2 * m:2 * m + 2][sel].sum(0), rtol=1e-5, atol=1e-5)


def test_kmeans_converges_and_beats_two_seed_iterations(rng):
    x = synth_kv(rng, 2, 300, 16, "k")
    cb, iters = vq.kmeans(x, 16, 16, False, max_iter=200, tol=0.0)
    codes, dist = vq.assign(x, cb)
    # converged: one more Lloyd step leaves the codebook (nearly) unchanged
    sums = np.zeros((1, 16, 16), np.float64)
    counts = np.zeros((1, 16), np.int32)
    vq.accumulate_into(x, codes, sums, counts)
    filled = counts[0] > 0
    means = sums[0][filled] / counts[0][filled][:, None]
    np.testing.assert_allclose(means, cb[0][filled], rtol=1e-4, atol=1e-4)
    assert 1 <= iters < 200
    base, _ = seed.vq(x, 16, 8)
    ours = vq.decode(codes, cb)
    assert nmse(x, ours) < nmse(x, base)


def test_kmeans_with_fewer_distinct_points_than_codewords(rng):
    x = np.repeat(rng.standard_normal((1, 3, 4)).astype(np.float32), 4, axis=1)  # 3 distinct points
    cb, _ = vq.kmeans(x, 8, 4, False)
    codes, dist = vq.assign(x, cb)
    assert np.all(dist == 0)


def test_kmeans_is_deterministic(rng):
    x = synth_kv(rng, 1, 100, 8, "v")
    a, _ = vq.kmeans(x, 8, 4, True, seed=3)
    b, _ = vq.kmeans(x, 8, 4, True, seed=3)
    assert np.array_equal(a, b)


def test_vq_rejects_bad_codebooks():
    x = np.zeros((2, 3, 8), np.float32)
    with pytest.raises(ValueError, match="codebooks: expected a sub-vector width ds dividing d=8"):
        vq.assign(x, np.zeros((1, 4, 3), np.float32))
    with pytest.raises(ValueError, match="codebooks: expected G = M"):
        vq.assign(x, np.zeros((3, 4, 8), np.float32))


# --- INT4 / INT8 ------------------------------------------------------------------------------------
def test_seed_example_threshold_and_exact_outlier():
    """algorithms.md §5.4: [0.1, 0.2, 0.15, 10.0] → median 0.2, MAD 0.1, threshold 0.8, 10.0 exact."""
    x = np.array([0.1, 0.2, 0.15, 10.0], np.float32).reshape(1, 4, 1)
    thr = intquant.mad_threshold(x)
    assert thr[0, 0] == np.float32(np.float32(0.2) + np.float32(6.0) * (np.float32(0.2) - np.float32(0.1)))
    assert thr[0, 0] == pytest.approx(0.8, abs=1e-6)
    for bits in (4, 8):
        q = intquant.int_quantize(x, bits)
        xh = intquant.int_dequantize(q)
        assert xh[0, 3, 0] == np.float32(10.0)
        assert q.num_outliers == 1 and q.outlier_idx.tolist() == [3]
        assert np.abs(xh[0, :3, 0] - x[0, :3, 0]).max() <= 0.8 / (7 if bits == 4 else 127) / 2 + 1e-7


@settings(max_examples=40, deadline=None)
@given(hnp.arrays(np.float32, st.tuples(st.integers(1, 3), st.integers(1, 40), st.integers(1, 3)),
                  elements=st.floats(-1e3, 1e3, width=32)))
def test_threshold_equals_sorting_oracle(x):
    thr = intquant.mad_threshold(x)
    for r in range(x.shape[0]):
        for c in range(x.shape[2]):
            # exact order statistics; the mean + 3·std fallback (MAD = 0) sums in float32
            assert thr[r, c] == pytest.approx(seed.mad_threshold(x[r, :, c]), rel=1e-5, abs=1e-30)


@settings(max_examples=40, deadline=None)
@given(hnp.arrays(np.float32, st.tuples(st.integers(1, 2), st.integers(1, 33), st.integers(1, 4)),
                  elements=st.floats(-100, 100, width=32)),
       st.sampled_from([4, 8]), st.sampled_from([None, 2, 6]))
def test_int_roundtrip_error_bound(x, bits, group):
    q = intquant.int_quantize(x, bits, group)
    xh = intquant.int_dequantize(q)
    assert xh.shape == x.shape
    thr = intquant.mad_threshold(x)
    lim = 7 if bits == 4 else 127
    g = q.group
    exact = np.zeros(x.size, bool)
    exact[q.outlier_idx] = True
    exact = exact.reshape(x.shape)
    assert np.array_equal(exact, np.abs(x) > thr[:, None, :])
    assert np.array_equal(xh[exact], x[exact])
    for gi in range(q.scales.shape[2]):
        sl = slice(gi * g, (gi + 1) * g)
        s = q.scales[:, :, gi][:, None, :]  # [R, 1, C]
        err = np.abs(xh[:, sl] - x[:, sl])
        ok = exact[:, sl] | (err <= s * 0.5 * (1 + 1e-5) + 1e-30)
        assert ok.all()
        assert (s > 0).all()
        assert ((np.abs(x[:, sl]) <= s * lim * (1 + 1e-5) + 1e-30) | exact[:, sl]).all()


def test_int4_nibble_layout():
    # one channel, 3 tokens: codes (q + 8) low nibble first, odd tail padded with 0
    x = np.array([7.0, -7.0, 0.0], np.float32).reshape(1, 3, 1)
    q = intquant.int_quantize(x, 4)
    assert q.scales[0, 0, 0] == 1.0
    assert q.packed.shape == (1, 1, 2)
    assert q.packed[0, 0].tolist() == [(7 + 8) | ((-7 + 8) << 4), 8]
    q8 = intquant.int_quantize(np.array([127.0, -127.0, 1.0], np.float32).reshape(1, 3, 1), 8)
    assert q8.packed[0, 0].view(np.int8).tolist() == [127, -127, 1]


def test_int_quantize_rejects_bad_arguments():
    x = np.zeros((1, 4, 2), np.float32)
    with pytest.raises(ValueError, match="bits: expected 4 or 8"):
        intquant.int_quantize(x, 5)
    with pytest.raises(ValueError, match="group_size: expected None or an even int"):
        intquant.int_quantize(x, 4, 3)
    with pytest.raises(ValueError, match="x: expected a 3-D array"):
        intquant.int_quantize(x[0], 4)
    bad = x.copy()
    bad[0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="x: expected finite values"):
        intquant.int_quantize(bad, 4)


# --- low-rank statistics at extreme scales ---------------------------------------------------------
@pytest.mark.parametrize("scales", [(1e20, 1e20), (1e-30, 1e-30), (3e36, 1e-3)], ids=["huge", "tiny", "mixed"])
def test_stats_into_holds_any_finite_scale(rng, scales):
    # per-row scales: a float32 Gram overflows at |x| ~ 1e19/sqrt(n) and underflows to 0 near 1e-20
    x = (rng.standard_normal((2, 64, 8)) + 3.0) * np.array(scales)[:, None, None]
    x = x.astype(np.float32)
    assert np.isfinite(x).all()
    mean, amax, gram = (np.empty((2, 8), np.float32), np.empty((2, 8), np.float32), np.empty((2, 8, 8), np.float32))
    lowrank.stats_into(x, mean, amax, gram)
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(mean, x64.mean(1), rtol=1e-5)
    assert np.array_equal(amax, np.abs(x).max(1))
    want_scale = 2.0 ** np.ceil(np.log2(np.abs(x64).max((1, 2))))  # smallest power of two >= max|x| of the row
    assert np.array_equal(lowrank.row_scale(amax), want_scale)
    xc = (x64 - x64.mean(1, keepdims=True)) / want_scale[:, None, None]
    want = np.einsum("rti,rtj->rij", xc, xc)
    assert np.isfinite(gram).all()
    np.testing.assert_allclose(gram, want, rtol=2e-4, atol=2e-4 * np.abs(want).max())


def test_row_scale_edges():
    amax = np.array([[0.0], [1.0], [1.5], [2.0 ** -140], [np.finfo(np.float32).max]], np.float32)
    assert lowrank.row_scale(amax).tolist() == [2.0 ** -126, 1.0, 2.0, 2.0 ** -126, 2.0 ** 127]


def test_channel_stats_rejects_a_gram_beyond_float32(rng):
    x = (rng.standard_normal((1, 64, 4)) * 1e20).astype(np.float32)
    with pytest.raises(ValueError, match="x: expected a centred Gram matrix within the float32 range"):
        lowrank.channel_stats(x)


def test_accumulate_sums_stay_exact_past_2_to_the_24():
    """float32 running sums stopped growing at 2**24 × the value added: a cluster of 2**25
    points of 1.0 summed to 2**24, and k-means put its centroid at 0.5."""
    n = 2 ** 25
    x = np.ones((1, n, 1), np.float32)
    codes = np.zeros((1, n, 1), np.uint8)
    sums, counts = np.zeros((1, 1, 1), np.float64), np.zeros((1, 1), np.int32)
    vq.accumulate_into(x, codes, sums, counts)
    assert sums[0, 0, 0] == n and counts[0, 0] == n
    with pytest.raises(TypeError, match="sums: expected dtype float64"):
        vq.accumulate_into(x, codes, np.zeros((1, 1, 1), np.float32), counts)


def test_a_device_kmeans_gather_past_int32_rows_is_refused():
    """The device gather of k-means++ seeds takes int32 row indices: past 2**31 − 1
    sub-vectors they would wrap and read other rows (a stand-in array: no 8 GiB needed)."""

    class Big:  # a device array's shape and reshape, nothing else (the guard comes first)
        def __init__(self, shape):
            self.shape = shape

        def reshape(self, *shape):
            return Big(shape)

    with pytest.raises(ValueError, match=r"^x: 2,147,483,648 sub-vectors; k-means on a device"):
        vq._gather_subvectors(Big((2, 2 ** 29, 128)), np.array([0, 1]), 64)


def test_f16_row_scales_are_powers_of_two_per_row_and_checked():
    """``pow2_row_scales`` by formula (smallest ``2**e >= bound / 2**15``, 1 for 0), a scaled round
    trip equal to the unscaled one times the scale (exact: powers of two), and scales of the
    wrong count refused naming ``row_scale``."""
    s = lowrank.pow2_row_scales(np.array([0.0, 2.0 ** 15, 2.0 ** 15 + 1, 3e-20]))
    assert s.dtype == np.float32
    assert s.tolist() == [1.0, 1.0, 2.0, 2.0 ** int(np.ceil(np.log2(3e-20 / 2.0 ** 15)))]
    x = np.random.default_rng(1).standard_normal((4, 5)).astype(np.float32)
    h = lowrank.f16_encode(x * s[:, None], s)
    assert np.array_equal(h, lowrank.f16_encode(x))
    assert np.array_equal(lowrank.f16_decode(h, s), lowrank.f16_decode(h) * s[:, None])
    with pytest.raises(ValueError, match="^row_scale: expected float32 powers of two, one per row of h"):
        lowrank.f16_decode(h, np.ones(3, np.float32))
    # host scales of another float dtype are converted (exact for powers of two)
    assert np.array_equal(lowrank.f16_decode(h, s.astype(np.float64)), lowrank.f16_decode(h, s))


@pytest.mark.parametrize("kw, exc, match", [
    (dict(max_iter=-3), ValueError, r"^max_iter: expected an int >= 0, got -3"),
    (dict(max_iter=2.0), TypeError, r"^max_iter: expected an int"),
    (dict(tol=float("nan")), ValueError, r"^tol: expected a float >= 0, got nan"),
    (dict(tol="a"), TypeError, r"^tol: expected a float >= 0, got str 'a'"),
    (dict(per_row="no"), TypeError, r"^per_row: expected a bool, got str 'no'"),
    (dict(seed=-1), ValueError, r"^seed: expected an int >= 0, got -1"),
])
def test_kmeans_rejects_bad_arguments(rng, kw, exc, match):
    """Each bad argument raises naming it: ``max_iter=-3`` ran no iteration, ``tol=nan``
    disabled the inertia stop, and the string ``"no"`` switched per-row codebooks on."""
    x = rng.standard_normal((2, 50, 8)).astype(np.float32)
    args = dict(per_row=True)
    args.update(kw)
    per_row = args.pop("per_row")
    with pytest.raises(exc, match=match):
        vq.kmeans(x, 4, 2, per_row, **args)


def test_kmeans_and_decode_name_bad_arrays(rng):
    """A list or a 2-D array for ``x3``, and codes of the wrong rank, raise naming the argument
    (TypeError for the type, ValueError for the shape: the library's rule); ``max_iter=0``
    keeps the k-means++ seeds."""
    x = rng.standard_normal((2, 50, 8)).astype(np.float32)
    with pytest.raises(TypeError, match=r"^x3: expected a float array"):
        vq.kmeans(x.tolist(), 4, 2, True)
    with pytest.raises(ValueError, match=r"^x3: expected a 3-D array, got shape \(50, 8\)"):
        vq.kmeans(x[0], 4, 2, True)
    cb, iters = vq.kmeans(x, 4, 2, True, max_iter=0)
    assert iters == 0 and cb.shape == (8, 4, 2)
    codes, _ = vq.assign(x, cb)
    with pytest.raises(ValueError, match=r"^codes: expected a 3-D uint8 array, got shape \(50, 4\)"):
        vq.decode(codes[0], cb)
    with pytest.raises(TypeError, match=r"^codes: expected a 3-D uint8 array, got int64"):
        vq.decode(codes.astype(np.int64), cb)


def test_energy_of_the_wrong_type_is_a_type_error(rng):
    """``fit_components(energy="a")`` raised Python's own conversion error, naming nothing."""
    x = rng.standard_normal((1, 64, 16))
    mean, gram = x.mean(1), np.einsum("rnd,rne->rde", x, x) / 64
    with pytest.raises(TypeError, match=r"^energy: expected None or a float in \(0, 1\], got str 'a'"):
        lowrank.fit_components(mean, gram, 64, 4, energy="a")
    with pytest.raises(ValueError, match=r"^energy: expected None or a float in \(0, 1\], got 1.5"):
        lowrank.fit_components(mean, gram, 64, 4, energy=1.5)
