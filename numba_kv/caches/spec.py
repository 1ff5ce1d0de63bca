"""The cache-name grammar: one parser for :func:`~numba_kv.make_cache`, the evaluation
command line and the compression-mode benchmark.

One cache is written ::

    NAME[-rR][-sS][:KEY=VALUE[,KEY=VALUE...]]

* ``NAME``: ``"dense"``; PolarQuant ``"pq2"``–``"pq4"``, ``"pqo2"``–``"pqo4"``; TurboQuant
  ``"tq2"``–``"tq4"``; asymmetric ``"pqo-k4v3"`` / ``"tq-k4v3"``; channel splits ``"pqo2.5"`` /
  ``"pqo3.5"``; combinable suffixes ``-l2``, ``-maxnorm``, ``-head``, ``-eden`` (see
  :data:`SUFFIX_OPTIONS`).
* Named presets ``"kv4"``, ``"kv5"`` (:mod:`numba_kv.caches.presets`): a name, a bit
  budget and per-layer settings; options (``"kv4:decode_output=dequantized"``) replace the
  preset's.  The ``-rR-sS`` suffix does not apply (a preset sizes its window itself).
* ``-rR`` / ``-sS``: the compact window form (``residual_length=R``, ``sink_tokens=S``), the
  form of a cache's own ``name``.
* ``KEY=VALUE``: a keyword option of the cache class; ``r`` and ``s`` abbreviate
  ``residual_length`` and ``sink_tokens``; values read as bool (``true``/``false``), int,
  float or str.

A *list* of caches is a command-line matter: the command line splits its argument and
hands each cache's text to :func:`parse_cache_spec` (``numba_kv.toolkit.specs``).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .polarquant import PolarQuantCache
from .presets import PRESETS

__all__ = ["CACHE_NAMES", "OPTION_ALIASES", "PRESET_NAMES", "SUFFIX_OPTIONS", "CacheSpec", "name_options",
           "parse_cache_spec", "parse_value"]

CACHE_NAMES = ("dense", "pq2", "pq3", "pq4", "pqo2", "pqo3", "pqo4", "pqo2.5", "pqo3.5", "tq2", "tq3", "tq4")
#: Named presets (:data:`numba_kv.caches.presets.PRESETS`).
PRESET_NAMES = tuple(sorted(PRESETS))
SUFFIX_OPTIONS: dict[str, dict[str, Any]] = {
    "-l2": {"norm_mode": "l2"},
    "-maxnorm": {"norm_mode": "maxnorm"},
    "-head": {"rotation": "head"},
    "-eden": {"unbiased": True},
}
OPTION_ALIASES = {"r": "residual_length", "residual": "residual_length", "s": "sink_tokens",
                  "sinks": "sink_tokens"}
_SUFFIXES = "|".join(s[1:] for s in SUFFIX_OPTIONS)
# NAME without the window suffix: family, width (uniform, half-bit split or asymmetric), suffixes
_NAME = re.compile(r"^(?P<family>pqo|pq|tq)(?:(?P<bits>[234])(?P<half>\.5)?|-k(?P<kb>[234])v(?P<vb>[234]))"
                   rf"(?P<suffix>(?:-(?:{_SUFFIXES}))*)$")
_COMPACT = re.compile(rf"^(?P<base>dense|(?:pqo?|tq)(?:[234](?:\.5)?|-k[234]v[234])(?:-(?:{_SUFFIXES}))*)"
                      r"(?:-r(?P<r>\d+))?(?:-s(?P<s>\d+))?$")
_KEY = re.compile(r"^[a-z_][a-z0-9_]*$")
_EXPECTED = (f"expected a preset {list(PRESET_NAMES)}, one of {list(CACHE_NAMES)}, or 'pqo-k<2-4>v<2-4>' / "
             f"'tq-k<2-4>v<2-4>', optionally with '-l2', '-maxnorm', '-head', '-eden' suffixes")
# what a user means as a preset name ("kv3", "KV4-r32"): answered with the list of presets
_PRESET_LIKE = re.compile(r"^kv\d")


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


def parse_value(text: str) -> Any:
    """An option value: ``true``/``false`` (any case) as bool, else int, else float, else str."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


@dataclass(frozen=True)
class CacheSpec:
    """One cache: a :func:`~numba_kv.make_cache` name and its keyword options.

    Attributes
    ----------
    name : str
        Name without window suffix (``"dense"``, ``"pqo3"``, ``"pq4-l2"``, ...).
    options : dict
        Keyword options of the cache (``residual_length``, ``sink_tokens``, ...).
    """

    name: str
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """Canonical compact label with the effective window, e.g. ``"pqo3-r32-s4"`` (the
        defaults of :class:`~numba_kv.PolarQuantCache`) or ``"pqo4-r0-s0:window_dtype=float32"``."""
        opts = dict(self.options)
        if self.is_preset:  # the window depends on the geometry: the name says it
            return self.name + (":" + ",".join(f"{k}={v}" for k, v in sorted(opts.items())) if opts else "")
        defaults = inspect.signature(PolarQuantCache.__init__).parameters
        r = opts.pop("residual_length", defaults["residual_length"].default)
        s = opts.pop("sink_tokens", defaults["sink_tokens"].default)
        out = self.name if self.is_dense else f"{self.name}-r{r}-s{s}"
        if opts:
            out += ":" + ",".join(f"{k}={v}" for k, v in sorted(opts.items()))
        return out

    @property
    def is_preset(self) -> bool:
        """True for a named preset (``"kv4"``, ``"kv5"``)."""
        return self.name in PRESETS

    @property
    def is_dense(self) -> bool:
        """True for the uncompressed dense cache."""
        return self.name == "dense"

    def make(self, num_layers: int, num_kv_heads: int, head_dim: int, **extra: Any) -> Any:
        """Build the cache for a model geometry.

        Parameters
        ----------
        num_layers, num_kv_heads, head_dim : int
            Model geometry.
        **extra
            Further :func:`~numba_kv.caches.factory.make_cache` options that belong to the
            model rather than to the spec (``sliding_window=`` of a model with local layers).

        Returns
        -------
        CompressedKVCache
        """
        from .factory import make_cache  # noqa: PLC0415 (cycle: factory imports this module)

        return make_cache(self.name, num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                          **dict(self.options), **extra)


def _add_option(opts: dict[str, Any], item: str, text: str) -> None:
    key, sep, value = item.partition("=")
    key, value = OPTION_ALIASES.get(key.strip().lower(), key.strip().lower()), value.strip()
    if not sep or not _KEY.match(key) or not value:
        raise ValueError(f"malformed option {item!r} (expected KEY=VALUE) in {text!r}")
    if key in opts:
        raise ValueError(f"option {key!r} given twice in {text!r}")
    opts[key] = parse_value(value)


def parse_cache_spec(text: str, defaults: Mapping[str, Any] | None = None) -> CacheSpec:
    """Parse one cache, ``NAME[-rR][-sS][:KEY=VALUE[,KEY=VALUE...]]`` (module docstring).

    Parameters
    ----------
    text : str
        E.g. ``"pqo3"``, ``"pqo3-r32-s4"``, ``"pqo4:r=16,window_dtype=int8"``.
    defaults : mapping, optional
        Options applied to a compressed (non-dense) cache that does not set them (not to a
        preset, which sizes its own window).

    Returns
    -------
    CacheSpec

    Raises
    ------
    ValueError
        Unknown name (``"unknown cache ..."``), malformed option, an option given twice.
        Option names and values are checked when the cache is built (:meth:`CacheSpec.make`).

    Examples
    --------
    >>> parse_cache_spec("pqo3-r16:key_center=true")
    CacheSpec(name='pqo3', options={'key_center': True, 'residual_length': 16})
    >>> parse_cache_spec("pqo4:r=8").label
    'pqo4-r8-s4'
    >>> parse_cache_spec("KV4").label
    'kv4'
    """
    if not isinstance(text, str):
        raise TypeError(f"cache: expected a str, got {type(text).__name__}")
    head, _, rest = text.strip().partition(":")
    opts: dict[str, Any] = {}
    for item in rest.split(",") if rest.strip() else ():
        _add_option(opts, item.strip(), text)
    low = head.strip().lower()
    if low in PRESETS:
        return CacheSpec(low, opts)
    if _PRESET_LIKE.match(low):
        raise ValueError(f"unknown preset {head.strip()!r}; expected one of {list(PRESET_NAMES)}")
    m = _COMPACT.match(low)
    if not m:
        raise ValueError(f"unknown cache {head.strip()!r}; {_EXPECTED} (window suffix '-rR-sS', "
                         "options ':key=value')")
    name = m.group("base")
    for short, key in (("r", "residual_length"), ("s", "sink_tokens")):
        if m.group(short) is not None:
            if key in opts:
                raise ValueError(f"{key} given twice for {head.strip()!r} (suffix and option)")
            opts[key] = int(m.group(short))
    if name != "dense":
        for key, value in (defaults or {}).items():
            opts.setdefault(key, value)
    return CacheSpec(name, opts)
