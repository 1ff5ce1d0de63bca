"""QJL: the 1-bit quantized Johnson–Lindenstrauss residual sketch of TurboQuant_prod.

TurboQuant_prod (Zandieh et al., arXiv:2504.19874; the sketch is QJL, Zandieh, Daliri, Han,
arXiv:2406.03482) stores, next to the block-quantized key
``x̂``, the signs of ``m`` Gaussian projections of the residual ``r = x − x̂`` and the
residual norm ``‖r‖₂``:

* sketch ``S`` ``[m, d]``, i.i.d. ``N(0, 1)`` entries, **unscaled** (:func:`make_sketch`);
* ``σ = sign(S r)``: bit ``j`` = 1 iff ``(S r)_j >= 0``, packed LSB-first (projection ``j``
  at byte ``j // 8``, bit ``j % 8``; the 1-bit layout of :mod:`numba_kv.ops.bitpack`);
* ``γ = ‖r‖₂`` computed in float32 and stored as IEEE binary16 bits (``uint16``; below
  65504: :func:`qjl_quantize` refuses a residual whose norm would reach it).

Inner-product estimator (asymmetric: the query is projected, not quantized)::

    ⟨y, x⟩ ≈ ⟨y, x̂⟩ + γ · (√(π/2) / m) · ⟨S y, σ⟩

Why ``√(π/2) / m`` (:func:`qjl_constant`): for one Gaussian row ``s ~ N(0, I_d)`` write
``s·y = a·(s·r)/‖r‖ + s·y⊥`` with ``a = ⟨r, y⟩/‖r‖`` and ``s·y⊥`` independent of
``s·r``.  Then ``E[sign(s·r)·(s·y)] = a·E|s·r|/‖r‖ = a·√(2/π)``, i.e.
``E[sign(⟨s, r⟩)⟨s, y⟩] = √(2/π)·⟨r, y⟩/‖r‖``.  Averaging ``m`` rows and multiplying by
``‖r‖·√(π/2)`` gives an unbiased estimate of ``⟨r, y⟩`` with variance
``((π/2)·‖r‖²‖y‖² − ⟨r, y⟩²) / m``.  The constant belongs with an *unscaled* ``S``; a
sketch already scaled by ``1/√m`` needs ``√(π/2)/√m`` instead — never mix the two
(§3.2).  With Rademacher rows the identity is only approximate; we use Gaussian rows, for
which it is exact.

Ops (CPU twin + CUDA kernel each, registered for PTX and simulator tests):

* ``qjl_signs``: ``r`` ``[rows, n, d]`` → ``signs[:, t0:t0+n]`` ``[rows, capacity, m//8]``
  and ``norms[:, t0:t0+n]`` ``[rows, capacity]``;
* ``qjl_scores``: projected queries ``sq`` ``[g, rows, m]`` against tokens ``0..n-1`` →
  ``out[g, r, t] = (c · γ_t) · Σ_j sq[g, r, j]·(±1)_j`` with ``c = √(π/2)/m``.

Both twins accumulate every projection / dot product sequentially over its inner index
in float32, in the same order, so they agree bit for bit (the CUDA simulator included).
On a real GPU NVVM would contract ``acc + a·b`` into an FMA (its default ``-fma=1``), which
could move a projection sum or ``‖r‖²`` by an ulp: a projection within rounding of 0 would
get the other sign, a norm very rarely the neighbouring binary16.  The products therefore go
through :func:`numba_kv.ops._exact.mul_rn` (never fused), so signs and norms are
bit-identical on every device.  Scores need no such care: their products are by ``±1`` and
exact, so FMA or not gives the same float32 sums.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
from numba import cuda, float32, int32, int64, prange, uint8

from .. import _backend
from .._jit import cpu_kernel, cuda_kernel, twin
from .._validate import F16_MAX, F32_MAX, check_f16_result, check_float_array, check_span
from ._exact import mul_rn, mul_rn_dev
from ._index import unravel2_cpu, unravel2_dev, unravel3_dev
from ._registry import register
from .finite import all_finite, check_finite, check_finite_stats
from .half import f16_bits_to_f32, f32_to_f16_bits_sat
from .lowrank import project_into

__all__ = ["SKETCH_SEED", "make_sketch", "qjl_constant", "qjl_quantize", "qjl_inner_product",
           "qjl_signs_into", "qjl_scores_into"]

SKETCH_SEED = 20250917
"""Default seed of :func:`make_sketch`.  An arbitrary constant of its own: the block
rotation (:mod:`numba_kv.ops.hadamard`) is a fixed sign pattern, not drawn from any
generator, so the sketch is independent of it (forks that derived both from one seed saw
correlated errors)."""


# --- sketch ------------------------------------------------------------------------------
def _pos_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or int(value) < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return int(value)


@functools.lru_cache(maxsize=32)
def _sketch_cached(d: int, m: int, seed: int) -> np.ndarray:
    s = np.random.default_rng(seed).standard_normal((m, d)).astype(np.float32)
    s.flags.writeable = False
    return s


def make_sketch(d: int, m: int | None = None, seed: int = SKETCH_SEED) -> np.ndarray:
    """Gaussian QJL sketch ``S`` with i.i.d. ``N(0, 1)`` entries (unscaled).

    Parameters
    ----------
    d : int
        Vector dimension (positive).
    m : int, optional
        Number of projections; defaults to ``d``.  Must be a positive multiple of 8 (the
        signs are packed 8 per byte).
    seed : int
        Seed of ``numpy.random.default_rng``; defaults to :data:`SKETCH_SEED`.

    Returns
    -------
    S : float32 ndarray, shape ``(m, d)``, read-only
        ``default_rng(seed).standard_normal((m, d))`` rounded to float32.  Built once per
        ``(d, m, seed)`` and cached: the same object is returned again.

    Raises
    ------
    ValueError
        Non-positive ``d``, ``m`` not a positive multiple of 8, negative ``seed``.

    Examples
    --------
    >>> make_sketch(64).shape
    (64, 64)
    >>> make_sketch(64, 16) is make_sketch(64, 16)
    True
    """
    d = _pos_int("d", d)
    if m is None:
        if d % 8:
            raise ValueError(f"m: expected a positive multiple of 8 (it defaults to d={d}, which is not); "
                             "pass m explicitly")
        m = d
    if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or int(m) < 1 or int(m) % 8:
        raise ValueError(f"m: expected a positive multiple of 8, got {m!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or int(seed) < 0:
        raise ValueError(f"seed: expected a non-negative int, got {seed!r}")
    return _sketch_cached(d, int(m), int(seed))


def qjl_constant(m: int) -> float:
    """Estimator constant ``√(π/2) / m`` for an unscaled Gaussian sketch of ``m`` rows.

    ``E[sign(⟨s, r⟩)·⟨s, y⟩] = √(2/π)·⟨r, y⟩/‖r‖`` for ``s ~ N(0, I)``, so
    ``‖r‖ · qjl_constant(m) · ⟨S y, sign(S r)⟩`` is unbiased for ``⟨y, r⟩``.

    Parameters
    ----------
    m : int
        Number of projections (rows of the sketch), positive.

    Returns
    -------
    float
    """
    return math.sqrt(math.pi / 2.0) / _pos_int("m", m)


# --- single-source cores -------------------------------------------------------------------
def _pack8(p, o):
    """Byte whose bit ``k`` is set iff ``p[o + k] >= 0`` (LSB-first)."""
    v = int64(0)
    for k in range(8):
        v |= int64(p[o + k] >= float32(0.0)) << k  # the compare as a bit: no branch per sign
    return uint8(v)


def _norm_f16_bits(x):
    """binary16 bits of ``min(‖x‖₂, 65504)``; the squares summed in order in float32."""
    s = float32(0.0)
    for i in range(x.shape[0]):
        v = x[i]
        s += mul_rn(v, v)  # never an FMA (ops/_exact.py)
    return f32_to_f16_bits_sat(float32(math.sqrt(s)))


def _sign_pm(sb, j):
    """``+1`` if bit ``j`` of the packed sign row ``sb`` is set, else ``−1`` (float32)."""
    # 2·bit − 1 in float32, branch-free (a branch per sign bit is a coin flip for the
    # predictor); the bit goes through int32, whose conversion to float AVX2 has
    bit = int32((int64(sb[j >> 3]) >> (j & 7)) & 1)
    return float32(bit) * float32(2.0) - float32(1.0)


def _token_scale(cst, h):
    """``cst · γ`` for the binary16 norm bits ``h`` (first factor of every score)."""
    return cst * f16_bits_to_f32(h)


pack8_cpu, pack8_dev = twin(_pack8)
norm_f16_bits_cpu, norm_f16_bits_dev = twin(_norm_f16_bits)
sign_pm_cpu, sign_pm_dev = twin(_sign_pm)
token_scale_cpu, token_scale_dev = twin(_token_scale)

_TOK_CHUNK = 16  # tokens per CPU work item of qjl_signs (one scratch allocation each)
_LANES = 64  # tokens per CPU work item of qjl_scores (inner loops over 64 lanes vectorize)


# --- CPU twins ---------------------------------------------------------------------------
@cpu_kernel
def _qjl_signs_cpu(r, sketch, t0, signs, norms):
    """CPU twin of :func:`_qjl_signs_cuda`: ``prange`` over chunks of tokens (sketch transposed once)."""
    rows, n, d = r.shape
    m = sketch.shape[0]
    # transposed sketch: the inner loop then runs over m contiguous accumulators (it
    # vectorizes) while each projection is still summed in order i = 0..d-1
    st = np.empty((d, m), dtype=np.float32)
    for i in range(d):
        for j in range(m):
            st[i, j] = sketch[j, i]
    nt = rows * n
    for c in prange((nt + _TOK_CHUNK - 1) // _TOK_CHUNK):
        acc = np.empty(m, dtype=np.float32)
        for e in range(c * _TOK_CHUNK, min(nt, (c + 1) * _TOK_CHUNK)):
            row, tok = unravel2_cpu(e, n)
            x = r[row, tok]
            for j in range(m):
                acc[j] = float32(0.0)
            for i in range(d):
                xi = x[i]
                si = st[i]
                for j in range(m):
                    acc[j] += si[j] * xi
            sb = signs[row, t0 + tok]
            for b in range(m // 8):
                sb[b] = pack8_cpu(acc, b * 8)
            norms[row, t0 + tok] = norm_f16_bits_cpu(x)


@cpu_kernel
def _qjl_scores_cpu(sq, signs, norms, n, cst, out):
    """CPU twin of :func:`_qjl_scores_cuda`: ``prange`` over (group, 64-token tile) items."""
    g, rows, m = sq.shape
    nch = (n + _LANES - 1) // _LANES
    for c in prange(g * nch):
        gi = c // nch
        t0 = (c - gi * nch) * _LANES
        nl = min(_LANES, n - t0)
        pm = np.empty(m * _LANES, dtype=np.float32)  # ±1 of projection j, token lane l at j*L + l
        acc = np.empty(_LANES, dtype=np.float32)
        sc = np.empty(_LANES, dtype=np.float32)
        for l in range(nl):
            sb = signs[gi, t0 + l]
            for j in range(m):
                pm[j * _LANES + l] = sign_pm_cpu(sb, j)
            sc[l] = token_scale_cpu(cst, norms[gi, t0 + l])
        for rr in range(rows):
            q = sq[gi, rr]
            for l in range(nl):
                acc[l] = float32(0.0)
            for j in range(m):
                s = q[j]
                pj = pm[j * _LANES:j * _LANES + nl]
                for l in range(nl):
                    acc[l] += s * pj[l]
            o = out[gi, rr, t0:t0 + nl]
            for l in range(nl):
                o[l] = sc[l] * acc[l]


# --- CUDA kernels (grid-stride) --------------------------------------------------------------
@cuda_kernel
def _qjl_signs_cuda(r, sketch, t0, signs, norms):
    """1-D grid over the ``rows·n`` tokens; one thread writes one token's ``m/8`` sign bytes
    and its binary16 norm (projections summed in order ``i = 0..d-1`` like the CPU twin)."""
    rows, n, d = r.shape
    m = sketch.shape[0]
    acc = cuda.local.array(8, dtype=float32)
    for e in range(cuda.grid(1), rows * n, cuda.gridsize(1)):
        row, tok = unravel2_dev(e, n)
        x = r[row, tok]
        sb = signs[row, t0 + tok]
        for b in range(m // 8):
            for k in range(8):
                sj = sketch[b * 8 + k]
                p = float32(0.0)
                for i in range(d):
                    p += mul_rn_dev(sj[i], x[i])
                acc[k] = p
            sb[b] = pack8_dev(acc, 0)
        norms[row, t0 + tok] = norm_f16_bits_dev(x)


@cuda_kernel
def _qjl_scores_cuda(sq, signs, norms, n, cst, out):
    """1-D grid over the ``g·rows·n`` scores, ``t`` fastest (coalesced stores); one thread
    computes one score."""
    g, rows, m = sq.shape
    for e in range(cuda.grid(1), g * rows * n, cuda.gridsize(1)):
        gi, rr, t = unravel3_dev(e, rows, n)
        q = sq[gi, rr]
        sb = signs[gi, t]
        acc = float32(0.0)
        for j in range(m):
            acc += q[j] * sign_pm_dev(sb, j)
        out[gi, rr, t] = token_scale_dev(cst, norms[gi, t]) * acc


_QJL_SIGNS = register("qjl_signs", _qjl_signs_cpu, _qjl_signs_cuda,
         ["void(float32[:, :, ::1], float32[:, ::1], int64, uint8[:, :, ::1], uint16[:, ::1])"])
_QJL_SCORES = register("qjl_scores", _qjl_scores_cpu, _qjl_scores_cuda,
         ["void(float32[:, :, ::1], uint8[:, :, ::1], uint16[:, ::1], int64, float32, float32[:, :, ::1])"])


# --- internal entry points used by caches (no validation: callers validated) -------------
def qjl_signs_into(r3: Any, sketch: Any, signs: Any, norms: Any, t0: int) -> None:
    """Sketch ``r3`` ``[rows, n, d]`` (float32, C-contiguous) with ``sketch`` ``[m, d]`` into
    ``signs[:, t0:t0+n]`` (uint8 ``[rows, capacity, m//8]``) and ``norms[:, t0:t0+n]``
    (uint16 ``[rows, capacity]``).  All arrays on one device."""
    rows, n, d = r3.shape
    if rows == 0 or n == 0:
        return
    t0 = check_span(t0, r3.shape[1], signs.shape[1], "signs")
    m = sketch.shape[0]
    _QJL_SIGNS.launch(_backend.device_of("r3", r3), rows * n, r3, sketch, int(t0), signs, norms,
                      work=rows * n * d * m)


def qjl_scores_into(sq: Any, signs: Any, norms: Any, n: int, m: int, out: Any) -> None:
    """``out[g, r, t] = γ_{g,t} · (√(π/2)/m) · ⟨sq[g, r], σ_{g,t}⟩`` for ``t < n``.

    ``sq`` float32 ``[g, rows, m]`` (projected queries ``S y``), ``signs`` uint8
    ``[g, capacity, m//8]``, ``norms`` uint16 ``[g, capacity]``, ``out`` float32
    ``[g, rows, >= n]``; all C-contiguous on one device."""
    g, rows, _ = sq.shape
    n = int(n)
    if g == 0 or rows == 0 or n == 0:
        return
    cst = np.float32(qjl_constant(m))
    _QJL_SCORES.launch(_backend.device_of("sq", sq), g * rows * n, sq, signs, norms, n, cst, out,
                       work=g * rows * n * m)


# --- public API ------------------------------------------------------------------------
#: largest accepted ``√d · max|S|`` (a bound on the row L2 norms) of a user sketch: times the
#: largest stored norm (binary16, < 2**16) it stays below half the float32 maximum, so no
#: projection sum overflows
SKETCH_ROW_NORM_MAX = F32_MAX / 2.0 ** 17


def sketch_arg(sketch: Any, d: int, m: int | None, like: Any, name: str = "sketch") -> Any:
    """Validated float32 C-contiguous sketch ``[m, d]`` on the device of ``like`` (argument
    ``name`` in the messages: ``k_qjl[2]`` for :func:`~numba_kv.decode_attention`)."""
    if sketch is None:
        if m is None and d % 8:
            raise ValueError(f"{name}: the default sketch has m = d projections, a multiple of 8; got d={d} "
                             "(pass a sketch from make_sketch(d, m))")
        return _backend.constant(like, make_sketch(d, m))
    check_float_array(name, sketch, 2)
    ms, ds = tuple(sketch.shape)
    if ds != d:
        raise ValueError(f"{name}: expected shape (m, {d}) to match the vector dimension d={d}, "
                         f"got {(ms, ds)}")
    if ms < 1 or ms % 8:
        raise ValueError(f"{name}: expected a positive multiple of 8 rows (m), got shape {(ms, ds)}")
    if m is not None and ms != m:
        raise ValueError(f"{name}: expected {m} rows (8 per byte of signs), got shape {(ms, ds)}")
    # a projection of a vector of norm <= 65504 (qjl_quantize refuses larger ones) is at most
    # the row norm (<= sqrt(d)·max|S|) times 65504: bounded so the float32 sums never overflow
    # (an overflowed projection gave an arbitrary sign bit, silently).  max|S| comes with the
    # finiteness pass; no norm is computed (a device sketch is not copied to the host)
    amax = check_finite_stats(name, sketch).amax
    if not amax * math.sqrt(d) <= SKETCH_ROW_NORM_MAX:
        raise ValueError(f"{name}: max |{name}| = {amax:.6g} times sqrt(d) exceeds {SKETCH_ROW_NORM_MAX:.6g} "
                         f"(float32 maximum / 2**17): projections could overflow float32; an unscaled "
                         f"Gaussian sketch (make_sketch) has entries of a few units")
    return _backend.ascontiguous_f32(name, sketch)


def _contig(a: Any) -> Any:
    xp = _backend.xp_of(a)
    return xp.ascontiguousarray(a) if xp is not None else a


def qjl_quantize(r: Any, sketch: Any = None, *, backend: str = "auto") -> tuple[Any, Any]:
    """1-bit QJL sketch of vectors: packed ``sign(S r)`` and binary16 ``‖r‖₂``.

    Parameters
    ----------
    r : float16/32/64 array, shape ``(..., d)``
        Vectors to sketch (TurboQuant_prod: the residuals ``x − x̂``); finite.  Computed in
        float32.  NumPy → CPU twin; CUDA array → CUDA kernel.
    sketch : float array, shape ``(m, d)``, optional
        ``m`` a positive multiple of 8; on the device of ``r``.  Defaults to
        ``make_sketch(d)`` (``m = d``), copied once per device.
    backend : {"auto", "cpu", "cuda"}
        Device check only (never moves data).

    Returns
    -------
    signs : uint8 array, shape ``(..., m // 8)``
        Bit ``j % 8`` of byte ``j // 8`` is 1 iff ``(S r)_j >= 0``.
    norms : uint16 array, shape ``(...)``
        binary16 bits of ``‖r‖₂`` (``norms.view(numpy.float16)`` on the host), below 65504
        (a larger norm raises).

    Raises
    ------
    TypeError
        Non-float ``r`` or ``sketch``, or an unsupported array type.
    ValueError
        Bad shapes (``m`` not a multiple of 8, ``sketch`` not ``(m, d)``), NaN/Inf,
        ``√d · max|sketch|`` above :data:`SKETCH_ROW_NORM_MAX` (its projections could
        overflow float32), ``‖r‖`` beyond binary16.

    Examples
    --------
    >>> import numpy as np
    >>> signs, norms = qjl_quantize(np.ones((3, 64), np.float32))
    >>> signs.shape, signs.dtype, norms.shape, float(norms.view(np.float16)[0])
    ((3, 8), dtype('uint8'), (3,), 8.0)
    """
    _backend.resolve_device(backend, r=r, sketch=sketch)
    check_float_array("r", r)
    shape = tuple(r.shape)  # a tuple: the simulator's shapes reject negative indices
    if len(shape) < 1 or shape[-1] == 0:
        raise ValueError(f"r: expected shape (..., d) with d >= 1, got {shape}")
    d = shape[-1]
    sk = sketch_arg(sketch, d, None, r)
    m = sk.shape[0]
    check_finite("r", r)
    r3 = _backend.ascontiguous_f32("r", r).reshape(1, -1, d)
    count = r3.shape[1]
    signs = _backend.empty(r, (1, count, m // 8), np.uint8)
    norms = _backend.empty(r, (1, count), np.uint16)
    qjl_signs_into(r3, sk, signs, norms, 0)
    check_f16_result("r", norms)  # a saturated binary16 norm: r is out of range for this format
    return signs.reshape(shape[:-1] + (m // 8,)), norms.reshape(shape[:-1])


def qjl_inner_product(y: Any, signs: Any, norms: Any, sketch: Any = None, *,
                      backend: str = "auto") -> Any:
    """QJL estimate of ``⟨y, r⟩`` for every query ``y`` against every sketched vector ``r``.

    ``est = ‖r‖ · (√(π/2)/m) · ⟨S y, sign(S r)⟩`` — TurboQuant_prod's correction term: add
    it to ``⟨y, x̂⟩`` to estimate ``⟨y, x⟩`` without bias.

    Shape contract (``...`` = batch axes, equal — not broadcast — across arguments)::

        y      (..., Q, d)       or (..., d)      one query per batch entry
        signs  (..., T, m // 8)
        norms  (..., T)
        out    (..., Q, T)       or (..., T)

    E.g. ``y (Q, d)`` against ``signs (T, m//8)`` gives ``(Q, T)``; paired estimates for
    ``N`` (query, vector) pairs: ``y[:, None]``, ``signs[:, None]``, ``norms[:, None]`` give
    ``(N, 1, 1)``.

    Parameters
    ----------
    y : float16/32/64 array
        Queries; finite.  Projected (``S y``) in float32 on the device of the arrays.
    signs : uint8 array
        From :func:`qjl_quantize`.
    norms : uint16 array
        binary16 bits of ``‖r‖``, from :func:`qjl_quantize` (finite patterns).
    sketch : float array, shape ``(m, d)``, optional
        The sketch the signs were made with; defaults to ``make_sketch(d, m)`` with
        ``m = 8 * signs.shape[-1]``.
    backend : {"auto", "cpu", "cuda"}
        Device check only.

    Returns
    -------
    out : float32 array, shape above, on the device of ``y``.

    Raises
    ------
    TypeError
        Wrong dtypes or array types.
    ValueError
        Mismatched shapes, NaN/Inf in ``y``, non-finite or negative binary16 patterns in
        ``norms`` (checked for host arrays), ``√d · max|sketch|`` above
        :data:`SKETCH_ROW_NORM_MAX`, an estimate beyond float32 (``y`` too large; checked
        after the computation, one reduction read back to the host).

    Examples
    --------
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> r = rng.standard_normal((5, 64)).astype(np.float32)
    >>> signs, norms = qjl_quantize(r)
    >>> qjl_inner_product(r[:2], signs, norms).shape
    (2, 5)
    """
    _backend.resolve_device(backend, y=y, signs=signs, norms=norms, sketch=sketch)
    check_float_array("y", y)
    if np.dtype(signs.dtype) != np.uint8:
        raise TypeError(f"signs: expected dtype uint8 (packed sign bits), got {signs.dtype}")
    if np.dtype(norms.dtype) != np.uint16:
        raise TypeError(f"norms: expected dtype uint16 (binary16 bits), got {norms.dtype}")
    yshape, sshape, nshape = tuple(y.shape), tuple(signs.shape), tuple(norms.shape)
    if len(sshape) < 2 or sshape[-1] < 1:
        raise ValueError(f"signs: expected shape (..., T, m // 8) with m // 8 >= 1, got {sshape}")
    lead, T, mb = sshape[:-2], sshape[-2], sshape[-1]
    if nshape != sshape[:-1]:
        raise ValueError(f"norms: expected shape {sshape[:-1]} (signs shape without its last axis), "
                         f"got {nshape}")
    if len(yshape) not in (len(lead) + 1, len(lead) + 2) or yshape[:len(lead)] != lead or yshape[-1] < 1:
        raise ValueError(f"y: expected shape {lead + ('Q', 'd')} or {lead + ('d',)} (batch axes of signs "
                         f"{lead}), got {yshape}")
    d = yshape[-1]
    single = len(yshape) == len(lead) + 1
    Q = 1 if single else yshape[-2]
    m = 8 * mb
    sk = sketch_arg(sketch, d, m, y)
    check_finite("y", y)
    if isinstance(norms, np.ndarray) and np.any((norms & 0x7C00) == 0x7C00):
        raise ValueError("norms: expected finite binary16 patterns, got NaN or Inf")
    if isinstance(norms, np.ndarray) and np.any(norms > 0x8000):  # a norm is >= 0 (-0.0 = 0x8000 is harmless)
        raise ValueError(f"norms: expected non-negative binary16 patterns (norms ||r||, as qjl_quantize "
                         f"stores them), got {float(norms.view(np.float16)[norms > 0x8000][0])!r}")
    G = int(np.prod(lead, dtype=np.int64))
    out_shape = lead + ((T,) if single else (Q, T))
    y3 = _backend.ascontiguous_f32("y", y).reshape(G, Q, d)
    s3 = _contig(signs).reshape(G, T, mb)
    n2 = _contig(norms).reshape(G, T)
    out = _backend.empty(y, (G, Q, T), np.float32)
    if G and Q and T:
        sq = _backend.empty(y, (G, Q, m), np.float32)
        project_into(y3, _backend.zeros(y, (1, d), np.float32), sk.reshape(1, m, d), sq)
        qjl_scores_into(sq, s3, n2, T, m, out)
        # finite y can still overflow S·y or the score sums (|y| near the float32 maximum,
        # norms up to 65504): an estimate that left float32 is an error, never inf/NaN returned
        if not all_finite(out):
            raise ValueError(f"y: an estimate exceeds {F32_MAX:.6g}, the largest float32: y is too large for "
                             f"these norms (binary16, up to {F16_MAX:g}) and this sketch")
    return out.reshape(out_shape)
