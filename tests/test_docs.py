"""The README and the documentation sources stay true to the code and to each other.

Fast checks only (no site build: ``make docs`` runs ``mkdocs build --strict``, and ``make test``
runs that): every relative link of the Markdown sources points at a file that exists, every
``numba_kv.xxx`` name they mention resolves, the snippets the site includes exist, and the
README stays a front door — at most 350 lines, no commit hashes and no issue references.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: every Markdown source of the site and the top-level documents
SOURCES = sorted([README, ROOT / "CHANGELOG.md", ROOT / "ARCHITECTURE.md", *(ROOT / "docs").rglob("*.md")])

README_MAX_LINES = 350
#: a 7- to 40-digit hex word with at least one digit and one letter: what a commit hash looks like
_HASH = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
#: an issue or pull-request reference "#12" (not an anchor "(#quick-start)", not an HTML entity)
_ISSUE = re.compile(r"(?<![\w&/#])#\d+\b")
#: inline links and images, [text](target) — the target up to the closing parenthesis or a title
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
_API = re.compile(r"(?<![\w./-])numba_kv(?:\.[A-Za-z_]\w*)+")
#: names of the form numba_kv.x that are not Python names: the cache file's format tag and the
#: JSON schema ids (``numba_kv.eval/1``, ``numba_kv.needle/1``; matched without their "/1")
NOT_API = {"numba_kv.cache"}
#: packages whose import pulls in optional heavy dependencies (torch, transformers, tokenizers):
#: their names are resolved from the source (defined or imported at module level) instead
STATIC_PREFIXES = ("numba_kv.toolkit", "numba_kv.integrations")
_SNIPPET = re.compile(r'^--8<--\s+"([^":]+)(?::([\w-]+))?"', re.M)


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _links(text: str) -> list[str]:
    return _LINK.findall(_FENCE.sub("", text))


def _api_names(text: str) -> set[str]:
    text = re.sub(r"\]\([^)]*\)", "]", text)  # link targets are file names (api/numba_kv.md), not API
    found = set()
    for m in _API.finditer(text):
        name = m.group(0).rstrip(".")
        if text[m.end():m.end() + 1] == "/" or name in NOT_API:
            continue
        found.add(name)
    return found


def test_readme_is_a_front_door():
    text = README.read_text(encoding="utf-8")
    lines = text.count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail to docs/"
    assert not _HASH.findall(text), f"commit hashes in README.md: {_HASH.findall(text)}"
    assert not _ISSUE.findall(text), f"issue references in README.md: {_ISSUE.findall(text)}"


def test_the_checks_catch_what_they_should():
    # the patterns themselves: a hash and an issue number are caught, anchors and numbers are not
    assert _HASH.findall("at commit `4dfe6fa`, then 86d5e6c") == ["4dfe6fa", "86d5e6c"]
    assert not _HASH.findall("1048576 tokens, a decade, deadbeef-free text, 2026-11-26")
    assert _ISSUE.findall("issue #14 and (#10)") == ["#14", "#10"]
    assert not _ISSUE.findall("[up](#quick-start), &#8212;, C# 3")
    assert _links("[a](docs/x.md) ![b](img.png \"t\") [c](https://x.org)\n```\n[d](no.md)\n```") == [
        "docs/x.md", "img.png", "https://x.org"]
    assert _api_names("`numba_kv.make_cache`, numba_kv.eval/1, [x](numba_kv.md), numba_kv/ops.py") == {
        "numba_kv.make_cache"}


@pytest.mark.parametrize("path", SOURCES, ids=_rel)
def test_relative_links_resolve(path):
    broken = []
    for target in _links(path.read_text(encoding="utf-8")):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # absolute URL (http:, mailto:) or an anchor of the same page (mkdocs --strict checks those)
        file = target.split("#", 1)[0]
        if not (path.parent / file).exists():
            broken.append(target)
    assert not broken, f"{_rel(path)}: links to missing files: {broken}"


def _resolves_statically(name: str) -> bool:
    """``name`` is a module or package under numba_kv/, or a name bound at its top level."""
    parts = name.split(".")
    base = ROOT
    for i, part in enumerate(parts):
        if (base / part / "__init__.py").exists():
            base = base / part
            continue
        if (base / f"{part}.py").exists():
            source, rest = (base / f"{part}.py").read_text(encoding="utf-8"), parts[i + 1:]
        else:
            source, rest = (base / "__init__.py").read_text(encoding="utf-8"), parts[i:]
        if not rest:
            return True
        first = re.escape(rest[0])
        return bool(re.search(rf"^(def|class)\s+{first}\b|^{first}\s*[:=]|^\s*(from\s+\S+\s+)?import\s.*\b{first}\b",
                              source, re.M))
    return True


def _resolves(name: str) -> bool:
    if name.startswith(STATIC_PREFIXES):
        return _resolves_statically(name)
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_numba_kv_name_resolves():
    missing = {}
    for path in SOURCES:
        for name in sorted(_api_names(path.read_text(encoding="utf-8"))):
            if not _resolves(name):
                missing.setdefault(_rel(path), []).append(name)
    assert not missing, f"names the docs mention that do not exist: {missing}"


def test_snippets_exist():
    for path in (ROOT / "docs").rglob("*.md"):
        for file, section in _SNIPPET.findall(path.read_text(encoding="utf-8")):
            target = ROOT / file
            assert target.exists(), f"{_rel(path)} includes {file}, which does not exist"
            if section:
                text = target.read_text(encoding="utf-8")
                for edge in ("start", "end"):
                    assert f"--8<-- [{edge}:{section}]" in text, f"{file} lacks the snippet marker {edge}:{section}"
