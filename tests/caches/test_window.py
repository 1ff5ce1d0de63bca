"""The sinks-and-window state of PolarQuantCache (numba_kv.caches._window) on its own:
the store / crop / eviction arithmetic against a token-list model, and the buffers."""

import numpy as np
import pytest

from numba_kv import reference
from numba_kv.caches._layer import LayerState
from numba_kv.caches._window import ExactWindow, crop_counts, evict_counts, layer_counts, plan_store


def _model_store(tokens, sinks, residual, n_new, start):
    """Token-list model: sink list, compressed list, window list after storing ``n_new``."""
    s, c, w = (list(t) for t in tokens)
    new = list(range(start, start + n_new))
    while new and len(s) < sinks and not c and not w:
        s.append(new.pop(0))
    w = w + new
    evicted = w[:max(0, len(w) - residual)]
    return (s, c + evicted, w[len(evicted):]), evicted


@pytest.mark.parametrize("sinks, residual", [(0, 0), (4, 0), (0, 3), (4, 3), (1, 8)])
def test_plan_store_follows_the_token_model(sinks, residual, rng):
    tokens, pos = ([], [], []), 0
    for _ in range(30):
        n = int(rng.integers(1, 9))
        s, c, w = tokens
        if not residual and not sinks:
            break
        plan = plan_store(n, len(s) + len(c) + len(w), len(w), sinks, residual)
        tokens, evicted = _model_store(tokens, sinks, residual, n, pos)
        pos += n
        assert plan.sinks == len(tokens[0]) - len(s)
        assert plan.compressed == len(evicted)
        assert plan.evict_old == len([t for t in evicted if t in w])
        assert plan.keep_old + plan.keep_new == len(tokens[2]) <= residual
        assert plan.keep_old == len([t for t in tokens[2] if t in w])


def test_crop_and_evict_counts():
    assert crop_counts(4, 10, 20, True) == (4, 10, 6)
    assert crop_counts(4, 10, 14, True) == (4, 10, 0)
    assert crop_counts(4, 10, 5, True) == (4, 1, 0)
    assert crop_counts(4, 10, 4, True) == (4, 0, 0)
    assert crop_counts(4, 10, 3, True) == (3, 0, 0)
    assert crop_counts(0, 10, 7, False) == (0, 7, 0)
    assert evict_counts(0, 3) == (0, 3) and evict_counts(9, 3) == (3, 0) and evict_counts(2, 3) == (2, 1)


def _state(win, dtype, rows=3):
    st = LayerState()
    for n, (w, dt, cap) in win.buffer_spec(dtype).items():
        st.buffers[n] = np.zeros((rows, cap, w), dt)
    return st


@pytest.mark.parametrize("dtype", ["float32", "float16", "int8"])
def test_write_read_move_round_trip(dtype, rng):
    win = ExactWindow(32, 2, 5)
    assert win.capacity == 7
    assert sorted(win.buffer_spec(dtype)) == (["k_exact", "k_exact_scale", "v_exact", "v_exact_scale"]
                                              if dtype == "int8" else ["k_exact", "v_exact"])
    st = _state(win, dtype)
    x = rng.standard_normal((3, 7, 32)).astype(np.float32)
    win.write(st, "k", x, 0, 7, 0)
    got = np.empty_like(x)
    win.read(st, "k", 0, 7, got, 0)
    # float16: 2^-11 relative; int8: half a step of max|x|/127 per vector
    tol = {"float32": 0, "float16": 2.0 ** -11 * np.abs(x), "int8": 0.5 * np.abs(x).max(2, keepdims=True) / 127}
    assert np.all(np.abs(got - x) <= tol[dtype] * 1.0001)
    win.move(st, "k", 1, 5, 0)  # overlapping ranges
    moved = np.empty((3, 5, 32), np.float32)
    win.read(st, "k", 0, 5, moved, 0)
    assert np.array_equal(moved, got[:, 1:6])


@pytest.mark.parametrize(("d", "rotation"), [(64, "head"), (64, "block"), (96, "block")])
def test_rotated_int8_is_within_half_a_step_in_the_rotated_domain(d, rotation, rng):
    """int8 of the rotated vector: every rotated coordinate within half a step of its own
    absmax / 127 (the rotation by the NumPy oracle: whole-head Hadamard or per 32-block); read
    with ``rotated=True`` the tokens stay in that domain; on vectors with one large channel the
    error is several times below the unrotated window's."""
    x = rng.standard_normal((2, 9, d)).astype(np.float32)
    x[:, :, 5] *= 40.0  # an outlier channel, as RoPE'd keys have
    errs = {}
    for rot in (None, rotation):
        win = ExactWindow(d, 0, 9, rotation=rot)
        st = _state(win, "int8", rows=2)
        assert win.stored_rotated(st) == (rot is not None)
        win.write(st, "k", x, 0, 9, 0)
        got = np.empty_like(x)
        win.read(st, "k", 0, 9, got, 0)
        errs[rot] = float(np.linalg.norm(got - x) / np.linalg.norm(x))
        if rot is None:
            continue
        oracle = ((lambda a: reference.rotate_head_forward(a, reference.head_sign_vector(d))) if rot == "head"
                  else reference.rotate_forward)
        y, y_got = oracle(x), oracle(got)
        step = np.abs(y).max(-1, keepdims=True) / 127
        assert np.all(np.abs(y_got - y) <= 0.5 * step * (1 + 2 ** -10) + 1e-6)
        raw = np.empty_like(x)
        win.read(st, "k", 0, 9, raw, 0, rotated=True)
        np.testing.assert_allclose(raw, oracle(got), rtol=0, atol=1e-4 * np.abs(y).max())
    assert errs[rotation] < errs[None] / 3


def test_window_rotation_must_fit_the_head():
    with pytest.raises(ValueError, match="rotation"):
        ExactWindow(96, 0, 4, rotation="head")
    with pytest.raises(ValueError, match="rotation"):
        ExactWindow(64, 0, 4, rotation="yes")


def test_store_compresses_what_leaves_the_window(rng):
    win = ExactWindow(32, 2, 3)
    st = _state(win, "float32", rows=1)
    comp = []
    x = rng.standard_normal((1, 9, 32)).astype(np.float32)
    seen = 0
    for n in (1, 3, 1, 4):
        chunk = x[:, seen:seen + n]
        n_sink, n_comp, n_win = layer_counts(st)
        plan = plan_store(n, st.seq_len, n_win, 2, 3)
        win.store(st, "k", chunk, plan, 2, lambda ev: comp.append(ev.copy()))
        st.meta.update(n_sink=n_sink + plan.sinks, n_comp=n_comp + plan.compressed,
                       n_win=plan.keep_old + plan.keep_new)
        st.seq_len += n
        seen += n
    n_sink, n_comp, n_win = layer_counts(st)
    assert (n_sink, n_comp, n_win) == (2, 4, 3)
    assert np.array_equal(np.concatenate(comp, axis=1), x[:, 2:6])  # compressed in token order
    ex, n_exact = win.exact_f32(st, "k")
    assert n_exact == 5 and np.array_equal(ex[:, :2], x[:, :2]) and np.array_equal(ex[:, 2:5], x[:, 6:9])
    pos = win.positions(st, x, 2)  # the layer's reused buffer, positions at its front
    assert pos[:n_exact].tolist() == [0, 1, 6, 7, 8] and win.positions(st, x, 2) is pos
    flat = np.empty((1, 9, 32), np.float32)
    win.merge(st, "k", x[:, 2:6], flat)
    assert np.array_equal(flat, x)


class _DeviceLike:
    """A stand-in device array: ``view`` makes a new object each time (as CuPy's does)."""

    def __init__(self, data: np.ndarray) -> None:
        self.data = data

    shape = property(lambda self: self.data.shape)
    dtype = property(lambda self: self.data.dtype)
    size = property(lambda self: self.data.size)

    def view(self, dtype):
        return _DeviceLike(self.data.view(dtype))


def test_float16_window_store_takes_the_same_bit_views_every_step():
    """A float16 window (CuPy) goes to the store's launch as its uint16 bit patterns: the same
    view objects from step to step while the buffers stand (a new view per step was a new
    launch argument per step: on an H200 no `pqo3` step replayed as a CUDA graph), new ones
    when a buffer is replaced; float32 windows as they are."""
    from types import SimpleNamespace

    rng = np.random.default_rng(3)
    k, v = (_DeviceLike(rng.standard_normal((2, 8, 64)).astype(np.float16)) for _ in range(2))
    st = SimpleNamespace(buffers={"k_exact": k, "v_exact": v}, scratch={})
    w = ExactWindow(64, 0, 8)
    first, again = w.store_targets(st), w.store_targets(st)
    assert all(a is b for a, b in zip(first, again))
    for view, buf in zip(first, (k, v)):
        assert view.dtype == np.uint16
        np.testing.assert_array_equal(view.data, buf.data.view(np.uint16))
    st.buffers["k_exact"] = _DeviceLike(k.data.copy())  # a grown window: a new buffer
    grown = w.store_targets(st)
    assert grown[0] is not first[0] and grown[1] is first[1]
    f32 = {name: _DeviceLike(np.zeros((2, 8, 64), np.float32)) for name in ("k_exact", "v_exact")}
    st32 = SimpleNamespace(buffers=f32, scratch={})
    assert w.store_targets(st32) == (f32["k_exact"], f32["v_exact"])
