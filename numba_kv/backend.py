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

from ._backend import CPU, CUDA, device_of, simulator_enabled, to_host, xp_of

__all__ = ["CPU", "CUDA", "device_of", "simulator_enabled", "to_host", "xp_of"]
