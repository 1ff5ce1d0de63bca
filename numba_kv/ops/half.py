"""IEEE binary16 conversion cores (single source for CPU and CUDA).

Numba's CPU target has no ``float16`` type, so scales are stored as ``uint16`` bit
patterns (``.view(numpy.float16)`` reads them on the host).  These cores implement
round-to-nearest-even ``float32 -> binary16`` and the exact inverse in float32
arithmetic, bit-identical to ``numpy.float16`` for every finite float32 whose magnitude
is at most :data:`F16_MAX` (checked exhaustively).  They use only compares, selects and
exact float32 operations — no ``frexp``/``ldexp``/``floor`` library calls — so they are
cheap inside the quantizer's per-block loops:

* the binade ``2**e <= a < 2**(e+1)`` is found by a 5-step binary search over powers
  of two (products of powers of two are exact);
* ``(a + K) - K`` with ``K = 2**(e+13)`` rounds ``a`` to a multiple of ``2**(e-10)``
  (binary16 spacing in that binade) with the hardware's round-to-nearest-even, because
  ``a + K`` lies in ``[2**(e+13), 2**(e+14))`` whose float32 spacing is ``2**(e-10)``;
  ``K = 0.5`` does the same for the subnormal spacing ``2**-24``.
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
    if a < float32(6.103515625e-05):  # below 2**-14: subnormal (or zero), spacing 2**-24
        r = (a + float32(0.5)) - float32(0.5)
        # r / 2**-24 in 0..1024; 1024 is the smallest normal 0x0400, as it should be
        return uint16(sign | int64(r * float32(16777216.0)))
    p = float32(6.103515625e-05)  # becomes 2**e, the largest power of two <= a
    e = int64(-14)
    if a >= p * float32(65536.0):
        p = p * float32(65536.0)
        e += 16
    if a >= p * float32(256.0):
        p = p * float32(256.0)
        e += 8
    if a >= p * float32(16.0):
        p = p * float32(16.0)
        e += 4
    if a >= p * float32(4.0):
        p = p * float32(4.0)
        e += 2
    if a >= p * float32(2.0):
        p = p * float32(2.0)
        e += 1
    k = p * float32(8192.0)
    r = (a + k) - k  # RNE to 11 significant bits; r / p in [1, 2]
    m = int64((r / p) * float32(1024.0)) - 1024  # 0..1024
    # a carry out of the mantissa (m == 1024) correctly bumps the exponent
    return uint16(sign | (((e + 15) << 10) + m))


def _f16_bits_to_f32(h):
    """float32 value of binary16 bit pattern ``h`` (finite patterns only)."""
    hi = int64(h)
    ex = (hi >> 10) & 31
    mant = hi & 1023
    if ex == 0:
        val = float32(mant) * float32(5.9604644775390625e-08)  # mant * 2**-24
    else:
        # (mant + 1024) * 2**(ex - 25), the power built from the bits of ex - 1 (exact)
        e1 = ex - 1
        p = float32(5.9604644775390625e-08)
        if e1 & 16:
            p = p * float32(65536.0)
        if e1 & 8:
            p = p * float32(256.0)
        if e1 & 4:
            p = p * float32(16.0)
        if e1 & 2:
            p = p * float32(4.0)
        if e1 & 1:
            p = p * float32(2.0)
        val = float32(mant + 1024) * p
    if hi & 0x8000:
        return -val
    return val


def _f16_bits_abs_to_f32(h):
    """float32 value of ``|binary16(h)|`` (the sign is the outlier flag, not the scale)."""
    return _f16_bits_to_f32(int64(h) & 0x7FFF)


f32_to_f16_bits_cpu, f32_to_f16_bits_dev = twin(_f32_to_f16_bits)
f16_bits_to_f32_cpu, f16_bits_to_f32_dev = twin(_f16_bits_to_f32)
f16_bits_abs_to_f32_cpu, f16_bits_abs_to_f32_dev = twin(_f16_bits_abs_to_f32)
