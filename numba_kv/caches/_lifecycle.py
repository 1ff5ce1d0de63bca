"""Cache lifecycle shared by every layered cache: ``crop``, ``fork`` (``copy.deepcopy``),
``select_batch`` and ``save`` (the file format lives in :mod:`numba_kv.caches.persist`).

These are the operations inference engines build on: rollback after speculative decoding
(``crop``), one prompt's cache copied to several continuations (``fork``), batch rows
reordered for beam search (``select_batch``), and prompt caches written to disk (``save``).

Every operation validates its arguments first and takes the locks of all layers (in
layer order, so it cannot deadlock against per-layer ``prefill``/``decode`` calls from
other threads); a call that raises leaves the cache exactly as it was.  A cache made of
several (``MixedCache``) takes every part's layer locks at once, in its model layer order,
through :func:`hold_layers`, and runs the parts' operations inside.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

import numpy as np

from .. import _backend
from .._validate import check_int, check_layer
from ..ops.gather import to_like
from ._format import save_cache

#: the cache class a lifecycle method returns (a fork of a PolarQuantCache is a PolarQuantCache)
_Cache = TypeVar("_Cache")


def copy_array(a: Any) -> Any:
    """An independent copy of ``a`` on its own device (NumPy, CuPy or Numba device array)."""
    if _backend.xp_of(a) is not None:
        return a.copy()
    out = _backend.empty(a, tuple(a.shape), a.dtype)
    out.copy_to_device(a)
    return out


def take_rows(a: Any, rows: np.ndarray) -> Any:
    """``a[rows]`` (first axis, repeats allowed) as a new array on the device of ``a``.

    Numba device arrays go through the host (no device-side fancy indexing for every
    dtype the caches store); NumPy and CuPy index on their own device.
    """
    xp = _backend.xp_of(a)
    if xp is np:
        return np.ascontiguousarray(a[rows])
    if xp is not None:
        return xp.ascontiguousarray(a[xp.asarray(rows)])
    return to_like(a, _backend.to_host(a)[rows])


#: per thread: ids of the caches whose layer locks the thread holds through :func:`hold_layers`
_HELD = threading.local()


@contextlib.contextmanager
def hold_layers(layers: Sequence[tuple[Any, int]]) -> Iterator[None]:
    """Hold the lock of every ``(cache, layer index)`` of ``layers`` for a whole operation,
    taken in the order given (layer order) and released in reverse.

    Meanwhile the lifecycle operations of this thread on those caches (``crop``, ``fork``,
    ``select_batch``, ``state_dict``, ...) take no lock again, so an operation over several
    caches holds all their locks at once and runs each cache's own operation inside.
    ``layers`` must name every layer of each cache it names; a cache whose locks this thread
    already holds is skipped (``reset`` too; ``seq_len``/``stored_len`` read without the
    lock).  Per-layer calls (``prefill``, ``decode``) still take their layer's lock: do not
    make them inside.
    """
    held = _HELD.__dict__.setdefault("ids", set())
    new = {id(cache) for cache, _ in layers} - held
    with contextlib.ExitStack() as stack:
        for cache, j in layers:
            if id(cache) in new:
                stack.enter_context(cache._layers[j].lock)  # noqa: SLF001 - the LifecycleMixin layers
        held.update(new)
        try:
            yield
        finally:
            held.difference_update(new)


def check_crop_length(length: int, floor: int, limit: int | None) -> None:
    """``ValueError`` unless ``crop(length)`` is possible: ``length`` is 0 or in
    ``[floor, limit]`` (``limit`` ``None``: every layer is empty, only 0 is)."""
    top = 0 if limit is None else limit
    if length > top:
        raise ValueError(f"length: expected an int in [0, {top}] (the shortest non-empty layer "
                         f"holds {top} tokens), got {length}")
    if 0 < length < floor:
        # (floor > top: a sliding layer is further along than the shortest layer, so only 0 is left)
        allowed = (f"0 or an int in [{floor}, {top}]" if floor <= top else
                   f"0 (the only length left: a sliding layer can return to {floor} at the earliest, "
                   f"the shortest non-empty layer holds {top} tokens)")
        raise ValueError(f"length: a sliding-window layer has evicted tokens that position {length} would "
                         f"see again; expected {allowed}, got {length}")


def check_indices(indices: Any, batch: int) -> np.ndarray:
    """Validate ``indices`` (1-D, ≥ 1 integer in ``[0, batch)``, repeats allowed) → int64."""
    try:
        idx = np.asarray(indices)
    except Exception as exc:  # pragma: no cover - exotic inputs
        raise TypeError(f"indices: expected a 1-D sequence of ints, got {type(indices).__name__}") from exc
    if idx.ndim != 1 or idx.size == 0:
        raise ValueError(f"indices: expected a non-empty 1-D sequence of batch rows, got shape {idx.shape}")
    if idx.dtype == np.bool_ or not np.issubdtype(idx.dtype, np.integer):
        raise TypeError(f"indices: expected a 1-D sequence of ints, got dtype {idx.dtype}")
    if idx.min() < 0 or idx.max() >= batch:
        raise ValueError(f"indices: expected batch rows in [0, {batch}), got {idx.tolist()}")
    return idx.astype(np.int64)


def cache_repr(cache: Any, lengths: list[int]) -> str:
    """``Type('name', num_layers=…, num_kv_heads=…, head_dim=…, tokens=…)`` of a layered cache:
    ``tokens`` one count when every layer holds the same, else the per-layer list.  Read
    without the layers' locks (a display, not a snapshot)."""
    tokens: Any = lengths[0] if lengths and len(set(lengths)) == 1 else lengths
    return (f"{type(cache).__name__}({getattr(cache, 'name', '?')!r}, num_layers={len(lengths)}, "
            f"num_kv_heads={getattr(cache, 'num_kv_heads', '?')}, head_dim={getattr(cache, 'head_dim', '?')}, "
            f"tokens={tokens})")


class LifecycleMixin:
    """``crop`` / ``fork`` / ``select_batch`` / ``save`` for caches made of ``LayerState`` s.

    Hooks: ``_crop_layer(st, length)`` (default: the layer keeps its first ``length``
    tokens by lowering ``seq_len``; windowed caches override it) and :meth:`config_dict`
    (constructor arguments, part of what ``save`` writes).
    """

    _layers: list[Any]
    num_kv_heads: int

    def __repr__(self) -> str:
        return cache_repr(self, [st.seq_len for st in getattr(self, "_layers", [])])

    def layer_cache(self: _Cache, layer: int) -> _Cache:
        """The cache that stores ``layer``: this one.  As ``MixedCache.layer_cache``, which
        returns the part.

        Parameters
        ----------
        layer : int
            In ``[0, num_layers)`` (else ``IndexError``, or ``TypeError`` for a non-int, naming
            ``layer``).

        Returns
        -------
        LayeredCache
            ``self``.
        """
        check_layer(layer, self.num_layers)  # type: ignore[attr-defined]
        return self

    def empty_layer(self: _Cache, layer: int) -> _Cache:
        """An empty one-layer cache configured like ``layer``.  As ``MixedCache.empty_layer``;
        the transformers integration builds its layers so.

        Parameters
        ----------
        layer : int
            In ``[0, num_layers)`` (else ``IndexError``, or ``TypeError`` for a non-int, naming
            ``layer``).

        Returns
        -------
        LayeredCache
            A new cache of this class: this cache's constructor arguments
            (:meth:`config_dict`) with ``num_layers=1`` and ``sliding_window=[window of
            layer]``, holding no tokens; it stores what ``layer`` stores, byte for byte.
        """
        i = check_layer(layer, self.num_layers)  # type: ignore[attr-defined]
        cfg = self.config_dict()  # type: ignore[attr-defined]
        cfg["num_layers"], cfg["sliding_window"] = 1, [self.layer_windows[i]]  # type: ignore[attr-defined]
        return type(self)(**cfg)

    def _all_locks(self) -> contextlib.AbstractContextManager[None]:
        """Every layer's lock, in layer order (none if this thread holds them: :func:`hold_layers`)."""
        return hold_layers([(self, j) for j in range(len(self._layers))])

    def _layer_lock(self, st: Any) -> contextlib.AbstractContextManager[Any]:
        """Layer state ``st``'s lock for a read, unless this thread holds every layer's lock
        (inside a lifecycle operation: :func:`hold_layers`)."""
        return contextlib.nullcontext() if id(self) in _HELD.__dict__.get("ids", ()) else st.lock

    def reset(self) -> None:
        """Drop every layer's tokens and buffers (and what ``validate="deferred"`` recorded),
        under every layer's lock at once: a ``fork``/``state_dict`` taken meanwhile sees the
        cache before or after, never some layers reset (each lock was taken in turn)."""
        with self._all_locks():
            self.__dict__.pop("_deferred", None)
            for st in self._layers:
                self._clear_layer(st)
                st.scratch = {}

    @staticmethod
    def _clear_layer(st: Any) -> None:
        st.buffers, st.capacity, st.seq_len, st.batch, st.device = {}, 0, 0, None, None
        st.live, st.meta = {}, {}

    def _crop_layer(self, st: Any, length: int) -> None:
        st.seq_len = length

    @staticmethod
    def _crop_floor(st: Any) -> int:
        """Shortest length a non-empty layer can be cropped to (besides 0): a sliding layer
        that evicted ``e`` tokens can return to position ``L`` only if it still stores every
        token the query at ``L`` sees, ``L − window + 1 >= e``."""
        e = st.meta.get("n_evicted", 0)
        return e + st.window - 1 if e else 0

    # -- crop -----------------------------------------------------------------------------
    def _crop_bounds(self) -> tuple[int, int | None]:
        """``(floor, limit)`` of :meth:`crop_range`; the caller holds every layer's lock."""
        lens = [st.total_len for st in self._layers if st.seq_len]
        floor = max([self._crop_floor(st) for st in self._layers if st.seq_len] + [0])
        return floor, (min(lens) if lens else None)

    def crop_range(self) -> tuple[int, int | None]:
        """The lengths :meth:`crop` accepts besides 0: ``(floor, limit)``, every ``length``
        with ``floor <= length <= limit``.  ``limit`` is the shortest non-empty layer's
        ``seq_len`` (``None`` when every layer is empty); ``floor`` is 0 unless a sliding
        layer has evicted tokens (see :meth:`crop`).  Layers fed to different lengths can
        leave ``floor > limit``: then only ``crop(0)`` is accepted."""
        with self._all_locks():
            return self._crop_bounds()

    def crop(self, length: int) -> None:
        """Keep the first ``length`` tokens of every layer, exactly as they were stored.

        Rollback after speculative decoding.  Lengths count the tokens each layer has seen
        (``seq_len``).  A sliding-window layer that has evicted tokens keeps its ``window −
        1`` newest tokens before each call plus that call's new tokens, so it can always be
        cropped back over the tokens of its last call (a rejected draft), but not further:
        a length whose window reaches evicted tokens raises ``ValueError`` (they cannot be
        restored), except ``crop(0)``.  Compressed tokens stay compressed, window
        and sink tokens stay exact; per-layer constants measured on the first chunk (key
        mean, channel scale, outlier-channel permutation) are kept, since the kept tokens
        were stored with them.  ``crop(0)`` empties every layer (like :meth:`reset`).
        Buffers are not shrunk: the call costs O(1) per layer and copies nothing;
        ``memory_usage()`` counts only the kept tokens.  Empty layers stay empty.

        Parameters
        ----------
        length : int
            ``0 <= length <= seq_len(layer)`` for every non-empty layer (and not inside
            the evicted horizon of a sliding layer, see above).

        Raises
        ------
        TypeError, ValueError
            ``length`` not an int or out of range (the cache is unchanged).
        """
        length = check_int("length", length, minimum=0)
        with self._all_locks():
            floor, limit = self._crop_bounds()
            check_crop_length(length, floor, limit)
            for st in self._layers:
                if not st.seq_len or st.total_len == length:
                    continue
                if length == 0:
                    self._clear_layer(st)
                else:
                    self._crop_layer(st, length - st.meta.get("n_evicted", 0))

    # -- fork -----------------------------------------------------------------------------
    def __deepcopy__(self: _Cache, memo: dict[int, Any]) -> _Cache:
        cls = type(self)
        new = cls.__new__(cls)
        memo[id(self)] = new
        # configuration (codebooks, layouts, sketch, signs) is read-only after __init__ and
        # shared: the device constant cache keys on the host arrays' identity
        fields = {}
        for key, val in self.__dict__.items():
            if key == "_deferred":  # validate="deferred": the fork holds its own copy of the record
                fields[key] = copy.deepcopy(val, memo)
            elif key != "_layers":
                fields[key] = copy.copy(val) if isinstance(val, (dict, list)) else val
        layers = []
        with self._all_locks():
            for st in self._layers:
                layers.append(type(st)(lock=threading.Lock(), seq_len=st.seq_len, batch=st.batch, device=st.device,
                                       capacity=st.capacity,
                                       buffers={n: copy_array(b) for n, b in st.buffers.items()},
                                       live=dict(st.live), meta=dict(st.meta), window=st.window))
        fields["_layers"] = layers
        new.__dict__.update(fields)
        return new

    def fork(self: _Cache) -> _Cache:
        """An independent copy (same as ``copy.deepcopy(cache)``).

        Every buffer is copied (O(allocated bytes), on the buffers' device); the copy has
        its own locks.  The read-only configuration (codebooks, layouts, QJL sketch) is
        shared.  Changing one cache never changes the other.
        """
        return copy.deepcopy(self)

    # -- select_batch ---------------------------------------------------------------------
    def _checked_indices(self, indices: Any) -> list[tuple[Any, np.ndarray]]:
        """``(layer, int64 indices)`` of every non-empty layer; the caller holds the locks."""
        checked = [(st, check_indices(indices, st.batch)) for st in self._layers if st.seq_len]
        if not checked:
            check_indices(indices, 1 << 62)  # shape and type errors even on an empty cache
        return checked

    def check_batch_indices(self, indices: Sequence[int]) -> None:
        """Raise what :meth:`select_batch` would raise for ``indices`` (``TypeError`` /
        ``ValueError``), changing nothing."""
        with self._all_locks():
            self._checked_indices(indices)

    def select_batch(self: _Cache, indices: Sequence[int]) -> _Cache:
        """Keep and reorder batch rows, in place: row ``i`` of the result is row
        ``indices[i]`` of the cache (repeats allowed — beam search).

        The result equals a cache built from those rows: per-row state (codes, scales,
        window, key mean/scale, channel permutations) moves with its row.  Costs one copy
        of the selected rows of every buffer (O(bytes)).  Returns ``self``.

        Parameters
        ----------
        indices : sequence of int, shape ``(new_batch,)``
            Rows in ``[0, batch)``; ``new_batch >= 1``.

        Raises
        ------
        TypeError, ValueError
            Bad ``indices`` (the cache is unchanged).
        """
        with self._all_locks():
            checked = self._checked_indices(indices)
            hk = np.arange(self.num_kv_heads, dtype=np.int64)
            for st, idx in checked:
                rows = (idx[:, None] * self.num_kv_heads + hk[None, :]).reshape(-1)
                st.buffers = {n: take_rows(b, rows) for n, b in st.buffers.items()}
                st.batch = int(idx.size)
        return self

    # -- persistence ----------------------------------------------------------------------
    def config_dict(self) -> dict[str, Any]:
        """Constructor arguments (JSON types) that rebuild this cache's configuration:
        ``type(cache)(**cache.config_dict())`` is an empty cache configured the same way."""
        raise NotImplementedError

    def save(self, path: Any) -> None:
        """Write the cache to ``path`` (safetensors; see :func:`numba_kv.load_cache`).

        Copies every live buffer to the host once (O(live bytes)); the file holds the
        configuration, each layer's counters and live buffers, and a SHA-256 of both.
        Needs the ``safetensors`` package (``pip install numba_kv[io]``).
        """
        save_cache(self, path)
