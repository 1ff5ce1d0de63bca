"""Release hygiene that needs no build (the build itself, ``twine check`` and the wheel's
contents are checked in ``tests/test_base_install.py``): the license text, the PEP 561 marker,
one version source, the classifiers, and the tag convention of ``RELEASING.md``."""

from __future__ import annotations

import configparser
import hashlib
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import numba_kv

ROOT = Path(__file__).resolve().parents[1]
#: MD5 of https://www.apache.org/licenses/LICENSE-2.0.txt, the text the Apache Software
#: Foundation publishes (the same file many packages ship; any edit changes it)
APACHE_2_0_MD5 = "3b83ef96387f14655fc854ddc3c6bd57"
#: a release version: X.Y.Z, optionally a pre-release (aN, bN, rcN) or .devN
VERSION_RE = r"\d+\.\d+\.\d+((a|b|rc)\d+)?(\.dev\d+)?"


def _setup_cfg() -> configparser.ConfigParser:
    cfg = configparser.ConfigParser(interpolation=None)
    cfg.read(ROOT / "setup.cfg", encoding="utf-8")
    return cfg


def _lines(value: str) -> list[str]:
    return [line.strip() for line in value.splitlines() if line.strip()]


def test_license_is_the_full_apache_2_0_text():
    text = (ROOT / "LICENSE").read_bytes()
    assert hashlib.md5(text).hexdigest() == APACHE_2_0_MD5  # a checksum of a public text
    assert _setup_cfg()["metadata"]["license"] == "Apache-2.0"


def test_py_typed_marker_is_shipped():
    assert (ROOT / "numba_kv" / "py.typed").is_file()
    assert _lines(_setup_cfg()["options.package_data"]["numba_kv"]) == ["py.typed"]


def test_package_data_is_shipped():
    """The head VQ codebooks (``numba_kv/ops/data/headvq.npz``) are package data."""
    assert (ROOT / "numba_kv" / "ops" / "data" / "headvq.npz").is_file()
    assert _lines(_setup_cfg()["options.package_data"]["numba_kv.ops"]) == ["data/*.npz"]


def test_one_version_source():
    """``numba_kv.__version__`` is the only place the version is written: setup.cfg reads it,
    pyproject.toml has no [project] version, no other module assigns one."""
    assert re.fullmatch(VERSION_RE, numba_kv.__version__), numba_kv.__version__
    assert _setup_cfg()["metadata"]["version"] == "attr: numba_kv.__version__"
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert "version" not in pyproject.get("project", {})
    assigning = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "numba_kv").rglob("*.py")
                       if re.search(r"^__version__\s*=", p.read_text(encoding="utf-8"), re.M))
    assert assigning == ["numba_kv/__init__.py"]


def test_classifiers_agree_with_the_metadata():
    meta, options = _setup_cfg()["metadata"], _setup_cfg()["options"]
    classifiers = _lines(meta["classifiers"])
    assert len(classifiers) == len(set(classifiers))
    for c in classifiers:
        assert re.fullmatch(r"[A-Z][^:]*( :: [^:]+)+", c), c
    for required in ("Typing :: Typed", "Topic :: Scientific/Engineering :: Artificial Intelligence",
                     "License :: OSI Approved :: Apache Software License",
                     "Programming Language :: Python :: 3 :: Only"):
        assert required in classifiers, required
    assert any(c.startswith("Operating System :: ") for c in classifiers)
    # the Python versions: consecutive, from python_requires' minimum, including the one running here
    minimum = re.fullmatch(r">=\s*3\.(\d+)", options["python_requires"].strip())
    assert minimum, options["python_requires"]
    minors = sorted(int(m.group(1)) for c in classifiers
                    if (m := re.fullmatch(r"Programming Language :: Python :: 3\.(\d+)", c)))
    assert minors[0] == int(minimum.group(1)) and minors == list(range(minors[0], minors[-1] + 1)), minors
    assert sys.version_info.minor in minors


def test_project_urls_are_real_or_absent():
    """No guessed addresses: a project URL, when there is one, is https and no placeholder."""
    meta = _setup_cfg()["metadata"]
    for line in _lines(meta.get("project_urls", "")):
        name, _, url = (part.strip() for part in line.partition("="))
        assert name and url.startswith("https://"), line
        assert not re.search(r"example|your[-_]?(org|name|user)|placeholder|<|>", url, re.I), line


def test_tag_convention():
    """RELEASING.md states the convention (annotated ``vX.Y.Z`` tags); every tag in the
    repository follows it."""
    releasing = (ROOT / "RELEASING.md").read_text(encoding="utf-8")
    assert "`vX.Y.Z`" in releasing and "version = attr: numba_kv.__version__" in releasing
    if not (ROOT / ".git").exists():  # an unpacked sdist: no history to check
        return
    proc = subprocess.run(["git", "-C", str(ROOT), "tag", "--list"], capture_output=True, text=True, timeout=60,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    bad = [t for t in proc.stdout.split() if not re.fullmatch(f"v{VERSION_RE}", t)]
    assert not bad, f"tags not of the form vX.Y.Z: {bad}"
