"""TurboQuantCache: storage, exact memory, the QJL logit bias and its unbiasedness,
fused attention == dequantized + bias, bad configurations."""

import numpy as np
import pytest

from numba_kv import AttendConfig, Dequantized, Fused, make_cache, reference
from numba_kv.caches.turboquant import TurboQuantCache
from numba_kv.ops.codebook import get_codebook
from numba_kv.ops.qjl import make_sketch

H, D = 2, 128


def kv(rng, s, d=D, outliers=True):
    k = rng.standard_normal((1, H, s, d)).astype(np.float32)
    v = rng.standard_normal((1, H, s, d)).astype(np.float32)
    if outliers:
        k[..., 3] += 6.0
        k[..., 40] *= 5.0
    return k, v


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("d", [64, 128])
def test_bits_per_value_exact(bits, d):
    c = TurboQuantCache(1, 1, d, bits=bits)
    # keys: (b-1)-bit indices in (b-1)-bit slots + f16 scale per 32 + m = d sign bits + f16 residual norm
    assert c.k_bits_per_value == (bits - 1) + 16 / 32 + 1 + 16 / d
    # values: all b bits to the MSE quantizer (PQO)
    assert c.v_bits_per_value == bits + 16 / 32
    assert c.bits_per_value == (c.k_bits_per_value + c.v_bits_per_value) / 2
    assert c.codebooks["k"] is get_codebook(bits - 1, "maxnorm")
    assert c.codebooks["v"] is get_codebook(bits, "maxnorm")
    assert c.name == f"tq{bits}-r32-s4"


def test_memory_usage_counts_every_live_buffer(rng):
    c = make_cache("tq3", num_layers=2, num_kv_heads=H, head_dim=D, residual_length=8, sink_tokens=2)
    c.prefill(0, *kv(rng, 30))
    for _ in range(3):
        k1, v1 = kv(rng, 1)
        c.decode(0, k1, v1, rng.standard_normal((1, 2 * H, 1, D)).astype(np.float32), AttendConfig(D ** -0.5, 2))
    n_comp = 33 - 10
    per_comp = (D * 2 // 8 + 4 * 2) + (D * 3 // 8 + 4 * 2) + D // 8 + 2  # K codes+scales, V, QJL signs+norm
    window = 10 * 2 * D * 2  # K and V float16
    assert c.memory_usage() == H * (n_comp * per_comp + window)
    assert c.memory_usage() == sum(a.nbytes for a in c.live_arrays(0))


def test_first_prefill_is_lossless_and_has_no_bias(rng):
    c = make_cache("tq3", num_layers=1, num_kv_heads=H, head_dim=D, residual_length=0, sink_tokens=0)
    k, v = kv(rng, 20)
    r = c.prefill(0, k, v, q=rng.standard_normal((1, 2 * H, 20, D)).astype(np.float32))
    assert r.k is k and r.v is v and r.logit_bias is None


def test_later_prefill_bias_only_with_q_and_only_on_compressed_tokens(rng):
    c = make_cache("tq3", num_layers=1, num_kv_heads=H, head_dim=D, residual_length=4, sink_tokens=2)
    c.prefill(0, *kv(rng, 20))
    k2, v2 = kv(rng, 3)
    q = rng.standard_normal((1, 2 * H, 3, D)).astype(np.float32)
    r = c.prefill(0, k2, v2, q=q)
    assert r.logit_bias.shape == (1, 2 * H, 3, 23) and r.logit_bias.dtype == np.float32
    n_comp = 23 - 6
    assert np.all(r.logit_bias[..., :2] == 0) and np.all(r.logit_bias[..., 2 + n_comp:] == 0)
    assert np.all(r.logit_bias[..., 2:2 + n_comp] != 0)
    assert c.prefill(0, *kv(rng, 1)).logit_bias is None


def _bias_by_hand(c, q, scale):
    """softmax_scale · ‖r‖·√(π/2)/m · ⟨S q, sign(S r)⟩ from the stored signs and norms, in NumPy."""
    st = c._layers[0]
    n = st.meta["n_comp"]
    S = make_sketch(D).astype(np.float64)
    bits = np.unpackbits(st.buffers["k_qjl"][:, :n], axis=2, bitorder="little").astype(np.float64) * 2 - 1
    norms = st.buffers["k_rnorm"][:, :n, 0].view(np.float16).astype(np.float64)
    g = q.reshape(H, -1, D).astype(np.float64) @ S.T  # [H, rows, m]
    return scale * np.sqrt(np.pi / 2) / D * np.einsum("grm,gtm->grt", g, bits) * norms[:, None, :]


@pytest.mark.parametrize("name", ["tq2", "tq3", "tq4-l2", "tq-k4v3", "tq3-head", "tq2-eden"])
@pytest.mark.parametrize("window", [False, True])
def test_fused_equals_dequantized_plus_bias(name, window, rng):
    opts = dict(residual_length=8, sink_tokens=2) if window else dict(residual_length=0, sink_tokens=0)
    fused = make_cache(name, num_layers=1, num_kv_heads=H, head_dim=D, **opts)
    deq = make_cache(name, num_layers=1, num_kv_heads=H, head_dim=D, decode_output="dequantized", **opts)
    k, v = kv(rng, 150)
    fused.prefill(0, k, v)
    deq.prefill(0, k, v)
    cfg = AttendConfig(0.1, 2)
    for _ in range(2):
        k1, v1 = kv(rng, 1)
        q = rng.standard_normal((1, 2 * H, 1, D)).astype(np.float32)
        out = fused.decode(0, k1, v1, q, cfg)
        res = deq.decode(0, k1, v1, q, cfg)
    assert isinstance(out, Fused) and isinstance(res, Dequantized)
    r = res.result
    st = deq._layers[0]
    n_sink, n = st.meta["n_sink"], st.meta["n_comp"]
    hand = _bias_by_hand(deq, q, 0.1)
    np.testing.assert_allclose(r.logit_bias[0, :, 0, n_sink:n_sink + n].reshape(H, 2, n), hand, rtol=1e-4, atol=1e-5)
    ref = reference.attention(q, r.k, r.v, 0.1, r.logit_bias)
    np.testing.assert_allclose(out.out, ref, rtol=2e-5, atol=2e-6)


def _logit_pairs(bits, rng, n_keys=256, n_q=16, seeds=range(12)):
    """(estimated, true) unscaled logits q·k over fresh sketch seeds and data."""
    est, true = [], []
    for seed in seeds:
        cc = TurboQuantCache(1, H, D, bits=bits, qjl_seed=1000 + seed, residual_length=0, sink_tokens=0,
                             decode_output="dequantized", norm_mode="l2")
        x = rng.standard_normal((1, H, n_keys, D)).astype(np.float32)
        x /= np.linalg.norm(x, axis=-1, keepdims=True)
        cc.prefill(0, x[:, :, :1], x[:, :, :1])  # the first prefill is returned losslessly
        cc.prefill(0, x[:, :, 1:], x[:, :, 1:])
        q = rng.standard_normal((1, 2 * H, n_q, D)).astype(np.float32)
        q /= np.linalg.norm(q, axis=-1, keepdims=True)
        res = cc.decode(0, x[:, :, :1], x[:, :, :1], q[:, :, :1], AttendConfig(1.0, 2))
        st = cc._layers[0]
        khat = res.result.k[0].astype(np.float64)  # [H, T, D]
        bias = res.result.logit_bias[0, :, 0].reshape(H, 2, -1)  # scale 1: q·k units
        qq = q[0, :, 0].reshape(H, 2, D).astype(np.float64)
        xx = np.concatenate([x, x[:, :, :1]], 2)[0].astype(np.float64)
        est.append((np.einsum("gqd,gtd->gqt", qq, khat) + bias)[:, :, 1:n_keys].ravel())
        true.append(np.einsum("gqd,gtd->gqt", qq, xx)[:, :, 1:n_keys].ravel())
        assert st.meta["n_comp"] == n_keys + 1
    return np.concatenate(est), np.concatenate(true)


@pytest.mark.parametrize("bits, d_prod", [(3, 0.173), (4, 0.051)])
def test_qjl_inner_product_is_unbiased_with_the_paper_variance(bits, d_prod, rng):
    est, true = _logit_pairs(bits, rng)
    err = est - true
    assert len(err) >= 12_000
    assert abs(err.mean()) < 4 * err.std() / np.sqrt(len(err))
    slope = (est * true).sum() / (true * true).sum()
    assert 0.97 < slope < 1.03
    # d·E[(est − true)²] within 10 % of algorithms.md §3.4 (unit vectors, L2 block quantizer)
    assert abs(D * np.mean(err ** 2) / d_prod - 1) < 0.10


def test_sketch_seed_is_independent_and_deterministic(rng):
    k, v = kv(rng, 40)
    a, b, c = (TurboQuantCache(1, H, D, qjl_seed=s, residual_length=0, sink_tokens=0) for s in (1, 1, 2))
    for x in (a, b, c):
        x.prefill(0, k, v)
    sa, sb, sc = (x._layers[0].buffers["k_qjl"][:, :40] for x in (a, b, c))
    assert np.array_equal(sa, sb) and not np.array_equal(sa, sc)
    # the base codes do not depend on the sketch
    assert np.array_equal(a._layers[0].buffers["k_codes"][:, :40], c._layers[0].buffers["k_codes"][:, :40])


@pytest.mark.parametrize("kwargs, word", [
    (dict(bits=5), "bits"), (dict(bits=1), "bits"), (dict(k_bits=6), "k_bits"), (dict(v_bits=5), "v_bits"),
    (dict(mode="pqo"), "mode"),
    (dict(qjl_dim=12), "m"), (dict(outlier_channels=32), "outlier_channels"), (dict(norm_mode="abs"), "norm_mode"),
    (dict(qjl_seed=-1), "seed"),
])
def test_bad_configs(kwargs, word):
    with pytest.raises((ValueError, TypeError), match=word):
        TurboQuantCache(1, 1, 64, **kwargs)


def test_factory_names():
    assert isinstance(make_cache("tq-k4v3", num_layers=1, num_kv_heads=1, head_dim=64), TurboQuantCache)
    c = make_cache("tq3-l2", num_layers=1, num_kv_heads=1, head_dim=64)
    assert c.norm_mode == "l2" and c.name.startswith("tq3-l2")
    with pytest.raises(ValueError, match="name"):
        make_cache("tq5", num_layers=1, num_kv_heads=1, head_dim=64)
    with pytest.raises(ValueError, match="name"):
        make_cache("tq2.5", num_layers=1, num_kv_heads=1, head_dim=64)
