"""8-bit vector norms (``norm_bits=8``) in the whole-head-rotation caches: stored bytes
against the NumPy oracle, fused decode, accuracy next to binary16 norms, the grid's range
check, lifecycle, persistence, names and bytes."""

import numpy as np
import pytest

from numba_kv import AttendConfig, Dequantized, Fused, load_cache, make_cache, reference
from numba_kv.caches.config import PolarQuantConfig
from numba_kv.caches.spec import parse_cache_spec
from numba_kv.ops.attention.layout import mma_operands
from numba_kv.ops.headquant import dequantize_head, quantize_head
from numba_kv.ops.headvq import dequantize_headvq, headvq_codebook, quantize_headvq
from numba_kv.reference import norm8 as ref8
from numba_kv.reference.polarquant import hadamard_apply

GEO = dict(num_layers=1, num_kv_heads=2, head_dim=64)


def rel_err(out, ref):
    return float(np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-30))


def _kv(rng, b, h, n, d, spread=0.0):
    """Gaussian K/V; ``spread``: each vector scaled by 2**U(−spread, spread) (norms over
    ``2·spread`` octaves, like a model's)."""
    out = []
    for _ in range(2):
        x = rng.standard_normal((b, h, n, d))
        out.append((x * 2.0 ** rng.uniform(-spread, spread, (b, h, n, 1))).astype(np.float32))
    return out


def state_snapshot(cache):
    """The cache's state and every allocated buffer of every layer, whole (not only the live
    tokens), copied."""
    st = cache.state_dict()
    whole = {f"{i}.{n}": b.copy() for i, lay in enumerate(cache._layers) for n, b in lay.buffers.items()}
    return st.state, whole


@pytest.mark.parametrize("name", ["pqo-k4v2-head-eden-vq-n8", "pqo-k4v3-head-n8"])
def test_stored_norms_are_the_oracle_codes(name):
    """Without a window every token is compressed: the codes are the head op's, the norm bytes
    the oracle's encoding of the op's binary16 norms on the oracle's first-store grid (keys
    and values together), and the history is the op's decode with the oracle's norms."""
    rng = np.random.default_rng(1)
    c = make_cache(name, residual_length=0, sink_tokens=0, decode_output="dequantized", **GEO)
    k, v = _kv(rng, 2, 2, 12, 64, spread=2.0)
    c.prefill(0, k, v)
    st = c._layers[0]
    ops = {}
    for side, x in (("k", k), ("v", v)):
        bits = c.slot_bits[side]
        vq = c.vq_sides[side]
        codes, norms = (quantize_headvq if vq else quantize_head)(x, bits, c.unbiased)
        ops[side] = (codes, norms.view(np.float16).astype(np.float64), vq, bits)
    base16 = ref8.norm8_base16(np.concatenate([ops["k"][1], ops["v"][1]]))
    assert st.meta["norm8_base"] - 1024 == base16
    hk, hv = c._history(st, np.float32)
    for side, hist in (("k", hk), ("v", hv)):
        codes, norms, vq, bits = ops[side]
        np.testing.assert_array_equal(st.buffers[side + "_codes"][:, :12], codes.reshape(4, 12, -1))
        want = ref8.norm8_encode(norms, base16).reshape(4, 12, 1)
        np.testing.assert_array_equal(st.buffers[side + "_scales"][:, :12], want)
        unit = np.ones(norms.shape, np.float16).view(np.uint16)
        dq = (dequantize_headvq if vq else dequantize_head)(codes, unit, bits)
        np.testing.assert_array_equal(hist, dq * ref8.norm8_decode(want.reshape(norms.shape), base16))


CASES = [("pqo-k4v2-head-eden-vq-n8", {}), ("pqo-k4v3-head-n8", {"window_dtype": "float32"}),
         ("pqo-k4v2-head-eden-n8", {"window_dtype": "int8", "key_center": True}),
         ("pqo2-head-n8", {"window_dtype": "int8", "window_rotation": False})]


@pytest.mark.parametrize(("R", "S"), [(0, 0), (5, 2)])
@pytest.mark.parametrize(("name", "opts"), CASES)
def test_fused_equals_reference_over_the_history(name, opts, R, S):
    """GQA, chunked prefill and decode steps: every fused output equals float64 attention over
    the history of the same cache in ``decode_output="dequantized"`` (the kernels read the
    norm bytes through the layer's table, the dequantizer scales by the decoded norms)."""
    rng = np.random.default_rng([len(name), len(opts), R, S])
    b, hkv, groups, d = 2, 2, 3, 64
    geo = dict(num_layers=1, num_kv_heads=hkv, head_dim=d, residual_length=R, sink_tokens=S, **opts)
    fused, deq = make_cache(name, **geo), make_cache(name, decode_output="dequantized", **geo)
    cfg = AttendConfig(d ** -0.5, groups)
    for step, n in enumerate([7, 6, 1, 1, 3, 1, 9, 1]):
        k, v = _kv(rng, b, hkv, n, d, spread=1.5)
        if step < 2:
            for c in (fused, deq):
                c.prefill(0, k, v)
            continue
        q = rng.standard_normal((b, hkv * groups, n, d)).astype(np.float32)
        out, hist = fused.decode(0, k, v, q, cfg), deq.decode(0, k, v, q, cfg)
        assert isinstance(out, Fused) and isinstance(hist, Dequantized)
        T = fused.seq_len(0)
        ref = reference.attention(q, hist.result.k, hist.result.v, cfg.softmax_scale, causal_offset=T - n)
        assert rel_err(out.out, ref) < 1e-5
    assert fused.memory_usage() == deq.memory_usage()
    assert fused._layers[0].meta["norm8_base"] == deq._layers[0].meta["norm8_base"]


def fro(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize(("name", "err16", "err8"), [("pqo-k4v2-head-eden-vq", 0.3843, 0.3855),
                                                     ("pqo4-head", 0.1717, 0.1787)])
def test_attention_error_close_to_binary16_norms(name, err16, err8):
    """Against exact float64 attention over the true K/V (512 tokens, norms over 2 octaves,
    16 query heads per batch row): the relative (Frobenius) error of the outputs, measured
    with this test's data, is ``err16`` with binary16 norms and ``err8`` with 8-bit ones; the
    two caches' outputs differ by 0.043 (k4v2 VQ) / 0.040 (pqo4) relative, well below the
    codes' own error.  (Seeds 1-2 and pqo3-head / pqo-k4v2-head-eden: +0.3 … +2.2 points, or
    slightly less error.)  The bounds: at most 6 % more error, a difference below 30 % of it."""
    rng = np.random.default_rng(0)
    b, hkv, groups, d, n = 2, 2, 8, 64, 512
    k, v = _kv(rng, b, hkv, n, d, spread=1.0)
    q = rng.standard_normal((b, hkv * groups, 1, d)).astype(np.float32)
    kq, vq = _kv(rng, b, hkv, 1, d, spread=1.0)
    cfg = AttendConfig(d ** -0.5, groups)
    exact = reference.attention(q, np.concatenate([k, kq], 2), np.concatenate([v, vq], 2), cfg.softmax_scale,
                                causal_offset=n)
    outs = {}
    for nb in (16, 8):
        c = make_cache(name, num_layers=1, num_kv_heads=hkv, head_dim=d, norm_bits=nb, residual_length=0,
                       sink_tokens=0)
        c.prefill(0, k, v)
        outs[nb] = c.decode(0, kq, vq, q, cfg).out
    assert fro(outs[16], exact) == pytest.approx(err16, abs=1e-4)
    assert fro(outs[8], exact) == pytest.approx(err8, abs=1e-4)
    assert fro(outs[8], exact) <= 1.06 * fro(outs[16], exact)
    assert fro(outs[8], outs[16]) <= 0.3 * fro(outs[16], exact)


@pytest.mark.parametrize("side", ["k", "v"])
@pytest.mark.parametrize("R", [0, 4])
def test_norm_above_the_grid_raises_and_changes_nothing(side, R):
    """A later norm above the top of the grid fixed at the first store: ValueError naming the
    input, before anything is stored (every buffer and counter as before); the window does not
    defer the check (the token would fail when it leaves the window)."""
    rng = np.random.default_rng(3)
    c = make_cache("pqo-k4v2-head-eden-vq-n8", residual_length=R, sink_tokens=0, **GEO)
    k, v = _kv(rng, 1, 2, 40, 64)
    c.prefill(0, k, v)
    before = state_snapshot(c)
    k1, v1 = _kv(rng, 1, 2, 1, 64)
    (k1 if side == "k" else v1)[0, 1, 0] *= np.float32(2.0 ** 12)  # 12 octaves above the others
    q = rng.standard_normal((1, 2, 1, 64)).astype(np.float32)
    with pytest.raises(ValueError, match=rf"^{side}: a vector norm of .* exceeds the 8-bit norm grid's top .* "
                                         r"first store \(norm_bits=8\); use norm_bits=16"):
        c.decode(0, k1, v1, q, AttendConfig(0.125, 1))
    after = state_snapshot(c)
    assert after[0] == before[0] and after[1].keys() == before[1].keys()
    for name, t in before[1].items():
        np.testing.assert_array_equal(after[1][name], t)
    # 3 octaves above: inside the grid's 4 octaves of headroom
    (k1 if side == "k" else v1)[0, 1, 0] *= np.float32(2.0 ** -9)
    c.decode(0, k1, v1, q, AttendConfig(0.125, 1))


def _concentrated(bits, d, count=256):
    """A unit vector whose head rotation is one group, along the sampled direction where the
    nearest point of the codebook ``(bits, d)`` is least aligned with it, and its EDEN ratio
    ``α/‖x‖`` by the reference (float64 brute force)."""
    m = 4 if bits == 2 else 2
    u = np.random.default_rng(bits).standard_normal((count, m))
    u /= np.linalg.norm(u, axis=1, keepdims=True)
    y = np.zeros((count, d))
    y[:, :m] = u
    x = hadamard_apply(y) * reference.head_sign_vector(d)
    _, norms, _ = reference.headvq_quantize(x, headvq_codebook(bits, d), unbiased=True)
    ratio = norms[:, 0].view(np.float16).astype(np.float64) / np.linalg.norm(x, axis=1)
    return x[np.argmax(ratio)], float(ratio.max())


def _grid_top(k, v, d):
    """The top of the 8-bit grid fixed by a first store of ``k`` (VQ pairs) / ``v`` (VQ quads)
    (reference EDEN scales, reference grid base; a norm codes above 255 past it)."""
    _, nk, _ = reference.headvq_quantize(k.reshape(-1, d), headvq_codebook(4, d), unbiased=True)
    _, nv, _ = reference.headvq_quantize(v.reshape(-1, d), headvq_codebook(2, d), unbiased=True)
    alphas = np.concatenate([nk, nv]).view(np.float16).astype(np.float64)
    return 2.0 ** ((reference.norm8_base16(alphas) + 255.5) / 16)


@pytest.mark.parametrize("side", ["k", "v"])
@pytest.mark.parametrize("norm_bits", [8, 16])
def test_concentrated_vector_is_checked_by_its_eden_scale(side, norm_bits):
    """A vector whose norm is well inside the limit (the 8-bit grid's top, or binary16's 65504)
    but whose EDEN scale is past it — its rotation sits in one group, where the scale is
    2.7-3.7× the norm at d = 64 — is refused before anything is stored; at 80 % of the limit
    it is stored.  The range check skips quantizing in scratch only below its proved bound
    (numba_kv.ops.headvq_bound): with a bound of 1 this vector would be stored saturated."""
    rng = np.random.default_rng(4)
    d = 64
    c = make_cache("pqo-k4v2-head-eden-vq" + ("-n8" if norm_bits == 8 else ""), residual_length=0,
                   sink_tokens=0, decode_output="dequantized", **GEO)
    k, v = _kv(rng, 1, 2, 40, d)
    c.prefill(0, k, v)
    limit = _grid_top(k, v, d) if norm_bits == 8 else 65504.0
    x, ratio = _concentrated(4 if side == "k" else 2, d)
    assert ratio > 2.5
    q = rng.standard_normal((1, 2, 1, d)).astype(np.float32)
    before = state_snapshot(c)
    for frac, ok in ((1.1, False), (0.8, True)):
        k1, v1 = _kv(rng, 1, 2, 1, d)
        (k1 if side == "k" else v1)[0, 1, 0] = (x * (frac * limit / ratio)).astype(np.float32)
        if ok:
            hist = c.decode(0, k1, v1, q, AttendConfig(0.125, 1)).result
            got = (hist.k if side == "k" else hist.v)[0, 1, -1]
            assert np.dot(got, (k1 if side == "k" else v1)[0, 1, 0]) > 0.5 * (frac * limit / ratio) ** 2
            continue
        with pytest.raises(ValueError, match=rf"^{side}: "):
            c.decode(0, k1, v1, q, AttendConfig(0.125, 1))
        after = state_snapshot(c)
        assert after[0] == before[0]
        for name, t in before[1].items():
            np.testing.assert_array_equal(after[1][name], t)


@pytest.mark.parametrize("norm_bits", [8, 16])
def test_a_token_below_the_norm_floor_is_stored_as_zero(norm_bits):
    """A value of norm 1.4e-13 built so that two groups of its rotation cancel in ``⟨y, ĉ⟩``:
    the cache cleared it by its norm and stored an EDEN scale of 65504 (reconstructed norm
    646 with 8-bit norms, 20675 with binary16; QA review).  The op keeps the norm below the
    1e-10 floor, so the token comes back as zero, as any token that small does."""
    d = 64
    y = np.zeros(d)
    y[0], y[4], y[9] = 2.0 ** -7 / 8, -(2.0 ** -7) / 8, -(2.0 ** -80)
    tv = (hadamard_apply(y) * reference.head_sign_vector(d) * float(np.float32(1e-10))).astype(np.float32)
    rng = np.random.default_rng(0)
    c = make_cache("pqo-k4v2-head-eden-vq" + ("-n8" if norm_bits == 8 else ""), residual_length=0,
                   sink_tokens=0, decode_output="dequantized", **GEO)
    k, v = _kv(rng, 1, 2, 40, d)
    c.prefill(0, k, v)
    k1, v1 = _kv(rng, 1, 2, 1, d)
    v1[0, 0, 0] = tv
    hist = c.decode(0, k1, v1, rng.standard_normal((1, 2, 1, d)).astype(np.float32), AttendConfig(0.125, 1)).result
    assert np.linalg.norm(hist.v[0, 0, -1]) == 0.0


def test_int8_window_round_trip_counts_in_the_bound(monkeypatch):
    """A token entering an int8 window is compressed later from its int8 round trip, whose
    norm can be ``1 + √d/254`` times larger (3 % at d = 64): a value whose norm times the
    proved bound ``F`` is 1 % under binary16's limit is not cleared by the bound alone, it is
    quantized in scratch first, as given and as its round trip (two calls more than the
    step's eviction needs)."""
    import numba_kv.caches._headnorm as hn
    from numba_kv.ops.headvq_bound import eden_scale_bound

    calls = []
    real = hn.quantize_headvq_into
    monkeypatch.setattr(hn, "quantize_headvq_into", lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    rng = np.random.default_rng(8)
    d = 64
    for window_dtype, extra in (("int8", 2), ("float32", 0)):
        c = make_cache("pqo-k4v2-head-eden-vq", residual_length=8, sink_tokens=0, window_dtype=window_dtype,
                       **GEO)
        c._window8_head = False  # the store op by op: its quantizer calls are counted too
        k, v = _kv(rng, 1, 2, 40, d)
        c.prefill(0, k, v)
        k1, v1 = _kv(rng, 1, 2, 1, d)
        v1[0, 1, 0] *= np.float32(0.99 * 65504 * (1 - 2.0 ** -10) / eden_scale_bound(2, d)
                                  / np.linalg.norm(v1[0, 1, 0]))
        calls.clear()
        c.decode(0, k1, v1, rng.standard_normal((1, 2, 1, d)).astype(np.float32), AttendConfig(0.125, 1))
        assert len(calls) == 2 + extra, window_dtype


def _window_round_trip(x, d):
    """The int8 window's round trip of the rows of ``x`` (float64): rotated by the head
    rotation, ``q = rint(z / s)`` with ``s = fp16(max|z| / 127)``, ``q · s`` rotated back (the
    absmax8 formula of the ops' docstring, in float64)."""
    signs = reference.head_sign_vector(d)
    z = hadamard_apply(x * signs)
    s = (np.abs(z).max(-1, keepdims=True) / 127).astype(np.float16).astype(np.float64)
    return hadamard_apply(np.clip(np.rint(z / s), -127, 127) * s) * signs


def _round_trip_token(rng, d, limit):
    """A value (float32 ``[d]``) whose EDEN scale on the quads codebook is 3 % under ``limit``
    and whose int8 window round trip's is over 2 % past it (or saturated at 65504), by the
    reference: the most sensitive of 2000 Gaussian directions (ratio about 1.07 at d = 64)."""
    pts = headvq_codebook(2, d)

    def alpha(x):
        return reference.headvq_quantize(x, pts, unbiased=True)[1][:, 0].view(np.float16).astype(np.float64)

    cand = rng.standard_normal((2000, d)).astype(np.float32).astype(np.float64)
    u = cand[np.argmax(alpha(_window_round_trip(cand, d)) / alpha(cand))]
    tok = (u * (0.97 * limit / alpha(u[None])[0])).astype(np.float32)
    a_tok, a_rt = alpha(tok[None].astype(np.float64))[0], alpha(_window_round_trip(tok[None].astype(np.float64), d))[0]
    # the premise, by the reference (whose binary16 scale stops at 65504)
    assert a_tok < 0.98 * limit and a_rt >= min(1.02 * limit, 65504.0), (a_tok, a_rt)
    return tok


def test_first_store_checks_the_int8_round_trip():
    """The 8-bit grid's first store checks its tokens' binary16 norms (before fixing the grid
    from them) — and, with an int8 window, their round trips' too: a window token whose
    round trip saturates binary16 is refused with an int8 window, stored with a float32 one."""
    d = 64
    rng = np.random.default_rng(2)
    k, v = _kv(rng, 1, 2, 40, d)
    v[0, 1, -1] = _round_trip_token(rng, d, 65504.0)  # in the window
    for window_dtype in ("int8", "float32"):
        c = make_cache("pqo-k4v2-head-eden-vq-n8", residual_length=8, sink_tokens=0, window_dtype=window_dtype, **GEO)
        if window_dtype == "float32":
            c.prefill(0, k, v)
            continue
        with pytest.raises(ValueError, match=r"^v: .* does not fit binary16"):
            c.prefill(0, k, v)
        assert c.seq_len(0) == 0 and "norm8_base" not in c._layers[0].meta


@pytest.mark.parametrize("norm_bits", [8, 16])
def test_scratch_check_covers_the_int8_round_trip(norm_bits):
    """The range check's slow path (quantizing in scratch) checks a token and its int8 round
    trip, which it is compressed from when it leaves an int8 window.  A value whose EDEN scale
    is 3 % under the limit (binary16's 65504, or the 8-bit grid's top) and whose round trip's
    is 3 % past it (by the reference) is refused with an int8 window, the cache untouched,
    and stored with a float32 one.  It used to be stored, and its scale saturated when it
    left the window."""
    d = 64
    rng = np.random.default_rng(1)
    k, v = _kv(rng, 1, 2, 40, d)
    tok = _round_trip_token(rng, d, _grid_top(k, v, d) if norm_bits == 8 else 65504.0)
    q = rng.standard_normal((1, 2, 1, d)).astype(np.float32)
    for window_dtype in ("int8", "float32"):
        c = make_cache("pqo-k4v2-head-eden-vq" + ("-n8" if norm_bits == 8 else ""), residual_length=8,
                       sink_tokens=0, window_dtype=window_dtype, decode_output="dequantized", **GEO)
        c.prefill(0, k, v)
        k1, v1 = _kv(rng, 1, 2, 1, d)
        v1[0, 1, 0] = tok
        if window_dtype == "float32":
            c.decode(0, k1, v1, q, AttendConfig(0.125, 1))
            for _ in range(8):  # evicts it: compressed as given
                hist = c.decode(0, *_kv(rng, 1, 2, 1, d), q, AttendConfig(0.125, 1)).result
            assert np.dot(hist.v[0, 1, 40], tok) > 0.9 * np.dot(tok, tok)
            continue
        before = state_snapshot(c)
        with pytest.raises(ValueError, match=r"^v: "):
            c.decode(0, k1, v1, q, AttendConfig(0.125, 1))
        after = state_snapshot(c)
        assert after[0] == before[0] and after[1].keys() == before[1].keys()
        for name, t in before[1].items():
            np.testing.assert_array_equal(after[1][name], t)


def test_ordinary_decode_step_quantizes_each_side_once(monkeypatch):
    """A decode step of ordinary tokens on the VQ + EDEN + 8-bit-norm cache (``kv3``'s code)
    runs the VQ quantizer once per side — the stored code — and no range-check dry run (the
    proved bound of the EDEN scale clears them); it used to run it twice per side."""
    import numba_kv.caches._headnorm as hn

    calls = []
    real = hn.quantize_headvq_into
    monkeypatch.setattr(hn, "quantize_headvq_into", lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    rng = np.random.default_rng(6)
    c = make_cache("pqo-k4v2-head-eden-vq-n8", residual_length=0, sink_tokens=0, **GEO)
    k, v = _kv(rng, 1, 2, 40, 64, spread=1.0)
    c.prefill(0, k, v)
    calls.clear()
    for _ in range(5):
        k1, v1 = _kv(rng, 1, 2, 1, 64, spread=1.0)
        c.decode(0, k1, v1, rng.standard_normal((1, 2, 1, 64)).astype(np.float32), AttendConfig(0.125, 1))
    assert len(calls) == 10


@pytest.mark.parametrize("validate", ["sync", "off"])
@pytest.mark.parametrize("name, opts", [
    ("kv3", {}),  # key centering, an int8 window, 16 sinks, VQ codes on both sides
    ("pqo-k4v3-head-n8", {"residual_length": 8, "sink_tokens": 2, "window_dtype": "float32"}),
    ("pqo-k4v2-head-eden-vq-n8", {"residual_length": 0, "sink_tokens": 0})])
def test_first_store_takes_its_compressed_tokens_from_the_scratch_codes(monkeypatch, name, opts, validate):
    """The first store quantizes every token in scratch to fix the grid (in the range check,
    or when the check is off in the grid's fixing); the tokens it compresses are then stored
    from those codes, not quantized again: one quantizer call per side instead of two, and
    the bytes of quantizing them again."""
    import numba_kv.caches._headnorm as hn

    calls = []
    for op in ("quantize_head_into", "quantize_headvq_into"):
        real = getattr(hn, op)
        monkeypatch.setattr(hn, op, lambda *a, real=real, **kw: (calls.append(1), real(*a, **kw))[1])
    rng = np.random.default_rng(12)
    k, v = _kv(rng, 2, 2, 200, 64, spread=2.0)
    new, old = (make_cache(name, **opts, **GEO) for _ in range(2))
    new.validate = old.validate = validate
    # the reference: every compressed token through the quantizer (as before)
    old._compressor = lambda st, side, pre, plan, t0: lambda ev: old._compress(st, side, ev, t0)
    counts = []
    for c in (new, old):
        calls.clear()
        c.prefill(0, k, v)
        counts.append(len(calls))
    assert counts == [2, 4], counts
    (st_new, bufs_new), (st_old, bufs_old) = state_snapshot(new), state_snapshot(old)
    assert st_new == st_old and bufs_new.keys() == bufs_old.keys()
    for key in bufs_new:
        np.testing.assert_array_equal(bufs_new[key], bufs_old[key], err_msg=key)
    assert new._layers[0].meta["n_comp"] > 100  # the premise: most tokens were compressed


def test_first_store_grid_covers_its_window_tokens():
    """The grid is fixed from every token of the first call, the window's too: a large token
    that sits in the window is compressed later without error (and within half a step)."""
    rng = np.random.default_rng(5)
    c = make_cache("pqo4-head-n8", residual_length=8, sink_tokens=0, decode_output="dequantized", **GEO)
    k, v = _kv(rng, 1, 2, 20, 64)
    k[0, 0, -1] *= np.float32(2.0 ** 9)  # in the window: 9 octaves above the median
    c.prefill(0, k, v)
    for _ in range(10):  # evicts it
        k1, v1 = _kv(rng, 1, 2, 1, 64)
        hist = c.decode(0, k1, v1, np.ones((1, 2, 1, 64), np.float32), AttendConfig(0.125, 1)).result
    got = np.linalg.norm(hist.k[0, 0, 19])
    assert abs(got / np.linalg.norm(k[0, 0, -1]) - 1) < 0.06  # the 4-bit code's norm error plus half a step


def test_lifecycle_keeps_and_reset_clears_the_grid():
    rng = np.random.default_rng(6)
    c = make_cache("pqo-k4v2-head-n8", **GEO)
    k, v = _kv(rng, 2, 2, 50, 64)
    c.prefill(0, k, v)
    base = c._layers[0].meta["norm8_base"]
    assert c.fork()._layers[0].meta["norm8_base"] == base
    assert c.select_batch([1])._layers[0].meta["norm8_base"] == base
    c.crop(45)
    assert c._layers[0].meta["norm8_base"] == base
    c.reset()
    assert "norm8_base" not in c._layers[0].meta
    c.prefill(0, k * np.float32(256.0), v * np.float32(256.0))  # a new grid, 8 octaves up
    assert c._layers[0].meta["norm8_base"] == base + 128


def test_save_load_round_trip(tmp_path):
    rng = np.random.default_rng(4)
    a = make_cache("pqo-k4v2-head-eden-vq-n8", residual_length=3, sink_tokens=1, window_dtype="int8",
                   key_center=True, **GEO)
    k, v = _kv(rng, 1, 2, 20, 64, spread=1.0)
    a.prefill(0, k, v)
    a.save(tmp_path / "n8.safetensors")
    b = load_cache(tmp_path / "n8.safetensors", expect=a)
    assert b.config == a.config and b.config.norm_bits == 8 and a.config_dict()["norm_bits"] == 8
    assert b._layers[0].meta["norm8_base"] == a._layers[0].meta["norm8_base"]
    k1, v1 = _kv(rng, 1, 2, 1, 64)
    q = rng.standard_normal((1, 4, 1, 64)).astype(np.float32)
    cfg = AttendConfig(0.125, 2)
    np.testing.assert_array_equal(a.decode(0, k1, v1, q, cfg).out, b.decode(0, k1, v1, q, cfg).out)
    # binary16 norms: the option is left out of the file (the bytes of earlier versions)
    assert "norm_bits" not in make_cache("pqo-k4v2-head-eden-vq", **GEO).config_dict()


def test_memory_usage_and_bits_per_value():
    """One byte per norm instead of two, by formula and as stored."""
    rng = np.random.default_rng(3)
    k, v = _kv(rng, 1, 2, 50, 64)
    c16, c8 = (make_cache("pqo-k4v2-head-eden-vq", window_dtype="int8", norm_bits=nb, **GEO) for nb in (16, 8))
    for c in (c16, c8):
        c.prefill(0, k, v)
    assert c8.memory_usage() == sum(x.nbytes for x in c8.live_arrays(0))
    n_exact = 4 + 32  # rows × (compressed: K 32 + V 16 code bytes + a one-byte norm each; exact: int8 + scale)
    assert c8.memory_usage() == 2 * ((50 - n_exact) * (32 + 1 + 16 + 1) + 2 * n_exact * (64 + 2))
    assert c16.memory_usage() - c8.memory_usage() == 2 * 2 * (50 - n_exact)
    assert c8.bits_per_value == (8 * 33 + 8 * 17) / 128 == c16.bits_per_value - 0.125


def test_names_and_options():
    c = make_cache("pqo-k4v2-head-eden-vq-n8", **GEO)
    assert c.name == "pqo-k4v2-head-eden-vq-n8-r32-s4" and c.norm_bits == 8
    assert c.config == make_cache("pqo-k4v2-head-eden-vq", norm_bits=8, **GEO).config
    assert make_cache(c.name, **GEO).config == c.config
    spec = parse_cache_spec("pqo3-head-n8-r8-s2")
    assert make_cache(spec.name, **GEO, **spec.options).name == "pqo3-head-n8-r8-s2"
    assert PolarQuantConfig(1, 1, 64, rotation="head").norm_bits == 16


@pytest.mark.parametrize(("name", "opts", "err", "match"), [
    ("pqo4", {"norm_bits": 8}, ValueError, r"^norm_bits: 8-bit norms need rotation='head'"),
    ("pqo4-n8", {}, ValueError, r"^norm_bits: 8-bit norms need rotation='head'"),
    ("pqo4-head", {"norm_bits": 12}, ValueError, r"^norm_bits: "),
    ("pqo4-head", {"norm_bits": "8"}, TypeError, r"^norm_bits: "),
    ("tq-k5v4-head", {"norm_bits": 8}, ValueError, r"^norm_bits: .*TurboQuantCache"),
])
def test_bad_options(name, opts, err, match):
    with pytest.raises(err, match=match):
        make_cache(name, **GEO, **opts)


def test_norm_bits_is_a_per_head_option():
    rng = np.random.default_rng(8)
    c = make_cache("pqo-k4v2-head", num_layers=1, num_kv_heads=3, head_dim=64,
                   head_overrides={0: {1: {"norm_bits": 8}}})
    assert {heads: part.config.norm_bits for part, _, heads in c.layer_pieces(0)} == {(0, 2): 16, (1,): 8}
    k, v = _kv(rng, 1, 3, 40, 64)
    c.prefill(0, k, v)
    whole = make_cache("pqo-k4v2-head", num_layers=1, num_kv_heads=3, head_dim=64)
    whole.prefill(0, k, v)
    assert whole.memory_usage() - c.memory_usage() == 2 * (40 - 36)  # one head's K and V norms, a byte less each


def test_tensor_core_kernel_is_not_given_norm_bytes():
    """The mma kernels read binary16 scales as words: a uint8 norm plane gives no operands
    (the step then runs the warp kernel, as for code rows that give no word views)."""
    kc = np.zeros((2, 8, 64), np.uint8)
    assert mma_operands(kc, np.zeros((2, 8, 1), np.uint16), kc, np.zeros((2, 8, 1), np.uint16), flat=True)
    assert mma_operands(kc, np.zeros((2, 8, 1), np.uint8), kc, np.zeros((2, 8, 1), np.uint8), flat=True) is None


def test_mixed_caches_keep_their_grids_through_save_load(tmp_path):
    """Per-layer (``layer_overrides``) and per-head (``head_overrides``) norm8 parts: each part
    layer has its own grid, and a saved and loaded mixed cache decodes bit for bit the same."""
    rng = np.random.default_rng(9)
    c = make_cache("pqo-k4v2-head-eden-vq", num_layers=2, num_kv_heads=2, head_dim=64,
                   layer_overrides={1: {"norm_bits": 8}}, head_overrides={0: {1: {"norm_bits": 8}}})
    cfg = AttendConfig(0.125, 2)
    for layer in range(2):
        k, v = _kv(rng, 1, 2, 30, 64, spread=1.0)
        c.prefill(layer, k, v)
    bases = [part._layers[i].meta.get("norm8_base") for layer in range(2) for part, i, _ in c.layer_pieces(layer)]
    assert sum(b is not None for b in bases) == 2  # layer 0's head 1, layer 1
    c.save(tmp_path / "mixed.safetensors")
    d = load_cache(tmp_path / "mixed.safetensors", expect=c)
    assert [part._layers[i].meta.get("norm8_base") for layer in range(2)
            for part, i, _ in d.layer_pieces(layer)] == bases
    k1, v1 = _kv(rng, 1, 2, 1, 64)
    q = rng.standard_normal((1, 4, 1, 64)).astype(np.float32)
    for layer in range(2):
        np.testing.assert_array_equal(c.decode(layer, k1, v1, q, cfg).out, d.decode(layer, k1, v1, q, cfg).out)


def test_restored_grid_is_validated():
    """A state whose layer lacks its grid (or has one the configuration does not store, or an
    out-of-range one) is rejected on load, naming the layer."""
    from numba_kv import PolarQuantCache
    from numba_kv.caches.state import CacheFileError, CacheState

    rng = np.random.default_rng(10)
    k, v = _kv(rng, 1, 2, 10, 64)
    for name, edit, match in (("pqo3-head-n8", lambda m: m.pop("norm8_base"), "needs its grid base"),
                              ("pqo3-head-n8", lambda m: m.update(norm8_base=5000), "needs its grid base"),
                              ("pqo3-head", lambda m: m.update(norm8_base=1000), "8-bit norm grid")):
        c = make_cache(name, **GEO)
        c.prefill(0, k, v)
        st = c.state_dict()
        edit(st.state["layers"][0]["meta"])
        with pytest.raises(CacheFileError, match=rf"^state: layer 0 .*{match}"):
            PolarQuantCache.from_state_dict(CacheState(st.config, st.state, st.tensors))
