"""CUDA kernels vs their CPU twins, on small shapes.

Runs under ``NUMBA_ENABLE_CUDASIM=1`` (``make test-sim``) or on a GPU.  Every twin in the
registry must have a runner here (``test_every_twin_has_a_runner`` runs in the normal
suite, so a new kernel without a simulator test fails CI).
"""

import numpy as np
import pytest

from numba_kv import _config
from numba_kv._backend import to_host
from numba_kv.ops import TWINS
from numba_kv.ops.bitpack import pack_bits, unpack_bits
from numba_kv.ops.blockquant import (
    count_args,
    dequantize_blocks,
    quantize_blocks,
    quantize_into,
    quantize_pair_into,
)
from numba_kv.ops.codebook import get_codebook
from numba_kv.ops.hadamard import rotate32
from numba_kv.ops.memory import copy_prefix, copy_tokens

from ..conftest import runner_params, to_device


def _pack(rng):
    for bits in (1, 2, 3, 4, 8):
        idx = rng.integers(0, 1 << bits, size=(5, 24), dtype=np.uint16).astype(np.uint8)
        dev = pack_bits(to_device(idx), bits)
        assert np.array_equal(to_host(dev), pack_bits(idx, bits))


def _unpack(rng):
    for bits in (2, 3, 4):
        packed = rng.integers(0, 256, size=(3, 3 * bits), dtype=np.uint16).astype(np.uint8)
        assert np.array_equal(to_host(unpack_bits(to_device(packed), bits)), unpack_bits(packed, bits))


def _rotate(rng):
    x = rng.standard_normal((3, 64)).astype(np.float32)
    for inverse in (False, True):
        np.testing.assert_allclose(to_host(rotate32(to_device(x), inverse)), rotate32(x, inverse), atol=1e-6)


def _quantize(rng):
    x = rng.standard_normal((2, 3, 64)).astype(np.float32) * 2
    x[0, 0, 5] = 40.0  # outlier channel
    x[1, 2, 32:] = 0.0  # all-zero block: the unbiased rescale keeps the plain scale
    for bits in (2, 3, 4):
        for mode in ("maxnorm", "l2"):
            for unbiased in (False, True):
                c, s = quantize_blocks(x, bits, mode, unbiased=unbiased)
                cd, sd = quantize_blocks(to_device(x), bits, mode, unbiased=unbiased)
                assert np.array_equal(to_host(sd), s)
                assert np.array_equal(to_host(cd), c)  # simulator arithmetic is float32 like the twin


def _dequantize(rng):
    x = rng.standard_normal((4, 64)).astype(np.float32)
    for bits in (2, 3, 4):
        c, s = quantize_blocks(x, bits)
        ref = dequantize_blocks(c, s, bits)
        out = to_host(dequantize_blocks(to_device(c), to_device(s), bits))
        np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-7)


def _copy(rng):
    for dt in (np.uint8, np.uint16, np.float32):
        src = (rng.standard_normal((2, 5, 3)) * 100).astype(dt)
        dst = np.zeros((2, 9, 3), dt)
        ddst = to_device(dst)
        copy_prefix(to_device(src), 4, ddst)
        copy_prefix(src, 4, dst)
        assert np.array_equal(to_host(ddst), dst)
        copy_tokens(to_device(src), 1, 3, ddst, 5)
        copy_tokens(src, 1, 3, dst, 5)
        assert np.array_equal(to_host(ddst), dst)


def _attention(rng):
    from numba_kv import reference
    from numba_kv.ops.attention import decode_attention

    b, hkv, T, d = 1, 2, 37, 64
    k = rng.standard_normal((b, hkv, T, d)).astype(np.float32)
    v = rng.standard_normal((b, hkv, T, d)).astype(np.float32)
    kc, ks = quantize_blocks(k, 3)
    vc, vs = quantize_blocks(v, 2)
    kx = rng.standard_normal((b, hkv, 3, d)).astype(np.float32)
    vx = rng.standard_normal((b, hkv, 3, d)).astype(np.float32)
    q = rng.standard_normal((b, 4, 2, d)).astype(np.float32)
    bias = rng.standard_normal((b, 4, 2, T + 3)).astype(np.float32)
    kw = dict(k_bits=3, v_bits=2, partition_size=16)
    cpu = decode_attention(q, kc, ks, vc, vs, logit_bias=bias, k_exact=kx, v_exact=vx, **kw)
    dev = decode_attention(*(to_device(a) for a in (q, kc, ks, vc, vs)), logit_bias=to_device(bias),
                           k_exact=to_device(kx), v_exact=to_device(vx), **kw)
    np.testing.assert_allclose(to_host(dev), cpu, rtol=2e-5, atol=2e-6)
    kh, vh = dequantize_blocks(kc, ks, 3), dequantize_blocks(vc, vs, 2)
    ref = reference.attention(q, np.concatenate([kh, kx], 2), np.concatenate([vh, vx], 2), d ** -0.5, bias,
                              causal_offset=T + 1)
    np.testing.assert_allclose(to_host(dev), ref, rtol=2e-5, atol=2e-5)


def _finite(rng):
    from numba_kv.ops.finite import all_finite

    for dt in (np.float32, np.float64):
        x = rng.standard_normal((3, 5, 64)).astype(dt)
        assert all_finite(to_device(x)) and all_finite(x)
        for bad in (np.nan, np.inf, -np.inf):
            y = x.copy()
            y[2, 4, 63] = bad
            assert not all_finite(to_device(y)) and not all_finite(y)


def _absmax8(rng):
    """The int8 window codec on the device: codes and scales bit-identical to the CPU twin,
    decoding as well (ties, a zero vector and subnormal scales included: one raised a step
    above round-to-nearest, one from 0 to the smallest)."""
    from numba_kv.ops.absmax8 import absmax8_dequantize_into, absmax8_quantize_into

    x = rng.standard_normal((2, 3, 32)).astype(np.float32)
    x[0, 0] = 0.0
    x[0, 1] *= np.float32(3e-6)
    x[1, 0] = (np.arange(32, dtype=np.float32) - 16) * np.float32(0.125)
    x[1, 0, 0] = 31.75
    x[1, 1] *= np.float32(1.1e-5) / np.abs(x[1, 1]).max()  # 1.1e-5/127 rounds to 2**-24: one step up
    x[1, 2] *= np.float32(1e-9)  # rounds to 0: the smallest subnormal
    outs = []
    for f in (to_device, lambda a: a):
        codes, scales = f(np.zeros((2, 5, 32), np.int8)), f(np.zeros((2, 5, 1), np.uint16))
        absmax8_quantize_into(f(x), codes, scales, 1)
        back = f(np.zeros((2, 4, 32), np.float32))
        absmax8_dequantize_into(codes, scales, 1, 3, back, 1)
        outs.append([to_host(a) for a in (codes, scales, back)])
    for dev, cpu in zip(*outs):
        np.testing.assert_array_equal(dev, cpu)


def _quantize_pair(rng):
    """Keys and values in one launch: the bytes of two single-side quantizations (CPU and
    device), each side at its own width, for both norm modes and both flags."""
    rows, n, d, t0, cap = 2, 3, 64, 2, 6
    xk = rng.standard_normal((rows, n, d)).astype(np.float32) * 4
    xv = rng.standard_normal((rows, n, d)).astype(np.float32)
    for mode, kb, vb, outlier, unbiased in (("maxnorm", 3, 2, True, False), ("l2", 4, 3, False, True)):
        kcb, vcb = get_codebook(kb, mode), get_codebook(vb, mode)
        want = [np.zeros((rows, cap, d * b // 8), np.uint8) for b in (kb, vb)]
        want_s = [np.zeros((rows, cap, d // 32), np.uint16) for _ in range(2)]
        quantize_into(xk, want[0], want_s[0], t0, kcb, outlier, unbiased)
        quantize_into(xv, want[1], want_s[1], t0, vcb, outlier, unbiased)
        for dev in (lambda a: a, to_device):
            bufs = [dev(np.zeros_like(a)) for a in (want[0], want_s[0], want[1], want_s[1])]
            quantize_pair_into(dev(xk), dev(xv), *bufs, t0, kcb, vcb, outlier, unbiased)
            for g, w in zip(bufs, (want[0], want_s[0], want[1], want_s[1])):
                assert np.array_equal(to_host(g), w), (mode, kb, vb)
            # with a paged append's bookkeeping folded in: two range records (the third slot
            # unused, mask 0) and a length update; the same bytes
            accs = [dev(np.array([v], np.uint64)) for v in (5, 1 << 40, 7)]
            lens = dev(np.array([3, 4, 5], np.int32))
            masks = (np.uint32(0x7FFFFFFF), np.uint32(0x7FFFFFFF), np.uint32(0))
            bits = [dev(a.reshape(-1).view(np.uint32)) for a in (xk, xv, xk)]
            ranges = tuple(x for u, m, o in zip(bits, masks, accs) for x in (u, m, o))
            bufs = [dev(np.zeros_like(a)) for a in (want[0], want_s[0], want[1], want_s[1])]
            quantize_pair_into(dev(xk), dev(xv), *bufs, t0, kcb, vcb, outlier, unbiased, ranges=ranges,
                               add_at=(lens, 1, 2))
            for g, w in zip(bufs, (want[0], want_s[0], want[1], want_s[1])):
                assert np.array_equal(to_host(g), w), (mode, kb, vb)
            assert [int(to_host(o)[0]) for o in accs] == [int(np.abs(xk).max().view(np.uint32)), 1 << 40, 7]
            assert to_host(lens).tolist() == [3, 6, 5]
            # the offset read from a device count (slot 2, t0 there; 0 by value) and the new
            # count written to slot 0 (a layer's step state): the same bytes
            bufs = [dev(np.zeros_like(a)) for a in (want[0], want_s[0], want[1], want_s[1])]
            lens = dev(np.array([9, 4, t0], np.int32))
            quantize_pair_into(dev(xk), dev(xv), *bufs, 0, kcb, vcb, outlier, unbiased, add_at=(lens, 0, n, 2))
            for g, w in zip(bufs, (want[0], want_s[0], want[1], want_s[1])):
                assert np.array_equal(to_host(g), w), (mode, kb, vb)
            assert to_host(lens).tolist() == [t0 + n, 4, t0]
            # the offset read from, and advanced in, one slot (a paged append's last-page
            # length): one block of 8 threads striding over the 24 blocks, the same bytes
            bufs = [dev(np.zeros_like(a)) for a in (want[0], want_s[0], want[1], want_s[1])]
            lens = dev(np.array([9, t0], np.int32))
            with _config.knobs(cuda_threads_sim=8):
                quantize_pair_into(dev(xk), dev(xv), *bufs, 0, kcb, vcb, outlier, unbiased, add_at=(lens, 1, n, 1))
            for g, w in zip(bufs, (want[0], want_s[0], want[1], want_s[1])):
                assert np.array_equal(to_host(g), w), (mode, kb, vb)
            assert to_host(lens).tolist() == [9, t0 + n]
    with pytest.raises(ValueError, match="the slot read must differ"):  # a kernel of several blocks
        count_args(xk, (np.zeros(2, np.int32), 1, 1, 1))
    with pytest.raises(ValueError, match="vcb: expected the keys' norm mode 'maxnorm'"):
        quantize_pair_into(xk, xv, *want, *want_s, 0, get_codebook(3, "maxnorm"), get_codebook(3, "l2"), True)


RUNNERS = {
    "absmax8_quantize": _absmax8,
    "absmax8_dequantize": _absmax8,
    "count_nonfinite": _finite,
    "decode_attention": _attention,
    "merge_partitions": _attention,
    "pack_bits": _pack,
    "unpack_bits": _unpack,
    "rotate32": _rotate,
    "quantize_blocks": _quantize,
    "quantize_blocks_pair": _quantize_pair,
    "dequantize_blocks": _dequantize,
    "copy_tokens": _copy,
}


def test_every_twin_has_a_runner():
    """Each registered twin has a runner in some ``tests/cuda/test_sim*.py`` RUNNERS dict."""
    import importlib
    import pathlib

    covered = set()
    for path in pathlib.Path(__file__).parent.glob("test_sim*.py"):
        mod = importlib.import_module(f"{__package__}.{path.stem}")
        covered |= set(getattr(mod, "RUNNERS", {}))
    missing = set(TWINS) - covered
    assert not missing, f"registered twins without a simulator/GPU test: {sorted(missing)}"


@pytest.mark.cuda
@pytest.mark.parametrize("runner", runner_params(RUNNERS))
def test_cuda_kernel_matches_cpu_twin(runner):
    runner(np.random.default_rng(3))


@pytest.mark.cuda
@pytest.mark.parametrize("opts", [{"bits": 3}, {"k_bits": 4, "v_bits": 2},
                                  {"k_bits": 4, "v_bits": 3, "rotation": "head", "unbiased": True},
                                  {"k_bits": 5, "v_bits": 4, "rotation": "head", "unbiased": True},
                                  {"k_bits": 4, "v_bits": 5, "rotation": "head"},
                                  {"k_bits": 4, "v_bits": 3, "rotation": "head", "vq": True, "norm_bits": 8,
                                   "unbiased": True},
                                  {"k_bits": 3, "v_bits": 2, "rotation": "head", "vq": True}],
                         ids=["pqo3", "pqo-k4v2", "pqo-k4v3-head-eden", "pqo-k5v4-head-eden", "pqo-k4v5-head",
                              "pqo-k4v3-head-vq-norm8", "pqo-k3v2-head-vq"])
@pytest.mark.usefixtures("float32_attention")  # (float32 round-off: the tensor-core builds off)
def test_windowed_fused_cache_on_device_matches_cpu(opts):
    """Decode steps that flush the window on the device (both sides' evicted tokens quantized
    in one launch, each side at its width and code: the VQ code on one side and the scalar
    code on the other in the last two cases, with 8-bit norms in the first) agree with the
    CPU cache: the outputs, and the stored bytes bit for bit."""
    from numba_kv import AttendConfig, PolarQuantCache

    rng = np.random.default_rng(1)
    caches = [PolarQuantCache(1, 2, 64, residual_length=4, sink_tokens=2, window_dtype="float32", **opts)
              for _ in range(2)]  # Numba device arrays keep float32 windows
    cfg = AttendConfig(0.125, 2)
    for n, decode in ((6, False), (1, True), (2, True), (1, True), (1, True)):
        k = rng.standard_normal((1, 2, n, 64)).astype(np.float32)
        v = rng.standard_normal((1, 2, n, 64)).astype(np.float32)
        q = rng.standard_normal((1, 4, n, 64)).astype(np.float32)
        if not decode:
            caches[0].prefill(0, k, v)
            caches[1].prefill(0, to_device(k), to_device(v))
            continue
        a = caches[0].decode(0, k, v, q, cfg).out
        bdev = caches[1].decode(0, to_device(k), to_device(v), to_device(q), cfg).out
        np.testing.assert_allclose(to_host(bdev), a, rtol=1e-4, atol=1e-5)
    ka, kb = caches[0].seq_len(0), caches[1].seq_len(0)
    assert ka == kb == 11 and caches[0].memory_usage() == caches[1].memory_usage()
    cpu, dev = caches[0]._layers[0], caches[1]._layers[0]
    assert cpu.buffers.keys() == dev.buffers.keys() and cpu.meta == dev.meta
    for key, buf in dev.buffers.items():
        np.testing.assert_array_equal(to_host(buf), cpu.buffers[key], err_msg=key)


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["pqo3", "pq3", "pqo4-l2", "dense"])
def test_cache_on_device_matches_cpu(name):
    """A cache fed device arrays stores on the device and agrees with the CPU cache."""
    from numba_kv import AttendConfig, make_cache

    rng = np.random.default_rng(0)
    k = rng.standard_normal((2, 2, 5, 64)).astype(np.float32)
    v = rng.standard_normal((2, 2, 5, 64)).astype(np.float32)
    k1, v1 = k[:, :, :1] * 0.5, v[:, :, :1] * 0.5
    q = rng.standard_normal((2, 4, 1, 64)).astype(np.float32)
    cfg = AttendConfig(0.125, 2)
    opts = {} if name == "dense" else {"decode_output": "dequantized", "window_dtype": "float32"}
    cpu = make_cache(name, num_layers=1, num_kv_heads=2, head_dim=64, **opts)
    dev = make_cache(name, num_layers=1, num_kv_heads=2, head_dim=64, **opts)
    cpu.prefill(0, k, v)
    dev.prefill(0, to_device(k), to_device(v))
    rc = cpu.decode(0, k1, v1, q, cfg).result
    rd = dev.decode(0, to_device(np.ascontiguousarray(k1)), to_device(np.ascontiguousarray(v1)), to_device(q),
                    cfg).result
    np.testing.assert_allclose(to_host(rd.k), rc.k, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(to_host(rd.v), rc.v, rtol=1e-6, atol=1e-6)
    assert dev.memory_usage() == cpu.memory_usage()
    with pytest.raises(ValueError, match="on cuda"):
        dev.prefill(0, k, v)  # mixing devices is an error, never a silent copy
