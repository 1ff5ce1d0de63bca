"""Caches that probe the protocol path of the analysis (:mod:`.analysis`): a cache that
quantizes only the keys or only the values (:class:`KVSplitCache`), and a dense cache that
records every layer's ``q`` / ``k`` / ``v`` (:class:`RecordingCache`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from numba_kv.backend import to_host
from numba_kv.caches.protocol import AttendConfig, DecodeOutput, Dequantized, DequantResult

__all__ = ["KVSplitCache", "RecordingCache"]


def _side_bytes(cache: Any, side: str) -> int:
    """Live bytes of the buffers of one side (``"k"`` or ``"v"``) of a layered cache.

    Buffers are named ``k``/``v`` (dense) or ``k_codes``, ``k_scales``, ``k_exact``, ...
    (PolarQuant).  Caches without that layout count half of ``memory_usage()``.
    """
    layers = getattr(cache, "_layers", None)
    if layers is None:
        return int(cache.memory_usage()) // 2
    total = 0
    for st in layers:
        with st.lock:
            for name, buf in st.buffers.items():
                if name == side or name.startswith(side + "_"):
                    total += (int(buf.shape[0]) * st.live_count(name) * int(buf.shape[2])
                              * np.dtype(buf.dtype).itemsize)
    return total


class KVSplitCache:
    """Quantize only the keys or only the values: keys from one cache, values from another.

    Both wrapped caches store every token; ``prefill`` / ``decode`` return the keys of
    the ``quantize`` side's cache and the other tensor from the exact cache.  Used to
    measure the sensitivity of a model to key vs value quantization through the real
    protocol path (:func:`numba_kv.toolkit.models.sequence_logits`).

    Parameters
    ----------
    quantized : CompressedKVCache
        Cache whose ``decode`` returns :class:`~numba_kv.caches.protocol.Dequantized`
        (e.g. ``PolarQuantCache(..., decode_output="dequantized")``).
    exact : CompressedKVCache
        Cache for the other tensor, typically a :class:`~numba_kv.caches.dense.DenseCache`;
        its ``decode`` must also return ``Dequantized``.
    quantize : {"k", "v"}
        Which tensor comes from ``quantized``.

    Attributes
    ----------
    name : str
        ``"<quantized.name>:k-only"`` or ``":v-only"``.
    num_layers, num_kv_heads, head_dim : int
        Geometry (equal for both caches).

    Raises
    ------
    ValueError
        Bad ``quantize``, geometries differ, or ``quantized`` is set to fused decode
        output (``decode_output="fused"``).

    Notes
    -----
    * The protocol's first-prefill rule holds: an empty layer returns the original
      ``k``/``v``.
    * A ``logit_bias`` of the cache that provides the keys is passed on (it acts on the
      scores); one from the other cache raises ``ValueError``.
    * :meth:`memory_usage` counts what this split actually stores: the quantized side's
      buffers of ``quantized`` plus the other side's buffers of ``exact``.
    * Both caches validate arguments the same way before storing, so a bad call raises
      from the first one and leaves both unchanged.

    Examples
    --------
    >>> import numpy as np
    >>> from numba_kv import DenseCache, PolarQuantCache
    >>> pq = PolarQuantCache(1, 2, 32, bits=3, residual_length=0, sink_tokens=0, decode_output="dequantized")
    >>> cache = KVSplitCache(pq, DenseCache(1, 2, 32), quantize="k")
    >>> k = np.random.default_rng(0).standard_normal((1, 2, 5, 32)).astype(np.float32)
    >>> _ = cache.prefill(0, k, k)
    >>> cache.seq_len(0), cache.memory_usage()        # K: 5 tokens x 2 heads x (12 + 2) B; V: float32
    (5, 1420)
    """

    def __init__(self, quantized: Any, exact: Any, quantize: str = "k") -> None:
        if quantize not in ("k", "v"):
            raise ValueError(f"quantize: expected 'k' or 'v', got {quantize!r}")
        geo_q = tuple(getattr(quantized, a, None) for a in ("num_layers", "num_kv_heads", "head_dim"))
        geo_e = tuple(getattr(exact, a, None) for a in ("num_layers", "num_kv_heads", "head_dim"))
        if geo_q != geo_e:
            raise ValueError(f"exact: geometry (num_layers, num_kv_heads, head_dim) {geo_e} differs from "
                             f"quantized {geo_q}")
        if getattr(quantized, "decode_output", "dequantized") != "dequantized":
            raise ValueError("quantized: expected a cache whose decode returns Dequantized "
                             f"(decode_output='dequantized'), got decode_output={quantized.decode_output!r}")
        self.quantized, self.exact, self.quantize = quantized, exact, quantize
        self.num_layers, self.num_kv_heads, self.head_dim = geo_q
        self.name = f"{getattr(quantized, 'name', type(quantized).__name__)}:{quantize}-only"

    def _combine(self, rq: DequantResult, re: DequantResult) -> DequantResult:
        if self.quantize == "k":
            k, v, bias, other = rq.k, re.v, rq.logit_bias, re.logit_bias
        else:
            k, v, bias, other = re.k, rq.v, re.logit_bias, rq.logit_bias
        if other is not None:
            raise ValueError("logit_bias: the cache that provides the values returned a logit bias; "
                             "KVSplitCache cannot apply it to other keys")
        return DequantResult(k, v, bias)

    def prefill(self, layer: int, k: Any, v: Any, q: Any = None) -> DequantResult:
        """Store the tokens in both caches; return K/V (originals if the layer was empty)."""
        empty = self.exact.seq_len(layer) == 0
        rq = self.quantized.prefill(layer, k, v, q)
        re = self.exact.prefill(layer, k, v, q)
        if empty:
            return DequantResult(k, v)
        return self._combine(rq, re)

    def decode(self, layer: int, k: Any, v: Any, q: Any, config: AttendConfig) -> DecodeOutput:
        """Store the new token(s) in both caches; return ``Dequantized`` with the split history."""
        rq = self.quantized.decode(layer, k, v, q, config)
        re = self.exact.decode(layer, k, v, q, config)
        for nm, r in (("quantized", rq), ("exact", re)):
            if not isinstance(r, Dequantized):
                raise TypeError(f"{nm}: decode returned {type(r).__name__}, expected Dequantized")
        return Dequantized(self._combine(rq.result, re.result))

    def seq_len(self, layer: int) -> int:
        """Tokens stored for ``layer``."""
        return int(self.exact.seq_len(layer))

    def reset(self) -> None:
        """Drop everything in both caches."""
        self.quantized.reset()
        self.exact.reset()

    def memory_usage(self) -> int:
        """Bytes of the quantized side in ``quantized`` plus the other side in ``exact``."""
        other = "v" if self.quantize == "k" else "k"
        return _side_bytes(self.quantized, self.quantize) + _side_bytes(self.exact, other)

    def side_bytes(self) -> tuple[int, int]:
        """``(key bytes, value bytes)`` actually stored by this split."""
        other = "v" if self.quantize == "k" else "k"
        q, o = _side_bytes(self.quantized, self.quantize), _side_bytes(self.exact, other)
        return (q, o) if self.quantize == "k" else (o, q)


class RecordingCache:
    """Pass-through wrapper that records the queries, keys and values of every layer.

    Parameters
    ----------
    inner : CompressedKVCache
        The cache doing the work (typically a :class:`~numba_kv.caches.dense.DenseCache`).

    Notes
    -----
    Copies of ``q``/``k``/``v`` of every call are kept on the host (queries only when
    given to ``prefill``).  :meth:`recorded` concatenates them along the sequence axis;
    ``reset`` clears them.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.num_layers = inner.num_layers
        self.num_kv_heads = inner.num_kv_heads
        self.head_dim = inner.head_dim
        self.name = f"{getattr(inner, 'name', type(inner).__name__)}+recording"
        self._rec: list[dict[str, list[np.ndarray]]] = [{"q": [], "k": [], "v": []}
                                                        for _ in range(self.num_layers)]

    def _keep(self, layer: int, q: Any, k: Any, v: Any) -> None:
        rec = self._rec[layer]
        for nm, a in (("q", q), ("k", k), ("v", v)):
            if a is not None:
                rec[nm].append(np.array(to_host(a), dtype=np.float32, copy=True))

    def prefill(self, layer: int, k: Any, v: Any, q: Any = None) -> DequantResult:
        """Forward to ``inner.prefill`` and record the arguments."""
        res = self.inner.prefill(layer, k, v, q)
        self._keep(layer, q, k, v)
        return res

    def decode(self, layer: int, k: Any, v: Any, q: Any, config: AttendConfig) -> DecodeOutput:
        """Forward to ``inner.decode`` and record the arguments."""
        res = self.inner.decode(layer, k, v, q, config)
        self._keep(layer, q, k, v)
        return res

    def seq_len(self, layer: int) -> int:
        """Tokens stored for ``layer``."""
        return int(self.inner.seq_len(layer))

    def reset(self) -> None:
        """Reset the inner cache and forget the recordings."""
        self.inner.reset()
        self._rec = [{"q": [], "k": [], "v": []} for _ in range(self.num_layers)]

    def memory_usage(self) -> int:
        """``inner.memory_usage()`` (recordings are not counted)."""
        return int(self.inner.memory_usage())

    def recorded(self, layer: int) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
        """``(q, k, v)`` of ``layer``, float32 ``[batch, heads, seq, head_dim]``.

        ``q`` is ``None`` when no call passed queries; it covers every position only if
        every ``prefill`` call passed ``q`` (as :class:`~numba_kv.toolkit.models.LlamaModel` does).
        """
        rec = self._rec[layer]
        if not rec["k"]:
            raise ValueError(f"layer: nothing recorded for layer {layer}")
        q = np.concatenate(rec["q"], axis=2) if rec["q"] else None
        return q, np.concatenate(rec["k"], axis=2), np.concatenate(rec["v"], axis=2)
