"""Realistic synthetic K/V for compressor tests and the README numbers.

Keys and values of real models are far from i.i.d. Gaussian (KIVI, KVQuant, Palu):

* **low-rank structure**: per head, most energy lies in a few directions (keys more than
  values); here ``x = z · diag(s) · A`` with ``s_i = exp(−i / decay)`` and a random
  orthonormal ``A`` (``signal_rank × head_dim``), plus small isotropic noise;
* **outlier channels**: a few fixed key channels carry a large mean and a larger spread
  (the "massive activation" channels that motivate per-channel key quantization);
* **outlier tokens**: an attention-sink token (position 0) and a few random tokens with
  several times the typical norm.
"""

from __future__ import annotations

import numpy as np


def synth_kv(rng: np.random.Generator, heads: int = 4, seq: int = 256, head_dim: int = 64, kind: str = "k",
             batch: int | None = None) -> np.ndarray:
    """float32 ``[heads, seq, head_dim]`` (or ``[batch, heads, seq, head_dim]``) K or V."""
    if batch is not None:
        return np.stack([synth_kv(rng, heads, seq, head_dim, kind) for _ in range(batch)])
    is_k = kind == "k"
    signal_rank = min(head_dim, 24 if is_k else 40)
    decay = 5.0 if is_k else 12.0
    noise = 0.03 if is_k else 0.06
    out = np.empty((heads, seq, head_dim), np.float32)
    for h in range(heads):
        a, _ = np.linalg.qr(rng.standard_normal((head_dim, signal_rank)))
        s = np.exp(-np.arange(signal_rank) / decay)
        z = rng.standard_normal((seq, signal_rank))
        x = (z * s) @ a.T + noise * rng.standard_normal((seq, head_dim))
        if is_k:
            ch = rng.choice(head_dim, size=max(1, head_dim // 32), replace=False)
            x[:, ch] = x[:, ch] * 3.0 + rng.choice([-1.0, 1.0], size=ch.shape[0]) * 6.0
        tok = np.concatenate([[0], rng.choice(np.arange(1, seq), size=max(1, seq // 128), replace=False)])
        x[tok] *= 4.0 if is_k else 2.5
        out[h] = x
    return out


def nmse(x: np.ndarray, x_hat: np.ndarray) -> float:
    """‖x − x̂‖² / ‖x‖² over the whole tensor (float64)."""
    x = np.asarray(x, np.float64)
    return float(((np.asarray(x_hat, np.float64) - x) ** 2).sum() / (x ** 2).sum())
