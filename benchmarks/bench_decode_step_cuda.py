"""One decode step on the GPU (pytest-benchmark groups ``decode-step-cuda-T<T>``, one a history): one
``cache.decode`` of one layer on CuPy arrays, host wall time to device synchronize, for the
caches ``dense``, ``pqo3`` and ``kv4`` at T = 4K, 16K, 64K, 128K, batch 1, 8 KV heads x 4 query
heads, d = 128 (:mod:`numba_kv.toolkit.bench_step`; ``dense`` returns the history and its step
includes the caller's CuPy attention over it).  The history grows by one token per round (the
steady state of generation: ``warmup_rounds`` + ``rounds`` = 23 tokens on top of T).  Next to
them, ``test_torch_sdpa_step``: one torch SDPA call (fp16, GQA, the backend fastest by wall
time of cuDNN/flash) over T tokens, skipped without torch.  Every entry records the GPU name;
the benchmark JSON's ``machine_info`` carries the provenance (``benchmarks/conftest.py``).

A fused cache's step writes one ``out=`` array; ``[...-graph]``: the same step through a
:class:`numba_kv.StepGraph` (captured in its warm-up rounds, then replayed); ``[...-bound]``:
through a :class:`numba_kv.DecodeStep` (armed in its warm-up rounds; a steady round is then
one graph launch without the step's Python).

Skipped without CuPy and a real GPU (the simulator is too slow for these shapes)."""

import os

import pytest

from numba_kv import AttendConfig, DecodeStep, StepGraph, make_cache
from numba_kv.toolkit.bench_cuda import (
    CudaBenchUnavailable,
    dense_attention,
    fastest_sdpa,
    free_device_memory,
    gpu_name,
    import_torch,
    make_sdpa,
    memory_properties,
    require_cupy,
    sdpa_backend,
)
from numba_kv.toolkit.bench_step import (
    BOUND_WARMUP,
    DEFAULT_MODES,
    DEFAULT_STEPS,
    DEFAULT_TOKENS,
    DEFAULT_WARMUP,
    GRAPH_WARMUP,
    make_decode_step,
    output_kind,
    time_wall_ms,
)

pytestmark = pytest.mark.gpu_only

HKV, GROUPS, D, BATCH = 8, 4, 128, 1


@pytest.fixture(scope="module")
def cupy():
    """CuPy on a real GPU, or skip (checked at run time: collection must not import CuPy)."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"):
        pytest.skip("needs a real GPU (the simulator is too slow for these shapes)")
    try:
        return require_cupy()
    except CudaBenchUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module", params=DEFAULT_TOKENS, ids=lambda t: f"T{t}")
def history(request, cupy):
    """``(T, k, v, q, k1, v1)``: float32 CuPy arrays of one configuration."""
    t = request.param
    rng = cupy.random.default_rng(0)

    def randn(*shape):
        return rng.standard_normal(shape, dtype=cupy.float32)

    yield (t, randn(BATCH, HKV, t, D), randn(BATCH, HKV, t, D), randn(BATCH, HKV * GROUPS, 1, D),
           randn(BATCH, HKV, 1, D), randn(BATCH, HKV, 1, D))
    free_device_memory(cupy, None)


def _info(benchmark, cupy, t, **extra):
    benchmark.extra_info.update(tokens=t, batch=BATCH, num_kv_heads=HKV, groups=GROUPS, head_dim=D,
                                gpu=gpu_name(memory_properties(cupy.cuda.runtime)), **extra)


@pytest.mark.parametrize("how", ["launches", "graph", "bound"])
@pytest.mark.parametrize("mode", DEFAULT_MODES)
def test_decode_step(benchmark, cupy, history, mode, how):
    t, k, v, q, k1, v1 = history
    benchmark.group = f"decode-step-cuda-T{t}"  # (the steps and torch's call at one T side by side)
    cfg = AttendConfig(D ** -0.5, GROUPS)
    cache = make_cache(mode, num_layers=1, num_kv_heads=HKV, head_dim=D)
    cache.prefill(0, k, v)
    kind = output_kind(cache.decode(0, k1, v1, q, cfg))
    if how != "launches" and kind != "fused":
        pytest.skip("a dequantized step ends in the caller's attention: no StepGraph")
    out = cupy.empty(q.shape, cupy.float32) if kind == "fused" else None  # the step's output, reused
    graph = StepGraph() if how == "graph" else None
    if how == "bound":
        bound = DecodeStep(cache, 0, k1, v1, q, cfg, out=out)
        graph = bound.graph

        def step():
            return bound().out
    else:
        step = make_decode_step(cache, k1, v1, q, cfg,
                                lambda qq, kk, vv, scale, bias: dense_attention(cupy, qq, kk, vv, scale, bias), out,
                                graph)
    sync = cupy.cuda.Device().synchronize

    def run():
        step()
        sync()

    sync()
    benchmark.pedantic(run, rounds=DEFAULT_STEPS, iterations=1,
                       warmup_rounds={"graph": GRAPH_WARMUP, "bound": BOUND_WARMUP}.get(how, DEFAULT_WARMUP - 1))
    _info(benchmark, cupy, t, mode=mode, output=kind, kv_mb=cache.memory_usage() / 1e6,
          tokens_after=cache.seq_len(0), graph=None if graph is None else graph.stats(),
          graph_error=None if graph is None else graph.error)
    del cache
    free_device_memory(cupy, None)


def test_torch_sdpa_step(benchmark, cupy, history):
    torch = import_torch()
    if torch is None:
        pytest.skip("needs torch with CUDA (the torch SDPA baseline)")
    t, k, v, q, _, _ = history
    benchmark.group = f"decode-step-cuda-T{t}"
    k16, v16, q16 = (a.astype(cupy.float16) for a in (k, v, q))
    fn = make_sdpa(torch, *(torch.from_dlpack(a) for a in (q16, k16, v16)))
    sync = cupy.cuda.Device().synchronize
    backend, wall, _, errors = fastest_sdpa(torch, fn, lambda f: time_wall_ms(f, 5, 1, sync), key=lambda w: w[0])
    if backend is None:
        pytest.skip(f"no torch SDPA backend runs this shape: {errors}")

    def run():
        fn()
        sync()

    with sdpa_backend(torch, backend):
        benchmark.pedantic(run, rounds=DEFAULT_STEPS, iterations=1, warmup_rounds=DEFAULT_WARMUP)
    _info(benchmark, cupy, t, mode="torch-sdpa-fp16", torch_backend=backend, skipped_backends=errors,
          torch=str(torch.__version__))
    del k16, v16, q16
    free_device_memory(cupy, torch)
