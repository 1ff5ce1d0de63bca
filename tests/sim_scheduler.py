"""A faster scheduler for Numba's CUDA simulator (``make test-sim``): same threads, same values.

The simulator stage is the suite's longest job, and most of its time is spent not in the
kernels' arithmetic but in three costs of numba-cuda 0.30.4's simulator, each replaced here by
an equivalent (installed by ``tests/conftest.py`` under ``NUMBA_ENABLE_CUDASIM=1``, only when
the sources it replaces and relies on are the ones written against, :data:`SOURCE_SHA256`;
otherwise it warns and the original runs, correct and slower):

1. **Every simulated thread an OS thread.**  ``BlockManager.run`` starts one OS thread per
   CUDA thread of a block and polls them in a loop; a ``syncthreads()`` waits on an event the
   poller sets once every live thread waits.  So every block barrier costs a wake-up and a GIL
   hand-over per thread (about 1.4 ms per barrier of 32 threads here), and this package's
   simulated warp primitives (``numba_kv.ops.attention.ptx``: a shuffle is an exchange through
   a block barrier) make barriers the bulk of a warp kernel's simulated time.  Here each
   simulated thread is a greenlet (the PyPI ``greenlet``: a coroutine with its own stack,
   switched in the launching thread, no GIL hand-over), run in turn until it reaches a
   barrier or returns; once every live one waits (or has returned: the original's release
   rule, threads that returned count as arrived), the next round resumes them (about
   0.09 ms per barrier of 32 threads).  ``threading.current_thread()``, through which the
   simulator's ``threadIdx``, ``blockIdx`` and ``syncthreads`` find their thread, answers
   the running simulated thread.  The one difference: threads run in a fixed order between
   barriers instead of preemptively; code whose progress needs another thread of its block
   to run without a barrier in between (a spin on memory) would hang here, and is wrong
   CUDA anyway.  A thread's exception aborts the launch with it, as before.
2. **A device-function call swaps modules.**  Each call of a device function enters
   ``swapped_cuda_module``, which — when its module is not swapped already — scans the
   module's globals for ``numba.cuda`` and swaps in the launch's fake module, then swaps it
   back on return: a scan of a whole module per call of a helper from another module.  Here
   a module is swapped at its functions' first call in a launch and restored when the launch
   ends (the simulator runs one launch at a time: ``_push_kernel_context`` asserts it).
3. **A shared array is found by its caller's line.**  ``cuda.shared.array`` keys a block's
   allocation on the calling file and line, taken from ``traceback.extract_stack``: a walk of
   the whole stack, each frame's source file checked on disk.  Here taken from the calling
   frame directly: the same file and line.

Measured on the 2-vCPU AMD EPYC (LLVM host znver3; ``docs/design/testing.md`` has the stage
times): one steady ``kv4`` decode step on simulated device arrays (three launches, 2 KV
heads, d = 64) 2.3 s → 0.7 s.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import sys
import threading
import warnings

import numpy as np

#: the numba-cuda release these replacements were written against
SOURCE_VERSION = "0.30.4"
#: sha256 of the numba-cuda 0.30.4 simulator modules whose code these replacements stand in
#: for or rely on (``BlockManager``, ``BlockThread``, ``FakeCUDAKernel``, the kernel context;
#: ``swapped_cuda_module``, ``FakeCUDAShared``, the thread lookups of ``FakeCUDAModule``)
SOURCE_SHA256 = {
    "kernel": "2202a5fb0922cb217547976ae2afcfb36917c71492f64f81fae32d149b670175",
    "kernelapi": "09d9a88aba1a12ff4594a9b00d2a47972319e96cdc830227d553f789d89d057a",
}

_real_current_thread = threading.current_thread
_running = threading.local()  # per launching OS thread: the simulated thread that runs now


def _current_thread():
    """``threading.current_thread()``: the running simulated thread inside a launch."""
    t = getattr(_running, "thread", None)
    return t if t is not None else _real_current_thread()


# --- 1. greenlets for threads ---------------------------------------------------------------
def _syncthreads(self):
    """``BlockThread.syncthreads``: back to the launch's scheduler until the round ends."""
    if self.abort:
        raise RuntimeError("abort flag set on syncthreads call")
    self._numba_kv_scheduler.switch()
    if self.abort:
        raise RuntimeError("abort flag set on syncthreads clear")


def _run_block(self, grid_point, *args):
    """``BlockManager.run``: one block's threads as greenlets, round by round (module docstring)."""
    import greenlet
    from numba.cuda.simulator import kernel as sim_kernel

    scheduler = greenlet.getcurrent()

    def target():
        self._f(*args)

    threads = []
    for block_point in sim_kernel.np.ndindex(*self._block_dim):
        t = sim_kernel.BlockThread(target, self, grid_point, block_point, self._debug)
        t._numba_kv_scheduler = scheduler  # noqa: SLF001 - our attribute on the simulator's thread
        # BlockThread.run records the kernel's exception on the thread, as in an OS thread
        t._numba_kv_greenlet = greenlet.greenlet(t.run, parent=scheduler)  # noqa: SLF001
        threads.append(t)
    outer = getattr(_running, "thread", None)
    live = threads
    try:
        while live:
            for t in live:  # a round: each live thread runs to its next barrier or its end
                _running.thread = t
                t._numba_kv_greenlet.switch()  # noqa: SLF001
                _running.thread = outer
                if t.exception:
                    for other in threads:
                        other.abort = True
                    raise t.exception[0].with_traceback(t.exception[1])
            live = [t for t in live if not t._numba_kv_greenlet.dead]  # noqa: SLF001
    finally:
        _running.thread = outer
        for t in threads:  # an aborted launch: end the threads still waiting at a barrier
            if not t._numba_kv_greenlet.dead:  # noqa: SLF001
                t._numba_kv_greenlet.throw(greenlet.GreenletExit)  # noqa: SLF001


# --- 2. device functions' modules swapped once per launch -----------------------------------
_swapped: dict = {}  # id(module globals) -> the entered swapped_cuda_module of this launch


def _kernel_call(self, *args):
    """``FakeCUDAKernel.__call__``: a device function's module swapped at its first call of the
    launch and restored when the launch returns (module docstring)."""
    from numba.cuda.simulator import kernel as sim_kernel
    from numba.cuda.simulator import kernelapi

    context = sim_kernel._kernel_context  # noqa: SLF001 - the simulator's launch in progress
    if context is not None:  # a device function called by a running kernel
        key = id(self.fn.__globals__)
        if key not in _swapped:
            swap = kernelapi.swapped_cuda_module(self.fn, context)
            swap.__enter__()
            _swapped[key] = swap
        return self.fn(*args)
    if self._device:  # a device function called from the host: as before
        return _ORIGINAL["call"](self, *args)
    try:
        return _ORIGINAL["call"](self, *args)
    finally:
        while _swapped:
            _swapped.popitem()[1].__exit__(None, None, None)


# --- 3. shared arrays keyed by the calling frame --------------------------------------------
def _shared_array(self, shape, dtype, alignment=None):
    """``FakeCUDAShared.array`` with the caller's file and line from its frame."""
    if shape == 0 or alignment is not None:  # dynamic shared memory, or the original's error
        return _ORIGINAL["shared"](self, shape, dtype, alignment)
    from numba.core import types
    from numba.np import numpy_support

    if isinstance(dtype, types.Type):
        dtype = numpy_support.as_dtype(dtype)
    frame = sys._getframe(1)
    caller = (frame.f_code.co_filename, frame.f_lineno)
    res = self._allocations.get(caller)
    if res is None:
        res = self._allocations[caller] = np.empty(shape, dtype)
    return res


_ORIGINAL: dict = {}


def install() -> bool:
    """Install the three replacements (module docstring) when the simulator's sources are the
    ones of :data:`SOURCE_SHA256` and ``greenlet`` imports; otherwise warn and leave the
    simulator as it is.  Returns whether they are installed."""
    from numba.cuda.simulator import kernel, kernelapi

    changed = [name for name, mod in (("kernel", kernel), ("kernelapi", kernelapi))
               if hashlib.sha256(inspect.getsource(mod).encode()).hexdigest() != SOURCE_SHA256[name]]
    try:
        import greenlet  # noqa: F401
    except ImportError:
        changed.append("greenlet (not installed)")
    if changed:
        warnings.warn(f"tests/sim_scheduler.py not installed ({', '.join(changed)} changed): the simulator "
                      "stage runs the original scheduler, several times slower; update SOURCE_VERSION and "
                      "SOURCE_SHA256",
                      stacklevel=1)
        return False
    if _ORIGINAL:
        return True
    _ORIGINAL.update(call=kernel.FakeCUDAKernel.__call__, shared=kernelapi.FakeCUDAShared.array,
                     run=kernel.BlockManager.run, sync=kernel.BlockThread.syncthreads,
                     current=threading.current_thread)
    _set(_current_thread, _run_block, _syncthreads, _kernel_call, _shared_array)
    return True


def _set(current, run, sync, call, shared) -> None:
    from numba.cuda.simulator import kernel, kernelapi

    threading.current_thread = current
    kernel.BlockManager.run, kernel.BlockThread.syncthreads = run, sync
    kernel.FakeCUDAKernel.__call__, kernelapi.FakeCUDAShared.array = call, shared


@contextlib.contextmanager
def original_simulator():
    """Numba's own simulator while the block runs (for the tests that compare the two)."""
    if not _ORIGINAL:
        yield
        return
    o = _ORIGINAL
    _set(o["current"], o["run"], o["sync"], o["call"], o["shared"])
    try:
        yield
    finally:
        _set(_current_thread, _run_block, _syncthreads, _kernel_call, _shared_array)
