"""``PolarQuantCache``: the turboquant-rs PQ / PQO block-quantized KV cache, with fused
decode attention and an optional full-precision recent window and attention sinks.

Modes (``algorithms.md`` §2.5):

* ``"pqo"`` (recommended): every 32-block uses the ``bits``-wide codebook; scales are
  stored negative (the outlier-block flag).  PQO3 = 3 bits of index + one f16 scale per
  32 values = 3.5 bits/value.
* ``"pq"``: the ``bits − 1``-wide codebook.  Unlike the anchor, which stores the
  ``(b−1)``-bit indices in ``b``-bit slots, we pack them in ``(b−1)``-bit slots, so PQ3
  costs 2.5 bits/value.

Norm modes ``"maxnorm"`` (default) and ``"l2"`` (see :mod:`numba_kv.ops.blockquant`).
The 2-bit (and 1-bit) MaxNorm codebooks are Lloyd–Max tables fitted to the MaxNorm
scaled distribution, not the anchor's defective 2-bit table (see
:mod:`numba_kv.ops.codebook`).

Window and sinks (the KIVI / HF ``QuantizedCache`` idea): with ``sink_tokens=S`` the
first ``S`` tokens and with ``residual_length=R`` the newest ``R`` tokens stay
uncompressed; a token is compressed when it leaves the window.  Fused attention
combines exact and compressed tokens in one softmax.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

from .. import _backend
from .._validate import check_int
from ..ops.attention import fused_attention_rows
from ..ops.blockquant import NORM_MODES, dequantize_into, packed_dim, quantize_into
from ..ops.codebook import get_codebook
from ..ops.hadamard import rotate32
from ..ops.memory import copy_tokens
from ._layer import BufferSpec, LayeredCache, LayerState
from .protocol import AttendConfig, DecodeOutput, Fused

MODES = ("pq", "pqo")
DECODE_OUTPUTS = ("fused", "dequantized")
WINDOW_DTYPES = ("float16", "float32")
KEY_SCALES = ("none", "channel")


def _assign(src: Any, s0: int, n: int, dst: Any, d0: int) -> None:
    """``dst[:, d0:d0+n] = src[:, s0:s0+n]`` (casting), on any device."""
    if n <= 0:
        return
    if _backend.xp_of(dst) is not None:
        dst[:, d0:d0 + n] = src[:, s0:s0 + n]
    else:
        copy_tokens(src, s0, n, dst, d0)


class PolarQuantCache(LayeredCache):
    """PolarQuant (PQ / PQO) compressed KV cache, 2–4 bits, fused decode attention.

    Parameters
    ----------
    num_layers, num_kv_heads, head_dim : int
        Model geometry; ``head_dim`` a positive multiple of 32.
    bits : {2, 3, 4}
        User-facing bit setting (of both K and V unless ``k_bits``/``v_bits`` say otherwise).
    k_bits, v_bits : {2, 3, 4}, optional
        Separate settings for keys and values (keys are usually the sensitive side:
        ``k_bits=4, v_bits=3`` is 4.0 bits/value on average).
    mode : {"pqo", "pq"}
        ``"pqo"`` quantizes with ``bits``-wide codebooks, ``"pq"`` with ``bits − 1``.
    norm_mode : {"maxnorm", "l2"}
        Block normalization.
    residual_length : int
        Newest tokens kept uncompressed (default 32; 0 = none, the anchor's behaviour).
    sink_tokens : int
        First tokens kept uncompressed (default 4; 0 = none).

        The defaults come from measurements on SmolLM2-135M (512 tokens of GPL-3, 128
        prefilled, PQO3): mean KL to the dense next-token distribution 0.395 without a
        window, 0.360 with 4 sinks only, 0.082 / 0.049 / 0.035 / 0.021 with 4 sinks and a
        window of 16 / 32 / 64 / 128 tokens.  R=32, S=4 removes ~88 % of the KL for
        36 float16 tokens per head (+0.44 bits/value at 1K tokens, +0.03 at 16K);
        doubling R again halves the rest but costs twice the window bytes.
    window_dtype : {"float16", "float32"}
        Storage of window/sink tokens.  float16 (default) is exact for fp16 models and
        within 2^-11 relative otherwise, at half the bytes.  Numba device arrays always
        use float32.
    key_scale : {"none", "channel"}
        ``"channel"``: keys are divided by a per-channel RMS (per batch row and KV head)
        measured on the layer's first stored chunk and frozen afterwards; queries are
        multiplied by it (``q·k = (q⊙s)·(k/s)``), the history multiplied back.  It takes
        outlier channels (large RoPE'd key dimensions) out of the 32-blocks' shared scale;
        costs ``head_dim`` float32 per row and layer (counted by ``memory_usage``).
        NumPy/CuPy arrays only.  Measured on SmolLM2-135M it *hurts* (PQO3 + window: KL
        0.049 → 0.115): the block rotation already spreads outlier channels, and
        equalizing them moves error onto the channels the queries weight most.  Kept as
        an experiment knob; off by default.
    key_center : bool
        Subtract a per-channel key mean (per batch row and KV head, measured on the
        layer's first stored chunk, frozen) before quantizing and add it back in the
        history.  Exact for attention: ``q·m`` is the same for every token of a query, and
        softmax ignores it, so fused attention simply drops it.  Large RoPE'd key channels
        are mostly such an offset; removing it stops it from inflating every 32-block's
        scale.  Costs ``head_dim`` float32 per row and layer.  NumPy/CuPy arrays only.
    decode_output : {"fused", "dequantized"}
        ``decode`` returns :class:`~numba_kv.caches.protocol.Fused` attention computed
        from the packed codes (default) or the full dequantized history.

    Notes
    -----
    Storage per layer, on the device of the first input: ``k_codes``/``v_codes`` uint8
    ``[batch·num_kv_heads, capacity, head_dim·slot_bits/8]``, ``k_scales``/``v_scales``
    uint16 (binary16 bits) ``[batch·num_kv_heads, capacity, head_dim/32]``, and with a
    window ``k_exact``/``v_exact`` ``[batch·num_kv_heads, S + R, head_dim]``.

    Examples
    --------
    >>> import numpy as np
    >>> cache = PolarQuantCache(num_layers=2, num_kv_heads=4, head_dim=64, bits=3)
    >>> k = np.random.default_rng(0).standard_normal((1, 4, 10, 64)).astype(np.float32)
    >>> _ = cache.prefill(0, k, k)
    >>> cache.seq_len(0), cache.memory_usage()
    (10, 2240)
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, bits: int = 3,
                 mode: str = "pqo", norm_mode: str = "maxnorm", residual_length: int = 32, sink_tokens: int = 4,
                 window_dtype: str = "float16", decode_output: str = "fused", k_bits: Optional[int] = None,
                 v_bits: Optional[int] = None, key_scale: str = "none", key_center: bool = False) -> None:
        super().__init__(num_layers, num_kv_heads, head_dim)
        self.bits = check_int("bits", bits, allowed=(2, 3, 4))
        self.k_bits = self.bits if k_bits is None else check_int("k_bits", k_bits, allowed=(2, 3, 4))
        self.v_bits = self.bits if v_bits is None else check_int("v_bits", v_bits, allowed=(2, 3, 4))
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {list(MODES)}, got {mode!r}")
        if norm_mode not in NORM_MODES:
            raise ValueError(f"norm_mode: expected one of {list(NORM_MODES)}, got {norm_mode!r}")
        if decode_output not in DECODE_OUTPUTS:
            raise ValueError(f"decode_output: expected one of {list(DECODE_OUTPUTS)}, got {decode_output!r}")
        if str(window_dtype) not in WINDOW_DTYPES:
            raise ValueError(f"window_dtype: expected one of {list(WINDOW_DTYPES)}, got {window_dtype!r}")
        self.residual_length = check_int("residual_length", residual_length, minimum=0)
        self.sink_tokens = check_int("sink_tokens", sink_tokens, minimum=0)
        self.window_dtype = np.dtype(str(window_dtype))
        if key_scale not in KEY_SCALES:
            raise ValueError(f"key_scale: expected one of {list(KEY_SCALES)}, got {key_scale!r}")
        self.key_scale = key_scale
        if not isinstance(key_center, (bool, np.bool_)):
            raise TypeError(f"key_center: expected a bool, got {type(key_center).__name__} {key_center!r}")
        self.key_center = bool(key_center)
        self.mode = mode
        self.norm_mode = norm_mode
        self.decode_output = decode_output
        drop = 0 if mode == "pqo" else 1
        self.slot_bits = {"k": self.k_bits - drop, "v": self.v_bits - drop}
        self.codebooks = {n: get_codebook(b, norm_mode) for n, b in self.slot_bits.items()}
        self.outlier = mode == "pqo"
        self.packed_dims = {n: packed_dim(self.head_dim, b) for n, b in self.slot_bits.items()}
        self.num_blocks = self.head_dim // 32
        if self.k_bits == self.v_bits:
            self.name = f"{mode}{self.k_bits}"
        else:
            self.name = f"{mode}-k{self.k_bits}v{self.v_bits}"
        self.name += "" if norm_mode == "maxnorm" else "-l2"
        if self.residual_length or self.sink_tokens:
            self.name += f"-r{self.residual_length}-s{self.sink_tokens}"

    @property
    def windowed(self) -> bool:
        """True when some tokens stay uncompressed."""
        return bool(self.residual_length or self.sink_tokens)

    @property
    def packed_dim(self) -> int:
        """Packed bytes per key vector (values: ``packed_dims["v"]``)."""
        return self.packed_dims["k"]

    @property
    def codebook(self):
        """Codebook of the keys (values: ``codebooks["v"]``)."""
        return self.codebooks["k"]

    @property
    def bits_per_value(self) -> float:
        """Stored bits per compressed value, averaged over K and V (indices + one binary16
        scale per 32 values)."""
        total = sum(8.0 * p + 16.0 * self.num_blocks for p in self.packed_dims.values())
        return total / (2 * self.head_dim)

    # -- storage ----------------------------------------------------------------------------
    def _buffer_spec(self) -> BufferSpec:
        spec: BufferSpec = {
            "k_codes": (self.packed_dims["k"], np.uint8, None),
            "v_codes": (self.packed_dims["v"], np.uint8, None),
            "k_scales": (self.num_blocks, np.uint16, None),
            "v_scales": (self.num_blocks, np.uint16, None),
        }
        if self.windowed:
            cap = self.sink_tokens + self.residual_length
            spec["k_exact"] = (self.head_dim, self._exact_dtype, cap)
            spec["v_exact"] = (self.head_dim, self._exact_dtype, cap)
        if self.key_center:
            spec["k_chmean"] = (self.head_dim, np.float32, 1)
        if self.key_scale == "channel":
            spec["k_chscale"] = (self.head_dim, np.float32, 1)
        return spec

    def _growing_needed(self, st: LayerState, new_tokens: int) -> int:
        return st.meta.get("n_comp", 0) + new_tokens

    def _append(self, st: LayerState, dev: str, k: Any, v: Any) -> int:
        # Numba device arrays cannot hold float16 windows (no device-side cast)
        self._exact_dtype = (np.dtype(np.float32) if _backend.xp_of(k) is None else self.window_dtype)
        return super()._append(st, dev, k, v)

    def _store(self, st: LayerState, k: Any, v: Any) -> None:
        n = int(k.shape[2])
        n_comp = st.meta.get("n_comp", 0)
        n_sink = st.meta.get("n_sink", 0)
        n_win = st.meta.get("n_win", 0)
        S, R = self.sink_tokens, self.residual_length
        a = min(n, max(0, S - st.seq_len))  # new tokens that become sinks
        m = n - a
        e = max(0, n_win + m - R)  # tokens that leave (or skip) the window: compressed
        e_old = min(e, n_win)
        e_new = e - e_old
        keep_old, keep_new = n_win - e_old, m - e_new
        for name, arr in (("k", k), ("v", v)):
            x = _backend.ascontiguous_f32(name, arr)
            x3 = x.reshape(x.shape[0] * x.shape[1], x.shape[2], x.shape[3])
            if name == "k" and (self.key_scale == "channel" or self.key_center):
                x3 = self._scale_keys(st, x3)
            codes, scales = st.buffers[name + "_codes"], st.buffers[name + "_scales"]
            if not self.windowed:
                quantize_into(x3, codes, scales, n_comp, self.codebooks[name], self.outlier)
                continue
            ex = st.buffers[name + "_exact"]
            _assign(x3, 0, a, ex, st.seq_len)
            if e:
                ev = _backend.empty(x3, (x3.shape[0], e, self.head_dim), np.float32)
                _assign(ex, S, e_old, ev, 0)
                _assign(x3, a, e_new, ev, e_old)
                quantize_into(ev, codes, scales, n_comp, self.codebooks[name], self.outlier)
            if e_old and keep_old:  # slide the surviving window tokens to the front
                tmp = _backend.empty(ex, (ex.shape[0], keep_old, self.head_dim), ex.dtype)
                _assign(ex, S + e_old, keep_old, tmp, 0)
                _assign(tmp, 0, keep_old, ex, S)
            _assign(x3, a + e_new, keep_new, ex, S + keep_old)
        if not self.windowed:
            e = n
        st.meta.update(n_comp=n_comp + e, n_sink=n_sink + a, n_win=keep_old + keep_new if self.windowed else 0)
        st.live = {"k_codes": n_comp + e, "v_codes": n_comp + e, "k_scales": n_comp + e, "v_scales": n_comp + e}
        if self.windowed:
            st.live["k_exact"] = st.live["v_exact"] = st.meta["n_sink"] + st.meta["n_win"]
        if self.key_scale == "channel":
            st.live["k_chscale"] = 1
        if self.key_center:
            st.live["k_chmean"] = 1

    def _scale_keys(self, st: LayerState, x3: Any) -> Any:
        """``(x3 − m) / s`` with the frozen per-channel key mean ``m`` and scale ``s`` (each
        only if enabled; both set on the layer's first chunk)."""
        xp = _backend.xp_of(x3)
        if xp is None:
            raise TypeError("k: key_scale='channel' and key_center need NumPy or CuPy arrays, got a Numba "
                            "device array")
        if self.key_center:
            mbuf = st.buffers["k_chmean"]
            if not st.meta.get("kmean_set", 0):
                mbuf[:, 0, :] = x3.astype(xp.float64).mean(axis=1).astype(xp.float32)
                st.meta["kmean_set"] = 1
            x3 = x3 - mbuf
        if self.key_scale != "channel":
            return xp.ascontiguousarray(x3, dtype=xp.float32)
        sbuf = st.buffers["k_chscale"]
        if not st.meta.get("kscale_set", 0):
            rms = xp.sqrt((x3.astype(xp.float64) ** 2).mean(axis=1))  # [rows, d]
            floor = xp.maximum(rms.max(axis=1, keepdims=True) * 1e-3, 1e-12)
            sbuf[:, 0, :] = xp.maximum(rms, floor).astype(xp.float32)
            st.meta["kscale_set"] = 1
        return xp.ascontiguousarray(x3 / sbuf, dtype=xp.float32)

    # -- reading ----------------------------------------------------------------------------
    def _exact_f32(self, st: LayerState, name: str) -> Tuple[Any, int]:
        """Window/sink tokens as float32 ``[rows, >= n_exact, d]`` and their count."""
        n_exact = st.meta.get("n_sink", 0) + st.meta.get("n_win", 0)
        if not self.windowed:
            like = st.buffers["k_codes"]
            return _backend.empty(like, (like.shape[0], 0, self.head_dim), np.float32), 0
        ex = st.buffers[name + "_exact"]
        xp = _backend.xp_of(ex)
        if xp is not None:
            return xp.ascontiguousarray(ex[:, :n_exact], dtype=xp.float32), n_exact
        return ex, n_exact

    def _exact_positions(self, st: LayerState, like: Any) -> Any:
        n_sink, n_win, n_comp = st.meta.get("n_sink", 0), st.meta.get("n_win", 0), st.meta.get("n_comp", 0)
        pos = np.concatenate([np.arange(n_sink), self.sink_tokens + n_comp + np.arange(n_win)]).astype(np.int32)
        if isinstance(like, np.ndarray):
            return pos
        xp = _backend.xp_of(like)
        if xp is not None:
            return xp.asarray(pos)
        from numba import cuda  # noqa: PLC0415

        return cuda.to_device(pos if pos.size else np.zeros(1, np.int32))

    def _history(self, st: LayerState, dtype: Any) -> Tuple[Any, Any]:
        out = []
        like = st.buffers["k_codes"]
        rows = like.shape[0]
        n_comp, n_sink, n_win = st.meta.get("n_comp", 0), st.meta.get("n_sink", 0), st.meta.get("n_win", 0)
        for name in ("k", "v"):
            comp = _backend.empty(like, (rows, n_comp, self.head_dim), np.float32)
            dequantize_into(st.buffers[name + "_codes"], st.buffers[name + "_scales"], 0, self.codebooks[name], comp)
            if self.windowed:
                flat = _backend.empty(like, (rows, st.seq_len, self.head_dim), np.float32)
                ex, _ = self._exact_f32(st, name)
                _assign(ex, 0, n_sink, flat, 0)
                _assign(comp, 0, n_comp, flat, n_sink)
                _assign(ex, n_sink, n_win, flat, n_sink + n_comp)
            else:
                flat = comp
            if name == "k" and self.key_scale == "channel":
                flat = flat * st.buffers["k_chscale"]  # [rows, 1, d] broadcasts over tokens
            if name == "k" and self.key_center:
                flat = flat + st.buffers["k_chmean"]
            out.append(self._reshape_out(flat, st.batch, dtype))
        return out[0], out[1]

    def _decode_output(self, st: LayerState, q: Any, config: AttendConfig, dtype: Any) -> DecodeOutput:
        if self.decode_output == "dequantized":
            return super()._decode_output(st, q, config, dtype)
        b, hq, ql, d = (int(s) for s in q.shape)
        q3 = _backend.ascontiguous_f32("q", q).reshape(b * self.num_kv_heads, (hq // self.num_kv_heads) * ql, d)
        if self.key_scale == "channel":
            q3 = q3 * st.buffers["k_chscale"]  # (q⊙s)·(k/s) = q·k
        qr = rotate32(q3)
        ke, n_exact = self._exact_f32(st, "k")
        ve, _ = self._exact_f32(st, "v")
        kcent = _backend.constant(q3, self.codebooks["k"].centroids)
        vcent = _backend.constant(q3, self.codebooks["v"].centroids)
        out = fused_attention_rows(
            qr, q3, st.buffers["k_codes"], st.buffers["k_scales"], st.buffers["v_codes"], st.buffers["v_scales"],
            st.meta.get("n_comp", 0), self.sink_tokens, ke, ve, n_exact, self._exact_positions(st, q3), kcent, vcent,
            self.slot_bits["k"], self.slot_bits["v"], config.softmax_scale, None, st.seq_len - ql, ql, True)
        return Fused(self._reshape_q(out, b, hq, ql, dtype))

    def _reshape_q(self, out: Any, b: int, hq: int, ql: int, dtype: Any) -> Any:
        res = out.reshape(b, hq, ql, self.head_dim)
        if np.dtype(dtype) != np.dtype(res.dtype):
            res = res.astype(dtype)
        return res
