"""The head VQ code's candidate grid (numba_kv.ops.headvq_grid): the grid search returns the
full search's point bit for bit — on random groups, on cell and Voronoi boundaries, outside
the grid's span — for every codebook; the tables' structure; the op against the reference."""

import math

import numpy as np
import pytest

from numba_kv import reference
from numba_kv.ops import headquant as hq
from numba_kv.ops import headvq as hv
from numba_kv.ops.headvq_grid import GRID_PARAMS, grid_nearest_cpu, nearest_lanes_cpu, search_grid

CONFIGS = [(4, 2), (2, 4)]


def full_search(y, cents):
    """The nearest point of every row of ``y`` ``[n, m]`` (float32) by the op's float32
    arithmetic over all 256 points: ``e = y − c`` rounded, products rounded, summed in
    coordinate order; ``argmin`` takes the first (lowest) index of a tie.  NumPy, no library
    code."""
    e = y[:, None, :].astype(np.float32) - cents[None].astype(np.float32)
    sq = e * e
    s = sq[..., 0] + sq[..., 1]
    for i in range(2, y.shape[1]):
        s = s + sq[..., i]
    return np.argmin(s, axis=1)


def grid_search(y, cents, d):
    """:func:`numba_kv.ops.headvq_grid._grid_nearest` (CPU twin) on every row of ``y``."""
    gpar, goff, gcand, slots = search_grid(cents, d)
    m = cents.shape[1]
    cf = np.ascontiguousarray(cents).reshape(-1)
    flat = np.ascontiguousarray(y, np.float32).reshape(-1)
    return np.array([grid_nearest_cpu(flat, r * m, 1, m, cf, gpar, slots, goff, gcand) for r in range(len(y))])


def boundary_groups(rng, cents, d, n):
    """Groups on the grid's cell boundaries (``y·a + b`` an integer, ± a few ulps) and on
    Voronoi boundaries (midpoints of a point and one of its nearest neighbours, ± a few ulps,
    which ties two points in float32 now and then)."""
    gpar = search_grid(cents, d)[0]
    a, b, g = float(gpar[0]), float(gpar[1]), int(gpar[2])
    m = cents.shape[1]
    out = []
    y = rng.standard_normal((n, m)) / math.sqrt(d)
    ax = rng.integers(0, m, n)
    edge = (rng.integers(0, g + 1, n) - b) / a
    y[np.arange(n), ax] = edge
    y = y.astype(np.float32)
    out.append(np.nextafter(y, np.float32(np.inf) * rng.choice([-1, 1], y.shape)).astype(np.float32))
    out.append(y)
    c64 = cents.astype(np.float64)
    dist = ((c64[:, None] - c64[None]) ** 2).sum(-1)
    np.fill_diagonal(dist, np.inf)
    p = rng.integers(0, 256, n)
    q = np.argsort(dist[p], axis=1)[np.arange(n), rng.integers(0, 4, n)]
    mid = ((c64[p] + c64[q]) / 2).astype(np.float32)
    out.append(mid)
    for _ in range(3):
        mid = np.nextafter(mid, np.float32(np.inf) * rng.choice([-1, 1], mid.shape)).astype(np.float32)
        out.append(mid)
    return np.concatenate(out)


@pytest.mark.parametrize("bits, m", CONFIGS)
@pytest.mark.parametrize("d", hq.HEAD_DIMS)
def test_grid_search_is_the_full_search(bits, m, d):
    """Random groups of unit vectors, groups holding most of a vector (past the grid's span:
    clamped cells), the origin, and boundary groups: the same index as the full search, every
    one (3,000+ groups per codebook)."""
    rng = np.random.default_rng(d * 10 + bits)
    cents = hv.headvq_centroids(bits, d)
    u = rng.standard_normal((300, d))
    u /= np.linalg.norm(u, axis=1, keepdims=True)
    groups = [u.reshape(-1, m)[:1200].astype(np.float32)]
    big = rng.standard_normal((200, m))
    groups.append((big / np.linalg.norm(big, axis=1, keepdims=True) * rng.uniform(0.2, 1.0, (200, 1))
                   ).astype(np.float32))  # |y| up to 1: far past span/√d
    groups.append(np.zeros((1, m), np.float32))
    groups.append(boundary_groups(rng, cents, d, 300))
    y = np.concatenate(groups)
    want = full_search(y, cents)
    got = grid_search(y, cents, d)
    bad = np.nonzero(got != want)[0]
    assert bad.size == 0, (bad[:5], y[bad[:5]], got[bad[:5]], want[bad[:5]])


@pytest.mark.parametrize("bits, m", CONFIGS)
@pytest.mark.parametrize("nl", [64, 37])
def test_lanes_search_is_the_full_search(bits, m, nl):
    """The op's search over lanes side by side (``nearest_lanes``: every lane's cell, each
    slot for every lane, then the cells with more candidates lane by lane) on the same groups
    as above, laid out as the op's tiles (group ``g`` of lane ``l`` at rows ``g·m … g·m + m −
    1``, column ``l``), full and partial tiles: the full search's index, every one."""
    d, L = 128, 64
    rng = np.random.default_rng(nl * 10 + bits)
    cents = hv.headvq_centroids(bits, d)
    u = rng.standard_normal((60, d))
    u /= np.linalg.norm(u, axis=1, keepdims=True)
    big = rng.standard_normal((100, m))
    y = np.concatenate([u.reshape(-1, m)[:600].astype(np.float32),
                        (big / np.linalg.norm(big, axis=1, keepdims=True)).astype(np.float32),
                        boundary_groups(rng, cents, d, 100)])
    want = full_search(y, cents)
    gpar, goff, gcand, slots = search_grid(cents, d)
    cf = np.ascontiguousarray(cents).reshape(-1)
    G = d // m  # groups a lane holds (a vector's)
    got = []
    for i0 in range(0, len(y), G * nl):  # one tile: G groups × nl lanes
        part = y[i0:i0 + G * nl]
        part = np.concatenate([part, np.zeros((G * nl - len(part), m), np.float32)])
        t = np.zeros((d + 3) * L, np.float32)
        t[:d * L].reshape(G, m, L)[:, :, :nl] = part.reshape(nl, G, m).transpose(1, 2, 0)
        ib = np.full(G * L, 255, np.uint8)
        nearest_lanes_cpu(t, d, L, nl, m, cf, gpar, slots, goff, gcand, ib, np.zeros(L, np.int64),
                             np.zeros(L, np.float32))
        got.append(ib.reshape(G, L)[:, :nl].T.reshape(-1)[:len(y) - i0])
    got = np.concatenate(got)
    bad = np.nonzero(got != want)[0]
    assert bad.size == 0, (bad[:5], y[bad[:5]], got[bad[:5]], want[bad[:5]])


@pytest.mark.parametrize("bits, m", CONFIGS)
def test_grid_tables(bits, m):
    """Offsets increase (every cell lists a point), candidates increase within a cell, slots are
    a cell's first ``P`` candidates padded with its first, the tables are read-only and cached."""
    d = 64
    cents = hv.headvq_centroids(bits, d)
    gpar, goff, gcand, slots = search_grid(cents, d)
    g, span, p = GRID_PARAMS[m]
    assert gpar[2] == g and gpar[3] == p
    assert gpar[0] == np.float32(math.sqrt(d) * g / (2 * span)) and gpar[1] == np.float32(g / 2)
    assert goff.dtype == np.int32 and gcand.dtype == np.uint8 and slots.dtype == np.uint8
    assert len(goff) == g ** m + 1 and goff[0] == 0 and goff[-1] == len(gcand)
    counts = np.diff(goff)
    assert counts.min() >= 1 and slots.shape == (g ** m * p,)
    for c in range(g ** m):
        own = gcand[goff[c]:goff[c + 1]]
        assert np.all(np.diff(own.astype(np.int64)) > 0)
        want = np.concatenate([own[:p], np.full(max(p - len(own), 0), own[0], np.uint8)])
        assert np.array_equal(slots[c * p:(c + 1) * p], want)
    for arr in (gpar, goff, gcand, slots):
        assert not arr.flags.writeable
    assert search_grid(cents, d)[1] is goff


@pytest.mark.parametrize("bits, m", CONFIGS)
def test_grid_lists_few_points(bits, m):
    """The point of the grid: groups of uniform unit vectors at d = 128 see about 2 (pairs) or
    8 (quads) candidates, not 256 (the figures the docs quote)."""
    d = 128
    cents = hv.headvq_centroids(bits, d)
    gpar, goff, _, _ = search_grid(cents, d)
    a, b, g = float(gpar[0]), float(gpar[1]), int(gpar[2])
    u = np.random.default_rng(3).standard_normal((2000, d))
    u /= np.linalg.norm(u, axis=1, keepdims=True)
    idx = np.clip((u.reshape(-1, m).astype(np.float32) * np.float32(a) + np.float32(b)).astype(np.int64), 0, g - 1)
    mean = np.diff(goff)[np.ravel_multi_index(idx.T, (g,) * m)].mean()
    assert (1.5 < mean < 2.5) if m == 2 else (6.5 < mean < 9.0), mean


@pytest.mark.parametrize("bits, m", CONFIGS)
@pytest.mark.parametrize("n", [3, 200])
def test_op_matches_the_reference(bits, m, n):
    """The op (grid search inside, tiles of 3 and of 64 lanes) against the float64 brute-force
    reference: the same codes except at near ties of the reference's distances."""
    d = 128
    rng = np.random.default_rng(n + bits)
    x = rng.standard_normal((n, d)).astype(np.float32)
    codes, _ = hv.quantize_headvq(x, bits)
    rc, _, gap = reference.headvq_quantize(x, hv.headvq_codebook(bits, d))
    differ = codes != rc
    assert np.all(gap[differ] < 1e-5), gap[differ]
    assert differ.mean() < 1e-3
