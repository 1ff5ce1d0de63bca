"""Decode attention, batch 1, 8 KV heads x 4 query heads each, d = 128: fused from packed
codes vs NumPy dense float32 attention (one BLAS thread, and two: best vs best) vs
dequantize-then-attend, in one group per (T, bits).  Every fused entry records the packed
GB/s it reads next to the machine's STREAM-style copy bandwidth measured in the same session
(:func:`numba_kv.info.stream_copy_gbs`); the machine info of the JSON carries
:func:`numba_kv.info.provenance` (CPU, LLVM host, codegen target, AVX-512, threads)."""

import pytest

from numba_kv.toolkit.bench import blas_control, blas_threads_limited, make_case

from ._util import env_info

TOKENS = [4096, 32768, 131072]
BITS = [3, 4]
_CASES = {}
_STREAM = {}


def case(t, b):
    if (t, b) not in _CASES:
        _CASES.clear()  # keep one case (up to 1.1 GB of float32 K/V at 128K) alive at a time
        _CASES[(t, b)] = make_case(t, b)
    return _CASES[(t, b)]


def stream_gbs():
    if not _STREAM:
        from numba_kv.info import stream_copy_gbs

        _STREAM["gbs"] = round(stream_copy_gbs(), 2)
    return _STREAM["gbs"]


def _run(benchmark, fn, c, kind, blas=None):
    benchmark.group = f"attention-T{c.tokens}-b{c.bits}"
    env_info(benchmark, c.tokens)
    benchmark.extra_info.update(kind=kind, compressed_bytes=c.compressed_bytes, dense_bytes=c.dense_bytes,
                                blas_threads=blas if blas_control() else "environment",
                                stream_copy_GB_per_s=stream_gbs())

    # the BLAS thread count is set around the rounds, not inside the timed call: threadpoolctl's
    # switch scans the loaded libraries (about 1 ms a call), which would be timed as dense's
    with blas_threads_limited(blas):
        fn()  # compile / warm up outside the timed region
        benchmark.pedantic(fn, rounds=5, warmup_rounds=1)
    if benchmark.stats is not None:
        t = benchmark.stats.stats.min
        nbytes = c.dense_bytes if kind.startswith("dense") else c.compressed_bytes
        benchmark.extra_info["GB_per_s_read"] = round(nbytes / t / 1e9, 3)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("tokens", TOKENS)
def test_fused(benchmark, tokens, bits):
    c = case(tokens, bits)
    _run(benchmark, c.fused, c, "fused")


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("tokens", TOKENS)
def test_dense_float32_numpy(benchmark, tokens, bits):
    c = case(tokens, bits)
    _run(benchmark, c.dense, c, "dense", blas=1)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("tokens", TOKENS)
def test_dense_float32_numpy_blas2(benchmark, tokens, bits):
    """Best vs best: dense with two BLAS threads (threadpoolctl; without it, the environment's)."""
    c = case(tokens, bits)
    _run(benchmark, c.dense, c, "dense-blas2", blas=2)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("tokens", TOKENS)
def test_dequantize_then_attend(benchmark, tokens, bits):
    c = case(tokens, bits)
    _run(benchmark, c.dequant_then_attend, c, "dequant+attend", blas=1)
