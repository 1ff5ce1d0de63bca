"""Test configuration: markers, skip rules, seeds.

* ``cuda`` tests run CUDA kernels: on a GPU or under ``NUMBA_ENABLE_CUDASIM=1``
  (``make test-sim``); skipped otherwise.
* ``ptx`` tests compile kernels with ``compile_ptx``; skipped under the simulator, where
  ``compile_ptx`` is a stub (hence two pytest invocations).
* Under the simulator, its block scheduler, device-function calls and shared-array lookup
  are replaced by equivalents several times faster (``tests/sim_scheduler.py``).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from . import sim_scheduler

SIM = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")


def _cuda_available() -> bool:
    try:
        from numba import cuda

        return bool(cuda.is_available())
    except Exception:  # noqa: BLE001
        return False


CUDA_OK = _cuda_available()
SIM_SCHEDULER_INSTALLED = SIM and sim_scheduler.install()


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


@pytest.fixture
def float32_attention():
    """The float32 attention kernels on CUDA (the ``cuda_mma_attention`` knob off): for tests
    that compare a device cache with the CPU twin at float32 round-off, at head_dims where the
    tensor-core kernels (binary16 operands, about 1e-3 relative error) would run by default
    (64 and 128).  Those kernels are tested in ``tests/cuda/test_sim_mma*.py``, against the
    twin within their own bound, and there for the steps' budgets and bytes too.  Use as
    ``pytestmark = pytest.mark.usefixtures("float32_attention")``."""
    from numba_kv import knobs

    with knobs(cuda_mma_attention=0):
        yield


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
