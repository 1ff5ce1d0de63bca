"""Named presets: ``make_cache("kv4", ...)`` / ``make_cache("kv5", ...)``.

A preset is a cache name of the grammar (:mod:`numba_kv.caches.spec`) with fixed options, a
bit budget and optional per-layer overrides.  Its full-precision window is not a fixed
number of tokens: it is the largest ``residual_length`` for which the cache stays within the
budget **at** :data:`BUDGET_TOKENS` **tokens** on the given geometry (``head_dim``, layer
count), every byte counted — compressed codes, per-vector norms, the int8 window with its
scales, per-layer constants (key means) and the protected layers' extra bits.  A wider head
pays less for its norms, so it gets a longer window for the same budget.  The count assumes
every layer global (it stores all the tokens): a model with sliding-window layers stores
fewer tokens, so its real bits/value at that length can only differ by the window's share
on those layers.

One table, :data:`PRESETS`; :func:`resolve_preset` turns a name and a geometry into the
arguments of :func:`~numba_kv.caches.factory.make_cache`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._layer import resolve_layer
from .mixed import MixedCache
from .polarquant import PolarQuantCache

__all__ = ["BUDGET_TOKENS", "PRESETS", "Preset", "preset_bytes", "resolve_preset"]

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
        Cache name of :func:`~numba_kv.make_cache` without window (``"pqo-k4v3-head-eden"``).
    options : dict
        Fixed constructor options (``key_center``, ``window_dtype``, ...).
    budget : float
        Bits per value (K and V averaged) at :data:`BUDGET_TOKENS` tokens.
    sink_tokens : int
        First tokens kept in the window; the newest ``residual_length`` fill the rest of
        the budget.
    layer_overrides : dict {int: dict}
        Options of single layers; negative keys count from the end (``-1``: last layer).
    summary : str
        One line for help texts.
    """

    name: str
    base: str
    options: Mapping[str, Any]
    budget: float
    sink_tokens: int = 4
    layer_overrides: Mapping[int, Mapping[str, Any]] = field(default_factory=dict)
    summary: str = ""


_BASE = "pqo-k4v3-head-eden"
_BASE_OPTIONS = {"key_center": True, "window_dtype": "int8"}

#: The presets.  Chosen by measurement on SmolLM2-135M (head_dim 64) and Gemma-3-270M
#: (head_dim 256), N = 1024, P = 128 (README, "Named presets"): at equal bits, protecting
#: the first and last layers (4-bit values or an all-int8 layer) bought no more than the
#: window those bytes would buy, so both presets spend the whole budget on the int8 window.
PRESETS: dict[str, Preset] = {
    "kv4": Preset("kv4", _BASE, _BASE_OPTIONS, 4.0,
                  summary="<= 4.0 bits/value at 1,024 tokens: 4-bit keys, 3-bit values, int8 window"),
    "kv5": Preset("kv5", _BASE, _BASE_OPTIONS, 5.0,
                  summary="<= 5.0 bits/value at 1,024 tokens: 4-bit keys, 3-bit values, long int8 window"),
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


def _part_bytes(cache: PolarQuantCache, tokens: int, sinks: int, residual: int) -> int:
    """Bytes of one layer and KV head of ``cache``'s configuration holding ``tokens`` tokens,
    by formula: compressed tokens' codes and scales, window tokens at the window dtype (int8
    with one binary16 scale per vector), per-row constants."""
    d = cache.head_dim
    n_exact = min(tokens, sinks + residual)
    comp = sum(lay.width + 2 * lay.num_scales for lay in cache.layouts.values())
    item = np.dtype(cache.window_dtype).itemsize
    exact = 2 * (d * item + (2 if item == 1 else 0))
    const = 4 * d * int(cache.key_center)
    const += 2 * 2 * d if cache.outlier_channels else 0
    return (tokens - n_exact) * comp + n_exact * exact + const


def preset_bytes(name: str, *, num_layers: int, num_kv_heads: int, head_dim: int, residual_length: int,
                 tokens: int = BUDGET_TOKENS) -> int:
    """KV bytes of preset ``name`` with a given window at ``tokens`` tokens, every layer global.

    Parameters
    ----------
    name : str
        A key of :data:`PRESETS`.
    num_layers, num_kv_heads, head_dim : int
        Model geometry.
    residual_length : int
        Newest tokens kept in the window (layers that override it keep their own).
    tokens : int
        Sequence length.

    Returns
    -------
    int
        Bytes of K and V of all layers and KV heads.
    """
    preset = _check_name(name)
    per_layer = _layer_options(preset, num_layers)
    base = {**preset.options, "sink_tokens": preset.sink_tokens, "residual_length": residual_length}
    total = 0
    configs: dict[str, PolarQuantCache] = {}
    for layer in range(num_layers):
        own = per_layer.get(layer, {})
        key = repr(sorted(own.items()))
        if key not in configs:
            from .spec import make_cache  # noqa: PLC0415 - cycle: make_cache resolves presets here

            # a two-layer cache whose layer 0 carries the override: its part is that layer's cache
            cache = make_cache(preset.base, num_layers=2, num_kv_heads=1, head_dim=head_dim, **base,
                               layer_overrides={0: dict(own)} if own else None)
            configs[key] = cache.layer_cache(0) if isinstance(cache, MixedCache) else cache
        cache = configs[key]
        total += num_kv_heads * _part_bytes(cache, tokens, cache.sink_tokens, cache.residual_length)
    return total


def resolve_preset(name: str, *, num_layers: int, num_kv_heads: int, head_dim: int
                   ) -> tuple[str, dict[str, Any], dict[int, dict[str, Any]]]:
    """The :func:`~numba_kv.make_cache` arguments of a preset on a geometry.

    Parameters
    ----------
    name : str
        ``"kv4"`` or ``"kv5"`` (any key of :data:`PRESETS`, any case).
    num_layers, num_kv_heads, head_dim : int
        Model geometry.

    Returns
    -------
    base : str
        Cache name (``"pqo-k4v3-head-eden"``).
    options : dict
        Constructor options: the preset's fixed ones, ``sink_tokens`` and the
        ``residual_length`` that fills the budget at :data:`BUDGET_TOKENS` tokens.
    layer_overrides : dict {int: dict}
        Per-layer options at absolute indices (empty when the preset has none).

    Raises
    ------
    ValueError
        Unknown preset (the message lists the presets), or a geometry on which even no
        window exceeds the budget.

    Examples
    --------
    >>> base, opts, over = resolve_preset("kv4", num_layers=30, num_kv_heads=3, head_dim=64)
    >>> base, opts["residual_length"], over
    ('pqo-k4v3-head-eden', 49, {})
    """
    preset = _check_name(name)
    values = 2 * num_layers * num_kv_heads * head_dim * BUDGET_TOKENS
    limit = preset.budget * values / 8  # bytes

    def fits(r: int) -> bool:
        return preset_bytes(preset.name, num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                            residual_length=r) <= limit

    if not fits(0):
        raise ValueError(f"preset {preset.name!r}: exceeds {preset.budget} bits/value on head_dim={head_dim}, "
                         f"{num_layers} layers even without a window")
    lo, hi = 0, BUDGET_TOKENS  # bytes grow with the window: bisect the largest that fits
    if fits(hi):
        lo = hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    options = {**preset.options, "sink_tokens": preset.sink_tokens, "residual_length": lo}
    return preset.base, options, _layer_options(preset, num_layers)
