"""Scalar codebooks for the 32-value block quantizer (host side, NumPy), and the bucketize cores.

A block quantizer rotates each 32-value block with a signed Hadamard matrix, divides it
by a per-block scale and replaces every coordinate by the nearest centroid of a scalar
codebook (Lloyd 1982 / Max 1960 scalar quantization).  This module owns those codebooks:

* **L2 mode** (``scale = ‖x‖₂``, coordinates of a unit vector in ``m = 32`` dimensions):
  Lloyd–Max tables for the exact sphere-coordinate density ``f_m`` (§2.4.1), computed
  here by the same iteration as turboquant-rs, which reproduces its published tables to
  ≥ 6 significant digits (the 4-bit runs stop at the 200-iteration cap; the cap is part
  of the definition of those tables).
* **MaxNorm mode** (``scale = amax / MAXNORM_REF``, so the block's largest coordinate
  lands at ``±MAXNORM_REF``): fixed tables in the scaled domain ``[−2.1573, 2.1573]``
  (§2.4.2).  3-bit is llama.cpp's ``tq3_centroids``; 4-bit is the uniform 16-point grid
  on that interval.

Why the 1-bit and 2-bit MaxNorm tables are not the reference ones
------------------------------------------------------------------
turboquant-rs builds its 2-bit MaxNorm table as "every other 3-bit centroid"
(``±0.7434, ±2.1573``) with boundaries ``0, ±1.0385`` copied from the 3-bit list
instead of the midpoints ``±1.45035``.  After MaxNorm scaling only one coordinate per
block sits at ``±2.1573``; the bulk of the mass lies within ``±1``, so the outer
centroids are almost unused and the inner ones are too wide: Gaussian data reaches a
normalized MSE of ≈ 0.32, worse than the 2-bit L2 table's ≈ 0.112 (§6.5, §7 item 7).
We do not copy that defect.  Our 1-bit and 2-bit MaxNorm tables are Lloyd–Max tables
fitted to the MaxNorm-scaled distribution itself (blocks of 32 i.i.d. N(0,1) values —
a rotated Gaussian block is Gaussian — each scaled by ``MAXNORM_REF / max|x|``), with
midpoint boundaries; see :func:`fit_maxnorm_lloyd` and the constants below.  They
reach NMSE ≈ 0.113 (2-bit; the L2 2-bit table gives ≈ 0.112) on Gaussian data.
``MAXNORM_REF`` stays the scale reference for every MaxNorm table, so the stored
per-block scale means the same thing at every bit width.

Index assignment (§2.4.3) is ``idx = #{i : y > t_i}``: ties go to the lower bin and
index 0 is the most negative centroid (:func:`assign`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import uint8

from .._jit import twin

__all__ = [
    "DEQUANTIZE_SIGNATURE",
    "MAXNORM_REF",
    "Codebook",
    "sphere_coordinate_pdf",
    "lloyd_max_sphere",
    "sphere_distortion",
    "maxnorm_table",
    "fit_maxnorm_lloyd",
    "get_codebook",
    "assign",
]

MAXNORM_REF: float = 2.1573
"""``c_outer``: MaxNorm scale reference, ``y = r / (amax / MAXNORM_REF)``."""

#: Signature of the codebook dequantizer kernels (``dequantize_blocks``, ``dequantize_head``):
#: ``(codes, scales, signs, centroids, bits, t0, out)``.
DEQUANTIZE_SIGNATURE = ("void(uint8[:, :, ::1], uint16[:, :, ::1], float32[::1], float32[::1], int64, int64, "
                        "float32[:, :, ::1])")

_NORM_MODES = ("maxnorm", "l2")
_MAX_BITS = {"maxnorm": 4, "l2": 8}

# --- Lloyd–Max parameters of §2.4.1 (those of turboquant-rs `codebook/gen.rs`) -------
_LM_MAX_ITER = 200
_LM_REL_TOL = 1e-12
_LM_TINY = 1e-30
# Uniform initialization (as in §2.4.1 / turboquant-rs) up to 4 bits.  From 5 bits on,
# 200 Lloyd steps from the uniform start leave the outer centroids far from the mass
# (m = 32: 6-bit m·D = 1.24e-3 vs the optimum 5.89e-4, 8-bit 1.53e-4 vs 3.75e-5), so
# those tables start from the companding (f^(1/3)-quantile) point density instead and
# land within about 0.05 % of the optimum.  There is no reference table above 4 bits.
_LM_UNIFORM_INIT_MAX_BITS = 4
# Nor above m = 512 (the largest head_dim, MAX_HEAD_DIM): there the density is so narrow
# (σ = 1/√m) that the uniform start on [−1, 1] leaves every bin but the middle ones empty,
# and 200 steps never recover them (m = 1024: 2-bit m·D 3.1x, 3-bit 1.7x the optimum;
# m = 16384, 3-bit: 10.5x).  The companding start is used there at every width; tables up
# to m = 512 (all the quantizers use) keep the uniform start and their values.
_LM_UNIFORM_INIT_MAX_M = 512
_SIMPSON_N = 1024  # sub-intervals per bin (even)
_SIMPSON_W = np.ones(_SIMPSON_N + 1)
_SIMPSON_W[1:-1:2] = 4.0
_SIMPSON_W[2:-1:2] = 2.0
_SIMPSON_T = np.arange(_SIMPSON_N + 1) / _SIMPSON_N

# --- MaxNorm tables (§2.4.2), scaled domain ------------------------------------------
_MAXNORM_3BIT_POS = (0.2428, 0.7434, 1.3336, 2.1573)  # llama.cpp tq3_centroids, positive half

# Fitted 1-/2-bit MaxNorm centroids (positive half; tables are symmetric).  Derived
# offline, once, with
#     fit_maxnorm_lloyd(bits, n_blocks=_FIT_N_BLOCKS, seed=_FIT_SEED)
# i.e. numpy.random.default_rng(20250428).standard_normal((8_000_000, 32)), every block
# multiplied by MAXNORM_REF / max|x|, then symmetric 1-D Lloyd (k-means on |y| with
# 2**bits / 2 centroids, midpoint boundaries, ties to the lower bin) iterated until no
# centroid moves by more than 1e-13.  Cross-check: the population optimum, obtained by
# running the same Lloyd iteration on the exact law of the scaled coordinates (a point
# mass 1/32 at MAXNORM_REF plus 31/32 of the max-conditioned truncated half-normal,
# integrated numerically over the block maximum), is 0.75054998 (1-bit) and
# 0.42373434, 1.43323742 (2-bit): the constants below are within 4e-5 of it.
_FIT_N_BLOCKS = 8_000_000
_FIT_SEED = 20250428
_FIT_BLOCK = 32
_MAXNORM_FITTED_POS = {
    1: (0.7505500016,),
    2: (0.4237008082, 1.4332059811),
}


def _check_int(name: str, value: Any, lo: int, hi: int | None, context: str = "") -> int:
    """Return ``value`` as int if it is an integer in ``[lo, hi]``, else ``TypeError`` (not an
    integer) or ``ValueError`` (out of range)."""
    rng = f"in {lo}..{hi}" if hi is not None else f">= {lo}"
    if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected an integer {rng}{context}, got {type(value).__name__} {value!r}")
    if not (lo <= int(value) and (hi is None or int(value) <= hi)):
        raise ValueError(f"{name}: expected an integer {rng}{context}, got {value!r}")
    return int(value)


def _check_norm_mode(norm_mode: Any) -> str:
    if not isinstance(norm_mode, str) or norm_mode not in _NORM_MODES:
        raise ValueError(f"norm_mode: expected one of {_NORM_MODES}, got {norm_mode!r}")
    return norm_mode


def _frozen_f32(a: Any) -> np.ndarray:
    out = np.array(a, dtype=np.float32, copy=True)
    out.flags.writeable = False
    return out


def _midpoints_f32(c32: np.ndarray) -> np.ndarray:
    """Float32 nearest to the exact midpoints of float32 centroids (computed in float64)."""
    c = c32.astype(np.float64)
    return ((c[:-1] + c[1:]) * 0.5).astype(np.float32)


@dataclass(frozen=True, eq=False)
class Codebook:
    """A scalar codebook with its decision boundaries.

    Instances are immutable (arrays are read-only copies) and compare by identity;
    :func:`get_codebook` returns cached instances.

    Attributes
    ----------
    bits : int
        Bits per index; the table has ``K = 2**bits`` entries.
    norm_mode : str
        ``"maxnorm"`` (values live in ``[-MAXNORM_REF, MAXNORM_REF]``) or ``"l2"``
        (values live in ``[-1, 1]``, coordinates of a unit vector).
    centroids : numpy.ndarray
        float32, shape ``(K,)``, strictly ascending, read-only.
    boundaries : numpy.ndarray
        float32, shape ``(K - 1,)``, ascending, ``centroids[i] <= boundaries[i] <=
        centroids[i + 1]``, read-only.  The library's tables use midpoints.
    ref : float
        Scale reference, finite and positive: ``MAXNORM_REF`` for MaxNorm (``scale = amax /
        ref``), ``1.0`` for L2 (``scale = ‖x‖₂``).
    source : str
        One line saying where the table comes from.
    """

    bits: int
    norm_mode: str
    centroids: np.ndarray
    boundaries: np.ndarray
    ref: float
    source: str

    def __post_init__(self) -> None:
        mode = _check_norm_mode(self.norm_mode)
        bits = _check_int("bits", self.bits, 1, 8)
        k = 1 << bits
        c = _frozen_f32(self.centroids)
        b = _frozen_f32(self.boundaries)
        if c.shape != (k,):
            raise ValueError(f"centroids: expected shape ({k},) for bits={bits}, got {c.shape}")
        if b.shape != (k - 1,):
            raise ValueError(f"boundaries: expected shape ({k - 1},) for bits={bits}, got {b.shape}")
        if not (np.all(np.isfinite(c)) and np.all(np.diff(c) > 0)):
            raise ValueError("centroids: expected finite, strictly ascending values")
        if not (np.all(np.isfinite(b)) and np.all(c[:-1] <= b) and np.all(b <= c[1:])):
            raise ValueError("boundaries: expected finite values with centroids[i] <= "
                             "boundaries[i] <= centroids[i + 1]")
        # the MaxNorm scale is amax / ref: ref <= 0 or NaN made every block scale 1e-10 (all-zero
        # reconstructions, silently), a tiny or infinite one a saturated or zero scale
        ref = self.ref
        if (isinstance(ref, (bool, np.bool_)) or not isinstance(ref, (int, float, np.integer, np.floating))
                or not 0.0 < float(ref) < math.inf):
            raise ValueError(f"ref: expected a finite positive float (the scale reference), got {ref!r}")
        object.__setattr__(self, "bits", bits)
        object.__setattr__(self, "norm_mode", mode)
        object.__setattr__(self, "centroids", c)
        object.__setattr__(self, "boundaries", b)
        object.__setattr__(self, "ref", float(ref))

    @property
    def size(self) -> int:
        """Number of centroids, ``2**bits``."""
        return 1 << self.bits


# ------------------------------------------------------------------------------------
# L2 mode: Lloyd–Max for the sphere-coordinate density
# ------------------------------------------------------------------------------------


def sphere_coordinate_pdf(x: np.ndarray, m: int) -> np.ndarray:
    """Density of one coordinate of a uniform random point on the unit sphere in R^m.

    ``f_m(x) = Γ(m/2) / (√π Γ((m−1)/2)) · (1 − x²)^((m−3)/2)`` on ``[−1, 1]``, 0
    outside (and at ``±1``).  Mean 0, variance ``1/m``; ``(x+1)/2 ~ Beta((m−1)/2,
    (m−1)/2)``.

    Parameters
    ----------
    x : array_like
        Points, any shape; evaluated in float64.
    m : int
        Dimension, ``>= 3`` (below that the density is unbounded or undefined).

    Returns
    -------
    numpy.ndarray
        float64, same shape as ``x``.
    """
    m = _check_int("m", m, 3, None)
    x = np.asarray(x, dtype=np.float64)
    # 1 - x² <= 0 (|x| >= 1) gives 0 since the exponent is > 0; m = 3 (exponent 0, where
    # 0**0 = 1) is the uniform density on the open interval.  In-place: this evaluation
    # dominates the Lloyd–Max cost.
    u = np.multiply(x, x, out=np.empty_like(x))
    np.subtract(1.0, u, out=u)
    if m == 3:
        u = (u > 0.0).astype(np.float64)
    else:
        np.maximum(u, 0.0, out=u)
        np.power(u, 0.5 * (m - 3), out=u)
    # Normalizer formed in log space (Γ overflows for large m).
    u *= math.exp(math.lgamma(m / 2) - 0.5 * math.log(math.pi) - math.lgamma((m - 1) / 2))
    return u


def _simpson_grid(edges: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Nodes and weights of composite Simpson (``_SIMPSON_N`` sub-intervals) on each bin.

    ``edges`` has shape ``(K + 1,)``; returns two ``(K, _SIMPSON_N + 1)`` arrays.
    """
    lo, hi = edges[:-1], edges[1:]
    width = hi - lo
    x = lo[:, None] + width[:, None] * _SIMPSON_T[None, :]
    w = (width / (3.0 * _SIMPSON_N))[:, None] * _SIMPSON_W[None, :]
    return x, w


def _companding_init(k: int, m: int) -> np.ndarray:
    """Quantiles ``(i + ½)/K`` of the density ``∝ f_m^(1/3)`` (optimal high-rate point density)."""
    x = np.linspace(-1.0, 1.0, 200_001)
    g = np.cbrt(sphere_coordinate_pdf(x, m))
    cdf = np.concatenate(([0.0], np.cumsum(0.5 * (g[1:] + g[:-1]))))
    return np.interp((np.arange(k) + 0.5) / k, cdf / cdf[-1], x)


def _bin_edges(boundaries: np.ndarray) -> np.ndarray:
    return np.concatenate(([-1.0], np.clip(boundaries, -1.0, 1.0), [1.0]))


@functools.lru_cache(maxsize=None, typed=True)
def lloyd_max_sphere(bits: int, m: int) -> Codebook:
    """L2-mode Lloyd–Max codebook for the sphere-coordinate density ``f_m``.

    The Lloyd–Max iteration (identical to turboquant-rs): start from
    ``c_i = −1 + 2(i + ½)/K``; up to 200 times set boundaries to midpoints, move each
    centroid to the conditional mean ``∫x f / ∫f`` of its bin ``[t_{i−1}, t_i]`` (bin
    midpoint if ``|∫f| < 1e−30``), compute ``D = Σ ∫_bin (x − c_i)² f`` with the new
    centroids, and stop once ``|D_prev − D| < 1e−12 · max(|D_prev|, 1e−30)``.  Integrals
    use composite Simpson with 1024 sub-intervals per bin.  The 4-bit runs reach the
    200-iteration cap; the cap is needed to reproduce the reference tables.

    One deviation, for ``bits >= 5`` or ``m > 512`` only (no reference tables exist there):
    the iteration starts from the quantiles ``(i + ½)/K`` of ``f_m^(1/3)`` (the optimal
    high-rate point density) instead of the uniform grid, because 200 steps from the
    uniform grid stay 2–4x above the optimal distortion (above 4 bits), or leave bins
    empty and up to 40x above it (``m > 512``, where ``f_m`` is too narrow for the grid).  The result is made exactly
    symmetric (``c_{K−1−i} = −c_i``) at the end.

    Parameters
    ----------
    bits : int
        1..8 (``K = 2**bits`` centroids).
    m : int
        Dimension of the normalized vector (the block size, 32, for the cache).

    Returns
    -------
    Codebook
        ``norm_mode="l2"``, ``ref=1.0``; cached per ``(bits, m)``.
    """
    bits = _check_int("bits", bits, 1, _MAX_BITS["l2"], " for norm_mode='l2'")
    m = _check_int("m", m, 3, None)
    k = 1 << bits
    if bits <= _LM_UNIFORM_INIT_MAX_BITS and m <= _LM_UNIFORM_INIT_MAX_M:
        c = -1.0 + 2.0 * (np.arange(k) + 0.5) / k
    else:
        c = _companding_init(k, m)
    d_prev = np.finfo(np.float64).max
    for _ in range(_LM_MAX_ITER):
        edges = _bin_edges((c[:-1] + c[1:]) * 0.5)
        x, w = _simpson_grid(edges)
        fw = sphere_coordinate_pdf(x, m)
        fw *= w
        mass = fw.sum(axis=1)
        first = (x * fw).sum(axis=1)
        empty = np.abs(mass) < _LM_TINY
        c = np.where(empty, 0.5 * (edges[:-1] + edges[1:]), first / np.where(empty, 1.0, mass))
        d = float((((x - c[:, None]) ** 2) * fw).sum())
        if abs(d_prev - d) < _LM_REL_TOL * max(abs(d_prev), _LM_TINY):
            break
        d_prev = d
    c = 0.5 * (c - c[::-1])  # exact symmetry (removes ~1e-17 drift; middle boundary = 0)
    return Codebook(
        bits=bits,
        norm_mode="l2",
        centroids=c.astype(np.float32),
        boundaries=((c[:-1] + c[1:]) * 0.5).astype(np.float32),
        ref=1.0,
        source=f"Lloyd-Max on the sphere-coordinate density f_{m} "
               f"(lloyd_max_sphere({bits}, {m}); equal to the turboquant-rs tables)",
    )


def sphere_distortion(cb: Codebook, m: int) -> float:
    """Expected squared error of a unit vector in R^m quantized coordinate-wise by ``cb``.

    Returns ``m · E[(x − Q(x))²]`` for ``x ~ f_m``, with ``Q`` given by ``cb``'s
    (float32) centroids and boundaries, integrated by composite Simpson (1024
    sub-intervals per bin) like :func:`lloyd_max_sphere`.

    Parameters
    ----------
    cb : Codebook
        An L2-mode codebook.
    m : int
        Dimension, ``>= 3``.

    Returns
    -------
    float
        Normalized MSE of the L2-mode quantizer on uniform unit vectors.
    """
    if not isinstance(cb, Codebook) or cb.norm_mode != "l2":
        raise ValueError(f"cb: expected an L2-mode Codebook, got {cb!r:.80}")
    m = _check_int("m", m, 3, None)
    c = cb.centroids.astype(np.float64)
    x, w = _simpson_grid(_bin_edges(cb.boundaries.astype(np.float64)))
    fw = sphere_coordinate_pdf(x, m) * w
    return float(m * (((x - c[:, None]) ** 2) * fw).sum())


# ------------------------------------------------------------------------------------
# MaxNorm mode
# ------------------------------------------------------------------------------------


def fit_maxnorm_lloyd(bits: int, n_blocks: int = _FIT_N_BLOCKS, seed: int = _FIT_SEED) -> np.ndarray:
    """Fit a symmetric Lloyd–Max table to MaxNorm-scaled Gaussian 32-blocks.

    Draws ``n_blocks`` blocks of 32 i.i.d. N(0, 1) values with
    ``numpy.random.default_rng(seed)``, scales each by ``MAXNORM_REF / max|x|`` (the
    MaxNorm quantizer's ``y``), and runs 1-D Lloyd on ``|y|`` with ``2**bits / 2``
    centroids (the table is symmetric, so 0 is always a boundary): midpoint boundaries,
    ties to the lower bin, centroids = bin means, until no centroid moves by more than
    1e-13.  The defaults are the settings used for the constants in this module (about
    2 minutes and 6 GB); a test re-derives them with a smaller sample.

    Parameters
    ----------
    bits : int
        1 or 2 (3 and 4 use the fixed tables).
    n_blocks : int
        Number of 32-value blocks.
    seed : int
        Seed of ``numpy.random.default_rng``.

    Returns
    -------
    numpy.ndarray
        float64, shape ``(2**bits,)``, ascending, symmetric centroids.
    """
    bits = _check_int("bits", bits, 1, 2, " (fit_maxnorm_lloyd fits the 1- and 2-bit tables)")
    n_blocks = _check_int("n_blocks", n_blocks, 1, None)
    rng = np.random.default_rng(seed)
    a = np.empty(n_blocks * _FIT_BLOCK)
    chunk = 1 << 18  # blocks per draw: bounds temporary memory; the stream is chunk-invariant
    for s in range(0, n_blocks, chunk):
        nb = min(chunk, n_blocks - s)
        x = np.abs(rng.standard_normal((nb, _FIT_BLOCK)))
        x *= MAXNORM_REF / x.max(axis=1, keepdims=True)
        a[s * _FIT_BLOCK:(s + nb) * _FIT_BLOCK] = x.ravel()
    # Sort once; every Lloyd step is then a searchsorted plus prefix-sum differences.
    a.sort()
    csum = np.concatenate(([0.0], np.cumsum(a)))
    k = (1 << bits) // 2
    c = MAXNORM_REF * (np.arange(k) + 0.5) / k
    for _ in range(10_000):
        cuts = np.searchsorted(a, (c[:-1] + c[1:]) * 0.5, side="right")  # ties -> lower bin
        edges = np.concatenate(([0], cuts, [a.size]))
        counts = np.diff(edges)
        new = np.where(counts > 0, (csum[edges[1:]] - csum[edges[:-1]]) / np.maximum(counts, 1), c)
        moved = float(np.max(np.abs(new - c)))
        c = new
        if moved < 1e-13:
            break
    return np.concatenate((-c[::-1], c))


@functools.lru_cache(maxsize=None, typed=True)
def maxnorm_table(bits: int) -> Codebook:
    """MaxNorm-mode codebook (values in ``[-MAXNORM_REF, MAXNORM_REF]``).

    * 1, 2 bits: Lloyd–Max fitted to MaxNorm-scaled Gaussian 32-blocks (hard-coded
      output of :func:`fit_maxnorm_lloyd`; replaces turboquant-rs's defective 2-bit
      table, see the module docstring).
    * 3 bits: llama.cpp ``tq3_centroids`` ``±0.2428, ±0.7434, ±1.3336, ±2.1573``.
    * 4 bits: uniform grid ``c_i = −2.1573 + i·(4.3146/15)``, ``i = 0..15``.

    Boundaries are midpoints of consecutive centroids in every case.

    Parameters
    ----------
    bits : int
        1..4.

    Returns
    -------
    Codebook
        ``norm_mode="maxnorm"``, ``ref=MAXNORM_REF``; cached per ``bits``.
    """
    bits = _check_int("bits", bits, 1, _MAX_BITS["maxnorm"], " for norm_mode='maxnorm'")
    if bits in _MAXNORM_FITTED_POS:
        pos = np.array(_MAXNORM_FITTED_POS[bits])
        c = np.concatenate((-pos[::-1], pos))
        source = (f"symmetric Lloyd fit to MaxNorm-scaled N(0,1) 32-blocks "
                  f"(fit_maxnorm_lloyd({bits}, {_FIT_N_BLOCKS}, seed={_FIT_SEED}))")
    elif bits == 3:
        pos = np.array(_MAXNORM_3BIT_POS)
        c = np.concatenate((-pos[::-1], pos))
        source = "llama.cpp tq3_centroids (turboquant-rs MaxNorm 3-bit)"
    else:
        c = -MAXNORM_REF + np.arange(16) * (2.0 * MAXNORM_REF / 15.0)
        source = "uniform 16-point grid on [-2.1573, 2.1573] (turboquant-rs MaxNorm 4-bit)"
    c32 = c.astype(np.float32)
    return Codebook(bits=bits, norm_mode="maxnorm", centroids=c32, boundaries=_midpoints_f32(c32),
                    ref=MAXNORM_REF, source=source)


# ------------------------------------------------------------------------------------
# Public entry points
# ------------------------------------------------------------------------------------


def get_codebook(bits: int, norm_mode: str, block: int = 32) -> Codebook:
    """Codebook used by the block quantizer.

    Parameters
    ----------
    bits : int
        1..4 for ``"maxnorm"``, 1..8 for ``"l2"``.
    norm_mode : str
        ``"maxnorm"`` -> :func:`maxnorm_table`; ``"l2"`` -> ``lloyd_max_sphere(bits,
        block)``.
    block : int
        Quantization block size (the dimension of the normalized vector in L2 mode).
        MaxNorm tables are defined for 32-blocks only.

    Returns
    -------
    Codebook
        Cached, immutable.

    Raises
    ------
    ValueError
        Naming the offending argument, the allowed values and the value received.
    """
    mode = _check_norm_mode(norm_mode)
    bits = _check_int("bits", bits, 1, _MAX_BITS[mode], f" for norm_mode={mode!r}")
    if mode == "maxnorm":
        if not (isinstance(block, (int, np.integer)) and not isinstance(block, (bool, np.bool_))
                and int(block) == _FIT_BLOCK):
            raise ValueError(f"block: expected 32 for norm_mode='maxnorm' (the MaxNorm tables "
                             f"are defined for 32-blocks), got {block!r}")
        return maxnorm_table(bits)
    block = _check_int("block", block, 3, None, " for norm_mode='l2'")
    return lloyd_max_sphere(bits, block)


def assign(y: np.ndarray, cb: Codebook) -> np.ndarray:
    """Reference index assignment ``idx = #{i : y > boundaries[i]}``.

    Ties at a boundary go to the lower bin; index 0 is the most negative centroid
    (§2.4.3).  NaN is not meaningful input (it maps to the top index).

    Parameters
    ----------
    y : array_like
        Normalized values (MaxNorm: ``r / scale``; L2: ``x / ‖x‖``), any shape.
    cb : Codebook
        The codebook.

    Returns
    -------
    numpy.ndarray
        uint8, same shape as ``y``, values in ``[0, 2**cb.bits)``.
    """
    # searchsorted(side="left") returns the number of boundaries strictly below y.
    return np.asarray(np.searchsorted(cb.boundaries, np.asarray(y), side="left"), dtype=np.uint8)


# --- single-source bucketize cores (the quantizers' index assignment) -----------------
# ``idx = #{i : y > t_i}`` counted boundary by boundary over a whole scratch row, with the
# comparison added as an integer (``ib += uint8(y > t_i)``) instead of a conditional store
# ``if y > t_i: ib += 1``.  Both give the same bytes, but the conditional uint8 store only
# vectorizes with AVX-512BW masked byte stores; with AVX2 it stays a scalar loop with an
# unpredictable branch per value (rate halving with every extra bit, about 11x slower at
# 3 bits).  The branch-free form vectorizes to compare + subtract on every x86-64 target
# and is a plain add on the GPU.
def bucketize(t, n, bounds, ib):
    """``ib[m] = #{i : t[m] > bounds[i]}`` for ``m < n`` (``bounds`` ascending; ties go low).

    ``t`` float32[>= n], ``bounds`` float32[k], ``ib`` uint8[>= n] (written).
    """
    for m in range(n):
        ib[m] = 0
    for i in range(bounds.shape[0]):
        bi = bounds[i]
        for m in range(n):
            ib[m] += uint8(t[m] > bi)


def bucketize_select(t, n, bounds, centroids, ib, cv):
    """:func:`bucketize`, plus ``cv[m] = centroids[ib[m]]`` picked by selects while counting
    (ascending boundaries: the last boundary passed wins) — no gather, so it vectorizes
    without AVX2/AVX-512 gathers.  ``cv`` float32[>= n] (written)."""
    c0 = centroids[0]
    for m in range(n):
        ib[m] = 0
        cv[m] = c0
    for i in range(bounds.shape[0]):
        bi = bounds[i]
        ci = centroids[i + 1]
        for m in range(n):
            gt = t[m] > bi
            ib[m] += uint8(gt)
            cv[m] = ci if gt else cv[m]


bucketize_cpu, bucketize_dev = twin(bucketize)
bucketize_select_cpu, _ = twin(bucketize_select)
