"""Where the tensor-core decode attention's time goes, read from the GPU's counters by Nsight
Compute (``ncu``): the warps' stall reasons, issue slots used, occupancy and memory traffic.

The kernel is instruction-bound by its static counts (the Kernels design page) but reached
under half of the issue rate on an H200 (about 1.9 of 4 instructions a cycle per SM at T =
128K, batch 32); whether its warps wait on global loads, on the pair-table reads, on the
tensor cores or on too few warps decides what to change next.  This script runs the kernel
path of ``gpu_mma_check.py`` (partition kernel and merge, prepared arguments) a few times at
one shape; ``ncu`` profiles one of those launches::

    ncu --clock-control none -k regex:decode_attention_mma --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \\
        --section WarpStateStats --section MemoryWorkloadAnalysis --section InstructionStats \\
        python3 benchmarks/gpu_profile_mma.py --tokens 131072 --batch 32

(``--clock-control none``: the device notes ask that the clocks be left alone.)
``--ncu auto`` (or a path to ``ncu``) runs that command on this script for each of
``--shapes`` (default T = 128K, batch 32 and T = 32K, batch 8), as ``benchmarks/gpu_check.sh``
does (its ``profile_mma.log``); where no ``ncu`` is found it says so and times the shapes
without counters.
"""

from __future__ import annotations

import argparse
import glob
import pathlib
import shutil
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # (run as a script: the package)
from benchmarks.gpu_mma_check import kernel_path, partition_note  # noqa: E402
from numba_kv.ops.blockquant import quantize_blocks  # noqa: E402
from numba_kv.toolkit.bench_cuda import require_cupy, time_cuda_ms  # noqa: E402

#: the Nsight Compute sections read (stall reasons: WarpStateStats; issue: SchedulerStats)
SECTIONS = ("SpeedOfLight", "Occupancy", "LaunchStats", "SchedulerStats", "WarpStateStats", "MemoryWorkloadAnalysis",
            "InstructionStats")


def find_ncu(spec: str) -> str | None:
    """``spec`` itself, or for ``auto`` the ``ncu`` on the path or the newest under
    ``/opt/nvidia/nsight-compute``."""
    if spec != "auto":
        return spec
    found = shutil.which("ncu") or (sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu")) or [None])[-1]
    return found


def profile(ncu: str, shapes: list[tuple[int, int]], bits: int) -> int:
    """Run ``ncu`` on this script once per shape (the third kernel-path launch profiled)."""
    status = 0
    for tokens, batch in shapes:
        cmd = [ncu, "--clock-control", "none", "-k", "regex:decode_attention_mma", "--launch-skip", "2",
               "--launch-count", "1", *(x for sec in SECTIONS for x in ("--section", sec)), sys.executable,
               __file__, "--tokens", str(tokens), "--batch", str(batch), "--bits", str(bits)]
        print("$", " ".join(cmd), flush=True)
        status |= subprocess.run(cmd, check=False).returncode
    return status


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--bits", type=int, default=3)
    ap.add_argument("--calls", type=int, default=4, help="kernel-path calls (ncu profiles the one it is told to)")
    ap.add_argument("--ncu", default=None, help="'auto' or a path: profile --shapes under Nsight Compute")
    ap.add_argument("--shapes", default="131072x32,32768x8", help="TOKENSxBATCH,... for --ncu")
    args = ap.parse_args()
    if args.ncu:
        shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
        ncu = find_ncu(args.ncu)
        if ncu is None:
            print("ncu: not found (no counters); the shapes timed without it", flush=True)
            for tokens, batch in shapes:
                subprocess.run([sys.executable, __file__, "--tokens", str(tokens), "--batch", str(batch), "--bits",
                                str(args.bits)], check=False)
            return
        raise SystemExit(profile(ncu, shapes, args.bits))
    cupy = require_cupy()
    hkv, groups, d = 8, 4, 128
    rng = cupy.random.default_rng(0)
    q = rng.standard_normal((args.batch, hkv * groups, 1, d), dtype=cupy.float32)
    k = rng.standard_normal((args.batch, hkv, args.tokens, d), dtype=cupy.float32)
    kc, ks = quantize_blocks(k, args.bits)
    vc, vs = quantize_blocks(rng.standard_normal(k.shape, dtype=cupy.float32), args.bits)
    del k
    fn = kernel_path(cupy, q, kc, ks, vc, vs, args.bits)
    for _ in range(args.calls):
        fn()
    cupy.cuda.runtime.deviceSynchronize()
    ms = time_cuda_ms(cupy, fn, 5)
    print(f"T={args.tokens} batch={args.batch} bits={args.bits}: kernel path {ms:.3f} ms (best of 5); "
          f"{partition_note(args.tokens, args.batch * hkv)}", flush=True)


if __name__ == "__main__":
    main()
