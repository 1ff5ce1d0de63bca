"""``numba_kv.StepGraph`` in Numba's CUDA simulator: steps whose launches are held back, then
launched one by one, captured, or replayed as a "graph" (the simulator's stand-in launches the
captured entries in order), with every output the CPU twin's.

What a graph replays is what it captured: if a replay launched anything but the step's
kernels on the step's arrays, the outputs (new inputs every step) would be stale and differ
from the twin's.  The invariant that keeps stream order — no device work other than a
launch while launches are held back — is checked by wrapping the simulator's allocation,
copy and item-assignment entry points across steady and non-steady steps (window filling,
buffers growing, a new output array, prefill).  The capture on a GPU:
``tests/gpu/test_device_step_graph.py``.
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import pytest

from numba_kv import AttendConfig, StepGraph, _backend, _config, make_cache
from numba_kv._backend import simulator_enabled, to_host

from ..conftest import to_device
from .test_sim_step_budget import steady_layer

# (device vs CPU twin at float32 round-off: the float32 kernels; the tensor-core ones: test_sim_mma*.py)
pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("float32_attention")]

H, G, D = 2, 2, 64
SHAPES = ((1, H, 1, D), (1, H, 1, D), (1, H * G, 1, D))


@pytest.fixture(autouse=True)
def _simulator_only():
    if not simulator_enabled():
        pytest.skip("the simulator's stand-in graph (a GPU: tests/gpu/test_device_step_graph.py)")


@contextlib.contextmanager
def no_device_work_while_held():
    """Fail on any allocation, copy or device item assignment made while the calling thread
    holds launches back (they would overtake the launches held)."""
    from numba import cuda

    arr_type = type(cuda.device_array(1))
    names = {"to_device": cuda, "device_array": cuda, "copy_to_host": arr_type, "copy_to_device": arr_type,
             "__setitem__": arr_type}
    orig = {name: getattr(owner, name) for name, owner in names.items()}
    seen: list = []

    def guarded(name):
        fn = orig[name]

        def wrapper(*args, **kwargs):
            rec = _backend.step_recorder()
            if rec is not None and rec.pending:
                seen.append(name)
            return fn(*args, **kwargs)

        return wrapper

    for name, owner in names.items():
        setattr(owner, name, guarded(name))
    try:
        yield seen
    finally:
        for name, owner in names.items():
            setattr(owner, name, orig[name])


@contextlib.contextmanager
def namespace_lookups_while_held(monkeypatch):
    """Record ``_backend.xp_of`` calls made while launches are held: each launches what is held
    (CuPy work or a Numba copy may follow), so a steady step must make none."""
    seen: list = []
    xp_of = _backend.xp_of

    def spy(a):
        rec = _backend.step_recorder()
        if rec is not None and rec.pending:
            seen.append(type(a).__name__)
        return xp_of(a)

    monkeypatch.setattr(_backend, "xp_of", spy)
    yield seen


def _inputs(rng):
    return tuple(rng.standard_normal(s).astype(np.float32) for s in SHAPES)


def _fixed_buffers():
    return tuple(to_device(np.zeros(s, np.float32)) for s in (*SHAPES, SHAPES[2]))


def _step(graph, cache, twin, attend, rng, buffers, *, out=True):
    """One decode step through ``graph`` via the fixed buffers, checked against the twin."""
    dk, dv, dq, dout = buffers
    host = _inputs(rng)
    for buf, x in zip((dk, dv, dq), host):
        buf.copy_to_device(x)
    kw = {"out": dout} if out else {}
    res = graph.run(cache.decode, 0, dk, dv, dq, attend, **kw)
    np.testing.assert_allclose(to_host(res.out), twin.decode(0, *host, attend).out, rtol=1e-5, atol=1e-6)
    return res


@pytest.mark.parametrize("mode", ["kv3", "kv4", "pqo3"])
def test_steady_steps_are_captured_then_replayed(mode, monkeypatch):
    rng = np.random.default_rng(41)
    cache, twin, attend = steady_layer(mode, rng, H, G, D)
    graph, buffers = StepGraph(), _fixed_buffers()
    n = 5
    with no_device_work_while_held() as seen, namespace_lookups_while_held(monkeypatch) as lookups:
        _step(graph, cache, twin, attend, rng, buffers)  # binds the layer's step (may look up while holding)
        bound = len(lookups)
        for _ in range(n - 1):
            _step(graph, cache, twin, attend, rng, buffers)
    assert not seen and len(lookups) == bound, (seen, lookups)
    st = graph.stats()
    assert st["steps"] == n and st["failed"] == 0 and graph.error is None, st
    # the first step binds the layer's step state (an upload: as launched); the next one's
    # launches are held and launched, the third captures, every later one replays
    assert st["captured"] == 1 and st["replayed"] == n - 3, st
    assert st["eager"] + st["launched"] == 2, st
    # another output array: launched, not replayed into the old one
    other = (*buffers[:3], to_device(np.full(SHAPES[2], 7.0, np.float32)))
    before = to_host(buffers[3]).copy()
    res = _step(graph, cache, twin, attend, rng, other)
    assert res.out is other[3]
    np.testing.assert_array_equal(to_host(buffers[3]), before)  # the old output untouched
    assert graph.stats()["replayed"] == n - 3 and graph.stats()["launched"] == 2


def test_non_steady_steps_run_in_order_and_steady_ones_recapture():
    """Prefill, the window filling, the buffers growing, a step without ``out=`` (a new
    output), new input arrays: every step gives the twin's output and no device work
    overtakes a held launch; steady stretches in between are captured again."""
    rng = np.random.default_rng(42)
    cache, twin = (make_cache("pqo3", num_layers=1, num_kv_heads=H, head_dim=D, residual_length=8, **kw)
                   for kw in ({}, {"window_dtype": "float32"}))
    attend = AttendConfig(D ** -0.5, n_kv_groups=G)
    graph, buffers = StepGraph(), _fixed_buffers()
    k = rng.standard_normal((1, H, 5, D)).astype(np.float32)
    with no_device_work_while_held() as seen, _config.knobs(growth_fraction=0.0, growth_min_extra=2):
        graph.run(cache.prefill, 0, to_device(k), to_device(k[:, :, ::-1].copy()))
        twin.prefill(0, k, k[:, :, ::-1].copy())
        for i in range(cache.config.residual_length + 10):
            if i % 9 == 8:  # new arrays: held launches that do not repeat
                host = _inputs(rng)
                res = graph.run(cache.decode, 0, *(to_device(x) for x in host), attend)
                np.testing.assert_allclose(to_host(res.out), twin.decode(0, *host, attend).out, rtol=1e-5, atol=1e-6)
            else:
                _step(graph, cache, twin, attend, rng, buffers, out=i % 5 != 4)
    assert not seen, seen
    st = graph.stats()
    assert st["eager"] >= 3 and st["captured"] >= 1 and st["replayed"] >= 1, st


def test_a_failing_step_launches_what_it_held_and_steps_do_not_nest():
    rng = np.random.default_rng(45)
    cache, twin, attend = steady_layer("pqo3", rng, H, G, D)
    graph, buffers = StepGraph(), _fixed_buffers()
    for _ in range(2):
        _step(graph, cache, twin, attend, rng, buffers)
    host = _inputs(rng)
    dk, dv, dq, dout = buffers
    for buf, x in zip((dk, dv, dq), host):
        buf.copy_to_device(x)

    def step_then_fail():
        cache.decode(0, dk, dv, dq, attend, out=dout)
        raise KeyError("after the launches")

    with pytest.raises(KeyError):
        graph.run(step_then_fail)
    assert _backend.step_recorder() is None
    np.testing.assert_allclose(to_host(dout), twin.decode(0, *host, attend).out, rtol=1e-5, atol=1e-6)
    assert graph.stats()["failed"] == 1
    with pytest.raises(RuntimeError, match="do not nest"):
        graph.run(graph.run, lambda: None)
    _step(graph, cache, twin, attend, rng, buffers)  # the graph still steps


#: paged steps: from PAGED_T0 tokens across the first page's end (page size PAGED_PS)
PAGED_PS, PAGED_T0, PAGED_STEPS = 16, 6, 14


def test_paged_steps_replay_within_a_page_and_recapture_in_the_next(monkeypatch):
    from numba_kv.caches.paged import PagedKVCache

    rng = np.random.default_rng(46)
    cache, twin = (PagedKVCache(4, 1, H, D, page_size=PAGED_PS, storage="pqo3") for _ in range(2))
    sid = cache.allocate_sequence()
    assert twin.allocate_sequence() == sid
    k = rng.standard_normal((H, PAGED_T0, D)).astype(np.float32)
    cache.append(0, sid, to_device(k), to_device(k[:, ::-1].copy()))
    twin.append(0, sid, k, k[:, ::-1].copy())
    shapes = ((H, 1, D), (H, 1, D), SHAPES[2])
    dk, dv, dq = (to_device(np.zeros(s, np.float32)) for s in shapes)
    dout = to_device(np.zeros(SHAPES[2], np.float32))

    def step():
        cache.append(0, sid, dk, dv)
        return cache.decode_attention(0, dq, [sid], out=dout)

    graph = StepGraph()
    with no_device_work_while_held() as seen, namespace_lookups_while_held(monkeypatch) as lookups:
        looked = []  # the steps that looked a namespace up while launches were held
        for i in range(PAGED_STEPS):
            host = tuple(rng.standard_normal(s).astype(np.float32) for s in shapes)
            for buf, x in zip((dk, dv, dq), host):
                buf.copy_to_device(x)
            before = len(lookups)
            out = graph.run(step)
            if len(lookups) > before:
                looked.append(i)
            twin.append(0, sid, host[0], host[1])
            np.testing.assert_allclose(to_host(out), twin.decode_attention(0, host[2], [sid]), rtol=1e-5, atol=1e-6)
    assert not seen, seen
    st = graph.stats()
    # only the first step and the one that opens the second page (a new table uploaded) may
    # look up while holding; the steps within each page are captured, then replayed
    opening = PAGED_PS - PAGED_T0
    assert cache.seq_len(0, sid) == PAGED_T0 + PAGED_STEPS > PAGED_PS and set(looked) <= {0, opening}, looked
    assert st["captured"] == 2 and st["replayed"] >= PAGED_STEPS - 8 and st["eager"] >= 2, st


def test_threads_hold_only_their_own_launches():
    """Thread A holds a steady step's launches while thread B steps its own layer through its
    own graph (the simulator runs one kernel at a time: B runs while A waits inside its
    step): B's launches are not held by A's step, A's are launched when its step ends, and
    every output is its twin's."""
    rng = np.random.default_rng(47)
    a, b = (steady_layer("pqo3", rng, H, G, D) for _ in range(2))
    graphs, buffers = (StepGraph(), StepGraph()), (_fixed_buffers(), _fixed_buffers())
    for _ in range(3):  # A's graph captured: its next step holds every launch
        _step(graphs[0], *a, rng, buffers[0])
    held, done, errors = threading.Event(), threading.Event(), []
    host = _inputs(rng)
    dk, dv, dq, dout = buffers[0]
    for buf, x in zip((dk, dv, dq), host):
        buf.copy_to_device(x)

    def step_a():
        res = a[0].decode(0, dk, dv, dq, a[2], out=dout)
        held.set()
        assert done.wait(600)
        return res

    def thread_b():
        try:
            assert held.wait(600)
            assert len(rec_of_a[-1].pending) == 3  # A still holds its step's launches
            for _ in range(3):
                _step(graphs[1], *b, rng, buffers[1])
        except Exception as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)
        finally:
            done.set()

    rec_of_a: list = []
    original = _backend.set_step_recorder

    def spy(recorder):
        if recorder is not None:
            rec_of_a.append(recorder)
        return original(recorder)

    t = threading.Thread(target=thread_b)
    t.start()

    _backend.set_step_recorder = spy
    try:
        graphs[0].run(step_a)
    finally:
        _backend.set_step_recorder = original
    t.join()
    assert not errors, errors
    np.testing.assert_allclose(to_host(dout), a[1].decode(0, *host, a[2]).out, rtol=1e-5, atol=1e-6)
    assert graphs[0].stats()["replayed"] == 1 and graphs[1].stats()["captured"] == 1


@pytest.mark.parametrize("name", ["dense", "pq3"])
def test_other_families_step_in_order(name):
    """Other families, whose steps do other device work (the dense cache returns its history,
    PQ its dequantized history): every step gives the twin's output, and no device work
    overtakes a held launch."""
    rng = np.random.default_rng(50)
    kw = {} if name == "dense" else {"window_dtype": "float32", "residual_length": 4}
    cache, twin = (make_cache(name, num_layers=1, num_kv_heads=H, head_dim=D, **kw) for _ in range(2))
    k = rng.standard_normal((1, H, 6, D)).astype(np.float32)
    cache.prefill(0, to_device(k), to_device(k))
    twin.prefill(0, k, k)
    attend, graph = AttendConfig(D ** -0.5, n_kv_groups=G), StepGraph()
    with no_device_work_while_held() as seen:
        for _ in range(3):
            host = _inputs(rng)
            res = graph.run(cache.decode, 0, *(to_device(x) for x in host), attend)
            ref = twin.decode(0, *host, attend)
            got, want = (r.result.k if hasattr(r, "result") else r.out for r in (res, ref))
            np.testing.assert_allclose(to_host(got), want, rtol=1e-5, atol=1e-6)
    assert not seen, seen
    assert graph.stats()["steps"] == 3 and graph.stats()["failed"] == 0
