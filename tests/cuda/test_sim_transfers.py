"""No host round trip in a steady-state CUDA decode step.

Host↔device traffic is counted by wrapping the simulator's transfer entry points
(``cuda.to_device``, ``DeviceNDArray.copy_to_host`` / ``copy_to_device``); allocations
(``cuda.device_array``) are counted apart — they are no transfer, but a steady state
should not need many either.  A PolarQuant cache (block and whole-head rotation, sinks +
window, fused decode) is prefilled, warmed up by a few decode steps (device constants,
accumulators and scratch are created once there), then ``N`` more steps must move nothing
between host and device.  ``validate="sync"`` is the documented exception: it reads one
result back per checked argument.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from numba_kv import AttendConfig, PolarQuantCache
from numba_kv._backend import simulator_enabled, to_host

from ..conftest import runner_params, to_device

# (device vs CPU twin at float32 round-off: the float32 kernels; the tensor-core ones: test_sim_mma*.py)
pytestmark = pytest.mark.usefixtures("float32_attention")

N_STEPS = 3


@contextlib.contextmanager
def count_transfers():
    """Count host↔device transfers and device allocations made through ``numba.cuda``."""
    from numba import cuda

    counts = {"h2d": 0, "d2h": 0, "alloc": 0}
    arr_type = type(cuda.device_array(1))
    orig = {"to_device": cuda.to_device, "device_array": cuda.device_array,
            "copy_to_host": arr_type.copy_to_host, "copy_to_device": arr_type.copy_to_device}

    def counted(name, key):
        fn = orig[name]

        def wrapper(*args, **kwargs):
            counts[key] += 1
            return fn(*args, **kwargs)

        return wrapper

    cuda.to_device = counted("to_device", "h2d")
    cuda.device_array = counted("device_array", "alloc")
    arr_type.copy_to_host = counted("copy_to_host", "d2h")
    arr_type.copy_to_device = counted("copy_to_device", "h2d")
    try:
        yield counts
    finally:
        cuda.to_device, cuda.device_array = orig["to_device"], orig["device_array"]
        arr_type.copy_to_host, arr_type.copy_to_device = orig["copy_to_host"], orig["copy_to_device"]


def _steps(rng, cache, n, h=2, g=2, d=64, twin=None):
    """``n`` decode steps on device arrays (counted); the same inputs on ``twin`` (a CPU
    cache) when given.  Returns the counts and the (device, CPU) outputs."""
    cfg = AttendConfig(d ** -0.5, n_kv_groups=g)
    host = [tuple(rng.standard_normal(s).astype(np.float32) for s in ((1, h, 1, d), (1, h, 1, d), (1, h * g, 1, d)))
            for _ in range(n)]
    inputs = [tuple(to_device(a) for a in step) for step in host]
    outs = []
    with count_transfers() as counts:
        for k, v, q in inputs:
            outs.append(cache.decode(0, k, v, q, cfg).out)
    ref = [twin.decode(0, k, v, q, cfg).out for k, v, q in host] if twin is not None else []
    return counts, list(zip(outs, ref))


@pytest.mark.cuda
@pytest.mark.parametrize("rotation", ["block", "head"])
def test_steady_state_decode_moves_nothing_between_host_and_device(rotation):
    if not simulator_enabled():
        pytest.skip("counts the simulator's transfer functions")
    rng = np.random.default_rng(3)
    h, d = 2, 64
    cache, twin = (PolarQuantCache(1, h, d, bits=3, residual_length=4, sink_tokens=2, rotation=rotation,
                                   window_dtype="float32")  # Numba device arrays hold no float16
                   for _ in range(2))
    k = rng.standard_normal((1, h, 9, d)).astype(np.float32)
    cache.prefill(0, to_device(k), to_device(k))
    twin.prefill(0, k, k)
    _steps(rng, cache, 2, twin=twin)  # warm-up: device constants, accumulators, position scratch
    counts, outs = _steps(rng, cache, N_STEPS, twin=twin)
    assert counts["h2d"] == 0 and counts["d2h"] == 0, counts
    # allocations (outputs, partition scratch of the fused kernel) are no transfer: not bounded here
    cache.check_inputs()  # the deferred check: one read, nothing to report
    for dev_out, cpu_out in outs:  # the window positions written on the device are right
        np.testing.assert_allclose(to_host(dev_out), cpu_out, rtol=1e-5, atol=1e-6)


@pytest.mark.cuda
def test_sync_validation_reads_back_and_deferred_reports_later():
    if not simulator_enabled():
        pytest.skip("counts the simulator's transfer functions")
    rng = np.random.default_rng(4)
    h, d = 2, 64
    cache = PolarQuantCache(1, h, d, bits=3, residual_length=4, sink_tokens=2)
    k = to_device(rng.standard_normal((1, h, 9, d)).astype(np.float32))
    cache.prefill(0, k, k)
    _steps(rng, cache, 2)
    cache.validate = "sync"
    counts, _ = _steps(rng, cache, 1)
    assert counts["d2h"] == 3, counts  # k, v, q: one range read each
    # deferred: a NaN key is stored without a sync, and reported by check_inputs
    cache.validate = "deferred"
    cfg = AttendConfig(d ** -0.5, n_kv_groups=2)
    bad = rng.standard_normal((1, h, 1, d)).astype(np.float32)
    bad[0, 1, 0, 5] = np.nan
    one = to_device(rng.standard_normal((1, h, 1, d)).astype(np.float32))
    q = to_device(rng.standard_normal((1, h * 2, 1, d)).astype(np.float32))
    cache.decode(0, to_device(bad), one, q, cfg)
    with pytest.raises(ValueError, match="k or v: expected finite values"):
        cache.check_inputs()
    cache.check_inputs()  # reading reset the record
    big = np.full((1, h, 1, d), 3e6, np.float32)  # above the 2**21 a PolarQuant cache accepts
    cache.decode(0, to_device(big), one, q, cfg)
    with pytest.raises(ValueError, match="exceeds"):
        cache.check_inputs()
    # sync mode raises at once and leaves the cache untouched
    cache.validate = "sync"
    n = cache.seq_len(0)
    with pytest.raises(ValueError, match="k: expected finite values"):
        cache.decode(0, to_device(bad), one, q, cfg)
    assert cache.seq_len(0) == n
    with pytest.raises(ValueError, match="validate: expected one of"):
        cache.validate = "later"


def _positions(rng):
    from numba_kv.ops.positions import exact_positions_into

    for n_sink, base, n_win in ((0, 0, 0), (2, 7, 3), (0, 12, 4), (3, 3, 0)):
        n = max(n_sink + n_win, 1)
        cpu = exact_positions_into(np.full(n + 2, -1, np.int32), n_sink, base, n_win)
        dev = exact_positions_into(to_device(np.full(n + 2, -1, np.int32)), n_sink, base, n_win)
        assert np.array_equal(to_host(dev), cpu)
        if n_sink + n_win:
            expect = np.concatenate([np.arange(n_sink), base + np.arange(n_win)]).astype(np.int32)
            assert np.array_equal(cpu, expect)


def _page_rows(rng):
    from numba_kv.ops.page_index import page_run_rows_into

    for page, slot, n, hkv, ps in ((0, 0, 1, 1, 16), (5, 3, 4, 2, 8), (9, 15, 1, 4, 16), (2, 0, 16, 3, 16)):
        cpu = page_run_rows_into(np.full(hkv * n + 3, -1, np.int32), page, slot, n, hkv, ps)
        dev = page_run_rows_into(to_device(np.full(hkv * n + 3, -1, np.int32)), page, slot, n, hkv, ps)
        assert np.array_equal(to_host(dev), cpu)
        # the formula, independently: rows of a [num_pages, hkv, ps] pool, head-major
        pool = np.arange((page + 1) * hkv * ps).reshape(page + 1, hkv, ps)
        assert np.array_equal(cpu, pool[page, :, slot:slot + n].reshape(-1))


def _add_at(rng):
    from numba_kv.ops.page_index import add_at

    a = rng.integers(0, 9, 5).astype(np.int32)
    cpu, dev = add_at(a.copy(), 3, 4), add_at(to_device(a), 3, 4)
    assert np.array_equal(to_host(dev), cpu)
    assert np.array_equal(cpu, a + np.array([0, 0, 0, 4, 0], np.int32))


def _range3(rng):
    """``DeferredRange.record_many`` (three arrays a launch, ``range_stats3``) records what one
    ``record`` per array does, and what NumPy measures: per slot the largest |x| and whether
    anything was NaN/Inf; float16 next to float32, four arrays (two launches)."""
    from numba_kv.ops.finite import DeferredRange

    a = rng.standard_normal((3, 40)).astype(np.float32) * 5
    b = rng.standard_normal(7).astype(np.float32)
    b[3] = -1e7
    c = rng.standard_normal(300).astype(np.float16)
    e = np.array([1.0, np.inf, 2.0], np.float32)
    items = [("kv", a), ("kv", b), ("q", c), ("x", e)]
    many, one = DeferredRange(), DeferredRange()
    assert many.record_many([(slot, to_device(x)) for slot, x in items]) == [True] * 4
    for slot, x in items:
        assert one.record(slot, to_device(x))
    got, want = many.read(), one.read()
    assert sorted(got) == sorted(want) == ["kv", "q", "x"]
    for slot in got:
        assert (got[slot].nonfinite, got[slot].amax) == (want[slot].nonfinite, want[slot].amax)
    assert got["kv"].nonfinite == 0 and got["kv"].amax == float(np.float32(1e7))
    assert got["q"].nonfinite == 0 and got["q"].amax == float(np.abs(c).max())
    assert got["x"].nonfinite == 1
    # the kernel against its CPU twin and the formula, on the accumulators themselves
    from numba_kv import _backend
    from numba_kv.ops import TWINS

    us = [a.reshape(-1).view(np.uint32), b.view(np.uint32), c.view(np.uint16)]
    masks = [np.uint32(0x7FFFFFFF), np.uint32(0x7FFFFFFF), np.uint16(0x7FFF)]
    cpu = [np.zeros(1, np.uint64) for _ in us]
    dev = [to_device(np.zeros(1, np.uint64)) for _ in us]
    TWINS["range_stats3"].launch(_backend.CPU, 1, *(x for t in zip(us, masks, cpu) for x in t))
    TWINS["range_stats3"].launch(_backend.CUDA, 3, *(x for t in zip((to_device(u) for u in us), masks, dev) for x in t))
    want = [int((u & m).max()) for u, m in zip(us, masks)]
    assert [int(x[0]) for x in cpu] == [int(to_host(x)[0]) for x in dev] == want
    # a strided Numba device array cannot be read in place (the caller checks it at once);
    # an empty one has nothing to record
    strided = to_device(np.zeros((4, 8), np.float32))[:, ::2]
    assert many.record_many([("kv", strided), ("q", to_device(np.zeros(0, np.float32)))]) == [False, True]
    assert many.read() == {}


RUNNERS = {"exact_positions": _positions, "page_run_rows": _page_rows, "add_at": _add_at, "range_stats3": _range3}


@pytest.mark.cuda
@pytest.mark.parametrize("runner", runner_params(RUNNERS))
def test_cuda_kernel_matches_cpu_twin(runner):
    runner(np.random.default_rng(5))


# -- the paged cache ------------------------------------------------------------------------
def _paged_steps(rng, cache, twin, sids, n, h, g, d):
    """``n`` steps (append one token to every sequence, then decode attention over all of
    them) on device arrays, counted; the same on the CPU ``twin``."""
    from numba_kv.caches.paged import PagedKVCache  # noqa: F401  (the cache under test)

    host = [([(rng.standard_normal((h, 1, d)).astype(np.float32),) * 2 for _ in sids],
             rng.standard_normal((len(sids), h * g, 1, d)).astype(np.float32)) for _ in range(n)]
    inputs = [([tuple(to_device(a) for a in kv) for kv in kvs], to_device(q)) for kvs, q in host]
    outs = []
    with count_transfers() as counts:
        for kvs, q in inputs:
            for sid, (k, v) in zip(sids, kvs):
                cache.append(0, sid, k, v)
            outs.append(cache.decode_attention(0, q, sids))
    ref = []
    for kvs, q in host:
        for sid, (k, v) in zip(sids, kvs):
            twin.append(0, sid, k, v)
        ref.append(twin.decode_attention(0, q, sids))
    return counts, list(zip(outs, ref))


@pytest.mark.cuda
@pytest.mark.parametrize("storage", ["float32", "pqo3"])
def test_paged_steady_state_moves_nothing_between_host_and_device(storage):
    """Append + paged decode attention of two sequences: after a warm-up, steps within a
    page move nothing; a step that opens a page uploads the page table (and the rows of
    the new page's token) once; the outputs equal the CPU twin's at every step."""
    if not simulator_enabled():
        pytest.skip("counts the simulator's transfer functions")
    from numba_kv.caches.paged import PagedKVCache

    rng = np.random.default_rng(6)
    h, g, d, ps = 2, 2, 64, 8
    cache, twin = (PagedKVCache(16, 1, h, d, page_size=ps, storage=storage) for _ in range(2))
    sids = [cache.allocate_sequence() for _ in range(2)]
    assert [twin.allocate_sequence() for _ in range(2)] == sids
    for i, sid in enumerate(sids):  # 3 and 5 tokens: both sequences have room in their page
        k = rng.standard_normal((h, 3 + 2 * i, d)).astype(np.float32)
        cache.append(0, sid, to_device(k), to_device(k))
        twin.append(0, sid, k, k)
    _paged_steps(rng, cache, twin, sids, 1, h, g, d)  # warm-up: table upload, scratch, constants
    counts, outs = _paged_steps(rng, cache, twin, sids, 2, h, g, d)  # lengths 5/7 -> 6/8: one page each
    assert counts["h2d"] == 0 and counts["d2h"] == 0, counts
    counts, more = _paged_steps(rng, cache, twin, sids, 1, h, g, d)  # sequence 1 opens its second page
    assert counts["d2h"] == 0 and 0 < counts["h2d"] <= 4, counts  # rows of the new page's token + the table
    counts, last = _paged_steps(rng, cache, twin, sids, 1, h, g, d)
    assert counts["h2d"] == 0 and counts["d2h"] == 0, counts
    assert [cache.seq_len(0, s) for s in sids] == [8, 10]
    for dev_out, cpu_out in outs + more + last:  # the device-side table kept its lengths right
        np.testing.assert_allclose(to_host(dev_out), cpu_out, rtol=1e-5, atol=1e-6)
    cache.check_inputs()
    # crop and fork drop the cached table: the next step uploads it and still matches
    for c in (cache, twin):
        c.crop(sids[1], 6)
    fork = cache.fork_sequence(sids[0])
    assert twin.fork_sequence(sids[0]) == fork
    counts, after = _paged_steps(rng, cache, twin, sids + [fork], 1, h, g, d)
    assert counts["h2d"] > 0, counts
    np.testing.assert_allclose(to_host(after[0][0]), after[0][1], rtol=1e-5, atol=1e-6)


@pytest.mark.cuda
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the stored Inf
def test_paged_deferred_validation_reports_later_and_sync_rejects():
    if not simulator_enabled():
        pytest.skip("counts the simulator's transfer functions")
    from numba_kv.caches.paged import PagedKVCache

    rng = np.random.default_rng(7)
    h, d = 2, 64
    cache = PagedKVCache(8, 1, h, d, page_size=8, storage="pqo3")
    sid = cache.allocate_sequence()
    k = to_device(rng.standard_normal((h, 2, d)).astype(np.float32))
    cache.append(0, sid, k, k)
    one = to_device(rng.standard_normal((h, 1, d)).astype(np.float32))
    q = to_device(rng.standard_normal((1, h * 2, 1, d)).astype(np.float32))
    cache.decode_attention(0, q, [sid])
    cache.validate = "sync"
    with count_transfers() as counts:
        cache.append(0, sid, one, one)
        cache.decode_attention(0, q, [sid])
    assert counts["d2h"] == 3, counts  # k, v, q: one range read each
    cache.validate = "auto"  # = deferred for device arrays
    bad = rng.standard_normal((h, 1, d)).astype(np.float32)
    bad[1, 0, 7] = np.inf
    with count_transfers() as counts:
        cache.append(0, sid, one, to_device(bad))
    assert counts["d2h"] == 0, counts
    with pytest.raises(ValueError, match="k or v: expected finite values"):
        cache.check_inputs()
    cache.check_inputs()  # reading reset the record
    cache.decode_attention(0, to_device(np.full((1, h * 2, 1, d), 2.0 ** 70, np.float32)), [sid])
    with pytest.raises(ValueError, match="exceeds"):
        cache.check_inputs()
    cache.append(0, sid, to_device(np.full((h, 1, d), 3e6, np.float32)), one)  # beyond 2**21
    with pytest.raises(ValueError, match="exceeds 2.09715e"):
        cache.check_inputs()
    cache.validate = "sync"
    n = cache.seq_len(0, sid)
    with pytest.raises(ValueError, match="v: expected finite values"):
        cache.append(0, sid, one, to_device(bad))
    assert cache.seq_len(0, sid) == n


@pytest.mark.cuda
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the stored NaN
@pytest.mark.parametrize("kind", ["polarquant", "paged"])
def test_a_fork_keeps_its_own_deferred_record(kind):
    """Forking a cache with a pending deferred NaN: both caches report it (they both hold the
    tokens), and reading one record does not reset the other."""
    if not simulator_enabled():
        pytest.skip("device arrays")
    from numba_kv.caches.paged import PagedKVCache

    rng = np.random.default_rng(8)
    h, d = 2, 64
    bad = rng.standard_normal((1, h, 1, d)).astype(np.float32)
    bad[0, 0, 0, 3] = np.nan
    good = rng.standard_normal((1, h, 2, d)).astype(np.float32)
    if kind == "paged":
        cache = PagedKVCache(4, 1, h, d, page_size=4, storage="pqo3")
        sid = cache.allocate_sequence()
        cache.append(0, sid, to_device(good[0]), to_device(good[0]))
        cache.append(0, sid, to_device(bad[0]), to_device(good[0, :, :1]))
    else:
        cache = PolarQuantCache(1, h, d, bits=3)
        cache.prefill(0, to_device(good), to_device(good))
        cache.prefill(0, to_device(bad), to_device(good[:, :, :1]))
    assert cache.validate == "auto"  # deferred for device arrays: nothing raised yet
    fork = cache.fork()
    for c in (cache, fork):
        with pytest.raises(ValueError, match="k or v: expected finite values"):
            c.check_inputs()
        c.check_inputs()  # each record was reset by its own read only
