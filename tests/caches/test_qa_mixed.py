"""QA of :class:`~numba_kv.caches.mixed.MixedCache` against separate plain caches.

The expectation never comes from the mixed cache: every layer of a mixed cache (every KV
head of a split layer) must answer bit for bit what a plain cache built by ``make_cache``
with that layer's (head's) options answers when fed that layer's (head's) slice of the
inputs, and ``seq_len`` / ``memory_usage`` must be those of the plain caches; a refused call
leaves every part as it was.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from numba_kv import AttendConfig, load_cache, make_cache

from .test_head_overrides import _arrays, _head_slices  # (same geometry: D, NKV, G)

D, NKV, G, L = 64, 3, 2, 3  # head_dim, KV heads, query heads per KV head, layers
CFG = AttendConfig.for_shapes(D, NKV * G, NKV)
CFG1 = AttendConfig(CFG.softmax_scale, G)  # a one-KV-head reference cache's config
OPTS = {"residual_length": 8, "sink_tokens": 2, "sliding_window": [None, 12, None]}
LAYERS = {1: {"bits": 4}, 2: {"residual_length": 4}}
HEADS = {0: {1: {"bits": 4}}, 2: {0: {"k_bits": 2}, 2: {"k_bits": 2}}}


def _mixed(decode_output: str):
    return make_cache("pqo3", num_layers=L, num_kv_heads=NKV, head_dim=D, layer_overrides=LAYERS,
                      head_overrides=HEADS, decode_output=decode_output, **OPTS)


def _references(decode_output: str) -> dict[tuple[int, int], object]:
    """One plain one-layer, one-KV-head cache per (layer, KV head), with its own options."""
    refs = {}
    for i in range(L):
        for h in range(NKV):
            own = {**LAYERS.get(i, {}), **HEADS.get(i, {}).get(h, {})}
            opts = {**OPTS, "sliding_window": [OPTS["sliding_window"][i]]}
            refs[i, h] = make_cache("pqo3", num_layers=1, num_kv_heads=1, head_dim=D, decode_output=decode_output,
                                    layer_overrides={0: own} if own else None, **opts)
    return refs


def _assert_state(cache, refs):
    for i in range(L):
        assert {refs[i, h].seq_len(0) for h in range(NKV)} == {cache.seq_len(i)}
        assert cache.stored_len(i) == refs[i, 0].stored_len(0)
    assert cache.memory_usage() == sum(r.memory_usage() for r in refs.values())
    assert cache.fp16_bytes() == sum(r.fp16_bytes() for r in refs.values())


def _step(rng, cache, refs, t, batch, prefill=False):
    """One call on every layer of ``cache`` and the same call, head by head, on ``refs``."""
    k, v = (rng.standard_normal((batch, NKV, t, D)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((batch, NKV * G, t, D)).astype(np.float32)
    for i in range(L):
        got = cache.prefill(i, k, v, q) if prefill else cache.decode(i, k, v, q, CFG)
        for h in range(NKV):
            args = (k[:, h:h + 1], v[:, h:h + 1], q[:, h * G:(h + 1) * G])
            want = refs[i, h].prefill(0, *args) if prefill else refs[i, h].decode(0, *args, CFG1)
            for a, b in zip(_head_slices(got, h), _arrays(want)):
                if b is None:
                    assert a is None or not np.any(a)
                else:
                    assert a.dtype == b.dtype and a.shape == b.shape
                    np.testing.assert_array_equal(a, b)
    _assert_state(cache, refs)


def _forks(refs):
    return {key: r.fork() for key, r in refs.items()}


@pytest.mark.parametrize("decode_output", ["fused", "dequantized"])
def test_layer_and_head_splits_answer_like_plain_caches_through_the_lifecycle(tmp_path, decode_output):
    rng = np.random.default_rng(7)
    cache, refs = _mixed(decode_output), _references(decode_output)
    _step(rng, cache, refs, 20, 2, prefill=True)
    for _ in range(6):  # the sliding layer evicts, the windows spill into the codes
        _step(rng, cache, refs, 1, 2)
    fork = cache.fork()
    _step(rng, fork, _forks(refs), 1, 2)
    _assert_state(cache, refs)  # the fork's calls left the original alone
    floor, limit = cache.crop_range()
    assert (floor, limit) == (25, 26)  # the sliding layer (window 12) after 26 tokens
    cache.crop(25)
    for r in refs.values():
        r.crop(25)
    _step(rng, cache, refs, 1, 2)
    cache.select_batch([1, 0, 1])
    for r in refs.values():
        r.select_batch([1, 0, 1])
    _step(rng, cache, refs, 1, 3)
    path = os.fspath(tmp_path / "mixed.safetensors")
    cache.save(path)
    loaded = load_cache(path)
    assert repr(loaded) == repr(cache)
    _step(rng, loaded, _forks(refs), 1, 3)
    _step(rng, type(cache).from_state_dict(cache.state_dict()), _forks(refs), 2, 3)
    cache.reset()
    for r in refs.values():
        r.reset()
    _assert_state(cache, refs)
    _step(rng, cache, refs, 5, 1, prefill=True)


def _snapshot(cache):
    return ([cache.seq_len(i) for i in range(cache.num_layers)], cache.memory_usage(),
            [(p.memory_usage(), [p.seq_len(j) for j in range(p.num_layers)]) for p in cache.parts])


@pytest.mark.parametrize("overrides", [{"layer_overrides": {0: {"bits": 4}}},  # part 1 (layers 1, 2) empty
                                       {"layer_overrides": {2: {"bits": 4}}},  # the empty part comes last
                                       {"head_overrides": {1: {0: {"bits": 4}}}}])  # an empty split layer
def test_crop_with_empty_layers_in_their_own_part(rng, overrides):
    # a plain cache crops its non-empty layers and leaves empty ones empty; a part holding only
    # empty layers refused every length but 0, after the parts before it had cropped
    cache = make_cache("pqo3", num_layers=3, num_kv_heads=2, head_dim=D, **overrides)
    filled = 2 if "layer_overrides" in overrides and 2 in overrides["layer_overrides"] else 0
    own = {**overrides.get("layer_overrides", {}).get(filled, {})}
    ref = make_cache("pqo3", num_layers=1, num_kv_heads=2, head_dim=D, layer_overrides={0: own} if own else None)
    k, v = (rng.standard_normal((2, 2, 10, D)).astype(np.float32) for _ in range(2))
    cache.prefill(filled, k, v)
    ref.prefill(0, k, v)
    assert cache.crop_range() == ref.crop_range() == (0, 10)
    cache.crop(5)
    ref.crop(5)
    assert [cache.seq_len(i) for i in range(3)] == [5 if i == filled else 0 for i in range(3)]
    assert cache.memory_usage() == ref.memory_usage()
    kq = rng.standard_normal((2, 2, 1, D)).astype(np.float32)
    cfg = AttendConfig.for_shapes(D, 2, 2)
    np.testing.assert_array_equal(cache.decode(filled, kq, kq, kq, cfg).out, ref.decode(0, kq, kq, kq, cfg).out)
    before = _snapshot(cache)
    with pytest.raises(ValueError, match=r"length: expected an int in \[0, 6\]"):
        cache.crop(7)
    assert _snapshot(cache) == before


def test_split_layer_batch_error_shows_the_callers_shape(rng):
    # the error named the shape of a piece's share ((3, 2, 1, 64) for a 3-head input)
    cache = make_cache("pqo3", num_layers=1, num_kv_heads=NKV, head_dim=D, head_overrides={0: {1: {"bits": 4}}})
    k = rng.standard_normal((2, NKV, 4, D)).astype(np.float32)
    cache.prefill(0, k, k)
    before = _snapshot(cache)
    k3 = rng.standard_normal((3, NKV, 1, D)).astype(np.float32)
    q3 = rng.standard_normal((3, NKV, 1, D)).astype(np.float32)
    with pytest.raises(ValueError, match=r"k: expected batch=2 .*got shape \(3, 3, 1, 64\)"):
        cache.decode(0, k3, k3, q3, AttendConfig.for_shapes(D, NKV, NKV))
    with pytest.raises(ValueError, match=r"k: expected batch=2 .*got shape \(3, 3, 1, 64\)"):
        cache.prefill(0, k3, k3)
    assert _snapshot(cache) == before


@pytest.mark.parametrize("layer", [0, 1, 2])
@pytest.mark.parametrize("head", [0, 1, 2])
@pytest.mark.parametrize("arg", ["k", "v", "q"])
def test_nan_in_any_head_leaves_every_part_unchanged(rng, layer, head, arg):
    # a NaN in the second piece's heads must not let the first piece store its share
    cache = _mixed("fused")
    for i in range(L):
        cache.prefill(i, *(rng.standard_normal((2, NKV, 10, D)).astype(np.float32) for _ in range(2)))
    before = _snapshot(cache)
    arrays = {"k": rng.standard_normal((2, NKV, 1, D)).astype(np.float32),
              "v": rng.standard_normal((2, NKV, 1, D)).astype(np.float32),
              "q": rng.standard_normal((2, NKV * G, 1, D)).astype(np.float32)}
    arrays[arg][:, head * (G if arg == "q" else 1), 0, 3] = np.nan
    with pytest.raises(ValueError, match=f"{arg}: expected finite values"):
        cache.decode(layer, arrays["k"], arrays["v"], arrays["q"], CFG)
    assert _snapshot(cache) == before
