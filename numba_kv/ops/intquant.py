"""Symmetric INT4 / INT8 quantization with per-channel (or per-channel-and-token-group)
scales and exact sparse outliers.

Data ``x`` is ``[R, n, C]``: ``R`` rows (e.g. heads), ``n`` tokens, ``C`` channels (e.g.
low-rank coefficients, whose variance falls by orders of magnitude from the first to the
last channel — why one scale per tensor, as in gllm-kernels, wastes most of the levels).

Per channel ``(r, c)`` (gllm-kernels' INT quantizer, applied per channel instead of per tensor):

1. ``a_t = |x_rtc|``; ``median`` = element ``⌊n/2⌋`` of sorted ``a`` (upper median);
   ``MAD`` = element ``⌊n/2⌋`` of sorted ``|a_t − median|``; threshold
   ``τ = median + 6·MAD`` if ``MAD > 0`` else ``mean(a) + 3·std(a)`` (population std).
   Both order statistics are found exactly by bisection on the value (count ``a <= mid``)
   followed by one pass for the smallest value above the bracket — no sort, no scratch
   memory, identical on both twins.
2. Values with ``|x| > τ`` are outliers: stored exactly (float32 value + int32 flat index
   into ``[R, n, C]``) and clipped to ``±τ`` for the scale.
3. Per token group ``[g·group, (g+1)·group)`` of the channel (``group = n``: one scale per
   channel): ``scale = max|clip(x)| / L`` (``1`` if that is 0), ``L = 7`` (INT4) or ``127``
   (INT8), float32, at least the smallest normal float; ``q = clamp(round(x / scale), −L, L)``
   rounding half away from zero (Rust ``f32::round``, gllm-kernels' rule).
4. Storage is channel-major ``packed[r, c, :]`` along tokens: INT8 as two's-complement
   bytes; INT4 as ``q + 8`` nibbles, token ``2i`` in the low nibble of byte ``i``, a
   missing odd tail nibble 0.  ``group`` is even, so no two groups share a byte.

Dequantization ``q · scale``, then the exact outliers are scattered back.

Ops (CPU twin + CUDA kernel each, one work item per channel or per (channel, group)):
``int_threshold``, ``int_quantize`` (also counts outliers per group), ``int_outliers``
(gathers them at host-computed offsets), ``int_dequantize``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import cuda, float32, int64, prange, uint8

from .. import _backend
from .._jit import cpu_kernel, cuda_kernel, twin
from .._validate import check_float_array
from ._exact import mul_rn
from ._index import unravel2, unravel3
from ._registry import F32_2D, F32_3D, U8_3D, register
from .finite import check_finite
from .gather import scatter_rows, to_like

__all__ = ["IntQuantized", "int_quantize", "int_dequantize", "mad_threshold", "OUTLIER_MAD_FACTOR",
           "OUTLIER_STD_FACTOR", "SUPPORTED_BITS"]

SUPPORTED_BITS = (4, 8)
OUTLIER_MAD_FACTOR = 6.0
OUTLIER_STD_FACTOR = 3.0
_FLT_MIN = np.float32(np.finfo(np.float32).tiny)  # smallest normal float32
_FLT_MAX = np.float32(np.finfo(np.float32).max)
# a bracket's width halves each step: from the float32 maximum (2**128) down to the spacing of
# subnormals (2**-149) takes 277 steps, the most a channel mixing both can need (200 stopped
# early there and returned the smallest value in the bracket, not the k-th); ordinary data
# converges in about 30
_MAX_BISECT = 300


# --- single-source cores -------------------------------------------------------------
def _kth_dev_abs(x, r, ch, k, center):
    """Element ``k`` (0-based) of sorted ``| |x[r, :, ch]| − center |``."""
    n = x.shape[1]
    hi = float32(0.0)
    nz = 0
    for t in range(n):
        a = abs(abs(x[r, t, ch]) - center)
        hi = max(hi, a)
        nz += int64(a <= float32(0.0))
    if nz >= k + 1:
        return float32(0.0)
    # invariant: count(a <= lo) <= k < count(a <= hi), so the answer is in (lo, hi]
    lo = float32(0.0)
    for _ in range(_MAX_BISECT):
        # lo + (hi - lo)/2, not (lo + hi)/2: the sum overflows to inf above half the float32
        # maximum, the bisection then stopped at once and returned the smallest deviation
        mid = lo + mul_rn(hi - lo, float32(0.5))  # never fused into an FMA
        if not (mid > lo and mid < hi):
            break
        cnt = 0
        for t in range(n):
            # counted as an integer: near the answer the compare is a coin flip, a branch
            # mispredicts about every other value
            cnt += int64(abs(abs(x[r, t, ch]) - center) <= mid)
        if cnt >= k + 1:
            hi = mid
        else:
            lo = mid
    best = hi
    for t in range(n):
        a = abs(abs(x[r, t, ch]) - center)
        best = a if (a > lo) & (a < best) else best
    return best


def _channel_threshold(x, r, ch):
    """Outlier threshold ``median + 6·MAD`` (else ``mean + 3·std``) of ``|x[r, :, ch]|``
    (factors :data:`OUTLIER_MAD_FACTOR`, :data:`OUTLIER_STD_FACTOR`)."""
    n = x.shape[1]
    k = n // 2
    med = _kth_dev_abs(x, r, ch, k, float32(0.0))
    mad = _kth_dev_abs(x, r, ch, k, med)
    # thresholds are clamped to the float32 maximum: past it ``med + 6·MAD`` would be inf, and
    # no finite value is above the maximum either, so the outliers stay the same
    if mad > float32(0.0):
        return min(med + mul_rn(float32(OUTLIER_MAD_FACTOR), mad), _FLT_MAX)  # never an FMA (ops/_exact.py)
    # mean + 3·std of a, computed on a / max(a): squares of tiny values would underflow
    amax = float32(0.0)
    for t in range(n):
        amax = max(amax, abs(x[r, t, ch]))
    if amax == float32(0.0):
        return float32(0.0)
    s = float32(0.0)
    for t in range(n):
        s += abs(x[r, t, ch]) / amax
    mean = s / float32(n)
    v = float32(0.0)
    for t in range(n):
        dv = abs(x[r, t, ch]) / amax - mean
        v += mul_rn(dv, dv)
    return min(amax * (mean + mul_rn(float32(OUTLIER_STD_FACTOR), float32(math.sqrt(v / float32(n))))), _FLT_MAX)


def _quant_level(v, th, scale, lim):
    """Clip to ±th, divide by scale, round half away from zero, clamp to ±lim."""
    c = min(max(v, -th), th)
    y = c / scale
    # floor(|y| + 0.5) rounded the sum first: 0.5 − 2**-25 + 0.5 is 1.0 in float32. The
    # remainder |y| − floor(|y|) is exact (|y| < 2**23), so its compare with 0.5 is too
    a = abs(y)
    f = int64(a)  # truncation of a value >= 0 is floor
    q = min(f + int64(a - float32(f) >= float32(0.5)), int64(lim))
    return -q if y < float32(0.0) else q


def _quantize_group(x, thr, bits, group, r, ch, gi, scales, packed, counts):
    """Scale, codes and outlier count of tokens ``[gi·group, …)`` of channel ``(r, ch)``."""
    n = x.shape[1]
    t0 = gi * group
    t1 = min(n, t0 + group)
    th = thr[r, ch]
    lim = 7 if bits == 4 else 127
    amax = float32(0.0)
    cnt = 0
    for t in range(t0, t1):
        a = abs(x[r, t, ch])
        is_out = a > th
        cnt += int64(is_out)
        amax = max(amax, th if is_out else a)
    # a scale below the smallest normal float would divide by ~0: subnormal data rounds to 0
    scale = max(amax / float32(lim), _FLT_MIN) if amax > float32(0.0) else float32(1.0)
    scales[r, ch, gi] = scale
    counts[r, ch, gi] = cnt
    if bits == 8:
        for t in range(t0, t1):
            packed[r, ch, t] = uint8(_quant_level(x[r, t, ch], th, scale, lim) & 0xFF)
    else:
        for t in range(t0, t1, 2):
            lo = _quant_level(x[r, t, ch], th, scale, lim) + 8
            hi = int64(0)
            if t + 1 < t1:
                hi = _quant_level(x[r, t + 1, ch], th, scale, lim) + 8
            packed[r, ch, t // 2] = uint8(lo | (hi << 4))


def _dequantize_group(packed, scales, bits, group, r, ch, gi, out):
    n = out.shape[1]
    t0 = gi * group
    t1 = min(n, t0 + group)
    s = scales[r, ch, gi]
    for t in range(t0, t1):
        b = int64(packed[r, ch, t]) if bits == 8 else int64(packed[r, ch, t // 2])
        if bits == 8:
            q = b - ((b >> 7) << 8)  # two's complement byte, branch-free
        else:
            q = ((b >> ((t & 1) << 2)) & 15) - 8  # low nibble for even t, high for odd
        out[r, t, ch] = float32(q) * s


def _outliers_group(x, thr, group, offsets, r, ch, gi, idx, vals):
    n = x.shape[1]
    nch = x.shape[2]
    t0 = gi * group
    t1 = min(n, t0 + group)
    th = thr[r, ch]
    o = offsets[r, ch, gi]
    for t in range(t0, t1):
        v = x[r, t, ch]
        if abs(v) > th:
            idx[o] = (r * n + t) * nch + ch
            vals[o] = v
            o += 1


def _threshold_item(x, e, out):
    """``out[r, ch]`` = outlier threshold of channel item ``e`` = (r, ch)."""
    r, ch = unravel2(e, x.shape[2])
    out[r, ch] = _channel_threshold(x, r, ch)


def _quantize_item(x, thr, bits, group, e, scales, packed, counts):
    r, ch, gi = unravel3(e, x.shape[2], scales.shape[2])
    _quantize_group(x, thr, bits, group, r, ch, gi, scales, packed, counts)


def _outliers_item(x, thr, group, offsets, e, idx, vals):
    r, ch, gi = unravel3(e, x.shape[2], offsets.shape[2])
    _outliers_group(x, thr, group, offsets, r, ch, gi, idx, vals)


def _dequantize_item(packed, scales, bits, group, e, out):
    r, ch, gi = unravel3(e, out.shape[2], scales.shape[2])
    _dequantize_group(packed, scales, bits, group, r, ch, gi, out)


for _core in (_kth_dev_abs, _channel_threshold, _quant_level, _quantize_group, _dequantize_group, _outliers_group):
    twin(_core)
# the item cores only locate the item: inlined, so a kernel makes one call per item, as before
threshold_item_cpu, threshold_item_dev = twin(_threshold_item, inline=True)
quantize_item_cpu, quantize_item_dev = twin(_quantize_item, inline=True)
outliers_item_cpu, outliers_item_dev = twin(_outliers_item, inline=True)
dequantize_item_cpu, dequantize_item_dev = twin(_dequantize_item, inline=True)


# --- CPU twins: prange over the items ----------------------------------------------------
@cpu_kernel
def _int_threshold_cpu(x, out):
    """CPU twin of :func:`_int_threshold_cuda`: ``prange`` over the ``R·C`` channels."""
    for e in prange(x.shape[0] * x.shape[2]):
        threshold_item_cpu(x, e, out)


@cpu_kernel
def _int_quantize_cpu(x, thr, bits, group, scales, packed, counts):
    """CPU twin of :func:`_int_quantize_cuda`: ``prange`` over the ``R·C·G`` token groups."""
    for e in prange(scales.shape[0] * scales.shape[1] * scales.shape[2]):
        quantize_item_cpu(x, thr, bits, group, e, scales, packed, counts)


@cpu_kernel
def _int_outliers_cpu(x, thr, group, offsets, idx, vals):
    """CPU twin of :func:`_int_outliers_cuda`: ``prange`` over the ``R·C·G`` token groups."""
    for e in prange(offsets.shape[0] * offsets.shape[1] * offsets.shape[2]):
        outliers_item_cpu(x, thr, group, offsets, e, idx, vals)


@cpu_kernel
def _int_dequantize_cpu(packed, scales, bits, group, out):
    """CPU twin of :func:`_int_dequantize_cuda`: ``prange`` over the ``R·C·G`` token groups."""
    for e in prange(scales.shape[0] * scales.shape[1] * scales.shape[2]):
        dequantize_item_cpu(packed, scales, bits, group, e, out)


# --- CUDA kernels: grid-stride over the same items ------------------------------------------
@cuda_kernel
def _int_threshold_cuda(x, out):
    """1-D grid over the ``R·C`` channels; one thread finds one channel's threshold."""
    for e in range(cuda.grid(1), x.shape[0] * x.shape[2], cuda.gridsize(1)):
        threshold_item_dev(x, e, out)


@cuda_kernel
def _int_quantize_cuda(x, thr, bits, group, scales, packed, counts):
    """1-D grid over the ``R·C·G`` token groups; one thread writes one group's scale, codes
    and outlier count."""
    for e in range(cuda.grid(1), scales.shape[0] * scales.shape[1] * scales.shape[2], cuda.gridsize(1)):
        quantize_item_dev(x, thr, bits, group, e, scales, packed, counts)


@cuda_kernel
def _int_outliers_cuda(x, thr, group, offsets, idx, vals):
    """1-D grid over the ``R·C·G`` token groups; one thread gathers one group's outliers at
    its offset."""
    for e in range(cuda.grid(1), offsets.shape[0] * offsets.shape[1] * offsets.shape[2], cuda.gridsize(1)):
        outliers_item_dev(x, thr, group, offsets, e, idx, vals)


@cuda_kernel
def _int_dequantize_cuda(packed, scales, bits, group, out):
    """1-D grid over the ``R·C·G`` token groups; one thread dequantizes one group."""
    for e in range(cuda.grid(1), scales.shape[0] * scales.shape[1] * scales.shape[2], cuda.gridsize(1)):
        dequantize_item_dev(packed, scales, bits, group, e, out)


_INT_THRESHOLD = register("int_threshold", _int_threshold_cpu, _int_threshold_cuda, [f"void({F32_3D}, {F32_2D})"])
_INT_QUANTIZE = register("int_quantize", _int_quantize_cpu, _int_quantize_cuda,
                         [f"void({F32_3D}, {F32_2D}, int64, int64, {F32_3D}, {U8_3D}, int32[:, :, ::1])"])
_INT_OUTLIERS = register("int_outliers", _int_outliers_cpu, _int_outliers_cuda,
                         [f"void({F32_3D}, {F32_2D}, int64, int64[:, :, ::1], int32[::1], float32[::1])"])
_INT_DEQUANTIZE = register("int_dequantize", _int_dequantize_cpu, _int_dequantize_cuda,
                           [f"void({U8_3D}, {F32_3D}, int64, int64, {F32_3D})"])


# --- result container ---------------------------------------------------------------------
@dataclass
class IntQuantized:
    """INT4/INT8 codes of a ``[R, n, C]`` float tensor, channel-major, with exact outliers.

    Attributes
    ----------
    packed : uint8 array, shape ``(R, C, ceil(n/2))`` (INT4) or ``(R, C, n)`` (INT8)
    scales : float32 array, shape ``(R, C, ceil(n / group))``
    outlier_idx : int32 array, shape ``(m,)``
        Flat indices into ``[R, n, C]``, ordered by (row, channel, token).
    outlier_vals : float32 array, shape ``(m,)``
        Exact values at those indices.
    bits : int
        4 or 8.
    group : int
        Tokens per scale (even).
    shape : tuple of int
        ``(R, n, C)``.
    """

    packed: Any
    scales: Any
    outlier_idx: Any
    outlier_vals: Any
    bits: int
    group: int
    shape: tuple

    @property
    def nbytes(self) -> int:
        """Exact stored bytes (codes + scales + outlier indices and values)."""
        return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
                   for a in (self.packed, self.scales, self.outlier_idx, self.outlier_vals))

    @property
    def num_outliers(self) -> int:
        """Number of values stored exactly."""
        return int(self.outlier_idx.shape[0])


# --- internal entry points (callers validated) ------------------------------------------
def thresholds_into(x3: Any, out: Any) -> None:
    """Per-channel outlier thresholds ``out[r, c]`` of ``x3`` ``[R, n, C]``."""
    rows, n, nch = x3.shape
    if rows * nch == 0 or n == 0:
        return
    _INT_THRESHOLD.launch(_backend.device_of("x3", x3), rows * nch, x3, out,
                          work=rows * nch * n * 32)  # tens of bisection passes over a channel


def quantize_int(x3: Any, bits: int, group: int) -> IntQuantized:
    """Quantize ``x3`` (float32 ``[R, n, C]``, C-contiguous) on its device."""
    rows, n, nch = x3.shape
    ng = max(1, -(-n // group))
    nbytes_t = n if bits == 8 else (n + 1) // 2
    thr = _backend.empty(x3, (rows, nch), np.float32)
    # no tokens: the scale of an all-zero group (1.0), not uninitialized memory
    scales = _backend.empty(x3, (rows, nch, ng), np.float32) if n else _backend.full(x3, (rows, nch, ng), np.float32, 1)
    packed = _backend.zeros(x3, (rows, nch, nbytes_t), np.uint8)
    counts = _backend.empty(x3, (rows, nch, ng), np.int32)
    dev = _backend.device_of("x3", x3)
    items = rows * nch * ng  # one (row, channel, token group) each
    if items and n:
        thresholds_into(x3, thr)
        _INT_QUANTIZE.launch(dev, items, x3, thr, bits, group, scales, packed, counts, work=rows * nch * n)
        h_counts = _backend.to_host(counts).astype(np.int64)
    else:
        h_counts = np.zeros((rows, nch, ng), np.int64)
    m = int(h_counts.sum())
    offsets = np.zeros(h_counts.size, np.int64)
    np.cumsum(h_counts.reshape(-1)[:-1], out=offsets[1:])
    idx = _backend.empty(x3, (m,), np.int32)
    vals = _backend.empty(x3, (m,), np.float32)
    if m:
        d_off = to_like(x3, offsets.reshape(rows, nch, ng))
        _INT_OUTLIERS.launch(dev, items, x3, thr, group, d_off, idx, vals, work=rows * nch * n)
    return IntQuantized(packed, scales, idx, vals, int(bits), int(group), (rows, n, nch))


def dequantize_int(q: IntQuantized) -> Any:
    """float32 ``[R, n, C]`` reconstruction of ``q`` on the device of its arrays."""
    rows, n, nch = q.shape
    out = _backend.empty(q.packed, (rows, n, nch), np.float32)
    ng = q.scales.shape[2]
    if rows * nch * ng and n:
        _INT_DEQUANTIZE.launch(_backend.device_of("q.packed", q.packed), rows * nch * ng, q.packed, q.scales, q.bits,
                               q.group, out, work=rows * nch * n)
    m = q.outlier_idx.shape[0]
    if m:
        scatter_rows(q.outlier_vals.reshape(m, 1), q.outlier_idx, out.reshape(rows * n * nch, 1))
    return out


# --- public API ------------------------------------------------------------------------
def _check_bits(bits: Any) -> int:
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or int(bits) not in SUPPORTED_BITS:
        raise ValueError(f"bits: expected 4 or 8 (INT4/INT8), got {bits!r}")
    return int(bits)


def check_group(group_size: Any, n: int) -> int:
    """Tokens per scale: ``None`` → one scale per channel (``n`` rounded up to even)."""
    if group_size is None:
        g = max(n, 1)
    else:
        if isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer)) \
                or int(group_size) < 2 or int(group_size) % 2:
            raise ValueError(f"group_size: expected None or an even int >= 2, got {group_size!r}")
        g = int(group_size)
    return g + (g & 1)


def int_quantize(x: Any, bits: int = 4, group_size: int | None = None) -> IntQuantized:
    """Quantize ``x`` to INT4/INT8 with per-channel (or per-group) scales and exact outliers.

    Parameters
    ----------
    x : float array, shape ``(R, n, C)``
        NumPy → CPU twins; CUDA array → CUDA kernels.  Finite values.
    bits : {4, 8}
        Integer width.
    group_size : int, optional
        Tokens per scale within a channel (even); ``None``: one scale per channel.

    Returns
    -------
    IntQuantized

    Raises
    ------
    ValueError
        ``bits`` not 4/8, bad ``group_size``, ``x`` not 3-D or not finite.

    Examples
    --------
    >>> import numpy as np
    >>> x = np.array([0.1, 0.2, 0.15, 10.0], np.float32).reshape(1, 4, 1)
    >>> q = int_quantize(x, 4)
    >>> float(int_dequantize(q)[0, 3, 0]), q.num_outliers
    (10.0, 1)
    """
    bits = _check_bits(bits)
    _backend.resolve_device("auto", x=x)
    check_float_array("x", x, 3)
    check_finite("x", x)
    group = check_group(group_size, int(x.shape[1]))
    return quantize_int(_backend.ascontiguous_f32("x", x), bits, group)


def int_dequantize(q: IntQuantized) -> Any:
    """Reconstruct ``[R, n, C]`` float32 from :func:`int_quantize` output.

    Parameters
    ----------
    q : IntQuantized

    Returns
    -------
    x_hat : float32 array, shape ``q.shape``, on the device of ``q.packed``.
    """
    if not isinstance(q, IntQuantized):
        raise TypeError(f"q: expected an IntQuantized, got {type(q).__name__}")
    _check_quantized(q)
    return dequantize_int(q)


def _check_quantized(q: IntQuantized) -> None:
    """``ValueError`` naming the field of ``q`` that :func:`int_quantize` cannot have made:
    the kernels index ``packed`` and ``scales`` by ``shape``, ``bits`` and ``group`` without
    bounds checks (a short ``packed`` was read past its end, a longer ``shape`` came back as
    uninitialized rows)."""
    shape = tuple(q.shape) if isinstance(q.shape, (tuple, list)) else ()
    if len(shape) != 3 or any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0 for v in shape):
        raise ValueError(f"q.shape: expected (R, n, C) of ints >= 0, got {q.shape!r}")
    if isinstance(q.bits, bool) or q.bits not in (4, 8):
        raise ValueError(f"q.bits: expected 4 or 8 (INT4/INT8), got {q.bits!r}")
    bits = int(q.bits)
    rows, n, nch = (int(v) for v in shape)
    group = q.group
    if isinstance(group, bool) or not isinstance(group, (int, np.integer)) or group < 2 or group % 2:
        raise ValueError(f"q.group: expected an even int >= 2, got {group!r}")
    group = int(group)
    want = {"packed": ((rows, nch, n if bits == 8 else (n + 1) // 2), np.uint8),
            "scales": ((rows, nch, max(1, -(-n // group))), np.float32)}
    for name, (shp, dt) in want.items():
        a = getattr(q, name)
        if tuple(a.shape) != shp or np.dtype(a.dtype) != dt:
            raise ValueError(f"q.{name}: expected {np.dtype(dt)} of shape {shp} for shape={shape}, bits={bits}, "
                             f"group={group}, got {np.dtype(a.dtype)} of shape {tuple(a.shape)}")
    m = q.outlier_idx.shape[0] if len(q.outlier_idx.shape) == 1 else -1
    if np.dtype(q.outlier_idx.dtype) != np.int32 or tuple(q.outlier_vals.shape) != (m,) \
            or np.dtype(q.outlier_vals.dtype) != np.float32:
        raise ValueError(f"q.outlier_idx, q.outlier_vals: expected int32 and float32 of one shape (m,), got "
                         f"{np.dtype(q.outlier_idx.dtype)} {tuple(q.outlier_idx.shape)} and "
                         f"{np.dtype(q.outlier_vals.dtype)} {tuple(q.outlier_vals.shape)}")
    check_finite("q.scales", q.scales)
    check_finite("q.outlier_vals", q.outlier_vals)
    if m > 0:
        idx = _backend.to_host(q.outlier_idx)
        if int(idx.min()) < 0 or int(idx.max()) >= rows * n * nch:
            raise ValueError(f"q.outlier_idx: expected flat indices in [0, {rows * n * nch}), got "
                             f"[{int(idx.min())}, {int(idx.max())}]")


def mad_threshold(x: Any) -> Any:
    """Per-channel outlier threshold ``median(|x|) + 6·MAD`` (else ``mean + 3·std``).

    Parameters
    ----------
    x : float array, shape ``(R, n, C)``
        Finite values.

    Returns
    -------
    thr : float32 array, shape ``(R, C)``, on the device of ``x``. A threshold past the float32
        maximum is clamped to it: no finite value lies above either, so the outliers are the same.

    Raises
    ------
    ValueError
        ``x`` not 3-D or not finite.

    Examples
    --------
    >>> import numpy as np
    >>> float(mad_threshold(np.array([0.1, 0.2, 0.15, 10.0], np.float32).reshape(1, 4, 1))[0, 0])
    0.800000011920929
    """
    _backend.resolve_device("auto", x=x)
    check_float_array("x", x, 3)
    check_finite("x", x)  # as int_quantize: a NaN would otherwise come back as a NaN threshold
    x3 = _backend.ascontiguous_f32("x", x)
    # no tokens: threshold 0 (no outliers), not uninitialized memory
    out = (_backend.empty if x3.shape[1] else _backend.zeros)(x3, (x3.shape[0], x3.shape[2]), np.float32)
    thresholds_into(x3, out)
    return out
