"""The A/B loader of ``benchmarks/gpu_mma_check.py`` (the GPU script's old-build kernels), on
the CPU: every ``numba_kv_ab*`` package of a folder is imported under its own name and its
tensor-core kernel is labelled by that name, so several older builds time side by side in
one process.  And the Nsight Compute command of ``benchmarks/gpu_profile_mma.py``."""

import shutil
import sys

import pytest

import numba_kv
from numba_kv import _backend

if _backend.simulator_enabled():  # the script builds a launch-bounds variant, which the simulator refuses
    pytest.skip("a GPU script's loader: tested in the plain suite", allow_module_level=True)

from benchmarks import gpu_mma_check, gpu_profile_mma  # noqa: E402
from numba_kv.ops import TWINS  # noqa: E402


def test_old_kernels_load_one_per_package_of_a_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    src = numba_kv.__path__[0]
    for name in ("numba_kv_ab_first", "numba_kv_ab_second"):
        shutil.copytree(src, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "numba_kv_ab_empty").mkdir()  # not a package: skipped
    try:
        kernels = gpu_mma_check.load_old_kernels(str(tmp_path))
        assert sorted(kernels) == ["mma numba_kv_ab_first", "mma numba_kv_ab_second"]
        for label, kernel in kernels.items():
            # each build's own kernel (its own package), not the checkout's
            assert kernel.py_func.__module__.startswith(label.split()[1] + "."), kernel.py_func.__module__
            assert kernel is not gpu_mma_check.SHIPPED
    finally:
        for mod in [m for m in sys.modules if m.startswith("numba_kv_ab_")]:
            del sys.modules[mod]


def test_old_kernels_want_a_package_in_the_folder(tmp_path):
    with pytest.raises(SystemExit, match="no numba_kv_ab"):
        gpu_mma_check.load_old_kernels(str(tmp_path))


def test_profile_runs_ncu_on_the_script_per_shape(capfd):
    """``--ncu`` runs the profiler (here ``echo`` in its place) once per shape on the script,
    with the clocks left alone, the tensor-core kernel's third launch and the stall-reason
    sections; a path is taken as given."""
    echo = shutil.which("echo")
    assert gpu_profile_mma.find_ncu(echo) == echo
    assert gpu_profile_mma.profile(echo, [(1024, 2), (4096, 8)], 3) == 0
    lines = [ln for ln in capfd.readouterr().out.splitlines() if not ln.startswith("$")]
    assert len(lines) == 2
    for line, (tokens, batch) in zip(lines, [(1024, 2), (4096, 8)]):
        assert line.startswith("--clock-control none -k regex:decode_attention_mma --launch-skip 2 --launch-count 1")
        assert "--section WarpStateStats" in line and "--section SchedulerStats" in line
        assert line.endswith(f"gpu_profile_mma.py --tokens {tokens} --batch {batch} --bits 3")


def test_launch_params_converts_a_signature_as_numba_does():
    """An array is ``meminfo, parent, size, itemsize, data, *shape, *strides`` (5 + 2·ndim Python
    ints), an integer a ctypes integer of its width, a float32 a ``c_float``, a boolean a bool."""
    import ctypes

    from benchmarks import launch_params

    params = launch_params.parameters("void(float32[:, ::1], int64, boolean, float32, int32[::1])")
    assert len(params) == (5 + 4) + 1 + 1 + 1 + (5 + 2)
    assert all(type(p) is int for p in params[:9]) and params[3] == 4 and params[7:9] == [32, 4]
    assert isinstance(params[9], ctypes.c_int64) and params[10] is True and isinstance(params[11], ctypes.c_float)
    assert params[15] == 4 and params[17:] == [8, 4]  # the int32 vector: itemsize, shape, byte stride
    assert launch_params.pack_us(params, rounds=1, n=10) > 0


def test_compile_times_refuses_an_unknown_kernel():
    from benchmarks import compile_times

    with pytest.raises(SystemExit, match="no registered kernel"):
        compile_times.main(["--kernel", "add_at,no_such_kernel"])


@pytest.mark.ptx
def test_compile_times_builds_every_signature_of_a_kernel(capsys):
    """One row per signature, built to machine code (the resources of the same build are
    then cached), and the total row."""
    from benchmarks import compile_times
    from numba_kv._cuda_resources import kernel_resources

    rows = compile_times.build_seconds(["copy_tokens"], (9, 0))
    assert [(n, i) for n, i, _ in rows] == [("copy_tokens", i) for i in range(len(TWINS["copy_tokens"].signatures))]
    assert all(s > 0 for *_, s in rows)
    assert kernel_resources("copy_tokens", (9, 0), 1).registers > 0
    compile_times.main(["--kernel", "add_at"])
    out = capsys.readouterr().out
    assert "| `add_at` | 0 |" in out and "| all 1 |" in out


def test_every_benchmark_script_imports_names_that_exist():
    """A script's ``from numba_kv... import name`` is only run when the script is: ``make
    soak`` failed at its first line after ``check_threading_layer`` moved to
    ``numba_kv.threads``.  Every such import of ``benchmarks/`` and ``notebooks/`` resolves."""
    import ast
    import importlib
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    missing = []
    for path in sorted((root / "benchmarks").glob("*.py")) + sorted((root / "notebooks").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("numba_kv"):
                module = importlib.import_module(node.module)
                for alias in node.names:
                    if not hasattr(module, alias.name):
                        try:
                            importlib.import_module(f"{node.module}.{alias.name}")
                        except ImportError:
                            missing.append(f"{path.name}:{node.lineno}: {node.module}.{alias.name}")
    assert not missing, missing


def test_soak_runs_and_checks_its_formula(capsys):
    """A short soak (2 threads, 2 layers, 40 steps, 2 cycles): its byte formula, NaN checks and
    RSS comparison pass on today's cache."""
    from benchmarks import soak

    assert soak.main(["--threads", "2", "--layers", "2", "--steps", "40", "--check-every", "10"]) == 0
    assert "result: PASS" in capsys.readouterr().out


@pytest.mark.parametrize("bits", ["3", "4"])
def test_profile_attention_tiles_runs(bits, capsys):
    """The script behind the Benchmarks page's tile-piece table called the tile decoder without
    the byte table it gained (a TypingError at its first call)."""
    from benchmarks import profile_attention_tiles

    profile_attention_tiles.main(["--tokens", "64", "--bits", bits, "--repeat", "1"])
    out = capsys.readouterr().out
    assert all(piece in out for piece in ("decode K (or V)", "scores", "online softmax", "P.V", "sum (K and V)"))
