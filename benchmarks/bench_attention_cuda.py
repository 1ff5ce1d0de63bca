"""GPU decode attention (pytest-benchmark group ``attention-cuda``): fused from packed codes vs
dense fp16 attention in CuPy vs dequantize-then-attend, T = 4K..128K, batch 1/8/32, 8 KV heads
x 4 groups, d = 128, 3/4 bits (:mod:`numba_kv.toolkit.bench_cuda`).  Every entry records the
best CUDA-event time of each path, the speedups, the fused kernel's packed GB/s against the
device's theoretical peak memory bandwidth, the GPU name and the provenance.  Skipped without
CuPy and a real GPU (the simulator is too slow for these shapes)."""

import os

import pytest

from numba_kv.toolkit.bench_cuda import (
    DEFAULT_BATCH,
    DEFAULT_BITS,
    DEFAULT_TOKENS,
    CudaBenchUnavailable,
    require_cupy,
    rows_as_dicts,
    run_attention_bench_cuda,
)

pytestmark = pytest.mark.gpu_only


@pytest.fixture(scope="module", autouse=True)
def _needs_gpu():
    """Skip without CuPy and a real GPU; checked at run time, not at collection (CuPy is an
    optional extra that collection must not import)."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"):
        pytest.skip("needs a real GPU (the simulator is too slow for these shapes)")
    try:
        require_cupy()
    except CudaBenchUnavailable as exc:
        pytest.skip(str(exc))


@pytest.mark.parametrize("batch", DEFAULT_BATCH)
@pytest.mark.parametrize("tokens", DEFAULT_TOKENS)
def test_attention_cuda(benchmark, tokens, batch):
    """One (T, batch): all bit widths; the pytest-benchmark time is the whole measurement of
    the configuration (one round), the figures are the CUDA-event bests in ``extra_info``."""
    benchmark.group = "attention-cuda"
    rows = benchmark.pedantic(run_attention_bench_cuda, kwargs=dict(tokens=(tokens,), batch=(batch,),
                                                                    bits=DEFAULT_BITS, repeat=10),
                              rounds=1, iterations=1)
    benchmark.extra_info["rows"] = rows_as_dicts(rows)
    for r in rows:
        assert r.fused_ms is not None or r.note, r
