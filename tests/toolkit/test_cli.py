"""``numba-kv`` itself: ``--version``, ``python -m numba_kv``, the one-line error of a
subcommand whose ``tools`` package is missing (the bare install is built and checked for real
by ``tests/test_base_install.py``), and the one convention of ``eval``, ``generate``, ``demo``,
``bench`` and ``analyze``: ``--json [FILE|-]``, ``--no-progress``, an example in ``--help``, and
progress that draws bars on a terminal only."""

import argparse
import importlib
import io
import json
import os
import re
import subprocess
import sys

import pytest

import numba_kv
from numba_kv.toolkit import cli, kernels, progress


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"numba-kv {numba_kv.__version__}\n"


def test_python_dash_m_is_the_same_command_line():
    proc = subprocess.run([sys.executable, "-m", "numba_kv", "--version"], capture_output=True, text=True,
                          timeout=300, check=False)
    assert (proc.returncode, proc.stdout) == (0, f"numba-kv {numba_kv.__version__}\n"), proc.stderr


@pytest.mark.parametrize(("argv", "command"), [
    (["eval"], "eval"), (["demo", "--synthetic"], "demo"), (["bench", "attention"], "bench attention"),
    (["bench", "modes"], "bench modes"), (["analyze"], "analyze"), (["generate", "hi"], "generate"),
])
def test_missing_tools_package_is_one_line_naming_the_extra(argv, command, monkeypatch, capsys):
    def toolkit(name):
        raise ModuleNotFoundError("No module named 'rich'", name="rich")

    monkeypatch.setattr(cli, "_toolkit", toolkit)
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == f"numba-kv {command}: error: needs the tools extra (missing package 'rich'): " \
                  'pip install "numba-kv[tools]"\n'


@pytest.mark.parametrize("package", ["torch", "transformers"])
def test_missing_hf_package_is_one_line_naming_the_hf_extra(package, monkeypatch, capsys):
    """``eval --engine transformers`` imports its engine (torch, transformers at its top) lazily:
    without the hf extra the answer is one line naming it."""
    def toolkit(name):
        if name == "evaluation.transformers_engine":
            raise ModuleNotFoundError(f"No module named '{package}'", name=package)
        return importlib.import_module(f"numba_kv.toolkit.{name}")

    monkeypatch.setattr(cli, "_toolkit", toolkit)
    assert cli.main(["eval", "--engine", "transformers"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == f"numba-kv eval: error: needs the hf extra (missing package '{package}'): " \
                  'pip install "numba-kv[hf]"\n'


def test_other_missing_modules_are_not_hidden(monkeypatch):
    """Only the tools extra's packages become the one-line error: anything else is a bug."""
    def toolkit(name):
        raise ModuleNotFoundError("No module named 'numba_kv.toolkit.gone'", name="numba_kv.toolkit.gone")

    monkeypatch.setattr(cli, "_toolkit", toolkit)
    with pytest.raises(ModuleNotFoundError, match="gone"):
        cli.main(["demo", "--synthetic"])


def test_kernels_without_the_cuda_compilers(monkeypatch, capsys):
    def missing():
        raise RuntimeError('Failure finding "libnvJitLink.so.13"')

    monkeypatch.setattr(kernels.nvjitlink, "version", missing)
    assert kernels.missing_compilers() == ('needs the CUDA compilers (nvJitLink not found; no GPU needed): '
                                           'pip install "numba-kv[cuda]"')
    monkeypatch.setattr(kernels.nvvm, "is_available", lambda: False)
    assert kernels.missing_compilers().startswith("needs the CUDA compilers (NVVM and nvJitLink not found;")
    for argv in (["kernels"], ["kernels", "--sass"]):
        assert cli.main(argv) == 2
        assert capsys.readouterr().err == ("numba-kv kernels: error: needs the CUDA compilers (NVVM and nvJitLink "
                                           'not found; no GPU needed): pip install "numba-kv[cuda]"\n')


# -- one convention across the subcommands: --json [FILE|-], --no-progress, --help, progress in logs -------

TEXT = "The quick brown fox jumps over the lazy dog, and then it runs back home to sleep. " * 6


@pytest.fixture
def fast_argv(tiny_gguf, tmp_path):
    """The arguments that make each subcommand run in seconds (the tiny random GGUF model, a
    short synthetic stream, one benchmark case), by subcommand."""
    path, _ = tiny_gguf
    text = tmp_path / "text.txt"
    text.write_text(TEXT, encoding="utf-8")
    model = ["--model", str(path), "--threads", "1"]
    return {
        "eval": ["eval", *model, "--text", str(text), "--cache", "pqo4-r4-s2", "--tokens", "24", "--prefill", "8",
                 "--gen-tokens", "0"],
        # the prompt before the options: `--json` takes an optional value
        "generate": ["generate", "The fox", *model, "--cache", "pqo4-r4-s2", "--max-new-tokens", "3"],
        "demo": ["demo", "--synthetic", "--caches", "dense,pqo3", "--layers", "2", "--kv-heads", "1", "--head-dim",
                 "64", "--tokens", "48", "--chunk", "16"],
        "bench": ["bench", "attention", "--tokens", "32", "--bits", "3", "--repeat", "1", "--no-decode"],
        "analyze": ["analyze", *model, "--text", str(text), "--tokens", "24", "--prefill", "8", "--bits", "3",
                    "--residual-length", "4", "--sink-tokens", "2", "--layer-sensitivity", "none"],
    }


#: a progress line of a log (progress.StageLine)
STAGE_LINE = r"^[^\n]*: [\d.]+(/[\d.]+)? \w+ in \d+\.\d s$"
SUBCOMMANDS = ["eval", "generate", "demo", "bench", "analyze"]
#: a line the table (or text) of each subcommand prints on stdout, absent from its JSON
TABLE_MARK = {"eval": "KL mean", "demo": "pqo3", "bench": "LLVM host", "analyze": "timings"}


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_json_dash_prints_json_only_and_logs_progress_without_cr(command, fast_argv, capsys):
    """``--json -``: stdout is one JSON document and nothing else, although progress is on;
    stderr is not a terminal here, so progress is plain lines: no ``\\r`` anywhere."""
    assert cli.main([*fast_argv[command], "--json", "-"]) == 0, capsys.readouterr().err
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert isinstance(doc, dict) and doc
    assert "\r" not in out and "\r" not in err


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_json_without_value_is_stdout_too(command, fast_argv, capsys):
    assert cli.main([*fast_argv[command], "--no-progress", "--json"]) == 0, capsys.readouterr().err
    out, err = capsys.readouterr()
    json.loads(out)
    assert "\r" not in err


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_json_file_writes_it_and_keeps_the_table(command, fast_argv, tmp_path, capsys):
    dest = tmp_path / "out.json"
    assert cli.main([*fast_argv[command], "--no-progress", "--json", str(dest)]) == 0, capsys.readouterr().err
    out, err = capsys.readouterr()
    doc = json.loads(dest.read_text(encoding="utf-8"))
    assert isinstance(doc, dict)
    if command == "generate":  # its "table" is the generated text
        assert out == doc["text"] + "\n"
    else:
        assert TABLE_MARK[command] in out
    assert f"wrote {dest}" in err
    # --no-progress: no stage lines either
    assert not re.search(STAGE_LINE, err, re.M), err


@pytest.mark.parametrize("command", [*SUBCOMMANDS, "kernels", "info"])
def test_help_ends_with_an_example(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main([command, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    tail = out[out.rindex("Example"):]
    assert tail.splitlines()[1].strip().startswith(f"numba-kv {command}"), tail


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_json_and_no_progress_are_the_same_option_everywhere(command):
    """Same flags, same help, same defaults in every subcommand."""
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    opts = {a.option_strings[0]: a for a in sub._actions if a.option_strings}
    assert (opts["--json"].nargs, opts["--json"].const, opts["--json"].default) == ("?", "-", None)
    assert opts["--no-progress"].dest == "no_progress" and opts["--no-progress"].default is False
    eval_sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["eval"]
    eval_opts = {a.option_strings[0]: a for a in eval_sub._actions if a.option_strings}
    assert opts["--no-progress"].help == eval_opts["--no-progress"].help
    assert opts["--json"].help.split(" as JSON")[1] == eval_opts["--json"].help.split(" as JSON")[1]


def test_progress_bar_draws_on_a_terminal_only(monkeypatch):
    """A terminal gets tqdm's redrawn bar (``\\r`` frames); anything else one line per stage
    (name, count, seconds); ``disable=True`` nothing."""
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    tty, log = Terminal(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", tty)
    for _ in progress.progress_bar(range(3), desc="stage a", leave=True):
        pass
    assert "\r" in tty.getvalue() and "stage a" in tty.getvalue()
    monkeypatch.setattr(sys, "stderr", log)
    for _ in progress.progress_bar(range(3), desc="stage a"):
        pass
    bar = progress.progress_bar(total=5, desc="  stage b", unit="tok")
    bar.update(2)
    bar.update(3)
    bar.close()
    bar.close()  # once
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue() and len(lines) == 2
    assert re.fullmatch(r"stage a: 3/3 it in \d+\.\d s", lines[0]), lines
    assert re.fullmatch(r"stage b: 5/5 tok in \d+\.\d s", lines[1]), lines
    log.truncate(0)
    for _ in progress.progress_bar(range(3), desc="quiet", disable=True):
        pass
    progress.progress_bar(total=2, disable=True).close()
    assert log.getvalue() == ""


def test_a_logged_command_has_one_line_per_stage(tmp_path):
    """``numba-kv ... 2> log`` (a real process, stderr a pipe): stage lines, no ``\\r`` frames."""
    proc = subprocess.run([sys.executable, "-m", "numba_kv", "demo", "--synthetic", "--caches", "dense,pqo3",
                           "--layers", "2", "--kv-heads", "1", "--head-dim", "64", "--tokens", "48", "--chunk", "16",
                           "--json", "-"], capture_output=True, text=True, timeout=600, check=False,
                          env=os.environ | {"COLUMNS": "80"})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["config"]["command"] == "demo"
    assert "\r" not in proc.stderr
    assert re.search(r"^caches x layers: 4/4 it in \d+\.\d s$", proc.stderr, re.M), proc.stderr


def test_analyze_quiet_is_still_no_progress():
    args = cli.build_parser().parse_args(["analyze", "--quiet"])
    assert args.no_progress is True


def test_third_party_bars_are_off_in_a_log_and_restored_after(monkeypatch):
    """transformers' loading bars (its own switch, and the GGUF loader's direct tqdm) draw
    nothing while stderr is not a terminal, and come back as they were after the block."""
    pytest.importorskip("transformers")
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    import transformers.utils.logging as hf_logging

    monkeypatch.setattr(sys, "stderr", io.StringIO())
    original, was_on = gguf_utils.tqdm, hf_logging.is_progress_bar_enabled()
    with progress.third_party_bars(True) as on:
        assert on is False and not hf_logging.is_progress_bar_enabled()
        log = io.StringIO()
        for _ in gguf_utils.tqdm(range(3), desc="Converting", file=log):
            pass
        assert log.getvalue() == ""
    assert gguf_utils.tqdm is original and hf_logging.is_progress_bar_enabled() == was_on


@pytest.mark.parametrize("argv, command, message", [
    (["demo", "--caches", "bogus"], "demo", r"--caches: 'bogus': name: unknown cache 'bogus'"),
    (["demo", "--caches", ","], "demo", r"--caches: expected comma-separated cache names, got ','"),
    (["demo", "--head-dim", "63"], "demo", r"--caches: 'dense': head_dim: expected a positive multiple of 32"),
    (["demo", "--json", "/nonexistent-folder/x.json"], "demo", r"--json: the folder of '/nonexistent-folder/x.json' "
                                                                r"does not exist"),
    (["bench", "attention", "--tokens", "abc"], "bench attention", r"--tokens: expected comma-separated ints"),
    (["bench", "attention", "--tokens", "0"], "bench attention", r"--tokens: expected comma-separated ints >= 1"),
    (["bench", "attention", "--bits", "7"], "bench attention", r"--bits: expected comma-separated widths in 1..4"),
    (["bench", "modes", "--modes", "bogus"], "bench modes", r"--modes: unknown cache 'bogus'"),
])
def test_a_bad_argument_is_one_line_before_any_work(argv, command, message, capsys):
    # (each was a traceback, or for `bench modes` a whole run with an error row, exit status 0)
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert re.fullmatch(f"numba-kv {command}: error: {message}.*\n", err), err


@pytest.mark.parametrize("opt", ["--tokens", "--chunk", "--layers", "--kv-heads", "--head-dim"])
def test_demo_counts_are_positive_ints(opt, capsys):
    for bad in ("0", "-3", "x"):
        with pytest.raises(SystemExit) as exc:
            cli.main(["demo", opt, bad])
        assert exc.value.code == 2
        assert f"argument {opt}: expected an int >= 1, got" in capsys.readouterr().err


@pytest.mark.parametrize("case", ["empty prompt", "eval not gguf", "generate not gguf", "text /dev/null",
                                  "text dir", "text empty"])
def test_user_errors_of_eval_and_generate_are_one_line_and_status_2(case, tiny_gguf, tmp_path, capsys):
    # (each was a traceback and exit status 1, or for --text a misleading "not found")
    not_gguf, empty, text = tmp_path / "notes.gguf", tmp_path / "empty.txt", tmp_path / "text.txt"
    not_gguf.write_text("Hello world.")
    empty.write_text("")
    text.write_text(TEXT)
    tiny = ["--model", str(tiny_gguf[0]), "--threads", "1"]
    quick = ["--tokens", "24", "--prefill", "8", "--gen-tokens", "0", "--cache", "dense", "--no-progress"]
    argv, message = {
        "empty prompt": (["generate", "", *tiny], "prompt: the text '' encodes to no tokens"),
        "eval not gguf": (["eval", "--model", str(not_gguf), "--text", str(text), *quick],
                          f"path: {str(not_gguf)!r} is not a GGUF model this loader can read: GGUF magic invalid"),
        "generate not gguf": (["generate", "--model", str(not_gguf), "hi"],
                              f"path: {str(not_gguf)!r} is not a GGUF model this loader can read: GGUF magic invalid"),
        "text /dev/null": (["eval", *tiny, "--text", "/dev/null", *quick],
                           "--text: file '/dev/null' is not a regular file"),
        "text dir": (["eval", *tiny, "--text", str(tmp_path), *quick],
                     f"--text: file {str(tmp_path)!r} is a directory"),
        "text empty": (["eval", *tiny, "--text", str(empty), *quick], f"--text: file {str(empty)!r} is empty"),
    }[case]
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == f"numba-kv {argv[0]}: error: {message}\n"


@pytest.mark.parametrize("bad, shown", [("0", "0"), ("-5", "-5"), ("x", "'x'")])
def test_eval_chunk_is_a_positive_int(bad, shown, capsys):
    # --chunk 0 was a ValueError traceback from the model's forward pass, after the model had loaded
    with pytest.raises(SystemExit) as exc:
        cli.main(["eval", "--chunk", bad])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.endswith(f"\nnumba-kv eval: error: argument --chunk: expected an int >= 1, got {shown}\n"), err


@pytest.mark.parametrize("option", ["--repeat", "--decode-tokens"])
@pytest.mark.parametrize("value", ["0", "-3", "x"])
def test_bench_counts_below_one_are_usage_errors(option, value, capsys):
    """``bench --repeat 0`` reported inf ms and NaN ratios (exit 0), ``--decode-tokens 0`` ended
    in a traceback: both are argparse usage errors naming the option (exit status 2)."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", "attention", option, value])
    assert exit_.value.code == 2
    assert f"argument {option}: expected an int >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["1", "0", "abc", "64,128"])
def test_bench_modes_takes_one_history_length(value, capsys):
    """``bench modes --tokens`` is one N >= 2: other values ended in a traceback (``int("64,128")``)
    or ran a one-token history; now a usage error naming the option (exit status 2)."""
    assert cli.main(["bench", "modes", "--tokens", value]) == 2
    assert "--tokens: " in capsys.readouterr().err


def test_bench_modes_counts_duplicates_as_it_runs_them(capsys, monkeypatch):
    """``bench modes`` runs a mode without a window unless it names one, so ``pqo3`` and
    ``pqo3-r32-s4`` are two modes (they were refused as one, the duplicate check applying the
    caches' default window) and ``pqo3`` and ``pqo3-r0-s0`` one (they ran twice)."""
    from numba_kv.toolkit import recommend

    ran = []
    monkeypatch.setattr(recommend, "run", lambda modes, *a, **k: ran.append(list(modes)) or [])
    monkeypatch.setattr(recommend, "render", lambda *a, **k: "")
    assert cli.main(["bench", "modes", "--tokens", "16", "--modes", "pqo3,pqo3-r32-s4", "--faiss", "",
                     "--no-progress"]) == 0
    assert ran == [["pqo3", "pqo3-r32-s4"]]
    assert cli.main(["bench", "modes", "--tokens", "16", "--modes", "pqo3,pqo3-r0-s0", "--faiss", ""]) == 2
    assert "--modes: cache 'pqo3-r0-s0' listed twice ('pqo3' and 'pqo3-r0-s0')" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["attention", "--head-dim", "64"], "--head-dim: `bench attention --device cpu` does not read it (read by: "
                                        "attention (cuda), decode-step (cuda))"),
    (["attention", "--steps", "3"], "--steps: `bench attention --device cpu` does not read it"),
    (["modes", "--repeat", "3"], "--repeat: `bench modes --device cpu` does not read it"),
    (["modes", "--device", "cuda"], "--device cuda: `bench modes` runs on cpu only"),
    (["attention", "--device", "cuda", "--no-decode"], "--no-decode: `bench attention --device cuda` does not"),
    (["decode-step", "--device", "cuda", "--bits", "3"], "--bits: `bench decode-step --device cuda` does not"),
])
def test_bench_refuses_options_its_benchmark_does_not_read(argv, message, capsys):
    """They were accepted, ignored, and written into the JSON's ``config`` (``--head-dim 64``
    on the CPU: the rows measured d = 128 under a config saying 64)."""
    assert cli.main(["bench", *argv, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"numba-kv bench {argv[0]}: error: ") and message in err


def test_bench_config_holds_the_options_read(monkeypatch, capsys):
    from numba_kv.toolkit import bench

    monkeypatch.setattr(bench, "attention_report", lambda *a, **k: {"rows": [], "_rows": []})
    assert cli.main(["bench", "attention", "--tokens", "32", "--bits", "3", "--no-progress", "--json", "-"]) == 0
    config = json.loads(capsys.readouterr().out)["config"]
    assert set(config) == {"what", "device", "tokens", "json", "no_progress", "bits", "repeat", "no_decode",
                           "decode_caches", "decode_tokens"}
    assert config["tokens"] == "32" and config["bits"] == "3"


def test_a_negative_seed_is_a_usage_error(capsys):
    """``--seed -1`` ended in NumPy's traceback (exit 1); it is argparse's error line (exit 2)."""
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", "--synthetic", "--seed", "-1"])
    assert exc.value.code == 2
    assert "--seed: expected an int >= 0, got -1" in capsys.readouterr().err
