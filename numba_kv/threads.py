"""Numba's threading layer: which one runs, and a check that it is safe for caches called
from several Python threads.  (Apart from :mod:`numba_kv.info`, which imports the package
for its version, so that the package can import this.)"""

from __future__ import annotations

import numba
import numpy as np

from .ops import finite as _finite  # noqa: F401 - registers the "range_stats" twin that threading_layer runs
from .ops._registry import TWINS

__all__ = ["check_threading_layer", "threading_layer"]


def threading_layer() -> str:
    """Name of Numba's threading layer (runs a tiny parallel function to initialize it)."""
    # call the parallel compilation directly: ``Twin.launch`` would pick the serial one for
    # this tiny input, and only a parallel region initializes the threading layer
    TWINS["range_stats"].cpu(np.zeros(2, np.uint32), np.uint32(1), np.zeros(2, np.uint64))
    try:
        return numba.threading_layer()
    except ValueError:
        return "uninitialized"


def check_threading_layer() -> str:
    """Return the threading layer; ``RuntimeError`` if it is ``workqueue``.

    ``workqueue`` aborts the process when two Python threads enter a ``parallel=True``
    region at once, which concurrent per-layer cache calls do.  Install ``tbb`` or use an
    OpenMP build, or set ``NUMBA_THREADING_LAYER=omp``.
    """
    layer = threading_layer()
    if layer == "workqueue":
        raise RuntimeError("Numba threading layer is 'workqueue', which is not thread-safe: concurrent "
                           "cache calls from several threads would abort. Set NUMBA_THREADING_LAYER=omp "
                           "(or install tbb).")
    return layer
