"""One formula for the bytes a cache stores (``PolarQuantConfig.stored_bytes``), checked
against ``memory_usage()`` and against bytes counted by hand from the storage layout the
cache documents: packed indices, binary16 scales, TurboQuant's sketch and residual norm,
window vectors at their dtype (an int8 vector with its binary16 scale), per-row constants."""

from __future__ import annotations

import numpy as np
import pytest

from numba_kv import make_cache
from numba_kv.toolkit.evaluation.simulate import polarquant_bits_per_value

B, H, L, D = 2, 3, 2, 64


def _hand(name: str, d: int, tokens: int, r: int, s: int, window: str, key_center: bool = False) -> int:
    """Bytes of one layer row by hand, for the names used below (not from the library)."""
    comp = {  # bytes of one compressed K vector, one V vector
        "pqo3": (d * 3 // 8 + 2 * d // 32, d * 3 // 8 + 2 * d // 32),
        "pq4": (d * 3 // 8 + 2 * d // 32, d * 3 // 8 + 2 * d // 32),  # pq: one bit less per index
        "pqo-k4v3-head": (d * 4 // 8 + 2, d * 3 // 8 + 2),  # one norm per vector
        "tq3": (d * 2 // 8 + 2 * d // 32 + d // 8 + 2, d * 3 // 8 + 2 * d // 32),  # + sketch, residual norm
        "pqo2.5": ((d // 2) * 3 // 8 + (d // 2) * 2 // 8 + 2 * d // 32,) * 2,  # half the channels 3 bits
    }[name]
    item = {"float16": 2, "float32": 4, "int8": 1}[window]
    exact = d * item + (2 if window == "int8" else 0)
    n_exact = min(tokens, r + s)
    const = 4 * d if key_center else 0
    if name == "pqo2.5":
        const += 2 * (2 * d)  # int16 channel permutations of K and V
    return (tokens - n_exact) * sum(comp) + n_exact * 2 * exact + const


CASES = [
    ("pqo3", 0, 0, "float16", {}),
    ("pqo3", 8, 2, "float16", {}),
    ("pq4", 5, 3, "float32", {}),
    ("pqo-k4v3-head", 16, 4, "int8", {"key_center": True}),
    ("tq3", 6, 2, "float16", {}),
    ("pqo2.5", 4, 4, "int8", {"key_center": True}),
]


@pytest.mark.parametrize(("name", "r", "s", "window", "extra"), CASES)
@pytest.mark.parametrize("tokens", [3, 40])
def test_stored_bytes_is_memory_usage_and_the_hand_count(name, r, s, window, extra, tokens):
    rng = np.random.default_rng(tokens)
    cache = make_cache(name, num_layers=L, num_kv_heads=H, head_dim=D, residual_length=r, sink_tokens=s,
                       window_dtype=window, **extra)
    for layer in range(L):
        k = rng.standard_normal((B, H, tokens, D)).astype(np.float32)
        cache.prefill(layer, k, 0.5 * k)
    hand = B * H * L * _hand(name, D, tokens, r, s, window, extra.get("key_center", False))
    assert cache.memory_usage() == hand
    assert B * H * L * cache.config.stored_bytes(tokens) == hand
    # bits per compressed value: the same vector bytes
    k_vec, v_vec = (cache.config.vector_bytes(side) for side in ("k", "v"))
    assert cache.bits_per_value == pytest.approx(8.0 * (k_vec + v_vec) / (2 * D))


def test_sliding_layer_counts_its_window_and_no_sinks():
    rng = np.random.default_rng(5)
    cache = make_cache("pqo3", num_layers=1, num_kv_heads=1, head_dim=D, residual_length=4, sink_tokens=2,
                       sliding_window=10)
    k = rng.standard_normal((1, 1, 30, D)).astype(np.float32)
    cache.prefill(0, k[:, :, :29], k[:, :, :29])
    cache.prefill(0, k[:, :, 29:], k[:, :, 29:])
    stored = cache.stored_len(0)
    assert stored == 10
    assert cache.memory_usage() == _hand("pqo3", D, stored, 4, 0, "float16")
    assert cache.memory_usage() == cache.config.stored_bytes(stored, sinks=0)


def test_empty_layer_stores_nothing():
    cache = make_cache("pqo3", num_layers=1, num_kv_heads=1, head_dim=D, key_center=True)
    assert cache.memory_usage() == cache.config.stored_bytes(0) == 0


@pytest.mark.parametrize(("kb", "vb", "r", "s", "t"), [(3, 3, 0, 0, 50), (4, 2, 8, 2, 7), (2, 4, 32, 4, 100)])
def test_simulator_bits_are_the_hand_count(kb, vb, r, s, t):
    bpv = polarquant_bits_per_value(t, D, kb, vb, r, s)
    n_exact = min(t, r + s)
    for side, b in (("k", kb), ("v", vb)):
        hand = (t - n_exact) * (D * b // 8 + 2 * D // 32) + n_exact * 2 * D
        assert bpv[side] == pytest.approx(8.0 * hand / (t * D))
    assert polarquant_bits_per_value(t, D, kb, None, r, s)["v"] == 32.0
    with pytest.raises(ValueError, match="window_itemsize"):
        polarquant_bits_per_value(t, D, kb, vb, r, s, window_itemsize=3)
