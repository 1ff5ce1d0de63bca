"""Low-rank projection ops: per-row channel statistics, projection onto a basis, and
reconstruction — plus binary16 storage conversion for coefficients and bases.

A *row* is one independent matrix of tokens, e.g. one (batch, KV head) pair:
``x[r]`` is ``(n, d)``.  Low-rank compression fits, per row, the channel mean ``μ_r`` and
the principal axes of the centred tokens (PCA = SVD of ``x_r − μ_r``; the axes are the
eigenvectors of the centred Gram matrix ``G_r = Σ_t (x_rt − μ_r)(x_rt − μ_r)ᵀ``), keeps
the top ``rank`` of them as the rows of ``components[r]`` (``(rank, d)``, orthonormal)
and stores ``coef_rt = components[r] · (x_rt − μ_r)``.  By Eckart–Young this is the best
rank-``rank`` affine approximation in the Frobenius norm; it subsumes gllm-kernels'
"keep the highest-energy channels" (a basis of unit vectors), which can only be worse.

Ops (CPU twin + CUDA kernel each, from the single-source cores below):

* ``lowrank_mean``, then ``lowrank_gram``: ``mean[r] = Σ_t x_rt / n`` and
  ``amax[r, i] = max_t |x_rti|``; ``gram[r] = Σ_t y_rt y_rtᵀ`` with ``y_rt = (x_rt − μ_r) / s_r``
  (two passes: centring first avoids the cancellation of ``E[x²] − E[x]²`` on channels with a
  large mean — exactly the outlier channels of real keys).  Every sum runs on values
  pre-scaled by a power of two (``s_r`` = :func:`row_scale` of the row's largest ``|x|``; the
  mean by its channel's own), so float32 holds the statistics of any finite input: a plain
  float32 Gram overflows once ``|x| ≳ 1e19 / √n`` and underflows to 0 below ``≈ 1e-20``.
  Scaling by a power of two is exact, so in between the result is the plain float32 sum's,
  bit for bit (times ``s_r⁻²``); the eigenvectors and the energy ratios do not depend on it;
* ``lowrank_project``: ``out[r, t, c] = Σ_j (x[r, t, j] − mean[r, j]) · components[r, c, j]``;
* ``lowrank_reconstruct``: ``out[r, t, j] = mean[r, j] + Σ_c coef[r, t, c] · components[r, c, j]``;
* ``f16_encode`` / ``f16_decode``: float32 ↔ binary16 bit patterns (uint16), round to
  nearest even, saturating at ±65504 (Numba's CPU target has no float16 type).

``mean``, ``components`` and ``coef`` broadcast over rows when their leading axis is 1
(one shared basis — the MLA up-projections use this).  The eigen-decomposition of the
small ``d × d`` Gram matrices runs on the host (:func:`fit_components`): only ``R·d²``
floats cross from the device.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import cuda, float32, prange

from .. import _backend
from .._jit import cpu_kernel, cuda_kernel, twin
from .._validate import check_int, check_real
from ._exact import mul_rn
from ._index import unravel2, unravel3
from ._registry import F32_2D, F32_3D, Twin, register
from .finite import all_finite, check_finite, range_stats
from .gather import to_like
from .half import f16_bits_to_f32_cpu, f16_bits_to_f32_dev, f32_to_f16_bits_sat_cpu, f32_to_f16_bits_sat_dev

__all__ = ["channel_stats", "fit_components", "project", "reconstruct", "f16_encode", "f16_decode",
           "pow2_row_scales", "row_scale", "ENERGY_FRACTION"]

ENERGY_FRACTION = 0.9
"""Seed rule for the automatic rank: smallest rank explaining >= 90 % (see :func:`fit_components`)."""

# --- single-source cores --------------------------------------------------------------
# The CPU twins ``prange`` over the items and the CUDA kernels grid-stride over them.  The
# Gram, projection and reconstruction cores cover ``span`` consecutive outputs starting at
# flat output ``e·span`` (C order; ``span`` divides the last axis): the CPU twins pass a
# whole row per call (``span`` = the last axis: a call per output would cost as much as the
# output; the inner loops stay contiguous), the CUDA kernels one output per thread
# (``span = 1``: coalesced stores).  Every output is the same float32 sum in the same order
# either way.
#
# Statistics pre-scale (see the module docstring): powers of two in [2**-126, 2**127], whose
# inverses are normal float32 numbers too, so ``x · (1 / s)`` is exact down to subnormals
_SCALE_MIN = float32(2.0 ** -126)
_SCALE_MAX = float32(2.0 ** 127)
_TWO = float32(2.0)
_HALF = float32(0.5)


def _pow2_at_least(m):
    """Smallest power of two ``>= m`` within ``[2**-126, 2**127]`` (``m >= 0``, finite):
    ``|x| / s <= 2`` for every ``|x| <= m``.  Doubling and halving are exact."""
    s = float32(1.0)
    while s < m and s < _SCALE_MAX:
        s = s * _TWO
    while s > _SCALE_MIN and s * _HALF >= m:
        s = s * _HALF
    return s


pow2_at_least_cpu, pow2_at_least_dev = twin(_pow2_at_least, inline=True)


def _channel_mean(x, e, mean, amax):
    """``mean[r, i] = Σ_t x[r, t, i] / n`` and ``amax[r, i] = max_t |x[r, t, i]|`` of channel
    item ``e = (r, i)`` (float32, tokens in order, summed pre-scaled by a power of two: no
    overflow; 0 when ``n == 0``)."""
    r, i = unravel2(e, x.shape[2])
    n = x.shape[1]
    m = float32(0.0)
    for t in range(n):
        a = abs(x[r, t, i])
        if a > m:
            m = a
    amax[r, i] = m
    sc = _pow2_at_least(m)
    inv = float32(1.0) / sc
    s = float32(0.0)
    for t in range(n):
        s += mul_rn(x[r, t, i], inv)  # exact: a power of two
    mean[r, i] = s * (float32(1.0) / float32(max(n, 1))) * sc


channel_mean_cpu, channel_mean_dev = twin(_channel_mean, inline=True)


def _gram_span(x, mean, amax, e, span, gram):
    """``gram[r, i, j] = Σ_t y_rti · y_rtj``, ``y = (x − μ) / s_r`` (``s_r`` the power of two of
    the row's largest ``amax``), for ``j`` in ``[j0, j0 + span)``, ``(r, i, j0)`` the Gram entry
    ``e·span``."""
    r, i, j0 = unravel3(e * span, gram.shape[1], gram.shape[2])
    j1 = j0 + span
    m = float32(0.0)
    for c in range(amax.shape[1]):
        if amax[r, c] > m:
            m = amax[r, c]
    inv = float32(1.0) / _pow2_at_least(m)
    mi = mean[r, i] * inv
    for j in range(j0, j1):
        gram[r, i, j] = float32(0.0)
    for t in range(x.shape[1]):
        xi = x[r, t, i] * inv - mi
        for j in range(j0, j1):
            gram[r, i, j] += xi * (x[r, t, j] * inv - mean[r, j] * inv)


gram_span_cpu, gram_span_dev = twin(_gram_span, inline=True)


def _project_span(x, mean, components, e, span, out):
    """``out[r, t, c] = Σ_j (x[r, t, j] − mean[r, j]) · components[r, c, j]`` for ``c`` in
    ``[c0, c0 + span)``, ``(r, t, c0)`` the coefficient ``e·span``; ``mean``/``components``
    broadcast when their leading axis is 1."""
    r, t, c0 = unravel3(e * span, out.shape[1], out.shape[2])
    xr = x[r, t]
    mr = mean[r if mean.shape[0] > 1 else 0]
    br = components[r if components.shape[0] > 1 else 0]
    orow = out[r, t]
    for c in range(c0, c0 + span):
        bc = br[c]
        s = float32(0.0)
        for j in range(xr.shape[0]):
            s += (xr[j] - mr[j]) * bc[j]
        orow[c] = s


project_span_cpu, project_span_dev = twin(_project_span, inline=True)


def _reconstruct_span(coef, mean, components, e, span, out):
    """``out[r, t, j] = mean[r, j] + Σ_c coef[r, t, c] · components[r, c, j]`` for ``j`` in
    ``[j0, j0 + span)``, ``(r, t, j0)`` the output ``e·span`` (``c`` in order; inputs
    broadcast when their leading axis is 1)."""
    r, t, j0 = unravel3(e * span, out.shape[1], out.shape[2])
    j1 = j0 + span
    rm = r if mean.shape[0] > 1 else 0
    rb = r if components.shape[0] > 1 else 0
    rc = r if coef.shape[0] > 1 else 0
    for j in range(j0, j1):
        out[r, t, j] = mean[rm, j]
    for c in range(components.shape[1]):
        a = coef[rc, t, c]
        for j in range(j0, j1):
            out[r, t, j] += a * components[rb, c, j]


reconstruct_span_cpu, reconstruct_span_dev = twin(_reconstruct_span, inline=True)


# --- CPU twins: prange over the items (a whole row each) -------------------------------------
@cpu_kernel
def _lowrank_mean_cpu(x, mean, amax):
    """CPU twin of :func:`_lowrank_mean_cuda`: ``prange`` over the ``R·d`` channels."""
    for e in prange(x.shape[0] * x.shape[2]):
        channel_mean_cpu(x, e, mean, amax)


@cpu_kernel
def _lowrank_gram_cpu(x, mean, amax, gram):
    """CPU twin of :func:`_lowrank_gram_cuda`: ``prange`` over the ``R·d`` Gram rows."""
    for e in prange(gram.shape[0] * gram.shape[1]):
        gram_span_cpu(x, mean, amax, e, gram.shape[2], gram)


@cpu_kernel
def _lowrank_project_cpu(x, mean, components, out):
    """CPU twin of :func:`_lowrank_project_cuda`: ``prange`` over the ``R·n`` tokens."""
    for e in prange(out.shape[0] * out.shape[1]):
        project_span_cpu(x, mean, components, e, out.shape[2], out)


@cpu_kernel
def _lowrank_reconstruct_cpu(coef, mean, components, out):
    """CPU twin of :func:`_lowrank_reconstruct_cuda`: ``prange`` over the ``R·n`` tokens."""
    for e in prange(out.shape[0] * out.shape[1]):
        reconstruct_span_cpu(coef, mean, components, e, out.shape[2], out)


@cpu_kernel
def _f16_encode_cpu(x, mul, per_row, out):
    """CPU twin of :func:`_f16_encode_cuda`: ``prange`` over the values."""
    for i in prange(x.shape[0]):
        out[i] = f32_to_f16_bits_sat_cpu(x[i] * mul[i // per_row])


@cpu_kernel
def _f16_decode_cpu(h, mul, per_row, out):
    """CPU twin of :func:`_f16_decode_cuda`: ``prange`` over the values."""
    for i in prange(h.shape[0]):
        out[i] = f16_bits_to_f32_cpu(h[i]) * mul[i // per_row]


# --- CUDA kernels: grid-stride over the items (one output each) -----------------------------
@cuda_kernel
def _lowrank_mean_cuda(x, mean, amax):
    """1-D grid over the ``R·d`` channels; one thread takes the largest ``|x|`` of one channel
    and averages it over the tokens."""
    for e in range(cuda.grid(1), x.shape[0] * x.shape[2], cuda.gridsize(1)):
        channel_mean_dev(x, e, mean, amax)


@cuda_kernel
def _lowrank_gram_cuda(x, mean, amax, gram):
    """1-D grid over the ``R·d·d`` Gram entries; one thread sums one entry over the tokens
    (``mean`` and ``amax`` from :func:`_lowrank_mean_cuda`, launched first)."""
    for e in range(cuda.grid(1), gram.shape[0] * gram.shape[1] * gram.shape[2], cuda.gridsize(1)):
        gram_span_dev(x, mean, amax, e, 1, gram)


@cuda_kernel
def _lowrank_project_cuda(x, mean, components, out):
    """1-D grid over the ``R·n·rank`` coefficients; one thread computes one dot product."""
    for e in range(cuda.grid(1), out.shape[0] * out.shape[1] * out.shape[2], cuda.gridsize(1)):
        project_span_dev(x, mean, components, e, 1, out)


@cuda_kernel
def _lowrank_reconstruct_cuda(coef, mean, components, out):
    """1-D grid over the ``R·n·d`` outputs; one thread reconstructs one value."""
    for e in range(cuda.grid(1), out.shape[0] * out.shape[1] * out.shape[2], cuda.gridsize(1)):
        reconstruct_span_dev(coef, mean, components, e, 1, out)


@cuda_kernel
def _f16_encode_cuda(x, mul, per_row, out):
    """1-D grid over the values; one thread converts one, times its row's power of two
    ``mul[i // per_row]`` (exact), saturating at ±65504."""
    for i in range(cuda.grid(1), x.shape[0], cuda.gridsize(1)):
        out[i] = f32_to_f16_bits_sat_dev(x[i] * mul[i // per_row])


@cuda_kernel
def _f16_decode_cuda(h, mul, per_row, out):
    """1-D grid over the values; one thread converts one binary16 pattern, times its row's
    power of two ``mul[i // per_row]`` (exact)."""
    for i in range(cuda.grid(1), h.shape[0], cuda.gridsize(1)):
        out[i] = f16_bits_to_f32_dev(h[i]) * mul[i // per_row]


_LOWRANK_MEAN = register("lowrank_mean", _lowrank_mean_cpu, _lowrank_mean_cuda,
                         [f"void({F32_3D}, {F32_2D}, {F32_2D})"])
_LOWRANK_GRAM = register("lowrank_gram", _lowrank_gram_cpu, _lowrank_gram_cuda,
                         [f"void({F32_3D}, {F32_2D}, {F32_2D}, {F32_3D})"])
_LOWRANK_PROJECT = register("lowrank_project", _lowrank_project_cpu, _lowrank_project_cuda,
                            [f"void({F32_3D}, {F32_2D}, {F32_3D}, {F32_3D})"])
_LOWRANK_RECONSTRUCT = register("lowrank_reconstruct", _lowrank_reconstruct_cpu, _lowrank_reconstruct_cuda,
                                [f"void({F32_3D}, {F32_2D}, {F32_3D}, {F32_3D})"])
_F16_ENCODE = register("f16_encode", _f16_encode_cpu, _f16_encode_cuda,
                       ["void(float32[::1], float32[::1], int64, uint16[::1])"])
_F16_DECODE = register("f16_decode", _f16_decode_cpu, _f16_decode_cuda,
                       ["void(uint16[::1], float32[::1], int64, float32[::1])"])


# --- internal entry points (callers validated; arrays float32 C-contiguous, one device) ----
def _contiguous(a: Any) -> Any:
    """``a`` C-contiguous on its own device (Numba device arrays must already be)."""
    xp = _backend.xp_of(a)
    return a if xp is None else xp.ascontiguousarray(a)


def _launch_per_output(op: Twin, dev: str, out: Any, inner: int, *args: Any) -> None:
    """Launch span op ``op`` with one CUDA item per element of ``out`` (3-D) and ``inner``
    scalar operations per element (the CPU work estimate); nothing when ``out`` is empty."""
    items = out.shape[0] * out.shape[1] * out.shape[2]
    if items:
        op.launch(dev, items, *args, work=items * inner)


def stats_into(x3: Any, mean: Any, amax: Any, gram: Any) -> None:
    """``mean`` ``[R, d]``, channel maxima ``amax = max_t |x3|`` ``[R, d]`` and the centred
    Gram matrices scaled by ``row_scale(amax)⁻²`` (``gram`` ``[R, d, d]``) of ``x3``
    ``[R, n, d]``; finite for any finite ``x3``."""
    rows, n, d = x3.shape
    if rows == 0 or d == 0:
        return
    dev = _backend.device_of("x3", x3)
    _LOWRANK_MEAN.launch(dev, rows * d, x3, mean, amax, work=2 * rows * n * d)
    _launch_per_output(_LOWRANK_GRAM, dev, gram, n, x3, mean, amax, gram)


def row_scale(amax: np.ndarray) -> np.ndarray:
    """The power of two each row's Gram matrix is scaled by (host, float64 ``[R]``): the
    smallest ``2**e >= max(amax[r])``, ``e`` clamped to ``[-126, 127]`` (as in the kernels)."""
    m = np.asarray(amax, np.float64).max(axis=1) if np.size(amax) else np.zeros(len(amax))
    frac, exp = np.frexp(m)  # m = frac · 2**exp, frac in [0.5, 1) (0 for m = 0)
    exp = np.where(frac == 0.5, exp - 1, exp)
    return np.ldexp(1.0, np.clip(np.where(m > 0, exp, -126), -126, 127))


def project_into(x3: Any, mean: Any, components: Any, out: Any) -> None:
    """``out[r, t] = components[r] · (x3[r, t] − mean[r])`` (``[R, n, rank]``)."""
    _launch_per_output(_LOWRANK_PROJECT, _backend.device_of("x3", x3), out, x3.shape[2], x3, mean, components, out)


def reconstruct_into(coef: Any, mean: Any, components: Any, out: Any) -> None:
    """``out[r, t] = mean[r] + coef[r, t] · components[r]`` (``[R, n, d]``)."""
    _launch_per_output(_LOWRANK_RECONSTRUCT, _backend.device_of("out", out), out, components.shape[1], coef, mean,
                       components, out)


_ONE = np.ones(1, np.float32)


def pow2_row_scales(bound: np.ndarray, top: float = 2.0 ** 15) -> np.ndarray:
    """Per-row powers of two that bring each row's values within ``top``, for :func:`f16_encode`.

    Stored as ``x / s_r`` in binary16 (``top = 2**15`` < 65504), a row keeps binary16's full
    relative precision down to ``2**-29`` of its bound, at any scale of the data.

    Parameters
    ----------
    bound : float array, shape ``(R,)``
        Host bounds (``>= 0``, finite) of every row's largest ``|value|``.
    top : float
        The largest magnitude a scaled row may reach.

    Returns
    -------
    numpy.ndarray
        float32, shape ``(R,)``: the smallest ``s_r = 2**e >= bound[r] / top``, ``e`` clamped to
        ``[-126, 127]`` (``1`` for a zero bound).
    """
    b = np.asarray(bound, np.float64) / top
    frac, exp = np.frexp(b)  # b = frac · 2**exp, frac in [0.5, 1)
    exp = np.where(frac == 0.5, exp - 1, exp)
    return np.ldexp(1.0, np.clip(np.where(b > 0, exp, 0), -126, 127)).astype(np.float32)


def _convert(op: Twin, name: str, a: Any, dtype: Any, expected: str, out_dtype: Any,
             mul: Any = None) -> Any:
    """Run elementwise conversion ``op`` over ``a`` (any shape, dtype ``dtype``; argument
    ``name``, described as ``expected`` in the error) into a new ``out_dtype`` array of the
    same shape on the device of ``a``, each value times ``mul[r]`` (float32 powers of two, one
    per index ``r`` of the first axis, on the host or the device of ``a``; ``None``: 1)."""
    dev = _backend.resolve_device("auto", **{name: a})
    if np.dtype(a.dtype) != dtype:
        raise TypeError(f"{name}: expected dtype {expected}, got {np.dtype(a.dtype)}")
    shape = tuple(a.shape)
    flat = a.reshape(-1)
    if mul is None:
        mul, per_row = _ONE, max(int(flat.shape[0]), 1)
    else:
        if isinstance(mul, np.ndarray):
            mul = np.ascontiguousarray(mul, np.float32)
        if not shape or tuple(mul.shape) != (shape[0],) or np.dtype(mul.dtype) != np.float32:
            raise ValueError(f"row_scale: expected float32 powers of two, one per row of {name} ({shape[:1]}), "
                             f"got {np.dtype(mul.dtype)} of shape {tuple(mul.shape)}")
        per_row = max(int(flat.shape[0]) // max(shape[0], 1), 1)
    out = _backend.empty(a, (flat.shape[0],), out_dtype)
    if flat.shape[0]:
        op.launch(dev, flat.shape[0], _contiguous(flat), to_like(a, mul), per_row, out)
    return out.reshape(shape)


def f16_encode(x: Any, row_scale: np.ndarray | None = None) -> Any:
    """float32 array → binary16 bit patterns (uint16, same shape, same device).

    Round to nearest even; values beyond ±65504 saturate.  ``out.view(numpy.float16)``
    reads the result on the host.

    Parameters
    ----------
    x : float32 array, any shape, C-contiguous.
    row_scale : float32 NumPy array, shape ``(x.shape[0],)``, optional
        Powers of two (:func:`pow2_row_scales`): row ``r`` is stored as ``x[r] / row_scale[r]``
        (exact), for :func:`f16_decode` with the same scales.

    Returns
    -------
    uint16 array, shape of ``x``.

    Raises
    ------
    TypeError
        ``x`` is not float32 (:func:`f16_decode` likewise for ``h`` not uint16).
    ValueError
        ``x`` holds a NaN (it came back as ±0; ±Inf saturate like the other large values).
    """
    inverse = None if row_scale is None else (1.0 / np.asarray(row_scale, np.float64)).astype(np.float32)
    out = _convert(_F16_ENCODE, "x", x, np.float32, "float32", np.uint16, inverse)  # (checks the array and dtype)
    if range_stats(x).nonfinite and np.isnan(_backend.to_host(x)).any():
        raise ValueError("x: expected no NaN (binary16 codes here have no NaN pattern), got NaN")
    return out


def f16_decode(h: Any, row_scale: Any = None) -> Any:
    """The inverse of :func:`f16_encode`.

    Parameters
    ----------
    h : uint16 array, any shape, C-contiguous
        Binary16 bit patterns (finite), NumPy or CUDA.
    row_scale : float32 array, shape ``(h.shape[0],)``, optional
        The powers of two ``h`` was encoded with (:func:`pow2_row_scales`), on the host or the
        device of ``h``: row ``r`` comes back times ``row_scale[r]``.

    Returns
    -------
    float32 array, the shape of ``h``, on its device.

    Raises
    ------
    TypeError
        ``h`` is not uint16.
    ValueError
        ``row_scale`` is not float32 of one value per row.
    """
    return _convert(_F16_DECODE, "h", h, np.uint16, "uint16 (binary16 bits)", np.float32, row_scale)


# --- host-side fitting -------------------------------------------------------------------
def fit_components(mean: np.ndarray, gram: np.ndarray, n: int, rank: int,
                   energy: float | None = ENERGY_FRACTION) -> tuple[np.ndarray, int]:
    """Principal axes of every row from its statistics (host, float64 eigen-decomposition).

    Parameters
    ----------
    mean : float array, shape ``(R, d)``
        Channel means (from :func:`channel_stats`).
    gram : float array, shape ``(R, d, d)``
        Centred Gram matrices, each times any positive factor (the rule uses eigenvectors and
        eigenvalue ratios only): :func:`stats_into`'s scaled ones or :func:`channel_stats`'.
    n : int
        Tokens per row the statistics were taken over (kept for callers; the rule
        uses eigenvalue ratios only).
    rank : int
        Upper bound on the rank (``>= 1``).
    energy : float or None
        Automatic rank (gllm-kernels' 0.9 rule, applied to what the
        basis has to explain — the variance around the stored mean, which is kept
        exactly): per row, the smallest ``k`` with ``Σ_{i<k} λ_i >= energy · Σ_i λ_i``
        (explained-variance ratio); the common rank is the largest over rows, clamped to
        ``[1, min(rank, d)]``.  gllm-kernels measures uncentred energy, where a large channel
        mean alone can pass 90 % and leave a rank-1 model.  ``None`` keeps
        ``min(rank, d)``.

    Returns
    -------
    components : float32 array, shape ``(R, r_eff, d)``
        Orthonormal rows, by decreasing eigenvalue; sign fixed so that each axis' largest
        entry is positive (deterministic across platforms).
    r_eff : int
    """
    rank = check_int("rank", rank, minimum=1)
    if energy is not None and not 0.0 < check_real("energy", energy, "None or a float in (0, 1]") <= 1.0:
        raise ValueError(f"energy: expected None or a float in (0, 1], got {energy!r}")
    mean = np.asarray(mean, np.float64)
    g = np.asarray(gram, np.float64)
    rows, d = mean.shape
    max_rank = min(rank, d)
    g = 0.5 * (g + np.swapaxes(g, 1, 2))  # float32 sums are not exactly symmetric
    # one call per row: NumPy's stacked eigh was ~30x slower than the loop here (OpenBLAS)
    lam = np.empty((rows, d))
    vec = np.empty((rows, d, d))
    for r in range(rows):
        lam[r], vec[r] = np.linalg.eigh(g[r])  # ascending
    lam = np.clip(lam[:, ::-1], 0.0, None)
    vec = vec[:, :, ::-1]
    if energy is None:
        r_eff = max_rank
    else:
        total = lam.sum(1)
        captured = np.cumsum(lam, axis=1)  # [R, d]
        ks = []
        for r in range(rows):
            if total[r] <= 0:  # constant row: the mean is exact, any rank >= 1 will do
                ks.append(1)
                continue
            hit = np.nonzero(captured[r] >= energy * total[r] * (1 - 1e-12))[0]
            ks.append(int(hit[0]) + 1 if hit.size else d)
        r_eff = int(min(max(max(ks), 1), max_rank))
    comp = np.ascontiguousarray(np.swapaxes(vec[:, :, :r_eff], 1, 2))  # [R, r_eff, d]
    idx = np.abs(comp).argmax(axis=2)
    sign = np.sign(np.take_along_axis(comp, idx[..., None], axis=2))
    sign[sign == 0] = 1.0
    comp *= sign
    return comp.astype(np.float32), r_eff


# --- public API ------------------------------------------------------------------------
def _f32_3d(name: str, a: Any) -> Any:
    if len(a.shape) != 3:
        raise ValueError(f"{name}: expected a 3-D array, got shape {tuple(a.shape)}")
    return _backend.ascontiguous_f32(name, a)


def _broadcast_ok(name: str, a: Any, rows: int) -> None:
    if a.shape[0] not in (1, rows):
        raise ValueError(f"{name}: expected a leading axis of 1 or {rows} (rows), got shape {tuple(a.shape)}")


def channel_stats(x: Any) -> tuple[Any, Any]:
    """Channel means and centred Gram matrices of every row.

    Parameters
    ----------
    x : float array, shape ``(R, n, d)``
        NumPy → CPU twin; CUDA array → CUDA kernel.

    Returns
    -------
    mean : float32, shape ``(R, d)``
    gram : float32, shape ``(R, d, d)``
        Unscaled (:func:`stats_into` computes it scaled, then it is multiplied back on the host).

    Raises
    ------
    ValueError
        A Gram entry beyond the float32 range (``|x| ≳ 1e19 / √n``); the compressor fits from
        the scaled Gram matrices of :func:`stats_into`, which have no such limit.
    """
    _backend.resolve_device("auto", x=x)
    x3 = _f32_3d("x", x)
    check_finite("x", x3)  # (a NaN was reported as a Gram matrix beyond the float32 range)
    rows, _, d = x3.shape
    mean = _backend.empty(x3, (rows, d), np.float32)
    amax = _backend.empty(x3, (rows, d), np.float32)
    gram = _backend.empty(x3, (rows, d, d), np.float32)
    stats_into(x3, mean, amax, gram)
    if rows == 0 or d == 0:
        return mean, gram
    s = row_scale(_backend.to_host(amax))
    with np.errstate(over="ignore"):
        g = (_backend.to_host(gram).astype(np.float64) * (s * s)[:, None, None]).astype(np.float32)
    if not np.isfinite(g).all():
        raise ValueError(f"x: expected a centred Gram matrix within the float32 range, got entries beyond "
                         f"{np.finfo(np.float32).max:.6g} (max |x| = {float(np.max(_backend.to_host(amax))):.6g})")
    return mean, to_like(x3, g)


def project(x: Any, mean: Any, components: Any) -> Any:
    """Coefficients ``components[r] · (x[r, t] − mean[r])``.

    Parameters
    ----------
    x : float array, shape ``(R, n, d)``
    mean : float32 array, shape ``(R, d)`` or ``(1, d)``
    components : float32 array, shape ``(R, rank, d)`` or ``(1, rank, d)``

    Returns
    -------
    coef : float32 array, shape ``(R, n, rank)``, on the device of ``x``.

    Raises
    ------
    ValueError
        Shapes that do not line up, NaN or Inf, or coefficients beyond the float32 range (the
        message names the arguments).
    """
    _backend.resolve_device("auto", x=x, mean=mean, components=components)
    x3 = _f32_3d("x", x)
    rows, n, d = x3.shape
    comp = _f32_3d("components", components)
    mean = _backend.ascontiguous_f32("mean", mean)
    _broadcast_ok("components", comp, rows)
    if len(mean.shape) != 2 or mean.shape[1] != d or comp.shape[2] != d:
        raise ValueError(f"mean/components: expected last axis d={d}, got {tuple(mean.shape)} and "
                         f"{tuple(comp.shape)}")
    _broadcast_ok("mean", mean, rows)
    for name, a in (("x", x3), ("mean", mean), ("components", comp)):
        check_finite(name, a)
    out = _backend.empty(x3, (rows, n, comp.shape[1]), np.float32)
    project_into(x3, mean, comp, out)
    _check_result("x, mean, components", out)
    return out


def _check_result(names: str, out: Any) -> None:
    """``ValueError`` naming the inputs when finite ones gave a value beyond float32."""
    if not all_finite(out):
        raise ValueError(f"{names}: expected values whose result fits float32, got a result that overflows "
                         f"to inf")


def reconstruct(coef: Any, mean: Any, components: Any, rows: int | None = None) -> Any:
    """``mean[r] + coef[r, t] · components[r]`` — the inverse of :func:`project`.

    Parameters
    ----------
    coef : float array, shape ``(R, n, rank)`` or ``(1, n, rank)``
    mean : float32 array, shape ``(R, d)`` or ``(1, d)``
    components : float32 array, shape ``(R, rank, d)`` or ``(1, rank, d)``
    rows : int, optional
        ``R`` when every input broadcasts (default: the largest leading axis).

    Returns
    -------
    x_hat : float32 array, shape ``(R, n, d)``.

    Raises
    ------
    ValueError
        Shapes that do not line up, NaN or Inf, or a reconstruction beyond the float32 range
        (the message names the arguments).
    """
    _backend.resolve_device("auto", coef=coef, mean=mean, components=components)
    c3 = _f32_3d("coef", coef)
    comp = _f32_3d("components", components)
    mean = _backend.ascontiguous_f32("mean", mean)
    if len(mean.shape) != 2:  # before the row count is read from its leading axis
        raise ValueError(f"mean: expected a 2-D array (R or 1, d), got shape {tuple(mean.shape)}")
    rows = max(c3.shape[0], comp.shape[0], mean.shape[0]) if rows is None else check_int("rows", rows, minimum=0)
    for name, a in (("coef", c3), ("components", comp), ("mean", mean)):
        _broadcast_ok(name, a, rows)
    d = comp.shape[2]
    if c3.shape[2] != comp.shape[1] or mean.shape[1] != d:
        raise ValueError(f"coef: expected rank {comp.shape[1]} and mean width {d}, got coef "
                         f"{tuple(c3.shape)}, mean {tuple(mean.shape)}")
    for name, a in (("coef", c3), ("mean", mean), ("components", comp)):
        check_finite(name, a)
    out = _backend.empty(c3, (rows, c3.shape[1], d), np.float32)
    reconstruct_into(c3, mean, comp, out)
    _check_result("coef, mean, components", out)
    return out
