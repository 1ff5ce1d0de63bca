"""Where a decode step's GPU time goes, kernel by kernel, and the tensor-core kernel's time
against its partition length (the fit behind ``mma.MERGE_PARTS_PER_SQRT_TOKEN``).

For each cache mode and history length, at batch 1 (8 KV heads × 4 query heads, d = 128,
as ``numba-kv bench decode-step``): every launch of one ``cache.decode`` timed alone (CUDA
events with a device synchronize around it, so each figure is the host's launch time plus
the kernel's GPU time) and, with torch installed, its GPU time alone (the launch repeated
behind a spin kernel that hides the host: ``gpu_mma_check.device_ms``; a repeated window
store slides the window again, which only moves finite values), a
``numba_kv.DecodeStep``'s steps back to back (GPU time and wall time per step), the host
time of each launch with the knob ``cuda_direct_launch`` on and off, and the
step's launches with the partition length forced to 128 … 2048 tokens.  Needs a GPU with
CuPy::

    python benchmarks/gpu_step_kernels.py [--modes pqo3,kv4] [--tokens 4096,32768]

``benchmarks/gpu_check.sh`` runs it (its ``step_kernels.log``).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

from numba_kv import AttendConfig, DecodeStep, _launch, knobs, make_cache
from numba_kv.ops.attention import plan as attention_plan
from numba_kv.ops.attention.mma import MMA_THREADS

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # (run as a script: the package)
from benchmarks.gpu_mma_check import device_ms, running_build  # noqa: E402

SIZES = (128, 256, 512, 1024, 2048)


def launch_times(cupy: Any, fn: Callable[[], Any], gpu_only: bool = False) -> list[tuple[str, str, float, float, Any]]:
    """``(kernel, grid, µs from launch to the end of the kernel, µs the host spent launching,
    GPU µs of the kernel alone or None)`` for each launch of ``fn()``, after two untimed calls
    (compiled, launches prepared); ``gpu_only`` (needs torch): each launch repeated 20 times
    behind a spin kernel (``device_ms``)."""
    for _ in range(2):
        fn()
    orig, times = _launch.launch, []

    def timed(dispatcher: Any, grid: Any, block: Any, args: tuple) -> None:
        e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
        cupy.cuda.runtime.deviceSynchronize()
        e0.record()
        t0 = time.perf_counter()
        orig(dispatcher, grid, block, args)
        t1 = time.perf_counter()
        e1.record()
        e1.synchronize()
        alone = None
        if gpu_only:
            ms, covered = device_ms(cupy, lambda: orig(dispatcher, grid, block, args), 20)
            alone = ms * 1e3 if covered else None
        times.append((dispatcher.py_func.__name__, str(grid), cupy.cuda.get_elapsed_time(e0, e1) * 1e3,
                      (t1 - t0) * 1e6, alone))

    _launch.launch = timed
    try:
        fn()
    finally:
        _launch.launch = orig
    return times


def _us(x: Any) -> str:
    return "n/a" if x is None else f"{x:.1f}"


def bound_step_us(cupy: Any, step: DecodeStep, n: int = 20) -> tuple[float, float]:
    """``(GPU µs, wall µs)`` per step of ``n`` bound steps back to back."""
    for _ in range(8):
        step()
    cupy.cuda.runtime.deviceSynchronize()
    e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
    t0 = time.perf_counter()
    e0.record()
    for _ in range(n):
        step()
    e1.record()
    e1.synchronize()
    return cupy.cuda.get_elapsed_time(e0, e1) * 1e3 / n, (time.perf_counter() - t0) * 1e6 / n


def run(modes: list[str], tokens: list[int], heads: int = 8, groups: int = 4, d: int = 128) -> None:
    import importlib.util  # noqa: PLC0415

    import cupy  # noqa: PLC0415 - a GPU script

    gpu_only = importlib.util.find_spec("torch") is not None  # (device_ms's spin kernel is torch's)

    rng = cupy.random.default_rng(0)
    cfg = AttendConfig(d ** -0.5, groups)
    for mode in modes:
        for t in tokens:
            k = rng.standard_normal((1, heads, t, d), dtype=cupy.float32)
            cache = make_cache(mode, num_layers=1, num_kv_heads=heads, head_dim=d)
            cache.prefill(0, k, k)
            k1 = rng.standard_normal((1, heads, 1, d), dtype=cupy.float32)
            q = rng.standard_normal((1, heads * groups, 1, d), dtype=cupy.float32)
            out = cupy.empty(q.shape, cupy.float32)

            def decode() -> Any:
                return cache.decode(0, k1, k1, q, cfg, out=out)  # noqa: B023 - called in this iteration

            lt = launch_times(cupy, decode, gpu_only)
            print(f"{mode} T={t}: " + "; ".join(f"{n}{g} {us:.1f}us (host {h:.0f}us, GPU alone {_us(a)}us)"
                                                for n, g, us, h, a in lt))
            with knobs(cuda_direct_launch=0):  # the repeats through cuda.core's launch (packs per call)
                core = launch_times(cupy, decode)
            print("   host us per launch, the driver's launch from the packed buffer / cuda.core's: "
                  + "; ".join(f"{n} {h:.0f} / {hc:.0f}" for (n, _, _, h, _), (_, _, _, hc, _) in zip(lt, core)))
            gpu, wall = bound_step_us(cupy, DecodeStep(cache, 0, k1, k1, q, cfg, out=out))
            print(f"   bound steps back to back: GPU {gpu:.1f} us/step, wall {wall:.1f} us/step")
            shipped = attention_plan.mma_partition_size
            compiled = list(running_build().overloads.values())
            resident = compiled[0].max_cooperative_grid_blocks(MMA_THREADS) if compiled else None
            print(f"   shipped partition: {shipped(t, heads, 0, resident)} tokens by the wave model "
                  f"({resident} resident blocks), {shipped(t, heads)} without it")
            for size in SIZES:
                attention_plan.mma_partition_size = lambda *_, s=size: s
                try:
                    lt = launch_times(cupy, decode, gpu_only)
                    att = [(round(us, 1), _us(a)) for n, _, us, _, a in lt if "attention" in n]
                    print(f"   partition {size}: attention (us, GPU alone us) {att}, all launches "
                          f"{sum(x[2] for x in lt):.1f} us")
                except Exception as exc:  # noqa: BLE001 - a size that fails is a line, not a lost run
                    print(f"   partition {size}: {type(exc).__name__}: {exc}")
                finally:
                    attention_plan.mma_partition_size = shipped
            cache = k = None  # (freed before the next history length)
            cupy.get_default_memory_pool().free_all_blocks()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="pqo3,kv4")
    ap.add_argument("--tokens", default="4096,32768")
    a = ap.parse_args(argv)
    run(a.modes.split(","), [int(x) for x in a.tokens.split(",")])


if __name__ == "__main__":
    main()
