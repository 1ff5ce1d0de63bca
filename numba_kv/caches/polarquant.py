"""``PolarQuantCache``: the turboquant-rs PQ / PQO block-quantized KV cache.

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
"""

from __future__ import annotations

from typing import Any, Tuple

import numpy as np

from .. import _backend
from .._validate import check_int
from ..ops.blockquant import NORM_MODES, dequantize_into, packed_dim, quantize_into
from ..ops.codebook import get_codebook
from ._layer import BufferSpec, LayeredCache, LayerState

MODES = ("pq", "pqo")


class PolarQuantCache(LayeredCache):
    """PolarQuant (PQ / PQO) compressed KV cache, 2–4 bits.

    Parameters
    ----------
    num_layers, num_kv_heads, head_dim : int
        Model geometry; ``head_dim`` a positive multiple of 32.
    bits : {2, 3, 4}
        User-facing bit setting.
    mode : {"pqo", "pq"}
        ``"pqo"`` quantizes with ``bits``-wide codebooks, ``"pq"`` with ``bits − 1``.
    norm_mode : {"maxnorm", "l2"}
        Block normalization.

    Notes
    -----
    Storage per layer, on the device of the first input: ``k_codes``/``v_codes`` uint8
    ``[batch·num_kv_heads, capacity, head_dim·slot_bits/8]`` and ``k_scales``/``v_scales``
    uint16 (binary16 bits) ``[batch·num_kv_heads, capacity, head_dim/32]``.
    ``decode`` returns :class:`~numba_kv.caches.protocol.Dequantized` (full history).

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
                 mode: str = "pqo", norm_mode: str = "maxnorm") -> None:
        super().__init__(num_layers, num_kv_heads, head_dim)
        self.bits = check_int("bits", bits, allowed=(2, 3, 4))
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {list(MODES)}, got {mode!r}")
        if norm_mode not in NORM_MODES:
            raise ValueError(f"norm_mode: expected one of {list(NORM_MODES)}, got {norm_mode!r}")
        self.mode = mode
        self.norm_mode = norm_mode
        self.slot_bits = self.bits if mode == "pqo" else self.bits - 1
        self.codebook = get_codebook(self.slot_bits, norm_mode)
        self.outlier = mode == "pqo"
        self.packed_dim = packed_dim(self.head_dim, self.slot_bits)
        self.num_blocks = self.head_dim // 32
        self.name = f"{mode}{self.bits}" + ("" if norm_mode == "maxnorm" else "-l2")

    @property
    def bits_per_value(self) -> float:
        """Stored bits per K or V value (indices + one binary16 scale per 32 values)."""
        return (8.0 * self.packed_dim + 16.0 * self.num_blocks) / self.head_dim

    def _buffer_spec(self) -> BufferSpec:
        return {
            "k_codes": (self.packed_dim, np.uint8),
            "v_codes": (self.packed_dim, np.uint8),
            "k_scales": (self.num_blocks, np.uint16),
            "v_scales": (self.num_blocks, np.uint16),
        }

    def _store(self, st: LayerState, k: Any, v: Any) -> None:
        t0 = st.seq_len
        for name, a in (("k", k), ("v", v)):
            x = _backend.ascontiguous_f32(name, a)
            x3 = x.reshape(x.shape[0] * x.shape[1], x.shape[2], x.shape[3])
            quantize_into(x3, st.buffers[name + "_codes"], st.buffers[name + "_scales"], t0,
                          self.codebook, self.outlier)

    def _history(self, st: LayerState, dtype: Any) -> Tuple[Any, Any]:
        out = []
        any_buf = st.buffers["k_codes"]
        rows = any_buf.shape[0]
        for name in ("k", "v"):
            flat = _backend.empty(any_buf, (rows, st.seq_len, self.head_dim), np.float32)
            dequantize_into(st.buffers[name + "_codes"], st.buffers[name + "_scales"], 0, self.codebook, flat)
            out.append(self._reshape_out(flat, st.batch, dtype))
        return out[0], out[1]
