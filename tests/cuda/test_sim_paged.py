"""Paged fused attention: CUDA kernel (simulator or GPU) vs the CPU twin."""

import numpy as np
import pytest

from numba_kv import PagedKVCache
from numba_kv._backend import to_host

from ..conftest import to_device


def _paged(rng):
    for storage in ("pqo3", "pqo-k4v2", "float32"):
        caches = [PagedKVCache(num_pages=12, num_layers=1, num_kv_heads=2, head_dim=64, page_size=8,
                               storage=storage) for _ in range(2)]
        for n in (9, 20):
            k = rng.standard_normal((2, n, 64)).astype(np.float32)
            v = rng.standard_normal((2, n, 64)).astype(np.float32)
            caches[0].append(0, caches[0].allocate_sequence(), k, v)
            caches[1].append(0, caches[1].allocate_sequence(), to_device(k), to_device(v))
        q = rng.standard_normal((2, 4, 2, 64)).astype(np.float32)
        a = caches[0].decode_attention(0, q)
        b = to_host(caches[1].decode_attention(0, to_device(q)))
        np.testing.assert_allclose(b, a, rtol=2e-5, atol=2e-6)


RUNNERS = {"paged_decode_attention": _paged}


@pytest.mark.cuda
@pytest.mark.parametrize("name", sorted(RUNNERS))
def test_cuda_kernel_matches_cpu_twin(name):
    RUNNERS[name](np.random.default_rng(5))
