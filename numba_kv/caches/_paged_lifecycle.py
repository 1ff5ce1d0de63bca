"""Lifecycle of a :class:`~numba_kv.caches.paged.PagedKVCache`: crop (rollback), fork a
sequence or the whole cache, beam-search batch selection, save.  A mixin over the paged
cache's own state (``_tables``, ``_lens``, ``_free``, ``_pools``, ``_lock``) so
``paged.py`` stays storage and kernel calls."""

from __future__ import annotations

import copy
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import _backend
from .._validate import check_int
from ._format import save_cache
from ._lifecycle import copy_array, take_rows

__all__ = ["OutOfPagesError", "PagedLifecycleMixin"]


class OutOfPagesError(RuntimeError):
    """Raised when an append needs more free pages than the pool has (nothing is appended)."""


class PagedLifecycleMixin:
    """``crop``, ``fork_sequence``, ``select_batch``, ``fork``/``deepcopy`` and ``save``."""

    # -- lifecycle ------------------------------------------------------------------------
    def _lifecycle_config(self) -> dict[str, Any]:
        """Constructor arguments (JSON types) that rebuild this cache's configuration."""
        return {"num_pages": self.num_pages, "num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads,
                "head_dim": self.head_dim, "page_size": self.page_size, "v_head_dim": self.v_head_dim,
                "storage": self.storage}

    def crop(self, seq_id: int, length: int) -> None:
        """Keep the first ``length`` tokens of ``seq_id`` in every layer (rollback).

        Pages past the kept tokens go back to the free list; kept tokens are not touched
        (O(pages freed), no copy).  ``memory_usage()`` drops by the freed pages.

        Raises
        ------
        KeyError
            Unknown ``seq_id``.
        TypeError, ValueError
            ``length`` not an int in ``[0, seq_len(layer, seq_id)]`` for every layer
            (nothing changes).
        """
        with self._lock:
            sid = self._check_seq(seq_id)
            length = check_int("length", length, minimum=0)
            limit = min(self._lens[layer][sid] for layer in range(self.num_layers))
            if length > limit:
                raise ValueError(f"length: expected an int in [0, {limit}] (the fewest tokens seq_id {sid} "
                                 f"holds in a layer), got {length}")
            keep = -(-length // self.page_size)
            self._dev_tables.clear()  # last-page lengths change (and pages may go)
            for layer in range(self.num_layers):
                table = self._tables[layer][sid]
                self._free.extend(reversed(table[keep:]))
                del table[keep:]
                self._lens[layer][sid] = length

    def fork_sequence(self, seq_id: int) -> int:
        """A new sequence holding a copy of ``seq_id``'s tokens in every layer; returns its id.

        Copies the sequence's pages (O(its bytes)); the two sequences are independent.

        Raises
        ------
        KeyError
            Unknown ``seq_id``.
        OutOfPagesError
            Fewer free pages than the sequence owns (nothing changes).
        """
        with self._lock:
            sid = self._check_seq(seq_id)
            need = sum(len(self._tables[layer][sid]) for layer in range(self.num_layers))
            if need > len(self._free):
                raise OutOfPagesError(f"fork_sequence: seq_id {sid} owns {need} pages, only {len(self._free)} "
                                      f"of {self.num_pages} are free; nothing was copied")
            new = self.allocate_sequence()
            self._dev_tables.clear()
            for layer in range(self.num_layers):
                src = self._tables[layer][sid]
                dst = [self._free.pop() for _ in src]
                if src:
                    self._copy_pages(src, dst)
                self._tables[layer][new] = dst
                self._lens[layer][new] = self._lens[layer][sid]
            return new

    def _copy_pages(self, src: list[int], dst: list[int]) -> None:
        s = np.asarray(src, np.int64)
        for pool in self._pools.values():
            pages = take_rows(pool, s)
            xp = _backend.xp_of(pool)
            if xp is not None:
                pool[xp.asarray(np.asarray(dst, np.int64))] = pages
            else:  # Numba device arrays: one page at a time
                for i, p in enumerate(dst):
                    pool[p].copy_to_device(pages[i])

    def select_batch(self, seq_ids: Sequence[int]) -> list[int]:
        """Keep the sequences ``seq_ids`` in this order (beam search) and free the others.

        The first occurrence of an id keeps it; a repeat becomes a copy
        (:meth:`fork_sequence`).  Returns the resulting ids, one per entry of ``seq_ids``.

        Raises
        ------
        KeyError, TypeError, ValueError
            Unknown or malformed ids, an empty list (nothing changes).
        OutOfPagesError
            The copies do not fit in the pool (nothing changes).
        """
        with self._lock:
            ids = [self._check_seq(s) for s in seq_ids]
            if not ids:
                raise ValueError("seq_ids: expected at least one sequence id, got none")
            keep = set(ids)
            freed = sum(len(self._tables[layer][s]) for layer in range(self.num_layers)
                        for s in self._tables[0] if s not in keep)
            seen, need = set(), 0
            for s in ids:
                if s in seen:
                    need += sum(len(self._tables[layer][s]) for layer in range(self.num_layers))
                seen.add(s)
            if need > len(self._free) + freed:
                raise OutOfPagesError(f"select_batch: the copies need {need} pages, only {len(self._free) + freed} "
                                      f"would be free; nothing changed")
            for s in list(self._tables[0]):
                if s not in keep:
                    self.free_sequence(s)
            out, seen = [], set()
            for s in ids:
                out.append(self.fork_sequence(s) if s in seen else s)
                seen.add(s)
            return out

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        cls = type(self)
        new = cls.__new__(cls)
        memo[id(self)] = new
        with self._lock:
            for key, val in self.__dict__.items():
                if key == "_lock":
                    new._lock = threading.RLock()
                elif key == "_pools":
                    new._pools = {n: copy_array(a) for n, a in val.items()}
                elif key in ("_dev_tables", "_row_scratch"):  # device bookkeeping of this cache
                    setattr(new, key, {} if key == "_dev_tables" else None)
                elif key in ("_tables", "_lens", "_free", "_deferred"):  # _deferred: the fork's own record
                    setattr(new, key, copy.deepcopy(val, memo))
                else:  # configuration, read-only after __init__ (codebooks shared)
                    setattr(new, key, copy.copy(val) if isinstance(val, (dict, list)) else val)
        return new

    def fork(self) -> Any:
        """An independent deep copy of the whole cache (pool, page tables, sequences); same
        as ``copy.deepcopy``.  Copies the whole pool (O(pool bytes)); new lock."""
        return copy.deepcopy(self)

    def save(self, path: Any) -> None:
        """Write the cache (whole page pool, page tables, lengths, free list) to ``path``
        (safetensors; see :func:`numba_kv.load_cache`).  O(pool bytes)."""
        save_cache(self, path)
