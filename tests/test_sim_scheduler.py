"""``tests/sim_scheduler.py``: the simulator stage's scheduler gives what Numba's own does.

Each kernel here runs under the replacement and under Numba's original simulator
(:func:`~tests.sim_scheduler.original_simulator`), and both are checked against values
computed independently with NumPy: barriers and shared memory, threads that return before a
barrier, the ``syncthreads`` reductions, a device function of another module (its module's
``numba.cuda`` swapped for the launch and restored after), this package's simulated warp
shuffles, an exception in one thread, shared arrays told apart by their line.
"""

from __future__ import annotations

import importlib.metadata

import numpy as np
import pytest
from numba import cuda

from numba_kv._backend import simulator_enabled

from . import conftest, sim_scheduler

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not simulator_enabled(), reason="the simulator's scheduler (NUMBA_ENABLE_CUDASIM=1)")]

BLOCK = 64


@cuda.jit
def _block_sums(x, out, counts):
    """Per block: a tree sum of ``x`` through shared memory, and the three barrier votes."""
    buf = cuda.shared.array(BLOCK, np.float64)
    t = cuda.threadIdx.x
    b = cuda.blockIdx.x
    buf[t] = x[b, t]
    cuda.syncthreads()
    step = BLOCK // 2
    while step > 0:
        if t < step:
            buf[t] += buf[t + step]
        cuda.syncthreads()
        step //= 2
    positive = x[b, t] > 0
    n = cuda.syncthreads_count(positive)
    every = cuda.syncthreads_and(positive)
    some = cuda.syncthreads_or(positive)
    if t == 0:
        out[b] = buf[0]
        counts[b, 0], counts[b, 1], counts[b, 2] = n, every, some


@cuda.jit
def _early_exit(out, live):
    """Threads at or past ``live`` return at once; the others meet at three barriers, each time
    reading what their neighbour wrote before it."""
    buf = cuda.shared.array(BLOCK, np.int64)
    t = cuda.threadIdx.x
    if t >= live:
        return
    buf[t] = t
    for r in range(3):
        cuda.syncthreads()
        v = buf[(t + 1) % live]
        cuda.syncthreads()
        buf[t] = v + r
    out[t] = buf[t]


@cuda.jit
def _two_shared(out):
    a = cuda.shared.array(BLOCK, np.int32)
    b = cuda.shared.array(BLOCK, np.int32)
    t = cuda.threadIdx.x
    a[t] = t
    b[t] = -t
    cuda.syncthreads()
    out[t] = a[BLOCK - 1 - t] - b[t]


@cuda.jit
def _out_of_range(x):
    t = cuda.threadIdx.x
    cuda.syncthreads()
    x[t + 5] = 1.0  # threads 27..31 index past the end of a 32-element array


def _warp_sum_kernel():
    """A butterfly sum over each warp with this package's simulated ``shfl.sync.bfly``, and
    its block barrier (``warp_sync``): device functions of other modules."""
    from numba_kv.ops.attention import ptx, warp

    shfl = ptx.shfl_xor_f32
    sync = warp.warp_sync

    @cuda.jit
    def kernel(x, out):
        t = cuda.threadIdx.x
        v = x[cuda.blockIdx.x, t]
        m = 16
        while m > 0:
            v += shfl(v, m)
            m //= 2
        sync()
        out[cuda.blockIdx.x, t] = v

    return kernel


def _both(run):
    """``run()`` under the replacement, then under Numba's simulator: the two results."""
    new = run()
    with sim_scheduler.original_simulator():
        old = run()
    return new, old


def test_the_replacement_is_installed():
    """Installed on the numba-cuda release it was written against (another release: the stage
    warns and runs Numba's own scheduler, and this says so instead of failing CI on an upstream
    release)."""
    version = importlib.metadata.version("numba-cuda")
    if version != sim_scheduler.SOURCE_VERSION:
        pytest.skip(f"numba-cuda {version}: tests/sim_scheduler.py was written against {sim_scheduler.SOURCE_VERSION}")
    assert conftest.SIM_SCHEDULER_INSTALLED, "the simulator stage runs Numba's own scheduler (see the warning)"


def test_barriers_shared_memory_and_votes(rng):
    x = rng.standard_normal((3, BLOCK))
    x[1] = np.abs(x[1]) + 0.5  # every thread of block 1 votes yes

    def run():
        out, counts = cuda.to_device(np.zeros(3)), cuda.to_device(np.zeros((3, 3), np.int64))
        _block_sums[3, BLOCK](cuda.to_device(x), out, counts)
        return out.copy_to_host(), counts.copy_to_host()

    for out, counts in _both(run):
        np.testing.assert_allclose(out, x.sum(axis=1), rtol=1e-12)
        pos = x > 0
        np.testing.assert_array_equal(counts, np.stack([pos.sum(1), pos.all(1), pos.any(1)], axis=1))
        assert counts[1].tolist() == [BLOCK, 1, 1]


def test_threads_that_returned_count_as_arrived():
    live = 40

    def run():
        out = cuda.to_device(np.full(BLOCK, -1, np.int64))
        _early_exit[1, BLOCK](out, live)
        return out.copy_to_host()

    want = np.arange(live)
    for r in range(3):
        want = np.roll(want, -1) + r
    for got in _both(run):
        np.testing.assert_array_equal(got[:live], want)
        assert (got[live:] == -1).all()


def test_shared_arrays_on_two_lines_are_two_arrays():
    def run():
        out = cuda.to_device(np.zeros(BLOCK, np.int32))
        _two_shared[2, BLOCK](out)
        return out.copy_to_host()

    t = np.arange(BLOCK)
    for got in _both(run):
        np.testing.assert_array_equal(got, (BLOCK - 1 - t) + t)


def test_device_functions_of_other_modules_and_warp_shuffles(rng):
    from numba_kv.ops.attention import ptx, warp

    kernel = _warp_sum_kernel()
    x = rng.standard_normal((2, 64)).astype(np.float32)

    def run():
        out = cuda.to_device(np.zeros_like(x))
        kernel[2, 64](cuda.to_device(x), out)
        return out.copy_to_host()

    want = np.repeat(x.reshape(2, 2, 32).astype(np.float64).sum(-1), 32, axis=-1).reshape(2, 64)
    for got in _both(run):
        np.testing.assert_allclose(got, want, rtol=1e-5)
    # the modules' numba.cuda is swapped back after each launch
    assert warp.cuda is cuda and ptx.cuda is cuda
    assert not sim_scheduler._swapped  # noqa: SLF001


def test_an_exception_in_one_thread_aborts_the_launch():
    x = cuda.to_device(np.zeros(32))
    with pytest.raises(IndexError, match=r"tid=\[27, 0, 0\] ctaid=\[0, 0, 0\]"):
        _out_of_range[1, 32](x)
    assert not sim_scheduler._swapped  # noqa: SLF001
    # and the next launch runs as usual
    out = cuda.to_device(np.zeros(3))
    counts = cuda.to_device(np.zeros((3, 3), np.int64))
    _block_sums[3, BLOCK](cuda.to_device(np.ones((3, BLOCK))), out, counts)
    np.testing.assert_array_equal(out.copy_to_host(), [BLOCK] * 3)
