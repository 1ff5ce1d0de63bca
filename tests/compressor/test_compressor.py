"""KVCacheCompressor: layouts, round trips, exact byte counts, error bounds per method,
the seed's own cases, bad input."""

import re

import numpy as np
import pytest

from numba_kv.compressor import (
    VQ_MAX_ABS,
    CompressedKV,
    CompressionMethod,
    Hybrid,
    KVCacheCompressor,
    LowRank,
    VectorQuantization,
    lowrank_max_abs,
)
from numba_kv.ops import intquant, lowrank, vq

from .synth import nmse, synth_kv

METHODS = [
    (LowRank(8), 8),
    (LowRank(64, energy=None, dtype="float32"), 8),
    (VectorQuantization(16), 4),
    (VectorQuantization(32, subvector_dim=8, per_head=True), 8),
    (Hybrid(16, 4), 8),
    (Hybrid(24, 0, group_size=8, energy=None), 8),
]
IDS = ["lowrank", "lowrank-full-f32", "vq16-4bit", "pq-per-head", "hybrid-int4", "hybrid-int8-group"]


@pytest.fixture(scope="module")
def kv():
    rng = np.random.default_rng(5)
    return synth_kv(rng, 3, 40, 32, "k", batch=2), synth_kv(rng, 3, 40, 32, "v", batch=2)


@pytest.mark.parametrize("method, bits", METHODS, ids=IDS)
def test_roundtrip_4d_and_3d(kv, method, bits):
    k, v = kv
    comp = KVCacheCompressor(method, bits)
    c4 = comp.compress_kv(k, v)
    assert isinstance(c4, CompressedKV) and c4.layout == ("batched", 2, 3, 40)
    k4, v4 = comp.decompress_kv(c4)
    assert k4.shape == k.shape and v4.shape == v.shape and k4.dtype == np.float32
    c3 = comp.compress_kv_3d(k[1], v[1])
    assert c3.layout == ("unbatched", 3, 40)
    k3, v3 = comp.decompress_kv_3d(c3)
    assert k3.shape == k[1].shape
    for x, xh in ((k, k4), (v, v4), (k[1], k3), (v[1], v3)):
        assert nmse(x, xh) < 0.9
    # nbytes is the exact sum of every stored array; the ratio is computed from it
    for c in (c4, c3):
        want = sum(a.nbytes for t in (c.k, c.v) for a in t.arrays.values())
        assert c.nbytes == want
        assert c.compression_ratio == pytest.approx(c.original_nbytes / want)
        assert c.bits_per_value == pytest.approx(8 * want / (2 * c.k.num_values))


def test_layout_mismatch_is_an_error(kv):
    k, v = kv
    comp = KVCacheCompressor(LowRank(4))
    with pytest.raises(ValueError, match="compressed: expected batched layout"):
        comp.decompress_kv(comp.compress_kv_3d(k[0], v[0]))
    with pytest.raises(ValueError, match="compressed: expected unbatched layout"):
        comp.decompress_kv_3d(comp.compress_kv(k, v))


def test_input_dtypes_and_api_names(kv):
    k, v = kv
    comp = KVCacheCompressor(CompressionMethod.Hybrid(rank=8, quant_bits=4), quant_bits=8)
    assert comp.method == Hybrid(8, 4) and comp.quant_bits == 8
    a = comp.decompress_kv_3d(comp.compress_kv_3d(k[0].astype(np.float16), v[0].astype(np.float64)))
    assert a[0].dtype == np.float32 and a[0].shape == k[0].shape


def test_lowrank_bytes_formula(kv):
    k, v = kv
    c = KVCacheCompressor(LowRank(6, energy=None)).compress_kv(k, v)
    rows, n, d, r = 6, 40, 32, 6
    # mean (float32), basis and coefficients (binary16), one power-of-two coefficient scale per row
    assert c.k.nbytes == rows * d * 4 + rows * r * d * 2 + rows * n * r * 2 + rows * 4
    assert c.k.meta["rank"] == 6


# --- error bounds -------------------------------------------------------------------------------
def test_lowrank_error_is_the_pca_tail(kv):
    k, _ = kv
    x = k.reshape(6, 40, 32).astype(np.float64)
    xc = x - x.mean(1, keepdims=True)
    sv = np.linalg.svd(xc, compute_uv=False)  # [rows, 32]
    for r in (2, 5, 12):
        tail = (sv[:, r:] ** 2).sum() / (x ** 2).sum()
        for dt, slack in (("float32", 1e-6), ("float16", 2e-4)):
            comp = KVCacheCompressor(LowRank(r, energy=None, dtype=dt))
            xh, _ = comp.decompress_kv(comp.compress_kv(k, k))
            assert nmse(k, xh) <= tail * (1 + 1e-3) + slack


def test_full_rank_lowrank_is_nearly_lossless(kv):
    k, v = kv
    comp = KVCacheCompressor(LowRank(32, energy=None, dtype="float32"))
    kh, vh = comp.decompress_kv(comp.compress_kv(k, v))
    assert nmse(k, kh) < 1e-10 and nmse(v, vh) < 1e-10


def test_vq_error_is_the_distance_to_the_stored_codebook(kv):
    k, _ = kv
    comp = KVCacheCompressor(VectorQuantization(16, subvector_dim=8), 8)
    c = comp.compress_kv_3d(k[0], k[0])
    kh, _ = comp.decompress_kv_3d(c)
    x = k[0].reshape(3, 40, 32)
    cb = lowrank.f16_decode(c.k.arrays["codebooks"], c.k.arrays["codebook_scale"])
    _, dist = vq.assign(x, cb)
    err = ((kh.astype(np.float64) - x) ** 2).sum(-1)
    out = np.zeros(3 * 40, bool)
    out[c.k.arrays["outlier_idx"]] = True
    out = out.reshape(3, 40)
    assert np.all(err[out] == 0)  # outlier tokens exact
    np.testing.assert_allclose(err[~out], dist.sum(-1)[~out], rtol=1e-4, atol=1e-6)
    tok = dist.sum(-1).astype(np.float64).ravel()
    assert np.array_equal(out.ravel(), tok > tok.mean() + 3 * tok.std())  # seed's outlier rule
    assert c.k.arrays["codes"].nbytes == 3 * 40 * 4  # 8-bit codes, 4 sub-vectors per token


def test_vq_4bit_codes_are_packed(kv):
    k, _ = kv
    c = KVCacheCompressor(VectorQuantization(16), 4).compress_kv_3d(k[0], k[0])
    assert c.k.arrays["codes"].nbytes == 3 * 40 // 2
    assert c.k.arrays["codebooks"].dtype == np.uint16  # binary16 codebook


@pytest.mark.parametrize("bits", [4, 8])
def test_hybrid_error_is_bounded_by_the_quantization_step(kv, bits):
    k, _ = kv
    rank = 10
    ref = KVCacheCompressor(LowRank(rank, energy=None, dtype="float32"))
    hyb = KVCacheCompressor(Hybrid(rank, bits, energy=None, basis_dtype="float32"))
    x_lr, _ = ref.decompress_kv(ref.compress_kv(k, k))
    c = hyb.compress_kv(k, k)
    x_hy, _ = hyb.decompress_kv(c)
    comp = c.k.arrays["components"]  # [rows, rank, d], identical basis to LowRank(float32)
    scales = c.k.arrays["scales"][:, :, 0]  # one scale per (row, coefficient channel)
    bound = np.einsum("rcd,rc->rd", np.abs(comp), scales / 2)[:, None, :]  # triangle inequality
    diff = np.abs(x_hy.reshape(6, 40, 32) - x_lr.reshape(6, 40, 32))
    assert np.all(diff <= bound * (1 + 1e-4) + 1e-5)
    assert c.k.meta["num_outliers"] == c.k.arrays["outlier_idx"].shape[0] > 0  # outlier tokens exist


def test_hybrid_groups_reduce_error(kv):
    k, _ = kv
    e = {}
    for g in (None, 8):
        comp = KVCacheCompressor(Hybrid(12, 4, group_size=g, energy=None))
        e[g] = nmse(k, comp.decompress_kv(comp.compress_kv(k, k))[0])
    assert e[8] < e[None]


# --- the seed's own cases --------------------------------------------------------------------------
def test_seed_outlier_example_through_the_compressor():
    """§5.4: an outlier of 10.0 among [0.1, 0.2, 0.15] is restored (exactly, up to the f32 mean)."""
    seq = np.array([0.1, 0.2, 0.15, 10.0], np.float32)
    for bits in (4, 8):
        comp = KVCacheCompressor(Hybrid(4, bits))
        # 4 tokens of one channel: the per-channel MAD rule flags 10.0 as an outlier
        c = comp.compress_kv_3d(seq.reshape(1, 4, 1), seq.reshape(1, 4, 1))
        kh, _ = comp.decompress_kv_3d(c)
        assert c.k.meta["num_outliers"] == 1
        assert kh[0, 3, 0] == pytest.approx(10.0, rel=1e-6)
        # one token of 4 channels (the seed's flat layout): the mean stores it exactly
        c = comp.compress_kv_3d(seq.reshape(1, 1, 4), seq.reshape(1, 1, 4))
        kh, _ = comp.decompress_kv_3d(c)
        np.testing.assert_array_equal(kh.ravel(), seq)
    q = intquant.int_quantize(seq.reshape(1, 4, 1), 4)
    assert intquant.int_dequantize(q)[0, 3, 0] == np.float32(10.0)


def test_seed_vq_effective_bits_rules():
    KVCacheCompressor(VectorQuantization(16), 4)
    KVCacheCompressor(VectorQuantization(256), 8)
    with pytest.raises(ValueError, match=r"codebook_size: expected <= 16 for quant_bits=4, got 17"):
        KVCacheCompressor(VectorQuantization(17), 4)
    with pytest.raises(ValueError, match=r"codebook_size: expected an int in 1..256, got 300"):
        VectorQuantization(300)
    with pytest.raises(ValueError, match="codebook_size"):
        VectorQuantization(0)


def test_seed_vq_fewer_tokens_than_codewords():
    x = np.arange(3 * 8, dtype=np.float32).reshape(1, 3, 8)
    comp = KVCacheCompressor(VectorQuantization(16), 8)
    kh, _ = comp.decompress_kv_3d(comp.compress_kv_3d(x, x))
    np.testing.assert_allclose(kh, x, rtol=1e-3)  # each token is its own (f16) codeword


# --- bad input ----------------------------------------------------------------------------------------
def test_bad_methods_and_widths():
    with pytest.raises(ValueError, match=r"rank: expected an int >= 1, got 0"):
        LowRank(0)
    with pytest.raises(ValueError, match=r"rank: expected an int >= 1, got 0"):
        Hybrid(0, 4)
    with pytest.raises(ValueError, match=r"quant_bits: expected 0 \(compressor default\), 4 or 8, got 6"):
        Hybrid(4, 6)
    with pytest.raises(ValueError, match=r"quant_bits: expected 4 or 8, got 5"):
        KVCacheCompressor(LowRank(4), 5)
    # a value of the wrong type is a TypeError, as rank's is (it was a ValueError)
    for make, message in ((lambda: KVCacheCompressor(LowRank(4), "8"), r"^quant_bits: expected 4 or 8, got str '8'$"),
                          (lambda: Hybrid(4, "4"), r"^quant_bits: expected 0 .* got str '4'$"),
                          (lambda: LowRank(4, energy="0.5"), r"^energy: expected None or a float in \(0, 1\], got str"),
                          (lambda: VectorQuantization(4, tol="x"), r"^tol: expected a float >= 0, got str 'x'$")):
        with pytest.raises(TypeError, match=message):
            make()
    with pytest.raises(TypeError, match="method: expected CompressionMethod"):
        KVCacheCompressor("lowrank")
    with pytest.raises(ValueError, match="energy"):
        LowRank(4, energy=1.5)
    with pytest.raises(ValueError, match="dtype"):
        LowRank(4, dtype="int8")
    with pytest.raises(ValueError, match="group_size"):
        Hybrid(4, 4, group_size=3)


def test_bad_tensors(kv):
    k, v = kv
    comp = KVCacheCompressor(LowRank(4))
    with pytest.raises(ValueError, match=r"v: expected \[batch, num_heads, seq_len\] = \(2, 3, 40\)"):
        comp.compress_kv(k, v[:, :, :39])
    with pytest.raises(ValueError, match="k: expected a 4-D array"):
        comp.compress_kv(k[0], v[0])
    with pytest.raises(ValueError, match="k: expected a 3-D array"):
        comp.compress_kv_3d(k, v)
    with pytest.raises(ValueError, match="k: expected a non-empty"):
        comp.compress_kv_3d(k[0, :, :0], v[0, :, :0])
    bad = k.copy()
    bad[0, 0, 0, 0] = np.inf
    with pytest.raises(ValueError, match="k: expected finite values"):
        comp.compress_kv(bad, v)
    with pytest.raises(TypeError, match="v: expected dtype float16, float32 or float64"):
        comp.compress_kv(k, v.astype(np.int32))
    with pytest.raises(ValueError, match="k: expected head_dim divisible by subvector_dim=5"):
        KVCacheCompressor(VectorQuantization(4, subvector_dim=5)).compress_kv(k, v)
    with pytest.raises(TypeError, match="compressed: expected a CompressedKV"):
        comp.decompress_kv((k, v))


# --- value range ---------------------------------------------------------------------------------
def _rank2(rng, rows=2, n=64, d=32):
    b = rng.standard_normal((2, d))
    return (rng.standard_normal((rows, n, 2)) @ b).astype(np.float32)  # exactly rank 2, [rows, n, d]


@pytest.mark.parametrize("method, tol", [(LowRank(4, dtype="float32"), 1e-5), (Hybrid(4, 8), 1e-2)],
                         ids=["lowrank-f32", "hybrid-int8"])
@pytest.mark.parametrize("scale", [1e-30, 1e18, 1e20, 1e30])
def test_lowrank_fit_holds_at_any_finite_scale(rng, method, tol, scale):
    # the float32 statistics overflowed (NaN / garbage) from ~1e18 and underflowed to 0 below ~1e-20
    x = _rank2(rng) * np.float32(scale)
    assert np.isfinite(x).all()
    comp = KVCacheCompressor(method)
    kh, vh = comp.decompress_kv_3d(comp.compress_kv_3d(x, x))
    assert np.isfinite(kh).all()
    assert np.abs(kh.astype(np.float64) - x).max() <= tol * np.abs(x).max()  # rank 2 <= 4: reconstructed
    assert np.array_equal(kh, vh)


def test_lowrank_range_limit(rng):
    d = 32
    limit = float(np.finfo(np.float32).max) / (4 * np.sqrt(d))
    assert lowrank_max_abs(d) == pytest.approx(limit, rel=1e-12)
    # worst case for the float32 sums at the limit: every channel at ±max, coefficient √d·max
    signs = np.where(rng.random((2, 64, 1)) < 0.5, -1.0, 1.0) * np.ones(d)
    x = (signs * (0.99 * limit)).astype(np.float32)
    for method in (LowRank(2, dtype="float32"), Hybrid(2, 8)):
        comp = KVCacheCompressor(method)
        kh, _ = comp.decompress_kv_3d(comp.compress_kv_3d(x, x))
        assert np.isfinite(kh).all()
        assert np.abs(kh.astype(np.float64) - x).max() <= 1e-2 * np.abs(x).max()
    big = (signs * (1.01 * limit)).astype(np.float32)
    small = _rank2(rng)
    for method in (LowRank(2, dtype="float32"), LowRank(2), Hybrid(2, 8)):
        comp = KVCacheCompressor(method)
        with pytest.raises(ValueError, match=r"k: expected max \|k\| <= 1\.5\d+e\+37 .*head_dim=32.*got 1\.5"):
            comp.compress_kv_3d(big, small)
        with pytest.raises(ValueError, match=r"v: expected max \|v\| <= "):
            comp.compress_kv_3d(small, big)


@pytest.mark.parametrize("method", [LowRank(4), VectorQuantization(16, subvector_dim=4)])
def test_float16_storage_keeps_its_accuracy_at_any_scale(rng, method):
    """``LowRank(dtype="float16")`` coefficients and VQ codewords are binary16 over a power of
    two per row / codebook set: data scaled by 2**-30 … 2**20 (exactly, so every float32 sum
    scales with it; VQ up to its range, 65504) decodes to the unit-scale result times the
    scale, within binary16's rounding. Before, LowRank's coefficients past 65504 were refused,
    and below ~1e-7 (LowRank) or ~1e-5 (VQ) binary16's subnormals dropped them: relative
    error 0.99 at 2**-30."""
    x = _rank2(rng)
    comp = KVCacheCompressor(method, 8)
    top = 2.0 ** 20 if isinstance(method, LowRank) else 2.0 ** 12
    assert np.abs(x).max() * top < (np.inf if isinstance(method, LowRank) else VQ_MAX_ABS)

    def rel_err(s):
        xs = (x * np.float32(s)).astype(np.float32)
        kh, _ = comp.decompress_kv_3d(comp.compress_kv_3d(xs, xs))
        return float(np.linalg.norm(kh.astype(np.float64) - xs) / np.linalg.norm(xs))

    unit = rel_err(1.0)
    for s in (2.0 ** -30, 2.0 ** -20, 2.0 ** 10, top):
        assert rel_err(s) <= unit * 1.01 + 2e-4, s


def test_vq_rejects_values_beyond_float16(rng):
    cw = rng.standard_normal((4, 32))
    x = cw[rng.integers(0, 4, (2, 64))]  # only 4 distinct vectors: 4 codewords hold them exactly
    at = (x * (65504.0 / np.abs(x).max())).astype(np.float32)  # max|x| = 65504, the largest float16
    assert np.abs(at).max() == 65504.0
    comp = KVCacheCompressor(VectorQuantization(4))
    kh, _ = comp.decompress_kv_3d(comp.compress_kv_3d(at, at))
    assert np.abs(kh - at).max() <= 2.0 ** -11 * 65504.0  # float16 rounding of the codewords
    above = (x * 1e5).astype(np.float32)
    for k, v, name in ((above, at, "k"), (at, above, "v")):
        want = f"{name}: expected max |{name}| <= 65504 (VectorQuantization's range), got "
        with pytest.raises(ValueError, match=re.escape(want + f"{np.abs(above).max():.6g}")):
            comp.compress_kv_3d(k, v)
    with pytest.raises(ValueError, match=r"k: expected max \|k\| <= 65504"):  # float64 input: checked as given
        comp.compress_kv_3d(at.astype(np.float64) * 1.01, at)
