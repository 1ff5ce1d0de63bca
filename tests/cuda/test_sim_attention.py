"""Cooperative CUDA decode attention (flat, paged, merge) vs the CPU twin and the oracles.

Each case targets one path of the block-per-(KV row, partition) kernels: GQA groups with
causal ``q_len > 1``, more query rows than one block holds (row chunks), exact window
tokens with their own positions (fully masked tiles), several partitions of each kind,
mixed and odd code widths (1–4 bits, one scale per two blocks), the QJL correction, the
whole-head rotation, head_dim 256, and paged pools with ragged lengths.  Small shapes:
every simulated thread is an OS thread.  Runs under ``NUMBA_ENABLE_CUDASIM=1`` or on a GPU.
"""

import numpy as np
import pytest

from numba_kv import PagedKVCache, knobs, reference
from numba_kv._backend import to_host
from numba_kv.ops.attention import CodeLayout, decode_attention, fused_attention_rows, rows_per_block
from numba_kv.ops.blockquant import dequantize_blocks, quantize_blocks
from numba_kv.ops.codebook import get_codebook

from ..conftest import spy_launches, to_device

TOL = dict(rtol=2e-5, atol=2e-6)


def _both(args, kw):
    """``decode_attention`` on host arrays and on device copies of the same arrays."""
    cpu = decode_attention(*args, **kw)
    dkw = {k: (to_device(v) if isinstance(v, np.ndarray) else v) for k, v in kw.items()}
    if isinstance(kw.get("k_qjl"), tuple):
        dkw["k_qjl"] = tuple(a if a is None else to_device(a) for a in kw["k_qjl"])
    dev = to_host(decode_attention(*(to_device(a) for a in args), **dkw))
    return cpu, dev


def _codes(rng, b, hkv, T, d, kbits, vbits):
    k = rng.standard_normal((b, hkv, T, d)).astype(np.float32)
    v = rng.standard_normal((b, hkv, T, d)).astype(np.float32)
    kc, ks = quantize_blocks(k, kbits)
    vc, vs = quantize_blocks(v, vbits)
    return (kc, ks, vc, vs), dequantize_blocks(kc, ks, kbits), dequantize_blocks(vc, vs, vbits)


def _gqa_causal_window(rng):
    """GQA 4 × q_len 3 causal, mixed K/V widths, 3 compressed + 2 exact partitions, bias."""
    b, hkv, T, E, d, ql = 1, 2, 45, 20, 64, 3
    codes, kh, vh = _codes(rng, b, hkv, T, d, 4, 2)
    kx = rng.standard_normal((b, hkv, E, d)).astype(np.float32)
    vx = rng.standard_normal((b, hkv, E, d)).astype(np.float32)
    q = rng.standard_normal((b, 4 * hkv, ql, d)).astype(np.float32)
    bias = rng.standard_normal((b, 4 * hkv, ql, T + E)).astype(np.float32)
    kw = dict(k_bits=4, v_bits=2, partition_size=16, k_exact=kx, v_exact=vx, logit_bias=bias)
    cpu, dev = _both((q, *codes), kw)
    np.testing.assert_allclose(dev, cpu, **TOL)
    ref = reference.attention(q, np.concatenate([kh, kx], 2), np.concatenate([vh, vx], 2), d ** -0.5, bias,
                              causal_offset=T + E - ql)
    np.testing.assert_allclose(dev, ref, rtol=2e-5, atol=2e-5)


def _row_chunks(rng):
    """GQA 8 × q_len 5 = 40 query rows per KV row: more than one block holds at d = 64."""
    b, hkv, T, d, ql = 1, 1, 20, 64, 5
    assert 8 * ql > rows_per_block(d)
    codes, kh, vh = _codes(rng, b, hkv, T, d, 3, 3)
    q = rng.standard_normal((b, 8, ql, d)).astype(np.float32)
    cpu, dev = _both((q, *codes), dict(partition_size=16))
    np.testing.assert_allclose(dev, cpu, **TOL)
    ref = reference.attention(q, kh, vh, d ** -0.5, causal_offset=T - ql)
    np.testing.assert_allclose(dev, ref, rtol=2e-5, atol=2e-5)


def _exact_positions_masked(rng, with_bias=True):
    """Exact tokens placed before, between and after the queries' positions: whole tiles
    of a partition are masked for some rows, one exact partition sees nothing at all."""
    b, hkv, T, d, ql = 1, 2, 10, 32, 3
    pos = np.array([21, 21, 20, 21, 10, 11, 12, 13, 14, 15, 16, 17], np.int32)  # queries at 19, 20, 21
    kx = rng.standard_normal((b, hkv, len(pos), d)).astype(np.float32)
    vx = rng.standard_normal((b, hkv, len(pos), d)).astype(np.float32)
    codes, _, _ = _codes(rng, b, hkv, T, d, 3, 3)
    q = rng.standard_normal((b, 2 * hkv, ql, d)).astype(np.float32)
    bias = rng.standard_normal((b, 2 * hkv, ql, T + len(pos))).astype(np.float32)
    kw = dict(partition_size=4, k_exact=kx, v_exact=vx, exact_positions=pos, logit_bias=bias if with_bias else None)
    cpu, dev = _both((q, *codes), kw)
    np.testing.assert_allclose(dev, cpu, **TOL)


def _exact_positions_masked_no_bias(rng):
    """:func:`_exact_positions_masked` without the logit bias (the warp kernel's case)."""
    _exact_positions_masked(rng, with_bias=False)


def _mixed_layout(rng):
    """Per-block widths 4/1/3/2 with one scale per two blocks (fused_attention_rows)."""
    from numba_kv.ops.bitpack import pack_bits
    from numba_kv.ops.hadamard import rotate32

    g, rows, d, T = 2, 6, 128, 37
    cbs = [get_codebook(bits, "maxnorm") for bits in (4, 1, 3, 2)]
    lay = CodeLayout.from_blocks(cbs, scale_group=2)
    idx = [rng.integers(0, 1 << cb.bits, (g, T, 32)).astype(np.uint8) for cb in cbs]
    codes = np.concatenate([pack_bits(ix.reshape(-1, 32), cb.bits).reshape(g, T, -1) for ix, cb in zip(idx, cbs)], 2)
    sbits = rng.uniform(0.5, 2.0, (g, T, 2)).astype(np.float16).view(np.uint16)
    q = rng.standard_normal((g, rows, d)).astype(np.float32)
    empty = np.zeros((g, 0, d), np.float32)

    def run(f):
        return to_host(fused_attention_rows(f(rotate32(q)), f(q), f(codes), f(sbits), f(codes), f(sbits), T, 0,
                                            f(empty), f(empty), 0, f(np.zeros(1, np.int32)), lay, lay, d ** -0.5,
                                            None, T - 3, 3, True, part_size=16))

    np.testing.assert_allclose(run(to_device), run(lambda a: a), **TOL)


def _head_vq_layouts(rng):
    """The head VQ code on both sides (``kv3``'s: pairs of 4 bits for K, quads of 2 bits for V;
    and the other way round) and next to the scalar head code (VQ keys, 3-bit scalar
    values), one norm per vector, at d = 64 and 128, GQA 2 × q_len 3 causal."""
    from numba_kv.ops.headquant import head_codebook

    def layout(code, d):
        kind, bits = code
        return CodeLayout.head_vq(bits, d) if kind == "vq" else CodeLayout.uniform(head_codebook(bits, d), d, d // 32)

    for d, kcode, vcode in ((64, ("vq", 4), ("vq", 2)), (128, ("vq", 2), ("vq", 4)), (128, ("vq", 4), ("s", 3))):
        g, rows, T = 2, 6, 37
        klay, vlay = layout(kcode, d), layout(vcode, d)
        kc, vc = (rng.integers(0, 256, (g, T, d * code[1] // 8)).astype(np.uint8) for code in (kcode, vcode))
        ks, vs = (rng.uniform(0.5, 2.0, (g, T, 1)).astype(np.float16).view(np.uint16) for _ in range(2))
        q = rng.standard_normal((g, rows, d)).astype(np.float32)
        empty = np.zeros((g, 0, d), np.float32)
        outs = []
        for f in (to_device, lambda a: a):
            outs.append(to_host(fused_attention_rows(f(q), f(q), f(kc), f(ks), f(vc), f(vs), T, 0, f(empty), f(empty),
                                                     0, f(np.zeros(1, np.int32)), klay, vlay, d ** -0.5, None, T - 3,
                                                     3, True, part_size=16)))
        np.testing.assert_allclose(*outs, **TOL, err_msg=f"d={d} {kcode} {vcode}")


def _stored_window_dtypes(rng):
    """Exact tokens read in their stored dtype: binary16 bits, and int8 with per-token
    binary16 scales (the caches' windows), several exact partitions after the codes."""
    g, rows, d, T, E = 2, 3, 64, 21, 19
    codes, _, _ = _codes(rng, 1, g, T, d, 3, 3)
    kc, ks, vc, vs = (a[0] for a in codes)
    lay = CodeLayout.uniform(get_codebook(3, "maxnorm"), d)
    q = rng.standard_normal((g, rows, d)).astype(np.float32)
    pos = (T + np.arange(E)).astype(np.int32)
    h16 = rng.standard_normal((2, g, E, d)).astype(np.float16).view(np.uint16)
    i8 = rng.integers(-127, 128, (2, g, E, d)).astype(np.int8)
    s8 = rng.uniform(0.01, 0.05, (2, g, E, 1)).astype(np.float16).view(np.uint16)
    for ke, ve, scales in ((h16[0], h16[1], None), (i8[0], i8[1], (s8[0], s8[1]))):
        def run(f, ke=ke, ve=ve, scales=scales):
            sc = None if scales is None else tuple(f(a) for a in scales)
            return to_host(fused_attention_rows(f(q), f(q), f(kc), f(ks), f(vc), f(vs), T, 0, f(ke), f(ve), E, f(pos),
                                                lay, lay, d ** -0.5, None, T + E - 2, 2, True, part_size=8,
                                                exact_scales=sc))

        np.testing.assert_allclose(run(to_device), run(lambda a: a), **TOL)


def _head_rotation_qjl(rng):
    """Whole-head rotation (d = 128) with the QJL correction, GQA 2 × q_len 2 causal."""
    from numba_kv import qjl_quantize, quantize_head
    from numba_kv.ops.headquant import dequantize_head

    b, hkv, T, d = 1, 2, 23, 128
    k = rng.standard_normal((b, hkv, T, d)).astype(np.float32)
    v = rng.standard_normal((b, hkv, T, d)).astype(np.float32)
    q = rng.standard_normal((b, 2 * hkv, 2, d)).astype(np.float32)
    kc, kn = quantize_head(k, 3)
    vc, vn = quantize_head(v, 2)
    signs, norms = qjl_quantize(k - dequantize_head(kc, kn, 3))
    kw = dict(k_bits=3, v_bits=2, rotation="head", partition_size=8, k_qjl=(signs, norms, None))
    cpu, dev = _both((q, kc, kn, vc, vn), kw)
    np.testing.assert_allclose(dev, cpu, **TOL)


def _head_dim_256(rng):
    """head_dim 256: 8-token tiles, 16 rows per block, exact window after the codes."""
    b, hkv, T, E, d = 1, 1, 19, 3, 256
    codes, _, _ = _codes(rng, b, hkv, T, d, 3, 4)
    kx = rng.standard_normal((b, hkv, E, d)).astype(np.float32)
    vx = rng.standard_normal((b, hkv, E, d)).astype(np.float32)
    q = rng.standard_normal((b, 3, 1, d)).astype(np.float32)
    cpu, dev = _both((q, *codes), dict(k_bits=3, v_bits=4, partition_size=12, k_exact=kx, v_exact=vx))
    np.testing.assert_allclose(dev, cpu, **TOL)


def _decode_cases(rng):
    for case in (_gqa_causal_window, _row_chunks, _exact_positions_masked, _mixed_layout, _stored_window_dtypes,
                 _head_rotation_qjl, _head_dim_256):
        case(rng)


def _paged_ragged(rng):
    """Paged pools, ragged lengths (3, 17, 24 tokens, page_size 8: a partial first page, a
    partial last page, full pages only), GQA 3 × q_len 2 causal, several partitions per
    sequence (and one for the short one): device vs CPU vs oracle.  Every simulated thread is
    an OS thread, so the longest sequence is kept at three pages."""
    for storage in ("pqo-k3v2", "float32"):
        caches = [PagedKVCache(num_pages=16, num_layers=1, num_kv_heads=2, head_dim=32, page_size=8,
                               storage=storage) for _ in range(2)]
        for n in (3, 17, 24):
            k = rng.standard_normal((2, n, 32)).astype(np.float32)
            v = rng.standard_normal((2, n, 32)).astype(np.float32)
            caches[0].append(0, caches[0].allocate_sequence(), k, v)
            caches[1].append(0, caches[1].allocate_sequence(), to_device(k), to_device(v))
        q = rng.standard_normal((3, 6, 2, 32)).astype(np.float32)
        a = caches[0].decode_attention(0, q, partition_size=8)
        b = to_host(caches[1].decode_attention(0, to_device(q), partition_size=8))
        np.testing.assert_allclose(b, a, **TOL, err_msg=storage)
        for i, s in enumerate(caches[0].sequences):
            K, V = caches[0].get_kv(0, s)
            ref = reference.attention(q[i:i + 1], K[None], V[None], 32 ** -0.5, causal_offset=K.shape[1] - 2)
            np.testing.assert_allclose(b[i:i + 1], ref, rtol=2e-5, atol=2e-5, err_msg=storage)


RUNNERS = {"decode_attention": _decode_cases, "merge_partitions": _decode_cases,
           "paged_decode_attention": _paged_ragged, "decode_attention_warp": _stored_window_dtypes,
           "decode_attention_warp_vq": _head_vq_layouts,
           "paged_decode_attention_warp": _paged_ragged}


_CASES = [_gqa_causal_window, _row_chunks, _exact_positions_masked, _mixed_layout, _head_vq_layouts,
          _stored_window_dtypes, _head_rotation_qjl, _head_dim_256, _paged_ragged]
# the cases without a logit bias or QJL correction at head_dim <= 128: what the warp kernels run
_WARP_CASES = [_row_chunks, _exact_positions_masked_no_bias, _mixed_layout, _head_vq_layouts, _stored_window_dtypes,
               _paged_ragged]


@pytest.mark.cuda
@pytest.mark.parametrize("case", _CASES, ids=lambda f: f.__name__.strip("_"))
def test_cooperative_attention_matches_cpu_twin(case):
    """The block kernel (the warp kernel switched off) on every case."""
    with knobs(cuda_warp_attention=0):
        case(np.random.default_rng(17))


@pytest.mark.cuda
@pytest.mark.parametrize("case", _WARP_CASES, ids=lambda f: f.__name__.strip("_"))
def test_warp_attention_matches_cpu_twin(case, monkeypatch):
    """The warp kernel (the default where it applies and no tensor-core kernel does: switched
    off here, tested in test_sim_mma*.py) on the same cases; it must be the kernel that ran."""
    from numba_kv.ops.attention import kernels

    launched = spy_launches(monkeypatch, (kernels, "DECODE_ATTENTION_WARP"), (kernels, "DECODE_ATTENTION_WARP_VQ"),
                            (kernels, "PAGED_DECODE_ATTENTION_WARP"))
    with knobs(cuda_mma_attention=0):
        case(np.random.default_rng(17))
    assert launched, "the warp kernel did not run"


@pytest.mark.cuda
def test_head_dim_beyond_shared_memory_is_a_clear_error():
    """The CUDA kernels hold head_dim <= 512 in static shared memory; beyond it the error
    names the limit (the CPU twin has none)."""
    rng = np.random.default_rng(2)
    codes, _, _ = _codes(rng, 1, 1, 3, 544, 3, 3)
    q = rng.standard_normal((1, 1, 1, 544)).astype(np.float32)
    assert decode_attention(q, *codes).shape == q.shape
    with pytest.raises(ValueError, match="head_dim <= 512"):
        decode_attention(*(to_device(a) for a in (q, *codes)))
