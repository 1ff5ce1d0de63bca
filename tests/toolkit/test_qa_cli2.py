"""QA of ``numba-kv demo`` / ``generate`` and the output options of every subcommand: what
used to end in a traceback (``demo --tokens 1``, a cache the demo built differently from its
check, ``--json DIR`` after the whole run), a decode speed reported for a loop that decoded
nothing, and the demo's prefill timing that included first-use compilation."""

import json
import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from numba_kv.toolkit import cli, demo
from numba_kv.toolkit.models.generation import Generation
from numba_kv.toolkit.specs import output_file_error

TINY_DEMO = ["demo", "--synthetic", "--layers", "1", "--kv-heads", "1", "--head-dim", "64", "--tokens", "16",
             "--chunk", "8", "--no-progress"]


def test_demo_with_fewer_than_two_tokens_is_a_usage_error(capsys):
    # (--tokens 1 was a ValueError traceback from the warm-up's empty prefill)
    assert cli.main(["demo", "--tokens", "1"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == ("numba-kv demo: error: --tokens: expected an int >= 2 (tokens - 1 prefilled, the last one "
                   "decoded), got 1\n")


def test_demo_refuses_a_fused_decode_output_in_one_line(capsys):
    # (the check built the cache without the demo's decode_output="dequantized": the run then
    # ended in a "conflicts with the name" traceback)
    assert cli.main([*TINY_DEMO, "--caches", "pqo3:decode_output=fused"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == ("numba-kv demo: error: --caches: 'pqo3:decode_output=fused': decode_output: the demo measures "
                   "the reconstruction, expected 'dequantized', got 'fused'\n")


def _per_vector_nmse(x: np.ndarray, y: np.ndarray) -> float:
    x, y = x.astype(np.float64), y.astype(np.float64)
    return float((((x - y) ** 2).sum(-1) / (x ** 2).sum(-1)).mean())


def test_demo_runs_dense_options_and_sliding_windows(capsys):
    """``dense:dtype=float16`` was given ``decode_output`` (a ``TypeError`` traceback), a sliding
    window's shorter history a shape ``ValueError`` in the NMSE; now both are rows."""
    caches = "dense:dtype=float16,dense:sliding_window=4,pqo3:sliding_window=4"
    assert cli.main([*TINY_DEMO, "--caches", caches, "--json", "-"]) == 0
    rows = {r["cache"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    k, v = demo.synthetic_layer(np.random.default_rng(0), 1, 16, 64)  # the demo's layer 0 (seed 0)
    half = rows["dense:dtype=float16"]
    for got, x in ((half["nmse_k"], k), (half["nmse_v"], v)):  # float16 rounding, by NumPy
        assert got == pytest.approx(_per_vector_nmse(x, x.astype(np.float16)), rel=1e-9)
    assert half["bytes"] == 16 * 64 * 2 * 2
    window = rows["dense:sliding_window=4"]  # the last 4 tokens, exactly, in float32
    assert (window["nmse_k"], window["nmse_v"], window["bytes"]) == (0.0, 0.0, 4 * 64 * 2 * 4)
    pq = rows["pqo3:sliding_window=4"]  # 4 tokens, all inside the float16 window of 32 + 4
    assert pq["bytes"] == 4 * 64 * 2 * 2
    assert pq["nmse_k"] == pytest.approx(_per_vector_nmse(k[..., -4:, :], k[..., -4:, :].astype(np.float16)),
                                         rel=1e-6)


@pytest.mark.parametrize("argv", [
    [*TINY_DEMO, "--caches", "dense", "--json", "{dir}"],
    ["bench", "modes", "--tokens", "16", "--modes", "pqo3", "--faiss", "", "--markdown", "{dir}"],
    ["kernels", "--kernel", "pack_bits", "--json", "{dir}"],
    ["eval", "--plot", "{dir}"],
])
def test_an_output_file_that_is_a_folder_is_refused_before_the_run(argv, tmp_path, capsys):
    # (the command ran to its end, printed its table, then raised IsADirectoryError)
    argv = [a.replace("{dir}", str(tmp_path)) for a in argv]
    option = argv[argv.index(str(tmp_path)) - 1]
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.endswith(f": error: {option}: {str(tmp_path)!r} is a folder, expected a file name\n")


def test_output_file_error_cases(tmp_path):
    assert output_file_error(None, "--json") is None
    assert output_file_error("-", "--json") is None
    assert output_file_error(str(tmp_path / "x.json"), "--json") is None
    assert output_file_error("", "--plot") == "--plot: expected a file name, got ''"
    missing = str(tmp_path / "no" / "x.json")
    assert output_file_error(missing, "--json") == f"--json: the folder of {missing!r} does not exist"


def test_generation_without_a_decoded_token_has_no_speed():
    # one new token (or EOS first): the loop decoded nothing, and 0.0 tokens/s was reported
    assert math.isnan(Generation("x", [1, 2], [5], 0.1, 1e-6).decode_tokens_per_s)
    assert Generation("x", [1, 2], [5, 6, 7], 0.1, 0.5).decode_tokens_per_s == 4.0


def test_generate_one_token_reports_no_decode_speed(tiny_gguf, capsys):
    argv = ["generate", "The fox", "--model", str(tiny_gguf[0]), "--threads", "1", "--max-new-tokens", "1",
            "--json", "-"]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert doc["new_tokens"] == 1 and doc["decode_tokens_per_s"] is None
    assert ", decode - tokens/s;" in err


_TIMED_COMPILES = textwrap.dedent("""
    from numba.core import event as ev
    from numba_kv.toolkit import demo
    state = {"timed": False, "hits": 0}
    real = demo.make_cache

    def make_cache(*args, **kwargs):  # the caches of the table (2 layers; the warm-up's have 1)
        cache = real(*args, **kwargs)
        if kwargs["num_layers"] == 2:
            prefill = cache.prefill

            def timed(*a, **kw):
                state["timed"] = True
                try:
                    return prefill(*a, **kw)
                finally:
                    state["timed"] = False
            cache.prefill = timed
        return cache

    demo.make_cache = make_cache

    class Compiles(ev.Listener):
        def on_start(self, event):
            state["hits"] += state["timed"]

        def on_end(self, event):
            pass

    with ev.install_listener("numba:compiler_lock", Compiles()):
        demo.run_demo(["dense", "pqo3"], num_layers=2, num_kv_heads=2, head_dim=64, tokens=256, chunk=64,
                      progress=False)
    print(state["hits"])
""")


def test_demo_timed_prefill_compiles_nothing():
    """The warm-up ran other chunk lengths than the table, so a buffer's growth first called
    its copy kernel inside the timed region: in a fresh process the first row's prefill
    rate came out up to 200x low.  A fresh interpreter counts the compilations (or cache
    loads) that start while a table cache's prefill runs: none."""
    proc = subprocess.run([sys.executable, "-c", _TIMED_COMPILES], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "0"


def test_kernels_json_dash_is_stdout_alone(capsys):
    """``kernels --json -`` wrote a file named ``-``; ``-`` is stdout for every other command."""
    assert cli.main(["kernels", "--kernel", "pack_bits", "--json", "-"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["command"] == "kernels" and [r["kernel"] for r in doc["rows"]] == ["pack_bits"]
    assert not os.path.exists("-")


def test_an_output_file_that_cannot_be_opened_is_refused_before_the_run(tmp_path, capsys):
    # the folder exists, but nothing can be created in it (/proc): the command ran to the end
    # and then died in a FileNotFoundError traceback while writing
    assert output_file_error("/proc/numba-kv-x.json", "--json").startswith("--json: '/proc/numba-kv-x.json' cannot "
                                                                           "be written (")
    assert cli.main([*TINY_DEMO, "--caches", "dense", "--json", "/proc/numba-kv-x.json"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("numba-kv demo: error: --json: '/proc/numba-kv-x.json' cannot be written")
    # the probe leaves nothing behind and an existing file as it was
    new, old = tmp_path / "new.json", tmp_path / "old.json"
    old.write_text("keep")
    assert output_file_error(str(new), "--json") is None and not new.exists()
    assert output_file_error(str(old), "--json") is None and old.read_text() == "keep"


def test_an_output_file_that_fails_after_the_run_is_one_line(monkeypatch, capsys):
    # what the check before the run cannot see (a disk filling up, a folder removed meanwhile)
    monkeypatch.setattr(cli, "output_file_error", lambda dest, arg: None)
    assert cli.main([*TINY_DEMO, "--caches", "dense", "--json", "/proc/numba-kv-x.json"]) == 2
    out, err = capsys.readouterr()
    assert "dense" in out  # the table of the finished run
    assert err.endswith("numba-kv demo: error: --json: '/proc/numba-kv-x.json' could not be written (No such file "
                        "or directory)\n")


@pytest.mark.parametrize(("argv", "message"), [
    (["--mode", "needle", "--lengths", ""], "--lengths: expected at least one int, got ''"),  # ran the default grid
    (["--mode", "needle", "--lengths", "64", "--depths", ""], "--depths: expected at least one int, got ''"),
    (["--mode", "needle", "--text", "/nonexistent"], "--text: only --mode text takes it (this is --mode needle)"),
    (["--mode", "needle", "--tokens", "-5"], "--tokens: only --mode text takes it (this is --mode needle)"),
    (["--mode", "long", "--depths", "50"], "--depths: only --mode needle takes it (this is --mode long)"),
    (["--tokens", "12", "--scored", "5"], "--scored: only --mode long takes it (this is --mode text)"),
    (["--order", "token"], "--order: only --mode long takes it (this is --mode text)"),
    (["--lengths", "64"], "--lengths: only --mode needle / long takes it (this is --mode text)"),
])
def test_eval_refuses_empty_lists_and_options_of_other_modes(argv, message, capsys):
    # these were silently ignored (a missing --text file, negative counts) or ran the wrong grid
    assert cli.main(["eval", "--cache", "dense", "--no-progress", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"numba-kv eval: error: {message}\n"


def test_nmse_of_vectors_whose_squares_overflow_float64():
    # squares above ~1.3e154 were inf, and inf / inf returned NaN for a true value of 1
    from numba_kv.metrics import nmse

    assert nmse(np.array([1e200, 1e200]), np.array([0.0, 0.0])) == 1.0
    assert nmse(np.array([[3e200, 4e200]]), np.array([[3e200, 4.5e200]])) == pytest.approx(0.01, rel=1e-12)
