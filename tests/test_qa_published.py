"""Every stored result a document cites is in the repository.

``benchmarks/results/`` is git-ignored (``make demo`` and ``make bench`` write there), so a raw
file that backs a published figure must be force-added; one that is not lies only on the
machine that measured it, and the figure can no longer be checked against it. This finds every
``benchmarks/results/...`` and ``benchmarks/gpu_results/...`` path that README.md and the
documentation sources cite (brace lists ``{a,b}`` expanded, ``*`` globs matched) and checks that
git tracks it.
"""

from __future__ import annotations

import fnmatch
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "docs" / "guide").glob("*.md")])
_CITED = re.compile(r"benchmarks/(?:gpu_)?results/[A-Za-z0-9_./{},*-]+")
#: files the documents name as what a command writes (its output, not a stored result)
WRITTEN_BY_COMMANDS = {
    "benchmarks/results/eval.json",  # make demo
    "benchmarks/results/eval.png",  # make demo
    "benchmarks/results/bench-native.json",  # make bench
}


def _expand(path: str) -> list[str]:
    """``a-{x,y}-{1,2}.json`` as its four paths (the shell's brace expansion)."""
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [p for alt in m.group(1).split(",") for p in _expand(path[:m.start()] + alt + path[m.end():])]


def _cited(text: str) -> set[str]:
    return {p.rstrip("/") for m in _CITED.findall(text) for p in _expand(m.rstrip(".,)"))}


def _tracked() -> tuple[set[str], set[str]]:
    """The tracked files under the two result folders, and every folder above them."""
    proc = subprocess.run(["git", "-C", str(ROOT), "ls-files", "benchmarks/results", "benchmarks/gpu_results"],
                          capture_output=True, text=True, timeout=60, check=True)
    files = set(proc.stdout.split())
    folders = {str(Path(f).parents[i]) for f in files for i in range(len(Path(f).parents) - 1)}
    return files, folders


def _is_tracked(path: str, files: set[str], folders: set[str]) -> bool:
    if "*" in path:
        return any(fnmatch.fnmatch(f, path) for f in files)
    return path in files or path in folders


def test_the_expansion():
    assert _expand("r/a-{x,y}-{1,2}.json") == ["r/a-x-1.json", "r/a-x-2.json", "r/a-y-1.json", "r/a-y-2.json"]
    assert _cited("(`benchmarks/results/b-{n,a}.json`), benchmarks/gpu_results/h/.") == {
        "benchmarks/results/b-n.json", "benchmarks/results/b-a.json", "benchmarks/gpu_results/h"}
    assert _is_tracked("benchmarks/results/a-*.json", {"benchmarks/results/a-1.json"}, set())
    assert not _is_tracked("benchmarks/results/b.json", {"benchmarks/results/a.json"}, {"benchmarks/results"})


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="not a git checkout (an unpacked sdist)")
def test_cited_results_are_tracked():
    files, folders = _tracked()
    missing = {}
    for source in SOURCES:
        for path in sorted(_cited(source.read_text(encoding="utf-8")) - WRITTEN_BY_COMMANDS):
            if not _is_tracked(path, files, folders):
                missing.setdefault(str(source.relative_to(ROOT)), []).append(path)
    assert not missing, f"stored results cited but not tracked by git (git add -f them): {missing}"
