"""The warp-level PTX primitives (``ops/attention/ptx.py``) and the tensor-core decode attention.

Each primitive runs in a small kernel, on a GPU (its inline PTX) or under
``NUMBA_ENABLE_CUDASIM=1`` (its Python twin), against NumPy: binary16 packing and products
bit for bit, ``mma.sync`` against float64 products of the binary16-rounded operands, the xor
shuffle against the lane permutation.  The tensor-core kernel is checked against the float32
CPU twin (binary16 operands: relative L2 error under :data:`MMA_RTOL`, far below what a wrong
fragment, pair order or scale gives) and must be the kernel that ran.
"""

import numpy as np
import pytest
from numba import cuda, uint64

from numba_kv import knobs
from numba_kv._backend import to_host
from numba_kv.ops import attention
from numba_kv.ops.attention import decode_attention, kernels
from numba_kv.ops.attention.mma import TAB_BYTES, _row, aligned_table
from numba_kv.ops.attention.ptx import (
    exp2_ftz,
    global_address,
    half2_bits,
    half_f32,
    high_halves,
    hmul2,
    ldg_u16,
    ldg_u32,
    lds_u32,
    low_halves,
    mma_16816,
    movmatrix_trans,
    pack_half2,
    shared_base32,
    shfl_idx_f32,
    shfl_xor_f32,
    shfl_xor_u32,
    unpack_half2,
)
from numba_kv.ops.blockquant import quantize_blocks
from numba_kv.ops.codebook import get_codebook
from numba_kv.reference import pair_table

from ..conftest import spy_launches, to_device

#: relative L2 error of the tensor-core kernel against the float32 CPU twin: binary16 keys
#: (11-bit significands of code·scale and of the scaled queries) and weights give ~1e-3
MMA_RTOL = 4e-3


@cuda.jit
def mma_kernel(A, B, C, out):
    ln = cuda.threadIdx.x
    gid = ln >> 2
    tig = ln & 3
    a0 = pack_half2(A[gid, 2 * tig], A[gid, 2 * tig + 1])
    a1 = pack_half2(A[gid + 8, 2 * tig], A[gid + 8, 2 * tig + 1])
    a2 = pack_half2(A[gid, 2 * tig + 8], A[gid, 2 * tig + 9])
    a3 = pack_half2(A[gid + 8, 2 * tig + 8], A[gid + 8, 2 * tig + 9])
    b0 = pack_half2(B[2 * tig, gid], B[2 * tig + 1, gid])
    b1 = pack_half2(B[2 * tig + 8, gid], B[2 * tig + 9, gid])
    d0, d1, d2, d3 = mma_16816(a0, a1, a2, a3, b0, b1, C[gid, 2 * tig], C[gid, 2 * tig + 1], C[gid + 8, 2 * tig],
                               C[gid + 8, 2 * tig + 1])
    out[gid, 2 * tig] = d0
    out[gid, 2 * tig + 1] = d1
    out[gid + 8, 2 * tig] = d2
    out[gid + 8, 2 * tig + 1] = d3


@cuda.jit
def half_kernel(x, y, packed, prod):
    i = cuda.threadIdx.x
    p = pack_half2(x[i], y[i])
    packed[i] = p
    prod[i] = hmul2(p, pack_half2(y[i], x[i]))


@cuda.jit
def shfl_kernel(xf, xu, mask, outf, outu):
    i = cuda.threadIdx.x
    outf[i] = shfl_xor_f32(xf[i], mask)
    outu[i] = shfl_xor_u32(xu[i], mask)


@cuda.jit
def movmatrix_kernel(words, out):
    i = cuda.threadIdx.x
    out[i] = movmatrix_trans(words[i])


@cuda.jit
def shfl_idx_kernel(x, src, out):
    i = cuda.threadIdx.x
    out[i] = shfl_idx_f32(x[i], src[i])


@cuda.jit
def half_f32_kernel(w, out):
    i = cuda.threadIdx.x
    out[i] = half_f32(w[i])


@cuda.jit
def halves_kernel(a, b, lo, hi):
    i = cuda.threadIdx.x
    lo[i] = low_halves(a[i], b[i])
    hi[i] = high_halves(a[i], b[i])


@cuda.jit
def exp2_kernel(x, out):
    i = cuda.threadIdx.x
    out[i] = exp2_ftz(x[i])


@cuda.jit(device=True)
def _fill_then_read(tab, src, offsets, out, bases, extra):
    """Thread ``i`` of 128 stores 32 words of ``src`` into the 16 KiB-aligned half of the 32 KiB
    shared array ``tab`` (:func:`aligned_table`); after the barrier it reads the word at byte
    offset ``offsets[i]`` by the OR-ed address and records the raw base, the realigned one and
    the start word (plus ``extra``, 0)."""
    i = cuda.threadIdx.x
    w0, base = aligned_table(tab)
    for j in range(i, 4096, cuda.blockDim.x):
        tab[w0 + j] = src[j]
    cuda.syncthreads()
    bases[0, i] = shared_base32(tab)
    bases[1, i] = base
    bases[2, i] = w0 + extra
    out[i] = lds_u32(tab, base | offsets[i])


@cuda.jit
def lds_kernel(src, offsets, out, bases):
    """:func:`_fill_then_read` on the block's only shared array."""
    _fill_then_read(cuda.shared.array(8192, dtype=np.uint32), src, offsets, out, bases, np.uint32(0))


@cuda.jit
def lds_second_array_kernel(src, offsets, out, bases):
    """As :func:`lds_kernel`, the tables in a second shared array (another window address)."""
    pad = cuda.shared.array(300, dtype=np.uint32)
    tab = cuda.shared.array(8192, dtype=np.uint32)
    i = cuda.threadIdx.x
    pad[i] = np.uint32(i)
    _fill_then_read(tab, src, offsets, out, bases, pad[i] & np.uint32(0))


@pytest.mark.cuda
@pytest.mark.parametrize("kernel", [lds_kernel, lds_second_array_kernel], ids=["first", "second"])
def test_lds_reads_the_word_at_an_ored_shared_address(kernel):
    """``aligned_table`` finds the first word of a shared array whose window address has bits
    0–13 clear (so ``base | offset`` is ``base + offset``; on sm_80/sm_90 the window address of
    a user array is 0x400 bytes past such a boundary, whatever alignment it is declared with,
    and the simulator's stand-in is not aligned either), and ``lds_u32`` at that address reads
    the word stored at ``tab[w0 + offset / 4]``: first, last, every bit of the offset, random
    words."""
    rng = np.random.default_rng(5)
    src = rng.integers(0, 2 ** 32, 4096, dtype=np.uint64).astype(np.uint32)
    words = np.concatenate([[0, 4095], 1 << np.arange(12), rng.integers(0, 4096, 128 - 14)]).astype(np.uint32)
    out, bases = to_device(np.zeros(128, np.uint32)), to_device(np.zeros((3, 128), np.uint32))
    kernel[1, 128](to_device(src), to_device(words << np.uint32(2)), out, bases)
    raw, base, w0 = (int(x) for x in to_host(bases)[:, 0])
    assert (to_host(bases) == to_host(bases)[:, :1]).all()
    assert base % TAB_BYTES == 0 and base - raw == 4 * w0 and 0 <= w0 < 4096, (hex(raw), hex(base), w0)
    np.testing.assert_array_equal(to_host(out), src[words])


def test_simulated_shared_base_is_not_aligned_past_1_kib():
    """The simulator's stand-in window address has bit 10 set, as the GPU's (user arrays 0x400
    bytes into the window): a kernel that ORs offsets into an unaligned address fails there too."""
    from numba_kv.ops.attention import ptx

    assert ptx.SIM_SHARED_BASE & 0x3FFF == 0x400


@pytest.mark.cuda
def test_exp2_ftz_is_exp2_with_flushed_subnormals():
    """``ex2.approx.ftz.f32``: within 2**-21 relative of 2**x, exact 0 for ``-inf`` and for
    results below the normal range, ``inf`` past the top."""
    x = np.concatenate([np.linspace(-30, 30, 24), [0.0, -126.0, -127.5, -140.0, -np.inf, 130.0, 1.0, -0.5]])
    x = x.astype(np.float32)
    out = to_device(np.full(32, np.nan, np.float32))
    exp2_kernel[1, 32](to_device(x), out)
    got = to_host(out).astype(np.float64)
    ref = np.exp2(x.astype(np.float64))
    normal = (ref >= 2.0 ** -126) & (ref < 2.0 ** 128)
    np.testing.assert_allclose(got[normal], ref[normal], rtol=2.0 ** -21)
    assert (got[ref < 2.0 ** -126] == 0.0).all() and np.isposinf(got[ref >= 2.0 ** 128]).all()


@pytest.mark.cuda
def test_half_f32_converts_the_low_binary16_exactly():
    """``cvt.f32.f16`` of the low half: every binary16 kind (zeros, subnormals, normals, the
    largest, infinities, NaN) exactly as NumPy's conversion, whatever the upper half holds."""
    rng = np.random.default_rng(11)
    low = np.array([0x0000, 0x8000, 0x0001, 0x03FF, 0x0400, 0x3C00, 0xBC00, 0x7BFF, 0xFBFF, 0x7C00, 0xFC00,
                    0x7E00, 0x3555, 0x1234], dtype=np.uint32)
    low = np.concatenate([low, rng.integers(0, 0x10000, 64 - len(low)).astype(np.uint32)])
    words = low | (rng.integers(0, 0x10000, 64).astype(np.uint32) << np.uint32(16))
    out = to_device(np.zeros(64, np.float32))
    half_f32_kernel[1, 64](to_device(words), out)
    ref = low.astype(np.uint16).view(np.float16).astype(np.float32)
    np.testing.assert_array_equal(to_host(out).view(np.uint32)[~np.isnan(ref)], ref.view(np.uint32)[~np.isnan(ref)])
    assert np.isnan(to_host(out)[np.isnan(ref)]).all()


@pytest.mark.cuda
def test_low_and_high_halves_regroup_two_words():
    """``prmt.b32`` 0x5410 / 0x7632: ``(a.lo, b.lo)`` and ``(a.hi, b.hi)``, bit patterns moved
    as they are."""
    rng = np.random.default_rng(3)
    a = rng.integers(0, 2 ** 32, 32, dtype=np.uint64).astype(np.uint32)
    b = rng.integers(0, 2 ** 32, 32, dtype=np.uint64).astype(np.uint32)
    lo = to_device(np.zeros(32, np.uint32))
    hi = to_device(np.zeros(32, np.uint32))
    halves_kernel[1, 32](to_device(a), to_device(b), lo, hi)
    a16, b16 = a.view(np.uint16).reshape(32, 2), b.view(np.uint16).reshape(32, 2)
    np.testing.assert_array_equal(to_host(lo).view(np.uint16).reshape(32, 2), np.stack([a16[:, 0], b16[:, 0]], 1))
    np.testing.assert_array_equal(to_host(hi).view(np.uint16).reshape(32, 2), np.stack([a16[:, 1], b16[:, 1]], 1))


@pytest.mark.cuda
def test_movmatrix_transposes_the_warps_8x8_binary16_matrix():
    """Lane ``4r + c`` holds columns ``2c, 2c+1`` of row ``r`` (low half first); afterwards it
    holds those of row ``r`` of the transpose.  Distinct bit patterns (NaN payloads and
    subnormals included) must move, not be converted."""
    m = (np.arange(64, dtype=np.uint32) * 0x9E37 + 0x7C01) & 0xFFFF  # 64 distinct 16-bit patterns
    m = m.astype(np.uint16).reshape(8, 8)
    words = m.reshape(32, 2).astype(np.uint32)
    words = words[:, 0] | (words[:, 1] << 16)
    out = to_device(np.zeros(32, np.uint32))
    movmatrix_kernel[1, 32](to_device(words.astype(np.uint32)), out)
    got = to_host(out).astype(np.uint32)
    got = np.stack([got & 0xFFFF, got >> 16], axis=1).reshape(8, 8).astype(np.uint16)
    np.testing.assert_array_equal(got, m.T)


@pytest.mark.cuda
def test_shfl_idx_reads_the_named_lane():
    x = (np.arange(32, dtype=np.float32) - 11.5) * 3
    src = ((np.arange(32) * 7 + 3) % 32).astype(np.int32)  # every lane read once, none its own
    out = to_device(np.zeros(32, np.float32))
    shfl_idx_kernel[1, 32](to_device(x), to_device(src), out)
    np.testing.assert_array_equal(to_host(out), x[src])


@pytest.mark.cuda
def test_mma_16816_matches_float64_of_binary16_operands():
    rng = np.random.default_rng(0)
    A = (rng.standard_normal((16, 16)) * 3).astype(np.float32)
    B = rng.standard_normal((16, 8)).astype(np.float32)
    C = rng.standard_normal((16, 8)).astype(np.float32)
    out = to_device(np.full((16, 8), np.nan, np.float32))
    mma_kernel[1, 32](to_device(A), to_device(B), to_device(C), out)
    ref = A.astype(np.float16).astype(np.float64) @ B.astype(np.float16).astype(np.float64) + C
    np.testing.assert_allclose(to_host(out), ref, rtol=1e-6, atol=1e-5)


@pytest.mark.cuda
def test_pack_and_hmul2_are_binary16_round_to_nearest():
    rng = np.random.default_rng(1)
    # ordinary values, binary16 subnormals, ties (1 + 2**-11), beyond binary16 (inf) and zeros
    x = np.concatenate([rng.standard_normal(24) * 100, [3e-6, -7e-8, 1 + 2 ** -11, 7e4, 0.0, -0.0, 1e-3, 2.0]])
    y = np.concatenate([rng.standard_normal(24), [0.5, 3.0, 1.0, 1.0, 5.0, 2.0, 1e-3, 65504.0]])
    x, y = x.astype(np.float32), y.astype(np.float32)
    packed = to_device(np.zeros(32, np.uint32))
    prod = to_device(np.zeros(32, np.uint32))
    half_kernel[1, 32](to_device(x), to_device(y), packed, prod)
    want = [half2_bits(a, b) for a, b in zip(x, y)]
    assert [int(v) for v in to_host(packed)] == want
    with np.errstate(over="ignore", invalid="ignore"):  # 7e4 rounds to binary16 inf, as on the GPU
        xh, yh = x.astype(np.float16).astype(np.float64), y.astype(np.float16).astype(np.float64)
        lo = (xh * yh).astype(np.float16)  # an exact float64 product rounded once
    got = np.array([unpack_half2(w) for w in to_host(prod)], dtype=np.float64)
    np.testing.assert_array_equal(got[:, 0], lo.astype(np.float64))
    np.testing.assert_array_equal(got[:, 1], lo.astype(np.float64))


def test_half2_bits_layout():
    assert half2_bits(1.0, -2.0) == 0x3C00 | (0xC000 << 16)  # element 0 in the low half
    assert unpack_half2(0x3C00 | (0xC000 << 16)) == (1.0, -2.0)


@pytest.mark.cuda
@pytest.mark.parametrize("mask", [1, 2, 5, 16])
def test_shfl_xor(mask):
    xf = np.arange(32, dtype=np.float32) * 1.5 - 7
    xu = (np.arange(32, dtype=np.uint32) * 0x9E3779B1) & 0xFFFFFFFF
    outf = to_device(np.zeros(32, np.float32))
    outu = to_device(np.zeros(32, np.uint32))
    shfl_kernel[1, 32](to_device(xf), to_device(xu.astype(np.uint32)), mask, outf, outu)
    perm = np.arange(32) ^ mask
    np.testing.assert_array_equal(to_host(outf), xf[perm])
    np.testing.assert_array_equal(to_host(outu), xu[perm].astype(np.uint32))


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_reference_pair_table(bits):
    """The oracle of the kernels' pair tables (``numba_kv.reference.pair_table``): its factor and
    entries from the codebook by the formula."""
    cent = get_codebook(bits, "maxnorm").centroids
    tab, inv = pair_table(cent, bits)
    f = 1.0 / inv
    assert f in (1.0, 0.5, 0.25) and float(np.abs(cent).max()) * f <= 1.0 < float(np.abs(cent).max()) * f * 2
    for e in (0, 1, (1 << (2 * bits)) - 1, 5 % (1 << (2 * bits))):
        lo, hi = unpack_half2(int(tab[e]))
        assert lo == np.float32(np.float16(cent[e & ((1 << bits) - 1)] * f))
        assert hi == np.float32(np.float16(cent[e >> bits] * f))


def _spy(monkeypatch):
    return spy_launches(monkeypatch, (kernels, "DECODE_ATTENTION_MMA"))


def _rel(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(np.asarray(b, np.float64)))


@pytest.mark.cuda
@pytest.mark.parametrize("kbits, vbits, T, n_exact, q_len, q_scale", [
    (3, 3, 45, 0, 1, 1.0),      # a ragged last tile in each of two partitions
    (4, 2, 37, 9, 2, 1.0),      # GQA 4 × causal q_len 2, a window of exact tokens
    (2, 4, 20, 0, 1, 3e5),      # queries far beyond binary16: the row scaling keeps them finite
])
def test_mma_attention_matches_cpu_twin(kbits, vbits, T, n_exact, q_len, q_scale, monkeypatch):
    launched = _spy(monkeypatch)
    rng = np.random.default_rng(kbits * 10 + vbits)
    b, hkv, G, d = 1, 2, 4, 128
    k = (rng.standard_normal((b, hkv, T, d)) * 4).astype(np.float32)
    v = rng.standard_normal((b, hkv, T, d)).astype(np.float32)
    kc, ks = quantize_blocks(k, kbits)
    vc, vs = quantize_blocks(v, vbits)
    # logits of a few units whatever q_scale (peaked enough that a wrong score shows)
    q = (rng.standard_normal((b, hkv * G, q_len, d)) * q_scale).astype(np.float32)
    kw = dict(k_bits=kbits, v_bits=vbits, partition_size=32, softmax_scale=d ** -0.5 / q_scale)
    if n_exact:
        kw["k_exact"] = rng.standard_normal((b, hkv, n_exact, d)).astype(np.float32)
        kw["v_exact"] = rng.standard_normal((b, hkv, n_exact, d)).astype(np.float32)
    cpu = decode_attention(q, kc, ks, vc, vs, **kw)
    dkw = {n: (to_device(a) if isinstance(a, np.ndarray) else a) for n, a in kw.items()}
    dev = to_host(decode_attention(*(to_device(a) for a in (q, kc, ks, vc, vs)), **dkw))
    assert launched, "the tensor-core kernel did not run"
    assert np.isfinite(dev).all()
    assert _rel(dev, cpu) < MMA_RTOL
    # and it is not the float32 kernel by accident: binary16 rounding shows
    assert not np.array_equal(dev, cpu)


@pytest.mark.cuda
@pytest.mark.parametrize("kbits, vbits, T, n_exact", [
    (4, 3, 45, 0),   # kv4's widths; a ragged last tile in each of two partitions
    (3, 2, 37, 9),   # a window of exact tokens
])
def test_mma_attention_with_token_scales_matches_cpu_twin(kbits, vbits, T, n_exact, monkeypatch):
    """Whole-head codes (one norm a token: the tiles scale the scores and weights, not the
    codes) against the CPU twin, with norms far apart from token to token (a wrong token's
    scale on a score or weight shows) and one token's norms stored as infinity and NaN (read
    as 0 by both, as the kernels' binary16 table does)."""
    from numba_kv.ops.headquant import quantize_head  # noqa: PLC0415

    launched = _spy(monkeypatch)
    rng = np.random.default_rng(kbits * 10 + vbits + 100)
    b, hkv, G, d = 1, 2, 4, 128
    spread = np.exp(rng.uniform(-3.0, 3.0, (b, hkv, T, 1))).astype(np.float32)
    k = (rng.standard_normal((b, hkv, T, d)) * spread).astype(np.float32)
    v = (rng.standard_normal((b, hkv, T, d)) * spread[:, :, ::-1]).astype(np.float32)
    kc, kn = quantize_head(k, kbits)
    vc, vn = quantize_head(v, vbits)
    kn[0, 1, 5, 0], vn[0, 0, 7, 0] = 0x7C00, 0x7E00  # +inf, NaN: read as 0
    q = (rng.standard_normal((b, hkv * G, 1, d)) * 0.05).astype(np.float32)
    # check_values=False: the public op refuses Inf/NaN norm patterns; the kernels' own reading
    # of them (as 0) is what is tested here
    kw = dict(k_bits=kbits, v_bits=vbits, rotation="head", partition_size=32, check_values=False)
    if n_exact:
        kw["k_exact"] = rng.standard_normal((b, hkv, n_exact, d)).astype(np.float32)
        kw["v_exact"] = rng.standard_normal((b, hkv, n_exact, d)).astype(np.float32)
    cpu = decode_attention(q, kc, kn, vc, vn, **kw)
    dev = to_host(decode_attention(*(to_device(a) for a in (q, kc, kn, vc, vn)), **{
        n: (to_device(a) if isinstance(a, np.ndarray) else a) for n, a in kw.items()}))
    assert launched, "the tensor-core kernel did not run"
    assert np.isfinite(dev).all()
    # (about 3e-4 measured: the scales in float32, the codes and weights in binary16; with the
    # block-scale tiles' binary16 code·scale products on these codes 3.1e-4 to 3.8e-4)
    assert _rel(dev, cpu) < 1e-3
    assert not np.array_equal(dev, cpu)  # binary16 operands: not the float32 kernel


@pytest.mark.cuda
@pytest.mark.parametrize("partition_size", [16, 64])
def test_paged_mma_attention_matches_cpu_twin(monkeypatch, partition_size):
    """PQO pools (K 3 bits, V 2 bits) of ragged sequences (5, 19, 40 tokens, page size 16, pages
    handed out interleaved), GQA 4 × causal q_len 2, several partitions per sequence (16
    tokens) or partitions of several tiles, each tile on a page of its own (64): the paged
    tensor-core kernel against the CPU twin, and it is the kernel that ran."""
    from numba_kv import PagedKVCache
    from numba_kv.ops.attention import kernels

    launched = spy_launches(monkeypatch, (kernels, "PAGED_DECODE_ATTENTION_MMA"))
    rng = np.random.default_rng(9)
    caches = [PagedKVCache(num_pages=12, num_layers=1, num_kv_heads=1, head_dim=128, page_size=16,
                           storage="pqo-k3v2") for _ in range(2)]
    seqs = [[c.allocate_sequence() for _ in range(3)] for c in caches]
    for chunk in range(5):  # interleaved appends: each sequence's pages are scattered in the pool
        for i, n in enumerate((5, 19, 40)):
            lo, hi = n * chunk // 5, n * (chunk + 1) // 5
            if hi > lo:
                k = (rng.standard_normal((1, hi - lo, 128)) * 3).astype(np.float32)
                v = rng.standard_normal((1, hi - lo, 128)).astype(np.float32)
                caches[0].append(0, seqs[0][i], k, v)
                caches[1].append(0, seqs[1][i], to_device(k), to_device(v))
    q = rng.standard_normal((3, 4, 2, 128)).astype(np.float32)
    a = caches[0].decode_attention(0, q, partition_size=partition_size)
    b = to_host(caches[1].decode_attention(0, to_device(q), partition_size=partition_size))
    assert launched, "the paged tensor-core kernel did not run"
    assert np.isfinite(b).all()
    assert _rel(b, a) < MMA_RTOL
    assert not np.array_equal(b, a)


@pytest.mark.cuda
@pytest.mark.parametrize(("page_size", "partition_size"), [(12, 16), (8, 16), (16, 24)])
def test_paged_mma_attention_needs_whole_tiles_on_a_page(monkeypatch, page_size, partition_size):
    """The tensor-core tiles read a 16-token tile's page once and a token's slot by a shift:
    pages of 12 tokens (not a power of two), of 8 (a tile spans two) and partitions of 24
    tokens (tiles across a page boundary) run the warp kernel instead, with the same result
    as the CPU twin."""
    from numba_kv import PagedKVCache
    from numba_kv.ops.attention import kernels

    launched = spy_launches(monkeypatch, (kernels, "PAGED_DECODE_ATTENTION_MMA"))
    rng = np.random.default_rng(4)
    caches = [PagedKVCache(num_pages=6, num_layers=1, num_kv_heads=1, head_dim=128, page_size=page_size,
                           storage="pqo-k3v2") for _ in range(2)]
    seqs = [c.allocate_sequence() for c in caches]
    k = (rng.standard_normal((1, 30, 128)) * 3).astype(np.float32)
    v = rng.standard_normal((1, 30, 128)).astype(np.float32)
    caches[0].append(0, seqs[0], k, v)
    caches[1].append(0, seqs[1], to_device(k), to_device(v))
    q = rng.standard_normal((1, 4, 1, 128)).astype(np.float32)
    a = caches[0].decode_attention(0, q, partition_size=partition_size)
    b = to_host(caches[1].decode_attention(0, to_device(q), partition_size=partition_size))
    assert not launched, f"the tensor-core kernel ran on {page_size}-token pages, {partition_size}-token partitions"
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


#: the tensor-core kernels' simulator/GPU runs (``tests/cuda/test_sim.py`` checks every registered
#: twin has one): the parametrized tests above
RUNNERS = {"decode_attention_mma": test_mma_attention_matches_cpu_twin,
           "paged_decode_attention_mma": test_paged_mma_attention_matches_cpu_twin}


@pytest.mark.cuda
def test_mma_knob_off_runs_the_warp_kernel(monkeypatch):
    launched = _spy(monkeypatch)
    rng = np.random.default_rng(3)
    k = rng.standard_normal((1, 1, 20, 128)).astype(np.float32)
    kc, ks = quantize_blocks(k, 3)
    q = rng.standard_normal((1, 4, 1, 128)).astype(np.float32)
    with knobs(cuda_mma_attention=0):
        out = to_host(decode_attention(*(to_device(a) for a in (q, kc, ks, kc, ks))))
    assert not launched
    np.testing.assert_allclose(out, decode_attention(q, kc, ks, kc, ks), rtol=2e-5, atol=2e-6)


def test_mma_dispatch_rules():
    cb3, cb1 = get_codebook(3, "maxnorm"), get_codebook(1, "maxnorm")
    lay3 = attention.CodeLayout.uniform(cb3, 128)
    mixed = attention.CodeLayout.from_blocks([cb3, cb3, cb1, cb3])
    assert attention.mma_layout_ok(lay3)
    assert not attention.mma_layout_ok(mixed)
    assert not attention.mma_layout_ok(attention.CodeLayout.uniform(cb1, 128))
    assert attention.use_mma_kernel("cuda", 128, False, False, lay3, lay3)
    assert not attention.use_mma_kernel("cpu", 128, False, False, lay3, lay3)
    assert not attention.use_mma_kernel("cuda", 96, False, False, lay3, lay3)  # (64 and 128 have builds)
    assert not attention.use_mma_kernel("cuda", 128, True, False, lay3, lay3)
    assert not attention.use_mma_kernel("cuda", 128, False, True, lay3, lay3)
    assert not attention.use_mma_kernel("cuda", 128, False, False, lay3, mixed)
    with knobs(cuda_mma_attention=0):
        assert not attention.use_mma_kernel("cuda", 128, False, False, lay3, lay3)
    codes = np.arange(2 * 5 * 48, dtype=np.uint32).astype(np.uint8).reshape(2, 5, 48)
    words = attention.code_words(codes)
    assert words.shape == (2, 5, 12)
    assert int(words[1, 2, 3]) == int.from_bytes(bytes(codes[1, 2, 12:16]), "little")  # little-endian words
    assert attention.code_words(np.zeros((2, 5, 6), np.uint8)) is None
    part = attention.code_words(codes[:, :, :44])  # rows apart (last axis contiguous): still a view
    assert part.shape == (2, 5, 11) and np.shares_memory(part, codes)
    scales = np.zeros((2, 5, 4), np.uint16)
    kc4, ks4, vc4, vs4 = attention.mma_operands(codes, scales, codes, scales, flat=True)
    assert kc4.shape == (2, 1, 5, 12) and ks4.shape == (2, 1, 5, 4) and np.shares_memory(kc4, codes)
    pool = np.zeros((3, 2, 8, 48), np.uint8)
    pool_scales = np.zeros((3, 2, 8, 4), np.uint16)
    assert attention.mma_operands(pool, pool_scales, pool, pool_scales, flat=False)[0].shape == (3, 2, 8, 12)
    assert attention.mma_operands(codes[:, :, :42], scales, codes, scales, flat=True) is None  # 42 % 4



@cuda.jit
def flat_word_kernel(arr, idx, out):
    i = cuda.threadIdx.x
    if i < idx.shape[0]:
        out[i] = ldg_u32(arr, _row(arr, idx[i, 0], idx[i, 1], idx[i, 2]) + uint64(4 * idx[i, 3]))


@cuda.jit
def flat_half_kernel(arr, idx, out):
    i = cuda.threadIdx.x
    if i < idx.shape[0]:
        out[i] = ldg_u16(arr, _row(arr, idx[i, 0], idx[i, 1], idx[i, 2]) + uint64(2 * idx[i, 3]))


@cuda.jit
def global_load_kernel(words, halves, offsets, out32, out16):
    """Thread ``i`` reads the word and the half-word at byte offset ``offsets[i]`` (times 4, 2)
    from the arrays' global addresses."""
    i = cuda.threadIdx.x
    out32[i] = ldg_u32(words, global_address(words) + uint64(4) * offsets[i])
    out16[i] = ldg_u16(halves, global_address(halves) + uint64(2) * offsets[i])


@pytest.mark.cuda
def test_global_loads_read_the_element_at_a_byte_address():
    """``global_address`` is element 0's byte address, ``ldg_u32`` / ``ldg_u16`` read the
    element at ``address + size·i`` (the half-word zero-extended, top bit set included):
    first, last, every bit of the index, random elements."""
    rng = np.random.default_rng(7)
    words = rng.integers(0, 2 ** 32, 5000, dtype=np.uint64).astype(np.uint32)
    halves = rng.integers(0, 2 ** 16, 5000, dtype=np.uint64).astype(np.uint16)
    halves[4999] = 0xFFFF
    idx = np.concatenate([[0, 4999], 1 << np.arange(12), rng.integers(0, 5000, 32 - 14)]).astype(np.uint64)
    out32, out16 = to_device(np.zeros(32, np.uint32)), to_device(np.zeros(32, np.uint32))
    global_load_kernel[1, 32](to_device(words), to_device(halves), to_device(idx), out32, out16)
    np.testing.assert_array_equal(to_host(out32), words[idx.astype(np.int64)])
    np.testing.assert_array_equal(to_host(out16), halves[idx.astype(np.int64)].astype(np.uint32))


@pytest.mark.cuda
@pytest.mark.parametrize("view", ["pool", "unit_axis"])
def test_flat_addressing_matches_4d_indexing(view):
    """The tiles' reads by byte address (``_row`` + ``ldg_u32`` / ``ldg_u16``) equal 4-D
    indexing on the C-contiguous arrays the kernels get: a pool ``[pages, heads, page_size,
    words]`` and a flat cache's array with its inserted unit axis, for the code words and the
    binary16 scales."""
    rng = np.random.default_rng(11)
    a = rng.integers(0, 2 ** 32, size=(3, 2, 29, 12), dtype=np.uint64).astype(np.uint32)
    sc = rng.integers(0, 2 ** 16, size=(3, 2, 29, 4), dtype=np.uint64).astype(np.uint16)
    if view == "unit_axis":
        a = np.ascontiguousarray(a[:, 0])[:, None]
        sc = np.ascontiguousarray(sc[:, 0])[:, None]
    for arr, kernel in ((a, flat_word_kernel), (sc, flat_half_kernel)):
        idx = np.stack([rng.integers(0, n, 32) for n in arr.shape], axis=1).astype(np.int64)
        out = to_device(np.zeros(32, np.uint32))
        kernel[1, 32](to_device(arr), to_device(idx), out)
        np.testing.assert_array_equal(to_host(out), arr[idx[:, 0], idx[:, 1], idx[:, 2], idx[:, 3]])


def test_mma_operands_refuse_rows_past_32_bit_addresses():
    """A flat KV row (or a page) of 2**32 bytes or more would overflow the kernels' 32-bit
    row factors (``mma._row``): such arrays go to the warp kernel.  Zero-stride views stand in
    for the huge arrays (only shapes, dtypes and contiguity flags are read)."""
    from numba_kv.ops.attention.layout import _fits_32bit_rows

    def fake(shape, dtype):
        return np.lib.stride_tricks.as_strided(np.zeros(1, dtype), shape=shape, strides=(0,) * len(shape))

    assert _fits_32bit_rows(fake((2, 1, (2 ** 32 - 1) // 48, 12), np.uint32))
    assert not _fits_32bit_rows(fake((2, 1, 2 ** 32 // 48 + 1, 12), np.uint32))
    assert not _fits_32bit_rows(fake((2, 1, 2 ** 31, 4), np.uint16))
    assert not _fits_32bit_rows(fake((2 ** 31, 2, 16, 12), np.uint32))
    assert _fits_32bit_rows(fake((2 ** 31 - 1, 2, 16, 12), np.uint32))


def test_mma_operands_refuse_views_that_are_not_c_contiguous():
    """The kernels address codes and scales from their shapes, so a view into a larger buffer
    (its token stride not the shape's) goes to the warp kernel instead."""
    from numba_kv.ops.attention.layout import mma_operands

    kc = np.zeros((2, 40, 48), np.uint8)
    ks = np.zeros((2, 40, 4), np.uint16)
    assert mma_operands(kc, ks, kc, ks, flat=True) is not None
    assert mma_operands(kc[:, :17], ks[:, :17], kc[:, :17], ks[:, :17], flat=True) is None


def _arg_kind(a):
    """What a launch argument's Numba type depends on: the class, and for an array its dtype,
    dimensions and C-contiguity (a unit axis counts as contiguous, as Numba's typing has it)."""
    if not hasattr(a, "shape"):
        return type(a)
    shape, strides, step = a.shape, a.strides, a.dtype.itemsize
    c = True
    for n, s in zip(reversed(shape), reversed(strides)):
        c = c and (n == 1 or s == step)
        step *= n
    return type(a), a.dtype, len(shape), c


@pytest.mark.cuda
@pytest.mark.parametrize("paged", [False, True])
def test_occupancy_probe_types_like_the_launch(paged, monkeypatch):
    """The arguments a plan hands :meth:`AttentionPlan.resident_blocks` (on a GPU it compiles
    the overload they select and asks the driver its occupancy) type like the launch's that
    follows, argument for argument: the probe compiles the overload the launch runs, not a
    second one.  A flat cache with exact tokens and a paged pool, the partition size left to
    the plan."""
    from numba_kv.ops._registry import Twin
    from numba_kv.ops.attention import plan as plan_module

    probed, launched = [], []
    real_size, real_launch = plan_module.AttentionPlan.partition_size, Twin.launch

    def partition_size(self, n_tokens, kernel=None, n_exact=0, launch_args=None):
        if launch_args is not None:
            probed.append(launch_args())
        return real_size(self, n_tokens, kernel, n_exact, launch_args)

    def launch(self, device, n_items, *args, **kw):
        if self.name.endswith("_mma"):
            launched.append(args)
        return real_launch(self, device, n_items, *args, **kw)

    monkeypatch.setattr(plan_module.AttentionPlan, "partition_size", partition_size)
    monkeypatch.setattr(Twin, "launch", launch)
    rng = np.random.default_rng(5)
    if paged:
        from numba_kv import PagedKVCache

        cache = PagedKVCache(num_pages=4, num_layers=1, num_kv_heads=1, head_dim=128, page_size=16,
                             storage="pqo-k3v2")
        seq = cache.allocate_sequence()
        k = to_device(rng.standard_normal((1, 20, 128)).astype(np.float32))
        cache.append(0, seq, k, k)
        cache.decode_attention(0, to_device(rng.standard_normal((1, 4, 1, 128)).astype(np.float32)))
    else:
        k = rng.standard_normal((1, 2, 40, 128)).astype(np.float32)
        kc, ks = quantize_blocks(k, 3)
        ex = to_device(rng.standard_normal((1, 2, 5, 128)).astype(np.float32))
        q = to_device(rng.standard_normal((1, 8, 1, 128)).astype(np.float32))
        decode_attention(q, *(to_device(a) for a in (kc, ks, kc, ks)), k_exact=ex, v_exact=ex)
    assert len(probed) == 1 and len(launched) == 1, "the tensor-core kernel did not run"
    assert [_arg_kind(a) for a in probed[0]] == [_arg_kind(a) for a in launched[0]]


@pytest.mark.cuda
@pytest.mark.slow
def test_mma_attention_on_real_model_kv():
    """The K, V and queries SmolLM2-135M writes (post-RoPE, one prefill of the evaluation text;
    two KV heads of 64 side by side make the kernel's 128-wide rows, and a query head of each
    group: ``benchmarks/mma_real_kv.py``), coded as every layout the tensor-core kernels read
    (``pqo3``'s, ``kv4``'s, and ``kv3``'s head VQ code on the VQ build): within :data:`MMA_RTOL`
    of the CPU twin and finite, the tensor-core kernel the one that ran (the published runs,
    every layer of both models: the Benchmarks page).  The
    layer is the one whose keys reach the largest magnitude: real keys carry outlier channels
    that random ones lack, and those set the block scales the binary16 products see."""
    from benchmarks.mma_real_kv import rows_128

    rows = smollm2_largest_layer(rows_128)
    assert rows[1].shape == (1, 3, 32, 128) and rows[0].shape == (1, 9, 32, 128)
    check_real_model_rows(rows)


def smollm2_largest_layer(make_rows):
    """``make_rows`` (``benchmarks/mma_real_kv.py``) of SmolLM2-135M's layer with the largest
    keys, 32 tokens of the evaluation text, with the softmax scale appended; skips without the
    model or its loaders."""
    from benchmarks.mma_real_kv import capture
    from numba_kv.toolkit.models import ModelNotFoundError, smollm2_path

    pytest.importorskip("gguf", reason="needs the 'gguf' package (pip install gguf)")
    pytest.importorskip("tokenizers", reason="needs the 'tokenizers' package (pip install tokenizers)")
    try:
        smollm2_path()
    except ModelNotFoundError as exc:
        pytest.skip(f"SmolLM2 model not installed ({exc})")
    layers, scale, _ = capture("smollm2", 32)
    return (*make_rows(*max(layers, key=lambda qkv: float(np.abs(qkv[1]).max()))), scale)


def check_real_model_rows(rows):
    """Every layout of ``benchmarks/mma_real_kv.py`` on ``rows`` (``q, k, v, scale``): the
    tensor-core build of their head_dim ran once, within :data:`MMA_RTOL` of the CPU twin,
    finite, and not the float32 kernel."""
    from benchmarks.mma_real_kv import LAYOUTS, kernel_error

    for layout in LAYOUTS:
        rel, finite, launches = kernel_error(*rows, layout, 1)
        assert launches == 1, f"{layout[0]}: the tensor-core kernel did not run"
        assert finite and rel < MMA_RTOL, (layout[0], rel)
        assert rel > 0.0  # binary16 operands: not the float32 kernel
