"""GPU check of the tensor-core decode attention (``decode_attention_mma``): accuracy, then speed.

1. **Accuracy** on fresh random K/V (and a window of exact tokens, causal rows; and whole-head
   codes, one norm a token, norms far apart: the flat kernel's token-scale loop): the fused
   output of :func:`numba_kv.decode_attention` on CuPy arrays with the tensor-core kernel,
   the warp kernel (``cuda_mma_attention=0``) and the CPU twin (NumPy, float32), as
   ``‖out − ref‖ / ‖ref‖`` against the CPU twin, for every width pair.
2. **Speed**, best of ``--repeat`` CUDA-event timings, 8 KV heads × 4 query heads, d = 128,
   one query per sequence: the tensor-core kernel, the warp kernel and torch
   ``scaled_dot_product_attention`` on float16 K/V (GQA; the best of the cuDNN and flash
   backends), with the packed bytes per second of the fused kernels, and ``mma api head``:
   the same K/V as whole-head codes through the API (the token-scale loop; ``mma api`` is the
   block-scale loop through the same path).  With ``--old REV``
   (git revisions, comma-separated, each extracted with ``git archive`` as
   ``benchmarks/ab_package.py`` does) or ``--old DIR`` (a folder holding such extracted
   packages named ``numba_kv_ab*``, for a machine without the repository's history), each
   older tensor-core kernel is timed as well, swapped into the same registry entry (the
   argument list must be unchanged): the A/B of old and new kernel builds in one process.
   ``mma no-waves`` is the shipped kernel with the partition rule before the wave model (the
   ``cuda_wave_partitions`` knob off); each line ends with the lengths both rules pick.  A
   ``kv3 codes`` line per shape: the same K/V as ``kv3``'s head VQ codes (4-bit pairs for K,
   2-bit quads for V) on the tensor-core VQ build (``decode_attention_mma_vq``) and on the warp
   kernel's VQ build (``cuda_mma_attention=0``), and their largest difference.  With ``--d64``
   a ``head_dim 64`` line per shape and width: the same shape at head_dim 64 on the
   tensor-core ``decode_attention_mma_d64`` build, on the warp kernel (what such heads ran
   before) and torch SDPA, GPU time too with ``--device-time``.

    python3 benchmarks/gpu_mma_check.py --tokens 32768,131072 --batch 1,8,32 [--old 2937c4b,95990cf]

For a GPU machine that gets the working tree without its git history, extract the old builds
first into a folder of the tree that git does not ignore, and pass that folder (2937c4b: the
first tensor-core build, timed on an H100; 95990cf: the transposed build before its
pair-table reads took OR-ed shared addresses):

    for r in 2937c4b 95990cf; do mkdir -p ab_old/$r && git archive $r numba_kv | tar -x -C ab_old/$r \
        && mv ab_old/$r/numba_kv ab_old/numba_kv_ab_$r && rmdir ab_old/$r; done
    OLD=ab_old bash benchmarks/gpu_check.sh OUTDIR
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import pathlib
import sys
import time

import numpy as np
from numba import cuda

from numba_kv import knobs
from numba_kv.info import provenance_line
from numba_kv.ops import TWINS
from numba_kv.ops.attention import CodeLayout, decode_attention, fused_attention_rows
from numba_kv.ops.attention.mma import MMA_THREADS, mma_partition_size
from numba_kv.ops.blockquant import quantize_blocks
from numba_kv.ops.codebook import get_codebook
from numba_kv.ops.hadamard import rotate32
from numba_kv.ops.headquant import head_signs, quantize_head, rotate_head
from numba_kv.ops.headvq import quantize_headvq
from numba_kv.toolkit.bench_cuda import packed_bytes, require_cupy, time_cuda_ms


def rel(a, b) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def accuracy(cupy) -> None:
    rng = np.random.default_rng(int(time.time()))
    print("accuracy vs the CPU twin (rel. L2 error)", flush=True)
    for kb, vb in ((3, 3), (4, 4), (2, 2), (3, 2), (4, 3), (2, 4)):
        for T, n_exact, ql in ((1, 0, 1), (37, 0, 1), (1000, 0, 1), (20000, 64, 1), (3000, 16, 2)):
            b, hkv, G, d = 2, 3, 4, 128
            k = (rng.standard_normal((b, hkv, T, d)) * rng.uniform(0.1, 20)).astype(np.float32)
            v = rng.standard_normal((b, hkv, T, d)).astype(np.float32)
            kc, ks = quantize_blocks(k, kb)
            vc, vs = quantize_blocks(v, vb)
            q = rng.standard_normal((b, hkv * G, ql, d)).astype(np.float32)
            kw = {"k_bits": kb, "v_bits": vb}
            if n_exact:
                kw["k_exact"] = rng.standard_normal((b, hkv, n_exact, d)).astype(np.float32)
                kw["v_exact"] = rng.standard_normal((b, hkv, n_exact, d)).astype(np.float32)
            ref = decode_attention(q, kc, ks, vc, vs, **kw)
            dev = [cupy.asarray(a) for a in (q, kc, ks, vc, vs)]
            dkw = {n: (cupy.asarray(a) if isinstance(a, np.ndarray) else a) for n, a in kw.items()}
            mma = cupy.asnumpy(decode_attention(*dev, **dkw))
            with knobs(cuda_mma_attention=0):
                warp = cupy.asnumpy(decode_attention(*dev, **dkw))
            print(f"  K{kb}V{vb} T={T} exact={n_exact} q_len={ql}: mma {rel(mma, ref):.2e}  warp {rel(warp, ref):.2e}"
                  f"  finite={bool(np.isfinite(mma).all())}", flush=True)
    # whole-head codes (one norm a token: the flat kernel's token-scale loop), norms far apart
    for kb, vb in ((4, 3), (3, 3), (2, 4)):
        for T in (37, 1000, 20000):
            b, hkv, G, d = 2, 3, 4, 128
            spread = np.exp(rng.uniform(-3.0, 3.0, (b, hkv, T, 1))).astype(np.float32)
            kc, kn = quantize_head((rng.standard_normal((b, hkv, T, d)) * spread).astype(np.float32), kb)
            vc, vn = quantize_head((rng.standard_normal((b, hkv, T, d)) * spread).astype(np.float32), vb)
            q = (rng.standard_normal((b, hkv * G, 1, d)) * 0.05).astype(np.float32)
            kw = {"k_bits": kb, "v_bits": vb, "rotation": "head"}
            ref = decode_attention(q, kc, kn, vc, vn, **kw)
            dev = [cupy.asarray(a) for a in (q, kc, kn, vc, vn)]
            mma = cupy.asnumpy(decode_attention(*dev, **kw))
            with knobs(cuda_mma_attention=0):
                warp = cupy.asnumpy(decode_attention(*dev, **kw))
            print(f"  head K{kb}V{vb} T={T}: mma {rel(mma, ref):.2e}  warp {rel(warp, ref):.2e}"
                  f"  finite={bool(np.isfinite(mma).all())}", flush=True)


def torch_sdpa(cupy, q, k16, v16, repeat, device_time=False):
    """Best-backend torch SDPA over float16 K/V ``[b, hkv, T, d]`` (GQA): ``(ms, backend, fn)``,
    with ``device_time`` ``(ms, backend, device ms)`` (:func:`device_ms`)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    tq = torch.from_dlpack(q.astype(cupy.float16))
    tk = torch.from_dlpack(k16)
    tv = torch.from_dlpack(v16)
    best = None
    for be in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        def fn(be=be):
            with sdpa_kernel(be):
                return sdpa(tq, tk, tv, enable_gqa=True)
        try:
            fn()
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - a backend that does not take the shape
            print(f"    torch {be.name}: {type(exc).__name__}", flush=True)
            continue
        ms = time_cuda_ms(cupy, fn, repeat)
        if best is None or ms < best[0]:
            best = (ms, be.name, fn)
    if best is not None and device_time:
        best = (best[0], best[1], device_ms(cupy, best[2], repeat)[0])
    return best


def device_ms(cupy, fn, repeat: int) -> tuple[float, bool]:
    """GPU time per call of ``fn`` with the host's launch cost hidden: ``(ms, covered)``.

    The stream first runs a spin kernel (``torch.cuda._sleep``) longer than the host takes to
    enqueue ``repeat`` calls, then CUDA events bracket those calls: the events then time the
    kernels back to back, not the host (Numba, CuPy and torch's default streams are the same
    legacy stream, so the spin, the events and the launches are ordered).  ``covered``: the
    enqueue ended before the spin did (else the figure includes host time)."""
    import torch

    fn()
    cupy.cuda.runtime.deviceSynchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        fn()
    host_s = (time.perf_counter() - t0) / 3
    cupy.cuda.runtime.deviceSynchronize()
    spin_s = 2.0 * host_s * repeat + 2e-3
    clock_hz = cupy.cuda.runtime.getDeviceProperties(0)["clockRate"] * 1e3
    torch.cuda._sleep(int(spin_s * clock_hz))
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    t0 = time.perf_counter()
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    enqueue_s = time.perf_counter() - t0
    end.synchronize()
    return float(cupy.cuda.get_elapsed_time(start, end)) / repeat, enqueue_s < 0.8 * spin_s


def kernel_path(cupy, q, kc, ks, vc, vs, nb):
    """The partition kernel and the merge alone (``fused_attention_rows`` on prepared
    arguments: no validation, no host synchronization), as a model's decode step runs them."""
    b, hq, _, d = q.shape
    hkv, T = kc.shape[1], kc.shape[2]
    g, rows = b * hkv, hq // hkv
    q3 = q.reshape(g, rows, d)
    qr = rotate32(q3)
    lay = CodeLayout.uniform(get_codebook(nb, "maxnorm"), d)
    kc3, vc3 = kc.reshape(g, T, -1), vc.reshape(g, T, -1)
    ks3, vs3 = ks.reshape(g, T, -1), vs.reshape(g, T, -1)
    empty = cupy.zeros((g, 0, d), cupy.float32)
    epos = cupy.zeros(1, cupy.int32)
    return lambda: fused_attention_rows(qr, q3, kc3, ks3, vc3, vs3, T, 0, empty, empty, 0, epos, lay, lay, d ** -0.5,
                                        None, T - 1, 1, True)


def vq_path(cupy, q, k, v):
    """``kv3``'s codes of ``k``, ``v`` (head VQ: 4-bit pairs for K, 2-bit quads for V, unbiased)
    through the kernel path (``fused_attention_rows``): the tensor-core VQ build
    (``decode_attention_mma_vq``), or with ``cuda_mma_attention=0`` the warp kernel's VQ build."""
    b, hq, _, d = q.shape
    hkv, T = k.shape[1], k.shape[2]
    g, rows = b * hkv, hq // hkv
    kc, kn = quantize_headvq(k, 4, unbiased=True)
    vc, vn = quantize_headvq(v, 2, unbiased=True)
    q3 = q.reshape(g, rows, d)
    qr = rotate_head(q3)
    kc3, vc3, kn3, vn3 = (a.reshape(g, T, -1) for a in (kc, vc, kn, vn))
    empty = cupy.zeros((g, 0, d), cupy.float32)
    epos = cupy.zeros(1, cupy.int32)
    signs = cupy.asarray(head_signs(d))
    klay, vlay = CodeLayout.head_vq(4, d), CodeLayout.head_vq(2, d)
    return lambda: fused_attention_rows(qr, q3, kc3, kn3, vc3, vn3, T, 0, empty, empty, 0, epos, klay, vlay,
                                        d ** -0.5, None, T - 1, 1, True, head_signs=signs)


#: the default build (launch bounds of 2 blocks an SM; a GPU of a capability with a build of its
#: own, sm_90's of 4 blocks, runs that one: ``Twin.build_for``)
SHIPPED = TWINS["decode_attention_mma"].cuda
#: other builds of the same source for the A/B in one process, each swapped in as the only
#: build: the default one (2 blocks an SM, what sm_90 ran before its build of 4) and 3 blocks
#: (5-18 % faster than 2 at batch >= 8 on an H100, spills on sm_80); with --device-time each
#: is also timed with the host hidden
VARIANTS = {"mma lb(128,2)": SHIPPED, "mma lb(128,3)": cuda.jit(SHIPPED.py_func, launch_bounds=(128, 3))}


def running_build() -> object:
    """The build of ``decode_attention_mma`` this GPU runs (its compute capability's)."""
    return TWINS["decode_attention_mma"].build_for(tuple(cuda.get_current_device().compute_capability))


#: the shipped kernel with the partition rule before the wave model (the ``cuda_wave_partitions``
#: knob off: about 3,200 warps; ``mma.mma_partition_size``)
NO_WAVES = "mma no-waves"


def partition_note(tokens: int, rows: int) -> str:
    """The partition lengths of both rules at these shapes, with the shipped kernel's resident
    blocks (the driver's occupancy of its compiled overload times the SMs)."""
    compiled = list(running_build().overloads.values())
    resident = compiled[0].max_cooperative_grid_blocks(MMA_THREADS) if compiled else None
    return (f"partitions: waves {mma_partition_size(tokens, rows, 0, resident)} tokens ({resident} resident blocks), "
            f"no-waves {mma_partition_size(tokens, rows)}")


def load_old_kernels(old: str) -> dict:
    """``{label: decode_attention_mma CUDA kernel}`` of other builds: ``old`` is a folder that
    holds extracted packages named ``numba_kv_ab*`` (each labelled by its name), or git
    revisions to extract, comma-separated (each labelled by its revision)."""
    folder = pathlib.Path(old)
    if folder.is_dir():
        names = sorted(p.name for p in folder.glob("numba_kv_ab*") if (p / "__init__.py").exists())
        if not names:
            raise SystemExit(f"--old {old}: no numba_kv_ab* package in that folder")
        sys.path.insert(0, str(folder))
        packages = {name: importlib.import_module(name) for name in names}
    else:
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
        from ab_package import load_old

        packages = {rev: load_old(rev, f"numba_kv_ab_{rev}") for rev in old.split(",")}
    return {f"mma {label}": nk.ops.TWINS["decode_attention_mma"].cuda for label, nk in packages.items()}


def d64_line(cupy, t: int, b: int, nb: int, repeat: int, device_time: bool) -> None:
    """One shape at head_dim 64 (8 KV heads × 4 query heads, ``nb``-bit block codes): the
    tensor-core ``*_d64`` build and the warp kernel through the kernel path, and torch SDPA."""
    hkv, groups, d = 8, 4, 64
    rng = cupy.random.default_rng(1)
    q = rng.standard_normal((b, hkv * groups, 1, d), dtype=cupy.float32)
    k = rng.standard_normal((b, hkv, t, d), dtype=cupy.float32)
    v = rng.standard_normal((b, hkv, t, d), dtype=cupy.float32)
    ref = None
    try:
        ref = torch_sdpa(cupy, q, k.astype(cupy.float16), v.astype(cupy.float16), repeat, device_time)
    except ImportError:
        pass
    kc, ks = quantize_blocks(k, nb)
    vc, vs = quantize_blocks(v, nb)
    cols, outs = [], {}
    for name, knob in (("mma d64", 1), ("warp d64", 0)):
        with knobs(cuda_mma_attention=knob):
            fn = kernel_path(cupy, q, kc, ks, vc, vs, nb)
            outs[name] = fn()
            ms = time_cuda_ms(cupy, fn, repeat)
            cols.append(f"{name} {ms:.3f} ms" + (f" x{ref[0] / ms:.2f}" if ref else ""))
            if device_time:
                dev_ms, ok = device_ms(cupy, fn, repeat)
                x = f" x{ref[2] / dev_ms:.2f}" if ref and len(ref) > 2 else ""
                cols.append(f"{name} device {dev_ms:.3f} ms{x}{'' if ok else ' (host not hidden)'}")
    tline = f"torch {ref[1]} {ref[0]:.3f} ms" + (f" (device {ref[2]:.3f} ms)" if ref and device_time else "") \
        if ref else "torch -"
    diff = float(cupy.abs(outs["mma d64"] - outs["warp d64"]).max())
    print(f"  T={t} batch={b} bits={nb} head_dim 64: " + "  ".join(cols) + f"  {tline}  max|mma-warp|={diff:.1e}",
          flush=True)
    del q, k, v, kc, ks, vc, vs, outs
    cupy.get_default_memory_pool().free_all_blocks()


def speed(cupy, tokens, batches, bits, repeat, device_time=False, vq_max_tokens=32768, d64=False) -> None:
    hkv, groups, d = 8, 4, 128
    rng = cupy.random.default_rng(0)
    print("speed (ms, best of repeats; GB/s = packed bytes read; xN = torch ms / ms)", flush=True)
    for t in tokens:
        for b in batches:
            q = rng.standard_normal((b, hkv * groups, 1, d), dtype=cupy.float32)
            k = rng.standard_normal((b, hkv, t, d), dtype=cupy.float32)
            v = rng.standard_normal((b, hkv, t, d), dtype=cupy.float32)
            ref = None
            try:
                k16, v16 = k.astype(cupy.float16), v.astype(cupy.float16)
                ref = torch_sdpa(cupy, q, k16, v16, repeat, device_time)
                del k16, v16
            except ImportError:
                pass
            tline = f"torch {ref[1]} {ref[0]:.3f} ms" if ref else "torch -"
            if ref and device_time:
                tline += f" (device {ref[2]:.3f} ms)"
            for nb in bits:
                kc, ks = quantize_blocks(k, nb)
                vc, vs = quantize_blocks(v, nb)
                gb = packed_bytes(t, b, nb, hkv, groups, d) / 1e9
                cols = []
                outs = {}
                for name, knob, api in (("mma", 1, False), *((v, 1, False) for v in VARIANTS), (NO_WAVES, 1, False),
                                        ("warp", 0, False), ("mma api", 1, True)):
                    twin = TWINS["decode_attention_mma"]
                    builds = twin.cuda_cc
                    if name in VARIANTS:  # (the only build while it is timed)
                        object.__setattr__(twin, "cuda", VARIANTS[name])
                        object.__setattr__(twin, "cuda_cc", ())
                    with knobs(cuda_mma_attention=knob, cuda_wave_partitions=int(name != NO_WAVES)):
                        if api:
                            fn = functools.partial(decode_attention, q, kc, ks, vc, vs, bits=nb)
                        else:
                            fn = kernel_path(cupy, q, kc, ks, vc, vs, nb)
                        outs[name] = fn().reshape(b, hkv * groups, 1, d)
                        ms = time_cuda_ms(cupy, fn, repeat)
                        timed_alone = name in VARIANTS or name == NO_WAVES
                        dev = device_ms(cupy, fn, repeat) if device_time and timed_alone else None
                    object.__setattr__(twin, "cuda", SHIPPED)
                    object.__setattr__(twin, "cuda_cc", builds)
                    x = f" x{ref[0] / ms:.2f}" if ref else ""
                    cols.append(f"{name} {ms:.3f} ms ({gb / (ms * 1e-3):.0f} GB/s{x})")
                    if dev is not None:  # a variant's GPU time, next to the shipped "mma device" below
                        x = f" x{ref[2] / dev[0]:.2f}" if ref and len(ref) > 2 else ""
                        cols.append(f"{name} device {dev[0]:.3f} ms{x}{'' if dev[1] else ' (host not hidden)'}")
                    err = float(cupy.abs(outs[name] - outs["mma"]).max())
                    if timed_alone and not err <= 1e-3:  # (the same arithmetic: other registers or partitions)
                        cols.append(f"{name} DIFFERS from mma by {err:.1e}")
                if device_time:
                    # the same kernel path and torch's SDPA, host launch cost hidden on both sides
                    dev_ms, ok = device_ms(cupy, kernel_path(cupy, q, kc, ks, vc, vs, nb), repeat)
                    x = f" x{ref[2] / dev_ms:.2f}" if ref and len(ref) > 2 else ""
                    cols.append(f"mma device {dev_ms:.3f} ms ({gb / (dev_ms * 1e-3):.0f} GB/s{x}"
                                f"{'' if ok else ', host not hidden'})")
                # whole-head codes of the same K/V through the API (the token-scale loop; "mma api"
                # is the block-scale loop through the same path)
                kch, knh = quantize_head(k, nb)
                vch, vnh = quantize_head(v, nb)
                head = functools.partial(decode_attention, q, kch, knh, vch, vnh, bits=nb, rotation="head")
                head()
                cols.append(f"mma api head {time_cuda_ms(cupy, head, repeat):.3f} ms")
                del kch, knh, vch, vnh
                cols.append(partition_note(t, b * hkv))
                diff = float(cupy.abs(outs["mma"] - outs["warp"]).max())
                print(f"  T={t} batch={b} bits={nb}: " + "  ".join(cols) + f"  {tline}  max|mma-warp|={diff:.1e}",
                      flush=True)
                del kc, ks, vc, vs, outs
            # kv3's codes (3.0 bits a value in codes: 4-bit pairs, 2-bit quads) on the tensor-core VQ
            # build and on the warp VQ build (the A/B), same K/V, up to --kv3-max-tokens
            cols = []
            vq_outs = {}
            for name, knob in (("mma vq", 1), ("warp vq", 0)) if t <= vq_max_tokens else ():
                with knobs(cuda_mma_attention=knob):
                    fn = vq_path(cupy, q, k, v)
                    vq_outs[name] = fn()
                    ms = time_cuda_ms(cupy, fn, repeat)
                    x = f" x{ref[0] / ms:.2f}" if ref else ""
                    cols.append(f"{name} {ms:.3f} ms{x}")
                    if device_time:
                        dev_ms, ok = device_ms(cupy, fn, repeat)
                        x = f" x{ref[2] / dev_ms:.2f}" if ref and len(ref) > 2 else ""
                        cols.append(f"{name} device {dev_ms:.3f} ms{x}{'' if ok else ' (host not hidden)'}")
            if vq_outs:
                diff = float(cupy.abs(vq_outs["mma vq"] - vq_outs["warp vq"]).max())
                print(f"  T={t} batch={b} kv3 codes: " + "  ".join(cols) + f"  {tline}  max|mma vq-warp vq|={diff:.1e}",
                      flush=True)
            del vq_outs
            del k, v, q
            cupy.get_default_memory_pool().free_all_blocks()
            for nb in bits if d64 else ():
                d64_line(cupy, t, b, nb, repeat, device_time)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="32768,131072")
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--bits", default="3,4")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--skip-accuracy", action="store_true")
    ap.add_argument("--kv3-max-tokens", type=int, default=32768, help="time kv3's codes at T up to this (0: never)")
    ap.add_argument("--device-time", action="store_true", help="also time the kernel path and torch with the host's "
                    "launch cost hidden behind a spin kernel (GPU time back to back)")
    ap.add_argument("--d64", action="store_true", help="also time each shape at head_dim 64 (the *_d64 build, the "
                    "warp kernel, torch)")
    ap.add_argument("--old", default=None, help="git revisions (comma-separated) or a folder of numba_kv_ab* packages: "
                    "time their mma kernels too")
    args = ap.parse_args()
    if args.old:
        VARIANTS.update(load_old_kernels(args.old))
    cupy = require_cupy()
    print(provenance_line(), flush=True)
    if args.device_time and importlib.util.find_spec("torch") is None:
        print("--device-time: torch is not installed (its spin kernel hides the host): per-call timings only",
              flush=True)
        args.device_time = False
    if not args.skip_accuracy:
        accuracy(cupy)
    speed(cupy, [int(x) for x in args.tokens.split(",")], [int(x) for x in args.batch.split(",")],
          [int(x) for x in args.bits.split(",")], args.repeat, args.device_time, args.kv3_max_tokens, args.d64)
    for name, kern in (("decode_attention_mma (this GPU's build)", running_build()), *VARIANTS.items(),
                       ("decode_attention_warp", TWINS["decode_attention_warp"].cuda)):
        try:
            print(name, "registers", list(kern.get_regs_per_thread().values()))
        except Exception as exc:  # noqa: BLE001 - report, do not fail the run
            print(name, "registers unavailable", exc)


if __name__ == "__main__":
    main()
