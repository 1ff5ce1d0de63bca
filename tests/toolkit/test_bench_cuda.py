"""The GPU decode-attention benchmark without a GPU: its byte and bandwidth arithmetic, the
CLI message without CuPy, and (under ``NUMBA_ENABLE_CUDASIM=1`` or on a GPU) the timed
callables it builds agree with the CPU ``decode_attention``."""

import math
import sys
import time
import types

import numpy as np
import pytest

from numba_kv._backend import to_host
from numba_kv.ops.attention import decode_attention
from numba_kv.ops.blockquant import quantize_blocks
from numba_kv.toolkit import bench_cuda
from numba_kv.toolkit.cli import main

from ..conftest import to_device


def test_packed_bytes_hand_count():
    # T=4096, batch=8, 3 bits, 8 KV heads x 4 groups, d=128:
    # per K (or V) vector: 128*3/8 = 48 code bytes + 4 blocks x 2 scale bytes = 56 bytes
    # vectors per tensor: 8 * 8 * 4096 = 262144 -> K and V: 2 * 262144 * 56 = 29360128
    # q: 8 * 32 heads * 128 float32 = 131072 bytes
    assert bench_cuda.packed_bytes(4096, 8, 3, 8, 4, 128) == 29_360_128 + 131_072
    # 4 bits: 64 + 8 = 72 bytes per vector
    assert bench_cuda.packed_bytes(4096, 8, 4) == 2 * 262_144 * 72 + 131_072


def test_peak_bandwidth_from_fake_properties():
    # H100 SXM-like: 2619 MHz memory clock, 5120-bit bus -> 2619e6 * 2 * 640 B = 3352.32 GB/s
    props = {"memoryClockRate": 2_619_000, "memoryBusWidth": 5120, "name": b"Fake GPU"}
    assert math.isclose(bench_cuda.peak_bandwidth_gbs(props), 3352.32)
    assert bench_cuda.gpu_name(props) == "Fake GPU"
    assert bench_cuda.peak_bandwidth_gbs({"name": b"x"}) == 0.0  # nothing reported: unknown, no KeyError


def test_memory_properties_fall_back_to_device_attributes():
    """CUDA 13's cudaDeviceProp has no memoryClockRate: read it as device attribute 36."""
    asked = []

    def attribute(attr, dev):
        asked.append((attr, dev))
        return {36: 2_619_000, 37: 5120}[attr]

    cuda13 = types.SimpleNamespace(getDeviceProperties=lambda i: {"name": b"H", "memoryBusWidth": 5120},
                                   deviceGetAttribute=attribute)
    props = bench_cuda.memory_properties(cuda13, 0)
    assert asked == [(36, 0)] and props["memoryClockRate"] == 2_619_000
    assert math.isclose(bench_cuda.peak_bandwidth_gbs(props), 3352.32)

    def missing(attr, dev):
        raise RuntimeError("cudaErrorInvalidValue")

    none = types.SimpleNamespace(getDeviceProperties=lambda i: {"name": b"H"}, deviceGetAttribute=missing)
    assert bench_cuda.peak_bandwidth_gbs(bench_cuda.memory_properties(none)) == 0.0


def test_row_arithmetic():
    r = bench_cuda.make_row(4096, 8, 3, 8, 4, 128, fused_ms=0.5, dense_ms=2.0, dequant_ms=4.0,
                            peak_gbs=1000.0, gpu="Fake", prov={"numba": "x"})
    assert r.speedup_vs_dense_fp16 == 4.0 and r.speedup_vs_dequant == 8.0
    assert math.isclose(r.packed_gb_per_s, r.packed_bytes / 0.5e-3 / 1e9)
    assert math.isclose(r.pct_of_peak, 100 * r.packed_gb_per_s / 1000.0)
    assert r.gpu == "Fake" and r.provenance == {"numba": "x"}
    empty = bench_cuda.make_row(64, 1, 4, 1, 4, 32, None, None, None, 1000.0, "Fake", {}, note="oom")
    assert empty.packed_gb_per_s is None and empty.speedup_vs_dense_fp16 is None
    assert "oom" in bench_cuda.render([r, empty])


def test_cli_without_cupy_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    assert main(["bench", "attention", "--device", "cuda", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "numba-kv bench attention: error: needs CuPy and a GPU: pip install -e .[cuda]" in err
    with pytest.raises(bench_cuda.CudaBenchUnavailable, match=r"needs CuPy and a GPU"):
        bench_cuda.run_attention_bench_cuda(tokens=(64,), batch=(1,))


def test_dense_attention_matches_reference_numpy():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 6, 1, 32)).astype(np.float32)
    k, v = rng.standard_normal((2, 2, 2, 40, 32)).astype(np.float32)
    out = bench_cuda.make_dense(np, q, k, v)()
    s = np.einsum("bhgd,bhtd->bhgt", q.reshape(2, 2, 3, 32).astype(np.float64), k) / math.sqrt(32)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ref = np.einsum("bhgt,bhtd->bhgd", p, v).reshape(2, 6, 1, 32)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
    # float16 operands (the fp16 baseline): same within half precision
    out16 = bench_cuda.make_dense(np, q.astype(np.float16), k.astype(np.float16), v.astype(np.float16))()
    assert out16.dtype == np.float16
    np.testing.assert_allclose(out16.astype(np.float32), ref, rtol=0, atol=5e-3)


@pytest.mark.cuda
@pytest.mark.parametrize("bits", [3, 4])
def test_timed_callables_agree_with_cpu_decode_attention(bits):
    """T=64, batch 1, one KV head x 4 groups: the fused and dequantize-then-attend callables
    built on device arrays match the CPU fused attention."""
    rng = np.random.default_rng(bits)
    k, v = rng.standard_normal((2, 1, 1, 64, 32)).astype(np.float32)
    q = rng.standard_normal((1, 4, 1, 32)).astype(np.float32)
    kc, ks = quantize_blocks(k, bits)
    vc, vs = quantize_blocks(v, bits)
    cpu = decode_attention(q, kc, ks, vc, vs, bits=bits)
    dev = [to_device(a) for a in (q, kc, ks, vc, vs)]
    fused = to_host(bench_cuda.make_fused(*dev, bits)())
    np.testing.assert_allclose(fused, cpu, rtol=2e-5, atol=2e-6)
    deq = bench_cuda.make_dequant_then_attend(np, *dev, bits, asarray=to_host)()
    np.testing.assert_allclose(deq, cpu, rtol=1e-4, atol=1e-5)


class _FakeEvent:
    def record(self):
        self.t = time.perf_counter()

    def synchronize(self):
        pass


def _fake_cupy() -> types.ModuleType:
    """NumPy dressed as CuPy (host arrays, so every op runs its CPU twin): enough of the CuPy
    API for ``run_attention_bench_cuda`` to go through its whole flow without a GPU."""
    fake = types.ModuleType("cupy")
    fake.__getattr__ = lambda name: getattr(np, name)
    runtime = types.SimpleNamespace(
        getDeviceCount=lambda: 1, deviceSynchronize=lambda: None,
        getDeviceProperties=lambda i: {"name": b"Fake GPU", "memoryClockRate": 1_000_000, "memoryBusWidth": 64})
    fake.cuda = types.SimpleNamespace(
        runtime=runtime, Event=_FakeEvent, get_elapsed_time=lambda a, b: (b.t - a.t) * 1e3,
        memory=types.SimpleNamespace(OutOfMemoryError=MemoryError))
    fake.random = types.SimpleNamespace(default_rng=np.random.default_rng)
    fake.get_default_memory_pool = lambda: types.SimpleNamespace(free_all_blocks=lambda: None)
    return fake


def test_whole_flow_with_numpy_dressed_as_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy())
    rows = bench_cuda.run_attention_bench_cuda(tokens=(64, 96), batch=(1, 2), bits=(3, 4), num_kv_heads=2,
                                               groups=2, head_dim=32, repeat=1)
    assert [(r.tokens, r.batch, r.bits) for r in rows] == [(t, b, nb) for t in (64, 96) for b in (1, 2)
                                                           for nb in (3, 4)]
    for r in rows:
        assert r.gpu == "Fake GPU" and r.peak_gb_per_s == 16.0 and r.provenance["gpu"] == "Fake GPU"
        assert "cpu_model" in r.provenance and r.note == ""
        assert r.fused_ms > 0 and r.dense_fp16_ms > 0 and r.dequant_ms > 0
        # fused and dequantize-then-attend read the same codes: float32 round-off apart
        assert 0 <= r.max_abs_diff_vs_dequant < 1e-5, r.max_abs_diff_vs_dequant
        assert r.packed_bytes == bench_cuda.packed_bytes(r.tokens, r.batch, r.bits, 2, 2, 32)
    assert "Fake GPU" in bench_cuda.render(rows)
