"""Vector quantization: nearest-codeword assignment, centroid accumulation, k-means++
seeding and decoding — the ops of a k-means (product) vector quantizer.

Data ``x`` is ``[R, n, d]`` (``R`` rows of ``n`` tokens).  Every token is cut into
``M = d / ds`` sub-vectors of ``ds`` channels (``M = 1``: whole-vector VQ as in gllm-kernels;
``M > 1``: product quantization).  Sub-space ``m`` of row ``r``
uses codebook ``g = r·M + m`` when ``codebooks`` holds ``R·M`` tables (one per row), or
``g = m`` when it holds ``M`` (shared by all rows).  Codes are uint8 (``K <= 256``).

Ops (CPU twin + CUDA kernel each, from the single-source per-item cores below):

* ``vq_assign``: ``codes[r, t, m] = argmin_k ‖x_rtm − C_g[k]‖²`` (ties → lowest ``k``,
  as in gllm-kernels) and ``dist[r, t, m]`` = that squared distance;
* ``vq_accumulate``: per-codeword sums and counts of the assigned sub-vectors (the
  M-step numerator/denominator); one work item per (codebook, channel), the only writer of
  its outputs, summing in token order: race-free and deterministic on both devices;
* ``kmeanspp_update``: ``min_d2 = min(min_d2, ‖x − c_new‖²)`` (k-means++ D² weights);
* ``vq_decode``: ``out[r, t, m·ds:(m+1)·ds] = C_g[codes[r, t, m]]``.

:func:`kmeans` drives them: k-means++ seeding (Arthur & Vassilvitskii 2007: each new
centre drawn with probability ∝ D²), then Lloyd iterations until the relative decrease of
the inertia falls below ``tol`` or the assignment stops changing, at most ``max_iter``;
empty clusters are re-seeded at the points farthest from their centre.  Sampling and the
``K × ds`` centroid division run on the host; the ``O(n·K·d)`` work runs on the data's
device (only codes, distances and the small sum tables cross).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import cuda, float32, int32, int64, prange, uint8

from .. import _backend
from .._jit import cpu_kernel, cuda_kernel, twin
from .._validate import check_bool, check_float_array, check_float_at_least, check_int
from ._exact import mul_rn
from ._index import unravel3
from ._registry import F32_3D, U8_3D, register
from .finite import check_finite_stats
from .gather import gather_rows, to_like

__all__ = ["kmeans", "assign", "decode", "KMEANS_MAX_ITER", "KMEANS_TOL"]

KMEANS_MAX_ITER = 100
KMEANS_TOL = 1e-4
_INF32 = np.float32(np.inf)


# --- single-source cores --------------------------------------------------------------
# One token ``(r, t)`` holds ``M`` sub-vectors; the token cores handle the ``span``
# sub-vectors from flat sub-vector ``e·span`` on (C order over ``[R, n, M]``; ``span``
# divides ``M``: ``[m0, m0 + span)`` of one token).  The CPU twins ``prange`` over tokens
# with the whole span (a call per token, not per sub-vector: the call and its index set-up
# cost as much as a short sub-vector's work), the CUDA kernels grid-stride over (token,
# sub-space) items with a span of one.  Accumulation items are (codebook g, channel j) on both.  Every output is
# computed with the same float32 operations in the same order on both twins.  Rows are read
# through views indexed from 0 (no negative-index wraparound code in the inner loops).
def _assign_span(x, codebooks, e, span, codes, dist):
    """Nearest codeword (ties: lowest ``k``) and its squared distance, sub-spaces ``[m0, m0 +
    span)`` of token ``(r, t)``."""
    ng, k_size, ds = codebooks.shape
    m_sub = x.shape[2] // ds
    r, t, m0 = unravel3(e * span, codes.shape[1], codes.shape[2])
    xr = x[r, t]
    cr = codes[r, t]
    dr = dist[r, t]
    for m in range(m0, m0 + span):
        tab = codebooks[r * m_sub + m if ng > m_sub else m]
        xs = xr[m * ds:m * ds + ds]
        best = _INF32
        bk = 0
        for k in range(k_size):
            s = float32(0.0)
            for j in range(ds):
                diff = xs[j] - tab[k, j]
                s += mul_rn(diff, diff)  # never an FMA (ops/_exact.py)
            if s < best:
                best = s
                bk = k
        cr[m] = uint8(bk)
        dr[m] = best


def _kmeanspp_span(x, centers, e, span, min_d2):
    """``min_d2 = min(min_d2, ‖x − centers[g]‖²)``, sub-spaces ``[m0, m0 + span)`` of token
    ``(r, t)``."""
    ng, ds = centers.shape
    m_sub = x.shape[2] // ds
    r, t, m0 = unravel3(e * span, min_d2.shape[1], min_d2.shape[2])
    xr = x[r, t]
    mr = min_d2[r, t]
    for m in range(m0, m0 + span):
        c = centers[r * m_sub + m if ng > m_sub else m]
        xs = xr[m * ds:m * ds + ds]
        s = float32(0.0)
        for j in range(ds):
            diff = xs[j] - c[j]
            s += mul_rn(diff, diff)
        if s < mr[m]:
            mr[m] = s


def _decode_span(codes, codebooks, e, span, out):
    """``out[r, t, m·ds:(m+1)·ds] = C_g[codes[r, t, m]]`` for sub-spaces ``[m0, m0 + span)``."""
    ng, k_size, ds = codebooks.shape
    m_sub = out.shape[2] // ds
    r, t, m0 = unravel3(e * span, codes.shape[1], codes.shape[2])
    for m in range(m0, m0 + span):
        g = r * m_sub + m if ng > m_sub else m
        c = codes[r, t, m]
        for j in range(ds):
            out[r, t, m * ds + j] = codebooks[g, c, j]


def _accumulate_item(x, codes, e, sums, counts):
    """Sums (and, for channel 0, counts) of codebook ``g``, channel ``j`` (item ``e``) over
    its member sub-vectors, in token order: one writer per output, no atomics."""
    rows, n, d = x.shape
    ng, k_size, ds = sums.shape
    m_sub = d // ds
    per_row = ng > m_sub
    g = e // ds
    j = e - g * ds
    m = g % m_sub if per_row else g
    r0 = g // m_sub if per_row else 0
    r1 = r0 + 1 if per_row else rows
    sg = sums[g]
    cg = counts[g]
    for r in range(r0, r1):
        xr = x[r]
        cr = codes[r]
        for t in range(n):
            c = int64(cr[t, m])
            sg[c, j] += xr[t, m * ds + j]
            if j == 0:
                cg[c] += int32(1)


assign_span_cpu, assign_span_dev = twin(_assign_span, inline=True)
kmeanspp_span_cpu, kmeanspp_span_dev = twin(_kmeanspp_span, inline=True)
decode_span_cpu, decode_span_dev = twin(_decode_span, inline=True)  # a few copies per call
accumulate_item_cpu, accumulate_item_dev = twin(_accumulate_item)


# --- CPU twins: prange over tokens (sub-vector spans) / (codebook, channel) items ------------
@cpu_kernel
def _vq_assign_cpu(x, codebooks, codes, dist):
    """CPU twin of :func:`_vq_assign_cuda`: ``prange`` over the ``R·n`` tokens."""
    for e in prange(codes.shape[0] * codes.shape[1]):
        assign_span_cpu(x, codebooks, e, codes.shape[2], codes, dist)


@cpu_kernel
def _vq_accumulate_cpu(x, codes, sums, counts):
    """CPU twin of :func:`_vq_accumulate_cuda`: ``prange`` over the ``G·ds`` (codebook, channel) pairs."""
    for e in prange(sums.shape[0] * sums.shape[2]):
        accumulate_item_cpu(x, codes, e, sums, counts)


@cpu_kernel
def _kmeanspp_update_cpu(x, centers, min_d2):
    """CPU twin of :func:`_kmeanspp_update_cuda`: ``prange`` over the ``R·n`` tokens."""
    for e in prange(min_d2.shape[0] * min_d2.shape[1]):
        kmeanspp_span_cpu(x, centers, e, min_d2.shape[2], min_d2)


@cpu_kernel
def _vq_decode_cpu(codes, codebooks, out):
    """CPU twin of :func:`_vq_decode_cuda`: ``prange`` over the ``R·n`` tokens."""
    for e in prange(codes.shape[0] * codes.shape[1]):
        decode_span_cpu(codes, codebooks, e, codes.shape[2], out)


# --- CUDA kernels: grid-stride over (token, sub-space) / (codebook, channel) items ---------
@cuda_kernel
def _vq_assign_cuda(x, codebooks, codes, dist):
    """1-D grid over the ``R·n·M`` sub-vectors; one thread scans the ``K`` codewords of one."""
    for e in range(cuda.grid(1), codes.shape[0] * codes.shape[1] * codes.shape[2], cuda.gridsize(1)):
        assign_span_dev(x, codebooks, e, 1, codes, dist)


@cuda_kernel
def _vq_accumulate_cuda(x, codes, sums, counts):
    """1-D grid over the ``G·ds`` (codebook, channel) pairs; one thread sums one channel of
    one codebook over its member tokens (the only writer of ``sums[g, :, j]``; deterministic)."""
    for e in range(cuda.grid(1), sums.shape[0] * sums.shape[2], cuda.gridsize(1)):
        accumulate_item_dev(x, codes, e, sums, counts)


@cuda_kernel
def _kmeanspp_update_cuda(x, centers, min_d2):
    """1-D grid over the ``R·n·M`` sub-vectors; one thread updates the D² weight of one."""
    for e in range(cuda.grid(1), min_d2.shape[0] * min_d2.shape[1] * min_d2.shape[2], cuda.gridsize(1)):
        kmeanspp_span_dev(x, centers, e, 1, min_d2)


@cuda_kernel
def _vq_decode_cuda(codes, codebooks, out):
    """1-D grid over the ``R·n·M`` sub-vectors; one thread copies the codeword of one."""
    for e in range(cuda.grid(1), codes.shape[0] * codes.shape[1] * codes.shape[2], cuda.gridsize(1)):
        decode_span_dev(codes, codebooks, e, 1, out)


_VQ_ASSIGN = register("vq_assign", _vq_assign_cpu, _vq_assign_cuda, [f"void({F32_3D}, {F32_3D}, {U8_3D}, {F32_3D})"])
_VQ_ACCUMULATE = register("vq_accumulate", _vq_accumulate_cpu, _vq_accumulate_cuda,
                          [f"void({F32_3D}, {U8_3D}, float64[:, :, ::1], int32[:, ::1])"],
                          float32_only=False)  # float64 sums on purpose (accumulate_into); fitting, not decoding
_KMEANSPP_UPDATE = register("kmeanspp_update", _kmeanspp_update_cpu, _kmeanspp_update_cuda,
                            [f"void({F32_3D}, float32[:, ::1], {F32_3D})"])
_VQ_DECODE = register("vq_decode", _vq_decode_cpu, _vq_decode_cuda, [f"void({U8_3D}, {F32_3D}, {F32_3D})"])


# --- internal entry points (callers validated: float32 C-contiguous, one device) ------------
def assign_into(x3: Any, codebooks: Any, codes: Any, dist: Any) -> None:
    """Nearest codeword of every sub-vector (see module docstring)."""
    rows, n, d = x3.shape
    m_sub = d // codebooks.shape[2]
    if rows * n * m_sub == 0:
        return
    _VQ_ASSIGN.launch(_backend.device_of("x3", x3), rows * n * m_sub, x3, codebooks, codes, dist,
                      work=rows * n * d * codebooks.shape[1])


def accumulate_into(x3: Any, codes: Any, sums: Any, counts: Any) -> None:
    """Add every sub-vector to ``sums[g, code]`` (float64) and count it in ``counts``
    (int32; outputs zeroed by the caller).  float64 sums: a float32 running sum stops
    growing once it is 2**24 times the values added (a cluster of ~10M points of 1.0 came out
    at half its mean)."""
    if np.dtype(sums.dtype) != np.float64:
        raise TypeError(f"sums: expected dtype float64, got {sums.dtype}")
    rows, n, d = x3.shape
    if rows * n * d == 0:
        return
    _VQ_ACCUMULATE.launch(_backend.device_of("x3", x3), sums.shape[0] * sums.shape[2], x3, codes, sums, counts,
                          work=rows * n * d)


def kmeanspp_update_into(x3: Any, centers: Any, min_d2: Any) -> None:
    """``min_d2 = min(min_d2, ‖x − centers[g]‖²)`` for every sub-vector."""
    rows, n, d = x3.shape
    m_sub = d // centers.shape[1]
    if rows * n * m_sub == 0:
        return
    _KMEANSPP_UPDATE.launch(_backend.device_of("x3", x3), rows * n * m_sub, x3, centers, min_d2, work=rows * n * d)


def decode_into(codes: Any, codebooks: Any, out: Any) -> None:
    """``out`` ``[R, n, d]`` ← codewords of ``codes`` ``[R, n, M]``."""
    rows, n, d = out.shape
    if rows * n * d == 0:
        return
    _VQ_DECODE.launch(_backend.device_of("out", out), rows * n * codes.shape[2], codes, codebooks, out,
                      work=rows * n * d)


def _gather_subvectors(x3: Any, flat_rows: np.ndarray, ds: int) -> Any:
    """Sub-vectors ``x3`` viewed as ``[R·n·M, ds]`` rows, gathered at ``flat_rows``."""
    rows, n, d = x3.shape
    src = x3.reshape(rows * n * (d // ds), ds)
    if isinstance(src, np.ndarray):  # host data: plain indexing, no parallel region per draw
        return src[flat_rows]
    if int(src.shape[0]) > 2 ** 31 - 1:  # (the device gather's row indices are int32: they would wrap)
        raise ValueError(f"x: {int(src.shape[0]):,} sub-vectors; k-means on a device gathers among at most "
                         f"2**31 - 1 (int32 row indices): fit on fewer tokens, or on the host")
    idx = to_like(x3, flat_rows.astype(np.int32))
    out = _backend.empty(x3, (flat_rows.shape[0], ds), np.float32)
    gather_rows(src, idx, out)
    return _backend.to_host(out)


def _group_members(rows: int, n: int, m_sub: int, g: int, per_row: bool) -> np.ndarray:
    """Flat sub-vector row indices ``(r·n + t)·M + m`` belonging to codebook ``g``."""
    if per_row:
        r, m = divmod(g, m_sub)
        return (r * n + np.arange(n)) * m_sub + m
    return np.arange(rows * n) * m_sub + g


def kmeans(x3: Any, codebook_size: int, ds: int, per_row: bool, *, max_iter: int = KMEANS_MAX_ITER,
           tol: float = KMEANS_TOL, seed: int = 0) -> tuple[np.ndarray, int]:
    """Fit (product) k-means codebooks on the device of ``x3``.

    Parameters
    ----------
    x3 : float32 array, shape ``(R, n, d)``, C-contiguous
        NumPy → CPU twins; CUDA array → CUDA kernels.
    codebook_size : int
        ``K`` in ``1..256``.
    ds : int
        Sub-vector width; ``d % ds == 0``.
    per_row : bool
        One codebook set per row (``R·M`` tables) or one shared by all rows (``M``).
    max_iter, tol : int, float
        Lloyd stops after ``max_iter`` iterations (``>= 0``; 0: the k-means++ seeds alone),
        when the assignment no longer changes, or when the inertia decreases by less than
        ``tol`` (relative, ``>= 0``).
    seed : int
        Seed of the k-means++ draws (deterministic), ``>= 0``.

    Returns
    -------
    codebooks : float32 host array, shape ``(G, K, ds)``
    iterations : int
        Lloyd iterations run.

    Raises
    ------
    TypeError
        ``x3`` not a float array; ``per_row`` not a bool; ``max_iter``, ``seed`` not ints;
        ``tol`` not a real number.
    ValueError
        ``x3`` not 3-D, ``codebook_size`` outside ``1..256``, ``ds`` not dividing ``d``,
        ``max_iter``, ``seed`` or ``tol`` negative (``tol`` NaN), NaN or Inf in ``x3``, or
        values beyond ``sqrt(float32 max / (4·ds))`` (see :func:`assign`).
    """
    if not hasattr(x3, "shape") or not hasattr(x3, "dtype"):
        raise TypeError(f"x3: expected a float array (NumPy or CUDA), got {type(x3).__name__}")
    check_float_array("x3", x3, ndim=3)
    rows, n, d = x3.shape
    per_row = check_bool("per_row", per_row)  # a truthy string must not switch per-row codebooks on
    max_iter = check_int("max_iter", max_iter, minimum=0)
    tol = check_float_at_least("tol", tol)  # (NaN would silently disable the inertia stop rule)
    seed = check_int("seed", seed, minimum=0)
    if isinstance(codebook_size, bool) or not isinstance(codebook_size, (int, np.integer)) \
            or not 1 <= int(codebook_size) <= 256:
        raise ValueError(f"codebook_size: expected an int in 1..256 (uint8 codes), got {codebook_size!r}")
    if isinstance(ds, bool) or not isinstance(ds, (int, np.integer)) or int(ds) < 1 or d % int(ds):
        raise ValueError(f"ds: expected a sub-vector width dividing d={d}, got {ds!r}")
    ds = int(ds)
    # codewords are means of the data: within its range, so |x − c| <= 2·max|x|
    _check_distance_range(check_finite_stats("x3", x3).amax, ds, "x3")
    m_sub = d // ds
    ng = rows * m_sub if per_row else m_sub
    k_size = int(codebook_size)
    rng = np.random.default_rng(seed)
    members = [_group_members(rows, n, m_sub, g, per_row) for g in range(ng)]

    # --- k-means++ seeding: all codebooks advance together, one centre per step -----------
    cb = np.zeros((ng, k_size, ds), np.float32)
    first = np.array([mem[rng.integers(mem.shape[0])] for mem in members])
    cb[:, 0] = _gather_subvectors(x3, first, ds)
    min_d2 = to_like(x3, np.full((rows, n, m_sub), np.inf, np.float32))
    for k in range(1, k_size):
        kmeanspp_update_into(x3, to_like(x3, cb[:, k - 1]), min_d2)
        w_all = _backend.to_host(min_d2).reshape(-1).astype(np.float64)
        pick = np.empty(ng, np.int64)
        for g, mem in enumerate(members):
            w = w_all[mem]
            tot = w.sum()
            # all points already covered (fewer distinct points than K): any point will do
            j = rng.integers(mem.shape[0]) if not tot > 0 else \
                int(np.searchsorted(np.cumsum(w), rng.random() * tot, side="right"))
            pick[g] = mem[min(j, mem.shape[0] - 1)]
        cb[:, k] = _gather_subvectors(x3, pick, ds)

    # --- Lloyd ------------------------------------------------------------------------
    codes = _backend.empty(x3, (rows, n, m_sub), np.uint8)
    dist = _backend.empty(x3, (rows, n, m_sub), np.float32)
    prev_codes: np.ndarray | None = None
    prev_inertia = np.inf
    iterations = 0
    for it in range(1, max_iter + 1):
        iterations = it
        assign_into(x3, to_like(x3, cb), codes, dist)
        h_codes = _backend.to_host(codes).copy()
        h_dist = _backend.to_host(dist).astype(np.float64)
        inertia = float(h_dist.sum())
        if prev_codes is not None and (np.array_equal(h_codes, prev_codes)
                                       or prev_inertia - inertia <= tol * max(prev_inertia, 1e-30)):
            break
        prev_codes, prev_inertia = h_codes, inertia
        sums = _backend.zeros(x3, (ng, k_size, ds), np.float64)
        counts = _backend.zeros(x3, (ng, k_size), np.int32)
        accumulate_into(x3, codes, sums, counts)
        h_sums = _backend.to_host(sums).astype(np.float64)
        h_counts = _backend.to_host(counts)
        filled = h_counts > 0
        new = cb.copy()
        new[filled] = (h_sums[filled] / h_counts[filled][:, None]).astype(np.float32)
        # empty clusters: move to the points worst served by their current centre
        flat_dist = h_dist.reshape(-1)
        for g in np.nonzero((~filled).any(axis=1))[0]:
            empty = np.nonzero(~filled[g])[0]
            mem = members[g]
            far = mem[np.argsort(-flat_dist[mem], kind="stable")[: empty.shape[0]]]
            if far.shape[0]:
                new[g, empty[: far.shape[0]]] = _gather_subvectors(x3, far, ds)
        cb = new
    return cb, iterations


# --- public API ------------------------------------------------------------------------
def _check_distance_range(span: float, ds: int, names: str) -> None:
    """``ValueError`` unless every squared distance of a ``ds``-wide sub-vector, whose
    coordinates differ by at most ``2·span``, stays below the float32 maximum: past it every
    candidate's distance is inf, and the first codeword won whatever the data."""
    limit = float(np.sqrt(np.finfo(np.float32).max / (4.0 * ds)))
    if span > limit:
        raise ValueError(f"{names}: expected |values| <= {limit:.3g} for sub-vectors of {ds} (squared distances "
                         f"overflow float32 beyond), got max |value| = {span:.3g}")


def _check_codebooks(x3: Any, codebooks: Any) -> tuple[int, int]:
    rows, n, d = x3.shape
    if len(codebooks.shape) != 3:
        raise ValueError(f"codebooks: expected 3-D (G, K, ds), got shape {tuple(codebooks.shape)}")
    ng, k_size, ds = codebooks.shape
    if ds < 1 or d % ds:
        raise ValueError(f"codebooks: expected a sub-vector width ds dividing d={d}, got ds={ds}")
    m_sub = d // ds
    if ng not in (m_sub, rows * m_sub):
        raise ValueError(f"codebooks: expected G = M = {m_sub} (shared) or R·M = {rows * m_sub} (per row), "
                         f"got G={ng}")
    if not 1 <= k_size <= 256:
        raise ValueError(f"codebooks: expected 1..256 codewords, got K={k_size}")
    return m_sub, k_size


def assign(x: Any, codebooks: Any) -> tuple[Any, Any]:
    """Nearest codeword of every sub-vector.

    Parameters
    ----------
    x : float array, shape ``(R, n, d)``
    codebooks : float32 array, shape ``(G, K, ds)``
        ``G = M`` (shared) or ``R·M`` (per row), ``M = d / ds``, ``K <= 256``.

    Returns
    -------
    codes : uint8 array, shape ``(R, n, M)``
    dist : float32 array, shape ``(R, n, M)``
        Squared Euclidean distance to the chosen codeword.

    Raises
    ------
    ValueError
        Bad shapes, NaN or Inf, or values beyond ``sqrt(float32 max / (4·ds))`` (about
        ``9.2e18`` for ``ds = 1``): squared distances would overflow and every codeword tie.
    """
    _backend.resolve_device("auto", x=x, codebooks=codebooks)
    if len(x.shape) != 3:
        raise ValueError(f"x: expected a 3-D array (R, n, d), got shape {tuple(x.shape)}")
    x3 = _backend.ascontiguous_f32("x", x)
    cbs = _backend.ascontiguous_f32("codebooks", codebooks)
    m_sub, _ = _check_codebooks(x3, cbs)
    span = max(check_finite_stats("x", x3).amax, check_finite_stats("codebooks", cbs).amax)
    _check_distance_range(span, int(cbs.shape[2]), "x, codebooks")
    rows, n, _ = x3.shape
    codes = _backend.empty(x3, (rows, n, m_sub), np.uint8)
    dist = _backend.empty(x3, (rows, n, m_sub), np.float32)
    assign_into(x3, cbs, codes, dist)
    return codes, dist


def decode(codes: Any, codebooks: Any) -> Any:
    """Codewords of ``codes``: the inverse of :func:`assign`.

    Parameters
    ----------
    codes : uint8 array, shape ``(R, n, M)``
    codebooks : float32 array, shape ``(G, K, ds)``

    Returns
    -------
    x_hat : float32 array, shape ``(R, n, M·ds)``.

    Raises
    ------
    TypeError
        ``codes`` not uint8.
    ValueError
        ``codes`` not 3-D, ``codebooks`` not ``(G, K, ds)`` with ``G = M`` or ``R·M``, or a
        code ``>= K`` (the kernels would read past the codebook).
    """
    _backend.resolve_device("auto", codes=codes, codebooks=codebooks)
    if np.dtype(codes.dtype) != np.uint8:
        raise TypeError(f"codes: expected a 3-D uint8 array, got {np.dtype(codes.dtype)} "
                        f"{tuple(codes.shape)}")
    if len(codes.shape) != 3:
        raise ValueError(f"codes: expected a 3-D uint8 array, got shape {tuple(codes.shape)} ({len(codes.shape)}-D)")
    cbs = _backend.ascontiguous_f32("codebooks", codebooks)
    rows, n, m_sub = codes.shape
    if len(cbs.shape) != 3 or cbs.shape[0] not in (m_sub, rows * m_sub) or not 1 <= cbs.shape[1] <= 256:
        raise ValueError(f"codebooks: expected (G, K, ds) with G = M = {m_sub} (shared) or R·M = {rows * m_sub} "
                         f"(per row) and K in 1..256, got shape {tuple(cbs.shape)}")
    k_size = int(cbs.shape[1])
    # every code indexes a codeword: the kernels do not bound-check (one small read of the codes)
    top = 0
    if k_size < 256 and rows * n * m_sub:
        xp = _backend.xp_of(codes)
        top = int(xp.max(codes)) if xp is not None else int(_backend.to_host(codes).max())
    if top >= k_size:
        raise ValueError(f"codes: expected values < K={k_size} (the codewords per codebook), got {top}")
    d = m_sub * cbs.shape[2]
    out = _backend.empty(codes, (rows, n, d), np.float32)
    decode_into(codes, cbs, out)
    return out
