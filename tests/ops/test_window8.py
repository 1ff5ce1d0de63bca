"""``window8_store`` (one serial call for the int8 window part of a store) against the
op-by-op path it replaces on the CPU (int8 read, inverse rotation, NumPy slide, rotation,
int8 write, one kernel launch each): codes, scales and evicted tokens bit for bit."""

import numpy as np
import pytest

from numba_kv.caches._layer import LayerState
from numba_kv.caches._window import ExactWindow, assign_tokens, plan_store


def _op_by_op(win: ExactWindow, st: LayerState, name: str, x3, plan, sinks: int):
    """The store of ``ExactWindow.store`` written with the element operations (the reference)."""
    a, e_old, e_new, keep_old, keep_new = plan
    win.write(st, name, x3, 0, a, st.seq_len)
    ev = np.empty((x3.shape[0], plan.compressed, win.head_dim), np.float32)
    win.read(st, name, sinks, e_old, ev, 0)
    assign_tokens(x3, a, e_new, ev, e_old)
    if e_old and keep_old:
        win.move(st, name, sinks + e_old, keep_old, sinks)
    win.write(st, name, x3, a + e_new, keep_new, sinks + keep_old)
    return ev


@pytest.mark.parametrize("rotation", [None, "head", "block"])
@pytest.mark.parametrize("n, stored, n_win", [(1, 40, 12), (1, 2, 0), (5, 40, 12), (30, 40, 12), (9, 0, 0),
                                              (1, 10, 6)])
def test_window8_store_matches_the_op_by_op_path(rotation, n, stored, n_win):
    d, S, R, rows = 64, 4, 12, 3
    rng = np.random.default_rng(n * 100 + stored)
    win = ExactWindow(d, S, R, rotation)
    n_sink = min(S, stored)
    plan = plan_store(n, stored, n_win, S, R)
    states = []
    for _ in range(2):
        st = LayerState()
        st.seq_len = stored
        st.buffers = {"k_exact": np.zeros((rows, S + R, d), np.int8),
                      "k_exact_scale": np.zeros((rows, S + R, 1), np.uint16)}
        states.append(st)
    # the same old window in both (written through the op-by-op path)
    old = (rng.standard_normal((rows, S + R, d)) * 3).astype(np.float32)
    for st in states:
        win.write(st, "k", old, 0, n_sink, 0)
        win.write(st, "k", old, S, n_win, S)
    x3 = (rng.standard_normal((rows, n, d)) * 2).astype(np.float32)
    x3[0, 0, 5] = 40.0  # an outlier channel: rotation matters
    got = []
    ref = _op_by_op(win, states[0], "k", x3, plan, S)
    win.store(states[1], "k", x3, plan, S, got.append)
    ev = got[0] if got else np.empty((rows, 0, d), np.float32)
    assert ev.shape == ref.shape
    np.testing.assert_array_equal(ev.view(np.uint32), ref.view(np.uint32))
    for key in ("k_exact", "k_exact_scale"):
        np.testing.assert_array_equal(states[1].buffers[key], states[0].buffers[key])


@pytest.mark.parametrize("center", [False, True])
@pytest.mark.parametrize("n, stored, n_win", [(1, 40, 12), (1, 2, 0), (3, 40, 12), (1, 10, 6)])
def test_window8_head_step_matches_store_then_quantize(center, n, stored, n_win):
    """The fused store of a head-quantized cache (both sides, key centering, eviction into the
    compressed store, positions) equals window8_store + quantize_head_into, bit for bit."""
    from numba_kv.ops.headquant import head_codebook, head_signs, quantize_head_into
    from numba_kv.ops.window8 import window8_head_args, window8_head_step

    d, S, R, b, h = 64, 4, 12, 1, 3
    rows, cap, t0 = b * h, 64, 7
    rng = np.random.default_rng(n * 1000 + stored + center)
    win = ExactWindow(d, S, R, "head")
    n_sink = min(S, stored)
    plan = plan_store(n, stored, n_win, S, R)
    kcb, vcb = head_codebook(4, d), head_codebook(3, d)
    old = (rng.standard_normal((2, rows, S + R, d)) * 3).astype(np.float32)
    k4, v4 = (rng.standard_normal((2, b, h, n, d)) * 2).astype(np.float32)
    kmean = (rng.standard_normal((rows, 1, d)) * 0.5).astype(np.float32) if center else None

    def fresh():
        st = LayerState()
        st.seq_len = stored
        for name, side in (("k", 0), ("v", 1)):
            st.buffers[name + "_exact"] = np.zeros((rows, S + R, d), np.int8)
            st.buffers[name + "_exact_scale"] = np.zeros((rows, S + R, 1), np.uint16)
            st.buffers[name + "_codes"] = np.zeros((rows, cap, d * (4 if name == "k" else 3) // 8), np.uint8)
            st.buffers[name + "_scales"] = np.zeros((rows, cap, 1), np.uint16)
            win.write(st, name, old[side], 0, n_sink, 0)
            win.write(st, name, old[side], S, n_win, S)
        return st

    ref, got = fresh(), fresh()
    for name, x, cb in (("k", k4, kcb), ("v", v4, vcb)):
        x3 = x.reshape(rows, n, d)
        if name == "k" and center:
            x3 = np.ascontiguousarray(x3 - kmean, dtype=np.float32)
        out = []
        win.store(ref, name, x3, plan, S, out.append)
        if out:
            quantize_head_into(out[0], ref.buffers[name + "_codes"], ref.buffers[name + "_scales"], t0, cb, True)
    pos = np.full(S + R + 3, -1, np.int32)
    bufs = got.buffers
    static = window8_head_args(bufs["k_exact"], bufs["k_exact_scale"], bufs["v_exact"], bufs["v_exact_scale"],
                               win.rot_code, win.rot_signs, head_signs(d), kcb, vcb, True, bufs["k_codes"],
                               bufs["k_scales"], bufs["v_codes"], bufs["v_scales"], pos)
    n_sink2, n_win2 = n_sink + plan.sinks, plan.keep_old + plan.keep_new
    window8_head_step(k4, v4, kmean, plan, S, stored, t0, (n_sink2, 50, n_win2), static)
    for key in ref.buffers:
        np.testing.assert_array_equal(got.buffers[key], ref.buffers[key], err_msg=key)
    expect = np.concatenate([np.arange(n_sink2), 50 + np.arange(n_win2)]).astype(np.int32)
    np.testing.assert_array_equal(pos[:n_sink2 + n_win2], expect)
    assert (pos[n_sink2 + n_win2:] == -1).all()
