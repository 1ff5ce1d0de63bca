"""The release builds, and the base install works: this checkout's sdist and wheel are built
(``python -m build``: the sdist, then the wheel from the sdist) and pass ``twine check``; the
BUILT WHEEL, ``pip install``-ed WITHOUT extras into a fresh virtual environment, imports, runs
the README quick start, and its command line answers.

Every test environment installs the ``test`` extra (CUDA toolkit wheels, SciPy, ...), which
hid that ``import numba_kv`` failed with only the core requirements (issue #26).  Here a new
venv gets the core requirements of ``setup.cfg`` and nothing else, and the checks run in
subprocesses of that venv, outside the checkout (so the checkout's ``numba_kv`` cannot shadow
the installed one).

The build runs offline (``--no-isolation``: the test environment's setuptools, from the test
extra, as do ``build`` and ``twine``).  The install needs the package index (PyPI; pip's cache
makes a repeat fast).  When the build or pip fails, the test fails with its message: it never
skips, so that CI cannot pass without having checked the release files and the install.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import numba_kv

ROOT = Path(__file__).resolve().parents[1]

#: packages that only extras bring (tools, test, cuda, io, bench, hf): none may be importable in the bare venv
EXTRAS_ONLY = ("rich", "tqdm", "gguf", "tokenizers", "matplotlib", "scipy", "torch", "cupy", "safetensors",
               "faiss", "pytest", "hypothesis", "transformers")

#: subcommands that need the tools extra (as their error line names them), with arguments that
#: would otherwise run them
TOOLS_COMMANDS = {"eval": ["eval", "--no-progress"], "demo": ["demo", "--synthetic"],
                  "bench attention": ["bench", "attention"], "analyze": ["analyze"], "generate": ["generate", "hello"]}

pytestmark = pytest.mark.slow


#: the checkout's files that the build reads (setup.cfg: README.md is the long description,
#: LICENSE the license file; MANIFEST.in names the documents the sdist carries)
SOURCE_FILES = ("setup.cfg", "pyproject.toml", "MANIFEST.in", "README.md", "LICENSE", "CHANGELOG.md",
                "RELEASING.md", "ARCHITECTURE.md")


def _copy_source(dst: Path) -> Path:
    """What the release is built from, without build artefacts: building in the checkout
    itself would leave ``build/`` and ``*.egg-info`` in it."""
    dst.mkdir()
    for name in SOURCE_FILES:
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, dst / name)
    shutil.copytree(ROOT / "numba_kv", dst / "numba_kv",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.nbi", "*.nbc"))
    return dst


def _env(tmp: Path, venv: Path) -> dict[str, str]:
    """The environment of the bare venv's processes: nothing of the test environment's Python
    setup leaks in, and Numba's on-disk cache goes to a folder of its own."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "NUMBA_ENABLE_CUDASIM", "PYTHONSTARTUP")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["NUMBA_CACHE_DIR"] = str(tmp / "numba-cache")
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    return env


class BareVenv:
    """A fresh venv with the checkout installed without extras."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.dir = tmp, tmp / "venv"
        self.python, self.bin = self.dir / "bin" / "python", self.dir / "bin"
        self.env = _env(tmp, self.dir)

    def run(self, *argv: str | Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """``argv`` in the venv, from a folder outside the checkout."""
        return subprocess.run([str(a) for a in argv], cwd=self.tmp, env=self.env, capture_output=True, text=True,
                              timeout=timeout, check=False)

    def python_ok(self, code: str, timeout: float = 300) -> str:
        """stdout of ``python -c code`` in the venv; fails the test with stderr when it raises."""
        proc = self.run(self.python, "-c", code, timeout=timeout)
        assert proc.returncode == 0, f"in the bare venv:\n{code}\n--- stderr ---\n{proc.stderr[-4000:]}"
        return proc.stdout


class Dist:
    """The sdist and the wheel of this checkout, built once."""

    def __init__(self, out: Path) -> None:
        (self.sdist,) = out.glob("numba_kv-*.tar.gz")
        (self.wheel,) = out.glob("numba_kv-*-py3-none-any.whl")
        with zipfile.ZipFile(self.wheel) as z:
            self.wheel_names = z.namelist()
            (meta,) = [n for n in self.wheel_names if n.endswith(".dist-info/METADATA")]
            self.metadata = z.read(meta).decode("utf-8")
        with tarfile.open(self.sdist) as t:
            self.sdist_names = t.getnames()


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Dist:
    """``python -m build`` of a copy of the checkout: the sdist, then the wheel built from the
    unpacked sdist (so a file missing from the sdist breaks the wheel too)."""
    tmp = tmp_path_factory.mktemp("release")
    src, out = _copy_source(tmp / "src"), tmp / "dist"
    proc = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(src)],
                          capture_output=True, text=True, timeout=600, check=False, cwd=tmp)
    assert proc.returncode == 0, (
        "python -m build --no-isolation failed (the test extra brings build and setuptools: "
        f"pip install -e '.[test]')\n--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-3000:]}")
    return Dist(out)


def test_twine_check(dist):
    """The metadata PyPI would render: twine's strict check (the long description included)."""
    proc = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", str(dist.sdist), str(dist.wheel)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, f"twine check failed:\n{proc.stdout}\n{proc.stderr}"
    assert proc.stdout.count("PASSED") == 2, proc.stdout


def test_wheel_and_sdist_contents(dist):
    """The wheel ships the PEP 561 marker and the license; the version is the package's; the
    sdist carries the license and the marker and no test suite."""
    version = numba_kv.__version__
    assert dist.wheel.name == f"numba_kv-{version}-py3-none-any.whl"
    assert "numba_kv/py.typed" in dist.wheel_names
    assert "numba_kv/ops/data/headvq.npz" in dist.wheel_names  # package data (the head VQ codebooks)
    assert "numba_kv/caches/calibrations/kv3-smollm2-135m-retrieval.json" in dist.wheel_names  # (@NAME)
    assert f"numba_kv-{version}.dist-info/licenses/LICENSE" in dist.wheel_names
    assert "numba_kv/__main__.py" in dist.wheel_names and "numba_kv/toolkit/cli.py" in dist.wheel_names
    assert not [n for n in dist.wheel_names if n.startswith("tests/")]
    assert re.search(rf"^Version: {re.escape(version)}$", dist.metadata, re.M)
    assert re.search(r"^License(-Expression)?: Apache-2.0$", dist.metadata, re.M), dist.metadata[:2000]
    for classifier in ("Typing :: Typed", "License :: OSI Approved :: Apache Software License",
                       "Topic :: Scientific/Engineering :: Artificial Intelligence"):
        assert f"Classifier: {classifier}\n" in dist.metadata
    root = f"numba_kv-{version}"
    for name in ("LICENSE", "README.md", "setup.cfg", "pyproject.toml", "numba_kv/py.typed", "numba_kv/__init__.py",
                 "numba_kv/ops/data/headvq.npz", "numba_kv/caches/calibrations/kv3-smollm2-135m.json"):
        assert f"{root}/{name}" in dist.sdist_names, name
    assert not [n for n in dist.sdist_names if n.startswith(f"{root}/tests")]


@pytest.fixture(scope="module")
def bare(tmp_path_factory, dist) -> BareVenv:
    tmp = tmp_path_factory.mktemp("base-install")
    v = BareVenv(tmp)
    # without pip (nor setuptools): as bare as a new Python 3.12 venv, and 7 s faster; the pip of
    # the test environment installs into it (--python)
    made = subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(v.dir)], capture_output=True,
                          text=True, timeout=300, check=False)
    assert made.returncode == 0, f"python -m venv failed:\n{made.stderr}"
    # default pip cache (a repeat downloads nothing); short network timeouts, so that an index
    # that cannot be reached fails within a few minutes instead of after pip's long retries;
    # --no-compile: the modules used are compiled on import (pip's byte-compiling of all of
    # NumPy and Numba was a third of the install's CPU time)
    pip = v.run(sys.executable, "-m", "pip", "--python", v.python, "install", "--disable-pip-version-check",
                "--no-compile", "--timeout", "60", "--retries", "2", "-q", dist.wheel, timeout=900)
    assert pip.returncode == 0, (
        "pip install of the built wheel without extras into a fresh venv failed: this test needs the package index "
        "(PyPI) for the core requirements of setup.cfg, and pip >= 22.3 (--python) in the test environment."
        f"\n--- pip stderr ---\n{pip.stderr[-6000:]}")
    return v


def _readme_quick_start() -> str:
    """The first python block under ``## Quick start`` of README.md."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("\n## Quick start"):]
    m = re.search(r"```python\n(.*?)```", section, re.S)
    assert m, "README.md: no ```python block under ## Quick start"
    return m.group(1)


def _docstring_quick_start() -> str:
    """The literal block after ``Quick start ...::`` in the package docstring."""
    doc = numba_kv.__doc__ or ""
    m = re.search(r"Quick start[^\n]*::\n\n((?: {4}.*\n?)+)", doc)
    assert m, "numba_kv.__doc__: no 'Quick start ...::' block"
    return "\n".join(line[4:] for line in m.group(1).splitlines())


def test_bare_venv_has_only_the_core(bare):
    """The venv really is bare: no package of any extra, this checkout's version installed
    (not an editable link to it), and the CUDA runtime library that numba-cuda loads at import
    comes from the venv's own wheel, not from a CUDA toolkit this machine may have."""
    out = bare.python_ok(
        "import importlib.util, importlib.metadata as md, cuda.pathfinder as pf\n"
        f"print([m for m in {EXTRAS_ONLY!r} if importlib.util.find_spec(m) is not None])\n"
        "print(md.version('numba-kv'))\n"
        "print(pf.load_nvidia_dynamic_lib('cudart').abs_path)\n")
    present, version, cudart = out.splitlines()[-3:]
    assert present == "[]", f"packages of extras in the bare venv: {present}"
    assert version == numba_kv.__version__
    assert Path(cudart).resolve().is_relative_to(bare.dir.resolve()), f"libcudart found outside the venv: {cudart}"


def test_import_and_quick_start(bare):
    """``import numba_kv`` and the quick starts of README.md and of the package docstring run
    (first use compiles the CPU kernels, without a CUDA compiler)."""
    readme, doc = _readme_quick_start(), _docstring_quick_start()
    code = ("import numba_kv, pathlib\n"
            "print(numba_kv.__file__)\n"
            "assert (pathlib.Path(numba_kv.__file__).parent / 'py.typed').is_file()\n"
            f"{readme}\n"
            "assert out.out.shape == (1, 9, 1, 64), out.out.shape\n"
            "assert cache.seq_len(0) == 101 and cache.memory_usage() > 0\n"
            "import numpy as np\n"
            "assert np.isfinite(out.out).all()\n"
            f"{doc}\n"
            "assert out.out.shape == (1, 9, 1, 64) and np.isfinite(out.out).all()\n"
            "print('quick start ok')\n")
    out = bare.python_ok(code, timeout=600).splitlines()
    assert Path(out[0]).resolve().is_relative_to(bare.dir.resolve()), f"numba_kv imported from {out[0]}"
    assert out[-1] == "quick start ok"


@pytest.fixture(scope="module")
def cli(bare) -> dict[str, subprocess.CompletedProcess[str]]:
    """Every command-line run of the tests below, started at once (each is mostly the import of
    numba_kv: together they take the time of the slowest on two cores), by label."""
    runs = {"numba-kv --version": [bare.bin / "numba-kv", "--version"],
            "python -m numba_kv --version": [bare.python, "-m", "numba_kv", "--version"],
            "info": [bare.bin / "numba-kv", "info"],
            # one kernel keeps the run short where the CUDA compilers are found
            "kernels": [bare.bin / "numba-kv", "kernels", "--kernel", "pack_bits"]}
    runs |= {command: [bare.bin / "numba-kv", *argv] for command, argv in TOOLS_COMMANDS.items()}
    procs = {label: subprocess.Popen([str(a) for a in argv], cwd=bare.tmp, env=bare.env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True) for label, argv in runs.items()}
    done = {}
    try:
        for label, proc in procs.items():
            out, err = proc.communicate(timeout=600)
            done[label] = subprocess.CompletedProcess(runs[label], proc.returncode, out, err)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return done


@pytest.mark.parametrize("label", ["numba-kv --version", "python -m numba_kv --version"])
def test_version_and_module_entry_point(cli, label):
    proc = cli[label]
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, f"numba-kv {numba_kv.__version__}\n", "")


def test_info_answers(cli):
    proc = cli["info"]
    assert proc.returncode == 0, proc.stderr
    assert re.search(rf"^numba_kv\s+: {re.escape(numba_kv.__version__)}$", proc.stdout, re.M), proc.stdout
    assert re.search(r"^numba-cuda\s+: \d", proc.stdout, re.M), proc.stdout
    assert re.search(r"^cupy\s+: not installed$", proc.stdout, re.M), proc.stdout


def test_kernels_answers(cli):
    """``numba-kv kernels`` needs NVVM and nvJitLink (the cuda extra's wheels, or a CUDA
    toolkit on the system): with them it prints the table, without them one line naming the
    cuda extra (exit status 2)."""
    proc = cli["kernels"]
    if proc.returncode == 0:
        assert "| `pack_bits` | 9.0 |" in proc.stdout
    else:
        assert proc.returncode == 2 and proc.stdout == "", proc.stderr
        assert re.fullmatch(r'numba-kv kernels: error: needs the CUDA compilers \((NVVM|nvJitLink|NVVM and nvJitLink) '
                            r'not found; no GPU needed\): pip install "numba-kv\[cuda\]"\n', proc.stderr), proc.stderr


@pytest.mark.parametrize("command", TOOLS_COMMANDS)
def test_tools_commands_name_the_extra(cli, command):
    """One line on stderr naming the extra, exit status 2, no traceback."""
    proc = cli[command]
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert re.fullmatch(rf"numba-kv {command}: error: needs the tools extra \(missing package '(rich|tqdm)'\): "
                        r'pip install "numba-kv\[tools\]"\n', proc.stderr), proc.stderr
