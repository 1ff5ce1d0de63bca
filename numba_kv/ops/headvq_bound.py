"""An a-priori bound of the head VQ code's EDEN scale (:mod:`numba_kv.ops.headvq`).

With ``unbiased=True`` a vector ``x`` is stored with the scale ``α = ‖x‖·‖y‖²/⟨y, ĉ⟩``
(``y`` the rotated unit vector, ``ĉ`` the chosen points; EDEN, Vargaftik et al.,
arXiv:2108.08842), a binary16 number or a code on a layer's 8-bit norm grid.  A cache must
refuse, before storing anything, a vector whose ``α`` would saturate; without a bound of
``α/‖x‖`` it can only find out by quantizing every stored token twice (once in scratch).
This module proves ``α <= F·‖x‖`` for every ``x``, per codebook, so that the range check
quantizes in scratch only when ``F·max‖x‖`` is past the limit.  (Below ``‖x‖ = 1e-10`` the op
normalizes by that floor, so ``y`` is no unit vector and nothing here applies; there the op
keeps the norm instead of the EDEN scale.)

**The bound.**  In the codebook's units (``√d``), a unit ``y`` is ``G = d/m`` groups
``z_g ∈ R^m`` with ``Σ_g ‖z_g‖² = d``, and ``d·⟨y, ĉ⟩ = Σ_g f(z_g)`` with ``f(z) = ⟨z, ĉ(z)⟩``,
``ĉ(z)`` the point nearest to ``z``.  For a line ``a + b·s`` under ``f`` on the ball,

    ``f(z) >= a + b·‖z‖²``  for all ``‖z‖ <= √d``                              (1)

summing over the groups gives ``⟨y, ĉ⟩ >= a/m + b``, so ``α/‖x‖ <= F = 1/(a/m + b)``.
``f`` dips below 0 only near the origin (a small group whose nearest point lies on the
other side), so ``a`` is a small negative number; ``b`` is set by the worst case, one group
holding all of ``y`` (``‖z‖ = √d``), where ``f ≈ √d·ρ`` (``ρ`` about the inradius of the
points' convex hull): ``F`` grows like ``√d/ρ`` — 2 at ``d = 32`` to 8 (pairs) or 15
(quads) at ``d = 512``, while a random vector has ``α/‖x‖ ≈ 1/(1 − MSE)`` (1.01 for pairs,
1.1 for quads, the code's mean squared error per coordinate of ``√d·u`` at ``d = 128``).

**The proof of (1)** is a branch-and-bound over cubes covering the ball
(:func:`verify_line`).  On a cube of centre ``z₀`` and half-diagonal ``ε``, let ``L`` be the
points that can be nearest somewhere in it (every point within ``D₀ + 2ε`` of ``z₀``,
``D₀`` the nearest distance at ``z₀``; a child cube filters its parent's list).  Then for
every ``z`` in the cube, with ``r₋ = max(‖z₀‖ − ε, 0)`` and ``c₋ = min_{c ∈ L} ‖c‖``:

* ``f = (‖z‖² + ‖ĉ‖² − D²)/2`` with ``D <= D₀ + ε`` and ``‖ĉ‖ >= max(c₋, ‖z‖ − D)``:
  ``f >= (r₋² + max(c₋, r₋ − D₀ − ε)² − (D₀ + ε)²)/2``;
* ``ĉ`` nearest means ``⟨z, ĉ⟩ − ‖ĉ‖²/2 >= ⟨z, c⟩ − ‖c‖²/2`` for every ``c``:
  ``f >= max_{c ∈ L} (⟨z₀, c⟩ − ε‖c‖ − ‖c‖²/2) + c₋²/2``;
* ``ĉ ∈ L``: ``f >= min_{c ∈ L} (⟨z₀, c⟩ − ε‖c‖)``;

and ``b‖z‖² <= b·min(‖z₀‖ + ε, √d)²``.  A cube whose best lower bound of
``f − b‖z‖²`` is ``>= a`` is done; any other is split in ``2^m``.  The proof fails (returns
``False``) at a cube centre that violates (1) or when the cubes get too small or too many.

The lines (:data:`LINES`) are fitted offline by :func:`fit_line` (``b`` a little under its
largest value on the sphere ``‖z‖ = √d``, the tightest line that verifies) and checked by
the tests with :func:`verify_line`; ``python -m numba_kv.ops.headvq_bound`` refits them.
:func:`eden_scale_bound` adds :data:`SLACK` for float32 rounding: the kernels normalize,
rotate and sum ``⟨y, ĉ⟩`` in float32 (relative error about ``d·2⁻²⁴`` of terms of size
``‖ĉ‖ <= 4``) and may pick a nearest point by float32 distances.
"""

from __future__ import annotations

import argparse
import functools
import math

import numpy as np

from .._jit import cpu_serial
from .headquant import HEAD_DIMS
from .headvq import headvq_centroids

__all__ = ["LINES", "SLACK", "eden_scale_bound", "fit_line", "line_bound", "verify_line"]

#: ``{(bits, d): (a, b)}``: ``f(z) >= a + b·‖z‖²`` on the ball ``‖z‖ <= √d`` for the
#: codebook ``headvq_codebook(bits, d)`` (proved by :func:`verify_line`; refit by
#: ``python -m numba_kv.ops.headvq_bound``)
LINES: dict[tuple[int, int], tuple[float, float]] = {
    (4, 32): (-0.02, 0.510116),  # F = 2.031, worst found 1.943
    (4, 64): (-0.02, 0.379152),  # F = 2.751, worst found 2.613
    (4, 128): (-0.02, 0.270715),  # F = 3.896, worst found 3.659
    (4, 256): (-0.02, 0.193925),  # F = 5.522, worst found 5.107
    (4, 512): (-0.02, 0.138947),  # F = 7.876, worst found 7.127
    (2, 32): (-0.1, 0.358147),  # F = 3.049, worst found 2.760
    (2, 64): (-0.05, 0.261892),  # F = 4.072, worst found 3.791
    (2, 128): (-0.05, 0.189628),  # F = 5.734, worst found 5.178
    (2, 256): (-0.05, 0.13539),  # F = 8.265, worst found 7.323
    (2, 512): (-0.1, 0.096589),  # F = 14.187, worst found 10.270
}

#: relative margin of :func:`eden_scale_bound` over ``1/(a/m + b)`` for float32 rounding
SLACK = 2.0 ** -6

#: the ball's radius is ``√d·(1 + RADIUS_SLACK)``: a float32-normalized ``y`` has norm ``1 ± 1e-6``
RADIUS_SLACK = 2.0 ** -10


def line_bound(a: float, b: float, m: int) -> float:
    """The largest ``α/‖x‖`` a line of (1) allows, before :data:`SLACK`.

    Parameters
    ----------
    a, b : float
        The line ``a + b·‖z‖²`` under ``f`` (``√d`` units).
    m : {2, 4}
        Group size of the codebook (pairs at 4 bits, quads at 2 bits).

    Returns
    -------
    float
        ``1/(a/m + b)``, or ``inf`` when ``a/m + b <= 0`` (the line bounds nothing).
    """
    low = a / m + b
    return 1.0 / low if low > 0 else math.inf


def _with_slack(a: float, b: float, bits: int) -> float:
    """:func:`line_bound` of a line for the code of ``bits``, with :data:`SLACK`."""
    return (1.0 + SLACK) * line_bound(a, b, 4 if bits == 2 else 2)


def _points(bits: int, d: int) -> np.ndarray:
    """The codebook's points in ``√d`` units as float64, from the float32 table the kernels use."""
    return np.asarray(headvq_centroids(bits, d), np.float64) * math.sqrt(d)


@functools.cache
def eden_scale_bound(bits: int, d: int) -> float:
    """An upper bound of ``α/‖x‖`` for the head VQ code with ``unbiased=True``.

    Parameters
    ----------
    bits : {4, 2}
        Bits per value of the code (pairs or quads).
    d : int
        Head dimension, a power of two in 32..512.

    Returns
    -------
    float
        ``(1 + SLACK)/(a/m + b)`` of the shipped line ``LINES[(bits, d)]``: every vector's
        stored scale is at most this times its norm.
    """
    if (bits, d) not in LINES:
        raise ValueError(f"(bits, d): expected a head VQ codebook, one of {sorted(LINES)}, got {(bits, d)!r}")
    return _with_slack(*LINES[(bits, d)], bits)


@cpu_serial
def _f_at(c, cands, z):
    """``f(z) = ⟨z, ĉ⟩``, ``ĉ`` the nearest of the points ``c[cands]`` (the first of ties)."""
    best = math.inf
    fz = 0.0
    for k in cands:
        s = 0.0
        dot = 0.0
        for j in range(c.shape[1]):
            e = z[j] - c[k, j]
            s += e * e
            dot += z[j] * c[k, j]
        if s < best:
            best = s
            fz = dot
    return fz


@cpu_serial
def _verify(c, a, b, radius, eps_min, max_cubes):
    """Branch-and-bound of (1) over cubes (depth first, explicit stacks); returns
    ``(status, cubes)``: status 1 proved, 0 a cube centre violates (1), -1 undecided."""
    K, m = c.shape
    cn = np.sqrt((c * c).sum(axis=1))
    depth_cap = 64
    cap = depth_cap * (1 << m) + 1
    zs = np.zeros((cap, m))
    sides = np.zeros(cap)
    lists = np.zeros(cap, np.int64)  # start of the cube's candidate list in ``pool``
    counts = np.zeros(cap, np.int64)
    pool = np.zeros(depth_cap * K + K, np.int64)
    for k in range(K):
        pool[k] = k
    zs[0, :] = 0.0
    sides[0] = 2.0 * radius
    lists[0] = 0
    counts[0] = K
    top = 1
    n_cubes = 0
    dist = np.zeros(K)
    while top > 0:
        top -= 1
        z0 = zs[top].copy()
        side = sides[top]
        start = lists[top]
        cnt = counts[top]
        pool_top = start + cnt  # everything above this cube's list belongs to finished cubes
        n_cubes += 1
        if n_cubes > max_cubes:
            return -1, n_cubes
        eps = 0.5 * side * math.sqrt(m)
        r0 = math.sqrt((z0 * z0).sum())
        if r0 - eps > radius:
            continue
        d0 = math.inf
        for i in range(cnt):
            k = pool[start + i]
            s = 0.0
            for j in range(m):
                e = z0[j] - c[k, j]
                s += e * e
            dist[i] = math.sqrt(s)
            d0 = min(d0, dist[i])
        # this cube's list: the points within d0 + 2 eps (pushed above the parent's)
        new_start = pool_top
        n_new = 0
        cmin = math.inf
        bb = -math.inf
        cc = math.inf
        for i in range(cnt):
            if dist[i] <= d0 + 2.0 * eps:
                k = pool[start + i]
                pool[new_start + n_new] = k
                n_new += 1
                dot = 0.0
                for j in range(m):
                    dot += z0[j] * c[k, j]
                cmin = min(cmin, cn[k])
                bb = max(bb, dot - eps * cn[k] - 0.5 * cn[k] * cn[k])
                cc = min(cc, dot - eps * cn[k])
        # a witness: (1) fails at the centre, or at its projection on the sphere (within eps
        # of the centre, so its nearest point is on the list)
        shrink = min(1.0, radius / r0) if r0 > 0 else 1.0
        if _f_at(c, pool[new_start:new_start + n_new], shrink * z0) - b * (shrink * r0) ** 2 < a:
            return 0, n_cubes
        rlo = max(r0 - eps, 0.0)
        rhi = min(r0 + eps, radius)
        low_a = 0.5 * (rlo * rlo + max(cmin, rlo - d0 - eps) ** 2 - (d0 + eps) ** 2)
        low = max(low_a, bb + 0.5 * cmin * cmin, cc) - b * rhi * rhi
        if low >= a:
            continue
        if eps < eps_min or top + (1 << m) > cap or new_start + n_new + K > pool.shape[0]:
            return -1, n_cubes
        # the children share this cube's list (kept on the pool until they are done)
        for ch in range(1 << m):
            for j in range(m):
                zs[top, j] = z0[j] + (0.25 * side if (ch >> j) & 1 else -0.25 * side)
            sides[top] = 0.5 * side
            lists[top] = new_start
            counts[top] = n_new
            top += 1
    return 1, n_cubes


def verify_line(bits: int, d: int, a: float, b: float, *, max_cubes: int = 20_000_000,
                eps_min: float = 1e-4) -> bool:
    """Prove (1) for the codebook ``(bits, d)`` and the line ``(a, b)`` by branch-and-bound.

    Parameters
    ----------
    bits : {4, 2}
        Bits per value of the code (pairs or quads).
    d : int
        Head dimension, a power of two in 32..512 (the ball ``‖z‖ <= √d·(1 + RADIUS_SLACK)``).
    a, b : float
        The line ``a + b·‖z‖²`` (``b > 0``).
    max_cubes : int
        Give up after visiting this many cubes.
    eps_min : float
        Give up at a cube of half-diagonal below this.

    Returns
    -------
    bool
        ``True`` when proved; ``False`` when a point violates (1) or the search gives up.
    """
    radius = math.sqrt(d) * (1.0 + RADIUS_SLACK)
    status, _ = _verify(_points(bits, d), float(a), float(b), radius, float(eps_min), int(max_cubes))
    return status == 1


def _f_on_sphere(c: np.ndarray, d: int, m: int) -> np.ndarray:
    """``f(√d·u)`` for a fixed set of directions ``u``: a fine circle (pairs) or a seeded
    sample of the 3-sphere (quads)."""
    if m == 2:
        t = np.arange(1 << 16) * (2 * math.pi / (1 << 16))
        u = np.stack([np.cos(t), np.sin(t)], axis=1)
    else:
        u = np.random.default_rng([20251202, d]).standard_normal((1 << 18, m))
        u /= np.linalg.norm(u, axis=1, keepdims=True)
    z = math.sqrt(d) * u
    k = np.argmin((c * c).sum(axis=1)[None, :] - 2.0 * (z @ c.T), axis=1)
    return (z * c[k]).sum(axis=1)


def fit_line(bits: int, d: int, *, max_cubes: int = 20_000_000) -> tuple[float, float]:
    """The tightest line of (1) found for the codebook ``(bits, d)`` (offline; deterministic,
    seconds per codebook).

    Candidates: ``a`` in -0.02 … -0.3 and ``b = (1 − η)·min_u (f(√d·u) − a)/d`` (rounded down
    to 6 digits), tried by increasing :func:`line_bound`; the first that :func:`verify_line`
    proves wins.

    Parameters
    ----------
    bits : {4, 2}
        Bits per value of the code.
    d : int
        Head dimension, a power of two in 32..512.
    max_cubes : int
        :func:`verify_line`'s budget per candidate.

    Returns
    -------
    a, b : float
        The line, as :data:`LINES` holds it.

    Raises
    ------
    RuntimeError
        No candidate was proved.
    """
    m = 4 if bits == 2 else 2
    fs = _f_on_sphere(_points(bits, d), d, m)
    cands = []
    for a in (-0.02, -0.05, -0.07, -0.1, -0.15, -0.2, -0.3):
        for eta in (0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4):
            b = math.floor((1 - eta) * float((fs - a).min()) / d * 1e6) / 1e6
            cands.append((line_bound(a, b, m), a, b))
    for bound, a, b in sorted(cands):
        if math.isfinite(bound) and verify_line(bits, d, a, b, max_cubes=max_cubes):
            return a, b
    raise RuntimeError(f"no line of (1) proved for bits={bits}, d={d}")


def main(argv: list[str] | None = None) -> None:
    """Print :data:`LINES` refitted (``python -m numba_kv.ops.headvq_bound``), each with its
    bound and the worst ``α/‖x‖`` found: ``d/f(√d·u)`` at the worst sampled direction ``u``
    (a unit vector whose rotation is ``u`` in one group)."""
    argparse.ArgumentParser(description=main.__doc__).parse_args(argv)
    print("LINES = {")
    for bits in (4, 2):
        for d in HEAD_DIMS:
            a, b = fit_line(bits, d)
            worst = d / float(_f_on_sphere(_points(bits, d), d, 4 if bits == 2 else 2).min())
            print(f"    ({bits}, {d}): ({a!r}, {b!r}),  # F = {_with_slack(a, b, bits):.3f}, worst found "
                  f"{worst:.3f}", flush=True)
    print("}")


if __name__ == "__main__":
    main()
