"""Per-layer cache configuration: ``make_cache(..., layer_overrides={layer: {...}})``.

Layers whose resolved options are equal share one cache object (a *part*); a
:class:`MixedCache` routes every per-layer call to its part and sums the rest
(``memory_usage``, ``reset``, lifecycle).  With no effective override ``make_cache``
returns the plain cache, so nothing changes for callers that do not use overrides.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import json
from collections.abc import Sequence
from typing import Any

from .._validate import check_int, check_layer
from ._format import save_cache
from ._layer import LayeredCache, check_sliding_window, resolve_layer
from ._lifecycle import check_crop_length
from .dense import DenseCache
from .polarquant import PolarQuantCache
from .protocol import AttendConfig, DecodeOutput, DequantResult
from .state import CacheFileError, CacheState
from .turboquant import TurboQuantCache

__all__ = ["PART_CLASSES", "MixedCache", "build_cache", "layer_options"]

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


def build_cache(cls: type, geom: dict[str, Any], options: dict[str, Any],
                layer_overrides: dict[int, dict[str, Any]] | None) -> Any:
    """``cls(**geom, **options)``, or a :class:`MixedCache` when ``layer_overrides`` changes
    some layers' options.

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
    """
    if not layer_overrides:
        if layer_overrides is not None and not isinstance(layer_overrides, dict):
            raise TypeError(f"layer_overrides: expected a dict {{layer: {{option: value}}}}, got "
                            f"{type(layer_overrides).__name__}")
        return cls(**geom, **options)
    if not isinstance(layer_overrides, dict):
        raise TypeError(f"layer_overrides: expected a dict {{layer: {{option: value}}}}, got "
                        f"{type(layer_overrides).__name__}")
    n = check_int("num_layers", geom["num_layers"], minimum=1)
    windows = check_sliding_window(options.get("sliding_window"), n)
    base = {k: v for k, v in options.items() if k != "sliding_window"}
    per_layer: list[dict[str, Any]] = [dict(base) for _ in range(n)]
    seen: dict[int, Any] = {}
    for key, override in layer_overrides.items():
        idx = resolve_layer("layer_overrides", key, n)
        if idx in seen:
            raise ValueError(f"layer_overrides: layer {idx} is given twice ({seen[idx]!r} and {key!r})")
        seen[idx] = key
        opts = layer_options(cls, base, override, f"layer_overrides[{key!r}]")
        if "sliding_window" in opts:
            windows[idx] = check_sliding_window([opts.pop("sliding_window")], 1)[0]
        per_layer[idx] = opts
    groups: dict[str, list[int]] = {}
    for i, opts in enumerate(per_layer):
        groups.setdefault(json.dumps(opts, sort_keys=True, default=str), []).append(i)
    if len(groups) == 1:  # one configuration: every layer's (the overrides may cover all layers)
        return cls(**geom, **per_layer[0], sliding_window=windows)
    parts, layer_map = [], [(0, 0)] * n
    for p, layers in enumerate(groups.values()):
        opts = per_layer[layers[0]]
        try:
            parts.append(cls(num_layers=len(layers), num_kv_heads=geom["num_kv_heads"], head_dim=geom["head_dim"],
                             **opts, sliding_window=[windows[i] for i in layers]))
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"layer_overrides: layers {layers}: {exc}") from exc
        for j, i in enumerate(layers):
            layer_map[i] = (p, j)
    return MixedCache(parts, layer_map)


class MixedCache:
    """Layers with different configurations (bits, rotation, window, sliding window) in one
    cache: every layer call goes to the layer's *part*, a cache holding the layers that
    share its configuration.  Built by ``make_cache(..., layer_overrides=...)``.

    Implements the protocol (``prefill``, ``decode``, ``seq_len``, ``reset``,
    ``memory_usage``) and the lifecycle (``crop``, ``fork``, ``select_batch``, ``save``;
    ``load_cache`` reads it back).  ``memory_usage`` is the sum over parts, so per-layer bit
    widths show up exactly.

    Parameters
    ----------
    parts : list of LayeredCache
        The caches of each configuration (same ``num_kv_heads`` and ``head_dim``).
    layer_map : list of (int, int)
        For every model layer: ``(part index, layer inside the part)``; each part layer is
        used exactly once.
    """

    def __init__(self, parts: Sequence[LayeredCache], layer_map: Sequence[tuple[int, int]]) -> None:
        parts = list(parts)
        if not parts or not all(isinstance(p, LayeredCache) for p in parts):
            raise TypeError("parts: expected a non-empty list of layered caches")
        geo = {(p.num_kv_heads, p.head_dim) for p in parts}
        if len(geo) != 1:
            raise ValueError(f"parts: expected one (num_kv_heads, head_dim), got {sorted(geo)}")
        lm = [(int(a), int(b)) for a, b in layer_map]
        if sorted(lm) != sorted((p, j) for p, c in enumerate(parts) for j in range(c.num_layers)):
            raise ValueError("layer_map: expected every layer of every part exactly once")
        self.parts = parts
        self.layer_map = lm
        self.num_layers = len(lm)
        self.num_kv_heads, self.head_dim = geo.pop()

    # -- routing ----------------------------------------------------------------------------
    def _part(self, layer: Any) -> tuple[LayeredCache, int]:
        p, j = self.layer_map[check_layer(layer, self.num_layers)]
        return self.parts[p], j

    def layer_cache(self, layer: int) -> LayeredCache:
        """The part that stores ``layer``."""
        return self._part(layer)[0]

    @property
    def layer_windows(self) -> list[int | None]:
        """Sliding window of every layer (``None``: global)."""
        return [self.parts[p].layer_windows[j] for p, j in self.layer_map]

    @property
    def name(self) -> str:
        """``mixed[...]``: the parts' names by layer."""
        return "mixed[" + ",".join(getattr(self.parts[p], "name", type(self.parts[p]).__name__)
                                   for p, _ in self.layer_map) + "]"

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
        part, j = self._part(layer)
        return part.prefill(j, k, v, q)

    def decode(self, layer: int, k: Any, v: Any, q: Any, config: AttendConfig) -> DecodeOutput:
        """See :meth:`LayeredCache.decode`."""
        part, j = self._part(layer)
        return part.decode(j, k, v, q, config)

    def seq_len(self, layer: int) -> int:
        """Tokens ``layer`` has seen."""
        part, j = self._part(layer)
        return part.seq_len(j)

    def stored_len(self, layer: int) -> int:
        """Tokens ``layer`` stores (less than ``seq_len`` on sliding layers)."""
        part, j = self._part(layer)
        return part.stored_len(j)

    def live_arrays(self, layer: int) -> list[Any]:
        """Views of the live part of every buffer of ``layer``."""
        part, j = self._part(layer)
        return part.live_arrays(j)

    def reset(self) -> None:
        """Drop every layer's tokens."""
        for p in self.parts:
            p.reset()

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
        floor, limit = 0, None
        for p in self.parts:
            f, lim = p.crop_range()
            floor = max(floor, f)
            if lim is not None:
                limit = lim if limit is None else min(limit, lim)
        return floor, limit

    def crop(self, length: int) -> None:
        """Keep the first ``length`` tokens of every layer (see :meth:`LayeredCache.crop`);
        the range is checked on every part before any part changes."""
        length = check_int("length", length, minimum=0)
        check_crop_length(length, *self.crop_range())
        for p in self.parts:
            p.crop(length)

    def __deepcopy__(self, memo: dict[int, Any]) -> MixedCache:
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(self.__dict__)
        new.parts = [copy.deepcopy(p, memo) for p in self.parts]
        new.layer_map = list(self.layer_map)
        return new

    def fork(self) -> MixedCache:
        """An independent copy (same as ``copy.deepcopy(cache)``)."""
        return copy.deepcopy(self)

    def select_batch(self, indices: Sequence[int]) -> MixedCache:
        """Keep and reorder batch rows of every layer (see :meth:`LayeredCache.select_batch`);
        the indices are checked on every part before any part changes."""
        for p in self.parts:
            p.check_batch_indices(indices)
        for p in self.parts:
            p.select_batch(indices)
        return self

    def config_dict(self) -> dict[str, Any]:
        """Parts (class and constructor arguments) and the layer map, as JSON types."""
        return {"parts": [{"cache_class": type(p).__name__, "config": p.config_dict()} for p in self.parts],
                "layer_map": [list(m) for m in self.layer_map]}

    def state_dict(self) -> CacheState:
        """The cache as plain data: :meth:`config_dict`, ``{"parts": [state of every part]}``
        and every part's tensors prefixed ``parts.<p>.`` (see
        :meth:`LayeredCache.state_dict`)."""
        states, tensors = [], {}
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
        return cls(parts, [tuple(m) for m in state.config.get("layer_map", [])])

    def save(self, path: Any) -> None:
        """Write the cache to ``path`` (safetensors; see :func:`numba_kv.load_cache`)."""
        save_cache(self, path)
