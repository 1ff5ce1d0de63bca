"""The GPU decode-attention benchmark without a GPU: its byte and bandwidth arithmetic, the
CLI message without CuPy, and (under ``NUMBA_ENABLE_CUDASIM=1`` or on a GPU) the timed
callables it builds agree with the CPU ``decode_attention``."""

import math
import sys
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
    assert r.torch_ms is None and r.speedup_vs_torch is None and r.torch_backend is None
    empty = bench_cuda.make_row(64, 1, 4, 1, 4, 32, None, None, None, 1000.0, "Fake", {}, note="oom")
    assert empty.packed_gb_per_s is None and empty.speedup_vs_dense_fp16 is None
    assert "oom" in bench_cuda.render([r, empty])


def test_row_with_torch_baseline():
    r = bench_cuda.make_row(4096, 8, 3, 8, 4, 128, fused_ms=0.5, dense_ms=2.0, dequant_ms=4.0, peak_gbs=1000.0,
                            gpu="Fake", prov={"torch": "2.11"}, torch_ms=0.25, torch_backend="cudnn",
                            max_abs_diff_torch=0.1, max_abs_diff_torch_dense=1e-3)
    assert r.speedup_vs_torch == 0.5 and r.torch_backend == "cudnn"
    assert r.max_abs_diff_vs_torch == 0.1 and r.max_abs_diff_torch_vs_dense == 1e-3
    # a backend name without a time is dropped
    assert bench_cuda.make_row(64, 1, 3, 1, 4, 32, 0.5, 1.0, 1.0, 0.0, "F", {}, torch_backend="flash"
                               ).torch_backend is None


def test_render_puts_the_torch_baseline_first():
    with_torch = bench_cuda.make_row(4096, 8, 3, 8, 4, 128, 0.5, 2.0, 4.0, 1000.0, "Fake", {"torch": "2.11"},
                                     max_abs_diff=1e-7, torch_ms=1.0, torch_backend="flash",
                                     max_abs_diff_torch=0.05)
    without = bench_cuda.make_row(4096, 8, 4, 8, 4, 128, 0.5, 2.0, 4.0, 1000.0, "Fake", {})
    lines = bench_cuda.render([with_torch, without]).splitlines()
    assert lines[2] == ""
    head = lines[3].split(" | ")
    assert head.index("torch sdpa ms") < head.index("cupy fp16 ms") < head.index("deq+attend ms")
    assert head[3:9] == ["fused ms", "torch sdpa ms", "torch backend", "x torch", "cupy fp16 ms", "x cupy"]
    assert lines[4].split(" | ") == ["4096", "8", "3", "0.500", "1.000", "flash", "2.00", "2.000", "4.00",
                                     "4.000", "8.00", f"{with_torch.packed_gb_per_s:.1f}",
                                     f"{with_torch.pct_of_peak:.1f}", "5.0e-02", "1.0e-07"]
    assert lines[5].split(" | ")[4:9] == ["-", "-", "-", "2.000", "4.00"]
    assert "torch 2.11" in lines[0] and "torch SDPA fp16" in lines[1]
    # a JSON row (gpu_check.sh re-renders them) rebuilds the dataclass
    assert bench_cuda.CudaAttentionRow(**bench_cuda.rows_as_dicts([with_torch])[0]) == with_torch


def test_cli_without_cupy_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    assert main(["bench", "attention", "--device", "cuda", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("numba-kv bench attention: error: needs CuPy and a GPU: pip install -e .[cuda]")
    assert err.count("\n") == 1  # one line, no traceback
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


def test_whole_flow_with_numpy_dressed_as_cupy(fake_cupy):
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
        # no torch: its columns are empty, the rest ran
        assert r.torch_ms is None and r.torch_backend is None and r.speedup_vs_torch is None
        assert r.max_abs_diff_vs_torch is None and r.max_abs_diff_torch_vs_dense is None
    assert r.provenance["torch"].startswith("not importable")
    text = bench_cuda.render(rows)
    assert "Fake GPU" in text and "torch not importable" in text


def test_whole_flow_with_a_torch_baseline(fake_cupy, fake_torch):
    """The torch column: cuDNN refuses the shape (skipped), flash runs and is named; the fused
    output is compared with it (3-bit quantization error) and torch with CuPy dense (fp16)."""
    rows = bench_cuda.run_attention_bench_cuda(tokens=(64,), batch=(1,), bits=(3,), num_kv_heads=2, groups=2,
                                               head_dim=32, repeat=2)
    (r,) = rows
    assert r.torch_backend == "flash" and r.torch_ms > 0 and r.note == ""
    assert r.speedup_vs_torch == r.torch_ms / r.fused_ms
    assert fake_torch.state["calls"]["flash"] >= 1 + 1 + 2  # probe, warm-up, timed
    assert r.max_abs_diff_torch_vs_dense < 1e-2  # the same fp16 attention twice
    assert 1e-4 < r.max_abs_diff_vs_torch < 0.5  # 3-bit codes vs fp16 K/V
    assert r.provenance["torch"] == "2.11.0+fake"
    line = bench_cuda.render(rows).splitlines()[-1].split(" | ")
    assert line[4:8] == [f"{r.torch_ms:.3f}", "flash", f"{r.speedup_vs_torch:.2f}", f"{r.dense_fp16_ms:.3f}"]


def test_torch_baseline_when_every_backend_refuses(fake_cupy, fake_torch, monkeypatch):
    monkeypatch.setattr(bench_cuda, "TORCH_BACKENDS", ("cudnn",))
    (r,) = bench_cuda.run_attention_bench_cuda(tokens=(64,), batch=(1,), bits=(4,), num_kv_heads=1, groups=2,
                                               head_dim=32, repeat=1)
    assert r.torch_ms is None and r.torch_backend is None and r.fused_ms > 0
    assert r.note == "torch SDPA skipped: cudnn: No available kernel. Aborting execution."


def test_pick_fastest_skips_refusing_backends():
    timings = {"a": 3.0, "b": 1.0, "c": RuntimeError("refused\nsecond line"), "d": 2.0}

    def run_one(name):
        t = timings[name]
        if isinstance(t, Exception):
            raise t
        return t, f"out-{name}"

    assert bench_cuda.pick_fastest("abcd", run_one) == ("b", 1.0, "out-b", {"c": "refused"})
    assert bench_cuda.pick_fastest("c", run_one) == (None, None, None, {"c": "refused"})
    # (median, min) timings, ranked by median
    pairs = {"x": (2.0, 0.5), "y": (1.0, 0.9)}
    assert bench_cuda.pick_fastest("xy", lambda n: (pairs[n], n), key=lambda t: t[0])[0] == "y"
    with pytest.raises(ValueError):  # anything but RuntimeError is a bug, not a refusal
        bench_cuda.pick_fastest("a", lambda n: (_ for _ in ()).throw(ValueError("bug")))


@pytest.mark.parametrize("version, ok", [("2.11.0+cu130", True), ("2.5.0", True), ("2.4.1", False),
                                         ("1.13.1", False), ("3.0.0a0", True), ("weird", False)])
def test_torch_supports_gqa(version, ok):
    assert bench_cuda.torch_supports_gqa(version) is ok


def test_speedup_and_notes():
    assert bench_cuda.speedup(3.0, 1.5) == 2.0
    assert bench_cuda.speedup(None, 1.0) is None and bench_cuda.speedup(1.0, None) is None
    assert bench_cuda.speedup(1.0, 0.0) is None
    assert bench_cuda.errors_note("p", {}) == ""
    assert bench_cuda.errors_note("p", {"a": "x", "b": "y"}) == "p: a: x; b: y"


def test_make_sdpa_matches_dense_attention_on_cpu_torch():
    """The real torch SDPA (CPU tensors, default backend) computes the attention of
    :func:`dense_attention`: GQA, scale 1/sqrt(d)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 8, 1, 32)).astype(np.float32)
    k, v = rng.standard_normal((2, 2, 2, 48, 32)).astype(np.float32)
    out = bench_cuda.make_sdpa(torch, *(torch.from_numpy(a) for a in (q, k, v)))().numpy()
    ref = bench_cuda.dense_attention(np, q, k, v, 32 ** -0.5)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)


def test_gpu_provenance_names_the_build_and_versions():
    """A GPU number names the compute capability (whose build ran), numba-cuda and the CUDA
    runtime and driver (they were missing: the README had to say by hand which kernel ran)."""
    runtime = types.SimpleNamespace(runtimeGetVersion=lambda: 13000, driverGetVersion=lambda: 13010)
    cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime))
    p = bench_cuda.gpu_provenance(cupy, {"name": b"NVIDIA H200", "major": 9, "minor": 0})
    assert p["gpu"] == "NVIDIA H200" and p["compute_capability"] == "9.0"
    assert (p["cuda_runtime"], p["cuda_driver"]) == ("13.0", "13.1") and p["numba_cuda"] != ""
    bare = bench_cuda.gpu_provenance(types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=object())), {})
    assert (bare["compute_capability"], bare["cuda_runtime"], bare["cuda_driver"]) == ("unknown",) * 3
