"""``numba-kv`` itself: ``--version``, ``python -m numba_kv``, and the one-line error of a
subcommand whose ``tools`` package is missing (the bare install is built and checked for real
by ``tests/test_base_install.py``)."""

import importlib
import subprocess
import sys

import pytest

import numba_kv
from numba_kv.toolkit import cli, kernels


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
