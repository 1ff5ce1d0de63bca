"""`numba-kv bench attention` and the benchmark helpers: tables and JSON carry the provenance,
the fused result agrees with dequantize-then-attend, the cache.decode rows come out."""

import json
import time

import numpy as np

import numba_kv.toolkit.bench as bench_module
from numba_kv.toolkit.bench import _interleaved_best, blas_threads_limited, make_case, run_decode_bench
from numba_kv.toolkit.cli import main


def test_cli_json_has_provenance_and_rows(tmp_path, capsys):
    js = tmp_path / "att.json"
    assert main(["bench", "attention", "--tokens", "64", "--bits", "3", "--repeat", "1", "--no-decode",
                 "--no-progress", "--json", str(js)]) == 0
    rep = json.loads(js.read_text())
    for key in ("cpu_model", "llvm_host_cpu", "codegen_target", "avx512_in_codegen", "numba_threads", "blas_threads"):
        assert key in rep["provenance"]
    assert rep["provenance_line"].startswith(rep["provenance"]["cpu_model"])
    assert rep["stream_copy_gb_per_s"] > 0
    (row,) = rep["rows"]
    assert (row["tokens"], row["bits"]) == (64, 3)
    assert row["max_rel_err_vs_dequant"] < 1e-5
    assert row["speedup_vs_dense"] == row["dense_ms"] / row["fused_ms"]
    assert row["dense_best_ms"] == min(row["dense_ms"], row["dense_blas2_ms"])
    assert rep["decode"] == []


def test_cli_table_is_labelled(capsys):
    assert main(["bench", "attention", "--tokens", "32", "--bits", "4", "--repeat", "1", "--no-decode",
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "LLVM host" in out and "AVX-512 in code" in out and "copy GB/s" in out


def test_dense_attention_matches_softmax_formula():
    c = make_case(40, 3, num_kv_heads=2, num_heads=6, head_dim=32)
    with blas_threads_limited(1):
        out = c.dense()
    q = c.q[0, :, 0].astype(np.float64).reshape(2, 3, 32)
    s = np.einsum("hgd,htd->hgt", q, c.k[0].astype(np.float64)) / np.sqrt(32)
    p = np.exp(s - s.max(-1, keepdims=True))
    ref = np.einsum("hgt,htd->hgd", p / p.sum(-1, keepdims=True), c.v[0])
    np.testing.assert_allclose(out[0, :, 0], ref.reshape(6, 32), rtol=1e-5, atol=1e-6)


def test_decode_rows():
    rows = run_decode_bench(["pqo3", "tq3:residual_length=0"], tokens=48, repeat=1, num_kv_heads=2, num_heads=4,
                            head_dim=64, progress=False)
    assert [r.cache.split("-")[0] for r in rows] == ["pqo3", "tq3"]
    assert all(r.decode_ms > 0 and r.dense_ms > 0 and r.kv_mb > 0 for r in rows)


def test_cli_decode_caches_and_tokens(tmp_path, capsys):
    """``--decode-caches`` picks the cache.decode rows (mixed widths and 1-bit codes included),
    ``--decode-tokens`` their history length; a bad cache is an error naming the option."""
    js = tmp_path / "dec.json"
    assert main(["bench", "attention", "--tokens", "32", "--bits", "3", "--repeat", "1", "--no-progress",
                 "--decode-caches", "pq2,pqo2.5:r=8,s=2", "--decode-tokens", "96", "--json", str(js)]) == 0
    rows = json.loads(js.read_text())["decode"]
    assert [(r["cache"], r["tokens"]) for r in rows] == [("pq2-r32-s4", 96), ("pqo2.5-r8-s2", 96)]
    assert all(r["decode_ms"] > 0 for r in rows)
    assert main(["bench", "attention", "--tokens", "32", "--bits", "3", "--repeat", "1", "--no-progress",
                 "--decode-caches", "pqo9"]) == 2
    assert "--decode-caches: unknown cache 'pqo9'" in capsys.readouterr().err


def test_interleaved_pause_is_idle_and_untimed():
    """``pause_s`` sleeps before every timed call (parking the threads the previous contender
    left spinning), then calls the same contender once untimed (waking its own threads); the
    sleep and that call are not part of any timing."""
    calls = []
    t0 = time.perf_counter()
    best = _interleaved_best([lambda: calls.append("a"), lambda: calls.append("b")], 3, pause_s=0.05)
    elapsed = time.perf_counter() - t0
    # one warm-up round, then three rounds of (untimed, timed) pairs
    assert calls == ["a", "b"] + ["a", "a", "b", "b"] * 3
    assert elapsed >= 6 * 0.05 and max(best) < 0.01


def test_interleaved_pause_times_only_the_call_after_the_untimed_one(monkeypatch):
    """The untimed call after the pause absorbs a contender's first-call-after-idle cost: a
    function that is slow only on its first call after a pause is timed at its fast speed."""
    real_sleep = time.sleep
    state = {"idle": False}

    def marking_sleep(s):
        state["idle"] = True
        real_sleep(s)

    def slow_after_idle():
        if state["idle"]:
            real_sleep(0.03)
        state["idle"] = False

    monkeypatch.setattr(bench_module.time, "sleep", marking_sleep)
    best = _interleaved_best([slow_after_idle], 2, pause_s=0.01)
    assert best[0] < 0.01
