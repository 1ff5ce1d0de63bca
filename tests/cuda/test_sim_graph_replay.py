"""What a CUDA graph of a steady-state decode step would replay (issue 27, item 3, last piece).

A captured CUDA graph replays the same kernels with the same arguments, grids and block sizes
every time: device arrays by address, scalars by value.  Counted in Numba's CUDA simulator by
wrapping its kernel launch (as ``test_sim_step_budget.py`` does): for consecutive steady-state
steps of a flat cache (``pqo3``, ``kv4``, ``kv3``: the window full, one token flushed into the
compressed store per step) with the caller's fixed input and output buffers (``k``, ``v``,
``q`` and ``decode(..., out=)``: a graph user copies each step's tokens into the same input
buffers), every launch's record (kernel, grid, block, dynamic shared memory, the arguments)
is compared with the next step's.

**A ratchet.**  Identical step to step: the kernels and their
order, every grid and block size, every device array (the layer's buffers, the eviction and
position buffers, the plan's workspace and merge counters, the caller's buffers) and every
other scalar: the store's sink offset (0 when a step stores no sink) and the attention's
query position (a single query row per head is the last token and sees every stored one: no
causal rule, position 0, on a device), the attention's compressed-token count, the
quantization's write offset and the window's first position (a per-layer device step state,
int32 ``[2]``: the store's launch reads the count from slot 1, adds it to its ``pos_base``,
passed relative to it, and copies it into slot 0; the pair quantization,
``quantize_blocks_pair`` / ``quantize_head_pair``, reads its offset there, ``t0`` passed as
0, and writes the new count to slot 1, which the partition kernel reads: ``n_comp`` passed
as 0).  :data:`STEP_VARIANT`, the arguments that still change per step, is now empty for
both modes and may only stay so (``docs/guide/decode.md``, "Towards a step replayable as a
CUDA graph").
A step whose count crosses a multiple of the partition size launches the same too: the
partition kernel's grid, partition count and the plan's workspace follow the codes'
capacity, the partitions past the live count storing empty partials
(:func:`test_steps_crossing_a_partition_boundary_launch_the_same_arguments`).  Recaptured by
design, not checked here: a step that grows a buffer (new addresses, a new capacity) and the
steps that fill the window.
A paged ``pqo3`` steady step within a page launches the same too
(:func:`test_steady_paged_steps_launch_the_same_kernels_with_the_same_arguments`): the append
reads its write slot from the cached device page table's last-page length, which its launch
advances (``t0`` passed as 0; before, the slot by value, one more every step).  Recaptured: a
step that opens a page (a new table, the new page's planes).

The outputs are still the CPU twin's (``test_sim_step_budget.py``'s check).
"""

from __future__ import annotations

import contextlib
import inspect

import numpy as np
import pytest

from numba_kv import AttendConfig, make_cache
from numba_kv._backend import simulator_enabled, to_host

from ..conftest import to_device
from .test_sim_step_budget import steady_layer

# (device vs CPU twin at float32 round-off: the float32 kernels; the tensor-core ones: test_sim_mma*.py)
pytestmark = pytest.mark.usefixtures("float32_attention")

#: per mode and kernel, the arguments that still change from one steady step to the next (may only shrink)
STEP_VARIANT: dict = {"kv3": {}, "kv4": {}, "pqo3": {}}
MODES = ("kv3", "kv4", "pqo3")
WARMUP, STEPS = 2, 3


def _arg_record(a):
    """An argument as a graph would capture it: a device array by address, shape, strides and
    dtype; a scalar by type and value; a tuple item by item."""
    if isinstance(a, tuple):
        return tuple(_arg_record(x) for x in a)
    host = _simulated_memory(a)
    if host is not None:  # a device array: its address (a view of a buffer: the buffer's address)
        return ("device", host.__array_interface__["data"][0], host.shape, host.strides, host.dtype.str)
    if isinstance(a, np.ndarray) and a.ndim:  # a host array: copied by the launch (a budget failure)
        return ("host", a.ctypes.data, a.shape, a.dtype.str)
    if isinstance(a, (np.ndarray, np.generic)):
        return (np.dtype(a.dtype).str, a.item())
    return (type(a).__name__, a)


@contextlib.contextmanager
def record_launches():
    """``(kernel name, grid, block, dynamic shared memory, {argument: record})`` of every
    kernel launch from the host while the block runs, in order."""
    from numba.cuda.simulator import kernel as simk

    log: list = []
    call = simk.FakeCUDAKernel.__call__

    def launch(self, *args):
        if not (self._device or simk._kernel_context):
            names = list(inspect.signature(self.fn).parameters)
            log.append((self.fn.__name__, self.grid_dim, self.block_dim, self.dynshared_size,
                        dict(zip(names, map(_arg_record, args), strict=True))))
        return call(self, *args)

    simk.FakeCUDAKernel.__call__ = launch
    try:
        yield log
    finally:
        simk.FakeCUDAKernel.__call__ = call


def _differences(before: list, after: list) -> dict:
    """Per kernel, the arguments whose records differ between two steps' launch logs (which
    must launch the same kernels with the same geometry)."""
    assert [x[:4] for x in before] == [x[:4] for x in after], "kernels or launch geometry changed"
    diff: dict = {}
    for (name, *_, a), (_, *_, b) in zip(before, after):
        diff.setdefault(name, set()).update(key for key in a if a[key] != b[key])
    return {name: keys for name, keys in diff.items() if keys}


def _simulated_memory(a):
    """The NumPy array behind a simulated device array (``None`` for anything else)."""
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    return a._ary if isinstance(a, FakeCUDAArray) else None


def _pointer(arr) -> int:
    return _simulated_memory(arr).__array_interface__["data"][0]


def _replayed_steps(cache, twin, attend, rng, shapes: tuple, steps: int, warmup: int = WARMUP):
    """Run ``steps`` decode steps through the caller's fixed device buffers (``k``, ``v``,
    ``q`` copied in, ``out=``), each checked against the CPU twin; returns the launch logs of
    the steps after ``warmup`` and the buffers ``(dk, dv, dq, dout)``."""
    dk, dv, dq = (to_device(np.zeros(s, np.float32)) for s in shapes)
    dout = to_device(np.zeros(shapes[2], np.float32))
    logs = []
    for i in range(steps):
        host = tuple(rng.standard_normal(s).astype(np.float32) for s in shapes)
        for buf, x in zip((dk, dv, dq), host):
            buf.copy_to_device(x)
        with record_launches() as log:
            out = cache.decode(0, dk, dv, dq, attend, out=dout).out
        assert out is dout
        np.testing.assert_allclose(to_host(out), twin.decode(0, *host, attend).out, rtol=1e-5, atol=1e-6)
        if i >= warmup:
            logs.append(log)
    return logs, (dk, dv, dq, dout)


@pytest.mark.cuda
@pytest.mark.parametrize("mode", MODES)
def test_steady_steps_launch_the_same_kernels_with_the_same_arguments(mode):
    if not simulator_enabled():
        pytest.skip("records the simulator's kernel launches")
    rng = np.random.default_rng(31)
    h, g, d = 2, 2, 64
    cache, twin, attend = steady_layer(mode, rng, h, g, d)  # the window full: every step flushes a token
    shapes = ((1, h, 1, d), (1, h, 1, d), (1, h * g, 1, d))
    # the caller's fixed buffers: each step's tokens are copied into them (as into a graph's inputs)
    logs, buffers = _replayed_steps(cache, twin, attend, rng, shapes, WARMUP + STEPS)
    assert len(logs[0]) == 3, [x[0] for x in logs[0]]  # the step budget's 3 launches
    launched = {x[0] for x in logs[0]}
    for before, after in zip(logs, logs[1:]):
        diff = _differences(before, after)
        assert all(keys <= STEP_VARIANT[mode].get(name, set()) for name, keys in diff.items()), diff
        # the ratchet is tight: an argument made step-invariant is taken off STEP_VARIANT
        assert diff == {name: keys for name, keys in STEP_VARIANT[mode].items() if name in launched}, diff
    # the caller's buffers are what the kernels read and write, by address: no staging copies
    addresses = {rec[1] for *_, args in logs[-1] for rec in args.values()
                 if isinstance(rec, tuple) and rec and rec[0] == "device"}
    assert {_pointer(x) for x in buffers} <= addresses
    assert not any(rec[0] == "host" for *_, args in logs[-1] for rec in args.values()
                   if isinstance(rec, tuple) and rec and isinstance(rec[0], str))


#: the partition size of the boundary test (the simulator's 64 would take ~60 simulated steps
#: to cross a boundary) and the spare capacity its prefill leaves
PART, SPARE, CROSSING_STEPS = 8, 16, 6


@pytest.mark.cuda
@pytest.mark.parametrize("mode", MODES)
def test_steps_crossing_a_partition_boundary_launch_the_same_arguments(mode, monkeypatch):
    """The partition kernel's grid, partition count and workspace follow the codes' capacity,
    not the live count: steps whose compressed tokens cross a multiple of the partition size
    (``PART``) launch the same kernels with the same arguments (the partitions past the live
    count store empty partials, which the merge skips), with the outputs still the CPU
    twin's.  Only a step that grows the buffers re-plans (new addresses: a recapture)."""
    if not simulator_enabled():
        pytest.skip("records the simulator's kernel launches")
    from numba_kv import _config
    from numba_kv.ops.attention import plan as plan_module

    monkeypatch.setattr(plan_module, "default_partition_size", lambda *a, **k: PART)
    rng = np.random.default_rng(33)
    h, g, d = 2, 2, 64
    # a prefill that leaves SPARE tokens of capacity: the decode steps below grow nothing
    with _config.knobs(growth_fraction=0.0, growth_min_extra=SPARE):
        cache, twin, attend = steady_layer(mode, rng, h, g, d)
    st = cache._layers[0]
    buffers, n_comp0 = st.buffers, st.meta["n_comp"]
    assert st.capacity >= st.seq_len + CROSSING_STEPS
    shapes = ((1, h, 1, d), (1, h, 1, d), (1, h * g, 1, d))
    logs, _ = _replayed_steps(cache, twin, attend, rng, shapes, CROSSING_STEPS)
    assert st.buffers is buffers  # no growth in between
    # the recorded steps attend over n_comp0 + WARMUP + 1 … n_comp0 + CROSSING_STEPS
    # compressed tokens: across a partition boundary
    assert (n_comp0 + WARMUP) // PART < (n_comp0 + CROSSING_STEPS - 1) // PART
    assert len(logs[0]) == 3, [x[0] for x in logs[0]]
    for before, after in zip(logs, logs[1:]):
        assert not _differences(before, after)
    # the partitions cover the codes' capacity (then the window's exact tokens), one warp or
    # block each along the grid's y axis (the simulator's blocks are one warp)
    name, grid, *_ = logs[-1][-1]
    n_exact = st.meta["n_sink"] + st.meta["n_win"]
    assert "decode_attention" in name and grid[1] == -(-st.capacity // PART) + -(-n_exact // PART), (name, grid)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_flat_attention_reads_the_count_from_the_device(device):
    """``FlatStep.run(n_comp_dev=)``: the partition kernel (CPU twin and CUDA kernel, one core:
    ``cores._flat_row``) reads the compressed-token count from the array, ``n_comp`` passed as
    0: the same bits as the count passed by value."""
    if device == "cuda" and not simulator_enabled():
        pytest.skip("the simulator's kernels (a GPU: tests/gpu)")
    rng = np.random.default_rng(32)
    h, g, d = 2, 2, 64
    cache = make_cache("pqo3", num_layers=1, num_kv_heads=h, head_dim=d, window_dtype="float32")
    put = to_device if device == "cuda" else np.asarray
    k = rng.standard_normal((1, h, 40, d)).astype(np.float32)
    cache.prefill(0, put(k), put(k[:, :, ::-1].copy()))
    q = rng.standard_normal((1, h * g, 1, d)).astype(np.float32)
    one = rng.standard_normal((1, h, 1, d)).astype(np.float32)
    cache.decode(0, put(one), put(one), put(q), AttendConfig(d ** -0.5, n_kv_groups=g))  # binds the step
    st = cache._layers[0]
    step, n_comp = st.scratch["fused_step"].step, st.meta["n_comp"]
    n_exact = st.meta["n_sink"] + st.meta["n_win"]
    assert n_comp > 0
    q3 = put(q.reshape(h, g, d))
    outs = [to_host(step.run(q3, q3, n_comp, n_exact, st.seq_len - 1, 1, d ** -0.5, n_comp_dev=counter))
            for counter in (None, put(np.array([n_comp], np.int32)))]
    np.testing.assert_array_equal(outs[0], outs[1])


#: the paged ``pqo3`` case: its page size and the tokens its prefill stores (the recorded
#: steps' appends stay within the first page)
PAGED_PS, PAGED_T0 = 16, 3


@pytest.mark.cuda
def test_steady_paged_steps_launch_the_same_kernels_with_the_same_arguments():
    """A paged ``pqo3`` steady step (append one token within a page, then ``decode_attention``
    with ``out=``) through the caller's fixed buffers launches the same kernels with the same
    arguments step to step: the append reads its write slot from the cached device table's
    last-page length, which its launch advances; the attention reads the lengths there.
    The step that opens a page uploads a new table (a recapture, not checked here)."""
    if not simulator_enabled():
        pytest.skip("records the simulator's kernel launches")
    from numba_kv.caches.paged import PagedKVCache

    rng = np.random.default_rng(34)
    h, g, d = 2, 2, 64
    cache, twin = (PagedKVCache(4, 1, h, d, page_size=PAGED_PS, storage="pqo3") for _ in range(2))
    sid = cache.allocate_sequence()
    assert twin.allocate_sequence() == sid
    k = rng.standard_normal((h, PAGED_T0, d)).astype(np.float32)
    cache.append(0, sid, to_device(k), to_device(k[:, ::-1].copy()))
    twin.append(0, sid, k, k[:, ::-1].copy())
    shapes = ((h, 1, d), (h, 1, d), (1, h * g, 1, d))
    dk, dv, dq = (to_device(np.zeros(s, np.float32)) for s in shapes)
    dout = to_device(np.zeros(shapes[2], np.float32))
    logs = []
    for i in range(WARMUP + STEPS):
        host = tuple(rng.standard_normal(s).astype(np.float32) for s in shapes)
        for buf, x in zip((dk, dv, dq), host):
            buf.copy_to_device(x)
        with record_launches() as log:
            cache.append(0, sid, dk, dv)
            out = cache.decode_attention(0, dq, [sid], out=dout)
        assert out is dout
        twin.append(0, sid, host[0], host[1])
        np.testing.assert_allclose(to_host(out), twin.decode_attention(0, host[2], [sid]), rtol=1e-5, atol=1e-6)
        if i >= WARMUP:
            logs.append(log)
    assert cache.seq_len(0, sid) == PAGED_T0 + WARMUP + STEPS <= PAGED_PS
    assert len(logs[0]) == 3, [x[0] for x in logs[0]]  # the paged step budget's 3 launches
    for before, after in zip(logs, logs[1:]):
        assert not _differences(before, after)
    addresses = {rec[1] for *_, args in logs[-1] for rec in args.values()
                 if isinstance(rec, tuple) and rec and rec[0] == "device"}
    assert {_pointer(x) for x in (dk, dv, dq, dout)} <= addresses
    assert not any(rec[0] == "host" for *_, args in logs[-1] for rec in args.values()
                   if isinstance(rec, tuple) and rec and isinstance(rec[0], str))
