"""Per-layer cache configuration: ``make_cache(..., layer_overrides={layer: {...}})``.

Layers whose resolved options are equal share one cache object (a *part*); a
:class:`MixedCache` routes every per-layer call to its part and sums the rest
(``memory_usage``, ``reset``, lifecycle).  With no effective override ``make_cache``
returns the plain cache, so nothing changes for callers that do not use overrides.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import json
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from .._validate import check_int, check_layer
from ._format import save_cache
from ._layer import LayeredCache, check_sliding_window, resolve_layer
from ._lifecycle import cache_repr, check_crop_length, hold_layers
from ._pieces import PER_HEAD_OPTIONS, Piece, split_call
from .dense import DenseCache
from .polarquant import PolarQuantCache
from .protocol import AttendConfig, DecodeOutput, DequantResult
from .state import CacheFileError, CacheState
from .turboquant import TurboQuantCache

__all__ = ["PART_CLASSES", "MixedCache", "Piece", "build_cache", "head_options", "layer_options", "resolve_head"]

#: the cache classes a mixed cache's parts may have, by name (the names its state stores)
PART_CLASSES: dict[str, type[LayeredCache]] = {c.__name__: c for c in (DenseCache, PolarQuantCache, TurboQuantCache)}

_GEOMETRY = ("num_layers", "num_kv_heads", "head_dim")


def _override_keys(cls: type) -> list[str]:
    """Constructor options of ``cls`` a layer may override (everything but the geometry):
    the fields of its configuration class, or its ``__init__`` keywords."""
    config_class = getattr(cls, "config_class", None)
    if config_class is not None:
        keys = [f.name for f in dataclasses.fields(config_class)]
    else:
        keys = [p.name for p in inspect.signature(cls.__init__).parameters.values()
                if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    return sorted(set(keys) - {"self", "mode", *_GEOMETRY})


def layer_options(cls: type, base: dict[str, Any], override: Any, where: str) -> dict[str, Any]:
    """``base`` updated by one layer's ``override`` dict (``bits`` resets ``k_bits``/``v_bits``)."""
    if not isinstance(override, dict):
        raise TypeError(f"{where}: expected a dict of options, got {type(override).__name__} {override!r}")
    allowed = _override_keys(cls)
    for key in override:
        if key not in allowed:
            raise ValueError(f"{where}: unknown option {key!r} for {cls.__name__}; expected one of {allowed}")
    opts = dict(base)
    if "bits" in override:  # a layer's bit width replaces the base's per-side widths
        for side in ("k_bits", "v_bits"):
            if side not in override:
                opts.pop(side, None)
        if opts.get("outlier_channels") and "outlier_bits" not in override:
            opts.pop("outlier_bits", None)
    opts.update(override)
    return opts


def resolve_head(where: str, key: Any, num_kv_heads: int) -> int:
    """A KV head index of a per-head mapping (``-1`` = last head) -> ``0 .. num_kv_heads-1``."""
    if isinstance(key, (bool, np.bool_)) or not isinstance(key, (int, np.integer)):
        raise TypeError(f"{where}: KV head keys must be ints, got {type(key).__name__} {key!r}")
    idx = int(key) + num_kv_heads if key < 0 else int(key)
    if not 0 <= idx < num_kv_heads:
        raise ValueError(f"{where}: KV head {key} is out of range for {num_kv_heads} KV heads "
                         f"(expected {-num_kv_heads} .. {num_kv_heads - 1})")
    return idx


def head_options(cls: type, layer_opts: dict[str, Any], override: Any, where: str) -> dict[str, Any]:
    """One KV head's options: its layer's ``layer_opts`` updated by ``override``, whose keys
    must be per-head options (:data:`~numba_kv.caches._pieces.PER_HEAD_OPTIONS`)."""
    if not isinstance(override, dict):
        raise TypeError(f"{where}: expected a dict of options, got {type(override).__name__} {override!r}")
    allowed = _override_keys(cls)
    per_head = sorted(set(PER_HEAD_OPTIONS) & set(allowed))
    for key in override:
        if key not in allowed:
            raise ValueError(f"{where}: unknown option {key!r} for {cls.__name__}; per-KV-head options: {per_head}")
        if key not in PER_HEAD_OPTIONS:
            raise ValueError(f"{where}: option {key!r} cannot differ between the KV heads of a layer (it decides "
                             f"which tokens the layer stores, for all its heads); per-KV-head options: {per_head}")
    return layer_options(cls, layer_opts, override, where)


def _per_head(cls: type, head_overrides: Any, per_layer: list[dict[str, Any]],
              num_kv_heads: int) -> dict[int, list[dict[str, Any]]]:
    """Every KV head's options of each layer ``head_overrides`` names (absolute indices)."""
    if head_overrides is None:
        return {}
    if not isinstance(head_overrides, dict):
        raise TypeError(f"head_overrides: expected a dict {{layer: {{kv_head: {{option: value}}}}}}, got "
                        f"{type(head_overrides).__name__}")
    out: dict[int, list[dict[str, Any]]] = {}
    seen: dict[int, Any] = {}
    for key, heads in head_overrides.items():
        idx = resolve_layer("head_overrides", key, len(per_layer))
        if idx in seen:
            raise ValueError(f"head_overrides: layer {idx} is given twice ({seen[idx]!r} and {key!r})")
        seen[idx] = key
        where = f"head_overrides[{key!r}]"
        if not isinstance(heads, dict):
            raise TypeError(f"{where}: expected a dict {{kv_head: {{option: value}}}}, got {type(heads).__name__}")
        opts = [per_layer[idx]] * num_kv_heads
        given: dict[int, Any] = {}
        for hkey, over in heads.items():
            h = resolve_head(where, hkey, num_kv_heads)
            if h in given:
                raise ValueError(f"{where}: KV head {h} is given twice ({given[h]!r} and {hkey!r})")
            given[h] = hkey
            opts[h] = head_options(cls, per_layer[idx], over, f"{where}[{hkey!r}]")
        out[idx] = opts
    return out


def _per_layer(cls: type, n: int, options: dict[str, Any],
               layer_overrides: Any) -> tuple[list[dict[str, Any]], list[int | None]]:
    """Every layer's options (``options`` updated by its override) and sliding window."""
    if layer_overrides is not None and not isinstance(layer_overrides, dict):
        raise TypeError(f"layer_overrides: expected a dict {{layer: {{option: value}}}}, got "
                        f"{type(layer_overrides).__name__}")
    windows = check_sliding_window(options.get("sliding_window"), n)
    base = {k: v for k, v in options.items() if k != "sliding_window"}
    per_layer: list[dict[str, Any]] = [dict(base) for _ in range(n)]
    seen: dict[int, Any] = {}
    for key, override in (layer_overrides or {}).items():
        idx = resolve_layer("layer_overrides", key, n)
        if idx in seen:
            raise ValueError(f"layer_overrides: layer {idx} is given twice ({seen[idx]!r} and {key!r})")
        seen[idx] = key
        opts = layer_options(cls, base, override, f"layer_overrides[{key!r}]")
        if "sliding_window" in opts:
            windows[idx] = check_sliding_window([opts.pop("sliding_window")], 1)[0]
        per_layer[idx] = opts
    return per_layer, windows


def build_cache(cls: type, geom: dict[str, Any], options: dict[str, Any],
                layer_overrides: dict[int, dict[str, Any]] | None,
                head_overrides: dict[int, dict[int, dict[str, Any]]] | None = None) -> Any:
    """``cls(**geom, **options)``, or a :class:`MixedCache` when ``layer_overrides`` or
    ``head_overrides`` change some layers' (or KV heads') options.

    Parameters
    ----------
    cls : type
        Cache class (``DenseCache``, ``PolarQuantCache``, ``TurboQuantCache``).
    geom : dict
        ``num_layers``, ``num_kv_heads``, ``head_dim``.
    options : dict
        Constructor options shared by every layer (``sliding_window`` may be per layer).
    layer_overrides : dict {int: dict}, optional
        Options of single layers (negative layers count from the end); keys are the
        constructor options of ``cls`` (``bits``, ``k_bits``, ``v_bits``, ``rotation``,
        ``residual_length``, ``sink_tokens``, ``window_dtype``, ``sliding_window``, ...).
        ``bits`` also replaces the base's ``k_bits``/``v_bits``.
    head_overrides : dict {int: dict {int: dict}}, optional
        Options of single KV heads of a layer, ``{layer: {kv_head: {option: value}}}``
        (negative layers and heads count from the end), applied over the layer's options
        with the same rule; only the per-vector code choices of
        :data:`~numba_kv.caches._pieces.PER_HEAD_OPTIONS` (``bits``, ``k_bits``,
        ``v_bits``, ...).  A layer whose heads differ is split into pieces, one per
        configuration.

    Raises
    ------
    TypeError, ValueError
        A bad override, naming the argument (``layer_overrides[...]`` /
        ``head_overrides[layer][kv_head]``), the layer or head, and the option.
    """
    if not layer_overrides and not head_overrides:
        for name, value in (("layer_overrides", layer_overrides), ("head_overrides", head_overrides)):
            if value is not None and not isinstance(value, dict):
                raise TypeError(f"{name}: expected a dict, got {type(value).__name__}")
        return cls(**geom, **options)
    n = check_int("num_layers", geom["num_layers"], minimum=1)
    nkv = check_int("num_kv_heads", geom["num_kv_heads"], minimum=1)
    per_layer, windows = _per_layer(cls, n, options, layer_overrides)
    per_head = _per_head(cls, head_overrides, per_layer, nkv)
    groups, opts_of, pieces = _layout(per_layer, per_head, nkv)
    if len(groups) == 1 and next(iter(groups))[1] == nkv:  # one configuration: every layer's, every head's
        return cls(**geom, **per_layer[0], sliding_window=windows)
    parts = []
    for (key, heads), members in groups.items():
        split = [(i, hs) for i, hs in members if heads < nkv]
        where = ("head_overrides: " + ", ".join(f"layer {i} KV heads {list(hs)}" for i, hs in split) if split
                 else f"layer_overrides: layers {[i for i, _ in members]}")
        try:
            parts.append(cls(num_layers=len(members), num_kv_heads=heads, head_dim=geom["head_dim"],
                             **opts_of[key], sliding_window=[windows[i] for i, _ in members]))
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{where}: {exc}") from exc
    return MixedCache(parts, pieces)


def _layout(per_layer: list[dict[str, Any]], per_head: dict[int, list[dict[str, Any]]], num_kv_heads: int
            ) -> tuple[dict[tuple[str, int], list[tuple[int, tuple[int, ...]]]], dict[str, dict[str, Any]], list[Any]]:
    """The parts and the layer map of a mixed cache: parts keyed by (configuration, head
    count), each with its ``(model layer, KV heads)`` members in layer order; the options of
    each configuration; the layer map (``(part, layer)`` for a layer in one piece, else its
    :class:`Piece` s)."""
    def key(opts: dict[str, Any]) -> str:
        k = json.dumps(opts, sort_keys=True, default=str)
        opts_of.setdefault(k, opts)
        return k

    opts_of: dict[str, dict[str, Any]] = {}
    groups: dict[tuple[str, int], list[tuple[int, tuple[int, ...]]]] = {}
    layer_pieces: list[list[tuple[tuple[str, int], tuple[int, ...]]]] = []
    for i, opts in enumerate(per_layer):
        by: dict[str, list[int]] = {}
        for h, o in enumerate(per_head.get(i, [opts] * num_kv_heads)):
            by.setdefault(key(o), []).append(h)
        layer_pieces.append([((k, len(hs)), tuple(hs)) for k, hs in by.items()])
        for g, hs in layer_pieces[-1]:
            groups.setdefault(g, []).append((i, hs))
    index = {g: p for p, g in enumerate(groups)}
    pieces: list[Any] = []
    for i, lp in enumerate(layer_pieces):
        ps = tuple(Piece(index[g], [m for m, _ in groups[g]].index(i), hs) for g, hs in lp)
        pieces.append((ps[0].part, ps[0].layer) if len(ps) == 1 else ps)
    return groups, opts_of, pieces


def _normalized(entry: Any, parts: list[LayeredCache]) -> tuple[Piece, ...]:
    """One layer-map entry as pieces: ``(part, layer)`` (the whole layer in one part, every
    KV head in order) or a sequence of ``(part, layer, heads)``."""
    if isinstance(entry, (list, tuple)) and len(entry) == 2 and all(
            isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in entry):
        p = int(entry[0])
        if not 0 <= p < len(parts):
            raise ValueError(f"layer_map: part {p} does not exist ({len(parts)} parts)")
        return (Piece(p, int(entry[1]), tuple(range(parts[p].num_kv_heads))),)
    if not isinstance(entry, (list, tuple)) or not entry:
        raise TypeError(f"layer_map: expected (part, layer) or a list of (part, layer, heads), got {entry!r:.80}")
    out = []
    for piece in entry:
        if not isinstance(piece, (list, tuple)) or len(piece) != 3 or not isinstance(piece[2], (list, tuple)):
            raise TypeError(f"layer_map: expected a piece (part, layer, heads), got {piece!r:.80}")
        p, j = check_int("layer_map part", piece[0], minimum=0), check_int("layer_map layer", piece[1], minimum=0)
        if p >= len(parts):
            raise ValueError(f"layer_map: part {p} does not exist ({len(parts)} parts)")
        out.append(Piece(p, j, tuple(check_int("layer_map head", h, minimum=0) for h in piece[2])))
    return tuple(out)


def _check_split_layer(i: int, pieces: tuple[Piece, ...], parts: list[LayeredCache], num_kv_heads: int) -> None:
    """``ValueError`` unless the pieces of layer ``i`` hold each KV head once, in parts of
    their head count and of one configuration up to the per-head options, with one sliding
    window and (filled parts: a loaded file) one sequence state."""
    heads = [h for pc in pieces for h in pc.heads]
    if sorted(heads) != list(range(num_kv_heads)):
        raise ValueError(f"layer_map: the pieces of layer {i} hold KV heads {heads}, expected each of "
                         f"0 .. {num_kv_heads - 1} once")
    shared = set(PER_HEAD_OPTIONS) | {"num_layers", "num_kv_heads", "sliding_window"}
    seen = set()
    for pc in pieces:
        part = parts[pc.part]
        if len(pc.heads) != part.num_kv_heads:
            raise ValueError(f"layer_map: a piece of layer {i} holds {len(pc.heads)} KV heads in part {pc.part}, "
                             f"which has {part.num_kv_heads}")
        cfg = {k: v for k, v in part.config_dict().items() if k not in shared}
        st = part._layers[pc.layer] if pc.layer < part.num_layers else None  # noqa: SLF001 - batch has no getter
        state = None if st is None else (st.seq_len, st.evicted, st.batch if st.seq_len else None)
        seen.add((type(part).__name__, json.dumps(cfg, sort_keys=True, default=str),
                  part.layer_windows[pc.layer] if st is not None else None, state))
    if len(seen) != 1:
        raise ValueError(f"layer_map: the pieces of layer {i} differ in more than the per-KV-head options "
                         f"{list(PER_HEAD_OPTIONS)} (class, window, sequence options or stored tokens)")


class MixedCache:
    """Layers (or KV heads of a layer) with different configurations in one cache: every
    layer call goes to the layer's *part*, a cache holding the layers that share its
    configuration.  Built by ``make_cache(..., layer_overrides=..., head_overrides=...)``.

    A layer whose KV heads differ (``head_overrides``) is *split*: each group of its heads
    that shares a configuration is a *piece*, a layer of a part with that many KV heads.
    A call on a split layer gathers each piece's KV heads (and their query heads) from the
    inputs, validates every piece before any stores, and scatters the outputs back (see
    :mod:`numba_kv.caches._pieces`); a layer in one piece is passed straight to its part.

    Implements the protocol (``prefill``, ``decode``, ``seq_len``, ``reset``,
    ``memory_usage``) and the lifecycle (``crop``, ``fork``, ``select_batch``, ``save``;
    ``load_cache`` reads it back).  ``memory_usage`` is the sum over parts, so per-layer and
    per-head bit widths show up exactly.

    Parameters
    ----------
    parts : list of LayeredCache
        The caches of each configuration (same ``head_dim``; a part holding pieces has their
        head count).
    layer_map : list
        For every model layer either ``(part index, layer inside the part)`` (the whole
        layer, every KV head) or a list of pieces ``(part index, layer inside the part,
        KV heads)``; each part layer is used exactly once.

    Attributes
    ----------
    layer_map : list of tuple of Piece
        Every model layer's pieces (one for a layer that is not split).
    """

    def __init__(self, parts: Sequence[LayeredCache], layer_map: Sequence[Any]) -> None:
        parts = list(parts)
        if not parts or not all(isinstance(p, LayeredCache) for p in parts):
            raise TypeError("parts: expected a non-empty list of layered caches")
        dims = {p.head_dim for p in parts}
        if len(dims) != 1:
            raise ValueError(f"parts: expected one head_dim, got {sorted(dims)}")
        lm = [_normalized(e, parts) for e in layer_map]
        if not lm:
            raise ValueError("layer_map: expected at least one layer")
        used = sorted((pc.part, pc.layer) for pieces in lm for pc in pieces)
        if used != sorted((p, j) for p, c in enumerate(parts) for j in range(c.num_layers)):
            raise ValueError("layer_map: expected every layer of every part exactly once")
        nkv = {sum(len(pc.heads) for pc in pieces) for pieces in lm}
        if len(nkv) != 1:
            raise ValueError(f"layer_map: expected one num_kv_heads for every layer, got {sorted(nkv)}")
        self.num_kv_heads, self.head_dim = nkv.pop(), dims.pop()
        whole = tuple(range(self.num_kv_heads))
        # a layer in one piece with its heads in order goes straight to its part (no gather)
        self._direct: list[tuple[LayeredCache, int] | None] = []
        self._locks: dict[int, threading.Lock] = {}  # split layers: one call at a time
        for i, pieces in enumerate(lm):
            if len(pieces) == 1 and pieces[0].heads == whole:
                self._direct.append((parts[pieces[0].part], pieces[0].layer))
            else:
                _check_split_layer(i, pieces, parts, self.num_kv_heads)
                self._direct.append(None)
                self._locks[i] = threading.Lock()
        self.parts = parts
        self.layer_map = lm
        self.num_layers = len(lm)

    # -- routing ----------------------------------------------------------------------------
    def _pieces(self, layer: int) -> list[tuple[LayeredCache, int, tuple[int, ...]]]:
        return [(self.parts[pc.part], pc.layer, pc.heads) for pc in self.layer_map[layer]]

    def layer_pieces(self, layer: int) -> list[tuple[LayeredCache, int, tuple[int, ...]]]:
        """``(part, layer inside the part, KV heads)`` of every piece of ``layer`` (one piece
        holding every head unless the layer is split by ``head_overrides``)."""
        return self._pieces(check_layer(layer, self.num_layers))

    def layer_cache(self, layer: int) -> LayeredCache:
        """The part that stores ``layer`` (``ValueError`` for a layer split over KV heads:
        see :meth:`layer_pieces`)."""
        i = check_layer(layer, self.num_layers)
        direct = self._direct[i]
        if direct is None:
            raise ValueError(f"layer: layer {i} is split over KV heads (head_overrides); see layer_pieces({i})")
        return direct[0]

    def empty_layer(self, layer: int) -> LayeredCache | MixedCache:
        """An empty one-layer cache configured like ``layer`` (its part's configuration and
        sliding window; a one-layer mixed cache for a split layer)."""
        i = check_layer(layer, self.num_layers)
        ones = []
        for part, j, _ in self._pieces(i):
            cfg = part.config_dict()
            cfg["num_layers"], cfg["sliding_window"] = 1, [part.layer_windows[j]]
            ones.append(type(part)(**cfg))
        if self._direct[i] is not None:
            return ones[0]
        return MixedCache(ones, [[(n, 0, pc.heads) for n, pc in enumerate(self.layer_map[i])]])

    @property
    def layer_windows(self) -> list[int | None]:
        """Sliding window of every layer (``None``: global)."""
        return [self.parts[pieces[0].part].layer_windows[pieces[0].layer] for pieces in self.layer_map]

    def __repr__(self) -> str:
        return cache_repr(self, [self.seq_len(i) for i in range(self.num_layers)])

    @property
    def name(self) -> str:
        """``mixed[...]``: the parts' names by layer; a split layer's pieces as
        ``name{heads}`` joined by ``+`` (``pqo3{0,2}+pqo4{1}``)."""
        def one(p: int) -> str:
            return getattr(self.parts[p], "name", type(self.parts[p]).__name__)

        return "mixed[" + ",".join(
            one(pieces[0].part) if d is not None else
            "+".join(one(pc.part) + "{" + ",".join(map(str, pc.heads)) + "}" for pc in pieces)
            for d, pieces in zip(self._direct, self.layer_map)) + "]"

    @property
    def validate(self) -> str:
        """See :attr:`LayeredCache.validate` (set on every part)."""
        return self.parts[0].validate

    @validate.setter
    def validate(self, mode: str) -> None:
        for part in self.parts:
            part.validate = mode

    def check_inputs(self) -> None:
        """See :meth:`LayeredCache.check_inputs` (every part)."""
        for part in self.parts:
            part.check_inputs()

    def prefill(self, layer: int, k: Any, v: Any, q: Any = None) -> DequantResult:
        """See :meth:`LayeredCache.prefill`."""
        i = check_layer(layer, self.num_layers)
        direct = self._direct[i]
        if direct is not None:
            return direct[0].prefill(direct[1], k, v, q)
        with self._locks[i]:
            return split_call(self._pieces(i), self.num_kv_heads, self.head_dim, k, v, q, None)

    def decode(self, layer: int, k: Any, v: Any, q: Any, config: AttendConfig, *, out: Any = None) -> DecodeOutput:
        """See :meth:`LayeredCache.decode` (``out=`` included: a layer split between parts
        attends piece by piece and copies the assembled output into ``out``)."""
        i = check_layer(layer, self.num_layers)
        direct = self._direct[i]
        if direct is not None:
            return direct[0].decode(direct[1], k, v, q, config, out=out)
        if not isinstance(config, AttendConfig):
            raise TypeError(f"config: expected an AttendConfig, got {type(config).__name__}")
        with self._locks[i]:
            return split_call(self._pieces(i), self.num_kv_heads, self.head_dim, k, v, q, config, out=out)

    def seq_len(self, layer: int) -> int:
        """Tokens ``layer`` has seen (every piece of a split layer has seen as many)."""
        pc = self.layer_map[check_layer(layer, self.num_layers)][0]
        return self.parts[pc.part].seq_len(pc.layer)

    def stored_len(self, layer: int) -> int:
        """Tokens ``layer`` stores (less than ``seq_len`` on sliding layers)."""
        pc = self.layer_map[check_layer(layer, self.num_layers)][0]
        return self.parts[pc.part].stored_len(pc.layer)

    def live_arrays(self, layer: int) -> list[Any]:
        """Views of the live part of every buffer of ``layer`` (of every piece, in order)."""
        i = check_layer(layer, self.num_layers)
        with self._locks.get(i) or contextlib.nullcontext():
            return [a for part, j, _ in self._pieces(i) for a in part.live_arrays(j)]

    @contextlib.contextmanager
    def _split_locks(self) -> Iterator[None]:
        """Hold every split layer's lock (taken before any part's locks, as calls take them),
        so that a lifecycle operation sees and leaves the pieces of a layer in one state."""
        with contextlib.ExitStack() as stack:
            for i in sorted(self._locks):
                stack.enter_context(self._locks[i])
            yield

    @contextlib.contextmanager
    def _all_locks(self) -> Iterator[None]:
        """Hold every lock of the cache for a whole lifecycle operation, so that it sees and
        leaves every layer in one state (a fork taken while other threads decode is a
        consistent snapshot): the split layers' locks first (as calls take them), then the
        lock of every part layer at once, in model layer order (a split layer's pieces in
        the order its calls take them), the rule of the plain caches
        (:func:`~numba_kv.caches._lifecycle.hold_layers`).  The parts' own lifecycle
        operations run inside without taking them again."""
        with self._split_locks(), hold_layers([(self.parts[pc.part], pc.layer)
                                               for pieces in self.layer_map for pc in pieces]):
            yield

    def reset(self) -> None:
        """Drop every layer's tokens, under every lock at once (see :meth:`LayeredCache.reset`)."""
        with self._all_locks():
            for p in self.parts:
                p.reset()

    @property
    def bits_per_value(self) -> float:
        """Stored bits per value, averaged over every KV head of every layer: each piece's
        part's ``bits_per_value`` weighted by the KV heads it holds (what the part counts:
        a compressed part's window tokens are not included, ``memory_usage`` counts them)."""
        total = sum(self.parts[pc.part].bits_per_value * len(pc.heads) for pieces in self.layer_map for pc in pieces)
        return total / (self.num_layers * self.num_kv_heads)

    def memory_usage(self) -> int:
        """Exact bytes of live stored data, summed over layers."""
        return sum(p.memory_usage() for p in self.parts)

    def allocated_bytes(self) -> int:
        """Bytes of all allocated buffers."""
        return sum(p.allocated_bytes() for p in self.parts)

    def fp16_bytes(self) -> int:
        """Bytes the live tokens would take as an uncompressed float16 cache."""
        return sum(p.fp16_bytes() for p in self.parts)

    # -- lifecycle --------------------------------------------------------------------------
    def crop_range(self) -> tuple[int, int | None]:
        """``(floor, limit)`` of the lengths :meth:`crop` accepts besides 0, over every part
        (see :meth:`LayeredCache.crop_range`)."""
        with self._all_locks():
            return self._crop_range()

    def _crop_range(self) -> tuple[int, int | None]:
        """:meth:`crop_range`; the caller holds every lock (:meth:`_all_locks`)."""
        floor, limit = 0, None
        for p in self.parts:
            f, lim = p.crop_range()
            floor = max(floor, f)
            if lim is not None:
                limit = lim if limit is None else min(limit, lim)
        return floor, limit

    def crop(self, length: int) -> None:
        """Keep the first ``length`` tokens of every layer (see :meth:`LayeredCache.crop`);
        the range is checked on every part before any part changes, all under every layer's
        lock.  Empty layers stay empty, as in a plain cache."""
        length = check_int("length", length, minimum=0)
        with self._all_locks():
            check_crop_length(length, *self._crop_range())
            for p in self.parts:
                # a part whose layers are all empty refuses every length but 0 (nothing to keep):
                # skipped, or a crop the whole cache allows would fail there after earlier parts cropped
                if length == 0 or p.crop_range()[1] is not None:
                    p.crop(length)

    def __deepcopy__(self, memo: dict[int, Any]) -> MixedCache:
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(self.__dict__)
        with self._all_locks():  # one snapshot of every part
            new.parts = [copy.deepcopy(p, memo) for p in self.parts]
        new.layer_map = list(self.layer_map)
        # the copy's own locks, and its direct routes to its own parts
        new.__dict__.update(_locks={i: threading.Lock() for i in self._locks},
                            _direct=[None if d is None else (new.parts[self.parts.index(d[0])], d[1])
                                     for d in self._direct])
        return new

    def fork(self) -> MixedCache:
        """An independent copy (same as ``copy.deepcopy(cache)``), taken under every layer's
        lock: a consistent snapshot even while other threads decode."""
        return copy.deepcopy(self)

    def select_batch(self, indices: Sequence[int]) -> MixedCache:
        """Keep and reorder batch rows of every layer (see :meth:`LayeredCache.select_batch`);
        the indices are checked on every part before any part changes, all under every
        layer's lock."""
        with self._all_locks():
            for p in self.parts:
                p.check_batch_indices(indices)
            for p in self.parts:
                p.select_batch(indices)
        return self

    def config_dict(self) -> dict[str, Any]:
        """Parts (class and constructor arguments) and the layer map, as JSON types: a layer
        in one piece as ``[part, layer]`` (the format of files written before
        ``head_overrides`` existed), a split layer as ``[[part, layer, [heads]], ...]``."""
        return {"parts": [{"cache_class": type(p).__name__, "config": p.config_dict()} for p in self.parts],
                "layer_map": [[pieces[0].part, pieces[0].layer] if d is not None else
                              [[pc.part, pc.layer, list(pc.heads)] for pc in pieces]
                              for d, pieces in zip(self._direct, self.layer_map)]}

    def state_dict(self) -> CacheState:
        """The cache as plain data: :meth:`config_dict`, ``{"parts": [state of every part]}``
        and every part's tensors prefixed ``parts.<p>.`` (see
        :meth:`LayeredCache.state_dict`), taken under every layer's lock (one snapshot)."""
        states, tensors = [], {}
        with self._all_locks():
            for p, part in enumerate(self.parts):
                sd = part.state_dict()
                states.append(sd.state)
                tensors.update({f"parts.{p}.{n}": t for n, t in sd.tensors.items()})
        return CacheState(self.config_dict(), {"parts": states}, tensors)

    @classmethod
    def from_state_dict(cls, state: CacheState) -> MixedCache:
        """The cache :meth:`state_dict` described, on the host; each part is rebuilt by its
        class's ``from_state_dict`` (which validates it) before the mixed cache is built.

        Raises
        ------
        CacheFileError
            Parts and part states that do not match, an unknown part class, tensors outside
            the parts, or a part's own error.
        TypeError, ValueError
            A bad ``config``.
        """
        parts_cfg, states = state.config.get("parts"), state.state.get("parts")
        if not isinstance(parts_cfg, list) or not isinstance(states, list) or len(parts_cfg) != len(states):
            raise CacheFileError("config: a MixedCache needs matching lists of parts and part states")
        parts = []
        used = 0
        for p, (pc, ps) in enumerate(zip(parts_cfg, states)):
            if not isinstance(pc, dict) or pc.get("cache_class") not in PART_CLASSES:
                raise CacheFileError(f"config: part {p} has an unknown cache class")
            prefix = f"parts.{p}."
            own = {n[len(prefix):]: t for n, t in state.tensors.items() if n.startswith(prefix)}
            used += len(own)
            parts.append(PART_CLASSES[pc["cache_class"]].from_state_dict(CacheState(pc.get("config"), ps, own)))
        if used != len(state.tensors):
            raise CacheFileError("tensors: unexpected tensors outside the parts")
        layer_map = state.config.get("layer_map")
        if not isinstance(layer_map, list):
            raise CacheFileError("config: a MixedCache needs a layer_map list")
        return cls(parts, layer_map)

    def save(self, path: Any) -> None:
        """Write the cache to ``path`` (safetensors; see :func:`numba_kv.load_cache`)."""
        save_cache(self, path)
