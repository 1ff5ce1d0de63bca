"""The binary16 pair table of a codebook: the entry for a pair of codes, as the tensor-core
decode kernel reads its K and V codes two at a time (one 32-bit shared-memory word per pair)."""

from __future__ import annotations

import numpy as np


def pair_table(cent: np.ndarray, bits: int) -> tuple[np.ndarray, float]:
    """Pair table of codebook ``cent`` and the factor to multiply back.

    Entry ``e < 4**bits`` is the ``.f16x2`` word ``(f·cent[e mod 2**bits], f·cent[e >> bits])``
    (low half first) as ``uint32``, where ``f`` is the largest power of two ``<= 1`` with
    ``f·max|cent| <= 1`` (so that ``f·c·scale`` stays in binary16 for every binary16 scale).

    Parameters
    ----------
    cent : float array, shape ``(>= 2**bits,)``
        The codebook's centroids (the first ``2**bits`` are read).
    bits : int
        Code width, 1 to 4.

    Returns
    -------
    table : uint32 array, shape ``(4**bits,)``
        One replica of the table.
    inv : float
        ``1/f`` (exact).

    Examples
    --------
    >>> import numpy as np
    >>> tab, inv = pair_table(np.array([-2.0, 2.0], np.float32), 1)
    >>> tab.shape, inv
    ((4,), 2.0)
    """
    c = np.asarray(cent[: 1 << bits], np.float32)
    f = 1.0
    while float(np.abs(c).max()) * f > 1.0:
        f *= 0.5
    e = np.arange(1 << (2 * bits))
    pairs = (np.stack([c[e & ((1 << bits) - 1)], c[e >> bits]], axis=1) * np.float32(f)).astype(np.float16)
    return pairs.view(np.uint32).reshape(-1), 1.0 / f
