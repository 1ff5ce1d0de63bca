"""``PagedKVCache``: a page pool shared by all layers and sequences, with per-layer block
tables (vLLM / FlashInfer paging; same role as ``PagedKVCache`` of the gllm-kernels Rust crate).

Storage (allocated on the device of the first appended array; layout ``HND`` per page)
-----------------------------------------------------------------------------------
* ``storage="float32"`` (exact): ``k_pages`` ``[num_pages, num_kv_heads, page_size, head_dim]``
  and ``v_pages`` ``[num_pages, num_kv_heads, page_size, v_head_dim]`` float32.
* ``storage="pqo2" | "pqo3" | "pqo4"``: PolarQuant-outlier block codes, byte-identical to
  :func:`numba_kv.quantize_blocks` (MaxNorm codebook, negative scales = outlier flag):
  ``k_codes`` uint8 ``[num_pages, num_kv_heads, page_size, packed_dim]`` and ``k_scales``
  uint16 (binary16 bits) ``[num_pages, num_kv_heads, page_size, head_dim // 32]``, the
  same for V.  PQO3 costs 3.5 bits per value.

A page holds ``page_size`` tokens of K *and* V for every KV head.  Page ``p`` is owned by
at most one (layer, sequence); the free list is a stack (the highest free id is handed
out first, like gllm-kernels' ``BlockManager``).  Logical token ``i`` of a sequence lives in
page ``table[i // page_size]``, slot ``i % page_size``.

Kernels address the pool through FlashInfer's CSR page table (:meth:`page_table`):
``kv_indptr`` ``[num_seqs + 1]``, ``kv_indices`` ``[kv_indptr[-1]]`` (page ids, in
order) and ``kv_last_page_len`` ``[num_seqs]`` (``1..page_size``, 0 for an empty
sequence), all int32.  A fused paged decode kernel reads ``k_codes[kv_indices[j], h, s]``
directly; no gather is needed.

``v_head_dim=0`` makes a key-only cache (the MLA latent cache stores one vector per
token, see :mod:`numba_kv.caches.mla`).

Every argument is validated before anything changes: an append that does not fit raises
:class:`OutOfPagesError` and leaves the cache as it was.  Values are checked as the
``validate`` attribute says (:class:`~numba_kv.caches._values.ValueChecks`: ``"auto"``
reads host arrays and defers the checks of CUDA arrays to :meth:`check_inputs`).  One lock
guards the whole cache (the free list is shared by every layer), so concurrent calls are
safe but serialized.

On CUDA a steady-state step (append one token into a page with room, then
:meth:`decode_attention` over the same sequences) moves nothing between host and device,
and with ``decode_attention(..., out=)`` allocates nothing and is 3 launches (issue 27): the
append of a PQO run within one page is one launch, both sides quantized straight into the
page with the deferred range records and the length update folded in
(:mod:`~numba_kv.caches._paged_write`; float32 pools: the run's rows written on the device by
:func:`~numba_kv.ops.page_index.page_run_rows_into`); the device copy of a layer's page table
is kept and its last-page length grown in place (:func:`~numba_kv.ops.page_index.add_at`, or
inside that launch); it is uploaded again only when pages change hands (a new page, crop,
fork, free).  Within a page such a step launches the same arguments every time (a CUDA
graph could replay it): the append reads its write slot from that last-page length instead
of taking it by value; the step that opens a page is a recapture point.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np

from .. import _backend
from .._validate import (
    F16_MAX,
    F32_MAX,
    check_bool,
    check_float_array,
    check_layer,
    check_magnitude,
    check_out,
    check_partition_size,
    check_real,
    check_softmax_scale,
    check_stored_f16,
)
from ..ops.attention import CodeLayout
from ..ops.attention.paged import paged_attention_rows, pool_arrays
from ..ops.blockquant import packed_dim, quantize_into, quantize_pair_into
from ..ops.codebook import get_codebook
from ..ops.finite import check_finite_stats
from ..ops.gather import to_like
from ..ops.page_index import add_at
from ._layer import check_q_values
from ._paged_lifecycle import OutOfPagesError, PagedLifecycleMixin
from ._paged_streams import PageStreamOrder
from ._paged_write import SMALL_WRITE, PagedStorageMixin
from ._values import ValueChecks
from .config import DEFAULT_PAGE_SIZE, PagedConfig
from .config import PAGED_STORAGES as STORAGES

__all__ = ["PagedKVCache", "PageTable", "OutOfPagesError", "STORAGES", "DEFAULT_PAGE_SIZE"]


class PageTable(NamedTuple):
    """FlashInfer-style CSR page table of a batch of sequences (int32 host arrays).

    Attributes
    ----------
    kv_indptr : int32, shape ``(num_seqs + 1,)``
        Sequence ``i`` owns ``kv_indices[kv_indptr[i]:kv_indptr[i + 1]]``.
    kv_indices : int32, shape ``(kv_indptr[-1],)``
        Page ids in logical order.
    kv_last_page_len : int32, shape ``(num_seqs,)``
        Valid tokens in each sequence's last page (``1..page_size``; 0 when empty).
    """

    kv_indptr: np.ndarray
    kv_indices: np.ndarray
    kv_last_page_len: np.ndarray



class PagedKVCache(PagedStorageMixin, PagedLifecycleMixin, ValueChecks):
    """Paged K/V storage shared by layers and sequences (float32 or PQO-compressed pages).

    Parameters
    ----------
    num_pages : int
        Pages in the pool (shared by every layer and sequence).
    num_layers, num_kv_heads, head_dim : int
        Model geometry.  PQO storage needs ``head_dim`` (and ``v_head_dim``) to be a
        multiple of 32.
    page_size : int
        Tokens per page (default 16).
    v_head_dim : int, optional
        Width of V (default ``head_dim``); 0 stores keys only.
    storage : {"float32", "pqo2", "pqo3", "pqo4"} or ``"pqo-k<b>v<b>"``
        Page format (see module docstring); ``"pqo-k4v3"`` stores keys with the 4-bit and
        values with the 3-bit codebook (``k_bits`` / ``v_bits``; 2–4 each).

    Raises
    ------
    ValueError
        A geometry argument out of range (the message names it).

    Examples
    --------
    >>> import numpy as np
    >>> cache = PagedKVCache(num_pages=8, num_layers=2, num_kv_heads=2, head_dim=64)
    >>> s = cache.allocate_sequence()
    >>> k = np.ones((2, 20, 64), np.float32)
    >>> cache.append(0, s, k, k)
    >>> cache.seq_len(0, s), cache.num_free_pages, cache.page_table(0, [s]).kv_last_page_len.tolist()
    (20, 6, [4])
    """

    def __init__(self, num_pages: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 page_size: int = DEFAULT_PAGE_SIZE, *, v_head_dim: int | None = None,
                 storage: str = "float32") -> None:
        # every argument is validated (and storage parsed) once, by the configuration
        cfg = self.config = PagedConfig(num_pages, num_layers, num_kv_heads, head_dim, page_size,
                                        v_head_dim=v_head_dim, storage=storage)
        self.num_pages, self.num_layers, self.num_kv_heads = cfg.num_pages, cfg.num_layers, cfg.num_kv_heads
        self.head_dim, self.page_size, self.v_head_dim = cfg.head_dim, cfg.page_size, cfg.v_head_dim
        self.storage, self.k_bits, self.v_bits = cfg.storage, cfg.k_bits, cfg.v_bits
        self.bits = self.k_bits  # 0 = float32 pages
        self.part_bits = cfg.part_bits
        if self.bits:
            self.codebooks = {n: get_codebook(b, "maxnorm") for n, b in self.part_bits.items()}
            self.codebook = self.codebooks["k"]
        else:
            self.codebooks = {}
            self.codebook = None
        # the code layouts the attention kernels read (decode_attention: K and V of one width)
        self._layouts: tuple[CodeLayout, CodeLayout] | None = None
        if self.bits and self.v_head_dim == self.head_dim:
            self._layouts = (CodeLayout.uniform(self.codebooks["k"], self.head_dim),
                             CodeLayout.uniform(self.codebooks["v"], self.head_dim))
        self._lock = threading.RLock()
        self._pools: dict[str, Any] = {}
        self._device: str | None = None
        self._free: list[int] = list(range(self.num_pages))  # stack: pop() → highest id
        self._streams = PageStreamOrder()  # page reuse across launch streams (_paged_streams)
        self._tables: list[dict[int, list[int]]] = [dict() for _ in range(self.num_layers)]
        self._lens: list[dict[int, int]] = [dict() for _ in range(self.num_layers)]
        self._next_seq = 0
        # per layer: (sequence ids, page table on the pool's device) of the last decode_attention
        self._dev_tables: dict[int, tuple[tuple[int, ...], PageTable]] = {}
        self._row_scratch: dict[int, Any] = {}  # per launch stream: int32 pool rows of a one-page run
        self._views: dict = {}  # the same views of the same arrays (_backend.same_view)
        # per (side, tokens, launch stream): the codes and scales of a small write on the pool's
        # device, reused (a decode step writes the same shape every step; used under the lock)
        self._write_scratch: dict[tuple[str, int, int], tuple[Any, Any]] = {}
        # (largest |x|, what sets it) tighter than the storage's, set by a cache built on this one
        self._value_cap: tuple[float, str] | None = None

    def __repr__(self) -> str:
        vd = "" if self.v_head_dim == self.head_dim else f", v_head_dim={self.v_head_dim}"
        return (f"{type(self).__name__}(num_layers={self.num_layers}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}{vd}, {self.pool_summary()})")

    def pool_summary(self) -> str:
        """``num_pages=…, page_size=…, storage=…, sequences=…, free_pages=…``: the part of a
        ``repr`` about the pool (read without the lock: a display, not a snapshot)."""
        return (f"num_pages={self.num_pages}, page_size={self.page_size}, storage={self.storage!r}, "
                f"sequences={len(self._tables[0])}, free_pages={len(self._free)}")

    # -- geometry -------------------------------------------------------------------------
    @property
    def has_values(self) -> bool:
        """False for a key-only cache (``v_head_dim=0``)."""
        return self.v_head_dim > 0

    def _pool_spec(self) -> dict[str, tuple[tuple[int, ...], Any]]:
        spec = {}
        parts = [("k", self.head_dim)] + ([("v", self.v_head_dim)] if self.has_values else [])
        for name, dim in parts:
            lead = (self.num_pages, self.num_kv_heads, self.page_size)
            if self.bits:
                spec[name + "_codes"] = (lead + (packed_dim(dim, self.part_bits[name]),), np.uint8)
                spec[name + "_scales"] = (lead + (dim // 32,), np.uint16)
            else:
                spec[name + "_pages"] = (lead + (dim,), np.float32)
        return spec

    @property
    def bytes_per_page(self) -> int:
        """Bytes of one page (K and V, every KV head, ``page_size`` tokens)."""
        return sum(int(np.prod(shape[1:])) * np.dtype(dt).itemsize
                   for shape, dt in self._pool_spec().values())

    @property
    def pools(self) -> dict[str, Any]:
        """The page pool arrays by name (empty until the first append), for kernels.

        Float storage: ``k_pages``/``v_pages``; PQO: ``k_codes``/``k_scales``/
        ``v_codes``/``v_scales`` (shapes in the module docstring).
        """
        return dict(self._pools)

    @property
    def device(self) -> str | None:
        """``"cpu"``/``"cuda"`` once the pools exist, else ``None``."""
        return self._device

    @property
    def num_free_pages(self) -> int:
        """Pages not owned by any (layer, sequence)."""
        with self._lock:
            return len(self._free)

    @property
    def num_used_pages(self) -> int:
        """Pages owned by some (layer, sequence)."""
        return self.num_pages - self.num_free_pages

    @property
    def sequences(self) -> list[int]:
        """Live sequence ids (ascending)."""
        with self._lock:
            return sorted(self._tables[0])

    # -- validation -----------------------------------------------------------------------
    def _check_seq(self, seq_id: Any, name: str = "seq_id") -> int:
        if isinstance(seq_id, bool) or not isinstance(seq_id, (int, np.integer)):
            raise TypeError(f"{name}: expected an int, got {type(seq_id).__name__} {seq_id!r}")
        if int(seq_id) not in self._tables[0]:
            raise KeyError(f"{name}: unknown sequence {seq_id!r}; live sequences: {sorted(self._tables[0])}")
        return int(seq_id)

    def check_sequence(self, seq_id: Any) -> int:
        """``seq_id`` as an int if it is a live sequence (``TypeError`` for a non-int,
        ``KeyError`` naming the live ones otherwise)."""
        with self._lock:
            return self._check_seq(seq_id)

    def _check_part(self, name: str, a: Any, dim: int, n: int | None) -> tuple[Any, str]:
        dev = check_float_array(name, a)
        shape = tuple(a.shape)
        if len(shape) == 4:
            if shape[0] != 1:
                raise ValueError(f"{name}: expected batch 1 for a 4-D [1, num_kv_heads, new_tokens, "
                                 f"head_dim] array (one sequence per call), got shape {shape}")
            shape = shape[1:]
        if len(shape) != 3:
            raise ValueError(f"{name}: expected [num_kv_heads, new_tokens, head_dim] (3-D) or [1, ...] "
                             f"(4-D), got shape {tuple(a.shape)}")
        if shape[0] != self.num_kv_heads or shape[2] != dim:
            raise ValueError(f"{name}: expected [num_kv_heads={self.num_kv_heads}, new_tokens, {dim}], "
                             f"got shape {tuple(a.shape)}")
        if shape[1] < 1:
            raise ValueError(f"{name}: expected new_tokens >= 1, got shape {tuple(a.shape)}")
        if n is not None and shape[1] != n:
            raise ValueError(f"{name}: expected {n} new tokens (those of k), got shape {tuple(a.shape)}")
        # the same view of the same array (a steady step's launches repeat, issue 27)
        return _backend.same_view(self._views, (name, id(a)), a, lambda x: x.reshape(shape)), dev

    def _input_limit(self) -> tuple[float, str]:
        if not self.bits:
            if self.has_values and self.v_head_dim == self.head_dim:
                # pages :meth:`decode_attention` reads: it sums values and takes the logits of
                # queries up to 2**64 in float32, finite for |x| <= 2**21 (3e38 values gave inf)
                limit, what = float(2 ** 21), "float32 pages that decode_attention reads (logits and sums in float32)"
            else:
                limit, what = F32_MAX, "float32 pages"  # key-only or latent pages (MLA): no fused attention
        else:
            limit, what = float(2 ** 21), f"storage={self.storage!r} pages"
        cap = self._value_cap  # a wrapper's tighter bound (an MLA cache up-projects the pages in float32)
        return cap if cap is not None and cap[0] < limit else (limit, what)

    def limit_values(self, limit: float, what: str) -> None:
        """Hold appended values to ``|x| <= limit`` where that is tighter than the storage's own
        bound: for a cache built on this one that reads the pages through another float32
        computation (the MLA caches up-project their latents).  Checked as :attr:`validate`
        says, like the storage's bound.

        Parameters
        ----------
        limit : float
            Largest ``|x|`` (``> 0``).
        what : str
            What sets it, for the error message ("… the largest value ``what`` can hold").
        """
        if not check_real("limit", limit, "a float > 0") > 0:
            raise ValueError(f"limit: expected a float > 0, got {limit!r}")
        self._value_cap = (float(limit), str(what))

    def _check_values(self, dev: str, parts: list[tuple[str, Any]]) -> list:
        """Value checks of the appended parts as :attr:`validate` says (see :class:`ValueChecks`).
        Returns the deferred range records not launched yet (``validate="deferred"``): the
        append folds them into its quantization's launch, or launches them itself."""
        mode = self._value_mode(dev)
        if mode == "deferred":
            ok, todo = self._deferred_record().plan_many([("kv", a) for _, a in parts])
            if all(ok):
                return todo
            if todo:
                self._deferred_record().launch(todo)
        if mode != "off":
            for name, a in parts:
                self._check_range(name, a)
        return []

    def _check_range(self, name: str, x3: Any) -> None:
        """Finite, and storable faithfully: float32 pages hold any float32 magnitude; PQO pages
        reject ``|x| > 2**21`` and any block whose binary16 scale (``<= ‖x‖ / ref``, or
        checked by quantizing into scratch when that bound is not below 65504) would saturate."""
        rs = check_finite_stats(name, x3)
        check_magnitude(name, rs.amax, *self._input_limit())
        if not self.bits:
            return
        cb = self.codebooks[name]
        limit = F16_MAX * (1 - 2.0 ** -10)
        ref = float(cb.ref)
        if math.sqrt(tuple(x3.shape)[2]) * rs.amax / ref <= limit or rs.max_norm / ref <= limit:
            return
        x = _backend.ascontiguous_f32(name, x3)
        h, n, d = x.shape
        codes = _backend.empty(x, (h, n, packed_dim(d, self.part_bits[name])), np.uint8)
        scales = _backend.empty(x, (h, n, d // 32), np.uint16)
        quantize_into(x, codes, scales, 0, cb, True)
        check_stored_f16(name, scales, rs.amax, rs.max_norm)

    # -- sequences ------------------------------------------------------------------------
    def allocate_sequence(self) -> int:
        """Create an empty sequence in every layer and return its id (0, 1, 2, …)."""
        with self._lock:
            sid = self._next_seq
            self._next_seq += 1
            for layer in range(self.num_layers):
                self._tables[layer][sid] = []
                self._lens[layer][sid] = 0
            return sid

    def free_sequence(self, seq_id: int) -> None:
        """Release the sequence's pages in every layer and forget it.

        Raises
        ------
        KeyError
            ``seq_id`` unknown (nothing changes).
        """
        with self._lock:
            sid = self._check_seq(seq_id)
            self._dev_tables.clear()
            for layer in range(self.num_layers):
                pages = self._tables[layer].pop(sid)
                del self._lens[layer][sid]
                self._release_pages(pages)

    def reset(self) -> None:
        """Free every sequence (the pools stay allocated) and drop what ``validate="deferred"``
        recorded."""
        with self._lock:
            self.__dict__.pop("_deferred", None)
            for sid in list(self._tables[0]):
                self.free_sequence(sid)
            self._free = list(range(self.num_pages))
            self._dev_tables.clear()

    def seq_len(self, layer: int, seq_id: int) -> int:
        """Tokens stored for ``seq_id`` in ``layer``."""
        with self._lock:
            layer = check_layer(layer, self.num_layers)
            return self._lens[layer][self._check_seq(seq_id)]

    def num_seq_pages(self, layer: int, seq_id: int) -> int:
        """Pages owned by ``seq_id`` in ``layer``."""
        return len(self.block_table(layer, seq_id))

    def block_table(self, layer: int, seq_id: int) -> list[int]:
        """Page ids of ``seq_id`` in ``layer``, in logical order (a copy)."""
        with self._lock:
            layer = check_layer(layer, self.num_layers)
            return list(self._tables[layer][self._check_seq(seq_id)])

    def page_table(self, layer: int, seq_ids: Sequence[int] | None = None,
                   on_device: bool = False) -> PageTable:
        """FlashInfer CSR page table of ``seq_ids`` (default: every live sequence) in ``layer``.

        Parameters
        ----------
        layer : int
        seq_ids : sequence of int, optional
            Sequences in batch order (default: every live sequence, ascending).
        on_device : bool
            Copy the three arrays to the device of the page pool (explicit copy, for a
            kernel launch); host arrays otherwise.

        Returns
        -------
        PageTable
            ``kv_indptr``, ``kv_indices``, ``kv_last_page_len`` (int32).

        Raises
        ------
        ValueError
            ``on_device=True`` before the first append: the pool, made on the device of the
            first K/V, has no device yet.
        """
        on_device = check_bool("on_device", on_device)
        with self._lock:
            layer = check_layer(layer, self.num_layers)
            if on_device and not self._pools:
                raise ValueError("on_device: the page pool has no device before the first append (it is allocated "
                                 "where the first K/V live); call page_table(layer) for host arrays")
            ids = sorted(self._tables[0]) if seq_ids is None else self._check_seqs(seq_ids)
            indptr = np.zeros(len(ids) + 1, np.int32)
            last = np.zeros(len(ids), np.int32)
            chunks = []
            for i, sid in enumerate(ids):
                pages = self._tables[layer][sid]
                chunks.append(pages)
                indptr[i + 1] = indptr[i] + len(pages)
                n = self._lens[layer][sid]
                last[i] = (n - 1) % self.page_size + 1 if n else 0
            indices = np.array([p for c in chunks for p in c], np.int32)
            table = PageTable(indptr, indices, last)
            if on_device and self._pools:
                like = next(iter(self._pools.values()))
                table = PageTable(*(to_like(like, a) for a in table))
            return table

    # -- data -----------------------------------------------------------------------------
    def _device_table(self, layer: int, ids: tuple[int, ...]) -> PageTable:
        """The page table of ``ids`` in ``layer`` on the pool's device, uploaded only when it
        is not the one cached (see the module docstring)."""
        cached = self._dev_tables.get(layer)
        if cached is not None and cached[0] == ids:
            return cached[1]
        table = self.page_table(layer, list(ids), on_device=bool(self._pools))  # (no pool: nothing to read)
        if self._device is not None and self._device != _backend.CPU and len(set(ids)) == len(ids):
            self._dev_tables[layer] = (ids, table)
        return table

    def _ensure_pools(self, like: Any, dev: str) -> None:
        if self._pools:
            return
        self._pools = {name: _backend.zeros(like, shape, dt)
                       for name, (shape, dt) in self._pool_spec().items()}
        self._device = dev

    def append(self, layer: int, seq_id: int, k: Any, v: Any = None) -> None:
        """Append ``new_tokens`` tokens of K (and V) to ``seq_id`` in ``layer``.

        Parameters
        ----------
        layer : int
        seq_id : int
            From :meth:`allocate_sequence`.
        k : float array, shape ``(num_kv_heads, new_tokens, head_dim)`` or ``(1, …)``
            float16/32/64 (stored as float32 or PQO codes); finite.
        v : float array, shape ``(num_kv_heads, new_tokens, v_head_dim)`` or ``(1, …)``
            ``None`` for a key-only cache.

        Raises
        ------
        OutOfPagesError
            Not enough free pages; nothing is appended.
        KeyError
            Unknown ``seq_id``.
        ValueError, TypeError, IndexError
            Bad shape, dtype, device, non-finite values or layer (the message names the
            argument); nothing is appended.
        """
        with self._lock:
            layer = check_layer(layer, self.num_layers)
            sid = self._check_seq(seq_id)
            k3, dev = self._check_part("k", k, self.head_dim, None)
            n = int(k3.shape[1])
            if self.has_values:
                if v is None:
                    raise ValueError(f"v: expected [num_kv_heads, new_tokens, {self.v_head_dim}], got None")
                v3, dv = self._check_part("v", v, self.v_head_dim, n)
                if dv != dev:
                    raise ValueError(f"k is on {dev} but v is on {dv}: both must live on the same device")
            elif v is not None:
                raise ValueError("v: expected None for a key-only cache (v_head_dim=0), got an array")
            if self._device is not None and dev != self._device:
                raise ValueError(f"k is on {dev} but the page pool lives on {self._device}")
            pending = self._check_values(dev, [("k", k3)] + ([("v", v3)] if self.has_values else []))
            try:
                self._append(layer, sid, dev, k3, v3 if self.has_values else None, pending)
            except BaseException:
                # a refused append stores nothing (its pages go back): its values are not
                # recorded either, or check_inputs() would report tokens "stored" that are not
                pending.clear()
                raise
            finally:  # the records no kernel took (a host-side append): launched on their own
                if pending:
                    self._deferred_record().launch(pending)

    def _append(self, layer: int, sid: int, dev: str, k3: Any, v3: Any | None, pending: list) -> None:
        """The storing half of :meth:`append` (arguments validated; under the cache's lock).
        A run within one page on a device is one launch (issue 27): both sides quantized
        straight into the pool's page, with ``pending`` (the deferred range records, taken
        from the list) and the cached device table's last-page length folded in; otherwise
        the pool rows are computed, the tokens quantized into scratch and scattered."""
        n = int(k3.shape[1])
        cur = self._lens[layer][sid]
        table = self._tables[layer][sid]
        need = -(-(cur + n) // self.page_size) - len(table)
        if need > len(self._free):
            raise OutOfPagesError(
                f"append: seq_id {sid} in layer {layer} needs {need} free pages for {n} new tokens "
                f"(page_size={self.page_size}), only {len(self._free)} of {self.num_pages} are free; "
                "nothing was appended")
        self._ensure_pools(k3, dev)
        xk = _backend.ascontiguous_f32("k", k3)
        xv = _backend.ascontiguous_f32("v", v3) if v3 is not None else None
        new_pages = self._take_pages(max(need, 0))
        pages = table + new_pages
        p0, slot = divmod(cur, self.page_size)
        planes = self._write_page_run(xk, xv, pages[p0], slot)
        try:
            if planes is not None:
                # the cached device table's last-page length grows in the write's launch
                grow = self._note_append(layer, sid, n, bool(new_pages))
                t0 = slot
                if grow is not None and slot and n <= SMALL_WRITE:
                    # a graph-replayable step (issue 27): the slot (> 0: the last page has room)
                    # is that length, read on the device where the previous launch advanced it
                    grow, t0 = (*grow, grow[1]), 0
                todo = pending[:]
                pending.clear()  # taken: folded into the launch below, or launched by folded()
                with self._deferred_record().folded(todo) if todo else contextlib.nullcontext() as ranges:
                    quantize_pair_into(xk, xv, *planes, t0, self.codebooks["k"], self.codebooks["v"], True,
                                       ranges=ranges, add_at=grow)
            else:
                self._write_kv(xk, xv, self._append_rows(xk, pages, cur, n, dev))
        except Exception:
            self._release_pages(new_pages)
            raise
        table.extend(new_pages)
        self._lens[layer][sid] = cur + n
        if planes is None:
            grow = self._note_append(layer, sid, n, bool(new_pages))
            if grow is not None:
                add_at(*grow)

    def get_kv(self, layer: int, seq_id: int) -> tuple[Any, Any]:
        """All tokens of ``seq_id`` in ``layer`` (dequantized for PQO storage).

        Returns
        -------
        k : float32 array, shape ``(num_kv_heads, seq_len, head_dim)``
        v : float32 array, shape ``(num_kv_heads, seq_len, v_head_dim)``, or ``None``
            for a key-only cache.

        Raises
        ------
        ValueError
            The sequence holds no tokens in ``layer`` (as in gllm-kernels).
        """
        with self._lock:
            layer = check_layer(layer, self.num_layers)
            sid = self._check_seq(seq_id)
            n = self._lens[layer][sid]
            if n == 0:
                raise ValueError(f"seq_id: sequence {sid} holds no tokens in layer {layer}")
            rows = self._rows(self._tables[layer][sid], 0, n)
            k = self._read("k", rows, n)
            v = self._read("v", rows, n) if self.has_values else None
            return k, v

    def iter_pages(self, layer: int, seq_id: int) -> Iterator[tuple[int, int, Any, Any]]:
        """Yield ``(page_id, num_tokens, k, v)`` for each page of ``seq_id`` in order.

        ``k``/``v`` are float32 ``[num_kv_heads, num_tokens, dim]`` (dequantized for PQO;
        ``v`` is ``None`` for a key-only cache).  The page list is read once, at the start;
        a page the sequence no longer holds when its turn comes (freed, cropped, or reused by
        another sequence meanwhile) raises ``RuntimeError`` instead of yielding its new data.
        """
        with self._lock:
            layer = check_layer(layer, self.num_layers)
            sid = self._check_seq(seq_id)
            pages = list(self._tables[layer][sid])
            n_total = self._lens[layer][sid]
        for i, p in enumerate(pages):
            t0 = i * self.page_size
            nt = min(self.page_size, n_total - t0)
            with self._lock:
                table = self._tables[layer].get(sid)
                if table is None or len(table) <= i or table[i] != p or self._lens[layer][sid] < t0 + nt:
                    raise RuntimeError(f"seq_id: sequence {sid} changed while its pages were iterated "
                                       f"(page {p} of layer {layer} no longer holds its tokens {t0}..{t0 + nt - 1})")
                rows = self._rows([p], 0, nt)
                k = self._read("k", rows, nt)
                v = self._read("v", rows, nt) if self.has_values else None
            yield p, nt, k, v

    # -- accounting -----------------------------------------------------------------------
    def decode_attention(self, layer: int, q: Any, seq_ids: Sequence[int] | None = None, *,
                         softmax_scale: float | None = None, causal: bool = True,
                         partition_size: int | None = None, out: Any = None) -> Any:
        """Fused attention of ``q`` ``[n_seq, num_heads, q_len, head_dim]`` over the pages of
        ``seq_ids`` (default: every live sequence) — compressed pages are read through the
        page table without dequantizing.  See
        :func:`numba_kv.ops.attention.paged.paged_decode_attention` (``out``: a float32
        array shaped like ``q``, C-contiguous, on its device, written and returned instead
        of a new array; checked before anything runs).  ``q``'s values are checked as
        :attr:`validate` says (finite, ``|q| <= 2**64``; the shapes by the op).
        """
        softmax_scale = None if softmax_scale is None else check_softmax_scale(softmax_scale)
        partition_size, causal = check_partition_size(partition_size), check_bool("causal", causal)
        with self._lock:  # the table, the lengths and the pools of one moment
            layer = check_layer(layer, self.num_layers)
            ids = tuple(sorted(self._tables[0]) if seq_ids is None else self._check_seqs(seq_ids))
            arrays = self._attention_arrays(q)
            if not ids:
                raise ValueError("seq_ids: expected at least one sequence to attend over, got none"
                                 + (" (no sequence is allocated)" if seq_ids is None else ""))
            dev = self._check_query(q, len(ids))
            lens = [self._lens[layer][s] for s in ids]
            ql = int(q.shape[2])
            if min(lens) < max(1, ql if causal else 1):
                raise ValueError(f"seq_ids: every sequence needs >= max(1, q_len={ql}) stored tokens, "
                                 f"got lengths {lens}")
            if out is not None:
                check_out(out, tuple(q.shape), np.float32, dev, "the attention output (float32, shaped like q)",
                          inputs=(("q", q),))
            mode = self._value_mode(dev)
            if mode == "sync" or (mode == "deferred" and not self._defer("q", q)):
                check_q_values(q)  # else deferred to check_inputs() (or "off")
            # the trusted entry: the configuration and the checks above vouch for every argument
            klay, vlay = self._layouts if self.bits else (None, None)
            return paged_attention_rows(q, self._device_table(layer, ids), arrays, klay, vlay,
                                        n_kv_heads=self.num_kv_heads, page_size=self.page_size, seq_lens=lens,
                                        softmax_scale=softmax_scale, causal=causal, partition_size=partition_size,
                                        out=out)

    def _check_query(self, q: Any, n_seq: int) -> str:
        """Dtype, device and shape of a ``decode_attention`` query (values are not read);
        returns its device."""
        dev = check_float_array("q", q, 4)
        if dev != self._device:
            raise ValueError(f"q is on {dev} but the page pool lives on {self._device}")
        n, hq, ql, d = (int(x) for x in q.shape)
        hkv = self.num_kv_heads
        if d % 32 or d != self.head_dim or hq % hkv:
            raise ValueError(f"q: expected [n_seq, k·{hkv}, q_len, {self.head_dim}] (the pools' KV heads and "
                             f"head_dim), got shape {(n, hq, ql, d)}")
        if n != n_seq:
            raise ValueError(f"q: expected {n_seq} rows (one per sequence of the page table), got {n}")
        return dev

    def _attention_arrays(self, like: Any) -> tuple:
        """The pools as the paged kernels take them (:func:`~numba_kv.ops.attention.paged.pool_arrays`)."""
        pools = self._pools
        if not pools:
            raise ValueError("cache: expected a paged cache with stored tokens, got an empty pool")
        if not self.has_values or self.v_head_dim != self.head_dim:
            raise ValueError(f"cache: paged attention needs v_head_dim == head_dim ({self.head_dim}), "
                             f"got {self.v_head_dim}")
        if not self.bits:
            return pool_arrays(like, pools["k_pages"], pools["v_pages"])
        return pool_arrays(like, k_codes=pools["k_codes"], k_scales=pools["k_scales"], v_codes=pools["v_codes"],
                           v_scales=pools["v_scales"])

    def memory_usage(self) -> int:
        """Bytes of the pages in use (whole pages, K and V)."""
        return self.num_used_pages * self.bytes_per_page

    def allocated_bytes(self) -> int:
        """Bytes of the whole pool (0 before the first append)."""
        return self.num_pages * self.bytes_per_page if self._pools else 0

    @property
    def bits_per_value(self) -> float:
        """Stored bits per K or V value of a full page."""
        vals = self.num_kv_heads * self.page_size * (self.head_dim + self.v_head_dim)
        return 8.0 * self.bytes_per_page / vals
