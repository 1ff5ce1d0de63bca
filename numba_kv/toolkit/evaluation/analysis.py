"""Where does PolarQuant's quality loss come from?  K vs V, per layer, per head (issue #6).

:func:`analyze_kv` runs a Llama GGUF model (SmolLM2-135M by default) over the same text
as ``numba-kv eval`` (:data:`numba_kv.toolkit.evaluation.evaluate.DEFAULT_TEXT`) and measures:

1. **K vs V sensitivity** — perplexity change, top-1 agreement and ``KL(dense ‖ cache)``
   of the decode part (the definitions of :mod:`numba_kv.toolkit.evaluation.evaluate`) when *only the keys*
   or *only the values* are block-quantized, at every bit width, without and with the
   full-precision window.  These rows run through the real protocol path
   (:func:`numba_kv.toolkit.models.sequence_logits` driving a :class:`KVSplitCache`, which
   takes dequantized keys from a :class:`~numba_kv.caches.polarquant.PolarQuantCache`
   and exact values from a :class:`~numba_kv.caches.dense.DenseCache`, or the other
   way round).  Asymmetric ``pqo-k4v3`` / ``pqo-k3v4`` and symmetric ``pqo3`` /
   ``pqo4`` rows (both sides quantized) are added with the one-pass engine.
2. **Per layer and KV head** — from the dense K, V and the queries recorded during the
   reference run (:class:`RecordingCache`): NMSE of K and V under block quantization,
   the per-channel RMS profile of the keys (how strong the outlier channels are, and
   which), and the attention error: ``KL(softmax(s) ‖ softmax(ŝ))`` with
   ``s = scale·q·Kᵀ`` and ``ŝ`` from the quantized keys, the standard deviation of the
   logit error ``ŝ − s``, and the relative error of the attention output caused by
   quantized keys (``‖(P̂ − P)V‖ / ‖PV‖``) and by quantized values
   (``‖P(V̂ − V)‖ / ‖PV‖``).
3. **Per-layer sensitivity** — keys (and values) of one layer quantized at a time, the
   others exact, no window: the change of perplexity / KL tells which layers matter.

Engines
-------
``"protocol"`` rows are teacher-forced decode steps through the cache protocol (one
model pass per token; 65–80 ms/token for SmolLM2-135M on one core).  The per-layer
sensitivity needs 30+ runs, so it uses :func:`simulate_logits`, a re-formulation of the
same computation as *one* causal pass over all tokens (~2–4 s at N=512): because the
block quantizer works vector by vector and teacher forcing fixes the tokens, what a
decode step at position ``i`` sees is known in advance — token ``j`` is exact (prompt
pass, sink or window) or its quantized reconstruction, decided per ``(i, j)`` by a mask.

Only the float summation order differs.  With one layer quantized the two engines agree
to ~1e-11 in KL.  With every layer's keys quantized, those rounding differences flip a
few quantization buckets (a key lying on a boundary) and SmolLM2's sensitive heads
amplify the flips: the two runs then differ per position by about a tenth of their
distance to dense, while the aggregate numbers agree (``engine_check``: N=512,
K-only PQO3 KL vs dense 0.340 protocol / 0.345 one-pass; at N=1024 the one-pass
``pqo3-r32-s4`` / ``pqo4-r32-s4`` reproduce the README's ``numba-kv eval`` table
within its noise).

JSON schema (``numba_kv.analysis/1``): see :func:`analyze_kv`.

Command line::

    numba-kv analyze --tokens 512 --json out.json
"""

from __future__ import annotations

import hashlib
import math
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from numba_kv.caches.protocol import AttendConfig, DecodeOutput, Dequantized, DequantResult
from numba_kv.metrics import LogitScorer, compare_logits, kl_rows, log_softmax, nmse

__all__ = [
    "SCHEMA",
    "KVSplitCache",
    "RecordingCache",
    "analyze_kv",
    "main",
    "polarquant_bits_per_value",
    "render_tables",
    "simulate_logits",
]

#: Version tag of the dictionary returned by :func:`analyze_kv` (and of its JSON file).
SCHEMA = "numba_kv.analysis/1"

QuantSpec = Union[None, int, Callable[[np.ndarray], np.ndarray]]


# --------------------------------------------------------------------------------------
# caches
# --------------------------------------------------------------------------------------
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

    def side_bytes(self) -> Tuple[int, int]:
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
        self._rec: List[Dict[str, List[np.ndarray]]] = [{"q": [], "k": [], "v": []}
                                                        for _ in range(self.num_layers)]

    def _keep(self, layer: int, q: Any, k: Any, v: Any) -> None:
        from numba_kv._backend import to_host  # noqa: PLC0415

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

    def recorded(self, layer: int) -> Tuple[Optional[np.ndarray], np.ndarray, np.ndarray]:
        """``(q, k, v)`` of ``layer``, float32 ``[batch, heads, seq, head_dim]``.

        ``q`` is ``None`` when no call passed queries; it covers every position only if
        every ``prefill`` call passed ``q`` (as :class:`~numba_kv.toolkit.models.LlamaModel` does).
        """
        rec = self._rec[layer]
        if not rec["k"]:
            raise ValueError(f"layer: nothing recorded for layer {layer}")
        q = np.concatenate(rec["q"], axis=2) if rec["q"] else None
        return q, np.concatenate(rec["k"], axis=2), np.concatenate(rec["v"], axis=2)


# --------------------------------------------------------------------------------------
# quantization helpers
# --------------------------------------------------------------------------------------
def _roundtrip(x: np.ndarray, bits: int, norm_mode: str = "maxnorm") -> np.ndarray:
    """``dequantize_blocks(quantize_blocks(x))`` (PQO: ``bits``-wide codebook), float32."""
    from numba_kv.ops.blockquant import dequantize_blocks, quantize_blocks  # noqa: PLC0415

    codes, scales = quantize_blocks(np.ascontiguousarray(x, dtype=np.float32), bits, norm_mode)
    return np.asarray(dequantize_blocks(codes, scales, bits, norm_mode), dtype=np.float32)


def _apply_quant(spec: QuantSpec, x: np.ndarray, norm_mode: str) -> Optional[np.ndarray]:
    if spec is None:
        return None
    if callable(spec):
        out = np.asarray(spec(x), dtype=np.float32)
        if out.shape != x.shape:
            raise ValueError(f"quantizer: returned shape {out.shape}, expected {x.shape}")
        return out
    return _roundtrip(x, int(spec), norm_mode)


def polarquant_bits_per_value(tokens: int, head_dim: int, k_bits: Optional[int], v_bits: Optional[int],
                              residual_length: int = 0, sink_tokens: int = 0, window_itemsize: int = 2,
                              exact_itemsize: int = 4) -> Dict[str, float]:
    """Stored bits per value of a PQO cache at ``tokens`` tokens (window at its real size).

    Parameters
    ----------
    tokens, head_dim : int
    k_bits, v_bits : int or None
        PQO bits of each side; ``None`` = that side stored exactly (``exact_itemsize``).
    residual_length, sink_tokens : int
        Window (stored with ``window_itemsize`` bytes per value).
    window_itemsize, exact_itemsize : int
        Bytes per value of window tokens (2: float16) and of an unquantized side.

    Returns
    -------
    dict
        ``k``, ``v`` (bits/value of each side) and ``mean`` (their average).
    """
    n_exact = min(tokens, sink_tokens + residual_length)
    n_comp = tokens - n_exact
    out: Dict[str, float] = {}
    for side, b in (("k", k_bits), ("v", v_bits)):
        if b is None:
            out[side] = 8.0 * exact_itemsize
        else:
            per_tok = head_dim * b / 8 + 2 * head_dim / 32
            out[side] = 8.0 * (n_comp * per_tok + n_exact * window_itemsize * head_dim) / (tokens * head_dim)
    out["mean"] = 0.5 * (out["k"] + out["v"])
    return out


# --------------------------------------------------------------------------------------
# the one-pass ("masked") engine
# --------------------------------------------------------------------------------------
def _per_layer(spec: Any, n_layers: int, arg: str) -> List[QuantSpec]:
    if spec is None or callable(spec) or isinstance(spec, (int, np.integer)):
        if isinstance(spec, bool):
            raise TypeError(f"{arg}: expected None, an int, a callable or a per-layer sequence, got {spec!r}")
        return [spec] * n_layers
    out = list(spec)
    if len(out) != n_layers:
        raise ValueError(f"{arg}: expected {n_layers} per-layer entries, got {len(out)}")
    return out


def _masks(n: int, n_prefill: int, chunk_size: Optional[int], residual_length: int,
           sink_tokens: int) -> Dict[str, np.ndarray]:
    """Which key ``j`` a query ``i`` sees exactly, quantized or from the window.

    ``first``: rows of the first prefill chunk (the cache returns the originals);
    ``quant``: ``(i, j)`` pairs read from quantized storage; ``win``: pairs read from
    the float16 window/sinks of a later call; ``causal``: ``j <= i``.
    """
    cs = n_prefill if chunk_size is None else int(chunk_size)
    first = np.zeros(n, dtype=bool)
    n_stored = np.empty(n, dtype=np.int64)
    for a in range(0, n_prefill, cs):
        b = min(a + cs, n_prefill)
        n_stored[a:b] = b
        first[a:b] = a == 0
    n_stored[n_prefill:] = np.arange(n_prefill, n) + 1
    j = np.arange(n)[None, :]
    causal = j <= np.arange(n)[:, None]
    later = causal & ~first[:, None]
    if residual_length or sink_tokens:
        exact = (j < sink_tokens) | (j >= np.maximum(sink_tokens, n_stored[:, None] - residual_length))
    else:
        exact = np.zeros((n, n), dtype=bool)
    return {"first": first, "causal": causal, "quant": later & ~exact, "win": later & exact,
            "orig": causal & first[:, None]}


def _via_window(n: int, n_prefill: int, chunk_size: Optional[int], residual_length: int,
                sink_tokens: int) -> np.ndarray:
    """Tokens that are compressed only after passing through the window (so from their
    window-dtype copy), replaying the bookkeeping of ``PolarQuantCache._store`` over the
    prefill chunks and the one-token decode steps."""
    via = np.zeros(n, dtype=bool)
    if not (residual_length or sink_tokens):
        return via
    cs = n_prefill if chunk_size is None else int(chunk_size)
    stores = ([(a, min(a + cs, n_prefill)) for a in range(0, n_prefill, cs)]
              + [(i, i + 1) for i in range(n_prefill, n)])
    n_win = 0
    for a, b in stores:
        cnt = b - a
        new_sinks = min(cnt, max(0, sink_tokens - a))
        m = cnt - new_sinks
        e = max(0, n_win + m - residual_length)
        e_new = e - min(e, n_win)
        via[a + new_sinks + e_new:b] = True      # these enter the window (sinks are never compressed)
        n_win = n_win - min(e, n_win) + (m - e_new)
    return via


def _masked_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, k_hat: Optional[np.ndarray],
                      v_hat: Optional[np.ndarray], m: Dict[str, np.ndarray], scale: float, groups: int,
                      fp16_window: bool) -> np.ndarray:
    """Attention ``[heads, n, d]`` where pair ``(i, j)`` uses K/V as the cache would return them."""
    h, n, d = q.shape
    kvh = k.shape[0]
    out = np.empty((h, n, d), dtype=np.float32)
    quant, win, orig, causal = m["quant"], m["win"], m["orig"], m["causal"]
    any_win = bool(win.any())
    for g in range(kvh):
        qg = np.ascontiguousarray(q[g * groups:(g + 1) * groups]).reshape(groups * n, d)
        s = (qg @ k[g].T).reshape(groups, n, n)
        if k_hat is not None:
            kw = k[g].astype(np.float16).astype(np.float32) if fp16_window else k[g]
            sq = (qg @ k_hat[g].T).reshape(groups, n, n)
            sw = (qg @ kw.T).reshape(groups, n, n) if (any_win and fp16_window) else s
            s = np.where(quant, sq, np.where(win, sw, s))
        s *= np.float32(scale)
        s[:, ~causal] = -np.inf
        s -= s.max(axis=-1, keepdims=True)
        np.exp(s, out=s)
        s /= s.sum(axis=-1, keepdims=True)
        if v_hat is None:
            o = s @ v[g]
        else:
            vw = v[g].astype(np.float16).astype(np.float32) if fp16_window else v[g]
            o = (s * quant) @ v_hat[g] + (s * orig) @ v[g]
            if any_win:
                o += (s * win) @ vw
        out[g * groups:(g + 1) * groups] = o
    return out


def simulate_logits(model: Any, tokens: Sequence[int], n_prefill: int, *, k_quant: Any = None,
                    v_quant: Any = None, residual_length: int = 0, sink_tokens: int = 0,
                    window_dtype: str = "float16", norm_mode: str = "maxnorm",
                    chunk_size: Optional[int] = 256, dense_states: Optional[List[np.ndarray]] = None,
                    return_states: bool = False) -> Any:
    """Logits of a teacher-forced decode through a PQO cache, computed in one causal pass.

    Equivalent to ``sequence_logits(model, tokens, cache, n_prefill,
    include_prefill=False)`` with a :class:`~numba_kv.caches.polarquant.PolarQuantCache`
    of the given bits and window (same model code, same quantizer; only the summation
    order differs): query ``i`` of the prompt's first chunk sees the original K/V; every
    later query sees, for key ``j``, the original when ``j`` is a sink or in the newest
    ``residual_length`` stored tokens (rounded to ``window_dtype``) and the quantized
    reconstruction otherwise (a token that passed through a float16 window is quantized
    from its float16 copy, as the cache does).

    Parameters
    ----------
    model : LlamaModel
    tokens : sequence of int, length ``N``
    n_prefill : int
        Prompt tokens ``P`` (``1 <= P <= N``).
    k_quant, v_quant : None, int, callable, or a sequence of those (one per layer)
        ``None``: exact; int: PQO bits (``quantize_blocks`` round trip); callable:
        ``f(x [1, kv_heads, N, head_dim]) -> x_hat`` (any per-token quantizer).
    residual_length, sink_tokens : int
        Window of the simulated cache.
    window_dtype : {"float16", "float32"}
    norm_mode : {"maxnorm", "l2"}
    chunk_size : int or None
        Prefill chunk of the simulated run (``sequence_logits``' default is 256).
    dense_states : list of ndarray, optional
        Hidden states at the entry of every layer and after the last one, from an
        unquantized run (``return_states=True``, all layers); the pass then starts at the
        first quantized layer.
    return_states : bool
        Also return the hidden states at the entry of every layer computed and after
        the last one.

    Returns
    -------
    logits : ndarray, shape ``(N - P + 1, vocab)``, float32
        Rows for positions ``P - 1 .. N - 1``, as ``sequence_logits(...,
        include_prefill=False)``.
    states : list of ndarray ``(N, dim)``
        Only with ``return_states=True`` (``n_layers + 1`` arrays when no
        ``dense_states`` were given).

    Notes
    -----
    The summation order differs from the protocol path, so a value lying within
    rounding of a codebook boundary can land in the other bucket; with many layers
    quantized such flips compound (see the module docstring).  Compare aggregate
    metrics, not single positions.
    """
    from ..models.llama import apply_rope, rms_norm, rope_tables  # noqa: PLC0415

    ids = model._check_tokens(tokens)
    n = ids.size
    if isinstance(n_prefill, bool) or int(n_prefill) != n_prefill or not 1 <= n_prefill <= n:
        raise ValueError(f"n_prefill: expected an int in [1, {n}], got {n_prefill!r}")
    if str(window_dtype) not in ("float16", "float32"):
        raise ValueError(f"window_dtype: expected 'float16' or 'float32', got {window_dtype!r}")
    c = model.config
    kq = _per_layer(k_quant, c.n_layers, "k_quant")
    vq = _per_layer(v_quant, c.n_layers, "v_quant")
    m = _masks(n, int(n_prefill), chunk_size, int(residual_length), int(sink_tokens))
    fp16 = str(window_dtype) == "float16" and bool(m["win"].any())
    # tokens compressed when they leave a float16 window are quantized from their float16 copy
    via = (_via_window(n, int(n_prefill), chunk_size, int(residual_length), int(sink_tokens))
           if str(window_dtype) == "float16" else np.zeros(n, dtype=bool))
    via4 = via[None, None, :, None] if via.any() else None

    def quant_input(x: np.ndarray) -> np.ndarray:
        return x if via4 is None else np.where(via4, x.astype(np.float16).astype(np.float32), x)

    hd, nh, nkv = c.head_dim, c.n_heads, c.n_kv_heads
    cos, sin = rope_tables(np.arange(n), c.rope_dim, c.rope_theta, model.freq_factors)
    start = 0
    if dense_states is not None:
        if len(dense_states) != c.n_layers + 1:
            raise ValueError(f"dense_states: expected {c.n_layers + 1} arrays (return_states=True), "
                             f"got {len(dense_states)}")
        touched = [i for i in range(c.n_layers) if kq[i] is not None or vq[i] is not None]
        start = touched[0] if touched else c.n_layers
        x = np.array(dense_states[start], dtype=np.float32)
    else:
        x = model.tok_embd[ids]
    states: List[np.ndarray] = []
    for li in range(start, c.n_layers):
        L = model.layers[li]
        if return_states:
            states.append(x.copy())
        h = rms_norm(x, L.attn_norm, c.rms_eps)
        q = apply_rope((h @ L.wq.T).reshape(n, nh, hd).transpose(1, 0, 2)[None], cos, sin)[0]
        k = apply_rope((h @ L.wk.T).reshape(n, nkv, hd).transpose(1, 0, 2)[None], cos, sin)
        v = np.ascontiguousarray((h @ L.wv.T).reshape(n, nkv, hd).transpose(1, 0, 2)[None])
        k_hat = None if kq[li] is None else _apply_quant(kq[li], quant_input(k), norm_mode)
        v_hat = None if vq[li] is None else _apply_quant(vq[li], quant_input(v), norm_mode)
        o = _masked_attention(q, k[0], v[0], None if k_hat is None else k_hat[0],
                              None if v_hat is None else v_hat[0], m, model.softmax_scale, c.n_kv_groups,
                              fp16)
        x += o.transpose(1, 0, 2).reshape(n, nh * hd) @ L.wo.T
        h = rms_norm(x, L.ffn_norm, c.rms_eps)
        g = h @ L.w_gate.T
        u = h @ L.w_up.T
        s = np.tanh(g * np.float32(0.5))
        s += 1.0
        s *= np.float32(0.5)
        g *= s
        g *= u
        x += g @ L.w_down.T
    logits = model._logits(x[int(n_prefill) - 1:], "all")
    if return_states:
        states.append(x.copy())
        return logits, states
    return logits


# --------------------------------------------------------------------------------------
# per-layer statistics
# --------------------------------------------------------------------------------------
def _attention_errors(q: np.ndarray, k: np.ndarray, v: np.ndarray, k_hat: np.ndarray, v_hat: np.ndarray,
                      quant: np.ndarray, causal: np.ndarray, scale: float,
                      groups: int) -> Dict[str, np.ndarray]:
    """Attention errors per query head for the decode rows.

    ``q`` ``[H, R, d]`` (the scored rows), ``k``/``v``/hats ``[KVH, T, d]``, masks
    ``[R, T]``.  Returns per query head: ``kl`` (mean over rows of
    ``KL(p ‖ p̂)``), ``logit_err_std`` (over quantized pairs), ``logit_std`` (over visible
    pairs), ``k_out_err`` (``‖(P̂ − P)V‖ / ‖PV‖``), ``v_out_err`` (``‖P(V̂ − V)‖ / ‖PV‖``),
    means over rows.
    """
    h = q.shape[0]
    res = {key: np.empty(h) for key in ("kl", "logit_err_std", "logit_std", "k_out_err", "v_out_err")}
    neg = ~causal
    for hh in range(h):
        g = hh // groups
        qh = q[hh].astype(np.float64)
        kk, kh = k[g].astype(np.float64), k_hat[g].astype(np.float64)
        s = scale * (qh @ kk.T)
        sh = np.where(quant, scale * (qh @ kh.T), s)
        err = (sh - s)[quant]
        res["logit_err_std"][hh] = float(err.std()) if err.size else 0.0
        res["logit_std"][hh] = float(s[causal].std())
        s[neg] = -np.inf
        sh[neg] = -np.inf
        lp, lph = log_softmax(s), log_softmax(sh)
        p, ph = np.exp(lp), np.exp(lph)
        res["kl"][hh] = float(np.maximum(kl_rows(lp, lph, causal), 0.0).mean())
        vv, vh = v[g].astype(np.float64), v_hat[g].astype(np.float64)
        o = p @ vv
        on = np.maximum(np.linalg.norm(o, axis=-1), 1e-30)
        res["k_out_err"][hh] = float((np.linalg.norm(ph @ vv - o, axis=-1) / on).mean())
        # values: the quantized pairs read v_hat, the others the exact value
        ov = (p * quant) @ vh + (p * ~quant) @ vv
        res["v_out_err"][hh] = float((np.linalg.norm(ov - o, axis=-1) / on).mean())
    return res


def _layer_stats(q: np.ndarray, k: np.ndarray, v: np.ndarray, n_prefill: int, bits: Sequence[int],
                 windows: Sequence[Tuple[int, int]], scale: float, groups: int,
                 top: int = 4) -> Dict[str, Any]:
    """Statistics of one layer from recorded ``q``/``k``/``v`` (``[1, heads, T, d]``)."""
    q, k, v = q[0], k[0], v[0]
    kvh, t, d = k.shape
    out: Dict[str, Any] = {}
    k_rms = np.sqrt(np.mean(k.astype(np.float64) ** 2, axis=1))  # [KVH, d]
    v_rms = np.sqrt(np.mean(v.astype(np.float64) ** 2, axis=1))
    med_k = np.maximum(np.median(k_rms, axis=1), 1e-30)
    med_v = np.maximum(np.median(v_rms, axis=1), 1e-30)
    out["k_channel_ratio"] = (k_rms.max(axis=1) / med_k).tolist()
    out["v_channel_ratio"] = (v_rms.max(axis=1) / med_v).tolist()
    top_k = [np.argsort(-k_rms[g])[:top] for g in range(kvh)]
    out["k_top_channels"] = [t.tolist() for t in top_k]
    out["k_top_channel_ratios"] = [(k_rms[g][top_k[g]] / med_k[g]).tolist() for g in range(kvh)]
    out["v_top_channels"] = [np.argsort(-v_rms[g])[:top].tolist() for g in range(kvh)]
    kn = np.linalg.norm(k.astype(np.float64), axis=-1)
    out["k_token_norm_ratio"] = (kn.max(axis=1) / np.maximum(np.median(kn, axis=1), 1e-30)).tolist()
    out["k_token_norm_argmax"] = kn.argmax(axis=1).tolist()
    rows = np.arange(n_prefill, t)
    qd = q[:, n_prefill:]
    for b in bits:
        kh = _roundtrip(k[None], b)[0]
        vh = _roundtrip(v[None], b)[0]
        key = f"pqo{b}"
        out.setdefault("k_nmse", {})[key] = nmse(k, kh, axis=-1).tolist()
        out.setdefault("v_nmse", {})[key] = nmse(v, vh, axis=-1).tolist()
        for (r, s) in windows:
            j = np.arange(t)[None, :]
            causal = j <= rows[:, None]
            if r or s:
                exact = (j < s) | (j >= np.maximum(s, rows[:, None] + 1 - r))
            else:
                exact = np.zeros_like(causal)
            quant = causal & ~exact
            errs = _attention_errors(qd, k, v, kh, vh, quant, causal, scale, groups)
            wkey = f"{key}-r{r}-s{s}"
            for name, val in errs.items():
                out.setdefault("attn", {}).setdefault(wkey, {})[name] = val.tolist()
    return out


# --------------------------------------------------------------------------------------
# the analysis
# --------------------------------------------------------------------------------------
def _bits_arg(bits: Any) -> Tuple[int, ...]:
    if isinstance(bits, (int, np.integer)) and not isinstance(bits, bool):
        bits = (int(bits),)
    out = tuple(int(b) for b in bits)
    if not out or any(b not in (2, 3, 4) for b in out):
        raise ValueError(f"bits: expected bit widths in {{2, 3, 4}}, got {bits!r}")
    return out


def analyze_kv(model: Any, tokenizer: Any, text_path: Optional[Union[str, Path]] = None, tokens: int = 512,
               prefill: int = 128, bits: Sequence[int] = (3, 4), residual_length: int = 32,
               sink_tokens: int = 4, progress: bool = True, *, layer_sensitivity: Sequence[str] = ("k",),
               chunk_size: Optional[int] = 256, threads: Optional[int] = None) -> Dict[str, Any]:
    """K vs V, per layer, per head: where the quality loss of PQO quantization comes from.

    Parameters
    ----------
    model, tokenizer
        A loaded ``(LlamaModel, GGUFTokenizer)`` (e.g. :func:`numba_kv.toolkit.models.load_smollm2`).
    text_path : str or Path, optional
        English text; default :data:`numba_kv.toolkit.evaluation.evaluate.DEFAULT_TEXT` (as ``numba-kv eval``).
    tokens : int
        ``N``, tokens of the text (``>= prefill + 2``).
    prefill : int
        ``P``, tokens stored through ``cache.prefill``; the ``N − P − 1`` predictions made
        by decode steps are scored (as in :mod:`numba_kv.toolkit.evaluation.evaluate`).
    bits : sequence of int
        PQO bit widths (2–4) to analyse.
    residual_length, sink_tokens : int
        The window of the "with window" rows (``0, 0`` rows are always included).
    progress : bool
        tqdm progress bars on stderr.
    layer_sensitivity : sequence of {"k", "v"}
        Sides of the per-layer sensitivity sweep (``()`` skips it); each side costs one
        one-pass simulation per layer at ``min(bits)`` bits without window (~1 min for
        30 layers at N=512).  Default: keys only (on SmolLM2 a single layer's values
        change the KL by at most ~0.003, its keys by up to ~0.1).
    chunk_size : int or None
        Prefill chunk (as ``numba-kv eval``).
    threads : int, optional
        Numba threads during the run (``None`` keeps the setting).

    Returns
    -------
    dict
        ``schema`` (:data:`SCHEMA`); ``config`` (``model_name``, ``text``,
        ``text_sha256``, ``tokens``, ``prefill``, ``scored_positions``, ``bits``,
        ``residual_length``, ``sink_tokens``, ``chunk_size``, ``n_layers``, ``n_heads``,
        ``n_kv_heads``, ``head_dim``, ``threads``);

        ``kv_sensitivity``: list of rows, dense first — ``label`` (e.g. ``"dense"``,
        ``"k-only pqo3-r0-s0"``, ``"v-only pqo4-r32-s4"``, ``"pqo-k4v3-r32-s4"``),
        ``quantized`` (``"none"``, ``"k"``, ``"v"`` or ``"kv"``), ``k_bits``, ``v_bits``
        (int or null = exact), ``residual_length``, ``sink_tokens``, ``engine``
        (``"protocol"`` or ``"simulated"``), ``ppl``, ``ppl_change_pct``,
        ``top1_agreement``, ``kl_mean``, ``kl_p95``, ``kl_max``, ``k_bits_per_value``,
        ``v_bits_per_value`` (an exact side: float32 = 32), ``bits_per_value`` (their
        mean), ``wall_s``;

        ``per_layer``: list (one per layer) of ``layer``, ``k_channel_ratio``,
        ``v_channel_ratio`` (per KV head: max / median of the per-channel RMS over all
        tokens), ``k_top_channels``, ``k_top_channel_ratios``, ``v_top_channels``,
        ``k_token_norm_ratio`` / ``k_token_norm_argmax`` (max / median key norm over
        tokens and where), ``k_nmse`` / ``v_nmse`` (``{"pqo3": [per KV head]}``),
        ``attn`` (``{"pqo3-r0-s0": {"kl", "logit_err_std", "logit_std", "k_out_err",
        "v_out_err"}}``, each a list per *query* head over the decode rows; see
        :func:`_attention_errors`);

        ``layer_sensitivity``: ``{"bits", "residual_length": 0, "sink_tokens": 0,
        "engine": "simulated", "k": [rows], "v": [rows]}``, a row per layer with
        ``layer``, ``ppl_change_pct``, ``top1_agreement``, ``kl_mean``;

        ``engine_check``: the one-pass engine against the protocol rows of the same
        configuration (``label``, ``kl_between``, ``top1_between``,
        ``max_abs_logit_diff``, ``ppl_protocol``, ``ppl_simulated``,
        ``kl_dense_protocol``, ``kl_dense_simulated``);

        ``wall_s`` and ``timings`` (seconds per phase).

    Raises
    ------
    numba_kv.toolkit.evaluation.evaluate.EvalConfigError
        Missing or too short text, bad ``tokens``/``prefill``/``threads``.
    ValueError
        Bad ``bits`` or ``layer_sensitivity``.
    """
    from tqdm.auto import tqdm  # noqa: PLC0415

    from numba_kv.caches.dense import DenseCache  # noqa: PLC0415
    from numba_kv.caches.polarquant import PolarQuantCache  # noqa: PLC0415
    from .evaluate import EvalConfigError, numba_threads, resolve_text  # noqa: PLC0415
    from ..models import sequence_logits  # noqa: PLC0415

    t_start = time.perf_counter()
    bits = _bits_arg(bits)
    sides = tuple(layer_sensitivity)
    if any(s not in ("k", "v") for s in sides):
        raise ValueError(f"layer_sensitivity: expected a sequence of 'k'/'v', got {layer_sensitivity!r}")
    for nm, val, lo in (("tokens", tokens, 3), ("prefill", prefill, 1),
                        ("residual_length", residual_length, 0), ("sink_tokens", sink_tokens, 0)):
        if isinstance(val, bool) or not isinstance(val, (int, np.integer)) or val < lo:
            raise EvalConfigError(f"--{nm.replace('_', '-')}: expected an int >= {lo}, got {val!r}")
    if prefill > tokens - 2:
        raise EvalConfigError(f"--prefill: expected <= --tokens - 2 = {tokens - 2}, got {prefill}")
    text_file = resolve_text(text_path)
    raw = text_file.read_bytes()
    ids_all = tokenizer.encode(raw.decode("utf-8", errors="replace"))
    if len(ids_all) < tokens:
        raise EvalConfigError(f"--text: {str(text_file)!r} has {len(ids_all)} tokens, "
                              f"fewer than --tokens={tokens}")
    ids = np.asarray(ids_all[:tokens], dtype=np.int64)
    c = model.config
    geom = (c.n_layers, c.n_kv_heads, c.head_dim)
    targets = ids[prefill + 1:]
    windows = [(0, 0)]
    if residual_length or sink_tokens:
        windows.append((int(residual_length), int(sink_tokens)))
    timings: Dict[str, float] = {}

    def run_protocol(cache: Any, desc: str) -> np.ndarray:
        bar = tqdm(total=tokens - prefill, desc=f"{desc:>22}", disable=not progress, leave=False, unit="tok")
        out = sequence_logits(model, ids, cache, prefill, chunk_size=chunk_size, include_prefill=False,
                              progress=lambda done, total: bar.update(1))
        bar.close()
        return out

    def pq(b: int, r: int, s: int, **kw: Any) -> Any:
        return PolarQuantCache(*geom, bits=b, residual_length=r, sink_tokens=s, **kw)

    rows: List[Dict[str, Any]] = []

    def add_row(label: str, quantized: str, kb: Optional[int], vb: Optional[int], r: int, s: int, engine: str,
                logits: np.ndarray, kbpv: float, vbpv: float, wall: float) -> Dict[str, Any]:
        m = score(logits[1:-1])
        row = {"label": label, "quantized": quantized, "k_bits": kb, "v_bits": vb, "residual_length": r,
               "sink_tokens": s, "engine": engine, "ppl": m["ppl"],
               "ppl_change_pct": 100.0 * (m["ppl"] / ref_ppl - 1.0), "top1_agreement": m["top1_agreement"],
               "kl_mean": m["kl_mean"], "kl_p95": m["kl_p95"], "kl_max": m["kl_max"],
               "k_bits_per_value": kbpv, "v_bits_per_value": vbpv, "bits_per_value": 0.5 * (kbpv + vbpv),
               "wall_s": wall}
        rows.append(row)
        return row

    values_per_side = c.n_layers * c.n_kv_heads * c.head_dim * tokens
    with numba_threads(threads) as n_threads:
        # warm-up: compile the kernels outside the timed runs (a short window exercises compression)
        t0 = time.perf_counter()
        for b in bits:
            sequence_logits(model, ids[:8], KVSplitCache(pq(b, 2, 1, decode_output="dequantized"),
                                                         DenseCache(*geom), "k"), 2, include_prefill=False)
            sequence_logits(model, ids[:8], pq(b, 2, 1), 2, include_prefill=False)
        timings["warmup"] = time.perf_counter() - t0

        # 1. dense reference, recording q/k/v of every layer
        t0 = time.perf_counter()
        rec = RecordingCache(DenseCache(*geom))
        ref_all = run_protocol(rec, "dense (recording)")
        ref = ref_all[1:-1]
        score = LogitScorer(ref, targets)
        ref_ppl = score(ref)["ppl"]
        add_row("dense", "none", None, None, 0, 0, "protocol", ref_all, 32.0, 32.0, time.perf_counter() - t0)
        timings["dense"] = time.perf_counter() - t0

        # 2. K-only / V-only through the protocol
        t0 = time.perf_counter()
        proto_logits: Dict[str, np.ndarray] = {}
        for side in ("k", "v"):
            for b in bits:
                for (r, s) in windows:
                    t1 = time.perf_counter()
                    cache = KVSplitCache(pq(b, r, s, decode_output="dequantized"), DenseCache(*geom), side)
                    label = f"{side}-only pqo{b}-r{r}-s{s}"
                    lg = run_protocol(cache, label)
                    kbytes, vbytes = cache.side_bytes()
                    add_row(label, side, b if side == "k" else None, b if side == "v" else None, r, s,
                            "protocol", lg, 8.0 * kbytes / values_per_side, 8.0 * vbytes / values_per_side,
                            time.perf_counter() - t1)
                    if r == 0 and s == 0 and b == bits[0]:
                        proto_logits[label] = lg
        timings["kv_only_protocol"] = time.perf_counter() - t0

        # 3. one-pass engine: check against the protocol, asymmetric rows, per-layer sweep
        t0 = time.perf_counter()
        sim_dense, states = simulate_logits(model, ids, prefill, chunk_size=chunk_size, return_states=True)
        checks = [{"label": "dense", **_agreement(score, ref_all, sim_dense, targets)}]
        for label, lg in proto_logits.items():
            side, b = label[0], bits[0]
            sim = simulate_logits(model, ids, prefill, k_quant=b if side == "k" else None,
                                  v_quant=b if side == "v" else None, chunk_size=chunk_size,
                                  dense_states=states)
            checks.append({"label": label, **_agreement(score, lg, sim, targets)})
        timings["engine_check"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        combos = [(kb, vb) for kb in bits for vb in bits if kb != vb] + [(b, b) for b in bits]
        for (kb, vb) in combos:
            for (r, s) in windows:
                t1 = time.perf_counter()
                lg = simulate_logits(model, ids, prefill, k_quant=kb, v_quant=vb, residual_length=r,
                                     sink_tokens=s, chunk_size=chunk_size, dense_states=states)
                name = f"pqo{kb}" if kb == vb else f"pqo-k{kb}v{vb}"
                bpv = polarquant_bits_per_value(tokens, c.head_dim, kb, vb, r, s)
                add_row(f"{name}-r{r}-s{s}", "kv", kb, vb, r, s, "simulated", lg, bpv["k"], bpv["v"],
                        time.perf_counter() - t1)
        timings["kv_simulated"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        sens: Dict[str, Any] = {"bits": min(bits), "residual_length": 0, "sink_tokens": 0,
                                "engine": "simulated"}
        for side in sides:
            out_rows = []
            bar = tqdm(total=c.n_layers, desc=f"{side}: one layer at a time", disable=not progress,
                       leave=False)
            for li in range(c.n_layers):
                spec = [None] * c.n_layers
                spec[li] = min(bits)
                lg = simulate_logits(model, ids, prefill, k_quant=spec if side == "k" else None,
                                     v_quant=spec if side == "v" else None, chunk_size=chunk_size,
                                     dense_states=states)
                m = score(lg[1:-1])
                out_rows.append({"layer": li, "ppl_change_pct": 100.0 * (m["ppl"] / ref_ppl - 1.0),
                                 "top1_agreement": m["top1_agreement"], "kl_mean": m["kl_mean"]})
                bar.update(1)
            bar.close()
            sens[side] = out_rows
        timings["layer_sensitivity"] = time.perf_counter() - t0

        # 4. per-layer statistics from the recorded dense q/k/v
        t0 = time.perf_counter()
        per_layer = []
        for li in range(c.n_layers):
            q, k, v = rec.recorded(li)
            st = _layer_stats(q, k, v, prefill, bits, windows, model.softmax_scale, c.n_kv_groups)
            per_layer.append({"layer": li, **st})
        timings["per_layer_stats"] = time.perf_counter() - t0

    config = {
        "model_name": getattr(c, "name", ""), "text": str(text_file),
        "text_sha256": hashlib.sha256(raw).hexdigest(),
        "tokens": int(tokens), "prefill": int(prefill), "scored_positions": int(tokens - prefill - 1),
        "bits": list(bits), "residual_length": int(residual_length), "sink_tokens": int(sink_tokens),
        "chunk_size": chunk_size, "n_layers": c.n_layers, "n_heads": c.n_heads, "n_kv_heads": c.n_kv_heads,
        "head_dim": c.head_dim, "threads": int(n_threads),
    }
    return _json_safe({"schema": SCHEMA, "config": config, "kv_sensitivity": rows, "per_layer": per_layer,
                       "layer_sensitivity": sens, "engine_check": checks, "timings": timings,
                       "wall_s": time.perf_counter() - t_start})


def _agreement(score: LogitScorer, a: np.ndarray, b: np.ndarray, targets: np.ndarray) -> Dict[str, float]:
    """Protocol logits ``a`` vs one-pass logits ``b`` (rows as ``sequence_logits``), and both vs dense."""
    ma = compare_logits(a[1:-1], b[1:-1], targets)
    return {"kl_between": ma["kl_mean"], "top1_between": ma["top1_agreement"],
            "max_abs_logit_diff": float(np.max(np.abs(a.astype(np.float64) - b))),
            "ppl_protocol": ma["ppl_ref"], "ppl_simulated": ma["ppl"],
            "kl_dense_protocol": score(a[1:-1])["kl_mean"], "kl_dense_simulated": score(b[1:-1])["kl_mean"]}


def _json_safe(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating, float)):
        return None if not math.isfinite(float(x)) else float(x)
    if isinstance(x, np.bool_):
        return bool(x)
    return x


# --------------------------------------------------------------------------------------
# output
# --------------------------------------------------------------------------------------
def render_tables(result: Dict[str, Any], console: Any = None, worst: int = 8) -> None:
    """Print the analysis as rich tables.

    Parameters
    ----------
    result : dict
        The dictionary returned by :func:`analyze_kv`.
    console : rich.console.Console, optional
        Default: a new console on stdout.
    worst : int
        Rows of the "worst layer/heads" table.
    """
    from rich.console import Console  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415

    con = console or Console(width=170)
    cfg = result["config"]
    b0 = f"pqo{min(cfg['bits'])}"
    win = f"r{cfg['residual_length']}-s{cfg['sink_tokens']}"

    t = Table(title=f"K vs V — {cfg['model_name']}, {Path(cfg['text']).name}: N={cfg['tokens']}, "
                    f"P={cfg['prefill']} ({cfg['scored_positions']} scored decode positions), "
                    f"{result['wall_s']:.0f} s")
    for col in ("row", "engine", "K b/v", "V b/v", "mean b/v", "PPL", "ΔPPL", "top-1", "KL mean", "KL p95"):
        t.add_column(col, justify="left" if col in ("row", "engine") else "right")
    for r in result["kv_sensitivity"]:
        t.add_row(r["label"], r["engine"], f"{r['k_bits_per_value']:.2f}", f"{r['v_bits_per_value']:.2f}",
                  f"{r['bits_per_value']:.2f}", f"{r['ppl']:.3f}", f"{r['ppl_change_pct']:+.2f}%",
                  f"{r['top1_agreement']:.3f}", f"{r['kl_mean']:.4f}", f"{r['kl_p95']:.4f}")
    con.print(t)

    sens = result.get("layer_sensitivity", {})
    groups = cfg["n_heads"] // cfg["n_kv_heads"]
    t = Table(title=f"Per layer ({b0}, mean over KV heads; attention errors over decode rows, no window; "
                    f"sensitivity = only this layer's K or V quantized, {b0}, no window)")
    cols = ["layer", "K NMSE", "V NMSE", "K ch max/med", "K top ch (worst head)", "V ch max/med", "attn KL",
            "attn KL max head", "logit err σ", "logit σ", "K→out err", "V→out err", "K-layer ΔPPL",
            "K-layer KL", "V-layer ΔPPL", "V-layer KL"]
    for col in cols:
        t.add_column(col, justify="right")
    for L in result["per_layer"]:
        li = L["layer"]
        a = L["attn"][f"{b0}-r0-s0"]
        wh = int(np.argmax(L["k_channel_ratio"]))
        ks, vs = sens.get("k", []), sens.get("v", [])

        def sweep(rows: List[Dict[str, Any]], key: str, fmt: str) -> str:
            return format(rows[li][key], fmt) + ("%" if key == "ppl_change_pct" else "") if rows else "-"

        t.add_row(str(li), f"{np.mean(L['k_nmse'][b0]):.4f}", f"{np.mean(L['v_nmse'][b0]):.4f}",
                  f"{max(L['k_channel_ratio']):.1f}", f"h{wh}:{L['k_top_channels'][wh]}",
                  f"{max(L['v_channel_ratio']):.1f}", f"{np.mean(a['kl']):.4f}",
                  f"{max(a['kl']):.4f} (q{int(np.argmax(a['kl']))}/kv{int(np.argmax(a['kl'])) // groups})",
                  f"{np.mean(a['logit_err_std']):.3f}", f"{np.mean(a['logit_std']):.2f}",
                  f"{np.mean(a['k_out_err']):.3f}", f"{np.mean(a['v_out_err']):.3f}",
                  sweep(ks, "ppl_change_pct", "+.2f"), sweep(ks, "kl_mean", ".4f"),
                  sweep(vs, "ppl_change_pct", "+.2f"), sweep(vs, "kl_mean", ".4f"))
    con.print(t)

    # worst query heads by attention KL, no window and with the window
    keys = [f"{b0}-r0-s0"] + ([f"{b0}-{win}"] if f"{b0}-{win}" in result["per_layer"][0]["attn"] else [])
    items = []
    for L in result["per_layer"]:
        for h, kl in enumerate(L["attn"][keys[0]]["kl"]):
            items.append((kl, L["layer"], h))
    items.sort(reverse=True)
    t = Table(title=f"Worst query heads by attention KL ({keys[0]})")
    for col in ("layer", "q head", "kv head", "attn KL", f"KL {keys[-1]}", "logit err σ", "K NMSE",
                "K ch max/med", "K top channels (ratio)", "K token-norm max/med (pos)"):
        t.add_column(col, justify="right")
    for kl, li, h in items[:worst]:
        L = result["per_layer"][li]
        g = h // groups
        a = L["attn"][keys[0]]
        top = ", ".join(f"{ch}({r:.1f})"
                        for ch, r in zip(L["k_top_channels"][g], L["k_top_channel_ratios"][g]))
        t.add_row(str(li), str(h), str(g), f"{kl:.4f}", f"{L['attn'][keys[-1]]['kl'][h]:.4f}",
                  f"{a['logit_err_std'][h]:.3f}", f"{L['k_nmse'][b0][g]:.4f}",
                  f"{L['k_channel_ratio'][g]:.1f}",
                  top, f"{L['k_token_norm_ratio'][g]:.1f} ({L['k_token_norm_argmax'][g]})")
    con.print(t)

    t = Table(title="One-pass engine vs protocol (same configuration; all-layer rows differ by "
                    "quantization-bucket flips that float rounding triggers: compare the KL-vs-dense "
                    "columns)")
    for col in ("row", "KL between", "top-1 between", "max |Δlogit|", "PPL protocol", "PPL one-pass",
                "KL vs dense: protocol", "one-pass"):
        t.add_column(col, justify="right")
    for ch in result["engine_check"]:
        t.add_row(ch["label"], f"{ch['kl_between']:.2e}", f"{ch['top1_between']:.4f}",
                  f"{ch['max_abs_logit_diff']:.2e}", f"{ch['ppl_protocol']:.4f}",
                  f"{ch['ppl_simulated']:.4f}", f"{ch['kl_dense_protocol']:.4f}",
                  f"{ch['kl_dense_simulated']:.4f}")
    con.print(t)
    con.print("timings: " + ", ".join(f"{k} {v:.0f} s" for k, v in result["timings"].items()))
