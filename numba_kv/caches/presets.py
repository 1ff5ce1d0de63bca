"""Named presets: ``make_cache("kv4", ...)`` / ``make_cache("kv5", ...)``.

A preset is a cache name of the grammar (:mod:`numba_kv.caches.spec`) with fixed options, a
bit budget and optional per-layer overrides.  Its full-precision window is not a fixed
number of tokens: it is the largest ``residual_length`` for which the cache stays within the
budget **at** :data:`BUDGET_TOKENS` **tokens** on the given geometry (``head_dim``, layer
count, sliding windows), every byte counted — compressed codes, per-vector norms, the int8
window with its scales, per-layer constants (key means) and the protected layers' extra
bits.  A wider head pays less for its norms, so it gets a longer window for the same
budget.  The global layers share one window; a sliding layer (Gemma-3's local layers)
stores only its last ``sliding_window`` tokens, so it is sized on its own over those and
its window is longer (at ``kv5`` on Gemma-3-270M, all 512 tokens it can see).

One table, :data:`PRESETS`; :func:`resolve_preset` turns a name and a geometry into the
arguments of :func:`~numba_kv.make_cache`.  Bytes are counted by
:meth:`PolarQuantConfig.stored_bytes <numba_kv.caches.config.PolarQuantConfig.stored_bytes>`, the
formula the caches' own accounting uses.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._validate import check_head_dim, check_int
from ..ops.headquant import HEAD_DIMS
from ._layer import check_sliding_window, resolve_layer
from .config import PolarQuantConfig
from .mixed import head_options, layer_options, resolve_head
from .names import merge_name_options, name_options
from .polarquant import PolarQuantCache
from .turboquant import TurboQuantCache

__all__ = ["BUDGET_TOKENS", "PRESETS", "Preset", "merge_head_overrides", "preset_bytes", "resolve_preset"]

#: Sequence length at which a preset's bit budget is counted (window tokens included).
BUDGET_TOKENS = 1024


@dataclass(frozen=True)
class Preset:
    """One named preset.

    Attributes
    ----------
    name : str
        The preset's name (``"kv4"``).
    base : str
        Compressed cache name of :func:`~numba_kv.make_cache` without window suffix or
        options (``"pqo-k4v3-head-eden"``).
    options : dict
        Fixed constructor options (``key_center``, ``window_dtype``, ...).
    budget : float
        Bits per value (K and V averaged) at :data:`BUDGET_TOKENS` tokens.
    sink_tokens : int
        First tokens kept in the window; the newest ``residual_length`` fill the rest of
        the budget.
    layer_overrides : dict {int: dict}
        Options of single layers; negative keys count from the end (``-1``: last layer).
    head_overrides : dict {int: dict {int: dict}}
        Bit widths of single KV heads, ``{layer: {kv_head: {option: value}}}`` (the
        ``head_overrides`` of :func:`~numba_kv.make_cache`; negative keys count from the
        end); counted in the budget head by head.
    summary : str
        One line for help texts.
    residual_fraction : float or "budget"
        A window that grows with the history (the cache option ``residual_fraction``, 0:
        none): at ``t`` tokens it holds ``max(residual_length, floor(f·t))`` tokens, so the
        bits/value stays near the budget at long lengths instead of falling to the codes'
        width.  ``residual_length`` is still sized to the budget at :data:`BUDGET_TOKENS`
        with the fraction counted (:func:`preset_bytes` counts it at any length).
        ``"budget"``: the global layers' fraction is their sized window over
        :data:`BUDGET_TOKENS` (``f = R / 1024``), so they hold the budget at every length
        from :data:`BUDGET_TOKENS` on whatever the geometry; a sliding layer's is its own
        sized window over :data:`BUDGET_TOKENS`, of the history it has seen, so its window
        grows until it holds every token the layer stores (all of them int8 from about
        1,300 tokens on with ``kv3`` on Gemma-3-270M) while its bits/value, counted over the
        history, falls.
    """

    name: str
    base: str
    options: Mapping[str, Any]
    budget: float
    sink_tokens: int = 4
    layer_overrides: Mapping[int, Mapping[str, Any]] = field(default_factory=dict)
    head_overrides: Mapping[int, Mapping[int, Mapping[str, Any]]] = field(default_factory=dict)
    summary: str = ""
    residual_fraction: float | str = 0.0  # (last: the fields before it keep their positions)


_BASE = "pqo-k4v3-head-eden"
_BASE_OPTIONS = {"key_center": True, "window_dtype": "int8"}

#: The presets.  Chosen by measurement on SmolLM2-135M (head_dim 64) and Gemma-3-270M
#: (head_dim 256), N = 1024, P = 128 (README, "Named presets"): at equal bits, protecting
#: the first and last layers (4-bit values or an all-int8 layer) bought no more than the
#: window those bytes would buy, so both presets spend the whole budget on the (rotated)
#: int8 window.  Sinks: of 4 / 8 / 16 / 32, the lowest mean KL summed over both models among
#: those that retrieve every needle dense retrieves — 4 at 4.0 bits, 8 at 5.0 bits (16 and
#: 32 sinks had KL as low, inside the noise, but each missed a SmolLM2 needle dense finds).
#: ``kv5`` spends its bits on wider codes instead of a long window: at long contexts the
#: window is a rounding error and the codes of the older history set the quality.  With 4-bit
#: keys and 3-bit values it lost 0.80 % perplexity on Gemma-3-270M at 8K tokens; 5-bit keys
#: and 4-bit values (a 60 + 8 token window at head_dim 64) hold its targets at 1,024 tokens
#: with lower KL on both models, and at 4K-32K (+0.25 % at 8K on Gemma-3-270M; the docs'
#: benchmarks page, "Long-context quality").
#: ``kv3`` (3.5 bits/value) takes every lever measured to pay below 4 bits
#: (``benchmarks/results/kv3-*.md``): 4-bit keys and 2-bit values on the head VQ code (pairs /
#: quads of rotated coordinates on one-byte codebooks: KL 0.0108 -> 0.0086 at equal bytes),
#: 8-bit log norms (free in quality; 0.125 bit/value at d = 64, spent on the window), 16 sinks
#: (on SmolLM2 at 1,024 tokens top-1 0.945 / 0.950 / 0.955 with 4 / 8 / 16 sinks and
#: calibrated widths) and a window that grows with the history at the rate the budget sized at
#: 1,024 tokens (``residual_fraction="budget"``): at 8K a window fixed at its 1K size missed
#: top-1 (0.938), one grown with the history passes (0.97).  Per-KV-head widths calibrated on
#: a model (``head_overrides``, ``benchmarks/kv3_layers.py --overrides-out``) are counted
#: before the window is sized.
PRESETS: dict[str, Preset] = {
    "kv3": Preset("kv3", "pqo-k4v2-head-eden-vq-n8", _BASE_OPTIONS, 3.5, sink_tokens=16,
                  summary="<= 3.5 bits/value at 1,024 tokens and beyond: 4-bit keys, 2-bit values (head VQ "
                          "codes), 8-bit norms, an int8 window growing with the history",
                  residual_fraction="budget"),
    "kv4": Preset("kv4", _BASE, _BASE_OPTIONS, 4.0,
                  summary="<= 4.0 bits/value at 1,024 tokens: 4-bit keys, 3-bit values, int8 window"),
    "kv5": Preset("kv5", "pqo-k5v4-head-eden", _BASE_OPTIONS, 5.0, sink_tokens=8,
                  summary="<= 5.0 bits/value at 1,024 tokens: 5-bit keys, 4-bit values, 8 sinks, int8 window"),
}


def _check_name(name: str) -> Preset:
    key = name.strip().lower() if isinstance(name, str) else name
    if key not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; expected one of {sorted(PRESETS)}")
    return PRESETS[key]


def _layer_options(preset: Preset, num_layers: int) -> dict[int, dict[str, Any]]:
    """The preset's overrides at absolute layer indices (``0`` and ``-1`` merge on one layer)."""
    out: dict[int, dict[str, Any]] = {}
    for key, opts in preset.layer_overrides.items():
        idx = resolve_layer(f"preset {preset.name!r}", key, num_layers)
        out.setdefault(idx, {}).update(opts)
    return out


def merge_head_overrides(preset_heads: Mapping[int, Mapping[int, Mapping[str, Any]]], head_overrides: Any,
                         num_layers: int, num_kv_heads: int) -> Any:
    """A preset's ``head_overrides`` updated by the caller's, at absolute layer and head
    indices (one head's options merge, the caller's winning); the caller's unchanged when the
    preset has none (:func:`~numba_kv.make_cache` validates them)."""
    if not preset_heads:
        return head_overrides
    if head_overrides is not None and not isinstance(head_overrides, Mapping):
        raise TypeError(f"head_overrides: expected a dict {{layer: {{kv_head: {{option: value}}}}}}, got "
                        f"{type(head_overrides).__name__}")
    out: dict[int, dict[int, dict[str, Any]]] = {}
    for where, given in (("preset head_overrides", preset_heads), ("head_overrides", head_overrides or {})):
        for key, heads in given.items():
            idx = resolve_layer(where, key, num_layers)
            if not isinstance(heads, Mapping):
                raise TypeError(f"{where}[{key!r}]: expected a dict {{kv_head: {{option: value}}}}, got "
                                f"{type(heads).__name__}")
            for hkey, opts in heads.items():
                h = resolve_head(f"{where}[{key!r}]", hkey, num_kv_heads)
                if not isinstance(opts, Mapping):
                    raise TypeError(f"{where}[{key!r}][{hkey!r}]: expected a dict of options, got "
                                    f"{type(opts).__name__}")
                out.setdefault(idx, {}).setdefault(h, {}).update(opts)
    return out


def _fraction(preset: Preset) -> dict[str, float]:
    """``{"residual_fraction": f}`` of a preset with a fixed growing fraction, else nothing (the
    options, and so the cache files, of a preset without one stay as they were; a
    ``"budget"`` fraction is set by :func:`resolve_preset` once the window is sized)."""
    f = preset.residual_fraction
    return {"residual_fraction": f} if f and f != "budget" else {}


def _local(window: int | None, tokens: int) -> bool:
    """A layer that stores fewer than ``tokens`` tokens (its sliding window is shorter)."""
    return window is not None and window < tokens


class _Geometry:
    """One preset on one model: each layer's configuration (the preset's overrides applied),
    sliding window and bytes by formula."""

    def __init__(self, preset: Preset, num_layers: int, num_kv_heads: int, head_dim: int, sliding_window: Any,
                 head_overrides: Any = None):
        # the geometry's types first: a float count would fail deep inside with an unclear message
        num_layers = check_int("num_layers", num_layers, minimum=1)
        num_kv_heads = check_int("num_kv_heads", num_kv_heads, minimum=1)
        head_dim = check_head_dim(head_dim)
        self.preset, self.num_kv_heads = preset, num_kv_heads
        self.windows = check_sliding_window(sliding_window, num_layers)
        self.own = _layer_options(preset, num_layers)
        family, bits, implied = name_options(preset.base, head_dim)
        cls = TurboQuantCache if family == "tq" else PolarQuantCache
        base = {**preset.options, **_fraction(preset), "sink_tokens": preset.sink_tokens, "residual_length": 0}
        base = merge_name_options(preset.base, family, bits, implied, base)
        if base.get("rotation") == "head" and head_dim not in HEAD_DIMS:
            # (said here: the configuration's own message names an option the caller never set)
            raise ValueError(f"head_dim: preset {preset.name!r} stores whole-head codes (rotation='head'), which need "
                             f"a power of two in {HEAD_DIMS[0]}..{HEAD_DIMS[-1]}, got {head_dim}; for this head_dim "
                             f"use a 32-block name such as 'pqo4' or 'pqo3' (any multiple of 32), with "
                             f"residual_length / sink_tokens as needed")
        parts: dict[str, PolarQuantConfig] = {}
        self.parts: list[PolarQuantConfig] = []
        # every KV head's configuration of the layers the preset splits (head_overrides)
        self.heads: dict[int, list[PolarQuantConfig]] = {}
        own_heads = merge_head_overrides(preset.head_overrides, head_overrides, num_layers, num_kv_heads) or {}
        for layer in range(num_layers):
            own = self.own.get(layer, {})
            key = repr(sorted(own.items()))
            opts = layer_options(cls, base, dict(own), f"preset {preset.name!r} layer {layer}") if own else base
            if key not in parts:  # the configuration make_cache gives a layer with these overrides
                parts[key] = cls.config_class(1, 1, head_dim, **opts)
            self.parts.append(parts[key])
            if layer in own_heads:
                self.heads[layer] = [
                    cls.config_class(1, 1, head_dim, **head_options(
                        cls, opts, dict(own_heads[layer][h]), f"preset {preset.name!r} layer {layer} KV head {h}"))
                    if h in own_heads[layer] else parts[key] for h in range(num_kv_heads)]

    def layer_bytes(self, layer: int, residual: int, tokens: int) -> int:
        """Bytes of ``layer`` (all KV heads) at ``tokens`` tokens with window ``residual`` (a
        residual_length the preset's override of that layer fixes wins); a sliding layer
        stores at most its window's tokens and keeps no sinks."""
        part, window, own = self.parts[layer], self.windows[layer], self.own.get(layer, {})
        if "residual_length" in own:
            residual = part.residual_length
        stored, sinks = (min(tokens, window), 0) if window is not None else (tokens, part.sink_tokens)
        if self.preset.residual_fraction == "budget" and (window is None or "residual_length" not in own):
            # f = R / BUDGET_TOKENS of the history: a sliding layer's window grows over what it stores
            residual = max(residual, residual * tokens // BUDGET_TOKENS)
        heads = self.heads.get(layer, [part] * self.num_kv_heads)
        return sum(h.stored_bytes(stored, sinks=sinks, residual=residual) for h in heads)


def _largest(fits: Any, hi: int) -> int:
    """The largest ``r`` in ``[0, hi]`` with ``fits(r)`` (``fits`` monotone, ``fits(0)`` true)."""
    lo = 0
    if fits(hi):
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def preset_bytes(name: str, *, num_layers: int, num_kv_heads: int, head_dim: int, residual_length: Any,
                 tokens: int = BUDGET_TOKENS, sliding_window: Any = None, head_overrides: Any = None) -> int:
    """KV bytes of preset ``name`` with given windows at ``tokens`` tokens, by formula.

    Parameters
    ----------
    name : str
        A key of :data:`PRESETS`.
    num_layers, num_kv_heads, head_dim : int
        Model geometry.
    residual_length : int or sequence of int
        Newest tokens kept in the window, for every layer or per layer (layers the preset
        overrides with their own ``residual_length`` keep it).
    tokens : int
        Sequence length (a preset's ``residual_fraction`` grows the window with it:
        ``max(residual_length, floor(f·tokens))`` tokens besides the sinks).
    sliding_window : None, int, sequence or dict, optional
        The model's sliding windows, as ``make_cache`` takes them: a sliding layer stores
        at most its window's tokens and no sinks.
    head_overrides : dict {int: dict {int: dict}}, optional
        A user's per-KV-head widths over the preset's own (as ``make_cache`` merges them).

    Returns
    -------
    int
        Bytes of K and V of all layers and KV heads.
    """
    geo = _Geometry(_check_name(name), num_layers, num_kv_heads, head_dim, sliding_window, head_overrides)
    res = [residual_length] * num_layers if isinstance(residual_length, (int, np.integer)) else list(residual_length)
    if len(res) != num_layers:
        raise ValueError(f"residual_length: expected an int or {num_layers} ints, got {len(res)}")
    return sum(geo.layer_bytes(i, int(res[i]), tokens) for i in range(num_layers))


def resolve_preset(name: str, *, num_layers: int, num_kv_heads: int, head_dim: int, sliding_window: Any = None,
                   head_overrides: Any = None) -> tuple[str, dict[str, Any], dict[int, dict[str, Any]]]:
    """The :func:`~numba_kv.make_cache` arguments of a preset on a geometry.

    The budget holds for the global layers together and for every sliding layer on its
    own, each counted at :data:`BUDGET_TOKENS` positions: the global layers share one
    ``residual_length``, the largest within budget; a sliding layer whose window is shorter
    stores only that many tokens, so its own window (``layer_overrides``) fills the budget
    over those — at most the whole sliding window.  Every layer thus stays within the
    budget at any length from :data:`BUDGET_TOKENS` on (its window is a fixed number of
    tokens), and the compressed global layers set the bits/value of long contexts.  A
    preset with a ``residual_fraction`` ``f`` keeps its window at ``floor(f·t)`` tokens
    once that is more than ``residual_length``: its bits/value at long lengths tends to the
    codes' plus ``f`` times the window vector's excess over a compressed one
    (:func:`preset_bytes` at any length).  With ``residual_fraction="budget"`` every layer
    grows its window at its own rate ``R_i / 1024`` of the history: a sliding layer's
    window then covers all it stores from ``1024·W / R_i`` tokens on (it keeps the budget,
    since its bytes stop growing while the history does).

    Parameters
    ----------
    name : str
        ``"kv3"``, ``"kv4"`` or ``"kv5"`` (any key of :data:`PRESETS`, any case).
    num_layers, num_kv_heads, head_dim : int
        Model geometry.
    sliding_window : None, int, sequence or dict, optional
        The model's sliding windows, as :func:`~numba_kv.make_cache` takes them (``None``:
        every layer global).
    head_overrides : dict {int: dict {int: dict}}, optional
        A user's per-KV-head widths (a calibration), merged over the preset's own before the
        window is sized: narrower heads leave room for a longer window, wider ones take it.

    Returns
    -------
    base : str
        Cache name (``"pqo-k4v3-head-eden"``).
    options : dict
        Constructor options: the preset's fixed ones, ``sink_tokens`` and the global
        layers' ``residual_length``.
    layer_overrides : dict {int: dict}
        Per-layer options at absolute indices: the preset's own and the sliding layers'
        ``residual_length`` (empty when there are none).

    Raises
    ------
    ValueError
        Unknown preset (the message lists the presets), a bad ``sliding_window``, a
        geometry on which even no window exceeds the budget, or a sliding layer whose
        own (preset-fixed) options exceed it.

    Examples
    --------
    >>> base, opts, over = resolve_preset("kv4", num_layers=30, num_kv_heads=3, head_dim=64)
    >>> base, opts["residual_length"], over
    ('pqo-k4v3-head-eden', 49, {})
    >>> _, opts, over = resolve_preset("kv4", num_layers=6, num_kv_heads=1, head_dim=256,
    ...                                sliding_window=[512] * 5 + [None])
    >>> opts["residual_length"], over[0]
    (92, {'residual_length': 501})
    """
    preset = _check_name(name)
    geo = _Geometry(preset, num_layers, num_kv_heads, head_dim, sliding_window, head_overrides)
    n = BUDGET_TOKENS
    per_layer = preset.budget * 2 * num_kv_heads * head_dim * n / 8  # bytes of one layer's budget
    local = [i for i in range(num_layers) if _local(geo.windows[i], n)]
    glob = [i for i in range(num_layers) if i not in local]

    def too_big() -> ValueError:
        grow = f" beyond its residual_fraction={preset.residual_fraction}" if preset.residual_fraction else ""
        return ValueError(f"preset {preset.name!r}: exceeds {preset.budget} bits/value on head_dim={head_dim}, "
                          f"{num_layers} layers even without a window{grow}")

    r_glob = 0
    if glob:
        def fits(r: int) -> bool:
            return sum(geo.layer_bytes(i, r, n) for i in glob) <= per_layer * len(glob)

        if not fits(0):
            raise too_big()
        r_glob = _largest(fits, n)
    options = {**preset.options, **_fraction(preset), "sink_tokens": preset.sink_tokens, "residual_length": r_glob}
    overrides = {i: dict(o) for i, o in geo.own.items()}
    growing = preset.residual_fraction == "budget"
    if growing and r_glob:
        # R / 1024 is a dyadic rational: floor(f·t) = R·t // 1024 exactly (the caches read f as
        # an exact fraction)
        options["residual_fraction"] = r_glob / n
    for i in local:
        def fits_one(r: int, i: int = i) -> bool:
            return geo.layer_bytes(i, r, n) <= per_layer

        if "residual_length" in geo.own.get(i, {}):  # the preset fixes this layer's window: no growth
            if not fits_one(0):
                raise ValueError(f"preset {preset.name!r}: sliding layer {i} with its own options exceeds "
                                 f"{preset.budget} bits/value at {n} tokens")
            if growing:
                overrides[i]["residual_fraction"] = 0.0
            continue
        if not fits_one(0):
            raise too_big()
        r = overrides.setdefault(i, {})["residual_length"] = _largest(fits_one, int(geo.windows[i]))
        if growing:
            # its own rate r / 1024 of the history (positions seen): at 1,024 tokens the window
            # the budget sized, then more as the history outgrows what the layer stores, while
            # its bits/value falls (it stores at most its sliding window's tokens)
            overrides[i]["residual_fraction"] = r / n
    return preset.base, options, overrides
