"""Frozen, validated configurations of the PolarQuant and TurboQuant caches.

A :class:`PolarQuantConfig` holds everything that defines a
:class:`~numba_kv.caches.polarquant.PolarQuantCache` (geometry, bit widths, modes, window,
sliding layers) in one immutable object: validation happens once, in ``__post_init__``,
and every bad value raises naming the argument and what was expected.  Optional values
are resolved there (``k_bits``/``v_bits`` default to ``bits``, ``norm_mode`` to the
rotation's norm, ``window_dtype`` becomes its name, ``sliding_window`` its per-layer
tuple), so two configurations describing the same cache compare equal.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import numpy as np

from .._validate import check_head_dim, check_int
from ..ops.blockquant import NORM_MODES
from ..ops.qjl import SKETCH_SEED
from ._layer import check_sliding_window
from ._window import fraction_ratio, window_capacity

__all__ = ["DECODE_OUTPUTS", "DEFAULT_PAGE_SIZE", "MAX_POOL_ROWS", "NORM_BITS", "PAGED_STORAGES", "ROTATIONS",
           "VQ_WIDTHS", "WINDOW_DTYPES",
           "PagedConfig", "PolarQuantConfig", "PolarQuantFields", "TurboQuantConfig", "TurboQuantFields",
           "mirror_config_fields"]

DECODE_OUTPUTS = ("fused", "dequantized")
WINDOW_DTYPES = ("float16", "float32", "int8")
ROTATIONS = ("block", "head")
_BITS = (2, 3, 4, 5)
#: codebooks this wide exist for the whole-head rotation only (one L2 norm per vector; the
#: 32-block codebooks and their decoders stop at 4 bits)
_HEAD_ONLY_SLOT = 5
_BLOCK_BITS = (2, 3, 4)  # channel splits are 32-block codes
DEFAULT_PAGE_SIZE = 16
#: most vectors a paged pool holds (pages × KV heads × page size): its row index is an int32
MAX_POOL_ROWS = 2 ** 31 - 1
PAGED_STORAGES = ("float32", "pqo2", "pqo3", "pqo4")
#: slot widths with a head VQ code (:mod:`numba_kv.ops.headvq`): 4 bits → pairs, 2 bits → quads
VQ_WIDTHS = (2, 4)
#: storage widths of a whole-head vector norm: binary16, or one byte on a log grid (norm_bits=8)
NORM_BITS = (16, 8)
_ASYM = re.compile(r"^pqo-k([234])v([234])$")
_Fields = TypeVar("_Fields", bound=type)


def mirror_config_fields(cls: _Fields) -> _Fields:
    """Make every field annotated on ``cls`` (``config`` aside) a read-only property
    ``cache.<name>`` that returns ``self.config.<name>``.  The annotations stay what type
    checkers see (a plain attribute of that type); only this function makes them properties."""
    for name in cls.__dict__.get("__annotations__", {}):
        if name != "config":
            setattr(cls, name, property(lambda self, n=name: getattr(self.config, n),
                                        doc=f"``config.{name}`` (see :class:`PolarQuantConfig`)."))
    return cls


def _check_fraction(value: Any) -> float:
    """``residual_fraction`` as a float in ``[0, 1)`` (``TypeError`` / ``ValueError`` naming it)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"residual_fraction: expected a float in [0, 1), got {type(value).__name__} {value!r}")
    # (NaN fails both comparisons.)  Below 1, floor(f·t) grows by less than a token per token
    # stored, so a store never needs a compressed token back in the window
    if not 0.0 <= float(value) < 1.0:
        raise ValueError(f"residual_fraction: expected a fraction of the history in [0, 1) (0: a window "
                         f"of residual_length tokens), got {value!r}")
    num, den = fraction_ratio(float(value))
    if num >= den:  # (the window's exact ratio has den <= 10**6: 0.9999999 is 1/1, nothing compressed)
        raise ValueError(f"residual_fraction: expected at most {1 - 1e-6:.6f} (the window's ratio is exact to "
                         f"1e-6, and {value!r} rounds to 1: the window would hold the whole history), "
                         f"got {value!r}")
    return float(value)


def _dtype_name(value: Any) -> Any:
    """A dtype's name (``"float16"`` for ``np.float16``, ``np.dtype("float16")`` or the
    string); anything that is not a dtype as it is (and refused by the choice after it)."""
    if isinstance(value, str):
        return value
    try:
        return np.dtype(value).name if isinstance(value, (type, np.dtype)) else value
    except TypeError:
        return value


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}: expected one of {list(allowed)}, got {value!r}")


@dataclass(frozen=True)
class PolarQuantConfig:
    """Configuration of a :class:`~numba_kv.caches.polarquant.PolarQuantCache`.

    Every field is a constructor keyword of the cache, with the same meaning and default
    (the cache's docstring describes them); ``PolarQuantCache(L, H, D, bits=3, **options)``
    builds ``PolarQuantConfig(L, H, D, bits=3, **options)`` and keeps it as ``cache.config``.

    Parameters
    ----------
    num_layers, num_kv_heads : int
        Model geometry (``>= 1``).
    head_dim : int
        A positive multiple of 32 (with ``rotation="head"``: a power of two ``<= 512``).
    bits : {2, 3, 4, 5}
        Bit setting of keys and values unless ``k_bits``/``v_bits`` say otherwise.  A
        5-bit codebook needs ``rotation="head"``.
    mode : {"pqo", "pq"}
        ``"pqo"``: ``bits``-wide codebooks; ``"pq"``: ``bits − 1``-wide.
    norm_mode : {"maxnorm", "l2"}, optional
        Block normalization; resolved to ``"l2"`` for ``rotation="head"`` (the only
        choice there), else ``"maxnorm"``.
    residual_length, sink_tokens : int
        Newest / first tokens kept uncompressed (``>= 0``).
    residual_fraction : float
        ``0 <= f < 1``: the window grows with the history.  After a store that brings a
        layer's history to ``t`` tokens (positions seen, sinks included; a sliding layer's
        window thus grows over all the tokens it stores) it holds up to
        ``R(t) = max(residual_length, floor(f·t))`` tokens besides the sinks
        (:func:`~numba_kv.caches._window.window_capacity`; ``f`` is taken as the nearest
        fraction with a denominator ``<= 10**6``, so ``0.07`` is exactly 7/100).  0 (default):
        a window of ``residual_length`` tokens.
    window_dtype : {"float16", "float32", "int8"}
        Storage of window and sink tokens (stored as the name).
    window_rotation : bool
        int8 windows only: quantize each exact vector after a randomized Hadamard
        rotation (undone on read).  No effect with float windows.
    decode_output : {"fused", "dequantized"}
        What ``decode`` returns.
    k_bits, v_bits : {2, 3, 4, 5}, optional
        Per-side settings; resolved to ``bits`` when not given.
    key_center, unbiased : bool
        Per-channel key mean removal; EDEN-style unbiased rescale.
    rotation : {"block", "head"}
        32-point block rotation or one rotation over the whole head.
    outlier_channels : int
        Channels per row quantized with wider codebooks: a multiple of 32 below
        ``head_dim`` (``rotation="block"`` only), 0 for none.
    outlier_bits : {2, 3, 4}, optional
        Codebook width of the outlier channels (default: one more than the rest's, per
        side).  Resolved to that width when it is the same for keys and values.
    sliding_window : None, int, sequence or dict
        Per-layer sliding windows (see :func:`~numba_kv.caches._layer.check_sliding_window`);
        resolved to a tuple of ``num_layers`` entries (int or None), or None when no layer
        slides.
    vq : bool
        ``rotation="head"`` only: the sides whose slot width has a head VQ code (4 bits:
        pairs, 2 bits: quads, :data:`VQ_WIDTHS`) store it instead of the scalar head code
        (same bytes; :attr:`vq_sides`); the other side keeps the scalar code, so
        ``pqo-k4v3-head`` with ``vq=True`` has VQ keys and scalar values.  Resolved to
        ``False`` when neither side has a VQ width (``pqo3-head``: the same cache).
    norm_bits : {16, 8}
        Storage of each vector's norm with ``rotation="head"``: binary16 (default), or one
        byte on a per-layer log grid of 1/16 octave (:mod:`numba_kv.ops.norm8`; relative
        error at most ``2**(1/32) − 1``; a norm above the grid's top, fixed at the layer's
        first store, is rejected with ``ValueError``).  8 needs ``rotation="head"``.

    Raises
    ------
    TypeError
        A value of the wrong type (``"bits: expected an int, got str '3'"``).
    ValueError
        A value out of range or contradicting another one; the message starts with the
        argument's name and says what was expected.

    Examples
    --------
    >>> cfg = PolarQuantConfig(2, 4, 64, bits=3, rotation="block")
    >>> cfg.k_bits, cfg.norm_mode, cfg.slot_bits
    (3, 'maxnorm', {'k': 3, 'v': 3})
    >>> PolarQuantConfig(2, 4, 64, bits=5)
    Traceback (most recent call last):
    ...
    ValueError: bits: 5-bit codebooks need rotation='head' (the 32-block codes stop at 4 bits), got rotation='block'
    """

    MODES: ClassVar[tuple[str, ...]] = ("pq", "pqo")

    num_layers: int
    num_kv_heads: int
    head_dim: int
    bits: int = 3
    mode: str = "pqo"
    norm_mode: str | None = None
    residual_length: int = 32
    sink_tokens: int = 4
    window_dtype: Any = "float16"
    window_rotation: bool = True
    decode_output: str = "fused"
    k_bits: int | None = None
    v_bits: int | None = None
    key_center: bool = False
    rotation: str = "block"
    unbiased: bool = False
    outlier_channels: int = 0
    outlier_bits: int | None = None
    sliding_window: Any = None
    vq: bool = False
    residual_fraction: float = 0.0
    norm_bits: int = 16

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)  # frozen: resolution happens once, here

    def __post_init__(self) -> None:
        # the order of the checks is the order users saw before the config existed
        self._set("num_layers", check_int("num_layers", self.num_layers, minimum=1))
        self._set("num_kv_heads", check_int("num_kv_heads", self.num_kv_heads, minimum=1))
        self._set("head_dim", check_head_dim(self.head_dim))
        windows = check_sliding_window(self.sliding_window, self.num_layers)
        self._set("sliding_window", tuple(windows) if any(w is not None for w in windows) else None)
        self._set("bits", check_int("bits", self.bits, allowed=_BITS))
        named = {}  # the argument that set each side's width (for the head-only rule below)
        for side in ("k_bits", "v_bits"):
            val = getattr(self, side)
            named[side[0]] = "bits" if val is None else side
            self._set(side, self.bits if val is None else check_int(side, val, allowed=_BITS))
        _choice("mode", self.mode, self.MODES)
        _choice("rotation", self.rotation, ROTATIONS)
        for side, width in self.slot_bits.items():
            if width >= _HEAD_ONLY_SLOT and self.rotation != "head":
                raise ValueError(f"{named[side]}: {width}-bit codebooks need rotation='head' (the 32-block "
                                 f"codes stop at 4 bits), got rotation={self.rotation!r}")
        if self.norm_mode is None:
            self._set("norm_mode", "l2" if self.rotation == "head" else "maxnorm")
        _choice("norm_mode", self.norm_mode, NORM_MODES)
        if self.rotation == "head":
            if self.norm_mode != "l2":
                raise ValueError(f"norm_mode: rotation='head' stores one L2 norm per vector, expected 'l2', "
                                 f"got {self.norm_mode!r}")
            if self.head_dim & (self.head_dim - 1) or self.head_dim > 512:
                raise ValueError(f"head_dim: rotation='head' needs a power of two <= 512, got {self.head_dim}")
        _choice("decode_output", self.decode_output, DECODE_OUTPUTS)
        self._set("window_dtype", _dtype_name(self.window_dtype))
        _choice("window_dtype", self.window_dtype, WINDOW_DTYPES)
        self._set("residual_length", check_int("residual_length", self.residual_length, minimum=0))
        self._set("sink_tokens", check_int("sink_tokens", self.sink_tokens, minimum=0))
        self._set("residual_fraction", _check_fraction(self.residual_fraction))
        for name in ("key_center", "unbiased", "window_rotation", "vq"):
            val = getattr(self, name)
            if not isinstance(val, (bool, np.bool_)):
                raise TypeError(f"{name}: expected a bool, got {type(val).__name__} {val!r}")
            self._set(name, bool(val))
        if self.vq:
            self._check_vq()
        self._set("norm_bits", check_int("norm_bits", self.norm_bits, allowed=NORM_BITS))
        if self.norm_bits == 8 and self.rotation != "head":
            raise ValueError(f"norm_bits: 8-bit norms need rotation='head' (one norm per vector; the 32-block "
                             f"scales stay binary16), got rotation={self.rotation!r}")
        self._check_outliers()

    def _check_vq(self) -> None:
        if self.rotation != "head":
            raise ValueError(f"vq: the head VQ code needs rotation='head' (it codes the whole-head rotation's "
                             f"coordinates), got rotation={self.rotation!r}")
        if not any(self.vq_sides.values()):
            # no side has a VQ width (e.g. a 3-bit head of a VQ layer's head_overrides): the
            # scalar code on both sides, the same cache as vq=False, so resolved to it
            self._set("vq", False)

    def _check_outliers(self) -> None:
        oc = check_int("outlier_channels", self.outlier_channels, minimum=0)
        self._set("outlier_channels", oc)
        self._set("_outlier_widths", {})
        if not oc:
            if self.outlier_bits is not None:
                raise ValueError(f"outlier_bits: expected None without outlier_channels (outlier_channels=0), "
                                 f"got {self.outlier_bits!r}")
            return
        if oc % 32 or oc >= self.head_dim:
            raise ValueError(f"outlier_channels: expected a multiple of 32 below head_dim={self.head_dim} "
                             f"(whole rotation blocks, some left for the rest), got {oc}")
        if self.rotation != "block":
            raise ValueError("outlier_channels: channel splits need rotation='block', got rotation='head'")
        if self.head_dim > 2 ** 15:  # (the stored channel permutation is int16: wider heads wrapped)
            raise ValueError(f"outlier_channels: channel splits need head_dim <= 32768 (an int16 channel "
                             f"permutation), got head_dim={self.head_dim}")
        widths: dict[str, int] = {}
        for n, lo in self.slot_bits.items():
            hi = lo + 1 if self.outlier_bits is None else check_int("outlier_bits", self.outlier_bits,
                                                                     allowed=_BLOCK_BITS)
            if not lo < hi <= 4:
                raise ValueError(f"outlier_bits: expected more bits than the {n} channels' {lo} and at most 4, "
                                 f"got {hi}")
            widths[n] = hi
        self._set("_outlier_widths", widths)  # resolved once: the caches read it, never re-check it
        if len(set(widths.values())) == 1:
            self._set("outlier_bits", widths["k"])

    # -- derived values ---------------------------------------------------------------------
    @property
    def slot_bits(self) -> dict[str, int]:
        """Codebook width (bits per stored index) of the keys ``"k"`` and values ``"v"``."""
        drop = 0 if self.mode == "pqo" else 1
        return {"k": self.k_bits - drop, "v": self.v_bits - drop}

    @property
    def vq_sides(self) -> dict[str, bool]:
        """Whether keys ``"k"`` / values ``"v"`` store the head VQ code (``vq`` and a slot
        width in :data:`VQ_WIDTHS`); the scalar code otherwise."""
        return {n: bool(self.vq) and b in VQ_WIDTHS for n, b in self.slot_bits.items()}

    @property
    def outlier_widths(self) -> dict[str, int]:
        """Codebook width of the outlier channels per side (empty without ``outlier_channels``),
        resolved (and checked: wider than the side's normal width, at most 4) at construction."""
        return dict(self._outlier_widths)

    @property
    def windowed(self) -> bool:
        """True when some tokens stay uncompressed (``residual_length``, ``sink_tokens`` or
        ``residual_fraction``)."""
        return bool(self.residual_length or self.sink_tokens or self.residual_fraction)

    @property
    def residual_ratio(self) -> tuple[int, int]:
        """``residual_fraction`` as the exact ratio ``(num, den)`` the window's capacity uses
        (:func:`~numba_kv.caches._window.fraction_ratio`)."""
        return fraction_ratio(self.residual_fraction)

    def window_tokens(self, tokens: int) -> int:
        """Window capacity ``R(t) = max(residual_length, floor(f·t))`` after a store that brings
        a layer's history to ``t`` tokens (positions seen: on a global layer the tokens it
        stores; :func:`~numba_kv.caches._window.window_capacity`)."""
        return window_capacity(tokens, self.residual_length, self.residual_ratio)

    # -- bytes (the one formula: caches, presets and the evaluation simulator use it) ---------
    def vector_bytes(self, side: str) -> int:
        """Stored bytes of one compressed vector of ``side`` (``"k"`` or ``"v"``): packed
        indices (``head_dim·slot_bits/8``; the outlier channels at their own width), one
        binary16 scale per 32-block (one norm per vector with ``rotation="head"``, a byte with
        ``norm_bits=8``) and, for TurboQuant keys, the ``qjl_dim``-bit sketch and the binary16
        residual norm."""
        d = self.head_dim
        hi = self.outlier_widths.get(side, 0)
        code_bits = self.outlier_channels * hi + (d - self.outlier_channels) * self.slot_bits[side]
        scale_bytes = 2 * (d // 32) if self.rotation != "head" else self.norm_bits // 8
        return code_bits // 8 + scale_bytes + self.sketch_bytes(side)

    def sketch_bytes(self, side: str) -> int:
        """Bytes of per-vector side information beyond indices and scales (none here;
        TurboQuant keys: sketch and residual norm)."""
        return 0

    @property
    def window_vector_bytes(self) -> int:
        """Stored bytes of one window/sink vector: ``head_dim`` values of ``window_dtype``
        (an int8 vector adds its binary16 scale)."""
        item = np.dtype(self.window_dtype).itemsize
        return self.head_dim * item + (2 if item == 1 else 0)

    def row_constant_bytes(self, side: str) -> int:
        """Per-layer constants of one row (batch row × KV head) of ``side``: the float32 key
        mean (``key_center``) and the int16 channel permutation (``outlier_channels``)."""
        d = self.head_dim
        return (4 * d if side == "k" and self.key_center else 0) + (2 * d if self.outlier_channels else 0)

    def stored_bytes(self, tokens: int, *, sinks: int | None = None, residual: int | None = None,
                     sides: tuple[str, ...] = ("k", "v"), seen: int | None = None) -> int:
        """Bytes one row (one batch row × KV head) of a layer stores holding ``tokens`` tokens.

        ``min(tokens, sinks + R)`` tokens sit in the window (:attr:`window_vector_bytes`
        each), ``R = max(residual, floor(f·seen))`` with ``f = residual_fraction``
        (:meth:`window_tokens`), the rest are compressed (:meth:`vector_bytes`), plus the
        per-layer constants (:meth:`row_constant_bytes`) once the layer holds a token.
        These are the bytes of a layer filled by stores (a crop drops window tokens; the
        stores that follow refill them).

        Parameters
        ----------
        tokens : int
            Tokens the layer stores (a sliding layer: at most its window).
        seen : int, optional
            Tokens of its history, which set a growing window (default ``tokens``; a sliding
            layer: the positions seen, of which it stores the last ``tokens``).
        sinks, residual : int, optional
            Window sizes (default: ``sink_tokens`` / ``residual_length``; a sliding layer keeps
            no sinks, pass ``sinks=0``).
        sides : tuple of str
            ``("k", "v")`` (default), or one side.
        """
        if not tokens:
            return 0
        sinks = self.sink_tokens if sinks is None else sinks
        residual = self.residual_length if residual is None else residual
        seen = tokens if seen is None else seen
        n_exact = min(tokens, sinks + window_capacity(seen, residual, self.residual_ratio))
        return sum((tokens - n_exact) * self.vector_bytes(side) + n_exact * self.window_vector_bytes
                   + self.row_constant_bytes(side) for side in sides)

    def options(self) -> dict[str, Any]:
        """Every field but the geometry, as constructor keywords (``sliding_window`` as a list)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for key in ("num_layers", "num_kv_heads", "head_dim"):
            del out[key]
        if out["sliding_window"] is not None:
            out["sliding_window"] = list(out["sliding_window"])
        return out


@dataclass(frozen=True)
class TurboQuantConfig(PolarQuantConfig):
    """Configuration of a :class:`~numba_kv.caches.turboquant.TurboQuantCache`.

    The fields of :class:`PolarQuantConfig` with ``mode="tq"`` (the only mode) and no
    channel splits, plus the QJL sketch's seed and size.

    Parameters
    ----------
    qjl_seed : int
        Seed of the Gaussian sketch (``>= 0``; default :data:`numba_kv.ops.qjl.SKETCH_SEED`).
    qjl_dim : int, optional
        Sketch rows ``m`` (a positive multiple of 8); resolved to ``head_dim``.

    Examples
    --------
    >>> TurboQuantConfig(1, 2, 128, bits=3).slot_bits
    {'k': 2, 'v': 3}
    """

    MODES: ClassVar[tuple[str, ...]] = ("tq",)

    mode: str = "tq"
    qjl_seed: int = SKETCH_SEED
    qjl_dim: int | None = None

    def __post_init__(self) -> None:
        if self.mode != "tq":
            raise ValueError(f"mode: TurboQuantCache is mode 'tq', got {self.mode!r}")
        if self.outlier_channels:
            raise ValueError(f"outlier_channels: expected 0 (channel splits are not supported by TurboQuantCache), "
                             f"got {self.outlier_channels!r}")
        if self.vq:
            raise ValueError(f"vq: expected False (the head VQ code is not supported by TurboQuantCache; PolarQuant "
                             f"caches only), got {self.vq!r}")
        if self.norm_bits != 16:
            raise ValueError(f"norm_bits: 8-bit norms are not supported by TurboQuantCache (PolarQuant caches "
                             f"only), got {self.norm_bits!r}")
        super().__post_init__()
        seed = self.qjl_seed
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise TypeError(f"qjl_seed: expected a non-negative int, got {type(seed).__name__} {seed!r}")
        if int(seed) < 0:
            raise ValueError(f"qjl_seed: expected a non-negative int, got {seed!r}")
        self._set("qjl_seed", int(seed))
        m = self.head_dim if self.qjl_dim is None else self.qjl_dim
        if isinstance(m, bool) or not isinstance(m, (int, np.integer)):
            raise TypeError(f"qjl_dim: expected a positive multiple of 8, got {type(m).__name__} {m!r}")
        if int(m) < 1 or int(m) % 8:
            raise ValueError(f"qjl_dim: expected a positive multiple of 8 (sketch rows m, packed 8 signs per "
                             f"byte), got {m!r}")
        self._set("qjl_dim", int(m))

    @property
    def slot_bits(self) -> dict[str, int]:
        """Keys: the ``k_bits − 1``-bit codebook (the QJL bit completes the budget);
        values: ``v_bits``."""
        return {"k": self.k_bits - 1, "v": self.v_bits}

    def sketch_bytes(self, side: str) -> int:
        """Keys: the ``qjl_dim``-bit sketch and the binary16 residual norm; values: none."""
        return self.qjl_dim // 8 + 2 if side == "k" else 0


@dataclass(frozen=True)
class PagedConfig:
    """Configuration of a :class:`~numba_kv.caches.paged.PagedKVCache` (and of the page pool
    under the MLA caches): validated once, in ``__post_init__``; the cache and its attention
    path trust it after that.

    Parameters
    ----------
    num_pages, num_layers, num_kv_heads, head_dim, page_size : int
        Pool and model geometry (``>= 1`` each).
    v_head_dim : int, optional
        Width of V (``>= 0``; 0 stores keys only); resolved to ``head_dim`` when not given.
    storage : {"float32", "pqo2", "pqo3", "pqo4"} or ``"pqo-k<b>v<b>"``
        Page format; PQO storage needs ``head_dim`` and ``v_head_dim`` to be multiples of 32.

    Attributes
    ----------
    k_bits, v_bits : int
        The storage's codebook widths of keys and values (0 for float32 pages): the one
        place ``storage`` is parsed.

    Raises
    ------
    TypeError, ValueError
        A value of the wrong type or out of range; the message starts with the argument's
        name and says what was expected.

    Examples
    --------
    >>> cfg = PagedConfig(8, 2, 2, 64, storage="pqo-k4v3")
    >>> cfg.k_bits, cfg.v_bits, cfg.v_head_dim
    (4, 3, 64)
    >>> PagedConfig(8, 2, 2, 48, storage="pqo3")
    Traceback (most recent call last):
    ...
    ValueError: head_dim: expected a multiple of 32 for storage='pqo3' (32-value quantization blocks), got 48
    """

    num_pages: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int = DEFAULT_PAGE_SIZE
    v_head_dim: int | None = None
    storage: str = "float32"
    k_bits: int = field(init=False, default=0)
    v_bits: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        # the order of the checks is the order users saw before the config existed
        for name in ("num_pages", "num_layers", "num_kv_heads", "head_dim", "page_size"):
            set_(name, check_int(name, getattr(self, name), minimum=1))
        set_("v_head_dim", self.head_dim if self.v_head_dim is None
             else check_int("v_head_dim", self.v_head_dim, minimum=0))
        rows = self.num_pages * self.num_kv_heads * self.page_size  # the pool's vectors, page-major
        if rows > MAX_POOL_ROWS:
            raise ValueError(f"num_pages: {self.num_pages} pages × {self.num_kv_heads} KV heads × {self.page_size} "
                             f"tokens are {rows:,} pool rows; at most {MAX_POOL_ROWS:,} (the row index of the page "
                             f"kernels is 32-bit): fewer pages, or one cache per group of layers or heads")
        storage = self.storage
        asym = _ASYM.match(storage) if isinstance(storage, str) else None
        if storage not in PAGED_STORAGES and not asym:
            raise ValueError(f"storage: expected one of {list(PAGED_STORAGES)} or 'pqo-k<2-4>v<2-4>', "
                             f"got {storage!r}")
        if asym:
            kb, vb = int(asym.group(1)), int(asym.group(2))
        else:
            kb = vb = 0 if storage == "float32" else int(storage[-1])
        if kb:
            for name in ("head_dim", "v_head_dim"):
                if getattr(self, name) % 32:
                    raise ValueError(f"{name}: expected a multiple of 32 for storage={storage!r} "
                                     f"(32-value quantization blocks), got {getattr(self, name)}")
        set_("k_bits", kb)
        set_("v_bits", vb)

    @property
    def part_bits(self) -> dict[str, int]:
        """Codebook width per side ``{"k": k_bits, "v": v_bits}`` (0: float32 pages)."""
        return {"k": self.k_bits, "v": self.v_bits}


@mirror_config_fields
class PolarQuantFields:
    """A PolarQuant cache's configuration, field by field: ``cache.bits`` is
    ``cache.config.bits`` (read-only; resolved values, so ``k_bits`` is an int even where
    only ``bits`` was given)."""

    config: PolarQuantConfig
    bits: int
    k_bits: int
    v_bits: int
    mode: str
    norm_mode: str
    residual_length: int
    sink_tokens: int
    decode_output: str
    key_center: bool
    window_rotation: bool
    rotation: str
    unbiased: bool
    outlier_channels: int
    vq: bool
    residual_fraction: float
    norm_bits: int


@mirror_config_fields
class TurboQuantFields(PolarQuantFields):
    """:class:`PolarQuantFields` and the QJL sketch's ``qjl_seed`` and (resolved) ``qjl_dim``."""

    config: TurboQuantConfig
    qjl_seed: int
    qjl_dim: int
