"""crop / fork / select_batch on every cache: compared with caches built directly from the
kept tokens or rows (an independent construction), bit-exactly."""

import copy
import threading

import numpy as np
import pytest

from numba_kv import AttendConfig, Dequantized, Fused, PagedKVCache, make_cache

# (device vs CPU twin at float32 round-off: the float32 kernels; the tensor-core ones: test_sim_mma*.py)
pytestmark = pytest.mark.usefixtures("float32_attention")

H, D, G = 2, 64, 2
CFG = AttendConfig(0.125, G)

# every stateful feature: window/sinks, int8 window, key centering, outlier permutation,
# head rotation, asymmetric bits, QJL (tq), no window
CASES = [
    ("dense", {}),
    ("pqo3", {}),
    ("pqo3", {"residual_length": 0, "sink_tokens": 0}),
    ("pqo3", {"residual_length": 8, "sink_tokens": 3, "window_dtype": "int8"}),
    ("pqo3", {"residual_length": 5, "sink_tokens": 2, "key_center": True}),
    ("pqo3.5", {"residual_length": 6, "sink_tokens": 1}),
    ("pqo-k4v3-head-eden", {"residual_length": 7, "sink_tokens": 2}),
    ("pq3", {"residual_length": 4, "sink_tokens": 0, "key_center": True}),
    ("tq3", {"residual_length": 6, "sink_tokens": 2}),
    ("tq3", {"residual_length": 0, "sink_tokens": 0, "decode_output": "dequantized"}),
]
IDS = [f"{n}-{'-'.join(f'{k}={v}' for k, v in o.items())}" for n, o in CASES]


def _rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def _make(name, opts, layers=2):
    return make_cache(name, num_layers=layers, num_kv_heads=H, head_dim=D, **opts)


def _outputs(res):
    """Arrays of a decode/prefill result (fused output or history + bias)."""
    if isinstance(res, Fused):
        return [res.out]
    r = res.result if isinstance(res, Dequantized) else res
    return [a for a in (r.k, r.v, r.logit_bias) if a is not None]


def _assert_same(a, b):
    for x, y in zip(_outputs(a), _outputs(b), strict=True):
        np.testing.assert_array_equal(x, y)


def _history(cache, layer, batch, rng):
    """Full dequantized history ``(k, v)`` of ``layer`` as stored (no new token: a decode on a
    fork would slide the window)."""
    return cache._history(cache._layers[layer], np.float32)


def _chunks(cache, layer, k, v, sizes):
    t = 0
    for s in sizes:
        cache.prefill(layer, k[:, :, t:t + s], v[:, :, t:t + s])
        t += s


@pytest.mark.parametrize("name,opts", CASES, ids=IDS)
def test_crop_equals_cache_that_stopped_there(name, opts):
    """Cropping at L after T tokens == a cache fed the same chunks up to L (when the cut falls
    on a chunk boundary the stored state is the same), then both decode identically."""
    rng = np.random.default_rng(1)
    B, T = 2, 40
    k, v = _rand(rng, B, H, T, D), _rand(rng, B, H, T, D)
    sizes = [3, 1, 9, 1, 1, 12, 13]
    bounds = np.cumsum(sizes)
    compared = 0
    for L in [0, 3, 4, 13, 14, 27]:
        a = _make(name, opts)
        for layer in range(2):
            _chunks(a, layer, k, v, sizes)
        a.crop(L)
        b = _make(name, opts)
        for layer in range(2):
            _chunks(b, layer, k, v, [s for s, e in zip(sizes, bounds) if e <= L])
        assert a.seq_len(0) == a.seq_len(1) == L
        same = a.memory_usage() == b.memory_usage()
        q, k1 = _rand(rng, B, H * G, 1, D), _rand(rng, B, H, 1, D)
        ra = a.decode(0, k1, k1, q, CFG)
        assert a.seq_len(0) == L + 1
        # equal bytes <=> the same number of compressed tokens <=> the same stored state
        # (a cut inside the window keeps tokens exact that ``b`` would also keep exact)
        assert same or L > 0
        if same:
            _assert_same(ra, b.decode(0, k1, k1, q, CFG))
            assert a.memory_usage() == b.memory_usage()
            compared += 1
    windowed = name != "dense" and (opts.get("residual_length", 32) or opts.get("sink_tokens", 4))
    assert compared == 6 or (windowed and compared >= 1)


@pytest.mark.parametrize("name,opts", CASES, ids=IDS)
def test_crop_keeps_tokens_exactly(name, opts):
    """The kept history is bit-identical to the history before cropping (tokens are not
    re-quantized), memory_usage drops, and prefill/decode keep working afterwards."""
    rng = np.random.default_rng(2)
    B, T = 2, 37
    k, v = _rand(rng, B, H, T, D), _rand(rng, B, H, T, D)
    cache = _make(name, dict(opts, decode_output="dequantized") if name != "dense" else opts)
    _chunks(cache, 0, k, v, [5, 20, 12])
    full = _history(cache, 0, B, rng)
    before = cache.memory_usage()
    for L in [30, 21, 9, 2]:
        cache.crop(L)
        hk, hv = _history(cache, 0, B, rng)
        np.testing.assert_array_equal(hk, full[0][:, :, :L])
        np.testing.assert_array_equal(hv, full[1][:, :, :L])
        assert cache.memory_usage() < before
        before = cache.memory_usage()
    cache.prefill(0, k[:, :, :3], v[:, :, :3])
    cache.decode(0, k[:, :, :1], v[:, :, :1], _rand(rng, B, H * G, 1, D), CFG)
    assert cache.seq_len(0) == 6
    cache.crop(0)
    assert cache.memory_usage() == 0 and cache.seq_len(0) == 0
    cache.prefill(0, k[:, :, :4], v[:, :, :4])  # re-measures per-layer constants like a fresh layer
    fresh = _make(name, dict(opts, decode_output="dequantized") if name != "dense" else opts)
    fresh.prefill(0, k[:, :, :4], v[:, :, :4])
    assert cache.memory_usage() == fresh.memory_usage()
    q = _rand(rng, B, H * G, 1, D)
    _assert_same(cache.decode(0, k[:, :, :1], v[:, :, :1], q, CFG), fresh.decode(0, k[:, :, :1], v[:, :, :1], q, CFG))


@pytest.mark.parametrize("bad,exc", [(-1, ValueError), (11, ValueError), (2.0, TypeError), (True, TypeError),
                                     ("3", TypeError)])
def test_crop_bad_length_leaves_cache_unchanged(bad, exc):
    rng = np.random.default_rng(3)
    cache = _make("pqo3", {"residual_length": 4, "sink_tokens": 2})
    k = _rand(rng, 1, H, 10, D)
    cache.prefill(0, k, k)
    cache.prefill(1, k, k)
    mem, snap = cache.memory_usage(), cache.fork()
    with pytest.raises(exc, match="length"):
        cache.crop(bad)
    assert cache.memory_usage() == mem and cache.seq_len(0) == 10
    q = _rand(rng, 1, H * G, 1, D)
    _assert_same(cache.decode(0, k[:, :, :1], k[:, :, :1], q, CFG), snap.decode(0, k[:, :, :1], k[:, :, :1], q, CFG))


def test_crop_checks_every_non_empty_layer():
    rng = np.random.default_rng(4)
    cache = _make("dense", {}, layers=3)
    k = _rand(rng, 1, H, 10, D)
    cache.prefill(0, k, k)
    cache.prefill(1, k[:, :, :6], k[:, :, :6])  # layer 2 empty
    with pytest.raises(ValueError, match=r"length: expected an int in \[0, 6\]"):
        cache.crop(7)
    assert cache.seq_len(0) == 10
    cache.crop(6)
    assert [cache.seq_len(i) for i in range(3)] == [6, 6, 0]


@pytest.mark.parametrize("name,opts", CASES, ids=IDS)
def test_fork_is_independent(name, opts):
    rng = np.random.default_rng(5)
    B = 2
    k = _rand(rng, B, H, 30, D)
    a = _make(name, opts)
    a.prefill(0, k, k)
    for b in (a.fork(), copy.deepcopy(a)):
        assert b is not a and b.memory_usage() == a.memory_usage()
        if name != "dense":  # read-only configuration shared (device constants key on it), containers not
            assert b.codebooks["k"] is a.codebooks["k"] and b.codebooks is not a.codebooks
        for sa, sb in zip(a._layers, b._layers):
            assert sa.lock is not sb.lock
            for n in sa.buffers:
                assert not np.shares_memory(sa.buffers[n], sb.buffers[n])
        q, k1 = _rand(rng, B, H * G, 1, D), _rand(rng, B, H, 1, D)
        ra = a.fork().decode(0, k1, k1, q, CFG)
        # change the fork a lot: more tokens, crop, reordering, reset of another fork
        b.decode(0, _rand(rng, B, H, 1, D), _rand(rng, B, H, 1, D), q, CFG)
        b.prefill(1, k, k)
        b.crop(5)
        b.select_batch([1, 1])
        b.reset()
        _assert_same(a.fork().decode(0, k1, k1, q, CFG), ra)
        assert a.seq_len(0) == 30 and a.seq_len(1) == 0


def test_fork_lock_is_fresh_even_while_held():
    cache = _make("pqo3", {})
    k = np.ones((1, H, 3, D), np.float32)
    cache.prefill(0, k, k)
    cache._layers[1].lock.acquire()  # another thread working on layer 1
    try:
        done = []
        t = threading.Thread(target=lambda: done.append(copy.copy(cache._layers[0].seq_len)))
        t.start()
        t.join()
        # fork waits for every layer lock: take it on a thread and release ours
        res = []
        th = threading.Thread(target=lambda: res.append(cache.fork()))
        th.start()
        th.join(0.2)
        assert th.is_alive()  # blocked on layer 1's lock: forks are consistent snapshots
    finally:
        cache._layers[1].lock.release()
    th.join()
    f = res[0]
    assert all(not s.lock.locked() for s in f._layers)


@pytest.mark.parametrize("name,opts", CASES, ids=IDS)
def test_select_batch_equals_cache_built_from_rows(name, opts):
    """Beam-search reorder (with repeats) == a cache prefilled/decoded with those rows only:
    bit-identical histories / fused outputs, equal memory_usage."""
    rng = np.random.default_rng(6)
    B, T = 3, 26
    k, v = _rand(rng, B, H, T, D), _rand(rng, B, H, T, D)
    idx = [2, 0, 2, 1]
    a = _make(name, opts)
    b = _make(name, opts)
    sizes = [7, 1, 18]
    for layer in range(2):
        _chunks(a, layer, k, v, sizes)
        _chunks(b, layer, k[idx], v[idx], sizes)
    assert a.select_batch(np.array(idx)) is a
    assert a.memory_usage() == b.memory_usage()
    for _step in range(3):
        q, k1 = _rand(rng, len(idx), H * G, 2, D), _rand(rng, len(idx), H, 2, D)
        for layer in range(2):
            _assert_same(a.decode(layer, k1, k1, q, CFG), b.decode(layer, k1, k1, q, CFG))
    _assert_same(a.prefill(0, k[idx, :, :5], v[idx, :, :5]), b.prefill(0, k[idx, :, :5], v[idx, :, :5]))


@pytest.mark.parametrize("bad,exc", [([], ValueError), ([3], ValueError), ([-1], ValueError), ([[0]], ValueError),
                                     ([0.5], TypeError), ([True], TypeError)])
def test_select_batch_bad_indices(bad, exc):
    cache = _make("tq3", {})
    k = np.ones((3, H, 4, D), np.float32)
    cache.prefill(0, k, k)
    mem = cache.memory_usage()
    with pytest.raises(exc, match="indices"):
        cache.select_batch(bad)
    assert cache.memory_usage() == mem and cache._layers[0].batch == 3


# -- paged cache: per sequence -------------------------------------------------------------
@pytest.mark.parametrize("storage", ["float32", "pqo3", "pqo-k4v3"])
def test_paged_crop_fork_select(storage):
    rng = np.random.default_rng(7)
    ps = 4
    c = PagedKVCache(num_pages=40, num_layers=2, num_kv_heads=H, head_dim=D, page_size=ps, storage=storage)
    s = c.allocate_sequence()
    k, v = _rand(rng, H, 14, D), _rand(rng, H, 14, D)
    for layer in range(2):
        c.append(layer, s, k, v)
    full = [c.get_kv(layer, s) for layer in range(2)]
    used = c.num_used_pages
    t = c.fork_sequence(s)
    assert c.num_used_pages == 2 * used
    for layer in range(2):
        np.testing.assert_array_equal(c.get_kv(layer, t)[0], full[layer][0])
        np.testing.assert_array_equal(c.get_kv(layer, t)[1], full[layer][1])
    c.append(0, t, k[:, :3], v[:, :3])  # the fork grows; the original does not move
    np.testing.assert_array_equal(c.get_kv(0, s)[0], full[0][0])
    c.crop(t, 9)
    assert c.seq_len(0, t) == c.seq_len(1, t) == 9
    assert c.num_seq_pages(0, t) == 3 and c.num_used_pages == used + 6
    np.testing.assert_array_equal(c.get_kv(1, t)[1], full[1][1][:, :9])
    with pytest.raises(ValueError, match="length"):
        c.crop(t, 10)
    with pytest.raises(KeyError, match="seq_id"):
        c.crop(99, 1)
    # crop then append == a sequence that was fed the kept tokens then the new ones
    c.append(0, t, k[:, 9:13], v[:, 9:13])
    np.testing.assert_array_equal(c.get_kv(0, t)[0], full[0][0][:, :13])
    q = _rand(rng, 2, H * G, 1, D)
    out = c.decode_attention(1, q, [s, t])
    ids = c.select_batch([t, s, t])
    assert ids[:2] == [t, s] and ids[2] not in (s, t)
    out2 = c.decode_attention(1, q[[1, 0, 1]], ids)
    np.testing.assert_array_equal(out2, out[[1, 0, 1]])
    d = copy.deepcopy(c)
    assert d._lock is not c._lock
    d.free_sequence(ids[0])
    assert c.sequences == sorted(ids)
    for name in c.pools:
        assert not np.shares_memory(c.pools[name], d.pools[name])


# -- Numba device arrays (simulator or GPU) --------------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("name,opts", [("dense", {}), ("pqo3", {"residual_length": 4, "sink_tokens": 2,
                                                              "window_dtype": "float32"}),
                                       ("pq3", {"window_dtype": "float32"})])
def test_lifecycle_on_device_matches_cpu(tmp_path, name, opts):
    """crop / fork / select_batch / save on a cache stored in Numba device arrays agree with
    the same operations on the host cache."""
    from numba_kv import load_cache
    from numba_kv._backend import to_host

    from ..conftest import to_device

    rng = np.random.default_rng(8)
    B = 2
    host, dev = _make(name, opts, layers=1), _make(name, opts, layers=1)
    k, v = _rand(rng, B, H, 12, D), _rand(rng, B, H, 12, D)
    host.prefill(0, k, v)
    dev.prefill(0, to_device(k), to_device(v))
    for c in (host, dev):
        c.crop(9)
    dev2 = dev.fork()
    for c in (host, dev2):
        c.select_batch([1, 0, 1])
    dev.reset()  # the fork must not notice
    q, k1 = _rand(rng, 3, H * G, 1, D), _rand(rng, 3, H, 1, D)
    a = _outputs(host.decode(0, k1, k1, q, CFG))
    b = _outputs(dev2.decode(0, to_device(k1), to_device(k1), to_device(q), CFG))
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(to_host(y), x, rtol=1e-4, atol=1e-5)
    dev2.save(tmp_path / "d.safetensors")
    host.save(tmp_path / "h.safetensors")
    la, lb = load_cache(tmp_path / "h.safetensors"), load_cache(tmp_path / "d.safetensors")
    assert la.memory_usage() == lb.memory_usage() == host.memory_usage()
    q = _rand(rng, 3, H * G, 1, D)
    for x, y in zip(_outputs(la.decode(0, k1, k1, q, CFG)), _outputs(lb.decode(0, k1, k1, q, CFG)), strict=True):
        np.testing.assert_allclose(y, x, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name,opts", [("dense", {}), ("pqo3", {"residual_length": 0, "sink_tokens": 0})])
def test_fork_while_other_threads_decode(name, opts):
    """Forks taken while 4 threads decode 4 layers are consistent per layer: each forked layer
    is a prefix of that layer's final history (tokens never change once stored here) and
    forks keep working on their own."""
    rng = np.random.default_rng(9)
    layers, steps = 4, 25
    cache = _make(name, opts, layers=layers)
    ks = _rand(rng, layers, steps + 4, 1, H, 1, D)
    q = _rand(rng, 1, H * G, 1, D)
    for layer in range(layers):
        cache.prefill(layer, ks[layer, 0], ks[layer, 0])
    barrier = threading.Barrier(layers + 1)
    errors = []

    def work(layer):
        try:
            barrier.wait()
            for t in range(1, steps + 1):
                cache.decode(layer, ks[layer, t], ks[layer, t], q, CFG)
        except Exception as exc:  # noqa: BLE001 - re-raised by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(layers)]
    for t in threads:
        t.start()
    barrier.wait()
    forks = [cache.fork() for _ in range(20)]
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    final = [_history(cache, layer, 1, rng) for layer in range(layers)]
    for f in forks:
        for layer in range(layers):
            n = f.seq_len(layer)
            assert 1 <= n <= steps + 1
            hk, hv = _history(f, layer, 1, rng)
            np.testing.assert_array_equal(hk, final[layer][0][:, :, :n])
            np.testing.assert_array_equal(hv, final[layer][1][:, :, :n])
    f = forks[0]
    f.decode(0, ks[0, steps + 1], ks[0, steps + 1], q, CFG)
    assert cache.seq_len(0) == steps + 1


@pytest.mark.parametrize("name", ["dense", "kv4", "kv3", "tq3", "pqo3"])
def test_empty_layer_is_a_one_layer_cache_like_that_layer(name):
    """``empty_layer(i)``: a new, empty one-layer cache of the same class with the whole
    cache's resolved options (a preset sizes its window on the whole geometry) and layer
    ``i``'s sliding window; it stores what layer ``i`` stores, byte for byte.
    ``layer_cache(i)`` is the cache itself (a mixed cache's is the part: ``kv3`` and ``kv4``
    size each layer's window on its own)."""
    windows = [None, 24, None]
    full = make_cache(name, num_layers=3, num_kv_heads=H, head_dim=D, sliding_window=windows)
    rng = np.random.default_rng(9)
    k, v = _rand(rng, 1, H, 40, D), _rand(rng, 1, H, 40, D)
    for i in range(3):
        full.prefill(i, k, v)
        one, part = full.empty_layer(i), full.layer_cache(i)
        assert type(one) is type(part) and one.num_layers == 1 and one.seq_len(0) == 0
        assert list(one.layer_windows) == [windows[i]]
        got, want = one.config_dict(), {**part.config_dict(), "num_layers": 1}
        got.pop("sliding_window", None)  # (left out when no layer slides)
        want.pop("sliding_window", None)
        assert got == want
        one.prefill(0, k, v)
        for a, b in zip(one.live_arrays(0), full.live_arrays(i), strict=True):
            np.testing.assert_array_equal(a, b)
        # the cache itself, or (a preset whose window differs by layer: mixed) its part for i
        assert part is full or part in full.parts
    for bad in (3, -1, "0"):
        for method in (full.empty_layer, full.layer_cache):
            with pytest.raises((IndexError, TypeError), match="layer"):
                method(bad)
