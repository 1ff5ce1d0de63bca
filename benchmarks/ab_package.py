"""A/B timing of the whole library: an older git revision vs the working tree, in ONE process.

The old revision's ``numba_kv/`` is extracted (``git archive``) into a temporary folder as the
package ``numba_kv_ab`` — the library uses relative imports only, so it runs as it was — and
both packages are timed on the same cases, round by round alternated (load changes on a
shared machine hit both alike).  Cases, all through public API:

- ``step``: one steady-state ``cache.decode`` (1 layer, 3 KV x 9 query heads, d = 64) after a
  prefill of T tokens, for dense / pqo3 / kv4 / kv3 / tq3 (``benchmarks/decode_overhead.py``);
- ``op``: ``decode_attention`` on 3-bit codes, batch 1, 8 KV x 4 query heads, d = 128, T tokens;
- ``paged``: ``PagedKVCache(storage="pqo3").decode_attention`` over 4 sequences;
- ``prefill``: a 1024-token ``pqo3`` or ``kv3`` prefill (the store path).

    NUMBA_NUM_THREADS=2 .venv/bin/python benchmarks/ab_package.py --rev 0864022 [--rounds 7]

AVX2 code generation: prefix ``env $(.venv/bin/python -m numba_kv.info --avx2-env)
NUMBA_CACHE_DIR=$PWD/.numba_cache_avx2``.  Prints one line a case: best-of-round medians
(µs) of old and new and new/old; ``--json`` writes them.
"""

from __future__ import annotations

import argparse
import importlib
import io
import json
import pathlib
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_old(rev: str, name: str = "numba_kv_ab") -> object:
    """``numba_kv`` as of ``rev``, imported as the package ``name`` (kept per revision in /tmp;
    give each revision its own ``name`` to load several in one process)."""
    dest = pathlib.Path(tempfile.gettempdir()) / "numba_kv_ab" / rev
    if not (dest / name / "__init__.py").exists():
        data = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "numba_kv"], check=True,
                              capture_output=True).stdout
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            tar.extractall(dest / "tmp", filter="data")
        (dest / "tmp" / "numba_kv").rename(dest / name)
    sys.path.insert(0, str(dest))
    return importlib.import_module(name)


def _step(nk: object, name: str, tokens: int) -> Callable[[], None]:
    rng = np.random.default_rng(0)
    cache = nk.make_cache(name, num_layers=1, num_kv_heads=3, head_dim=64)
    k = rng.standard_normal((1, 3, tokens, 64)).astype(np.float32)
    cache.prefill(0, k, k.copy())
    q = rng.standard_normal((1, 9, 1, 64)).astype(np.float32)
    att = nk.AttendConfig(64 ** -0.5, n_kv_groups=3)
    k1 = k[:, :, -1:].copy()

    def run() -> None:
        for _ in range(20):
            cache.decode(0, k1, k1, q, att)
    return run


def _op(nk: object, tokens: int) -> Callable[[], None]:
    rng = np.random.default_rng(1)
    kc, ks = nk.quantize_blocks(rng.standard_normal((1, 8, tokens, 128)).astype(np.float32), 3)
    vc, vs = nk.quantize_blocks(rng.standard_normal((1, 8, tokens, 128)).astype(np.float32), 3)
    q = rng.standard_normal((1, 32, 1, 128)).astype(np.float32)
    return lambda: nk.decode_attention(q, kc, ks, vc, vs, bits=3)


def _paged(nk: object, tokens: int) -> Callable[[], None]:
    rng = np.random.default_rng(2)
    c = nk.PagedKVCache(num_pages=4 * (tokens // 16 + 1), num_layers=1, num_kv_heads=2, head_dim=64,
                        page_size=16, storage="pqo3")
    for _ in range(4):
        x = rng.standard_normal((2, tokens, 64)).astype(np.float32)
        c.append(0, c.allocate_sequence(), x, x.copy())
    q = rng.standard_normal((4, 8, 1, 64)).astype(np.float32)
    return lambda: c.decode_attention(0, q)


def _prefill(nk: object, name: str = "pqo3") -> Callable[[], None]:
    rng = np.random.default_rng(3)
    k = rng.standard_normal((1, 3, 1024, 64)).astype(np.float32)

    def run() -> None:
        cache = nk.make_cache(name, num_layers=1, num_kv_heads=3, head_dim=64)
        cache.prefill(0, k, k)
    return run


CASES: dict[str, tuple[Callable[..., Callable[[], None]], tuple, int]] = {
    # name: (builder, args, calls the timed function stands for)
    **{f"step {n} T={t}": (_step, (n, t), 20) for n in ("dense", "pqo3", "kv4", "kv3", "tq3") for t in (100, 1000)},
    "op 3-bit T=32768": (_op, (32768,), 1),
    "paged pqo3 4x2048": (_paged, (2048,), 1),
    "prefill pqo3 1024": (_prefill, (), 1),
    "prefill kv3 1024": (_prefill, ("kv3",), 1),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rev", required=True, help="git revision of the old library")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("cases", nargs="*", help="substrings of case names (default: all)")
    args = ap.parse_args()
    import numba_kv as new
    from numba_kv.info import provenance_line

    old = load_old(args.rev)
    print(provenance_line())
    print(f"{'case':24s} {'old us':>10s} {'new us':>10s} {'new/old':>8s}")
    rows = {}
    for name, (build, bargs, calls) in CASES.items():
        if args.cases and not any(s in name for s in args.cases):
            continue
        fns = {"old": build(old, *bargs), "new": build(new, *bargs)}
        for f in fns.values():  # compile and warm
            f()
            f()
        times: dict[str, list[float]] = {"old": [], "new": []}
        for r in range(args.rounds):
            for side in (("old", "new") if r % 2 == 0 else ("new", "old")):
                best = float("inf")
                for _ in range(3):
                    t = time.perf_counter()
                    fns[side]()
                    best = min(best, time.perf_counter() - t)
                times[side].append(best / calls * 1e6)
        o, n = statistics.median(times["old"]), statistics.median(times["new"])
        rows[name] = {"old_us": o, "new_us": n, "ratio": n / o}
        print(f"{name:24s} {o:10.1f} {n:10.1f} {n / o:8.2f}", flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"provenance": provenance_line(), "rev": args.rev,
                                                       "cases": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
