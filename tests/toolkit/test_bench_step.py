"""`numba-kv bench decode-step --device cuda` without a GPU: the row and its arithmetic, the
table with and without torch, the command line (arguments, the error without CuPy), the
whole flow on NumPy dressed as CuPy (and as torch), and (under ``NUMBA_ENABLE_CUDASIM=1`` or
on a GPU) the timed decode step on Numba device arrays against the same cache on the host."""

import json
import sys

import numpy as np
import pytest

from numba_kv import AttendConfig, StepGraph, make_cache
from numba_kv._backend import to_host
from numba_kv.toolkit import bench_cuda, bench_step
from numba_kv.toolkit.cli import build_parser, main

from ..conftest import to_device


def _row(**kw):
    args = dict(mode="pqo3", tokens=4096, batch=1, num_kv_heads=8, groups=4, head_dim=128, output="fused",
                step=(2.0, 1.5), torch_ms=(0.5, 0.4), torch_backend="flash", kv_mb=3.5, steps=20, warmup=3,
                gpu="Fake GPU", prov={"torch": "2.11", "numba": "0.68"})
    args.update(kw)
    return bench_step.make_row(**args)


def test_row_arithmetic():
    r = _row()
    assert (r.step_ms_median, r.step_ms_min, r.torch_ms_median, r.torch_ms_min) == (2.0, 1.5, 0.5, 0.4)
    assert r.speedup_vs_torch == 0.25  # torch median / step median
    assert r.tokens_after == 4096 + 3 + 20 and r.torch_backend == "flash"
    no_torch = _row(torch_ms=None)
    assert no_torch.torch_ms_median is None and no_torch.speedup_vs_torch is None
    assert no_torch.torch_backend is None  # a backend without a time is dropped
    graphed = _row(graph=(0.08, 0.07), graph_replayed=20)
    assert (graphed.graph_ms_median, graphed.graph_ms_min, graphed.graph_replayed) == (0.08, 0.07, 20)
    assert graphed.tokens_after == 4096 + 3 + 20 + bench_step.GRAPH_WARMUP + 20 and r.graph_ms_median is None
    bound = _row(graph=(0.08, 0.07), graph_replayed=20, bound=(0.04, 0.03), bound_skipped=19)
    assert (bound.bound_ms_median, bound.bound_ms_min, bound.bound_skipped) == (0.04, 0.03, 19)
    assert bound.tokens_after == graphed.tokens_after + bench_step.BOUND_WARMUP + 20 and r.bound_ms_median is None
    failed = _row(step=None, output=None, kv_mb=None, note="error: ValueError: x")
    assert failed.step_ms_median is None and failed.speedup_vs_torch is None and failed.tokens_after == 4096
    assert bench_step.failed([r, failed, _row(step=None, note="out of device memory: 1 GiB")]) == [failed]


def test_render_with_and_without_torch():
    rows = [_row(), _row(mode="dense", output="dequantized+attend", torch_ms=None, note="oom")]
    text = bench_step.render(rows)
    assert "Fake GPU" in text and "torch 2.11" in text and "median/min of 20 steps" in text
    head = next(line for line in text.splitlines() if "mode" in line)
    assert head.index("step ms (median)") < head.index("torch sdpa ms (median)") < head.index("x torch")
    pqo3 = next(line for line in text.splitlines() if "pqo3" in line).split()
    assert pqo3[:12] == ["│", "pqo3", "│", "4096", "│", "1", "│", "fused", "│", "2.000", "│", "1.500"]
    assert "0.500" in pqo3 and "flash" in pqo3 and "0.25" in pqo3
    dense = next(line for line in text.splitlines() if "dense" in line and "│" in line)
    assert "dequantized+attend" in dense and "oom" in dense and dense.split().count("-") == 10  # torch, graph, bound
    graphed = bench_step.render([_row(graph=(0.08, 0.07), graph_replayed=20, bound=(0.04, 0.03), bound_skipped=19)])
    row = next(line for line in graphed.splitlines() if "pqo3" in line).split()
    assert "0.080" in row and "0.070" in row and "20/20" in row
    assert row.index("0.070") < row.index("0.040") < row.index("0.030") < row.index("19/20")
    assert bench_step.render([]) == "no rows\n"


def test_time_wall_ms_syncs_after_every_call():
    calls = []
    med, mn = bench_step.time_wall_ms(lambda: calls.append("f"), steps=5, warmup=2,
                                      sync=lambda: calls.append("s"))
    assert calls == ["f", "f", "s"] + ["f", "s"] * 5
    assert 0 <= mn <= med


def test_parser_of_decode_step():
    a = build_parser().parse_args(["bench", "decode-step", "--device", "cuda", "--modes", "dense,pqo3:r=0",
                                   "--tokens", "64,128", "--batch", "1,2", "--kv-heads", "2", "--groups", "3",
                                   "--head-dim", "64", "--steps", "7", "--warmup", "2", "--no-torch", "--json",
                                   "out.json"])
    assert (a.what, a.device, a.modes, a.tokens, a.batch) == ("decode-step", "cuda", "dense,pqo3:r=0", "64,128",
                                                              "1,2")
    assert (a.kv_heads, a.groups, a.head_dim, a.steps, a.warmup, a.no_torch, a.json) == (2, 3, 64, 7, 2, True,
                                                                                         "out.json")
    d = build_parser().parse_args(["bench", "decode-step", "--device", "cuda"])
    assert (d.modes, d.tokens, d.batch, d.steps, d.warmup, d.no_torch, d.json) == (None, None, None, 20, 3, False,
                                                                                   None)
    assert (d.kv_heads, d.groups, d.head_dim) == (8, 4, 128)


def test_cli_without_cupy_is_a_one_line_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    assert main(["bench", "decode-step", "--device", "cuda", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("numba-kv bench decode-step: error: needs CuPy and a GPU: pip install -e .[cuda]")
    assert err.count("\n") == 1
    with pytest.raises(bench_cuda.CudaBenchUnavailable, match=r"pip install -e \.\[cuda\]"):
        bench_step.run_decode_step_bench(tokens=(64,))


@pytest.mark.parametrize("argv, message", [
    ([], "only --device cuda"),
    (["--device", "cuda", "--modes", "nope"], "--modes: unknown cache 'nope'"),
    (["--device", "cuda", "--tokens", "4k"], "--tokens: expected comma-separated ints"),
    (["--device", "cuda", "--steps", "0"], "--steps and --warmup"),
])
def test_cli_user_errors(argv, message, capsys):
    assert main(["bench", "decode-step", "--no-progress", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("numba-kv bench decode-step: error: ") and message in err and err.count("\n") == 1


def test_whole_flow_with_numpy_dressed_as_cupy(fake_cupy, tmp_path, capsys):
    """CPU caches behind the fake CuPy: every mode decodes, the history grows by the steps."""
    js = tmp_path / "step.json"
    assert main(["bench", "decode-step", "--device", "cuda", "--modes", "dense,pqo3,kv4,kv3", "--tokens", "48,80",
                 "--kv-heads", "2", "--groups", "2", "--head-dim", "64", "--steps", "3", "--warmup", "2",
                 "--no-progress", "--json", str(js)]) == 0
    doc = json.loads(js.read_text())
    rows = [bench_step.DecodeStepRow(**r) for r in doc["rows"]]
    assert [(r.tokens, r.mode) for r in rows] == [(t, m) for t in (48, 80) for m in ("dense", "pqo3", "kv4", "kv3")]
    for r in rows:
        assert r.note == "" and r.gpu == "Fake GPU" and r.provenance["gpu"] == "Fake GPU"
        assert "cpu_model" in r.provenance and r.provenance["torch"].startswith("not importable")
        assert 0 < r.step_ms_min <= r.step_ms_median and r.kv_mb > 0
        assert r.torch_ms_median is None and r.speedup_vs_torch is None and (r.steps, r.warmup, r.batch) == (3, 2, 1)
        assert r.output == ("dequantized+attend" if r.mode == "dense" else "fused")
        if r.mode == "dense":  # the caller attends: no out=, no graph
            assert r.tokens_after == r.tokens + 2 + 3 and r.graph_ms_median is None and r.graph_replayed is None
        else:  # host arrays: the graph's steps just run (nothing to replay)
            assert r.tokens_after == r.tokens + 2 + 3 + bench_step.GRAPH_WARMUP + 3 + bench_step.BOUND_WARMUP + 3
            assert 0 < r.graph_ms_min <= r.graph_ms_median and r.graph_replayed == 0
            assert 0 < r.bound_ms_min <= r.bound_ms_median and r.bound_skipped == 0  # NumPy: every step in full
    assert main(["bench", "decode-step", "--device", "cuda", "--modes", "pqo3", "--tokens", "40", "--kv-heads",
                 "1", "--groups", "2", "--head-dim", "32", "--steps", "1", "--no-progress"]) == 0
    assert "pqo3" in capsys.readouterr().out


def test_whole_flow_with_a_torch_baseline(fake_cupy, fake_torch):
    rows = bench_step.run_decode_step_bench(modes=("pqo3",), tokens=(40,), batch=(1, 2), num_kv_heads=1, groups=2,
                                            head_dim=32, steps=2, warmup=1)
    for r in rows:
        assert r.torch_backend == "flash" and 0 < r.torch_ms_min <= r.torch_ms_median, r  # cuDNN refused
        assert r.speedup_vs_torch == r.torch_ms_median / r.step_ms_median and r.note == ""
    assert rows[0].provenance["torch"] == "2.11.0+fake"


def test_a_failing_mode_is_a_row_and_exit_status_1(fake_cupy, monkeypatch, capsys):
    real = bench_step.make_cache

    def make(name, **kw):
        if name == "pqo4":
            raise RuntimeError("kernel fault\nsecond line")
        return real(name, **kw)

    monkeypatch.setattr(bench_step, "make_cache", make)
    assert main(["bench", "decode-step", "--device", "cuda", "--modes", "pqo4,pqo3", "--tokens", "40",
                 "--kv-heads", "1", "--groups", "2", "--head-dim", "32", "--steps", "1", "--no-progress",
                 "--json", "-"]) == 1
    out = capsys.readouterr()
    rows = json.loads(out.out)["rows"]
    assert rows[0]["note"] == "error: RuntimeError: kernel fault" and rows[0]["step_ms_median"] is None
    assert rows[1]["note"] == "" and rows[1]["step_ms_median"] > 0
    assert "pqo4 at T=40, batch 1: error: RuntimeError: kernel fault" in out.err


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["dense", "pqo3:window_dtype=float32,residual_length=4"])
def test_decode_step_on_device_arrays(name):
    """T=40, batch 1, one KV head x 2 groups, d=32: prefill and timed decode steps on Numba
    device arrays give the outputs of the same cache fed NumPy arrays."""
    rng = np.random.default_rng(7)
    k, v = rng.standard_normal((2, 1, 1, 40, 32)).astype(np.float32)
    k1, v1 = rng.standard_normal((2, 1, 1, 1, 32)).astype(np.float32)
    q = rng.standard_normal((1, 2, 1, 32)).astype(np.float32)
    cfg = AttendConfig(32 ** -0.5, 2)

    def attend(qq, kk, vv, scale, bias):
        host = [None if a is None else to_host(a) for a in (qq, kk, vv, bias)]
        return bench_cuda.dense_attention(np, host[0], host[1], host[2], scale, host[3])

    from numba import cuda

    outs = []
    for put in (lambda a: a, to_device):
        cache = make_cache(name, num_layers=1, num_kv_heads=1, head_dim=32)
        cache.prefill(0, put(k), put(v))
        step = bench_step.make_decode_step(cache, put(k1), put(v1), put(q), cfg, attend)
        med, mn = bench_step.time_wall_ms(step, steps=2, warmup=1, sync=cuda.synchronize)
        assert 0 < mn <= med and cache.seq_len(0) == 40 + 3
        outs.append(to_host(step()))
        if name != "dense":  # fused: the out= step, then through a StepGraph (captured, replayed)
            out, graph = put(np.zeros(q.shape, np.float32)), StepGraph()
            for g in (None, graph):
                step = bench_step.make_decode_step(cache, put(k1), put(v1), put(q), cfg, attend, out, g)
                bench_step.time_wall_ms(step, steps=1, warmup=bench_step.GRAPH_WARMUP, sync=cuda.synchronize)
                res = step()
                assert res is out
                outs.append(to_host(res).copy())  # (out is rewritten by the next step)
            # device: launched one by one, captured, then the timed step and step() replayed
            assert graph.stats()["replayed"] == (3 if put is to_device else 0), graph.stats()
    half = len(outs) // 2
    for host_out, dev_out in zip(outs[:half], outs[half:]):
        np.testing.assert_allclose(dev_out, host_out, rtol=1e-4, atol=1e-5)
