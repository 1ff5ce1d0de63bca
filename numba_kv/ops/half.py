"""IEEE binary16 conversion cores (single source for CPU and CUDA).

Numba's CPU target has no ``float16`` type, so scales are stored as ``uint16`` bit
patterns (``.view(numpy.float16)`` reads them on the host).  These cores implement
round-to-nearest-even ``float32 -> binary16`` and the exact inverse in float32
arithmetic, bit-identical to ``numpy.float16`` for every finite float32 whose magnitude
is at most :data:`F16_MAX` (checked exhaustively).  They use only compares, selects and
exact float32 operations — no ``frexp``/``ldexp``/``floor`` library calls — so they are
cheap inside the quantizer's per-block loops:

* the binade ``2**e <= a < 2**(e+1)`` is found by a 5-step binary search over powers
  of two (products of powers of two are exact), written with selects, not branches, so
  per-lane loops that convert many values stay vectorizable on AVX2 and AVX-512 alike;
* ``(a + K) - K`` with ``K = 2**(e+13)`` rounds ``a`` to a multiple of ``2**(e-10)``
  (binary16 spacing in that binade) with the hardware's round-to-nearest-even, because
  ``a + K`` lies in ``[2**(e+13), 2**(e+14))`` whose float32 spacing is ``2**(e-10)``;
  ``K = 0.5`` does the same for the subnormal spacing ``2**-24``.
"""

from __future__ import annotations

import math

from numba import float32, int32, uint16

from .._jit import twin

F16_MAX = 65504.0  # largest finite binary16


def _binade_step(a, p, q, e, k):
    """One step of the binary search for the binade of ``a``: ``(p, q, e) = (p·2**k,
    q·2**-k, e + k)`` when ``a >= p·2**k``, else unchanged (``p = 2**e``, ``q = 1/p``;
    products of powers of two are exact; a select, not a branch).  ``k`` is a literal at
    every call, so the powers fold to constants."""
    f = float32(1 << k)
    c = a >= p * f
    p = p * f if c else p
    q = q * (float32(1.0) / f) if c else q
    return p, q, e + int32(c) * int32(k)


def f32_to_f16_bits(v):
    """binary16 bit pattern (uint16) of float32 ``v``; |v| must be <= F16_MAX.

    Branch-free (selects only, int32 conversions): the CPU twins call it in per-lane loops,
    where a data-dependent branch per value would be mispredicted and would keep the loop
    scalar on targets without AVX-512 masking; ``float -> int64`` has no AVX2 instruction,
    ``float -> int32`` has.
    """
    a = float32(v)
    neg = math.copysign(float32(1.0), a) < float32(0.0)  # also catches -0.0
    a = abs(a)
    # p = 2**e, the largest power of two <= a, but at least 2**-14 (q = 1/p, also exact)
    p = float32(6.103515625e-05)
    q = float32(16384.0)
    e = int32(-14)
    p, q, e = _binade_step(a, p, q, e, 16)
    p, q, e = _binade_step(a, p, q, e, 8)
    p, q, e = _binade_step(a, p, q, e, 4)
    p, q, e = _binade_step(a, p, q, e, 2)
    p, q, e = _binade_step(a, p, q, e, 1)
    k = p * float32(8192.0)
    r = (a + k) - k  # RNE to 11 significant bits (below 2**-14: to a multiple of 2**-24)
    # r·q = r / p in [1, 2] for normal a (m in 0..1024); below 2**-14, e = -14, k = 0.5 and
    # r·q·1024 = r / 2**-24 in 0..1024, so ((e + 15) << 10) + m = r / 2**-24: the subnormal
    # pattern (1024, the smallest normal 0x0400, included) from the same formula.  A carry
    # out of the mantissa (m == 1024) correctly bumps the exponent.
    m = int32((r * q) * float32(1024.0)) - int32(1024)
    h = ((e + int32(15)) << int32(10)) + m
    return uint16(h | (int32(0x8000) if neg else int32(0)))


def f32_to_f16_bits_sat(v):
    """binary16 bit pattern of float32 ``v`` saturated to ``±F16_MAX``; ``v`` not NaN.

    The one saturating conversion of the package (scales, norms, coefficients): values
    beyond the binary16 range (±inf included) store as ±65504 instead of ±inf, and the
    saturated pattern ``0x7BFF`` is what the range checks of :mod:`numba_kv._validate` look
    for.  ``min``/``max`` (one instruction each; a NaN would pass through, and inputs are
    validated finite): the select form that maps NaN to 65504 made ``f16_encode`` ~15 %
    slower.
    """
    m = float32(F16_MAX)
    return f32_to_f16_bits(min(max(float32(v), -m), m))


def f16_bits_to_f32(h):
    """float32 value of binary16 bit pattern ``h`` (finite patterns only); branch-free."""
    hi = int32(h)
    ex = (hi >> 10) & 31
    mant = hi & 1023
    # (mant + 1024) * 2**(ex - 25) for ex >= 1, mant * 2**-24 for ex == 0: both are
    # (mant + 1024·[ex > 0]) * 2**(max(ex, 1) - 25), the power built from the bits of
    # max(ex, 1) - 1 (products of powers of two: exact)
    nrm = ex > 0
    e1 = (ex if nrm else int32(1)) - int32(1)
    p = float32(5.9604644775390625e-08)
    p = p * float32(65536.0) if e1 & 16 else p
    p = p * float32(256.0) if e1 & 8 else p
    p = p * float32(16.0) if e1 & 4 else p
    p = p * float32(4.0) if e1 & 2 else p
    p = p * float32(2.0) if e1 & 1 else p
    val = float32(mant + (int32(1024) if nrm else int32(0))) * p
    return -val if hi & 0x8000 else val


def f16_bits_abs_to_f32(h):
    """float32 value of ``|binary16(h)|`` (the sign is the outlier flag, not the scale)."""
    return f16_bits_to_f32(int32(h) & 0x7FFF)


# inlined on the CPU: called per value, often in per-lane loops
twin(_binade_step, inline=True)
f32_to_f16_bits_cpu, f32_to_f16_bits_dev = twin(f32_to_f16_bits, inline=True)
f32_to_f16_bits_sat_cpu, f32_to_f16_bits_sat_dev = twin(f32_to_f16_bits_sat, inline=True)
f16_bits_to_f32_cpu, f16_bits_to_f32_dev = twin(f16_bits_to_f32, inline=True)
_, f16_bits_abs_to_f32_dev = twin(f16_bits_abs_to_f32, inline=True)
