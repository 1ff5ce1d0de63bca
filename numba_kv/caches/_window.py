"""Exact-token storage of :class:`~numba_kv.caches.polarquant.PolarQuantCache`: attention
sinks, the recent window and its eviction into the compressed store.

Per layer the cache stores, in token order, ``n_sink`` sink tokens (the first ``S`` tokens
of a global layer, kept exact for good), ``n_comp`` compressed tokens and ``n_win`` window
tokens (the newest, at most ``R``, kept exact until they leave the window).  ``R`` is
``residual_length``, or with ``residual_fraction = f > 0`` it grows with the history:
``R(t) = max(residual_length, floor(f·t))`` after a store that brings the layer's history
to ``t`` tokens (positions seen: on a sliding layer more than it stores, so its window grows
over all it stores; :func:`window_capacity`).  Since ``f < 1``, ``R`` grows by less than one
token per token stored, so the new tokens always cover the growth and no compressed token
ever comes back; a store evicts the oldest window tokens down to ``R(t)``.  The exact
tokens live in buffers ``<side>_exact`` ``[rows, >= S + R, head_dim]`` (sinks at
``[0, n_sink)``, the window at ``[S, S + n_win)``; ``S + residual_length`` long, grown by
:meth:`ExactWindow.reserve` when ``R(t)`` outgrows them), as float32, float16, or int8 with one
binary16 absmax scale per vector in ``<side>_exact_scale`` ``[rows, S + R, 1]``; int8
vectors are stored rotated by the cache's own randomized Hadamard rotation (whole head or
per 32-block) unless ``rotation=None``, so fused attention can score and accumulate them
in the rotated domain of the compressed tokens.  The counters live in the layer's ``meta``
(``n_sink``, ``n_comp``, ``n_win``).

The arithmetic of a store / crop / eviction is in pure functions (:func:`window_capacity`,
:func:`plan_store`, :func:`crop_counts`, :func:`evict_counts`) so it can be tested without
buffers; :class:`WindowedLayers` keeps a layer's counters consistent with them.
(Keeping the first and the newest tokens exact is the scheme of KIVI, arXiv:2402.02750,
and of StreamingLLM's attention sinks, arXiv:2309.17453.)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from fractions import Fraction
from typing import Any, NamedTuple

import numpy as np

from .. import _backend
from ..ops.absmax8 import absmax8_dequantize_into, absmax8_quantize_into
from ..ops.hadamard import SIGNS32, rotate32_rows
from ..ops.headquant import HEAD_DIMS, head_signs, rotate_head_rows
from ..ops.memory import copy_tokens, slide_windows
from ..ops.positions import exact_positions_into
from ..ops.window8 import ROT_BLOCK, ROT_HEAD, ROT_NONE, slide_windows8, window8_store
from ._layer import BufferSpec, LayerState, grown_capacity, moved_buffer, shift_front
from .state import CacheFileError

__all__ = ["ExactWindow", "StorePlan", "WindowedLayers", "assign_tokens", "crop_counts", "evict_counts",
           "fraction_ratio", "layer_counts", "plan_store", "window_capacity"]

#: largest denominator of a window fraction (:func:`fraction_ratio`): six decimal places are exact
FRACTION_DENOMINATOR = 10 ** 6


@functools.lru_cache(maxsize=64)
def fraction_ratio(fraction: float) -> tuple[int, int]:
    """``(num, den)``: the fraction ``f`` as the nearest ratio with ``den <= 10**6``.

    The window's capacity is then integer arithmetic, exact at every length: ``0.07`` is
    7/100 (the binary float ``0.07`` is a little more than that, ``0.29`` a little less, so
    ``floor(0.29·100)`` in floating point is 28, not 29).

    Examples
    --------
    >>> fraction_ratio(0.07), fraction_ratio(0.29), fraction_ratio(0.0)
    ((7, 100), (29, 100), (0, 1))
    """
    r = Fraction(fraction).limit_denominator(FRACTION_DENOMINATOR)
    return r.numerator, r.denominator


def window_capacity(tokens: int, residual: int, ratio: tuple[int, int] = (0, 1)) -> int:
    """Window tokens ``R(t) = max(residual, floor(t·num/den))`` after a store that brings a
    layer's history to ``t = tokens`` tokens (positions seen, sinks included; the window
    excludes the sinks).

    Parameters
    ----------
    tokens : int
        Tokens of the layer's history after the store (on a sliding layer more than it
        stores: the window may hold all it stores).
    residual : int
        ``residual_length``: the window's floor.
    ratio : tuple of int
        ``residual_fraction`` as ``(num, den)`` (:func:`fraction_ratio`), ``num < den``.

    Returns
    -------
    int
        Nondecreasing in ``tokens`` and ``R(t + n) - R(t) <= n`` (``num < den``): a store of
        ``n`` tokens never needs more window than its own tokens supply.

    Examples
    --------
    >>> window_capacity(8192, 44, (7, 100)), window_capacity(512, 44, (7, 100))
    (573, 44)
    """
    num, den = ratio
    return max(residual, tokens * num // den)


def int8_round_trip_norm(norm: float, head_dim: int) -> float:
    """An upper bound of ``‖x̃‖`` for a vector of norm ``norm`` kept in an int8 window and
    compressed from its round trip ``x̃`` when it leaves: every value comes back within
    ``max|x|/254 + 2**-25`` (:mod:`numba_kv.ops.absmax8`; in the rotated domain when the window
    rotates, which keeps norms), so ``‖x̃ − x‖ <= √d·(‖x‖/254 + 2**-25)``."""
    root_d = math.sqrt(head_dim)  # (math, not NumPy: a NumPy scalar costs ~1 µs a call, twice per step)
    return norm * (1.0 + root_d / 254.0) + root_d * 2.0 ** -25


def assign_tokens(src: Any, s0: int, n: int, dst: Any, d0: int) -> None:
    """``dst[:, d0:d0+n] = src[:, s0:s0+n]`` (casting between float dtypes), on any device.

    NumPy/CuPy use array assignment (which casts); Numba device arrays go through the
    :func:`~numba_kv.ops.memory.copy_tokens` kernel (same dtype on both sides).
    """
    if n <= 0:
        return
    if _backend.xp_of(dst) is not None:
        dst[:, d0:d0 + n] = src[:, s0:s0 + n]
    else:
        copy_tokens(src, s0, n, dst, d0)


class StorePlan(NamedTuple):
    """Where the ``n`` new tokens of one store go (all counts in tokens).

    Attributes
    ----------
    sinks : int
        New tokens that become sinks (the first of the new tokens).
    evict_old : int
        Window tokens pushed out of the window: compressed, oldest first.
    evict_new : int
        New tokens that skip the window (more new tokens than it holds): compressed after them.
    keep_old : int
        Window tokens that stay (slid to the window's front).
    keep_new : int
        New tokens that enter the window (after the kept ones).
    """

    sinks: int
    evict_old: int
    evict_new: int
    keep_old: int
    keep_new: int

    @property
    def compressed(self) -> int:
        """Tokens compressed by this store."""
        return self.evict_old + self.evict_new


def plan_store(n: int, stored: int, n_win: int, sinks: int, residual: int) -> StorePlan:
    """Plan a store of ``n`` new tokens into a layer with a window.

    Parameters
    ----------
    n : int
        New tokens.
    stored : int
        Tokens the layer stores now (sinks + compressed + window).
    n_win : int
        Tokens in the window now (more than ``residual`` only after a sliding layer's
        eviction lowered its window capacity: the store evicts down to it).
    sinks, residual : int
        Sink tokens of the layer (0 on sliding layers) and the window's capacity after this
        store (``residual_length``, or :func:`window_capacity` of ``stored + n`` when it grows).

    Returns
    -------
    StorePlan
        Afterwards the window holds ``keep_old + keep_new = min(n_win + new non-sinks,
        residual)`` tokens: only what must leave is compressed.

    Examples
    --------
    >>> plan_store(10, 0, 0, 4, 3)
    StorePlan(sinks=4, evict_old=0, evict_new=3, keep_old=0, keep_new=3)
    >>> plan_store(2, 7, 3, 4, 3)
    StorePlan(sinks=0, evict_old=2, evict_new=0, keep_old=1, keep_new=2)
    """
    a = min(n, max(0, sinks - stored))
    m = n - a
    e = max(0, n_win + m - residual)
    e_old = min(e, n_win)
    e_new = e - e_old
    return StorePlan(a, e_old, e_new, n_win - e_old, m - e_new)


def crop_counts(n_sink: int, n_comp: int, length: int, windowed: bool) -> tuple[int, int, int]:
    """``(n_sink, n_comp, n_win)`` after keeping the first ``length`` stored tokens.

    Stored order is sinks, compressed, window; a cut inside the compressed part drops the
    whole window (compressed tokens are never re-expanded).

    Examples
    --------
    >>> crop_counts(4, 10, 16, True), crop_counts(4, 10, 9, True), crop_counts(4, 10, 2, True)
    ((4, 10, 2), (4, 5, 0), (2, 0, 0))
    """
    if not windowed:
        return n_sink, length, 0
    if length <= n_sink:
        return length, 0, 0
    if length <= n_sink + n_comp:
        return n_sink, length - n_sink, 0
    return n_sink, n_comp, length - n_sink - n_comp


def evict_counts(n_comp: int, e: int) -> tuple[int, int]:
    """Split the eviction of the ``e`` oldest tokens of a sliding layer (which keeps no
    sinks: compressed tokens first, then the window) into ``(compressed, window)`` counts.

    Examples
    --------
    >>> evict_counts(5, 3), evict_counts(5, 7)
    ((3, 0), (5, 2))
    """
    ec = min(e, n_comp)
    return ec, e - ec


#: new tokens of a store that runs as one launch on a device (:func:`~numba_kv.ops.memory.slide_windows`,
#: one thread per channel loops over the tokens): a decode step's few, not a prefill
_SLIDE_MAX_NEW = 16
#: window dtypes it stores (float16: CuPy's, as rounded by an array assignment; int8 with its
#: rotation and binary16 scales: :func:`~numba_kv.ops.window8.slide_windows8`)
_SLIDE_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.int8))

_IOTA = np.arange(0, dtype=np.int32)


def _iota(n: int) -> np.ndarray:
    """Read-only int32 ``[0, 1, …]`` of length ``>= n`` (one array, grown on demand)."""
    global _IOTA  # noqa: PLW0603 - a module-level constant, replaced only by a longer one
    if _IOTA.shape[0] < n:
        iota = np.arange(max(n, 2 * _IOTA.shape[0], 256), dtype=np.int32)
        iota.flags.writeable = False
        _IOTA = iota
    return _IOTA


def layer_counts(st: LayerState) -> tuple[int, int, int]:
    """``(n_sink, n_comp, n_win)`` of a layer."""
    return st.meta.get("n_sink", 0), st.meta.get("n_comp", 0), st.meta.get("n_win", 0)


class ExactWindow:
    """The sinks-and-window buffers of one cache configuration (stateless: the state lives
    in each :class:`~numba_kv.caches._layer.LayerState`).

    Parameters
    ----------
    head_dim : int
        Vector width.
    sink_tokens, residual_length : int
        ``S`` and ``R``; the exact buffers hold ``S + R`` tokens (more once a growing window
        outgrows them, :meth:`reserve`).
    rotation : {None, "head", "block"}
        Store int8 vectors rotated over the whole head (``head_dim`` a power of two ≤ 512)
        or per 32-block, or unrotated (``None``); no effect on float buffers.
    residual_fraction : float
        ``f``: the window holds up to ``max(R, floor(f·t))`` tokens at ``t`` tokens of history
        (:func:`window_capacity`).
    """

    def __init__(self, head_dim: int, sink_tokens: int, residual_length: int, rotation: str | None = None,
                 residual_fraction: float = 0.0) -> None:
        if rotation not in (None, "head", "block") or (rotation == "head" and head_dim not in HEAD_DIMS):
            raise ValueError(f"rotation: expected None, 'block' or 'head' (head_dim in {HEAD_DIMS}), got {rotation!r}")
        self.head_dim = head_dim
        self.sink_tokens = sink_tokens
        self.residual_length = residual_length
        self.ratio = fraction_ratio(residual_fraction)
        self.rotation = rotation
        #: the rotation as :func:`~numba_kv.ops.window8.window8_store` takes it, and its signs
        self.rot_code = {None: ROT_NONE, "head": ROT_HEAD, "block": ROT_BLOCK}[rotation]
        self.rot_signs = head_signs(head_dim) if rotation == "head" else SIGNS32

    def _rotated(self, x3: Any, inverse: bool, out: Any = None) -> Any:
        """``x3`` ``[rows, n, d]`` float32 rotated (or rotated back) into ``out`` (C-contiguous
        float32 of that shape; a new array when ``None``): int8's absmax step is set by a
        vector's largest entry, and a randomized Hadamard transform spreads a few large
        channels over all of them (QuaRot, arXiv:2404.00456)."""
        rows, n, d = x3.shape
        x2 = _backend.ascontiguous_f32("x", x3).reshape(rows * n, d)
        if self.rotation == "head":
            return rotate_head_rows(x2, inverse, None if out is None else out.reshape(rows * n, d)).reshape(rows, n, d)
        res = rotate32_rows(x2, inverse).reshape(rows, n, d)
        if out is None:
            return res
        assign_tokens(res, 0, n, out, 0)
        return out

    def stored_rotated(self, st: LayerState) -> bool:
        """True when the layer's exact tokens are stored rotated (an int8 window with a rotation)."""
        return self.rotation is not None and st.buffers["k_exact"].dtype == np.int8

    @property
    def capacity(self) -> int:
        """Tokens of newly allocated exact buffers (``S + R``)."""
        return self.sink_tokens + self.residual_length

    def window_at(self, tokens: int) -> int:
        """The window's capacity at ``tokens`` tokens of history (:func:`window_capacity`)."""
        return window_capacity(tokens, self.residual_length, self.ratio)

    def reserve(self, st: LayerState, sinks: int, tokens: int, stored: int | None = None) -> int:
        """The window's capacity ``R`` after a store that brings the layer's history to
        ``tokens`` tokens (positions seen) and its store to ``stored`` tokens (default
        ``tokens``; fewer on a sliding layer that evicted), with the layer's exact buffers grown
        (when allocated and too short) to hold its ``sinks`` and ``min(R, stored)`` window
        tokens: a sliding layer's window may outgrow what it stores, its buffers never do.

        Growth follows :func:`~numba_kv.caches._layer.grown_capacity` (``S + R`` plus a
        quarter, at least 128 tokens, by default): amortized, not once per token.  The grown
        buffers go into a new buffer dict, so whatever is bound to the old one (a fused
        attention step, the int8 store's arguments) is bound again.
        """
        if not self.ratio[0]:  # a fixed window (every store of a decode step passes here)
            return self.residual_length
        r = window_capacity(tokens, self.residual_length, self.ratio)
        held = min(r, tokens if stored is None else stored)
        bufs = st.buffers
        ex = bufs.get("k_exact")
        if ex is None or int(ex.shape[1]) >= sinks + held:
            return r
        live = st.meta.get("n_sink", 0) + st.meta.get("n_win", 0)  # sinks at the front, the window after them
        length = self.sink_tokens + grown_capacity(held)
        grown = {}
        for key in ("k_exact", "v_exact", "k_exact_scale", "v_exact_scale"):
            if key in bufs:
                old = bufs[key]
                grown[key] = moved_buffer(old, live, old, (int(old.shape[0]), length, int(old.shape[2])), old.dtype)
        st.buffers = {**bufs, **grown}
        return r

    def buffer_spec(self, dtype: Any) -> BufferSpec:
        """``k_exact``/``v_exact`` (and with int8 storage their binary16 scales)."""
        dt = np.dtype(dtype)
        spec: BufferSpec = {"k_exact": (self.head_dim, dt, self.capacity),
                            "v_exact": (self.head_dim, dt, self.capacity)}
        if dt == np.int8:
            spec["k_exact_scale"] = (1, np.uint16, self.capacity)
            spec["v_exact_scale"] = (1, np.uint16, self.capacity)
        return spec

    # -- element access: float32/float16 copies, or int8 with one binary16 absmax scale ------
    def _int8(self, st: LayerState, name: str, n: int) -> Any:
        """The int8 tokens of side ``name`` when ``n > 0`` tokens are to be converted, else
        ``None`` (nothing to do, or float tokens, which a plain copy converts)."""
        ex = st.buffers[name + "_exact"]
        return ex if n > 0 and ex.dtype == np.int8 else None

    def write(self, st: LayerState, name: str, src: Any, s0: int, n: int, d0: int) -> None:
        """Exact tokens ``d0 : d0+n`` of side ``name`` ← float32 ``src[:, s0 : s0+n]``."""
        ex = self._int8(st, name, n)
        if ex is None:
            assign_tokens(src, s0, n, st.buffers[name + "_exact"], d0)
            return
        if _backend.xp_of(src) is not None or (s0 == 0 and n == int(src.shape[1])):
            x = src[:, s0:s0 + n]
        else:  # a Numba device array's token range, made contiguous by the copy kernel
            x = _backend.empty(src, (int(src.shape[0]), n, self.head_dim), np.float32)
            copy_tokens(src, s0, n, x, 0)
        x = self._rotated(x, False) if self.rotation is not None else _backend.ascontiguous_f32("x", x)
        absmax8_quantize_into(x, ex, st.buffers[name + "_exact_scale"], d0)

    def read(self, st: LayerState, name: str, s0: int, n: int, dst: Any, d0: int, rotated: bool = False) -> None:
        """float32 ``dst[:, d0 : d0+n]`` (C-contiguous) ← exact tokens ``s0 : s0+n`` of side ``name`` (with
        ``rotated``, int8 tokens stay in the rotated domain they are stored in)."""
        ex = self._int8(st, name, n)
        if ex is None:
            assign_tokens(st.buffers[name + "_exact"], s0, n, dst, d0)
            return
        sc = st.buffers[name + "_exact_scale"]
        if self.rotation is None or rotated:
            absmax8_dequantize_into(ex, sc, s0, n, dst, d0)
            return
        x = _backend.empty(ex, (int(ex.shape[0]), n, self.head_dim), np.float32)
        absmax8_dequantize_into(ex, sc, s0, n, x, 0)
        if d0 == 0 and int(dst.shape[1]) == n:  # the whole of dst (an eviction): rotate straight into it
            self._rotated(x, True, dst)
        else:
            assign_tokens(self._rotated(x, True), 0, n, dst, d0)

    def move(self, st: LayerState, name: str, s0: int, n: int, d0: int) -> None:
        """Exact tokens ``d0 : d0+n`` ← tokens ``s0 : s0+n`` (the ranges may overlap)."""
        for key in (name + "_exact", name + "_exact_scale"):
            if key not in st.buffers:
                continue
            ex = st.buffers[key]
            if isinstance(ex, np.ndarray):  # NumPy assignment handles overlapping ranges
                ex[:, d0:d0 + n] = ex[:, s0:s0 + n]
                continue
            tmp = _backend.empty(ex, (ex.shape[0], n, ex.shape[2]), ex.dtype)
            assign_tokens(ex, s0, n, tmp, 0)
            assign_tokens(tmp, 0, n, ex, d0)

    def int8_round_trip(self, x3: Any) -> Any:
        """What an int8 window gives back for the float32 tokens ``x3`` ``[rows, n, d]`` (stored
        domain; rotated and back when the window rotates): the values a token is compressed from
        when it leaves the window.  Computed in scratch, for a range check (a new float32 array)."""
        rows, n = int(x3.shape[0]), int(x3.shape[1])
        tmp = LayerState(meta={})
        tmp.buffers["x_exact"] = _backend.empty(x3, (rows, n, self.head_dim), np.int8)
        tmp.buffers["x_exact_scale"] = _backend.empty(x3, (rows, n, 1), np.uint16)
        out = _backend.empty(x3, (rows, n, self.head_dim), np.float32)
        self.write(tmp, "x", x3, 0, n, 0)
        self.read(tmp, "x", 0, n, out, 0)
        return out

    def exact_f32(self, st: LayerState, name: str, rotated: bool = False) -> tuple[Any, int]:
        """Sink and window tokens of side ``name`` as float32 ``[rows, >= n_exact, d]`` (the
        buffer itself when it is float32) and their count ``n_exact = n_sink + n_win``.
        ``rotated``: rotated int8 tokens are returned in their stored, rotated domain (the
        caller attends there); see :meth:`stored_rotated`."""
        n_sink, _, n_win = layer_counts(st)
        n_exact = n_sink + n_win
        ex = st.buffers[name + "_exact"]
        xp = _backend.xp_of(ex)
        if ex.dtype == np.int8:
            out = _backend.empty(ex, (int(ex.shape[0]), n_exact, self.head_dim), np.float32)
            self.read(st, name, 0, n_exact, out, 0, rotated)
            return out, n_exact
        if xp is not None and ex.dtype != np.float32:
            return xp.ascontiguousarray(ex[:, :n_exact], dtype=xp.float32), n_exact
        return ex, n_exact

    def exact_stored(self, st: LayerState, name: str) -> tuple[Any, Any, int]:
        """Sink and window tokens of side ``name`` as stored, for the fused kernel to read in
        place: ``(tokens, scales, n_exact)`` with ``tokens`` ``[rows, >= n_exact, d]``
        float32, float16 or int8 (rotated when :meth:`stored_rotated`) and ``scales`` the
        int8 tokens' binary16 scales ``[rows, >= n_exact, 1]`` uint16 (else ``None``)."""
        n_sink, _, n_win = layer_counts(st)
        ex = st.buffers[name + "_exact"]
        return ex, st.buffers.get(name + "_exact_scale") if ex.dtype == np.int8 else None, n_sink + n_win

    def positions(self, st: LayerState, like: Any, sinks: int) -> Any:
        """Stored positions (int32) of the exact tokens, sinks then window, on the device of
        ``like``: the layer's reused position buffer ``[>= max(n, 1)]`` with the ``n = n_sink
        + n_win`` positions at its front (the kernels read those; one buffer object from step
        to step, so a bound attention step stays bound).  Written only when the counters
        changed since the last write (:meth:`position_buffer`)."""
        meta = st.meta
        n_sink, n_win = meta.get("n_sink", 0), meta.get("n_win", 0)
        key = (n_sink, sinks + meta.get("n_comp", 0), n_win)
        if st.scratch.get("exact_pos_of") == key:  # (set only for a buffer that holds them)
            return st.scratch["exact_pos"]
        n_comp = key[1] - sinks
        buf = self.position_buffer(st, like, n_sink + n_win)
        if isinstance(buf, np.ndarray):
            iota = _iota(n_sink + n_win)
            buf[:n_sink] = iota[:n_sink]  # sinks at 0 .. n_sink-1, then the window from sinks + n_comp
            np.add(iota[:n_win], np.int32(sinks + n_comp), out=buf[n_sink:n_sink + n_win])
        else:
            exact_positions_into(buf, n_sink, sinks + n_comp, n_win)
        st.scratch["exact_pos_of"] = key
        return buf

    def position_buffer(self, st: LayerState, like: Any, n: int) -> Any:
        """The layer's int32 position buffer, at least ``max(n, 1)`` long (reused: no allocation
        and no upload per decode step).  ``st.scratch["exact_pos_of"]`` names the counters
        ``(n_sink, first window position, n_win)`` its front was written for; whoever writes
        it sets that (a new buffer has none)."""
        buf = st.scratch.get("exact_pos")
        if buf is None or int(buf.shape[0]) < max(n, 1):
            buf = st.scratch["exact_pos"] = _backend.empty(like, (grown_capacity(n + 1),), np.int32)
            st.scratch.pop("exact_pos_of", None)
        return buf

    # -- whole operations --------------------------------------------------------------------
    def store(self, st: LayerState, name: str, x3: Any, plan: StorePlan, sinks: int,
              compress: Callable[[Any], None]) -> None:
        """Store the new tokens ``x3`` ``[rows, n, d]`` (float32, stored domain) of side
        ``name`` by ``plan``: sinks first, then the tokens leaving the window (old window
        tokens, then new tokens that skip it) go to ``compress`` as one ``[rows, e, d]``
        array, the survivors slide to the window's front and the rest of the new tokens
        follow them.  The counters are not touched (the caller updates them once per call).
        """
        ex = st.buffers[name + "_exact"]
        if isinstance(ex, np.ndarray) and ex.dtype == np.int8:
            # the whole window part in one serial call (bit-identical to the steps below)
            ev = window8_store(_backend.ascontiguous_f32("x", x3), ex, st.buffers[name + "_exact_scale"], plan,
                               sinks, st.seq_len, self.rot_code, self.rot_signs)
            if plan.compressed:
                compress(ev)
            return
        a, e_old, e_new, keep_old, keep_new = plan
        self.write(st, name, x3, 0, a, st.seq_len)
        if plan.compressed:
            ev = _backend.empty(x3, (x3.shape[0], plan.compressed, self.head_dim), np.float32)
            self.read(st, name, sinks, e_old, ev, 0)
            assign_tokens(x3, a, e_new, ev, e_old)
            compress(ev)
        if e_old and keep_old:  # slide the surviving window tokens to the front
            self.move(st, name, sinks + e_old, keep_old, sinks)
        self.write(st, name, x3, a + e_new, keep_new, sinks + keep_old)

    def pair_applies(self, st: LayerState, n: int) -> bool:
        """Whether a store of ``n`` new tokens runs as :meth:`store_pair`: float32, float16 or
        int8 windows on a device and a few tokens."""
        exk, exv = st.buffers.get("k_exact"), st.buffers.get("v_exact")
        return (exk is not None and exv is not None and not isinstance(exk, np.ndarray) and n <= _SLIDE_MAX_NEW
                and exk.dtype in _SLIDE_DTYPES and exv.dtype == exk.dtype)

    def store_pair(self, st: LayerState, xk3: Any, xv3: Any, plan: StorePlan, sinks: int,
                   pos_counts: tuple[int, int, int], ranges: tuple | None = None,
                   count: tuple | None = None, kmean: Any = None) -> tuple[Any, Any] | None:
        """:meth:`store` of both sides and the exact tokens' positions in one launch
        (:func:`~numba_kv.ops.memory.slide_windows`; int8 windows
        :func:`~numba_kv.ops.window8.slide_windows8`), where it applies (:meth:`pair_applies`:
        float32, float16 or int8 windows on a device, a store of a few tokens: a decode step).
        ``kmean``: the keys are stored as ``xk3 − kmean`` (key centering in the launch).
        ``pos_counts``: ``(n_sink, first window position, n_win)`` after the store, written to
        the layer's position buffer (:meth:`position_buffer`; :meth:`positions` then finds them
        current).  ``ranges``: deferred range records folded into the launch (see
        :func:`~numba_kv.ops.memory.slide_windows`); ``count``: ``(state, read, write, held)``,
        the layer's device step state (``slide_windows(count=)``) and ``held``, the value of
        ``state[read]`` when the launch runs: the first window position is then passed
        relative to it.  Returns the
        ``(k, v)`` evicted tokens ``[rows, plan.compressed, d]`` for the caller to compress
        (reused buffers: valid until the layer's next store), or ``None`` when it does not
        apply (nothing done; :meth:`store` then stores op by op, with the same bytes)."""
        if not self.pair_applies(st, int(xk3.shape[1])):
            return None
        exk, exv = self.store_targets(st)
        xk3, xv3 = _backend.ascontiguous_f32("k", xk3), _backend.ascontiguous_f32("v", xv3)
        evk = self._eviction_buffer(st, "k", xk3, plan.compressed)
        evv = self._eviction_buffer(st, "v", xk3, plan.compressed)
        n_sink, base, n_win = pos_counts
        pos = self.position_buffer(st, xk3, n_sink + n_win)
        # where the new sinks go (none in a steady step: 0 then, so that the launch's arguments
        # do not change from step to step; a CUDA graph replays them, issue 27)
        s_at = st.seq_len if plan.sinks else 0
        if count is not None:  # relative to the count the kernel reads (the same every steady step)
            base -= int(count[3])
            count = count[:3]
        if exk.dtype == np.int8:
            bufs = st.buffers
            slide_windows8(xk3, xv3, kmean, exk, bufs["k_exact_scale"], exv, bufs["v_exact_scale"], evk, evv, plan,
                           s_at, sinks, self.rot_code, _backend.constant(xk3, self.rot_signs), pos,
                           (n_sink, base, n_win), ranges, count)
        else:
            slide_windows(xk3, xv3, exk, exv, evk, evv, plan.sinks, s_at, plan.evict_new, sinks, plan.evict_old,
                          plan.keep_old, plan.keep_new, pos, n_sink, base, n_win, ranges, count, kmean)
        st.scratch["exact_pos_of"] = tuple(pos_counts)
        return evk, evv

    def store_targets(self, st: LayerState) -> tuple[Any, Any]:
        """The layer's two window buffers as :meth:`store_pair`'s launch takes them: float16
        ones (CuPy) as their ``uint16`` bit patterns, the same view objects from step to step
        while the buffers stand (a new view each step would be a new launch argument each step:
        no prepared launch, no :class:`~numba_kv.StepGraph` replay)."""
        exk, exv = st.buffers["k_exact"], st.buffers["v_exact"]
        if exk.dtype != np.float16:
            return exk, exv
        views = st.scratch.setdefault("views", {})
        return tuple(_backend.same_view(views, ("bits16", name), buf, lambda a: a.view(np.uint16), owned=True)
                     for name, buf in (("k", exk), ("v", exv)))

    def _eviction_buffer(self, st: LayerState, name: str, like: Any, n: int) -> Any:
        """The layer's reused float32 buffer ``[rows, n, d]`` of side ``name``'s evicted tokens
        (exactly ``n`` tokens long, so the compressor takes it whole; a new one only when ``n``
        or the rows change: a decode step evicts the same count every step)."""
        key = "evict_" + name
        buf = st.scratch.get(key)
        rows = int(like.shape[0])
        if buf is None or int(buf.shape[0]) != rows or int(buf.shape[1]) != max(n, 1):
            buf = st.scratch[key] = _backend.empty(like, (rows, max(n, 1), self.head_dim), np.float32)
        return buf

    def merge(self, st: LayerState, name: str, comp: Any, flat: Any) -> None:
        """Token-ordered float32 history ``flat`` ``[rows, stored, d]``: sinks, the
        decompressed tokens ``comp`` ``[rows, n_comp, d]``, then the window."""
        n_sink, n_comp, n_win = layer_counts(st)
        ex, _ = self.exact_f32(st, name)
        assign_tokens(ex, 0, n_sink, flat, 0)
        assign_tokens(comp, 0, n_comp, flat, n_sink)
        assign_tokens(ex, n_sink, n_win, flat, n_sink + n_comp)


class WindowedLayers:
    """The layer bookkeeping of a cache with an :class:`ExactWindow` (sinks, compressed
    tokens, window), as a mixin of :class:`~numba_kv.caches.polarquant.PolarQuantCache`:
    live counts, counter checks of a loaded file, sliding eviction and crop.  Reads the
    cache's ``_window``, ``windowed``, ``sink_tokens``, ``layer_windows`` and ``_buffer_spec``."""

    _window: ExactWindow

    def _fixed_limit(self, name: str, fixed: int, seq_len: int, evicted: int = 0) -> int:
        """An exact buffer holds up to ``S + R(seq_len + evicted)`` tokens (more than its
        spec's ``S + residual_length`` once a growing window outgrew it); other buffers
        ``fixed``."""
        if name.endswith(("_exact", "_exact_scale")):
            return self.sink_tokens + self._window.window_at(seq_len + evicted)
        return fixed

    def _checked_layer(self, i: int, lay: Any, spec: Any, tensors: dict[str, np.ndarray]) -> tuple:
        """The layer checks of a loaded file, and its outlier-channel permutations: each row of
        a set ``k_perm`` / ``v_perm`` must hold every channel once (a duplicate gave silently
        wrong attention, an index out of range an ``IndexError`` at the first decode)."""
        item = super()._checked_layer(i, lay, spec, tensors)  # type: ignore[misc]
        meta, bufs = item[2], item[4]
        for name in ("k", "v"):
            if meta.get(name + "perm_set") and name + "_perm" in bufs:
                t = bufs[name + "_perm"][0]  # [rows, 1, d] int16
                if not np.array_equal(np.sort(t, axis=-1), np.broadcast_to(np.arange(t.shape[-1]), t.shape)):
                    raise CacheFileError(f"tensors: layers.{i}.{name}_perm: every row must be a permutation of "
                                         f"0..{t.shape[-1] - 1} (the outlier-channel order)")
        return item

    def _check_counters(self, i: int, seq_len: int, meta: dict[str, int], live: dict[str, Any],
                        evicted: int = 0) -> None:
        window = self.layer_windows[i]
        n_sink, n_comp, n_win = (meta.get(k, 0) for k in ("n_sink", "n_comp", "n_win"))
        # every state a store or crop leaves has n_win <= R(seen), seen = seq_len + evicted: a store
        # evicts down to it, a sliding eviction only lowers n_win, and a crop by d tokens lowers R
        # by at most d (floor(f·t) grows by < 1 per token)
        S, R = (0 if window is not None else self.sink_tokens), self._window.window_at(seq_len + evicted)
        ok = n_sink + n_comp + n_win == seq_len and n_sink <= S and n_win <= R and (n_sink == S or n_comp + n_win == 0)
        if not self.windowed:
            ok = ok and n_comp == seq_len
        probe = LayerState(seq_len=seq_len, meta=dict(meta))
        self._set_live(probe)
        if not ok or probe.live != live:
            raise CacheFileError(f"state: layer {i} counters {meta} / live {live} are inconsistent with seq_len "
                                 f"{seq_len} and the configuration (sinks {S}, window {R})")

    def _set_live(self, st: LayerState) -> None:
        """Live token counts of every buffer from the layer's counters."""
        meta = st.meta
        # the allocated buffers are the spec's (rebuilding the spec each decode step cost more
        # than the rest of this bookkeeping); their names grouped by counter, once per buffer dict
        names = st.buffers or self._buffer_spec()
        groups = st.scratch.get("live_groups")
        if groups is None or groups[0] is not names:
            kinds: tuple[list[str], list[str], list[str]] = ([], [], [])
            for bname in names:
                kinds[0 if bname.endswith(("_exact", "_exact_scale"))
                      else 1 if bname in ("k_chmean", "k_perm", "v_perm") else 2].append(bname)
            groups = (names, *kinds)
            if st.buffers:
                st.scratch["live_groups"] = groups
        live = st.live
        n_exact = meta.get("n_sink", 0) + meta.get("n_win", 0)
        for bname in groups[1]:
            live[bname] = n_exact
        for bname in groups[2]:
            live[bname] = 1
        n_comp = meta.get("n_comp", 0)
        for bname in groups[3]:
            live[bname] = n_comp

    def _evict(self, st: LayerState, e: int) -> None:
        # sliding layers keep no sinks: stored order is compressed [0, n_comp), window after
        _, n_comp, n_win = layer_counts(st)
        ec, ew = evict_counts(n_comp, e)
        if ec:
            for bname, (_, _, fixed) in self._buffer_spec().items():
                if fixed is None:
                    shift_front(st.buffers[bname], ec, n_comp)
        if ew:
            for name in ("k", "v"):
                self._window.move(st, name, ew, n_win - ew, 0)
        st.meta.update(n_comp=n_comp - ec, n_win=n_win - ew)
        st.seq_len -= e
        self._set_live(st)

    def _crop_layer(self, st: LayerState, length: int) -> None:
        n_sink, n_comp, n_win = crop_counts(st.meta.get("n_sink", 0), st.meta.get("n_comp", 0), length,
                                            self.windowed)
        st.meta.update(n_sink=n_sink, n_comp=n_comp, n_win=n_win)
        st.seq_len = length
        self._set_live(st)
