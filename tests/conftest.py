"""Test configuration: markers, skip rules, seeds.

* ``cuda`` tests run CUDA kernels: on a GPU or under ``NUMBA_ENABLE_CUDASIM=1``
  (``make test-sim``); skipped otherwise.
* ``ptx`` tests compile kernels with ``compile_ptx``; skipped under the simulator, where
  ``compile_ptx`` is a stub (hence two pytest invocations).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

SIM = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")


def _cuda_available() -> bool:
    try:
        from numba import cuda

        return bool(cuda.is_available())
    except Exception:  # noqa: BLE001
        return False


CUDA_OK = _cuda_available()


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


def to_host(a):
    from numba_kv._backend import to_host as th

    return th(a)
