"""QA of the CUDA path of the caches and the decode step machinery, in Numba's CUDA simulator.

* A strided float32 Numba device array (a slice of a wider array, e.g. of a fused QKV
  projection) is taken like a C-contiguous one: a decode with a strided ``q`` used to store
  ``k`` and ``v`` and then raise ``TypeError`` (the cache changed by a refused call).
* ``DecodeStep`` names a bad layer when it is built (was ``IndexError: list index out of
  range`` at the first call).
* Two caches (or layers) of one shape whose partition counts differ share the attention plan:
  its workspace is now kept per partition count and launch stream, so alternating steps
  neither allocate nor change their launches' arguments (every step ran eager before, and no
  bound step ever skipped its Python), and two streams never share partials.

Expected values are the NumPy twin's (the same cache on host arrays), computed independently
of the device path.  Tiny shapes: the simulator runs every kernel in Python.
"""

from __future__ import annotations

import numpy as np
import pytest

from numba_kv import AttendConfig, DecodeStep, _config, _graph, knobs, make_cache
from numba_kv._backend import simulator_enabled, to_host

from ..conftest import to_device

pytestmark = pytest.mark.cuda

H, G, D = 1, 2, 32
ATT = AttendConfig(D ** -0.5, n_kv_groups=G)
SHAPES = ((1, H, 1, D), (1, H, 1, D), (1, H * G, 1, D))


@pytest.fixture(autouse=True)
def _simulator_only():
    if not simulator_enabled():
        pytest.skip("simulator checks (device arrays from numba.cuda.to_device)")
    yield
    _config.reset()


def _cache():
    return make_cache("pqo3", num_layers=1, num_kv_heads=H, head_dim=D, residual_length=2, sink_tokens=1,
                      window_dtype="float32")  # (Numba device arrays hold no float16 window)


def _strided(x: np.ndarray):
    """``x`` as a strided view of a device array twice as wide in the last axis."""
    wide = np.zeros((*x.shape[:-1], 2 * x.shape[-1]), np.float32)
    wide[..., 1::2] = x
    view = to_device(wide)[..., 1::2]
    assert not view.is_c_contiguous()
    return view


def test_strided_device_inputs_are_taken_like_contiguous_ones():
    rng = np.random.default_rng(81)
    k, v = (rng.standard_normal((1, H, 5, D)).astype(np.float32) for _ in range(2))
    k1, v1 = (rng.standard_normal(SHAPES[0]).astype(np.float32) for _ in range(2))
    q = rng.standard_normal(SHAPES[2]).astype(np.float32)
    twin = _cache()
    twin.prefill(0, k, v)
    want = twin.decode(0, k1, v1, q, ATT).out
    cache = _cache()
    cache.prefill(0, _strided(k), to_device(v))
    got = cache.decode(0, _strided(k1), _strided(v1), _strided(q), ATT).out
    np.testing.assert_allclose(to_host(got), want, rtol=1e-5, atol=1e-6)
    st, tw = cache._layers[0], twin._layers[0]
    assert (st.seq_len, st.meta, st.live) == (tw.seq_len, tw.meta, tw.live)
    for name, buf in st.buffers.items():
        np.testing.assert_array_equal(to_host(buf), tw.buffers[name], err_msg=name)


def test_a_device_array_of_another_dtype_is_named_and_nothing_is_stored():
    cache = _cache()
    with pytest.raises(TypeError, match=r"k: expected a float32 Numba device array .*got dtype float64"):
        cache.prefill(0, to_device(np.zeros((1, H, 3, D))), to_device(np.zeros((1, H, 3, D))))
    assert cache.seq_len(0) == 0 and cache.memory_usage() == 0


def test_an_integer_device_array_is_told_float32():
    """A Numba device array holds no other float dtype, so naming float16/float64 misleads."""
    cache = _cache()
    with pytest.raises(TypeError, match=r"k: expected a float32 Numba device array .*got dtype int32"):
        cache.prefill(0, to_device(np.zeros((1, H, 3, D), np.int32)), to_device(np.zeros((1, H, 3, D), np.int32)))
    assert cache.seq_len(0) == 0 and cache.memory_usage() == 0


@pytest.mark.parametrize("validate", ["sync", "deferred"])
@pytest.mark.parametrize("dtype", [np.float64, np.float16])
def test_a_query_of_another_dtype_is_refused_before_the_store(validate, dtype):
    """q is converted after k and v are stored: its dtype is checked with theirs, before."""
    cache = _cache()
    cache.validate = validate
    rng = np.random.default_rng(74)
    kv = to_device(rng.standard_normal((1, H, 4, D)).astype(np.float32))
    cache.prefill(0, kv, kv)
    before = cache.memory_usage()
    k, v = (to_device(rng.standard_normal(SHAPES[0]).astype(np.float32)) for _ in range(2))
    q = to_device(rng.standard_normal(SHAPES[2]).astype(dtype))
    with pytest.raises(TypeError, match=rf"q: expected a float32 Numba device array .*got dtype {np.dtype(dtype)}"):
        cache.decode(0, k, v, q, ATT)
    assert cache.seq_len(0) == 4 and cache.memory_usage() == before


@pytest.mark.parametrize("layer", [1, -1, 0.0, True])
def test_decode_step_names_a_bad_layer_when_built(layer):
    bufs = [to_device(np.zeros(s, np.float32)) for s in (*SHAPES, SHAPES[2])]
    with pytest.raises((IndexError, TypeError), match=r"layer: expected an int in \[0, 1\)"):
        DecodeStep(_cache(), layer, *bufs[:3], ATT, out=bufs[3])


def test_caches_of_one_shape_with_other_partition_counts_keep_replaying(monkeypatch):
    """Two caches whose capacities give 1 and 3 partitions (64 tokens each in the simulator)
    decode in turn through bound steps: each step after the warm-up skips its Python."""
    monkeypatch.setattr(_graph._SimGraph, "launch", lambda self, stream: None)  # (bookkeeping only)
    rng = np.random.default_rng(82)
    steps = []
    with knobs(growth_min_extra=8):
        for n in (8, 120):
            cache = _cache()
            cache.prefill(0, *(to_device(rng.standard_normal((1, H, n, D)).astype(np.float32)) for _ in range(2)))
            bufs = [to_device(np.zeros(s, np.float32)) for s in (*SHAPES, SHAPES[2])]
            steps.append(DecodeStep(cache, 0, *bufs[:3], ATT, out=bufs[3]))
        for _ in range(7):
            for step in steps:
                step()
    for step in steps:
        # the first step grows the window's store (eager), then launched, captured, replayed
        # twice (armed), then skipped: as for one cache alone
        assert step.stats()["eager"] == 1 and step.stats()["bound"] == 3, step.stats()


def test_the_plan_workspace_is_per_launch_stream():
    from numba import cuda

    import numba_kv
    from numba_kv.ops.attention.layout import CodeLayout
    from numba_kv.ops.attention.plan import attention_plan

    cache = _cache()
    like = to_device(np.zeros(1, np.float32))
    lay = cache.layouts["k"]
    assert isinstance(lay, CodeLayout)
    plan = attention_plan(like, paged=False, n_g=3, rows=2, d=D, klayout=lay, vlayout=cache.layouts["v"], v_width=16)
    ws, counter = plan.workspace(like, 2), plan.merge_counter(like)
    with numba_kv.launch_stream(cuda.stream()):
        other, other_counter = plan.workspace(like, 2), plan.merge_counter(like)
        assert plan.workspace(like, 2)[0] is other[0] and plan.merge_counter(like) is other_counter
    assert all(a is not b for a, b in zip(ws, other)) and counter is not other_counter
    assert plan.workspace(like, 2)[2] is ws[2] and plan.workspace(like, 3)[2] is not ws[2]
    assert plan.workspace(like, 2)[2] is ws[2]  # (a second count does not evict the first)
    assert to_host(other_counter).shape == (3 * 2,) and not to_host(other_counter).any()


def test_an_armed_step_on_another_launch_stream_runs_in_full(monkeypatch):
    """A bound step armed on the default stream, called inside ``launch_stream(other)``: its
    graph is not replayed there, so the step runs in full (it raised ``RuntimeError`` naming
    ``DecodeStep(verify=True)`` after storing the token), and it skips again once back."""
    from numba import cuda

    import numba_kv

    monkeypatch.setattr(_graph._SimGraph, "launch", lambda self, stream: None)  # (bookkeeping only)
    rng = np.random.default_rng(83)
    with knobs(growth_min_extra=64):
        cache = _cache()
        cache.prefill(0, *(to_device(rng.standard_normal((1, H, 8, D)).astype(np.float32)) for _ in range(2)))
        bufs = [to_device(np.zeros(s, np.float32)) for s in (*SHAPES, SHAPES[2])]
        step = DecodeStep(cache, 0, *bufs[:3], ATT, out=bufs[3])
        for _ in range(6):
            step()
        assert step._armed is not None and step.stats()["bound"] == 2, step.stats()
        n = cache.seq_len(0)
        with numba_kv.launch_stream(cuda.stream()):
            assert step().out is bufs[3]
        assert cache.seq_len(0) == n + 1 and step.stats()["bound"] == 2, step.stats()
        for _ in range(4):
            step()
        assert cache.seq_len(0) == n + 5 and step.stats()["bound"] == 4, step.stats()  # (two full, two skipped)


def test_an_out_that_overlaps_an_input_is_refused_in_the_simulator_too():
    """The overlap check reads CUDA arrays' byte spans; the simulator's arrays have none, and
    ``out=q`` (or an ``out`` that holds ``k``) was accepted there: the kernels would read their
    own output."""
    cache = _cache()
    rng = np.random.default_rng(75)
    kv = to_device(rng.standard_normal((1, H, 4, D)).astype(np.float32))
    cache.prefill(0, kv, kv)
    k, v = (to_device(rng.standard_normal(SHAPES[0]).astype(np.float32)) for _ in range(2))
    q = to_device(rng.standard_normal(SHAPES[2]).astype(np.float32))
    with pytest.raises(ValueError, match=r"out: expected an array that shares no memory with q"):
        cache.decode(0, k, v, q, ATT, out=q)
    buf = to_device(np.zeros(SHAPES[2], np.float32))
    with pytest.raises(ValueError, match=r"out: expected an array that shares no memory with k"):
        cache.decode(0, buf[:, :H], v, q, ATT, out=buf)
    assert cache.seq_len(0) == 4


@pytest.mark.parametrize("kind", ["plain", "mixed"])
def test_a_step_on_another_device_names_k_and_changes_nothing(kind):
    """A layer holding host tokens refuses device ones.  In a mixed cache the message named
    the layer's index inside its part ("layer 0" for the cache's layer 1); it names ``k``
    and "this layer" now."""
    opts = {"layer_overrides": {0: {"bits": 4}}} if kind == "mixed" else {}
    cache = make_cache("pqo3", num_layers=2, num_kv_heads=H, head_dim=D, residual_length=2, sink_tokens=1,
                       window_dtype="float32", **opts)
    rng = np.random.default_rng(75)
    kv = rng.standard_normal((1, H, 4, D)).astype(np.float32)
    cache.prefill(1, kv, kv)
    before = cache.state_dict()
    k, v, q = (to_device(rng.standard_normal(s).astype(np.float32)) for s in SHAPES)
    with pytest.raises(ValueError, match=r"^k: expected an array on cpu, where this layer stores its tokens, "
                                         r"got one on cuda"):
        cache.decode(1, k, v, q, ATT)
    after = cache.state_dict()
    assert after.state == before.state and sorted(after.tensors) == sorted(before.tensors)
    assert all(np.array_equal(after.tensors[n], t) for n, t in before.tensors.items())


def _state_equal(a, b) -> bool:
    return a.state == b.state and sorted(a.tensors) == sorted(b.tensors) and \
        all(np.array_equal(a.tensors[n], t) for n, t in b.tensors.items())


@pytest.mark.parametrize("kind", ["pqo3-float64", "dense-strided", "dense-float16-into-float32"])
def test_a_refused_device_array_leaves_a_sliding_layer_as_it_was(kind):
    """The device arrays' dtype and layout were checked only by the store, after a sliding layer
    had evicted its oldest tokens: a refused call left 2 of 5 tokens (and n_evicted = 3)."""
    if kind.startswith("pqo3"):
        cache = make_cache("pqo3", num_layers=1, num_kv_heads=H, head_dim=D, residual_length=2,
                           window_dtype="float32", sliding_window=3)
    else:
        cache = make_cache("dense", num_layers=1, num_kv_heads=H, head_dim=D, sliding_window=3)
    rng = np.random.default_rng(77)
    kv = rng.standard_normal((1, H, 5, D)).astype(np.float32)
    cache.prefill(0, to_device(kv), to_device(kv))
    before = cache.state_dict()
    one = rng.standard_normal(SHAPES[0])
    bad = {"pqo3-float64": lambda: to_device(one),
           "dense-strided": lambda: _strided(one.astype(np.float32)),
           "dense-float16-into-float32": lambda: to_device(one.astype(np.float16))}[kind]()
    q = to_device(rng.standard_normal(SHAPES[2]).astype(np.float32))
    with pytest.raises(TypeError, match="^k: "):
        cache.decode(0, bad, bad, q, ATT)
    assert _state_equal(cache.state_dict(), before) and cache.stored_len(0) == 5


def test_a_refused_call_records_nothing_for_check_inputs():
    """Deferred validation: a refused call's NaN values were still recorded, and check_inputs()
    reported tokens "stored" that were not (a paged append out of pages; a float64 device k)."""
    from numba_kv import PagedKVCache

    paged = PagedKVCache(num_pages=2, num_layers=1, num_kv_heads=1, head_dim=D, page_size=4, storage="pqo3")
    paged.validate = "deferred"
    s = paged.allocate_sequence()
    one = to_device(np.ones((1, 2, D), np.float32))
    paged.append(0, s, one, one)
    paged.check_inputs()
    nan = to_device(np.full((1, 40, D), np.nan, np.float32))
    with pytest.raises(Exception, match="nothing was appended"):
        paged.append(0, s, nan, nan)
    assert paged.seq_len(0, s) == 2
    paged.check_inputs()  # nothing stored, nothing to report
    cache = _cache()
    cache.validate = "deferred"
    kv = to_device(np.ones((1, H, 4, D), np.float32))
    cache.prefill(0, kv, kv)
    cache.check_inputs()
    k64 = to_device(np.full(SHAPES[0], np.nan))
    with pytest.raises(TypeError, match="^k: expected a float32 Numba device array"):
        cache.decode(0, k64, k64, to_device(np.ones(SHAPES[2], np.float32)), ATT)
    assert cache.seq_len(0) == 4
    cache.check_inputs()


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_a_dense_cache_of_another_dtype_returns_its_history_on_the_device(dtype):
    """float16/float64 histories of Numba device arrays came back as NumPy host arrays (a copy
    of the whole history to the host every step)."""
    rng = np.random.default_rng(78)
    dev, host = (make_cache("dense", num_layers=1, num_kv_heads=H, head_dim=D, dtype=np.dtype(dtype).name)
                 for _ in range(2))
    kv = rng.standard_normal((1, H, 4, D)).astype(dtype)
    k1 = rng.standard_normal(SHAPES[0]).astype(dtype)
    q = rng.standard_normal(SHAPES[2]).astype(np.float32)
    dev.prefill(0, to_device(kv), to_device(kv))
    host.prefill(0, kv, kv)
    got = dev.decode(0, to_device(k1), to_device(k1), to_device(q), ATT).result
    want = host.decode(0, k1, k1, q, ATT).result
    for g, w in ((got.k, want.k), (got.v, want.v)):
        assert not isinstance(g, np.ndarray) and g.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(to_host(g), w)


def test_a_grid_past_cudas_y_limit_is_refused_naming_partition_size():
    """A small ``partition_size`` on a long history asked for more than 65,535 blocks on the
    grid's y axis: a cryptic launch error (``CUDA_ERROR_INVALID_VALUE``) instead of one that
    says what to change."""
    from numba_kv._validate import MAX_GRID_YZ
    from numba_kv.ops.attention.plan import attention_plan

    cache = _cache()
    like = to_device(np.zeros(1, np.float32))
    plan = attention_plan(like, paged=False, n_g=3, rows=2, d=D, klayout=cache.layouts["k"],
                          vlayout=cache.layouts["v"], v_width=16)
    per_block = plan.grid(plan.kernel, 64)[0][1] / 64  # blocks a partition on y (1, or 1 / warps a block)
    fits = int(MAX_GRID_YZ / per_block)
    assert plan.grid(plan.kernel, fits)[0][1] <= MAX_GRID_YZ
    with pytest.raises(ValueError, match=r"^partition_size: \d+ partitions a KV row need \d+ blocks on the grid's y"):
        plan.grid(plan.kernel, fits + int(1 / per_block))
