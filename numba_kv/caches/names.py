"""Compressed cache names: what a ``NAME`` of the cache-name grammar
(:mod:`numba_kv.caches.spec`) says about the cache — its family, index width and the options
it implies — and the configuration it stands for.

Kept below :mod:`~numba_kv.caches.presets` and :mod:`~numba_kv.caches.spec`: a preset is sized
from the configuration of its base name, and the grammar accepts presets by name.
"""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Any

from .config import PolarQuantConfig, TurboQuantConfig

__all__ = ["CACHE_NAMES", "SUFFIX_OPTIONS", "compressed_config", "config_name", "fraction_percent",
           "merge_name_options", "name_options", "percent_fraction"]

CACHE_NAMES = ("dense", "pq2", "pq3", "pq4", "pqo2", "pqo3", "pqo4", "pqo2.5", "pqo3.5", "tq2", "tq3", "tq4")
SUFFIX_OPTIONS: dict[str, dict[str, Any]] = {
    "-l2": {"norm_mode": "l2"},
    "-maxnorm": {"norm_mode": "maxnorm"},
    "-head": {"rotation": "head"},
    "-eden": {"unbiased": True},
    "-vq": {"vq": True},
    "-n8": {"norm_bits": 8},
}
_SUFFIXES = "|".join(s[1:] for s in SUFFIX_OPTIONS)
# NAME without the window suffix: family, width (uniform, half-bit split or asymmetric), suffixes
_NAME = re.compile(r"^(?P<family>pqo|pq|tq)(?:(?P<bits>[234])(?P<half>\.5)?|-k(?P<kb>[2-5])v(?P<vb>[2-5]))"
                   rf"(?P<suffix>(?:-(?:{_SUFFIXES}))*)$")
_EXPECTED = (f"expected one of {list(CACHE_NAMES[1:])} or 'pq-k<2-5>v<2-5>' / 'pqo-k<2-5>v<2-5>' / "
             "'tq-k<2-5>v<2-5>', optionally with '-l2', '-maxnorm', '-head', '-eden', '-vq', '-n8' suffixes")


def fraction_percent(fraction: float) -> str:
    """The window suffix's percentage of a ``residual_fraction``: the shortest decimal that
    reads back as the same float (:func:`percent_fraction`), no exponent.

    Examples
    --------
    >>> fraction_percent(0.07), fraction_percent(0.075), fraction_percent(0.5)
    ('7', '7.5', '50')
    """
    pct = (Decimal(repr(float(fraction))) * 100).normalize()
    return format(pct, "f")


def percent_fraction(text: str) -> float:
    """``residual_fraction`` of a window suffix's percentage (``"7.5"`` -> 0.075): the float
    nearest the decimal's hundredth, so :func:`fraction_percent` round-trips."""
    return float(Decimal(text) / 100)


def name_options(name: str, head_dim: Any) -> tuple[str, int, dict[str, Any]]:
    """The cache class family, index width and implied options of a compressed cache name.

    Parameters
    ----------
    name : str
        Lower-case name without window suffix or options, e.g. ``"pqo3-head"``, ``"tq-k4v3"``.
    head_dim : int
        Head dimension (channel splits need a multiple of 64).

    Returns
    -------
    family : {"pq", "pqo", "tq"}
    bits : int
        Index bits (the wider of the two sides of an asymmetric name).
    implied : dict
        Options the name fixes (``k_bits``, ``outlier_channels``, ``norm_mode``, ...).

    Raises
    ------
    ValueError
        Not a compressed cache name (message ``"name: ..."``), or a channel split that does
        not fit ``head_dim`` (``"head_dim: ..."``).
    """
    m = _NAME.match(name)
    if not m:
        raise ValueError(f"name: {_EXPECTED}, got {name!r}")
    family = m.group("family")
    implied: dict[str, Any] = {}
    if m.group("bits"):
        bits = int(m.group("bits"))
        if m.group("half"):
            if family != "pqo" or bits == 4:
                raise ValueError(f"name: channel splits exist as 'pqo2.5' and 'pqo3.5', got {name!r}")
            if not isinstance(head_dim, int) or head_dim % 64:
                raise ValueError(f"head_dim: {name!r} splits every head in two halves of whole 32-blocks, "
                                 f"expected a multiple of 64, got {head_dim!r}")
            implied.update(outlier_channels=head_dim // 2, outlier_bits=bits + 1)
    else:
        kb, vb = int(m.group("kb")), int(m.group("vb"))
        bits = max(kb, vb)
        implied.update(k_bits=kb, v_bits=vb)
    for suf in re.findall(r"-[a-z0-9]+", m.group("suffix")):
        implied.update(SUFFIX_OPTIONS[suf])
    return family, bits, implied


def merge_name_options(label: str, family: str, bits: int, implied: dict[str, Any],
                       options: dict[str, Any]) -> dict[str, Any]:
    """Constructor options of a cache named ``label``: ``options`` and what the name implies
    (``implied``; an option that contradicts it raises ``ValueError``), plus ``bits`` and the
    PolarQuant ``mode`` the name sets (given in ``options`` too: ``TypeError``).  ``family``
    ``"dense"`` takes no bits."""
    for opt, val in implied.items():
        if opt in options and options[opt] != val:
            raise ValueError(f"{opt}: {options[opt]!r} conflicts with the name {label!r}")
    options = {**options, **implied}
    if family == "dense":
        for opt in options:  # (DenseCache's own TypeError would name neither the option's owner nor the choices)
            if opt not in ("dtype", "sliding_window"):
                raise TypeError(f"{opt}: not an option of DenseCache; expected one of ['dtype', 'sliding_window']")
        return options
    for opt in ("bits", "mode"):
        if opt in options:  # the name sets them
            raise TypeError(f"{opt}: set by the name {label!r}; spell it there ('pq4', 'pqo4', 'tq4', 'pqo-k4v3')"
                            + (", or per layer: layer_overrides={layer: {'bits': ...}}" if opt == "bits" else ""))
    if family == "tq":
        return {"bits": bits, **options}
    return {"bits": bits, "mode": family, **options}


def compressed_config(name: str, num_layers: int, num_kv_heads: int, head_dim: int,
                      **options: Any) -> PolarQuantConfig:
    """The validated configuration of compressed cache ``name`` (e.g. ``"pqo-k4v3-head"``)
    with ``options``: a :class:`TurboQuantConfig` for ``tq`` names, else a
    :class:`PolarQuantConfig`."""
    family, bits, implied = name_options(name, head_dim)
    opts = merge_name_options(name, family, bits, implied, options)
    cls = TurboQuantConfig if family == "tq" else PolarQuantConfig
    return cls(num_layers, num_kv_heads, head_dim, **opts)


def config_name(cfg: PolarQuantConfig) -> str:
    """The name of a PolarQuant / TurboQuant cache of configuration ``cfg`` (``cache.name``):
    family and widths (average widths with a channel split), then the ``-l2``, ``-head``,
    ``-eden``, ``-vq``, ``-n8`` suffixes that apply and the window suffix ``-rR-sS``
    (``-rR-gG-sS`` with a window that grows to ``G`` % of the history, ``residual_fraction =
    G/100``; ``-r0-s0`` without a window).  ``make_cache(name)`` at the same geometry builds
    the same configuration but for the options no name spells (``key_center``,
    ``window_dtype``, ``sliding_window``, ...: :meth:`config_dict` has them all)."""
    d, oc = cfg.head_dim, cfg.outlier_channels
    if oc:
        avg = {n: (oc * cfg.outlier_widths[n] + (d - oc) * cfg.slot_bits[n]) / d + (0 if cfg.mode == "pqo" else 1)
               for n in ("k", "v")}
        kb, vb = (f"{x:g}" for x in (avg["k"], avg["v"]))
    else:
        kb, vb = str(cfg.k_bits), str(cfg.v_bits)
    # (the uniform form exists for 2-4 bits and the half-bit splits: 5-bit codes are "-k5v5")
    uniform = kb == vb and re.fullmatch(r"[234](?:\.5)?", kb) is not None
    name = f"{cfg.mode}{kb}" if uniform else f"{cfg.mode}-k{kb}v{vb}"
    name += "" if cfg.norm_mode == "maxnorm" or cfg.rotation == "head" else "-l2"
    name += "-head" if cfg.rotation == "head" else ""
    name += "-eden" if cfg.unbiased else ""
    name += "-vq" if cfg.vq else ""
    name += "-n8" if cfg.norm_bits == 8 else ""
    # always the window: a name without it means the default window (make_cache("pqo3") is
    # -r32-s4), so a windowless cache is "-r0-s0" and every name builds its own cache again
    grow = f"-g{fraction_percent(cfg.residual_fraction)}" if cfg.residual_fraction else ""
    return name + f"-r{cfg.residual_length}{grow}-s{cfg.sink_tokens}"
