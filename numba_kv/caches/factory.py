"""``make_cache``: build any cache of the library by name."""

from __future__ import annotations

import re
from typing import Any

from ._layer import LayeredCache
from .dense import DenseCache
from .polarquant import PolarQuantCache

CACHE_NAMES = ("dense", "pq2", "pq3", "pq4", "pqo2", "pqo3", "pqo4")
_PQ = re.compile(r"^(pqo|pq)([234])(-l2|-maxnorm)?$")
_PQ_KV = re.compile(r"^(pqo|pq)-k([234])v([234])(-l2|-maxnorm)?$")


def make_cache(name: str, *, num_layers: int, num_kv_heads: int, head_dim: int, **options: Any) -> LayeredCache:
    """Create a cache by name.

    Parameters
    ----------
    name : str
        ``"dense"``, ``"pq2"``–``"pq4"``, ``"pqo2"``–``"pqo4"``, asymmetric
        ``"pqo-k4v3"`` (keys 4 bits, values 3 bits; any of 2–4 each); a ``"-l2"`` suffix
        selects the L2 norm mode (same as ``norm_mode="l2"``).
    num_layers, num_kv_heads, head_dim : int
        Model geometry.
    **options
        Forwarded to the cache class (``norm_mode=``, ``dtype=`` for dense, ...).

    Returns
    -------
    cache : CompressedKVCache

    Raises
    ------
    ValueError
        Unknown name (the message lists the valid ones).

    Examples
    --------
    >>> cache = make_cache("pqo3", num_layers=2, num_kv_heads=2, head_dim=64)
    >>> cache.bits_per_value
    3.5
    """
    if not isinstance(name, str):
        raise TypeError(f"name: expected a str, got {type(name).__name__}")
    key = name.strip().lower()
    geom = dict(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim)
    if key == "dense":
        return DenseCache(**geom, **options)
    m = _PQ.match(key)
    mkv = _PQ_KV.match(key)
    if m or mkv:
        if m:
            mode, bits, suffix = m.group(1), int(m.group(2)), m.group(3)
            kv = {}
        else:
            mode, kb, vb, suffix = mkv.group(1), int(mkv.group(2)), int(mkv.group(3)), mkv.group(4)
            bits, kv = max(kb, vb), {"k_bits": kb, "v_bits": vb}
            for opt in kv:
                if opt in options and options[opt] != kv[opt]:
                    raise ValueError(f"{opt}: {options[opt]!r} conflicts with the name {name!r}")
        if suffix:
            if "norm_mode" in options and options["norm_mode"] != suffix[1:]:
                raise ValueError(f"norm_mode: {options['norm_mode']!r} conflicts with the name suffix {suffix!r}")
            options = dict(options, norm_mode=suffix[1:])
        return PolarQuantCache(**geom, bits=bits, mode=mode, **{**options, **kv})
    raise ValueError(f"name: expected one of {list(CACHE_NAMES)}, or 'pqo-k<2-4>v<2-4>' (optionally with "
                     f"'-l2'), got {name!r}")
