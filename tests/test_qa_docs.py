"""The user-facing docs' snippets are promises: their names exist and the outputs they show are true.

``tests/test_docs.py`` checks links and ``numba_kv.xxx`` names; this file adds what a new user
copies: the ``nk.xxx`` alias names and ``cache.xxx`` / ``paged.xxx`` methods the text names, the
README's NumPy quick start run as written with every value its comments show, and the guide's
copy of that quick start kept equal to the README's.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

import numba_kv
from numba_kv.caches.mixed import MixedCache

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CACHES_GUIDE = ROOT / "docs" / "guide" / "caches.md"
#: the user-facing documents: the README, the install page and the guides
USER_DOCS = sorted([README, ROOT / "docs" / "install.md", *(ROOT / "docs" / "guide").glob("*.md")])
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
#: ``nk.name`` (the alias every snippet imports numba_kv as), not ``x.nk.name``
_ALIAS = re.compile(r"(?<![\w.])nk\.([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)")
#: ``cache.method`` / ``paged.method``, not a file name such as ``paged.md``
_METHOD = re.compile(r"(?<![\w.])(?:cache|paged)\.(?!md\b)([A-Za-z_]\w*)")
CACHE_CLASSES = (numba_kv.DenseCache, numba_kv.PolarQuantCache, numba_kv.TurboQuantCache, MixedCache,
                 numba_kv.PagedKVCache, numba_kv.MLACache, numba_kv.SimpleMLACache)


def _python_block(path: Path, heading: str) -> str:
    """The first ``python`` fence after the line ``heading`` of ``path``."""
    text = path.read_text(encoding="utf-8")
    start = text.index(f"\n{heading}\n")
    m = next(m for m in _FENCE.finditer(text, start) if m.group(1) == "python")
    return m.group(2)


def _code(block: str) -> list[str]:
    """The block's code lines without comments or blank lines."""
    lines = (re.sub(r"\s*#.*$", "", line) for line in block.splitlines())
    return [line for line in lines if line.strip()]


def test_alias_names_resolve():
    missing = []
    for path in USER_DOCS:
        for name in sorted(set(_ALIAS.findall(path.read_text(encoding="utf-8")))):
            obj = numba_kv
            for part in name.split("."):
                if not hasattr(obj, part):
                    missing.append(f"{path.relative_to(ROOT)}: nk.{name}")
                    break
                obj = getattr(obj, part)
    assert not missing, f"names the docs use through `import numba_kv as nk` that do not exist: {missing}"


def test_cache_methods_exist():
    probe = numba_kv.make_cache("pqo3", num_layers=1, num_kv_heads=1, head_dim=64)  # instance attributes too
    missing = []
    for path in USER_DOCS:
        for name in sorted(set(_METHOD.findall(path.read_text(encoding="utf-8")))):
            if not any(hasattr(cls, name) for cls in CACHE_CLASSES) and not hasattr(probe, name):
                missing.append(f"{path.relative_to(ROOT)}: {name}")
    assert not missing, f"cache methods the docs name that no cache has: {missing}"


def test_the_patterns_catch_what_they_should():
    assert _ALIAS.findall("nk.make_cache(...), x.nk.y, `nk.ops.attention.f`") == ["make_cache", "ops.attention.f"]
    assert _METHOD.findall("cache.crop(3), paged.fork_sequence, [x](paged.md), my_cache.x") == ["crop", "fork_sequence"]


def test_readme_numpy_quick_start_shows_what_it_gives():
    """Run the README's NumPy quick start as written; each bare expression line whose comment
    shows a value (``# Fused: (1, 9, 1, 64)``) must evaluate to exactly that value."""
    block = _python_block(README, "## Quick start: NumPy")
    ns: dict = {}
    exec(compile(block, "README.md quick start", "exec"), ns)  # noqa: S102 - the snippet is the test
    shown = 0
    for line in block.splitlines():
        expr, _, comment = line.partition("#")
        value = re.search(r"\([\d, ]+\)", comment)
        if not value or "=" in expr or not expr.strip():
            continue
        assert repr(eval(expr, ns)) == value.group(0), f"README quick start: {line.strip()}"  # noqa: S307
        shown += 1
    assert shown == 2  # the output's shape and (memory_usage(), seq_len(0))
    # the bytes by hand: kv4 at head_dim 64 keeps 4 sinks + 49 recent tokens exact as int8 vectors
    # (64 bytes + a binary16 scale, K and V); the 48 older tokens are 4-bit keys (32 bytes) and
    # 3-bit values (24 bytes), each with a binary16 norm; the key means are 64 float32 a head
    exact, compressed = 53, 101 - 53
    per_head = exact * 2 * (64 + 2) + compressed * ((32 + 2) + (24 + 2)) + 64 * 4
    assert ns["cache"].memory_usage() == 3 * per_head == 30396
    assert np.array_equal(ns["res"].k, ns["k"]) and np.array_equal(ns["res"].v, ns["v"])  # the originals


def test_guide_quick_start_is_the_readme_one():
    assert _code(_python_block(CACHES_GUIDE, "## Quick start")) == _code(
        _python_block(README, "## Quick start: NumPy"))
