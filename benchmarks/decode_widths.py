"""One fused decode step per code width: ``cache.decode`` of one layer (1 KV head, 4 query
rows, T tokens, d = 256 by default, an 8-token window) for each cache name, best of
``--repeat`` steps, all caches interleaved in one run (so a loaded machine slows every side
alike).  The figures of the 5-bit decoder (docs/guide/caches.md)::

    NUMBA_NUM_THREADS=1 python benchmarks/decode_widths.py --repeat 25
    env $(python -m numba_kv.info --avx2-env) NUMBA_CACHE_DIR=.nc-avx2 NUMBA_NUM_THREADS=1 \\
        python benchmarks/decode_widths.py --repeat 25
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from numba_kv import AttendConfig, make_cache
from numba_kv.info import provenance_line

CACHES = "pqo-k4v3-head-eden,pqo-k4v4-head-eden,pqo-k5v4-head-eden,pqo-k5v5-head-eden"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--caches", default=CACHES, help="comma-separated cache names (a '-r8-s0' window is added)")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--groups", type=int, default=4, help="query rows per KV head")
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    d, g = args.head_dim, args.groups
    caches = {}
    for name in args.caches.split(","):
        c = make_cache(f"{name}-r8-s0", num_layers=1, num_kv_heads=1, head_dim=d)
        k, v = rng.standard_normal((2, 1, 1, args.tokens, d)).astype(np.float32)
        c.prefill(0, k, v)
        caches[name] = c
    cfg = AttendConfig(d ** -0.5, n_kv_groups=g)
    best = dict.fromkeys(caches, float("inf"))
    for _ in range(args.repeat + 1):  # the first round compiles
        for name, c in caches.items():
            k1 = rng.standard_normal((1, 1, 1, d)).astype(np.float32)
            q = rng.standard_normal((1, g, 1, d)).astype(np.float32)
            t = time.perf_counter()
            c.decode(0, k1, k1, q, cfg)
            best[name] = min(best[name], time.perf_counter() - t)
    print(provenance_line())
    for name, sec in best.items():
        print(f"{name}: {sec * 1e3:.2f} ms per step (T = {args.tokens}, d = {d}, {g} query rows)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
