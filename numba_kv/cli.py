"""``numba-kv`` command line: ``demo`` (synthetic KV stream), ``bench attention``, ``info``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional


def _demo(args: argparse.Namespace) -> int:
    from .demo import iter_names, render_table, rows_as_dicts, run_demo  # noqa: PLC0415
    from .info import collect  # noqa: PLC0415

    env = collect()
    rows = run_demo(list(iter_names(args.caches)), args.layers, args.kv_heads, args.head_dim, args.tokens,
                    args.chunk, args.seed, progress=not args.no_progress)
    title = (f"synthetic KV stream: {args.layers} layers x {args.kv_heads} KV heads x {args.tokens} tokens, "
             f"d={args.head_dim} ({env['threads']} threads, layer {env['threading_layer']})")
    if args.json:
        json.dump({"config": vars(args) | {"command": "demo"}, "env": env, "rows": rows_as_dicts(rows)},
                  sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    else:
        render_table(rows, title)
    return 0


def _bench(args: argparse.Namespace) -> int:
    from .bench import render_attention, rows_as_dicts, run_attention_bench  # noqa: PLC0415
    from .info import collect  # noqa: PLC0415

    env = collect()
    tokens = [int(t) for t in args.tokens.split(",")]
    bits = [int(b) for b in args.bits.split(",")]
    rows = run_attention_bench(tokens, bits, args.repeat, progress=not args.no_progress)
    if args.json:
        json.dump({"config": vars(args) | {"func": None}, "env": env, "rows": rows_as_dicts(rows)}, sys.stdout,
                  indent=2, default=str)
        sys.stdout.write("\n")
    else:
        render_attention(rows, f"decode attention, batch 1, 8 KV heads, 32 query heads, d=128 "
                               f"({env['threads']} threads, layer {env['threading_layer']})")
    return 0


def _info(args: argparse.Namespace) -> int:
    from .info import main as info_main  # noqa: PLC0415

    info_main()
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``numba-kv``."""
    p = argparse.ArgumentParser(prog="numba-kv", description="numba_kv: compressed KV caches on CPU and CUDA")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="push a synthetic KV stream through several caches and print a table")
    d.add_argument("--synthetic", action="store_true", help="the synthetic stream (the only demo for now)")
    d.add_argument("--caches", default="dense,pq3,pqo3,pqo4", help="comma-separated cache names")
    d.add_argument("--layers", type=int, default=8)
    d.add_argument("--kv-heads", type=int, default=8)
    d.add_argument("--head-dim", type=int, default=128)
    d.add_argument("--tokens", type=int, default=4096)
    d.add_argument("--chunk", type=int, default=512, help="prefill chunk length")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--json", action="store_true", help="print JSON instead of a table")
    d.add_argument("--no-progress", action="store_true")
    d.set_defaults(func=_demo)
    b = sub.add_parser("bench", help="benchmarks: `bench attention` (fused vs dense vs dequantize+attend)")
    b.add_argument("what", choices=["attention"])
    b.add_argument("--tokens", default="1024,4096,16384,32768")
    b.add_argument("--bits", default="3,4")
    b.add_argument("--repeat", type=int, default=5)
    b.add_argument("--json", action="store_true")
    b.add_argument("--no-progress", action="store_true")
    b.set_defaults(func=_bench)
    i = sub.add_parser("info", help="versions, threading layer, CUDA/simulator/NVVM status")
    i.set_defaults(func=_info)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the ``numba-kv`` console script."""
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
