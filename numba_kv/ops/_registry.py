"""Registry of kernel twins: every CUDA kernel is listed with its CPU twin.

Tests iterate :data:`TWINS`, so a kernel registered here is automatically compiled to
PTX for every listed signature and compute capability, and its signature parity with the
CPU twin is checked (``tests/test_conventions.py``).  Simulator-vs-CPU runs are written
per op (they need op-specific inputs) and ``tests/cuda/test_sim_coverage.py`` checks that
every registered twin has one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Tuple

__all__ = ["Twin", "TWINS", "register"]


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
    """

    name: str
    cpu: Callable
    cuda: Callable
    signatures: Tuple[str, ...]
    float32_only: bool = True
    module: str = field(default="")


TWINS: Dict[str, Twin] = {}


def register(name: str, cpu: Callable, cuda: Callable, signatures, float32_only: bool = True) -> Twin:
    """Add a twin to :data:`TWINS` (names are unique)."""
    if name in TWINS:
        raise ValueError(f"name: twin {name!r} is already registered")
    t = Twin(name, cpu, cuda, tuple(signatures), float32_only, cuda.py_func.__module__)
    TWINS[name] = t
    return t
