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
from ._format import host_copy, save_cache
from ._lifecycle import copy_array, take_rows
from ._paged_streams import PageStreamOrder
from .state import CacheFileError, CacheState, check_declared_sizes, expect_int

__all__ = ["OutOfPagesError", "PagedLifecycleMixin"]


class OutOfPagesError(RuntimeError):
    """Raised when an append needs more free pages than the pool has (nothing is appended)."""


class PagedLifecycleMixin:
    """``crop``, ``fork_sequence``, ``select_batch``, ``fork``/``deepcopy`` and ``save``."""

    # -- pages ----------------------------------------------------------------------------
    def _check_seqs(self, seq_ids: Any) -> list[int]:
        """``seq_ids`` (a list, tuple or 1-D integer array of live ids) as ints, each checked
        as ``seq_ids[i]`` (the paged cache's ``_check_seq``)."""
        if isinstance(seq_ids, np.ndarray) and seq_ids.ndim == 1:
            seq_ids = seq_ids.tolist()
        if not isinstance(seq_ids, (list, tuple)):
            raise TypeError(f"seq_ids: expected a list of sequence ids, got {type(seq_ids).__name__} {seq_ids!r}")
        return [self._check_seq(s, f"seq_ids[{i}]") for i, s in enumerate(seq_ids)]

    def _take_pages(self, n: int) -> list[int]:
        """Pop ``n`` free pages for writing on this thread's launch stream (ordered after their
        release on any other stream: :class:`~._paged_streams.PageStreamOrder`)."""
        pages = [self._free.pop() for _ in range(n)]
        self._streams.taken(pages)
        return pages

    def _release_pages(self, pages: list[int]) -> None:
        """Give ``pages`` back to the free list (the next take pops them in ascending order)."""
        self._free.extend(reversed(pages))
        self._streams.released(pages, self._device not in (None, _backend.CPU))

    # -- lifecycle ------------------------------------------------------------------------
    def config_dict(self) -> dict[str, Any]:
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
                self._release_pages(table[keep:])
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
                dst = self._take_pages(len(src))
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
            ids = self._check_seqs(seq_ids)
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
        fields: dict[str, Any] = {}
        with self._lock:
            for key, val in self.__dict__.items():
                if key == "_lock":
                    fields[key] = threading.RLock()
                elif key == "_pools":
                    fields[key] = {n: copy_array(a) for n, a in val.items()}
                elif key in ("_dev_tables", "_row_scratch", "_views", "_write_scratch"):
                    # device bookkeeping and scratch of this cache: shared write buffers would let an
                    # append to the fork overwrite this cache's codes between quantize and scatter
                    fields[key] = {}
                elif key == "_streams":  # the fork's pool is its own: no release to wait for
                    fields[key] = PageStreamOrder()
                elif key in ("_tables", "_lens", "_free", "_deferred"):  # _deferred: the fork's own record
                    fields[key] = copy.deepcopy(val, memo)
                else:  # configuration, read-only after __init__ (codebooks shared)
                    fields[key] = copy.copy(val) if isinstance(val, (dict, list)) else val
        new.__dict__.update(fields)
        return new

    def fork(self) -> Any:
        """An independent deep copy of the whole cache (pool, page tables, sequences); same
        as ``copy.deepcopy``.  Copies the whole pool (O(pool bytes)); new lock."""
        return copy.deepcopy(self)

    def save(self, path: Any) -> None:
        """Write the cache (whole page pool, page tables, lengths, free list) to ``path``
        (safetensors; see :func:`numba_kv.load_cache`).  O(pool bytes)."""
        save_cache(self, path)

    # -- state (the cache file, see numba_kv.caches.persist) ---------------------------------
    def state_dict(self) -> CacheState:
        """The cache as plain data (:class:`~numba_kv.caches.state.CacheState`).

        ``config``: :meth:`config_dict`; ``state``: page tables and lengths per layer
        (sequence ids as strings), the free list and the next sequence id; ``tensors``: the
        whole page pool ``pool.<name>`` on the host (O(pool bytes); none before the first
        append).  :meth:`from_state_dict` rebuilds an equal cache on the host.
        """
        with self._lock:
            state = {"tables": [{str(s): list(p) for s, p in t.items()} for t in self._tables],
                     "lens": [{str(s): int(n) for s, n in d.items()} for d in self._lens],
                     "free": list(self._free), "next_seq": self._next_seq}
            tensors = {f"pool.{n}": host_copy(a) for n, a in self._pools.items()}
        return CacheState(self.config_dict(), state, tensors)

    @classmethod
    def from_state_dict(cls, state: CacheState) -> Any:
        """The cache :meth:`state_dict` described, on the host.

        The page tables, lengths and free list must partition the pool and the pool
        tensors match the configuration; everything is checked before the cache is built.

        Raises
        ------
        CacheFileError
            Malformed or inconsistent bookkeeping, or pool tensors of the wrong names,
            dtypes or shapes.
        TypeError, ValueError
            A bad ``config`` (from the constructor).
        """
        check_declared_sizes(state.config, state.state)
        cache = cls(**state.config)
        st, tensors = state.state, state.tensors
        try:
            # (JSON object keys are strings: the sequence ids; every value must be a JSON int, or
            # 1.5 and true would load as 1)
            tables = [{int(s): [expect_int("state: a page", p) for p in pages] for s, pages in t.items()}
                      for t in st["tables"]]
            lens = [{int(s): expect_int("state: a length", n) for s, n in d.items()} for d in st["lens"]]
            free = [expect_int("state: a free page", p) for p in st["free"]]
            next_seq = expect_int("state: next_seq", st["next_seq"])
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
            raise CacheFileError(f"state: malformed paged-cache state: {exc}") from exc
        if len(tables) != cache.num_layers or len(lens) != cache.num_layers:
            raise CacheFileError(f"state: expected {cache.num_layers} layers of page tables")
        seqs = set(tables[0])
        owned = list(free)
        for layer, (t, ln) in enumerate(zip(tables, lens)):
            if set(t) != seqs or set(ln) != seqs:
                raise CacheFileError(f"state: layer {layer} has different sequences than layer 0")
            for s, pages in t.items():
                if not 0 <= ln[s] <= len(pages) * cache.page_size or len(pages) != -(-ln[s] // cache.page_size):
                    raise CacheFileError(f"state: sequence {s} in layer {layer}: {ln[s]} tokens in {len(pages)} "
                                         "pages")
                owned.extend(pages)
        if sorted(owned) != list(range(cache.num_pages)):
            raise CacheFileError("state: page tables and free list do not partition the page pool")
        if next_seq < 0 or (seqs and (min(seqs) < 0 or next_seq <= max(seqs))):  # (ids count up from 0)
            raise CacheFileError(f"state: next_seq {next_seq} is not above the live sequence ids "
                                 f"{sorted(seqs)}, all >= 0")
        spec = cache._pool_spec()
        pools = {}
        if tensors:
            if set(tensors) != {f"pool.{n}" for n in spec}:
                raise CacheFileError(f"tensors: expected {sorted(spec)} pools, got {sorted(tensors)}")
            for n, (shape, dt) in spec.items():
                t = tensors[f"pool.{n}"]
                if t.dtype != np.dtype(dt) or t.shape != shape:
                    raise CacheFileError(f"tensors: pool.{n} is {t.dtype} {t.shape}, the configuration expects "
                                         f"{np.dtype(dt)} {shape}")
                pools[n] = np.array(t)  # writable copy
        elif len(free) != cache.num_pages:
            raise CacheFileError("tensors: pages are in use but the file holds no page pool")
        cache._pools = pools
        cache._device = "cpu" if pools else None
        cache._tables, cache._lens, cache._free, cache._next_seq = tables, lens, free, next_seq
        return cache
