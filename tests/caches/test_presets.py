"""Named presets (``make_cache("kv4")``, ``"kv5"``): they build on both evaluation models'
shapes, their bits/value counted by hand stay within budget with the window at 1,024 tokens
(and the window is the largest that does), the count equals what the cache stores, relative
per-layer overrides, errors."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

import numba_kv as nk
from numba_kv.caches import presets
from numba_kv.caches.mixed import MixedCache
from numba_kv.caches.presets import BUDGET_TOKENS, PRESETS, Preset, resolve_preset
from numba_kv.caches.spec import parse_cache_spec
from numba_kv.toolkit.specs import EvalConfigError, parse_cache_specs

GEMMA_WINDOWS = [512, 512, 512, 512, 512, None] * 3  # Gemma-3-270M: 5 local layers, then 1 global
# (name, num_layers, num_kv_heads, head_dim, sliding windows)
MODELS = [("smollm2", 30, 3, 64, None), ("gemma3-270m", 18, 1, 256, GEMMA_WINDOWS)]
BUDGETS = {"kv3": 3.5, "kv4": 4.0, "kv5": 5.0}


def _layers(cache):
    """(layer cache, layer index inside it) of every model layer."""
    if isinstance(cache, MixedCache):
        return [cache.layer_pieces(i)[0][:2] for i in range(cache.num_layers)]
    return [(cache, j) for j in range(cache.num_layers)]


def _part(cache, layer: int):
    """The cache holding ``layer`` (the cache itself unless mixed)."""
    return _layers(cache)[layer][0]


def _hand_bytes(part, d: int, tokens: int, window: int | None = None) -> int:
    """Bytes of one layer and KV head of a ``pqo-k?v?-head`` cache with an int8 window and key
    centering, counted by hand: a compressed vector is ``bits * d / 8`` index bytes plus one
    binary16 norm (one byte with ``norm_bits=8``); a window vector ``d`` int8 bytes plus one
    binary16 scale; key centering one float32 mean per channel.  A sliding layer holds its last
    ``window`` tokens, no sinks.  A growing window (``residual_fraction`` f) holds
    ``max(residual_length, floor(f·t))`` tokens at ``t`` tokens of history (on a sliding
    layer more than it stores)."""
    assert part.rotation == "head" and part.window_dtype == np.int8 and part.key_center
    assert part.outlier_channels == 0
    grown = max(part.residual_length, int(Fraction(part.residual_fraction).limit_denominator(10**6) * tokens))
    if window is not None:
        tokens = min(tokens, window)
    exact = min(tokens, (part.sink_tokens if window is None else 0) + grown)
    norm = part.norm_bits // 8
    comp_k = part.k_bits * d // 8 + norm
    comp_v = part.v_bits * d // 8 + norm
    return (tokens - exact) * (comp_k + comp_v) + exact * 2 * (d + 2) + 4 * d


def _bits(nbytes: int, layers: int, heads: int, d: int, tokens: int = BUDGET_TOKENS) -> float:
    return 8.0 * nbytes / (2 * layers * heads * d * tokens)


def _hand_bits(cache, heads: int, d: int, tokens: int = BUDGET_TOKENS, layers=None) -> float:
    """bits/value of ``layers`` (default: all) counted by hand at ``tokens`` tokens."""
    parts = _layers(cache)
    idx = range(len(parts)) if layers is None else layers
    windows = cache.layer_windows
    total = sum(heads * _hand_bytes(parts[i][0], d, tokens, windows[i]) for i in idx)
    return _bits(total, len(idx), heads, d, tokens)


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("model", MODELS, ids=[m[0] for m in MODELS])
def test_preset_builds_within_budget(preset, model):
    """The global layers together, and every sliding layer on its own, stay within the budget
    at 1,024 tokens, and each window is the largest that does (one token more would not)."""
    _, layers, heads, d, windows = model
    budget = BUDGETS[preset]
    cache = nk.make_cache(preset, num_layers=layers, num_kv_heads=heads, head_dim=d, sliding_window=windows)
    assert cache.num_layers == layers and cache.num_kv_heads == heads and cache.head_dim == d
    windows = windows or [None] * layers
    assert cache.layer_windows == windows
    assert _hand_bits(cache, heads, d) <= budget
    glob = [i for i in range(layers) if windows[i] is None]
    assert budget - 0.02 < _hand_bits(cache, heads, d, layers=glob) <= budget
    r = _part(cache, glob[0]).residual_length
    assert all(_part(cache, i).residual_length == r for i in glob)
    # one more window token on every global layer exceeds the budget
    wider = nk.make_cache(preset, num_layers=layers, num_kv_heads=heads, head_dim=d, residual_length=r + 1)
    assert _hand_bits(wider, heads, d, layers=glob) > budget
    for i in range(layers):
        if windows[i] is None:
            continue
        part = _part(cache, i)
        one = _bits(_hand_bytes(part, d, BUDGET_TOKENS, windows[i]), 1, 1, d)
        more = _bits(_hand_bytes(part, d, BUDGET_TOKENS, windows[i]) + 2 * (d + 2) - (part.k_bits + part.v_bits)
                     * d // 8 - 4, 1, 1, d)
        assert one <= budget and (part.residual_length == windows[i] or more > budget)


def test_sliding_layers_by_hand():
    """Gemma-3-270M's geometry (d = 256, one KV head, sliding window 512): a local layer holds
    512 tokens at 1,024 positions; with ``kv4``'s keys 4·256/8 + 2 = 130 bytes and values
    3·256/8 + 2 = 98 (``kv5``: 5·256/8 + 2 = 162 and 4·256/8 + 2 = 130), an int8 window vector
    2·(256 + 2) = 516 and 1,024 bytes of key means, 4.0 bits/value over 1,024 positions
    (262,144 bytes) allow 501 window tokens, 5.0 bits (327,680) all 512; the global layers
    keep the window of an all-global model."""
    gemma = [512] * 5 + [None]
    for preset, want, comp in (("kv4", 501, 130 + 98), ("kv5", 512, 162 + 130)):
        _, opts, over = resolve_preset(preset, num_layers=6, num_kv_heads=1, head_dim=256, sliding_window=gemma)
        r = over[0]["residual_length"]
        assert r == want and all(over[i] == {"residual_length": want} for i in range(5)) and 5 not in over
        assert (512 - r) * comp + r * 516 + 1024 <= BUDGETS[preset] * 2 * 256 * 1024 / 8
        assert r == 512 or (511 - r) * comp + (r + 1) * 516 + 1024 > BUDGETS[preset] * 2 * 256 * 1024 / 8
        plain = resolve_preset(preset, num_layers=6, num_kv_heads=1, head_dim=256)[1]["residual_length"]
        assert opts["residual_length"] == plain
    # windows of 1,024 tokens or more: the layer stores every budget token, sized as global
    assert resolve_preset("kv4", num_layers=2, num_kv_heads=1, head_dim=256, sliding_window=1024)[2] == {}
    # a preset that fixes a sliding layer's window is held to the budget on that layer too
    over_budget = Preset("t", "pqo-k4v3-head-eden", {"key_center": True, "window_dtype": "int8"}, 4.0,
                         layer_overrides={0: {"residual_length": 512}})  # 512 int8 tokens: 4.05 bits
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(PRESETS, "t", over_budget)
        with pytest.raises(ValueError, match="sliding layer 0 with its own options exceeds 4.0 bits/value"):
            resolve_preset("t", num_layers=6, num_kv_heads=1, head_dim=256, sliding_window=gemma)
        mp.setitem(PRESETS, "t", Preset("t", "pqo-k4v3-head-eden", {"key_center": True, "window_dtype": "int8"},
                                        4.0, layer_overrides={0: {"residual_length": 400}}))
        assert resolve_preset("t", num_layers=6, num_kv_heads=1, head_dim=256, sliding_window=gemma)[2][0] == {
            "residual_length": 400}
    # a user's override of a sliding layer's window wins over the preset's
    cache = nk.make_cache("kv4", num_layers=6, num_kv_heads=1, head_dim=256, sliding_window=gemma,
                          layer_overrides={1: {"residual_length": 7}})
    assert [_part(cache, i).residual_length for i in range(6)] == [501, 7, 501, 501, 501, 92]


def test_kv4_numbers_by_hand():
    """The arithmetic spelled out for SmolLM2's geometry (30 layers, 3 KV heads, d = 64): keys
    4·64/8 + 2 = 34 bytes, values 3·64/8 + 2 = 26, an int8 window vector 64 + 2 = 66, key means
    256 bytes per layer and head; 4.0 bits/value at 1,024 tokens allows 53 window tokens."""
    base, opts, over = resolve_preset("kv4", num_layers=30, num_kv_heads=3, head_dim=64)
    window = opts["sink_tokens"] + opts["residual_length"]
    per_head = (1024 - window) * (34 + 26) + window * 2 * 66 + 256
    assert per_head * 8 / (2 * 64 * 1024) <= 4.0 < (per_head + 132 - 60) * 8 / (2 * 64 * 1024)
    assert (base, window, over) == ("pqo-k4v3-head-eden", 53, {})


def test_kv5_numbers_by_hand():
    """``kv5`` on SmolLM2's geometry: keys 5·64/8 + 2 = 42 bytes, values 4·64/8 + 2 = 34, an
    int8 window vector 64 + 2 = 66, key means 256 bytes per layer and head; 5.0 bits/value at
    1,024 tokens (81,920 bytes per head) allows 68 window tokens: 8 sinks and 60 recent."""
    base, opts, over = resolve_preset("kv5", num_layers=30, num_kv_heads=3, head_dim=64)
    window = opts["sink_tokens"] + opts["residual_length"]
    per_head = (1024 - window) * (42 + 34) + window * 2 * 66 + 256
    assert per_head * 8 / (2 * 64 * 1024) <= 5.0 < (per_head + 132 - 76) * 8 / (2 * 64 * 1024)
    assert (base, opts["sink_tokens"], window, over) == ("pqo-k5v4-head-eden", 8, 68, {})


def test_kv3_numbers_by_hand():
    """``kv3`` on SmolLM2's geometry: keys 4·64/8 + 1 = 33 bytes and values 2·64/8 + 1 = 17 (one
    byte per 8-bit norm), an int8 window vector 64 + 2 = 66, key means 256 bytes per layer and
    head; 3.5 bits/value at 1,024 tokens (57,344 bytes per head) allows 16 sinks and 55 recent
    tokens.  The window then grows as f = 55/1024 of the history: at 8,192 tokens 440, and the
    bits/value stay within the budget at every length from 1,024 on (3.412 at 8K, where a fixed
    window would fall to 3.171)."""
    base, opts, over = resolve_preset("kv3", num_layers=30, num_kv_heads=3, head_dim=64)
    assert (base, opts["sink_tokens"], opts["residual_length"], opts["residual_fraction"], over) == \
        ("pqo-k4v2-head-eden-vq-n8", 16, 55, 55 / 1024, {})

    def bits(t: int, grow: bool = True) -> float:
        window = 16 + max(55, 55 * t // 1024 if grow else 0)
        return ((t - window) * (33 + 17) + window * 2 * 66 + 256) * 8 / (2 * 64 * t)

    assert bits(1024) <= 3.5 < ((1024 - 72) * 50 + 72 * 132 + 256) * 8 / (2 * 64 * 1024)
    assert all(3.4 < bits(t) <= 3.5 for t in (1024, 1500, 2048, 4096, 8192, 32768))
    assert bits(8192) == pytest.approx(3.412, abs=5e-4) and bits(8192, grow=False) == pytest.approx(3.171, abs=5e-4)
    cache = nk.make_cache("kv3", num_layers=30, num_kv_heads=3, head_dim=64)
    for t in (1024, 8192):
        assert presets.preset_bytes("kv3", num_layers=30, num_kv_heads=3, head_dim=64, residual_length=55,
                                    tokens=t) * 8 / (2 * 30 * 3 * 64 * t) == pytest.approx(bits(t), abs=1e-12)
    assert cache.name.startswith("pqo-k4v2-head-eden-vq-n8-r55-g5.37109375-s16")


def test_kv3_grown_window_is_what_the_cache_stores():
    """At 3,000 tokens ``kv3``'s window (d = 64: 55 tokens at 1,024) is 55·3000 // 1024 = 161
    tokens, and the cache stores the bytes of the hand count (fed in uneven chunks, as a decode
    loop would)."""
    rng = np.random.default_rng(1)
    cache = nk.make_cache("kv3", num_layers=1, num_kv_heads=1, head_dim=64)
    k = rng.standard_normal((1, 1, 3000, 64)).astype(np.float32)
    t = 0
    for n in (700, 1, 299, 1000, 7, 993):
        cache.prefill(0, k[:, :, t:t + n], 0.5 * k[:, :, t:t + n])
        t += n
    part = _layers(cache)[0][0]
    assert t == 3000 and 55 * 3000 // 1024 == 161
    assert cache.memory_usage() == _hand_bytes(part, 64, 3000) == (3000 - 177) * 50 + 177 * 132 + 256


@pytest.mark.parametrize("windows", [None, [16, None]], ids=["global", "sliding"])
def test_formula_equals_memory_usage(windows):
    """The count the presets are sized by is what the cache stores at 1,024 tokens (a
    sliding layer after the model's last step: its window's tokens); ``preset_bytes`` too."""
    rng = np.random.default_rng(0)
    for preset in sorted(PRESETS):
        cache = nk.make_cache(preset, num_layers=2, num_kv_heads=1, head_dim=64, sliding_window=windows)
        for layer in range(2):
            k = rng.standard_normal((1, 1, BUDGET_TOKENS, 64)).astype(np.float32)
            cache.prefill(layer, k[:, :, :-1], 0.5 * k[:, :, :-1])
            cache.prefill(layer, k[:, :, -1:], 0.5 * k[:, :, -1:])
        ws = windows or [None, None]
        hand = sum(_hand_bytes(p, 64, BUDGET_TOKENS, ws[i]) for i, (p, _) in enumerate(_layers(cache)))
        assert cache.memory_usage() == hand
        res = [_part(cache, i).residual_length for i in range(2)]
        assert presets.preset_bytes(preset, num_layers=2, num_kv_heads=1, head_dim=64, residual_length=res,
                                    sliding_window=windows) == hand


def test_relative_layer_overrides(monkeypatch):
    """A preset's ``{0: ..., -1: ...}`` lands on the first and last layer of any depth, and its
    bytes are counted when the window is sized."""
    monkeypatch.setitem(PRESETS, "kv4", Preset("kv4", "pqo-k4v3-head-eden", {"key_center": True,
                                                                             "window_dtype": "int8"}, 4.0,
                                               layer_overrides={0: {"v_bits": 4}, -1: {"v_bits": 4}}))
    plain = resolve_preset("kv5", num_layers=30, num_kv_heads=3, head_dim=64)
    for layers, heads, d, _ in [(m[1], m[2], m[3], m[4]) for m in MODELS]:
        cache = nk.make_cache("kv4", num_layers=layers, num_kv_heads=heads, head_dim=d)
        assert isinstance(cache, MixedCache)
        assert [cache.layer_cache(i).v_bits for i in range(layers)] == [4] + [3] * (layers - 2) + [4]
        assert _hand_bits(cache, heads, d) <= 4.0
    eight = nk.make_cache("kv4", num_layers=8, num_kv_heads=1, head_dim=64)
    assert [eight.layer_cache(i).v_bits for i in range(8)] == [4] + [3] * 6 + [4]
    with pytest.raises(ValueError, match="exceeds 4.0 bits/value on head_dim=64, 1 layers even without a window"):
        nk.make_cache("kv4", num_layers=1, num_kv_heads=1, head_dim=64)  # first = last layer: all at 4 bits
    assert resolve_preset("kv5", num_layers=30, num_kv_heads=3, head_dim=64) == plain
    # the protected layers cost window tokens: fewer than without them
    _, with_layers, _ = resolve_preset("kv4", num_layers=30, num_kv_heads=3, head_dim=64)
    assert with_layers["residual_length"] < 49


def test_grammar_and_options():
    spec = parse_cache_spec("KV4")
    assert spec.is_preset and spec.label == "kv4" and not spec.is_dense
    assert parse_cache_spec("kv5:decode_output=dequantized").label == "kv5:decode_output=dequantized"
    # --residual-length of the command line does not resize a preset's window
    assert parse_cache_spec("kv4", {"residual_length": 8}).options == {}
    assert [s.label for s in parse_cache_specs("dense,kv4,kv5")] == ["dense", "kv4", "kv5"]
    cache = spec.make(30, 3, 64)
    assert cache.name == "pqo-k4v3-head-eden-r49-s4"
    c = nk.make_cache("kv4", num_layers=2, num_kv_heads=1, head_dim=64, decode_output="dequantized")
    assert c.decode_output == "dequantized" and c.residual_length == 49


@pytest.mark.parametrize("bad", ["kv2", "KV9", "kv4-r32"])
def test_unknown_preset_lists_presets(bad):
    with pytest.raises(ValueError, match=r"unknown preset .*\['kv3', 'kv4', 'kv5'\]"):
        nk.make_cache(bad, num_layers=2, num_kv_heads=1, head_dim=64)
    with pytest.raises(EvalConfigError, match=r"--cache: unknown preset .*\['kv3', 'kv4', 'kv5'\]"):
        parse_cache_specs(f"dense,{bad}")
    with pytest.raises(ValueError, match=r"unknown preset 'nope'; expected one of \['kv3', 'kv4', 'kv5'\]"):
        presets.resolve_preset("nope", num_layers=2, num_kv_heads=1, head_dim=64)


@pytest.mark.parametrize("kw, exc, word", [
    (dict(num_layers=2.0), TypeError, "num_layers: expected an int, got float 2.0"),
    (dict(num_kv_heads=1.0), TypeError, "num_kv_heads: expected an int, got float 1.0"),
    (dict(num_layers=0), ValueError, "num_layers: expected an int >= 1"),
    (dict(head_dim=48), ValueError, "head_dim: expected a positive multiple of 32"),
])
def test_a_preset_names_a_bad_geometry_argument(kw, exc, word):
    # (a float count failed inside the layer list: "can't multiply sequence by non-int")
    geo = {"num_layers": 2, "num_kv_heads": 1, "head_dim": 64, **kw}
    for call in (nk.make_cache, presets.resolve_preset):
        with pytest.raises(exc, match=word):
            call("kv4", **geo)
    with pytest.raises(exc, match=word):
        presets.preset_bytes("kv4", residual_length=8, tokens=64, **geo)


def test_override_of_every_layer_applies():
    """Overrides that give every layer the same options (a preset's first and last layer on a
    one-layer model) build one plain cache of those options, not of the base."""
    one = nk.make_cache("pqo3", num_layers=1, num_kv_heads=1, head_dim=64, layer_overrides={-1: {"bits": 4}})
    assert not isinstance(one, MixedCache) and one.bits == 4


def test_user_head_overrides_resize_the_window():
    """A calibration passed to a preset (``head_overrides``) is counted before the window is
    sized: narrower heads buy window tokens, the budget still holds by hand, and the window
    grows as f = R / 1024 of the history (on a model with sliding layers, each layer at the rate of
    its own window)."""
    geo = dict(num_layers=2, num_kv_heads=2, head_dim=64)
    narrow = {0: {0: {"k_bits": 3}}, 1: {1: {"k_bits": 3}}}  # two of four heads: keys 33 -> 25 bytes
    _, plain, _ = resolve_preset("kv3", **geo)
    _, opts, _ = resolve_preset("kv3", **geo, head_overrides=narrow)
    r = opts["residual_length"]
    assert r > plain["residual_length"] == 55 and opts["residual_fraction"] == r / 1024

    def per_layer(r: int) -> int:  # one layer: a narrow head (25 + 17 bytes) and a k4v2 one (33 + 17)
        w = 16 + r
        return sum((1024 - w) * comp + w * 132 + 256 for comp in (42, 50))

    assert per_layer(r) * 8 / (2 * 2 * 64 * 1024) <= 3.5 < per_layer(r + 1) * 8 / (2 * 2 * 64 * 1024)
    cache = nk.make_cache("kv3", **geo, head_overrides=narrow)
    assert _part(cache, 0).residual_length == r
    assert presets.preset_bytes("kv3", **geo, residual_length=r, head_overrides=narrow) == 2 * per_layer(r)
    _, opts, over = resolve_preset("kv3", num_layers=6, num_kv_heads=1, head_dim=256, sliding_window=[512] * 5 + [None])
    assert opts["residual_fraction"] == opts["residual_length"] / 1024
    assert all(over[i]["residual_fraction"] == over[i]["residual_length"] / 1024 for i in range(5))


@pytest.mark.parametrize("tokens", [1024, 2048])
def test_kv3_sliding_windows_grow_with_the_history(tokens, rng):
    """``kv3`` on a Gemma-3-like geometry: a sliding layer's window is the budget's
    ``r`` tokens at 1,024 tokens of history (its bytes then within 3.5 bits/value of that
    history) and, as ``floor(r·t / 1024)`` outgrows the 512 tokens it stores, every stored
    token is int8 (2,048 tokens); bytes counted by hand (int8 vector 256 + 2 bytes, 4-bit
    VQ keys 128 + 1, 2-bit values 64 + 1, a float32 key mean per row)."""
    geo = dict(num_layers=6, num_kv_heads=1, head_dim=256, sliding_window=[512] * 5 + [None])
    _, opts, over = resolve_preset("kv3", **geo)
    r, R = over[0]["residual_length"], opts["residual_length"]
    assert 0 < r < 512 and 512 * 1024 // r < 2048  # all 512 exact before 2,048 tokens
    cache = nk.make_cache("kv3", **geo)
    x = rng.standard_normal((1, 1, tokens, 256)).astype(np.float32)
    cfg = nk.AttendConfig(256 ** -0.5, 1)
    for layer in range(6):
        cache.prefill(layer, x[:, :, :-1], x[:, :, :-1])
        cache.decode(layer, x[:, :, -1:], x[:, :, -1:], x[:, :, -1:], cfg)
    win = min(512, r * tokens // 1024)
    part, j = _layers(cache)[0]
    meta = part._layers[j].meta
    assert (meta.get("n_comp", 0), meta["n_win"]) == (512 - win, win)
    sliding = 2 * win * 258 + (512 - win) * (129 + 65) + 256 * 4
    exact = 16 + max(R, R * tokens // 1024)
    glob = 2 * exact * 258 + (tokens - exact) * (129 + 65) + 256 * 4
    assert cache.memory_usage() == 5 * sliding + glob
    assert presets.preset_bytes("kv3", **geo, residual_length=[r] * 5 + [R], tokens=tokens) == 5 * sliding + glob
    assert 8 * sliding / (2 * 256 * tokens) <= 3.5


@pytest.mark.parametrize("preset", ["kv3", "kv4", "kv5"])
def test_preset_names_a_head_dim_its_whole_head_codes_cannot_take(preset):
    """The presets store whole-head codes (a Hadamard over the head: a power of two); a head_dim
    of 96 (Phi-3) is refused naming ``head_dim`` and the preset, not an option the caller never
    set, and a 32-block name still builds there."""
    with pytest.raises(ValueError, match=rf"head_dim: preset '{preset}'.*power of two.*got 96.*'pqo4'"):
        nk.make_cache(preset, num_layers=2, num_kv_heads=2, head_dim=96)
    assert nk.make_cache("pqo4", num_layers=2, num_kv_heads=2, head_dim=96).head_dim == 96
