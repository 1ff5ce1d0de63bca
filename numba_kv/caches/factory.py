"""``make_cache``: build any cache of the library by name."""

from __future__ import annotations

from typing import Any

from ._layer import LayeredCache
from .dense import DenseCache
from .polarquant import PolarQuantCache
from .spec import CACHE_NAMES, name_options, parse_cache_spec
from .turboquant import TurboQuantCache

__all__ = ["CACHE_NAMES", "make_cache"]

def make_cache(name: str, *, num_layers: int, num_kv_heads: int, head_dim: int, **options: Any) -> LayeredCache:
    """Create a cache by name.

    Parameters
    ----------
    name : str
        ``"dense"``; PolarQuant ``"pq2"``–``"pq4"``, ``"pqo2"``–``"pqo4"``; TurboQuant
        (QJL) ``"tq2"``–``"tq4"``; asymmetric ``"pqo-k4v3"`` / ``"tq-k4v3"`` (keys 4 bits,
        values 3; any of 2–4 each); channel splits ``"pqo2.5"`` / ``"pqo3.5"`` (half of
        every head's channels — the outlier half, chosen per layer and KV head on the first
        prefill — one bit wider: 2.5 / 3.5 index bits per value).  Suffixes, combinable:
        ``"-l2"`` (L2 norm mode), ``"-head"`` (one rotation over the whole head and one
        norm per vector instead of per-32-block scales), ``"-eden"`` (unbiased rescale).
        The full grammar of :mod:`numba_kv.caches.spec` is accepted: a window suffix
        ``"-rR-sS"`` and options ``":key=value,..."`` (``"pqo3-r0-s0:key_center=true"``).
    num_layers, num_kv_heads, head_dim : int
        Model geometry.
    **options
        Forwarded to the cache class (``residual_length=``, ``dtype=`` for dense, ...).

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
    """
    if not isinstance(name, str):
        raise TypeError(f"name: expected a str, got {type(name).__name__}")
    try:
        spec = parse_cache_spec(name)
    except ValueError as exc:
        raise ValueError(f"name: {exc}") from None
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
        return DenseCache(**geom, **options)
    if family == "tq":
        return TurboQuantCache(**geom, bits=bits, **options)
    return PolarQuantCache(**geom, bits=bits, mode=family, **options)
