"""decode_attention from packed codes equals float64 attention over the dequantized K/V."""

import itertools

import numpy as np
import pytest

from numba_kv import reference
from numba_kv.ops.attention import decode_attention
from numba_kv.ops.blockquant import dequantize_blocks, quantize_blocks
from numba_kv.ops.codebook import get_codebook

GRID = list(itertools.product([1, 31, 32, 33, 1000], [32, 64, 128, 256], [1, 3, 4, 8]))


def rel_err(out, ref):
    return float(np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-30))


def make(rng, b, hkv, t, d, bits=3, kbits=None):
    k = rng.standard_normal((b, hkv, t, d)).astype(np.float32)
    v = rng.standard_normal((b, hkv, t, d)).astype(np.float32)
    k[..., 5 % d] *= 8  # an outlier channel
    kc, ks = quantize_blocks(k, kbits or bits)
    vc, vs = quantize_blocks(v, bits)
    return kc, ks, vc, vs, dequantize_blocks(kc, ks, kbits or bits), dequantize_blocks(vc, vs, bits)


@pytest.mark.parametrize("T, d, groups", GRID, ids=[f"T{t}-d{d}-g{g}" for t, d, g in GRID])
def test_grid_matches_reference(T, d, groups):
    """Every (T, head_dim, group) with q_len, batch, exact window and bias cycled through."""
    i = GRID.index((T, d, groups))
    rng = np.random.default_rng(i)
    q_len = [1, 4][i % 2] if T >= 4 else 1
    b = [1, 2][(i // 2) % 2]
    window = (i // 4) % 2 == 1
    use_bias = (i // 8) % 2 == 1
    hkv = 2
    kc, ks, vc, vs, kh, vh = make(rng, b, hkv, T, d)
    q = rng.standard_normal((b, hkv * groups, q_len, d)).astype(np.float32) * 2
    kx = vx = None
    if window:
        kx = rng.standard_normal((b, hkv, 5, d)).astype(np.float32)
        vx = rng.standard_normal((b, hkv, 5, d)).astype(np.float32)
        kh, vh = np.concatenate([kh, kx], 2), np.concatenate([vh, vx], 2)
    total = kh.shape[2]
    bias = rng.standard_normal((b, hkv * groups, q_len, total)).astype(np.float32) if use_bias else None
    out = decode_attention(q, kc, ks, vc, vs, logit_bias=bias, k_exact=kx, v_exact=vx, partition_size=64)
    ref = reference.attention(q, kh, vh, d ** -0.5, bias, causal_offset=total - q_len)
    assert out.shape == (b, hkv * groups, q_len, d) and out.dtype == np.float32
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("part", [32, 96, 4096, None])
def test_partitioning_does_not_change_result(part):
    rng = np.random.default_rng(1)
    kc, ks, vc, vs, kh, vh = make(rng, 1, 2, 777, 128)
    q = rng.standard_normal((1, 8, 1, 128)).astype(np.float32)
    out = decode_attention(q, kc, ks, vc, vs, partition_size=part)
    assert rel_err(out, reference.attention(q, kh, vh, 128 ** -0.5)) < 1e-5


def test_sinks_and_window_positions_with_causal_queries():
    """Exact tokens at arbitrary positions (sinks first, window last) mask correctly."""
    rng = np.random.default_rng(2)
    kc, ks, vc, vs, kh, vh = make(rng, 1, 1, 20, 64)
    kx = rng.standard_normal((1, 1, 6, 64)).astype(np.float32)
    vx = rng.standard_normal((1, 1, 6, 64)).astype(np.float32)
    # layout by position: 2 sinks (0,1), 20 compressed (2..21) — the op numbers compressed
    # tokens from 0, so shift: sinks at the end of the code range is equivalent; use
    # explicit positions instead: window tokens at 20..23, "sinks" at 24..25 (any order)
    pos = np.array([20, 21, 22, 23, 24, 25], np.int32)
    q = rng.standard_normal((1, 2, 3, 64)).astype(np.float32)
    out = decode_attention(q, kc, ks, vc, vs, k_exact=kx, v_exact=vx, exact_positions=pos)
    ref = reference.attention(q, np.concatenate([kh, kx], 2), np.concatenate([vh, vx], 2), 0.125, causal_offset=23)
    assert rel_err(out, ref) < 1e-5


def test_non_causal_and_asymmetric_bits():
    rng = np.random.default_rng(3)
    kc, ks, vc, vs, kh, vh = make(rng, 1, 2, 50, 64, bits=2, kbits=4)
    q = rng.standard_normal((1, 2, 3, 64)).astype(np.float32)
    out = decode_attention(q, kc, ks, vc, vs, k_bits=4, v_bits=2, causal=False, softmax_scale=0.3)
    assert rel_err(out, reference.attention(q, kh, vh, 0.3)) < 1e-5


def test_huge_bias_masks_tokens():
    rng = np.random.default_rng(4)
    kc, ks, vc, vs, kh, vh = make(rng, 1, 1, 40, 32)
    q = rng.standard_normal((1, 1, 1, 32)).astype(np.float32)
    bias = np.zeros((1, 1, 1, 40), np.float32)
    bias[..., :-1] = -1e30  # only the last token survives
    out = decode_attention(q, kc, ks, vc, vs, logit_bias=bias)
    np.testing.assert_allclose(out[0, 0, 0], vh[0, 0, -1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mutate, exc, word", [
    (lambda a: a.update(q=a["q"][:, :3]), ValueError, "q"),
    (lambda a: a.update(q=a["q"][..., :48]), ValueError, "q"),
    (lambda a: a.update(k_codes=a["k_codes"][..., :10]), ValueError, "k_codes"),
    (lambda a: a.update(k_codes=a["k_codes"][:, :, :5]), ValueError, "k_scales"),
    (lambda a: a.update(v_scales=a["v_scales"].astype(np.int32)), TypeError, "v_scales"),
    (lambda a: a.update(logit_bias=np.zeros((1, 4, 1, 3), np.float32)), ValueError, "logit_bias"),
    (lambda a: a.update(k_exact=np.zeros((1, 2, 3, 64), np.float32)), ValueError, "k_exact"),
    (lambda a: a.update(k_bits=7), ValueError, "k_bits"),
    (lambda a: a.update(q=np.full((1, 4, 1, 64), np.nan, np.float32)), ValueError, "q"),
    # a NaN scale returned zeros, an infinite or huge one NaN, 0 and negatives went through
    (lambda a: a.update(softmax_scale=float("nan")), ValueError, r"^softmax_scale: expected a float in \(0, 2\*\*30\]"),
    (lambda a: a.update(softmax_scale=1e38), ValueError, r"^softmax_scale: expected a float in \(0, 2\*\*30\]"),
    (lambda a: a.update(softmax_scale=-0.125), ValueError, r"^softmax_scale: expected a float in \(0, 2\*\*30\]"),
    (lambda a: a.update(softmax_scale="0.125"), TypeError, "^softmax_scale"),
    # 0 raised ZeroDivisionError, -1 "negative dimensions are not allowed"
    (lambda a: a.update(partition_size=0), ValueError, r"^partition_size: expected an int >= 1"),
    (lambda a: a.update(partition_size=-1), ValueError, r"^partition_size: expected an int >= 1"),
    (lambda a: a.update(partition_size=2.0), TypeError, r"^partition_size: expected an int >= 1"),
])
def test_bad_input(mutate, exc, word):
    rng = np.random.default_rng(0)
    kc, ks, vc, vs, _, _ = make(rng, 1, 2, 10, 64)
    args = dict(q=rng.standard_normal((1, 4, 1, 64)).astype(np.float32), k_codes=kc, k_scales=ks, v_codes=vc,
                v_scales=vs)
    mutate(args)
    with pytest.raises(exc, match=word):
        decode_attention(**args)


def _exact_args(rng, E=2):
    kc, ks, vc, vs, kh, vh = make(rng, 1, 2, 10, 64)
    kx, vx = rng.standard_normal((2, 1, 2, E, 64)).astype(np.float32)
    q = rng.standard_normal((1, 4, 1, 64)).astype(np.float32)
    return dict(q=q, k_codes=kc, k_scales=ks, v_codes=vc, v_scales=vs, k_exact=kx, v_exact=vx), kh, vh


def _set(a, name, index, value):
    a[name] = a[name].copy()
    a[name][index] = value


@pytest.mark.parametrize("mutate, word", [
    # read the logit bias out of bounds: a wrong output, or a crash for 10**9 (total = 12)
    (lambda a: a.update(exact_positions=np.array([10, 12])), r"^exact_positions: expected positions in \[0, 12\)"),
    (lambda a: a.update(exact_positions=np.array([10, 10 ** 9])), r"^exact_positions: expected positions in"),
    (lambda a: a.update(exact_positions=np.array([-1, 11])), r"^exact_positions: expected positions in"),
    # finite, but the sums or logits left float32: inf, or a wrong answer
    (lambda a: _set(a, "v_exact", (0, 0, 1, 3), 3e38), r"^v_exact: expected \|v_exact\| <= 2\*\*21 .*got max 3e\+38"),
    (lambda a: _set(a, "k_exact", (0, 1, 0, 0), -2.0 ** 21 * 1.001), r"^k_exact: expected \|k_exact\| <= 2\*\*21"),
    (lambda a: _set(a, "q", (0, 2, 0, 5), 2.0 ** 65), r"^q: expected \|q\| <= 2\*\*64"),
    # binary16 Inf / NaN scale patterns decoded as 65536 / 98304 (the sign bit is the outlier flag)
    (lambda a: _set(a, "k_scales", (0, 1, 3, 0), 0x7C00), r"^k_scales: expected finite binary16 bit patterns"),
    (lambda a: _set(a, "v_scales", (0, 0, 9, 1), 0xFE00), r"^v_scales: expected finite binary16 bit patterns"),
])
def test_values_that_would_leave_the_arrays_or_float32_are_refused(mutate, word):
    args, _, _ = _exact_args(np.random.default_rng(0))
    mutate(args)
    with pytest.raises(ValueError, match=word):
        decode_attention(**args, logit_bias=np.zeros((1, 4, 1, 12), np.float32))


def test_check_values_false_skips_the_value_reads_not_the_addressing():
    """``check_values=False`` trusts the values (an Inf scale pattern goes to the kernels) but
    still refuses positions that would read outside the logit bias."""
    args, _, _ = _exact_args(np.random.default_rng(2))
    good = decode_attention(**args)
    np.testing.assert_array_equal(decode_attention(**args, check_values=False), good)
    _set(args, "v_scales", (0, 0, 9, 1), 0x7C00)
    with pytest.raises(ValueError, match="^v_scales"):
        decode_attention(**args)
    decode_attention(**args, check_values=False)  # not read: the caller vouches
    with pytest.raises(ValueError, match=r"^exact_positions: expected positions in \[0, 12\)"):
        decode_attention(**args, check_values=False, exact_positions=np.array([10, 10 ** 9]),
                         logit_bias=np.zeros((1, 4, 1, 12), np.float32))


def test_exact_tokens_at_the_limits_match_the_reference():
    """Exact tokens at ±2**21 (the largest accepted), positions in any order or shared by two
    tokens or inside the codes' range: finite and equal to the float64 oracle."""
    rng = np.random.default_rng(1)
    args, kh, vh = _exact_args(rng, E=3)
    args["v_exact"][0, 1, 2, :] = 2.0 ** 21
    args["k_exact"][0, 0, 1, 7] = -(2.0 ** 21)
    for pos in ([12, 10, 11], [10, 10, 12], [0, 11, 12]):
        bias = rng.standard_normal((1, 4, 1, 13)).astype(np.float32)
        out = decode_attention(**args, exact_positions=np.array(pos), logit_bias=bias, causal=False)
        by_token = bias[..., np.concatenate([np.arange(10), pos])]  # the bias of each token's position
        ref = reference.attention(args["q"], np.concatenate([kh, args["k_exact"]], 2),
                                  np.concatenate([vh, args["v_exact"]], 2), 0.125, logit_bias=by_token)
        assert np.isfinite(out).all() and rel_err(out, ref) < 1e-5


# --- whole-head rotation and the QJL correction through the public op ------------------------
def _qjl_case(rng, d=64, T=90):
    from numba_kv import qjl_quantize

    k = rng.standard_normal((1, 2, T, d)).astype(np.float32)
    v = rng.standard_normal((1, 2, T, d)).astype(np.float32)
    q = rng.standard_normal((1, 4, 1, d)).astype(np.float32)
    kc, ks = quantize_blocks(k, 2, "l2")
    vc, vs = quantize_blocks(v, 3)
    khat = dequantize_blocks(kc, ks, 2, "l2")
    signs, norms = qjl_quantize(k - khat)
    return q, k, v, kc, ks, vc, vs, khat, signs, norms


def test_decode_attention_with_qjl_equals_dequantized_plus_bias(rng):
    from numba_kv import make_sketch, qjl_inner_product

    q, k, v, kc, ks, vc, vs, khat, signs, norms = _qjl_case(rng)
    d = q.shape[-1]
    out = decode_attention(q, kc, ks, vc, vs, k_bits=2, v_bits=3, norm_mode="l2", causal=False,
                           k_qjl=(signs, norms, None), v_codebook=get_codebook(3, "maxnorm"))
    # bias in scaled-logit units: softmax_scale · ‖r‖·√(π/2)/m·⟨S q, σ⟩, per query head's KV head
    qg = q[0, :, 0].reshape(2, 2, d)  # [hkv, group, d]
    corr = qjl_inner_product(qg, signs[0], norms[0], make_sketch(d))  # [hkv, group, T]
    bias = (d ** -0.5 * corr).reshape(1, 4, 1, -1)
    ref = reference.attention(q, khat, dequantize_blocks(vc, vs, 3), d ** -0.5, bias)
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-6)
    plain = decode_attention(q, kc, ks, vc, vs, k_bits=2, v_bits=3, norm_mode="l2", causal=False,
                             v_codebook=get_codebook(3, "maxnorm"))
    assert np.abs(out - plain).max() > 1e-3  # the correction is really applied


@pytest.mark.parametrize("kb, vb", [(4, 3), (5, 4), (3, 5), (5, 5)])
def test_decode_attention_head_rotation(rng, kb, vb):
    from numba_kv import dequantize_head, quantize_head

    d, T = 128, 70
    k = rng.standard_normal((1, 2, T, d)).astype(np.float32)
    v = rng.standard_normal((1, 2, T, d)).astype(np.float32)
    q = rng.standard_normal((1, 6, 2, d)).astype(np.float32)
    kc, kn = quantize_head(k, kb, unbiased=True)
    vc, vn = quantize_head(v, vb)
    out = decode_attention(q, kc, kn, vc, vn, k_bits=kb, v_bits=vb, rotation="head", partition_size=16)
    ref = reference.attention(q, dequantize_head(kc, kn, kb), dequantize_head(vc, vn, vb), d ** -0.5,
                              causal_offset=T - 2)
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-6)
    if max(kb, vb) == 5:  # 5-bit codebooks exist for the whole-head rotation only
        with pytest.raises(ValueError, match=r"^[kv]_bits: expected an int in 1..4 \(5 needs rotation='head'\)"):
            decode_attention(q, kc, kn, vc, vn, k_bits=kb, v_bits=vb, norm_mode="l2")
        with pytest.raises(ValueError, match=r"^k_bits: expected an int in 1..5 with rotation='head', got 6"):
            decode_attention(q, kc, kn, vc, vn, k_bits=6, v_bits=vb, rotation="head")


def test_inf_and_nan_norm_patterns_are_refused(rng):
    """Whole-head norms and QJL residual norms are binary16 patterns too: an Inf/NaN one is
    named (it was decoded as a finite number, or fed the QJL correction)."""
    from numba_kv import quantize_head

    k = rng.standard_normal((1, 2, 20, 64)).astype(np.float32)
    q = rng.standard_normal((1, 4, 1, 64)).astype(np.float32)
    kc, kn = quantize_head(k, 4)
    bad = kn.copy()
    bad[0, 1, 7, 0] = 0x7E00
    with pytest.raises(ValueError, match=r"^v_scales: expected finite binary16 bit patterns"):
        decode_attention(q, kc, kn, kc, bad, k_bits=4, v_bits=4, rotation="head")
    q, k, v, kc, ks, vc, vs, khat, signs, norms = _qjl_case(rng)
    norms = norms.copy()
    norms[0, 0, 3] = 0xFC00  # -Inf
    with pytest.raises(ValueError, match=r"^k_qjl\[1\]: expected finite binary16 bit patterns"):
        decode_attention(q, kc, ks, vc, vs, k_bits=2, v_bits=3, norm_mode="l2", k_qjl=(signs, norms, None),
                         v_codebook=get_codebook(3, "maxnorm"))


@pytest.mark.parametrize("kw, word", [
    (dict(rotation="full"), "rotation"),
    (dict(k_qjl=[1, 2, 3]), "k_qjl"),
    (dict(k_qjl="signs"), "k_qjl"),
])
def test_decode_attention_bad_modes(rng, kw, word):
    q, k, v, kc, ks, vc, vs, khat, signs, norms = _qjl_case(rng)
    with pytest.raises((ValueError, TypeError), match=word):
        decode_attention(q, kc, ks, vc, vs, k_bits=2, **kw)


def test_decode_attention_bad_qjl_shapes(rng):
    q, k, v, kc, ks, vc, vs, khat, signs, norms = _qjl_case(rng)
    with pytest.raises(ValueError, match=r"^k_qjl\[0\]"):
        decode_attention(q, kc, ks, vc, vs, k_bits=2, k_qjl=(signs[:, :, :5], norms, None))
    with pytest.raises(ValueError, match=r"^k_qjl\[1\]"):
        decode_attention(q, kc, ks, vc, vs, k_bits=2, k_qjl=(signs, norms[:, :1], None))
    with pytest.raises(TypeError, match=r"^k_qjl\[0\]"):
        decode_attention(q, kc, ks, vc, vs, k_bits=2, k_qjl=(signs.astype(np.int8), norms, None))
    with pytest.raises(ValueError, match=r"^k_qjl\[2\]: expected 64 rows"):
        decode_attention(q, kc, ks, vc, vs, k_bits=2, k_qjl=(signs, norms, np.zeros((8, 64), np.float32)))


# --- every code width and layout the CPU token-lane tiles decode ---------------------------------
@pytest.mark.parametrize("kbits, vbits", [(1, 1), (2, 2), (3, 3), (4, 4), (1, 4), (4, 2)])
@pytest.mark.parametrize("T, part", [(5, None), (45, 32), (77, 64), (300, None)])
def test_every_width_and_short_tiles(kbits, vbits, T, part):
    """1–4 bit keys and values, tokens not a multiple of the tile, several partitions; GQA
    group of 4 and of 3 (a row remainder) in one call: vs float64 attention over the dequantized K/V."""
    rng = np.random.default_rng(100 * kbits + 10 * vbits + T)
    kc, ks, vc, vs, kh, vh = make(rng, 1, 2, T, 64, bits=vbits, kbits=kbits)
    for groups in (4, 3):
        q = rng.standard_normal((1, 2 * groups, 1, 64)).astype(np.float32) * 2
        out = decode_attention(q, kc, ks, vc, vs, k_bits=kbits, v_bits=vbits, partition_size=part)
        ref = reference.attention(q, kh, vh, 64 ** -0.5, causal_offset=T - 1)
        assert rel_err(out, ref) < 1e-5, (groups, rel_err(out, ref))


def test_mixed_block_widths_and_shared_scale():
    """A CodeLayout with a different width and codebook per 32-block (channel splits) and one
    scale per two blocks, through fused_attention_rows, vs a NumPy decode of the same bytes."""
    from numba_kv.ops.attention import CodeLayout, fused_attention_rows
    from numba_kv.ops.bitpack import pack_bits
    from numba_kv.ops.hadamard import rotate32

    rng = np.random.default_rng(7)
    g, rows, d, T = 3, 5, 128, 83
    cbs = [get_codebook(b, "maxnorm") for b in (4, 2, 3, 1)]
    lay = CodeLayout.from_blocks(cbs, scale_group=2)
    idx = [rng.integers(0, 1 << cb.bits, (g, T, 32)).astype(np.uint8) for cb in cbs]
    codes = np.concatenate([pack_bits(ix.reshape(-1, 32), cb.bits).reshape(g, T, -1) for ix, cb in zip(idx, cbs)], 2)
    scales = rng.uniform(0.5, 2.0, (g, T, 2)).astype(np.float16)
    vals = np.concatenate([cb.centroids[ix] * scales[..., [b // 2]].astype(np.float32)
                           for b, (ix, cb) in enumerate(zip(idx, cbs))], 2)  # rotated-domain K/V
    sbits = scales.view(np.uint16)
    q = rng.standard_normal((g, rows, d)).astype(np.float32)
    qr = rotate32(q)
    empty = np.zeros((g, 0, d), np.float32)
    out = fused_attention_rows(qr, q, codes, sbits, codes, sbits, T, 0, empty, empty, 0, np.zeros(0, np.int32),
                               lay, lay, d ** -0.5, None, T - 1, 1, False, part_size=32)
    # reference in the rotated domain: softmax(qr·k̂) @ v̂, then inverse-rotate every 32-block
    s = np.einsum("grd,gtd->grt", qr.astype(np.float64), vals) * d ** -0.5
    p = np.exp(s - s.max(-1, keepdims=True))
    acc = np.einsum("grt,gtd->grd", p / p.sum(-1, keepdims=True), vals).astype(np.float32)
    ref = rotate32(acc, inverse=True)
    assert rel_err(out, ref) < 1e-5


def test_qjl_sketch_width_not_a_multiple_of_32(rng):
    """m = 40 sign bits per token (a partial last word) through the fused correction."""
    from numba_kv import make_sketch, qjl_inner_product, qjl_quantize

    d, T = 64, 50
    k = rng.standard_normal((1, 2, T, d)).astype(np.float32)
    v = rng.standard_normal((1, 2, T, d)).astype(np.float32)
    q = rng.standard_normal((1, 4, 1, d)).astype(np.float32)
    kc, ks = quantize_blocks(k, 3)
    vc, vs = quantize_blocks(v, 3)
    khat = dequantize_blocks(kc, ks, 3)
    sk = make_sketch(d, 40)
    signs, norms = qjl_quantize(k - khat, sk)
    out = decode_attention(q, kc, ks, vc, vs, causal=False, k_qjl=(signs, norms, sk), partition_size=32)
    corr = qjl_inner_product(q[0, :, 0].reshape(2, 2, d), signs[0], norms[0], sk)
    bias = (d ** -0.5 * corr).reshape(1, 4, 1, -1)
    ref = reference.attention(q, khat, dequantize_blocks(vc, vs, 3), d ** -0.5, bias)
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-6)


def _stored_window(rng, g, E, d):
    """Exact tokens in the three stored forms with the same float32 values: float32,
    binary16 (values rounded to it first) and int8 with per-token binary16 scales
    (``q·s``, as the caches' int8 window stores them)."""
    codes8 = rng.integers(-127, 128, (g, E, d)).astype(np.int8)
    s16 = rng.uniform(0.01, 0.05, (g, E, 1)).astype(np.float16)
    vals8 = codes8.astype(np.float32) * s16.astype(np.float32)  # exact in float32
    h16 = rng.standard_normal((g, E, d)).astype(np.float16)
    return codes8, s16.view(np.uint16), vals8, h16


@pytest.mark.parametrize("E", [1, 7, 40])
def test_exact_tokens_read_in_their_stored_dtype(rng, E):
    """fused_attention_rows reads float16 (or its uint16 bits) and int8 + binary16-scale
    exact tokens in place: bit-identical to passing their float32 values, and equal to the
    float64 oracle over those values."""
    from numba_kv.ops.attention import CodeLayout, fused_attention_rows
    from numba_kv.ops.hadamard import rotate32

    g, rows, d, T = 2, 3, 64, 20
    kc, ks, vc, vs, kh, vh = make(rng, 1, g, T, d)
    lay = CodeLayout.uniform(get_codebook(3, "maxnorm"), d)
    q = rng.standard_normal((g, rows, d)).astype(np.float32)
    pos = (T + np.arange(E)).astype(np.int32)
    codes8, s8, vals8, h16 = _stored_window(rng, g, E, d)

    def run(ke, ve, scales=None):
        return fused_attention_rows(rotate32(q), q, kc[0], ks[0], vc[0], vs[0], T, 0, ke, ve, E, pos, lay, lay,
                                    d ** -0.5, None, T + E - 1, 1, part_size=128, exact_scales=scales)

    f16 = run(h16, h16[:, ::-1].copy())
    np.testing.assert_array_equal(run(h16.view(np.uint16), h16[:, ::-1].copy().view(np.uint16)), f16)
    np.testing.assert_array_equal(run(h16.astype(np.float32), h16[:, ::-1].astype(np.float32)), f16)
    i8 = run(codes8, codes8[:, ::-1].copy(), (s8, s8[:, ::-1].copy()))
    np.testing.assert_array_equal(run(vals8, vals8[:, ::-1].copy()), i8)
    for out, ke in ((f16, h16.astype(np.float32)), (i8, vals8)):
        ve = ke[:, ::-1]
        ref = reference.attention(q[None], np.concatenate([kh[0], ke], 1)[None], np.concatenate([vh[0], ve], 1)[None],
                                  d ** -0.5)[0]
        assert rel_err(out, ref) < 1e-5


def test_exact_tokens_of_unsupported_dtype_are_refused(rng):
    from numba_kv.ops.attention import CodeLayout, fused_attention_rows

    g, d, T = 1, 32, 4
    kc, ks, vc, vs, _, _ = make(rng, 1, g, T, d)
    lay = CodeLayout.uniform(get_codebook(3, "maxnorm"), d)
    q = rng.standard_normal((g, 1, d)).astype(np.float32)
    pos = np.array([T], np.int32)

    def run(ke, scales=None):
        return fused_attention_rows(q, q, kc[0], ks[0], vc[0], vs[0], T, 0, ke, ke, 1, pos, lay, lay, 1.0, None, T,
                                    1, exact_scales=scales)

    with pytest.raises(TypeError, match="k_exact: expected float32, float16"):
        run(np.zeros((g, 1, d), np.float64))
    with pytest.raises(ValueError, match="exact_scales: int8 exact tokens need"):
        run(np.zeros((g, 1, d), np.int8))


def test_warp_kernel_dispatch_rules():
    """The warp kernel runs on CUDA without a logit bias or QJL correction at head_dim 32, 64
    or 128 with whole warps per block; the knob switches it off; anything else runs the
    block kernel."""
    from numba_kv import knobs
    from numba_kv.ops.attention import use_warp_kernel

    assert use_warp_kernel("cuda", 128, False, False)
    assert use_warp_kernel("cuda", 32, False, False)
    assert not use_warp_kernel("cpu", 128, False, False)
    assert not use_warp_kernel("cuda", 128, True, False)
    assert not use_warp_kernel("cuda", 128, False, True)
    assert not use_warp_kernel("cuda", 256, False, False)
    assert not use_warp_kernel("cuda", 96, False, False)
    with knobs(cuda_warp_attention=0):
        assert not use_warp_kernel("cuda", 128, False, False)
    with knobs(cuda_threads=96):
        assert use_warp_kernel("cuda", 128, False, False)


def test_warp_partition_size_formula():
    """About n_rows·T/16384 tokens per warp, in multiples of 32 within 64..1024."""
    from numba_kv.ops.attention import default_partition_size

    assert default_partition_size(131072, 64, "cuda", warp=True) == 512      # 8·8 rows × 128K
    assert default_partition_size(131072, 256, "cuda", warp=True) == 1024    # capped
    assert default_partition_size(4096, 8, "cuda", warp=True) == 64          # floor
    assert default_partition_size(100_000, 10, "cuda", warp=True) == 64      # ceil(61.03) -> 64
    assert default_partition_size(300_000, 10, "cuda", warp=True) == 192     # ceil(183.1) -> 192
    assert default_partition_size(4096, 8, "cuda") == 256                    # the block kernel


def test_a_plan_in_use_is_never_the_one_the_plan_cache_drops(monkeypatch):
    """The plan cache keeps the most recently used plans (dropping a plan in use would bind its
    layers again every time: a new workspace, a CUDA graph of the step captured again); one
    plan per key also under concurrent lookups."""
    import threading

    from numba_kv.ops.attention import plan as plan_module

    monkeypatch.setattr(plan_module, "_PLANS", {})
    monkeypatch.setattr(plan_module, "MAX_PLANS", 4)
    q = np.zeros((2, 3, 64), np.float32)

    def get(rows):
        return plan_module.attention_plan(q, paged=False, n_g=2, rows=rows, d=64, klayout=None, vlayout=None,
                                          v_width=0)

    hot = get(3)
    for rows in range(4, 20):  # many other shapes, the hot one asked for in between
        get(rows)
        assert get(3) is hot
    assert len(plan_module._PLANS) == 4
    seen: list = []
    threads = [threading.Thread(target=lambda: seen.extend(get(99) for _ in range(200))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(p) for p in seen}) == 1


@pytest.mark.parametrize("tokens", [1, 100, 4096, 32768, 131072, 10 ** 6])
@pytest.mark.parametrize("rows", [1, 8, 64, 256])
def test_mma_partitions_cap_the_merge(tokens, rows):
    """The tensor-core kernel's partitions: multiples of 64 in [128, 2048]; at most
    ``ceil(0.8·√T)`` a KV row (the merge's share: ``√(a/b)`` with ``a`` = 0.068 µs a token a
    warp fitted on an H200, ``b`` ≈ 0.1 µs a partition for the lane-parallel merge) unless
    that needs more than 2048 tokens a partition; otherwise about 3,200 warps in all."""
    import math

    from numba_kv.ops.attention.mma import mma_partition_size

    per = mma_partition_size(tokens, rows)
    assert per % 64 == 0 and 128 <= per <= 2048
    parts = -(-tokens // per)
    cap = math.ceil(0.8 * math.sqrt(tokens))
    assert parts <= cap or per == 2048
    if per > 128 and per < 2048:  # no longer than one of the two rules asks
        assert per - 64 < max(-(-rows * tokens // 3200), -(-tokens // cap))


#: the resident blocks of the tensor-core kernel on an H200: 132 SMs × 3 blocks of 128 threads
#: (168 registers; the driver's occupancy in the 2026-11-30 run)
H200_RESIDENT = 396


@pytest.mark.parametrize("tokens, rows, n_exact, want, waves", [
    # worked by hand from the model (cost = waves·(L + 32) + 1.5·P, L a multiple of 64):
    # 256 rows, one wave = 1.55 blocks a row: 2 waves need ≤ 3 blocks (≤ 12 partitions, L ≥
    # 2731), cost 2·2784 + 18; 3 waves (L = 2048: the rule before, 1,024 blocks) 6,264;
    # 4 waves (≤ 24 partitions, L = 1408) 5,796; 1 wave needs L = 8192
    (32768, 256, 0, 2752, 2),
    # 64 rows: one wave holds 6 blocks a row (24 partitions, L = 1408: 1,476) against two
    # waves of L = 704 (the rule before: 768 blocks, 1,544)
    (32768, 64, 0, 1408, 1),
    # batch 1: every length fits one wave; the merge's 1.5 a partition against a tile's
    # 16 tokens keeps the floor (L = 128: 160 + 49.5; L = 192: 224 + 34.5)
    (4096, 8, 36, 128, 1),
])
def test_mma_partitions_fill_whole_waves(tokens, rows, n_exact, want, waves):
    """With the resident blocks known, the tensor-core kernel's partition length is the one the
    wave model prices lowest: grids of whole waves (a wave lasts as long as its longest
    partition), checked against hand-worked cases."""
    from numba_kv.ops.attention.mma import mma_partition_size

    per = mma_partition_size(tokens, rows, n_exact, H200_RESIDENT)
    assert per == want
    parts = -(-tokens // per) + -(-n_exact // per)
    blocks = rows * -(-parts // 4)
    assert -(-blocks // H200_RESIDENT) == waves


@pytest.mark.parametrize("tokens", [1, 100, 4096, 32768, 131072, 10 ** 6])
@pytest.mark.parametrize("rows", [1, 8, 64, 256, 2048])
@pytest.mark.parametrize("resident", [108 * 4, 132 * 2, H200_RESIDENT])
def test_mma_wave_partitions_are_the_cheapest_length(tokens, rows, resident):
    """Every length the model may pick (multiples of 64 from 128 up to the row's length
    rounded up, at most 8192) costs at least as much as the one picked, and a longer one
    costs more: the search misses no length and prefers fewer partitions on ties."""
    from numba_kv.ops.attention.mma import mma_partition_size

    def cost(size):
        parts = -(-tokens // size)
        waves = -(-rows * -(-parts // 4) // resident)
        return waves * (size + 32) + 1.5 * parts

    per = mma_partition_size(tokens, rows, 0, resident)
    top = max(128, min(8192, -(-tokens // 64) * 64))
    assert per % 64 == 0 and 128 <= per <= top
    sizes = range(128, top + 1, 64)
    assert all(cost(s) >= cost(per) for s in sizes)
    assert all(cost(s) > cost(per) for s in sizes if s > per)


def test_plan_counts_resident_blocks_once_from_the_launch_arguments():
    """:meth:`AttentionPlan.resident_blocks` compiles the overload the launch's arguments
    select and asks the driver's occupancy at the kernel's 128 threads, once per kernel;
    a failing query gives ``None`` (the rule without waves), and the wave model sizes the
    tensor-core kernel's partitions from the count."""
    from types import SimpleNamespace

    from numba_kv.ops.attention import plan as plan_module
    from numba_kv.ops.attention.mma import mma_partition_size

    asked: list = []

    class Compiled:
        def max_cooperative_grid_blocks(self, threads):
            asked.append(threads)
            return H200_RESIDENT

    class Dispatcher:
        def typeof_pyval(self, a):
            return type(a).__name__

        def compile(self, types):
            asked.append(types)
            return Compiled()

    class Broken(Dispatcher):
        def compile(self, types):
            raise RuntimeError("no driver")

    probes: list = []

    def probe():
        probes.append(1)
        return (np.zeros(1, np.float32), 3, True)

    q = np.zeros((64, 4, 128), np.float32)
    plan = plan_module.AttentionPlan(q, paged=False, n_g=64, rows=4, d=128, klayout=None, vlayout=None, v_width=0)
    dispatcher, broken_dispatcher = Dispatcher(), Broken()
    mma = SimpleNamespace(name="decode_attention_mma", build_for=lambda cc: dispatcher)
    assert plan.resident_blocks(mma, probe) == H200_RESIDENT
    assert plan.resident_blocks(mma, probe) == H200_RESIDENT
    assert probes == [1] and asked == [("ndarray", "int", "bool"), 128]
    plan.wave_partitions = True  # (a CPU plan has it off: the probe is the GPU's)
    assert plan.partition_size(32768, mma, 0, probe) == mma_partition_size(32768, 64, 0, H200_RESIDENT) == 1408
    plan.wave_partitions = False
    assert plan.partition_size(32768, mma, 0, probe) == mma_partition_size(32768, 64) == 704
    broken = SimpleNamespace(name="paged_decode_attention_mma", build_for=lambda cc: broken_dispatcher)
    assert plan.resident_blocks(broken, probe) is None


@pytest.mark.parametrize("causal", ["no", 0, None, np.array([True])])
def test_causal_must_be_a_bool(rng, causal):
    """A truthy ``"no"`` once meant causal (and ``0``/``None`` non-causal) without a word."""
    q = rng.standard_normal((1, 2, 2, 32)).astype(np.float32)
    kc, ks = quantize_blocks(rng.standard_normal((1, 1, 5, 32)).astype(np.float32), 3)
    vc, vs = quantize_blocks(rng.standard_normal((1, 1, 5, 32)).astype(np.float32), 3)
    with pytest.raises(TypeError, match="causal: expected a bool"):
        decode_attention(q, kc, ks, vc, vs, causal=causal)
    assert decode_attention(q, kc, ks, vc, vs, causal=np.bool_(False)).shape == (1, 2, 2, 32)


def test_messages_name_the_arguments_the_caller_passed(rng):
    """``bits=9`` was reported as ``k_bits`` (not passed), ``v_exact`` alone as ``k_exact``, zero
    KV heads as a problem of ``q``, and the parts of ``k_qjl`` under names ``decode_attention``
    does not have (``k_qjl_signs``, ``sketch``)."""
    k, v = (rng.standard_normal((1, 2, 40, 64)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((1, 4, 1, 64)).astype(np.float32)
    kc, ks = quantize_blocks(k, 3)
    vc, vs = quantize_blocks(v, 3)
    with pytest.raises(ValueError, match=r"^bits: expected an int in 1..4 \(5 needs rotation='head'\), got 9$"):
        decode_attention(q, kc, ks, vc, vs, bits=9)
    with pytest.raises(TypeError, match=r"^bits: expected an int in 1..4 .*, got bool True$"):
        decode_attention(q, kc, ks, vc, vs, bits=True)
    ve = rng.standard_normal((1, 2, 3, 64)).astype(np.float32)
    with pytest.raises(ValueError, match="^k_exact: expected an array given together with v_exact, got None$"):
        decode_attention(q, kc, ks, vc, vs, v_exact=ve)
    with pytest.raises(ValueError, match=r"^k_codes: expected num_kv_heads >= 1 \(axis 1\)"):
        decode_attention(q, kc[:, :0], ks[:, :0], vc[:, :0], vs[:, :0])
    from numba_kv import qjl_quantize

    signs, norms = qjl_quantize(k)
    with pytest.raises(TypeError, match=r"^k_qjl\[2\]: expected dtype float16, float32 or float64, got int32$"):
        decode_attention(q, kc, ks, vc, vs, k_qjl=(signs, norms, np.ones((64, 64), np.int32)))
    with pytest.raises(TypeError, match=r"^k_qjl\[0\]: "):
        decode_attention(q, kc, ks, vc, vs, k_qjl=([1], norms, None))


def test_exact_positions_of_a_float_dtype_is_a_type_error():
    """Positions of a float dtype are the wrong type (TypeError, the library's rule for
    dtypes); of the wrong length, a ValueError; both name ``exact_positions``."""
    args, _, _ = _exact_args(np.random.default_rng(2))
    with pytest.raises(TypeError, match=r"^exact_positions: expected an int array of shape \(2,\), got float64"):
        decode_attention(**args, exact_positions=np.array([10.0, 11.0]))
    with pytest.raises(ValueError, match=r"^exact_positions: expected an int array of shape \(2,\), got int64 \(3,\)"):
        decode_attention(**args, exact_positions=np.array([9, 10, 11]))
