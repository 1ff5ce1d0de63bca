"""The whole-head rotation's vector codes of :class:`~numba_kv.caches.polarquant.PolarQuantCache`
and their norms' storage, binary16 or 8-bit (``norm_bits=8``), as a mixin.

With ``norm_bits=8`` a layer stores each vector's norm as one byte on a log grid of 1/16
octave (:mod:`numba_kv.ops.norm8`) whose base is cache state, fixed at the layer's first store:

* the base is chosen from the binary16 norms of **every** token of that first call (window
  and sink tokens included: they are compressed later, and must then fit the same grid);
  every later call's tokens are checked against the grid on arrival, before anything is
  stored, so no token can fail when it leaves the window;
* it lives in the layer's counters (``meta["norm8_base"]``, ``base16`` plus
  :data:`BASE_OFFSET`, so that a state's counters stay non-negative ints): fork, crop,
  ``select_batch``, save/load and the mixed caches' pieces carry it with the rest, and
  ``reset`` / ``crop(0)`` clear it;
* quantization writes each vector's binary16 norm into a scratch plane first (the head
  quantizers unchanged), then one launch copies the codes into place and encodes the norms
  (:func:`~numba_kv.ops.norm8.norm8_store_into`); the dequantizer reads a plane of unit
  norms and scales its output by the decoded ones; the fused kernels read the byte through
  the layer's scale table (:func:`~numba_kv.ops.norm8.norm8_scale_table`).  The one-call
  decode-step stores encode the norms in the same call (the serial int8-window step on the
  CPU, :mod:`numba_kv.ops.headpair`'s launch on a device).
* the first store quantizes all its tokens in scratch to fix the grid; the tokens it
  compresses (those that skip the window) are then stored from those scratch codes
  (:meth:`HeadNormMixin._compressor`) rather than quantized a second time.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import _backend
from .._validate import F16_MAX, check_stored_f16
from ..ops.gather import to_like
from ..ops.headquant import dequantize_head_into, quantize_head_into
from ..ops.headvq import dequantize_headvq_into, quantize_headvq_into
from ..ops.norm8 import norm8_base16, norm8_codes, norm8_scale_rows_into, norm8_scale_table, norm8_store_into, norm8_top
from ._layer import LayerState
from .state import CacheFileError

__all__ = ["BASE_OFFSET", "HeadNormMixin"]

#: ``meta["norm8_base"] = base16 + BASE_OFFSET``: binary16 norms give ``base16`` in
#: ``[-575, 128]`` (16·log2 of 2**-24 … 65504, minus the grid's offsets), so it stays in
#: ``[1, 2047]`` and every counter stays a non-negative int
BASE_OFFSET = 1024
_ONE_F16 = 0x3C00  # binary16 1.0


class HeadNormMixin:
    """The head rotation's vector (de)quantization with binary16 or 8-bit norms; mixed into
    :class:`~numba_kv.caches.polarquant.PolarQuantCache`, whose codebooks, VQ tables and
    configuration it reads."""

    @property
    def _norm8(self) -> bool:
        return self.config.norm_bits == 8

    # -- codes ----------------------------------------------------------------------------
    def _head_quantize(self, name: str, x3: Any, codes: Any, norms: Any, t0: int) -> None:
        if name in self._vq_cents:
            quantize_headvq_into(x3, codes, norms, t0, self._vq_cents[name], self.unbiased)
        else:
            quantize_head_into(x3, codes, norms, t0, self.codebooks[name], self.unbiased)

    def _quantize_vectors(self, st: LayerState, name: str, x3: Any, t0: int) -> None:
        """Quantize ``x3`` ``[rows, n, d]`` (stored domain) into tokens ``t0 : t0 + n`` of side
        ``name`` (whole-head rotation, scalar or VQ code)."""
        codes, scales = st.buffers[name + "_codes"], st.buffers[name + "_scales"]
        if not self._norm8:
            self._head_quantize(name, x3, codes, scales, t0)
            return
        rows, n = int(x3.shape[0]), int(x3.shape[1])
        tc = _backend.empty(x3, (rows, n, int(codes.shape[2])), np.uint8)
        tn = _backend.empty(x3, (rows, n, 1), np.uint16)
        self._head_quantize(name, x3, tc, tn, 0)
        if "norm8_base" not in st.meta:
            # a store that set no base first (the range check's scratch state, or a deferred
            # validation): this batch's own grid
            st.meta["norm8_base"] = norm8_base16(_backend.to_host(tn)) + BASE_OFFSET
        norm8_store_into(tc, tn, st.meta["norm8_base"] - BASE_OFFSET, t0, codes, scales)

    def _dequantize_vectors(self, st: LayerState, name: str, t0: int, out: Any) -> None:
        """Reconstruct tokens ``t0 : t0 + out.shape[1]`` of side ``name`` into ``out``."""
        codes, scales = st.buffers[name + "_codes"], st.buffers[name + "_scales"]
        norms = scales
        if self._norm8:  # unit norms, then the output scaled by the decoded ones (the same product)
            norms = to_like(out, np.full((int(codes.shape[0]), t0 + int(out.shape[1]), 1), _ONE_F16, np.uint16))
        if name in self._vq_cents:
            dequantize_headvq_into(codes, norms, t0, self._vq_cents[name], out)
        else:
            dequantize_head_into(codes, norms, t0, self.codebooks[name], out)
        if self._norm8:
            norm8_scale_rows_into(scales, self._norm8_base16(st), t0, out)

    # -- the grid -------------------------------------------------------------------------
    @staticmethod
    def _norm8_base16(st: LayerState) -> int:
        return st.meta.get("norm8_base", BASE_OFFSET) - BASE_OFFSET

    def _norm8_scale_table(self, st: LayerState, like: Any) -> Any:
        """The fused kernels' scale table of the layer on the device of ``like`` (None:
        binary16 norms, the plan's own table)."""
        return _backend.constant(like, norm8_scale_table(self._norm8_base16(st))) if self._norm8 else None

    def _scratch_norms(self, st: LayerState, name: str, arr: Any, round_trip: bool = False,
                       keep: dict | None = None) -> np.ndarray:
        """Binary16 norms (host uint16 ``[rows, n, 1]``) of input ``arr`` ``[b, h, n, d]``
        as the layer would store them, computed in scratch (the layer is not touched); with
        ``round_trip``, of its tokens' int8 window round trips (what a token is compressed from
        when it leaves an int8 window).  ``keep[name]``: the scratch codes and binary16 norms
        (on the device of ``arr``), when given."""
        rows, n, d = int(arr.shape[0]) * self.num_kv_heads, int(arr.shape[2]), self.head_dim
        tmp = LayerState(meta=dict(st.meta))
        if self.config.key_center:  # a frozen mean is only read; else this chunk's, in scratch
            mean = st.buffers.get("k_chmean") if st.meta.get("kmean_set", 0) else None
            tmp.buffers["k_chmean"] = mean if mean is not None else _backend.zeros(arr, (rows, 1, d), np.float32)
        x3 = self._transform_in(tmp, name, _backend.ascontiguous_f32(name, arr).reshape(rows, n, d))
        if round_trip:
            x3 = self._window.int8_round_trip(x3)
        width = int(self.layouts[name].width)
        tn = _backend.empty(x3, (rows, n, 1), np.uint16)
        tc = _backend.empty(x3, (rows, n, width), np.uint8)
        self._head_quantize(name, x3, tc, tn, 0)
        if keep is not None:
            keep[name] = (tc, tn)
        return _backend.to_host(tn)

    def _check_norm8(self, st: LayerState, k: Any, v: Any, stats: Any) -> None:
        """Range check of ``norm_bits=8`` (``ValueError`` before anything is stored): the first
        store fixes the grid from all its tokens' norms (kept as pending for :meth:`_fix_norm8_base`);
        a later one is checked against it — by the free bound ``‖x‖ · _f16_factor`` where it
        proves every norm below the top, else by the norms themselves, computed in scratch."""
        if not self._norm8:
            return
        sides = (("k", k, stats[0]), ("v", v, stats[1]))
        # a token that enters an int8 window is compressed from its round trip when it leaves
        round_trips = (False, True) if self._windowed and self._exact_dtype == np.int8 else (False,)
        f16_limit = F16_MAX * (1 - 2.0 ** -10)
        if "norm8_base" not in st.meta:
            codes: dict = {}
            norms = {name: self._scratch_norms(st, name, arr, keep=codes) for name, arr, _ in sides}
            for name, arr, rs in sides:
                check_stored_f16(name, norms[name], rs.amax, rs.max_norm, self._range_note(st, name))
                if len(round_trips) == 2 and not self._norms_cleared(st, name, rs, f16_limit):
                    check_stored_f16(name, self._scratch_norms(st, name, arr, True), rs.amax, rs.max_norm,
                                     self._range_note(st, name))
            # (the grid leaves 4 octaves above this call's largest norm: nothing to check)
            st.scratch["norm8_pending"] = (k, v, norm8_base16(np.concatenate([norms["k"], norms["v"]], axis=1)),
                                           codes)
            return
        base16 = self._norm8_base16(st)
        limit = min(norm8_top(base16), f16_limit)
        for name, arr, rs in sides:
            for round_trip in round_trips if not self._norms_cleared(st, name, rs, limit) else ():
                h = self._scratch_norms(st, name, arr, round_trip)
                check_stored_f16(name, h, rs.amax, rs.max_norm, self._range_note(st, name))
                codes = norm8_codes(h, base16)
                if h.size and int(codes.max()) > 255:
                    big = float(np.abs((h & 0x7FFF).view(np.float16).astype(np.float64)).max())
                    raise ValueError(f"{name}: a vector norm of {big:.6g} exceeds the 8-bit norm grid's top "
                                     f"{norm8_top(base16):.6g} fixed at this layer's first store (norm_bits=8"
                                     f"{self._range_note(st, name)}); use norm_bits=16; nothing was stored")

    def _norms_cleared(self, st: LayerState, name: str, rs: Any, limit: float) -> bool:
        """Whether the proved bound (the largest stored-domain norm, its int8 round trip's
        included, times :meth:`_f16_factor`) keeps every norm of side ``name`` below ``limit``:
        first with the free norm bound ``√d·max|x|``, then (a pass over the values, computed
        once) with the measured largest norm."""
        for norm_in in (math.sqrt(self.head_dim) * rs.amax, None):
            _, norm, _ = self._stored_domain_bounds(st, name, rs.amax, rs.max_norm if norm_in is None else norm_in)
            if norm * self._f16_factor(name) * (1 + 2.0 ** -10) <= limit:
                return True
        return False

    def _fix_norm8_base(self, st: LayerState, k: Any, v: Any) -> dict | None:
        """Fix the layer's grid before its first store (from :meth:`_check_norm8`'s pending
        base of these very inputs, else computed the same way).  Returns the scratch codes of
        that first store (``{side: (codes, binary16 norms)}``, every token of ``k`` and ``v``
        quantized as the store would), or ``None`` when the grid was fixed before."""
        if not self._norm8 or "norm8_base" in st.meta:
            return None
        pending = st.scratch.pop("norm8_pending", None)
        if pending is None or pending[0] is not k or pending[1] is not v:
            codes: dict = {}
            norms = [self._scratch_norms(st, name, arr, keep=codes) for name, arr in (("k", k), ("v", v))]
            pending = (k, v, norm8_base16(np.concatenate(norms, axis=1)), codes)
        st.meta["norm8_base"] = pending[2] + BASE_OFFSET
        return pending[3]

    def _compressor(self, st: LayerState, name: str, pre: dict | None, plan: Any, t0: int) -> Callable[[Any], None]:
        """The compress step of a store of side ``name`` at token ``t0`` (given the tokens that
        leave the window, or every new token without a window): the quantizer, or for the
        layer's first store (``pre``: :meth:`_fix_norm8_base`'s scratch codes of its tokens)
        a copy of their scratch codes with the norms encoded — a first store compresses only
        new tokens that skip the window (from the first after its sinks on), which the scratch
        quantized from the same stored-domain values as the quantizer would."""
        if pre is None or self.outlier_channels or (plan is not None and plan.evict_old):
            return lambda ev: self._compress(st, name, ev, t0)
        tc, tn = pre[name]
        s0 = 0 if plan is None else plan.sinks
        return lambda ev: norm8_store_into(tc, tn, self._norm8_base16(st), t0, st.buffers[name + "_codes"],
                                           st.buffers[name + "_scales"], s0=s0, n=int(ev.shape[1]))

    def _check_counters(self, i: int, seq_len: int, meta: dict[str, int], live: dict[str, Any],
                        evicted: int = 0) -> None:
        """A restored layer's grid, then the window bookkeeping's own checks."""
        self._check_norm8_meta(i, seq_len, meta)
        super()._check_counters(i, seq_len, meta, live, evicted)  # type: ignore[misc]

    def _check_norm8_meta(self, i: int, seq_len: int, meta: dict[str, int]) -> None:
        """``CacheFileError`` unless a restored layer's grid base is present exactly when the
        cache stores 8-bit norms (and in range)."""
        base = meta.get("norm8_base")
        if not self._norm8:
            if base is not None:
                raise CacheFileError(f"state: layer {i} has an 8-bit norm grid, the configuration stores "
                                     f"binary16 norms (norm_bits=16)")
        elif seq_len and (base is None or not 1 <= base <= 2 * BASE_OFFSET - 1):
            raise CacheFileError(f"state: layer {i} of a norm_bits=8 cache needs its grid base norm8_base in "
                                 f"[1, {2 * BASE_OFFSET - 1}], got {base!r}")
