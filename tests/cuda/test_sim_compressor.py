"""Compressor, paged-cache and MLA kernels vs their CPU twins, on small shapes.

Runs under ``NUMBA_ENABLE_CUDASIM=1`` (``make test-sim``) or on a GPU.  ``RUNNERS`` covers
every twin registered by ``numba_kv.ops.{gather, lowrank, vq, intquant}`` (checked by
``test_sim.py::test_every_twin_has_a_runner``).  Integer outputs computed from identical
inputs must match bit for bit; float outputs within a stated tolerance (a GPU contracts
``a*b + c`` into FMA).
"""

import numpy as np
import pytest

from numba_kv import _backend
from numba_kv._backend import to_host
from numba_kv.ops import intquant, lowrank, vq
from numba_kv.ops.gather import gather_rows, scatter_rows

from ..conftest import runner_params, to_device


def _grid(n):
    return _backend.cuda_grid(n)


# --- gather / scatter ---------------------------------------------------------------------------
def _gather(rng):
    for dt in (np.uint8, np.uint16, np.float32):
        src = (rng.standard_normal((9, 5)) * 100).astype(dt)
        idx = rng.integers(0, 9, size=6).astype(np.int32)
        out = to_device(np.zeros((6, 5), dt))
        gather_rows(to_device(src), to_device(idx), out)
        assert np.array_equal(to_host(out), src[idx])


def _scatter(rng):
    for dt in (np.uint8, np.uint16, np.float32):
        src = (rng.standard_normal((6, 5)) * 100).astype(dt)
        idx = rng.permutation(9)[:6].astype(np.int32)
        host = np.zeros((9, 5), dt)
        scatter_rows(src, idx, host)
        dev = to_device(np.zeros((9, 5), dt))
        scatter_rows(to_device(src), to_device(idx), dev)
        assert np.array_equal(to_host(dev), host)


def _move(rng):
    _gather(rng)
    _scatter(rng)


# --- low rank -------------------------------------------------------------------------------------
def _stats(rng):
    x = (rng.standard_normal((2, 9, 6)) + 3).astype(np.float32)
    m, g = lowrank.channel_stats(x)
    md, gd = lowrank.channel_stats(to_device(x))
    np.testing.assert_allclose(to_host(md), m, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(to_host(gd), g, rtol=1e-5, atol=1e-5)


def _project(rng):
    x = rng.standard_normal((3, 7, 8)).astype(np.float32)
    for rm, rb in ((3, 3), (1, 1), (3, 1)):
        mean = rng.standard_normal((rm, 8)).astype(np.float32)
        comp = rng.standard_normal((rb, 4, 8)).astype(np.float32)
        ref = lowrank.project(x, mean, comp)
        out = lowrank.project(to_device(x), to_device(mean), to_device(comp))
        np.testing.assert_allclose(to_host(out), ref, rtol=1e-5, atol=1e-5)


def _reconstruct(rng):
    for rc, rb in ((3, 3), (1, 3), (3, 1)):
        coef = rng.standard_normal((rc, 5, 4)).astype(np.float32)
        mean = rng.standard_normal((1, 8)).astype(np.float32)
        comp = rng.standard_normal((rb, 4, 8)).astype(np.float32)
        ref = lowrank.reconstruct(coef, mean, comp, rows=3)
        out = lowrank.reconstruct(to_device(coef), to_device(mean), to_device(comp), rows=3)
        np.testing.assert_allclose(to_host(out), ref, rtol=1e-5, atol=1e-5)


def _f16_encode(rng):
    """Plain, and over a power of two per row (rows of 1e-12 and 1e9 data kept in range)."""
    x = np.concatenate([rng.standard_normal(40) * 10.0 ** rng.uniform(-7, 4, 40), [7e4, -1e6, 0.0]])
    x = x.astype(np.float32)
    assert np.array_equal(to_host(lowrank.f16_encode(to_device(x))), lowrank.f16_encode(x))
    rows = (rng.standard_normal((3, 7)) * np.array([[1e-12], [1.0], [1e9]])).astype(np.float32)
    scale = lowrank.pow2_row_scales(np.abs(rows).max(axis=1))
    want = lowrank.f16_encode(rows, scale)
    assert np.array_equal(to_host(lowrank.f16_encode(to_device(rows), scale)), want)
    back = lowrank.f16_decode(want, scale)
    assert np.all(np.abs(back - rows) <= 2.0 ** -11 * np.abs(rows))  # normal binary16 rounding in every row


def _f16_decode(rng):
    h = rng.integers(0, 0x7BFF, size=50).astype(np.uint16)
    h[::2] |= 0x8000
    assert np.array_equal(to_host(lowrank.f16_decode(to_device(h))), lowrank.f16_decode(h))
    scale = np.float32([2.0 ** -40, 1.0, 2.0 ** 30, 0.5, 4.0])
    h5 = h.reshape(5, 10)
    for s in (scale, to_device(scale)):  # the scales on the host or on the device
        got = to_host(lowrank.f16_decode(to_device(h5), s))
        assert np.array_equal(got, lowrank.f16_decode(h5) * scale[:, None])


# --- vector quantization -------------------------------------------------------------------------------
def _vq_inputs(rng):
    x = rng.standard_normal((2, 7, 8)).astype(np.float32)
    per_row = rng.standard_normal((4, 5, 4)).astype(np.float32)  # R·M = 2·2 codebooks of 5
    shared = rng.standard_normal((1, 6, 8)).astype(np.float32)
    return x, per_row, shared


def _assign(rng):
    x, per_row, shared = _vq_inputs(rng)
    for cb in (per_row, shared):
        c, d = vq.assign(x, cb)
        cd, dd = vq.assign(to_device(x), to_device(cb))
        assert np.array_equal(to_host(cd), c)
        np.testing.assert_allclose(to_host(dd), d, rtol=1e-5, atol=1e-6)


def _accumulate(rng):
    x, per_row, shared = _vq_inputs(rng)
    for cb in (per_row, shared):
        codes, _ = vq.assign(x, cb)
        ng, k, ds = cb.shape
        sums, counts = np.zeros((ng, k, ds), np.float64), np.zeros((ng, k), np.int32)
        vq.accumulate_into(x, codes, sums, counts)
        dsums, dcounts = to_device(np.zeros_like(sums)), to_device(np.zeros_like(counts))
        vq.accumulate_into(to_device(x), to_device(codes), dsums, dcounts)
        assert np.array_equal(to_host(dcounts), counts)
        assert np.array_equal(to_host(dsums), sums)  # one writer per output, token order: deterministic


def _kmeanspp(rng):
    x, per_row, _ = _vq_inputs(rng)
    centers = per_row[:, 0]  # [G, ds]
    min_d2 = np.full((2, 7, 2), 2.0, np.float32)
    dev = to_device(min_d2)
    vq.kmeanspp_update_into(x, centers, min_d2)
    vq.kmeanspp_update_into(to_device(x), to_device(centers), dev)
    np.testing.assert_allclose(to_host(dev), min_d2, rtol=1e-5, atol=1e-6)
    assert (min_d2 <= 2.0).all() and (min_d2 < 2.0).any()


def _decode(rng):
    x, per_row, shared = _vq_inputs(rng)
    for cb in (per_row, shared):
        codes, _ = vq.assign(x, cb)
        assert np.array_equal(to_host(vq.decode(to_device(codes), to_device(cb))), vq.decode(codes, cb))


# --- INT4 / INT8 ------------------------------------------------------------------------------------------
def _int_inputs(rng):
    x = rng.standard_normal((2, 11, 3)).astype(np.float32)
    x[0, 4, 1] = 25.0  # outliers
    x[1, 0, 2] = -40.0
    x[1, :, 0] = 0.5  # constant channel: MAD = 0, mean + 3·std rule
    return x, intquant.mad_threshold(x)


def _threshold(rng):
    x, thr = _int_inputs(rng)
    np.testing.assert_allclose(to_host(intquant.mad_threshold(to_device(x))), thr, rtol=1e-6)


def _run_quantize(x, thr, bits, group, dev):
    rows, n, nch = x.shape
    ng = -(-n // group)
    nbt = n if bits == 8 else (n + 1) // 2
    outs = [np.zeros((rows, nch, ng), np.float32), np.zeros((rows, nch, nbt), np.uint8),
            np.zeros((rows, nch, ng), np.int32)]
    if not dev:
        intquant._int_quantize_cpu(x, thr, bits, group, *outs)
        return outs
    d_outs = [to_device(a) for a in outs]
    b, t = _grid(rows * nch * ng)
    intquant._int_quantize_cuda[b, t](to_device(x), to_device(thr), bits, group, *d_outs)
    return [to_host(a) for a in d_outs]


def _int_quantize(rng):
    x, thr = _int_inputs(rng)
    for bits in (4, 8):
        for group in (4, 12):
            cpu = _run_quantize(x, thr, bits, group, False)
            for a, b in zip(cpu, _run_quantize(x, thr, bits, group, True)):
                assert np.array_equal(a, b)


def _int_outliers(rng):
    x, _ = _int_inputs(rng)
    q = intquant.quantize_int(x, 4, 4)
    qd = intquant.quantize_int(to_device(x), 4, 4)
    assert q.num_outliers >= 2
    assert np.array_equal(to_host(qd.outlier_idx), q.outlier_idx)
    assert np.array_equal(to_host(qd.outlier_vals), q.outlier_vals)


def _int_dequantize(rng):
    x, _ = _int_inputs(rng)
    for bits in (4, 8):
        q = intquant.quantize_int(x, bits, 6)
        arrays = (q.packed, q.scales, q.outlier_idx, q.outlier_vals)
        qd = intquant.IntQuantized(*(to_device(a) for a in arrays), q.bits, q.group, q.shape)
        np.testing.assert_allclose(to_host(intquant.dequantize_int(qd)), intquant.dequantize_int(q),
                                   rtol=1e-6, atol=1e-7)


RUNNERS = {
    "move_rows": _move,
    "lowrank_mean": _stats,
    "lowrank_gram": _stats,
    "lowrank_project": _project,
    "lowrank_reconstruct": _reconstruct,
    "f16_encode": _f16_encode,
    "f16_decode": _f16_decode,
    "vq_assign": _assign,
    "vq_accumulate": _accumulate,
    "kmeanspp_update": _kmeanspp,
    "vq_decode": _decode,
    "int_threshold": _threshold,
    "int_quantize": _int_quantize,
    "int_outliers": _int_outliers,
    "int_dequantize": _int_dequantize,
}


@pytest.mark.cuda
@pytest.mark.parametrize("runner", runner_params(RUNNERS))
def test_cuda_kernel_matches_cpu_twin(runner):
    runner(np.random.default_rng(11))


# --- end to end on the device ------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["lowrank", "hybrid", "vq", "pq"])
def test_compressor_on_device_matches_cpu(kind):
    from numba_kv.compressor import Hybrid, KVCacheCompressor, LowRank, VectorQuantization

    from ..compressor.synth import nmse, synth_kv

    rng = np.random.default_rng(4)
    k = synth_kv(rng, 2, 10, 16, "k")  # 2·16·16 = 512 threads for the Gram kernel
    v = synth_kv(rng, 2, 10, 16, "v")
    method, bits = {"lowrank": (LowRank(4), 8), "hybrid": (Hybrid(6, 4, group_size=4, energy=None), 8),
                    "vq": (VectorQuantization(6, max_iter=3), 4),
                    "pq": (VectorQuantization(4, subvector_dim=8, per_head=True, max_iter=2), 8)}[kind]
    comp = KVCacheCompressor(method, bits)
    c_cpu = comp.compress_kv_3d(k, v)
    c_dev = comp.compress_kv_3d(to_device(k), to_device(v))
    assert all(not isinstance(a, np.ndarray) for a in c_dev.k.arrays.values())  # payload stays on device
    kh, vh = comp.decompress_kv_3d(c_cpu)
    kd, vd = (to_host(a) for a in comp.decompress_kv_3d(c_dev))
    if kind in ("lowrank", "hybrid"):
        assert c_dev.nbytes == c_cpu.nbytes or kind == "hybrid"
        for ref, got, x in ((kh, kd, k), (vh, vd, v)):
            assert nmse(x, got) <= nmse(x, ref) * 1.05 + 1e-6
            if kind == "lowrank":
                np.testing.assert_allclose(got, ref, rtol=1e-3, atol=1e-3)
    else:  # k-means++ draws may differ with the last bits of the distances on a GPU
        for ref, got, x in ((kh, kd, k), (vh, vd, v)):
            assert nmse(x, got) <= max(2.0 * nmse(x, ref), 1e-3)


@pytest.mark.cuda
@pytest.mark.parametrize("storage", ["float32", "pqo3"])
def test_paged_cache_on_device_matches_cpu(storage):
    from numba_kv.caches.paged import PagedKVCache

    rng = np.random.default_rng(2)
    k = rng.standard_normal((2, 7, 32)).astype(np.float32)
    v = rng.standard_normal((2, 7, 32)).astype(np.float32)
    out = []
    for dev in (False, True):
        cache = PagedKVCache(num_pages=4, num_layers=1, num_kv_heads=2, head_dim=32, page_size=4,
                             storage=storage)
        s = cache.allocate_sequence()
        put = to_device if dev else (lambda a: a)
        cache.append(0, s, put(np.ascontiguousarray(k[:, :3])), put(np.ascontiguousarray(v[:, :3])))
        cache.append(0, s, put(np.ascontiguousarray(k[:, 3:])), put(np.ascontiguousarray(v[:, 3:])))
        out.append([to_host(a) for a in cache.get_kv(0, s)] + [to_host(a) for a in cache.pools.values()])
        assert cache.device == ("cuda" if dev else "cpu")
        if dev:
            with pytest.raises(ValueError, match="k is on cpu but the page pool lives on cuda"):
                cache.append(0, s, k, v)
    for a, b in zip(*out):
        assert np.array_equal(a, b)


@pytest.mark.cuda
def test_mla_caches_on_device():
    from numba_kv.caches.mla import MLACache, SimpleMLACache

    rng = np.random.default_rng(3)
    w_uk = rng.standard_normal((2, 8, 4)).astype(np.float32)
    w_uv = rng.standard_normal((2, 8, 4)).astype(np.float32)
    lat = rng.standard_normal((3, 8 + 4)).astype(np.float32)
    res = []
    for dev in (False, True):
        cache = MLACache(2, 1, 2, 8, 4, 4, 4, w_uk, w_uv, page_size=4)
        s = cache.allocate_sequence()
        cache.append_latent(0, s, to_device(lat) if dev else lat)
        res.append([to_host(a) for a in cache.get_kv(0, s)])
    for a, b in zip(*res):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
    down = rng.standard_normal((8, 4)).astype(np.float32)
    up = rng.standard_normal((4, 8)).astype(np.float32)
    k = rng.standard_normal((2, 3, 8)).astype(np.float32)
    res = []
    for dev in (False, True):
        cache = SimpleMLACache(2, 1, 2, 8, 4, down, up, up)
        s = cache.allocate_sequence()
        cache.append(0, s, to_device(k) if dev else k, to_device(k) if dev else k)
        res.append([to_host(a) for a in cache.get_kv(0, s)])
    for a, b in zip(*res):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
