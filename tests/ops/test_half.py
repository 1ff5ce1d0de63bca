"""binary16 conversion cores: bit-identical to numpy.float16."""

import numpy as np
from numba import njit

from numba_kv.ops.half import f16_bits_to_f32_cpu, f32_to_f16_bits_cpu


@njit(cache=False)
def _to_bits(a, out):
    for i in range(a.size):
        out[i] = f32_to_f16_bits_cpu(a[i])


@njit(cache=False)
def _from_bits(h, out):
    for i in range(h.size):
        out[i] = f16_bits_to_f32_cpu(h[i])


def test_f32_to_f16_round_to_nearest_even_matches_numpy():
    rng = np.random.default_rng(0)
    a = (rng.standard_normal(300_000) * 10.0 ** rng.integers(-9, 5, 300_000)).astype(np.float32)
    special = np.array([0.0, -0.0, 65504.0, -65504.0, 6e-8, 3e-8, 2.98e-8, 1e-10, -1e-10, 6.1e-5,
                        65519.0, 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11, 2049.0, 2051.0], np.float32)
    # every half-way point between adjacent binary16 values (ties to even)
    h = np.arange(0, 0x7BFF, dtype=np.uint16).view(np.float16).astype(np.float64)
    mids = ((h[:-1] + h[1:]) / 2).astype(np.float32)
    a = np.concatenate([a[np.abs(a) <= 65504], special, mids, -mids])
    out = np.empty(a.size, np.uint16)
    _to_bits(a, out)
    assert np.array_equal(out, a.astype(np.float16).view(np.uint16))


def test_f16_to_f32_exact_for_every_finite_pattern():
    allh = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    allh = allh[np.isfinite(allh.view(np.float16))]
    out = np.empty(allh.size, np.float32)
    _from_bits(allh, out)
    assert np.array_equal(out.view(np.uint32), allh.view(np.float16).astype(np.float32).view(np.uint32))
