"""Soak run: many threads decoding into one cache for a long time (``make soak``).

Default: 8 threads × 8 layers (one layer per thread) × 10,000 decode steps of a ``pqo3``
cache (fused decode attention), batch 1, 2 KV heads, 4 query heads, head_dim 64.  Every
``--check-every`` steps each thread checks, for its layer:

* ``seq_len`` and ``memory_usage`` equal to the closed-form byte count (computed here from
  the storage format, not from the cache's buffers);
* the fused output holds no NaN / Inf (checked at every step);

and the main thread samples the resident set size (RSS, ``/proc/self/statm``).  The run is
repeated ``--cycles`` times (default 2) with ``cache.reset()`` in between: the same work
again must not need more memory, so RSS at the end of the last cycle must be within
``--rss-slack`` MiB of RSS at the end of the first (a leak of 100 bytes per decode call
would add 8 MB per cycle of the default run).  Within a cycle RSS grows with the cache
(and with temporaries that scale with the sequence length), which is why cycles are
compared at equal progress rather than the start with the end.
Prints a summary; exits 1 if any check failed.  Not part of the test suite (minutes).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import numpy as np


def rss_bytes() -> int:
    """Resident set size of this process (Linux ``/proc/self/statm``; 0 elsewhere)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def expected_bytes(name: str, tokens: int, rows: int, d: int, sinks: int, window: int) -> int:
    """Live bytes of one layer after ``tokens`` tokens, from the storage format alone.

    ``dense``: float32 K and V.  ``pqo<b>``: ``sinks + window`` newest/first tokens as
    float16 K and V; the rest as ``b``-bit indices (``d·b/8`` bytes) plus one binary16 scale
    per 32 values (``d/32 · 2`` bytes), for K and V.
    """
    if name == "dense":
        return rows * tokens * 2 * d * 4
    bits = int(name[3:])
    exact = min(tokens, sinks + window)
    comp = tokens - exact
    return rows * (exact * 2 * d * 2 + comp * 2 * (d * bits // 8 + d // 32 * 2))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--cache", default="pqo3", help="dense, pqo2, pqo3 or pqo4")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--groups", type=int, default=2, help="query heads per KV head")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--check-every", type=int, default=100)
    ap.add_argument("--cycles", type=int, default=2, help="runs, with cache.reset() in between")
    ap.add_argument("--rss-slack", type=float, default=8.0, help="MiB allowed between cycle ends")
    args = ap.parse_args(argv)

    import numba_kv
    from numba_kv.info import provenance_line
    from numba_kv.threads import check_threading_layer

    layer_kind = check_threading_layer()
    b, h, g, d = args.batch, args.kv_heads, args.groups, args.head_dim
    cache = numba_kv.make_cache(args.cache, num_layers=args.layers, num_kv_heads=h, head_dim=d)
    sinks = getattr(cache, "sink_tokens", 0)
    window = getattr(cache, "residual_length", 0)
    cfg = numba_kv.AttendConfig(d ** -0.5, n_kv_groups=g)
    failures: list = []
    done = [0] * args.threads
    start, end = threading.Barrier(args.threads + 1), threading.Barrier(args.threads + 1)

    def work(t: int) -> None:
        rng = np.random.default_rng(t)
        mine = list(range(t, args.layers, args.threads))
        # a small pool of inputs, reused: the soak measures the cache, not the RNG
        pool = [(rng.standard_normal((b, h, 1, d)).astype(np.float32),
                 rng.standard_normal((b, h, 1, d)).astype(np.float32),
                 rng.standard_normal((b, h * g, 1, d)).astype(np.float32)) for _ in range(16)]
        for _cycle in range(args.cycles):
            start.wait()
            try:
                run(t, mine, pool)
            except Exception as e:  # noqa: BLE001 - reported in the summary
                failures.append(f"thread {t}: {type(e).__name__}: {e}")
            end.wait()

    def run(t: int, mine: list, pool: list) -> None:
        for step in range(1, args.steps + 1):
            for layer in mine:
                k, v, q = pool[(step + layer) % len(pool)]
                out = cache.decode(layer, k, v, q, cfg)
                arr = out.out if isinstance(out, numba_kv.Fused) else out.result.k
                if not np.isfinite(arr).all():
                    failures.append(f"layer {layer} step {step}: non-finite output")
                    return
                if step % args.check_every == 0 or step == args.steps:
                    if cache.seq_len(layer) != step:
                        failures.append(f"layer {layer} step {step}: seq_len {cache.seq_len(layer)}")
                        return
                    got = sum(int(a.nbytes) for a in cache.live_arrays(layer))
                    want = expected_bytes(args.cache, step, b * h, d, sinks, window)
                    if got != want:
                        failures.append(f"layer {layer} step {step}: {got} live bytes, formula {want}")
                        return
            done[t] = step

    threads = [threading.Thread(target=work, args=(t,), daemon=True) for t in range(args.threads)]
    for th in threads:
        th.start()
    rss0 = rss_bytes()
    ends, walls = [], []
    total_mem = want_total = 0
    for cycle in range(args.cycles):
        if cycle:
            cache.reset()
        for i in range(args.threads):
            done[i] = 0
        start.wait()
        t0 = time.perf_counter()
        end.wait()
        walls.append(time.perf_counter() - t0)
        ends.append(rss_bytes())
        if cycle == 0:
            total_mem = cache.memory_usage()
            want_total = args.layers * expected_bytes(args.cache, args.steps, b * h, d, sinks, window)
            if not failures and total_mem != want_total:
                failures.append(f"memory_usage {total_mem} != formula {want_total}")
    for th in threads:
        th.join()
    growth = ends[-1] - ends[0]
    calls = args.steps * args.layers
    print(f"soak: {args.threads} threads x {args.layers} layers x {args.steps} decode steps x {args.cycles} "
          f"cycles, cache {args.cache} (batch {b}, {h} KV heads, {h * g} query heads, head_dim {d})")
    print(f"  {provenance_line()}; threading layer {layer_kind}")
    for c, w in enumerate(walls):
        print(f"  cycle {c + 1}: wall {w:.1f} s, {calls / w:,.0f} decode calls/s "
              f"({1e6 * w / calls:.0f} us/call, all threads together); RSS at end {ends[c] / 2**20:.1f} MiB")
    print(f"  memory_usage {total_mem:,} B == formula {want_total:,} B: {total_mem == want_total}; "
          f"seq_len and live bytes checked every {args.check_every} steps per layer; "
          "outputs checked for NaN/Inf at every step")
    print(f"  RSS before {rss0 / 2**20:.1f} MiB; cache allocated {cache.allocated_bytes() / 2**20:.2f} MiB; "
          f"RSS growth from the end of cycle 1 to the end of cycle {args.cycles}: {growth / 2**20:+.2f} MiB "
          f"({growth / max(calls * (args.cycles - 1), 1):+.1f} B per decode call; "
          f"allowed {args.rss_slack:g} MiB)")
    ok = not failures and growth <= args.rss_slack * 2**20
    for f in failures[:10]:
        print("  FAIL:", f)
    print("  result:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
