"""The tensor-core kernel's head VQ build (``ops/attention/mma_vq.py``: ``decode_attention_mma_vq``)
and the two loads it adds (``ldg_u8``, ``lds_u32x2``).

The loads run in small kernels, on a GPU (their inline PTX) or under ``NUMBA_ENABLE_CUDASIM=1``
(their Python twins), against NumPy indexing.  The kernel runs on the head VQ code (pairs of 4
bits, quads of 2 bits) on either side, next to a scalar side, with binary16 or 8-bit norms,
against the float32 CPU twin — which decodes the VQ code by its own loop
(``ops/attention/cpu.py``) — within binary16 rounding (relative L2 error far below what a wrong
table entry, quad half, replica or norm gives), and must be the kernel that ran.
"""

import numpy as np
import pytest
from numba import cuda, uint32, uint64

from numba_kv import AttendConfig, knobs, make_cache
from numba_kv._backend import to_host
from numba_kv.caches._headnorm import BASE_OFFSET
from numba_kv.ops.attention import CodeLayout, kernels
from numba_kv.ops.attention.flat import fused_attention_rows
from numba_kv.ops.attention.ptx import (
    SIM_SHARED_BASE,
    _sim_lds_u32x2,
    global_address,
    ldg_u8,
    lds_u32x2,
    shared_base32,
    static_itemsize,
)
from numba_kv.ops.headquant import head_codebook

from ..conftest import spy_launches, to_device

#: relative L2 error against the float32 CPU twin: binary16 codes, queries and weights (about
#: 3e-4 measured; a table entry or norm off shows at 1e-2 and more)
VQ_RTOL = 1e-3


@cuda.jit
def byte_kernel(arr, offsets, out):
    i = cuda.threadIdx.x
    if i < offsets.shape[0]:
        out[i] = ldg_u8(arr, global_address(arr) + uint64(offsets[i]))


@cuda.jit
def pair_kernel(src, entries, out):
    tab = cuda.shared.array(66, dtype=uint32)
    i = cuda.threadIdx.x
    w = i
    while w < 66:
        tab[w] = src[w]
        w += cuda.blockDim.x
    cuda.syncthreads()
    raw = shared_base32(tab)
    base = uint32(uint32(raw + uint32(7)) & uint32(0xFFFFFFF8))  # (an 8-byte-aligned word of the array)
    if i < entries.shape[0]:
        a, b = lds_u32x2(tab, base + uint32(8 * entries[i]))
        out[i, 0] = a
        out[i, 1] = b
        out[i, 2] = uint32(base - raw) >> uint32(2)


@cuda.jit
def itemsize_kernel(a8, a16, a32, a64, out):
    if cuda.threadIdx.x == 0:
        out[0] = static_itemsize(a8)
        out[1] = static_itemsize(a16)
        out[2] = static_itemsize(a32)
        out[3] = static_itemsize(a64)
        out[4] = 1 if static_itemsize(a8) == 1 else 0  # (a branch on it: folds on a GPU)


@pytest.mark.cuda
def test_static_itemsize_is_the_element_size():
    arrays = [to_device(np.zeros((2, 3), dt)) for dt in (np.uint8, np.uint16, np.float32, np.int64)]
    out = to_device(np.zeros(5, np.int64))
    itemsize_kernel[1, 32](*arrays, out)
    np.testing.assert_array_equal(to_host(out), [1, 2, 4, 8, 1])


@pytest.mark.cuda
def test_ldg_u8_reads_the_byte_at_an_address():
    """Odd and even offsets, the first and the last byte, zero-extended (bytes >= 128 too)."""
    rng = np.random.default_rng(0)
    arr = rng.integers(0, 256, 97).astype(np.uint8)
    offsets = np.array([0, 1, 2, 3, 7, 50, 95, 96, *rng.integers(0, 97, 24)], dtype=np.int64)
    out = to_device(np.zeros(len(offsets), np.uint32))
    byte_kernel[1, 32](to_device(arr), to_device(offsets), out)
    np.testing.assert_array_equal(to_host(out), arr[offsets].astype(np.uint32))


@pytest.mark.cuda
def test_lds_u32x2_reads_two_words_at_an_aligned_shared_address():
    rng = np.random.default_rng(1)
    src = rng.integers(0, 2 ** 32, 66, dtype=np.uint64).astype(np.uint32)
    entries = np.array([0, 1, 2, 31, *rng.integers(0, 32, 12)], dtype=np.int64)
    out = to_device(np.zeros((len(entries), 3), np.uint32))
    pair_kernel[1, 32](to_device(src), to_device(entries), out)
    got = to_host(out)
    w0 = got[:, 2].astype(np.int64)
    np.testing.assert_array_equal(got[:, 0], src[w0 + 2 * entries])
    np.testing.assert_array_equal(got[:, 1], src[w0 + 2 * entries + 1])


def test_simulated_lds_u32x2_refuses_a_misaligned_address():
    tab = np.arange(8, dtype=np.uint32)
    assert tuple(int(x) for x in _sim_lds_u32x2(tab, np.uint32(SIM_SHARED_BASE + 8))) == (2, 3)
    with pytest.raises(IndexError, match="8-byte"):
        _sim_lds_u32x2(tab, np.uint32(SIM_SHARED_BASE + 4))
    with pytest.raises(IndexError, match="not a word"):
        _sim_lds_u32x2(tab, np.uint32(SIM_SHARED_BASE + 32))  # past the array


def _layout(code, d):
    kind, bits = code
    return CodeLayout.head_vq(bits, d) if kind == "vq" else CodeLayout.uniform(head_codebook(bits, d), d, d // 32)


def _rel(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(np.asarray(b, np.float64)))


@pytest.mark.cuda
@pytest.mark.parametrize("kcode, vcode, n_exact, q_len", [
    (("vq", 4), ("vq", 2), 0, 1),   # kv3's codes: pairs for K, quads for V
    (("vq", 2), ("vq", 4), 9, 2),   # the other way round, a window of exact tokens, causal q_len 2
    (("vq", 4), ("s", 3), 0, 2),    # VQ keys, scalar values (kv4:vq=true)
    (("s", 3), ("vq", 2), 5, 1),    # scalar keys, VQ quads for values
], ids=["pairs-quads", "quads-pairs-window", "pairs-scalar", "scalar-quads"])
def test_head_vq_on_tensor_cores_matches_cpu_twin(kcode, vcode, n_exact, q_len, monkeypatch):
    """Random code bytes (every codebook entry reachable) with norms spread over 8 octaves
    (a wrong token's norm shows), 45 tokens in partitions of 32 (a ragged last tile in each),
    GQA 4: the VQ build against the CPU twin."""
    launched = spy_launches(monkeypatch, (kernels, "DECODE_ATTENTION_MMA_VQ"))
    rng = np.random.default_rng(sum(kcode[1:]) * 10 + vcode[1] + n_exact)
    g, d, T, rows = 2, 128, 45, 4 * q_len
    klay, vlay = _layout(kcode, d), _layout(vcode, d)
    kc, vc = (rng.integers(0, 256, (g, T, d * code[1] // 8)).astype(np.uint8) for code in (kcode, vcode))
    ks, vs = (np.exp(rng.uniform(-3.0, 3.0, (g, T, 1))).astype(np.float16).view(np.uint16) for _ in range(2))
    q = (rng.standard_normal((g, rows, d)) * 0.3).astype(np.float32)
    ke = rng.standard_normal((g, max(n_exact, 1), d)).astype(np.float32)[:, :n_exact]
    ve = rng.standard_normal((g, max(n_exact, 1), d)).astype(np.float32)[:, :n_exact]
    pos = (T + np.arange(max(n_exact, 1))).astype(np.int32)
    outs = []
    for f in (to_device, np.ascontiguousarray):
        outs.append(to_host(fused_attention_rows(f(q), f(q), f(kc), f(ks), f(vc), f(vs), T, 0, f(ke), f(ve), n_exact,
                                                 f(pos), klay, vlay, d ** -0.5, None, T + n_exact - q_len, q_len, True,
                                                 part_size=32)))
    dev, cpu = outs
    assert launched, "the tensor-core VQ build did not run"
    assert np.isfinite(dev).all()
    assert _rel(dev, cpu) < VQ_RTOL
    assert not np.array_equal(dev, cpu)  # binary16 operands: not a float32 kernel


@pytest.mark.cuda
@pytest.mark.parametrize("big", [False, True], ids=["norms", "norms-at-binary16-top"])
def test_norm8_cache_on_tensor_cores_matches_cpu(big, monkeypatch):
    """``kv3``'s storage (VQ pairs and quads, 8-bit norms, int8 window) at head_dim 128 on the
    device: its decode steps run the VQ build, which reads the norm bytes through the layer's
    table, and agree with the CPU cache.  With value norms near binary16's largest (64,000:
    their grid point is ``2**16``, past binary16), a weight of 1 times the norm would round to
    infinity in binary16; the build halves the norms in the weights and doubles the output
    back, so the output stays finite and right."""
    launched = spy_launches(monkeypatch, (kernels, "DECODE_ATTENTION_MMA_VQ"))
    rng = np.random.default_rng(5 + big)
    # (without the unbiased rescale for the large norms: it scales a norm up by a few per cent)
    d, name = 128, "pqo-k4v2-head-vq-n8" if big else "pqo-k4v2-head-eden-vq-n8"
    geo = dict(num_layers=1, num_kv_heads=2, head_dim=d, residual_length=2, sink_tokens=1)
    cpu, dev = make_cache(name, **geo), make_cache(name, **geo)
    cfg = AttendConfig(d ** -0.5, 4)

    def values(n):
        v = rng.standard_normal((1, 2, n, d)).astype(np.float32)
        if big:  # every value norm in [64,800, 65,400]: each decodes to 2**16 (from 2**(255.5/16) on)
            v *= (rng.uniform(64800.0, 65400.0, (1, 2, n, 1)) / np.linalg.norm(v, axis=-1, keepdims=True))
        return v.astype(np.float32)

    k = rng.standard_normal((1, 2, 40, d)).astype(np.float32)
    v = values(40)
    cpu.prefill(0, k, v)
    dev.prefill(0, to_device(k), to_device(v))
    with knobs(cuda_warp_attention=1, cuda_mma_attention=1):
        for _ in range(2):
            k1, v1 = rng.standard_normal((1, 2, 1, d)).astype(np.float32), values(1)
            q = rng.standard_normal((1, 8, 1, d)).astype(np.float32)
            a = cpu.decode(0, k1, v1, q, cfg).out
            b = to_host(dev.decode(0, to_device(k1), to_device(v1), to_device(q), cfg).out)
            assert np.isfinite(b).all()
            # (equal norms: the output is a near-cancelling sum of the values, whose binary16
            # weights' rounding shows larger next to its norm: 1.3e-3 measured; a norm not
            # doubled back gives 0.5)
            assert _rel(b, a) < (2 * VQ_RTOL if big else VQ_RTOL)
    sd = dev._layers[0]
    codes = to_host(sd.buffers["v_scales"])[:, :sd.live_count("v_scales")]
    assert codes.dtype == np.uint8 and codes.size > 0
    if big:  # the premise, by the grid's formula (ops/norm8.py): every stored value norm decodes to 2**16
        base16 = int(sd.meta["norm8_base"]) - BASE_OFFSET
        np.testing.assert_array_equal(2.0 ** ((base16 + codes.astype(np.float64)) / 16), 65536.0)
    step = sd.scratch["fused_step"].step
    assert step.plan.variant == "mma" and step._kernel.name == "decode_attention_mma_vq"
    assert len(launched) == 2  # one a step


#: the VQ build's simulator run (``tests/cuda/test_sim.py`` checks every registered twin has one)
RUNNERS = {"decode_attention_mma_vq": test_head_vq_on_tensor_cores_matches_cpu_twin}


def test_vq_layout_rules():
    """The tensor-core kernels take the head VQ code's pairs (4 bits) and quads (2 bits) with
    every ``|centroid| <= 1`` (their tables carry no scaling factor), at head_dim 128; a
    codebook past 1, or a group that does not match the width, is refused (the warp kernel's
    VQ build runs)."""
    from numba_kv.ops.attention import mma_layout_ok, use_mma_kernel

    pairs, quads = CodeLayout.head_vq(4, 128), CodeLayout.head_vq(2, 128)
    assert mma_layout_ok(pairs) and mma_layout_ok(quads)
    assert use_mma_kernel("cuda", 128, False, False, pairs, quads)
    assert use_mma_kernel("cuda", 64, False, False, CodeLayout.head_vq(4, 64), CodeLayout.head_vq(2, 64))
    big = CodeLayout(pairs.bits, pairs.offsets, pairs.centroids * 4.0, pairs.scale_group, pairs.group)
    assert float(np.abs(big.centroids).max()) > 1.0 and not mma_layout_ok(big)
    odd = CodeLayout(quads.bits, quads.offsets, quads.centroids, quads.scale_group, 2)  # quads' table, group 2
    assert not mma_layout_ok(odd)


@pytest.mark.cuda
def test_kv3_steady_step_on_tensor_cores_stays_within_its_budget():
    """``kv3`` at head_dim 128 (its attention on the tensor-core VQ build): a steady decode
    step, each flushing a token out of the window, keeps ``kv3``'s budget of launches,
    allocations and transfers (``test_sim_step_budget.BUDGET``, counted in the simulator),
    its outputs stay within binary16 rounding of the CPU twin's and its stored bytes equal
    the twin's."""
    from numba_kv._backend import simulator_enabled

    from .test_sim_step_budget import BUDGET, STEPS, WARMUP, count_device_work, steady_layer

    if not simulator_enabled():
        pytest.skip("counts the simulator's launches, allocations and transfers")
    rng = np.random.default_rng(31)
    h, g, d = 2, 2, 128
    cache, twin, attend = steady_layer("kv3", rng, h, g, d)
    dout = to_device(np.zeros((1, h * g, 1, d), np.float32))
    worst: dict = {}
    for i in range(WARMUP + STEPS):
        host = tuple(rng.standard_normal(s).astype(np.float32) for s in ((1, h, 1, d), (1, h, 1, d), (1, h * g, 1, d)))
        dev = tuple(to_device(a) for a in host)
        with count_device_work() as counts:
            out = cache.decode(0, *dev, attend, out=dout).out
        if i >= WARMUP:
            worst = {key: max(worst.get(key, 0), counts.get(key, 0)) for key in BUDGET["kv3"]}
            assert counts["launch _decode_attention_mma_vq_cuda"] == 1, dict(counts)  # the VQ build's one launch
        want = twin.decode(0, *host, attend).out
        assert np.isfinite(to_host(out)).all() and _rel(to_host(out), want) < VQ_RTOL
    assert all(worst[key] <= BUDGET["kv3"][key] for key in worst), worst
    st, tw = cache._layers[0], twin._layers[0]
    for key, buf in st.buffers.items():
        np.testing.assert_array_equal(to_host(buf), tw.buffers[key], err_msg=key)
