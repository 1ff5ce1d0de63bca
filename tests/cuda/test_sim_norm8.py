"""8-bit vector norms (``norm_bits=8``): the encode/scale kernels and a norm8 cache on device
arrays (simulator or GPU) vs the CPU twins.

The encoder reads a table (no ``log2`` on either side), so the norm bytes must be
bit-identical; the fused kernels (warp kernel for the scalar code, block kernel for the VQ
code) read the uint8 plane through the layer's scale table and agree with the CPU twin up to
float32 rounding.  Small sizes: the simulator runs every thread of every block in Python."""

import numpy as np
import pytest

from numba_kv import AttendConfig, knobs, make_cache
from numba_kv._backend import to_host
from numba_kv.ops.attention import kernels
from numba_kv.ops.norm8 import norm8_scale_rows_into, norm8_store_into

from ..conftest import runner_params, spy_launches, to_device


def _store(rng):
    h = (2.0 ** rng.uniform(-12, 12, (2, 5, 1))).astype(np.float16).view(np.uint16)
    h[0, 0, 0] = 0
    src = rng.integers(0, 256, (2, 5, 12)).astype(np.uint8)
    want_c, want_n = np.zeros((2, 9, 12), np.uint8), np.zeros((2, 9, 1), np.uint8)
    norm8_store_into(src, h, -40, 3, want_c, want_n)
    dc, dn = to_device(np.zeros_like(want_c)), to_device(np.zeros_like(want_n))
    norm8_store_into(to_device(src), to_device(h), -40, 3, dc, dn)
    assert np.array_equal(to_host(dc), want_c) and np.array_equal(to_host(dn), want_n)
    assert want_n[0, 3, 0] == 0 and want_n[:, 4:8].all()
    # a span of the source (s0, n): tokens 2 … 4 to 0 … 2
    want_c, want_n = np.zeros((2, 9, 12), np.uint8), np.zeros((2, 9, 1), np.uint8)
    norm8_store_into(src, h, -40, 0, want_c, want_n, s0=2, n=3)
    dc, dn = to_device(np.zeros_like(want_c)), to_device(np.zeros_like(want_n))
    norm8_store_into(to_device(src), to_device(h), -40, 0, dc, dn, s0=2, n=3)
    assert np.array_equal(to_host(dc), want_c) and np.array_equal(to_host(dn), want_n)
    assert np.array_equal(want_c[:, :3], src[:, 2:5]) and not want_c[:, 3:].any()


def _scale(rng):
    codes = rng.integers(0, 256, (2, 6, 1)).astype(np.uint8)
    x = rng.standard_normal((2, 4, 32)).astype(np.float32)
    want = x.copy()
    norm8_scale_rows_into(codes, -7, 2, want)
    out = to_device(x)
    norm8_scale_rows_into(to_device(codes), -7, 2, out)
    assert np.array_equal(to_host(out), want)


RUNNERS = {"norm8_store": _store, "norm8_scale_rows": _scale}


@pytest.mark.cuda
@pytest.mark.parametrize("runner", runner_params(RUNNERS))
def test_cuda_kernel_matches_cpu_twin(runner):
    runner(np.random.default_rng(12))


@pytest.mark.cuda
@pytest.mark.parametrize(("name", "warp"), [("pqo4-head-n8", 1), ("pqo4-head-n8", 0),
                                            ("pqo-k4v2-head-eden-vq-n8", 1), ("pqo-k4v2-head-eden-vq-n8", 0)],
                         ids=["scalar-warp", "scalar-block", "vq-warp", "vq-block"])
def test_norm8_cache_on_device_matches_cpu(name, warp, monkeypatch):
    """Prefill and decode steps that move tokens out of the window: the stored codes, norm
    bytes and grid base equal the CPU cache's, the fused outputs agree (the warp kernel
    decodes the VQ code too)."""
    launched = spy_launches(monkeypatch, (kernels, "DECODE_ATTENTION_WARP_VQ" if "vq" in name
                                          else "DECODE_ATTENTION_WARP"))
    rng = np.random.default_rng(2)
    d = 32
    geo = dict(num_layers=1, num_kv_heads=1, head_dim=d, residual_length=2, sink_tokens=1, window_dtype="float32")
    cpu, dev = make_cache(name, **geo), make_cache(name, **geo)
    cfg = AttendConfig(d ** -0.5, 2)
    with knobs(cuda_warp_attention=warp):
        for n, decode in ((6, False), (1, True), (2, True)):
            k = (rng.standard_normal((1, 1, n, d)) * 2.0 ** rng.uniform(-1, 1, (1, 1, n, 1))).astype(np.float32)
            v = rng.standard_normal((1, 1, n, d)).astype(np.float32)
            q = rng.standard_normal((1, 2, n, d)).astype(np.float32)
            if not decode:
                cpu.prefill(0, k, v)
                dev.prefill(0, to_device(k), to_device(v))
                continue
            a = cpu.decode(0, k, v, q, cfg).out
            b = dev.decode(0, to_device(k), to_device(v), to_device(q), cfg).out
            np.testing.assert_allclose(to_host(b), a, rtol=2e-5, atol=2e-6)
    sc, sd = cpu._layers[0], dev._layers[0]
    assert sc.meta == sd.meta and "norm8_base" in sc.meta
    for buf in ("k_codes", "k_scales", "v_codes", "v_scales"):
        n = sc.live_count(buf)
        assert np.array_equal(to_host(sd.buffers[buf])[:, :n], sc.buffers[buf][:, :n]), buf
    assert sd.buffers["k_scales"].dtype == np.uint8
    assert bool(launched) == (warp == 1)  # the kernel the case names ran


@pytest.mark.cuda
@pytest.mark.parametrize("d", [128, 64])
def test_tensor_core_plan_runs_the_vq_build(d, monkeypatch):
    """At head_dim 128 and 64 the plan picks the tensor-core kernel, whose scalar build reads
    binary16 scales: a norm8 layer's step runs the VQ build of its head_dim instead, which
    reads the norm bytes (scalar codes too; one norm a token: ``scale_shift`` 2 at 128, 1 at
    64), and agrees with the CPU cache within binary16 rounding."""
    vq = "decode_attention_mma_vq" + ("" if d == 128 else f"_d{d}")
    launched = spy_launches(monkeypatch, (kernels, vq.upper()))
    rng = np.random.default_rng(4)
    geo = dict(num_layers=1, num_kv_heads=1, head_dim=d, residual_length=1, sink_tokens=0, window_dtype="float32")
    cpu, dev = make_cache("pqo4-head-n8", **geo), make_cache("pqo4-head-n8", **geo)
    cfg = AttendConfig(d ** -0.5, 2)
    k, v = (rng.standard_normal((1, 1, 5, d)).astype(np.float32) for _ in range(2))
    cpu.prefill(0, k, v)
    dev.prefill(0, to_device(k), to_device(v))
    k1, v1 = (rng.standard_normal((1, 1, 1, d)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((1, 2, 1, d)).astype(np.float32)
    with knobs(cuda_warp_attention=1, cuda_mma_attention=1):
        b = dev.decode(0, to_device(k1), to_device(v1), to_device(q), cfg).out
    a = cpu.decode(0, k1, v1, q, cfg).out
    assert np.linalg.norm(to_host(b) - a) < 1e-3 * np.linalg.norm(a)  # (binary16 operands: ~3e-4)
    step = dev._layers[0].scratch["fused_step"].step
    assert step.plan.variant == "mma" and step._kernel.name == vq  # chosen, then the build
    assert len(launched) == 1  # the VQ build ran


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["pqo-k4v2-head-eden-vq", "pqo-k4v2-head-eden-vq-n8"])
def test_range_check_on_device_covers_the_int8_round_trip(name):
    """With ``validate="sync"`` on device arrays, a window token whose int8 round trip's EDEN
    scale saturates binary16 (its own 3 % under it) is refused — by the dry run (binary16
    norms) or the first store's norm check (8-bit norms) — and nothing is stored; a float32
    window stores it."""
    from ..caches.test_norm8 import _kv, _round_trip_token

    rng = np.random.default_rng(2)
    d = 64
    k, v = _kv(rng, 1, 2, 12, d)
    v[0, 1, -1] = _round_trip_token(rng, d, 65504.0)
    for window_dtype in ("int8", "float32"):
        c = make_cache(name, num_layers=1, num_kv_heads=2, head_dim=d, residual_length=4, sink_tokens=0,
                       window_dtype=window_dtype)
        c.validate = "sync"
        if window_dtype == "float32":
            c.prefill(0, to_device(k), to_device(v))
            assert c.seq_len(0) == 12
            continue
        with pytest.raises(ValueError, match=r"^v: .* does not fit binary16"):
            c.prefill(0, to_device(k), to_device(v))
        assert c.seq_len(0) == 0
