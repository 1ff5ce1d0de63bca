"""GPU decode-attention benchmark (``numba-kv bench attention --device cuda``).

One decode step per configuration (``T`` tokens, ``batch`` sequences, ``num_kv_heads`` KV heads
x ``groups`` query heads each, ``head_dim``, 3/4-bit block codes): random K/V are quantized once
on the device (:func:`numba_kv.quantize_blocks` on CuPy arrays), then three paths are timed
with CUDA events (best of ``repeat`` after a warm-up):

* **fused** -- :func:`numba_kv.decode_attention` straight from the packed codes;
* **dense fp16** -- CuPy ``q @ K^T``, softmax, ``@ V`` per KV-head group over float16 K/V
  (float16 storage and GEMM operands, softmax in float32);
* **dequantize-then-attend** -- :func:`numba_kv.dequantize_blocks` of K and V, then the same
  dense attention in float32.

Reported per row: the three times, the fused speedups over both baselines, the largest
absolute difference between the fused and the dequantize-then-attend outputs (both read the
same codes, so it is float32 round-off; a large value flags a kernel fault at that shape), and
the *packed
GB/s* of the fused kernel -- the bytes it must read (codes and scales of K and V for every
token, plus ``q``) per second -- as a percentage of the device's theoretical peak memory
bandwidth (:func:`peak_bandwidth_gbs`).  Every row carries :func:`numba_kv.info.provenance`
and the GPU name.

The timed callables are built by :func:`make_fused`, :func:`make_dense` and
:func:`make_dequant_then_attend`, which take the array namespace as an argument, so the same
code runs on CuPy arrays (the benchmark) and on Numba device arrays / NumPy (the tests, under
``NUMBA_ENABLE_CUDASIM=1``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from numba_kv.info import provenance
from numba_kv.ops.attention import decode_attention
from numba_kv.ops.blockquant import dequantize_blocks, quantize_blocks

CUPY_MISSING = "needs CuPy and a GPU: pip install -e .[cuda]"

DEFAULT_TOKENS = (4096, 16384, 32768, 65536, 131072)
DEFAULT_BATCH = (1, 8, 32)
DEFAULT_BITS = (3, 4)


class CudaBenchUnavailable(RuntimeError):
    """CuPy is not installed or no GPU is visible."""


def require_cupy() -> Any:
    """Import CuPy and check that a GPU is visible.

    Returns
    -------
    cupy : module

    Raises
    ------
    CudaBenchUnavailable
        With the message :data:`CUPY_MISSING` (plus the cause).
    """
    try:
        import cupy  # noqa: PLC0415 - optional dependency (extra "cuda")
    except ImportError as exc:
        raise CudaBenchUnavailable(f"{CUPY_MISSING} ({exc})") from None
    try:
        n = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # noqa: BLE001 - any CUDA runtime error means "no usable GPU"
        raise CudaBenchUnavailable(f"{CUPY_MISSING} (no CUDA device: {exc})") from None
    if n < 1:
        raise CudaBenchUnavailable(f"{CUPY_MISSING} (no CUDA device)")
    return cupy


def packed_bytes(tokens: int, batch: int, bits: int, num_kv_heads: int = 8, groups: int = 4,
                 head_dim: int = 128) -> int:
    """Bytes the fused kernel must read for one decode step.

    Codes (``head_dim·bits/8`` bytes per token and KV head) and binary16 scales (one per
    32-value block, 2 bytes) of K and of V for every token, plus the float32 query
    (``batch·num_kv_heads·groups·head_dim`` values).  The output write is not counted.

    Returns
    -------
    int
    """
    vectors = batch * num_kv_heads * tokens
    per_vector = head_dim * bits // 8 + (head_dim // 32) * 2
    return 2 * vectors * per_vector + batch * num_kv_heads * groups * head_dim * 4


#: ``cudaDevAttrMemoryClockRate`` (kHz) and ``cudaDevAttrGlobalMemoryBusWidth`` (bits) of the
#: CUDA runtime (``CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE`` = 36, ``..._GLOBAL_MEMORY_BUS_WIDTH`` = 37)
ATTR_MEMORY_CLOCK_RATE, ATTR_MEMORY_BUS_WIDTH = 36, 37


def memory_properties(runtime: Any, device: int = 0) -> dict[str, Any]:
    """``name``, ``memoryClockRate`` (kHz) and ``memoryBusWidth`` (bits) of ``device``.

    CUDA 13 removed ``memoryClockRate`` from ``cudaDeviceProp`` (so CuPy's
    :func:`getDeviceProperties` may lack it); it is then read with
    ``cudaDeviceGetAttribute``, which every CUDA version has.
    """
    props = dict(runtime.getDeviceProperties(device))
    for key, attr in (("memoryClockRate", ATTR_MEMORY_CLOCK_RATE), ("memoryBusWidth", ATTR_MEMORY_BUS_WIDTH)):
        if not props.get(key):
            try:
                props[key] = int(runtime.deviceGetAttribute(attr, device))
            except Exception:  # noqa: BLE001 - no such attribute here: the peak stays unknown
                props[key] = 0
    return props


def peak_bandwidth_gbs(props: Mapping[str, Any]) -> float:
    """Theoretical peak memory bandwidth in GB/s (10^9 bytes/s) from device properties
    (:func:`memory_properties`); 0.0 when the device does not report them.

    ``memoryClockRate`` (kHz) x 2 (double data rate) x ``memoryBusWidth`` (bits) / 8.  This
    is the theoretical peak; measured copy bandwidth is lower (typically 85-95 % of it).
    """
    clock_hz = float(props.get("memoryClockRate") or 0) * 1e3
    return clock_hz * 2 * float(props.get("memoryBusWidth") or 0) / 8 / 1e9


def dense_attention(xp: Any, q: Any, k: Any, v: Any, softmax_scale: float) -> Any:
    """Dense decode attention in the namespace ``xp`` (``numpy`` or ``cupy``).

    GEMM operands keep the dtype of ``k``/``v`` (float16 for the fp16 baseline; CuPy's
    float16 matmul accumulates in float32); the softmax is computed in float32.

    Parameters
    ----------
    q : float array, shape ``(batch, num_kv_heads·groups, 1, d)``, same dtype as ``k``
    k, v : float array, shape ``(batch, num_kv_heads, T, d)``

    Returns
    -------
    out : array, shape ``(batch, num_kv_heads·groups, 1, d)``, dtype of ``v``.
    """
    b, hq, _, d = (int(s) for s in q.shape)
    hkv = int(k.shape[1])
    qg = q.reshape(b, hkv, hq // hkv, d)                     # one GEMM per (sequence, KV head)
    s = xp.matmul(qg, xp.swapaxes(k, -1, -2)).astype(xp.float32) * np.float32(softmax_scale)
    s -= s.max(axis=-1, keepdims=True)
    p = xp.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    out = xp.matmul(p.astype(v.dtype), v)
    return out.reshape(b, hq, 1, d)


def make_fused(q: Any, kc: Any, ks: Any, vc: Any, vs: Any, bits: int) -> Callable[[], Any]:
    """Timed callable (a): :func:`numba_kv.decode_attention` from the packed codes.

    ``q`` float32 ``(batch, heads, 1, d)``; codes/scales as from :func:`quantize_kv`, on the
    same device (CuPy or Numba device arrays)."""
    def run() -> Any:
        return decode_attention(q, kc, ks, vc, vs, bits=bits)
    return run


def make_dense(xp: Any, q16: Any, k16: Any, v16: Any) -> Callable[[], Any]:
    """Timed callable (b): :func:`dense_attention` over float16 ``q``/K/V in ``xp``."""
    scale = 1.0 / math.sqrt(int(tuple(q16.shape)[-1]))
    return lambda: dense_attention(xp, q16, k16, v16, scale)


def make_dequant_then_attend(xp: Any, q: Any, kc: Any, ks: Any, vc: Any, vs: Any, bits: int,
                             asarray: Callable[[Any], Any] | None = None) -> Callable[[], Any]:
    """Timed callable (c): :func:`numba_kv.dequantize_blocks` of K and V, then
    :func:`dense_attention` in float32.

    ``asarray`` turns the dequantized arrays and ``q`` into ``xp`` arrays (default
    ``xp.asarray``: zero-copy for CuPy; the tests pass a device-to-host copy with
    ``xp=numpy``)."""
    conv = asarray or xp.asarray
    scale = 1.0 / math.sqrt(int(tuple(q.shape)[-1]))  # tuple: simulator shapes
    qx = conv(q)

    def run() -> Any:
        k = dequantize_blocks(kc, ks, bits)
        v = dequantize_blocks(vc, vs, bits)
        return dense_attention(xp, qx, conv(k), conv(v), scale)
    return run


def time_cuda_ms(cupy: Any, fn: Callable[[], Any], repeat: int, warmup: int = 1) -> float:
    """Best of ``repeat`` CUDA-event timings of ``fn`` (ms) after ``warmup`` untimed calls.

    Events are recorded on CuPy's current stream, and Numba launches its kernels on the
    legacy default stream, which orders them with the events."""
    for _ in range(warmup):
        fn()
    cupy.cuda.runtime.deviceSynchronize()
    best = math.inf
    for _ in range(max(1, repeat)):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, float(cupy.cuda.get_elapsed_time(start, end)))
    return best


@dataclass
class CudaAttentionRow:
    """One configuration of :func:`run_attention_bench_cuda` (times in ms; ``None``: did not
    fit in device memory, see ``note``)."""

    tokens: int
    batch: int
    bits: int
    num_kv_heads: int
    groups: int
    head_dim: int
    fused_ms: float | None
    dense_fp16_ms: float | None
    dequant_ms: float | None
    speedup_vs_dense_fp16: float | None
    speedup_vs_dequant: float | None
    packed_bytes: int
    packed_gb_per_s: float | None
    peak_gb_per_s: float
    pct_of_peak: float | None
    gpu: str
    provenance: dict = field(default_factory=dict)
    note: str = ""
    max_abs_diff_vs_dequant: float | None = None


def make_row(tokens: int, batch: int, bits: int, num_kv_heads: int, groups: int, head_dim: int,
             fused_ms: float | None, dense_ms: float | None, dequant_ms: float | None, peak_gbs: float,
             gpu: str, prov: dict, note: str = "", max_abs_diff: float | None = None) -> CudaAttentionRow:
    """Assemble a row: speedups are baseline time / fused time; packed GB/s is
    :func:`packed_bytes` / fused time; ``max_abs_diff``: max |fused - dequantize-then-attend|."""
    nbytes = packed_bytes(tokens, batch, bits, num_kv_heads, groups, head_dim)
    gbs = nbytes / (fused_ms * 1e-3) / 1e9 if fused_ms else None
    return CudaAttentionRow(
        tokens, batch, bits, num_kv_heads, groups, head_dim, fused_ms, dense_ms, dequant_ms,
        dense_ms / fused_ms if fused_ms and dense_ms else None,
        dequant_ms / fused_ms if fused_ms and dequant_ms else None,
        nbytes, gbs, peak_gbs, 100.0 * gbs / peak_gbs if gbs and peak_gbs else None, gpu, prov, note,
        max_abs_diff)


def gpu_name(props: Mapping[str, Any]) -> str:
    """The ``name`` of CuPy's device properties as text."""
    name = props.get("name", b"unknown GPU")
    return name.decode(errors="replace") if isinstance(name, bytes) else str(name)


def run_attention_bench_cuda(tokens: Sequence[int] = DEFAULT_TOKENS, batch: Sequence[int] = DEFAULT_BATCH,
                             bits: Sequence[int] = DEFAULT_BITS, num_kv_heads: int = 8, groups: int = 4,
                             head_dim: int = 128, repeat: int = 10, seed: int = 0,
                             progress: bool = False) -> list[CudaAttentionRow]:
    """Time fused vs dense fp16 vs dequantize-then-attend decode attention on GPU 0.

    Parameters
    ----------
    tokens, batch, bits : sequences of int
        Every combination is one row.
    num_kv_heads, groups, head_dim : int
        KV heads, query heads per KV head, head dimension (a multiple of 32).
    repeat : int
        CUDA-event timings per path; the best is reported (after one warm-up call).
    seed : int
        Seed of CuPy's generator for K, V and q (standard normal).
    progress : bool
        A progress bar over the (T, batch) configurations.

    Returns
    -------
    rows : list of :class:`CudaAttentionRow`
        A configuration whose arrays do not fit in device memory gets ``None`` times and a
        ``note``.

    Raises
    ------
    CudaBenchUnavailable
        Without CuPy or a GPU.
    """
    cupy = require_cupy()
    props = memory_properties(cupy.cuda.runtime, 0)
    peak, gpu = peak_bandwidth_gbs(props), gpu_name(props)
    prov = provenance() | {"gpu": gpu, "peak_hbm_gb_per_s": f"{peak:.1f}"}
    rng = cupy.random.default_rng(seed)
    rows: list[CudaAttentionRow] = []
    configs = [(t, b) for t in tokens for b in batch]
    for t, b in tqdm(configs, desc="attention-cuda", disable=not progress, leave=False):
        try:
            rows.extend(_bench_one(cupy, rng, int(t), int(b), bits, num_kv_heads, groups, head_dim, repeat,
                                   peak, gpu, prov))
        except cupy.cuda.memory.OutOfMemoryError as exc:
            rows.extend(make_row(int(t), int(b), int(nb), num_kv_heads, groups, head_dim, None, None, None,
                                 peak, gpu, prov, note=f"out of device memory: {exc}") for nb in bits)
        cupy.get_default_memory_pool().free_all_blocks()
    return rows


def _bench_one(cupy: Any, rng: Any, t: int, b: int, bits: Sequence[int], hkv: int, groups: int, d: int,
               repeat: int, peak: float, gpu: str, prov: dict) -> list[CudaAttentionRow]:
    """All bit widths of one (T, batch): K/V made and quantized one sequence at a time (the
    float32 source of one sequence is the only float32 copy alive)."""
    k16 = cupy.empty((b, hkv, t, d), cupy.float16)
    v16 = cupy.empty((b, hkv, t, d), cupy.float16)
    codes = {nb: [cupy.empty((b, hkv, t, d * nb // 8), cupy.uint8) for _ in range(2)]
             + [cupy.empty((b, hkv, t, d // 32), cupy.uint16) for _ in range(2)] for nb in bits}
    for i in range(b):
        for j, dst in ((0, k16), (1, v16)):
            x = rng.standard_normal((hkv, t, d), dtype=cupy.float32)
            dst[i] = x.astype(cupy.float16)
            for nb in bits:
                c, s = quantize_blocks(x, nb)
                codes[nb][j][i] = c
                codes[nb][2 + j][i] = s
            del x
    q = rng.standard_normal((b, hkv * groups, 1, d), dtype=cupy.float32)
    dense_ms = time_cuda_ms(cupy, make_dense(cupy, q.astype(cupy.float16), k16, v16), repeat)
    rows = []
    for nb in bits:
        kc, vc, ks, vs = codes[nb]
        fused = make_fused(q, kc, ks, vc, vs, nb)
        fused_ms = time_cuda_ms(cupy, fused, repeat)
        diff = None
        try:
            deq = make_dequant_then_attend(cupy, q, kc, ks, vc, vs, nb)
            deq_ms = time_cuda_ms(cupy, deq, repeat)
            diff = float(cupy.abs(cupy.asarray(fused()) - deq()).max())
            note = ""
        except cupy.cuda.memory.OutOfMemoryError:
            deq_ms, note = None, "dequantize-then-attend: out of device memory"
        cupy.get_default_memory_pool().free_all_blocks()
        rows.append(make_row(t, b, nb, hkv, groups, d, fused_ms, dense_ms, deq_ms, peak, gpu, prov, note, diff))
    return rows


def rows_as_dicts(rows: Sequence[CudaAttentionRow]) -> list[dict]:
    """JSON-able rows."""
    return [asdict(r) for r in rows]


def render(rows: Sequence[CudaAttentionRow]) -> str:
    """Plain-text table of the rows, labelled with the GPU, peak bandwidth and provenance."""
    if not rows:
        return "no rows\n"
    p = rows[0].provenance
    peak = f"{rows[0].peak_gb_per_s:.0f} GB/s" if rows[0].peak_gb_per_s else "not reported"
    head = (f"GPU decode attention on {rows[0].gpu} (theoretical peak {peak}), "
            f"{rows[0].num_kv_heads} KV heads x {rows[0].groups} groups, d={rows[0].head_dim}; numba "
            f"{p.get('numba', '?')}, host {p.get('cpu_model', '?')}\n")
    cols = ("T", "batch", "bits", "fused ms", "dense fp16 ms", "deq+attend ms", "x dense", "x deq",
            "packed GB/s", "% peak", "max |fused-deq|")

    def f(x: float | None, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    lines = [head, " | ".join(cols)]
    for r in rows:
        lines.append(" | ".join((str(r.tokens), str(r.batch), str(r.bits), f(r.fused_ms, ".3f"),
                                 f(r.dense_fp16_ms, ".3f"), f(r.dequant_ms, ".3f"),
                                 f(r.speedup_vs_dense_fp16, ".2f"), f(r.speedup_vs_dequant, ".2f"),
                                 f(r.packed_gb_per_s, ".1f"), f(r.pct_of_peak, ".1f"),
                                 f(r.max_abs_diff_vs_dequant, ".1e")))
                     + (f"  ({r.note})" if r.note else ""))
    return "\n".join(lines) + "\n"
