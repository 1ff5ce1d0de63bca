"""Where a :class:`~numba_kv.caches.paged.PagedKVCache`'s tokens go in its page pool and how
they come back: pool rows, the write of an append (quantized straight into a page on a
device, or quantized into scratch and scattered to its rows), the read of a run of tokens, and
the cached device page table kept in step.  A mixin over the paged cache's own state
(``_pools``, ``_dev_tables``, ``_row_scratch``, ``_write_scratch``, its configuration) so
``paged.py`` stays validation, sequences and attention."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import _backend
from ..ops.blockquant import dequantize_into, packed_dim, quantize_into, quantize_pair_into
from ..ops.gather import gather_rows, scatter_rows, to_like
from ..ops.page_index import page_run_rows_into

__all__ = ["SMALL_WRITE", "PagedStorageMixin"]

#: tokens of a device write whose codes and scales go through reused buffers (a decode step's few)
SMALL_WRITE = 16


class PagedStorageMixin:
    """Pool rows, writes and reads of a paged cache (see the module docstring)."""

    def _rows(self, pages: Sequence[int], t0: int, n: int) -> np.ndarray:
        """Pool rows (``[num_pages·H·page_size]`` view) of tokens ``t0 : t0+n``, head-major."""
        pos = t0 + np.arange(n, dtype=np.int64)
        page = np.asarray(pages, np.int64)[pos // self.page_size]
        slot = pos % self.page_size
        h = np.arange(self.num_kv_heads, dtype=np.int64)[:, None]
        rows = (page[None, :] * self.num_kv_heads + h) * self.page_size + slot[None, :]
        return rows.reshape(-1).astype(np.int32)

    def _append_rows(self, like: Any, pages: list[int], t0: int, n: int, dev: str) -> Any:
        """Pool rows of tokens ``t0 : t0+n`` (as :meth:`_rows`) on the pool's device: written
        there by a kernel when the run stays within one page (no host copy), else uploaded."""
        p0, slot = divmod(t0, self.page_size)
        if dev == _backend.CPU or slot + n > self.page_size:
            return self._rows(pages, t0, n)
        size = self.num_kv_heads * self.page_size
        handle = _backend.launch_stream_state()[1]  # per stream: streams run at once
        rows = self._row_scratch.get(handle)
        if rows is None:
            rows = self._row_scratch[handle] = _backend.empty(like, (size,), np.int32)
        return page_run_rows_into(rows, pages[p0], slot, n, self.num_kv_heads, self.page_size)

    def _note_append(self, layer: int, sid: int, n: int, new_pages: bool) -> tuple[Any, int, int] | None:
        """Keep the cached device page table of ``layer`` in step with an append: drop the
        table when pages were added, else return ``(kv_last_page_len, index, n)``, the
        in-place growth of the sequence's last-page length for the caller to launch (``None``:
        nothing to do)."""
        cached = self._dev_tables.get(layer)
        if cached is None or sid not in cached[0]:
            return None
        if new_pages:
            del self._dev_tables[layer]
            return None
        return cached[1].kv_last_page_len, cached[0].index(sid), n

    def _write_page_run(self, xk: Any, xv: Any | None, page: int, slot: int) -> tuple | None:
        """The pool's code and scale planes of ``page`` (``[H, page_size, ·]`` views, no copy)
        when an append of ``xk``/``xv`` into it from ``slot`` on can be quantized straight into
        the pool (:meth:`_append`): PQO pools on a device, both sides of one shape, the run
        within the page.  ``None`` otherwise."""
        h, n, _ = xk.shape
        if xv is None or not self.bits or isinstance(xk, np.ndarray) or tuple(xv.shape) != tuple(xk.shape) \
                or slot + n > self.page_size:
            return None
        rows = slice(page * h, (page + 1) * h)
        # the same views of a page's planes every time (a steady step's launch repeats, issue 27)
        return tuple(_backend.same_view(self._views, ("planes", name, page), self._pools[name],
                                        lambda a: a.reshape(self.num_pages * h, self.page_size, int(a.shape[3]))[rows],
                                        owned=True)
                     for name in ("k_codes", "k_scales", "v_codes", "v_scales"))

    def _write(self, part: str, x3: Any, rows: np.ndarray) -> None:
        h, n, d = x3.shape
        idx = to_like(x3, rows) if isinstance(rows, np.ndarray) else rows
        if self.bits:
            pd = packed_dim(d, self.part_bits[part])
            codes, scales = self._write_buffers(x3, part, h, n, pd, d // 32)
            quantize_into(x3, codes, scales, 0, self.codebooks[part], True)
            self._scatter_codes(part, codes, scales, idx)
        else:
            scatter_rows(x3.reshape(h * n, d), idx, self._pools[part + "_pages"].reshape(-1, d))

    def _write_kv(self, xk: Any, xv: Any | None, rows: np.ndarray) -> None:
        """Write both sides: on a device with codes of one shape, both quantized in one launch
        (:func:`~numba_kv.ops.blockquant.quantize_pair_into`, the bytes of two), else side by side."""
        if xv is None or not self.bits or isinstance(xk, np.ndarray) or tuple(xv.shape) != tuple(xk.shape):
            self._write("k", xk, rows)
            if xv is not None:
                self._write("v", xv, rows)
            return
        h, n, d = xk.shape
        idx = to_like(xk, rows) if isinstance(rows, np.ndarray) else rows
        ck, sk = self._write_buffers(xk, "k", h, n, packed_dim(d, self.part_bits["k"]), d // 32)
        cv, sv = self._write_buffers(xk, "v", h, n, packed_dim(d, self.part_bits["v"]), d // 32)
        quantize_pair_into(xk, xv, ck, sk, cv, sv, 0, self.codebooks["k"], self.codebooks["v"], True)
        self._scatter_codes("k", ck, sk, idx)
        self._scatter_codes("v", cv, sv, idx)

    def _scatter_codes(self, part: str, codes: Any, scales: Any, idx: Any) -> None:
        """Codes ``[h, n, pd]`` and scales ``[h, n, nb]`` of side ``part`` into the pool rows ``idx``."""
        h, n, pd = codes.shape
        nb = int(scales.shape[2])
        scatter_rows(codes.reshape(h * n, pd), idx, self._pools[part + "_codes"].reshape(-1, pd))
        scatter_rows(scales.reshape(h * n, nb), idx, self._pools[part + "_scales"].reshape(-1, nb))

    def _write_buffers(self, like: Any, part: str, h: int, n: int, pd: int, nb: int) -> tuple[Any, Any]:
        """Codes ``[h, n, pd]`` uint8 and scales ``[h, n, nb]`` uint16 for a write of ``n``
        tokens of side ``part``: reused on a device for a write of a few tokens (no allocation
        per decode step; the pool rows are scattered from them before the next write on the
        same launch stream: each stream has its own), new arrays otherwise."""
        if isinstance(like, np.ndarray) or n > SMALL_WRITE:
            return _backend.empty(like, (h, n, pd), np.uint8), _backend.empty(like, (h, n, nb), np.uint16)
        key = (part, n, _backend.launch_stream_state()[1])  # per launch stream: streams run at once
        hit = self._write_scratch.get(key)
        if hit is None or tuple(hit[0].shape) != (h, n, pd) or tuple(hit[1].shape) != (h, n, nb):
            hit = self._write_scratch[key] = (_backend.empty(like, (h, n, pd), np.uint8),
                                              _backend.empty(like, (h, n, nb), np.uint16))
        return hit

    def _read(self, part: str, rows: np.ndarray, n: int) -> Any:
        h = self.num_kv_heads
        d = self.head_dim if part == "k" else self.v_head_dim
        like = next(iter(self._pools.values()))
        idx = to_like(like, rows)
        out = _backend.empty(like, (h, n, d), np.float32)
        if self.bits:
            pd = packed_dim(d, self.part_bits[part])
            codes = _backend.empty(like, (h * n, pd), np.uint8)
            scales = _backend.empty(like, (h * n, d // 32), np.uint16)
            gather_rows(self._pools[part + "_codes"].reshape(-1, pd), idx, codes)
            gather_rows(self._pools[part + "_scales"].reshape(-1, d // 32), idx, scales)
            dequantize_into(codes.reshape(h, n, pd), scales.reshape(h, n, d // 32), 0, self.codebooks[part], out)
        else:
            gather_rows(self._pools[part + "_pages"].reshape(-1, d), idx, out.reshape(h * n, d))
        return out
