"""``numba_kv.DecodeStep`` in Numba's CUDA simulator: steady steps that skip their Python (one
"graph" launch, the layer's counters advanced) give the CPU twin's outputs and leave the
twin's buffers and counters; ``verify=True`` checks, step by step across buffer growth, that
a skipped step would have left exactly what the full step left, and fails when the cache's
regime is wrong; anything that changes what a step launches (a knob, an environment variable,
the launch stream, a read of the deferred checks, a crop, a reset, a decode from elsewhere)
makes the next step a full one.  NaN written into a bound input is still caught by
``check_inputs`` (the deferred record rides in the replayed store launch).

The simulator runs a step's kernels in Python (seconds per step), so the checks of the host
bookkeeping alone stub the simulator's graph launch out (the kernels' work is the GPU's);
the outputs are compared with real launches.  On a GPU: ``tests/gpu/test_device_step_graph.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

from numba_kv import AttendConfig, DecodeStep, _config, _graph, knobs, make_cache
from numba_kv._backend import simulator_enabled, to_host
from numba_kv.caches import step as step_module

from ..conftest import to_device

# (device vs CPU twin at float32 round-off: the float32 kernels; the tensor-core ones: test_sim_mma*.py)
pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("float32_attention")]

H, G, D = 1, 2, 64
SHAPES = ((1, H, 1, D), (1, H, 1, D), (1, H * G, 1, D))


@pytest.fixture(autouse=True)
def _simulator_only():
    if not simulator_enabled():
        pytest.skip("the simulator's stand-in graph (a GPU: tests/gpu/test_device_step_graph.py)")
    yield
    _config.reset()


def _pair(mode: str, rng, put=to_device):
    """A one-layer cache on ``put``'s arrays with a small window, after a prefill that fills it
    (``pqo3`` with a float32 window: Numba device arrays hold no float16 window, the twin would)."""
    kw = {"window_dtype": "float32"} if mode == "pqo3" else {}
    cache = make_cache(mode, num_layers=1, num_kv_heads=H, head_dim=D, residual_length=4, sink_tokens=1, **kw)
    k, v = (rng.standard_normal((1, H, 8, D)).astype(np.float32) for _ in range(2))
    cache.prefill(0, put(k), put(v))
    return cache


def _bound(cache, verify=False):
    bufs = [to_device(np.zeros(s, np.float32)) for s in (*SHAPES, SHAPES[2])]
    return DecodeStep(cache, 0, *bufs[:3], AttendConfig(D ** -0.5, n_kv_groups=G), out=bufs[3], verify=verify), bufs


def _fill(bufs, rng) -> tuple:
    host = tuple(rng.standard_normal(s).astype(np.float32) for s in SHAPES)
    for buf, x in zip(bufs, host):
        buf.copy_to_device(x)
    return host


@pytest.fixture
def no_kernels(monkeypatch):
    """The simulator's graph launches nothing (the host bookkeeping alone is under test)."""
    monkeypatch.setattr(_graph._SimGraph, "launch", lambda self, stream: None)


@pytest.mark.filterwarnings("ignore:invalid value encountered in cast")  # (the NaN step, quantized)
@pytest.mark.parametrize("mode", ["kv3:residual_fraction=0.0", "kv4", "pqo3"])
def test_skipped_steps_give_the_twins_outputs_and_state(mode):
    rng = np.random.default_rng(71)
    with knobs(growth_min_extra=64):  # (no growth inside the test's steps)
        cache, twin = _pair(mode, np.random.default_rng(1)), _pair(mode, np.random.default_rng(1), np.asarray)
        step, bufs = _bound(cache)
        attend = step.config
        for i in range(7):
            host = _fill(bufs[:3], rng)
            out = step().out
            assert out is bufs[3]
            np.testing.assert_allclose(to_host(out), twin.decode(0, *host, attend).out, rtol=1e-5, atol=1e-6)
            got, want = cache._layers[0], twin._layers[0]
            assert (got.seq_len, got.meta, got.live) == (want.seq_len, want.meta, want.live), i
            for name, buf in got.buffers.items():  # codes, scales, window, key mean: the twin's
                np.testing.assert_array_equal(to_host(buf), want.buffers[name], err_msg=f"{name}, step {i}")
        # launched, launched, captured, replayed (armed after two steps of one graph), then skipped
        assert step.stats()["bound"] == 3 and step.stats()["replayed"] == 4, step.stats()
        k = rng.standard_normal(SHAPES[0]).astype(np.float32)
        k[0, 0, 0, 5] = np.nan
        bufs[0].copy_to_device(k)
        step()
        assert step.stats()["bound"] == 4  # the NaN step skipped its Python too ...
    with pytest.raises(ValueError, match="k or v: expected finite values"):
        cache.check_inputs()  # ... and its deferred check still saw the NaN


def test_a_growing_window_skips_the_steps_between_its_growth_steps():
    """``kv3``'s window grows with the history (``residual_fraction``): the step that widens it
    evicts nothing and runs in full, the steps in between store like the one before and skip
    their Python.  Here the window is ``max(4, t // 8)`` tokens after ``t``: it widens at the
    steps that bring the history to 40 and 48 tokens.  Every output and byte is the twin's."""
    rng = np.random.default_rng(74)
    mode = "kv3:residual_fraction=0.125"
    with knobs(growth_min_extra=64):  # (no growth of the codes inside the test's steps)
        cache, twin = _pair(mode, np.random.default_rng(1)), _pair(mode, np.random.default_rng(1), np.asarray)
        step, bufs = _bound(cache)
        attend = step.config
        wins = []
        for i in range(44):  # the history from 9 to 52 tokens
            host = _fill(bufs[:3], rng)
            bound = step.stats()["bound"]
            np.testing.assert_allclose(to_host(step().out), twin.decode(0, *host, attend).out, rtol=1e-5, atol=1e-6)
            got, want = cache._layers[0], twin._layers[0]
            assert (got.seq_len, got.meta, got.live) == (want.seq_len, want.meta, want.live), i
            wins.append((got.seq_len, got.meta["n_win"], step.stats()["bound"] - bound))
        for name, buf in got.buffers.items():
            np.testing.assert_array_equal(to_host(buf), want.buffers[name], err_msg=name)
    assert [t for t, n_win, _ in wins if n_win != max(4, t // 8)] == []  # the premise: the window grew
    # in full: the first four steps (launched, launched, captured, replayed: then armed), and
    # each growth step with the three after it (its launches differ from theirs: the graph is
    # captured and armed again)
    full = [t for t, _, skipped in wins if not skipped]
    assert full == [9, 10, 11, 12, 40, 41, 42, 43, 48, 49, 50, 51], full
    assert step.stats()["bound"] == 44 - len(full)


@pytest.mark.parametrize("mode", ["kv4", "pqo3"])
def test_verify_holds_across_growth(mode, no_kernels, monkeypatch):
    checked = []
    check = step_module.DecodeStep._check
    monkeypatch.setattr(step_module.DecodeStep, "_check", lambda self, *a: checked.append(1) or check(self, *a))
    rng = np.random.default_rng(72)
    with knobs(growth_min_extra=4, growth_fraction=0.0):
        cache = _pair(mode, rng)
        step, bufs = _bound(cache, verify=True)
        caps = set()
        for _ in range(16):
            _fill(bufs[:3], rng)
            step()
            caps.add(cache._layers[0].capacity)
    assert len(caps) >= 3 and len(checked) >= 6 and step.stats()["bound"] == 0, (caps, checked, step.stats())


def test_verify_holds_across_the_windows_growth(no_kernels, monkeypatch):
    """Armed across the steps that widen ``kv3``'s window (``max(4, t // 8)`` tokens after
    ``t``: at the history's 40th and 48th tokens), ``verify=True`` finds every step it checks
    as a skipped step would have left it (a regime blind to the widening fails:
    :func:`test_verify_catches_a_regime_that_misses_the_windows_growth`)."""
    checked = []
    check = step_module.DecodeStep._check
    monkeypatch.setattr(step_module.DecodeStep, "_check",
                        lambda self, *a: checked.append(self._cache._layers[0].seq_len) or check(self, *a))
    rng = np.random.default_rng(72)
    with knobs(growth_min_extra=64):
        cache = _pair("kv3:residual_fraction=0.125", rng)
        step, bufs = _bound(cache, verify=True)
        for _ in range(44):  # the history from 9 to 52 tokens
            _fill(bufs[:3], rng)
            step()
    assert cache._layers[0].meta["n_win"] == 6 and step.stats()["bound"] == 0
    # checked: every step while armed (the history after the step), none that widens the window
    # nor the three after it, which arm the bound step again
    assert checked == [t for t in range(13, 53) if t not in (40, 41, 42, 43, 48, 49, 50, 51)], checked


def test_verify_catches_a_regime_that_misses_growth(no_kernels, monkeypatch):
    from numba_kv.caches.polarquant import PolarQuantCache

    regime = PolarQuantCache._steady_regime

    def blind(self, st, n):  # ignores the codes' capacity: claims the growing step is steady
        saved = st.capacity
        st.capacity = 1 << 30
        try:
            return regime(self, st, n)
        finally:
            st.capacity = saved

    monkeypatch.setattr(PolarQuantCache, "_steady_regime", blind)
    rng = np.random.default_rng(73)
    with knobs(growth_min_extra=4, growth_fraction=0.0):
        step, bufs = _bound(_pair("kv4", rng), verify=True)
        with pytest.raises(RuntimeError, match=r"DecodeStep\(verify=True\).*(replayed|counters)"):
            for _ in range(12):
                _fill(bufs[:3], rng)
                step()


def test_verify_catches_a_regime_that_misses_the_windows_growth(no_kernels, monkeypatch):
    from numba_kv.caches import _fused_step

    # blind to residual_fraction: claims the step that widens the window is steady
    monkeypatch.setattr(_fused_step, "window_capacity", lambda tokens, residual, ratio: residual)
    rng = np.random.default_rng(75)
    with knobs(growth_min_extra=64):
        step, bufs = _bound(_pair("kv3:residual_fraction=0.25", rng), verify=True)
        with pytest.raises(RuntimeError, match=r"DecodeStep\(verify=True\).*(replayed|counters)"):
            for _ in range(16):  # the window widens at the history's 20th token
                _fill(bufs[:3], rng)
                step()


def test_what_changes_a_steps_launches_makes_it_a_full_one(no_kernels, monkeypatch):
    from numba import cuda

    import numba_kv

    rng = np.random.default_rng(74)
    with knobs(growth_min_extra=64):
        cache = _pair("kv4", rng)
        step, bufs = _bound(cache)

        def arm():
            for _ in range(6):
                _fill(bufs[:3], rng)
                step()
            assert step._armed is not None, step.stats()
            armed = step._armed
            return lambda: cache._steady_step(0, 1, armed.after, armed.delta, None)

        skippable = arm()
        assert skippable() is not None
        with knobs(cuda_warp_attention=0):
            assert skippable() is None
        assert skippable() is None  # (the key of the knobs moved on: knobs are asked again)
        skippable = arm()
        monkeypatch.setenv("NUMBA_KV_CUDA_MMA_ATTENTION", "1")
        assert skippable() is None
        monkeypatch.delenv("NUMBA_KV_CUDA_MMA_ATTENTION")
        assert skippable() is not None
        with numba_kv.launch_stream(cuda.stream()):
            assert not step.graph.replay(step._armed.generation)  # captured for the default stream
        assert step.graph.replay(step._armed.generation)
        cache.check_inputs()  # the deferred record's accumulators are new
        assert skippable() is None
        skippable = arm()
        cache.decode(0, *bufs[:3], step.config)  # a step from elsewhere
        assert skippable() is None
        skippable = arm()
        cache.crop(cache.seq_len(0) - 1)
        assert skippable() is None
        before = step.stats()["bound"]
        step()
        assert step.stats()["bound"] == before  # the step after the crop ran in full
        cache.reset()
        assert skippable() is None


def test_the_bound_objects_are_read_only():
    """A skipped step replays what it captured: a ``config`` or ``out`` swapped in afterwards
    was ignored (the old scale, the old output array) without a word."""
    cache = _pair("kv4", np.random.default_rng(1))
    step, bufs = _bound(cache)
    for name in ("cache", "layer", "config", "k", "v", "q", "out"):
        with pytest.raises(AttributeError):
            setattr(step, name, getattr(step, name))
    assert step.out is bufs[3] and step.k is bufs[0] and step.config == AttendConfig(D ** -0.5, n_kv_groups=G)


@pytest.mark.filterwarnings("ignore:invalid value encountered in cast")  # (the NaN step, quantized)
def test_check_inputs_on_another_thread_cannot_drop_a_skipped_steps_record(monkeypatch):
    """A skipped step compares the deferred record's accumulators, then replays a launch that
    folds into them; a ``check_inputs()`` between the two took them, and the NaN the replay
    recorded went into an accumulator nobody read again.  The other thread now waits for the
    replay (forced here into that gap, as the scheduler could)."""
    import threading

    rng = np.random.default_rng(7)
    with knobs(growth_min_extra=64):
        cache = _pair("kv4", np.random.default_rng(1))
        step, bufs = _bound(cache)
        for _ in range(6):
            _fill(bufs[:3], rng)
            step()
        assert step._armed is not None
        k = rng.standard_normal(SHAPES[0]).astype(np.float32)
        k[0, 0, 0, 3] = np.nan
        bufs[0].copy_to_device(k)
        real, seen, threads = _graph._SimGraph.launch, [], []

        def launch(self, stream):
            def other():
                try:
                    cache.check_inputs()
                    seen.append("clean")
                except ValueError as e:
                    seen.append(str(e))
            th = threading.Thread(target=other)
            th.start()
            th.join(0.5)  # blocked on the record's lock now: it reads after the replay
            threads.append(th)
            return real(self, stream)

        monkeypatch.setattr(_graph._SimGraph, "launch", launch)
        bound = step.stats()["bound"]
        step()
        threads[0].join(10)
        assert step.stats()["bound"] == bound + 1, "the NaN step skipped its Python"
    # the other thread's read saw the NaN (it waited for the replay), or a later one does
    if seen == ["clean"]:
        with pytest.raises(ValueError, match="expected finite values"):
            cache.check_inputs()
    else:
        assert seen and "expected finite values" in seen[0], seen
