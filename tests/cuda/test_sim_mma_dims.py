"""The tensor-core kernels at head_dim 64 (``ops/attention/mma_dims.py``: ``*_mma_d64``, ``*_mma_vq_d64``).

The same tiles as at 128 with a lane's share of a head halved: a lane of a quad scores 16
coordinates of a key (half a 32-block; at 3 bits the odd lanes' half starts mid-word), a lane
of a column group decodes 8 of a value (at 3 bits 24 bits that cross a word on some lanes
only).  Each build runs, in the simulator or on a GPU, against the float32 CPU twin within
binary16 rounding (a lane reading its neighbour's half, a wrong shift or a missed second word
shows at 1e-2 and more), and must be the kernel that ran.
"""

import numpy as np
import pytest

from numba_kv import AttendConfig, knobs, make_cache
from numba_kv._backend import to_host
from numba_kv.ops.attention import CodeLayout, decode_attention, kernels, mma_layout_ok, use_mma_kernel
from numba_kv.ops.attention.flat import fused_attention_rows
from numba_kv.ops.blockquant import quantize_blocks
from numba_kv.ops.codebook import get_codebook
from numba_kv.ops.headquant import head_codebook, quantize_head

from ..conftest import spy_launches, to_device
from .test_sim_mma import MMA_RTOL, check_real_model_rows, smollm2_largest_layer
from .test_sim_mma_vq import VQ_RTOL

D = 64


def _rel(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(np.asarray(b, np.float64)))


def _both(fn, *arrays, **kw):
    """``fn`` on NumPy arrays (the CPU twin) and on device arrays: ``(cpu, device)``."""
    cpu = fn(*arrays, **kw)
    dkw = {n: (to_device(a) if isinstance(a, np.ndarray) else a) for n, a in kw.items()}
    return cpu, to_host(fn(*(to_device(a) for a in arrays), **dkw))


@pytest.mark.cuda
@pytest.mark.parametrize("kbits, vbits, T, n_exact, q_len, q_scale", [
    (3, 3, 45, 0, 1, 1.0),   # 3-bit halves mid-word (keys) and values crossing a word on some lanes
    (4, 2, 37, 9, 2, 1.0),   # GQA 4 × causal q_len 2, a window of exact tokens
    (2, 4, 3, 0, 1, 3e5),    # 3 tokens (a tile mostly past the end); queries far beyond binary16
])
def test_mma_d64_matches_cpu_twin(kbits, vbits, T, n_exact, q_len, q_scale, monkeypatch):
    """32-block codes with a scale per block (two blocks a head), keys spread ×4, in partitions
    of 32 (a ragged last tile in each); logits of a few units whatever ``q_scale`` (the row
    scaling keeps the binary16 query fragments finite)."""
    launched = spy_launches(monkeypatch, (kernels, "DECODE_ATTENTION_MMA_D64"))
    rng = np.random.default_rng(kbits * 10 + vbits + 640)
    b, hkv, G = 1, 2, 4
    k = (rng.standard_normal((b, hkv, T, D)) * 4).astype(np.float32)
    v = rng.standard_normal((b, hkv, T, D)).astype(np.float32)
    kc, ks = quantize_blocks(k, kbits)
    vc, vs = quantize_blocks(v, vbits)
    q = (rng.standard_normal((b, hkv * G, q_len, D)) * q_scale).astype(np.float32)
    kw = dict(k_bits=kbits, v_bits=vbits, partition_size=32, softmax_scale=D ** -0.5 / q_scale)
    if n_exact:
        kw["k_exact"] = rng.standard_normal((b, hkv, n_exact, D)).astype(np.float32)
        kw["v_exact"] = rng.standard_normal((b, hkv, n_exact, D)).astype(np.float32)
    cpu, dev = _both(decode_attention, q, kc, ks, vc, vs, **kw)
    assert launched, "the head_dim 64 tensor-core kernel did not run"
    assert np.isfinite(dev).all()
    assert _rel(dev, cpu) < MMA_RTOL
    assert not np.array_equal(dev, cpu)  # binary16 operands: not the float32 kernel


@pytest.mark.cuda
def test_mma_d64_token_scales_match_cpu_twin(monkeypatch):
    """Whole-head codes at 64 (``kv4``'s widths, one norm a token: ``sshift`` 1 is "one scale
    a token" here, 2 at 128), norms spread over 6 octaves from token to token."""
    launched = spy_launches(monkeypatch, (kernels, "DECODE_ATTENTION_MMA_D64"))
    rng = np.random.default_rng(641)
    b, hkv, T = 1, 2, 45
    spread = np.exp(rng.uniform(-3.0, 3.0, (b, hkv, T, 1))).astype(np.float32)
    k = (rng.standard_normal((b, hkv, T, D)) * spread).astype(np.float32)
    v = (rng.standard_normal((b, hkv, T, D)) * spread[:, :, ::-1]).astype(np.float32)
    kc, kn = quantize_head(k, 4)
    vc, vn = quantize_head(v, 3)
    q = (rng.standard_normal((b, hkv * 4, 1, D)) * 0.1).astype(np.float32)
    cpu, dev = _both(decode_attention, q, kc, kn, vc, vn, k_bits=4, v_bits=3, rotation="head", partition_size=32)
    assert launched, "the head_dim 64 tensor-core kernel did not run"
    assert np.isfinite(dev).all() and _rel(dev, cpu) < 1e-3
    assert not np.array_equal(dev, cpu)


@pytest.mark.cuda
def test_paged_mma_d64_matches_cpu_twin(monkeypatch):
    """PQO pools (K 3 bits, V 2 bits) at head_dim 64, ragged sequences on interleaved pages,
    GQA 4 × causal q_len 2."""
    from numba_kv import PagedKVCache

    launched = spy_launches(monkeypatch, (kernels, "PAGED_DECODE_ATTENTION_MMA_D64"))
    rng = np.random.default_rng(642)
    caches = [PagedKVCache(num_pages=12, num_layers=1, num_kv_heads=1, head_dim=D, page_size=16,
                           storage="pqo-k3v2") for _ in range(2)]
    seqs = [[c.allocate_sequence() for _ in range(3)] for c in caches]
    for chunk in range(3):
        for i, n in enumerate((5, 19, 40)):
            lo, hi = n * chunk // 3, n * (chunk + 1) // 3
            if hi > lo:
                k = (rng.standard_normal((1, hi - lo, D)) * 3).astype(np.float32)
                v = rng.standard_normal((1, hi - lo, D)).astype(np.float32)
                caches[0].append(0, seqs[0][i], k, v)
                caches[1].append(0, seqs[1][i], to_device(k), to_device(v))
    q = rng.standard_normal((3, 4, 2, D)).astype(np.float32)
    a = caches[0].decode_attention(0, q, partition_size=16)
    b = to_host(caches[1].decode_attention(0, to_device(q), partition_size=16))
    assert launched, "the paged head_dim 64 tensor-core kernel did not run"
    assert np.isfinite(b).all() and _rel(b, a) < MMA_RTOL
    assert not np.array_equal(b, a)


def _layout(code):
    kind, bits = code
    return CodeLayout.head_vq(bits, D) if kind == "vq" else CodeLayout.uniform(head_codebook(bits, D), D, D // 32)


@pytest.mark.cuda
@pytest.mark.parametrize("kcode, vcode, n_exact", [
    (("vq", 4), ("vq", 2), 0),   # kv3's codes: pairs for K, quads for V
    (("vq", 2), ("s", 3), 5),    # quads for K (a lane's 4 bytes in one word), scalar values, a window
], ids=["pairs-quads", "quads-scalar-window"])
def test_head_vq_d64_matches_cpu_twin(kcode, vcode, n_exact, monkeypatch):
    """Random code bytes with norms spread over 8 octaves on the VQ build at 64."""
    launched = spy_launches(monkeypatch, (kernels, "DECODE_ATTENTION_MMA_VQ_D64"))
    rng = np.random.default_rng(643 + n_exact)
    g, T, rows = 2, 45, 4
    klay, vlay = _layout(kcode), _layout(vcode)
    kc, vc = (rng.integers(0, 256, (g, T, D * code[1] // 8)).astype(np.uint8) for code in (kcode, vcode))
    ks, vs = (np.exp(rng.uniform(-3.0, 3.0, (g, T, 1))).astype(np.float16).view(np.uint16) for _ in range(2))
    q = (rng.standard_normal((g, rows, D)) * 0.3).astype(np.float32)
    ke = rng.standard_normal((g, max(n_exact, 1), D)).astype(np.float32)[:, :n_exact]
    ve = rng.standard_normal((g, max(n_exact, 1), D)).astype(np.float32)[:, :n_exact]
    pos = (T + np.arange(max(n_exact, 1))).astype(np.int32)
    outs = []
    for f in (to_device, np.ascontiguousarray):
        outs.append(to_host(fused_attention_rows(f(q), f(q), f(kc), f(ks), f(vc), f(vs), T, 0, f(ke), f(ve), n_exact,
                                                 f(pos), klay, vlay, D ** -0.5, None, T + n_exact - 1, 1, True,
                                                 part_size=32)))
    dev, cpu = outs
    assert launched, "the head_dim 64 VQ build did not run"
    assert np.isfinite(dev).all() and _rel(dev, cpu) < VQ_RTOL
    assert not np.array_equal(dev, cpu)


@pytest.mark.cuda
def test_kv3_cache_at_d64_decodes_on_tensor_cores(monkeypatch):
    """``kv3`` at SmolLM2's head_dim (64): 8-bit norms, VQ pairs and quads, an int8 window; its
    device steps run the VQ build for 64 (the 8-bit norms are one scale a token there at
    ``scale_shift`` 1) and agree with the CPU cache."""
    launched = spy_launches(monkeypatch, (kernels, "DECODE_ATTENTION_MMA_VQ_D64"))
    rng = np.random.default_rng(644)
    geo = dict(num_layers=1, num_kv_heads=2, head_dim=D, residual_length=2, sink_tokens=1)
    cpu, dev = make_cache("kv3", **geo), make_cache("kv3", **geo)
    cfg = AttendConfig(D ** -0.5, 4)
    k, v = (rng.standard_normal((1, 2, 40, D)).astype(np.float32) for _ in range(2))
    cpu.prefill(0, k, v)
    dev.prefill(0, to_device(k), to_device(v))
    with knobs(cuda_warp_attention=1, cuda_mma_attention=1):
        for _ in range(2):
            k1, v1 = (rng.standard_normal((1, 2, 1, D)).astype(np.float32) for _ in range(2))
            q = rng.standard_normal((1, 8, 1, D)).astype(np.float32)
            a = cpu.decode(0, k1, v1, q, cfg).out
            b = to_host(dev.decode(0, to_device(k1), to_device(v1), to_device(q), cfg).out)
            assert np.isfinite(b).all() and _rel(b, a) < VQ_RTOL
    step = dev._layers[0].scratch["fused_step"].step
    assert step.plan.variant == "mma" and step._kernel.name == "decode_attention_mma_vq_d64"
    assert len(launched) == 2  # one a step


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["pqo3", "kv4", "kv3"])
def test_steady_step_at_d64_on_tensor_cores_stays_within_its_budget(mode):
    """A steady decode step at head_dim 64 on the default kernels (the ``*_d64`` builds; the
    step budget's own tests pin the float32 kernels): each flushing a token out of the window,
    it keeps the mode's budget of launches, allocations and transfers
    (``test_sim_step_budget.BUDGET``), launches the head_dim 64 build once, stays within
    binary16 rounding of the CPU twin's output, and stores the twin's bytes."""
    from numba_kv._backend import simulator_enabled

    from .test_sim_step_budget import BUDGET, STEPS, WARMUP, count_device_work, steady_layer

    if not simulator_enabled():
        pytest.skip("counts the simulator's launches, allocations and transfers")
    rng = np.random.default_rng(645)
    h, g = 2, 2
    cache, twin, attend = steady_layer(mode, rng, h, g, D)
    kernel = "_decode_attention_mma_vq_d64_cuda" if mode == "kv3" else "_decode_attention_mma_d64_cuda"
    dout = to_device(np.zeros((1, h * g, 1, D), np.float32))
    worst: dict = {}
    for i in range(WARMUP + STEPS):
        host = tuple(rng.standard_normal(s).astype(np.float32) for s in ((1, h, 1, D), (1, h, 1, D), (1, h * g, 1, D)))
        dev = tuple(to_device(a) for a in host)
        with count_device_work() as counts:
            out = cache.decode(0, *dev, attend, out=dout).out
        if i >= WARMUP:
            worst = {key: max(worst.get(key, 0), counts.get(key, 0)) for key in BUDGET[mode]}
            assert counts[f"launch {kernel}"] == 1, dict(counts)
        want = twin.decode(0, *host, attend).out
        assert np.isfinite(to_host(out)).all() and _rel(to_host(out), want) < VQ_RTOL
    assert all(worst[key] <= BUDGET[mode][key] for key in worst), worst
    st, tw = cache._layers[0], twin._layers[0]
    for key, buf in st.buffers.items():
        np.testing.assert_array_equal(to_host(buf), tw.buffers[key], err_msg=key)


def test_tensor_core_head_dims():
    """64 and 128 have tensor-core builds; 32, 96 and 256 run the warp or block kernels."""
    lay = {d: CodeLayout.uniform(get_codebook(3, "maxnorm"), d) for d in (32, 64, 96, 128)}
    assert all(mma_layout_ok(x) for x in lay.values())
    assert use_mma_kernel("cuda", 64, False, False, lay[64], lay[64])
    assert use_mma_kernel("cuda", 128, False, False, lay[128], lay[128])
    assert not use_mma_kernel("cuda", 32, False, False, lay[32], lay[32])
    assert not use_mma_kernel("cuda", 96, False, False, lay[96], lay[96])
    vq = CodeLayout.head_vq(4, 64), CodeLayout.head_vq(2, 64)
    assert use_mma_kernel("cuda", 64, False, False, *vq)
    assert not use_mma_kernel("cpu", 64, False, False, *vq)
    assert {(d, paged, v): t.name for (d, paged, v), t in kernels.MMA_TWINS.items() if d == 64} == {
        (64, False, False): "decode_attention_mma_d64", (64, True, False): "paged_decode_attention_mma_d64",
        (64, False, True): "decode_attention_mma_vq_d64"}


#: the head_dim 64 builds' simulator/GPU runs (``tests/cuda/test_sim.py`` checks every registered
#: twin has one)
RUNNERS = {"decode_attention_mma_d64": test_mma_d64_matches_cpu_twin,
           "decode_attention_mma_vq_d64": test_head_vq_d64_matches_cpu_twin,
           "paged_decode_attention_mma_d64": test_paged_mma_d64_matches_cpu_twin}


@pytest.mark.cuda
@pytest.mark.slow
def test_mma_d64_on_real_model_kv():
    """SmolLM2-135M's own heads (head_dim 64, 3 KV heads × 3 query heads; post-RoPE, one
    prefill of the evaluation text: ``benchmarks/mma_real_kv.py --rows native``) of the layer
    whose keys reach the largest magnitude, coded as every layout the tensor-core kernels
    read: the head_dim 64 builds within :data:`MMA_RTOL` of the CPU twin, and the ones that
    ran."""
    from benchmarks.mma_real_kv import native_rows

    rows = smollm2_largest_layer(native_rows)
    assert rows[1].shape == (1, 3, 32, D) and rows[0].shape == (1, 9, 32, D)
    check_real_model_rows(rows)  # (kernel_error's spy: the head_dim's build, kernels.MMA_TWINS)
