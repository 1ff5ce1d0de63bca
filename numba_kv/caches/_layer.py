"""Per-layer storage, locking and validation shared by every cache.

A cache is a list of :class:`LayerState` objects.  Each layer owns its buffers
(``[batch·num_kv_heads, capacity, width]``, allocated on the device of the first input),
its ``threading.Lock`` and its ``seq_len``.  Buffers grow by the rule of turboquant-rs
(``needed + max(needed // 4, 128)``).  Every argument is validated before storage is
touched, so a call that raises leaves the cache exactly as it was.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .. import _backend, _config
from .._validate import (F32_MAX, check_head_dim, check_int, check_kv_stats, check_layer, check_magnitude,
                         check_q)
from ..ops.finite import RangeStats
from ..ops.memory import copy_prefix
from ._lifecycle import LifecycleMixin
from .protocol import AttendConfig, DecodeOutput, Dequantized, DequantResult

# name -> (width, dtype, fixed_capacity); fixed_capacity None = grows with the sequence
BufferSpec = Dict[str, Tuple[int, Any, Optional[int]]]


@dataclass
class LayerState:
    """Storage of one layer: buffers ``[rows, capacity, width]`` plus bookkeeping."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    seq_len: int = 0
    batch: Optional[int] = None
    device: Optional[str] = None
    capacity: int = 0
    buffers: Dict[str, Any] = field(default_factory=dict)
    # live tokens per buffer when it differs from seq_len (e.g. compressed vs window)
    live: Dict[str, int] = field(default_factory=dict)
    # cache-specific counters (compressed tokens, sinks, window), reset with the layer
    meta: Dict[str, int] = field(default_factory=dict)

    def live_count(self, name: str) -> int:
        """Live tokens of buffer ``name``."""
        return self.live.get(name, self.seq_len)

    def live_arrays(self) -> List[Any]:
        """Views ``buf[:, :live]`` of every buffer (what ``memory_usage`` counts)."""
        return [b[:, : self.live_count(n)] for n, b in self.buffers.items()]

    def live_bytes(self) -> int:
        """Exact bytes of live data (rows × live tokens × width × itemsize, summed)."""
        total = 0
        for n, b in self.buffers.items():
            total += int(b.shape[0]) * self.live_count(n) * int(b.shape[2]) * np.dtype(b.dtype).itemsize
        return total

    def allocated_bytes(self) -> int:
        """Bytes of all allocated buffers (capacity, not just live tokens)."""
        return sum(int(b.size) * np.dtype(b.dtype).itemsize for b in self.buffers.values())


def grown_capacity(needed: int) -> int:
    """Capacity after growth: ``needed + max(needed·growth_fraction, growth_min_extra)``."""
    extra = max(int(needed * _config.get("growth_fraction")), int(_config.get("growth_min_extra")))
    return needed + extra


class LayeredCache(LifecycleMixin):
    """Base of all caches: validation, per-layer locks, growth, protocol bookkeeping.

    Subclasses define :meth:`_buffer_spec`, :meth:`_store` and :meth:`_history`.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_layers = check_int("num_layers", num_layers, minimum=1)
        self.num_kv_heads = check_int("num_kv_heads", num_kv_heads, minimum=1)
        self.head_dim = check_head_dim(head_dim)
        self._layers = [LayerState() for _ in range(self.num_layers)]

    # -- subclass hooks -------------------------------------------------------------------
    def _buffer_spec(self) -> BufferSpec:
        raise NotImplementedError

    def _store(self, st: LayerState, k: Any, v: Any) -> None:
        """Write the new tokens at ``[:, st.seq_len : st.seq_len + S]`` (capacity ensured)."""
        raise NotImplementedError

    def _history(self, st: LayerState, dtype: Any) -> Tuple[Any, Any]:
        """Full K/V history ``[batch, num_kv_heads, seq_len, head_dim]`` in ``dtype``."""
        raise NotImplementedError

    # -- helpers --------------------------------------------------------------------------
    def _validate(self, layer: Any, k: Any, v: Any, q: Any, config: Optional[AttendConfig],
                  need_q: bool) -> Tuple[int, str, Tuple[RangeStats, RangeStats]]:
        layer = check_layer(layer, self.num_layers)
        st = self._layers[layer]
        batch = st.batch if st.seq_len > 0 else None
        dev, sk, sv = check_kv_stats(k, v, self.num_kv_heads, self.head_dim, batch=batch)
        if st.seq_len > 0 and st.device != dev:
            raise ValueError(f"k is on {dev} but layer {layer} stores its tokens on {st.device}")
        if config is not None and not isinstance(config, AttendConfig):
            raise TypeError(f"config: expected an AttendConfig, got {type(config).__name__}")
        if q is not None or need_q:
            if q is None:
                raise ValueError("q: expected an array [batch, num_heads, q_len, head_dim], got None")
            check_q(q, k.shape[0], self.num_kv_heads, self.head_dim,
                    None if config is None else config.n_kv_groups, q_len=k.shape[2], device=dev)
        return layer, dev, (sk, sv)

    def _check_range(self, st: LayerState, k: Any, v: Any, stats: Tuple[RangeStats, RangeStats]) -> None:
        """``ValueError`` (naming ``k`` or ``v`` and the limit) if the cache cannot store the
        values faithfully.  Runs under the layer's lock, before anything is stored.  The base
        class stores float32 (``F32_MAX`` bounds float64 input)."""
        for name, rs in zip(("k", "v"), stats):
            check_magnitude(name, rs.amax, F32_MAX, "float32 storage")

    def _growing_needed(self, st: LayerState, new_tokens: int) -> int:
        """Capacity the growing buffers need after storing ``new_tokens`` more."""
        return st.seq_len + new_tokens

    def _ensure_capacity(self, st: LayerState, like: Any, batch: int, needed: int) -> None:
        if needed <= st.capacity and st.buffers:
            return
        cap = grown_capacity(needed)
        rows = batch * self.num_kv_heads
        new = {}
        for name, (width, dtype, fixed) in self._buffer_spec().items():
            if fixed is not None and name in st.buffers:
                new[name] = st.buffers[name]  # fixed-size buffers never move
                continue
            new[name] = _backend.zeros(like, (rows, fixed if fixed is not None else cap, width), dtype)
            if name in st.buffers and st.live_count(name):
                if np.dtype(dtype) == np.float16:  # no float16 in Numba's CPU kernels (NumPy/CuPy only)
                    new[name][:, : st.live_count(name)] = st.buffers[name][:, : st.live_count(name)]
                else:
                    copy_prefix(st.buffers[name], st.live_count(name), new[name])
        st.buffers = new
        st.capacity = cap

    def _append(self, st: LayerState, dev: str, k: Any, v: Any) -> int:
        """Grow if needed, store, advance ``seq_len``; return the old length."""
        old = st.seq_len
        batch = int(k.shape[0])
        if old == 0 and st.buffers and (st.batch != batch or st.device != dev):
            st.buffers, st.capacity = {}, 0  # batch or device changed after reset
        self._ensure_capacity(st, k, batch, self._growing_needed(st, int(k.shape[2])))
        self._store(st, k, v)
        st.batch, st.device = batch, dev
        st.seq_len = old + int(k.shape[2])
        return old

    # -- protocol -------------------------------------------------------------------------
    def prefill(self, layer: int, k: Any, v: Any, q: Any = None) -> DequantResult:
        """Store ``k``/``v`` ``[batch, num_kv_heads, new_tokens, head_dim]``.

        Returns the original ``k``/``v`` if the layer was empty (lossless prompt
        attention), otherwise the full dequantized history ``[batch, num_kv_heads,
        old + new_tokens, head_dim]`` in the dtype of ``k``.  ``q`` (optional,
        ``[batch, num_heads, new_tokens, head_dim]``) is validated but not needed here.
        """
        layer, dev, stats = self._validate(layer, k, v, q, None, need_q=False)
        st = self._layers[layer]
        with st.lock:
            self._check_range(st, k, v, stats)
            old = self._append(st, dev, k, v)
            if old == 0:
                return DequantResult(k, v)
            return self._prefill_result(st, q, k.dtype)

    def _prefill_result(self, st: LayerState, q: Any, dtype: Any) -> DequantResult:
        """What a prefill into a non-empty layer returns (default: the full history)."""
        hk, hv = self._history(st, dtype)
        return DequantResult(hk, hv)

    def decode(self, layer: int, k: Any, v: Any, q: Any, config: AttendConfig) -> DecodeOutput:
        """Store the new token(s), then attend (``Fused``) or return the full history
        (``Dequantized``) for the caller's SDPA, depending on the cache.

        ``q`` is ``[batch, num_heads, new_tokens, head_dim]``; ``config.n_kv_groups`` must
        equal ``num_heads // num_kv_heads``.  New query ``i`` sees the stored tokens and
        the new tokens ``0..i`` (causal).
        """
        if not isinstance(config, AttendConfig):
            raise TypeError(f"config: expected an AttendConfig, got {type(config).__name__}")
        layer, dev, stats = self._validate(layer, k, v, q, config, need_q=True)
        st = self._layers[layer]
        with st.lock:
            self._check_range(st, k, v, stats)
            self._append(st, dev, k, v)
            return self._decode_output(st, q, config, k.dtype)

    def _decode_output(self, st: LayerState, q: Any, config: AttendConfig, dtype: Any) -> DecodeOutput:
        """What ``decode`` returns once the tokens are stored (default: the full history)."""
        hk, hv = self._history(st, dtype)
        return Dequantized(DequantResult(hk, hv))

    def seq_len(self, layer: int) -> int:
        """Tokens stored for ``layer`` (``IndexError`` if out of range)."""
        layer = check_layer(layer, self.num_layers)
        return self._layers[layer].seq_len

    def reset(self) -> None:
        """Drop every layer's tokens and buffers."""
        for st in self._layers:
            with st.lock:
                st.buffers, st.capacity, st.seq_len, st.batch, st.device = {}, 0, 0, None, None
                st.live, st.meta = {}, {}

    def memory_usage(self) -> int:
        """Exact bytes of live stored data, summed over layers."""
        total = 0
        for st in self._layers:
            with st.lock:
                total += st.live_bytes()
        return total

    def allocated_bytes(self) -> int:
        """Bytes of all allocated buffers (capacity), summed over layers."""
        total = 0
        for st in self._layers:
            with st.lock:
                total += st.allocated_bytes()
        return total

    def live_arrays(self, layer: int) -> List[Any]:
        """Views of the live part of every buffer of ``layer`` (for inspection and tests)."""
        layer = check_layer(layer, self.num_layers)
        st = self._layers[layer]
        with st.lock:
            return st.live_arrays()

    def fp16_bytes(self) -> int:
        """Bytes the live tokens would take as an uncompressed float16 K/V cache."""
        total = 0
        for st in self._layers:
            if st.seq_len:
                total += 2 * st.batch * self.num_kv_heads * st.seq_len * self.head_dim * 2
        return total

    def _reshape_out(self, flat: Any, batch: int, dtype: Any) -> Any:
        out = flat.reshape(batch, self.num_kv_heads, flat.shape[1], self.head_dim)
        if np.dtype(dtype) != np.dtype(out.dtype):
            out = out.astype(dtype)
        return out
