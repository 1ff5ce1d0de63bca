"""The head VQ code as a PolarQuantCache option (``vq``): stored codes, fused decode, names,
persistence, options and bytes."""

import numpy as np
import pytest

from numba_kv import AttendConfig, Dequantized, Fused, PolarQuantCache, load_cache, make_cache, reference
from numba_kv.caches.config import PolarQuantConfig
from numba_kv.ops.attention import CodeLayout, attention_plan, mma_layout_ok
from numba_kv.ops.headquant import dequantize_head, quantize_head
from numba_kv.ops.headvq import dequantize_headvq, quantize_headvq


def rel_err(out, ref):
    return float(np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-30))


def _kv(rng, b, h, n, d):
    return (rng.standard_normal((b, h, n, d)).astype(np.float32), rng.standard_normal((b, h, n, d)).astype(np.float32))


@pytest.mark.parametrize(("name", "vq_sides"), [("pqo-k4v2-head-eden", (True, True)),
                                                ("pqo-k4v3-head", (True, False)),
                                                ("pqo-k3v2-head-eden", (False, True))])
def test_stored_history_is_the_headvq_op(name, vq_sides):
    """Without a window every token is compressed: the history equals the public ops'
    quantize → dequantize (VQ sides: quantize_headvq; scalar sides: quantize_head), bit for bit."""
    rng = np.random.default_rng(1)
    d = 64
    c = make_cache(name, num_layers=1, num_kv_heads=2, head_dim=d, vq=True, residual_length=0, sink_tokens=0,
                   decode_output="dequantized")
    assert tuple(c.vq_sides.values()) == vq_sides and c.name == name + "-vq-r0-s0"
    k, v = _kv(rng, 2, 2, 9, d)
    c.prefill(0, k, v)
    q = rng.standard_normal((2, 2, 1, d)).astype(np.float32)
    k1, v1 = _kv(rng, 2, 2, 1, d)
    hist = c.decode(0, k1, v1, q, AttendConfig(0.125, 1)).result
    for side, x, got, on in (("k", k, hist.k, vq_sides[0]), ("v", v, hist.v, vq_sides[1])):
        bits = c.slot_bits[side]
        full = np.concatenate([x, k1 if side == "k" else v1], axis=2)
        if on:
            want = dequantize_headvq(*quantize_headvq(full, bits, c.unbiased), bits)
            # (a head VQ layout: the tensor-core kernel's VQ build reads it, at head_dim 128)
            assert c.layouts[side].group == 8 // bits and mma_layout_ok(c.layouts[side])
        else:
            want = dequantize_head(*quantize_head(full, bits, c.unbiased), bits)
            assert c.layouts[side].group == 1
        np.testing.assert_array_equal(got, want)


CASES = [("pqo-k4v2-head-eden", {}), ("pqo-k4v3-head", {"window_dtype": "float32"}),
         ("pqo-k4v2-head-eden", {"window_dtype": "int8", "key_center": True}),
         ("pqo2-head", {"window_dtype": "int8", "window_rotation": False})]


@pytest.mark.parametrize(("R", "S"), [(0, 0), (5, 2)])
@pytest.mark.parametrize(("name", "opts"), CASES)
def test_fused_equals_reference_over_the_history(name, opts, R, S):
    """GQA (3 query heads per KV head), chunked prefill and decode steps (one of 3 tokens):
    every fused output equals float64 attention over the history of the same cache in
    ``decode_output="dequantized"`` (window/sinks exact or int8, the rest the VQ / scalar code)."""
    rng = np.random.default_rng([len(name), len(opts), R, S])
    b, hkv, groups, d = 2, 2, 3, 64
    geo = dict(num_layers=1, num_kv_heads=hkv, head_dim=d, residual_length=R, sink_tokens=S, vq=True, **opts)
    fused, deq = make_cache(name, **geo), make_cache(name, decode_output="dequantized", **geo)
    cfg = AttendConfig(d ** -0.5, groups)
    for step, n in enumerate([7, 6, 1, 1, 3, 1, 9, 1]):
        k, v = _kv(rng, b, hkv, n, d)
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


def test_plan_routes_vq_layouts_to_the_block_kernel():
    """The warp and tensor-core kernels decode scalar codes only: a VQ layout on either side
    gets the block kernel (CPU: the twin, which reads both)."""
    lay = CodeLayout.head_vq(4, 128)
    assert lay.width == 64 and lay.num_scales == 1 and lay.centroids.shape == (4, 512)
    assert CodeLayout.head_vq(2, 128).centroids.shape == (4, 1024)
    q = np.zeros((2, 3, 128), np.float32)
    plan = attention_plan(q, paged=False, n_g=2, rows=3, d=128, klayout=lay, vlayout=lay, v_width=64)
    assert plan.variant == "cpu"


def test_memory_is_the_scalar_codes_bytes():
    """Same bytes per vector as the scalar head code (by formula and as stored)."""
    rng = np.random.default_rng(3)
    k, v = _kv(rng, 1, 2, 50, 64)
    caches = [make_cache("pqo-k4v2-head-eden", num_layers=1, num_kv_heads=2, head_dim=64, vq=vq, window_dtype="int8")
              for vq in (False, True)]
    for c in caches:
        c.prefill(0, k, v)
    a, b = caches
    assert a.memory_usage() == b.memory_usage() == sum(x.nbytes for x in b.live_arrays(0))
    n_exact = 4 + 32  # rows × (compressed: K 32 + V 16 code bytes + a binary16 norm each; exact: int8 + scale)
    assert b.memory_usage() == 2 * ((50 - n_exact) * (32 + 2 + 16 + 2) + 2 * n_exact * (64 + 2))
    assert b.bits_per_value == a.bits_per_value


def test_save_load_round_trip(tmp_path):
    rng = np.random.default_rng(4)
    a = make_cache("pqo-k4v3-head-eden-vq", num_layers=1, num_kv_heads=2, head_dim=64, residual_length=3,
                   sink_tokens=1, window_dtype="int8", key_center=True)
    k, v = _kv(rng, 1, 2, 20, 64)
    a.prefill(0, k, v)
    a.save(tmp_path / "vq.safetensors")
    b = load_cache(tmp_path / "vq.safetensors", expect=a)
    assert b.config == a.config and b.config.vq and b.layouts["k"].group == 2
    assert a.config_dict()["vq"] is True
    k1, v1 = _kv(rng, 1, 2, 1, 64)
    q = rng.standard_normal((1, 4, 1, 64)).astype(np.float32)
    cfg = AttendConfig(0.125, 2)
    np.testing.assert_array_equal(a.decode(0, k1, v1, q, cfg).out, b.decode(0, k1, v1, q, cfg).out)
    # a file written without the option (older versions) loads as the scalar code
    old = make_cache("pqo-k4v3-head-eden", num_layers=1, num_kv_heads=2, head_dim=64)
    old.prefill(0, k, v)
    old.save(tmp_path / "old.safetensors")
    assert not load_cache(tmp_path / "old.safetensors").config.vq


def test_names_and_option_resolution():
    geo = dict(num_layers=1, num_kv_heads=1, head_dim=64)
    assert make_cache("pqo-k4v2-head-eden-vq", **geo).config == make_cache("pqo-k4v2-head-eden", vq=True, **geo).config
    assert make_cache("pqo4-head-vq-r8-s2", **geo).name == "pqo4-head-vq-r8-s2"
    # no side at 4 or 2 bits: the scalar code, resolved to vq=False (the same cache)
    assert PolarQuantConfig(1, 1, 64, bits=3, rotation="head", vq=True) == PolarQuantConfig(1, 1, 64, bits=3,
                                                                                            rotation="head")
    assert PolarQuantConfig(1, 1, 64, bits=3, mode="pq", rotation="head", vq=True).vq_sides == {"k": True, "v": True}
    # presets take the option (same bytes: the same window)
    assert make_cache("kv4:vq=true", **geo).name == make_cache("kv4", **geo).name.replace("-eden", "-eden-vq")


@pytest.mark.parametrize(("name", "opts", "err", "match"), [
    ("pqo4", {"vq": True}, ValueError, r"^vq: .*rotation='head'"),
    ("pqo4-head", {"vq": "yes"}, TypeError, r"^vq: expected a bool"),
    ("tq-k5v4-head", {"vq": True}, ValueError, r"^vq: .*TurboQuantCache"),
    ("pqo4-vq", {}, ValueError, r"^vq: .*rotation='head'"),
])
def test_bad_option_combinations(name, opts, err, match):
    with pytest.raises(err, match=match):
        make_cache(name, num_layers=1, num_kv_heads=1, head_dim=64, **opts)


def test_vq_is_a_per_head_option():
    """head_overrides may switch single heads to the VQ code (same bytes, one layer's pieces)."""
    c = make_cache("pqo-k4v2-head-eden", num_layers=1, num_kv_heads=3, head_dim=64,
                   head_overrides={0: {1: {"vq": True}}})
    pieces = {heads: part.config.vq for part, _, heads in c.layer_pieces(0)}
    assert pieces == {(0, 2): False, (1,): True}
    with pytest.raises(ValueError, match="rotation"):
        make_cache("pqo4", num_layers=1, num_kv_heads=2, head_dim=64, head_overrides={0: {1: {"vq": True}}})
    assert isinstance(PolarQuantCache(1, 1, 64, bits=4, rotation="head", vq=True), PolarQuantCache)
