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


@pytest.mark.parametrize("code", ["scalar", "vq", "vq-scalar", "scalar-vq"])  # both sides, or keys-values
@pytest.mark.parametrize("norm8", [False, True])
@pytest.mark.parametrize("center", [False, True])
@pytest.mark.parametrize("n, stored, n_win", [(1, 40, 12), (1, 2, 0), (3, 40, 12), (1, 10, 6)])
def test_window8_head_step_matches_store_then_quantize(center, n, stored, n_win, code, norm8):
    """The fused store of a head-quantized cache (both sides, key centering, eviction into the
    compressed store, positions) equals window8_store + quantize_head_into (or
    quantize_headvq_into, per side; with 8-bit norms, into scratch + norm8_store_into), bit for
    bit: ``window8_head_args`` for the scalar code with binary16 norms, ``window8_codes_args``
    for every other case."""
    from numba_kv.ops.headquant import head_codebook, head_signs, quantize_head_into
    from numba_kv.ops.headvq import headvq_centroids, quantize_headvq_into
    from numba_kv.ops.norm8 import norm8_store_into
    from numba_kv.ops.window8 import window8_codes_args, window8_head_args, window8_head_step

    d, S, R, b, h = 64, 4, 12, 1, 3
    rows, cap, t0 = b * h, 64, 7
    rng = np.random.default_rng(n * 1000 + stored + center)
    win = ExactWindow(d, S, R, "head")
    n_sink = min(S, stored)
    plan = plan_store(n, stored, n_win, S, R)
    kcb, vcb = head_codebook(4, d), head_codebook(3, d)
    kvq, vvq = headvq_centroids(4, d), headvq_centroids(2, d)
    kinds = dict(zip("kv", code.split("-") * (2 if "-" not in code else 1)))  # side: "scalar" or "vq"
    widths = {"k": d * 4 // 8, "v": d * (3 if kinds["v"] == "scalar" else 2) // 8}
    base16 = -40
    old = (rng.standard_normal((2, rows, S + R, d)) * 3).astype(np.float32)
    k4, v4 = (rng.standard_normal((2, b, h, n, d)) * 2).astype(np.float32)
    kmean = (rng.standard_normal((rows, 1, d)) * 0.5).astype(np.float32) if center else None

    def fresh():
        st = LayerState()
        st.seq_len = stored
        for name, side in (("k", 0), ("v", 1)):
            st.buffers[name + "_exact"] = np.zeros((rows, S + R, d), np.int8)
            st.buffers[name + "_exact_scale"] = np.zeros((rows, S + R, 1), np.uint16)
            st.buffers[name + "_codes"] = np.zeros((rows, cap, widths[name]), np.uint8)
            st.buffers[name + "_scales"] = np.zeros((rows, cap, 1), np.uint8 if norm8 else np.uint16)
            win.write(st, name, old[side], 0, n_sink, 0)
            win.write(st, name, old[side], S, n_win, S)
        return st

    ref, got = fresh(), fresh()
    for name, x, cb, cents in (("k", k4, kcb, kvq), ("v", v4, vcb, vvq)):
        x3 = x.reshape(rows, n, d)
        if name == "k" and center:
            x3 = np.ascontiguousarray(x3 - kmean, dtype=np.float32)
        out = []
        win.store(ref, name, x3, plan, S, out.append)
        if not out:
            continue
        ev, codes, scales = out[0], ref.buffers[name + "_codes"], ref.buffers[name + "_scales"]
        tc = np.zeros((rows, ev.shape[1], widths[name]), np.uint8) if norm8 else codes
        tn = np.zeros((rows, ev.shape[1], 1), np.uint16) if norm8 else scales
        if kinds[name] == "scalar":
            quantize_head_into(ev, tc, tn, 0 if norm8 else t0, cb, True)
        else:
            quantize_headvq_into(ev, tc, tn, 0 if norm8 else t0, cents, True)
        if norm8:
            norm8_store_into(tc, tn, base16, t0, codes, scales)
    pos = np.full(S + R + 3, -1, np.int32)
    bufs = got.buffers
    windows = (bufs["k_exact"], bufs["k_exact_scale"], bufs["v_exact"], bufs["v_exact_scale"], win.rot_code,
               win.rot_signs, head_signs(d))
    stores = (True, bufs["k_codes"], bufs["k_scales"], bufs["v_codes"], bufs["v_scales"], pos)
    kcode, vcode = (kcb if kinds["k"] == "scalar" else kvq), (vcb if kinds["v"] == "scalar" else vvq)
    static = (window8_head_args(*windows, kcb, vcb, *stores) if code == "scalar" and not norm8 else
              window8_codes_args(*windows, kcode, vcode, *stores, norm8))
    n_sink2, n_win2 = n_sink + plan.sinks, plan.keep_old + plan.keep_new
    window8_head_step(k4, v4, kmean, plan, S, stored, t0, (n_sink2, 50, n_win2), static, base16)
    for key in ref.buffers:
        np.testing.assert_array_equal(got.buffers[key], ref.buffers[key], err_msg=key)
    expect = np.concatenate([np.arange(n_sink2), 50 + np.arange(n_win2)]).astype(np.int32)
    np.testing.assert_array_equal(pos[:n_sink2 + n_win2], expect)
    assert (pos[n_sink2 + n_win2:] == -1).all()


def window8_state(rng, rows: int, cap: int, d: int):
    """Random int8 windows ``(codes, binary16 scales)`` of both sides (scales of finite,
    positive binary16 steps between 2**-9 and 2**-5)."""
    codes = [rng.integers(-127, 128, (rows, cap, d)).astype(np.int8) for _ in range(2)]
    steps = rng.uniform(2.0 ** -9, 2.0 ** -5, (2, rows, cap, 1)).astype(np.float16).view(np.uint16)
    return codes[0], steps[0].copy(), codes[1], steps[1].copy()


#: (n new tokens, StorePlan fields, s_at, sinks, positions): a decode step's flush (17 survivors
#: slide: a batch of ``memory.SHIFT_BATCH`` and one), new sinks into a window that is not full,
#: new tokens that skip the window
SLIDE8_CASES = ((1, (0, 1, 0, 17, 1), 0, 3, (3, 40, 18)), (3, (2, 0, 0, 0, 1), 1, 3, (3, 3, 1)),
                (4, (0, 2, 2, 1, 2), 0, 2, (2, 9, 3)))


def slide8_oracle(x, kmean, codes, steps, plan, s_at, sinks, rot, d):
    """NumPy float64 reference of one side of ``slide_windows8`` (independent of the package's
    cores): the expected evicted tokens, the expected codes/scales of the moved tokens, and
    the float64 rotations of the tokens the call quantizes (with their destinations)."""
    from numba_kv import reference
    from numba_kv.reference.polarquant import hadamard, rotate_forward, rotate_inverse

    a, e_old, e_new, keep_old, keep_new = plan
    xs = x.astype(np.float64) - (0.0 if kmean is None else kmean.astype(np.float64))
    signs = reference.head_sign_vector(d)  # the spec's signs, not the library's

    def fwd(v):
        return {0: lambda u: u, 1: lambda u: (u * signs) @ hadamard(d).T, 2: rotate_forward}[rot](v)

    def inv(v):
        return {0: lambda u: u, 1: lambda u: (u @ hadamard(d)) * signs, 2: rotate_inverse}[rot](v)

    old = codes.astype(np.float64) * steps.view(np.float16).astype(np.float64)
    back = inv(old[:, sinks:sinks + e_old]) if e_old else np.zeros((x.shape[0], 0, d))
    ev = np.concatenate([back, xs[:, a:a + e_new]], axis=1)
    moved = (codes[:, sinks + e_old:sinks + e_old + keep_old], steps[:, sinks + e_old:sinks + e_old + keep_old])
    new = [(fwd(xs[:, i]), s_at + i) for i in range(a)]
    new += [(fwd(xs[:, a + e_new + i]), sinks + keep_old + i) for i in range(keep_new)]
    return ev, moved, new


@pytest.mark.parametrize("rot", [0, 1, 2])
@pytest.mark.parametrize("case", range(len(SLIDE8_CASES)))
def test_slide_windows8_matches_a_numpy_oracle(rot, case):
    """The CPU twin of the one-launch int8 store: evicted tokens read back and rotated back
    (float64 oracle), survivors moved byte for byte, new tokens stored as absmax int8 of
    their rotation (``|q·s − y| <= s/2``, ``s`` the binary16 rounding of ``max|y|/127``),
    keys centered on the mean, positions, the count copy, nothing else touched."""
    from numba_kv.caches._window import StorePlan
    from numba_kv.ops.hadamard import SIGNS32
    from numba_kv.ops.headquant import head_signs
    from numba_kv.ops.window8 import slide_windows8

    rows, cap, d = 3, 22, 64
    n, plan, s_at, sinks, (p_sink, p_base, p_win) = SLIDE8_CASES[case]
    plan = StorePlan(*plan)
    rng = np.random.default_rng(10 * rot + case)
    xk, xv = (rng.standard_normal((2, rows, n, d)) * 2).astype(np.float32)
    xk[0, -1, 7] = 30.0  # an outlier channel: the rotation spreads it
    kmean = (rng.standard_normal((rows, 1, d)) * 0.5).astype(np.float32) if case != 1 else None
    exk, exks, exv, exvs = window8_state(rng, rows, cap, d)
    before = [a.copy() for a in (exk, exks, exv, exvs)]
    evk, evv = np.full((2, rows, plan.compressed + 1, d), -9.0, np.float32)
    pos = np.full(p_sink + p_win + 2, -1, np.int32)
    held = min(p_base, 4)  # the count the launch reads: the window's first position is relative to it
    cnt = np.array([-5, held, 3], np.int32)
    slide_windows8(xk, xv, kmean, exk, exks, exv, exvs, evk, evv, plan, s_at, sinks, rot,
                   head_signs(d) if rot == 1 else SIGNS32, pos, (p_sink, p_base - held, p_win), count=(cnt, 1, 0))
    assert cnt.tolist() == [held, held, 3]
    want_pos = np.concatenate([np.arange(p_sink), p_base + np.arange(p_win), [-1, -1]])
    np.testing.assert_array_equal(pos, want_pos)
    for x, m, (c0, s0), c, s, ev in ((xk, kmean, before[:2], exk, exks, evk), (xv, None, before[2:], exv, exvs, evv)):
        want_ev, (mc, ms), new = slide8_oracle(x, m, c0, s0, plan, s_at, sinks, rot, d)
        np.testing.assert_allclose(ev[:, :plan.compressed], want_ev, rtol=1e-5, atol=1e-5)
        assert (ev[:, plan.compressed:] == -9.0).all()
        written = np.zeros(cap, bool)
        if plan.evict_old:
            np.testing.assert_array_equal(c[:, sinks:sinks + plan.keep_old], mc)
            np.testing.assert_array_equal(s[:, sinks:sinks + plan.keep_old], ms)
            written[sinks:sinks + plan.keep_old] = True
        for y, t in new:
            step = np.abs(y).max(axis=-1, keepdims=True) / 127
            got_s = s[:, t].view(np.float16).astype(np.float64)
            np.testing.assert_allclose(got_s, step, rtol=2.0 ** -10)  # binary16 rounding of the step
            assert (np.abs(c[:, t].astype(np.float64) * got_s - y) <= got_s * (0.5 + 1e-3) + 1e-6).all()
            written[t] = True
        np.testing.assert_array_equal(c[:, ~written], c0[:, ~written])  # nothing else touched
        np.testing.assert_array_equal(s[:, ~written], s0[:, ~written])


def test_slide_windows8_rejects_bad_arguments():
    from numba_kv.caches._window import StorePlan
    from numba_kv.ops.hadamard import SIGNS32
    from numba_kv.ops.window8 import ROT_HEAD, ROT_NONE, slide_windows8

    rng = np.random.default_rng(0)
    rows, cap, d = 2, 8, 96
    x = np.zeros((rows, 1, d), np.float32)
    exk, exks, exv, exvs = window8_state(rng, rows, cap, d)
    ev = np.zeros((rows, 1, d), np.float32)
    pos = np.zeros(8, np.int32)
    args = (exk, exks, exv, exvs, ev, ev)
    ok = StorePlan(0, 1, 0, 3, 1)
    with pytest.raises(ValueError, match="plan: token ranges out of bounds"):
        slide_windows8(x, x, None, *args, StorePlan(0, 1, 0, 7, 1), 0, 2, ROT_NONE, SIGNS32, pos, (0, 0, 1))
    with pytest.raises(ValueError, match="rot: expected .* d = 96"):
        slide_windows8(x, x, None, *args, ok, 0, 2, ROT_HEAD, SIGNS32, pos, (0, 0, 1))
    with pytest.raises(ValueError, match="exks: expected uint16"):
        slide_windows8(x, x, None, exk, exks.view(np.int16), exv, exvs, ev, ev, ok, 0, 2, ROT_NONE, SIGNS32, pos,
                       (0, 0, 1))
    with pytest.raises(ValueError, match=r"kmean: expected float32 \(2, 1, 96\)"):
        slide_windows8(x, x, np.zeros((rows, 1, 64), np.float32), *args, ok, 0, 2, ROT_NONE, SIGNS32, pos, (0, 0, 1))
    with pytest.raises(ValueError, match="count: expected two different slots"):
        slide_windows8(x, x, None, *args, ok, 0, 2, ROT_NONE, SIGNS32, pos, (0, 0, 1),
                       count=(np.zeros(2, np.int32), 1, 1))
    with pytest.raises(ValueError, match="pos: expected int32 of length >= 9"):
        slide_windows8(x, x, None, *args, ok, 0, 2, ROT_NONE, SIGNS32, pos, (4, 0, 5))
    with pytest.raises(ValueError, match=r"pos_counts: expected three counts >= 0, got \(0, -1, 1\)"):
        slide_windows8(x, x, None, *args, ok, 0, 2, ROT_NONE, SIGNS32, pos, (0, -1, 1))
    np.testing.assert_array_equal(exk, window8_state(np.random.default_rng(0), rows, cap, d)[0])  # untouched
