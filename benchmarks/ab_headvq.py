"""A/B of the head VQ quantizer (``quantize_headvq``) of an older revision against the working
tree, in one process: 2**18 vectors at d = 128, 4 and 2 bits, 6 rounds alternated, M vectors/s
(best round).  The old library is loaded by :func:`benchmarks.ab_package.load_old`.

    NUMBA_NUM_THREADS=2 .venv/bin/python benchmarks/ab_headvq.py --rev fe238bd

AVX2 code generation: prefix ``env $(.venv/bin/python -m numba_kv.info --avx2-env)
NUMBA_CACHE_DIR=$PWD/.numba_cache_avx2``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.ab_package import load_old  # noqa: E402 - after the path set-up


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rev", required=True, help="git revision of the old library")
    ap.add_argument("--vectors", type=int, default=1 << 18)
    args = ap.parse_args()
    from numba_kv.info import provenance_line
    from numba_kv.ops import headvq as new

    load_old(args.rev)
    old = importlib.import_module("numba_kv_ab.ops.headvq")
    print(provenance_line())
    x = np.random.default_rng(0).standard_normal((args.vectors, 128)).astype(np.float32)
    for bits in (4, 2):
        res: dict[str, list[float]] = {"old": [], "new": []}
        for lib in (old, new):
            lib.quantize_headvq(x[:1024], bits)  # compile and warm
        for r in range(6):
            for side, lib in ((("old", old), ("new", new)) if r % 2 == 0 else (("new", new), ("old", old))):
                t = time.perf_counter()
                lib.quantize_headvq(x, bits)
                res[side].append(time.perf_counter() - t)
        print(f"{bits} bits: " + ", ".join(f"{k} {args.vectors / min(v) / 1e6:.2f}" for k, v in res.items())
              + " M vectors/s", flush=True)


if __name__ == "__main__":
    main()
