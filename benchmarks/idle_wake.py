"""What the first fused decode-attention call after an idle pause costs, and what one untimed
call before the timed one (``numba-kv bench attention``'s method) removes: best and median
wall time of the fused call after ``pause`` seconds of sleep, without and with that call.

    NUMBA_NUM_THREADS=2 .venv/bin/python benchmarks/idle_wake.py [--tokens 4096] [--repeat 20]

A decode loop runs its steps back to back, so the "warm" column is what it sees; the "cold"
one adds waking idle worker threads (and, on a VM, idle vCPUs) to the kernel's time.
"""

import argparse
import time

import numpy as np

from numba_kv.info import provenance_line
from numba_kv.toolkit.bench import make_case


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--bits", type=int, default=3)
    p.add_argument("--repeat", type=int, default=20)
    a = p.parse_args()
    case = make_case(a.tokens, a.bits)
    case.fused()  # compile
    print(provenance_line())
    print(f"fused decode attention, T = {a.tokens}, {a.bits} bits; ms over {a.repeat} calls")
    print(f"{'pause s':>8} {'cold best':>10} {'cold median':>12} {'warm best':>10} {'warm median':>12}")
    for pause in (0.0, 0.01, 0.05, 0.15):
        row = []
        for warm in (False, True):
            ts = []
            for _ in range(a.repeat):
                if pause:
                    time.sleep(pause)
                if warm:
                    case.fused()
                t = time.perf_counter()
                case.fused()
                ts.append(time.perf_counter() - t)
            row += [min(ts) * 1e3, float(np.median(ts)) * 1e3]
        print(f"{pause:8.2f} {row[0]:10.2f} {row[1]:12.2f} {row[2]:10.2f} {row[3]:12.2f}")


if __name__ == "__main__":
    main()
