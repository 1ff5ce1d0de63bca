"""How long the registered CUDA kernels take to build, timed without a GPU.

A process's first launch of a kernel on a GPU types and lowers it (Numba), turns it into PTX
(NVVM) and loads it (the driver's ptxas).  This times the same steps for every registered
kernel and signature in one fresh process, in the order of :data:`numba_kv.ops.TWINS`:
``numba_kv._cuda_resources.kernel_resources`` (``compile_ptx``, then ptxas through
nvJitLink).  Device functions compile once per process and are shared by the kernels that
call them, so a kernel's time depends on what compiled before it; the total does not::

    python benchmarks/compile_times.py [--cc 9.0] [--kernel decode_attention_mma,...]

Needs the ``cuda`` extra (NVVM and nvJitLink), no GPU or driver.
"""

from __future__ import annotations

import argparse
import time

from numba_kv._cuda_resources import kernel_resources
from numba_kv.info import provenance_line
from numba_kv.ops import TWINS


def build_seconds(names: list[str], cc: tuple[int, int]) -> list[tuple[str, int, float]]:
    """``(kernel, signature index, seconds)`` of each build, in the order built."""
    rows = []
    for name in names:
        for i in range(len(TWINS[name].signatures)):
            t = time.perf_counter()
            kernel_resources(name, cc, i)
            rows.append((name, i, time.perf_counter() - t))
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cc", default="9.0", help="compute capability (default 9.0)")
    ap.add_argument("--kernel", default="", help="comma-separated kernel names (default: all)")
    args = ap.parse_args(argv)
    cc = tuple(int(x) for x in args.cc.split("."))
    names = [n for n in args.kernel.split(",") if n] or sorted(TWINS)
    unknown = sorted(set(names) - set(TWINS))
    if unknown:
        raise SystemExit(f"--kernel: no registered kernel {unknown}; known: {sorted(TWINS)}")
    print(provenance_line())
    print(f"| kernel | signature | s to PTX and sm_{cc[0]}{cc[1]} machine code |")
    print("| --- | --- | --- |")
    rows = build_seconds(names, cc)
    for name, i, s in rows:
        print(f"| `{name}` | {i} | {s:.1f} |")
    print(f"| all {len(rows)} | | {sum(s for *_, s in rows):.0f} |")


if __name__ == "__main__":
    main()
