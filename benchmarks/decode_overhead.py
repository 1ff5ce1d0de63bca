"""Fixed cost of one ``cache.decode`` call on the CPU: a single layer with 3 KV heads and
9 query heads, d = 64, after a prefill of T tokens, best of 5 sweeps of 80 steps each.
At small T the arithmetic is a few microseconds, so the time is Python work and kernel
dispatch; for an L-layer model multiply by L.

    NUMBA_NUM_THREADS=2 .venv/bin/python benchmarks/decode_overhead.py [dense pqo3 kv4 tq3]

AVX2 code generation: prefix ``env $(.venv/bin/python -m numba_kv.info --avx2-env)
NUMBA_CACHE_DIR=$PWD/.numba_cache_avx2``.
"""

import sys
import time

import numpy as np

import numba_kv as nk
from numba_kv.info import provenance_line


def step_us(name: str, tokens: int, steps: int = 400) -> float:
    """Best mean µs per decode step of cache ``name`` after ``tokens`` prefilled tokens."""
    rng = np.random.default_rng(0)
    cache = nk.make_cache(name, num_layers=1, num_kv_heads=3, head_dim=64)
    k = rng.standard_normal((1, 3, tokens, 64)).astype(np.float32)
    v = rng.standard_normal((1, 3, tokens, 64)).astype(np.float32)
    cache.prefill(0, k, v)
    q = rng.standard_normal((1, 9, 1, 64)).astype(np.float32)
    att = nk.AttendConfig(64 ** -0.5, n_kv_groups=3)
    k1, v1 = k[:, :, -1:].copy(), v[:, :, -1:].copy()
    for _ in range(30):
        cache.decode(0, k1, v1, q, att)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(steps // 5):
            cache.decode(0, k1, v1, q, att)
        best = min(best, (time.perf_counter() - t) / (steps // 5))
    return best * 1e6


def main() -> None:
    names = sys.argv[1:] or ["dense", "pqo3", "kv4", "tq3"]
    print(provenance_line())
    print(f"{'cache':8s} {'T=100 us/step':>14s} {'T=1000 us/step':>15s}")
    for name in names:
        print(f"{name:8s} {step_us(name, 100):14.1f} {step_us(name, 1000):15.1f}")


if __name__ == "__main__":
    main()
