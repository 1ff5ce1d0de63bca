"""A full-precision window that grows with the history (``residual_fraction``): the pure
arithmetic against a token-list model with exact rationals, and caches whose window grows
while they are fed, checked against formulas, a fixed-window cache, the dequantized
oracle, a save/load round trip and the name grammar."""

import math
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from numba_kv import AttendConfig, PolarQuantCache, load_cache, make_cache, reference
from numba_kv.caches import presets
from numba_kv.caches._window import crop_counts, fraction_ratio, plan_store, window_capacity
from numba_kv.caches.config import PolarQuantConfig
from numba_kv.caches.spec import parse_cache_spec
from numba_kv.caches.state import CacheFileError


def _cap(t, residual, pct):
    """``R(t)`` by its definition, with the percentage read as an exact decimal."""
    return max(residual, math.floor(Fraction(pct) / 100 * t))


def _counts(cache, layer=0):
    meta = cache._layers[layer].meta
    return meta.get("n_sink", 0), meta.get("n_comp", 0), meta.get("n_win", 0)


# -- the arithmetic ----------------------------------------------------------------------------

@pytest.mark.parametrize("pct", ["7", "7.5", "29", "0.1", "33.333", "99.9999"])
def test_fraction_ratio_is_the_decimal(pct):
    f = float(Decimal(pct) / 100)
    num, den = fraction_ratio(f)
    assert Fraction(num, den) == Fraction(pct) / 100
    # the binary float alone would round some lengths the other way (0.29·100 = 28.99...)
    for t in (100, 1024, 8192, 10 ** 6 + 7):
        assert window_capacity(t, 0, (num, den)) == _cap(t, 0, pct)


@given(hs.integers(0, 10 ** 6), hs.integers(0, 2000), hs.integers(0, 64), hs.integers(1, 999))
def test_window_capacity_grows_slower_than_the_tokens(t, n, residual, permille):
    ratio = fraction_ratio(permille / 1000)
    r0, r1 = window_capacity(t, residual, ratio), window_capacity(t + n, residual, ratio)
    assert r0 == _cap(t, residual, Decimal(permille) / 10)
    assert r0 <= r1 <= r0 + n  # nondecreasing, and never more than the new tokens supply


@given(hs.integers(1, 500), hs.integers(0, 300), hs.integers(0, 300))
def test_a_store_evicts_down_to_the_capacity_from_any_window(n, n_win, cap):
    """A sliding layer's eviction can leave more window than the capacity at its now shorter
    length (no sinks there): the next store evicts down to it, oldest first."""
    plan = plan_store(n, n_win + 7, n_win, 0, cap)
    assert min(plan) >= 0 and plan.sinks == 0
    assert plan.keep_old + plan.keep_new == min(n_win + n, cap)
    assert plan.evict_old == min(n_win, max(0, n_win + n - cap))  # old tokens first
    assert plan.compressed == n_win + n - min(n_win + n, cap) and plan.keep_old + plan.evict_old == n_win


def _model_store(model, n, sinks, residual, pct):
    """The token-list model: new tokens fill the sinks, then the window; the oldest window
    tokens beyond ``R(t)`` are compressed (appended to the compressed list)."""
    s, c, w = model["s"], model["c"], model["w"]
    t0 = len(s) + len(c) + len(w)
    new = list(range(model["next"], model["next"] + n))
    model["next"] += n
    while new and len(s) < sinks and not c and not w:
        s.append(new.pop(0))
    w.extend(new)
    cap = _cap(t0 + n, residual, pct)
    while len(w) > cap:
        c.append(w.pop(0))


def _model_crop(model, length):
    order = model["s"] + model["c"] + model["w"]
    keep = set(order[:length])
    for key in ("s", "c", "w"):
        model[key] = [x for x in model[key] if x in keep]
    model["next"] = length


_OPS = hs.lists(hs.one_of(hs.tuples(hs.just("store"), hs.integers(1, 300)),
                          hs.tuples(hs.just("crop"), hs.floats(0.0, 1.0))), min_size=1, max_size=40)


@settings(max_examples=300, deadline=None)
@given(_OPS, hs.integers(0, 6), hs.integers(0, 40), hs.sampled_from(["7", "7.5", "29", "50", "0.5"]))
def test_stores_and_crops_follow_the_token_model(ops, sinks, residual, pct):
    """After any sequence of stores and crops the counters are the model's; every token is
    in exactly one place, in order (sinks, compressed, window); the window never exceeds
    ``R(t)``; a store compresses only what must leave it, so after stores alone the window
    is ``min(tokens past the sinks, R(t))``."""
    ratio = fraction_ratio(float(Decimal(pct) / 100))
    model = {"s": [], "c": [], "w": [], "next": 0}
    n_sink = n_comp = n_win = 0
    cropped = False
    for op, arg in ops:
        t = n_sink + n_comp + n_win
        if op == "store":
            plan = plan_store(arg, t, n_win, sinks, window_capacity(t + arg, residual, ratio))
            assert min(plan) >= 0
            assert plan.keep_old + plan.keep_new == min(n_win + arg - plan.sinks, _cap(t + arg, residual, pct))
            n_sink, n_comp, n_win = n_sink + plan.sinks, n_comp + plan.compressed, plan.keep_old + plan.keep_new
            _model_store(model, arg, sinks, residual, pct)
        else:
            length = int(arg * t)
            n_sink, n_comp, n_win = crop_counts(n_sink, n_comp, length, True)
            _model_crop(model, length)
            cropped = cropped or length < t
        t = n_sink + n_comp + n_win
        assert (n_sink, n_comp, n_win) == (len(model["s"]), len(model["c"]), len(model["w"]))
        assert model["s"] + model["c"] + model["w"] == list(range(t))
        assert n_win <= _cap(t, residual, pct)
        if not cropped:
            assert n_sink == min(t, sinks) and n_win == min(t - n_sink, _cap(t, residual, pct))


# -- configuration and names -------------------------------------------------------------------

@pytest.mark.parametrize("bad", [-0.01, 1.0, 1.5, float("nan"), float("inf"), -float("inf"), 0.9999999,
                                 1 - 2 ** -30])
def test_bad_fractions_raise_naming_the_argument(bad):
    with pytest.raises(ValueError, match="residual_fraction"):
        PolarQuantCache(1, 1, 64, residual_fraction=bad)
    with pytest.raises(ValueError, match="residual_fraction"):
        make_cache("tq3", num_layers=1, num_kv_heads=1, head_dim=64, residual_fraction=bad)
    for wrong in ("0.1", True, None):
        with pytest.raises(TypeError, match="residual_fraction"):
            PolarQuantConfig(1, 1, 64, residual_fraction=wrong)
    with pytest.raises(ValueError, match="residual_fraction"):
        make_cache("pqo3-r4-g100", num_layers=1, num_kv_heads=1, head_dim=64)


@pytest.mark.parametrize("text, pct", [("pqo3-r44-g7-s4", "7"), ("pqo-k4v3-head-eden-r0-g7.5-s0", "7.5"),
                                       ("tq3-r8-g12.25-s2", "12.25"), ("pqo4-g50", "50")])
def test_name_round_trip(text, pct):
    spec = parse_cache_spec(text)
    assert spec.options["residual_fraction"] == float(Decimal(pct) / 100)
    cfg = spec.config(2, 2, 64)
    assert cfg.residual_fraction == float(Decimal(pct) / 100)
    cache = make_cache(text, num_layers=2, num_kv_heads=2, head_dim=64)
    assert cache.name == spec.label == parse_cache_spec(cache.name).label
    assert f"-g{pct}-" in cache.name
    rebuilt = type(cache)(**cache.config_dict())
    assert rebuilt.config == cache.config
    with pytest.raises(ValueError, match="residual_fraction given twice"):
        parse_cache_spec(text + ":residual_fraction=0.1")


def test_the_largest_fraction_below_one_is_accepted():
    """0.9999999 passed the ``[0, 1)`` check but its exact ratio (denominator <= 10**6) was 1/1,
    so every token stayed in the window; it is refused now (above), the largest ratio below 1
    still taken."""
    assert PolarQuantCache(1, 1, 64, residual_fraction=0.999999).residual_fraction == 0.999999


def test_config_dict_omits_a_zero_fraction():
    """Caches without a growing window write the configuration they always wrote (golden
    digests, files readable by earlier versions)."""
    plain = make_cache("pqo3-r8-s2", num_layers=1, num_kv_heads=1, head_dim=64)
    assert "residual_fraction" not in plain.config_dict() and plain.name == "pqo3-r8-s2"
    grown = make_cache("pqo3-r8-s2", num_layers=1, num_kv_heads=1, head_dim=64, residual_fraction=0.25)
    assert grown.config_dict()["residual_fraction"] == 0.25 and grown.name == "pqo3-r8-g25-s2"
    only = make_cache("pqo3-r0-s0", num_layers=1, num_kv_heads=1, head_dim=64, residual_fraction=0.1)
    assert only.windowed and only.name == "pqo3-r0-g10-s0"
    x = np.ones((1, 1, 30, 64), np.float32)
    only.prefill(0, x, x)  # no sinks, no floor: the window is the fraction alone (buffers of 0 tokens grow)
    assert _counts(only) == (0, 27, 3)


def test_fraction_is_a_layer_option_not_a_head_option():
    mixed = make_cache("pqo3-r4-s2", num_layers=2, num_kv_heads=2, head_dim=64,
                       layer_overrides={1: {"residual_fraction": 0.5}})
    assert [mixed.layer_cache(i).residual_fraction for i in range(2)] == [0.0, 0.5]
    x = np.ones((1, 2, 100, 64), np.float32)
    for layer in (0, 1):
        mixed.prefill(layer, x, x)
    wins = []
    for layer in (0, 1):
        part, j, _ = mixed.layer_pieces(layer)[0]
        wins.append(part._layers[j].meta["n_win"])
    assert wins == [4, 50]  # residual_length 4; floor(0.5 · 100)
    again = type(mixed).from_state_dict(mixed.state_dict())
    assert again.config_dict() == mixed.config_dict() and again.memory_usage() == mixed.memory_usage()
    with pytest.raises(ValueError, match="residual_fraction"):
        make_cache("pqo3", num_layers=1, num_kv_heads=2, head_dim=64,
                   head_overrides={0: {1: {"residual_fraction": 0.5}}})


# -- caches fed a long sequence ------------------------------------------------------------------

_CHUNKS = [200, 1, 1, 5, 1, 1, 1, 17, 1, 1, 64, 1, 1, 1, 1, 3, 1, 1, 200, 1, 1, 1, 1, 1, 9, 1, 1, 130, 1, 1]
_D, _H = 64, 2


def _feed(caches, chunks, rng, q_groups=1):
    """Feed every cache the same chunks (the first a prefill, the rest decode steps); yield
    after each step the step's decode outputs."""
    cfg = AttendConfig(_D ** -0.5, q_groups)
    for i, n in enumerate(chunks):
        k = rng.standard_normal((1, _H, n, _D)).astype(np.float32)
        v = rng.standard_normal((1, _H, n, _D)).astype(np.float32)
        if i == 0:
            yield k, v, [c.prefill(0, k, v) for c in caches]
            continue
        q = rng.standard_normal((1, _H * q_groups, n, _D)).astype(np.float32)
        yield k, v, [c.decode(0, k, v, q, cfg) for c in caches]


def _row_bytes(t, sinks, residual, pct, window_item, vector):
    """Bytes one row stores at ``t`` tokens filled by stores, K and V (by hand: exact tokens
    at ``window_item`` bytes per value plus int8 scales, the rest ``vector`` bytes)."""
    exact = min(t, sinks + _cap(t, residual, pct))
    per_exact = _D * window_item + (2 if window_item == 1 else 0)
    return 2 * (exact * per_exact + (t - exact) * vector)


@pytest.mark.parametrize("name, window_dtype, vector", [
    ("pqo3", "float16", _D * 3 // 8 + 2 * (_D // 32)),           # 3-bit codes, a binary16 scale per 32
    ("pqo-k4v3-head-eden", "int8", None),                        # sides differ: counted by the config
])
def test_window_follows_the_formula_at_every_step(name, window_dtype, vector, rng):
    """Prefill and many decode steps of varied sizes: ``n_win == min(t − S, R(t))`` and
    ``memory_usage`` counts exactly the stored bytes after every step; the exact buffers
    grow a few times (amortized), not once per token."""
    cache = make_cache(f"{name}-r20-g7.5-s4", num_layers=1, num_kv_heads=_H, head_dim=_D, window_dtype=window_dtype)
    t, buffers = 0, set()
    for _ in _feed([cache], _CHUNKS, rng):
        t = cache.seq_len(0)
        n_sink, n_comp, n_win = _counts(cache)
        assert n_sink == 4 and n_win == min(t - 4, _cap(t, 20, "7.5")) and n_comp == t - 4 - n_win
        if vector is None:
            cfg = cache.config
            want = _H * sum(_row_bytes_side(t, cfg, side) for side in ("k", "v"))
        else:
            want = _H * _row_bytes(t, 4, 20, "7.5", 2, vector)
        assert cache.memory_usage() == want
        buffers.add(cache._layers[0].buffers["k_exact"].shape[1])
    # R grew from 20 to 48 tokens over the decode steps; the buffers grew once (S + R = 24,
    # then 4 + 21 + 128 by the growth rule)
    assert _cap(t, 20, "7.5") == 48 and buffers == {24, 153}


def _row_bytes_side(t, cfg, side):
    """One side of one row: int8 exact tokens (value bytes plus a binary16 scale) and the head
    code (``slot_bits`` per value and one binary16 norm per vector); the key mean when set."""
    exact = min(t, 4 + _cap(t, 20, "7.5"))
    return exact * (_D + 2) + (t - exact) * (_D * cfg.slot_bits[side] // 8 + 2)


@pytest.mark.parametrize("name, opts", [("pqo3", {"window_dtype": "float32"}),
                                        ("pqo-k4v3-head-eden", {"window_dtype": "float32"}),
                                        ("tq3", {"window_dtype": "float32", "decode_output": "dequantized"})])
def test_growing_window_equals_a_fixed_window_of_its_final_size(name, opts, rng):
    """A store-only history leaves the same tokens compressed whatever the window's size was
    on the way (each vector is coded on its own, and a float32 window hands the compressor
    the token as it came; a rounding window would not): a growing cache fed in chunks ends with the
    bytes of a fixed-window cache with ``residual_length = R(T)`` fed at once, and their
    decode outputs agree."""
    chunks = _CHUNKS[:-1]
    # (the window outgrows its first buffers during the decode steps: R(250) = 25 > 24)
    grow = make_cache(f"{name}-r24-g10-s3", num_layers=1, num_kv_heads=_H, head_dim=_D, **opts)
    steps = list(_feed([grow], chunks, rng))
    T = grow.seq_len(0) + 1
    fixed = make_cache(f"{name}-r{_cap(T, 24, '10')}-s3", num_layers=1, num_kv_heads=_H, head_dim=_D, **opts)
    fixed.prefill(0, np.concatenate([s[0] for s in steps], 2), np.concatenate([s[1] for s in steps], 2))
    last = list(_feed([grow, fixed], [1, 1], np.random.default_rng(5)))
    a, b = (r.out if hasattr(r, "out") else r.result.k for r in last[-1][2])
    np.testing.assert_array_equal(a, b)
    assert _counts(grow) == _counts(fixed) and grow.memory_usage() == fixed.memory_usage()
    for key, buf in fixed._layers[0].buffers.items():
        live = fixed._layers[0].live_count(key)
        np.testing.assert_array_equal(grow._layers[0].buffers[key][:, :live], buf[:, :live])


@pytest.mark.parametrize("window_dtype", ["float32", "int8"])
def test_fused_decode_equals_the_dequantized_oracle_while_growing(window_dtype, rng):
    """Every fused decode output equals float64 attention over the history the dequantized
    cache returns, and (float32 window) that history holds the sinks and the newest
    ``n_win`` tokens bit-exact and every other token compressed."""
    opts = dict(num_layers=1, num_kv_heads=_H, head_dim=_D, window_dtype=window_dtype)
    fused = make_cache("pqo3-head-r8-g10-s2", **opts)
    deq = make_cache("pqo3-head-r8-g10-s2", decode_output="dequantized", **opts)
    cfg = AttendConfig(_D ** -0.5, 2)
    history = []
    for n in [40, 1, 3, 1, 60, 1, 1, 1, 30, 1, 1, 2, 1]:
        k = rng.standard_normal((1, _H, n, _D)).astype(np.float32)
        v = rng.standard_normal((1, _H, n, _D)).astype(np.float32)
        q = rng.standard_normal((1, 2 * _H, n, _D)).astype(np.float32)
        history.append(k)
        out = fused.decode(0, k, v, q, cfg).out
        res = deq.decode(0, k, v, q, cfg).result
        T = fused.seq_len(0)
        ref = reference.attention(q, res.k, res.v, cfg.softmax_scale, causal_offset=T - n)
        assert float(np.abs(out - ref).max() / np.abs(ref).max()) < 1e-5
        full = np.concatenate(history, 2)
        n_sink, _, n_win = _counts(deq)
        assert _counts(fused) == _counts(deq) and n_win == min(T - 2, _cap(T, 8, "10"))
        if window_dtype != "float32":
            continue
        exact = np.zeros(T, bool)
        exact[:n_sink] = True
        exact[T - n_win:] = True
        np.testing.assert_array_equal(res.k[:, :, exact], full[:, :, exact])
        err = np.linalg.norm(res.k[:, :, ~exact] - full[:, :, ~exact], axis=-1)
        # compressed, and from the token itself (3-bit codes: a fraction of its norm)
        assert (err > 0).all() and (err < 0.5 * np.linalg.norm(full[:, :, ~exact], axis=-1)).all()


def test_save_load_mid_growth(tmp_path, rng):
    """A cache saved after its window outgrew its first buffers (a global and a sliding
    layer) loads equal: counters, and every later output bit for bit."""
    pytest.importorskip("safetensors")
    cache = make_cache("pqo4-r6-g20-s2", num_layers=2, num_kv_heads=_H, head_dim=_D, window_dtype="int8",
                       sliding_window=[None, 48])
    list(_feed_layers(cache, [90, 1, 1, 7, 1], rng))
    assert cache._layers[0].buffers["k_exact"].shape[1] > 2 + 6
    # the sliding layer's window follows its history, beyond a share of what it stores
    assert _cap(cache.stored_len(1), 6, "20") < _counts(cache, 1)[2] <= _cap(cache.seq_len(1), 6, "20")
    cache.save(tmp_path / "grown.safetensors")
    loaded = load_cache(tmp_path / "grown.safetensors")
    assert loaded.name == cache.name == "pqo4-r6-g20-s2"
    for a, b in zip(cache._layers, loaded._layers):
        assert a.meta == b.meta and a.seq_len == b.seq_len
    cfg = AttendConfig(_D ** -0.5, 1)
    for n in (1, 30, 1):
        k = rng.standard_normal((1, _H, n, _D)).astype(np.float32)
        for layer in (0, 1):
            np.testing.assert_array_equal(cache.decode(layer, k, k, k, cfg).out, loaded.decode(layer, k, k, k, cfg).out)
    assert [st.meta for st in loaded._layers] == [st.meta for st in cache._layers]
    assert loaded.memory_usage() == cache.memory_usage()


def test_crop_then_grow(rng):
    """A crop into the window and one into the compressed tokens keep the counters
    consistent (the window within ``R`` of the new length); the stores after them refill
    the window up to ``R(t)``, and the state stays loadable."""
    cache = make_cache("pqo4-r6-g20-s2", num_layers=1, num_kv_heads=_H, head_dim=_D, window_dtype="float32")
    list(_feed_layers(cache, [90, 1, 1, 7, 1, 30], rng))
    T = cache.seq_len(0)
    n_sink, n_comp, n_win = _counts(cache)
    assert n_win == _cap(T, 6, "20") == 26
    cache.crop(T - 3)  # inside the window
    assert _counts(cache) == (n_sink, n_comp, n_win - 3) and n_win - 3 <= _cap(T - 3, 6, "20")
    cache.crop(n_sink + n_comp - 5)  # inside the compressed tokens: the window is gone
    assert _counts(cache) == (n_sink, n_comp - 5, 0)
    t = cache.seq_len(0)
    for n in (1, 40, 1):
        list(_feed_layers(cache, [n], rng, prefill=False))
        t += n
        assert _counts(cache)[2] == min(_cap(t, 6, "20"), t - (n_sink + n_comp - 5))
    assert _counts(cache)[2] == _cap(t, 6, "20")  # refilled
    again = type(cache).from_state_dict(cache.state_dict())
    assert [st.meta for st in again._layers] == [st.meta for st in cache._layers]


def _feed_layers(cache, chunks, rng, prefill=True):
    cfg = AttendConfig(_D ** -0.5, 1)
    for i, n in enumerate(chunks):
        k = rng.standard_normal((1, _H, n, _D)).astype(np.float32)
        for layer in range(cache.num_layers):
            yield cache.prefill(layer, k, k) if prefill and i == 0 else cache.decode(layer, k, k, k, cfg)


def test_a_file_with_a_window_beyond_its_capacity_is_refused(rng):
    cache = make_cache("pqo3-r4-g10-s2", num_layers=1, num_kv_heads=1, head_dim=_D)
    x = rng.standard_normal((1, 1, 100, _D)).astype(np.float32)
    cache.prefill(0, x, x)
    assert _counts(cache) == (2, 88, 10)
    state = cache.state_dict()
    meta = state.state["layers"][0]["meta"]
    meta.update(n_comp=87, n_win=11)  # one more than R(100) = 10
    state.state["layers"][0]["live"].update({k: 13 for k in state.state["layers"][0]["live"] if "exact" in k})
    for key in ("k_exact", "v_exact"):
        t = state.tensors[f"layers.0.{key}"]
        state.tensors[f"layers.0.{key}"] = np.concatenate([t, t[:, :1]], 1)
    for key in ("k_codes", "v_codes", "k_scales", "v_scales"):
        state.tensors[f"layers.0.{key}"] = state.tensors[f"layers.0.{key}"][:, :87]
    with pytest.raises(CacheFileError):
        type(cache).from_state_dict(state)


@pytest.mark.parametrize("tokens", [1024, 8192])
def test_bits_per_value_at_length(tokens, rng):
    """bits/value of a filled cache at 1K and 8K tokens by formula: the growing window keeps
    it near ``codes + f·(window − codes)``, while a fixed window's share falls with length."""
    opts = dict(num_layers=1, num_kv_heads=1, head_dim=128, window_dtype="int8", key_center=True)
    cache = make_cache("pqo3-head-r44-g7-s4", **opts)
    x = rng.standard_normal((1, 1, tokens, 128)).astype(np.float32)
    cache.prefill(0, x, x)
    exact = 4 + max(44, tokens * 7 // 100)
    want = 2 * (exact * (128 + 2) + (tokens - exact) * (128 * 3 // 8 + 2)) + 128 * 4  # + the key mean
    assert cache.memory_usage() == want
    assert cache.config.stored_bytes(tokens) == want
    bits = 8 * want / (2 * tokens * 128)
    assert bits == pytest.approx(3.125 + (exact / tokens) * (8 + 16 / 128 - 3.125) + 128 * 32 / (2 * tokens * 128))


def test_a_preset_can_carry_a_fraction(monkeypatch):
    """A preset's fraction reaches the cache and its bytes at any length (``preset_bytes``)."""
    grown = presets.Preset("kvg", "pqo-k4v3-head-eden", {"key_center": True, "window_dtype": "int8"}, 4.25,
                           residual_fraction=0.07)
    monkeypatch.setitem(presets.PRESETS, "kvg", grown)
    base, opts, over = presets.resolve_preset("kvg", num_layers=2, num_kv_heads=1, head_dim=64)
    assert opts["residual_fraction"] == 0.07 and over == {}
    r = opts["residual_length"]
    cfg = PolarQuantConfig(1, 1, 64, bits=4, k_bits=4, v_bits=3, rotation="head", unbiased=True, **opts)
    for tokens in (1024, 8192):
        exact = 4 + max(r, tokens * 7 // 100)
        row = 2 * exact * (64 + 2) + (tokens - exact) * (64 * 4 // 8 + 2 + 64 * 3 // 8 + 2) + 64 * 4
        assert presets.preset_bytes("kvg", num_layers=2, num_kv_heads=1, head_dim=64, residual_length=r,
                                    tokens=tokens) == 2 * row == 2 * cfg.stored_bytes(tokens)
        if tokens == 1024:  # within the budget where the preset is sized
            assert 8 * row / (2 * tokens * 64) <= 4.25
    cache = make_cache("kvg", num_layers=2, num_kv_heads=1, head_dim=64)
    assert cache.residual_fraction == 0.07 and base in cache.name


def test_sliding_layer_window_is_a_share_of_its_history(rng):
    """On a sliding layer ``t`` is the history (positions seen), not what the layer still
    stores: after every step the counters are those of a token model (evict the oldest
    down to ``W − 1``, append the new tokens to the window, compress its oldest beyond
    ``R(t)``; a compressed token never comes back), the history it returns holds exactly
    its newest ``n_win`` tokens bit for bit (float32 window) and compressed ones before
    them, and once ``R(t)`` passes the window every stored token is exact."""
    W, pct = 40, "25"
    cache = make_cache("pqo3-r2-g25-s2", num_layers=1, num_kv_heads=1, head_dim=_D, window_dtype="float32",
                       decode_output="dequantized", sliding_window=W)
    cfg = AttendConfig(_D ** -0.5, 1)
    seen, model, t = [], [], 0  # model: True = exact, per stored token, oldest first
    for n in (30, 1, 1, 9, 1, 1, 25, 1, 3, 1, 1, 60, 1, 1, 30, 1, 1):
        k = rng.standard_normal((1, 1, n, _D)).astype(np.float32)
        seen.append(k)
        res = cache.decode(0, k, k, k, cfg).result
        t += n
        model = model[max(0, len(model) - (W - 1)):] + [True] * n
        for _ in range(max(0, sum(model) - _cap(t, 2, pct))):
            model[model.index(True)] = False
        stored = cache.stored_len(0)
        _, n_comp, n_win = _counts(cache)
        assert (stored, n_comp, n_win) == (len(model), model.count(False), model.count(True))
        full = np.concatenate(seen, 2)[:, :, -stored:]
        np.testing.assert_array_equal(res.k[:, :, stored - n_win:], full[:, :, stored - n_win:])
        assert (np.abs(res.k[:, :, :n_comp] - full[:, :, :n_comp]).max(axis=-1) > 0).all()
    assert _cap(t, 2, pct) > W and (n_comp, n_win) == (0, W)  # a window over all the layer stores
