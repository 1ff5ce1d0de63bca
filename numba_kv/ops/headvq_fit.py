"""Fitting the codebooks of the head VQ code (:mod:`numba_kv.ops.headvq`).

A head-VQ codebook quantizes ``m`` consecutive rotated coordinates of ``√d·u`` jointly
(``u = y / ‖y‖``, ``y = H_d D_s x``) on ``256`` points: pairs at 4 bits (``m = 2``), quads at
2 bits (``m = 4``).  After the randomized Hadamard the rotated unit vector of any input is
(close to) uniform on the sphere, so the codebooks are fitted once, to the ``m``-coordinate
marginal of ``√d·u`` for ``u`` uniform on the unit sphere in ``d`` dimensions (Gaussian
vectors normalized), by Lloyd's algorithm — k-means, the generalized Lloyd algorithm of
vector quantization (Gersho & Gray, *Vector Quantization and Signal Compression*, 1992,
ch. 11) — started from the ``m``-fold product of the scalar head codebook
(:func:`numba_kv.ops.headquant.head_codebook`): Lloyd iterations never raise the training
MSE, so the result is never worse than the scalar code on its training sample.

Determinism: the sample comes from ``numpy.random.default_rng([SEED, d, m])``; distances are
computed element-wise in float64 (no BLAS, whose summation order depends on the machine; a
Numba loop over the points, :func:`nearest`, with NumPy's order of operations and no FMA),
ties go to the lowest index (``argmin``), cell sums are sequential (``bincount``), an empty
cell keeps its point, and the iteration count is fixed.  The 256 points are then sorted
lexicographically (coordinate 0 first) and rounded to float32.  The shipped file
``numba_kv/ops/data/headvq.npz`` is written by::

    python -m numba_kv.ops.headvq_fit [--out PATH]

(``N_POINTS`` groups and ``ITERS`` iterations per codebook; about 14 s per codebook on a
2-vCPU AMD EPYC, 40-75 s with the chunked NumPy search that wrote the file, bit for bit the
same points.)  The fitting lives in the package, next to the data it makes, so the tests can
rerun it (:func:`fit_codebook` with a few iterations is deterministic) and an installed
wheel can regenerate and check its own file.
"""

from __future__ import annotations

import argparse
import io
import math
import pathlib
import zipfile

import numpy as np
from numba import prange

from .._jit import cpu_kernel
from .headquant import HEAD_DIMS, head_codebook

__all__ = ["CONFIGS", "DATA_PATH", "ITERS", "N_POINTS", "SEED", "codebook_key", "fit_all", "fit_codebook", "lloyd",
           "nearest", "product_codebook", "sphere_groups", "write_npz"]

#: (bits, group size m) of the head VQ codes: 256-point codebooks (one byte per group)
CONFIGS = ((4, 2), (2, 4))
#: seed of the training sample (``default_rng([SEED, d, m])``)
SEED = 20250601
#: training groups per codebook (``N_POINTS · m / d`` unit vectors)
N_POINTS = 1 << 19
#: Lloyd iterations per codebook
ITERS = 60
#: the shipped codebooks
DATA_PATH = pathlib.Path(__file__).with_name("data") / "headvq.npz"


def codebook_key(bits: int, m: int, d: int) -> str:
    """Name of a codebook in the ``.npz`` file: ``"b{bits}m{m}d{d}"``."""
    return f"b{bits}m{m}d{d}"


def sphere_groups(d: int, m: int, n_points: int, seed: int | list[int]) -> np.ndarray:
    """``n_points`` groups of ``m`` consecutive coordinates of ``√d·u``, ``u`` uniform on the unit
    sphere in ``d`` dimensions: float64 ``[n_points, m]``."""
    n_vec = -(-n_points * m // d)
    g = np.random.default_rng(seed).standard_normal((n_vec, d))
    g *= math.sqrt(d) / np.sqrt((g * g).sum(axis=1, keepdims=True))
    return g.reshape(-1, m)[:n_points]


def product_codebook(bits: int, m: int, d: int) -> np.ndarray:
    """The scalar head codebook's ``m``-fold product in ``√d·u`` units: float64
    ``[2^(bits·m), m]``, lexicographic (coordinate 0 slowest)."""
    c = np.asarray(head_codebook(bits, d).centroids, dtype=np.float64) * math.sqrt(d)
    grids = np.meshgrid(*([c] * m), indexing="ij")
    return np.stack([g.ravel() for g in grids], axis=1)


@cpu_kernel
def _nearest_rows(x, cb, idx, dist):
    """Per row ``i`` of ``x``: the lowest ``c`` of least ``Σ_j (x[i, j] − cb[c, j])²``, the
    sum in float64 from 0 coordinate by coordinate, each square rounded before it is added
    (no FMA: not fastmath), so it is NumPy's element-wise sum bit for bit."""
    n, m = x.shape
    k = cb.shape[0]
    for i in prange(n):
        best = np.inf
        arg = 0
        for c in range(k):
            acc = 0.0
            for j in range(m):
                diff = x[i, j] - cb[c, j]
                acc += diff * diff
            if acc < best:  # strict: a tie keeps the lower index, as argmin does
                best = acc
                arg = c
        idx[i] = arg
        dist[i] = best


def nearest(x: np.ndarray, cb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The nearest row of a codebook for every row of ``x``.

    The squared distance is summed coordinate by coordinate in float64 (NumPy's element-wise
    order, no FMA); a tie goes to the lowest index, as ``argmin``.

    Parameters
    ----------
    x : ndarray, shape [n, m]
        The points (converted to float64).
    cb : ndarray, shape [k, m], k >= 1
        The codebook (converted to float64).

    Returns
    -------
    idx : ndarray of int64, shape [n]
        Index of each point's nearest codebook row.
    dist : ndarray of float64, shape [n]
        Its squared distance.

    Raises
    ------
    ValueError
        ``x`` or ``cb`` of another shape, or not finite.
    """
    x = np.ascontiguousarray(x, dtype=np.float64)
    cb = np.ascontiguousarray(cb, dtype=np.float64)
    if x.ndim != 2 or cb.ndim != 2 or x.shape[1] != cb.shape[1] or not cb.shape[0]:
        raise ValueError(f"x [n, m] and cb [k >= 1, m]: got shapes {x.shape} and {cb.shape}")
    for name, a in (("x", x), ("cb", cb)):
        if not np.isfinite(a).all():
            raise ValueError(f"{name}: expected finite values, got NaN or Inf")
    idx = np.empty(x.shape[0], dtype=np.int64)
    dist = np.empty(x.shape[0], dtype=np.float64)
    _nearest_rows(x, cb, idx, dist)
    return idx, dist


def lloyd(x: np.ndarray, init: np.ndarray, iters: int) -> tuple[np.ndarray, list[float]]:
    """``iters`` Lloyd iterations on the rows of ``x`` from ``init``: (codebook float64
    ``[k, m]``, the MSE per coordinate before each iteration and after the last).  An empty
    cell keeps its point."""
    cb = np.array(init, dtype=np.float64)
    k, m = cb.shape
    hist = []
    for _ in range(iters):
        idx, dist = nearest(x, cb)
        hist.append(float(dist.mean() / m))
        cnt = np.bincount(idx, minlength=k).astype(np.float64)
        for j in range(m):
            s = np.bincount(idx, weights=x[:, j], minlength=k)
            cb[:, j] = np.where(cnt > 0, s / np.maximum(cnt, 1.0), cb[:, j])
    hist.append(float(nearest(x, cb)[1].mean() / m))
    return cb, hist


def fit_codebook(bits: int, m: int, d: int, *, n_points: int = N_POINTS, iters: int = ITERS,
                 seed: int = SEED) -> np.ndarray:
    """Fit the head-VQ codebook for ``(bits, m, d)``: Lloyd from the product codebook on
    ``n_points`` groups of ``√d·u`` (sample ``default_rng([seed, d, m])``), points sorted
    lexicographically, float32 ``[256, m]`` in ``√d·u`` units."""
    if (bits, m) not in CONFIGS or d not in HEAD_DIMS:
        raise ValueError(f"(bits, m, d): expected (bits, m) in {CONFIGS} and d in {HEAD_DIMS}, got {(bits, m, d)}")
    x = sphere_groups(d, m, n_points, [seed, d, m])
    cb, _ = lloyd(x, product_codebook(bits, m, d), iters)
    cb = cb.astype(np.float32)
    order = np.lexsort(cb.T[::-1])  # lexsort's last key is the primary one: coordinate 0 first
    return np.ascontiguousarray(cb[order])


def fit_all(**kwargs) -> dict[str, np.ndarray]:
    """Every shipped codebook, keyed by :func:`codebook_key` (``kwargs`` as :func:`fit_codebook`)."""
    return {codebook_key(b, m, d): fit_codebook(b, m, d, **kwargs) for b, m in CONFIGS for d in HEAD_DIMS}


def write_npz(path: str | pathlib.Path, arrays: dict[str, np.ndarray]) -> None:
    """``numpy.savez`` with reproducible bytes: members in key order, stored, fixed timestamps."""
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as z:
        for key in sorted(arrays):
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.ascontiguousarray(arrays[key]), allow_pickle=False)
            z.writestr(zipfile.ZipInfo(key + ".npy", date_time=(1980, 1, 1, 0, 0, 0)), buf.getvalue())


def main(argv: list[str] | None = None) -> int:
    """``python -m numba_kv.ops.headvq_fit [--out PATH]``: fit every codebook and write them."""
    ap = argparse.ArgumentParser(description="Fit the head VQ codebooks (numba_kv.ops.headvq).")
    ap.add_argument("--out", default=str(DATA_PATH))
    a = ap.parse_args(argv)
    books = {}
    for b, m in CONFIGS:
        for d in HEAD_DIMS:
            books[codebook_key(b, m, d)] = fit_codebook(b, m, d)
            print(f"{codebook_key(b, m, d)} done", flush=True)
    write_npz(a.out, books)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
