"""Candidate grid of the head VQ code's nearest-point search (:mod:`numba_kv.ops.headvq`).

The head VQ code picks, for every group of ``m`` rotated coordinates, the nearest of 256
points.  A full search computes 256 distances per group, which made quantizing the VQ code
8× (natively) to 20× (AVX2) slower than the scalar head code, and a ``kv3`` decode step 2–3×
a ``kv4`` one.  A grid over the group's coordinates lists, per cell, every point that can
be the nearest somewhere in the cell; the search computes the distances to those points
only, in increasing index order, with the full search's float32 operations and its tie
rule (the lowest index), so the codes are bit for bit the full search's.  For uniform unit
vectors a group looks at about 2 points (pairs) or 8 (quads) instead of 256.

**Cells.**  ``G`` cells per axis over ``[−span, span]`` in the codebook's ``√d·u`` units
(pairs: ``G = 64``, ``span = 3``; quads: ``G = 10``, ``span = 2.5``), the outermost cells
unbounded outwards, ``G**m`` cells in all.  A coordinate ``y`` (in the units of the rotated
unit vector) falls in cell ``clamp(int(y·a + b), 0, G − 1)`` along its axis, ``a = √d·G/(2·span)``
and ``b = G/2`` in float32 (:data:`GRID_PARAMS` row: ``a``, ``b``, ``G``).

**Why the lists are complete.**  A point ``p`` is the nearest at ``y`` only if ``y`` lies in
every half-space ``H_pq = {y : 2⟨y, q − p⟩ <= ‖q‖² − ‖p‖²}``; so ``p`` is left out of a cell
only when some ``H_pq`` misses the cell (the minimum of the linear form over the box is past
the bound), or — for a bounded cell — when ``p`` is farther from the whole cell than the
farthest corner of some other point (``min_{y∈C} ‖y − p‖² > min_q max_{y∈C} ‖y − q‖²``).  Two
margins make this hold for the op's float32 arithmetic:

* each cell is widened by ``1e-3`` of a cell on every side: ``y·a + b`` is computed in float32
  (values below ``2G``) within ``2·2G·2⁻²⁴`` (under ``1e-5``) of a cell boundary's true side;
* every test has a slack of ``1e-5``: the op's squared distance ``s`` (``e = y − c`` rounded,
  products rounded, sums rounded) is within ``5·2⁻²⁴·D`` of the exact ``D`` of the same
  float32 ``y`` and ``c``, and ``D <= (1 + max‖c‖)² < 4`` (a group of a unit vector, points
  inside the unit ball in these units), so a point the float32 comparison prefers to ``q`` has
  ``D_p <= D_q + 2.4e-6``.

**The search** (:func:`_grid_nearest`, one group; :func:`nearest_lanes`, a CPU tile of
vectors side by side) lives here too, as twin cores the quantizer calls.

The tests compare the grid search with the full search on random, boundary and clamped
vectors for every codebook (``tests/ops/test_headvq_grid.py``).
"""

from __future__ import annotations

import math
import threading

import numpy as np
from numba import int32, uint8

from .._jit import cpu_serial, twin
from ._exact import mul_rn

__all__ = ["GRID_PARAMS", "MARGIN", "SLACK", "grid_nearest_cpu", "grid_nearest_dev", "nearest_lanes",
           "nearest_lanes_cpu", "search_grid"]

#: ``(G, span, P)`` per group size ``m``: cells per axis, the covered range in ``√d·u`` units,
#: and the slots per cell (a cell's first ``P`` candidates, padded: a fixed-length loop the
#: CPU twin vectorizes across vectors; a group of a uniform unit vector has more than ``P``
#: candidates in 0.0 % (pairs) and 4 % (quads) of cases, searched by a tail loop)
GRID_PARAMS = {2: (64, 3.0, 4), 4: (10, 2.5, 12)}
#: widening of every cell, in cells, on each side (covers float32 rounding of ``y·a + b``)
MARGIN = 1e-3
#: slack of the exclusion tests (covers float32 squared distances; see the module docstring)
SLACK = 1e-5

_LOCK = threading.Lock()
_GRIDS: dict[bytes, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}
_BY_ID: dict[int, tuple] = {}  # id(read-only codebook) -> (the codebook, d, its grid)


@cpu_serial
def _candidates(c, lo, hi, slack, order):
    """``out[i, p]``: whether point ``p`` of ``c`` ``[K, m]`` (float64) can be the nearest
    somewhere in the box ``lo[i] <= y <= hi[i]`` (float64 ``[cells, m]``, ``±inf`` allowed).
    ``order[p]``: the points by distance from ``p`` (a half-space that excludes ``p`` is
    usually a near neighbour's: the test stops early)."""
    k_size, m = c.shape
    n = lo.shape[0]
    out = np.zeros((n, k_size), np.bool_)
    nrm = np.zeros(k_size)
    for k in range(k_size):
        for j in range(m):
            nrm[k] += c[k, j] * c[k, j]
    for i in range(n):
        ub = np.inf  # min over points of the farthest squared distance from the box (inf: unbounded)
        for q in range(k_size):
            far = 0.0
            for j in range(m):
                f = max(abs(c[q, j] - lo[i, j]), abs(c[q, j] - hi[i, j]))
                far += f * f
            ub = min(ub, far)
        for p in range(k_size):
            near = 0.0
            for j in range(m):
                f = max(lo[i, j] - c[p, j], 0.0, c[p, j] - hi[i, j])
                near += f * f
            if near > ub + slack:
                continue
            ok = True
            for qi in range(k_size):
                q = order[p, qi]
                if q == p:
                    continue
                low = 0.0  # min over the box of 2<y, q - p> (-inf where the box is unbounded that way)
                for j in range(m):
                    a = 2.0 * (c[q, j] - c[p, j])
                    if a > 0.0:
                        low += a * lo[i, j]
                    elif a < 0.0:
                        low += a * hi[i, j]
                if low > nrm[q] - nrm[p] + slack:
                    ok = False
                    break
            out[i, p] = ok
    return out


def _build(cents: np.ndarray, d: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The grid of :func:`search_grid`, built (uncached)."""
    m = int(cents.shape[1])
    g, span, p = GRID_PARAMS[m]
    a = np.float32(math.sqrt(d) * g / (2.0 * span))
    b = np.float32(g / 2)
    # cell i of an axis holds y·a + b in [i, i + 1): y in [(i − b)/a, (i + 1 − b)/a), widened
    i = np.arange(g, dtype=np.float64)
    lo1 = (i - MARGIN - float(b)) / float(a)
    hi1 = (i + 1 + MARGIN - float(b)) / float(a)
    lo1[0], hi1[-1] = -np.inf, np.inf
    idx = np.stack([ax.ravel() for ax in np.meshgrid(*[np.arange(g)] * m, indexing="ij")], axis=-1)
    c64 = np.asarray(cents, np.float64)
    order = np.argsort(((c64[:, None] - c64[None]) ** 2).sum(-1), axis=1, kind="stable")
    mask = _candidates(c64, lo1[idx], hi1[idx], SLACK, order)
    counts = mask.sum(axis=1)
    offsets = np.zeros(len(counts) + 1, np.int32)
    np.cumsum(counts, out=offsets[1:])
    cand = np.nonzero(mask)[1].astype(np.uint8)  # row-major: each cell's points in index order
    # slot j of a cell: its candidate j, or (past its count) its first one again, whose
    # distance is then computed twice: equal, never strictly smaller, so nothing changes
    j = np.arange(p)[None, :]
    slots = cand[offsets[:-1, None] + np.where(j < counts[:, None], j, 0)].ravel()
    params = np.array([a, b, g, p], np.float32)
    for arr in (params, offsets, cand, slots):
        arr.flags.writeable = False
    return params, offsets, cand, slots


def search_grid(cents: np.ndarray, d: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The candidate grid of the nearest-point search on ``cents`` at head dimension ``d``.

    Parameters
    ----------
    cents : float32 array, shape ``(256, m)``
        The kernels' codebook in the units of the rotated vector
        (:func:`~numba_kv.ops.headvq.headvq_centroids`), ``m`` 2 or 4.
    d : int
        Head dimension (sets the cell width in those units).

    Returns
    -------
    params : float32 array, shape ``(4,)``
        ``a``, ``b``, ``G`` and ``P``: a coordinate ``y`` is in cell ``clamp(int(y·a + b), 0,
        G − 1)`` along its axis; the cell of a group is ``((i₀·G + i₁)·G + i₂)·G + i₃`` (two
        axes for pairs).
    offsets : int32 array, shape ``(G**m + 1,)``
        Cell ``c``'s candidates are ``cand[offsets[c] : offsets[c + 1]]``.
    cand : uint8 array
        Point indices, increasing within each cell.
    slots : uint8 array, shape ``(G**m · P,)``
        ``slots[c·P + j]``: candidate ``j`` of cell ``c`` for ``j`` below its count, else its
        first candidate; a search takes the ``P`` slots, then ``cand[offsets[c] + P :
        offsets[c + 1]]``.

    Built once per codebook and head dimension (0.03 s for pairs, 0.3 s for quads on a
    2-vCPU AMD EPYC) and kept; the arrays are read-only.
    """
    same = _BY_ID.get(id(cents))  # (the caches pass the one cached codebook array: no hashing)
    if same is not None and same[0] is cents and same[1] == d:
        return same[2]
    key = np.ascontiguousarray(cents, np.float32).tobytes() + int(d).to_bytes(4, "little")
    hit = _GRIDS.get(key)
    if hit is None:
        with _LOCK:
            hit = _GRIDS.get(key)
            if hit is None:
                hit = _GRIDS[key] = _build(np.asarray(cents, np.float32), int(d))
    if not cents.flags.writeable:  # (a writeable array could change under the same id)
        _BY_ID[id(cents)] = (cents, d, hit)
    return hit


# --- the search (cores of the head VQ quantizer, numba_kv.ops.headvq) --------------------------
_INF32 = np.float32(np.inf)
_SLOTS2 = GRID_PARAMS[2][2]
_SLOTS4 = GRID_PARAMS[4][2]


def _dist2(y0, y1, c0, c1):
    """Squared distance of ``(y0, y1)`` to the point ``(c0, c1)``: ``d₀² + d₁²``, products
    rounded first (the full search's operations)."""
    e0 = y0 - c0
    e1 = y1 - c1
    return mul_rn(e0, e0) + mul_rn(e1, e1)


def _dist4(y0, y1, y2, y3, c0, c1, c2, c3):
    """:func:`_dist2` of a quad: ``((d₀² + d₁²) + d₂²) + d₃²``."""
    e2 = y2 - c2
    e3 = y3 - c3
    return (_dist2(y0, y1, c0, c1) + mul_rn(e2, e2)) + mul_rn(e3, e3)


def _grid_nearest(t, o, stride, m, cf, gpar, slots, goff, gcand):
    """Index of the point nearest to the group whose coordinates are ``t[o + i·stride]``
    (``i < m``), among the candidates of its grid cell (``gpar``, ``slots``, ``goff``,
    ``gcand`` of :func:`~numba_kv.ops.headvq_grid.search_grid`; ``cf`` the codebook flat,
    ``k·m + i``): the cell's ``P`` slots (a loop of fixed length: no branch to mispredict),
    then its rare candidates past ``P``, each in increasing index order, keeping a strictly
    smaller distance — the full search's result bit for bit (ties → the lowest index), as
    every point that can be nearest in the cell is a candidate."""
    a = gpar[0]
    b = gpar[1]
    gn = int32(gpar[2])
    y0 = t[o]
    y1 = t[o + stride]
    cell = _cell_axis(y0, a, b, gn) * gn + _cell_axis(y1, a, b, gn)
    best = _INF32
    bk = int32(0)
    if m == 2:
        for e in range(_SLOTS2):
            k = int32(slots[cell * _SLOTS2 + e])
            s = _dist2(y0, y1, cf[2 * k], cf[2 * k + 1])
            less = s < best
            best = s if less else best
            bk = k if less else bk
        for e in range(goff[cell] + _SLOTS2, goff[cell + 1]):
            k = int32(gcand[e])
            s = _dist2(y0, y1, cf[2 * k], cf[2 * k + 1])
            less = s < best
            best = s if less else best
            bk = k if less else bk
        return bk
    y2 = t[o + 2 * stride]
    y3 = t[o + 3 * stride]
    cell = (cell * gn + _cell_axis(y2, a, b, gn)) * gn + _cell_axis(y3, a, b, gn)
    for e in range(_SLOTS4):
        k = int32(slots[cell * _SLOTS4 + e])
        c = 4 * k
        s = _dist4(y0, y1, y2, y3, cf[c], cf[c + 1], cf[c + 2], cf[c + 3])
        less = s < best
        best = s if less else best
        bk = k if less else bk
    for e in range(goff[cell] + _SLOTS4, goff[cell + 1]):
        k = int32(gcand[e])
        c = 4 * k
        s = _dist4(y0, y1, y2, y3, cf[c], cf[c + 1], cf[c + 2], cf[c + 3])
        less = s < best
        best = s if less else best
        bk = k if less else bk
    return bk


def _cell_axis(y, a, b, gn):
    """Cell of coordinate ``y`` along one axis of the candidate grid
    (:mod:`numba_kv.ops.headvq_grid`): ``clamp(int(y·a + b), 0, G − 1)``, float32 (the
    product rounded first, in both twins; the grid's margin would cover a fused one too)."""
    return min(max(int32(mul_rn(y, a) + b), int32(0)), gn - int32(1))


def nearest_lanes(t, d, L, nl, m, cf, gpar, slots, goff, gcand, ib, cell, best):
    """The nearest point of every group of a CPU tile of vectors: ``ib[g·L + l]`` =
    :func:`_grid_nearest` of group ``g`` of lane ``l < nl``.

    Pairs: the lanes side by side — per group every lane's cell, then each of the cell's ``P``
    slots for every lane (a loop over the lanes with gathered points, which vectorizes), then
    the rare candidates past ``P`` lane by lane.  Per lane the candidates come in the order of
    :func:`_grid_nearest` and a strictly smaller distance wins: the same index bit for bit.
    About 1.2× the lane-by-lane search's pairs a second, natively and with AVX2 code
    generation (2-vCPU AMD EPYC, d = 128, ``benchmarks/ab_headvq.py``).  Quads (12 slots of
    four gathered coordinates each): lane by lane, each search in registers — side by side
    they ran 1.9× slower.

    Parameters
    ----------
    t : float32 array, shape ``((d + 3)·L,)``
        The tile: coordinate ``j`` of lane ``l`` at ``t[j·L + l]`` (rows past ``d`` unread).
    d, L, nl, m : int
        Head dimension, lanes of the tile, live lanes (``nl <= L``), group size (2 or 4).
    cf : float32 array, shape ``(256·m,)``
        The codebook flat (point ``k`` at ``cf[k·m : k·m + m]``).
    gpar, slots, goff, gcand : arrays
        The candidate grid of :func:`search_grid` for that codebook and ``d``.
    ib : uint8 array, shape ``(d/m·L,)``
        Output: the point index of group ``g`` of lane ``l`` at ``ib[g·L + l]``.
    cell : int64 array, shape ``(L,)``
        Scratch (pairs): each lane's cell.
    best : float32 array, shape ``(L,)``
        Scratch (pairs): each lane's smallest distance so far.
    """
    if m != 2:
        for g in range(d // m):
            for l in range(nl):
                ib[g * L + l] = uint8(_grid_nearest(t, g * m * L + l, L, m, cf, gpar, slots, goff, gcand))
        return
    a = gpar[0]
    b = gpar[1]
    gn = int32(gpar[2])
    for g in range(d // 2):
        o = g * 2 * L
        ig = ib[g * L:(g + 1) * L]
        for l in range(nl):
            cell[l] = _cell_axis(t[o + l], a, b, gn) * gn + _cell_axis(t[o + L + l], a, b, gn)
            best[l] = _INF32
            ig[l] = uint8(0)
        for e in range(_SLOTS2):
            for l in range(nl):
                k = int32(slots[cell[l] * _SLOTS2 + e])
                s = _dist2(t[o + l], t[o + L + l], cf[2 * k], cf[2 * k + 1])
                less = s < best[l]
                best[l] = s if less else best[l]
                ig[l] = uint8(k) if less else ig[l]
        for l in range(nl):  # cells with more than _SLOTS2 candidates
            for e in range(goff[cell[l]] + _SLOTS2, goff[cell[l] + 1]):
                k = int32(gcand[e])
                s = _dist2(t[o + l], t[o + L + l], cf[2 * k], cf[2 * k + 1])
                if s < best[l]:
                    best[l] = s
                    ig[l] = uint8(k)


twin(_cell_axis, inline=True)
twin(_dist2, inline=True)
twin(_dist4, inline=True)
grid_nearest_cpu, grid_nearest_dev = twin(_grid_nearest)
nearest_lanes_cpu, _ = twin(nearest_lanes)
