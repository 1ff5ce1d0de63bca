"""IEEE binary16 conversion cores (single source for CPU and CUDA).

Numba's CPU target has no ``float16`` type, so scales are stored as ``uint16`` bit
patterns (``.view(numpy.float16)`` reads them on the host).  These cores implement
round-to-nearest-even ``float32 -> binary16`` and the exact inverse with ``frexp`` /
``ldexp`` in float32 arithmetic, bit-identical to ``numpy.float16`` for every finite
float32 whose magnitude is at most :data:`F16_MAX`.
"""

from __future__ import annotations

import math

from numba import float32, int64, uint16

from .._jit import twin

F16_MAX = 65504.0  # largest finite binary16


def _f32_to_f16_bits(v):
    """binary16 bit pattern (uint16) of float32 ``v``; |v| must be <= F16_MAX."""
    sign = int64(0)
    a = float32(v)
    if math.copysign(float32(1.0), a) < float32(0.0):  # also catches -0.0
        sign = int64(0x8000)
        a = -a
    if a == float32(0.0):
        return uint16(sign)
    m, e = math.frexp(a)  # a = m * 2**e, m in [0.5, 1)
    ex = int(e) + 14  # binary16 biased exponent of a
    if ex >= 1:
        y = float32(m) * float32(2048.0) - float32(1024.0)  # exact: 10-bit mantissa + fraction
    else:  # subnormal: units of 2**-24
        y = float32(math.ldexp(float32(m), int(e) + 24))
        ex = 0
    r = math.floor(y)
    frac = y - r
    ri = int64(r)
    if frac > float32(0.5) or (frac == float32(0.5) and (ri & 1) == 1):
        ri += 1
    # a carry out of the mantissa (ri == 1024) correctly bumps the exponent
    return uint16(sign | ((int64(ex) << 10) + ri))


def _f16_bits_to_f32(h):
    """float32 value of binary16 bit pattern ``h`` (finite patterns only)."""
    hi = int64(h)
    ex = (hi >> 10) & 31
    mant = hi & 1023
    if ex == 0:
        val = float32(math.ldexp(float32(mant), -24))
    else:
        val = float32(math.ldexp(float32(mant + 1024), int(ex) - 25))
    if hi & 0x8000:
        return -val
    return val


def _f16_bits_abs_to_f32(h):
    """float32 value of ``|binary16(h)|`` (the sign is the outlier flag, not the scale)."""
    return _f16_bits_to_f32(int64(h) & 0x7FFF)


f32_to_f16_bits_cpu, f32_to_f16_bits_dev = twin(_f32_to_f16_bits)
f16_bits_to_f32_cpu, f16_bits_to_f32_dev = twin(_f16_bits_to_f32)
f16_bits_abs_to_f32_cpu, f16_bits_abs_to_f32_dev = twin(_f16_bits_abs_to_f32)
