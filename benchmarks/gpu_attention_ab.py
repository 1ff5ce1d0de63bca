"""GPU A/B of the fused decode attention kernels, and the measured copy bandwidth.

Times :func:`numba_kv.decode_attention` (3/4-bit block codes, 8 KV heads x 4 groups,
d = 128) with each CUDA kernel, alternating, best of ``--repeat`` CUDA-event timings per
round:

* ``block``: the block-per-(KV row, partition) kernel (``cuda_warp_attention=0``), compiled
  with its launch bounds (256, 2), and with ``--block-unbounded`` also without them;
* ``warp``: the warp-per-partition kernel (the default), as shipped (no launch bounds) and
  compiled with launch bounds (256, 2) (128 registers: 4 blocks of 128 threads per SM).

The tensor-core kernel is switched off here (``cuda_mma_attention=0``; its own A/B against the
warp kernel and torch is ``benchmarks/gpu_mma_check.py``).  Variants are swapped into the op
registry (the entries are frozen dataclasses).  Every variant's output is compared with the
shipped warp kernel's.  It also times a device-to-device copy with CuPy (bytes read + written
per second): the bandwidth a memory-bound kernel can reach in practice, next to the theoretical
peak that ``numba-kv bench attention --device cuda`` reports.

    python3 benchmarks/gpu_attention_ab.py --tokens 131072 --batch 8,32
"""

import argparse

from numba import cuda

from numba_kv import knobs
from numba_kv.info import provenance_line
from numba_kv.ops import TWINS
from numba_kv.ops.blockquant import quantize_blocks
from numba_kv.toolkit.bench_cuda import make_fused, packed_bytes, require_cupy, time_cuda_ms


def copy_gbs(cupy, nbytes: int = 4 << 30, repeat: int = 10) -> float:
    """Device-to-device copy of ``nbytes``: (read + written bytes) / best time, GB/s."""
    a = cupy.ones(nbytes // 4, cupy.float32)
    b = cupy.empty_like(a)
    ms = time_cuda_ms(cupy, lambda: b.__setitem__(Ellipsis, a), repeat)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def variants(block_unbounded: bool = False):
    """``name -> (twin name, kernel, cuda_warp_attention knob)``."""
    blk, wrp = TWINS["decode_attention"], TWINS["decode_attention_warp"]
    out = {
        "warp": ("decode_attention_warp", wrp.cuda, 1),
        "warp bounds(256,2)": ("decode_attention_warp", cuda.jit(wrp.cuda.py_func, launch_bounds=(256, 2)), 1),
        "block bounds(256,2)": ("decode_attention", blk.cuda, 0),
    }
    if block_unbounded:
        out["block no bounds"] = ("decode_attention", cuda.jit(blk.cuda.py_func), 0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="131072")
    ap.add_argument("--batch", default="8,32")
    ap.add_argument("--bits", default="3,4")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--block-unbounded", action="store_true")
    args = ap.parse_args()
    cupy = require_cupy()
    print(provenance_line())
    print(f"device-to-device copy: {copy_gbs(cupy):.0f} GB/s (read + written)", flush=True)
    var = variants(args.block_unbounded)
    shipped = {n: TWINS[n].cuda for n in ("decode_attention", "decode_attention_warp")}
    hkv, groups, d = 8, 4, 128
    rng = cupy.random.default_rng(0)
    for t in (int(x) for x in args.tokens.split(",")):
        for b in (int(x) for x in args.batch.split(",")):
            q = rng.standard_normal((b, hkv * groups, 1, d), dtype=cupy.float32)
            for nb in (int(x) for x in args.bits.split(",")):
                k = rng.standard_normal((b, hkv, t, d), dtype=cupy.float32)
                kc, ks = quantize_blocks(k, nb)
                vc, vs = quantize_blocks(k * 0.5, nb)
                del k
                best, outs = {}, {}
                for _ in range(args.rounds):
                    for name, (twin, kern, knob) in var.items():
                        object.__setattr__(TWINS[twin], "cuda", kern)
                        with knobs(cuda_warp_attention=knob, cuda_mma_attention=0):
                            fn = make_fused(q, kc, ks, vc, vs, nb)
                            best[name] = min(best.get(name, 1e30), time_cuda_ms(cupy, fn, args.repeat))
                            outs[name] = cupy.asarray(fn())
                        object.__setattr__(TWINS[twin], "cuda", shipped[twin])
                gb = packed_bytes(t, b, nb, hkv, groups, d) / 1e9
                diff = max(float(cupy.abs(o - outs["warp"]).max()) for o in outs.values())
                cols = "  ".join(f"{n}: {ms:.3f} ms {gb / (ms * 1e-3):.0f} GB/s" for n, ms in best.items())
                print(f"T={t} batch={b} bits={nb}  {cols}  max|diff|={diff:.1e}", flush=True)
                cupy.get_default_memory_pool().free_all_blocks()
    for name, (_, kern, _) in var.items():
        try:
            regs = list(kern.get_regs_per_thread().values())
        except Exception as exc:  # noqa: BLE001 - report, do not fail the run
            regs = f"unavailable ({exc})"
        print(f"{name}: registers per thread {regs}")


if __name__ == "__main__":
    main()
