"""Decode attention, batch 1, 8 KV heads, 32 query heads, d = 128: fused from packed codes vs
NumPy dense float32 attention vs dequantize-then-attend, in one group per (T, bits)."""

import pytest

from numba_kv.bench import make_case

from ._util import env_info

TOKENS = [1024, 4096, 16384, 32768]
BITS = [3, 4]
_CASES = {}


def case(t, b):
    if (t, b) not in _CASES:
        _CASES.clear()  # keep one case (up to 270 MB of float32 K/V) alive at a time
        _CASES[(t, b)] = make_case(t, b)
    return _CASES[(t, b)]


def _run(benchmark, fn, c, kind):
    benchmark.group = f"attention-T{c.tokens}-b{c.bits}"
    env_info(benchmark, c.tokens)
    benchmark.extra_info.update(kind=kind, compressed_bytes=c.compressed_bytes, dense_bytes=c.dense_bytes)
    fn()  # compile / warm up outside the timed region
    benchmark.pedantic(fn, rounds=5, warmup_rounds=1)
    if benchmark.stats is not None:
        t = benchmark.stats.stats.min
        nbytes = c.compressed_bytes if kind != "dense" else c.dense_bytes
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
    _run(benchmark, c.dense, c, "dense")


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("tokens", TOKENS)
def test_dequantize_then_attend(benchmark, tokens, bits):
    c = case(tokens, bits)
    _run(benchmark, c.dequant_then_attend, c, "dequant+attend")
