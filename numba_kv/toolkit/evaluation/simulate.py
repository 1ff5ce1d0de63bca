"""The one-pass ("masked") engine of the analysis: the logits a model would produce with
PQO-quantized keys and/or values, computed in one forward pass with per-pair masks instead
of running a cache (:func:`simulate_logits`), and the bits/value of such a configuration."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from numba_kv.caches.config import PolarQuantConfig
from numba_kv.ops.blockquant import dequantize_blocks, quantize_blocks

from ..models.llama import rms_norm

__all__ = ["QuantSpec", "polarquant_bits_per_value", "pqo_roundtrip", "simulate_logits"]

#: Quantizer of one side: None (exact), a PQO bit width, or a function ``x -> x_hat``.
QuantSpec = int | Callable[[np.ndarray], np.ndarray] | None


def pqo_roundtrip(x: np.ndarray, bits: int, norm_mode: str = "maxnorm") -> np.ndarray:
    """``dequantize_blocks(quantize_blocks(x))`` (PQO: ``bits``-wide codebook), float32."""
    codes, scales = quantize_blocks(np.ascontiguousarray(x, dtype=np.float32), bits, norm_mode)
    return np.asarray(dequantize_blocks(codes, scales, bits, norm_mode), dtype=np.float32)


def _apply_quant(spec: QuantSpec, x: np.ndarray, norm_mode: str) -> np.ndarray | None:
    if spec is None:
        return None
    if callable(spec):
        out = np.asarray(spec(x), dtype=np.float32)
        if out.shape != x.shape:
            raise ValueError(f"quantizer: returned shape {out.shape}, expected {x.shape}")
        return out
    return pqo_roundtrip(x, int(spec), norm_mode)


def polarquant_bits_per_value(tokens: int, head_dim: int, k_bits: int | None, v_bits: int | None,
                              residual_length: int = 0, sink_tokens: int = 0, window_itemsize: int = 2,
                              exact_itemsize: int = 4) -> dict[str, float]:
    """Stored bits per value of a PQO cache at ``tokens`` tokens (window at its real size), by
    :meth:`~numba_kv.caches.config.PolarQuantConfig.stored_bytes` (the caches' own formula).

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
    window_dtype = {2: "float16", 4: "float32"}.get(window_itemsize)
    if window_dtype is None:
        raise ValueError(f"window_itemsize: expected 2 (float16) or 4 (float32), got {window_itemsize!r}")
    out: dict[str, float] = {}
    for side, b in (("k", k_bits), ("v", v_bits)):
        if b is None:
            out[side] = 8.0 * exact_itemsize
        else:  # the caches' own byte count of one row (one layer, batch row and KV head)
            cfg = PolarQuantConfig(1, 1, head_dim, bits=b, residual_length=residual_length, sink_tokens=sink_tokens,
                                   window_dtype=window_dtype)
            out[side] = 8.0 * cfg.stored_bytes(tokens, sides=(side,)) / (tokens * head_dim)
    out["mean"] = 0.5 * (out["k"] + out["v"])
    return out


# --------------------------------------------------------------------------------------
# the one-pass ("masked") engine
# --------------------------------------------------------------------------------------
def _per_layer(spec: Any, n_layers: int, arg: str) -> list[QuantSpec]:
    if spec is None or callable(spec) or isinstance(spec, (int, np.integer)):
        if isinstance(spec, bool):
            raise TypeError(f"{arg}: expected None, an int, a callable or a per-layer sequence, got {spec!r}")
        return [spec] * n_layers
    out = list(spec)
    if len(out) != n_layers:
        raise ValueError(f"{arg}: expected {n_layers} per-layer entries, got {len(out)}")
    return out


def _masks(n: int, n_prefill: int, chunk_size: int | None, residual_length: int,
           sink_tokens: int) -> dict[str, np.ndarray]:
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


def _via_window(n: int, n_prefill: int, chunk_size: int | None, residual_length: int,
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


def _masked_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, k_hat: np.ndarray | None,
                      v_hat: np.ndarray | None, m: dict[str, np.ndarray], scale: float, groups: int,
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
                    chunk_size: int | None = 256, dense_states: list[np.ndarray] | None = None,
                    return_states: bool = False) -> Any:
    """Logits of a teacher-forced decode through a PQO cache, computed in one causal pass.

    Equivalent to ``sequence_logits(model, tokens, cache, n_prefill,
    include_prefill=False)`` with a :class:`~numba_kv.caches.polarquant.PolarQuantCache`
    of the given bits and window (same model code, same quantizer; only the summation
    order differs): query ``i`` of the prompt's first chunk sees the original K/V; every
    later query sees, for key ``j``, the original when ``j`` is a sink or in the newest
    ``residual_length`` stored tokens (rounded to ``window_dtype``) and the quantized
    reconstruction otherwise (a token that passed through a float16 window is quantized
    from its float16 copy, as the cache does).  The blocks are the model's own
    (:meth:`~numba_kv.toolkit.models.LlamaModel.qkv`, :meth:`~numba_kv.toolkit.models.LlamaModel.finish_block`),
    so a Gemma-3 model runs as Gemma-3: scaled embeddings, QK-norm, local and global RoPE
    bases, post-norms, and its local layers' queries see only the last ``sliding_window``
    keys.  The simulated cache is one without ``sliding_window`` (as :func:`~.analysis.analyze_kv`
    builds them): sinks count on every layer and the model masks a local layer's history.

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
    ids = model.check_tokens(tokens)
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
    quant_input = _window_rounding(n, int(n_prefill), chunk_size, int(residual_length), int(sink_tokens),
                                   str(window_dtype))

    def quantizer(spec: QuantSpec) -> Callable[[np.ndarray], np.ndarray] | None:
        return None if spec is None else (lambda x: _apply_quant(spec, quant_input(x), norm_mode))

    # the model's own RoPE bases (Gemma-3: local and global) and, per sliding window, the masks
    # cut to what a local layer's query sees (the model masks the cache's history the same way)
    tables = model.rope_tables_at(np.arange(n))
    windows = list(getattr(model, "layer_windows", None) or [None] * c.n_layers)
    layer_masks = {w: m if w is None else _slide(m, int(w)) for w in set(windows)}
    start, x = _first_layer_input(model, ids, kq, vq, dense_states)
    states: list[np.ndarray] = []
    for li in range(start, c.n_layers):
        if return_states:
            states.append(x.copy())
        cos, sin = tables[c.layer_rope_theta(li)]
        _masked_block(model, li, x, cos, sin, quantizer(kq[li]), quantizer(vq[li]), layer_masks[windows[li]], fp16)
    logits = model.output_logits(x[int(n_prefill) - 1:], "all")
    if return_states:
        states.append(x.copy())
        return logits, states
    return logits


def _window_rounding(n: int, n_prefill: int, chunk_size: int | None, residual_length: int, sink_tokens: int,
                     window_dtype: str) -> Callable[[np.ndarray], np.ndarray]:
    """The input of the quantizer for ``x`` ``[1, kv_heads, n, head_dim]``: tokens compressed when
    they leave a float16 window are quantized from their float16 copy (as the cache does)."""
    via = (_via_window(n, n_prefill, chunk_size, residual_length, sink_tokens)
           if window_dtype == "float16" else np.zeros(n, dtype=bool))
    via4 = via[None, None, :, None] if via.any() else None

    def quant_input(x: np.ndarray) -> np.ndarray:
        return x if via4 is None else np.where(via4, x.astype(np.float16).astype(np.float32), x)

    return quant_input


def _first_layer_input(model: Any, ids: np.ndarray, kq: list[Any], vq: list[Any],
                       dense_states: list[np.ndarray] | None) -> tuple[int, np.ndarray]:
    """Where the pass starts: layer 0 with the token embeddings, or, given the states of a
    dense run, the first layer that quantizes anything with its (copied) input state."""
    c = model.config
    if dense_states is None:
        return 0, model.embed(ids)  # (Gemma scales the embedding)
    if len(dense_states) != c.n_layers + 1:
        raise ValueError(f"dense_states: expected {c.n_layers + 1} arrays (return_states=True), "
                         f"got {len(dense_states)}")
    touched = [i for i in range(c.n_layers) if kq[i] is not None or vq[i] is not None]
    start = touched[0] if touched else c.n_layers
    return start, np.array(dense_states[start], dtype=np.float32)


def _slide(m: dict[str, np.ndarray], window: int) -> dict[str, np.ndarray]:
    """The masks ``m`` of :func:`_masks` restricted to a sliding-window layer: query ``i`` sees keys
    ``i − window < j ≤ i`` (the model applies that mask to whatever the cache returns)."""
    n = m["causal"].shape[0]
    visible = np.arange(n)[:, None] - np.arange(n)[None, :] < window
    return {key: (a & visible if a.ndim == 2 else a) for key, a in m.items()}


def _masked_block(model: Any, li: int, x: np.ndarray, cos: np.ndarray, sin: np.ndarray,
                  k_quant: Callable[[np.ndarray], np.ndarray] | None,
                  v_quant: Callable[[np.ndarray], np.ndarray] | None, m: dict[str, np.ndarray],
                  fp16: bool) -> None:
    """Transformer block ``li`` over all ``n`` positions at once, adding into ``x`` ``(n, dim)``
    in place: the model's own projections, QK-norm and RoPE (:meth:`~numba_kv.toolkit.models.LlamaModel.qkv`),
    attention through :func:`_masked_attention` (``k_quant`` / ``v_quant`` map
    ``[1, kv_heads, n, head_dim]`` to its reconstruction, ``None``: exact), then the model's
    output projection, post-norms and feed-forward (:meth:`~numba_kv.toolkit.models.LlamaModel.finish_block`:
    SwiGLU for Llama, Gemma-3's GELU-tanh with its pre- and post-norms)."""
    c = model.config
    L = model.layers[li]
    q, k, v = model.qkv(L, rms_norm(x, L.attn_norm, c.rms_eps), cos, sin)
    k_hat = None if k_quant is None else k_quant(k)
    v_hat = None if v_quant is None else v_quant(v)
    o = _masked_attention(q[0], k[0], v[0], None if k_hat is None else k_hat[0],
                          None if v_hat is None else v_hat[0], m, model.softmax_scale, c.n_kv_groups, fp16)
    model.finish_block(L, x, o[None])
