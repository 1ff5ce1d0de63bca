"""QA pass over the head VQ code, the key-mean twins, the exact positions and the int8 window
store: independent NumPy expectations, bad input refused with the argument named."""

import numpy as np
import pytest

from numba_kv.ops.headvq import dequantize_headvq, headvq_codebook, quantize_headvq
from numba_kv.ops.keymean import add_channel_into, channel_mean_into
from numba_kv.ops.positions import exact_positions_into
from numba_kv.reference.headvq import headvq_dequantize, headvq_quantize

from ..conftest import to_device, to_host


# --- head VQ -------------------------------------------------------------------------------
@pytest.mark.parametrize(("d", "bits", "unbiased"), [(32, 2, True), (128, 4, False), (512, 2, False)])
def test_headvq_matches_the_float64_oracle_on_strided_views(d, bits, unbiased):
    rng = np.random.default_rng(d + bits)
    base = rng.standard_normal((3, 5, 2 * d)) * rng.uniform(0.01, 300.0, (3, 5, 1))
    x = base.astype(np.float32)[:, ::2, ::2]  # odd token count, strided on every axis
    codes, norms = quantize_headvq(x, bits, unbiased)
    rc, rn, gap = headvq_quantize(x.reshape(-1, d), headvq_codebook(bits, d), unbiased)
    flat = codes.reshape(rc.shape)
    assert not ((flat != rc) & (gap > 1e-5)).any()  # codes differ only at float32 near-ties
    assert np.abs(norms.reshape(-1).astype(np.int64) - rn.reshape(-1).astype(np.int64)).max() <= 1
    ref = headvq_dequantize(rc, rn, headvq_codebook(bits, d))
    got = dequantize_headvq(codes[:, ::-1], norms[:, ::-1], bits)[:, ::-1]  # negative strides too
    np.testing.assert_allclose(got.reshape(ref.shape), ref, rtol=0, atol=4e-7 * np.abs(ref).max())


@pytest.mark.cuda
@pytest.mark.parametrize("pattern", [0x7C00, 0xFC00, 0x7E00, 0xFFFF])
def test_dequantize_headvq_refuses_nonfinite_norms_on_numba_device_arrays(pattern):
    """Device arrays decoded an Inf/NaN norm without an error (only NumPy and CuPy were read)."""
    codes = np.zeros((2, 16), np.uint8)
    norms = np.full((2, 1), 0x3C00, np.uint16)  # 1.0
    norms[1, 0] = pattern
    with pytest.raises(ValueError, match="norms: expected finite binary16 patterns"):
        dequantize_headvq(to_device(codes), to_device(norms), 4)
    norms[1, 0] = 0x7BFF  # 65504, the largest finite pattern: decodes
    ref = headvq_dequantize(codes, norms, headvq_codebook(4, 32))
    got = to_host(dequantize_headvq(to_device(codes), to_device(norms), 4))
    np.testing.assert_allclose(got, ref, rtol=0, atol=4e-7 * np.abs(ref).max())


# --- key mean -------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(1, 1, 1), (3, 7, 5), (2, 1, 129)])
def test_key_mean_twins_match_numpy(shape):
    rng = np.random.default_rng(sum(shape))
    x = (rng.standard_normal(shape) * 1e3).astype(np.float32)
    m = np.empty((shape[0], 1, shape[2]), np.float32)
    channel_mean_into(x, m)
    np.testing.assert_array_equal(m, x.astype(np.float64).mean(axis=1, keepdims=True).astype(np.float32))
    out = add_channel_into(x, m, -1, np.empty_like(x))
    np.testing.assert_array_equal(out, x - m)
    np.testing.assert_array_equal(add_channel_into(out, m, 1, np.empty_like(x)), out + m)


@pytest.mark.parametrize("x3", [np.zeros((2, 3, 4), np.float16), np.zeros((3, 4), np.float32),
                                np.zeros((2, 3, 4), np.float64)])
def test_key_mean_twins_refuse_a_bad_x3_by_name(x3):
    d = x3.shape[-1]
    with pytest.raises(ValueError, match=r"x3: expected a float32 array of shape \(rows, n, d\)"):
        channel_mean_into(x3, np.zeros((2, 1, d), np.float32))
    out = np.full((2, 3, d), 7.0, np.float32)
    with pytest.raises(ValueError, match=r"x3: expected a float32 array of shape \(rows, n, d\)"):
        add_channel_into(x3, np.zeros((2, 1, d), np.float32), -1, out)
    assert (out == 7.0).all()


# --- exact positions ------------------------------------------------------------------------
@pytest.mark.parametrize(("n_sink", "base", "n_win"), [(0, 0, 0), (3, 10, 4), (0, 5, 1), (4, 0, 0),
                                                        (1, 2**31 - 2, 1)])
def test_exact_positions_match_numpy(n_sink, base, n_win):
    out = np.full(9, -7, np.int32)
    got = exact_positions_into(out, n_sink, base, n_win)
    want = np.concatenate([np.arange(n_sink), np.arange(base, base + n_win)]).astype(np.int32)
    assert got.shape == (max(n_sink + n_win, 1),)
    np.testing.assert_array_equal(got[:n_sink + n_win], want)
    assert (out[n_sink + n_win:] == -7).all()


@pytest.mark.parametrize("counts", [(-1, 0, 2), (2, 0, -1), (0, -3, 1), (0, 2**31 - 1, 2), (0, 2**31, 1)])
def test_exact_positions_refuse_negative_counts_and_int32_overflow(counts):
    """A negative count returned stale entries; positions past 2**31 − 1 wrapped negative."""
    out = np.full(8, -7, np.int32)
    with pytest.raises(ValueError, match="n_sink, base, n_win: expected counts >= 0"):
        exact_positions_into(out, *counts)
    assert (out == -7).all()


def test_exact_positions_refuse_a_2d_out():
    out = np.full((4, 2), -7, np.int32)
    with pytest.raises(ValueError, match="out: expected a 1-D int32 array"):
        exact_positions_into(out, 1, 0, 2)
    assert (out == -7).all()


# --- int8 window store ------------------------------------------------------------------------
@pytest.mark.parametrize(("rot", "signs"), [("head", np.ones(32, np.float32)), ("head", np.ones(64, np.float64)),
                                            ("block", np.ones(0, np.float32)), ("none", np.ones((1, 32), np.float32))])
def test_slide_windows8_refuses_bad_signs(rot, signs):
    """The kernels index ``signs`` unchecked: a short table was read past its end."""
    from numba_kv.caches._window import StorePlan
    from numba_kv.ops.window8 import ROT_BLOCK, ROT_HEAD, ROT_NONE, slide_windows8

    code = {"head": ROT_HEAD, "block": ROT_BLOCK, "none": ROT_NONE}[rot]
    rows, cap, d = 2, 8, 64
    x = np.ones((rows, 1, d), np.float32)
    exk, exv = np.ones((2, rows, cap, d), np.int8)
    exks, exvs = np.full((2, rows, cap, 1), 0x3C00, np.uint16)
    ev = np.zeros((rows, 1, d), np.float32)
    pos = np.full(8, -7, np.int32)
    with pytest.raises(ValueError, match=r"signs: expected float32 \((64|32),\)"):
        slide_windows8(x, x, None, exk, exks, exv, exvs, ev, ev, StorePlan(0, 1, 0, 3, 1), 0, 2, code, signs, pos,
                       (0, 0, 1))
    assert (exk == 1).all() and (exks == 0x3C00).all() and (pos == -7).all() and not ev.any()


def test_dequantize_headvq_check_values_is_a_bool_and_skips_the_norm_pass():
    """``check_values=False`` skips the norms' pass (as ``dequantize_head``'s); a finite
    norm decodes the same either way, and the flag must be a bool."""
    x = np.random.default_rng(77).standard_normal((3, 64)).astype(np.float32)
    codes, norms = quantize_headvq(x, 4)
    np.testing.assert_array_equal(dequantize_headvq(codes, norms, 4, check_values=False),
                                  dequantize_headvq(codes, norms, 4))
    bad = norms.copy()
    bad[1] = 0x7C00
    with pytest.raises(ValueError, match="norms: expected finite binary16 patterns"):
        dequantize_headvq(codes, bad, 4)
    dequantize_headvq(codes, bad, 4, check_values=False)  # the caller vouches: no pass, no error
    with pytest.raises(TypeError, match="check_values: expected a bool"):
        dequantize_headvq(codes, norms, 4, check_values="no")


_F = float(np.finfo(np.float32).max)


@pytest.mark.parametrize("where", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize(("sign", "bias", "want"), [
    (1.0, [_F, 0.0], 1.0),  # logit 2**120 + max: inf − inf was a NaN output
    (-1.0, [-_F, 0.0], 2.0),  # −2**120 − max rounds below −max: that token alone is left out
])
def test_a_logit_bias_near_the_float32_maximum_keeps_the_output_finite(where, sign, bias, want):
    """A finite bias (``finfo.min`` is a common additive mask) plus a logit inside the input
    limits (``|q| <= 2**64``, ``|k| <= 2**21``, scale ``2**30``: ``2**120``) overflowed to ±inf;
    the sums are now clamped to ±max.  Expected: all weight on one token (the float64 oracle
    agrees: ``numba_kv.reference.attention``)."""
    from numba_kv.ops.attention import decode_attention
    from numba_kv.reference import attention

    d = 32
    q = np.full((1, 1, 1, d), sign * 2.0**64, np.float32)
    ke = np.zeros((1, 1, 2, d), np.float32)
    ke[0, 0, 0] = 2.0**21
    ve = np.zeros((1, 1, 2, d), np.float32)
    ve[0, 0, 0], ve[0, 0, 1] = 1.0, 2.0
    kc = np.zeros((1, 1, 0, d * 3 // 8), np.uint8)
    ks = np.zeros((1, 1, 0, 1), np.uint16)
    lb = np.array(bias, np.float32).reshape(1, 1, 1, 2)
    np.testing.assert_allclose(attention(q, ke, ve, 2.0**30, lb), want)
    dev = to_device if where == "cuda" else (lambda a: a)
    out = decode_attention(dev(q), dev(kc), dev(ks), dev(kc), dev(ks), k_exact=dev(ke), v_exact=dev(ve),
                           logit_bias=dev(lb), softmax_scale=2.0**30, causal=False)
    np.testing.assert_array_equal(to_host(out) if where == "cuda" else out, np.full((1, 1, 1, d), want, np.float32))
