"""Head VQ code: CUDA kernels (simulator or GPU) vs the CPU twins.

Both twins do the same float32 operations in the same order per value (the rotation, the
nearest-point distances, the EDEN sums), so codes and norms must be bit-identical and
reconstructions equal up to float32 rounding.  Small sizes: the simulator runs every thread
of every block in Python.
"""

import numpy as np
import pytest
from numba import cuda

from numba_kv._backend import to_host
from numba_kv.ops.headvq import (
    dequantize_headvq,
    dequantize_headvq_into,
    headvq_centroids,
    packed_dim,
    quantize_headvq,
    quantize_headvq_into,
)
from numba_kv.ops.headvq_grid import grid_nearest_dev
from numba_kv.reference import head_sign_vector
from numba_kv.reference.polarquant import hadamard_apply

from ..conftest import runner_params, to_device


def _quantize(rng):
    for d, bits in ((32, 4), (32, 2), (64, 2)):
        x = rng.standard_normal((2, d)).astype(np.float32) * 2
        x[0, 5] = 40.0  # outlier channel
        for unbiased in (False, True):
            c, n = quantize_headvq(x, bits, unbiased)
            cd, nd = quantize_headvq(to_device(x), bits, unbiased)
            assert np.array_equal(to_host(cd), c), (d, bits, unbiased)
            assert np.array_equal(to_host(nd), n), (d, bits, unbiased)
    # below the 1e-10 norm floor: the norm is kept, not the EDEN scale (two groups cancel)
    d = 32
    y = np.zeros(d)
    y[0], y[4], y[9] = 2.0 ** -7 / d ** 0.5, -(2.0 ** -7) / d ** 0.5, -(2.0 ** -80)
    tiny = (hadamard_apply(y) * head_sign_vector(d) * 1e-10).astype(np.float32)
    x = np.stack([tiny, tiny * np.float32(1e6)])  # (the second one is above the floor)
    for bits in (4, 2):
        c, n = quantize_headvq(x, bits, True)
        cd, nd = quantize_headvq(to_device(x), bits, True)
        assert np.array_equal(to_host(cd), c) and np.array_equal(to_host(nd), n), bits
        assert n[0, 0] == 0 and n[1, 0] != 0
    # internal entry point at token offset t0 of a [rows, capacity, .] store, a zero vector
    d, bits, t0, cap = 32, 4, 1, 4
    x3 = rng.standard_normal((2, 2, d)).astype(np.float32)
    x3[1, 0] = 0.0
    cents = headvq_centroids(bits, d)
    codes = np.zeros((2, cap, packed_dim(d, bits)), np.uint8)
    norms = np.zeros((2, cap, 1), np.uint16)
    quantize_headvq_into(x3, codes, norms, t0, cents, True)
    dc, dn = to_device(np.zeros_like(codes)), to_device(np.zeros_like(norms))
    quantize_headvq_into(to_device(x3), dc, dn, t0, cents, True)
    assert np.array_equal(to_host(dc), codes) and np.array_equal(to_host(dn), norms)
    assert not codes[:, :t0].any() and not codes[:, t0 + 2:].any() and norms[0, t0:t0 + 2].all()


def _dequantize(rng):
    for d, bits in ((32, 4), (64, 2)):
        x = rng.standard_normal((3, d)).astype(np.float32)
        c, n = quantize_headvq(x, bits, True)
        ref = dequantize_headvq(c, n, bits)
        out = to_host(dequantize_headvq(to_device(c), to_device(n), bits))
        np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-7)
    d, bits, t0 = 32, 2, 1
    x3 = rng.standard_normal((2, 3, d)).astype(np.float32)
    cents = headvq_centroids(bits, d)
    codes = np.zeros((2, 3, packed_dim(d, bits)), np.uint8)
    norms = np.zeros((2, 3, 1), np.uint16)
    quantize_headvq_into(x3, codes, norms, 0, cents, False)
    ref = np.empty((2, 2, d), np.float32)
    dequantize_headvq_into(codes, norms, t0, cents, ref)
    out = to_device(np.empty((2, 2, d), np.float32))
    dequantize_headvq_into(to_device(codes), to_device(norms), t0, cents, out)
    np.testing.assert_allclose(to_host(out), ref, rtol=1e-6, atol=1e-7)


RUNNERS = {"quantize_headvq": _quantize, "dequantize_headvq": _dequantize}


@pytest.mark.cuda
@pytest.mark.parametrize("runner", runner_params(RUNNERS))
def test_cuda_kernel_matches_cpu_twin(runner):
    runner(np.random.default_rng(11))


@pytest.mark.cuda
@pytest.mark.gpu_only
@pytest.mark.parametrize("d", [64, 128, 512])
def test_gpu_codes_bit_identical_at_scale(d):
    """On a real GPU: thousands of vectors (GQA-like [kv_heads, tokens, d], scaled per head,
    offsets and outliers), every code byte and norm equal to the CPU twin's."""
    rng = np.random.default_rng(d)
    x = rng.standard_normal((8, 512, d)) * rng.uniform(0.05, 20.0, (8, 1, 1)) + rng.normal(0, 1, (8, 1, d))
    x = x.astype(np.float32)
    for bits in (4, 2):
        for unbiased in (False, True):
            c, n = quantize_headvq(x, bits, unbiased)
            cd, nd = quantize_headvq(to_device(x), bits, unbiased)
            assert np.array_equal(to_host(cd), c), (d, bits, unbiased, int((to_host(cd) != c).sum()))
            assert np.array_equal(to_host(nd), n), (d, bits, unbiased)
        ref = dequantize_headvq(c, n, bits)
        np.testing.assert_allclose(to_host(dequantize_headvq(to_device(c), to_device(n), bits)), ref, rtol=1e-5,
                                   atol=1e-6 * float(np.abs(ref).max()))


@cuda.jit
def _grid_kernel(m, flat, cf, gpar, slots, goff, gcand, out):
    """One group per thread: the device variant of the grid search."""
    r = cuda.grid(1)
    if r < out.shape[0]:
        out[r] = grid_nearest_dev(flat, r * m, 1, m, cf, gpar, slots, goff, gcand)


@pytest.mark.cuda
@pytest.mark.parametrize(("bits", "d"), [(4, 64), (2, 64)])
def test_device_grid_search_is_the_full_search(bits, d):
    """The device variant of the candidate-grid search, one group per thread, on random,
    clamped and boundary groups (those of ``tests/ops/test_headvq_grid.py``): the full
    search's index, every one, as the CPU twin's."""
    from numba_kv.ops.headvq_grid import search_grid

    from ..ops.test_headvq_grid import boundary_groups, full_search

    rng = np.random.default_rng(bits)
    cents = headvq_centroids(bits, d)
    m = cents.shape[1]
    y = np.concatenate([(rng.standard_normal((40, m)) / d ** 0.5).astype(np.float32),
                        rng.uniform(-1, 1, (10, m)).astype(np.float32), boundary_groups(rng, cents, d, 10)])
    gpar, goff, gcand, slots = search_grid(cents, d)

    out = to_device(np.zeros(len(y), np.int32))
    args = [to_device(np.ascontiguousarray(a)) for a in (y.reshape(-1), cents.reshape(-1), gpar, slots, goff, gcand)]
    _grid_kernel[(len(y) + 31) // 32, 32](m, *args, out)
    assert np.array_equal(to_host(out), full_search(y, cents))
