"""``numba_kv.DecodeStep`` and the layer-state split it relies on (``caches/_steady.py``),
without a device: the split of a layer's state into counters, identities and constants, and
the regime a windowed cache reports for its next step.  On device arrays in the simulator:
``tests/cuda/test_sim_decode_step.py``."""

from __future__ import annotations

import numpy as np
import pytest

from numba_kv import AttendConfig, DecodeStep, Fused, make_cache
from numba_kv.caches._layer import LayerState
from numba_kv.caches._steady import _split, _write
from numba_kv.caches._window import StorePlan

H, G, D = 2, 2, 64


def _layer() -> LayerState:
    st = LayerState(seq_len=40, capacity=64)
    st.buffers = {"k_codes": np.zeros((2, 64, 8), np.uint8)}
    st.meta.update(n_comp=30, n_sink=2, n_win=8)
    st.live.update(k_codes=30, k_exact=10)
    st.scratch.update(exact_pos_of=(2, 32, 8), count=[np.zeros(2, np.int32), 30, "view"], plain=7,
                      step=object())
    return st


def test_split_reads_every_counter_and_write_puts_them_back():
    st = _layer()
    layout, values, idents = _split(st)
    assert values == (40, 30, 2, 8, 30, 10, 2, 32, 8, 30, 7)  # seq_len, meta, live, tuple, list int, scratch int
    held = {id(x) for x in idents}
    assert idents[0] is st.buffers and idents[1] is st.scratch and id(st.scratch["step"]) in held
    assert {id(st.scratch["count"]), id(st.scratch["count"][0]), id("view")} <= held  # a list, its other items
    new = tuple(v + 1 for v in values)
    count = st.scratch["count"]
    _write(st, layout, new)
    assert _split(st)[1] == new
    assert (st.seq_len, st.meta["n_comp"], st.live["k_exact"], st.scratch["exact_pos_of"]) == (41, 31, 11, (3, 33, 9))
    assert st.scratch["count"] is count and count[1] == 31 and st.scratch["plain"] == 8  # the list stays, in place


def _cache(**kw):
    return make_cache("pqo3", num_layers=1, num_kv_heads=H, head_dim=D, window_dtype="float32", **kw)


def test_marks_compare_counters_identities_and_constants():
    cache = _cache()
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, H, 40, D)).astype(np.float32)
    cache.prefill(0, x, x)
    a = cache._steady_mark(0, 1)
    b = cache._steady_mark(0, 1)
    assert a.same(b) and b.delta(a) == (0,) * len(a.values)
    st = cache._layers[0]
    st.seq_len += 2
    c = cache._steady_mark(0, 1)
    assert not c.same(a) and c.delta(a)[0] == 2 and set(c.delta(a)[1:]) == {0}
    assert a.advanced(c.delta(a)).values == c.values
    assert c.differences(a) == ["(0, None): 42 (other: 40)"]  # seq_len, named by where it lives
    st.buffers = dict(st.buffers)  # an equal dict, another object: the launches would take other arrays
    d = cache._steady_mark(0, 1)
    assert d.delta(c) is None and not d.same(c)
    cache.check_inputs()  # (host arrays: nothing deferred) no change
    st.capacity += 1
    assert cache._steady_mark(0, 1).delta(d) is None  # a constant changed


def test_windowed_regime_is_the_store_plan_of_a_full_window():
    cache = _cache(residual_length=8, sink_tokens=2)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((1, H, 20, D)).astype(np.float32)
    cache.prefill(0, x, x)
    st = cache._layers[0]
    assert cache._steady_regime(st, 1) is None  # host arrays: no graph to replay
    st.device = "cuda"  # (the regime's own logic, on the layer's counters)
    assert cache._steady_regime(st, 1) == StorePlan(0, 1, 0, 7, 1)  # one in, one out of the full window
    assert cache._steady_regime(st, 2) == StorePlan(0, 2, 0, 6, 2)
    meta = dict(st.meta)
    st.meta["n_win"] = 5  # a window not full yet: it grows this step
    assert cache._steady_regime(st, 1) is None
    st.meta.update(meta)
    st.meta["n_comp"] = st.capacity  # no room in the codes: they grow
    assert cache._steady_regime(st, 1) is None
    st.meta.update(meta)
    st.window = 16  # a sliding layer evicts
    assert cache._steady_regime(st, 1) is None


def test_turboquant_states_no_regime():
    """TurboQuant's step forms its key residual and projected queries with CuPy arithmetic
    between its launches: a replay of the launches alone is not its step, on any layer."""
    cache = make_cache("tq3", num_layers=1, num_kv_heads=H, head_dim=D, residual_length=8, sink_tokens=2)
    twin = _cache(residual_length=8, sink_tokens=2)
    x = np.random.default_rng(6).standard_normal((1, H, 20, D)).astype(np.float32)
    for c in (cache, twin):
        c.prefill(0, x, x)
        c._layers[0].device = "cuda"
    assert twin._steady_regime(twin._layers[0], 1) is not None  # the same counters would bind PolarQuant
    assert cache._steady_regime(cache._layers[0], 1) is None


def test_on_numpy_every_step_is_the_cache_decode():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((1, H, 30, D)).astype(np.float32)
    bound, plain = _cache(), _cache()
    for c in (bound, plain):
        c.prefill(0, x, x)
    k, v, q, out = (np.zeros(s, np.float32) for s in ((1, H, 1, D), (1, H, 1, D), (1, H * G, 1, D), (1, H * G, 1, D)))
    attend = AttendConfig(D ** -0.5, n_kv_groups=G)
    step = DecodeStep(bound, 0, k, v, q, attend, out=out)
    for _ in range(6):
        for buf in (k, v, q):
            buf[...] = rng.standard_normal(buf.shape)
        res = step()
        assert isinstance(res, Fused) and res.out is out
        np.testing.assert_array_equal(out, plain.decode(0, k, v, q, attend).out)
    assert bound.seq_len(0) == plain.seq_len(0) == 36
    st = step.stats()
    assert st["host"] == 6 and st["bound"] == 0, st


def test_bad_config_is_refused():
    x = np.zeros((1, H, 1, D), np.float32)
    with pytest.raises(TypeError, match="config: expected an AttendConfig"):
        DecodeStep(_cache(), 0, x, x, x, 0.125)


_KV = np.zeros((1, H, 1, D), np.float32)
_Q = np.zeros((1, H * G, 1, D), np.float32)


@pytest.mark.parametrize("arg, bad, err, match", [
    ("k", np.zeros((1, D), np.float32), ValueError, r"k: expected a 4-D array, got shape \(1, 64\)"),
    ("k", None, TypeError, "k: expected a numpy.ndarray or a CUDA array"),
    ("k", _KV.tolist(), TypeError, "k: expected a numpy.ndarray or a CUDA array"),
    ("v", _KV[0], ValueError, "v: expected a 4-D array"),
    ("v", _KV.astype(np.int32), TypeError, "v: expected dtype float16, float32 or float64, got int32"),
    ("q", None, TypeError, "q: expected a numpy.ndarray"),
    ("q", _Q[0, 0], ValueError, "q: expected a 4-D array"),
    ("out", _Q.tolist(), TypeError, "out: expected a numpy.ndarray"),
    ("out", _Q[0], ValueError, "out: expected a 4-D array"),
])
def test_bad_arrays_are_refused_naming_the_argument(arg, bad, err, match):
    """The constructor reads the bound arrays' shapes: a wrong one is refused as ``cache.decode``
    refuses it (an IndexError / AttributeError from inside before), and nothing is stored."""
    cache = _cache()
    args = {"k": _KV, "v": _KV.copy(), "q": _Q, "out": np.zeros_like(_Q), arg: bad}
    with pytest.raises(err, match=match):
        DecodeStep(cache, 0, args["k"], args["v"], args["q"], AttendConfig(D ** -0.5, n_kv_groups=G),
                   out=args["out"])
    assert cache.seq_len(0) == 0


def test_bad_flags_and_a_non_cache_are_refused_when_built():
    """``verify="no"`` switched verification on (``bool("no")``), and a non-cache failed only at
    the first call with an AttributeError; ``StepGraph(capture="no")`` likewise."""
    from numba_kv import StepGraph

    cache = make_cache("pqo3", num_layers=1, num_kv_heads=2, head_dim=64)
    k = np.ones((1, 2, 1, 64), np.float32)
    q = np.ones((1, 4, 1, 64), np.float32)
    cfg = AttendConfig(0.125, n_kv_groups=2)
    with pytest.raises(TypeError, match="^verify: expected a bool, got str 'no'$"):
        DecodeStep(cache, 0, k, k, q, cfg, verify="no")
    with pytest.raises(TypeError, match="^cache: expected a numba_kv cache"):
        DecodeStep(5, 0, k, k, q, cfg)
    with pytest.raises(TypeError, match="^capture: expected a bool, got str 'no'$"):
        StepGraph(capture="no")
    assert cache.seq_len(0) == 0
