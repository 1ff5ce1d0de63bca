"""CPU time of the split-K partition merge of the fused decode attention (serial twin,
one call = one decode step of one layer): (KV rows, query rows per KV row, head_dim,
partitions), best of 5 sweeps of 2,000 calls, µs per call.

    NUMBA_NUM_THREADS=2 .venv/bin/python benchmarks/merge_partitions.py
"""

import time

import numpy as np

from numba_kv.info import provenance_line
from numba_kv.ops import TWINS
from numba_kv.ops.hadamard import SIGNS32

SHAPES = [(3, 3, 64, 2), (3, 3, 128, 2), (8, 4, 128, 8)]  # SmolLM2-like, d = 128, the bench's 8 × 4


def merge_us(g: int, rows: int, d: int, parts: int, calls: int = 2000) -> float:
    rng = np.random.default_rng(0)
    pm = rng.standard_normal((g, parts, rows)).astype(np.float32)
    pl = rng.uniform(1, 2, (g, parts, rows)).astype(np.float32)
    pa = rng.standard_normal((g, parts, rows, d)).astype(np.float32)
    out = np.empty((g, rows, d), np.float32)
    args = (pm, pl, pa, parts - 1, SIGNS32, False, SIGNS32, out)  # one exact partition, 32-block rotation
    f = TWINS["merge_partitions"].cpu.serial
    f(*args)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(calls):
            f(*args)
        best = min(best, (time.perf_counter() - t) / calls)
    return best * 1e6


def main() -> None:
    print(provenance_line())
    for shape in SHAPES:
        print(f"{'x'.join(map(str, shape)):>12s} {merge_us(*shape):8.2f} us")


if __name__ == "__main__":
    main()
