"""Concurrency for real: >= 4 Python threads, one cache layer each, released together by a
``threading.Barrier`` before every call so the calls overlap; every call's work is far above
``cpu_parallel_min_work``, so each one runs the *parallel* compilation of its kernels
(:func:`numba_kv._jit.cpu_call` picks the serial one only below that knob) and several
parallel regions are open at once.  Every result and the final state must equal, bit for
bit, the same calls made one after another.

The paged caches (``PagedKVCache``, and ``MLACache``'s pages) serialize their calls under one
pool lock (the free list and page tables are shared by the layers), so in the paged test the
threads' kernels do not overlap; ``MLACache`` reconstructs and attends outside that lock, so
its kernels do.

Several threads on *one* layer (``test_same_layer_...``): the layer's lock serializes them;
the result must be that of some sequential order of the calls (without the lock, tokens are
lost: checked by replacing the locks with ``contextlib.nullcontext`` in a scratch script).

``check_threading_layer`` guards this: the ``workqueue`` layer aborts the process when two
threads enter parallel regions at once, so it must raise there (tested in a subprocess).
"""

import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from numba_kv import AttendConfig, MLACache, PagedKVCache, _config, check_threading_layer, make_cache

NL = 4  # layers = threads
B, H, D, G = 2, 4, 64, 2  # batch, KV heads, head_dim, query groups
S = 4096  # prompt tokens per layer (prefilled in two chunks)
STEPS = 3  # decode steps per layer
CFG = AttendConfig(D ** -0.5, n_kv_groups=G)


def _work_prefill() -> int:
    return B * H * (S // 2) * D  # quantize / copy of one chunk: rows · tokens · head_dim


def _work_decode() -> int:
    return G * B * H * D * S  # fused attention: groups · rows · head_dim · tokens


def test_sizes_are_far_above_the_serial_threshold():
    thr = _config.get("cpu_parallel_min_work")
    assert _work_prefill() >= 4 * thr and _work_decode() >= 16 * thr
    assert H * S * D >= 4 * thr  # one paged append (one sequence's K or V)


def _run(scripts, concurrent: bool):
    """Run per-layer scripts (lists of zero-argument calls); return their results."""
    out = [[] for _ in scripts]
    if not concurrent:
        for i, steps in enumerate(scripts):
            for step in steps:
                out[i].append(step())
        return out
    barrier = threading.Barrier(len(scripts))
    errors = []

    def work(i):
        try:
            for step in scripts[i]:
                barrier.wait(timeout=300)  # everyone enters the call at the same time
                out[i].append(step())
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(scripts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errs = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    assert not errs, errs
    assert not errors, errors
    return out


def _arrays(x):
    """Flatten results (arrays, tuples, protocol outputs) into a list of NumPy arrays."""
    if x is None:
        return []
    if isinstance(x, np.ndarray):
        return [x]
    if isinstance(x, (tuple, list)):
        return [a for y in x for a in _arrays(y)]
    if hasattr(x, "__dataclass_fields__"):
        return [a for f in x.__dataclass_fields__ for a in _arrays(getattr(x, f))]
    return [np.asarray(x)]


def _assert_same(a, b):
    fa, fb = _arrays(a), _arrays(b)
    assert len(fa) == len(fb)
    for x, y in zip(fa, fb):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert np.array_equal(x, y), "concurrent result differs from the sequential one"


def _data(seed):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((B, H, S, D)).astype(np.float32)
    v = rng.standard_normal((B, H, S, D)).astype(np.float32)
    steps = [(rng.standard_normal((B, H, 1, D)).astype(np.float32),
              rng.standard_normal((B, H, 1, D)).astype(np.float32),
              rng.standard_normal((B, H * G, 1, D)).astype(np.float32)) for _ in range(STEPS)]
    return k, v, steps


@pytest.fixture(scope="module", autouse=True)
def _threading_layer_is_safe():
    check_threading_layer()


@pytest.mark.parametrize("name", ["dense", "pqo3", "pqo-k4v3-head-eden", "tq3"])
def test_layered_caches_concurrent_equals_sequential(name):
    data = [_data(100 + i) for i in range(NL)]

    def scripts(cache):
        sc = []
        for i in range(NL):
            k, v, steps = data[i]
            s = [lambda c=cache, i=i, k=k, v=v: c.prefill(i, k[:, :, : S // 2], v[:, :, : S // 2]),
                 lambda c=cache, i=i, k=k, v=v: c.prefill(i, k[:, :, S // 2:], v[:, :, S // 2:])]
            s += [lambda c=cache, i=i, st=st: c.decode(i, st[0], st[1], st[2], CFG) for st in steps]
            sc.append(s)
        return sc

    seq = make_cache(name, num_layers=NL, num_kv_heads=H, head_dim=D)
    par = make_cache(name, num_layers=NL, num_kv_heads=H, head_dim=D)
    want = _run(scripts(seq), concurrent=False)
    got = _run(scripts(par), concurrent=True)
    for i in range(NL):
        for a, b in zip(got[i], want[i]):
            _assert_same(a, b)
        _assert_same(par.live_arrays(i), seq.live_arrays(i))
        assert par.seq_len(i) == seq.seq_len(i) == S + STEPS
    assert par.memory_usage() == seq.memory_usage()


@pytest.mark.parametrize("storage", ["float32", "pqo3"])
def test_paged_concurrent_equals_sequential(storage):
    data = [_data(200 + i) for i in range(NL)]

    def build():
        c = PagedKVCache(num_pages=NL * B * (S + STEPS) // 16 + 4 * NL * B, num_layers=NL, num_kv_heads=H,
                         head_dim=D, storage=storage)
        return c, [c.allocate_sequence() for _ in range(B)]

    def scripts(c, sids):
        sc = []
        for i in range(NL):
            k, v, steps = data[i]
            s = [lambda c=c, i=i, k=k, v=v, b=b: c.append(i, sids[b], k[b], v[b]) for b in range(B)]
            for st in steps:
                s += [lambda c=c, i=i, st=st, b=b: c.append(i, sids[b], st[0][b], st[1][b]) for b in range(B)]
                s.append(lambda c=c, i=i, st=st: c.decode_attention(i, st[2], sids, softmax_scale=D ** -0.5))
            s.append(lambda c=c, i=i: [c.get_kv(i, sid) for sid in sids])
            sc.append(s)
        return sc

    seq, s_ids = build()
    par, p_ids = build()
    want = _run(scripts(seq, s_ids), concurrent=False)
    got = _run(scripts(par, p_ids), concurrent=True)
    for i in range(NL):
        for a, b in zip(got[i][-1], want[i][-1]):  # the stored history, page order aside
            _assert_same(a, b)
        for j in range(len(got[i]) - 1):
            _assert_same(got[i][j], want[i][j])
    assert par.memory_usage() == seq.memory_usage()


def test_mla_concurrent_equals_sequential():
    heads, rank, rope, nope, dv, n = 4, 128, 32, 64, 64, 8192
    rng = np.random.default_rng(7)
    w_uk = rng.standard_normal((NL, heads, rank, nope)).astype(np.float32) / np.sqrt(rank)
    w_uv = rng.standard_normal((NL, heads, rank, dv)).astype(np.float32) / np.sqrt(rank)
    lat = [rng.standard_normal((n, rank + rope)).astype(np.float32) for _ in range(NL)]
    qs = [(rng.standard_normal((heads, 1, nope)).astype(np.float32),
           rng.standard_normal((heads, 1, rope)).astype(np.float32)) for _ in range(NL)]
    # quantizing the latent pages (tokens · latent width) and reconstructing K and V
    # (heads · tokens · rank · width) are far above the threshold
    thr = _config.get("cpu_parallel_min_work")
    assert n * (rank + rope) >= 4 * thr and heads * n * rank * nope >= 16 * thr

    def build():
        c = MLACache(num_pages=NL * n // 16 + 8, num_layers=NL, num_heads=heads, kv_lora_rank=rank,
                     qk_rope_head_dim=rope, qk_nope_head_dim=nope, v_head_dim=dv, w_uk=w_uk, w_uv=w_uv,
                     storage="pqo3")
        return c, c.allocate_sequence()

    def scripts(c, sid):
        return [[lambda c=c, i=i: c.append_latent(i, sid, lat[i]),
                 lambda c=c, i=i: c.get_kv(i, sid),
                 lambda c=c, i=i: c.attend_absorbed(i, sid, qs[i][0], qs[i][1], 0.1)] for i in range(NL)]

    seq, s0 = build()
    par, p0 = build()
    want = _run(scripts(seq, s0), concurrent=False)
    got = _run(scripts(par, p0), concurrent=True)
    for i in range(NL):
        for a, b in zip(got[i], want[i]):
            _assert_same(a, b)
    assert par.memory_usage() == seq.memory_usage()


def _fresh_python(code, **env):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          check=False, env={**os.environ, **env})


def test_threading_layer_initialized_in_a_fresh_process():
    r = _fresh_python("from numba_kv.info import threading_layer; print(threading_layer())")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() in ("omp", "tbb", "workqueue")  # never "uninitialized"


def test_check_threading_layer_raises_under_workqueue():
    r = _fresh_python("import numba_kv; numba_kv.check_threading_layer()", NUMBA_THREADING_LAYER="workqueue")
    assert r.returncode != 0
    assert "RuntimeError" in r.stderr and "workqueue" in r.stderr


# -- several threads on ONE layer: serialized by the layer's lock ---------------------------------
SAME_T, SAME_S, SAME_CHUNK = 4, 8192, 1024  # threads, prompt tokens, tokens of a threaded prefill
SAME_STEPS = (SAME_CHUNK, 1, 1, SAME_CHUNK, 1)  # new tokens of each thread's calls (prefill when > 1)


def _same_layer_calls(cache, toks, q):
    """:data:`SAME_T` threads make their calls on layer 0 of ``cache`` at once (a barrier before
    every call); ``{(thread, step): result}``."""
    res, errors = {}, []
    barrier = threading.Barrier(SAME_T)

    def work(t):
        try:
            for s, n in enumerate(SAME_STEPS):
                k, v = toks[(t, s)]
                barrier.wait(timeout=300)
                res[(t, s)] = cache.prefill(0, k, v) if n > 1 else cache.decode(0, k, v, q, CFG)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=work, args=(t,)) for t in range(SAME_T)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return res


def _token_bytes(cache, pos):
    """The stored bytes of token ``pos`` of layer 0, all buffers."""
    return b"".join(a[..., pos:pos + 1, :].tobytes() for a in cache.live_arrays(0))


@pytest.mark.parametrize("name", ["pqo3-r0-s0", "tq3-r0-s0"])
def test_same_layer_from_several_threads_equals_some_sequential_order(name):
    """Calls on one layer from several threads are serialized by its lock: every token is stored
    once, each call's tokens together, and every result (prefill histories, fused decode outputs)
    is that of the sequential run in the order the calls stored their tokens.  Without the lock,
    two calls read the same length and store at the same place (tokens lost).  No window, so
    every token is compressed on its own and its bytes identify it."""
    assert G * 1 * H * D * SAME_S >= 16 * _config.get("cpu_parallel_min_work")  # parallel attention
    assert H * SAME_CHUNK * D >= _config.get("cpu_parallel_min_work")  # parallel prefill compression
    rng = np.random.default_rng(11)
    k0 = rng.standard_normal((1, H, SAME_S, D)).astype(np.float32)
    q = rng.standard_normal((1, H * G, 1, D)).astype(np.float32)
    keys = [(t, s) for t in range(SAME_T) for s in range(len(SAME_STEPS))]
    toks = {(t, s): tuple(rng.standard_normal((2, 1, H, SAME_STEPS[s], D)).astype(np.float32)) for t, s in keys}
    total = sum(SAME_STEPS) * SAME_T

    def fresh():
        c = make_cache(name, num_layers=1, num_kv_heads=H, head_dim=D)
        c.prefill(0, k0, k0)
        return c

    ref = fresh()  # every token's bytes: (call, token of the call)
    for key in keys:
        ref.prefill(0, *toks[key])
    owner = {_token_bytes(ref, SAME_S + j): (key, i) for j, (key, i) in
             enumerate((key, i) for key in keys for i in range(SAME_STEPS[key[1]]))}
    assert len(owner) == total

    par = fresh()
    got = _same_layer_calls(par, toks, q)
    assert par.seq_len(0) == SAME_S + total, "tokens were lost"
    stored = [owner.get(_token_bytes(par, SAME_S + j)) for j in range(total)]
    assert sorted(x for x in stored if x is not None) == sorted(owner.values()), "a token was lost or garbled"
    order = [key for key, i in stored if i == 0]
    assert stored == [(key, i) for key in order for i in range(SAME_STEPS[key[1]])], "calls interleaved"
    assert all([s for t2, s in order if t2 == t] == list(range(len(SAME_STEPS))) for t in range(SAME_T))
    seq = fresh()
    for key in order:
        k, v = toks[key]
        _assert_same(got[key], seq.prefill(0, k, v) if SAME_STEPS[key[1]] > 1 else seq.decode(0, k, v, q, CFG))
    _assert_same(par.live_arrays(0), seq.live_arrays(0))


def test_seq_len_read_during_an_eviction_is_a_count_that_existed():
    """``seq_len`` summed two fields without the layer's lock, and an eviction changes them one
    at a time (``seq_len`` first, ``n_evicted`` after): a reader in between saw a count that
    never existed (a decrease, thousands a run under load).  Here the reader runs exactly
    there: another thread reads while the decoding thread is between the two updates."""
    cache = make_cache("kv4", num_layers=1, num_kv_heads=2, head_dim=64, sliding_window=8)
    rng = np.random.default_rng(3)
    k = rng.standard_normal((1, 2, 1, 64)).astype(np.float32)
    q = rng.standard_normal((1, 4, 1, 64)).astype(np.float32)
    cfg = AttendConfig(64 ** -0.5, n_kv_groups=2)
    for _ in range(8):  # past the window: every further step evicts
        cache.decode(0, k, k, q, cfg)
    set_live, readers, seen = cache._set_live, [], []

    def set_live_then_read(st):  # runs inside the eviction, between its two updates
        set_live(st)
        r = threading.Thread(target=lambda: seen.append(cache.seq_len(0)))
        r.start()
        r.join(timeout=0.2)  # (a reader that waits for the layer's lock finishes after the step)
        readers.append(r)

    cache._set_live = set_live_then_read
    for step in range(9, 13):
        cache.decode(0, k, k, q, cfg)
        for r in readers:
            r.join(timeout=60)
        assert readers and set(seen) <= {step - 1, step}, (step, seen)
        readers.clear()
        seen.clear()


@pytest.mark.parametrize("mixed", [False, True])
def test_a_fork_taken_during_reset_sees_every_layer_before_or_after_it(mixed):
    """``reset`` took each layer's lock in turn: a fork waiting meanwhile could see some layers
    reset and others not (about 2 % of forks with a short switch interval)."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        k = np.ones((1, 2, 16, 64), np.float32)
        mixes = 0
        for _ in range(40):
            opts = {"layer_overrides": {0: {"bits": 4}}} if mixed else {}
            cache = make_cache("dense" if not mixed else "pqo3", num_layers=16, num_kv_heads=2, head_dim=64, **opts)
            for layer in range(16):
                cache.prefill(layer, k, k)
            stop, seen = threading.Event(), []

            def snapper(cache=cache, stop=stop, seen=seen):
                while not stop.is_set():
                    f = cache.fork()
                    seen.append(len({f.seq_len(j) for j in range(16)}))

            t = threading.Thread(target=snapper)
            t.start()
            cache.reset()
            stop.set()
            t.join(timeout=60)
            mixes += sum(n > 1 for n in seen)
        assert mixes == 0
    finally:
        sys.setswitchinterval(old)
