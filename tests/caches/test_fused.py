"""Fused decode of the PolarQuant caches, the full-precision window and attention sinks."""

import numpy as np
import pytest

from numba_kv import AttendConfig, Dequantized, Fused, PolarQuantCache, make_cache, reference


def rel_err(out, ref):
    return float(np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-30))


WINDOWS = [(0, 0), (8, 0), (0, 4), (16, 4), (1, 1)]


@pytest.mark.parametrize("R, S", WINDOWS)
@pytest.mark.parametrize("name", ["pqo3", "pq3", "pqo4", "pqo2-l2"])
def test_fused_equals_reference_over_the_history(name, R, S):
    """Stream prefill chunks + decode steps; every Fused output equals float64 attention over
    the history the same cache returns (exact window/sinks + dequantized rest)."""
    rng = np.random.default_rng(hash((name, R, S)) % 2**32)
    b, hkv, groups, d = 2, 2, 3, 64
    opts = dict(num_layers=1, num_kv_heads=hkv, head_dim=d, residual_length=R, sink_tokens=S)
    fused = make_cache(name, **opts)
    deq = make_cache(name, decode_output="dequantized", **opts)
    cfg = AttendConfig(d ** -0.5, groups)
    for step, n in enumerate([7, 3, 1, 1, 4, 1, 20, 1]):
        k = rng.standard_normal((b, hkv, n, d)).astype(np.float32)
        v = rng.standard_normal((b, hkv, n, d)).astype(np.float32)
        if step < 2:
            for c in (fused, deq):
                c.prefill(0, k, v)
            continue
        q = rng.standard_normal((b, hkv * groups, n, d)).astype(np.float32)
        out = fused.decode(0, k, v, q, cfg)
        hist = deq.decode(0, k, v, q, cfg)
        assert isinstance(out, Fused) and isinstance(hist, Dequantized)
        T = fused.seq_len(0)
        ref = reference.attention(q, hist.result.k, hist.result.v, cfg.softmax_scale, causal_offset=T - n)
        assert out.out.shape == (b, hkv * groups, n, d)
        assert rel_err(out.out, ref) < 1e-5
    assert fused.memory_usage() == deq.memory_usage()


@pytest.mark.parametrize("R, S", [(8, 0), (0, 3), (5, 2), (100, 0)])
def test_window_keeps_tokens_exact_and_in_order(R, S):
    rng = np.random.default_rng(0)
    c = PolarQuantCache(1, 2, 64, bits=3, residual_length=R, sink_tokens=S, window_dtype="float32")
    chunks = [rng.standard_normal((1, 2, n, 64)).astype(np.float32) for n in (4, 9, 1, 1, 30, 1)]
    for x in chunks:
        res = c.prefill(0, x, x)
    full = np.concatenate(chunks, 2)
    T = full.shape[2]
    hist = res.k
    assert hist.shape == (1, 2, T, 64)
    exact = np.zeros(T, bool)
    exact[:min(S, T)] = True
    exact[max(S, T - R):] = True
    np.testing.assert_array_equal(hist[:, :, exact], full[:, :, exact])  # window + sinks bit-exact
    if (~exact).any():
        err = np.abs(hist[:, :, ~exact] - full[:, :, ~exact]).max()
        assert 0 < err < 2.0  # compressed, in the right order (a misplaced token would be way off)
        cos = (hist[:, :, ~exact] * full[:, :, ~exact]).sum(-1) / np.linalg.norm(full[:, :, ~exact], axis=-1) / \
            np.linalg.norm(hist[:, :, ~exact], axis=-1)
        assert cos.min() > 0.9


def test_window_memory_is_counted_exactly():
    rng = np.random.default_rng(0)
    d, hkv, R, S = 64, 2, 16, 4
    for dt, item in (("float16", 2), ("float32", 4)):
        c = PolarQuantCache(1, hkv, d, bits=3, residual_length=R, sink_tokens=S, window_dtype=dt)
        for n in (3, 10, 50):
            c.prefill(0, *rng.standard_normal((2, 1, hkv, n, d)).astype(np.float32))
        T = 63
        n_exact = S + R
        n_comp = T - n_exact
        per_comp = 2 * (d * 3 // 8 + 2 * d // 32)
        assert c.memory_usage() == hkv * (n_comp * per_comp + 2 * n_exact * d * item)
        assert c.memory_usage() == sum(a.nbytes for a in c.live_arrays(0))


def test_float16_window_is_close_to_exact():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 2, 10, 64)).astype(np.float32)
    c = PolarQuantCache(1, 2, 64, residual_length=16)
    c.prefill(0, x, x)
    h = c.prefill(0, x[:, :, :1], x[:, :, :1]).k
    np.testing.assert_allclose(h[:, :, :10], x, rtol=2.0 ** -10, atol=1e-7)


def test_fused_keeps_query_dtype_and_validates_groups():
    rng = np.random.default_rng(0)
    c = make_cache("pqo3", num_layers=1, num_kv_heads=2, head_dim=64)
    k = rng.standard_normal((1, 2, 5, 64))
    c.prefill(0, k, k)
    q = rng.standard_normal((1, 6, 1, 64))
    out = c.decode(0, k[:, :, :1], k[:, :, :1], q, AttendConfig(0.125, 3))
    assert out.out.dtype == np.float64
    before = c.memory_usage()
    with pytest.raises(ValueError, match="n_kv_groups"):
        c.decode(0, k[:, :, :1], k[:, :, :1], q, AttendConfig(0.125, 2))
    assert c.memory_usage() == before and c.seq_len(0) == 6


@pytest.mark.parametrize("kwargs, word", [
    (dict(residual_length=-1), "residual_length"), (dict(sink_tokens=1.5), "sink_tokens"),
    (dict(window_dtype="int4"), "window_dtype"), (dict(decode_output="both"), "decode_output"),
])
def test_bad_window_options(kwargs, word):
    with pytest.raises((ValueError, TypeError), match=word):
        PolarQuantCache(1, 1, 64, **kwargs)


@pytest.mark.parametrize("name, kb, vb, bpv", [("pqo-k4v3", 4, 3, 4.0), ("pqo-k3v2", 3, 2, 3.0),
                                               ("pq-k4v3", 4, 3, 3.0), ("pqo-k2v4-l2", 2, 4, 3.5)])
def test_asymmetric_bits(name, kb, vb, bpv):
    rng = np.random.default_rng(0)
    opts = dict(num_layers=1, num_kv_heads=2, head_dim=64, residual_length=0, sink_tokens=0)
    c = make_cache(name, **opts)
    deq = make_cache(name, decode_output="dequantized", **opts)
    assert (c.k_bits, c.v_bits, c.bits_per_value) == (kb, vb, bpv)
    k, v = rng.standard_normal((2, 1, 2, 30, 64)).astype(np.float32)
    for x in (c, deq):
        x.prefill(0, k, v)
    k1, v1 = rng.standard_normal((2, 1, 2, 1, 64)).astype(np.float32)
    q = rng.standard_normal((1, 4, 1, 64)).astype(np.float32)
    cfg = AttendConfig(0.125, 2)
    out = c.decode(0, k1, v1, q, cfg).out
    hist = deq.decode(0, k1, v1, q, cfg).result
    assert rel_err(out, reference.attention(q, hist.k, hist.v, 0.125)) < 1e-5
    kc, vc = c.live_arrays(0)[0], c.live_arrays(0)[1]
    assert kc.shape[-1] == 64 * c.slot_bits["k"] // 8 and vc.shape[-1] == 64 * c.slot_bits["v"] // 8
    assert c.memory_usage() == 2 * 31 * (kc.shape[-1] + vc.shape[-1] + 2 * 2 * 2)
    with pytest.raises(ValueError, match="k_bits"):
        make_cache("pqo-k4v3", num_layers=1, num_kv_heads=2, head_dim=64, k_bits=3)
    with pytest.raises(ValueError, match="k_bits"):
        PolarQuantCache(1, 2, 64, k_bits=5)


@pytest.mark.parametrize("name, kb, vb", [("pqo-k5v4-head-eden", 5, 4), ("pqo-k4v5-head", 4, 5),
                                           ("pqo-k5v5-head-eden", 5, 5)])
@pytest.mark.parametrize("d", [64, 256])
def test_five_bit_head_codes(name, kb, vb, d):
    """5-bit sides (the whole-head rotation only): fused decode equals float64 attention over
    the history the cache returns, bytes by formula, and the stored keys/values have the
    5-bit Lloyd–Max distortion (a 4-bit code's, 0.0093, would fail)."""
    rng = np.random.default_rng(d + 10 * kb + vb)
    opts = dict(num_layers=1, num_kv_heads=2, head_dim=d, residual_length=4, sink_tokens=2)
    c = make_cache(name, **opts)
    deq = make_cache(name, decode_output="dequantized", **opts)
    assert (c.k_bits, c.v_bits) == (kb, vb)
    k, v = rng.standard_normal((2, 1, 2, 400, d)).astype(np.float32)
    for x in (c, deq):
        x.prefill(0, k, v)
    cfg = AttendConfig(d ** -0.5, 2)
    for _ in range(3):
        k1, v1 = rng.standard_normal((2, 1, 2, 1, d)).astype(np.float32)
        q = rng.standard_normal((1, 4, 1, d)).astype(np.float32)
        out = c.decode(0, k1, v1, q, cfg).out
        hist = deq.decode(0, k1, v1, q, cfg).result
        assert rel_err(out, reference.attention(q, hist.k, hist.v, d ** -0.5)) < 1e-5
        k, v = np.concatenate([k, k1], 2), np.concatenate([v, v1], 2)
    n_comp = 403 - 4 - 2
    per_token = (d * kb // 8 + 2) + (d * vb // 8 + 2)  # packed indices + one binary16 norm per side
    window = 2 * 2 * (4 + 2) * d * 2  # float16 window and sinks: heads × (K, V) × tokens × d × 2 bytes
    assert c.memory_usage() == 2 * n_comp * per_token + window
    comp = slice(2, 403 - 4)  # the compressed tokens (after the sinks, before the window)
    for side, want, got in (("k", k, hist.k), ("v", v, hist.v)):
        err = ((got[..., comp, :] - want[..., comp, :]) ** 2).sum(-1) / (want[..., comp, :] ** 2).sum(-1)
        bits = kb if side == "k" else vb
        # Gaussian Lloyd–Max distortion (Max 1960); the head coordinate at d = 64 runs below it
        # and the EDEN rescale up to 15 % above it (tests/ops/test_headquant.py), hence 15 %
        assert float(err.mean()) == pytest.approx({4: 0.00950, 5: 0.00250}[bits], rel=0.15), side


def test_key_scale_was_removed():
    """The per-channel key scaling experiment is gone: its keyword is an unknown option."""
    with pytest.raises(TypeError, match=r"key_scale: not an option of PolarQuantCache; expected one of"):
        PolarQuantCache(1, 2, 64, key_scale="channel")


@pytest.mark.parametrize("R, S", [(0, 0), (8, 2)])
def test_key_centering_is_exact_for_attention(R, S):
    """key_center: fused attention (which drops the constant q·m) equals attention over the
    history (centered codes + m), and centering removes a large key offset's damage."""
    rng = np.random.default_rng(11)
    opts = dict(residual_length=R, sink_tokens=S, key_center=True, window_dtype="float32")
    c = PolarQuantCache(1, 2, 64, **opts)
    d = PolarQuantCache(1, 2, 64, decode_output="dequantized", **opts)
    plain = PolarQuantCache(1, 2, 64, residual_length=R, sink_tokens=S, window_dtype="float32",
                            decode_output="dequantized")
    k = rng.standard_normal((1, 2, 40, 64)).astype(np.float32)
    k[..., 44:50] += 20.0  # a large constant offset on a few channels (like slow RoPE pairs)
    v = rng.standard_normal((1, 2, 40, 64)).astype(np.float32)
    for x in (c, d, plain):
        x.prefill(0, k, v)
    cfg = AttendConfig(0.125, 2)
    k1 = rng.standard_normal((1, 2, 1, 64)).astype(np.float32)
    k1[..., 44:50] += 20.0
    v1 = rng.standard_normal((1, 2, 1, 64)).astype(np.float32)
    q = rng.standard_normal((1, 4, 1, 64)).astype(np.float32)
    out = c.decode(0, k1, v1, q, cfg).out
    hist = d.decode(0, k1, v1, q, cfg).result
    assert rel_err(out, reference.attention(q, hist.k, hist.v, 0.125)) < 1e-5
    full = np.concatenate([k, k1], 2)
    err_c = np.abs(hist.k - full)[:, :, :40 - R].mean()
    err_p = np.abs(plain.decode(0, k1, v1, q, cfg).result.k - full)[:, :, :40 - R].mean()
    assert err_c < 0.5 * err_p  # the offset no longer inflates the block scales
    assert c.memory_usage() == sum(a.nbytes for a in c.live_arrays(0))
    with pytest.raises(TypeError, match="key_center"):
        PolarQuantCache(1, 2, 64, key_center="yes")


@pytest.mark.parametrize("name", ["kv4", "pqo3", "tq3", "kv4:vq=true", "kv3:residual_fraction=0.0,residual_length=8",
                                  "kv4:norm_bits=8", "kv4:vq=true,norm_bits=8"])
def test_bound_decode_step_equals_a_fresh_one_every_step(name):
    """A layer binds its fused attention step (and, for kv4 and kv3 — the scalar or the VQ code
    on either side (``kv4:vq=true``: VQ keys, scalar values), binary16 or 8-bit norms — the
    one-call store) once and reuses it; over steps that regrow
    the buffers and move the window, outputs and stored bytes equal, bit for bit, a cache that
    takes the op-by-op store and binds afresh every step (its scratch dropped before each
    call).  (``kv3`` with a fixed window: its growing one evicts too rarely to regrow them.)"""
    from numba_kv import _config

    rng = np.random.default_rng(5)
    caches = [make_cache(name, num_layers=2, num_kv_heads=2, head_dim=64) for _ in range(2)]
    caches[1]._window8_head = False  # the op-by-op store
    att = AttendConfig(0.125, n_kv_groups=3)
    k = rng.standard_normal((1, 2, 150, 64)).astype(np.float32)
    with _config.knobs(growth_min_extra=4, growth_fraction=0.0):  # the buffers regrow every 4 tokens
        for c in caches:
            for layer in range(2):  # two chunks: the second fills the compressed buffers to capacity
                for lo, hi in ((0, 60), (60, 120 + layer)):
                    c.prefill(layer, k[:, :, lo:hi], k[:, :, ::-1][:, :, lo:hi].copy())
        caps = [st.capacity for st in caches[0]._layers]
        for step in range(12):
            kv = rng.standard_normal((2, 1, 2, 1 + (step == 7), 64)).astype(np.float32)
            q = rng.standard_normal((1, 6, kv.shape[3], 64)).astype(np.float32)
            outs = []
            for c in caches:
                if c is caches[1]:
                    for st in c._layers:
                        st.scratch.clear()
                outs.append([c.decode(layer, kv[0], kv[1], q, att).out for layer in range(2)])
            for a, b in zip(*outs):
                np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
        assert all(st.capacity > cap for st, cap in zip(caches[0]._layers, caps))  # the buffers moved
    for layer in range(2):
        for a, b in zip(caches[0].live_arrays(layer), caches[1].live_arrays(layer)):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("name", ["kv4", "pqo3", "tq3", "kv4:vq=true"])
def test_one_call_host_step_equals_the_op_by_op_step(name, parallel, monkeypatch):
    """A host decode step rotates the queries, runs the partitions (serially, or in parallel
    from the ``cpu_parallel_min_work`` knob's work on) and merges them in one compiled
    call (``FlatStep.run(..., rotate=...)``); the same steps op by op (the rotation, the
    partition kernel and the merge dispatched one by one) give the same bits."""
    from numba_kv import _config
    from numba_kv.ops.attention import plan as plan_mod

    calls = []
    entry = "flat_step_parallel" if parallel else "flat_step_serial"
    one_call = getattr(plan_mod, entry)
    monkeypatch.setattr(plan_mod, entry, lambda *a: calls.append(1) or one_call(*a))
    rng = np.random.default_rng(11)
    caches = [make_cache(name, num_layers=1, num_kv_heads=3, head_dim=64) for _ in range(2)]
    k = rng.standard_normal((1, 3, 100, 64)).astype(np.float32)
    for c in caches:
        c.prefill(0, k, k[:, :, ::-1].copy())
    att = AttendConfig(0.125, n_kv_groups=3)
    op_by_op = 0
    with _config.knobs(cpu_parallel_min_work=0 if parallel else 1 << 40):
        for _ in range(8):
            kv = rng.standard_normal((2, 1, 3, 1, 64)).astype(np.float32)
            q = rng.standard_normal((1, 9, 1, 64)).astype(np.float32)
            n_calls = len(calls)
            one = caches[0].decode(0, kv[0], kv[1], q, att).out
            assert len(calls) == n_calls + 1  # the one-call path ran
            st = caches[1]._layers[0]
            if "fused_step" in st.scratch:  # the bound step without its rotation: op by op
                st.scratch["fused_step"] = st.scratch["fused_step"]._replace(rotate=None)
            n_calls = len(calls)
            ops = caches[1].decode(0, kv[0], kv[1], q, att).out
            op_by_op += len(calls) == n_calls
            np.testing.assert_array_equal(one.view(np.uint32), ops.view(np.uint32))
    assert op_by_op >= 4  # (a step that regrows the buffers binds again, with the rotation)
    # both paths ran one compilation of the partition kernel: the one-call step hands it plain
    # bools (literal Falses made a Literal[bool] signature of its own: ~13 s a compile)
    from numba_kv.ops.attention.kernels import DECODE_ATTENTION

    twin = DECODE_ATTENTION.cpu if parallel else DECODE_ATTENTION.cpu.serial
    assert twin.signatures and not any("Literal" in str(sig) for sig in twin.signatures), twin.signatures
