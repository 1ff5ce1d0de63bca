"""The binary16 pair table of a codebook: the entry for a pair of codes, as the tensor-core
decode kernel reads its K and V codes two at a time (one 32-bit shared-memory word per pair)."""

from __future__ import annotations

import numpy as np


def pair_table(cent: np.ndarray, bits: int) -> tuple[np.ndarray, float]:
    """Pair table of codebook ``cent`` and the factor to multiply back.

    Entry ``e < 4**bits`` is the ``.f16x2`` word ``(f·cent[e mod 2**bits], f·cent[e >> bits])``
    (low half first) as ``uint32``, where ``f`` is the largest power of two ``<= 1`` with
    ``f·max|cent| <= 1`` (so that ``f·c·scale`` stays in binary16 for every binary16 scale).
    Returns ``(table, 1/f)``.
    """
    c = np.asarray(cent[: 1 << bits], np.float32)
    f = 1.0
    while float(np.abs(c).max()) * f > 1.0:
        f *= 0.5
    e = np.arange(1 << (2 * bits))
    pairs = (np.stack([c[e & ((1 << bits) - 1)], c[e >> bits]], axis=1) * np.float32(f)).astype(np.float16)
    return pairs.view(np.uint32).reshape(-1), 1.0 / f
