"""Out-of-range values are never silently corrupted.

Every cache, for finite float32 inputs of any magnitude, either stores them faithfully or
raises a ``ValueError`` that names the argument and the limit and leaves the cache exactly
as it was (compared bit for bit).  The rule (README, "Value range"):

* inputs above ``2**21`` are rejected by the compressed caches and PQO pages;
* a float16 window (``window_dtype="float16"``, the default) rejects ``|x| > 65504``;
* a derived binary16 block scale / vector norm that would reach 65504 is rejected;
* dense float16 storage rejects ``|x| > 65504``, float32 storage (and float32 pages)
  rejects float64 input above the float32 range;
* tiny values (subnormal included) are stored with an absolute error below ``1e-6`` and
  never produce inf/NaN.

Expected values come from the inputs themselves (exact for float32 storage, a relative
bound for quantized storage that saturation would break: 1e5 saturating to 65504 is
34 % off, 1e30 to 65504 is ~100 % off).
"""

import copy
import re

import numpy as np
import pytest

from numba_kv import AttendConfig, MLACache, PagedKVCache, make_cache

H, D, G = 2, 64, 2
CFG = AttendConfig(D ** -0.5, n_kv_groups=G)

CONFIGS = {
    "dense": ("dense", {}),
    "dense-f16": ("dense", {"dtype": np.float16}),
    "pqo3": ("pqo3", {}),  # float16 window, 4 sinks, 32 window tokens
    "pqo3-int8win": ("pqo3", {"window_dtype": "int8"}),
    "pqo3-f32win": ("pqo3", {"window_dtype": "float32"}),
    "pqo3-nowin": ("pqo3", {"residual_length": 0, "sink_tokens": 0}),
    "pqo3-dequantized": ("pqo3", {"decode_output": "dequantized", "window_dtype": "float32"}),
    "pq3-l2": ("pq3-l2", {"window_dtype": "float32"}),
    "pqo-k4v3-head-eden": ("pqo-k4v3-head-eden", {"key_center": True, "window_dtype": "int8"}),
    "pqo3-eden": ("pqo3-eden", {"residual_length": 0, "sink_tokens": 0}),
    "pqo3-center": ("pqo3", {"key_center": True, "window_dtype": "float32"}),
    "pqo3.5": ("pqo3.5", {}),
    "tq3": ("tq3", {}),
    "tq3-head-nowin": ("tq3-l2-head", {"residual_length": 0, "sink_tokens": 0}),
    # the head VQ code: EDEN scales checked by the dry run, plain norms by the cheap bound
    "pqo-k4v2-head-eden-vq": ("pqo-k4v2-head-eden-vq", {"key_center": True, "window_dtype": "int8"}),
    "pqo4-head-vq": ("pqo4-head-vq", {"window_dtype": "float32"}),
}
VALUES = [6.55e4, 1e5, 1e6, 1e30, -1e30]
POSITIONS = ["sink", "window", "compressed"]


def _cache(cid, layers=1):
    name, opts = CONFIGS[cid]
    return make_cache(name, num_layers=layers, num_kv_heads=H, head_dim=D, **opts)


def _snapshot(cache):
    """Everything a call could change, copied."""
    layers = []
    for st in cache._layers:
        layers.append((st.seq_len, st.batch, st.capacity, dict(st.meta), dict(st.live),
                       {n: b.copy() for n, b in st.buffers.items()}))
    return layers, cache.memory_usage(), cache.allocated_bytes()


def _assert_snapshot_equal(a, b):
    (la, ma, aa), (lb, mb, ab) = a, b
    assert (ma, aa) == (mb, ab)
    for x, y in zip(la, lb):
        assert x[:5] == y[:5]
        assert x[5].keys() == y[5].keys()
        for n in x[5]:
            assert np.array_equal(x[5][n], y[5][n]), n


def _history(cache, layer=0):
    st = cache._layers[layer]
    return cache._history(st, np.float32)


def _rng_kv(rng, s):
    return (rng.standard_normal((1, H, s, D)).astype(np.float32),
            rng.standard_normal((1, H, s, D)).astype(np.float32))


def _assert_rejected(exc, name):
    msg = str(exc)
    assert msg.startswith(f"{name}: "), msg
    assert re.search(r"\d", msg) and ("exceeds" in msg or "does not fit" in msg), msg


def _scenario(val, pos, seed):
    """The calls of one case: ``(setup chunks, (k, v, q) of the call with the value, its
    token index, (k, v, q) of the decode that pushes it into the compressed part)``."""
    rng = np.random.default_rng(seed)
    k0, v0 = _rng_kv(rng, 80)
    if pos == "sink":  # the very first token of an empty layer (a sink when there are sinks)
        k, v = _rng_kv(rng, 40)
        q, t_bad, setup = None, 0, []
    elif pos == "window":  # a decode step: the newest token, inside the window
        k, v = _rng_kv(rng, 1)
        q, t_bad, setup = rng.standard_normal((1, H * G, 1, D)).astype(np.float32), 80, [(k0, v0)]
    else:  # the first token of a long chunk: compressed at once (beyond the window)
        k, v = _rng_kv(rng, 60)
        q, t_bad, setup = None, 80, [(k0, v0)]
    k[0, 1, 0, 5] = val
    ke, ve = _rng_kv(rng, 70)
    qe = rng.standard_normal((1, H * G, 70, D)).astype(np.float32)
    return setup, (k, v, q), t_bad, (ke, ve, qe)


def _call(cache, kvq, sc):
    k, v, q = kvq
    if q is None:
        return cache.prefill(0, k * sc, v * sc)
    return cache.decode(0, k * sc, v * sc, q, CFG)


@pytest.mark.parametrize("pos", POSITIONS)
@pytest.mark.parametrize("val", VALUES)
@pytest.mark.parametrize("cid", sorted(CONFIGS))
def test_large_value_stored_faithfully_or_rejected(cid, val, pos):
    """Rejected: ValueError naming ``k`` and a limit, state bit-identical, cache still usable.
    Stored: the history equals ``2**e`` times that of a cache given the same calls with every
    input scaled by ``2**-e`` (``val·2**-e`` in [1, 2), far inside every range) — quantization
    commutes exactly with power-of-two scaling while no binary16 number saturates, so this
    oracle catches saturation, in the window and in the compressed part."""
    setup, bad, t_bad, follow = _scenario(val, pos, seed=POSITIONS.index(pos) * 100 + VALUES.index(val))
    e = int(np.floor(np.log2(abs(val))))
    big, small = _cache(cid), _cache(cid)
    for c, sc in ((big, 1.0), (small, 2.0 ** -e)):
        for k0, v0 in setup:
            c.prefill(0, k0 * np.float32(sc), v0 * np.float32(sc))
    before = _snapshot(big)
    try:
        out = _call(big, bad, np.float32(1.0))
    except ValueError as exc:
        _assert_rejected(exc, "k")
        _assert_snapshot_equal(_snapshot(big), before)
        rng = np.random.default_rng(1)  # not poisoned: the cache keeps working, with finite outputs
        k1, v1 = _rng_kv(rng, 1)
        q1 = rng.standard_normal((1, H * G, 1, D)).astype(np.float32)
        for a in _outputs(big.decode(0, k1, v1, q1, CFG)):
            assert np.isfinite(a).all()
        return
    assert abs(val) <= 2 ** 21 or CONFIGS[cid][0] == "dense"
    _call(small, bad, np.float32(2.0 ** -e))
    for a in _outputs(out):
        assert np.isfinite(a).all()
    for step in (0, 1):  # just stored, then after the token moved on
        if step:
            ke, ve, qe = follow
            for c, sc in ((big, 1.0), (small, 2.0 ** -e)):
                res = c.decode(0, ke * np.float32(sc), ve * np.float32(sc), qe, CFG)
                for a in _outputs(res):
                    assert np.isfinite(a).all()
        hk, hv = _history(big)
        assert np.isfinite(hk).all() and np.isfinite(hv).all()
        got, want = float(hk[0, 1, t_bad, 5]), float(_history(small)[0][0, 1, t_bad, 5]) * 2.0 ** e
        assert got == want, (step, got, want, val)
        assert abs(got - val) <= 0.7 * abs(val)  # and it is the value, not 0 or a clipped number


def _outputs(res):
    from numba_kv import Dequantized, DequantResult, Fused

    if isinstance(res, Fused):
        return [res.out]
    if isinstance(res, Dequantized):
        return [res.result.k, res.result.v]
    if isinstance(res, DequantResult):
        return [res.k, res.v]
    raise AssertionError(type(res))


@pytest.mark.parametrize("cid", ["pqo3", "pqo3-f32win", "tq3", "pqo-k4v3-head-eden"])
def test_large_value_in_v_names_v(cid):
    cache = _cache(cid)
    rng = np.random.default_rng(3)
    k, v = _rng_kv(rng, 40)
    v[0, 0, 30, 0] = -1e30
    with pytest.raises(ValueError, match=r"^v: .*\d"):
        cache.prefill(0, k, v)
    assert cache.seq_len(0) == 0 and cache.memory_usage() == 0


def test_thresholds_are_exact_for_float16_window():
    """65504 (the largest binary16) is stored exactly in a float16 window; the next float32 is rejected."""
    cache = _cache("pqo3")
    rng = np.random.default_rng(4)
    k, v = _rng_kv(rng, 8)
    k[0, 0, 0, 0] = 65504.0
    cache.prefill(0, k, v)
    assert _history(cache)[0][0, 0, 0, 0] == 65504.0
    k2, v2 = _rng_kv(rng, 1)
    k2[0, 0, 0, 0] = np.nextafter(np.float32(65504.0), np.float32(np.inf))
    with pytest.raises(ValueError, match=r"^k: max \|k\| = 65504 exceeds 65504"):
        cache.prefill(0, k2, v2)


def test_float64_beyond_float32_rejected_by_dense():
    cache = _cache("dense")
    k = np.ones((1, H, 2, D))
    k[0, 0, 0, 0] = 1e300
    with pytest.raises(ValueError, match=r"^k: .*exceeds 3\.40282e\+38"):
        cache.prefill(0, k, np.ones_like(k))
    assert cache.seq_len(0) == 0
    c64 = make_cache("dense", num_layers=1, num_kv_heads=H, head_dim=D, dtype=np.float64)
    c64.prefill(0, k, np.ones_like(k))
    assert c64._layers[0].buffers["k"][0, 0, 0] == 1e300


def test_huge_query_rejected_without_state_change():
    cache = _cache("pqo3")
    rng = np.random.default_rng(5)
    cache.prefill(0, *_rng_kv(rng, 50))
    before = _snapshot(cache)
    k, v = _rng_kv(rng, 1)
    q = rng.standard_normal((1, H * G, 1, D)).astype(np.float32)
    q[0, 0, 0, 0] = 1e30
    with pytest.raises(ValueError, match=r"^q: .*exceeds"):
        cache.decode(0, k, v, q, CFG)
    _assert_snapshot_equal(_snapshot(cache), before)
    q[0, 0, 0, 0] = 1e18  # large but accepted: the output stays finite
    out = cache.decode(0, k, v, q, CFG).out
    assert np.isfinite(out).all()


def test_largest_scale_and_query_keep_the_output_finite():
    # the bounds meet: |q| = 2**64 (the largest accepted query) at softmax_scale = 2**30 (the
    # largest accepted scale) gives finite logits (at 1e38 every output was NaN)
    cache = make_cache("kv4", num_layers=1, num_kv_heads=H, head_dim=D)
    rng = np.random.default_rng(6)
    cache.prefill(0, *_rng_kv(rng, 50))
    k, v = _rng_kv(rng, 1)
    q = rng.standard_normal((1, H * G, 1, D)).astype(np.float32)
    q[0, 0, 0, :] = 2.0 ** 64
    out = cache.decode(0, k, v, q, AttendConfig(2.0 ** 30, n_kv_groups=G)).out
    assert np.isfinite(out).all()


@pytest.mark.parametrize("name, opts", [("kv4", {}), ("pqo3", {"key_center": True, "window_dtype": "float32"})])
def test_key_centering_error_names_the_frozen_mean(name, opts):
    # key centering subtracts the key mean frozen from the layer's first chunk: small keys after
    # a chunk of 6e4s saturate their norms or scales, and the message must say why (it cited
    # only max |k| = 3.1)
    cache = make_cache(name, num_layers=1, num_kv_heads=H, head_dim=D, **opts)
    cache.prefill(0, np.full((1, H, 4, D), 6e4, np.float32), np.ones((1, H, 4, D), np.float32))
    before = _snapshot(cache)
    rng = np.random.default_rng(7)
    with pytest.raises(ValueError, match=r"^k: .*stored minus the layer's key mean, frozen from its first stored "
                                         r"chunk: max \|mean\| = 60000.*does not fit binary16") as exc:
        cache.prefill(0, *_rng_kv(rng, 4))
    _assert_rejected(exc.value, "k")
    _assert_snapshot_equal(_snapshot(cache), before)


# --- the binary16 bound of derived scales is an upper bound -------------------------------
@pytest.mark.parametrize("cid", ["pqo3", "pq3-l2", "pqo3-eden", "pqo-k4v3-head-eden", "tq3", "tq3-head-nowin",
                                 "pqo3.5", "pqo4-head-vq"])
def test_f16_factor_bounds_every_stored_binary16(cid):
    """``_f16_factor`` · ‖x‖ bounds every stored binary16 number: the cheap check that skips
    the scratch quantization must never let a saturating block through."""
    cache = _cache(cid)
    rng = np.random.default_rng(6)
    x = rng.standard_normal((1, H, 300, D)).astype(np.float32)
    x[0, 0, ::7] *= rng.uniform(0, 30, size=(x[0, 0, ::7].shape[0], 1)).astype(np.float32)
    x[0, 1, ::5, ::9] *= 50.0  # spiky vectors
    x[0, 1, 3, :] = 0.0
    x[0, 1, 3, 0] = 1.0  # one-hot: the worst case for MaxNorm
    cache.prefill(0, x, x)
    st = cache._layers[0]
    norms = np.sqrt((x.astype(np.float64) ** 2).sum(-1)).max()
    for name in ("k", "v"):
        bound = cache._f16_factor(name) * norms * (1 + 1e-3)
        for b, buf in st.buffers.items():
            if b.startswith(name + "_") and buf.dtype == np.uint16 and "exact" not in b:
                vals = np.abs(buf[:, : st.live_count(b)].view(np.float16).astype(np.float64))
                assert vals.max() <= bound, (b, vals.max(), bound)


# --- tiny values ------------------------------------------------------------------------
TINY_FLOOR = 1e-6


@pytest.mark.parametrize("mag", [1e-40, 1e-30, 1e-12, 1e-8])
@pytest.mark.parametrize("cid", sorted(CONFIGS))
def test_tiny_values_absolute_error_floor(cid, mag):
    """Subnormal and tiny inputs: stored, never inf/NaN, absolute error <= 1e-6 (window and
    compressed part; binary16 scales below 2**-24 round to 0)."""
    rng = np.random.default_rng(8)
    cache = _cache(cid)
    k = (rng.standard_normal((1, H, 90, D)) * mag).astype(np.float32)
    v = (rng.standard_normal((1, H, 90, D)) * mag).astype(np.float32)
    cache.prefill(0, k[:, :, :80], v[:, :, :80])
    q = rng.standard_normal((1, H * G, 10, D)).astype(np.float32)
    res = cache.decode(0, k[:, :, 80:], v[:, :, 80:], q, CFG)
    for a in _outputs(res):
        assert np.isfinite(a).all()
    hk, hv = _history(cache)
    assert np.isfinite(hk).all() and np.isfinite(hv).all()
    assert np.abs(hk - k).max() <= TINY_FLOOR and np.abs(hv - v).max() <= TINY_FLOOR


# --- paged and MLA ------------------------------------------------------------------------
def _paged_snapshot(c):
    return (copy.deepcopy(c._tables), copy.deepcopy(c._lens), list(c._free),
            {n: p.copy() for n, p in c._pools.items()}, c.memory_usage())


def _assert_paged_equal(a, b):
    assert a[0] == b[0] and a[1] == b[1] and a[2] == b[2] and a[4] == b[4]
    assert a[3].keys() == b[3].keys()
    for n in a[3]:
        assert np.array_equal(a[3][n], b[3][n])


@pytest.mark.parametrize("val", VALUES + [1e300])
@pytest.mark.parametrize("storage", ["float32", "pqo3", "pqo-k4v3"])
def test_paged_large_values(storage, val):
    rng = np.random.default_rng(9)
    c = PagedKVCache(num_pages=16, num_layers=1, num_kv_heads=H, head_dim=D, storage=storage)
    s = c.allocate_sequence()
    c.append(0, s, *(a[0] for a in _rng_kv(rng, 20)))
    k, v = (a[0].astype(np.float64) for a in _rng_kv(rng, 5))
    k[1, 2, 3] = val
    before = _paged_snapshot(c)
    try:
        c.append(0, s, k, v)
    except ValueError as e:
        assert str(e).startswith("k: ") and "exceeds" in str(e) or "does not fit" in str(e), str(e)
        _assert_paged_equal(_paged_snapshot(c), before)
        return
    assert storage == "float32" or abs(val) < 2 ** 21
    hk, hv = c.get_kv(0, s)
    assert np.isfinite(hk).all() and np.isfinite(hv).all()
    got = float(hk[1, 22, 3])
    assert got == np.float32(val) if storage == "float32" else abs(got - val) <= 0.25 * abs(val)
    q = rng.standard_normal((1, H * G, 1, D)).astype(np.float32)
    assert np.isfinite(c.decode_attention(0, q, [s], softmax_scale=D ** -0.5)).all()


@pytest.mark.parametrize("val", [1e5, 1e30])
def test_mla_latent_out_of_range(val):
    heads, rank, rope, nope, dv = 2, 64, 32, 32, 32
    rng = np.random.default_rng(10)
    w = rng.standard_normal((1, heads, rank, nope)).astype(np.float32) / 8
    c = MLACache(num_pages=8, num_layers=1, num_heads=heads, kv_lora_rank=rank, qk_rope_head_dim=rope,
                 qk_nope_head_dim=nope, v_head_dim=dv, w_uk=w, w_uv=w, storage="pqo3")
    s = c.allocate_sequence()
    lat = rng.standard_normal((10, rank + rope)).astype(np.float32)
    c.append_latent(0, s, lat)
    bad = rng.standard_normal((3, rank + rope)).astype(np.float32)
    bad[1, 7] = val
    before = _paged_snapshot(c.paged)
    try:
        c.append_latent(0, s, bad)
    except ValueError as e:
        assert str(e).startswith("c_kv: ") and "|c_kv|" in str(e), str(e)
        assert re.search(r"\d", str(e)) and ("exceeds" in str(e) or "does not fit" in str(e))
        _assert_paged_equal(_paged_snapshot(c.paged), before)
    else:
        got = c.get_compressed_kv(0, s)
        assert np.isfinite(got).all() and abs(float(got[11, 7]) - val) <= 0.25 * val
    q = rng.standard_normal((heads, 1, nope)).astype(np.float32)
    qp = rng.standard_normal((heads, 1, rope)).astype(np.float32)
    assert np.isfinite(c.attend_absorbed(0, s, q, qp, 0.1)).all()


@pytest.mark.parametrize("val", [1e5, 1e30, 3e38])
@pytest.mark.parametrize("storage", ["float32", "pqo3"])
def test_simple_mla_out_of_range(storage, val):
    """The simplified latent cache: stored latents equal ``k·down_proj`` (float32 pages: to
    float32 rounding), or a ValueError naming ``k`` with nothing stored."""
    from numba_kv import SimpleMLACache

    rng = np.random.default_rng(11)
    heads, d, lat = 2, 64, 32
    down = (rng.standard_normal((d, lat)) / 8).astype(np.float32)
    up = (rng.standard_normal((lat, d)) / 8).astype(np.float32)
    c = SimpleMLACache(8, 1, heads, d, lat, down, up, np.zeros_like(up), storage=storage)
    s = c.allocate_sequence()
    c.append(0, s, *(rng.standard_normal((heads, 4, d)).astype(np.float32) for _ in range(2)))
    k, v = (rng.standard_normal((heads, 3, d)).astype(np.float32) for _ in range(2))
    k[1, 1, 2] = val
    before = _paged_snapshot(c.paged)
    try:
        c.append(0, s, k, v)
    except ValueError as e:
        assert str(e).startswith("k: ") and re.search(r"\d", str(e)), str(e)
        _assert_paged_equal(_paged_snapshot(c.paged), before)
        return
    got = c.get_compressed_kv(0, s)[0][1, 5]
    want = k[1, 1].astype(np.float64) @ down.astype(np.float64)
    assert np.isfinite(got).all()
    tol = 1e-5 if storage == "float32" else 0.3
    assert np.abs(got - want).max() <= tol * np.abs(want).max()
