"""Building blocks of :class:`~numba_kv.toolkit.models.llama.LlamaModel`, in NumPy:
RMSNorm, tanh-GELU, RoPE tables and rotation, and causal softmax attention with GQA.

Everything is float32; see :mod:`numba_kv.toolkit.models.llama` for the model they make up.
"""

from __future__ import annotations

import numpy as np

__all__ = ["apply_rope", "attention", "gelu_tanh", "rms_norm", "rope_tables"]


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU, tanh approximation ``x/2 · (1 + tanh(sqrt(2/π)(x + 0.044715 x³)))`` (float32, new array).

    Hendrycks & Gimpel, arXiv:1606.08415, eq. for the tanh approximation; what Gemma's
    ``gelu_pytorch_tanh`` and llama.cpp's ``ggml_gelu`` compute.
    """
    x = np.asarray(x, dtype=np.float32)
    inner = x * x
    inner *= np.float32(0.044715)
    inner += 1.0
    inner *= x
    inner *= np.float32(np.sqrt(2.0 / np.pi))
    np.tanh(inner, out=inner)
    inner += 1.0
    inner *= x
    inner *= np.float32(0.5)
    return inner


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm ``x / sqrt(mean(x²) + eps) * weight`` over the last axis.

    Parameters
    ----------
    x : ndarray, shape ``(..., dim)``, float32
    weight : ndarray, shape ``(dim,)``, float32
    eps : float

    Returns
    -------
    ndarray, shape ``(..., dim)``, float32
    """
    ms = np.mean(np.square(x), axis=-1, keepdims=True, dtype=np.float32)
    return x * (1.0 / np.sqrt(ms + np.float32(eps))) * weight


def rope_tables(positions: np.ndarray, rope_dim: int, theta: float,
                freq_factors: np.ndarray | None = None) -> tuple:
    """Cosine/sine tables of RoPE for absolute ``positions``.

    Parameters
    ----------
    positions : ndarray of int, shape ``(seq,)``
    rope_dim : int
        Rotated dimensions per head (even).
    theta : float
        Frequency base; pair ``i`` rotates by ``pos · theta^(-2i/rope_dim)``.
    freq_factors : ndarray, shape ``(rope_dim // 2,)``, optional
        llama.cpp ``rope_freqs.weight``: the frequency of pair ``i`` is divided by it.

    Returns
    -------
    cos, sin : ndarray, shape ``(seq, rope_dim // 2)``, float32
    """
    inv = theta ** (-np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)
    if freq_factors is not None:
        inv = inv / np.asarray(freq_factors, dtype=np.float64)
    ang = np.asarray(positions, dtype=np.float64)[:, None] * inv[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, neox: bool = False) -> np.ndarray:
    """Rotate adjacent pairs ``(2i, 2i+1)`` (or split halves ``(i, i + half)`` with ``neox``)
    of the first ``2·cos.shape[1]`` dims.

    Parameters
    ----------
    x : ndarray, shape ``(batch, heads, seq, head_dim)``, float32
    cos, sin : ndarray, shape ``(seq, rope_dim // 2)``, float32
        From :func:`rope_tables`.
    neox : bool
        Pair dim ``i`` with ``i + rope_dim/2`` (``LLAMA_ROPE_TYPE_NEOX``, HF ``rotate_half``).

    Returns
    -------
    ndarray, same shape as ``x``, float32 (new array)

    Notes
    -----
    ``out[2i] = x[2i]·cos − x[2i+1]·sin``, ``out[2i+1] = x[2i]·sin + x[2i+1]·cos``
    (llama.cpp ``ggml_rope`` with ``LLAMA_ROPE_TYPE_NORM``; RoFormer, Su et al. 2021,
    arXiv:2104.09864, eq. 34); with ``neox`` the pair of frequency ``i`` is ``(i, i + half)``.
    """
    half = cos.shape[1]
    out = x.copy()
    if neox:
        a, b = slice(0, half), slice(half, 2 * half)
    else:
        a, b = slice(0, 2 * half, 2), slice(1, 2 * half, 2)
    x0 = x[..., a]
    x1 = x[..., b]
    out[..., a] = x0 * cos - x1 * sin
    out[..., b] = x0 * sin + x1 * cos
    return out


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, softmax_scale: float, n_kv_groups: int,
              logit_bias: np.ndarray | None = None, window: int | None = None) -> np.ndarray:
    """Causal softmax attention of new queries over a K/V history, with GQA.

    Parameters
    ----------
    q : ndarray, shape ``(batch, num_heads, q_len, head_dim)``, float32
        Queries of the ``q_len`` newest positions.
    k, v : ndarray, shape ``(batch, num_kv_heads, kv_len, head_dim)``
        History whose last ``q_len`` entries are the new tokens.
    softmax_scale : float
        Multiplier of ``q·k``.
    n_kv_groups : int
        ``num_heads // num_kv_heads``; head ``h`` reads KV head ``h // n_kv_groups``.
    logit_bias : ndarray, shape ``(batch, num_heads, q_len, kv_len)``, optional
        Added to the scaled logits before softmax.
    window : int, optional
        Sliding window: query ``i`` also ignores keys more than ``window − 1`` positions
        before it (it sees at most ``window`` keys, itself included).

    Returns
    -------
    ndarray, shape ``(batch, num_heads, q_len, head_dim)``, float32

    Raises
    ------
    ValueError
        Inconsistent shapes (``kv_len < q_len``, head counts, bias shape).

    Notes
    -----
    Query ``i`` sees keys ``0 .. kv_len − q_len + i`` (and, with ``window``, only the
    last ``window`` of them).
    """
    b, h, t, d = q.shape
    kb, kvh, s, kd = k.shape
    if kvh * n_kv_groups != h or kd != d or kb != b:
        raise ValueError(f"k: shape {k.shape} does not match q {q.shape} with n_kv_groups={n_kv_groups}")
    if s < t:
        raise ValueError(f"k: kv_len={s} is shorter than q_len={t}")
    k = np.asarray(k, dtype=np.float32)
    v = np.asarray(v, dtype=np.float32)
    # heads of one group are contiguous: [b, kvh, g*t, d] @ [b, kvh, d, s]
    qg = np.ascontiguousarray(q, dtype=np.float32).reshape(b, kvh, n_kv_groups * t, d)
    scores = np.matmul(qg, k.transpose(0, 1, 3, 2)).reshape(b, h, t, s)
    scores *= np.float32(softmax_scale)
    if logit_bias is not None:
        lb = np.asarray(logit_bias, dtype=np.float32)
        if lb.shape != scores.shape:
            raise ValueError(f"logit_bias: expected shape {scores.shape}, got {lb.shape}")
        scores += lb
    if window is not None and int(window) < 1:
        raise ValueError(f"window: expected None or an int >= 1, got {window!r}")
    if t > 1 or (window is not None and s > window):
        qpos = (s - t + np.arange(t))[:, None]
        kpos = np.arange(s)[None, :]
        mask = kpos > qpos
        if window is not None:
            mask |= kpos <= qpos - int(window)
        scores[..., mask] = -np.inf
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    out = np.matmul(scores.reshape(b, kvh, n_kv_groups * t, s), v)
    return out.reshape(b, h, t, d)
