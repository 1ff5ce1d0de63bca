"""Protocol conformance and semantics of every cache name; bad input leaves caches unchanged."""

import dataclasses

import numpy as np
import pytest

from numba_kv import (
    CACHE_NAMES,
    AttendConfig,
    CompressedKVCache,
    DenseCache,
    Dequantized,
    DequantResult,
    Fused,
    PolarQuantCache,
    make_cache,
)
from numba_kv.caches._layer import grown_capacity

L, H, D = 3, 2, 64


def kv(rng, b=1, s=5, h=H, d=D, dtype=np.float32):
    return (rng.standard_normal((b, h, s, d)).astype(dtype), rng.standard_normal((b, h, s, d)).astype(dtype))


def q_of(rng, b=1, groups=2, s=1, d=D, dtype=np.float32):
    return rng.standard_normal((b, H * groups, s, d)).astype(dtype)


CFG = AttendConfig(softmax_scale=D ** -0.5, n_kv_groups=2)


@pytest.fixture(params=CACHE_NAMES + ("pqo3-window", "tq3-window", "pqo3-head-eden", "tq3-l2-head", "pqo-k3v2-eden",
                                      "pqo3-int8window"))
def cache(request):
    if request.param.endswith("-window"):  # the default window and sinks
        return make_cache(request.param[:-7], num_layers=L, num_kv_heads=H, head_dim=D)
    if request.param.endswith("-int8window"):
        return make_cache(request.param[:-11], num_layers=L, num_kv_heads=H, head_dim=D, window_dtype="int8")
    opts = {} if request.param == "dense" else {"residual_length": 0, "sink_tokens": 0}
    return make_cache(request.param, num_layers=L, num_kv_heads=H, head_dim=D, **opts)


def snapshot(c):
    """Everything observable about a cache's state."""
    return (c.memory_usage(), [c.seq_len(i) for i in range(L)],
            [[np.array(a, copy=True) for a in c.live_arrays(i)] for i in range(L)])


def same(a, b):
    return a[0] == b[0] and a[1] == b[1] and all(
        all(np.array_equal(x, y) for x, y in zip(la, lb)) for la, lb in zip(a[2], b[2]))


def test_protocol_conformance(cache):
    assert isinstance(cache, CompressedKVCache)
    assert cache.seq_len(0) == 0 and cache.memory_usage() == 0


def test_semantics(cache, rng):
    k, v = kv(rng, b=2, s=7)
    r = cache.prefill(0, k, v)
    assert isinstance(r, DequantResult) and r.k is k and r.v is v and r.logit_bias is None
    k2, v2 = kv(rng, b=2, s=3)
    r2 = cache.prefill(0, k2, v2, q_of(rng, b=2, s=3))
    assert r2.k.shape == (2, H, 10, D) and r2.v.shape == (2, H, 10, D) and r2.k.dtype == np.float32
    k3, v3 = kv(rng, b=2, s=1)
    q = q_of(rng, b=2)
    out = cache.decode(0, k3, v3, q, CFG)
    assert cache.seq_len(0) == 11 and cache.seq_len(1) == 0
    if isinstance(out, Fused):  # compressed caches attend from the packed codes
        assert out.out.shape == (2, 2 * H, 1, D) and out.out.dtype == np.float32
        hist = cache.prefill(0, *kv(rng, b=2, s=1)).k[:, :, :11]
    else:
        assert isinstance(out, Dequantized) and out.result.k.shape == (2, H, 11, D)
        hist = out.result.k
    # the history is the stored tokens in order (exact for dense, close for the others)
    full_k = np.concatenate([k, k2, k3], axis=2)
    cos = (hist * full_k).sum(-1) / np.linalg.norm(hist, axis=-1) / np.linalg.norm(full_k, axis=-1)
    assert cos.min() > (0.9999 if cache.name == "dense" else 0.6)
    cache.reset()
    assert cache.seq_len(0) == 0 and cache.memory_usage() == 0 and cache.allocated_bytes() == 0


def test_memory_usage_is_live_nbytes(cache, rng):
    for layer, s in ((0, 5), (0, 200), (2, 3)):
        cache.prefill(layer, *kv(rng, b=2, s=s))
    live = sum(a.nbytes for i in range(L) for a in cache.live_arrays(i))
    assert cache.memory_usage() == live
    assert cache.allocated_bytes() >= live
    if isinstance(cache, PolarQuantCache) and not cache.windowed:
        # K + V bytes per token, counted by hand: codes + f16 scales (+ QJL signs and norm)
        per_token = sum(cache.packed_dims.values()) + 2 * sum(lay.num_scales for lay in cache.layouts.values())
        if cache.mode == "tq":
            per_token += cache.qjl_dim // 8 + 2
        # per used layer and row: int16 channel permutations of K and V (channel splits only)
        per_row = 2 * D * 2 if cache.outlier_channels else 0
        rows = 2 * H
        assert cache.memory_usage() == rows * (205 + 3) * per_token + 2 * rows * per_row
        assert cache.bits_per_value == 8 * per_token / (2 * D)


def test_pqo3_is_3_5_bits_and_pq3_is_2_5_bits():
    assert make_cache("pqo3", num_layers=1, num_kv_heads=1, head_dim=128).bits_per_value == 3.5
    assert make_cache("pq3", num_layers=1, num_kv_heads=1, head_dim=128).bits_per_value == 2.5
    assert make_cache("pqo4", num_layers=1, num_kv_heads=1, head_dim=128).bits_per_value == 4.5


def test_growth_rule():
    assert grown_capacity(16) == 144 and grown_capacity(1000) == 1250
    c = make_cache("pqo3", num_layers=1, num_kv_heads=H, head_dim=D, residual_length=0, sink_tokens=0)
    rng = np.random.default_rng(0)
    c.prefill(0, *kv(rng, s=16))
    assert c._layers[0].capacity == 144
    c.prefill(0, *kv(rng, s=200))  # grows, keeps the first tokens
    assert c._layers[0].capacity == grown_capacity(216) and c.seq_len(0) == 216


def test_growth_preserves_codes(rng):
    c = make_cache("pqo3", num_layers=1, num_kv_heads=H, head_dim=D, residual_length=0, sink_tokens=0)
    k, v = kv(rng, s=100)
    c.prefill(0, k, v)
    before = [np.array(a) for a in c.live_arrays(0)]
    c.prefill(0, *kv(rng, s=300))
    after = [np.array(a)[:, :100] for a in c.live_arrays(0)]
    assert all(np.array_equal(x, y) for x, y in zip(before, after))


@pytest.mark.parametrize("name", ["pqo3", "pq3", "pqo4"])
def test_batch_rows_are_independent(name, rng):
    k, v = kv(rng, b=3, s=9)
    cb = make_cache(name, num_layers=1, num_kv_heads=H, head_dim=D)
    cb.prefill(0, k, v)
    hist = cb.prefill(0, *kv(rng, b=3, s=1)).k
    for row in range(3):
        c1 = make_cache(name, num_layers=1, num_kv_heads=H, head_dim=D)
        c1.prefill(0, k[row:row + 1], v[row:row + 1])
        np.testing.assert_array_equal(c1.prefill(0, *kv(np.random.default_rng(9), b=1, s=1)).k[0, :, :9],
                                      hist[row, :, :9])


@pytest.mark.parametrize("name, norm_mode, min_cos", [("pqo3", "maxnorm", 0.85), ("pqo3", "l2", 0.83),
                                                        ("pqo4", "maxnorm", 0.92)])
def test_anchor_cosine_thresholds(name, norm_mode, min_cos):
    """turboquant-rs tests/cache_pqo_tests.rs data and thresholds (algorithms.md §6.3)."""
    s = 64
    i = np.arange(8 * s * 128).reshape(1, 8, s, 128)
    k = (2 * np.sin(0.0137 * (i + 3))).astype(np.float32)
    v = (1.5 * np.cos(0.0213 * (i + 3 + 1000))).astype(np.float32)
    c = make_cache(name, num_layers=1, num_kv_heads=8, head_dim=128, norm_mode=norm_mode,
                   decode_output="dequantized", residual_length=0, sink_tokens=0)
    first = c.prefill(0, k, v)
    assert first.k is k
    k1 = (2 * np.sin(0.0137 * (np.arange(8 * 128).reshape(1, 8, 1, 128) + 7))).astype(np.float32)
    r = c.decode(0, k1, k1, np.ones((1, 8, 1, 128), np.float32), AttendConfig(128 ** -0.5, 1)).result
    assert r.k.shape == (1, 8, s + 1, 128)
    kh = r.k[:, :, :s]
    cos = float((kh * k).sum() / np.linalg.norm(kh) / np.linalg.norm(k))
    assert cos > min_cos


def test_dense_is_exact_and_keeps_dtype(rng):
    c = DenseCache(L, H, D, dtype=np.float64)
    k, v = kv(rng, s=4, dtype=np.float64)
    c.prefill(1, k, v)
    k2, v2 = kv(rng, s=1, dtype=np.float64)
    r = c.decode(1, k2, v2, q_of(rng, dtype=np.float64), CFG).result
    np.testing.assert_array_equal(r.k, np.concatenate([k, k2], 2))
    np.testing.assert_array_equal(r.v, np.concatenate([v, v2], 2))
    assert c.memory_usage() == 2 * H * 5 * D * 8


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_output_dtype_follows_input(cache, rng, dtype):
    cache.prefill(0, *kv(rng, s=3, dtype=dtype))
    r = cache.prefill(0, *kv(rng, s=2, dtype=dtype))
    assert r.k.dtype == dtype and r.v.dtype == dtype


# --- bad input: clear error, cache unchanged ----------------------------------------------
def _bad_calls(rng):
    k, v = kv(rng, s=2)
    return [
        ("layer", IndexError, lambda c: c.prefill(L, k, v)),
        ("layer", IndexError, lambda c: c.prefill(-1, k, v)),
        ("layer", TypeError, lambda c: c.prefill(1.0, k, v)),
        ("k", ValueError, lambda c: c.prefill(0, k[0], v[0])),
        ("v", ValueError, lambda c: c.prefill(0, k, v[:, :, :1])),
        ("num_kv_heads", ValueError, lambda c: c.prefill(0, *kv(rng, h=H + 1))),
        ("head_dim", ValueError, lambda c: c.prefill(0, *kv(rng, d=D + 32))),
        ("batch", ValueError, lambda c: c.prefill(0, *kv(rng, b=2))),
        ("dtype", TypeError, lambda c: c.prefill(0, k.astype(np.int32), v.astype(np.int32))),
        ("k", TypeError, lambda c: c.prefill(0, k.tolist(), v)),
        ("k: expected finite", ValueError, lambda c: c.prefill(0, np.where(k > 1, np.nan, k), v)),
        ("v: expected finite", ValueError, lambda c: c.prefill(0, k, np.where(v > 1, np.inf, v))),
        ("n_kv_groups", ValueError, lambda c: c.decode(0, k[:, :, :1], v[:, :, :1], q_of(rng),
                                                          AttendConfig(0.1, n_kv_groups=3))),
        ("q", ValueError, lambda c: c.decode(0, k[:, :, :1], v[:, :, :1], q_of(rng, d=32), CFG)),
        ("q", ValueError, lambda c: c.decode(0, k[:, :, :1], v[:, :, :1], q_of(rng, s=2), CFG)),
        ("q", ValueError, lambda c: c.decode(0, k[:, :, :1], v[:, :, :1], None, CFG)),
        ("config", TypeError, lambda c: c.decode(0, k[:, :, :1], v[:, :, :1], q_of(rng), None)),
        ("q: expected finite", ValueError, lambda c: c.decode(0, k[:, :, :1], v[:, :, :1],
                                                              np.full((1, 4, 1, D), np.nan, np.float32), CFG)),
    ]


@pytest.mark.parametrize("case", range(18))
def test_bad_input_leaves_cache_unchanged(cache, case):
    rng = np.random.default_rng(5)
    cache.prefill(0, *kv(rng, s=6))
    cache.prefill(2, *kv(rng, s=3))
    word, exc, call = _bad_calls(rng)[case]
    before = snapshot(cache)
    with pytest.raises(exc, match=word):
        call(cache)
    assert same(before, snapshot(cache))


def test_seq_len_bad_layer(cache):
    with pytest.raises(IndexError, match="layer"):
        cache.seq_len(L)


@pytest.mark.parametrize("kwargs, word", [
    (dict(name="pqo5"), "name"), (dict(name="xyz"), "name"),
    (dict(name="pqo3", head_dim=48), "head_dim"), (dict(name="pqo3", num_layers=0), "num_layers"),
    (dict(name="pqo3", norm_mode="abs"), "norm_mode"), (dict(name="pqo3-l2", norm_mode="maxnorm"), "norm_mode"),
])
def test_bad_construction(kwargs, word):
    args = dict(num_layers=2, num_kv_heads=2, head_dim=64)
    args.update(kwargs)
    name = args.pop("name")
    with pytest.raises((ValueError, TypeError), match=word):
        make_cache(name, **args)


def test_bad_bits_and_mode():
    with pytest.raises(ValueError, match="bits"):
        PolarQuantCache(1, 1, 64, bits=5)
    with pytest.raises(ValueError, match="mode"):
        PolarQuantCache(1, 1, 64, mode="tq")


def test_attend_config_validation():
    with pytest.raises(ValueError, match="softmax_scale"):
        AttendConfig(float("nan"))
    with pytest.raises(ValueError, match="n_kv_groups"):
        AttendConfig(0.1, 0)
    # the logits q·k reach 2**96 for accepted queries (|q| <= 2**64): a scale above 2**30
    # could overflow float32 (decode returned NaN for finite inputs at 1e38)
    AttendConfig(2.0 ** 30)
    for bad in (2.0 ** 30 * (1 + 2.0 ** -52), 1e38, float("inf"), 0.0, -0.125):
        with pytest.raises(ValueError, match=r"softmax_scale: expected a float in \(0, 2\*\*30\]"):
            AttendConfig(bad)
    for bad, field in (("0.125", "softmax_scale"), (True, "softmax_scale")):
        with pytest.raises(TypeError, match=field):
            AttendConfig(bad)
    for bad in (1.0, True, "2"):
        with pytest.raises(TypeError, match="n_kv_groups: expected an int"):
            AttendConfig(0.1, bad)
    # NumPy scalars are stored as Python numbers (the config is a dict key of plans and graphs)
    cfg = AttendConfig(np.float32(0.125), np.int64(2))
    assert type(cfg.softmax_scale) is float and type(cfg.n_kv_groups) is int
    assert cfg == AttendConfig(0.125, 2) and hash(cfg) == hash(AttendConfig(0.125, 2))
    with pytest.raises(dataclasses.FrozenInstanceError):
        CFG.softmax_scale = 2.0  # frozen



def test_repr_names_the_cache_its_geometry_and_tokens():
    """What a notebook shows for a cache: its class, name, geometry and tokens per layer (one
    count while every layer holds the same)."""
    cache = make_cache("pqo3", num_layers=3, num_kv_heads=2, head_dim=64)
    assert repr(cache) == "PolarQuantCache('pqo3-r32-s4', num_layers=3, num_kv_heads=2, head_dim=64, tokens=0)"
    k = np.zeros((1, 2, 5, 64), np.float32)
    cache.prefill(1, k, k)
    assert repr(cache).endswith("tokens=[0, 5, 0])")
    mixed = make_cache("pqo3", num_layers=2, num_kv_heads=2, head_dim=64, layer_overrides={0: {"k_bits": 4}})
    assert repr(mixed) == ("MixedCache('mixed[pqo-k4v3-r32-s4,pqo3-r32-s4]', num_layers=2, num_kv_heads=2, "
                           "head_dim=64, tokens=0)")
