"""Meta-tests: the twin conventions hold for every op module, and the two rooms of
``ARCHITECTURE.md`` (library, toolkit) keep their import rules."""

import ast
import inspect
import pathlib
import re

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
    for path in sorted((PKG / "ops").rglob("*.py")):
        for fn in _decorated(path, {"cuda_kernel"}):
            assert fn in registered, f"{path.name}:{fn} is a CUDA kernel without a registered CPU twin"
            assert fn.endswith("_cuda"), f"{path.name}:{fn}: CUDA kernels end in _cuda"


def test_twins_have_identical_signatures_and_names():
    """``_<op>_cpu`` / ``_<op>_cuda`` with the same parameters; a second CUDA kernel of an op
    (``_<op>_<variant>_cuda``, registered as ``<op>_<variant>``) shares the op's CPU twin."""
    for name, t in TWINS.items():
        cpu, gpu = t.cpu.py_func, t.cuda.py_func
        assert list(inspect.signature(cpu).parameters) == list(inspect.signature(gpu).parameters), name
        base, gname = cpu.__name__.removesuffix("_cpu"), gpu.__name__.removesuffix("_cuda")
        assert gname == base or (gname.startswith(base + "_") and gname.lstrip("_") == name), name
        assert cpu.__module__ == gpu.__module__, f"{name}: twins live in one module"


def test_no_hand_written_numba_decorators():
    """All jit decorators come from numba_kv._jit, so cache/nogil/fastmath are uniform."""
    for path in sorted(PKG.rglob("*.py")):
        if path.name == "_jit.py" or "models" in path.parts:  # the NumPy LLM compiles nothing
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef):
                for d in node.decorator_list:
                    target = d.func if isinstance(d, ast.Call) else d
                    name = getattr(target, "id", None) or getattr(target, "attr", None)
                    assert name not in ("njit", "jit"), \
                        f"{path.relative_to(PKG)}:{node.name} uses a raw numba decorator; use numba_kv._jit"


# -- one dispatch point ------------------------------------------------------------------------
#: modules that may compute launch geometry, launch a CUDA kernel or pick a CPU compilation
DISPATCH_MODULES = ("ops/_registry.py", "_backend.py", "_launch.py", "_graph.py")
#: modules still launching by hand, with the reason; an entry whose module is clean fails the test
DISPATCH_ALLOWED: dict[str, str] = {}


def _hand_dispatch(tree: ast.AST):
    """``(line, what)`` of every launch that bypasses ``Twin.launch``: a call of ``cuda_grid``
    or ``cpu_call`` (by name or attribute), or a call of a subscripted callable
    (``kernel[blocks, threads](...)``, a CUDA launch configuration)."""
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = getattr(f, "id", None) or getattr(f, "attr", None)
        if name in ("cuda_grid", "cpu_call"):
            out.append((node.lineno, f"calls {name}"))
        elif isinstance(f, ast.Subscript):
            out.append((node.lineno, "launches kernel[blocks, threads](...)"))
    return out


def test_hand_dispatch_detector():
    tree = ast.parse("k[b, t](x)\n_backend.cuda_grid(n)\ncpu_call(k, 1)\nT.launch('cpu', 1, x)\nf(x)[0]\n")
    assert [line for line, _ in _hand_dispatch(tree)] == [1, 2, 3]


def test_every_launch_goes_through_twin_launch():
    """``Twin.launch`` (``ops/_registry.py``) is the one dispatch point: no other module
    computes a CUDA grid, launches a kernel with a launch configuration or picks the
    serial/parallel CPU compilation itself."""
    bad, clean_but_allowed = [], []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        if rel in DISPATCH_MODULES:
            continue
        hits = _hand_dispatch(ast.parse(path.read_text()))
        if rel in DISPATCH_ALLOWED:
            if not hits:
                clean_but_allowed.append(rel)
            continue
        bad += [f"{rel}:{line} {what}" for line, what in hits]
    assert not bad, "launch outside Twin.launch (use TWIN.launch(dev, n_items, *args)):\n" + "\n".join(bad)
    assert not clean_but_allowed, f"remove from DISPATCH_ALLOWED (now dispatched by Twin.launch): {clean_but_allowed}"


#: kernels still without a launch-contract docstring, by module (the entries may go once clean)
DOCSTRING_ALLOWED = {
    "headquant.py": "converted in a parallel branch",
    "finite.py": "converted in a parallel branch",
    "hadamard.py": "converted in a parallel branch",
}


def test_every_kernel_states_its_launch_contract():
    """Every CUDA kernel's docstring states its grid (what one thread does); every CPU twin
    has a docstring (what one ``prange`` iteration does)."""
    bad = []
    for path in sorted((PKG / "ops").rglob("*.py")):
        if path.name in DOCSTRING_ALLOWED:
            continue
        for node in ast.parse(path.read_text()).body:
            if not isinstance(node, ast.FunctionDef):
                continue
            decos = {getattr(d, "id", None) or getattr(getattr(d, "func", None), "id", None)
                     for d in node.decorator_list}
            doc = ast.get_docstring(node) or ""
            if "cuda_kernel" in decos and "grid" not in doc:
                bad.append(f"{path.name}:{node.name} (CUDA kernel: docstring must state its grid)")
            elif "cpu_kernel" in decos and not doc:
                bad.append(f"{path.name}:{node.name} (CPU twin without docstring)")
    assert not bad, "kernels without a launch contract:\n" + "\n".join(bad)

# -- the two rooms (ARCHITECTURE.md) ------------------------------------------------------------
TOOLKIT = "numba_kv.toolkit"
#: entry points of the command line outside the toolkit, imported by nothing (``python -m numba_kv``)
ENTRY_POINTS = ("numba_kv.__main__",)
#: third-party packages only the toolkit may use (the ``tools`` extra and friends)
TOOL_DEPS = ("tqdm", "rich", "matplotlib", "gguf", "tokenizers", "scipy", "faiss", "threadpoolctl")
#: ... and none of these is loaded by ``import numba_kv`` (safetensors: the library's own optional
#: ``io`` extra, imported by ``caches._format`` only when a cache is saved or loaded)
NOT_AT_IMPORT = TOOL_DEPS + ("safetensors",)
#: NumPy-only leaves of the library: they import nothing of numba_kv outside themselves
NUMPY_ONLY = ("numba_kv.reference", "numba_kv.metrics")
STDLIB_OK = ("numpy", "__future__", "typing", "math", "dataclasses")


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _package_modules():
    """``(module name, path)`` of every module of the package, at any depth."""
    return [(_module_name(p), p) for p in sorted(PKG.rglob("*.py"))]


def imported_modules(path: pathlib.Path, module: str):
    """Absolute names of everything ``path`` imports, anywhere in the file (function-level
    imports included): ``import a.b``, ``from a import b`` (-> ``a``, ``a.b``), and relative
    forms (``from .. import ops`` -> ``numba_kv``, ``numba_kv.ops``)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                if node.level > 1:
                    base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            out.append((node.lineno, base))
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names if a.name != "*"]
    return out


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_import_parser_resolves_relative_imports(tmp_path):
    """The loophole of the old check: ``from .. import ops`` must resolve to ``numba_kv.ops``."""
    f = tmp_path / "mod.py"
    f.write_text("from .. import toolkit\nfrom ..toolkit.cli import main\nimport numba_kv.toolkit.models\n"
                 "def f():\n    from . import x\n")
    names = {n for _, n in imported_modules(f, "numba_kv.caches.mod")}
    assert {"numba_kv.toolkit", "numba_kv.toolkit.cli", "numba_kv.toolkit.models", "numba_kv.caches.x"} <= names


def test_modules_are_found_at_every_depth():
    names = {m for m, _ in _package_modules()}
    assert {"numba_kv", "numba_kv.ops.attention", "numba_kv.toolkit.models.llama",
            "numba_kv.toolkit.evaluation.evaluate"} <= names


def test_library_never_imports_the_toolkit():
    """The library (everything outside ``numba_kv.toolkit``) imports no toolkit module and none
    of the toolkit's third-party packages, not even inside a function.  ``numba_kv.__main__``
    (``python -m numba_kv``, the command line) may, because no module imports it."""
    bad = []
    for module, path in _package_modules():
        library = not (_within(module, TOOLKIT) or module in ENTRY_POINTS)
        for line, name in imported_modules(path, module):
            if name in ENTRY_POINTS or (library and (_within(name, TOOLKIT) or name.split(".")[0] in TOOL_DEPS)):
                bad.append(f"{path.relative_to(PKG.parent)}:{line} imports {name}")
    assert not bad, "library modules import application code:\n" + "\n".join(bad)


def test_numpy_only_modules_import_numpy_only():
    """The oracles (``numba_kv.reference``) and the metrics import NumPy and the standard library
    only, never ``numba_kv.ops`` or ``numba_kv.caches``: an oracle cannot inherit the bug it is
    meant to catch."""
    for module, path in _package_modules():
        leaf = next((p for p in NUMPY_ONLY if _within(module, p)), None)
        if leaf is None:
            continue
        for line, name in imported_modules(path, module):
            assert name.split(".")[0] in STDLIB_OK or _within(name, leaf), \
                f"{path.relative_to(PKG.parent)}:{line} imports {name}"


_IMPORT_PROBE = """
import importlib.abc, os, sys, traceback
PKG = os.path.join(sys.argv[1], "")  # the numba_kv directory
BLOCKED = set(sys.argv[2].split(","))
offenders = []

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            # the innermost real frame is the module that asked (importlib frames are "<frozen ...>")
            caller = [f for f in traceback.extract_stack()[:-1] if not f.filename.startswith("<")][-1]
            if caller.filename.startswith(PKG):
                offenders.append(f"{name} from {caller.filename}:{caller.lineno}")
            raise ModuleNotFoundError(f"blocked: {name}", name=name)
        return None

sys.meta_path.insert(0, Block())
import numba_kv
loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
print(repr((offenders, loaded)))
"""


def test_import_numba_kv_loads_no_tool_dependency():
    """``import numba_kv`` works without the tools' packages and asks for none of them.

    Run in a fresh interpreter in which every tool package is unimportable: Numba itself
    probes for SciPy (optional for it), so the check is on who asks, not on ``sys.modules``
    alone."""
    import ast as _ast
    import subprocess
    import sys

    init = pathlib.Path(numba_kv.__file__)
    proc = subprocess.run([sys.executable, "-c", _IMPORT_PROBE, str(init.parent), ",".join(NOT_AT_IMPORT)],
                          check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    offenders, loaded = _ast.literal_eval(proc.stdout.strip().splitlines()[-1])
    assert not offenders, f"import numba_kv asks for tool packages: {offenders}"
    assert not loaded, f"import numba_kv loaded {loaded}"


def test_no_print_in_package():
    """Library and toolkit code report through return values/logging; only command-line entry
    points (``toolkit/cli.py`` and functions named ``main``) write to the terminal."""
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


def test_kernel_sources_digest_covers_every_kernel_module(tmp_path, monkeypatch):
    """Every module that defines a kernel or a core (``ops/attention/cores.py`` included) feeds
    the digest: a copy of the package with one byte changed in any such file gets another
    digest.  (It once globbed ``ops/*.py`` only and missed the ``ops/attention`` package.)"""
    import shutil

    import numba_kv._jit as jit

    src = pathlib.Path(jit.__file__).parent
    kernel_modules = sorted(p.relative_to(src) for p in src.rglob("*.py")
                            if re.search(r"@(cpu_kernel|cuda_kernel|cpu_serial)|\btwin\(", p.read_text()))
    assert pathlib.Path("ops/attention/cores.py") in kernel_modules
    copy = tmp_path / "numba_kv"
    shutil.copytree(src, copy, ignore=shutil.ignore_patterns("__pycache__"))

    def digest_of(root):
        monkeypatch.setattr(jit, "__file__", str(root / "_jit.py"))
        jit.kernel_sources_digest.cache_clear()
        try:
            return jit.kernel_sources_digest()
        finally:
            jit.kernel_sources_digest.cache_clear()

    base = digest_of(copy)
    for rel in kernel_modules:
        path = copy / rel
        text = path.read_text()
        path.write_text(text + "\n# edited\n")
        assert digest_of(copy) != base, f"editing {rel} leaves the kernel cache key unchanged"
        path.write_text(text)
    assert digest_of(copy) == base


# -- no private name crosses a module boundary ----------------------------------------------------


def cross_module_private_names(path: pathlib.Path, module: str, modules: set[str]):
    """``(line, "pkg.mod._name")`` for every private name of another numba_kv module that
    ``path`` uses: ``from pkg.mod import _name`` (relative forms too) and ``mod._name`` where
    ``mod`` is a numba_kv module bound by an import.  Private *modules* (``from .. import
    _backend``) are not names; dunder names are public."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def private(name: str) -> bool:
        return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))

    tree = ast.parse(path.read_text())
    bound, out = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)] if node.level > 1 else parts
                src = ".".join(parts + ([node.module] if node.module else []))
            else:
                src = node.module or ""
            if src.split(".")[0] != "numba_kv":
                continue
            for a in node.names:
                if f"{src}.{a.name}" in modules:
                    bound[a.asname or a.name] = f"{src}.{a.name}"
                elif private(a.name) and src != module:
                    out.append((node.lineno, f"{src}.{a.name}"))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "numba_kv" and a.asname:
                    bound[a.asname] = a.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound:
            target = bound[node.value.id]
            if target != module and private(node.attr) and f"{target}.{node.attr}" not in modules:
                out.append((node.lineno, f"{target}.{node.attr}"))
    return out


def test_private_name_scan_finds_every_form(tmp_path):
    f = tmp_path / "mod.py"
    f.write_text("from .qjl import _sketch_arg, SKETCH_SEED\nfrom .. import _backend\nfrom . import half\n"
                 "import numba_kv.ops.hadamard as hd\nfrom .attention import __all__\n"
                 "def g():\n    from .attention import _merge_partitions_cpu\n    return half._f32_to_f16_bits, "
                 "hd._rotate32_inverse, _backend.xp_of, half.__name__\n")
    mods = {"numba_kv._backend", "numba_kv.ops.qjl", "numba_kv.ops.half", "numba_kv.ops.hadamard",
            "numba_kv.ops.attention", "numba_kv.ops.mod"}
    found = sorted(n for _, n in cross_module_private_names(f, "numba_kv.ops.mod", mods))
    assert found == ["numba_kv.ops.attention._merge_partitions_cpu", "numba_kv.ops.hadamard._rotate32_inverse",
                     "numba_kv.ops.half._f32_to_f16_bits", "numba_kv.ops.qjl._sketch_arg"]


def test_no_private_name_crosses_modules():
    """A name shared between modules is public (in its module's ``__all__``); private names
    (``_x``) stay inside their module."""
    modules = {m for m, _ in _package_modules()}
    bad = []
    for module, path in _package_modules():
        for line, name in cross_module_private_names(path, module, modules):
            bad.append(f"{path.relative_to(PKG.parent)}:{line} uses {name}")
    assert not bad, "private names used across modules:\n" + "\n".join(bad)


# -- sizes: modules a reader takes in whole, functions that fit on a screen ----------------------
MAX_MODULE_LINES = 700
MAX_FUNCTION_LINES = 90  # lines after the ``def`` line, the docstring not counted

# current offenders, each with its reason; the toolkit has none and may not gain any
_LONG_MODULES: dict[str, str] = {}
_LONG_FUNCTIONS: dict[str, str] = {}


def _long_functions(path: pathlib.Path, limit: int) -> list[tuple[str, int]]:
    """``(qualified name, lines)`` of every function in ``path`` (methods and nested
    functions included) spanning more than ``limit`` lines."""
    out = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    n = _code_lines(child)
                    if n > limit:
                        out.append((name, n))
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text(encoding="utf-8")), "")
    return out


def _code_lines(fn: ast.AST) -> int:
    """Lines of ``fn`` after its ``def`` line, its docstring not counted (documentation is
    not what makes a function hard to read)."""
    n = fn.end_lineno - fn.lineno
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        n -= body[0].end_lineno - body[0].lineno + 1
    return n


def test_long_function_scan_finds_methods_and_nested_functions(tmp_path):
    f = tmp_path / "mod.py"
    f.write_text("def a():\n    x = 1\n    y = 2\n    return x + y\n\n"
                 "def b():\n    return 1\n\n"
                 "class C:\n    def m(self):\n        x = 1\n        y = 2\n        return x + y\n\n"
                 "    def n(self):\n        def inner():\n            x = 1\n            y = 2\n"
                 "            return x + y\n        return inner\n"
                 "def d():\n    \"\"\"Doc\n    string\n    lines.\"\"\"\n    return 1\n")
    assert sorted(_long_functions(f, 2)) == [("C.m", 3), ("C.n", 5), ("C.n.inner", 3), ("a", 3)]


def test_module_and_function_sizes():
    """No module over 700 lines, no function over 90 (allow-listed offenders aside); none at
    all in the toolkit."""
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        in_toolkit = rel.startswith("toolkit/")
        n = len(path.read_text(encoding="utf-8").splitlines())
        if n > MAX_MODULE_LINES and (in_toolkit or rel not in _LONG_MODULES):
            bad.append(f"{rel}: {n} lines (max {MAX_MODULE_LINES})")
        for name, lines in _long_functions(path, MAX_FUNCTION_LINES):
            if in_toolkit or f"{rel}::{name}" not in _LONG_FUNCTIONS:
                bad.append(f"{rel}::{name}: {lines} lines (max {MAX_FUNCTION_LINES}): split it into named helpers")
    assert not bad, "too long:\n" + "\n".join(bad)


#: the most imports a function body may hold, package-wide (each one needs a reason); 11 since
#: the GPU benchmarks' optional torch baseline (``toolkit/bench_cuda.py``: torch must not load
#: when the ``numba-kv`` command line starts)
MAX_FUNCTION_IMPORTS = 11


def function_level_imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """``(line number, source line)`` of every import statement inside a function body of ``path``."""
    source = path.read_text()
    lines = source.splitlines()
    out = []
    for fn in ast.walk(ast.parse(source)):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    out.append((node.lineno, lines[node.lineno - 1]))
    return sorted(set(out))


def _import_reason(line: str) -> str:
    """The reason after ``# noqa: PLC0415`` on ``line`` ('' without one)."""
    _, sep, rest = line.partition("# noqa: PLC0415")
    return rest.strip(" -:—") if sep else ""


def test_function_import_scan_and_reason(tmp_path):
    f = tmp_path / "mod.py"
    f.write_text("import os\n\n\ndef g():\n    import json  # noqa: PLC0415 - optional dependency here\n"
                 "    if os:\n        from . import x  # noqa: PLC0415\n    return json\n")
    found = function_level_imports(f)
    assert [n for n, _ in found] == [5, 7]
    assert _import_reason(found[0][1]) == "optional dependency here" and _import_reason(found[1][1]) == ""


def test_function_level_imports_are_few_and_justified():
    """Imports inside functions hide a module's dependencies and cost a lookup per call: at most
    :data:`MAX_FUNCTION_IMPORTS` in the package, each marked ``# noqa: PLC0415`` with its reason
    (a named import cycle or an optional dependency) of a few words.  A run of adjacent imports
    may share the reason written on its first line."""
    found, bad = [], []
    for _, path in _package_modules():
        rel = path.relative_to(PKG.parent)
        previous, reason = -2, ""
        for n, line in function_level_imports(path):
            found.append(f"{rel}:{n}")
            if "# noqa: PLC0415" not in line:
                bad.append(f"{rel}:{n} lacks '# noqa: PLC0415'")
                continue
            reason = _import_reason(line) or (reason if n == previous + 1 else "")
            previous = n
            if len(reason.split()) < 3:
                bad.append(f"{rel}:{n} gives no reason (a few words after the noqa)")
    assert len(found) <= MAX_FUNCTION_IMPORTS, f"{len(found)} function-level imports:\n" + "\n".join(found)
    assert not bad, "\n".join(bad)
