"""What the CPU benchmarks measure (QA pass): the BLAS thread switch of the dense baselines
stays out of the timed calls, a run without timed calls is refused, ``bench modes`` builds
the caches its rows name, and the pytest-benchmark suites time what their names say."""

from __future__ import annotations

import time
import types
from typing import Any

import numba
import numpy as np
import pytest

import numba_kv.toolkit.bench as bench_module
from numba_kv import make_cache
from numba_kv.toolkit import recommend


class _Timeline:
    """Records the BLAS limit switches (a stand-in for threadpoolctl), the clock reads of
    :mod:`numba_kv.toolkit.bench` and the calls of the contenders, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []
        self.limit: int | None = None

    def limits(self, limits: int, user_api: str) -> Any:
        timeline = self

        class _Limit:
            def __enter__(self) -> None:
                timeline.events.append(("enter", limits))
                self.prev, timeline.limit = timeline.limit, limits

            def __exit__(self, *exc: object) -> None:
                timeline.events.append(("exit", limits))
                timeline.limit = self.prev

        return _Limit()

    def clock(self) -> float:
        self.events.append(("clock", None))
        return time.perf_counter()

    def timed_windows(self) -> list[list[tuple[str, Any]]]:
        """The events between each start and stop read of the clock (reads come in pairs)."""
        clocks = [i for i, e in enumerate(self.events) if e[0] == "clock"]
        assert len(clocks) % 2 == 0
        return [self.events[a + 1:b] for a, b in zip(clocks[::2], clocks[1::2])]


@pytest.fixture
def timeline(monkeypatch: pytest.MonkeyPatch) -> _Timeline:
    tl = _Timeline()
    monkeypatch.setattr(bench_module, "threadpool_limits", tl.limits)
    monkeypatch.setattr(bench_module, "time", types.SimpleNamespace(perf_counter=tl.clock, sleep=lambda s: None))
    return tl


def test_attention_bench_switches_blas_threads_outside_the_timed_calls(timeline, monkeypatch):
    """Each timed window holds exactly one call of its contender, under its BLAS thread count
    (fused: untouched; dense: 1 and ``best_threads``; dequantize-then-attend: 1), and no
    threadpoolctl switch (about 1 ms each, which was timed as part of the dense baselines)."""
    case_cls = bench_module.AttentionCase
    for name in ("fused", "dense", "dequant_then_attend"):
        real = getattr(case_cls, name)

        def recorded(self: Any, real: Any = real, name: str = name) -> np.ndarray:
            timeline.events.append((name, timeline.limit))
            return real(self)

        monkeypatch.setattr(case_cls, name, recorded)
    rows = bench_module.run_attention_bench([32], [3], repeat=2, progress=False, best_threads=2, stream_gbs=1.0)
    assert len(rows) == 1 and rows[0].dense_best_threads == 2
    windows = timeline.timed_windows()
    expected = [[("fused", None)], [("dense", 1)], [("dense", 2)], [("dequant_then_attend", 1)]] * 2
    assert windows == expected


def test_decode_bench_switches_blas_threads_outside_the_timed_calls(timeline, monkeypatch):
    real_dense = bench_module.dense_attention

    def dense(*args: Any) -> np.ndarray:
        timeline.events.append(("dense", timeline.limit))
        return real_dense(*args)

    monkeypatch.setattr(bench_module, "dense_attention", dense)
    (row,) = bench_module.run_decode_bench(["pqo3"], tokens=40, repeat=2, num_kv_heads=2, num_heads=4, head_dim=32,
                                           progress=False)
    windows = timeline.timed_windows()
    assert len(windows) == 6
    # the baselines: one call each, one BLAS thread and best_threads, no switch timed
    n = numba.get_num_threads()  # (the default best: as many BLAS threads as the step's Numba threads)
    assert windows[1::3] == [[("dense", 1)]] * 2 and windows[2::3] == [[("dense", n)]] * 2
    assert all(e[0] not in ("enter", "exit", "dense") for w in windows[::3] for e in w)  # the cache's step
    # best vs best, as the attention table: the faster dense against the step on every Numba thread
    assert row.dense_best_threads == n and row.dense_best_ms == min(row.dense_ms, row.dense_blas2_ms)
    assert row.speedup_vs_dense_best == row.dense_best_ms / row.decode_ms


def test_best_dense_takes_as_many_blas_threads_as_the_fused_side_has_numba_threads():
    """"Best vs best": the best dense column's BLAS threads follow the Numba threads (it was a
    fixed 2: on a 16-core host, 2 BLAS threads against 16 Numba threads)."""
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        assert bench_module.best_blas_threads() == 1
        assert bench_module.best_blas_threads(3) == 3
    finally:
        numba.set_num_threads(before)
    assert bench_module.best_blas_threads() == before


@pytest.mark.parametrize("repeat", [0, -1])
def test_no_timed_call_is_refused(repeat):
    """``repeat`` < 1 timed nothing and reported ``inf`` ms and NaN ratios (exit status 0)."""
    with pytest.raises(ValueError, match="repeat"):
        bench_module._interleaved_best([lambda: None], repeat)
    with pytest.raises(ValueError, match="repeat"):
        bench_module.run_attention_bench([32], [3], repeat=repeat, progress=False, stream_gbs=1.0)


class _Benchmark:
    """pytest-benchmark's fixture, as far as ``benchmarks/bench_attention.py`` uses it: every
    round (warm-up included) a timed window of the timeline."""

    def __init__(self, timeline: _Timeline) -> None:
        self.timeline, self.extra_info, self.group, self.stats = timeline, {}, None, None

    def pedantic(self, fn: Any, rounds: int, warmup_rounds: int = 0) -> Any:
        for _ in range(warmup_rounds + rounds):
            self.timeline.clock()
            out = fn()
            self.timeline.clock()
        return out


def test_pytest_benchmark_attention_times_dense_without_the_blas_switch(timeline, monkeypatch):
    """``benchmarks/bench_attention.py``: the dense rounds run under one BLAS thread set once
    around them; the function pytest-benchmark times is the attention alone."""
    from benchmarks import bench_attention
    from numba_kv.threads import threading_layer

    threading_layer()  # (the suite's env_info reads it; a fused call would have set it up)
    monkeypatch.setitem(bench_attention._STREAM, "gbs", 1.0)
    c = bench_module.make_case(32, 3, num_kv_heads=2, num_heads=4, head_dim=32)
    real = bench_module.AttentionCase.dense

    def dense(self: Any) -> np.ndarray:
        timeline.events.append(("dense", timeline.limit))
        return real(self)

    monkeypatch.setattr(bench_module.AttentionCase, "dense", dense)
    bench = _Benchmark(timeline)
    bench_attention._run(bench, c.dense, c, "dense", blas=1)
    assert timeline.timed_windows() == [[("dense", 1)]] * 6
    assert bench.extra_info["blas_threads"] == 1 and bench.group == "attention-T32-b3"


def test_bench_modes_builds_what_make_cache_builds():
    """A preset row is the preset (its budget-sized window, not a window forced to 0), a
    plain mode gets no window, ``dense`` is measured (it refused the window options)."""
    rows = {r["mode"]: r for r in recommend.run(["kv4", "pqo3", "pqo3-r16-s2", "dense"], T=256, faiss_specs=None,
                                                num_kv_heads=2, queries_per_head=4)}
    assert all(r["error"] is None for r in rows.values()), rows
    preset = make_cache("kv4", num_layers=1, num_kv_heads=2, head_dim=128)
    assert rows["kv4"]["cache_name"] == preset.name and "-r0-" not in preset.name
    # (the name of what was built: make_cache("pqo3") would hold the default 32 + 4 window)
    assert rows["pqo3"]["cache_name"] == "pqo3-r0-s0" and rows["pqo3"]["bits_measured"] == pytest.approx(3.5)
    assert rows["pqo3-r16-s2"]["cache_name"] == "pqo3-r16-s2"
    dense = rows["dense"]
    assert (dense["bits_avg"], dense["bits_measured"], dense["nmse_k"], dense["nmse_v"]) == (32.0, 32.0, 0.0, 0.0)


def test_bench_modes_table_shows_the_bytes_stored():
    """``bits avg`` counts the codes; the table also shows ``memory_usage()``'s bits, which
    a window adds to (``pqo3-r32-s4`` at 256 tokens: 3.5 bits of codes, 5.25 stored)."""
    rows = recommend.run(["pqo3-r32-s4"], T=256, faiss_specs=None, num_kv_heads=2, queries_per_head=4)
    (row,) = rows
    assert row["bits_avg"] == 3.5 and row["bits_measured"] > 5.0
    head, _, line = recommend.to_markdown(rows).splitlines()
    cells = dict(zip([c.strip() for c in head.strip("|").split("|")], [c.strip() for c in line.strip("|").split("|")]))
    assert cells["bits avg"] == "3.500" and cells["bits (memory)"] == f"{row['bits_measured']:.3f}"


def test_pytest_benchmark_numpy_dense_step_attends_over_the_growing_history():
    """``benchmarks/bench_modes_attention.py``'s ``dense-numpy`` entry (the dense step without
    DenseCache's copy of the history): each call appends the token and attends over all
    tokens so far, as dense attention over the concatenated history does."""
    from benchmarks.bench_modes_attention import numpy_dense_step

    rng = np.random.default_rng(1)
    k, v = rng.standard_normal((2, 1, 2, 40, 32)).astype(np.float32)
    k1, v1 = rng.standard_normal((2, 1, 2, 1, 32)).astype(np.float32)
    q = rng.standard_normal((1, 6, 1, 32)).astype(np.float32)
    step = numpy_dense_step(k, v, k1, v1, q, 32 ** -0.5, max_steps=2)
    for n in (1, 2):
        ref = bench_module.dense_attention(q, np.concatenate([k] + [k1] * n, 2), np.concatenate([v] + [v1] * n, 2),
                                           32 ** -0.5)
        np.testing.assert_allclose(step().reshape(6, 32), ref[0, :, 0], rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="more than 2 steps"):
        step()


class _GroupOnly:
    """pytest-benchmark's fixture where only the grouping matters: the targets of our kernels
    run once (their results are checked), the slow NumPy oracle's are not run."""

    def __init__(self) -> None:
        self.extra_info, self.group, self.stats = {}, None, None

    def pedantic(self, target: Any, args: tuple = (), rounds: int = 1, iterations: int = 1,
                 warmup_rounds: int = 0) -> Any:
        return None if self.extra_info.get("backend") == "numpy" else target(*args)


def test_pytest_benchmark_quantize_groups_hold_one_amount_of_work():
    """``benchmarks/bench_quantize.py``: every entry of a group times the same number of
    vectors (the NumPy oracle's 131,072 of the suite's vectors had stood beside the full
    set, so pytest-benchmark's ratios compared 8× less work)."""
    from benchmarks import bench_quantize

    vectors = np.random.default_rng(0).standard_normal(((1 << 17) + 32, 128)).astype(np.float32)
    seen: dict[str, set[int]] = {}
    for test in (bench_quantize.test_quantize_numba_kv, bench_quantize.test_dequantize_numba_kv,
                 bench_quantize.test_quantize_numpy_reference, bench_quantize.test_dequantize_numpy_reference):
        bench = _GroupOnly()
        test(bench, vectors, 3)
        seen.setdefault(bench.group, set()).add(bench.extra_info["n_vectors"])
    assert len(seen) == 4 and all(len(n) == 1 for n in seen.values()), seen


def test_provenance_names_the_blas_threads_the_environment_leaves_to_the_library(monkeypatch):
    """With no thread variable set, the benchmark's provenance says how many threads the
    loaded BLAS runs with (it said only "default")."""
    for var in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "OMP_NUM_THREADS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(bench_module, "threadpool_info", lambda: [
        {"user_api": "openmp", "internal_api": "openmp", "num_threads": 7},
        {"user_api": "blas", "internal_api": "openblas", "num_threads": 3},
        {"user_api": "blas", "internal_api": "openblas", "num_threads": 3}])  # (NumPy's and SciPy's)
    prov = bench_module.bench_provenance()
    assert prov["blas_threads"] == "default: 3 (openblas)"
    assert "BLAS threads default: 3 (openblas)" in bench_module.provenance_line(prov)
    from benchmarks import conftest  # the pytest-benchmark suites' machine info says the same

    machine_info: dict[str, Any] = {}
    conftest.pytest_benchmark_update_machine_info(None, machine_info)
    assert machine_info["numba_kv_provenance"]["blas_threads"] == "default: 3 (openblas)"
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")
    assert bench_module.bench_provenance()["blas_threads"] == "1 (OPENBLAS_NUM_THREADS)"


def test_info_prints_what_runs_the_dense_baselines(monkeypatch):
    """``python -m numba_kv.info`` under ``env $(python -m numba_kv.info --avx2-env)`` names
    OpenBLAS's Haswell kernels and the BLAS threads, as the benchmarks' provenance does."""
    from numba_kv import info

    monkeypatch.setenv("OPENBLAS_CORETYPE", "Haswell")
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")
    facts = info.collect()
    assert facts["openblas_coretype"] == "Haswell" and facts["blas_threads"] == "1 (OPENBLAS_NUM_THREADS)"
