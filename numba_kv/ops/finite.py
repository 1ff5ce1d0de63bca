"""All-finite check for input validation (NaN / Inf detection), as twins.

``count = #{i : not |x_i| < inf}`` counts the non-finite values (NaN fails every
comparison, ``±Inf`` is not below ``inf``) with one compare per element — branch-free,
vectorizable, free of floating-point exceptions, and the same for every float dtype.
The CPU twin is a parallel reduction that reads the input once (``numpy.isfinite(x).all()``
writes a boolean temporary as large as ``x`` first); the CUDA kernel checks device arrays
in place instead of copying them to the host.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional

import numpy as np
from numba import cuda, float32, float64, int64, prange

from .. import _backend
from .._jit import cpu_call, cpu_kernel, cuda_kernel
from ._registry import register

_CHUNK = 1 << 14  # elements per CPU work item
_INF = float32(np.inf)  # float32: no float64 compare in float32 kernels (exact for float64 ones)
_INF64 = float64(np.inf)


# --- CPU twin ---------------------------------------------------------------------------
@cpu_kernel
def _count_nonfinite_cpu(x, out):
    n = x.shape[0]
    bad = 0
    for c in prange((n + _CHUNK - 1) // _CHUNK):
        # a view indexed from 0: no negative-index wraparound check, so the loop vectorizes
        xc = x[c * _CHUNK:min(n, (c + 1) * _CHUNK)]
        k = 0
        for i in range(xc.shape[0]):
            v = xc[i]
            if not abs(v) < _INF:
                k += 1
        bad += k
    out[0] = bad


# --- CUDA kernel: grid-stride, one atomic add per thread that found something ----------
@cuda_kernel
def _count_nonfinite_cuda(x, out):
    n = x.shape[0]
    k = int64(0)
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    for i in range(start, n, stride):
        v = x[i]
        if not abs(v) < _INF:
            k += 1
    if k:
        cuda.atomic.add(out, 0, k)


register("count_nonfinite", _count_nonfinite_cpu, _count_nonfinite_cuda,
         ["void(float32[::1], int64[::1])", "void(float64[::1], int64[::1])"], float32_only=False)


# --- public helper ----------------------------------------------------------------------
def all_finite(a: Any) -> bool:
    """True when array ``a`` (NumPy or CUDA, any shape) holds no NaN and no Inf.

    C-contiguous float32/float64 arrays are checked by the twins; anything else (float16,
    strided views) falls back to ``isfinite(a).all()`` in the array's own namespace.
    """
    dt = np.dtype(a.dtype)
    if a.size == 0 or dt.kind in "iub":
        return True
    fast = dt in (np.dtype(np.float32), np.dtype(np.float64))
    xp = _backend.xp_of(a)
    if isinstance(a, np.ndarray):
        if fast and a.flags.c_contiguous:
            out = np.zeros(1, np.int64)
            cpu_call(_count_nonfinite_cpu, a.size, a.reshape(-1), out)
            return int(out[0]) == 0
    elif xp is None and fast and getattr(a, "is_c_contiguous", lambda: False)():  # Numba device array
        out = _backend.zeros(a, (1,), np.int64)
        blocks, threads = _backend.cuda_grid((a.size + 255) // 256)  # ~256 elements per thread
        _count_nonfinite_cuda[blocks, threads](a.reshape(a.size), out)
        return int(_backend.to_host(out)[0]) == 0
    if xp is None:  # other Numba device arrays: on the host
        return bool(np.isfinite(_backend.to_host(a)).all())
    return bool(xp.isfinite(a).all())  # NumPy fallback, CuPy


# --- range statistics: finiteness, max |x| and the largest vector L2 norm, in one pass --
# Caches store binary16 numbers (float16 windows, block scales, vector norms): before they
# store anything they need to know whether the input's magnitude fits.  One read of the
# input gives all three numbers; squares are summed in float64 so no float32 value (up to
# 3.4e38) overflows the norm, and float64 input that does overflow shows as an infinite norm.
@cpu_kernel
def _range_stats_cpu(x, d, out):
    nv = x.shape[0] // d
    nch = out.shape[0]
    per = (nv + nch - 1) // nch
    for c in prange(nch):
        bad = 0.0
        amax = 0.0
        nmax = 0.0
        for r in range(c * per, min(nv, (c + 1) * per)):
            xr = x[r * d:(r + 1) * d]
            s = 0.0
            for j in range(d):
                v = float64(xr[j])
                a = abs(v)
                if not a < _INF64:
                    bad += 1.0
                else:
                    amax = max(amax, a)
                    s += v * v
            nmax = max(nmax, s)
        out[c, 0] = bad
        out[c, 1] = amax
        out[c, 2] = nmax


@cuda_kernel
def _range_stats_cuda(x, d, out):
    nv = x.shape[0] // d
    bad = float64(0.0)
    amax = float64(0.0)
    nmax = float64(0.0)
    for r in range(cuda.grid(1), nv, cuda.gridsize(1)):
        s = float64(0.0)
        for j in range(d):
            v = float64(x[r * d + j])
            a = abs(v)
            if not a < _INF64:
                bad += 1.0
            else:
                amax = max(amax, a)
                s += v * v
        nmax = max(nmax, s)
    if bad > 0.0:
        cuda.atomic.add(out, (0, 0), bad)
    cuda.atomic.max(out, (0, 1), amax)
    cuda.atomic.max(out, (0, 2), nmax)


register("range_stats", _range_stats_cpu, _range_stats_cuda,
         ["void(float32[::1], int64, float64[:, ::1])", "void(float64[::1], int64, float64[:, ::1])"],
         float32_only=False)


class RangeStats(NamedTuple):
    """What :func:`range_stats` measures (``amax`` and ``max_norm`` over finite values)."""

    nonfinite: int
    amax: float
    max_norm: float


def range_stats(a: Any, d: Optional[int] = None) -> RangeStats:
    """NaN/Inf count, largest ``|x|`` and largest L2 norm of the length-``d`` vectors of
    ``a`` (the last axis by default), in one read of ``a``.

    C-contiguous float32/float64 NumPy and Numba device arrays run on the twins; float16
    and strided views are measured with NumPy (float64) in the array's namespace.
    """
    # tuple(): the simulator's shapes reject negative indices
    d = int(tuple(a.shape)[-1]) if d is None else int(d)
    if a.size == 0 or d == 0:
        return RangeStats(0, 0.0, 0.0)
    dt = np.dtype(a.dtype)
    fast = dt in (np.dtype(np.float32), np.dtype(np.float64))
    xp = _backend.xp_of(a)
    if isinstance(a, np.ndarray) and fast and a.flags.c_contiguous:
        nch = max(1, min(64, a.size // _CHUNK))
        out = np.zeros((nch, 3), np.float64)
        cpu_call(_range_stats_cpu, a.size, a.reshape(-1), d, out)
        return RangeStats(int(out[:, 0].sum()), float(out[:, 1].max()), math.sqrt(float(out[:, 2].max())))
    if xp is None and fast and getattr(a, "is_c_contiguous", lambda: False)():  # Numba device array
        out = _backend.zeros(a, (1, 3), np.float64)
        blocks, threads = _backend.cuda_grid(max(1, (a.size // d + 7) // 8))  # ~8 vectors per thread
        _range_stats_cuda[blocks, threads](a.reshape(a.size), d, out)
        h = _backend.to_host(out)
        return RangeStats(int(h[0, 0]), float(h[0, 1]), math.sqrt(float(h[0, 2])))
    if xp is None:
        a, xp = _backend.to_host(a), np
    x = xp.asarray(a, dtype=xp.float64).reshape(-1, d)
    fin = xp.isfinite(x)
    bad = int((~fin).sum())
    x = xp.where(fin, x, 0.0)
    with np.errstate(over="ignore"):
        norm2 = (x * x).sum(axis=1)
    return RangeStats(bad, float(xp.abs(x).max()), math.sqrt(float(norm2.max())))
