"""All-finite check for input validation (NaN / Inf detection), as twins.

``count = #{i : not |x_i| < inf}`` counts the non-finite values (NaN fails every
comparison, ``±Inf`` is not below ``inf``) with one compare per element — branch-free,
vectorizable, free of floating-point exceptions, and the same for every float dtype.
The CPU twin is a parallel reduction that reads the input once (``numpy.isfinite(x).all()``
writes a boolean temporary as large as ``x`` first); the CUDA kernel checks device arrays
in place instead of copying them to the host.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import cuda, float32, int64, prange

from .. import _backend
from .._jit import cpu_call, cpu_kernel, cuda_kernel
from ._registry import register

_CHUNK = 1 << 14  # elements per CPU work item
_INF = float32(np.inf)  # float32: no float64 compare in float32 kernels (exact for float64 ones)


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
