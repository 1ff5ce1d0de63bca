"""Sliding-window layers in the caches: a layer with window ``W`` lets the query at
position ``p`` see keys ``p − W < j <= p``, stores only what later queries can still see
(its ``W − 1`` newest tokens before each call, plus the call's new tokens) and masks per
query row (a finite logit bias) inside fused attention.

References: the dense cache's stored history is bit-exact against the tokens fed in, and
its attention equals NumPy masked attention over the exact history; compressed caches are
compared with :func:`numba_kv.reference.attention` over the same cache configuration
without a window (identical per-token compression) plus the window mask.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

from numba_kv import AttendConfig, Dequantized, Fused, make_cache, reference
from numba_kv.caches.dense import DenseCache

# (device vs CPU twin at float32 round-off: the float32 kernels; the tensor-core ones: test_sim_mma*.py)
pytestmark = pytest.mark.usefixtures("float32_attention")

W = 7
D = 64
NKV = 2
HQ = 4
CHUNKS = (5, 1, 1, 4, 1, 1, 1, 9, 1, 1, 12, 1)
CFG = AttendConfig.for_shapes(D, HQ, NKV)


def window_mask(total: int, ql: int, window: int) -> np.ndarray:
    """``[ql, total]`` True where key ``j`` is invisible to query ``i`` (causal + window)."""
    qpos = total - ql + np.arange(ql)[:, None]
    j = np.arange(total)[None, :]
    return (j > qpos) | (j <= qpos - window)


def masked_attention(q, k, v, window):
    """float64 attention of the last ``q_len`` positions over the exact history ``k``/``v``."""
    ql, total = q.shape[2], k.shape[2]
    bias = np.where(window_mask(total, ql, window), -np.inf, 0.0)[None, None]
    return reference.attention(q, k, v, CFG.softmax_scale, np.broadcast_to(bias, (1, HQ, ql, total)))


def output_of(res, q):
    """Attention output of a decode result (``Dequantized``: with its logit bias)."""
    if isinstance(res, Fused):
        return np.asarray(res.out, np.float64)
    r = res.result
    total = r.k.shape[2]
    return reference.attention(q, r.k, r.v, CFG.softmax_scale, r.logit_bias, causal_offset=total - q.shape[2])


def tokens(rng, t):
    k = rng.standard_normal((1, NKV, t, D)).astype(np.float32)
    v = rng.standard_normal((1, NKV, t, D)).astype(np.float32)
    q = rng.standard_normal((1, HQ, t, D)).astype(np.float32)
    return k, v, q


def rel_err(a, b):
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


def test_dense_sliding_decode_is_exact(rng):
    cache = DenseCache(1, NKV, D, sliding_window=W)
    hk = np.zeros((1, NKV, 0, D), np.float32)
    hv = hk.copy()
    for t in CHUNKS:
        k, v, q = tokens(rng, t)
        hk, hv = np.concatenate([hk, k], 2), np.concatenate([hv, v], 2)
        res = cache.decode(0, k, v, q, CFG)
        stored = min(hk.shape[2], W - 1 + t)
        assert cache.seq_len(0) == hk.shape[2] and cache.stored_len(0) == stored
        # bit-exact storage of exactly the visible tokens
        np.testing.assert_array_equal(res.result.k, hk[:, :, -stored:])
        np.testing.assert_array_equal(res.result.v, hv[:, :, -stored:])
        bias = res.result.logit_bias
        if t == 1:
            assert bias is None  # one query: everything stored is visible
        if bias is not None:
            assert np.isfinite(bias).all() and bias.shape == (1, HQ, t, stored)
        assert rel_err(output_of(res, q), masked_attention(q, hk, hv, W)) < 1e-5


@pytest.mark.parametrize("name,opts", [
    ("pqo3", {}),
    ("pqo3", {"residual_length": 0}),
    ("pqo3", {"residual_length": 3, "window_dtype": "int8"}),
    ("pqo-k4v3-head-eden", {"residual_length": 2}),
    ("tq3", {"residual_length": 2}),
    ("tq3", {"residual_length": 2, "decode_output": "dequantized"}),
    ("pqo4", {"residual_length": 0, "decode_output": "dequantized"}),
])
def test_compressed_sliding_decode_matches_reference(rng, name, opts):
    """Fused (or dequantized + bias) attention over the window equals the reference over
    what a non-sliding cache of the same configuration reconstructs, masked."""
    slide = make_cache(name, num_layers=1, num_kv_heads=NKV, head_dim=D, sliding_window=W, sink_tokens=0, **opts)
    twin = make_cache(name, num_layers=1, num_kv_heads=NKV, head_dim=D, sink_tokens=0,
                      **{**opts, "decode_output": "dequantized"})
    for t in CHUNKS:
        k, v, q = tokens(rng, t)
        res = slide.decode(0, k, v, q, CFG)
        hist = twin.decode(0, k, v, q, CFG).result
        stored = slide.stored_len(0)
        assert stored == min(twin.seq_len(0), W - 1 + t) and slide.seq_len(0) == twin.seq_len(0)
        want = masked_attention(q, hist.k, hist.v, W) if name[:2] != "tq" else None
        if want is None:  # TurboQuant: the QJL logit correction is part of the reference
            total = hist.k.shape[2]
            bias = hist.logit_bias.astype(np.float64) + np.where(window_mask(total, t, W), -np.inf, 0.0)
            want = reference.attention(q, hist.k, hist.v, CFG.softmax_scale, bias)
        assert rel_err(output_of(res, q), want) < 1e-4
        if isinstance(res, Dequantized):  # the stored history is the twin's newest tokens, bit for bit
            np.testing.assert_array_equal(res.result.k, hist.k[:, :, -stored:])


@pytest.mark.parametrize("name", ["dense", "pqo3", "tq4"])
def test_memory_usage_by_formula(rng, name):
    """Layer 0 slides (``{0: W}``), layer 1 (= ``-1``) is global: bytes = stored tokens ×
    bytes per token, stored = min(seen, W − 1 + last chunk) on the sliding layer."""
    opts = {} if name == "dense" else {"residual_length": 0, "sink_tokens": 0}
    cache = make_cache(name, num_layers=2, num_kv_heads=NKV, head_dim=D, sliding_window={0: W, -1: None}, **opts)
    assert cache.layer_windows == [W, None]
    per_tok = None
    seen = 0
    for t in CHUNKS:
        k, v, q = tokens(rng, t)
        seen += t
        for layer in (0, 1):
            cache.prefill(layer, k, v, q) if t > 1 else cache.decode(layer, k, v, q, CFG)
        if per_tok is None:
            per_tok = cache.memory_usage() // (2 * seen)
        stored = min(seen, W - 1 + t)
        assert cache.stored_len(0) == stored and cache.seq_len(0) == seen == cache.stored_len(1)
        assert cache.memory_usage() == per_tok * (stored + seen)
    if name == "dense":
        assert per_tok == 2 * NKV * D * 4


def test_sinks_are_not_kept_on_sliding_layers(rng):
    cache = make_cache("pqo3", num_layers=2, num_kv_heads=NKV, head_dim=D, sliding_window=[W, None],
                       residual_length=2, sink_tokens=4)
    for t in (6, 1, 1, 1, 1, 3):
        k, v, q = tokens(rng, t)
        for layer in (0, 1):
            cache.decode(layer, k, v, q, CFG)
    assert cache._layers[0].meta["n_sink"] == 0 and cache._layers[1].meta["n_sink"] == 4
    assert cache.stored_len(0) == W - 1 + 3 and cache.stored_len(1) == cache.seq_len(1) == 13


def test_prefill_returns_the_stored_window(rng):
    """A sliding layer's prefill returns what it stores (the caller masks by position)."""
    cache = DenseCache(1, NKV, D, sliding_window=W)
    k1, v1, _ = tokens(rng, 10)
    r = cache.prefill(0, k1, v1)
    assert r.k is k1  # empty layer: the original tokens
    k2, v2, _ = tokens(rng, 3)
    r = cache.prefill(0, k2, v2)
    np.testing.assert_array_equal(r.k, np.concatenate([k1[:, :, -(W - 1):], k2], 2))
    assert cache.seq_len(0) == 13 and cache.stored_len(0) == W - 1 + 3


@pytest.mark.parametrize("name", ["dense", "pqo3", "tq3"])
def test_crop_fork_select_batch_save_load(rng, tmp_path, name):
    pytest.importorskip("safetensors")
    from numba_kv import load_cache

    # no residual window: a crop inside it would leave the dropped window compressed
    # (crop never re-expands tokens), so the cropped cache would differ from `ref`
    opts = {} if name == "dense" else {"residual_length": 0}
    cache = make_cache(name, num_layers=2, num_kv_heads=NKV, head_dim=D, sliding_window={0: W}, **opts)
    k0, v0, _ = tokens(rng, 12)
    kb, vb = np.concatenate([k0, k0[:, ::-1]], 0), np.concatenate([v0, v0], 0)
    for layer in (0, 1):
        cache.prefill(layer, kb, vb)
    dk, dv, dq = (np.concatenate([a, a], 0) for a in tokens(rng, 4))
    ref = cache.fork()
    for layer in (0, 1):
        cache.decode(layer, dk, dv, dq, CFG)
    assert cache.seq_len(0) == 16 and cache.stored_len(0) == W - 1 + 4
    # rollback over the last call: back to the state that never saw the draft
    cache.crop(12)
    assert cache.seq_len(0) == 12 and cache.stored_len(0) == W - 1
    k1, v1, q1 = (np.concatenate([a, a], 0) for a in tokens(rng, 1))
    for layer in (0, 1):
        a, b = cache.decode(layer, k1, v1, q1, CFG), ref.decode(layer, k1, v1, q1, CFG)
        np.testing.assert_array_equal(output_of(a, q1), output_of(b, q1))
    # a length whose window reaches evicted tokens cannot be restored
    before = cache.memory_usage()
    with pytest.raises(ValueError, match="evicted"):
        cache.crop(10)
    assert cache.memory_usage() == before and cache.seq_len(0) == 13
    # fork, select_batch and save/load keep the sliding state
    path = tmp_path / "c.safetensors"
    cache.save(path)
    loaded = load_cache(path, expect=cache)
    assert loaded.layer_windows == [W, None] and loaded.seq_len(0) == 13 and loaded.stored_len(0) == W
    forked = copy.deepcopy(cache)
    cache.select_batch([1])
    k2, v2, q2 = (np.concatenate([a, a], 0) for a in tokens(rng, 2))
    for layer in (0, 1):
        want = output_of(forked.decode(layer, k2, v2, q2, CFG), q2)
        np.testing.assert_array_equal(output_of(loaded.decode(layer, k2, v2, q2, CFG), q2), want)
        np.testing.assert_array_equal(output_of(cache.decode(layer, k2[1:], v2[1:], q2[1:], CFG), q2[1:]), want[1:])
    cache.crop(0)
    assert cache.memory_usage() == 0 and cache.seq_len(0) == 0


@pytest.mark.parametrize("bad,err", [
    (1, ValueError), (0, ValueError), ("7", TypeError), ([7], ValueError), ({2: 7}, ValueError),
    ({"0": 7}, TypeError), ({0: 1.5}, TypeError),
])
def test_bad_sliding_window(bad, err):
    with pytest.raises(err, match="sliding_window"):
        DenseCache(2, NKV, D, sliding_window=bad)


# -- Numba device arrays (simulator or GPU) --------------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("name,opts", [("dense", {}), ("pqo3", {"residual_length": 2, "window_dtype": "float32"}),
                                       ("pqo3", {"residual_length": 0})])
def test_sliding_on_device_matches_cpu(name, opts):
    """Eviction (row shifts) and the per-row window bias work on Numba device arrays."""
    from numba_kv._backend import to_host

    from ..conftest import to_device

    rng = np.random.default_rng(3)
    host = make_cache(name, num_layers=1, num_kv_heads=NKV, head_dim=D, sliding_window=W, **opts)
    dev = make_cache(name, num_layers=1, num_kv_heads=NKV, head_dim=D, sliding_window=W, **opts)
    for t in (5, 1, 4, 1, 9, 1):
        k, v, q = tokens(rng, t)
        a = host.decode(0, k, v, q, CFG)
        b = dev.decode(0, to_device(k), to_device(v), to_device(q), CFG)
        if isinstance(a, Fused):
            np.testing.assert_allclose(to_host(b.out), a.out, rtol=1e-4, atol=1e-5)
        else:
            np.testing.assert_array_equal(to_host(b.result.k), a.result.k)
            if a.result.logit_bias is not None:
                np.testing.assert_array_equal(to_host(b.result.logit_bias), a.result.logit_bias)
        assert dev.stored_len(0) == host.stored_len(0) and dev.memory_usage() == host.memory_usage()


@pytest.mark.parametrize("make", [
    lambda w: DenseCache(4, NKV, D, sliding_window=w),
    lambda w: make_cache("pqo3", num_layers=4, num_kv_heads=NKV, head_dim=D, sliding_window=w),
    lambda w: make_cache("kv4", num_layers=4, num_kv_heads=NKV, head_dim=D, sliding_window=w),
])
def test_a_layer_given_twice_in_a_sliding_window_dict_is_refused(make):
    """``{0: 8, -4: 9}`` names layer 0 twice: refused as ``layer_overrides`` refuses it (the last
    entry won)."""
    with pytest.raises(ValueError, match=r"^sliding_window: layer 0 is given twice \(0 and -4\)$"):
        make({0: 8, -4: 9})
    assert make({0: 8, -1: 9}).layer_windows == [8, None, None, 9]


_CH, _CD, _CW = 1, 64, 16  # (the crop-message tests: one KV head, a 16-token window)


def _crop_kv(rng, t):
    return (rng.standard_normal((1, _CH, t, _CD)).astype(np.float32),
            rng.standard_normal((1, _CH, t, _CD)).astype(np.float32),
            rng.standard_normal((1, 2 * _CH, t, _CD)).astype(np.float32))


def test_crop_names_the_only_length_left_when_a_sliding_layer_is_ahead():
    # layer 0 slides (window _CW) and has seen 46 tokens, storing positions 26..45 (_CW - 1 + 5); a crop
    # to L needs the _CW - 1 positions before L, so L >= 41.  Layer 1 (global) holds 40, so crop(0) is
    # the only crop possible, and the message must not offer the empty range "[41, 40]"
    rng = np.random.default_rng(0)
    att = AttendConfig.for_shapes(_CD, 2 * _CH, _CH)
    cache = make_cache("dense", num_layers=2, num_kv_heads=_CH, head_dim=_CD, sliding_window={0: _CW})
    k, v, _ = _crop_kv(rng, 40)
    for layer in range(2):
        cache.prefill(layer, k, v)
    for t in (1, 5):
        k, v, q = _crop_kv(rng, t)
        cache.decode(0, k, v, q, att)
    assert (cache.seq_len(0), cache.stored_len(0), cache.seq_len(1)) == (46, _CW - 1 + 5, 40)
    for length in (1, 30, 40):
        with pytest.raises(ValueError, match=r"length: .*expected 0 \(the only length left") as err:
            cache.crop(length)
        assert "[41, 40]" not in str(err.value)
        assert (cache.seq_len(0), cache.seq_len(1)) == (46, 40)  # nothing changed
    cache.crop(0)
    assert cache.seq_len(0) == cache.seq_len(1) == 0


def test_crop_still_offers_the_range_when_there_is_one():
    rng = np.random.default_rng(1)
    att = AttendConfig.for_shapes(_CD, 2 * _CH, _CH)
    cache = make_cache("dense", num_layers=2, num_kv_heads=_CH, head_dim=_CD, sliding_window={0: _CW})
    for t in (40, 1, 5):
        k, v, q = _crop_kv(rng, t)
        for layer in range(2):
            (cache.prefill(layer, k, v) if t == 40 else cache.decode(layer, k, v, q, att))
    # the sliding layer keeps _CW - 1 = 15 tokens before its last 5: it can return to 46 - 5 = 41
    with pytest.raises(ValueError, match=r"expected 0 or an int in \[41, 46\], got 40"):
        cache.crop(40)
    cache.crop(41)
    assert cache.seq_len(0) == 41 and cache.stored_len(0) == _CW - 1
