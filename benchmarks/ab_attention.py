"""A/B timing of the fused CPU decode attention: the kernel of an older git revision vs the
working tree, in ONE process, calls alternated round by round (load changes hit both alike),
plus dense NumPy float32 attention with one BLAS thread.  Batch 1, 8 KV heads x 4 query
heads, d = 128 (:func:`numba_kv.toolkit.bench.make_case`).

    .venv/bin/python benchmarks/ab_attention.py [--rev 544a7c9] [--tokens 32768] [--bits 3] [--rounds 10]

AVX2 code generation: prefix ``env $(.venv/bin/python -m numba_kv.info --avx2-env)
NUMBA_CACHE_DIR=$PWD/.numba_cache_avx2``.  The old kernel is that revision's whole package
(``git archive``, imported under its own name by ``benchmarks/ab_package.py``), timed through
its public ``decode_attention``.
"""

import argparse
import pathlib
import statistics
import sys
import time

import numba
import numpy as np

from numba_kv.info import provenance_line
from numba_kv.ops import attention as new
from numba_kv.toolkit.bench import blas_threads_limited, make_case

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_old(rev: str):
    """``numba_kv`` as of ``rev`` as its own package (:func:`benchmarks.ab_package.load_old`:
    the library's relative imports keep it whole).  This file rewrote the imports of one
    module once, which broke when the kernel became a package."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.ab_package import load_old as load_package

    return load_package(rev, name=f"numba_kv_ab_{rev}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rev", default="544a7c9", help="git revision of the old kernel (default: before the rewrite)")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--bits", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=10)
    a = ap.parse_args()
    old = load_old(a.rev)  # (kept per revision in the temporary folder)
    c = make_case(a.tokens, a.bits)
    args = (c.q, c.kc, c.ks, c.vc, c.vs)

    # one BLAS thread for dense, switched outside its timed call (threadpoolctl's switch scans
    # the process's libraries, about a millisecond: it must not count as dense attention)
    fns = {"old": lambda: old.decode_attention(*args, bits=a.bits),
           "new": lambda: new.decode_attention(*args, bits=a.bits), "dense1": c.dense}
    limits = {"dense1": 1}
    o, n = fns["old"](), fns["new"]()  # compile outside the timed rounds
    print(provenance_line())
    print(f"T={a.tokens} bits={a.bits} Numba threads={numba.get_num_threads()} max |old - new| = "
          f"{float(np.abs(o - n).max()):.2e}")
    ts = {k: [] for k in fns}
    for _ in range(a.rounds):
        for k, f in fns.items():
            with blas_threads_limited(limits.get(k)):
                t = time.perf_counter()
                f()
                ts[k].append(time.perf_counter() - t)
    med = {k: statistics.median(v) * 1e3 for k, v in ts.items()}
    best = {k: min(v) * 1e3 for k, v in ts.items()}
    print("median ms " + "  ".join(f"{k} {v:.2f}" for k, v in med.items()))
    print("best ms   " + "  ".join(f"{k} {v:.2f}" for k, v in best.items()))
    print(f"new vs old {med['old'] / med['new']:.2f}x   "
          f"new vs dense(1 BLAS thread) {med['dense1'] / med['new']:.2f}x"
          f"   old vs dense {med['dense1'] / med['old']:.2f}x   (medians of {a.rounds} rounds)")


if __name__ == "__main__":
    main()
