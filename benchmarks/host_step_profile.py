"""The host side of a decode step replayed as a CUDA graph, without a GPU (issue 27 item 3).

On a GPU a steady ``cache.decode`` through a :class:`numba_kv.StepGraph` is one graph launch
plus the step's Python: validation, bookkeeping, the launches' recording and matching. This
script measures that Python in Numba's CUDA simulator, where the device arrays are NumPy
underneath: it warms a one-layer cache up on device arrays until its steps replay, then turns
the simulator's graph replay into a no-op (the kernels' work is the GPU's, not the host's) and
times ``--steps`` steps, with a ``cProfile`` of the replayed ones among ``--steps`` more by
default.

    NUMBA_ENABLE_CUDASIM=1 .venv/bin/python benchmarks/host_step_profile.py [--modes kv4,pqo3]
        [--steps 300] [--top 25] [--no-profile]

The simulator's arrays cost less to touch than CuPy's, and its launch recording takes the
simulator's branch, so the figure is a floor of the GPU host's, on this CPU: what the step's
own Python costs. The step's state stops advancing (the graph does not run), which a steady
step does not notice: its launches read the step state on the device.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
    sys.exit("run with NUMBA_ENABLE_CUDASIM=1 (the simulator stands in for the GPU)")

import numpy as np  # noqa: E402
from numba import cuda  # noqa: E402

from numba_kv import AttendConfig, DecodeStep, StepGraph, _graph, make_cache  # noqa: E402
from numba_kv.info import provenance_line  # noqa: E402


def steady(mode: str, h: int, g: int, d: int, bound: bool = False) -> tuple:
    """A one-layer ``mode`` cache on device arrays whose steps replay: ``(graph, step)``;
    ``bound``: the step a :class:`numba_kv.DecodeStep` whose steps skip their Python."""
    rng = np.random.default_rng(0)
    cache = make_cache(mode, num_layers=1, num_kv_heads=h, head_dim=d)
    t0 = cache.config.sink_tokens + cache.config.residual_length + 3
    k = rng.standard_normal((1, h, t0, d)).astype(np.float32)
    cache.prefill(0, cuda.to_device(k), cuda.to_device(k[:, :, ::-1].copy()))
    bufs = [cuda.to_device(rng.standard_normal(s).astype(np.float32)) for s in ((1, h, 1, d), (1, h, 1, d))]
    q = cuda.to_device(rng.standard_normal((1, h * g, 1, d)).astype(np.float32))
    out = cuda.to_device(np.zeros((1, h * g, 1, d), np.float32))
    attend = AttendConfig(d ** -0.5, n_kv_groups=g)
    if bound:
        step = DecodeStep(cache, 0, bufs[0], bufs[1], q, attend, out=out)
        graph = step.graph
    else:
        graph = StepGraph()

        def step():
            return graph.run(cache.decode, 0, bufs[0], bufs[1], q, attend, out=out)

    for _ in range(6):
        step()
    st = graph.stats()
    if st["bound" if bound else "replayed"] < 1:
        raise SystemExit(f"{mode}: steps do not {'skip their Python' if bound else 'replay'} in the simulator ({st})")
    return graph, step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="kv4,pqo3")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--bound", action="store_true",
                    help="steps through a numba_kv.DecodeStep (replayed steps skip their Python)")
    ap.add_argument("--sort", default="tottime", help="pstats sort key (tottime, cumulative, ...)")
    args = ap.parse_args()
    print(provenance_line(), flush=True)
    for mode in args.modes.split(","):
        graph, step = steady(mode, args.kv_heads, args.groups, args.head_dim, args.bound)
        _graph._SimGraph.launch = lambda self, stream: None  # noqa: SLF001 - the GPU's work, not the host's
        counted = "bound" if args.bound else "replayed"
        times = []
        for _ in range(args.steps):  # each step timed: a step that grows the buffers runs the simulator's kernels
            before = graph.stats()[counted]
            t0 = time.perf_counter()
            step()
            dt = time.perf_counter() - t0
            if graph.stats()[counted] > before:
                times.append(dt)
        us, med = float(np.mean(times)) * 1e6, float(np.median(times)) * 1e6
        print(f"{mode}{' (DecodeStep)' if args.bound else ''}: {us:.1f} us of host time per {counted} step "
              f"(median {med:.1f}; {len(times)}/{args.steps} {counted})", flush=True)
        if not args.no_profile:
            # one profile per step, kept when the step replayed (a step that grows the buffers
            # or recaptures runs the simulator's kernels, which are no host cost on a GPU)
            stats = None
            for _ in range(args.steps):
                before = graph.stats()[counted]
                prof = cProfile.Profile()
                prof.enable()
                step()
                prof.disable()
                if graph.stats()[counted] > before:
                    stats = pstats.Stats(prof) if stats is None else stats.add(prof)
            if stats is not None:
                stats.sort_stats(args.sort).print_stats(args.top)


if __name__ == "__main__":
    main()
