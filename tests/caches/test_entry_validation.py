"""Each parameter is validated once, where it enters (the configuration objects), and trusted
after that: every bad constructor argument of the paged and MLA caches raises at
construction naming the argument, and a paged decode step runs the trusted attention entry,
not the validating public op."""

import numpy as np
import pytest

import numba_kv.caches.paged as paged_cache
import numba_kv.ops.attention.paged as paged_op
from numba_kv import PagedKVCache
from numba_kv.caches.config import PagedConfig, PolarQuantConfig
from numba_kv.caches.mla import MLACache, SimpleMLACache
from numba_kv.ops.attention import paged_decode_attention

# (overrides of PagedKVCache(8, 2, 2, 64), exception, full message)
PAGED_RULES = [
    (dict(num_pages=0), ValueError, "num_pages: expected an int >= 1, got 0"),
    (dict(num_pages=8.0), TypeError, "num_pages: expected an int, got float 8.0"),
    (dict(num_layers=0), ValueError, "num_layers: expected an int >= 1, got 0"),
    (dict(num_kv_heads="2"), TypeError, "num_kv_heads: expected an int, got str '2'"),
    (dict(head_dim=0), ValueError, "head_dim: expected an int >= 1, got 0"),
    (dict(page_size=0), ValueError, "page_size: expected an int >= 1, got 0"),
    (dict(page_size=True), TypeError, "page_size: expected an int, got bool True"),
    (dict(v_head_dim=-1), ValueError, "v_head_dim: expected an int >= 0, got -1"),
    (dict(storage="int4"), ValueError,
     "storage: expected one of ['float32', 'pqo2', 'pqo3', 'pqo4'] or 'pqo-k<2-4>v<2-4>', got 'int4'"),
    (dict(storage="pqo-k5v3"), ValueError,
     "storage: expected one of ['float32', 'pqo2', 'pqo3', 'pqo4'] or 'pqo-k<2-4>v<2-4>', got 'pqo-k5v3'"),
    (dict(storage=3), ValueError,
     "storage: expected one of ['float32', 'pqo2', 'pqo3', 'pqo4'] or 'pqo-k<2-4>v<2-4>', got 3"),
    (dict(head_dim=48, storage="pqo3"), ValueError,
     "head_dim: expected a multiple of 32 for storage='pqo3' (32-value quantization blocks), got 48"),
    (dict(v_head_dim=48, storage="pqo-k4v3"), ValueError,
     "v_head_dim: expected a multiple of 32 for storage='pqo-k4v3' (32-value quantization blocks), got 48"),
]


def _paged_args(overrides: dict) -> tuple[tuple, dict]:
    args = dict(num_pages=8, num_layers=2, num_kv_heads=2, head_dim=64)
    args.update({k: v for k, v in overrides.items() if k in args})
    kw = {k: v for k, v in overrides.items() if k not in args}
    return tuple(args.values()), kw


@pytest.mark.parametrize("overrides, exc, message", PAGED_RULES)
def test_every_paged_rule_names_its_argument(overrides, exc, message):
    args, kw = _paged_args(overrides)
    for build in (PagedConfig, PagedKVCache):
        with pytest.raises(exc) as info:
            build(*args, **kw)
        assert str(info.value) == message


def test_paged_config_resolves_once_and_the_cache_mirrors_it():
    cfg = PagedConfig(8, 2, 2, 64, storage="pqo-k4v3")
    assert (cfg.k_bits, cfg.v_bits, cfg.v_head_dim, cfg.part_bits) == (4, 3, 64, {"k": 4, "v": 3})
    assert PagedConfig(8, 2, 2, 64, v_head_dim=64) == PagedConfig(np.int64(8), 2, 2, 64)  # one canonical form
    assert type(PagedConfig(np.int64(8), 2, 2, 64).num_pages) is int
    cache = PagedKVCache(8, 2, 2, 64, storage="pqo-k4v3")
    assert cache.config == cfg
    assert (cache.k_bits, cache.v_bits, cache.bits, cache.part_bits) == (4, 3, 4, {"k": 4, "v": 3})
    assert [cb.bits for cb in cache.codebooks.values()] == [4, 3]
    with pytest.raises(AttributeError):
        cfg.k_bits = 2  # frozen


@pytest.mark.parametrize("build, message", [
    (lambda w: MLACache(4, 1, 2, 40, 16, 16, 16, w((2, 40, 16)), w((2, 40, 16)), storage="pqo3"),
     "kv_lora_rank + qk_rope_head_dim: expected a multiple of 32 for storage='pqo3' (32-value quantization "
     "blocks), got 56"),
    (lambda w: MLACache(4, 1, 2, 32, 0, 16, 16, w((2, 32, 16)), w((2, 32, 16)), storage="int4"),
     "storage: expected one of ['float32', 'pqo2', 'pqo3', 'pqo4'] or 'pqo-k<2-4>v<2-4>', got 'int4'"),
    (lambda w: MLACache(4, 1, 2, 32, 0, 16, 16, w((2, 32, 16)), w((2, 32, 16)), page_size=0),
     "page_size: expected an int >= 1, got 0"),
    (lambda w: SimpleMLACache(4, 1, 2, 16, 40, w((16, 40)), w((40, 16)), w((40, 16)), storage="pqo4"),
     "latent_dim: expected a multiple of 32 for storage='pqo4' (32-value quantization blocks), got 40"),
    (lambda w: SimpleMLACache(0, 1, 2, 16, 32, w((16, 32)), w((32, 16)), w((32, 16))),
     "num_pages: expected an int >= 1, got 0"),
])
def test_mla_pool_arguments_raise_at_construction_naming_the_argument(build, message):
    def w(shape):
        return np.ones(shape, np.float32)
    with pytest.raises(ValueError) as info:
        build(w)
    assert str(info.value) == message


def test_outlier_widths_are_resolved_once():
    cfg = PolarQuantConfig(1, 1, 128, bits=3, v_bits=2, outlier_channels=32)
    assert cfg.outlier_widths == {"k": 4, "v": 3} and cfg.outlier_bits is None
    widths = cfg.outlier_widths
    widths["k"] = 99  # a copy: the configuration cannot be changed through it
    assert cfg.outlier_widths == {"k": 4, "v": 3}


def _filled(storage: str, rng: np.random.Generator) -> tuple[PagedKVCache, list[int]]:
    cache = PagedKVCache(num_pages=16, num_layers=1, num_kv_heads=2, head_dim=64, page_size=4, storage=storage)
    ids = []
    for n in (5, 9):
        s = cache.allocate_sequence()
        cache.append(0, s, *rng.standard_normal((2, 2, n, 64)).astype(np.float32))
        ids.append(s)
    return cache, ids


@pytest.mark.parametrize("storage", ["float32", "pqo3", "pqo-k4v3"])
def test_a_paged_decode_step_runs_the_trusted_entry(storage, monkeypatch, rng):
    cache, ids = _filled(storage, rng)
    q = rng.standard_normal((2, 4, 1, 64)).astype(np.float32)
    pools = cache.pools
    kw = ({"k_pages": pools["k_pages"], "v_pages": pools["v_pages"]} if storage == "float32" else
          {**{n: pools[n] for n in ("k_codes", "k_scales", "v_codes", "v_scales")},
           "k_codebook": cache.codebooks["k"], "v_codebook": cache.codebooks["v"]})
    expected = paged_decode_attention(q, cache.page_table(0, ids), **kw)  # the public op, validating

    def refuse(*args, **kwargs):
        raise AssertionError("the paged cache re-validated through the public op")
    for name in ("paged_decode_attention", "_check_kind", "_pools", "_same_pages", "_table_lens",
                 "_check_pool_values", "check_f16_bits", "check_finite_stats", "check_float_array"):
        monkeypatch.setattr(paged_op, name, refuse)
    calls = []
    trusted = paged_cache.paged_attention_rows

    def counting(*args, **kwargs):
        calls.append(1)
        return trusted(*args, **kwargs)
    monkeypatch.setattr(paged_cache, "paged_attention_rows", counting)
    for _ in range(2):
        out = cache.decode_attention(0, q, ids)
        np.testing.assert_array_equal(out, expected)  # same kernels, same arguments: bit for bit
    assert len(calls) == 2


@pytest.mark.parametrize("make_q, seq_ids, message", [
    (lambda: np.zeros((2, 4, 1, 64), np.float16)[..., :32], None,
     r"q: expected \[n_seq, k·2, q_len, 64\]"),
    (lambda: np.zeros((2, 4, 64), np.float32), None, "q: expected a 4-D array"),
    (lambda: np.zeros((2, 4, 1, 64), np.int32), None, "q: expected dtype float16, float32 or float64"),
    (lambda: np.zeros((1, 4, 1, 64), np.float32), None, "q: expected 2 rows"),
    (lambda: np.zeros((2, 4, 6, 64), np.float32), None, r"seq_ids: every sequence needs >= max\(1, q_len=6\)"),
])
def test_the_cache_entry_still_rejects_a_bad_query(make_q, seq_ids, message, rng):
    cache, _ = _filled("pqo3", rng)
    before = cache.memory_usage()
    with pytest.raises((TypeError, ValueError), match=message):
        cache.decode_attention(0, make_q(), seq_ids)
    assert cache.memory_usage() == before


@pytest.mark.parametrize("name", ["pqo3", "tq3", "pqo-k4v3-head", "pqo-k5v4-head-eden"])
def test_tiny_values_keep_the_documented_accuracy(name):
    """The validation guide's small end: down to 1e-6 the relative error of the compressed
    history is within 5 % of unit-scale input's; below, binary16's subnormal scales hold the absolute
    error under 4e-8 (a 1e-8 block comes back as zeros or nearly)."""
    from numba_kv import make_cache

    x0 = np.random.default_rng(0).standard_normal((1, 1, 64, 64)).astype(np.float32)

    def max_error(scale):
        cache = make_cache(name, num_layers=1, num_kv_heads=1, head_dim=64, residual_length=0, sink_tokens=0)
        x = x0 * np.float32(scale)
        cache.prefill(0, x, x)
        history = cache.prefill(0, x[:, :, :1], x[:, :, :1]).k[:, :, :64]
        return float(np.abs(history - x).max())

    unit = max_error(1.0)
    assert max_error(1e-6) <= 1.05e-6 * unit
    for scale in (1e-7, 1e-8, 1e-9):
        assert max_error(scale) <= 4e-8 + scale * unit


@pytest.mark.parametrize("name", ["kv4", "pqo3-r64-s0:window_dtype=int8"])
@pytest.mark.parametrize("scale", [1.0, 1e-3, 1e-5, 1e-6, 1e-8])
def test_tiny_values_in_an_int8_window_keep_the_codec_bound(name, scale):
    """Tokens in an int8 window (kv4's: key-centred and rotated) come back within half a
    step of their per-vector binary16 scale: per vector, an L2 error of at most
    ``√d·(‖x‖/254·(1 + 2**-10) + 2**-25)`` (the rotation is orthonormal; ``2**-25`` is the
    subnormal scale's part, ``ops/absmax8.py``). Below ``max|x| ≈ 3.8e-6`` the tokens came
    back as zeros, and subnormal scales clipped codes by up to a third."""
    from numba_kv import make_cache

    d = 64
    x = np.random.default_rng(1).standard_normal((1, 1, 40, d)).astype(np.float32) * np.float32(scale)
    cache = make_cache(name, num_layers=1, num_kv_heads=1, head_dim=d)
    cache.prefill(0, x, x)
    history = cache.prefill(0, x[:, :, :1], x[:, :, :1])
    for got in (history.k[:, :, :40], history.v[:, :, :40]):
        err = np.linalg.norm((got.astype(np.float64) - x)[0, 0], axis=-1)
        # kv4 centres keys on their mean first: the vector the window quantizes is at most ‖x‖ + ‖mean‖
        norm = np.linalg.norm(x[0, 0].astype(np.float64), axis=-1) + np.linalg.norm(x[0, 0].mean(0))
        assert (err <= np.sqrt(d) * (norm / 254 * (1 + 2 ** -10) + 2.0 ** -25) * (1 + 1e-5)).all()


@pytest.mark.parametrize("name", ["dense", "pqo3", "kv4"])
def test_a_kv_pair_of_two_dtypes_is_refused_and_nothing_is_stored(name):
    """float16 keys with float32 values: a ``TypeError`` naming ``v`` (the outputs would take
    ``k``'s dtype), in prefill and decode, with the cache unchanged."""
    from numba_kv import AttendConfig, make_cache

    rng = np.random.default_rng(2)
    k, v = (rng.standard_normal((1, 2, 6, 64)).astype(np.float32) for _ in range(2))
    cache = make_cache(name, num_layers=1, num_kv_heads=2, head_dim=64)
    with pytest.raises(TypeError, match=r"v: expected the dtype of k \(float16\), got float32"):
        cache.prefill(0, k.astype(np.float16), v)
    assert cache.seq_len(0) == 0 and cache.memory_usage() == 0
    cache.prefill(0, k, v)
    before = cache.memory_usage()
    q = rng.standard_normal((1, 4, 1, 64)).astype(np.float32)
    with pytest.raises(TypeError, match="v: expected the dtype of k"):
        cache.decode(0, k[:, :, :1], v[:, :, :1].astype(np.float64), q, AttendConfig(0.125, n_kv_groups=2))
    assert cache.seq_len(0) == 6 and cache.memory_usage() == before
