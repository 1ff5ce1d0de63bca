"""A bad growth knob (``NUMBA_KV_GROWTH_MIN_EXTRA`` / ``NUMBA_KV_GROWTH_FRACTION``, read live)
refuses a ``prefill`` / ``decode`` before anything is stored: storage grows midway through a
store (a window's exact tokens, the exact tokens' position buffer, a sliding layer's buffers
after its eviction), so the knobs are read when the call's arguments are checked."""

from __future__ import annotations

import numpy as np
import pytest

from numba_kv import AttendConfig, make_cache
from numba_kv.caches.dense import DenseCache

H, G, D = 2, 2, 64
CFG = AttendConfig(D ** -0.5, n_kv_groups=G)
BAD = [("NUMBA_KV_GROWTH_MIN_EXTRA", "x", "expected int"), ("NUMBA_KV_GROWTH_MIN_EXTRA", "-1", "expected 0 <="),
       ("NUMBA_KV_GROWTH_FRACTION", "nan", "expected 0.0 <=")]


def _state(cache):
    arrays = [np.array(a, copy=True) for a in cache.live_arrays(0)]
    return (cache.seq_len(0), cache.stored_len(0), cache.memory_usage(), cache.allocated_bytes()), arrays


def _same(a, b):
    assert a[0] == b[0]
    assert len(a[1]) == len(b[1]) and all(np.array_equal(x, y) for x, y in zip(a[1], b[1]))


CACHES = {
    "pqo3": lambda: make_cache("pqo3", num_layers=1, num_kv_heads=H, head_dim=D),  # the position buffer
    "tq3": lambda: make_cache("tq3", num_layers=1, num_kv_heads=H, head_dim=D),
    "pqo3-g50": lambda: make_cache("pqo3-g50", num_layers=1, num_kv_heads=H, head_dim=D),  # the window grows
    "dense-sliding": lambda: DenseCache(1, H, D, sliding_window=8),  # evicts, then grows
}


@pytest.mark.parametrize("var, value, match", BAD)
@pytest.mark.parametrize("name, op, n", [("pqo3", "decode", 1), ("tq3", "decode", 1), ("pqo3", "prefill", 200),
                                         ("pqo3-g50", "decode", 1), ("dense-sliding", "prefill", 300)])
def test_a_bad_growth_knob_leaves_the_cache_as_it_was(monkeypatch, rng, name, op, n, var, value, match):
    cache = CACHES[name]()
    x = rng.standard_normal((1, H, 140, D)).astype(np.float32)
    cache.prefill(0, x, x)
    k = rng.standard_normal((1, H, n, D)).astype(np.float32)
    q = rng.standard_normal((1, H * G, n, D)).astype(np.float32)

    def call():
        return cache.decode(0, k, k, q, CFG) if op == "decode" else cache.prefill(0, k, k)

    before = _state(cache)
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=f"{var}: {match}"):
        call()
    _same(_state(cache), before)
    monkeypatch.delenv(var)
    call()  # the retry stores the tokens once
    assert cache.seq_len(0) == 140 + n
