"""The package's import graph: no cycles between ``numba_kv`` modules, and the library does not
import the toolkit, whose code reaches the library through public names only.

The graph is read from the source (``ast``), with every import statement counted wherever it
stands — a function-level import that dodges a cycle at import time is still an edge.  An edge
``a -> b`` means module ``a`` names module ``b``: ``import b``, ``from b import x`` (or, when
``b.x`` is itself a module, ``from b import x`` names ``b.x``).  A package's ``__init__`` is the
package's own node (importing ``numba_kv.caches.spec`` does not count as importing
``numba_kv``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "numba_kv"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _is_package(name: str) -> bool:
    return MODULES.get(name, Path()).name == "__init__.py"


def _imports(name: str) -> list[tuple[str, str, int]]:
    """``(imported module, imported name or "", line)`` of every import in module ``name``
    (``numba_kv`` modules only)."""
    path = MODULES[name]
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    here = name if _is_package(name) else name.rpartition(".")[0]  # the package relative imports start from
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, "", node.lineno) for a in node.names if a.name.split(".")[0] == "numba_kv"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != "numba_kv":
                continue
            out += [(mod, a.name, node.lineno) for a in node.names]
    return out


def _edges() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for name in MODULES:
        for mod, item, _ in _imports(name):
            target = f"{mod}.{item}" if item and f"{mod}.{item}" in MODULES else mod
            while target not in MODULES:  # ``import numba_kv.x.y`` of a name: its module
                target = target.rpartition(".")[0]
            if target != name:
                graph[name].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _in_toolkit(name: str) -> bool:
    return name == "numba_kv.toolkit" or name.startswith("numba_kv.toolkit.")


def _private(name: str) -> bool:
    """A leading underscore in any part, except dunders (``__init__``, ``__version__``)."""
    return any(part.startswith("_") and not (part.endswith("__") and len(part) > 4) for part in name.split("."))


def test_the_graph_is_read():
    graph = _edges()
    assert "numba_kv.caches.spec" in graph["numba_kv"]
    assert "numba_kv.caches.presets" in graph["numba_kv.caches.spec"]
    assert "numba_kv.caches._layer" in graph["numba_kv.caches.polarquant"]


def test_no_import_cycles():
    cycles = _cycles(_edges())
    assert not cycles, f"import cycles between numba_kv modules: {cycles}"


def test_the_detector_finds_a_function_level_cycle():
    """A cycle through an import inside a function counts (the case it exists for)."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    src = "def f():\n    from .spec import make_cache\n"
    tree = ast.parse(src)
    assert any(isinstance(n, ast.ImportFrom) and n.module == "spec" for n in ast.walk(tree))


#: ``python -m numba_kv``: the command line's entry point, like the console script (nothing imports it)
ENTRY_POINT = "numba_kv.__main__"


def test_library_does_not_import_the_toolkit():
    edges = _edges()
    bad = sorted(f"{name} -> {target}" for name, targets in edges.items()
                 if not _in_toolkit(name) and name != ENTRY_POINT for target in targets if _in_toolkit(target))
    assert not bad, f"library modules import the toolkit: {bad}"
    importers = sorted(name for name, targets in edges.items() if ENTRY_POINT in targets)
    assert not importers, f"{ENTRY_POINT} is an entry point, yet imported by {importers}"


@pytest.mark.parametrize("name", sorted(m for m in MODULES if _in_toolkit(m)))
def test_toolkit_uses_public_library_names(name):
    """The toolkit imports library modules and names without a leading underscore (its own
    private modules are its business)."""
    bad = []
    for mod, item, line in _imports(name):
        if _in_toolkit(mod):
            continue
        target = f"{mod}.{item}" if item and f"{mod}.{item}" in MODULES else mod
        if _private(mod) or _private(item) or _private(target):
            bad.append(f"line {line}: {mod} {item}".strip())
    assert not bad, f"{name} imports private library names: {bad}"
