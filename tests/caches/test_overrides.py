"""Per-layer configuration: ``make_cache(..., layer_overrides={layer: {...}})``.

Each layer of a mixed cache behaves exactly like a plain cache built with that layer's
options (bit-identical outputs), ``memory_usage`` is the sum of the layers' formulas, and
the mixed cache survives crop / fork / select_batch / save / load.
"""

from __future__ import annotations

import numpy as np
import pytest

from numba_kv import AttendConfig, PolarQuantCache, make_cache
from numba_kv.caches.mixed import MixedCache

D = 64
NKV = 2
HQ = 4
CFG = AttendConfig.for_shapes(D, HQ, NKV)
GEOM = {"num_kv_heads": NKV, "head_dim": D}


def tokens(rng, t, batch=1):
    return tuple(rng.standard_normal((batch, h, t, D)).astype(np.float32) for h in (NKV, NKV, HQ))


def out(res):
    return np.asarray(res.out if hasattr(res, "out") else res.result.k)


def test_no_override_returns_the_plain_cache():
    assert type(make_cache("pqo3", num_layers=3, **GEOM, layer_overrides={})) is PolarQuantCache
    same = make_cache("pqo3", num_layers=3, **GEOM, layer_overrides={1: {"bits": 3}})
    assert type(same) is PolarQuantCache


def test_layers_behave_like_their_own_plain_cache(rng):
    overrides = {0: {"bits": 4}, -1: {"bits": 4, "rotation": "head"}, 1: {"residual_length": 0, "sink_tokens": 0},
                 2: {"sliding_window": 6}}
    mixed = make_cache("pqo-k4v3", num_layers=5, **GEOM, layer_overrides=overrides)
    assert isinstance(mixed, MixedCache) and mixed.num_layers == 5
    assert mixed.layer_windows == [None, None, 6, None, None]
    plain = [make_cache("pqo4", num_layers=1, **GEOM),
             make_cache("pqo-k4v3", num_layers=1, **GEOM, residual_length=0, sink_tokens=0),
             make_cache("pqo-k4v3", num_layers=1, **GEOM, sliding_window=6),
             make_cache("pqo-k4v3", num_layers=1, **GEOM),
             make_cache("pqo4-head", num_layers=1, **GEOM)]
    for t in (9, 1, 1, 3, 1):
        k, v, q = tokens(rng, t)
        for layer in range(5):
            a = mixed.decode(layer, k, v, q, CFG)
            b = plain[layer].decode(0, k, v, q, CFG)
            np.testing.assert_array_equal(out(a), out(b))
            assert mixed.seq_len(layer) == plain[layer].seq_len(0)
            assert mixed.stored_len(layer) == plain[layer].stored_len(0)
    assert mixed.memory_usage() == sum(p.memory_usage() for p in plain)
    assert mixed.layer_cache(4).rotation == "head" and mixed.layer_cache(0).k_bits == 4


def test_memory_usage_by_formula(rng):
    """No window or sinks: bytes = tokens × rows × (K + V bits per vector) / 8 per layer."""
    n, t = 4, 10
    cache = make_cache("pqo3", num_layers=n, **GEOM, residual_length=0, sink_tokens=0,
                       layer_overrides={0: {"bits": 4}, -1: {"k_bits": 4, "v_bits": 2}})
    k, v, _ = tokens(rng, t)
    for layer in range(n):
        cache.prefill(layer, k, v)
    bits = {3: 3.5, 4: 4.5, 2: 2.5}  # PQO: index bits + one binary16 scale per 32 values
    want = [(bits[4] + bits[4]), (bits[3] + bits[3]), (bits[3] + bits[3]), (bits[4] + bits[2])]
    assert cache.memory_usage() == sum(int(w * D / 8) * t * NKV for w in want)


@pytest.mark.parametrize("overrides,err,match", [
    ({4: {"bits": 4}}, ValueError, "out of range"),
    ({-5: {"bits": 4}}, ValueError, "out of range"),
    ({0: {"bitz": 4}}, ValueError, "unknown option 'bitz'"),
    ({0: {"num_layers": 2}}, ValueError, "unknown option"),
    ({0: 4}, TypeError, "expected a dict"),
    ({"0": {}}, TypeError, "layer keys must be ints"),
    ({0: {"bits": 5}}, ValueError, "layers \\[0\\]: bits"),
    ({0: {"bits": 4}, -4: {"bits": 2}}, ValueError, "given twice"),
    ({0: {"sliding_window": 1}}, ValueError, "sliding_window"),
    ([0], TypeError, "layer_overrides"),
])
def test_bad_overrides(overrides, err, match):
    with pytest.raises(err, match=match):
        make_cache("pqo3", num_layers=4, **GEOM, layer_overrides=overrides)


def test_dense_overrides_and_unknown_bits():
    c = make_cache("dense", num_layers=2, **GEOM, layer_overrides={1: {"dtype": "float16"}})
    assert isinstance(c, MixedCache) and c.layer_cache(1).dtype == np.float16
    with pytest.raises(ValueError, match="unknown option 'bits'"):
        make_cache("dense", num_layers=2, **GEOM, layer_overrides={1: {"bits": 4}})


def test_lifecycle_and_save_load(rng, tmp_path):
    pytest.importorskip("safetensors")
    from numba_kv import CacheFileError, load_cache

    cache = make_cache("tq3", num_layers=3, **GEOM, residual_length=0,
                       layer_overrides={0: {"bits": 4}, 1: {"sliding_window": 5}})
    k, v, q = tokens(rng, 8, batch=2)
    for layer in range(3):
        cache.prefill(layer, k, v)
    k, v, q = tokens(rng, 2, batch=2)
    ref = cache.fork()
    for layer in range(3):
        cache.decode(layer, k, v, q, CFG)
    cache.crop(8)
    assert [cache.seq_len(i) for i in range(3)] == [8, 8, 8] and cache.stored_len(1) == 4
    with pytest.raises(ValueError, match="evicted"):
        cache.crop(7)  # checked on every part before any part changes
    assert cache.seq_len(0) == 8
    path = tmp_path / "mixed.safetensors"
    cache.save(path)
    loaded = load_cache(path, expect=cache)
    assert isinstance(loaded, MixedCache) and loaded.name == cache.name
    assert loaded.memory_usage() == cache.memory_usage()
    with pytest.raises(CacheFileError, match="configuration mismatch"):
        load_cache(path, expect=make_cache("tq3", num_layers=3, **GEOM, residual_length=0,
                                           layer_overrides={0: {"bits": 2}, 1: {"sliding_window": 5}}))
    k1, v1, q1 = tokens(rng, 1, batch=2)
    for layer in range(3):
        want = out(ref.decode(layer, k1, v1, q1, CFG))
        np.testing.assert_array_equal(out(cache.decode(layer, k1, v1, q1, CFG)), want)
        np.testing.assert_array_equal(out(loaded.decode(layer, k1, v1, q1, CFG)), want)
    loaded.select_batch([1])
    k2, v2, q2 = tokens(rng, 1, batch=2)
    for layer in range(3):
        want = out(cache.decode(layer, k2, v2, q2, CFG))
        np.testing.assert_array_equal(out(loaded.decode(layer, k2[1:], v2[1:], q2[1:], CFG)), want[1:])
    loaded.reset()
    assert loaded.memory_usage() == 0


def test_mixed_bits_per_value_averages_every_layer_and_head():
    """By formula: a PQO 32-block code is ``bits + 16/32`` bits a value (binary16 scale per
    32 values); the mixed cache weighs each configuration by the KV heads it stores."""
    layers = make_cache("pqo3", num_layers=4, num_kv_heads=2, head_dim=64,
                        layer_overrides={0: {"bits": 4}, -1: {"k_bits": 2}})
    assert isinstance(layers, MixedCache)
    assert layers.bits_per_value == pytest.approx((4.5 + 3.5 + 3.5 + (2.5 + 3.5) / 2) / 4, abs=1e-12)
    heads = make_cache("pqo3", num_layers=2, num_kv_heads=3, head_dim=64, head_overrides={0: {1: {"bits": 4}}})
    assert heads.bits_per_value == pytest.approx((5 * 3.5 + 4.5) / 6, abs=1e-12)
    head_codes = make_cache("pqo3-head", num_layers=2, num_kv_heads=1, head_dim=128,
                                 layer_overrides={1: {"bits": 4}})
    # whole-head codes: bits + 16/d (one binary16 norm a vector)
    assert head_codes.bits_per_value == pytest.approx((3 + 16 / 128 + 4 + 16 / 128) / 2, abs=1e-12)
