"""A/B of one steady-state ``cache.decode`` at a FIXED T: an older revision vs the working tree,
in one process (the old library is loaded as ``numba_kv_ab`` by :mod:`benchmarks.ab_package`).

Unlike the ``step`` cases of ``ab_package.py``, which keep decoding into one cache (T grows
by some 600 tokens over a run and crosses ``cpu_parallel_min_work`` into the parallel
kernels), every round builds a fresh cache: prefill T tokens, 10 warm-up steps, 40 timed
steps.  Rounds alternate old/new.  Prints best and median per step of the wall time and of
the main thread's CPU time (``time.thread_time``: on a shared machine the steadier figure,
and the whole step runs on the main thread below ``cpu_parallel_min_work``), then each
cache's median against the dense cache's.

    NUMBA_NUM_THREADS=2 .venv/bin/python benchmarks/ab_decode_step.py --rev 0329084 [dense kv4 pqo3]

AVX2 code generation: prefix ``env $(.venv/bin/python -m numba_kv.info --avx2-env)
NUMBA_CACHE_DIR=$PWD/.numba_cache_avx2``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.ab_package import load_old  # noqa: E402 - after the path set-up


def _fresh(nk: object, name: str, k: np.ndarray, q: np.ndarray) -> tuple[object, object]:
    att = nk.AttendConfig(64 ** -0.5, n_kv_groups=3)
    cache = nk.make_cache(name, num_layers=1, num_kv_heads=3, head_dim=64)
    cache.prefill(0, k, k[:, :, ::-1].copy())
    k1 = k[:, :, -1:].copy()
    for _ in range(10):
        cache.decode(0, k1, k1, q, att)
    return cache, att


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rev", required=True, help="git revision of the old library")
    ap.add_argument("--tokens", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("names", nargs="*", default=["dense", "kv4", "pqo3"])
    args = ap.parse_args()
    import numba_kv as new
    from numba_kv.info import provenance_line

    old = load_old(args.rev)
    rng = np.random.default_rng(0)
    k = rng.standard_normal((1, 3, args.tokens, 64)).astype(np.float32)
    q = rng.standard_normal((1, 9, 1, 64)).astype(np.float32)
    k1 = k[:, :, -1:].copy()
    print(provenance_line())
    print(f"T = {args.tokens}, {args.rounds} rounds of 40 steps; µs per step")
    med: dict[tuple[str, str], tuple[float, float]] = {}
    for name in args.names:
        libs = {"old": old, "new": new}
        for lib in libs.values():
            _fresh(lib, name, k, q)  # compile and warm
        wall: dict[str, list[float]] = {"old": [], "new": []}
        cpu: dict[str, list[float]] = {"old": [], "new": []}
        for r in range(args.rounds):
            for side in (("old", "new") if r % 2 == 0 else ("new", "old")):
                cache, att = _fresh(libs[side], name, k, q)
                t, c = time.perf_counter(), time.thread_time()
                for _ in range(40):
                    cache.decode(0, k1, k1, q, att)
                wall[side].append((time.perf_counter() - t) / 40 * 1e6)
                cpu[side].append((time.thread_time() - c) / 40 * 1e6)
        for side in ("old", "new"):
            med[name, side] = statistics.median(wall[side]), statistics.median(cpu[side])
            print(f"{name:8s} {side}: wall best {min(wall[side]):8.1f} median {med[name, side][0]:8.1f} | "
                  f"cpu best {min(cpu[side]):8.1f} median {med[name, side][1]:8.1f}", flush=True)
    if "dense" in args.names:
        for side in ("old", "new"):
            d = med["dense", side]
            print(f"vs dense ({side}, median wall / cpu): " + ", ".join(
                f"{n} {med[n, side][0] / d[0]:.2f}x / {med[n, side][1] / d[1]:.2f}x"
                for n in args.names if n != "dense"))


if __name__ == "__main__":
    main()
