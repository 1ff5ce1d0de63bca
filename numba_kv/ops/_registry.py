"""Registry of kernel twins: every CUDA kernel is listed with its CPU twin.

Tests iterate :data:`TWINS`, so a kernel registered here is automatically compiled to
PTX for every listed signature and compute capability, and its signature parity with the
CPU twin is checked (``tests/test_conventions.py``).  Simulator-vs-CPU runs are written
per op (they need op-specific inputs) and ``tests/cuda/test_sim_coverage.py`` checks that
every registered twin has one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .. import _backend, _launch
from .._jit import cpu_call

__all__ = ["F32_1D", "F32_2D", "F32_3D", "Twin", "TWINS", "U8_3D", "register"]


@dataclass(frozen=True)
class Twin:
    """One operation implemented twice.

    Attributes
    ----------
    name : str
        Operation name (``"pack_bits"``, ``"rotate32_forward"``, ...).
    cpu : dispatcher
        ``@njit(parallel=True)`` CPU twin.
    cuda : dispatcher
        ``@cuda.jit`` kernel.
    signatures : tuple of str
        Numba signatures used to compile the kernel to PTX.
    float32_only : bool
        If true the PTX must not contain ``.f64`` instructions.
    cuda_cc : tuple of ((int, int), dispatcher)
        Builds of the kernel's source for one compute capability each (other launch
        bounds): :meth:`build_for` hands them to the devices of that capability, ``cuda``
        to every other.
    """

    name: str
    cpu: Callable
    cuda: Callable
    signatures: tuple[str, ...]
    float32_only: bool = True
    module: str = field(default="")
    cuda_cc: tuple = ()

    def build_for(self, cc: tuple[int, int] | None) -> Callable:
        """The CUDA build that runs on a device of compute capability ``cc``.

        Parameters
        ----------
        cc : (int, int) or None
            ``(major, minor)`` of the device; ``None`` (the CPU, the simulator, a caller that
            does not know) gives the default build.

        Returns
        -------
        dispatcher
            The build of :attr:`cuda_cc` for ``cc``, else :attr:`cuda`.
        """
        for want, build in self.cuda_cc:
            if want == cc:
                return build
        return self.cuda

    def launch(self, device: str, n_items: int, *args: Any, work: int | None = None,
               threads: int | None = None, grid: tuple[Any, Any] | None = None,
               coop: tuple[int, int] | None = None, cc: tuple[int, int] | None = None) -> None:
        """Run the twin on ``device``: the one dispatch point of the package.

        Parameters
        ----------
        device : {"cpu", "cuda"}
            From :func:`numba_kv._backend.resolve_device` over the call's arrays.
        n_items : int
            Independent work items of the launch contract (CUDA: threads in the 1-D grid,
            one item each; ignored when ``grid`` is given).
        *args
            The kernel arguments, identical for both twins.
        work : int, optional
            Scalar operations, roughly (CPU): below the ``cpu_parallel_min_work`` knob the
            serial compilation runs (no parallel region).  Default ``n_items``.
        threads : int, optional
            CUDA threads per block for the 1-D grid (default: the ``cuda_threads`` knob).
        grid : (blocks, threads), optional
            Explicit CUDA launch geometry for cooperative kernels (tuples allowed).
        coop : (rows, width), optional
            A block-cooperative kernel's geometry as :func:`numba_kv._backend.coop_grid`
            computes it (one block per row, ``width`` work items per row); computed here,
            only for CUDA launches (a CPU decode step pays nothing for it).
        cc : (int, int), optional
            The compute capability of the device the launch goes to, when the caller knows
            it (an attention plan): the build for it runs (:meth:`build_for`).
        """
        if device == _backend.CPU:
            cpu_call(self.cpu, n_items if work is None else work, *args)
            return
        if grid is None and coop is not None:
            grid = _backend.coop_grid(coop[0], coop[1])
        if grid is None:
            if n_items <= 0:
                return
            grid = _backend.cuda_grid(n_items, threads)
        # (a repeat of an earlier launch skips Numba's argument typing and conversion)
        _launch.launch(self.build_for(cc) if self.cuda_cc else self.cuda, grid[0], grid[1], args)


TWINS: dict[str, Twin] = {}

# Numba array types of the registered signatures (C-contiguous), shared by the op modules.
F32_1D = "float32[::1]"
F32_2D = "float32[:, ::1]"
F32_3D = "float32[:, :, ::1]"
U8_3D = "uint8[:, :, ::1]"


def register(name: str, cpu: Callable, cuda: Callable, signatures, float32_only: bool = True,
             cuda_cc: dict | None = None) -> Twin:
    """Add a twin to :data:`TWINS` (names are unique); ``cuda_cc``: ``{(major, minor): build}``,
    builds of the same source for devices of one compute capability (:attr:`Twin.cuda_cc`)."""
    if name in TWINS:
        raise ValueError(f"name: twin {name!r} is already registered")
    for cc, build in (cuda_cc or {}).items():
        if build.py_func.__code__ is not cuda.py_func.__code__:
            raise ValueError(f"cuda_cc: the build for {cc} of {name!r} must compile the same source")
    t = Twin(name, cpu, cuda, tuple(signatures), float32_only, cuda.py_func.__module__,
             tuple((tuple(cc), build) for cc, build in (cuda_cc or {}).items()))
    TWINS[name] = t
    return t
