"""The seed's simplistic methods (gllm-kernels, ``algorithms.md`` §5.2–§5.4), reimplemented
in NumPy as baselines.  Byte counts are those of the seed's storage (f32 data, f32
codebook, f32 outlier vectors; indices counted as 4 bytes, which favours the seed: Rust
stores ``usize``).

Every function takes ``x`` ``[rows, seq, head_dim]`` and returns ``(x_hat, nbytes)``.
"""

from __future__ import annotations

import numpy as np

ENERGY_FRACTION = 0.9
KMEANS_ITERS = 2
OUTLIER_STD_FACTOR = 3.0
OUTLIER_MAD_FACTOR = 6.0


def _select_channels(x: np.ndarray, rank: int, energy: bool = True) -> np.ndarray:
    d = x.shape[-1]
    e = (x.astype(np.float64) ** 2).reshape(-1, d).sum(0)
    order = np.argsort(-e, kind="stable")
    max_rank = min(rank, d)
    total = e.sum()
    if not energy:
        return order[:max_rank]
    if total > 0:
        frac = np.cumsum(e[order]) / total
        r = int(np.searchsorted(frac, ENERGY_FRACTION) + 1)
        r = min(max(r, 1), max_rank)
    else:
        r = max_rank
    return order[:r]


def lowrank(x: np.ndarray, rank: int, energy: bool = True):
    """Keep the highest-energy channels (f32); others become 0."""
    idx = _select_channels(x, rank, energy)
    out = np.zeros_like(x, dtype=np.float32)
    out[..., idx] = x[..., idx]
    nbytes = x.shape[0] * x.shape[1] * idx.shape[0] * 4 + idx.shape[0] * 4
    return out, nbytes


def _effective_bits(quant_bits: int, k: int) -> int:
    if quant_bits == 4:
        if k > 16:
            raise ValueError("codebook_size > 16 with 4 bits")
        return 4
    if quant_bits == 8:
        if k > 256:
            raise ValueError("codebook_size > 256 with 8 bits")
        return 8
    return 4 if k <= 16 else 8


def _assign(v: np.ndarray, cb: np.ndarray, chunk: int = 256):
    codes, dists = [], []
    for i in range(0, v.shape[0], chunk):
        d2 = ((v[i:i + chunk, None, :] - cb[None, :, :]) ** 2).sum(-1)
        c = d2.argmin(1)  # ties -> lowest index
        codes.append(c)
        dists.append(d2[np.arange(c.shape[0]), c])
    return np.concatenate(codes), np.concatenate(dists)


def vq(x: np.ndarray, codebook_size: int, quant_bits: int = 8):
    """Whole-vector k-means over the whole tensor: first-K init, 2 Lloyd iterations."""
    bits = _effective_bits(quant_bits, codebook_size)
    d = x.shape[-1]
    v = x.reshape(-1, d).astype(np.float32)
    n = v.shape[0]
    cb = np.zeros((codebook_size, d), np.float32)
    cb[: min(n, codebook_size)] = v[:codebook_size]
    for _ in range(KMEANS_ITERS):
        code, _ = _assign(v, cb)
        for k in range(codebook_size):
            sel = code == k
            if sel.any():
                cb[k] = v[sel].mean(0)
    code, dist = _assign(v, cb)
    thr = dist.mean() + OUTLIER_STD_FACTOR * dist.std()
    out_idx = np.nonzero(dist > thr)[0]
    out = cb[code]
    out[out_idx] = v[out_idx]
    code_bytes = (n + 1) // 2 if bits == 4 else n
    nbytes = cb.size * 4 + code_bytes + out_idx.shape[0] * (4 + d * 4)
    return out.reshape(x.shape), nbytes


def mad_threshold(a: np.ndarray) -> float:
    """Seed's threshold on absolute values: upper median + 6·MAD (else mean + 3·std)."""
    a = np.sort(np.abs(np.asarray(a, np.float32)).ravel())
    n = a.shape[0]
    med = a[n // 2]
    mad = np.sort(np.abs(a - med))[n // 2]
    if mad > 0:
        return float(np.float32(med + np.float32(OUTLIER_MAD_FACTOR) * mad))
    a = a.astype(np.float64)
    return float(a.mean() + 3 * a.std())


def round_half_away(y: np.ndarray) -> np.ndarray:
    return np.sign(y) * np.floor(np.abs(y) + 0.5)


def int_quant_tensor(p: np.ndarray, bits: int):
    """Per-tensor symmetric INT quantization with MAD outliers; returns (p_hat, nbytes)."""
    lim = 7 if bits == 4 else 127
    thr = mad_threshold(p)
    flat = p.ravel().astype(np.float32)
    out_mask = np.abs(flat) > thr
    clipped = np.clip(flat, -thr, thr)
    max_abs = np.abs(clipped).max()
    scale = max_abs / lim if max_abs > 0 else 1.0
    q = np.clip(round_half_away(clipped / scale), -lim, lim)
    rec = (q * scale).astype(np.float32)
    rec[out_mask] = flat[out_mask]
    code_bytes = (flat.shape[0] + 1) // 2 if bits == 4 else flat.shape[0]
    nbytes = code_bytes + 4 + int(out_mask.sum()) * 8
    return rec.reshape(p.shape), nbytes


def hybrid(x: np.ndarray, rank: int, bits: int, energy: bool = True):
    """Channel selection, then per-tensor INT4/INT8 of the kept channels."""
    idx = _select_channels(x, rank, energy)
    p = x[..., idx]
    p_hat, nbytes = int_quant_tensor(p, bits)
    out = np.zeros_like(x, dtype=np.float32)
    out[..., idx] = p_hat
    return out, nbytes + idx.shape[0] * 4
