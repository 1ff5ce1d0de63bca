"""Meta-tests: the twin conventions of architecture.md §5.2 hold for every op module."""

import ast
import inspect
import pathlib

import numba_kv
from numba_kv.ops import TWINS

PKG = pathlib.Path(numba_kv.__file__).parent


def _decorated(path, deco_names):
    tree = ast.parse(path.read_text())
    out = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            for d in node.decorator_list:
                name = d.id if isinstance(d, ast.Name) else getattr(getattr(d, "func", None), "id", None) or \
                    getattr(d, "attr", None)
                if name in deco_names:
                    out.append(node.name)
    return out


def test_every_cuda_kernel_is_registered_with_a_cpu_twin():
    registered = {t.cuda.py_func.__name__ for t in TWINS.values()}
    for path in sorted((PKG / "ops").glob("*.py")):
        for fn in _decorated(path, {"cuda_kernel"}):
            assert fn in registered, f"{path.name}:{fn} is a CUDA kernel without a registered CPU twin"
            assert fn.endswith("_cuda"), f"{path.name}:{fn}: CUDA kernels end in _cuda"


def test_twins_have_identical_signatures_and_names():
    for name, t in TWINS.items():
        cpu, gpu = t.cpu.py_func, t.cuda.py_func
        assert list(inspect.signature(cpu).parameters) == list(inspect.signature(gpu).parameters), name
        assert cpu.__name__.removesuffix("_cpu") == gpu.__name__.removesuffix("_cuda"), name
        assert cpu.__module__ == gpu.__module__, f"{name}: twins live in one module"


def test_no_hand_written_numba_decorators():
    """All jit decorators come from numba_kv._jit, so cache/nogil/fastmath are uniform."""
    for path in sorted(PKG.rglob("*.py")):
        if path.name == "_jit.py" or "models" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef):
                for d in node.decorator_list:
                    target = d.func if isinstance(d, ast.Call) else d
                    name = getattr(target, "id", None) or getattr(target, "attr", None)
                    assert name not in ("njit", "jit"), \
                        f"{path.relative_to(PKG)}:{node.name} uses a raw numba decorator; use numba_kv._jit"


def test_reference_imports_numpy_only():
    for path in sorted((PKG / "reference").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mods = [node.module or ""] if node.level == 0 else [f".{node.module or ''}"]
                if node.level and node.module and node.module.split(".")[0] not in ("polarquant",):
                    mods = ["numba_kv." + node.module]
            else:
                continue
            for m in mods:
                assert m.split(".")[0] in ("numpy", "__future__", "typing", "math", "") or m.startswith(".polar"), \
                    f"reference/{path.name} imports {m}"


def test_no_print_in_package():
    """Library code reports through return values/logging; only command-line entry points
    (``cli.py`` and functions named ``main``) write to the terminal."""
    for path in sorted(PKG.rglob("*.py")):
        if path.name in ("cli.py",) or "models" in path.parts:
            continue
        tree = ast.parse(path.read_text())
        mains = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name in ("main", "_main")]
        allowed = {id(c) for m in mains for c in ast.walk(m)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print" and id(node) not in allowed:
                raise AssertionError(f"print() in {path.relative_to(PKG)}:{node.lineno}")


def test_public_api_has_docstrings():
    for name in numba_kv.__all__:
        obj = getattr(numba_kv, name)
        if inspect.isfunction(obj) or inspect.isclass(obj):
            assert inspect.getdoc(obj), f"numba_kv.{name} has no docstring"


def test_kernel_caches_are_keyed_on_all_kernel_sources():
    """Editing a core in one module must invalidate cached kernels of every module that
    inlines it: each cached dispatcher's stamp carries the digest of all kernel sources."""
    from numba_kv._jit import kernel_sources_digest
    from numba_kv.ops import TWINS

    digest = kernel_sources_digest()
    assert len(digest) == 64
    for twin in TWINS.values():
        for disp in (twin.cpu, twin.cpu.serial, twin.cuda):
            stamp = disp._cache._cache_file._source_stamp
            assert isinstance(stamp, tuple) and stamp[1] == digest, twin.name
