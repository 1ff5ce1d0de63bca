"""Fuzzing the public ops with hypothesis.

Inputs: shapes with empty and size-1 axes, valid and invalid last axes, C / Fortran /
strided / negative-stride views, float16/32/64 and wrong dtypes, magnitudes from subnormal
to 1e38.  Each call must either match an independent NumPy oracle
(:mod:`numba_kv.reference` or a NumPy re-implementation here) or raise ``TypeError`` /
``ValueError`` whose message names the offending argument.

Where an op's binary16 output cannot hold the result (a block scale or norm above 65504),
the op must raise; :func:`test_public_quantizers_reject_out_of_range` pins that (the ops
call :func:`numba_kv._validate.check_f16_result`).  The fuzz test itself skips the oracle
comparison for those inputs and only requires "raises a clear error or returns finite".
"""

import numpy as np
import pytest
import scipy.linalg
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from numba_kv import (
    dequantize_blocks,
    dequantize_head,
    get_codebook,
    make_sketch,
    pack_bits,
    qjl_quantize,
    quantize_blocks,
    quantize_head,
    reference,
    rotate32,
    rotate_head,
    unpack_bits,
)
from numba_kv.ops import headquant as hq

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
F16_MAX = 65504.0
MAGNITUDES = [0.0, 1e-45, 1e-40, 1e-30, 1e-8, 1.0, 1e3, 6.55e4, 1e5, 1e30, 3e38]
FLOATS = (np.float16, np.float32, np.float64)


@st.composite
def arrays(draw, last_axes, dtypes=FLOATS + (np.int32, np.bool_, np.complex64)):
    """``(array, layout)``: a random array of a random layout."""
    lead = tuple(draw(st.lists(st.sampled_from([0, 1, 2, 3]), min_size=0, max_size=2)))
    d = draw(st.sampled_from(last_axes))
    dtype = np.dtype(draw(st.sampled_from(dtypes)))
    mag = draw(st.sampled_from(MAGNITUDES))
    layout = draw(st.sampled_from(["c", "f", "strided", "neg", "lead-strided"]))
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    shape = lead + (d,)
    big = shape[:-1] + (2 * d,) if layout == "strided" else (
        ((2 * shape[0],) + shape[1:]) if layout == "lead-strided" and lead else shape)
    with np.errstate(all="ignore"):  # float16 casts of huge values give inf: wanted, as invalid input
        base = (rng.standard_normal(big) * mag)
        if dtype.kind in "fc":
            base = base.astype(dtype)
        else:
            base = np.round(base).astype(dtype) if dtype.kind != "b" else base > 0
    if layout == "f":
        a = np.asfortranarray(base)
    elif layout == "strided":
        a = base[..., ::2]
    elif layout == "neg":
        a = base[..., ::-1]
    elif layout == "lead-strided" and lead:
        a = base[::2]
    else:
        a = base
    assert a.shape == shape
    return a


def _clear_error(exc, names):
    msg = str(exc)
    assert any(n in msg for n in names), f"error does not name an argument of {names}: {msg!r}"


def _float_ok(x):
    return np.dtype(x.dtype) in (np.dtype(t) for t in FLOATS)


def _finite(x):
    return bool(np.isfinite(x.astype(np.float64) if x.dtype == np.float16 else x).all())


def _beyond_f32(x):
    """float64 input that float32 (the ops' arithmetic) cannot hold: must be rejected."""
    return bool(x.size) and np.abs(x.astype(np.float64)).max() > np.finfo(np.float32).max


def _block_norms(x, block):
    x64 = np.asarray(x, np.float64)
    return np.sqrt((x64.reshape(*x64.shape[:-1], -1, block) ** 2).sum(-1)) if x64.size else np.zeros(0)


# --- the range check itself ------------------------------------------------------------------
@SETTINGS
@given(x=arrays([0, 1, 32, 64], dtypes=FLOATS), special=st.sampled_from([None, np.nan, np.inf, -np.inf]))
def test_range_stats_fuzz(x, special):
    """Non-finite flag, exact max |x| and the largest vector norm against NumPy (float64)."""
    from numba_kv.ops.finite import range_stats

    if special is not None and x.size:
        x = x.copy()
        x.reshape(-1)[x.size // 2] = special
    x64 = x.astype(np.float64)
    got = range_stats(x)
    bad = bool(x.size) and not np.isfinite(x64).all()
    assert got.nonfinite == int(bad)
    if bad or x.size == 0:
        return
    assert got.amax == np.abs(x64).max()  # exact: an integer max over the bit patterns
    want = np.sqrt((x64 ** 2).sum(-1).max()) if x.shape[-1] else 0.0
    assert got.max_norm == pytest.approx(want, rel=1e-6, abs=1e-300)


# --- rotations ----------------------------------------------------------------------------
def _rotation_case(op, x, inverse, block_ok, oracle, names=("x",)):
    """Shared rules of the two rotations.  Real non-float dtypes may be accepted (computed in
    float32) — then they must match the oracle; complex must raise; non-finite input may
    pass through (NaN in, NaN out) or raise."""
    d = x.shape[-1]
    if np.dtype(x.dtype).kind == "c" or not block_ok(d):
        with pytest.raises((TypeError, ValueError)) as ei:
            op(x, inverse)
        _clear_error(ei.value, names)
        return
    try:
        y = op(x, inverse)
    except (TypeError, ValueError) as e:
        _clear_error(e, names)
        big = bool(x.size) and np.abs(x.astype(np.float64)).max() > 3.4e38 / 64
        assert not _float_ok(x) or not _finite(x) or big
        return
    assert y.shape == x.shape and y.dtype == np.float32
    if x.size == 0 or not _finite(x):
        return
    x32 = x.astype(np.float32)
    ref = oracle(x32)
    if np.abs(ref).max() > np.finfo(np.float32).max:
        return  # not representable: pinned by test_rotations_reject_unrepresentable_output
    bs = 32 if op is rotate32 else d
    tol = 1e-6 * np.repeat(_block_norms(x32, bs), bs, axis=-1) + 1e-44
    assert np.all(np.abs(y - ref) <= tol)


@SETTINGS
@given(x=arrays([0, 16, 32, 64, 96]), inverse=st.booleans())
def test_rotate32_fuzz(x, inverse):
    _rotation_case(rotate32, x, inverse, lambda d: d > 0 and d % 32 == 0,
                   reference.rotate_inverse if inverse else reference.rotate_forward)


@SETTINGS
@given(x=arrays([0, 24, 32, 64, 128]), inverse=st.booleans())
def test_rotate_head_fuzz(x, inverse):
    d = x.shape[-1]

    def oracle(x32):
        r = scipy.linalg.hadamard(d) / np.sqrt(d) * reference.head_sign_vector(d)[None, :]
        return x32.astype(np.float64) @ (r if inverse else r.T)

    _rotation_case(rotate_head, x, inverse, lambda d: d in hq.HEAD_DIMS, oracle)


# --- block quantizer ----------------------------------------------------------------------
@SETTINGS
@given(x=arrays([0, 16, 32, 64]), bits=st.sampled_from([0, 1, 2, 3, 4, 5]),
       mode=st.sampled_from(["maxnorm", "l2", "max"]), outlier=st.booleans())
def test_quantize_blocks_fuzz(x, bits, mode, outlier):
    d = x.shape[-1]
    valid = (_float_ok(x) and d > 0 and d % 32 == 0 and 1 <= bits <= 4 and mode in ("maxnorm", "l2")
             and _finite(x))
    if not valid:
        with pytest.raises((TypeError, ValueError)) as ei:
            quantize_blocks(x, bits, mode, outlier)
        _clear_error(ei.value, ["x", "bits", "norm_mode"])
        return
    cb = get_codebook(bits, mode)
    rc, rs = None, None
    # float64 beyond float32 is a case under test (refused below): no NumPy warning for it
    with np.errstate(over="ignore", invalid="ignore"):
        x32 = x.astype(np.float32)
        if x.size:
            rc, rs = reference.quantize(x32, cb.centroids, cb.boundaries, bits, mode, cb.ref, outlier)
    # the oracle's scale before binary16 clamping
    raw = np.zeros(0)
    if x.size:
        with np.errstate(over="ignore", invalid="ignore"):
            xb = x32.reshape(*x.shape[:-1], d // 32, 32).astype(np.float64)
            raw = (np.sqrt((xb ** 2).sum(-1)) if mode == "l2"
                   else np.abs(reference.rotate_forward(x32).reshape(xb.shape)).max(-1) / cb.ref)
    out_of_range = bool(raw.size) and not raw.max() < F16_MAX or _beyond_f32(x)
    try:
        c, s = quantize_blocks(x, bits, mode, outlier)
    except ValueError as e:
        _clear_error(e, ["x"])
        assert out_of_range, str(e)
        return
    assert c.shape == x.shape[:-1] + (d * bits // 8,) and s.shape == x.shape[:-1] + (d // 32,)
    xh = dequantize_blocks(c, s, bits, mode)
    assert xh.shape == x.shape and np.isfinite(xh).all()
    if out_of_range or x.size == 0:
        return  # pinned by test_public_quantizers_reject_out_of_range
    ridx, idx = reference.unpack_bits(rc, bits), unpack_bits(c, bits)
    assert np.abs(idx.astype(int) - ridx.astype(int)).max() <= 1  # near-tie flips by one level at most
    got, want = s.view(np.float16).astype(np.float64), rs.view(np.float16).astype(np.float64)
    assert np.all(np.abs(got - want) <= 2.0 ** -10 * np.abs(want) + 2.0 ** -24)
    np.testing.assert_allclose(xh, reference.dequantize(c, s, cb.centroids, bits), rtol=1e-5,
                               atol=1e-5 * max(1.0, float(np.abs(got).max())))


@SETTINGS
@given(x=arrays([0, 32, 64, 100], dtypes=(np.uint8, np.int64, np.float32)),
       bits=st.sampled_from([0, 1, 2, 3, 4, 5, 8, 9]))
def test_pack_unpack_fuzz(x, bits):
    """Indices ``(..., n)``: pack to ``(..., n·bits/8)`` bytes; wrong dtype, ``n`` not a
    multiple of 8, ``bits`` out of range or indices >= 2**bits raise."""
    idx = np.abs(x) % 16 if x.dtype.kind in "iu" else x
    n = idx.shape[-1]
    ok_bits = 1 <= bits <= 8
    valid = idx.dtype == np.uint8 and n % 8 == 0 and ok_bits and (idx.size == 0 or int(idx.max()) < 2 ** bits)
    if not valid:
        with pytest.raises((TypeError, ValueError)) as ei:
            pack_bits(idx, bits)
        _clear_error(ei.value, ["idx", "bits"])
        return
    p = pack_bits(idx, bits)
    assert np.array_equal(p, reference.pack_bits(np.ascontiguousarray(idx), bits))
    assert np.array_equal(unpack_bits(p, bits), idx)


# --- whole-head quantizer and QJL -----------------------------------------------------------
@SETTINGS
@given(x=arrays([0, 24, 32, 64]), bits=st.sampled_from([0, 1, 2, 3, 4, 5, 6]), unbiased=st.booleans())
def test_quantize_head_fuzz(x, bits, unbiased):
    d = x.shape[-1]
    valid = _float_ok(x) and d in hq.HEAD_DIMS and 1 <= bits <= 5 and _finite(x)
    if not valid:
        with pytest.raises((TypeError, ValueError)) as ei:
            quantize_head(x, bits, unbiased)
        _clear_error(ei.value, ["x", "bits"])
        return
    with np.errstate(over="ignore"):  # float64 beyond float32: a case under test (refused below)
        n = _block_norms(x.astype(np.float32), d)[..., 0] if x.size else np.zeros(0)
    out_of_range = bool(n.size) and not n.max() < F16_MAX or _beyond_f32(x)
    try:
        c, s = quantize_head(x, bits, unbiased)
    except ValueError as e:
        _clear_error(e, ["x"])
        assert out_of_range or unbiased, str(e)
        return
    xh = dequantize_head(c, s, bits)
    assert xh.shape == x.shape and np.isfinite(xh).all()
    if out_of_range or x.size == 0 or unbiased:
        return
    # plain mode stores binary16(‖x‖): the oracle is the float64 norm, rounded
    want = n.astype(np.float16).astype(np.float64)
    got = s[..., 0].view(np.float16).astype(np.float64)
    assert np.all(np.abs(got - want) <= 2.0 ** -10 * want + 2.0 ** -24)


@SETTINGS
@given(r=arrays([0, 8, 40, 64]), m=st.sampled_from([0, 7, 8, 32]))
def test_qjl_quantize_fuzz(r, m):
    d = r.shape[-1]
    if m == 0 or m % 8 or d == 0:
        with pytest.raises((TypeError, ValueError)) as ei:
            qjl_quantize(r, make_sketch(max(d, 1), m))
        _clear_error(ei.value, ["m", "d", "r", "sketch"])
        return
    S = make_sketch(d, m)
    if not _float_ok(r) or not _finite(r):
        with pytest.raises((TypeError, ValueError)) as ei:
            qjl_quantize(r, S)
        _clear_error(ei.value, ["r"])
        return
    with np.errstate(over="ignore"):  # float64 beyond float32: a case under test (refused below)
        n = _block_norms(r.astype(np.float32), d)[..., 0] if r.size else np.zeros(0)
    out_of_range = bool(n.size) and not n.max() < F16_MAX or _beyond_f32(r)
    try:
        signs, norms = qjl_quantize(r, S)
    except ValueError as e:
        _clear_error(e, ["r"])
        assert out_of_range, str(e)
        return
    assert signs.shape == r.shape[:-1] + (m // 8,) and norms.shape == r.shape[:-1]
    if out_of_range or r.size == 0:
        return
    got = norms.view(np.float16).astype(np.float64)
    want = n.astype(np.float16).astype(np.float64)  # n < 65504 here
    assert np.all(np.abs(got - want) <= 2.0 ** -10 * want + 2.0 ** -24)
    p64 = r.astype(np.float32).astype(np.float64).reshape(-1, d) @ S.T.astype(np.float64)
    bits = np.unpackbits(signs.reshape(-1, m // 8), axis=-1, bitorder="little").astype(bool)
    # signs are clear unless the projection is within float32 rounding of 0 (subnormal inputs:
    # float32 products below 2**-126 lose their precision)
    clear = np.abs(p64) > np.maximum(1e-4 * n.reshape(-1, 1) * np.sqrt(d), 2.0 ** -120 * d)
    assert np.array_equal(bits[clear], (p64 >= 0)[clear])


@pytest.mark.parametrize("op", [rotate32, rotate_head])
def test_rotations_reject_unrepresentable_output(op):
    """All 32 values 1e38: the rotated block holds sqrt(32)·1e38 > float32 max: must raise, not return inf."""
    x = np.full((1, 64), 1e38, np.float32)
    with pytest.raises(ValueError, match=r"^x: "):
        op(x)


# --- fused decode attention over codes ----------------------------------------------------
@st.composite
def attention_cases(draw):
    b, hkv = draw(st.sampled_from([1, 2])), 2
    t = draw(st.sampled_from([1, 40]))
    hq = draw(st.sampled_from([2, 3, 4, 6]))  # 3 is not a multiple of hkv
    q_len = draw(st.sampled_from([0, 1, 3]))
    dq = draw(st.sampled_from([64, 64, 32]))  # 32: does not match the codes' head_dim
    dtype = np.dtype(draw(st.sampled_from(FLOATS + (np.int32,))))
    layout = draw(st.sampled_from(["c", "neg", "strided"]))
    mag = draw(st.sampled_from([0.0, 1e-40, 1e-8, 1.0, 1e4, 1e18, 1e30, 1e38]))
    seed = draw(st.integers(0, 2 ** 32 - 1))
    return b, hkv, t, hq, q_len, dq, dtype, layout, mag, seed


@SETTINGS
@given(case=attention_cases())
def test_decode_attention_fuzz(case):
    """Queries of any shape, dtype, layout and magnitude against float64 softmax attention
    over the dequantized keys and values (``numba_kv.reference.attention``)."""
    from numba_kv import decode_attention

    b, hkv, t, hq, q_len, dq, dtype, layout, mag, seed = case
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((b, hkv, t, 64)).astype(np.float32)
    v = rng.standard_normal((b, hkv, t, 64)).astype(np.float32)
    kc, ks = quantize_blocks(k, 3)
    vc, vs = quantize_blocks(v, 3)
    shape = (b, hq, q_len, dq)
    with np.errstate(all="ignore"):
        base = rng.standard_normal(shape[:-1] + (2 * dq,)) * mag
        base = base.astype(dtype) if dtype.kind == "f" else np.round(base).astype(dtype)
    q = base[..., ::2] if layout == "strided" else (base[..., dq:][..., ::-1] if layout == "neg" else
                                                      np.ascontiguousarray(base[..., :dq]))
    valid = dtype.kind == "f" and hq % hkv == 0 and dq == 64 and _finite(q)
    if not valid:
        with pytest.raises((TypeError, ValueError)) as ei:
            decode_attention(q, kc, ks, vc, vs)
        _clear_error(ei.value, ["q", "k_codes", "num_heads", "head_dim"])
        return
    try:
        out = decode_attention(q, kc, ks, vc, vs)
    except ValueError as e:
        _clear_error(e, ["q"])
        return
    assert out.shape == shape and out.dtype == np.float32
    assert np.isfinite(out).all(), "non-finite attention output from finite inputs"
    if q.size == 0:
        return
    kh, vh = dequantize_blocks(kc, ks, 3), dequantize_blocks(vc, vs, 3)
    ref = reference.attention(q.astype(np.float32), kh, vh, 64 ** -0.5, causal_offset=t - q_len)
    # huge logits make softmax one-hot: any float32 rounding may pick a different near-tie,
    # so the output is compared only while logits are moderate
    if mag <= 1e4:
        # float32 logits carry a rounding error of about an ulp of |s| (the kernel sums q·k in
        # another order than the float64 oracle); that error moves the softmax weights and so
        # the output by up to ~|Δs|·max|v|.  Negligible for unit-scale queries (the fixed
        # 1e-4 decides), it reaches ~1e-3 at mag = 1e4 where |s| ~ 1e4.
        g = hq // hkv
        logits = np.einsum("bhqd,bhtd->bhqt", q.astype(np.float64).reshape(b, hkv, g * q_len, 64),
                           kh.astype(np.float64)) * 64 ** -0.5
        s_max = float(np.abs(logits).max())
        tol = 1e-4 + float(np.finfo(np.float32).eps) * s_max * float(np.abs(vh).max())
        np.testing.assert_allclose(out, ref, rtol=1e-4, atol=tol)


# --- out-of-range outputs of the stateless quantizers -----------------------------------------
OUT_OF_RANGE = [
    ("quantize_blocks", lambda x: quantize_blocks(x, 3)),
    ("quantize_blocks-l2", lambda x: quantize_blocks(x, 3, "l2")),
    ("quantize_head", lambda x: quantize_head(x, 3)),
    ("qjl_quantize", lambda x: qjl_quantize(x, make_sketch(64))),
]


@pytest.mark.parametrize("val", [1e5, 1e30, -1e30])
@pytest.mark.parametrize("name, op", OUT_OF_RANGE, ids=[o[0] for o in OUT_OF_RANGE])
def test_public_quantizers_reject_out_of_range(name, op, val):
    """A binary16 scale / norm above 65504 must raise ``ValueError`` naming ``x``/``r`` (they
    used to saturate silently: 1e30 came back as ~8e5 or 65504)."""
    x = np.ones((2, 64), np.float32)
    x[1, 3:40] = val
    with pytest.raises(ValueError, match=r"^(x|r): .*65504"):
        op(x)
