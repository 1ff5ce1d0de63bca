"""``python -m numba_kv.info``: its arguments (a typo or ``--help`` was ignored and the
provenance printed instead)."""

import pytest

from numba_kv import info


def test_avx2_env_prints_the_haswell_environment(capsys):
    info.main(["--avx2-env"])
    out = capsys.readouterr().out
    assert out.startswith("OPENBLAS_CORETYPE=Haswell NUMBA_CPU_NAME=haswell NUMBA_CPU_FEATURES=+64bit,")
    assert "+avx2" in out and "+avx512" not in out and out.count("\n") == 1


def test_unknown_arguments_and_help_are_not_ignored(capsys):
    with pytest.raises(SystemExit) as e:
        info.main(["--avx2env"])
    assert e.value.code == 2
    assert "unrecognized arguments: --avx2env" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        info.main(["--help"])
    assert e.value.code == 0 and "--avx2-env" in capsys.readouterr().out


def test_no_argument_prints_the_provenance_lines(capsys):
    info.main([])
    lines = capsys.readouterr().out.splitlines()
    keys = [line.split(" : ")[0].strip() for line in lines]
    assert len(lines) == len(info.collect()) and keys == list(info.collect())


def test_avx2_env_holds_numpy_to_avx2_too():
    """NumPy's own SIMD loops (the dense baselines' softmax) kept the host's AVX-512 kernels
    under ``--avx2-env``: it names NumPy's dispatch targets above AVX2, and a process started
    with it dispatches to none of them (``numpy_simd`` in the provenance)."""
    import os
    import subprocess
    import sys

    env_line = subprocess.run([sys.executable, "-m", "numba_kv.info", "--avx2-env"], capture_output=True, text=True,
                              check=True).stdout.split()
    env = dict(os.environ, **dict(kv.split("=", 1) for kv in env_line))
    above = info.numpy_avx512_targets()
    if above:
        assert env["NPY_DISABLE_CPU_FEATURES"].split(",") == above
    got = subprocess.run([sys.executable, "-c", "from numba_kv import info; print(info.provenance()['numpy_simd'])"],
                         env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert not any(t == "X86_V4" or t.startswith("AVX512") for t in got.split(",")), got


def test_provenance_names_the_knobs_set_from_the_environment(monkeypatch):
    import os

    for key in [k for k in os.environ if k.startswith("NUMBA_KV_")]:
        monkeypatch.delenv(key)
    assert info.provenance()["knobs_env"] == "defaults"
    monkeypatch.setenv("NUMBA_KV_CUDA_MMA_ATTENTION", "0")
    assert info.provenance()["knobs_env"] == "NUMBA_KV_CUDA_MMA_ATTENTION=0"


def test_make_bench_avx2_line_sets_every_variable_of_avx2_env(tmp_path):
    """``make bench``'s AVX2 half cut ``--avx2-env``'s output with ``sed`` after
    ``NUMBA_CPU_FEATURES=``; once the line also named ``NPY_DISABLE_CPU_FEATURES`` that tail
    joined the feature list and LLVM aborted at the first compile.  The Makefile's own recipe
    (``make -n``, with the benchmark run replaced by a probe) must set every variable as
    ``--avx2-env`` prints it and compile."""
    import json
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    if shutil.which("make") is None:
        pytest.skip("no make")
    root = Path(__file__).resolve().parents[1]
    probe = tmp_path / "probe.py"
    probe.write_text("import json, os, sys\nfrom numba import njit\nassert njit(lambda x: x + 1)(1) == 2\n"
                     "json.dump({k: os.environ.get(k) for k in sys.argv[1].split(',')}, sys.stdout)\n")
    printed = subprocess.run([sys.executable, "-m", "numba_kv.info", "--avx2-env"], capture_output=True, text=True,
                             check=True).stdout
    want = dict(kv.split("=", 1) for kv in printed.split())
    dry = subprocess.run(["make", "-n", "-s", "bench", f"BIN={Path(sys.executable).parent}",
                          f"PYTEST={sys.executable} {probe} {','.join(want)}", "BENCH_ARGS="],
                         cwd=root, capture_output=True, text=True, check=True).stdout
    recipe = dry.replace("\\\n", " ").splitlines()
    avx2 = [line for line in recipe if ".numba_cache_avx2" in line]
    assert len(avx2) == 1, dry
    line = avx2[0].replace(str(root / ".numba_cache_avx2"), str(tmp_path / "cache")).split("--benchmark-json")[0]
    got = subprocess.run(["bash", "-c", line], cwd=root, capture_output=True, text=True,
                         env={k: v for k, v in os.environ.items() if not k.startswith(("NUMBA_CPU", "NPY_DISABLE"))})
    assert got.returncode == 0, got.stderr[-2000:]
    assert json.loads(got.stdout) == want
