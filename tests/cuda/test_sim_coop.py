"""Block-cooperative head kernels (one block per vector, the vector in shared memory) on
launch geometries the public API does not pick: fewer blocks than vectors (grid-stride),
fewer threads than butterfly pairs, more threads than values, every head dimension.

Codes and norms must equal the CPU twin's bit for bit; rotations and reconstructions too
(the same float32 operations in the same order per value).
"""

import numpy as np
import pytest

from numba_kv._backend import to_host
from numba_kv.ops import headquant as hq

from ..conftest import to_device

GRIDS = [(1, 1), (2, 3), (3, 32), (5, 64)]  # (blocks, threads); 64 > d/2 for d = 32, 64


def _vectors(rng, rows, seq, d):
    x = rng.standard_normal((rows, seq, d)).astype(np.float32)
    x[0, 0, 3] = 30.0  # an outlier channel
    x[-1, -1] = 0.0  # the zero vector (norm 0)
    return x


@pytest.mark.cuda
@pytest.mark.parametrize("d", [32, 64, 128, 256, 512])
def test_coop_head_kernels_match_cpu_twin_bit_for_bit(d):
    rng = np.random.default_rng(d)
    grids = GRIDS if d <= 64 else [(2, 32)]  # the simulator runs a thread per OS thread
    rows, seq, t0, cap = 2, 3, 1, 5
    x = _vectors(rng, rows, seq, d)
    signs = hq.head_signs(d)
    for bits in (1, 3, 4, 5) if d <= 64 else (3,):
        cb = hq.head_codebook(bits, d)
        w = hq.packed_dim(d, bits)
        for unbiased in (False, True):
            codes = np.zeros((rows, cap, w), np.uint8)
            norms = np.zeros((rows, cap, 1), np.uint16)
            hq.quantize_head_into(x, codes, norms, t0, cb, unbiased)
            for grid in grids:
                dc, dn = to_device(np.zeros_like(codes)), to_device(np.zeros_like(norms))
                hq._quantize_head_cuda[grid](to_device(x), to_device(signs), to_device(cb.boundaries),
                                             to_device(cb.centroids), unbiased, bits, t0, dc, dn)
                assert np.array_equal(to_host(dc), codes), (d, bits, unbiased, grid)
                assert np.array_equal(to_host(dn), norms), (d, bits, unbiased, grid)
        ref = np.empty((rows, seq, d), np.float32)
        hq.dequantize_head_into(codes, norms, t0, cb, ref)
        for grid in grids:
            out = to_device(np.full((rows, seq, d), np.nan, np.float32))
            hq._dequantize_head_cuda[grid](to_device(codes), to_device(norms), to_device(signs),
                                           to_device(cb.centroids), bits, t0, out)
            assert np.array_equal(to_host(out), ref), (d, bits, grid)
    x2 = x.reshape(-1, d)
    for inverse in (False, True):
        ref = hq.rotate_head(x2, inverse)
        for grid in grids:
            out = to_device(np.full_like(x2, np.nan))
            hq._rotate_head_cuda[grid](to_device(x2), to_device(signs), inverse, out)
            assert np.array_equal(to_host(out), ref), (d, inverse, grid)
