"""``make_cache``: build any cache of the library by name.

Defined beside the cache-name grammar in :mod:`numba_kv.caches.spec` (so that
:meth:`~numba_kv.caches.spec.CacheSpec.make` needs no import cycle) and re-exported here.
"""

from __future__ import annotations

from .spec import CACHE_NAMES, make_cache

__all__ = ["CACHE_NAMES", "make_cache"]
