"""``numba-kv eval --mode long``: on the tiny random model (context 256), the long mode equals
the text mode run with the same tokens and a single-chunk prefill (an independent path: the
text mode prefills through each cache, the long mode stores the dense model's history), dense
against dense is exactly zero, the chunked dense history (sliding windows included) matches
the one-chunk one, bad options raise errors naming the argument, JSON schema, plot, CLI."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from numba_kv.toolkit import cli
from numba_kv.toolkit.evaluation import evaluate as ev
from numba_kv.toolkit.evaluation import long_context as lc
from numba_kv.toolkit.specs import EvalConfigError, parse_cache_specs

from .test_eval import PROSE

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SCORED = 40
LENGTHS = (120, 200)
# (the presets need head_dim >= 64) pqo4 keeps a 36-token window, pqo3-r8-s2 compresses most of the history
CACHES = "pqo4,pqo3-r8-s2,dense:dtype=float32"


@pytest.fixture(scope="module")
def result(tiny):
    """Token order: the text mode's own loop, so the two modes must agree exactly."""
    model, tok, _ = tiny
    return lc.run_long(parse_cache_specs(CACHES), model=model, tokenizer=tok, text=PROSE, lengths=LENGTHS,
                       scored=SCORED, chunk_size=None, threads=1, progress=False, order="token")


def test_layer_order_matches_token_order(tiny, result):
    """The default layer-major decode: same rows as the token loop up to BLAS rounding (the
    compressed caches store the same codes, so their metrics agree closely, not just within SE)."""
    model, tok, _ = tiny
    lay = lc.run_long(parse_cache_specs(CACHES), model=model, tokenizer=tok, text=PROSE, lengths=LENGTHS,
                      scored=SCORED, chunk_size=None, threads=1, progress=False)
    assert lay.config["decode_order"] == "layer" and result.config["decode_order"] == "token"
    assert [(r.length, r.cache) for r in lay.rows] == [(r.length, r.cache) for r in result.rows]
    for a, b in zip(lay.rows, result.rows):
        assert (a.kv_bytes, a.kv_tokens) == (b.kv_bytes, b.kv_tokens)
        assert a.top1_agreement == b.top1_agreement, a.cache
        assert a.ppl == pytest.approx(b.ppl, rel=1e-4), a.cache
        assert a.kl_mean == pytest.approx(b.kl_mean, rel=1e-2, abs=1e-7), a.cache


def test_rows_in_order(result):
    labels = ["dense", "pqo4-r32-s4", "pqo3-r8-s2", "dense:dtype=float32"]
    assert [(r.length, r.cache) for r in result.rows] == [(n, c) for n in LENGTHS for c in labels]
    for r in result.rows:
        assert r.history == r.length - SCORED - 1 and r.scored == SCORED
        assert r.kv_tokens == r.length  # bits/value counted at the length reached
        assert r.model == "tiny-test-llama"


def test_equals_the_text_mode(tiny, result, tmp_path):
    """Same tokens, P = length − scored − 1, single-chunk prefill: identical numbers."""
    model, tok, _ = tiny
    f = tmp_path / "prose.txt"
    f.write_text(PROSE, encoding="utf-8")
    for n in LENGTHS:
        text = ev.run_eval(parse_cache_specs(CACHES), model=model, tokenizer=tok, text_path=f, tokens=n,
                           prefill=n - SCORED - 1, gen_tokens=0, chunk_size=None, threads=1, progress=False)
        assert text.config["scored_positions"] == SCORED
        long_rows = [r for r in result.rows if r.length == n]
        assert [r.cache for r in long_rows] == [r.cache for r in text.rows]
        for a, b in zip(long_rows, text.rows):
            assert (a.kv_bytes, a.kv_tokens, a.bits_per_value) == (b.kv_bytes, b.kv_tokens, b.bits_per_value)
            for key in ("ppl", "ppl_change_pct", "ppl_change_se", "kl_mean", "kl_p99", "kl_max",
                        "top1_agreement", "top5_overlap"):
                assert getattr(a, key) == pytest.approx(getattr(b, key), rel=1e-12, abs=1e-12), (n, a.cache, key)


def test_dense_against_dense_is_zero(result):
    for r in result.rows:
        if r.name == "dense":  # the reference and the explicit float32 dense cache
            assert r.ppl_change_pct == 0.0 and r.ppl_change_se == 0.0 and r.kl_mean == 0.0 and r.kl_max == 0.0
            assert r.top1_agreement == 1.0 and r.bits_per_value == 32.0
    pq = [r for r in result.rows if r.cache == "pqo3-r8-s2"]
    assert all(r.kl_mean > 0.0 and r.bits_per_value < 8.0 for r in pq)
    # the window (8 + 2 tokens at float16) weighs less at the longer length
    assert pq[1].bits_per_value < pq[0].bits_per_value


def test_chunked_history_matches_one_chunk_with_sliding_windows(tiny, monkeypatch):
    """The recorder's per-chunk views (a local layer sees its last window − 1 tokens and the
    chunk) give the one-chunk keys/values, and the window changes them (it is applied)."""
    model, tok, _ = tiny
    ids = np.asarray(tok.encode(PROSE)[:150], dtype=np.int64)
    monkeypatch.setattr(model, "layer_windows", [24, None])
    one = lc.dense_history(model, ids, None)
    chunked = lc.dense_history(model, ids, 16)
    for li in range(model.config.n_layers):
        np.testing.assert_allclose(chunked.k[li], one.k[li], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(chunked.v[li], one.v[li], rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(model, "layer_windows", [None, None])
    full = lc.dense_history(model, ids, 16)
    np.testing.assert_allclose(full.k[0], one.k[0], rtol=1e-5, atol=1e-5)  # layer 0: no attention before it
    assert not np.allclose(full.k[1][:, :, 30:], one.k[1][:, :, 30:], atol=1e-4)  # beyond the window: differs
    np.testing.assert_allclose(full.k[1][:, :, :24], one.k[1][:, :, :24], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("kw", "fragment"), [
    ({"lengths": [300]}, "--lengths: 300 exceeds the context of tiny-test-llama (256 tokens)"),
    ({"lengths": None}, "--lengths: 8192 exceeds the context"),           # SmolLM2's defaults
    ({"lengths": [200], "text": "Too short."}, "--lengths: the text has"),
    ({"lengths": [41]}, "--lengths: 41 leaves no history before the --scored=40 tokens"),
    ({"lengths": [100, 100]}, "lists a length twice"),
    ({"lengths": []}, "--lengths: expected at least one length"),
    ({"lengths": [100], "scored": 0}, "--scored: expected an int >= 1"),
    ({"lengths": [100], "chunk_size": 0}, "--chunk: expected an int >= 1"),
    ({"lengths": [100], "threads": 10_000}, "--threads"),
    ({"lengths": [100], "order": "random"}, "--order: expected 'layer' or 'token'"),
])
def test_bad_options(tiny, kw, fragment):
    model, tok, _ = tiny
    args = {"text": PROSE, "scored": SCORED, **kw}
    with pytest.raises(EvalConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        lc.run_long([], model=model, tokenizer=tok, progress=False, **args)


def test_default_lengths(tiny):
    model, _, _ = tiny
    assert lc.default_lengths(model) == lc.SMOLLM2_LENGTHS == (4096, 8192)
    gemma = type("M", (), {"config": type("C", (), {"arch": "gemma3"})()})()
    assert lc.default_lengths(gemma) == lc.GEMMA3_LENGTHS == (8192, 16384, 32768)


ROW_KEYS = {"model": str, "length": int, "history": int, "scored": int, "cache": str, "bits_per_value": float,
            "ppl_change_pct": float, "ppl_change_se": float, "kl_mean": float, "top1_agreement": float,
            "wall_s": float, "store_s": float, "decode_s": float, "kv_bytes": int, "kv_tokens": int}
CONFIG_KEYS = {"model": str, "model_name": str, "text": str, "text_sha256": str, "text_tokens": int,
               "context_length": int, "scored": int, "lengths": list, "chunk_size": type(None), "caches": list,
               "threads": int, "decode_order": str, "dense_forward_s": dict}


def test_json_schema(result):
    doc = json.loads(json.dumps(result.to_json(), allow_nan=False))
    assert set(doc) == {"schema", "config", "env", "rows", "wall_s"}
    assert doc["schema"] == lc.LONG_SCHEMA == "numba_kv.long/1"
    assert set(doc["config"]) == set(CONFIG_KEYS)
    for key, typ in CONFIG_KEYS.items():
        assert isinstance(doc["config"][key], typ), key
    assert doc["config"]["lengths"] == list(LENGTHS) and doc["config"]["scored"] == SCORED
    assert set(doc["config"]["dense_forward_s"]) == {str(n) for n in LENGTHS}
    assert doc["config"]["caches"] == ["dense", "pqo4-r32-s4", "pqo3-r8-s2", "dense:dtype=float32"]
    assert len(doc["rows"]) == 8
    for row in doc["rows"]:
        for key, typ in ROW_KEYS.items():
            assert isinstance(row[key], typ), key
        assert row["wall_s"] >= row["store_s"] + row["decode_s"] - 1e-9
        assert row["generations"] == [] and row["gen_match"] is None and row["paris"] is None
        assert math.isfinite(row["ppl"])


def test_plot_and_table(result, tmp_path, capsys):
    out = lc.plot_long(result, tmp_path / "long.png")
    assert out.read_bytes()[:8] == PNG_MAGIC
    lc.render_long_table(result)
    text = capsys.readouterr().out
    assert "pqo3-r8-s2" in text and "ΔPPL" in text


def test_cli_long_outputs(result, monkeypatch, capsys, tmp_path):
    seen = {}

    def fake_run(specs, **kw):
        seen.update(kw, specs=[s.label for s in specs])
        return result

    monkeypatch.setattr(lc, "run_long", fake_run)
    js, png = tmp_path / "l.json", tmp_path / "l.png"
    assert cli.main(["eval", "--mode", "long", "--cache", "dense,kv4,kv5", "--lengths", "4096,8192", "--scored",
                     "512", "--chunk", "128", "--json", str(js), "--plot", str(png), "--threads", "1"]) == 0
    assert seen["specs"] == ["dense", "kv4", "kv5"] and seen["lengths"] == [4096, 8192]
    assert seen["scored"] == 512 and seen["chunk_size"] == 128 and seen["threads"] == 1
    assert seen["order"] == "layer"
    assert json.loads(js.read_text())["schema"] == lc.LONG_SCHEMA and png.read_bytes()[:8] == PNG_MAGIC
    assert "last 40 positions" in capsys.readouterr().out
    seen.clear()
    assert cli.main(["eval", "--mode", "long", "--cache", "kv4", "--json", "-"]) == 0
    assert seen["lengths"] is None and seen["scored"] == 1024  # the model's default lengths
    assert json.loads(capsys.readouterr().out)["schema"] == lc.LONG_SCHEMA
    seen.clear()
    assert cli.main(["eval", "--mode", "long", "--cache", "kv4", "--order", "token", "--json", "-"]) == 0
    assert seen["order"] == "token"
    capsys.readouterr()


def test_cli_long_errors(tiny, monkeypatch, capsys):
    assert cli.main(["eval", "--mode", "long", "--lengths", "4k"]) == 2
    assert "--lengths: expected comma-separated ints" in capsys.readouterr().err
    model, tok, _ = tiny
    monkeypatch.setattr(lc.models, "load_model", lambda path=None: (model, tok))
    assert cli.main(["eval", "--mode", "long", "--lengths", "2048", "--cache", "kv4"]) == 2
    assert "--lengths: 2048 exceeds the context of tiny-test-llama (256 tokens)" in capsys.readouterr().err
