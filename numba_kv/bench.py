"""Decode-attention benchmark shared by ``numba-kv bench attention`` and ``benchmarks/``.

One decode step, batch 1: fused attention from packed codes vs (a) NumPy dense float32
attention over the uncompressed K/V (``q @ K.T``, softmax, ``@ V`` per KV-head group) and
(b) dequantize-then-attend.  All three run in one process on the same data, so the ratios
are measured, not assembled.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Sequence

import numpy as np

from .ops.attention import decode_attention
from .ops.blockquant import dequantize_blocks, quantize_blocks


def dense_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, softmax_scale: float) -> np.ndarray:
    """NumPy float32 attention for one decode step.

    Parameters
    ----------
    q : ``[1, num_heads, 1, d]``; k, v : ``[1, num_kv_heads, T, d]`` float32.

    Returns
    -------
    out : ``[1, num_heads, 1, d]`` float32.
    """
    hq, hkv = q.shape[1], k.shape[1]
    g = hq // hkv
    out = np.empty((1, hq, 1, q.shape[3]), np.float32)
    for h in range(hkv):
        qs = q[0, h * g:(h + 1) * g, 0]
        s = (qs @ k[0, h].T) * np.float32(softmax_scale)
        s -= s.max(1, keepdims=True)
        p = np.exp(s)
        p /= p.sum(1, keepdims=True)
        out[0, h * g:(h + 1) * g, 0] = p @ v[0, h]
    return out


@dataclass
class AttentionCase:
    """Inputs of one benchmark case (dense and compressed views of the same K/V)."""

    tokens: int
    bits: int
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    kc: np.ndarray
    ks: np.ndarray
    vc: np.ndarray
    vs: np.ndarray

    @property
    def compressed_bytes(self) -> int:
        """Bytes of codes + scales that fused attention reads."""
        return int(self.kc.nbytes + self.ks.nbytes + self.vc.nbytes + self.vs.nbytes)

    @property
    def dense_bytes(self) -> int:
        return int(self.k.nbytes + self.v.nbytes)

    def fused(self) -> np.ndarray:
        return decode_attention(self.q, self.kc, self.ks, self.vc, self.vs, bits=self.bits)

    def dense(self) -> np.ndarray:
        return dense_attention(self.q, self.k, self.v, self.q.shape[3] ** -0.5)

    def dequant_then_attend(self) -> np.ndarray:
        kh = dequantize_blocks(self.kc, self.ks, self.bits)
        vh = dequantize_blocks(self.vc, self.vs, self.bits)
        return dense_attention(self.q, kh, vh, self.q.shape[3] ** -0.5)


def make_case(tokens: int, bits: int, num_kv_heads: int = 8, num_heads: int = 32, head_dim: int = 128,
              seed: int = 0) -> AttentionCase:
    """Random keys/values with a few outlier key channels, quantized once."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((1, num_kv_heads, tokens, head_dim)).astype(np.float32)
    k[..., [3, 17, 64 % head_dim]] *= 6.0
    v = rng.standard_normal((1, num_kv_heads, tokens, head_dim)).astype(np.float32)
    q = rng.standard_normal((1, num_heads, 1, head_dim)).astype(np.float32)
    kc, ks = quantize_blocks(k, bits)
    vc, vs = quantize_blocks(v, bits)
    return AttentionCase(tokens, bits, q, k, v, kc, ks, vc, vs)


@dataclass
class AttentionRow:
    """Timings (best of ``repeat``, milliseconds) of one case."""

    tokens: int
    bits: int
    fused_ms: float
    dense_ms: float
    dequant_attend_ms: float
    speedup_vs_dense: float
    speedup_vs_dequant: float
    fused_gb_per_s: float
    compressed_mb: float
    dense_mb: float
    max_rel_err_vs_dequant: float


def _best(fn: Callable[[], object], repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def run_attention_bench(tokens: Sequence[int] = (1024, 4096, 16384, 32768), bits: Sequence[int] = (3, 4),
                        repeat: int = 5, progress: bool = True) -> List[AttentionRow]:
    """Time fused vs dense vs dequantize-then-attend for every (tokens, bits)."""
    from tqdm.auto import tqdm  # noqa: PLC0415

    rows = []
    for t, b in tqdm([(t, b) for t in tokens for b in bits], desc="attention", disable=not progress, leave=False):
        c = make_case(t, b)
        fused = c.fused()
        ref = c.dequant_then_attend()
        err = float(np.abs(fused - ref).max() / np.abs(ref).max())
        tf, td, tq = _best(c.fused, repeat), _best(c.dense, repeat), _best(c.dequant_then_attend, repeat)
        rows.append(AttentionRow(t, b, tf * 1e3, td * 1e3, tq * 1e3, td / tf, tq / tf,
                                 c.compressed_bytes / tf / 1e9, c.compressed_bytes / 1e6, c.dense_bytes / 1e6, err))
    return rows


def render_attention(rows: Sequence[AttentionRow], title: str) -> None:
    """Print attention rows as a rich table."""
    from rich.console import Console  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415

    table = Table(title=title)
    for col in ("T", "bits", "fused ms", "dense f32 ms", "deq+attend ms", "vs dense", "vs deq", "fused GB/s",
                "KV MB (packed/f32)", "rel err"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r.tokens), str(r.bits), f"{r.fused_ms:.2f}", f"{r.dense_ms:.2f}",
                      f"{r.dequant_attend_ms:.2f}", f"{r.speedup_vs_dense:.2f}x", f"{r.speedup_vs_dequant:.2f}x",
                      f"{r.fused_gb_per_s:.2f}", f"{r.compressed_mb:.1f}/{r.dense_mb:.1f}",
                      f"{r.max_rel_err_vs_dequant:.1e}")
    Console(width=160).print(table)


def rows_as_dicts(rows: Sequence[object]) -> List[Dict]:
    """Dataclass rows as plain dicts (for ``--json``)."""
    return [asdict(r) for r in rows]
