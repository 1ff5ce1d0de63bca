"""A cache's state as plain data: what ``cache.state_dict()`` returns and
``Cache.from_state_dict()`` takes back.

Every cache class (``DenseCache``, ``PolarQuantCache``, ``TurboQuantCache``,
``PagedKVCache``, ``MixedCache``) serializes itself through this pair; the cache file
(:mod:`numba_kv.caches.persist`) is :class:`CacheState` written as safetensors — its
``config`` and ``state`` become the JSON metadata entries of the same names and its
``tensors`` the file's tensors — so no other module needs a cache's private attributes.

``from_state_dict`` validates everything before it builds anything and raises
:class:`CacheFileError` for a state the class cannot have written (wrong counters, tensor
shapes or dtypes, malformed page tables); a :class:`TypeError` / :class:`ValueError` from the
constructor means a bad ``config``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["CacheFileError", "CacheState", "check_declared_sizes", "expect_int"]


class CacheFileError(ValueError):
    """A cache file that cannot be loaded: unreadable, truncated, corrupted (checksum), of an
    unknown format version, or not matching the expected class / configuration."""


@dataclass(frozen=True)
class CacheState:
    """One cache as plain data.

    Attributes
    ----------
    config : dict
        The constructor arguments that rebuild the cache's configuration, as JSON types
        (``cache.config_dict()``).
    state : dict
        The bookkeeping, as JSON types: per layer ``seq_len``, ``batch``, counters
        (``meta``) and live token counts (``live``) of a layered cache; page tables,
        lengths, free list and next sequence id of a paged cache; one such state per part
        of a mixed cache.
    tensors : dict of str to numpy.ndarray
        Host arrays: ``layers.<i>.<buffer>`` (the live tokens
        ``[batch·num_kv_heads, live_tokens, width]`` of every buffer of a non-empty layer),
        ``pool.<name>`` (a paged cache's whole page pool), ``parts.<p>.<name>`` (a mixed
        cache's part ``p``).
    """

    config: dict[str, Any]
    state: dict[str, Any]
    tensors: dict[str, np.ndarray]


def expect_int(where: str, value: Any, minimum: int = 0) -> int:
    """``value`` if it is an int ``>= minimum`` (JSON numbers of a state), else
    :class:`CacheFileError` naming ``where``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise CacheFileError(f"{where}: expected an int >= {minimum}, got {value!r}")
    return value


def check_declared_sizes(cfg: Any, st: Any) -> None:
    """:class:`CacheFileError` unless the layer and page counts configuration ``cfg`` declares
    match the lists state ``st`` holds; every ``from_state_dict`` calls it before the
    constructor allocates per layer and per page (a 20 kB file claiming ``num_layers=10**7``
    spent 24 s and 6 GB before its state was rejected, 10**12 raised ``MemoryError``).
    Malformed metadata is left to the rest of ``from_state_dict``."""
    if not isinstance(cfg, dict) or not isinstance(st, dict):
        return
    parts_cfg, parts_st = cfg.get("parts"), st.get("parts")
    if isinstance(parts_cfg, list) and isinstance(parts_st, list):  # a mixed cache: every part
        for pc, ps in zip(parts_cfg, parts_st):
            check_declared_sizes(pc.get("config") if isinstance(pc, dict) else None, ps)
        return
    lists = st.get("tables", st.get("layers"))
    if not isinstance(lists, list):
        return
    if cfg.get("num_layers") != len(lists):
        raise CacheFileError(f"config: num_layers={cfg.get('num_layers')!r:.40} does not match the "
                             f"{len(lists)} layers of the state")
    free = st.get("free")
    if "tables" in st and isinstance(free, list) and all(isinstance(t, dict) for t in lists):
        used = sum(len(p) for t in lists for p in t.values() if isinstance(p, list))
        if cfg.get("num_pages") != len(free) + used:
            raise CacheFileError(f"config: num_pages={cfg.get('num_pages')!r:.40} does not match the "
                                 f"{len(free) + used} pages of the page tables and free list")
