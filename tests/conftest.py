"""Test configuration: markers, skip rules, seeds.

* ``cuda`` tests run CUDA kernels: on a GPU or under ``NUMBA_ENABLE_CUDASIM=1``
  (``make test-sim``); skipped otherwise.
* ``ptx`` tests compile kernels with ``compile_ptx``; skipped under the simulator, where
  ``compile_ptx`` is a stub (hence two pytest invocations).
* Under the simulator, its block scheduler polls without yielding the GIL (see
  :func:`_patch_simulator_polling`): patched here to yield, a third to a quarter of the CPU time.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import time
import warnings

import numpy as np
import pytest

SIM = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")


def _cuda_available() -> bool:
    try:
        from numba import cuda

        return bool(cuda.is_available())
    except Exception:  # noqa: BLE001
        return False


#: sha256 of the source of ``numba.cuda.simulator.kernel.BlockManager.run`` that
#: :func:`_yielding_run` copies (numba-cuda 0.30.4)
_SIM_RUN_SHA256 = "54626c6819f55d514a598517b1467ed1cc2e7c3bf1f3b9814e13ef2a4ba3541f"


def _yielding_run(self, grid_point, *args):
    """``BlockManager.run`` of numba-cuda 0.30.4, line for line, plus one ``time.sleep(0)``.

    (numba-cuda is BSD-2-Clause: Copyright (c) 2012, Anaconda, Inc.; Copyright (c) 2024,
    NVIDIA CORPORATION; all rights reserved.  This test-only copy of one method keeps that
    notice; redistribution in source form must retain it.)

    The simulator runs each CUDA thread of a block as an OS thread; this method starts them,
    then polls them in a loop to release a ``syncthreads()`` once every live thread waits in
    it.  The original loop never blocks, so it holds the GIL until the interpreter forces a
    switch (every 5 ms): a simulated thread woken from a barrier, or ready to run, waits that
    long for the GIL, block after block.  Yielding once per polling round while some thread
    still runs (``time.sleep(0)`` releases the GIL) leaves the threads, their order of
    release and every value they compute as they were; the simulator stage's tests take a
    third to a quarter of the CPU time (measured: tests/cuda/test_sim_transfers.py, three
    tests, 104 s -> 24 s of user CPU)."""
    from numba.cuda.simulator import kernel as sim_kernel

    threads = set()
    livethreads = set()
    blockedthreads = set()
    for block_point in sim_kernel.np.ndindex(*self._block_dim):

        def target():
            self._f(*args)

        t = sim_kernel.BlockThread(target, self, grid_point, block_point, self._debug)
        t.start()
        threads.add(t)
        livethreads.add(t)

    while livethreads:
        for t in livethreads:
            if t.syncthreads_blocked:
                blockedthreads.add(t)
            elif t.exception:
                for t_other in threads:
                    t_other.abort = True
                    t_other.syncthreads_blocked = False
                    t_other.syncthreads_event.set()

                raise t.exception[0].with_traceback(t.exception[1])
        if livethreads == blockedthreads:
            for t in blockedthreads:
                t.syncthreads_blocked = False
                t.syncthreads_event.set()
            blockedthreads = set()
        livethreads = set([t for t in livethreads if t.is_alive()])
        if livethreads and livethreads != blockedthreads:
            time.sleep(0)  # the one change: let the simulated threads have the GIL
    for t in threads:
        if t.exception:
            raise t.exception[0].with_traceback(t.exception[1])


def _patch_simulator_polling() -> bool:
    """Install :func:`_yielding_run` when the simulator's ``BlockManager.run`` is the one it
    copies; otherwise warn and keep the original (correct, only slower)."""
    from numba.cuda.simulator import kernel as sim_kernel

    src = inspect.getsource(sim_kernel.BlockManager.run)
    if hashlib.sha256(src.encode()).hexdigest() != _SIM_RUN_SHA256:
        warnings.warn("numba-cuda's simulator BlockManager.run changed: tests/conftest.py's yielding copy "
                      "is not installed (the simulator stage runs, several times slower); update "
                      "_yielding_run and _SIM_RUN_SHA256", stacklevel=1)
        return False
    sim_kernel.BlockManager.run = _yielding_run
    return True


CUDA_OK = _cuda_available()
SIM_POLLING_PATCHED = SIM and _patch_simulator_polling()


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="no CUDA device and simulator off (run `make test-sim`)")
    skip_ptx = pytest.mark.skip(reason="compile_ptx is unavailable under the CUDA simulator")
    skip_gpu = pytest.mark.skip(reason="needs a real GPU")
    for item in items:
        # get_closest_marker, not item.keywords: the folder tests/cuda is a keyword too
        if item.get_closest_marker("cuda") and not CUDA_OK:
            item.add_marker(skip_cuda)
        if item.get_closest_marker("ptx") and SIM:
            item.add_marker(skip_ptx)
        if item.get_closest_marker("gpu_only") and (SIM or not CUDA_OK):
            item.add_marker(skip_gpu)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def to_device(a):
    """Host array -> CUDA device array (simulator or GPU)."""
    from numba import cuda

    return cuda.to_device(np.ascontiguousarray(a))


def spy_launches(monkeypatch, *targets):
    """Record the launch grids of each ``(module, NAME)`` twin (``Twin.launch`` is wrapped, so
    the spy sees the twin wherever it is looked up: a module global or a cached attention
    plan); returns the list the grids go to, so a test can check which kernel ran."""
    from numba_kv.ops._registry import Twin

    launched = []
    watched = {getattr(module, name).name for module, name in targets}
    real_launch = Twin.launch

    def launch(self, *args, **kw):
        if self.name in watched:
            launched.append(kw["grid"])
        return real_launch(self, *args, **kw)

    monkeypatch.setattr(Twin, "launch", launch)
    return launched


def runner_params(runners):
    """``pytest.param`` per distinct runner of a ``RUNNERS`` dict (twin name -> runner): twins
    that share one runner (a kernel pair tested together, or a kernel checked through another's
    op) run it once, under an id naming them all.  Each runner gets the same seeded generator
    from the test, so a second run of it would repeat the same launches on the same data: no
    check is lost, the twin coverage (``test_every_twin_has_a_runner``) still reads the dict."""
    by_runner: dict = {}
    for name in sorted(runners):
        by_runner.setdefault(runners[name], []).append(name)
    return [pytest.param(fn, id="+".join(names)) for fn, names in by_runner.items()]


def to_host(a):
    from numba_kv._backend import to_host as th

    return th(a)
