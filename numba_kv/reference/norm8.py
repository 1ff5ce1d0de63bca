"""NumPy reference of the 8-bit log-domain vector norm (``norm_bits=8``), float64.

Written from the definition in :mod:`numba_kv.ops.norm8`'s docstring: a norm ``n > 0`` on the
grid of base ``base16/16`` octaves is stored as ``k = round(16·log2 n − base16)`` clamped to
``1 … 255`` (``k = 0``: ``n = 0``) and read back as ``2**((base16 + k)/16)``; the first store's
base puts its median nonzero norm 128 steps above the base, or its largest norm 191 steps
above it when that is higher (4 octaves of headroom below code 255).  ``log2`` is NumPy's
float64 one: no table, so the op's table cannot hide a wrong entry.
"""

from __future__ import annotations

import numpy as np

__all__ = ["norm8_base16", "norm8_decode", "norm8_encode"]


def norm8_encode(norms: np.ndarray, base16: int) -> np.ndarray:
    """Codes (uint8, the shape of ``norms``) of non-negative norms ``norms`` (float)."""
    n = np.asarray(norms, dtype=np.float64)
    with np.errstate(divide="ignore"):
        k = np.round(16.0 * np.log2(np.where(n > 0, n, 1.0)) - int(base16))
    return np.where(n > 0, np.clip(k, 1, 255), 0).astype(np.uint8)


def norm8_decode(codes: np.ndarray, base16: int) -> np.ndarray:
    """Decoded norms (float32, the shape of ``codes``): ``2**((base16 + k)/16)``, 0 for ``k = 0``."""
    k = np.asarray(codes, dtype=np.float64)
    return np.where(k > 0, 2.0 ** ((int(base16) + k) / 16.0), 0.0).astype(np.float32)


def norm8_base16(norms: np.ndarray) -> int:
    """``base16`` of a first store with norms ``norms`` (float; zeros ignored; 0 when all are zero)."""
    n = np.asarray(norms, dtype=np.float64).ravel()
    n = n[n > 0]
    if not n.size:
        return 0
    med = int(np.round(16.0 * np.log2(np.median(n))))
    top = int(np.round(16.0 * np.log2(n.max())))
    return max(med - 128, top - 191)
