"""The fused decode step of :class:`~numba_kv.caches.polarquant.PolarQuantCache` (and
TurboQuant's), as a mixin: the attention over the codes and the window, bound once per layer.

A steady-state decode step re-decides nothing: per layer (in its scratch, used under its
lock, so nothing here is shared between layers or threads) the cache keeps

* the :class:`~numba_kv.ops.attention.FlatStep` of the layer's arrays and the query shape:
  the attention plan's constants, partitioning and the static part of the kernel's
  arguments, built again only when the layer's buffers move, its position buffer grows or
  the query shape changes;
* a buffer for the rotated queries (either rotation, on every device: the step rotates into it);
* for an int8 window with the whole-head quantizer, the static arguments of the one-call
  store (:func:`~numba_kv.ops.window8.window8_head_step`), which also writes the exact
  tokens' positions.

The store of a step on a device with a float window is two launches: both sides' window
stores with the exact tokens' positions (:meth:`~numba_kv.caches._window.ExactWindow.store_pair`),
into which the call's deferred range records of ``k``, ``v`` and ``q`` are folded (no launch
of their own: ``LayerState.range_pending``), and both sides' evicted tokens quantized together
(``quantize_head_pair`` / ``quantize_blocks_pair``, :meth:`FusedDecodeMixin._compress_pair`).
With the caller's ``out=`` (float32) the attention kernel writes the step's output there: the
step allocates nothing.

Bit for bit the same as building everything per step (``tests/caches/test_fused.py``).
"""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple

import numpy as np

from .. import _backend, _config
from ..ops.attention import attention_plan
from ..ops.attention.step_cpu import ROTATE_BLOCK, ROTATE_HEAD
from ..ops.blockquant import quantize_pair_into
from ..ops.hadamard import SIGNS32, rotate32_rows
from ..ops.headpair import quantize_head_pair_into
from ..ops.headquant import head_signs, rotate_head_rows
from ..ops.window8 import window8_codes_args, window8_head_args, window8_head_step
from ._layer import LayerState, finite_astype
from ._window import layer_counts, plan_store, window_capacity
from .protocol import AttendConfig, DecodeOutput, Fused

__all__ = ["FusedDecodeMixin"]

_F32, _I8 = np.dtype(np.float32), np.dtype(np.int8)


class _FusedStep(NamedTuple):
    """A layer's fused attention step (:meth:`FusedDecodeMixin._fused_step`), valid while the
    layer's buffer dict (replaced as a whole when a buffer moves), its position buffer and
    the query shape ``key`` stay the same."""

    buffers: dict
    pos: Any
    key: tuple
    step: Any  # FlatStep
    rot: bool  # the window is attended in the rotated domain
    qr: Any  # the rotated queries' buffer (either rotation)
    rotate: Any  # FlatStep.run's ``rotate`` (kind, None, signs), the step's queries still to set (None: op by op)


class FusedDecodeMixin:
    """``decode_output="fused"``: attention computed from the packed codes and the window
    (:meth:`_decode_output`), with the per-layer bindings described in the module
    docstring.  Mixed into :class:`~numba_kv.caches.polarquant.PolarQuantCache`, whose
    state (layouts, window, codebooks, head signs) it reads."""

    def _store_window_pair(self, st: LayerState, k: Any, v: Any, plan: Any, sinks: int, n_sink: int,
                           n_comp: int) -> bool:
        """The store of a small step on a device (a decode step) into float32, float16 or int8
        windows: both sides' window stores (keys centered there on a frozen mean) and the
        exact tokens' positions in one launch (:meth:`ExactWindow.store_pair`), then the
        evicted tokens' quantization.  Returns
        whether it stored (else the caller stores op by op, with the same bytes)."""
        if isinstance(k, np.ndarray) or not self._window.pair_applies(st, int(k.shape[2])):
            return False
        # a frozen key mean is subtracted in the store's launch: no array arithmetic between
        # the step's launches (a CUDA graph replays launches only, issue 27)
        kmean = st.buffers["k_chmean"] if self.key_center and not self.outlier_channels \
            and st.meta.get("kmean_set", 0) else None
        x3 = []
        for name, arr in (("k", k), ("v", v)):
            x = _backend.ascontiguous_f32(name, arr)
            # the same view object for the same input array (a repeated launch, issue 27)
            x = _backend.same_view(st.scratch.setdefault("views", {}), name, x,
                                   lambda a: a.reshape(a.shape[0] * a.shape[1], a.shape[2], a.shape[3]))
            x3.append(x if kmean is not None else self._transform_in(st, name, x))
        pos_counts = (n_sink + plan.sinks, sinks + n_comp + plan.compressed, plan.keep_old + plan.keep_new)
        # the layer's device step state (_device_count), current before the store reads it
        counted = self._device_count(st, x3[0], n_comp)
        # the call's deferred range records (k, v, q) ride in the store's launch (issue 27)
        pending, st.range_pending = st.range_pending, None
        with self._deferred_record().folded(pending) if pending else contextlib.nullcontext() as ranges:
            ev = self._window.store_pair(st, x3[0], x3[1], plan, sinks, pos_counts, ranges,
                                         count=None if counted is None else (counted[0], 1, 0, n_comp), kmean=kmean)
        if ev is None:
            return False
        if plan.compressed:
            self._compress_pair(st, ev[0], ev[1], n_comp, staged=True)
        return True

    def _steady_regime(self, st: LayerState, n: int) -> Any:
        """What the next fused decode step of ``n`` tokens stores, when it stores the way the
        step before did (:mod:`numba_kv.caches._steady`): on a device, no sliding eviction, room
        in the codes, and with a window no new sinks and a window that stays full at its
        capacity (every step then evicts as many tokens into the codes as it takes in).  A
        window that grows with the history (``residual_fraction``) does so between its growth
        steps: the step that widens it stores without evicting and is a full one.  The
        :class:`~numba_kv.caches._window.StorePlan` (``True`` without a window), or ``None``."""
        if not self._fused or not st.seq_len or st.window is not None or st.device == _backend.CPU \
                or self._growing_needed(st, n) > st.capacity:
            return None
        if not self._windowed:
            return True
        win = self._window
        _, _, n_win = layer_counts(st)
        # the window's capacity after the step, as _store reserves it
        cap = win.residual_length if not win.ratio[0] else \
            window_capacity(st.seq_len + st.evicted + n, win.residual_length, win.ratio)
        plan = plan_store(n, st.seq_len, n_win, self._sinks(st), cap)
        return plan if not plan.sinks and plan.keep_old + plan.keep_new == n_win else None

    def _compress_pair(self, st: LayerState, xk3: Any, xv3: Any, t0: int, staged: bool = False) -> None:
        """:meth:`_compress` of both sides (one shape) in one launch where the codes allow it
        (this class's quantizer without channel split: with the whole-head rotation either
        code on either side, either norm width, once the 8-bit grid is fixed), else one side
        after the other.  ``staged``: the store's launch copied the layer's device count
        (``t0``) into the step state's first slot, from which the launch then reads its offset."""
        if not self._pair_quantize or (self._norm8 and "norm8_base" not in st.meta):
            self._compress(st, "k", xk3, t0)
            self._compress(st, "v", xv3, t0)
            return
        n = int(xk3.shape[1])
        counted = self._device_count(st, xk3, t0)
        add_at, at = None, t0
        if counted is not None:
            # staged: the offset read from slot 0 (t0 there), slot 1 = slot 0 + n (no offset
            # argument that changes every step); else slot 1 += n at the offset given
            add_at, at = ((counted[0], 1, n, 0), 0) if staged else ((counted[0], 1, n), t0)
        b, cbs = st.buffers, self.codebooks
        args = (xk3, xv3, b["k_codes"], b["k_scales"], b["v_codes"], b["v_scales"], at, cbs["k"], cbs["v"])
        if self.rotation == "head":
            codes = [self._vq_cents.get(name, cbs[name]) for name in ("k", "v")]
            quantize_head_pair_into(*args[:7], *codes, self.unbiased, add_at=add_at,
                                    base16=self._norm8_base16(st) if self._norm8 else None)
        else:
            quantize_pair_into(*args, self.outlier, unbiased=self.unbiased, add_at=add_at)
        if counted is not None:  # the launch advanced the device's count
            counted[1] += n

    def _device_count(self, st: LayerState, like: Any, t0: int) -> list | None:
        """The layer's device step state, ``[state, count, count view]``: int32 ``[2]``, slot 1
        the compressed-token count (``t0``; ``count`` its host mirror, ``count view`` slot 1
        as an array ``[1]``) and slot 0 the count before the step, which the store's launch
        copies from slot 1 and the pair quantization's launch reads as its offset while it
        writes the new count to slot 1; the attention then reads slot 1.  No launch reads a
        slot it writes, and none of them takes an argument that changes every step (a CUDA
        graph replays a launch's arguments, issue 27).  ``None`` on the host.  Uploaded only
        when the mirror is not ``t0`` (the layer's first such step, or one after a store op
        by op): a steady step moves nothing."""
        if isinstance(like, np.ndarray):
            return None
        hit = st.scratch.get("n_comp_dev")
        if hit is None or hit[1] != t0:
            state = _backend.empty(like, (2,), np.int32) if hit is None else hit[0]
            if _backend.xp_of(state) is None:
                state.copy_to_device(np.array([t0, t0], np.int32))
            else:
                state[...] = t0
            hit = st.scratch["n_comp_dev"] = [state, t0, state[1:2]]
        return hit

    def _store_window8_head(self, st: LayerState, k: Any, v: Any, plan: Any, sinks: int, n_sink: int,
                            n_comp: int) -> bool:
        """The store of a small step (a decode step) in one serial call
        (:func:`~numba_kv.ops.window8.window8_head_step`) when it applies: NumPy float32
        inputs, an int8 window, the whole-head quantizer without channel split (the scalar or
        the VQ code on either side, binary16 or 8-bit norms), a key mean already frozen (if
        any) and an 8-bit grid already fixed (if any).  The call also writes the exact
        tokens' positions for the attention that follows (:meth:`ExactWindow.positions` then
        finds them current).
        Returns whether it stored (else the caller stores op by op, with the same bytes)."""
        if not self._window8_head or type(k) is not np.ndarray or type(v) is not np.ndarray:
            return False
        bufs = st.buffers
        kex = bufs["k_exact"]
        # (the builtin dtypes are singletons: an identity test, else the op-by-op path)
        if type(kex) is not np.ndarray or kex.dtype is not _I8:
            return False
        if k.dtype is not _F32 or v.dtype is not _F32 or not (k.flags.c_contiguous and v.flags.c_contiguous):
            return False
        b, h, n, d = k.shape
        if b * h * n * d >= _config.get("cpu_parallel_min_work"):
            return False  # a prefill: the parallel quantizer, op by op
        kmean = None
        if self.config.key_center:
            if not st.meta.get("kmean_set", 0):
                return False  # the first chunk sets the mean (op by op)
            kmean = bufs["k_chmean"]
        if self._norm8 and "norm8_base" not in st.meta:
            return False  # the first store fixes the 8-bit grid (op by op)
        win = self._window
        n_sink += plan.sinks
        n_win = plan.keep_old + plan.keep_new
        pos_counts = (n_sink, sinks + n_comp + plan.compressed, n_win)
        pos = win.position_buffer(st, k, n_sink + n_win)
        # the arguments that stay put, once per buffer set (the buffer dict is replaced as a whole)
        hit = st.scratch.get("window8_args")
        if hit is None or hit[0] is not bufs or hit[1] is not pos:
            windows = (kex, bufs["k_exact_scale"], bufs["v_exact"], bufs["v_exact_scale"], win.rot_code, win.rot_signs,
                       self._head_signs)
            stores = (self.config.unbiased, bufs["k_codes"], bufs["k_scales"], bufs["v_codes"], bufs["v_scales"], pos)
            codes = [self._vq_cents.get(name, self.codebooks[name]) for name in ("k", "v")]
            static = (window8_head_args(*windows, *codes, *stores) if not (self._vq_cents or self._norm8) else
                      window8_codes_args(*windows, *codes, *stores, self._norm8))
            hit = st.scratch["window8_args"] = (bufs, pos, static)
        window8_head_step(k, v, kmean, plan, sinks, st.seq_len, n_comp, pos_counts, hit[2], self._norm8_base16(st))
        st.scratch["exact_pos_of"] = pos_counts
        return True

    def _rotate_queries(self, q3: Any, out: Any = None) -> Any:
        """``q3`` ``[n_g, rows, d]`` rotated like the compressed tokens (whole head or per
        32-block), into ``out`` (same shape, C-contiguous float32) when given (whole-head only)."""
        # q was validated by decode (finite, |q| <= 2**64): its rotation fits float32, so the
        # internal entries (no second validation, no host round trip) suffice
        q2 = q3.reshape(-1, self.head_dim)
        if self._head_signs is None:
            return rotate32_rows(q2).reshape(tuple(q3.shape))
        if out is not None:
            rotate_head_rows(q2, False, out.reshape(q2.shape))
            return out
        return rotate_head_rows(q2).reshape(tuple(q3.shape))

    def _qjl_args(self, st: LayerState, q3: Any) -> Any:
        """``(sq, signs, norms, const)`` for the fused kernel's QJL correction (TurboQuant)."""
        return None

    def _fuses(self) -> bool:
        """``decode_output="fused"``: decode returns ``Fused`` (and takes ``out=``)."""
        return self._fused

    def _decode_output(self, st: LayerState, q: Any, config: AttendConfig, dtype: Any, out: Any = None) -> DecodeOutput:
        if not self._fused:
            return super()._decode_output(st, q, config, dtype)
        b, hq, ql, d = map(int, q.shape)
        hkv = self.num_kv_heads
        views = st.scratch.setdefault("views", {})  # the same views of the same arrays (issue 27)
        q3 = _backend.same_view(views, "q", _backend.ascontiguous_f32("q", q),
                                lambda a: a.reshape(b * hkv, (hq // hkv) * ql, d))
        outliers = self.config.outlier_channels
        if outliers:
            q3 = self._query_in(st, q3)
        bias = None if st.window is None else self._window_bias(st, q)
        qjl = self._qjl_args(st, q3)
        bound = self._fused_step(st, q3, bias is not None, qjl is not None)
        rotate = bound.rotate
        if rotate is None:  # (a step bound without its rotation, as tests/caches/test_fused.py does: op by op)
            qr = self._rotate_queries(q3, bound.qr)
        else:  # the step rotates the queries into the layer's buffer (on the host one compiled call where small)
            qr = bound.qr
            rotate = (rotate[0], _backend.same_view(views, "q2", q3, lambda a: a.reshape(-1, d)), rotate[2])
        meta = st.meta
        n_exact = meta.get("n_sink", 0) + meta.get("n_win", 0) if self._windowed else 0
        # a rotated int8 window is attended in the rotated domain, like the compressed tokens:
        # q·k = Rq·Rk and the merge rotates its values back once per query row, instead of
        # rotating every window token back on every step
        # the caller's float32 ``out`` (checked by decode) is the kernel's own output: no
        # allocation (issue 27); an output permuted or converted afterwards is copied into it
        direct = out is not None and not outliers and np.dtype(dtype) == _F32
        # one query per KV row and head is the step's last token: it sees every stored token,
        # so on a device the kernel gets no causal rule and no query position, an argument
        # that would change every step (a CUDA graph replays a launch's arguments, issue 27);
        # the same scores either way (the rule masks nothing here)
        unmasked = ql == 1 and not isinstance(q3, np.ndarray)
        n_comp = meta.get("n_comp", 0)
        out3 = _backend.same_view(views, "out", out, lambda a: a.reshape(tuple(q3.shape))) if direct else None
        # the count as this step's quantization left it on the device (_device_count), if so
        counted = st.scratch.get("n_comp_dev")
        res = bound.step.run(qr, qr if bound.rot else q3, n_comp, n_exact,
                             0 if unmasked else st.seq_len - ql, ql, config.softmax_scale, bias, qjl,
                             causal=not unmasked, rotate=rotate, out=out3,
                             n_comp_dev=counted[2] if counted is not None and counted[1] == n_comp else None)
        if outliers:
            xp = _backend.xp_of(res)
            res = xp.take_along_axis(res, xp.argsort(st.buffers["v_perm"].astype(np.int64), axis=2), axis=2)
        if out is None:
            return Fused(self._reshape_q(res, b, hq, ql, dtype))
        if not direct:
            res = self._reshape_q(res, b, hq, ql, dtype)
            if _backend.xp_of(out) is None:  # a Numba device array: a device-to-device copy
                out.copy_to_device(res)
            else:
                out[...] = res
        return Fused(out)

    def _fused_step(self, st: LayerState, q3: Any, has_bias: bool, has_qjl: bool) -> _FusedStep:
        """The layer's fused attention step for queries shaped like ``q3``: its
        :class:`~numba_kv.ops.attention.FlatStep` (the layer's arrays bound to the plan of
        this shape), whether the window is attended rotated, and a buffer for the rotated
        queries.  Kept in the layer's scratch (used under the layer's lock: nothing in it is
        shared with another layer or thread) and built again when the layer's buffers, its
        position buffer or the query shape change.  The exact positions of this step are
        written (if they changed) on the way."""
        pos = self._exact_positions(st, q3)
        n_g, rows = int(q3.shape[0]), int(q3.shape[1])
        key = (n_g, rows, has_bias, has_qjl)
        hit = st.scratch.get("fused_step")
        host = isinstance(q3, np.ndarray)
        if hit is not None and hit.buffers is st.buffers and hit.pos is pos and hit.key == key:
            if host:
                return hit
        plan = attention_plan(q3, paged=False, n_g=n_g, rows=rows, d=self.head_dim, klayout=self.layouts["k"],
                              vlayout=self.layouts["v"], v_width=int(st.buffers["v_codes"].shape[2]),
                              has_bias=has_bias, has_qjl=has_qjl)
        if hit is not None and hit.buffers is st.buffers and hit.pos is pos and hit.key == key \
                and hit.step.plan is plan:
            return hit  # (on a GPU the plan also follows the CUDA knobs: asked for every step)
        bufs = st.buffers
        rot = False
        kes = ves = None
        if self._windowed:  # the kernel reads the window in its stored dtype: no float32 copy per step
            rot = self._window.stored_rotated(st)
            ke, kes, _ = self._window.exact_stored(st, "k")
            ve, ves, _ = self._window.exact_stored(st, "v")
        else:
            ke, _ = self._exact_f32(st, "k")
            ve, _ = self._exact_f32(st, "v")
        hs = None if self._head_signs is None else _backend.constant(q3, self._head_signs)
        step = plan.bind_flat(bufs["k_codes"], bufs["k_scales"], bufs["v_codes"], bufs["v_scales"], self._sinks(st),
                              ke, ve, pos, head_signs=hs, exact_rotated=rot,
                              exact_scales=None if kes is None else (kes, ves),
                              scale_table=self._norm8_scale_table(st, q3))
        # either rotation into a reused buffer, with the signs the op-by-op rotations use (on a
        # device too: a step allocates no rotated queries)
        rotate = (ROTATE_BLOCK, None, _backend.constant(q3, SIGNS32)) if hs is None else \
            (ROTATE_HEAD, None, _backend.constant(q3, head_signs(self.head_dim)))
        qr = _backend.empty(q3, (n_g, rows, self.head_dim), np.float32)
        bound = st.scratch["fused_step"] = _FusedStep(bufs, pos, key, step, rot, qr, rotate)
        return bound

    def _reshape_q(self, out: Any, b: int, hq: int, ql: int, dtype: Any) -> Any:
        res = out.reshape(b, hq, ql, self.head_dim)
        if dtype is not _F32 and np.dtype(dtype) != np.dtype(res.dtype):
            res = finite_astype(res, dtype)  # (a mean of reconstructions may overshoot a float16 input's ±65504)
        return res
