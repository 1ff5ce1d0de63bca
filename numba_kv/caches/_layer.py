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
from typing import Any, TypeVar

import numpy as np

from .. import _backend, _config
from .._validate import (
    F32_MAX,
    Q_MAX,
    check_head_dim,
    check_int,
    check_kv_shapes,
    check_layer,
    check_magnitude,
    check_out,
    check_q_shape,
)
from ..ops.finite import RangeStats, check_finite_stats
from ..ops.gather import to_like
from ..ops.memory import copy_prefix, copy_tokens
from ._format import host_copy
from ._lifecycle import LifecycleMixin
from ._steady import SteadyStepMixin
from ._values import ValueChecks
from .protocol import AttendConfig, DecodeOutput, Dequantized, DequantResult
from .state import CacheFileError, CacheState, check_declared_sizes, expect_int

# name -> (width, dtype, fixed_capacity); fixed_capacity None = grows with the sequence
BufferSpec = dict[str, tuple[int, Any, int | None]]
_Cache = TypeVar("_Cache", bound="LayeredCache")  # from_state_dict's class

#: the per-layer counters a layered cache's state may hold (``LayerState.meta``)
STATE_COUNTERS = ("n_comp", "n_sink", "n_win", "n_evicted", "kmean_set", "kperm_set", "vperm_set", "norm8_base")


@dataclass
class LayerState:
    """Storage of one layer: buffers ``[rows, capacity, width]`` plus bookkeeping."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    seq_len: int = 0
    batch: int | None = None
    device: str | None = None
    capacity: int = 0
    buffers: dict[str, Any] = field(default_factory=dict)
    # live tokens per buffer when it differs from seq_len (e.g. compressed vs window)
    live: dict[str, int] = field(default_factory=dict)
    # cache-specific counters (compressed tokens, sinks, window, evicted), reset with the layer
    meta: dict[str, int] = field(default_factory=dict)
    # sliding window of the layer (None: global attention); configuration, not state
    window: int | None = None
    # reusable device scratch (e.g. exact-token positions), never counted as stored data
    scratch: dict[str, Any] = field(default_factory=dict)
    # the deferred range records of the call in progress (``validate="deferred"``) not launched
    # yet: a store kernel that runs anyway folds them in (issue 27), else ``decode`` launches
    # them before it returns; set and cleared under the layer's lock
    range_pending: list | None = None

    @property
    def evicted(self) -> int:
        """Tokens dropped from the front of a sliding layer (absolute position of the first
        stored token)."""
        return self.meta.get("n_evicted", 0)

    @property
    def total_len(self) -> int:
        """Tokens the layer has seen: stored plus evicted."""
        return self.seq_len + self.evicted if self.seq_len else 0

    def live_count(self, name: str) -> int:
        """Live tokens of buffer ``name``."""
        return self.live.get(name, self.seq_len)

    def live_arrays(self) -> list[Any]:
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


def check_kv_stats(k: Any, v: Any, num_kv_heads: int, head_dim: int,
                   batch: int | None = None) -> tuple[str, RangeStats, RangeStats]:
    """Validate a K/V pair ``[batch, num_kv_heads, new_tokens, head_dim]`` (shapes, then
    values); return the device and the :func:`~numba_kv.ops.finite.range_stats` of ``k``
    and ``v`` (one read of each: the finiteness check and the range numbers)."""
    dev = check_kv_shapes(k, v, num_kv_heads, head_dim, batch)
    return dev, check_finite_stats("k", k), check_finite_stats("v", v)


def check_q_values(q: Any) -> None:
    """``ValueError`` unless query ``q`` is finite and ``|q| <= 2**64``."""
    # logits q·k must stay finite in float32: stored keys are at most 2**21 per value (larger
    # ones are rejected by the compressed caches), head_dim <= 512, so |q| <= 2**64 keeps
    # |q·k| <= 2**96, far below float32's 2**128
    check_magnitude("q", check_finite_stats("q", q).amax, Q_MAX,
                    "a query (logits must stay finite in float32)")


#: Logit bias that hides a token from a query (finite: the fused op rejects non-finite
#: biases; exp(-1e30 - m) is exactly 0 in float32 for any finite logit m).
MASKED_LOGIT = -1.0e30


def check_sliding_window(sliding_window: Any, num_layers: int) -> list[int | None]:
    """Per-layer sliding windows from the user's ``sliding_window`` argument.

    ``None`` (every layer global), an int (every layer slides), a sequence of ``num_layers``
    entries (int or None, e.g. a model's ``layer_windows`` / HF ``layer_types`` resolved),
    or a dict ``{layer: window}`` (negative layers count from the end; layers not named are
    global).  Windows are ints >= 2.
    """
    def one(where: str, w: Any) -> int | None:
        if w is None:
            return None
        return check_int(where, w, minimum=2)

    if sliding_window is None:
        return [None] * num_layers
    if isinstance(sliding_window, dict):
        out: list[int | None] = [None] * num_layers
        seen: dict[int, Any] = {}
        for key, w in sliding_window.items():
            idx = resolve_layer("sliding_window", key, num_layers)
            if idx in seen:  # (0 and -num_layers: one layer, as layer_overrides / head_overrides say)
                raise ValueError(f"sliding_window: layer {idx} is given twice ({seen[idx]!r} and {key!r})")
            seen[idx] = key
            out[idx] = one(f"sliding_window[{key!r}]", w)
        return out
    if isinstance(sliding_window, (list, tuple)):
        if len(sliding_window) != num_layers:
            raise ValueError(f"sliding_window: expected {num_layers} per-layer entries (int or None), "
                             f"got {len(sliding_window)}")
        return [one(f"sliding_window[{i}]", w) for i, w in enumerate(sliding_window)]
    w = one("sliding_window", sliding_window)
    return [w] * num_layers


def check_layer_holds(st: LayerState, k: Any, dev: str) -> None:
    """Under the layer's lock: ``ValueError`` naming ``k`` unless the layer is empty or still
    holds ``k``'s batch size on ``k``'s device.  ``_validate`` checked that without the lock;
    a call on the same layer from another thread may have stored since, and a store of
    another batch size writes past the buffers' rows (a crash of the compressing kernels)."""
    if st.seq_len and (st.batch != int(k.shape[0]) or st.device != dev):
        raise ValueError(f"k: expected batch={st.batch} on {st.device} (this layer stores them: another call "
                         f"stored since this one was checked), got shape {tuple(k.shape)} on {dev}; nothing was stored")


def finite_astype(a: Any, dtype: Any) -> Any:
    """``a.astype(dtype)`` saturating at the largest finite value of a narrower float ``dtype``
    instead of overflowing to ±inf: ``MASKED_LOGIT`` in float16, and a reconstruction that
    overshoots the input's range (a float16 input of ±65504 dequantizes to a few per cent more).

    NumPy and CuPy arrays are converted in their namespace; a Numba device array (which has
    no ``astype`` or ufuncs) through the host, and only when the dtype changes."""
    dt = np.dtype(dtype)
    xp = _backend.xp_of(a)
    if xp is None:
        return a if np.dtype(a.dtype) == dt else to_like(a, finite_astype(_backend.to_host(a), dt))
    src = np.dtype(a.dtype)
    if dt.kind == "f" and src.kind == "f" and dt.itemsize < src.itemsize:
        lim = float(np.finfo(dt).max)
        a = xp.clip(a, -lim, lim)
    return a.astype(dt)


def add_bias(a: Any, b: Any) -> Any:
    """``a + b`` of two logit biases of one shape on one device (for Numba device arrays,
    which have no arithmetic, through the host)."""
    if _backend.xp_of(a) is None:
        return to_like(a, _backend.to_host(a) + _backend.to_host(b))
    return a + b


def resolve_layer(where: str, key: Any, num_layers: int) -> int:
    """A layer index of a per-layer mapping (``-1`` = last layer) -> ``0 .. num_layers-1``."""
    if isinstance(key, (bool, np.bool_)) or not isinstance(key, (int, np.integer)):
        raise TypeError(f"{where}: layer keys must be ints, got {type(key).__name__} {key!r}")
    idx = int(key) + num_layers if key < 0 else int(key)
    if not 0 <= idx < num_layers:
        raise ValueError(f"{where}: layer {key} is out of range for {num_layers} layers "
                         f"(expected {-num_layers} .. {num_layers - 1})")
    return idx


def shift_front(buf: Any, e: int, n: int) -> None:
    """``buf[:, :n-e] = buf[:, e:n]`` through a temporary (the ranges overlap; CuPy and Numba
    device arrays do not promise overlapping copies)."""
    m = n - e
    if e <= 0 or m <= 0:
        return
    xp = _backend.xp_of(buf)
    if xp is not None:
        buf[:, :m] = buf[:, e:n].copy()
        return
    tmp = _backend.empty(buf, (buf.shape[0], m, buf.shape[2]), buf.dtype)
    copy_tokens(buf, e, m, tmp, 0)
    copy_tokens(tmp, 0, m, buf, 0)


def moved_buffer(old: Any, live: int, like: Any, shape: tuple[int, int, int], dtype: Any) -> Any:
    """A new zeroed buffer ``shape`` on the device of ``like`` holding the first ``live``
    tokens of ``old`` (storage growth; ``old`` may be ``None`` when ``live`` is 0)."""
    new = _backend.zeros(like, shape, dtype)
    if live:
        if np.dtype(dtype) == np.float16:  # no float16 in Numba's CPU kernels (NumPy/CuPy only)
            new[:, :live] = old[:, :live]
        else:
            copy_prefix(old, live, new)
    return new


def growth_knobs() -> tuple[float, int]:
    """``(growth_fraction, growth_min_extra)``: the growth rule's knobs, read now (``ValueError``
    naming a bad one).  ``prefill`` and ``decode`` read them before they store anything, since
    a store grows buffers midway (a window's exact tokens, the position buffer); cheap:
    :func:`numba_kv._config.get` parses an environment value once."""
    return _config.get("growth_fraction"), _config.get("growth_min_extra")


def grown_capacity(needed: int) -> int:
    """Capacity after growth: ``needed + max(needed·growth_fraction, growth_min_extra)``."""
    fraction, min_extra = growth_knobs()
    return needed + max(int(needed * fraction), int(min_extra))


class LayeredCache(SteadyStepMixin, LifecycleMixin, ValueChecks):
    """Base of all caches: validation, per-layer locks, growth, protocol bookkeeping.

    Subclasses define :meth:`_buffer_spec`, :meth:`_store`, :meth:`_history` and
    :meth:`_evict`.

    Sliding-window layers (``sliding_window``, see :func:`check_sliding_window`): a layer
    with window ``W`` lets the query at position ``p`` see the keys ``p − W < j <= p`` (the
    Gemma / Mistral / HF convention: ``W`` keys, itself included).  Before new tokens are
    stored, the layer evicts from the front everything but its ``W − 1`` newest tokens (what
    the first new query can still see), so it holds at most ``W − 1 + T`` tokens after a
    call with ``T`` new tokens (``W`` after a one-token decode: exactly the visible ones)
    and ``memory_usage`` counts only those.  Eviction shifts the stored rows down (one read
    and write of the ``W − 1`` kept tokens' compressed bytes per call).  ``seq_len(layer)``
    stays the number of tokens the layer has *seen* (positions), not stored.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, sliding_window: Any = None) -> None:
        n = check_int("num_layers", num_layers, minimum=1)
        self._init_geometry(n, check_int("num_kv_heads", num_kv_heads, minimum=1), check_head_dim(head_dim),
                            check_sliding_window(sliding_window, n))

    def _init_geometry(self, num_layers: int, num_kv_heads: int, head_dim: int,
                       layer_windows: list[int | None]) -> None:
        """Geometry and empty layers from values validated already (by ``__init__`` or by a
        configuration object, which validates them once)."""
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.layer_windows = list(layer_windows)
        self._layers = [LayerState(window=w) for w in self.layer_windows]

    # -- subclass hooks -------------------------------------------------------------------
    def _buffer_spec(self) -> BufferSpec:
        raise NotImplementedError

    def _store(self, st: LayerState, k: Any, v: Any) -> None:
        """Write the new tokens at ``[:, st.seq_len : st.seq_len + S]`` (capacity ensured)."""
        raise NotImplementedError

    def _history(self, st: LayerState, dtype: Any) -> tuple[Any, Any]:
        """Stored K/V history ``[batch, num_kv_heads, seq_len, head_dim]`` in ``dtype``
        (never a view of the buffers: eviction shifts them in place)."""
        raise NotImplementedError

    def _evict(self, st: LayerState, e: int) -> None:
        """Drop the ``e`` oldest stored tokens (``0 < e < st.seq_len``): shift the rest to the
        front and lower ``st.seq_len``.  Called under the layer's lock."""
        raise NotImplementedError

    def _window_config(self) -> dict[str, Any]:
        """``{"sliding_window": [...]}`` for ``config_dict`` if any layer slides."""
        if any(w is not None for w in self.layer_windows):
            return {"sliding_window": list(self.layer_windows)}
        return {}

    def _slide(self, st: LayerState) -> None:
        """Evict all but the ``window − 1`` newest tokens of a sliding layer."""
        if st.window is None or not st.seq_len:
            return
        e = st.seq_len - (st.window - 1)
        if e > 0:
            self._evict(st, e)
            st.meta["n_evicted"] = st.meta.get("n_evicted", 0) + e

    def _window_bias(self, st: LayerState, q: Any) -> Any:
        """Sliding mask of the queries of the tokens just stored, as a finite logit bias
        ``[batch·num_kv_heads, G·q_len, seq_len]`` float32 (``MASKED_LOGIT`` on keys older
        than each query's window), or ``None`` when no stored key is out of any window."""
        b, hq, ql, _ = (int(s) for s in q.shape)
        s = st.seq_len
        if st.window is None or s - 1 - st.window < 0:  # the last query sees every stored key
            return None
        qpos = np.arange(s - ql, s)
        mask = np.arange(s)[None, :] <= qpos[:, None] - st.window  # [ql, s]
        row = np.where(mask, np.float32(MASKED_LOGIT), np.float32(0.0)).astype(np.float32)
        g = hq // self.num_kv_heads
        bias = np.broadcast_to(row[None, None], (b * self.num_kv_heads, g, ql, s)).reshape(
            b * self.num_kv_heads, g * ql, s)
        return to_like(q, bias)

    # -- helpers --------------------------------------------------------------------------
    def _validate(self, layer: Any, k: Any, v: Any, q: Any, config: AttendConfig | None,
                  need_q: bool, out: Any = None,
                  pending: list | None = None) -> tuple[int, str, tuple[RangeStats, RangeStats] | None]:
        """Check the arguments (``out``: a decode's output array, when given); return the
        layer, the device and the range statistics of ``k``/``v`` (``None`` when values are
        not checked synchronously).  ``pending`` (a list): the deferred range records are
        appended to it instead of launched (the caller folds or launches them)."""
        layer = check_layer(layer, self.num_layers)
        growth_knobs()  # a bad knob raises now, not from a growth after the store began
        st = self._layers[layer]
        batch = st.batch if st.seq_len > 0 else None
        dev = check_kv_shapes(k, v, self.num_kv_heads, self.head_dim, batch=batch)
        self._check_device_inputs(k, v)  # (the store converts them after a sliding layer evicted)
        mode = self._value_mode(dev)
        stats = None
        if mode == "sync":
            stats = (check_finite_stats("k", k), check_finite_stats("v", v))
        if st.seq_len > 0 and st.device != dev:
            raise ValueError(f"k: expected an array on {st.device}, where this layer stores its tokens, "
                             f"got one on {dev}")
        if config is not None and not isinstance(config, AttendConfig):
            raise TypeError(f"config: expected an AttendConfig, got {type(config).__name__}")
        q_now = False
        if q is not None or need_q:
            if q is None:
                raise ValueError("q: expected an array [batch, num_heads, q_len, head_dim], got None")
            check_q_shape(q, k.shape[0], self.num_kv_heads, self.head_dim,
                          None if config is None else config.n_kv_groups, q_len=k.shape[2], device=dev)
            q_now = mode == "sync"
        if out is not None:  # before the deferred record below: a refused call records nothing
            self._check_decode_out(out, q, k, v)
        if mode == "deferred":
            # once every shape is right: k, v (and q) recorded in one launch
            items = [("kv", k), ("kv", v)] + ([] if q is None else [("q", q)])
            if pending is None:
                ok = self._defer_many(items)
            else:
                ok, todo = self._deferred_record().plan_many(items)
                pending.extend(todo)
            if not (ok[0] and ok[1]):  # a strided Numba device array: read synchronously instead
                stats = (check_finite_stats("k", k), check_finite_stats("v", v))
            q_now = q is not None and not ok[2]
        if q_now:
            check_q_values(q)
        return layer, dev, stats

    def _check_range(self, st: LayerState, k: Any, v: Any, stats: tuple[RangeStats, RangeStats]) -> None:
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
                new[name] = st.buffers[name]  # fixed-size buffers move only when their owner grows them
                continue
            old = st.buffers.get(name)
            new[name] = moved_buffer(old, st.live_count(name) if old is not None else 0, like,
                                     (rows, fixed if fixed is not None else cap, width), dtype)
        st.buffers = new
        st.capacity = cap

    def _append(self, st: LayerState, dev: str, k: Any, v: Any) -> int:
        """Grow if needed, store, advance ``seq_len``; return the old length."""
        self._slide(st)
        old = st.seq_len
        batch = int(k.shape[0])
        if old == 0 and st.buffers and (st.batch != batch or st.device != dev):
            st.buffers, st.capacity, st.scratch = {}, 0, {}  # batch or device changed after reset
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
        old + new_tokens, head_dim]`` in the dtype of ``k``.  On a sliding-window layer the
        history is what the layer still stores (at most ``window − 1`` old tokens plus the
        new ones) and the caller applies the window mask (positions are relative: the
        last ``new_tokens`` keys are the new tokens).  ``q`` (optional,
        ``[batch, num_heads, new_tokens, head_dim]``) is validated but not needed here.
        """
        layer, dev, stats = self._validate(layer, k, v, q, None, need_q=False)
        st = self._layers[layer]
        with st.lock:
            check_layer_holds(st, k, dev)
            if stats is not None:
                self._check_range(st, k, v, stats)
            return self._prefill_checked(st, dev, k, v, q)

    def _prefill_checked(self, st: LayerState, dev: str, k: Any, v: Any, q: Any) -> DequantResult:
        """The storing half of :meth:`prefill`, for arguments already validated (``_validate``
        and ``_check_range``) under the layer's lock; a mixed cache whose layer spans several
        parts validates every part first, then calls this on each."""
        old = self._append(st, dev, k, v)
        if old == 0:
            return DequantResult(k, v)
        return self._prefill_result(st, q, k.dtype)

    def _prefill_result(self, st: LayerState, q: Any, dtype: Any) -> DequantResult:
        """What a prefill into a non-empty layer returns (default: the full history)."""
        hk, hv = self._history(st, dtype)
        return DequantResult(hk, hv)

    def decode(self, layer: int, k: Any, v: Any, q: Any, config: AttendConfig, *, out: Any = None) -> DecodeOutput:
        """Store the new token(s), then attend (``Fused``) or return the full history
        (``Dequantized``) for the caller's SDPA, depending on the cache.

        ``q`` is ``[batch, num_heads, new_tokens, head_dim]``; ``config.n_kv_groups`` must
        equal ``num_heads // num_kv_heads``.  New query ``i`` sees the stored tokens and
        the new tokens ``0..i`` (causal); on a sliding-window layer only the last
        ``window`` of those (the cache masks, or returns the mask as ``logit_bias``).

        ``out`` (keyword, optional; fused decode only): an array shaped like ``q``, of the
        dtype the output has (that of ``k``), C-contiguous, on ``q``'s device and not
        overlapping ``k``, ``v`` or ``q``.  The attention is written into it and
        ``Fused.out`` is ``out`` itself, so that a steady-state step allocates nothing
        (float32 on a GPU: the kernel writes it directly; otherwise the result is copied
        in).  Without ``out`` every call returns a new array, which the caller may keep.
        A bad ``out`` (or ``out`` for a cache that returns ``Dequantized``) raises
        ``TypeError``/``ValueError`` naming ``out`` before anything is stored.
        """
        if not isinstance(config, AttendConfig):
            raise TypeError(f"config: expected an AttendConfig, got {type(config).__name__}")
        pending: list = []  # k, v, q's deferred range records: folded into the step's store kernel
        layer, dev, stats = self._validate(layer, k, v, q, config, need_q=True, out=out, pending=pending)
        st = self._layers[layer]
        with st.lock:
            check_layer_holds(st, k, dev)  # (before the deferred records are handed over: none launch)
            st.range_pending = pending or None
            try:
                if stats is not None:
                    self._check_range(st, k, v, stats)
                return self._decode_checked(st, dev, k, v, q, config, out)
            finally:  # the records no store kernel took: launched on their own
                left, st.range_pending = st.range_pending, None
                if left:
                    self._deferred_record().launch(left)

    def _fuses(self) -> bool:
        """Whether :meth:`decode` attends itself (returns ``Fused``; ``out=`` applies)."""
        return False

    def _check_decode_out(self, out: Any, q: Any, k: Any, v: Any) -> None:
        """``TypeError``/``ValueError`` naming ``out`` unless ``decode`` can write its output
        (shaped like ``q``, the dtype of ``k``, sharing no memory with ``k``, ``v``, ``q``)
        into it (see :meth:`decode`)."""
        if not self._fuses():
            raise TypeError(f"out: {type(self).__name__} returns Dequantized (the caller runs attention): "
                            "out= takes the output of a fused decode only, got an array")
        check_out(out, tuple(q.shape), k.dtype, _backend.device_of("q", q), "the decode output (shaped like q, "
                  "the dtype of k)", inputs=(("k", k), ("v", v), ("q", q)))

    def _decode_checked(self, st: LayerState, dev: str, k: Any, v: Any, q: Any, config: AttendConfig,
                        out: Any = None) -> DecodeOutput:
        """The storing half of :meth:`decode` (see :meth:`_prefill_checked`)."""
        self._append(st, dev, k, v)
        return self._decode_output(st, q, config, k.dtype, out)

    def _decode_output(self, st: LayerState, q: Any, config: AttendConfig, dtype: Any, out: Any = None) -> DecodeOutput:
        """What ``decode`` returns once the tokens are stored (default: the stored history,
        with the sliding mask as ``logit_bias`` where a query's window excludes stored keys;
        ``out`` is ``None`` here: it was refused for an unfused cache)."""
        hk, hv = self._history(st, dtype)
        return Dequantized(DequantResult(hk, hv, self._window_bias4(st, q, dtype)))

    def _window_bias4(self, st: LayerState, q: Any, dtype: Any) -> Any:
        """:meth:`_window_bias` in the protocol's ``[batch, num_heads, q_len, seq_len]`` layout."""
        bias = self._window_bias(st, q)
        if bias is None:
            return None
        b, hq, ql, _ = (int(s) for s in q.shape)
        return finite_astype(bias.reshape(b, hq, ql, st.seq_len), dtype)

    def seq_len(self, layer: int) -> int:
        """Tokens ``layer`` has seen (``IndexError`` if out of range).

        Equal to the stored tokens, except on sliding-window layers, which evict what no
        future query can see (:meth:`stored_len`)."""
        st = self._layers[check_layer(layer, self.num_layers)]
        with self._layer_lock(st):  # (two fields, which an eviction changes one at a time)
            return st.total_len

    def stored_len(self, layer: int) -> int:
        """Tokens ``layer`` currently stores (``seq_len`` minus evicted tokens)."""
        st = self._layers[check_layer(layer, self.num_layers)]
        with self._layer_lock(st):
            return st.seq_len

    def _sum_layers(self, count: Any) -> int:
        """``count(st)`` summed over layers, each read under its lock."""
        total = 0
        for st in self._layers:
            with st.lock:
                total += count(st)
        return total

    @property
    def bits_per_value(self) -> float:
        """Stored bits per K or V value (each cache class says what it counts)."""
        raise NotImplementedError(f"{type(self).__name__}.bits_per_value")

    def memory_usage(self) -> int:
        """Exact bytes of live stored data, summed over layers."""
        return self._sum_layers(LayerState.live_bytes)

    def allocated_bytes(self) -> int:
        """Bytes of all allocated buffers (capacity), summed over layers."""
        return self._sum_layers(LayerState.allocated_bytes)

    def live_arrays(self, layer: int) -> list[Any]:
        """Views of the live part of every buffer of ``layer`` (for inspection and tests)."""
        layer = check_layer(layer, self.num_layers)
        st = self._layers[layer]
        with st.lock:
            return st.live_arrays()

    def fp16_bytes(self) -> int:
        """Bytes the live tokens would take as an uncompressed float16 K/V cache (each layer
        read under its lock: a reset between its two reads would leave no batch)."""
        return self._sum_layers(lambda st: 4 * st.batch * self.num_kv_heads * st.seq_len * self.head_dim
                                if st.seq_len else 0)

    def _reshape_out(self, flat: Any, batch: int, dtype: Any) -> Any:
        out = flat.reshape(batch, self.num_kv_heads, flat.shape[1], self.head_dim)
        if np.dtype(dtype) != np.dtype(out.dtype):
            out = finite_astype(out, dtype)  # (a reconstruction may overshoot a float16 input's ±65504)
        return out

    # -- state (the cache file, see numba_kv.caches.persist) ---------------------------------
    def state_dict(self) -> CacheState:
        """The cache as plain data (:class:`~numba_kv.caches.state.CacheState`).

        ``config``: :meth:`config_dict`; ``state``: per layer ``None`` (empty) or
        ``{"seq_len", "batch", "meta", "live"}`` (tokens, batch size, counters, live token
        counts of the buffers that differ from ``seq_len``); ``tensors``: the live part
        ``layers.<i>.<buffer>`` of every buffer, copied to the host (O(live bytes)).
        :meth:`from_state_dict` rebuilds an equal cache on the host.
        """
        layers, tensors = [], {}
        with self._all_locks():
            for i, st in enumerate(self._layers):
                if not st.seq_len:
                    layers.append(None)
                    continue
                layers.append({"seq_len": st.seq_len, "batch": st.batch, "meta": dict(st.meta),
                               "live": dict(st.live)})
                for n, b in st.buffers.items():
                    tensors[f"layers.{i}.{n}"] = host_copy(b, st.live_count(n))
        return CacheState(self.config_dict(), {"layers": layers}, tensors)

    @classmethod
    def from_state_dict(cls: type[_Cache], state: CacheState) -> _Cache:
        """The cache :meth:`state_dict` described, on the host (NumPy buffers).

        Every layer's counters, live counts and tensors (names, dtypes, shapes, capacities)
        are checked against the configuration before anything is built.

        Parameters
        ----------
        state : CacheState
            ``config`` (constructor arguments), ``state`` and ``tensors`` as
            :meth:`state_dict` returns them.

        Raises
        ------
        CacheFileError
            A state or tensor this configuration cannot have produced.
        TypeError, ValueError
            A bad ``config`` (from the constructor).
        """
        check_declared_sizes(state.config, state.state)
        cache = cls(**state.config)
        layers, tensors = state.state.get("layers"), state.tensors
        if not isinstance(layers, list) or len(layers) != cache.num_layers:
            raise CacheFileError(f"state: expected {cache.num_layers} layers, got {layers!r:.80}")
        spec = cache._buffer_spec()
        used: set[str] = set()
        built = []
        for i, lay in enumerate(layers):
            if lay is None:
                built.append(None)
                continue
            item = cache._checked_layer(i, lay, spec, tensors)
            used.update(f"layers.{i}.{n}" for n in spec)
            built.append(item)
        extra = set(tensors) - used
        if extra:
            raise CacheFileError(f"tensors: unexpected {sorted(extra)[:5]}")
        for st, item in zip(cache._layers, built):
            if item is not None:
                cache._restore_layer(st, *item)
        return cache

    def _checked_layer(self, i: int, lay: Any, spec: BufferSpec, tensors: dict[str, np.ndarray]) -> tuple:
        """Layer ``i`` of a state, validated: ``(seq_len, batch, meta, live, buffers)``."""
        if not isinstance(lay, dict):
            raise CacheFileError(f"state: layer {i} is not an object")
        seq_len = expect_int(f"layer {i} seq_len", lay.get("seq_len"), 1)
        batch = expect_int(f"layer {i} batch", lay.get("batch"), 1)
        meta, live = lay.get("meta", {}), lay.get("live", {})
        if not isinstance(meta, dict) or not isinstance(live, dict):
            raise CacheFileError(f"state: layer {i} meta/live are not objects")
        for k, v in meta.items():
            if k not in STATE_COUNTERS:
                raise CacheFileError(f"state: layer {i} has an unknown counter {k!r}")
            expect_int(f"layer {i} {k}", v)
        if not set(live) <= set(spec):
            raise CacheFileError(f"state: layer {i} counts buffers {sorted(live)}, the configuration has "
                                 f"{sorted(spec)}")
        rows, evicted = batch * self.num_kv_heads, int(meta.get("n_evicted", 0))
        bufs = {}
        for n, (width, dtype, fixed) in spec.items():
            key = f"layers.{i}.{n}"
            if key not in tensors:
                raise CacheFileError(f"tensors: {key} is missing")
            t = tensors[key]
            nl = expect_int(f"layer {i} live {n}", live.get(n, seq_len))
            if t.dtype != np.dtype(dtype) or t.shape != (rows, nl, width):
                raise CacheFileError(f"tensors: {key} is {t.dtype} {t.shape}, the configuration expects "
                                     f"{np.dtype(dtype)} {(rows, nl, width)}")
            limit = None if fixed is None else self._fixed_limit(n, fixed, seq_len, evicted)
            if limit is not None and nl > limit:
                raise CacheFileError(f"tensors: {key} holds {nl} tokens, more than its capacity {limit}")
            bufs[n] = (t, nl, fixed)
        if meta.get("n_evicted", 0) and self.layer_windows[i] is None:
            raise CacheFileError(f"state: layer {i} has evicted tokens but is not a sliding-window layer")
        self._check_counters(i, seq_len, {k: v for k, v in meta.items() if k != "n_evicted"}, live, evicted)
        return seq_len, batch, dict(meta), {n: int(v) for n, v in live.items()}, bufs

    def _fixed_limit(self, name: str, fixed: int, seq_len: int, evicted: int = 0) -> int:
        """Most tokens buffer ``name`` (of spec capacity ``fixed``) can hold in a layer storing
        ``seq_len`` tokens after evicting ``evicted``: ``fixed`` (a cache whose window grows
        with the history says more)."""
        return fixed

    def _check_counters(self, i: int, seq_len: int, meta: dict[str, int], live: dict[str, Any],
                        evicted: int = 0) -> None:
        """``CacheFileError`` unless a restored layer's counters (without ``n_evicted``, given
        as ``evicted``) and live counts describe a state the cache can reach (kernels trust
        them).  Here: every buffer holds ``seq_len`` tokens, so there are none."""
        if meta or live:
            raise CacheFileError(f"state: layer {i} of a {type(self).__name__} has counters {meta} / {live}")

    def _restore_layer(self, st: LayerState, seq_len: int, batch: int, meta: dict[str, int],
                       live: dict[str, int], bufs: dict[str, tuple[np.ndarray, int, int | None]]) -> None:
        """Fill an empty layer with validated host buffers (growing ones at the grown capacity)."""
        cap = grown_capacity(max([nl for _, nl, fixed in bufs.values() if fixed is None], default=0))
        st.buffers = {}
        for n, (t, nl, fixed) in bufs.items():
            # (a fixed-size buffer holds at least its spec's tokens: a grown window may hold more)
            buf = np.zeros((batch * self.num_kv_heads, max(fixed, nl) if fixed is not None else cap, t.shape[2]),
                           t.dtype)
            buf[:, :nl] = t
            st.buffers[n] = buf
        st.capacity, st.seq_len, st.batch, st.device = cap, seq_len, batch, "cpu"
        st.meta, st.live = meta, live
