"""``numba_kv.StepGraph`` with real device arrays: steady decode steps captured as one CUDA
graph (``cuda.core``) and replayed, with the outputs of the same steps launched one by one
(bit for bit) and of the CPU twin (float32 round-off).  ``kv4`` as the preset makes it (key
centering, a rotated int8 window) on both array kinds: its keys are centered in the store's
launch, so its steps replay too, and ``kv3``'s (VQ codes, 8-bit norms: the same one-launch store);
``pqo3`` with its float16 window too (its store takes the
same bit-pattern views every step).  On a GPU with CuPy and Numba device arrays (the
simulator's stand-in graph is tested by ``tests/cuda/test_sim_step_graph.py``)."""

from __future__ import annotations

import numpy as np
import pytest

from numba_kv import AttendConfig, StepGraph, _backend, make_cache

H, G, D = 2, 2, 64
STEPS = 6
SHAPES = ((1, H, 1, D), (1, H, 1, D), (1, H * G, 1, D))


def _cache(mode, dev):
    if mode == "pqo3-f16":  # the preset's float16 window (CuPy: stored as binary16 bit patterns)
        return make_cache("pqo3", num_layers=1, num_kv_heads=H, head_dim=D)
    kw = {} if mode.startswith(("kv3", "kv4")) else {"window_dtype": "float32"}
    return make_cache(mode, num_layers=1, num_kv_heads=H, head_dim=D, **kw)


@pytest.mark.parametrize("mode", ["pqo3", "pqo3-f16", "kv4", "kv3"])
def test_steady_steps_replay_as_a_graph(dev, mode):
    if _backend.simulator_enabled():
        pytest.skip("a real capture (the simulator's stand-in graph: tests/cuda/test_sim_step_graph.py)")
    rng = np.random.default_rng(61)
    graphed, plain = (_cache(mode, dev) for _ in range(2))
    # Numba device arrays hold no float16 window: the preset keeps it in float32 there, so the
    # twin that holds what the device cache holds is the float32-window one
    twin = _cache("pqo3" if mode == "pqo3-f16" and dev.kind == "numba" else mode, dev)
    t0 = graphed.config.sink_tokens + graphed.config.residual_length + 3  # the window full
    k, v = (rng.standard_normal((1, H, t0, D)).astype(np.float32) for _ in range(2))
    for cache, put in ((graphed, dev.put), (plain, dev.put), (twin, np.asarray)):
        cache.prefill(0, put(k), put(v))
    attend = AttendConfig(D ** -0.5, n_kv_groups=G)
    bufs = [tuple(dev.put(np.zeros(s, np.float32)) for s in (*SHAPES, SHAPES[2])) for _ in range(2)]
    graph = StepGraph()
    for _ in range(STEPS):
        host = tuple(rng.standard_normal(s).astype(np.float32) for s in SHAPES)
        outs = []
        runners = (graph.run, lambda fn, *a, **kw: fn(*a, **kw))
        for (dk, dv, dq, dout), cache, run in zip(bufs, (graphed, plain), runners):
            for buf, x in zip((dk, dv, dq), host):
                if dev.kind == "cupy":
                    buf[...] = dev.cupy.asarray(x)
                else:
                    buf.copy_to_device(x)
            outs.append(dev.get(run(cache.decode, 0, dk, dv, dq, attend, out=dout).out).copy())
        np.testing.assert_array_equal(outs[0], outs[1])  # the graph replays the very launches
        # the key mean on the device is NumPy's bit for bit (ops.keymean), so the int8 window
        # codes are the twin's and only the attention's float32 sums differ
        np.testing.assert_allclose(outs[0], twin.decode(0, *host, attend).out, rtol=1e-5, atol=1e-6)
        got, want = graphed._layers[0].buffers, twin._layers[0].buffers
        assert got.keys() == want.keys()
        for name, buf in got.items():  # codes, scales, the int8 window, the key mean: the twin's
            np.testing.assert_array_equal(dev.get(buf), want[name], err_msg=name)
    st = graph.stats()
    assert graph.error is None and st["failed"] == 0, (graph.error, st)
    assert st["captured"] == 1 and st["replayed"] >= STEPS - 4, st


@pytest.mark.parametrize("mode", ["pqo3", "pqo3-f16", "kv4", "kv3:residual_fraction=0.0", "tq3"])
def test_bound_steps_skip_their_python(dev, mode):
    """``numba_kv.DecodeStep``: from the fifth step on a steady step is one graph launch with the
    layer's counters advanced, and its outputs, buffers and counters are those of the same
    steps through ``cache.decode`` (bit for bit)."""
    if _backend.simulator_enabled():
        pytest.skip("a real capture (the simulator's: tests/cuda/test_sim_decode_step.py)")
    from numba_kv import DecodeStep

    if mode == "tq3" and dev.kind != "cupy":
        pytest.skip("TurboQuant caches take NumPy or CuPy arrays")
    rng = np.random.default_rng(62)
    bound, plain = (_cache(mode, dev) for _ in range(2))
    t0 = bound.config.sink_tokens + bound.config.residual_length + 3
    k, v = (rng.standard_normal((1, H, t0, D)).astype(np.float32) for _ in range(2))
    for cache in (bound, plain):
        cache.prefill(0, dev.put(k), dev.put(v))
    attend = AttendConfig(D ** -0.5, n_kv_groups=G)
    bufs = [tuple(dev.put(np.zeros(s, np.float32)) for s in (*SHAPES, SHAPES[2])) for _ in range(2)]
    step = DecodeStep(bound, 0, *bufs[0][:3], attend, out=bufs[0][3])
    for _ in range(STEPS + 4):
        host = tuple(rng.standard_normal(s).astype(np.float32) for s in SHAPES)
        for dk, dv, dq, _ in bufs:
            for buf, x in zip((dk, dv, dq), host):
                if dev.kind == "cupy":
                    buf[...] = dev.cupy.asarray(x)
                else:
                    buf.copy_to_device(x)
        got = dev.get(step().out).copy()
        want = dev.get(plain.decode(0, *bufs[1][:3], attend, out=bufs[1][3]).out)
        np.testing.assert_array_equal(got, want)
        a, b = bound._layers[0], plain._layers[0]
        assert (a.seq_len, a.meta, a.live) == (b.seq_len, b.meta, b.live)
        for name, buf in a.buffers.items():
            np.testing.assert_array_equal(dev.get(buf), dev.get(b.buffers[name]), err_msg=name)
    st = step.stats()
    if mode == "tq3":  # CuPy arithmetic between its launches: every step in full (no regime)
        assert st["bound"] == 0 and st["steps"] == STEPS + 4, st
        return
    assert step.graph.error is None and st["bound"] >= STEPS - 1, (step.graph.error, st)
