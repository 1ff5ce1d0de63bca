"""``numba-kv kernels``: what every CUDA kernel of the package needs from an SM, without a GPU.

Registers, spills, local and static shared memory as ptxas builds each registered kernel
(through nvJitLink), the largest block that launches, and the theoretical occupancy at the
block size the package launches with (the ``cuda_threads`` knob).  See
:mod:`numba_kv._cuda_resources` for the rules.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from numba_kv import _config
from numba_kv._cuda_resources import ARCHS, kernel_resources, max_block_threads, occupancy
from numba_kv.ops import TWINS

__all__ = ["parse_cc", "report", "to_markdown"]

COLUMNS = ("kernel", "sm", "registers", "spill B (st/ld)", "local B", "shared B", "max block",
           "blocks/SM", "warps/SM", "occupancy", "limited by")


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
        Compute capabilities, keys of :data:`numba_kv._cuda_resources.ARCHS`.
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
    threads = int(_config.get("cuda_threads") if threads is None else threads)
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
