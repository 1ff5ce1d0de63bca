"""Device-array factory of the ``tests/gpu`` tests: every test body runs once per kind of
CUDA array the library accepts.

* ``cupy``: CuPy arrays (``gpu_only``: a real GPU with CuPy installed; ``make test-gpu``);
* ``numba``: Numba device arrays (``cuda``: a real GPU, or the simulator in ``make test-sim``).

The same assertions hold for both: results stay on the device (for CuPy inputs as CuPy
arrays) and equal the CPU twin — bit for bit where the CPU twin's integer outputs (codes,
binary16 scales) are compared, within float32 round-off for floats.  So the attention runs
the float32 kernels here (every test: the ``float32_attention`` fixture); the tensor-core
kernels (binary16 operands, by default at head_dim 64 and 128) are checked against the twin
within their own bound by ``tests/cuda/test_sim_mma*.py``, on a GPU too.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from numba_kv import _backend


class DeviceArrays:
    """Move host arrays to the device as one kind of CUDA array, and check results."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        if kind == "cupy":
            self.cupy = pytest.importorskip("cupy")

    def __repr__(self) -> str:
        return f"DeviceArrays({self.kind!r})"

    def put(self, a: np.ndarray) -> Any:
        """``a`` (C-contiguous copy) on the device."""
        a = np.ascontiguousarray(a)
        if self.kind == "cupy":
            return self.cupy.asarray(a)
        from numba import cuda

        return cuda.to_device(a)

    def get(self, a: Any) -> np.ndarray:
        """Result ``a`` on the host, after checking it stayed on the device in this kind."""
        self.check(a)
        return _backend.to_host(a)

    def check(self, a: Any) -> None:
        assert _backend.device_of("result", a) == _backend.CUDA, type(a)
        if self.kind == "cupy":
            assert isinstance(a, self.cupy.ndarray), f"expected a CuPy result, got {type(a)}"
        else:
            assert not isinstance(a, np.ndarray)

    @property
    def f16_windows(self) -> bool:
        """CuPy arrays can hold float16 windows; Numba device arrays cannot (no cast)."""
        return self.kind == "cupy"


@pytest.fixture(params=[pytest.param("cupy", marks=pytest.mark.gpu_only),
                        pytest.param("numba", marks=pytest.mark.cuda)])
def dev(request) -> DeviceArrays:
    return DeviceArrays(request.param)


@pytest.fixture(autouse=True)
def _float32_kernels(float32_attention):
    """Every test here: the float32 attention kernels (the module docstring)."""
    yield
