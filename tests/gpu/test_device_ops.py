"""Every public op with CUDA arrays (CuPy and Numba device arrays): outputs stay on the
device and equal the CPU twin (codes and binary16 bits exactly, floats within round-off).

Shapes are tiny: the ``numba`` kind also runs under the CUDA simulator (``make test-sim``).
"""

from __future__ import annotations

import numpy as np

from numba_kv import reference
from numba_kv.ops import intquant, lowrank, vq
from numba_kv.ops.attention import decode_attention
from numba_kv.ops.blockquant import dequantize_blocks, quantize_blocks
from numba_kv.ops.hadamard import rotate32
from numba_kv.ops.headquant import dequantize_head, quantize_head, rotate_head
from numba_kv.ops.headvq import dequantize_headvq, quantize_headvq
from numba_kv.ops.qjl import make_sketch, qjl_inner_product, qjl_quantize

F32 = dict(rtol=2e-5, atol=2e-6)


def test_quantize_and_dequantize_blocks(dev):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 64)).astype(np.float32)
    x[0, 0, 5] = 30.0
    for bits, mode in ((2, "maxnorm"), (3, "l2"), (4, "maxnorm")):
        c, s = quantize_blocks(x, bits, mode)
        cd, sd = quantize_blocks(dev.put(x), bits, mode)
        assert np.array_equal(dev.get(cd), c) and np.array_equal(dev.get(sd), s), (bits, mode)
        ref = dequantize_blocks(c, s, bits, mode)
        np.testing.assert_allclose(dev.get(dequantize_blocks(dev.put(c), dev.put(s), bits, mode)), ref, **F32)


def test_quantize_dequantize_and_rotate_head(dev):
    rng = np.random.default_rng(1)
    for d in (32, 128):
        x = rng.standard_normal((3, d)).astype(np.float32)
        for unbiased in (False, True):
            c, n = quantize_head(x, 3, unbiased)
            cd, nd = quantize_head(dev.put(x), 3, unbiased)
            assert np.array_equal(dev.get(cd), c) and np.array_equal(dev.get(nd), n), (d, unbiased)
        ref = dequantize_head(c, n, 3)
        np.testing.assert_allclose(dev.get(dequantize_head(dev.put(c), dev.put(n), 3)), ref, **F32)
        for inverse in (False, True):
            np.testing.assert_allclose(dev.get(rotate_head(dev.put(x), inverse)), rotate_head(x, inverse), **F32)


def test_quantize_and_dequantize_headvq(dev):
    rng = np.random.default_rng(12)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    x[0, 3] = 25.0
    for bits in (4, 2):
        c, n = quantize_headvq(x, bits, True)
        cd, nd = quantize_headvq(dev.put(x), bits, True)
        assert np.array_equal(dev.get(cd), c) and np.array_equal(dev.get(nd), n), bits
        ref = dequantize_headvq(c, n, bits)
        np.testing.assert_allclose(dev.get(dequantize_headvq(dev.put(c), dev.put(n), bits)), ref, **F32)


def test_rotate32(dev):
    x = np.random.default_rng(2).standard_normal((2, 3, 64)).astype(np.float32)
    for inverse in (False, True):
        np.testing.assert_allclose(dev.get(rotate32(dev.put(x), inverse)), rotate32(x, inverse), **F32)


def test_decode_attention(dev):
    rng = np.random.default_rng(3)
    b, hkv, T, d = 1, 2, 11, 64
    k = rng.standard_normal((b, hkv, T, d)).astype(np.float32)
    v = rng.standard_normal((b, hkv, T, d)).astype(np.float32)
    kc, ks = quantize_blocks(k, 3)
    vc, vs = quantize_blocks(v, 3)
    q = rng.standard_normal((b, 4, 1, d)).astype(np.float32)
    cpu = decode_attention(q, kc, ks, vc, vs, bits=3, partition_size=8)
    out = decode_attention(*(dev.put(a) for a in (q, kc, ks, vc, vs)), bits=3, partition_size=8)
    np.testing.assert_allclose(dev.get(out), cpu, **F32)
    kh, vh = dequantize_blocks(kc, ks, 3), dequantize_blocks(vc, vs, 3)
    np.testing.assert_allclose(cpu, reference.attention(q, kh, vh, d ** -0.5, causal_offset=T - 1),
                               rtol=2e-5, atol=2e-5)


def test_paged_decode_attention(dev):
    from numba_kv.caches.paged import PagedKVCache

    rng = np.random.default_rng(4)
    k = rng.standard_normal((2, 7, 32)).astype(np.float32)
    v = rng.standard_normal((2, 7, 32)).astype(np.float32)
    q = rng.standard_normal((1, 4, 1, 32)).astype(np.float32)
    outs = []
    for on_dev in (False, True):
        put = dev.put if on_dev else (lambda a: a)
        cache = PagedKVCache(num_pages=4, num_layers=1, num_kv_heads=2, head_dim=32, page_size=4, storage="pqo3")
        s = cache.allocate_sequence()
        cache.append(0, s, put(k), put(v))
        # the cache's glue hands pools + page table to ops.attention.paged_decode_attention
        outs.append(cache.decode_attention(0, put(q), [s], partition_size=4))
    np.testing.assert_allclose(dev.get(outs[1]), outs[0], **F32)


def test_qjl(dev):
    rng = np.random.default_rng(5)
    S = make_sketch(32, 16, seed=5)
    r = rng.standard_normal((3, 32)).astype(np.float32)
    y = rng.standard_normal((2, 32)).astype(np.float32)
    hs, hn = qjl_quantize(r, S)
    gs, gn = qjl_quantize(dev.put(r), dev.put(S))
    assert np.array_equal(dev.get(gs), hs) and np.array_equal(dev.get(gn), hn)
    ref = qjl_inner_product(y, hs, hn, S)
    got = qjl_inner_product(dev.put(y), dev.put(hs), dev.put(hn), dev.put(S))
    np.testing.assert_allclose(dev.get(got), ref, rtol=1e-4, atol=1e-5)


def test_intquant(dev):
    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 11, 3)).astype(np.float32)
    x[0, 4, 1] = 25.0  # an outlier
    for bits in (4, 8):
        q = intquant.quantize_int(x, bits, 4)
        qd = intquant.quantize_int(dev.put(x), bits, 4)
        for name in ("packed", "scales", "outlier_idx", "outlier_vals"):
            assert np.array_equal(dev.get(getattr(qd, name)), getattr(q, name)), (bits, name)
        np.testing.assert_allclose(dev.get(intquant.dequantize_int(qd)), intquant.dequantize_int(q), **F32)


def test_vq(dev):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 7, 8)).astype(np.float32)
    cb = rng.standard_normal((1, 6, 8)).astype(np.float32)
    c, dist = vq.assign(x, cb)
    cd, dd = vq.assign(dev.put(x), dev.put(cb))
    assert np.array_equal(dev.get(cd), c)
    np.testing.assert_allclose(dev.get(dd), dist, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dev.get(vq.decode(dev.put(c), dev.put(cb))), vq.decode(c, cb), **F32)


def test_lowrank(dev):
    rng = np.random.default_rng(8)
    x = (rng.standard_normal((2, 9, 8)) + 3).astype(np.float32)
    m, g = lowrank.channel_stats(x)
    md, gd = lowrank.channel_stats(dev.put(x))
    np.testing.assert_allclose(dev.get(md), m, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dev.get(gd), g, rtol=1e-4, atol=1e-4)
    mean = rng.standard_normal((2, 8)).astype(np.float32)
    comp = rng.standard_normal((2, 4, 8)).astype(np.float32)
    coef = lowrank.project(x, mean, comp)
    coef_d = lowrank.project(dev.put(x), dev.put(mean), dev.put(comp))
    np.testing.assert_allclose(dev.get(coef_d), coef, rtol=1e-5, atol=1e-5)
    rec = lowrank.reconstruct(coef, mean, comp, rows=2)
    np.testing.assert_allclose(dev.get(lowrank.reconstruct(coef_d, dev.put(mean), dev.put(comp), rows=2)), rec,
                               rtol=1e-5, atol=1e-5)


def test_compressor(dev):
    from numba_kv.compressor import KVCacheCompressor, LowRank, VectorQuantization

    rng = np.random.default_rng(9)
    k = rng.standard_normal((2, 10, 16)).astype(np.float32)
    v = rng.standard_normal((2, 10, 16)).astype(np.float32)
    for method, bits in ((LowRank(4), 8), (VectorQuantization(4, max_iter=2), 4)):
        comp = KVCacheCompressor(method, bits)
        c_cpu = comp.compress_kv_3d(k, v)
        c_dev = comp.compress_kv_3d(dev.put(k), dev.put(v))
        for a in c_dev.k.arrays.values():
            dev.check(a)  # the payload stays on the device
        kh, vh = comp.decompress_kv_3d(c_cpu)
        kd, vd = (dev.get(a) for a in comp.decompress_kv_3d(c_dev))
        assert kd.shape == kh.shape and vd.shape == vh.shape
        if isinstance(method, LowRank):  # deterministic: the same fit up to round-off
            np.testing.assert_allclose(kd, kh, rtol=1e-3, atol=1e-3)
            np.testing.assert_allclose(vd, vh, rtol=1e-3, atol=1e-3)
        else:  # k-means++ draws may differ with the last bits of the distances
            for x, got in ((k, kd), (v, vd)):
                assert float(np.mean((x - got) ** 2)) < float(np.mean(x ** 2))
