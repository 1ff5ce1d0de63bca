"""MLA latent caches: DeepSeek-style joint latent + shared RoPE key (up-projection,
absorbed attention, least-squares append) and the seed's simplified form."""

import numpy as np
import pytest

from numba_kv.caches.mla import MLACache, SimpleMLACache
from numba_kv.caches.paged import OutOfPagesError
from numba_kv.compressor import KVCacheCompressor, LowRank

H, R, ROPE, NOPE, DV, L = 4, 32, 16, 24, 20, 2


@pytest.fixture
def mla(rng):
    w_uk = (rng.standard_normal((L, H, R, NOPE)) / np.sqrt(R)).astype(np.float32)
    w_uv = (rng.standard_normal((L, H, R, DV)) / np.sqrt(R)).astype(np.float32)
    return MLACache(num_pages=16, num_layers=L, num_heads=H, kv_lora_rank=R, qk_rope_head_dim=ROPE,
                    qk_nope_head_dim=NOPE, v_head_dim=DV, w_uk=w_uk, w_uv=w_uv, page_size=4)


def _latent(rng, n):
    return rng.standard_normal((n, R)).astype(np.float32), rng.standard_normal((n, ROPE)).astype(np.float32)


def test_latent_storage_and_up_projection(mla, rng):
    s = mla.allocate_sequence()
    c, pe = _latent(rng, 7)
    mla.append_latent(1, s, c[:3], pe[:3])
    mla.append_latent(1, s, np.concatenate([c[3:], pe[3:]], axis=1))  # concatenated form
    assert mla.seq_len(1, s) == 7 and mla.seq_len(0, s) == 0
    cc, pp = mla.get_latent(1, s)
    assert np.array_equal(cc, c) and np.array_equal(pp, pe)
    # one paged vector per token, shared by every head
    assert mla.paged.num_kv_heads == 1 and mla.paged.head_dim == R + ROPE and not mla.paged.has_values
    k, v = mla.get_kv(1, s)
    assert k.shape == (H, 7, NOPE + ROPE) and v.shape == (H, 7, DV)
    w_uk, w_uv = mla.w_uk[1], mla.w_uv[1]
    np.testing.assert_allclose(k[:, :, :NOPE], np.einsum("tr,hrn->htn", c, w_uk), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(k[:, :, NOPE:], np.broadcast_to(pe, (H, 7, ROPE)))
    np.testing.assert_allclose(v, np.einsum("tr,hrv->htv", c, w_uv), rtol=1e-5, atol=1e-5)
    assert mla.memory_usage() == 2 * 4 * (R + ROPE) * 4  # 2 pages of 4 tokens, float32 latent


@pytest.mark.parametrize("causal", [False, True])
def test_absorbed_attention_equals_up_projected_attention(mla, rng, causal):
    s = mla.allocate_sequence()
    c, pe = _latent(rng, 11)
    mla.append_latent(0, s, c, pe)
    q = rng.standard_normal((H, 3, NOPE + ROPE)).astype(np.float32)
    scale = 1.0 / np.sqrt(NOPE + ROPE)
    ref = mla.attend(0, s, q, scale, causal=causal)
    q_nope, q_pe = np.ascontiguousarray(q[:, :, :NOPE]), np.ascontiguousarray(q[:, :, NOPE:])
    out = mla.attend_absorbed(0, s, q_nope, q_pe, scale, causal=causal)
    assert out.shape == (H, 3, DV)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)


def test_full_kv_append_recovers_the_latent(mla, rng):
    s, t = mla.allocate_sequence(), mla.allocate_sequence()
    c, pe = _latent(rng, 6)
    mla.append_latent(0, s, c, pe)
    k, v = mla.get_kv(0, s)
    mla.append(0, t, k, v)  # least squares back to the latent: exact (full row rank)
    cc, pp = mla.get_latent(0, t)
    np.testing.assert_allclose(cc, c, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(pp, pe, rtol=1e-6, atol=1e-6)


def test_pqo_latent_pages(rng):
    w = (rng.standard_normal((H, R, NOPE)) / 6).astype(np.float32)  # 3-D: shared by layers
    mla = MLACache(4, 1, H, R, 32, NOPE, NOPE, w, w, storage="pqo3")
    s = mla.allocate_sequence()
    c, _ = _latent(rng, 5)
    pe = rng.standard_normal((5, 32)).astype(np.float32)
    mla.append_latent(0, s, c, pe)
    cc, pp = mla.get_latent(0, s)
    err = ((cc - c) ** 2).sum() / (c ** 2).sum()
    assert 0 < err < 0.05
    assert mla.paged.pools["k_codes"].shape == (4, 1, 16, (R + 32) * 3 // 8)


def test_mla_bad_input(mla, rng):
    s = mla.allocate_sequence()
    c, pe = _latent(rng, 2)
    with pytest.raises(ValueError, match=r"c_kv: expected \[new_tokens, kv_lora_rank=32\]"):
        mla.append_latent(0, s, c[:, :5], pe)
    with pytest.raises(ValueError, match=r"k_pe: expected shape \(2, 16\)"):
        mla.append_latent(0, s, c, pe[:1])
    with pytest.raises(ValueError, match=r"c_kv: expected \[new_tokens, 48\]"):
        mla.append_latent(0, s, c)
    with pytest.raises(KeyError, match="seq_id"):
        mla.append_latent(0, 9, c, pe)
    with pytest.raises(ValueError, match=r"w_uk: expected shape \(4, 32, 24\)"):
        MLACache(4, 2, H, R, ROPE, NOPE, DV, np.zeros((H, R, NOPE + 1)), np.zeros((H, R, DV)))
    with pytest.raises(ValueError, match=r"q_pe: expected \[num_heads=4, 1, 16\]"):
        mla.attend_absorbed(0, s, np.zeros((H, 1, NOPE)), np.zeros((H, 2, ROPE)), 1.0)
    assert mla.seq_len(0, s) == 0 and mla.num_free_pages == 16
    small = MLACache(1, 1, H, R, ROPE, NOPE, DV, mla.w_uk[0], mla.w_uv[0], page_size=4)
    t = small.allocate_sequence()
    c, pe = _latent(rng, 5)
    with pytest.raises(OutOfPagesError):
        small.append_latent(0, t, c, pe)
    assert small.seq_len(0, t) == 0


def _attend(mla, how, s, q, scale, causal=False):
    if how == "absorbed":
        return mla.attend_absorbed(0, s, np.ascontiguousarray(q[:, :, :NOPE]), np.ascontiguousarray(q[:, :, NOPE:]),
                                   scale, causal=causal)
    return mla.attend(0, s, q, scale, causal=causal)


@pytest.mark.parametrize("how", ["absorbed", "up-projected"])
def test_mla_attention_refuses_what_would_give_nan(mla, rng, how):
    """The attention helpers check what the paged cache's attention checks: every causal query
    row sees a token (7 rows over 5 tokens gave NaN rows), the query is finite, the scale is a
    real number in (0, 2**30] (NaN gave NaN, -1 was taken, a string was an unnamed error)."""
    s, empty = mla.allocate_sequence(), mla.allocate_sequence()
    mla.append_latent(0, s, *_latent(rng, 5))
    q = rng.standard_normal((H, 7, NOPE + ROPE)).astype(np.float32)
    with pytest.raises(ValueError, match=r"seq_id: expected .*q_len=7.* it holds 5"):
        _attend(mla, how, s, q, 0.1, causal=True)
    with pytest.raises(ValueError, match=r"seq_id: sequence \d+ holds no tokens in layer 0"):
        _attend(mla, how, empty, q, 0.1)
    bad = q.copy()
    bad[1, 2, NOPE + 3] = np.nan  # in the rotary part: q_pe for the absorbed form
    with pytest.raises(ValueError, match="q_pe" if how == "absorbed" else "q"):
        _attend(mla, how, s, bad, 0.1)
    for scale in (float("nan"), -1.0, 0.0, float("inf"), 2.0 ** 31):
        with pytest.raises(ValueError, match="softmax_scale"):
            _attend(mla, how, s, q[:, :1], scale)
    with pytest.raises(TypeError, match="softmax_scale"):
        _attend(mla, how, s, q[:, :1], "x")
    assert mla.seq_len(0, s) == 5 and mla.seq_len(0, empty) == 0
    # the boundary is accepted: 5 causal rows over 5 tokens, the last row sees them all
    out = _attend(mla, how, s, q[:, :5], 0.1, causal=True)
    assert out.shape == (H, 5, DV) and np.isfinite(out).all()


def test_compressor_on_mla_cache(mla, rng):
    s, t = mla.allocate_sequence(), mla.allocate_sequence()
    c, pe = _latent(rng, 8)
    mla.append_latent(1, s, c, pe)
    comp = KVCacheCompressor(LowRank(64, energy=None, dtype="float32"))
    cz = comp.compress_mla_cache(mla, 1, s)  # K and V widths differ (48 vs 20)
    assert cz.k.shape == (H, 8, NOPE + ROPE) and cz.v.shape == (H, 8, DV)
    comp.decompress_to_mla_cache(cz, mla, 1, t)
    np.testing.assert_allclose(mla.get_latent(1, t)[0], c, rtol=1e-3, atol=1e-3)


# --- the seed's simplified form ------------------------------------------------------------------
def test_simple_mla_matches_the_seed_formulas(rng):
    d, lat = 16, 8
    down = rng.standard_normal((d, lat)).astype(np.float32)
    up = rng.standard_normal((lat, d)).astype(np.float32)
    rk = rng.standard_normal((lat, d)).astype(np.float32)
    cache = SimpleMLACache(8, 2, 3, d, lat, down, up, rk, page_size=4)
    s = cache.allocate_sequence()
    k = rng.standard_normal((3, 5, d)).astype(np.float32)
    v = rng.standard_normal((3, 5, d)).astype(np.float32)
    cache.append(0, s, k, v)
    kl, vl = cache.get_compressed_kv(0, s)
    np.testing.assert_allclose(kl, k @ down, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(vl, v @ down, rtol=1e-5, atol=1e-5)
    kk, vv = cache.get_kv(0, s)
    np.testing.assert_allclose(kk, kl @ up + kl @ rk, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(vv, vl @ up, rtol=1e-4, atol=1e-4)
    cache.append_compressed(0, s, kl[:, :1], vl[:, :1])
    assert cache.seq_len(0, s) == 6
    comp = KVCacheCompressor(LowRank(16, energy=None, dtype="float32"))
    t = cache.allocate_sequence()
    comp.decompress_to_mla_cache(comp.compress_mla_cache(cache, 0, s), cache, 0, t)
    assert cache.seq_len(0, t) == 6
    with pytest.raises(ValueError, match=r"k: expected \[num_heads=3, new_tokens >= 1, 16\]"):
        cache.append(0, s, k[:2], v[:2])
    with pytest.raises(ValueError, match=r"up_proj: expected shape \(8, 16\)"):
        SimpleMLACache(8, 2, 3, d, lat, down, up.T, rk)
    with pytest.raises(TypeError, match=r"rope_key: expected a float array \(latent_dim, head_dim\), got int"):
        SimpleMLACache(8, 2, 3, d, lat, down, up, 16)  # a size where the array goes


def test_mla_validate_is_the_pages_mode(mla, rng):
    """``validate`` of an MLA cache is its paged cache's: full ``k``/``v`` and latents are read
    under "sync"/"auto" (a rejected append stores nothing) and stored unchecked under "off"."""
    s = mla.allocate_sequence()
    k = rng.standard_normal((H, 2, NOPE + ROPE)).astype(np.float32)
    v = rng.standard_normal((H, 2, DV)).astype(np.float32)
    k[1, 0, 3] = np.inf
    assert mla.validate == mla.paged.validate == "auto"
    with pytest.raises(ValueError, match="k: expected finite values"):
        mla.append(0, s, k, v)
    c, pe = _latent(rng, 2)
    c[0, 0] = np.nan
    with pytest.raises(ValueError, match="c_kv/k_pe: expected finite values"):
        mla.append_latent(0, s, c, pe)
    assert mla.seq_len(0, s) == 0
    mla.validate = "off"
    assert mla.paged.validate == "off"
    mla.append_latent(0, s, c, pe)
    assert mla.seq_len(0, s) == 2
    mla.check_inputs()
    simple = SimpleMLACache(4, 1, 2, 8, 4, *(rng.standard_normal(sh).astype(np.float32)
                                             for sh in ((8, 4), (4, 8), (4, 8))))
    t = simple.allocate_sequence()
    kk = rng.standard_normal((2, 1, 8)).astype(np.float32)
    with pytest.raises(ValueError, match="v: expected finite values"):
        simple.append(0, t, kk, np.full_like(kk, np.nan))
    simple.validate = "off"
    simple.append(0, t, kk, np.full_like(kk, np.nan))
    assert simple.seq_len(0, t) == 1


def test_projections_beyond_float32_are_refused_by_name():
    """A finite float64 projection past the float32 range became inf when stored, and an
    ``up_proj + rope_key`` sum overflowed in float32: the constructors then failed naming an
    internal ``limit`` (or built a cache whose every append failed, blaming ``k``)."""
    ok = np.full((64, 32), 0.01, np.float32)
    with pytest.raises(ValueError, match=r"^down_proj: expected values within the float32 range"):
        SimpleMLACache(4, 1, 1, 64, 32, np.full((64, 32), 1e300), ok.T, ok.T)
    big = np.full((32, 64), 2e38, np.float32)  # finite, but big + big is not
    with pytest.raises(ValueError, match=r"^up_proj, rope_key: expected a sum up_proj \+ rope_key within"):
        SimpleMLACache(4, 1, 1, 64, 32, ok, big, big)
    with pytest.raises(ValueError, match=r"^w_uk: expected values within the float32 range"):
        MLACache(4, 1, 2, 32, 0, 16, 16, np.full((2, 32, 16), 1e300), np.ones((2, 32, 16)))


@pytest.mark.parametrize("which", ["attend", "attend_absorbed"])
def test_attention_refuses_queries_past_two_to_the_64(mla, rng, which):
    """Finite float64 queries of 1e300 overflowed the float64 logits: NaN came back.  The
    caches' decode rule (|q| <= 2**64) applies; the same call just inside it is finite."""
    s = mla.allocate_sequence()
    c, pe = _latent(rng, 3)
    mla.append_latent(0, s, c * 1e20, pe)
    def call(scale):
        q_nope, q_pe = np.full((H, 1, NOPE), scale), np.zeros((H, 1, ROPE))
        if which == "attend":
            return mla.attend(0, s, np.concatenate([q_nope, q_pe], 2), 0.1)
        return mla.attend_absorbed(0, s, q_nope, q_pe, 0.1)

    with pytest.raises(ValueError, match=r"expected \|values\| <= 2\*\*64"):
        call(1e300)
    assert np.isfinite(call(2.0**64 / 2)).all()


def test_causal_must_be_a_bool(mla, rng):
    s = mla.allocate_sequence()
    mla.append_latent(0, s, *_latent(rng, 5))
    q = rng.standard_normal((H, 2, NOPE + ROPE)).astype(np.float32)
    with pytest.raises(TypeError, match="causal: expected a bool"):
        mla.attend(0, s, q, 0.1, causal="no")
    with pytest.raises(TypeError, match="causal: expected a bool"):
        mla.attend_absorbed(0, s, q[..., :NOPE], q[..., NOPE:], 0.1, causal="yes")


def test_latent_appends_name_the_callers_arguments(mla, rng):
    """``SimpleMLACache.append_compressed`` takes ``k_lat``/``v_lat`` (its messages said ``k``/``v``);
    ``MLACache.append_latent`` of no tokens showed an internal reshaped shape; nothing is stored."""
    s = mla.paged.allocate_sequence()
    with pytest.raises(ValueError, match=r"^c_kv: expected new_tokens >= 1 \(axis 0\), got shape \(0, 32\)$"):
        mla.append_latent(0, s, np.zeros((0, R), np.float32), np.zeros((0, ROPE), np.float32))
    simple = SimpleMLACache(8, 1, 2, 32, 16, np.ones((32, 16), np.float32) / 32, np.ones((16, 32), np.float32),
                            np.zeros((16, 32), np.float32))
    t = simple.paged.allocate_sequence()
    lat = np.ones((2, 3, 16), np.float32)
    with pytest.raises(ValueError, match=r"^k_lat: expected \[num_heads=2, new_tokens >= 1, 16\]"):
        simple.append_compressed(0, t, lat[:, :, :15], lat)
    with pytest.raises(ValueError, match=r"^v_lat: expected the shape of k_lat"):
        simple.append_compressed(0, t, lat, lat[:1].repeat(2, 0)[:, :2])
    assert simple.paged.seq_len(0, t) == 0 and mla.paged.seq_len(0, s) == 0
