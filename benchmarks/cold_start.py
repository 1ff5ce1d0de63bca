"""What a new user waits for: the README's quick start (``kv4`` cache, prefill of 100 tokens,
two decode steps) in fresh processes, first with an empty Numba cache directory (every kernel
it uses is compiled), then again with the cache that run wrote (machine code loaded from
disk).

    .venv/bin/python benchmarks/cold_start.py [--runs 2]

Each run prints the import time, the first prefill and the first decode (the compiles land
there), and the second decode step (steady state).
"""

import argparse
import os
import subprocess
import sys
import tempfile

from numba_kv.info import provenance_line

QUICK_START = r"""
import time
t0 = time.perf_counter()
import numpy as np
import numba_kv as nk
t1 = time.perf_counter()
cache = nk.make_cache("kv4", num_layers=30, num_kv_heads=3, head_dim=64)
rng = np.random.default_rng(0)
k = rng.standard_normal((1, 3, 100, 64)).astype(np.float32)
v = rng.standard_normal((1, 3, 100, 64)).astype(np.float32)
cache.prefill(0, k, v)
t2 = time.perf_counter()
q = rng.standard_normal((1, 9, 1, 64)).astype(np.float32)
att = nk.AttendConfig(64 ** -0.5, n_kv_groups=3)
cache.decode(0, k[:, :, -1:], v[:, :, -1:], q, att)
t3 = time.perf_counter()
cache.decode(0, k[:, :, -1:], v[:, :, -1:], q, att)
t4 = time.perf_counter()
print(f"{t1 - t0:8.2f} {t2 - t1:14.2f} {t3 - t2:13.2f} {1e3 * (t4 - t3):17.2f}")
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=2, help="cold/warm pairs, each with a new cache directory")
    a = p.parse_args()
    print(provenance_line())
    print(f"{'cache':>6} {'import s':>8} {'first prefill s':>15} {'first decode s':>14} {'second decode ms':>17}")
    for _ in range(a.runs):
        with tempfile.TemporaryDirectory() as cache_dir:
            env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir)
            for label in ("empty", "filled"):
                out = subprocess.run([sys.executable, "-c", QUICK_START], env=env, check=True, capture_output=True,
                                     text=True).stdout
                print(f"{label:>6} {out.strip()}")


if __name__ == "__main__":
    main()
