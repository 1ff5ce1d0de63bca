"""Array backends, public: which device an array lives on and how to bring it to the host.

The caches and ops accept NumPy arrays (CPU), CuPy arrays and Numba device arrays (CUDA).
These are the helpers the toolkit and user code need to handle whatever a cache returns
(e.g. ``to_host(cache.decode(...).result.k)``); the library's internal backend module has more.

Examples
--------
>>> import numpy as np
>>> from numba_kv.backend import CPU, device_of, to_host
>>> a = np.ones(3, np.float32)
>>> device_of("a", a) == CPU, to_host(a) is a
(True, True)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _backend
from ._backend import CPU, CUDA, device_of, simulator_enabled

__all__ = ["CPU", "CUDA", "device_of", "simulator_enabled", "to_host", "xp_of"]


def to_host(a: Any) -> np.ndarray:
    """``a`` as a NumPy array: itself for a NumPy array, a device-to-host copy for a CuPy or
    Numba device array (after the launches a :class:`numba_kv.StepGraph` step holds back).

    Raises
    ------
    TypeError
        ``a`` is not one of those arrays (a list was an ``AttributeError`` from inside).
    """
    device_of("a", a)
    return _backend.to_host(a)


def xp_of(a: Any) -> Any:
    """Array namespace of ``a``: ``numpy`` for a NumPy array, ``cupy`` for a CuPy array,
    ``None`` for a Numba device array.

    Raises
    ------
    TypeError
        ``a`` is not one of those arrays (a list gave ``None``, as if it were a device array).
    """
    device_of("a", a)
    return _backend.xp_of(a)
