"""``PolarQuantCache``: the turboquant-rs PQ / PQO block-quantized KV cache, with fused
decode attention and an optional full-precision recent window and attention sinks.

Modes:

* ``"pqo"`` (recommended): every 32-block uses the ``bits``-wide codebook; scales are
  stored negative (the outlier-block flag).  PQO3 = 3 bits of index + one f16 scale per
  32 values = 3.5 bits/value.
* ``"pq"``: the ``bits − 1``-wide codebook.  Unlike turboquant-rs, which stores the
  ``(b−1)``-bit indices in ``b``-bit slots, we pack them in ``(b−1)``-bit slots, so PQ3
  costs 2.5 bits/value.

Norm modes ``"maxnorm"`` (default) and ``"l2"`` (see :mod:`numba_kv.ops.blockquant`).
The 2-bit (and 1-bit) MaxNorm codebooks are Lloyd–Max tables fitted to the MaxNorm
scaled distribution, not turboquant-rs's defective 2-bit table (see
:mod:`numba_kv.ops.codebook`).

Window and sinks (the idea of KIVI, arXiv:2402.02750, and of HF ``QuantizedCache``): with
``sink_tokens=S`` the first ``S`` tokens and with ``residual_length=R`` the newest ``R`` tokens stay
uncompressed; a token is compressed when it leaves the window.  Fused attention
combines exact and compressed tokens in one softmax.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import numpy as np

from .. import _backend
from .._validate import F16_MAX, check_magnitude, check_stored_f16
from ..ops.attention import CodeLayout
from ..ops.blockquant import dequantize_into, quantize_into
from ..ops.codebook import get_codebook
from ..ops.finite import check_finite_stats
from ..ops.headquant import head_signs
from ..ops.headvq import headvq_centroids
from ..ops.headvq_bound import eden_scale_bound
from ..ops.keymean import add_channel_into, channel_mean_into
from ._fused_step import FusedDecodeMixin
from ._headnorm import HeadNormMixin
from ._layer import BufferSpec, LayeredCache, LayerState
from ._window import ExactWindow, WindowedLayers, int8_round_trip_norm, layer_counts, plan_store
from .config import PolarQuantConfig, PolarQuantFields
from .names import config_name

__all__ = ["MAX_INPUT", "PolarQuantCache", "PolarQuantConfig"]

# larger inputs are rejected outright: float32 sums inside the quantizers stay far from overflow
MAX_INPUT = float(2 ** 21)
_F32 = np.dtype(np.float32)


class PolarQuantCache(PolarQuantFields, HeadNormMixin, FusedDecodeMixin, WindowedLayers, LayeredCache):
    """PolarQuant (PQ / PQO) compressed KV cache, 2–5 bits, fused decode attention.

    Parameters
    ----------
    num_layers, num_kv_heads, head_dim : int
        Model geometry; ``head_dim`` a positive multiple of 32.
    bits : {2, 3, 4, 5}
        User-facing bit setting (of both K and V unless ``k_bits``/``v_bits`` say otherwise);
        5 only with ``rotation="head"`` (the 32-block codebooks stop at 4 bits).
        The parameters below are keyword-only; together they form a
        :class:`~numba_kv.caches.config.PolarQuantConfig`, which validates them.
    k_bits, v_bits : {2, 3, 4, 5}, optional
        Separate settings for keys and values (5 as for ``bits``; keys are usually the sensitive side:
        ``k_bits=4, v_bits=3`` is 4.0 bits/value on average).
    mode : {"pqo", "pq"}
        ``"pqo"`` quantizes with ``bits``-wide codebooks, ``"pq"`` with ``bits − 1``.
    norm_mode : {"maxnorm", "l2"}
        Block normalization.
    residual_length : int
        Newest tokens kept uncompressed (default 32; 0 = none, turboquant-rs's behaviour).
    sink_tokens : int
        First tokens kept uncompressed (default 4; 0 = none).

        The defaults come from measurements on SmolLM2-135M (512 tokens of GPL-3, 128
        prefilled, PQO3): mean KL to the dense next-token distribution 0.395 without a
        window, 0.360 with 4 sinks only, 0.082 / 0.049 / 0.035 / 0.021 with 4 sinks and a
        window of 16 / 32 / 64 / 128 tokens.  R=32, S=4 removes ~88 % of the KL for
        36 float16 tokens per head (+0.44 bits/value at 1K tokens, +0.03 at 16K);
        doubling R again halves the rest but costs twice the window bytes.
    residual_fraction : float
        ``0 <= f < 1`` (default 0): a window that grows with the history, so that the
        cache's bits/value stays at its budget at every length.  After a store that brings
        a layer's history to ``t`` tokens (positions seen, sinks included; a sliding layer's
        window thus grows over all the tokens it stores) the window holds up to
        ``max(residual_length, floor(f·t))`` tokens besides the sinks; a store compresses
        the oldest window tokens beyond that (a compressed token never comes back).  The
        window buffers grow by the cache's growth rule.  At 8K tokens on SmolLM2-135M a
        window of 7 % of the history passed the quality targets that a window fixed at its
        1K size missed, for the same bits/value (the windows guide, "A window that grows with
        the history").
    window_dtype : {"float16", "float32", "int8"}
        Storage of window/sink tokens.  float16 (default) is exact for fp16 models and
        within 2^-11 relative otherwise, at half the bytes.  ``"int8"``: symmetric absmax
        int8 per vector with one binary16 scale (8 + 16/head_dim bits per value, error
        ≤ half a step of ``max|x|/127`` in the stored domain, see ``window_rotation``),
        halving the window's bytes again.  Numba device arrays store ``"float16"`` as float32
        (no device-side cast to it); int8 and float32 windows are kept as configured.
    window_rotation : bool
        With ``window_dtype="int8"`` (default ``True``): each window/sink vector is rotated
        by a randomized Hadamard transform before the absmax int8 quantization and rotated
        back on read — the whole head when ``head_dim`` is a power of two ≤ 512, else per
        32-block.  A few large channels (RoPE'd key channels, Gemma-3's QK-normed keys)
        otherwise set every vector's step; spread over the head the step shrinks and the
        int8 error falls 2–3× (the rotation-before-quantization of QuaRot, arXiv:2404.00456,
        applied to the exact tokens).  Measured at N = 1024 with every token in an int8
        window: Gemma-3-270M top-1 0.966 → 0.991 and mean KL 0.0073 → 0.0005,
        SmolLM2-135M 0.981 → 0.997 / 0.0007 → 0.0002.  No effect with float windows.
    key_center : bool
        Subtract a per-channel key mean (per batch row and KV head, measured on the
        layer's first stored chunk, frozen) before quantizing and add it back in the
        history.  Exact for attention: ``q·m`` is the same for every token of a query, and
        softmax ignores it, so fused attention simply drops it.  Large RoPE'd key channels
        are mostly such an offset; removing it stops it from inflating every 32-block's
        scale.  Costs ``head_dim`` float32 per row and layer.  On every device (on Numba device
        arrays the mean and the centering are kernels); a decode step on a device subtracts
        the frozen mean inside its window store's launch.
    decode_output : {"fused", "dequantized"}
        ``decode`` returns :class:`~numba_kv.caches.protocol.Fused` attention computed
        from the packed codes (default) or the full dequantized history.
    rotation : {"block", "head"}
        ``"block"`` (default): a signed 32-point Hadamard per 32-value block and one
        binary16 scale per block (+0.5 bit/value).  ``"head"``: one signed Hadamard over
        the whole head (``head_dim`` a power of two ≤ 512), L2 normalization and one
        binary16 norm per vector (+16/head_dim bit/value: PQO3 = 3.125 at d = 128, the
        layout of FAISS ``HR,SQtqmse``; one byte with ``norm_bits=8``), with the Lloyd–Max
        codebook for ``head_dim`` dimensions.  ``norm_mode`` defaults to ``"l2"`` there.
    unbiased : bool
        EDEN-style rescale: store ``α = s·‖y‖²/⟨y, c⟩`` instead of the scale ``s`` of each
        block (or vector), so ``⟨x̂, x⟩ = ‖x‖²`` and inner products with independent queries
        are unbiased (slope 1) at almost the MSE-optimal error, for the same bytes.
    outlier_channels : int
        Channel split (TurboQuant, arXiv:2504.19874, §4.3): this many channels per (layer,
        batch row, KV head) — a multiple of 32 — are quantized with ``outlier_bits``-wide codebooks and
        the rest with the normal ones.  Rule: the channels with the largest RMS over the
        layer's **first stored chunk** (after key centering), per row; the choice is then
        frozen (stored as an int16 permutation per row, counted by ``memory_usage``).  Both
        K and V are permuted so the outlier channels form the leading 32-blocks; queries
        are permuted the same way and outputs permuted back, so attention is unchanged.
        ``pqo2.5`` / ``pqo3.5`` use half of the channels at one bit more.  NumPy/CuPy only.
    outlier_bits : int, optional
        Codebook width of the outlier channels (default: one more than the rest, ≤ 4).
    vq : bool
        With ``rotation="head"``: sides of slot width 4 or 2 store the head VQ code
        (:mod:`numba_kv.ops.headvq`; same bytes), other widths the scalar code (``pqo-k4v3-head``:
        VQ keys, scalar values; neither side at 4/2 bits: resolved to ``False``).  See the
        caches guide, "Head VQ".
    norm_bits : {16, 8}
        With ``rotation="head"``: each vector's norm in binary16 (default) or in one byte on a
        log grid of 1/16 octave fixed per layer at its first store (:mod:`numba_kv.ops.norm8`;
        relative error ≤ 2.2 %; a later norm above the grid's top raises ``ValueError``).
    sliding_window : None, int, sequence or dict, optional
        Per-layer sliding windows (``None``: all global; an int: every layer; a list of
        ``num_layers`` ints/None; ``{layer: window}``, negative layers from the end).  A
        sliding layer stores only the tokens its queries can still see (at most
        ``window − 1`` plus the current call's), keeps **no sinks** (``sink_tokens`` applies
        to global layers only: a sink older than the window is invisible anyway), keeps its
        newest ``residual_length`` tokens exact as usual, and masks per query row inside
        the fused kernel (a finite logit bias) when a chunk of queries spans more than the
        window.

    Attributes
    ----------
    config : PolarQuantConfig
        The frozen, validated configuration (every parameter above, resolved: ``k_bits``,
        ``norm_mode``, ...).  Its fields are also readable as cache attributes
        (``cache.bits``, ``cache.rotation``, ...; ``window_dtype`` as a NumPy dtype).
        ``PolarQuantCache.from_config(config)`` builds a cache from one.

    Notes
    -----
    Storage per layer, on the device of the first input: ``k_codes``/``v_codes`` uint8
    ``[batch·num_kv_heads, capacity, head_dim·slot_bits/8]``, ``k_scales``/``v_scales``
    uint16 (binary16 bits) ``[batch·num_kv_heads, capacity, head_dim/32]``, and with a
    window ``k_exact``/``v_exact`` ``[batch·num_kv_heads, S + R, head_dim]`` (longer once a
    growing window, ``residual_fraction``, outgrows them).

    Examples
    --------
    >>> import numpy as np
    >>> cache = PolarQuantCache(num_layers=2, num_kv_heads=4, head_dim=64, bits=3)
    >>> k = np.random.default_rng(0).standard_normal((1, 4, 10, 64)).astype(np.float32)
    >>> _ = cache.prefill(0, k, k)
    >>> cache.seq_len(0), cache.memory_usage()
    (10, 10240)
    """

    #: the configuration type the constructor builds (``TurboQuantConfig`` for TurboQuant)
    config_class: ClassVar[type[PolarQuantConfig]] = PolarQuantConfig

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, bits: int = 3, **options: Any) -> None:
        known = [f.name for f in dataclasses.fields(self.config_class)]
        for key in options:  # (the dataclass's own TypeError names neither the cache nor the options it takes)
            if key not in known:
                raise TypeError(f"{key}: not an option of {type(self).__name__}; expected one of "
                                f"{sorted(set(known) - {'num_layers', 'num_kv_heads', 'head_dim'})}")
        self._setup(self.config_class(num_layers, num_kv_heads, head_dim, bits, **options))

    @classmethod
    def from_config(cls, config: PolarQuantConfig) -> PolarQuantCache:
        """The cache of a configuration (``cls(**fields)`` without validating twice).

        Parameters
        ----------
        config : PolarQuantConfig
            Of exactly the class's configuration type (:class:`PolarQuantConfig`, or
            :class:`~numba_kv.caches.config.TurboQuantConfig` for ``TurboQuantCache``).

        Returns
        -------
        PolarQuantCache
            An empty cache with ``cache.config is config``.

        Raises
        ------
        TypeError
            ``config`` of another type.
        """
        if type(config) is not cls.config_class:
            raise TypeError(f"config: expected a {cls.config_class.__name__}, got {type(config).__name__}")
        cache = cls.__new__(cls)
        cls._setup(cache, config)  # what __init__ does after building the configuration
        return cache

    def _setup(self, cfg: PolarQuantConfig) -> None:
        """Derived read-only state (codebooks, code layouts, rotation signs) of ``cfg``."""
        # the configuration validated the geometry: not checked again
        self._init_geometry(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                            list(cfg.sliding_window or [None] * cfg.num_layers))
        self.config = cfg
        self.num_blocks = self.head_dim // 32
        self.slot_bits = cfg.slot_bits
        self.outlier_bits: dict[str, int] = cfg.outlier_widths
        self.codebooks = {n: self._codebook(b) for n, b in self.slot_bits.items()}
        #: the sides that store the head VQ code, and its table (``headvq_centroids``) per side
        self.vq_sides = cfg.vq_sides
        self._vq_cents = {n: headvq_centroids(self.slot_bits[n], self.head_dim)
                          for n, on in self.vq_sides.items() if on}
        self.layouts: dict[str, CodeLayout] = {}
        for n, cb in self.codebooks.items():
            if n in self._vq_cents:
                self.layouts[n] = CodeLayout.head_vq(self.slot_bits[n], self.head_dim)
            elif cfg.rotation == "head":
                self.layouts[n] = CodeLayout.uniform(cb, self.head_dim, scale_group=self.num_blocks)
            elif cfg.outlier_channels:
                n_hi = cfg.outlier_channels // 32
                hi = self._codebook(self.outlier_bits[n])
                self.layouts[n] = CodeLayout.from_blocks([hi] * n_hi + [cb] * (self.num_blocks - n_hi))
            else:
                self.layouts[n] = CodeLayout.uniform(cb, self.head_dim)
        self.outlier = cfg.mode != "pq"
        self.packed_dims = {n: lay.width for n, lay in self.layouts.items()}
        self._head_signs = head_signs(self.head_dim) if cfg.rotation == "head" else None
        # plain copies of the configuration flags every decode step reads (a mirrored field is a
        # property call and a lookup on the configuration each time)
        self._windowed, self._fused = cfg.windowed, cfg.decode_output == "fused"
        self._window_np_dtype = np.dtype(cfg.window_dtype)
        # a store into an int8 window with the whole-head quantizer can run as one serial call
        # (_store_window8_head); whether the window is int8 is decided per layer (device); either
        # code on either side
        self._window8_head = (cfg.rotation == "head" and cfg.window_dtype == "int8" and self._windowed
                              and not cfg.outlier_channels and self._compress.__func__ is PolarQuantCache._compress)
        # both sides of a decode step's evicted tokens in one launch (_compress_pair): this class's
        # quantizer without channel split, any code (TurboQuant adds its QJL stage per side)
        self._pair_quantize = not cfg.outlier_channels and self._compress.__func__ is PolarQuantCache._compress
        self._window = ExactWindow(self.head_dim, cfg.sink_tokens, cfg.residual_length,
                                   cfg.rotation if cfg.window_rotation else None, cfg.residual_fraction)
        # storage of the window buffers: the configured dtype, float32 for a float16 window while
        # the layer's arrays are Numba device arrays (set by _append, which sees the arrays)
        self._exact_dtype = self.window_dtype
        self.name = config_name(cfg)

    @property
    def window_dtype(self) -> np.dtype:
        """Configured storage of window/sink tokens (Numba device arrays store float16 as float32)."""
        return self._window_np_dtype

    def _codebook(self, bits: int):
        return get_codebook(bits, self.norm_mode, block=self.head_dim if self.rotation == "head" else 32)

    def _sinks(self, st: LayerState) -> int:
        """Sink tokens of the layer: none on sliding-window layers (a sink older than the
        window is invisible to every later query, so it is evicted like any other token)."""
        return 0 if st.window is not None else self.config.sink_tokens

    @property
    def windowed(self) -> bool:
        """True when some tokens stay uncompressed."""
        return self._windowed

    @property
    def packed_dim(self) -> int:
        """Packed bytes per key vector (values: ``packed_dims["v"]``)."""
        return self.packed_dims["k"]

    @property
    def codebook(self):
        """Codebook of the keys (values: ``codebooks["v"]``)."""
        return self.codebooks["k"]

    def _side_bits(self, name: str) -> float:
        """Stored bits of one compressed vector of side ``name`` (:meth:`PolarQuantConfig.vector_bytes`)."""
        return 8.0 * self.config.vector_bytes(name)

    @property
    def k_bits_per_value(self) -> float:
        """Stored bits per compressed key value."""
        return self._side_bits("k") / self.head_dim

    @property
    def v_bits_per_value(self) -> float:
        """Stored bits per compressed value-vector value."""
        return self._side_bits("v") / self.head_dim

    @property
    def bits_per_value(self) -> float:
        """Stored bits per compressed value, averaged over K and V (indices, binary16
        scales and any per-vector side information; window tokens and per-layer constants
        such as channel permutations are not included — ``memory_usage`` counts them)."""
        return (self.k_bits_per_value + self.v_bits_per_value) / 2

    # -- storage ----------------------------------------------------------------------------
    def _buffer_spec(self) -> BufferSpec:
        spec: BufferSpec = {n + "_codes": (lay.width, np.uint8, None) for n, lay in self.layouts.items()}
        for n, lay in self.layouts.items():
            spec[n + "_scales"] = (lay.num_scales, np.uint8 if self.config.norm_bits == 8 else np.uint16, None)
        if self.windowed:
            spec.update(self._window.buffer_spec(self._exact_dtype))
        if self.key_center:
            spec["k_chmean"] = (self.head_dim, np.float32, 1)
        if self.outlier_channels:
            spec["k_perm"] = (self.head_dim, np.int16, 1)
            spec["v_perm"] = (self.head_dim, np.int16, 1)
        return spec

    def _growing_needed(self, st: LayerState, new_tokens: int) -> int:
        return st.meta.get("n_comp", 0) + new_tokens

    def _window_dtype_for(self, k: Any) -> np.dtype:
        """The window's dtype for input ``k``: the configured one, except float16 on Numba device
        arrays (no device-side cast to it there): float32.  An int8 window is written by
        kernels on every device."""
        dt = self._window_np_dtype
        return _F32 if dt == np.float16 and _backend.xp_of(k) is None else dt

    def _append(self, st: LayerState, dev: str, k: Any, v: Any) -> int:
        # (Numba device arrays cannot hold float16 windows: no device-side cast)
        self._exact_dtype = self._window_dtype_for(k)
        if _backend.xp_of(k) is None and self.outlier_channels:
            raise TypeError("k: outlier_channels needs NumPy or CuPy arrays, got a Numba device array")
        return super()._append(st, dev, k, v)

    # -- range validation (before anything is stored) ---------------------------------------
    def _f16_factor(self, name: str) -> float:
        """Upper bound of every binary16 number stored for one compressed vector of side
        ``name`` (block scales, vector norms, TurboQuant's residual norm) per unit of the
        vector's L2 norm ``‖x‖`` in the stored domain.

        Rotations keep L2 norms, so a rotated block's largest value and its norm are at most
        ``‖x‖``; MaxNorm divides by the outer centroid ``ref``; the EDEN rescale multiplies
        by ``‖y‖²/⟨y, c⟩``: every term of ``⟨y, c⟩`` is ``>= 0`` (0 is a decision boundary),
        so it is at most ``32`` for MaxNorm blocks (``‖y‖² <= 32·ref²``, the extreme term is
        ``ref²``) and at most ``√m / c_min`` for a unit vector of ``m`` values.  A
        reconstruction has norm at most ``√m · c_max`` times that bound, which bounds the
        residual norm ``‖x − x̂‖``.  The head VQ code's EDEN scale has no such term-wise
        bound (a group's nearest point can point away from it); its bound is proved per
        codebook (:func:`~numba_kv.ops.headvq_bound.eden_scale_bound`).
        """
        cached = self.__dict__.setdefault("_f16_factors", {})
        if name in cached:
            return cached[name]
        m = self.head_dim if self.rotation == "head" else 32
        cbs = [self.codebooks[name]]
        if self.outlier_channels:
            cbs.append(self._codebook(self.outlier_bits[name]))
        f = 0.0
        if name in self._vq_cents and self.unbiased:
            # the VQ code's EDEN scale ‖x‖·‖y‖²/⟨y, ĉ⟩: a bound proved per codebook
            # (branch-and-bound over the nearest-point map, numba_kv.ops.headvq_bound)
            cbs, f = [], eden_scale_bound(self.slot_bits[name], self.head_dim)
        for cb in cbs:
            c = np.abs(np.asarray(cb.centroids, np.float64))
            if cb.norm_mode == "l2":
                a = math.sqrt(m) / float(c[c > 0].min()) if self.unbiased else 1.0
            else:
                a = (32.0 if self.unbiased else 1.0) / float(cb.ref)
            if name == "k" and getattr(self, "qjl_dim", 0):  # TurboQuant stores the residual norm
                a = max(a, 1.0 + math.sqrt(m) * float(c.max()) * a)
            f = max(f, a)
        cached[name] = f
        return f

    def _input_limit(self) -> tuple[float, str]:
        return MAX_INPUT, f"a {self.name} cache"

    def _check_range(self, st: LayerState, k: Any, v: Any, stats: Any) -> None:
        """Reject (``ValueError``, nothing stored) what would not be stored faithfully.

        * ``|x| > 2**21`` (:data:`MAX_INPUT`): always;
        * ``|x| > 65504`` with ``window_dtype="float16"`` (such a token cannot sit in the window);
        * any derived binary16 block scale / vector norm ``>= 65504``.  A cheap bound
          (:meth:`_f16_factor` times the largest vector norm) proves most inputs safe; the
          rest are quantized once into scratch buffers and the scales inspected.

        An int8 window's binary16 scale needs no check of its own: it is ``max|x|/127``,
        rotated at most ``‖x‖/127``, and every token is checked as if compressed, which
        bounds each 32-block's norm by ``√32·65504`` (max-norm scales of the rotated block)
        or 65504 (L2 norms), so ``‖x‖ ≤ √d·65504 ≤ 1.5e6``, well below ``127·65504``.
        """
        # the window dtype as _append will choose it
        self._exact_dtype = self._window_dtype_for(k)
        f16_window = self._windowed and self._exact_dtype == np.float16
        limit = F16_MAX * (1 - 2.0 ** -10)
        root_d = math.sqrt(self.head_dim)
        for name, arr, rs in (("k", k, stats[0]), ("v", v, stats[1])):
            if not rs.amax <= MAX_INPUT:
                check_magnitude(name, rs.amax, MAX_INPUT, f"a {self.name} cache")
            # first with the free bound ‖x‖ <= √d·max|x|, then (if needed) the measured norm
            amax, norm, exact = self._stored_domain_bounds(st, name, rs.amax, root_d * rs.amax)
            if f16_window and exact:
                check_magnitude(name, amax, F16_MAX, "a float16 window (window_dtype='float16')")
            safe = norm * self._f16_factor(name) <= limit
            if not safe:
                amax, norm, exact = self._stored_domain_bounds(st, name, rs.amax, rs.max_norm)
                safe = norm * self._f16_factor(name) <= limit
            # (8-bit norms: _check_norm8 checks them; the dry run would repeat the float16-window check)
            if (not safe and not self._norm8) or (f16_window and amax > F16_MAX):
                self._dry_run(st, name, arr, rs, f16_window)
        self._check_norm8(st, k, v, stats)

    def _stored_domain_bounds(self, st: LayerState, name: str, amax: float,
                              norm: float) -> tuple[float, float, bool]:
        """Bounds of ``max|x|`` and ``max ‖x‖`` after :meth:`_transform_in` (key centering;
        permutations change neither), and whether the domain is the input's own.  The norm
        bound covers the int8 round trip a token is compressed from when it leaves an int8
        window (:func:`~numba_kv.caches._window.int8_round_trip_norm`)."""
        exact = True
        if name == "k" and self.config.key_center:
            exact = False
            if st.meta.get("kmean_set", 0):
                m_amax, m_norm = self._mean_bounds(st)
                amax += m_amax
                norm += m_norm
            else:  # the mean of this chunk: no larger than its largest value / norm
                amax, norm = 2 * amax, 2 * norm
        if self._windowed and self._exact_dtype == np.int8:
            norm = int8_round_trip_norm(norm, self.head_dim)
        return amax, norm, exact

    def _range_note(self, st: LayerState, name: str) -> str:
        """What a range error on ``name`` must add besides the input's own numbers: with key
        centering the stored keys are ``k − mean``, the mean frozen from the layer's first
        stored chunk, so a mean far from this call's keys saturates their norms."""
        if name != "k" or not self.config.key_center:
            return ""
        if not st.meta.get("kmean_set", 0):
            return "; the keys are stored minus this chunk's mean (key centering)"
        m_amax, m_norm = self._mean_bounds(st)
        return (f"; the keys are stored minus the layer's key mean, frozen from its first stored chunk: max |mean| = "
                f"{m_amax:.6g}, largest row norm {m_norm:.6g} (key centering)")

    def _mean_bounds(self, st: LayerState) -> tuple[float, float]:
        """``max|m|`` and the largest row norm ``‖m‖`` of the frozen key mean (float64), measured
        once per layer: the mean never changes once set (:meth:`_center_keys`), so each decode
        step reads two floats instead of the buffer.  Kept in ``st.scratch`` with the buffer it
        was measured on (a reset, a load or a batch selection replaces the buffer object)."""
        mbuf = st.buffers["k_chmean"]
        hit = st.scratch.get("kmean_bounds")
        if hit is not None and hit[0] is mbuf:
            return hit[1], hit[2]
        mb = _backend.to_host(mbuf).astype(np.float64)
        bounds = float(np.abs(mb).max()), float(np.sqrt((mb ** 2).sum(axis=-1)).max())
        st.scratch["kmean_bounds"] = (mbuf, *bounds)
        return bounds

    def _dry_run(self, st: LayerState, name: str, arr: Any, rs: Any, f16_window: bool) -> None:
        """Quantize ``arr`` into scratch buffers (the layer is not touched) and raise if a
        binary16 number saturates (or, with a float16 window, a stored-domain value exceeds 65504)."""
        rows, n = int(arr.shape[0]) * self.num_kv_heads, int(arr.shape[2])
        tmp = LayerState(meta=dict(st.meta))
        scratch = []
        for b, (w, dt, fixed) in self._buffer_spec().items():
            if fixed is None:
                tmp.buffers[b] = _backend.zeros(arr, (rows, n, w), dt)
                scratch.append(b)
            elif st.seq_len and b in st.buffers:
                tmp.buffers[b] = st.buffers[b]  # frozen per-layer constants: only read
            else:
                tmp.buffers[b] = _backend.zeros(arr, (rows, fixed, w), dt)
        x = _backend.ascontiguous_f32(name, arr)
        x3 = self._transform_in(tmp, name, x.reshape(rows, n, self.head_dim))
        if f16_window:
            check_magnitude(name, check_finite_stats(name, x3).amax, F16_MAX,
                            "a float16 window (window_dtype='float16'; after key centering)")
        if self._norm8:
            return  # its norms are checked (binary16 saturation too) by _check_norm8, from one quantization
        int8 = self._windowed and self._exact_dtype == np.int8  # (then compressed from its round trip, too)
        for y3 in (x3, self._window.int8_round_trip(x3)) if int8 else (x3,):
            self._compress(tmp, name, y3, 0)
            for b in scratch:
                if b.startswith(name + "_") and np.dtype(tmp.buffers[b].dtype) == np.uint16:
                    check_stored_f16(name, tmp.buffers[b], rs.amax, rs.max_norm, self._range_note(st, name))

    def _split_parts(self, name: str) -> tuple[tuple[int, int, int, int, int], ...]:
        """Channel split of side ``name``: ``(first channel, end channel, first code byte,
        end code byte, bits)`` of the outlier part and of the rest."""
        lay = self.layouts[name]
        c_hi = self.outlier_channels
        w_hi = int(lay.offsets[c_hi // 32])
        return ((0, c_hi, 0, w_hi, self.outlier_bits[name]),
                (c_hi, self.head_dim, w_hi, lay.width, self.slot_bits[name]))

    def _compress(self, st: LayerState, name: str, x3: Any, t0: int) -> None:
        """Quantize ``x3`` ``[rows, n, d]`` (transformed domain) into tokens ``t0 : t0+n``."""
        if self.rotation == "head":  # (scalar or VQ code, binary16 or 8-bit norms: HeadNormMixin)
            self._quantize_vectors(st, name, x3, t0)
            return
        codes, scales = st.buffers[name + "_codes"], st.buffers[name + "_scales"]
        if not self.outlier_channels:
            quantize_into(x3, codes, scales, t0, self.codebooks[name], self.outlier, unbiased=self.unbiased)
            return
        xp = _backend.xp_of(x3)
        rows, n, _ = x3.shape
        for lo_c, hi_c, lo_w, hi_w, bits in self._split_parts(name):
            part = xp.ascontiguousarray(x3[:, :, lo_c:hi_c])
            tc = xp.empty((rows, n, hi_w - lo_w), dtype=np.uint8)
            ts = xp.empty((rows, n, (hi_c - lo_c) // 32), dtype=np.uint16)
            quantize_into(part, tc, ts, 0, self._codebook(bits), self.outlier, unbiased=self.unbiased)
            codes[:, t0:t0 + n, lo_w:hi_w] = tc
            scales[:, t0:t0 + n, lo_c // 32:hi_c // 32] = ts

    def _decompress(self, st: LayerState, name: str, t0: int, out: Any) -> None:
        """Reconstruct tokens ``t0 : t0 + out.shape[1]`` into ``out`` (transformed domain)."""
        if self.rotation == "head":
            self._dequantize_vectors(st, name, t0, out)
            return
        codes, scales = st.buffers[name + "_codes"], st.buffers[name + "_scales"]
        if not self.outlier_channels:
            dequantize_into(codes, scales, t0, self.codebooks[name], out)
            return
        xp = _backend.xp_of(out)
        rows, n, _ = out.shape
        for lo_c, hi_c, lo_w, hi_w, bits in self._split_parts(name):
            tc = xp.ascontiguousarray(codes[:, t0:t0 + n, lo_w:hi_w])
            ts = xp.ascontiguousarray(scales[:, t0:t0 + n, lo_c // 32:hi_c // 32])
            part = xp.empty((rows, n, hi_c - lo_c), dtype=np.float32)
            dequantize_into(tc, ts, 0, self._codebook(bits), part)
            out[:, :, lo_c:hi_c] = part

    def _store(self, st: LayerState, k: Any, v: Any) -> None:
        n = int(k.shape[2])
        pre = self._fix_norm8_base(st, k, v)  # a first store's scratch codes (8-bit norms)
        n_sink, n_comp, n_win = layer_counts(st)
        S = self._sinks(st)
        # without a window every token is compressed; a growing window's buffers grow first
        # the window's capacity follows the history (positions seen), so a sliding layer's window
        # can grow over all it stores
        plan = plan_store(n, st.seq_len, n_win, S, self._window.reserve(st, S, st.seq_len + st.evicted + n,
                                                                       st.seq_len + n)) \
            if self._windowed else None
        if plan is not None and self._store_window8_head(st, k, v, plan, S, n_sink, n_comp):
            st.meta.update(n_comp=n_comp + plan.compressed, n_sink=n_sink + plan.sinks,
                           n_win=plan.keep_old + plan.keep_new)
            self._set_live(st)
            return
        if plan is not None and self._store_window_pair(st, k, v, plan, S, n_sink, n_comp):
            st.meta.update(n_comp=n_comp + plan.compressed, n_sink=n_sink + plan.sinks,
                           n_win=plan.keep_old + plan.keep_new)
            self._set_live(st)
            return
        for name, arr in (("k", k), ("v", v)):
            x = _backend.ascontiguous_f32(name, arr)
            x3 = self._transform_in(st, name, x.reshape(x.shape[0] * x.shape[1], x.shape[2], x.shape[3]))
            compress = self._compressor(st, name, pre, plan, n_comp)
            if plan is None:
                compress(x3)
            else:
                self._window.store(st, name, x3, plan, S, compress)
        if plan is None:
            st.meta.update(n_comp=n_comp + n, n_sink=n_sink, n_win=0)
        else:
            st.meta.update(n_comp=n_comp + plan.compressed, n_sink=n_sink + plan.sinks,
                           n_win=plan.keep_old + plan.keep_new)
        self._set_live(st)

    def _transform_in(self, st: LayerState, name: str, x3: Any) -> Any:
        """The stored domain: keys ``x − m`` with the frozen per-channel key mean ``m`` (only
        with ``key_center``), then both sides permuted so the outlier channels come first
        (only with ``outlier_channels``).  Both are measured on the layer's first chunk and
        frozen."""
        if name == "k" and self.key_center:
            x3 = self._center_keys(st, x3)
        if not self.outlier_channels:
            return x3
        xp = _backend.xp_of(x3)
        pbuf = st.buffers[name + "_perm"]
        if not st.meta.get(name + "perm_set", 0):
            # outlier channels: the ``outlier_channels`` largest by RMS over the first chunk
            rms = xp.sqrt((x3.astype(xp.float64) ** 2).mean(axis=1))  # [rows, d]
            # stable order (ties by channel index); CuPy's argsort is always stable and takes no kind
            order = xp.argsort(-rms, axis=1, kind="stable") if xp is np else xp.argsort(-rms, axis=1)
            hi = xp.sort(order[:, :self.outlier_channels], axis=1)
            lo = xp.sort(order[:, self.outlier_channels:], axis=1)
            pbuf[:, 0, :] = xp.concatenate([hi, lo], axis=1).astype(np.int16)
            st.meta[name + "perm_set"] = 1
        perm = pbuf.astype(np.int64)  # [rows, 1, d]
        return xp.ascontiguousarray(xp.take_along_axis(x3, perm, axis=2), dtype=xp.float32)

    def _transform_out(self, st: LayerState, name: str, flat: Any) -> Any:
        """Inverse of :meth:`_transform_in` on ``[rows, n, d]`` float32."""
        if self.outlier_channels:
            xp = _backend.xp_of(flat)
            inv = xp.argsort(st.buffers[name + "_perm"].astype(np.int64), axis=2)
            flat = xp.take_along_axis(flat, inv, axis=2)
        if name == "k" and self.key_center:
            mean = st.buffers["k_chmean"]
            if _backend.xp_of(flat) is None:  # Numba device arrays: no array arithmetic
                return add_channel_into(flat, mean, 1, _backend.empty(flat, tuple(flat.shape), np.float32))
            flat = flat + mean
        return flat

    def _query_in(self, st: LayerState, q3: Any) -> Any:
        """Queries ``[rows, G·q_len, d]`` in the keys' stored domain: ``q·k`` is unchanged up
        to a per-query constant (the key mean, which softmax ignores)."""
        if self.outlier_channels:
            xp = _backend.xp_of(q3)
            q3 = xp.take_along_axis(q3, st.buffers["k_perm"].astype(np.int64), axis=2)
        return _backend.ascontiguous_f32("q", q3)

    def _center_keys(self, st: LayerState, x3: Any) -> Any:
        """``x3 − m`` with the frozen per-channel key mean ``m`` (set on the layer's first chunk)."""
        xp = _backend.xp_of(x3)
        mbuf = st.buffers["k_chmean"]
        if xp is not np:  # a device (CuPy or Numba): NumPy's float32 results, bit for bit, through two twins
            # (CuPy's own reduction sums in another order: a last-bit difference in the mean can
            # move an int8 window code by one step, and the device cache would drift from the host's)
            x3 = _backend.ascontiguous_f32("k", x3)
            if not st.meta.get("kmean_set", 0):
                channel_mean_into(x3, mbuf)
                st.meta["kmean_set"] = 1
            return add_channel_into(x3, mbuf, -1, _backend.empty(x3, tuple(x3.shape), np.float32))
        if not st.meta.get("kmean_set", 0):
            mbuf[:, 0, :] = x3.astype(xp.float64).mean(axis=1).astype(xp.float32)
            st.meta["kmean_set"] = 1
        return xp.ascontiguousarray(x3 - mbuf, dtype=xp.float32)

    # -- reading ----------------------------------------------------------------------------
    def _exact_f32(self, st: LayerState, name: str, rotated: bool = False) -> tuple[Any, int]:
        """Window/sink tokens as float32 ``[rows, >= n_exact, d]`` and their count (``rotated``:
        a rotated int8 window stays in the rotated domain)."""
        if not self.windowed:
            like = st.buffers["k_codes"]
            # one empty array per layer and device (a bound attention step stays bound)
            empty = st.scratch.get("no_exact")
            if empty is None or int(empty.shape[0]) != int(like.shape[0]) or type(empty) is not type(like):
                empty = st.scratch["no_exact"] = _backend.empty(like, (like.shape[0], 0, self.head_dim), np.float32)
            return empty, 0
        return self._window.exact_f32(st, name, rotated)

    def _exact_positions(self, st: LayerState, like: Any) -> Any:
        """Stored positions (int32) of the window/sink tokens at the front of a reused buffer,
        on the device of ``like`` (:meth:`ExactWindow.positions`)."""
        return self._window.positions(st, like, self._sinks(st))

    def _history(self, st: LayerState, dtype: Any) -> tuple[Any, Any]:
        out = []
        like = st.buffers["k_codes"]
        rows = like.shape[0]
        n_comp = st.meta.get("n_comp", 0)
        for name in ("k", "v"):
            comp = _backend.empty(like, (rows, n_comp, self.head_dim), np.float32)
            if n_comp:
                self._decompress(st, name, 0, comp)
            if self.windowed:
                flat = _backend.empty(like, (rows, st.seq_len, self.head_dim), np.float32)
                self._window.merge(st, name, comp, flat)
            else:
                flat = comp
            out.append(self._reshape_out(self._transform_out(st, name, flat), st.batch, dtype))
        return out[0], out[1]

    # -- lifecycle ----------------------------------------------------------------------------
    def config_dict(self) -> dict[str, Any]:
        """Constructor arguments (JSON types) that rebuild this cache's configuration."""
        cfg = self.config
        # ``vq``, ``residual_fraction`` and ``norm_bits`` only when not the default: such a cache
        # writes the files it wrote before the options existed (same bytes, readable by earlier
        # versions)
        opts = {k: v for k, v in cfg.options().items()
                if k != "sliding_window" and not (k in ("vq", "residual_fraction") and not v)
                and not (k == "norm_bits" and v == 16)}
        return {"num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
                **opts, **self._window_config()}
