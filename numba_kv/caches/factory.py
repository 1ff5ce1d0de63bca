"""``make_cache``: build any cache of the library by name."""

from __future__ import annotations

from typing import Any

from ._layer import LayeredCache, resolve_layer
from .dense import DenseCache
from .mixed import MixedCache, build_cache
from .polarquant import PolarQuantCache
from .presets import resolve_preset
from .spec import CACHE_NAMES, name_options, parse_cache_spec
from .turboquant import TurboQuantCache

__all__ = ["CACHE_NAMES", "make_cache"]


def make_cache(name: str, *, num_layers: int, num_kv_heads: int, head_dim: int,
               layer_overrides: dict[int, dict[str, Any]] | None = None,
               **options: Any) -> LayeredCache | MixedCache:
    """Create a cache by name.

    Parameters
    ----------
    name : str
        A named preset, ``"kv4"`` (≤ 4.0 bits/value) or ``"kv5"`` (≤ 5.0), counted at 1,024 tokens
        on this geometry (:mod:`numba_kv.caches.presets`; ``options`` and ``layer_overrides``
        replace the preset's own); ``"dense"``; PolarQuant ``"pq2"``–``"pq4"``,
        ``"pqo2"``–``"pqo4"``; TurboQuant (QJL) ``"tq2"``–``"tq4"``; asymmetric ``"pqo-k4v3"`` /
        ``"tq-k4v3"`` (keys 4 bits, values 3; any of 2–4 each); channel splits ``"pqo2.5"`` /
        ``"pqo3.5"`` (half of every head's channels — the outlier half, chosen per layer and KV head
        on the first prefill — one bit wider: 2.5 / 3.5 index bits per value).  Suffixes,
        combinable: ``"-l2"`` (L2 norm mode), ``"-head"`` (one rotation over the whole head and one
        norm per vector instead of per-32-block scales), ``"-eden"`` (unbiased rescale). The full
        grammar of :mod:`numba_kv.caches.spec` is accepted: a window suffix ``"-rR-sS"`` and options
        ``":key=value,..."`` (``"pqo3-r0-s0:key_center=true"``).
    num_layers, num_kv_heads, head_dim : int
        Model geometry.
    layer_overrides : dict {int: dict}, optional
        Options of single layers, e.g. ``{0: {"bits": 4}, -1: {"bits": 4}}`` (negative
        layers count from the end): any constructor option of the cache class (``bits``
        — which also replaces the name's ``k_bits``/``v_bits`` —, ``k_bits``,
        ``v_bits``, ``rotation``, ``residual_length``, ``sink_tokens``, ``window_dtype``,
        ``sliding_window``, ...).  Unknown options and layers raise ``ValueError``.  The
        result is then a :class:`~numba_kv.caches.mixed.MixedCache` (one cache per
        distinct configuration).
    **options
        Forwarded to the cache class (``residual_length=``, ``dtype=`` for dense,
        ``sliding_window=`` — an int, a per-layer list of int/None or ``{layer: window}``
        — ...).

    Returns
    -------
    cache : CompressedKVCache

    Raises
    ------
    ValueError
        Unknown name (the message lists the valid ones), or an option that contradicts
        the name.

    Examples
    --------
    >>> cache = make_cache("pqo3", num_layers=2, num_kv_heads=2, head_dim=64)
    >>> cache.bits_per_value
    3.5
    >>> make_cache("pqo3-head", num_layers=1, num_kv_heads=1, head_dim=128).bits_per_value
    3.125
    >>> mixed = make_cache("pqo3", num_layers=4, num_kv_heads=1, head_dim=64,
    ...                    layer_overrides={0: {"bits": 4}, -1: {"bits": 4}})
    >>> [mixed.layer_cache(i).bits for i in range(4)]
    [4, 3, 3, 4]
    """
    if not isinstance(name, str):
        raise TypeError(f"name: expected a str, got {type(name).__name__}")
    try:
        spec = parse_cache_spec(name)
    except ValueError as exc:
        raise ValueError(f"name: {exc}") from None
    if spec.is_preset:
        base, preset_opts, preset_layers = resolve_preset(spec.name, num_layers=num_layers,
                                                          num_kv_heads=num_kv_heads, head_dim=head_dim)
        for key, over in (layer_overrides or {}).items():
            idx = resolve_layer("layer_overrides", key, num_layers)
            preset_layers[idx] = {**preset_layers.get(idx, {}), **over}
        return make_cache(base, num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                          layer_overrides=preset_layers or None, **{**preset_opts, **spec.options, **options})
    if spec.is_dense:
        family, bits, implied = "dense", 0, dict(spec.options)
    else:
        family, bits, implied = name_options(spec.name, head_dim)
        implied = {**spec.options, **implied}
    geom = {"num_layers": num_layers, "num_kv_heads": num_kv_heads, "head_dim": head_dim}
    for opt, val in implied.items():
        if opt in options and options[opt] != val:
            raise ValueError(f"{opt}: {options[opt]!r} conflicts with the name {name!r}")
    options = {**options, **implied}
    if family == "dense":
        return build_cache(DenseCache, geom, options, layer_overrides)
    for opt in ("bits", "mode"):
        if opt in options:  # as before: the name sets them
            raise TypeError(f"make_cache() got multiple values for keyword argument {opt!r}")
    if family == "tq":
        return build_cache(TurboQuantCache, geom, {"bits": bits, **options}, layer_overrides)
    return build_cache(PolarQuantCache, geom, {"bits": bits, "mode": family, **options}, layer_overrides)
