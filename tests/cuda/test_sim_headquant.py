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
    quantize_head_pair_into,
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


def _quantize_pair(rng):
    """Keys and values in one launch: the bytes of two single-side quantizations (on the CPU
    and on the device), each side at its own width, at a token offset, nothing else written."""
    for d, kb, vb in ((64, 4, 3), (32, 3, 2), (128, 2, 4)):
        t0, cap, rows, n = 1, 5, 3, 2
        xk = rng.standard_normal((rows, n, d)).astype(np.float32) * 3
        xv = rng.standard_normal((rows, n, d)).astype(np.float32)
        xk[1, 0] = 0.0  # zero vector: norm stored as 0
        kcb, vcb = head_codebook(kb, d), head_codebook(vb, d)
        want = [np.zeros((rows, cap, packed_dim(d, b)), np.uint8) for b in (kb, vb)]
        want_n = [np.zeros((rows, cap, 1), np.uint16) for _ in range(2)]
        for x, cb, c, nn in ((xk, kcb, want[0], want_n[0]), (xv, vcb, want[1], want_n[1])):
            quantize_head_into(x, c, nn, t0, cb, True)
        for dev in (lambda a: a, to_device):
            bufs = [dev(np.zeros_like(a)) for a in (want[0], want_n[0], want[1], want_n[1])]
            quantize_head_pair_into(dev(xk), dev(xv), *bufs, t0, kcb, vcb, True)
            got = [to_host(b) for b in bufs]
            for g, w in zip(got, (want[0], want_n[0], want[1], want_n[1])):
                assert np.array_equal(g, w), (d, kb, vb)
            # with a count update folded in (a layer's device count of compressed tokens): the
            # same bytes, and lens[1] += 2 only
            bufs = [dev(np.zeros_like(a)) for a in (want[0], want_n[0], want[1], want_n[1])]
            lens = dev(np.array([3, 4, 5], np.int32))
            quantize_head_pair_into(dev(xk), dev(xv), *bufs, t0, kcb, vcb, True, add_at=(lens, 1, 2))
            for g, w in zip(bufs, (want[0], want_n[0], want[1], want_n[1])):
                assert np.array_equal(to_host(g), w), (d, kb, vb)
            assert to_host(lens).tolist() == [3, 6, 5]
            # the offset read from a device count (slot 0, t0 there; 0 by value), the new count
            # written to slot 1 (a layer's step state): the same bytes
            bufs = [dev(np.zeros_like(a)) for a in (want[0], want_n[0], want[1], want_n[1])]
            lens = dev(np.array([t0, 7], np.int32))
            quantize_head_pair_into(dev(xk), dev(xv), *bufs, 0, kcb, vcb, True, add_at=(lens, 1, n, 0))
            for g, w in zip(bufs, (want[0], want_n[0], want[1], want_n[1])):
                assert np.array_equal(to_host(g), w), (d, kb, vb)
            assert to_host(lens).tolist() == [t0, t0 + n]
        assert want[0][:, t0:t0 + n].any() and not want[0][:, t0 + n:].any()


RUNNERS = {"rotate_head": _rotate, "quantize_head": _quantize, "dequantize_head": _dequantize,
           "quantize_head_pair": _quantize_pair}


@pytest.mark.cuda
@pytest.mark.parametrize("runner", runner_params(RUNNERS))
def test_cuda_kernel_matches_cpu_twin(runner):
    runner(np.random.default_rng(7))
