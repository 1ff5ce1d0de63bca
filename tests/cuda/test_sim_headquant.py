"""Whole-head rotation quantizer: CUDA kernels (simulator or GPU) vs the CPU twins.

Both twins do the same float32 operations in the same order per value, so codes and
norms must be bit-identical and reconstructions equal up to float32 rounding.
"""

import numpy as np
import pytest

from numba_kv._backend import to_host
from numba_kv.ops.headquant import (
    dequantize_head,
    dequantize_head_into,
    head_codebook,
    packed_dim,
    quantize_head,
    quantize_head_into,
    rotate_head,
)

from ..conftest import runner_params, to_device


def _rotate(rng):
    for d in (32, 64, 128):
        x = rng.standard_normal((3, d)).astype(np.float32)
        for inverse in (False, True):
            ref = rotate_head(x, inverse)
            out = to_host(rotate_head(to_device(x), inverse))
            np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-7)


def _quantize(rng):
    for d in (32, 64):
        x = rng.standard_normal((2, 3, d)).astype(np.float32) * 2
        x[0, 0, 5] = 40.0  # outlier channel
        x[1, 2] = 0.0  # zero vector: norm stored as 0
        for bits in (1, 2, 3, 4, 5):
            for unbiased in (False, True):
                c, n = quantize_head(x, bits, unbiased)
                cd, nd = quantize_head(to_device(x), bits, unbiased)
                assert np.array_equal(to_host(cd), c), (d, bits, unbiased)
                assert np.array_equal(to_host(nd), n), (d, bits, unbiased)
    # internal entry point: write at token offset t0 of a larger [rows, capacity, .] store
    d, bits, t0, cap = 64, 3, 2, 6
    x3 = rng.standard_normal((2, 3, d)).astype(np.float32)
    cb = head_codebook(bits, d)
    codes = np.zeros((2, cap, packed_dim(d, bits)), np.uint8)
    norms = np.zeros((2, cap, 1), np.uint16)
    quantize_head_into(x3, codes, norms, t0, cb, True)
    dc, dn = to_device(np.zeros_like(codes)), to_device(np.zeros_like(norms))
    quantize_head_into(to_device(x3), dc, dn, t0, cb, True)
    assert np.array_equal(to_host(dc), codes) and np.array_equal(to_host(dn), norms)
    assert not codes[:, :t0].any() and not codes[:, t0 + 3:].any() and norms[:, t0:t0 + 3].all()


def _dequantize(rng):
    for d in (32, 64):
        x = rng.standard_normal((4, d)).astype(np.float32)
        for bits in (1, 2, 3, 4, 5):
            c, n = quantize_head(x, bits)
            ref = dequantize_head(c, n, bits)
            out = to_host(dequantize_head(to_device(c), to_device(n), bits))
            np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-7)
    d, bits, t0 = 64, 4, 1
    x3 = rng.standard_normal((2, 5, d)).astype(np.float32)
    cb = head_codebook(bits, d)
    codes = np.zeros((2, 5, packed_dim(d, bits)), np.uint8)
    norms = np.zeros((2, 5, 1), np.uint16)
    quantize_head_into(x3, codes, norms, 0, cb, False)
    ref = np.empty((2, 3, d), np.float32)
    dequantize_head_into(codes, norms, t0, cb, ref)
    out = to_device(np.empty((2, 3, d), np.float32))
    dequantize_head_into(to_device(codes), to_device(norms), t0, cb, out)
    np.testing.assert_allclose(to_host(out), ref, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(ref, x3[:, t0:t0 + 3], atol=0.1 * float(np.abs(x3).max()))


RUNNERS = {"rotate_head": _rotate, "quantize_head": _quantize, "dequantize_head": _dequantize}


@pytest.mark.cuda
@pytest.mark.parametrize("runner", runner_params(RUNNERS))
def test_cuda_kernel_matches_cpu_twin(runner):
    runner(np.random.default_rng(7))
