"""GPU decode attention (pytest-benchmark groups ``attention-cuda-T<T>-b<batch>``, one a shape):
fused from packed codes vs torch SDPA (fp16, GQA, fastest of cuDNN/flash; when torch with CUDA
is installed) vs dense fp16 attention in CuPy vs dequantize-then-attend, T = 4K..128K, batch
1/8/32, 8 KV heads x 4 groups, d = 128, 3/4 bits (:mod:`numba_kv.toolkit.bench_cuda`).  Every
entry records the best CUDA-event time of each path, the speedups, the fused kernel's packed
GB/s against the device's theoretical peak memory bandwidth, the GPU name and the provenance.

Groups ``attention-cuda-torch-T<T>-b<batch>``: the torch SDPA baseline on its own, one call per round
(host wall time to ``torch.cuda.synchronize``) under the backend that was fastest by CUDA
events; skipped without torch and a GPU.

Skipped without CuPy and a real GPU (the simulator is too slow for these shapes)."""

import os

import pytest

from numba_kv.toolkit.bench_cuda import (
    DEFAULT_BATCH,
    DEFAULT_BITS,
    DEFAULT_TOKENS,
    CudaBenchUnavailable,
    fastest_sdpa,
    gpu_name,
    import_torch,
    make_sdpa,
    memory_properties,
    require_cupy,
    rows_as_dicts,
    run_attention_bench_cuda,
    sdpa_backend,
    time_torch_ms,
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
    benchmark.group = f"attention-cuda-T{tokens}-b{batch}"  # (a group compares the same work)
    rows = benchmark.pedantic(run_attention_bench_cuda, kwargs=dict(tokens=(tokens,), batch=(batch,),
                                                                    bits=DEFAULT_BITS, repeat=10),
                              rounds=1, iterations=1)
    benchmark.extra_info["rows"] = rows_as_dicts(rows)
    for r in rows:
        assert r.fused_ms is not None or r.note, r


@pytest.mark.parametrize("batch", DEFAULT_BATCH)
@pytest.mark.parametrize("tokens", DEFAULT_TOKENS)
def test_torch_sdpa_cuda(benchmark, tokens, batch):
    """torch SDPA over random float16 q/K/V (8 KV heads x 4 groups, d = 128, GQA): the backend
    is picked by CUDA-event bests (recorded in ``extra_info``), then pytest-benchmark times
    one call + ``torch.cuda.synchronize`` per round."""
    torch = import_torch()
    if torch is None:
        pytest.skip("needs torch with CUDA (the torch SDPA baseline)")
    benchmark.group = f"attention-cuda-torch-T{tokens}-b{batch}"
    hkv, groups, d = 8, 4, 128
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.float16, generator=gen)

    fn = make_sdpa(torch, randn(batch, hkv * groups, 1, d), randn(batch, hkv, tokens, d),
                   randn(batch, hkv, tokens, d))
    backend, event_ms, _, errors = fastest_sdpa(torch, fn, lambda f: time_torch_ms(torch, f, 10))
    if backend is None:
        pytest.skip(f"no torch SDPA backend runs this shape: {errors}")

    def step():
        fn()
        torch.cuda.synchronize()

    with sdpa_backend(torch, backend):
        benchmark.pedantic(step, rounds=20, iterations=1, warmup_rounds=3)
    import cupy

    benchmark.extra_info.update(tokens=tokens, batch=batch, num_kv_heads=hkv, groups=groups, head_dim=d,
                                torch_backend=backend, cuda_event_best_ms=event_ms, skipped_backends=errors,
                                torch=str(torch.__version__), gpu=gpu_name(memory_properties(cupy.cuda.runtime)))
    torch.cuda.empty_cache()
