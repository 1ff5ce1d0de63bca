"""``numba-kv kernels``: what every CUDA kernel of the package needs from an SM, without a GPU.

Registers, spills, local and static shared memory as ptxas builds each registered kernel
(through nvJitLink), the largest block that launches, and the theoretical occupancy at the
block size the package launches with (the ``cuda_threads`` knob).  See
:mod:`numba_kv.resources` for the rules.

``numba-kv kernels --sass``: the same ptxas build disassembled (``nvdisasm``) and the hot
loop of each decode attention kernel counted, per token per KV head and by instruction
class (rules in :mod:`numba_kv.resources`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from cuda.bindings import nvjitlink
from numba.cuda.cudadrv import nvvm

from numba_kv.ops import TWINS
from numba_kv.resources import ARCHS, Loop, cuda_threads, kernel_resources, kernel_sass, max_block_threads, occupancy

__all__ = ["missing_compilers", "parse_cc", "report", "sass_kernels", "sass_markdown", "sass_report", "to_markdown"]

COLUMNS = ("kernel", "sm", "registers", "spill B (st/ld)", "local B", "shared B", "max block",
           "blocks/SM", "warps/SM", "occupancy", "limited by")


def missing_compilers() -> str | None:
    """Why ``numba-kv kernels`` cannot build machine code here (one line), or ``None``.

    The table needs NVVM (``numba.cuda.compile_ptx``: Python to PTX) and nvJitLink (ptxas:
    PTX to machine code), neither a GPU nor a driver.  They are the CUDA toolkit wheels of the
    ``cuda`` extra (a CUDA 13 toolkit on the system serves too); the core install has only
    the CUDA runtime library.  Checked before any compilation, so that their absence is one
    line, not a traceback per kernel.
    """
    missing = []
    for name, load in (("NVVM", nvvm.is_available), ("nvJitLink", nvjitlink.version)):
        try:
            if load() is False:
                missing.append(name)
        except (RuntimeError, OSError):  # cuda.pathfinder's DynamicLibNotFoundError is a RuntimeError
            missing.append(name)
    if not missing:
        return None
    return (f"needs the CUDA compilers ({' and '.join(missing)} not found; no GPU needed): "
            'pip install "numba-kv[cuda]"')


def parse_cc(text: str) -> list[tuple[int, int]]:
    """``"9.0,8.0"`` → ``[(9, 0), (8, 0)]``; ``ValueError`` names ``--cc`` and the known ones."""
    out = []
    for item in text.split(","):
        major, _, minor = item.strip().partition(".")
        try:
            cc = (int(major), int(minor or 0))
        except ValueError:
            raise ValueError(f"--cc: expected compute capabilities like 9.0,8.0, got {text!r}") from None
        if cc not in ARCHS:
            known = ", ".join(f"{a}.{b}" for a, b in sorted(ARCHS))
            raise ValueError(f"--cc: limits are known for {known}, got {item.strip()!r}")
        out.append(cc)
    return out


def report(ccs: Sequence[tuple[int, int]], threads: int | None = None,
           names: Iterable[str] | None = None) -> list[dict[str, Any]]:
    """One row per (kernel, compute capability).

    Parameters
    ----------
    ccs : sequence of (int, int)
        Compute capabilities, keys of :data:`numba_kv.resources.ARCHS`.
    threads : int, optional
        Block size of the occupancy columns; default the ``cuda_threads`` knob (the most
        any launch of the package uses).
    names : iterable of str, optional
        Registered kernel names; default all of :data:`numba_kv.ops.TWINS`.

    Returns
    -------
    list of dict
        Keys ``kernel, cc, registers, spill_stores, spill_loads, local, shared,
        max_block_threads, threads, blocks_per_sm, warps_per_sm, occupancy, limiters``.
    """
    threads = int(cuda_threads() if threads is None else threads)
    if not 1 <= threads <= 1024:
        raise ValueError(f"--threads: expected 1 to 1024 threads per block, got {threads}")
    names = sorted(TWINS) if names is None else list(names)
    for name in names:
        if name not in TWINS:
            raise ValueError(f"--kernel: no registered kernel {name!r}; known: {', '.join(sorted(TWINS))}")
    rows = []
    for name in names:
        for cc in ccs:
            r = kernel_resources(name, tuple(cc))
            o = occupancy(r, threads, cc)
            rows.append({"kernel": name, "cc": f"{cc[0]}.{cc[1]}", "registers": r.registers,
                         "spill_stores": r.spill_stores, "spill_loads": r.spill_loads, "local": r.local,
                         "shared": r.shared, "max_block_threads": max_block_threads(r, cc), "threads": threads,
                         "blocks_per_sm": o.blocks_per_sm, "warps_per_sm": o.warps_per_sm,
                         "occupancy": round(o.fraction, 4), "limiters": list(o.limiters)})
    return rows


def to_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The rows of :func:`report` as a GitHub markdown table."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    for r in rows:
        cells = [f"`{r['kernel']}`", r["cc"], r["registers"], f"{r['spill_stores']}/{r['spill_loads']}", r["local"],
                 r["shared"], r["max_block_threads"], r["blocks_per_sm"], r["warps_per_sm"],
                 f"{100 * r['occupancy']:.0f} %", ", ".join(r["limiters"]) or "does not launch"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


# --- numba-kv kernels --sass ---------------------------------------------------------------
#: short column names of the instruction classes (``numba_kv.resources.CLASSES``)
CLASS_COLUMNS = {"load.global": "ld.global", "load.shared": "ld.shared", "load.const": "ld.const",
                 "load.local": "ld.local", "store": "st", "fp32": "fp32", "mufu": "mufu", "mma": "mma",
                 "fp16": "fp16", "int": "int", "move": "mov", "shfl": "shfl", "convert": "cvt", "branch": "branch",
                 "sync": "sync", "other": "other"}
SASS_COLUMNS = ("kernel", "sm", "registers", "spill B (st/ld)", "hot loop", "SASS / iteration", "tokens / iteration",
                "SASS / token / KV head")


def sass_kernels() -> list[str]:
    """The decode attention kernels ``--sass`` reports by default: every registered kernel
    whose name starts with ``decode_attention``."""
    return sorted(n for n in TWINS if n.startswith("decode_attention"))


def _loop_row(loop: Loop) -> dict[str, Any]:
    return {"header": f"{loop.header:#x}", "depth": loop.depth, "instructions": loop.size, "classes": loop.counts()}


def sass_report(ccs: Sequence[tuple[int, int]], names: Iterable[str] | None = None) -> list[dict[str, Any]]:
    """One row per (kernel, compute capability): registers, spills and the hot loop's SASS.

    Parameters
    ----------
    ccs : sequence of (int, int)
        Compute capabilities.
    names : iterable of str, optional
        Registered kernel names; default :func:`sass_kernels`.

    Returns
    -------
    list of dict
        Keys ``kernel, cc, registers, spill_stores, spill_loads, loop`` (the hot loop:
        ``header, depth, instructions, classes``, or ``None`` without loops),
        ``tokens_per_iteration`` and ``per_token`` (``None`` for a kernel without an entry
        in ``TOKENS_PER_ITERATION``), ``per_token_classes`` (the classes divided likewise)
        ``nested`` (the loops inside the hot loop, each as ``loop``) and ``error`` (``None``,
        or why the kernel did not compile; its figures are then ``None``).

    Raises
    ------
    ValueError
        For an unregistered name.
    FileNotFoundError
        Without ``nvdisasm``.
    """
    names = sass_kernels() if names is None else list(names)
    for name in names:
        if name not in TWINS:
            raise ValueError(f"--kernel: no registered kernel {name!r}; known: {', '.join(sorted(TWINS))}")
    return [_sass_row(name, cc) for name in names for cc in ccs]


def _sass_row(name: str, cc: tuple[int, int]) -> dict[str, Any]:
    """One row of :func:`sass_report`; a kernel that does not compile gives a row with its
    ``error`` (one line) and ``None`` figures, so that it does not hide the others."""
    row: dict[str, Any] = {"kernel": name, "cc": f"{cc[0]}.{cc[1]}", "error": None}
    try:
        k = kernel_sass(name, tuple(cc))
    except (FileNotFoundError, ImportError):
        raise
    except Exception as e:  # a kernel being written may not compile yet: report it, go on
        first = (str(e).strip().splitlines() or [""])[0]
        return row | {"error": f"{type(e).__name__}: {first}", "registers": None, "spill_stores": None,
                      "spill_loads": None, "loop": None, "tokens_per_iteration": None, "per_token": None,
                      "per_token_classes": None, "nested": []}
    r = k.resources
    hot = None if k.hot is None else k.loops[k.hot]
    per = k.tokens_per_iteration if hot is not None else None
    return row | {
        "registers": r.registers, "spill_stores": r.spill_stores, "spill_loads": r.spill_loads,
        "loop": None if hot is None else _loop_row(hot), "tokens_per_iteration": per,
        "per_token": None if per is None else round(hot.size / per, 2),
        "per_token_classes": None if per is None else {c: round(n / per, 2) for c, n in hot.counts().items()},
        "nested": [_loop_row(lp) for i, lp in enumerate(k.loops) if _inside(k.loops, i, k.hot)]}


def _inside(loops: Sequence[Loop], i: int, outer: int | None) -> bool:
    """Whether loop ``i`` is nested (at any depth) in loop ``outer``."""
    p = loops[i].parent
    while p is not None:
        if p == outer:
            return True
        p = loops[p].parent
    return False


def sass_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The rows of :func:`sass_report` as three GitHub markdown tables: the hot loop per
    kernel, its instruction classes (per token per KV head, or per iteration where the
    tokens per iteration are not stated), and the loops nested in it."""
    lines = ["| " + " | ".join(SASS_COLUMNS) + " |", "|" + " --- |" * len(SASS_COLUMNS)]
    for r in rows:
        loop = r["loop"]
        if r["error"]:
            lines.append(f"| `{r['kernel']}` | {r['cc']} | does not compile: {r['error'].replace('|', '/')} |")
            continue
        cells = [f"`{r['kernel']}`", r["cc"], r["registers"], f"{r['spill_stores']}/{r['spill_loads']}",
                 "none" if loop is None else f"{loop['header']} (depth {loop['depth']})",
                 "" if loop is None else loop["instructions"], _num(r["tokens_per_iteration"], "not stated"),
                 _num(r["per_token"], "raw: see SASS / iteration")]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    cols = list(CLASS_COLUMNS.values())
    lines += ["", "| kernel | sm | per | " + " | ".join(cols) + " |", "|" + " --- |" * (len(cols) + 3)]
    for r in rows:
        if r["loop"] is None:
            continue
        per_token = r["per_token_classes"] is not None
        classes = r["per_token_classes"] if per_token else r["loop"]["classes"]
        cells = [f"`{r['kernel']}`", r["cc"], "token" if per_token else "iteration",
                 *(_num(classes[c], "") for c in CLASS_COLUMNS)]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    lines += ["", "| kernel | sm | nested loop | depth | SASS / iteration | largest classes |", "|" + " --- |" * 6]
    for r in rows:
        for n in r["nested"]:
            top = sorted(((v, c) for c, v in n["classes"].items() if v), reverse=True)[:4]
            lines.append(f"| `{r['kernel']}` | {r['cc']} | {n['header']} | {n['depth']} | {n['instructions']} | "
                         + ", ".join(f"{CLASS_COLUMNS[c]} {v}" for v, c in top) + " |")
    return "\n".join(lines) + "\n"


def _num(x: float | None, missing: str) -> str:
    """``x`` without a trailing ``.0``; ``missing`` for ``None``."""
    if x is None:
        return missing
    return f"{x:g}" if isinstance(x, float) else str(x)
