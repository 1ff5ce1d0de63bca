"""Every cache family with CUDA arrays (CuPy and Numba device arrays): stored on the
device, results on the device, equal to the same cache fed NumPy arrays.

Families: dense, pq / pqo (block and whole-head rotation), tq, paged (float32 and
compressed pages), mla (latent and simple), mixed (per-layer and per-KV-head overrides).
"""

from __future__ import annotations

import numpy as np
import pytest

from numba_kv import AttendConfig, make_cache

H, D, G = 2, 64, 2
F32 = dict(rtol=1e-4, atol=1e-5)


def _chunks(rng, n_prefill=6, n_decode=2):
    def kv(n):
        return tuple(rng.standard_normal((1, H, n, D)).astype(np.float32) for _ in range(2))

    steps = [kv(n_prefill)] + [kv(1) for _ in range(n_decode)]
    return steps, [rng.standard_normal((1, H * G, 1, D)).astype(np.float32) for _ in range(n_decode)]


def _run(cache, steps, queries, put):
    cfg = AttendConfig(D ** -0.5, n_kv_groups=G)
    k, v = steps[0]
    cache.prefill(0, put(k), put(v))
    outs = []
    for (k, v), q in zip(steps[1:], queries):
        res = cache.decode(0, put(k), put(v), put(q), cfg)
        outs.append(res.out if hasattr(res, "out") else res.result.k)
    return outs


@pytest.mark.parametrize("name, opts", [
    ("dense", {}),
    ("pq3", {}),
    ("pqo3", {}),
    ("pqo3-head", {}),
    ("pqo4", {"decode_output": "dequantized"}),
    ("tq3", {}),
    ("pqo3", {"layer_overrides": {0: {"bits": 4}}}),  # a MixedCache
    ("pqo3", {"head_overrides": {0: {1: {"bits": 4}}}}),  # a MixedCache whose layer 0 is split over KV heads
])
def test_layered_cache_families(dev, name, opts):
    rng = np.random.default_rng(0)
    steps, queries = _chunks(rng)
    if name != "dense" and not dev.f16_windows:
        opts = {**opts, "window_dtype": "float32"}
    n_layers = 2 if "layer_overrides" in opts or "head_overrides" in opts else 1
    cpu = make_cache(name, num_layers=n_layers, num_kv_heads=H, head_dim=D, **opts)
    gpu = make_cache(name, num_layers=n_layers, num_kv_heads=H, head_dim=D, **opts)
    if name.startswith("tq") and dev.kind == "numba":  # documented: TurboQuant needs NumPy or CuPy
        with pytest.raises(TypeError, match="NumPy or CuPy"):
            _run(gpu, steps, queries, dev.put)
        return
    ref = _run(cpu, steps, queries, lambda a: a)
    got = _run(gpu, steps, queries, dev.put)
    for r, g in zip(ref, got):
        np.testing.assert_allclose(dev.get(g), r, **F32)
    assert gpu.memory_usage() == cpu.memory_usage()
    for a in gpu.live_arrays(0):
        dev.check(a)
    gpu.check_inputs()  # the deferred value checks of the device calls found nothing


@pytest.mark.parametrize("storage", ["float32", "pqo3"])
def test_paged_cache(dev, storage):
    from numba_kv.caches.paged import PagedKVCache

    rng = np.random.default_rng(1)
    k = rng.standard_normal((H, 7, 32)).astype(np.float32)
    v = rng.standard_normal((H, 7, 32)).astype(np.float32)
    res = []
    for put in (lambda a: a, dev.put):
        cache = PagedKVCache(num_pages=4, num_layers=1, num_kv_heads=H, head_dim=32, page_size=4, storage=storage)
        s = cache.allocate_sequence()
        cache.append(0, s, put(k[:, :3]), put(v[:, :3]))
        cache.append(0, s, put(k[:, 3:]), put(v[:, 3:]))
        res.append((cache.get_kv(0, s), list(cache.pools.values())))
    (kc, vc), pools_c = res[0]
    (kd, vd), pools_d = res[1]
    assert np.array_equal(dev.get(kd), kc) and np.array_equal(dev.get(vd), vc)
    for a, b in zip(pools_c, pools_d):
        assert np.array_equal(dev.get(b), a)  # codes and scales bit for bit


def test_mla_caches(dev):
    from numba_kv.caches.mla import MLACache, SimpleMLACache

    rng = np.random.default_rng(2)
    w_uk = rng.standard_normal((2, 8, 4)).astype(np.float32)
    w_uv = rng.standard_normal((2, 8, 4)).astype(np.float32)
    lat = rng.standard_normal((3, 8 + 4)).astype(np.float32)
    res = []
    for put in (lambda a: a, dev.put):
        cache = MLACache(2, 1, 2, 8, 4, 4, 4, w_uk, w_uv, page_size=4)
        s = cache.allocate_sequence()
        cache.append_latent(0, s, put(lat))
        res.append(cache.get_kv(0, s))
    for a, b in zip(*res):
        np.testing.assert_allclose(dev.get(b), a, rtol=1e-5, atol=1e-5)
    down = rng.standard_normal((8, 4)).astype(np.float32)
    up = rng.standard_normal((4, 8)).astype(np.float32)
    k = rng.standard_normal((2, 3, 8)).astype(np.float32)
    res = []
    for put in (lambda a: a, dev.put):
        cache = SimpleMLACache(2, 1, 2, 8, 4, down, up, up)
        s = cache.allocate_sequence()
        cache.append(0, s, put(k), put(k))
        res.append(cache.get_kv(0, s))
    for a, b in zip(*res):
        np.testing.assert_allclose(dev.get(b), a, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("storage", ["float32", "pqo3"])
def test_paged_decode_loop_with_kept_tables(dev, storage):
    """Decode steps (one token per sequence, then attention over both) across page
    boundaries, a crop and a fork: the device cache's kept page tables (grown in place)
    give the CPU twin's outputs; the deferred checks of the device calls find nothing."""
    from numba_kv.caches.paged import PagedKVCache

    rng = np.random.default_rng(3)
    h, g, d = H, 2, 32
    cpu, gpu = (PagedKVCache(num_pages=16, num_layers=1, num_kv_heads=h, head_dim=d, page_size=4,
                             storage=storage) for _ in range(2))
    ids = [cpu.allocate_sequence(), cpu.allocate_sequence()]
    assert [gpu.allocate_sequence() for _ in ids] == ids
    for n, sid in zip((3, 6), ids):
        k = rng.standard_normal((h, n, d)).astype(np.float32)
        cpu.append(0, sid, k, k)
        gpu.append(0, sid, dev.put(k), dev.put(k))
    for step in range(7):
        if step == 4:
            cpu.crop(ids[1], 5)
            gpu.crop(ids[1], 5)
            assert cpu.fork_sequence(ids[0]) == gpu.fork_sequence(ids[0])
            ids = cpu.sequences
        for sid in ids:
            k = rng.standard_normal((h, 1, d)).astype(np.float32)
            cpu.append(0, sid, k, k)
            gpu.append(0, sid, dev.put(k), dev.put(k))
        q = rng.standard_normal((len(ids), h * g, 1, d)).astype(np.float32)
        out = gpu.decode_attention(0, dev.put(q), ids)
        dev.check(out)
        np.testing.assert_allclose(dev.get(out), cpu.decode_attention(0, q, ids), **F32)
    gpu.check_inputs()


def _spin_kernel():
    """A one-thread kernel that sleeps ``ms`` milliseconds on its stream (``nanosleep``, cc ≥ 7.0)."""
    from numba import cuda

    @cuda.jit
    def spin(ms):
        for _ in range(ms):
            cuda.nanosleep(1000000)

    return spin


@pytest.mark.gpu_only
def test_paged_page_freed_on_one_stream_and_taken_on_another_is_read_first():
    """Stream A is held busy, then queues a decode of sequence ``a`` and frees it; stream B
    appends another sequence into ``a``'s page at once. The decode still reads ``a``'s
    tokens: B's append waits on the device for A's release (no host synchronization)."""
    cp = pytest.importorskip("cupy")
    import numba_kv
    from numba_kv import PagedKVCache

    rng = np.random.default_rng(11)
    h, d, ps = 2, 64, 16
    ka, va, kb, vb = (rng.standard_normal((h, ps, d)).astype(np.float32) for _ in range(4))
    q = rng.standard_normal((1, 2 * h, 1, d)).astype(np.float32)
    cpu = PagedKVCache(1, 1, h, d, page_size=ps, storage="pqo3")
    cpu.append(0, cpu.allocate_sequence(), ka, va)
    want = cpu.decode_attention(0, q)
    gpu = PagedKVCache(1, 1, h, d, page_size=ps, storage="pqo3")  # one page: b must take a's
    a = gpu.allocate_sequence()
    gpu.append(0, a, cp.asarray(ka), cp.asarray(va))
    qd, kbd, vbd = cp.asarray(q), cp.asarray(kb), cp.asarray(vb)
    spin = _spin_kernel()
    cp.cuda.Device().synchronize()
    sa, sb = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    with numba_kv.launch_stream(sa) as stream:
        spin[1, 1, stream](200)  # ~0.2 s: A's decode runs long after B's append was queued
        out = gpu.decode_attention(0, qd, [a])
        gpu.free_sequence(a)
    with numba_kv.launch_stream(sb):
        b = gpu.allocate_sequence()
        gpu.append(0, b, kbd, vbd)
    sb.synchronize()
    sa.synchronize()
    np.testing.assert_allclose(cp.asnumpy(out), want, **F32)
