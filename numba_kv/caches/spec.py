"""The cache-name grammar: one parser for :func:`~numba_kv.make_cache`, the evaluation
command line and the compression-mode benchmark.

One cache is written ::

    NAME[-rR][-gG][-sS][:KEY=VALUE[,KEY=VALUE...]]

* ``NAME``: ``"dense"``; PolarQuant ``"pq2"``–``"pq4"``, ``"pqo2"``–``"pqo4"``; TurboQuant
  ``"tq2"``–``"tq4"``; asymmetric ``"pq-k4v3"`` / ``"pqo-k4v3"`` / ``"tq-k4v3"``; channel splits ``"pqo2.5"`` /
  ``"pqo3.5"``; combinable suffixes ``-l2``, ``-maxnorm``, ``-head``, ``-eden``, ``-vq``, ``-n8`` (see
  :data:`SUFFIX_OPTIONS`).
* Named presets ``"kv3"``, ``"kv4"``, ``"kv5"`` (:mod:`numba_kv.caches.presets`): a name, a bit
  budget and per-layer settings; options (``"kv4:decode_output=dequantized"``) replace the
  preset's.  The ``-rR-gG-sS`` suffix does not apply (a preset sizes its window itself).
* ``-rR`` / ``-sS``: the compact window form (``residual_length=R``, ``sink_tokens=S``), the
  form of a cache's own ``name``.  ``-gG``: a window that grows to ``G`` % of the history
  (``residual_fraction=G/100``; ``G`` a decimal, ``-g7.5``): ``pqo3-r44-g7-s4`` keeps at
  least 44 tokens, ``floor(0.07·t)`` at ``t`` tokens of history once that is more.
* ``KEY=VALUE``: a keyword option of the cache class; ``r`` and ``s`` abbreviate
  ``residual_length`` and ``sink_tokens``; values read as bool (``true``/``false``), int,
  float or str.
* ``layer_overrides=@FILE`` / ``head_overrides=@FILE``: the per-layer / per-KV-head options
  of :func:`make_cache` from a JSON file (``{"3": {"k_bits": 4}}`` /
  ``{"3": {"0": {"k_bits": 4}}}``: JSON's string keys are read as ints), so a calibrated
  allocation fits on a command line (``"kv3:head_overrides=@widths.json"``).  The file is
  read when the text is parsed; the option's label is ``@FILE``.  ``@NAME`` (no ``/``, no
  ``.json``, no such file) names an allocation shipped with the package
  (:func:`shipped_calibrations`: ``"kv3:head_overrides=@kv3-smollm2-135m-retrieval"``).

A *list* of caches is a command-line matter: the command line splits its argument and
hands each cache's text to :func:`parse_cache_spec` (``numba_kv.toolkit.specs``).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._validate import check_head_dim, check_int
from ._layer import LayeredCache, resolve_layer
from .config import PolarQuantConfig, TurboQuantConfig
from .dense import DenseCache
from .mixed import MixedCache, build_cache, head_options, layer_options, resolve_head
from .names import CACHE_NAMES, SUFFIX_OPTIONS, fraction_percent, merge_name_options, name_options, percent_fraction
from .polarquant import PolarQuantCache
from .presets import PRESETS, merge_head_overrides, resolve_preset
from .turboquant import TurboQuantCache

__all__ = ["CACHE_NAMES", "OPTION_ALIASES", "PRESET_NAMES", "SUFFIX_OPTIONS", "CacheSpec", "FILE_OPTIONS",
           "FileOverrides", "load_overrides", "make_cache", "shipped_calibrations",
           "name_options",
           "parse_cache_spec", "parse_value"]

#: Named presets (:data:`numba_kv.caches.presets.PRESETS`).
PRESET_NAMES = tuple(sorted(PRESETS))
OPTION_ALIASES = {"r": "residual_length", "residual": "residual_length", "s": "sink_tokens",
                  "sinks": "sink_tokens"}
_SUFFIXES = "|".join(s[1:] for s in SUFFIX_OPTIONS)
_COMPACT = re.compile(rf"^(?P<base>dense|(?:pqo?|tq)(?:[234](?:\.5)?|-k[2-5]v[2-5])(?:-(?:{_SUFFIXES}))*)"
                      r"(?:-r(?P<r>\d+))?(?:-g(?P<g>\d+(?:\.\d+)?))?(?:-s(?P<s>\d+))?$")
_KEY = re.compile(r"^[a-z_][a-z0-9_]*$")
_EXPECTED = (f"expected a preset {list(PRESET_NAMES)}, one of {list(CACHE_NAMES)}, or "
             "'pq-k<2-5>v<2-5>' / 'pqo-k<2-5>v<2-5>' / 'tq-k<2-5>v<2-5>', optionally with '-l2', '-maxnorm', "
             "'-head', '-eden', '-vq', '-n8' suffixes")
# what a user means as a preset name ("kv3", "KV4-r32"): answered with the list of presets
_PRESET_LIKE = re.compile(r"^kv\d")


#: Options whose value is a JSON file (``KEY=@FILE``): nested mappings a command line cannot spell.
FILE_OPTIONS = ("layer_overrides", "head_overrides")
#: Allocations shipped with the package (``@NAME``): ``benchmarks/kv3_layers.py`` /
#: ``benchmarks/kv3_retrieval.py`` wrote them; ``docs/guide/caches.md`` says how.
CALIBRATIONS = Path(__file__).with_name("calibrations")


def shipped_calibrations() -> list[str]:
    """Names ``@NAME`` accepts for ``head_overrides`` / ``layer_overrides``: the JSON files
    shipped in ``numba_kv/caches/calibrations`` (``"kv3-smollm2-135m"``, ...)."""
    return sorted(p.stem for p in CALIBRATIONS.glob("*.json"))


def _overrides_path(path: str) -> str:
    # a file wins; a bare name (no directory, no .json) is a shipped calibration
    if os.path.exists(path) or "/" in path or os.sep in path or path.endswith(".json"):
        return path
    shipped = CALIBRATIONS / f"{path}.json"
    return str(shipped) if shipped.is_file() else path


class FileOverrides(dict):
    """A ``layer_overrides`` / ``head_overrides`` mapping read from ``@FILE`` (int keys); its
    text form is ``@FILE``, so a spec's label names the file rather than spelling the dict."""

    def __init__(self, data: Any = (), source: str = "") -> None:
        # (``source`` optional: ``dataclasses.asdict`` and ``copy`` rebuild a dict subclass from
        # its items alone)
        super().__init__(data)
        self.source = source

    def __reduce__(self) -> tuple:
        return (FileOverrides, (dict(self), self.source))

    def __str__(self) -> str:
        return f"@{self.source}"

    __repr__ = __str__


def _int_keys(where: str, obj: Any, depth: int) -> dict[int, Any]:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    out: dict[int, Any] = {}
    for key, val in obj.items():
        try:
            idx = int(key)
        except ValueError:
            raise ValueError(f"{where}: keys must be integers, got {key!r}") from None
        if not isinstance(val, dict):
            raise ValueError(f"{where}[{key!r}]: expected a JSON object, got {type(val).__name__}")
        out[idx] = _int_keys(f"{where}[{key!r}]", val, depth - 1) if depth > 1 else dict(val)
    return out


def load_overrides(key: str, path: str) -> FileOverrides:
    """``layer_overrides`` (``{layer: {option: value}}``) or ``head_overrides``
    (``{layer: {kv_head: {option: value}}}``) from the JSON file ``path`` — or, for a bare
    name that is no file, the shipped calibration of that name (:func:`shipped_calibrations`)
    — keys as ints.

    Raises
    ------
    ValueError
        ``key`` is not one of :data:`FILE_OPTIONS`, the file cannot be read or is not JSON of
        that shape (the message names ``key`` and the file).
    """
    if key not in FILE_OPTIONS:
        raise ValueError(f"{key}: only {list(FILE_OPTIONS)} read a file (@FILE), got {key}=@{path}")
    try:
        with open(_overrides_path(path), encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{key}: cannot read the JSON file {path!r} (or a shipped calibration: "
                         f"{shipped_calibrations()}): {exc}") from None
    return FileOverrides(_int_keys(f"{key} (@{path})", data, 2 if key == "head_overrides" else 1), path)


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
        r = opts.pop("residual_length", PolarQuantConfig.residual_length)
        s = opts.pop("sink_tokens", PolarQuantConfig.sink_tokens)
        g = opts.pop("residual_fraction", 0.0) if not self.is_dense else 0.0
        # (a fraction the suffix cannot write, e.g. a str, stays an option for make() to refuse)
        grow = f"-g{fraction_percent(g)}" if isinstance(g, float) and 0 < g < 1 else ""
        if g and not grow:
            opts["residual_fraction"] = g
        out = self.name if self.is_dense else f"{self.name}-r{r}{grow}-s{s}"
        if opts:
            out += ":" + ",".join(f"{k}={v}" for k, v in sorted(opts.items()))
        return out

    def config(self, num_layers: int, num_kv_heads: int, head_dim: int,
               **extra: Any) -> PolarQuantConfig | TurboQuantConfig:
        """The validated configuration :meth:`make` would build (compressed caches only).

        Parameters
        ----------
        num_layers, num_kv_heads, head_dim : int
            Model geometry.
        **extra
            Further options, as for :meth:`make` (no ``layer_overrides``).

        Raises
        ------
        ValueError
            The dense cache (it has no such configuration), or a bad option.

        Examples
        --------
        >>> parse_cache_spec("pqo3-r8:key_center=true").config(2, 4, 64).residual_length
        8
        """
        if self.is_dense:
            raise ValueError("name: the dense cache has no PolarQuant configuration")
        for key in set(self.options) & set(extra):
            raise TypeError(f"config() got multiple values for keyword argument {key!r}")
        cls, opts = _resolve(self.name, head_dim, {**dict(self.options), **extra})
        return cls.config_class(num_layers, num_kv_heads, head_dim, **opts)

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
            Further :func:`make_cache` options that belong to the
            model rather than to the spec (``sliding_window=`` of a model with local layers).

        Returns
        -------
        CompressedKVCache
        """
        return make_cache(self.name, num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                          **dict(self.options), **extra)


def _add_option(opts: dict[str, Any], item: str, text: str) -> None:
    key, sep, value = item.partition("=")
    key, value = OPTION_ALIASES.get(key.strip().lower(), key.strip().lower()), value.strip()
    if not sep or not _KEY.match(key) or not value:
        raise ValueError(f"malformed option {item!r} (expected KEY=VALUE) in {text!r}")
    if key in opts:
        raise ValueError(f"option {key!r} given twice in {text!r}")
    if key in FILE_OPTIONS:
        if not value.startswith("@") or len(value) < 2:
            raise ValueError(f"{key}: expected @FILE (a JSON file) in {text!r}, got {value!r}")
        opts[key] = load_overrides(key, value[1:])
        return
    opts[key] = parse_value(value)


def parse_cache_spec(text: str, defaults: Mapping[str, Any] | None = None) -> CacheSpec:
    """Parse one cache, ``NAME[-rR][-gG][-sS][:KEY=VALUE[,KEY=VALUE...]]`` (module docstring).

    Parameters
    ----------
    text : str
        E.g. ``"pqo3"``, ``"pqo3-r32-s4"``, ``"pqo3-r44-g7-s4"``, ``"pqo4:r=16,window_dtype=int8"``.
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
    >>> parse_cache_spec("pqo3-r44-g7.5")
    CacheSpec(name='pqo3', options={'residual_length': 44, 'residual_fraction': 0.075})
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
        raise ValueError(f"unknown cache {head.strip()!r}; {_EXPECTED} (window suffix '-rR-gG-sS', "
                         "options ':key=value')")
    name = m.group("base")
    for short, key in (("r", "residual_length"), ("s", "sink_tokens")):
        if m.group(short) is not None:
            if key in opts:
                raise ValueError(f"{key} given twice for {head.strip()!r} (suffix and option)")
            opts[key] = int(m.group(short))
    if m.group("g") is not None:
        if "residual_fraction" in opts:
            raise ValueError(f"residual_fraction given twice for {head.strip()!r} (suffix and option)")
        opts["residual_fraction"] = percent_fraction(m.group("g"))
    if name != "dense":
        for key, value in (defaults or {}).items():
            opts.setdefault(key, value)
    return CacheSpec(name, opts)


# -- building -------------------------------------------------------------------------------

def make_cache(name: str, *, num_layers: int, num_kv_heads: int, head_dim: int,
               layer_overrides: dict[int, dict[str, Any]] | None = None,
               head_overrides: dict[int, dict[int, dict[str, Any]]] | None = None,
               **options: Any) -> LayeredCache | MixedCache:
    """Create a cache by name.

    Parameters
    ----------
    name : str
        ``"dense"``; PolarQuant ``"pq2"``–``"pq4"``, ``"pqo2"``–``"pqo4"``; TurboQuant
        (QJL) ``"tq2"``–``"tq4"``; asymmetric ``"pq-k4v3"`` / ``"pqo-k4v3"`` / ``"tq-k4v3"``
        (keys 4 bits, values 3; any of 2–5 each, 5 with ``-head`` only); channel splits
        ``"pqo2.5"`` / ``"pqo3.5"`` (half of every head's channels — the outlier half, chosen
        per layer and KV head on the first prefill — one bit wider: 2.5 / 3.5 index bits per
        value); the presets ``"kv3"``, ``"kv4"``, ``"kv5"`` (:mod:`numba_kv.caches.presets`).
        Suffixes, combinable: ``"-l2"`` / ``"-maxnorm"`` (norm mode), ``"-head"`` (one
        rotation over the whole head and one norm per vector instead of per-32-block scales),
        ``"-eden"`` (unbiased rescale), ``"-vq"`` (head VQ codes), ``"-n8"`` (one-byte norms).
        The full grammar of :mod:`numba_kv.caches.spec` is accepted: a window suffix
        ``"-rR-sS"`` and options ``":key=value,..."`` (``"pqo3-r0-s0:key_center=true"``).
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
    head_overrides : dict {int: dict {int: dict}}, optional
        Bit widths of single KV heads, ``{layer: {kv_head: {option: value}}}``, e.g.
        ``{3: {0: {"k_bits": 4}, 2: {"bits": 2}}}`` (negative layers and heads count from
        the end), applied over the layer's options (base and ``layer_overrides``) with the
        same ``bits`` rule.  Only options that choose a vector's code may differ per head
        (``bits``, ``k_bits``, ``v_bits``, ``norm_mode``, ``unbiased``,
        ``outlier_bits``, ``vq``, ``norm_bits``); window, sink, sliding-window and rotation options raise
        ``ValueError`` (they set what the whole layer stores).  A layer whose heads differ
        is split: each group of its heads with one configuration is stored by a part cache
        with that many KV heads, and the :class:`~numba_kv.caches.mixed.MixedCache`
        gathers and scatters the heads (``memory_usage`` counts each head's width).
    **options
        Forwarded to the cache class (``residual_length=``, ``dtype=`` for dense,
        ``sliding_window=`` — an int, a per-layer list of int/None or ``{layer: window}``
        — ...).

    Returns
    -------
    cache : LayeredCache or MixedCache
        The name's cache class (:class:`~numba_kv.DenseCache`,
        :class:`~numba_kv.PolarQuantCache`, :class:`~numba_kv.TurboQuantCache`), or a
        :class:`~numba_kv.caches.mixed.MixedCache` when layers or heads differ.

    Raises
    ------
    TypeError
        A name that is not a string, an option the cache class does not take (a misspelt
        keyword), or an option's value of the wrong type.
    ValueError
        Unknown name (the message lists the valid ones), an option that contradicts the
        name, or an unknown option or layer inside ``layer_overrides`` / ``head_overrides``.

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
    >>> split = make_cache("pqo3", num_layers=2, num_kv_heads=3, head_dim=64,
    ...                    head_overrides={0: {1: {"bits": 4}}})
    >>> [(part.bits, heads) for part, _, heads in split.layer_pieces(0)]
    [(3, (0, 2)), (4, (1,))]
    """
    try:
        spec = parse_cache_spec(name) if isinstance(name, str) else None
    except ValueError:
        spec = None  # _resolve raises it again, naming the argument
    if spec is not None and any(k in spec.options for k in FILE_OPTIONS):  # "NAME:head_overrides=@FILE"
        layer_overrides = _one_source("layer_overrides", spec.options.get("layer_overrides"), layer_overrides)
        head_overrides = _one_source("head_overrides", spec.options.get("head_overrides"), head_overrides)
        spec = CacheSpec(spec.name, {k: v for k, v in spec.options.items() if k not in FILE_OPTIONS})
    if spec is not None and spec.is_preset:
        # the caller's overrides checked as a plain name's are (build_cache) before they merge into the preset's
        users = _checked_overrides(PRESETS[spec.name].base, layer_overrides, head_overrides,
                                   num_layers, num_kv_heads, head_dim)
        windows = {**spec.options, **options}.get("sliding_window")  # local layers are sized on their own
        base, preset_opts, preset_layers = resolve_preset(spec.name, num_layers=num_layers, num_kv_heads=num_kv_heads,
                                                          head_dim=head_dim, sliding_window=windows,
                                                          head_overrides=head_overrides)
        for idx, over in users.items():
            preset_layers[idx] = {**preset_layers.get(idx, {}), **over}
        heads = merge_head_overrides(PRESETS[spec.name].head_overrides, head_overrides, num_layers, num_kv_heads)
        try:
            return make_cache(base, num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                              layer_overrides=preset_layers or None, head_overrides=heads or None,
                              **{**preset_opts, **spec.options, **options})
        except (TypeError, ValueError) as exc:  # name the preset the caller wrote, not its expansion
            if type(exc) not in (TypeError, ValueError) or repr(base) not in str(exc):
                raise
            raise type(exc)(str(exc).replace(repr(base), f"{spec.name!r} (= {base!r})")) from None
    cls, options = _resolve(name, head_dim, options)
    geom = {"num_layers": num_layers, "num_kv_heads": num_kv_heads, "head_dim": head_dim}
    return build_cache(cls, geom, options, layer_overrides, head_overrides)


def _absolute(where: str, mapping: Any, count: int, expected: str, kind: str = "layer") -> dict[int, tuple[Any, Any]]:
    """``{index: (key, value)}`` of a per-layer (``kind="layer"``) or per-KV-head (``"KV head"``)
    mapping at absolute indices: ``TypeError`` unless it is a dict (``expected`` spells its
    form), ``TypeError``/``ValueError`` for a bad key, one out of range or an index given twice."""
    if not isinstance(mapping, dict):
        raise TypeError(f"{where}: expected a dict {expected}, got {type(mapping).__name__}")
    out: dict[int, tuple[Any, Any]] = {}
    for key, value in mapping.items():
        idx = resolve_layer(where, key, count) if kind == "layer" else resolve_head(where, key, count)
        if idx in out:
            raise ValueError(f"{where}: {kind} {idx} is given twice ({out[idx][0]!r} and {key!r})")
        out[idx] = (key, value)
    return out


def _checked_overrides(base: str, layer_overrides: Any, head_overrides: Any, num_layers: Any, num_kv_heads: Any,
                       head_dim: Any) -> dict[int, dict[str, Any]]:
    """A preset's caller's ``layer_overrides`` at absolute layer indices, once both override
    mappings passed the checks :func:`make_cache` gives a plain name's (the geometry first;
    dicts, layers and KV heads in range and given once, options the class of the preset's
    ``base`` name knows and, per KV head, may vary).  The values are checked when the cache
    is built."""
    num_layers = check_int("num_layers", num_layers, minimum=1)
    num_kv_heads = check_int("num_kv_heads", num_kv_heads, minimum=1)
    cls, _ = _resolve(base, check_head_dim(head_dim), {})
    layers: dict[int, dict[str, Any]] = {}
    if layer_overrides is not None:
        for idx, (key, over) in _absolute("layer_overrides", layer_overrides, num_layers,
                                          "{layer: {option: value}}").items():
            layer_options(cls, {}, over, f"layer_overrides[{key!r}]")
            layers[idx] = dict(over)
    if head_overrides is not None:
        for key, heads in _absolute("head_overrides", head_overrides, num_layers,
                                    "{layer: {kv_head: {option: value}}}").values():
            where = f"head_overrides[{key!r}]"
            for hkey, over in _absolute(where, heads, num_kv_heads, "{kv_head: {option: value}}", "KV head").values():
                head_options(cls, {}, over, f"{where}[{hkey!r}]")
    return layers


def _one_source(key: str, from_name: Any, argument: Any) -> Any:
    """An override mapping given in the name (``@FILE``) or as the argument, not both."""
    if from_name is not None and argument is not None:
        raise ValueError(f"{key}: given twice (in the name as {from_name} and as an argument)")
    return argument if from_name is None else dict(from_name)


def _resolve(name: str, head_dim: Any, options: dict[str, Any]) -> tuple[type, dict[str, Any]]:
    """The cache class of ``name`` and its constructor options (the name's and ``options``)."""
    if not isinstance(name, str):
        raise TypeError(f"name: expected a str, got {type(name).__name__}")
    try:
        spec = parse_cache_spec(name)
    except ValueError as exc:
        raise ValueError(f"name: {exc}") from None
    named = {k: v for k, v in spec.options.items() if k not in FILE_OPTIONS}  # make_cache took them
    if spec.is_dense:
        family, bits, implied = "dense", 0, named
    else:
        family, bits, implied = name_options(spec.name, head_dim)
        implied = {**named, **implied}
    options = merge_name_options(name, family, bits, implied, options)
    if family == "dense":
        return DenseCache, options
    return (TurboQuantCache if family == "tq" else PolarQuantCache), options
