"""What the CUDA kernels need from an SM, public: ptxas resources (registers, spills, shared
memory), the largest block that launches, theoretical occupancy, and the SASS of a kernel
with its loops — found without a GPU (nvJitLink runs ptxas in the process; ``nvdisasm``
disassembles).  ``numba-kv kernels`` reports them.

The rules (occupancy calculator, instruction classes, loop finding) are documented with the
functions: :func:`kernel_resources`, :func:`occupancy`, :func:`max_block_threads`,
:func:`kernel_sass`.
"""

from __future__ import annotations

from . import _config
from ._cuda_resources import (
    ARCHS,
    ArchLimits,
    KernelResources,
    Occupancy,
    kernel_ptx,
    kernel_resources,
    max_block_threads,
    occupancy,
)
from ._sass import CLASSES, NVDISASM_PACKAGE, KernelSass, Loop, kernel_sass

__all__ = ["ARCHS", "CLASSES", "NVDISASM_PACKAGE", "ArchLimits", "KernelResources", "KernelSass", "Loop", "Occupancy",
           "cuda_threads", "kernel_ptx", "kernel_resources", "kernel_sass", "max_block_threads", "occupancy"]


def cuda_threads() -> int:
    """Threads per block the kernels launch with (the ``cuda_threads`` knob, see
    :func:`numba_kv.knobs`)."""
    return int(_config.get("cuda_threads"))
