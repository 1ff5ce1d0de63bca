"""GPU decode-attention benchmark (``numba-kv bench attention --device cuda``).

One decode step per configuration (``T`` tokens, ``batch`` sequences, ``num_kv_heads`` KV heads
x ``groups`` query heads each, ``head_dim``, 3/4-bit block codes): random K/V are quantized once
on the device (:func:`numba_kv.quantize_blocks` on CuPy arrays), then four paths are timed
with CUDA events (best of ``repeat`` after a warm-up):

* **fused** -- :func:`numba_kv.decode_attention` straight from the packed codes;
* **torch SDPA** (the honest dense baseline, when PyTorch with CUDA is importable) --
  ``torch.nn.functional.scaled_dot_product_attention`` over the same float16 q/K/V (CuPy
  arrays shared with torch through DLPack, no copy), GQA with ``enable_gqa=True`` (torch >= 2.5;
  older versions get K/V expanded to the query heads), timed under
  ``torch.nn.attention.sdpa_kernel`` with the cuDNN and with the flash backend; the faster one
  is reported and named (a backend that refuses the shape is skipped);
* **CuPy dense fp16** -- CuPy ``q @ K^T``, softmax, ``@ V`` per KV-head group over float16 K/V
  (float16 storage and GEMM operands, softmax in float32);
* **dequantize-then-attend** -- :func:`numba_kv.dequantize_blocks` of K and V, then the same
  dense attention in float32.

Reported per row: the four times, the fused speedups over the three baselines, the largest
absolute difference between the fused and the dequantize-then-attend outputs (both read the
same codes, so it is float32 round-off; a large value flags a kernel fault at that shape), the
largest difference between the fused and the torch outputs (this one includes the 3/4-bit
quantization error: a sanity check of the order of 0.1, not round-off), and the *packed
GB/s* of the fused kernel -- the bytes it must read (codes and scales of K and V for every
token, plus ``q``) per second -- as a percentage of the device's theoretical peak memory
bandwidth (:func:`peak_bandwidth_gbs`).  Every row carries :func:`numba_kv.info.provenance`
and the GPU name.

The timed callables are built by :func:`make_fused`, :func:`make_dense` and
:func:`make_dequant_then_attend`, which take the array namespace as an argument, so the same
code runs on CuPy arrays (the benchmark) and on Numba device arrays / NumPy (the tests, under
``NUMBA_ENABLE_CUDASIM=1``).  The torch helpers (:func:`import_torch`, :func:`make_sdpa`,
:func:`fastest_sdpa`) are shared with :mod:`numba_kv.toolkit.bench_step`.
"""

from __future__ import annotations

import contextlib
import math
import re
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from importlib.metadata import version
from typing import Any, TypeVar

import numpy as np

from numba_kv.info import provenance
from numba_kv.ops.attention import decode_attention
from numba_kv.ops.blockquant import dequantize_blocks, quantize_blocks

from .progress import progress_bar

CUPY_MISSING = "needs CuPy and a GPU: pip install -e .[cuda]"
#: torch SDPA backends of the dense baseline, tried in this order; the fastest is reported
TORCH_BACKENDS = ("cudnn", "flash")

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


def dense_attention(xp: Any, q: Any, k: Any, v: Any, softmax_scale: float, logit_bias: Any | None = None) -> Any:
    """Dense decode attention in the namespace ``xp`` (``numpy`` or ``cupy``).

    GEMM operands keep the dtype of ``k``/``v`` (float16 for the fp16 baseline; CuPy's
    float16 matmul accumulates in float32); the softmax is computed in float32.

    Parameters
    ----------
    q : float array, shape ``(batch, num_kv_heads·groups, 1, d)``, same dtype as ``k``
    k, v : float array, shape ``(batch, num_kv_heads, T, d)``
    softmax_scale : float
    logit_bias : float array, shape ``(batch, num_kv_heads·groups, 1, T)``, optional
        Added to the scaled logits (the ``logit_bias`` of a
        :class:`~numba_kv.DequantResult`).

    Returns
    -------
    out : array, shape ``(batch, num_kv_heads·groups, 1, d)``, dtype of ``v``.
    """
    b, hq, _, d = (int(s) for s in q.shape)
    hkv = int(k.shape[1])
    qg = q.reshape(b, hkv, hq // hkv, d)                     # one GEMM per (sequence, KV head)
    s = xp.matmul(qg, xp.swapaxes(k, -1, -2)).astype(xp.float32) * np.float32(softmax_scale)
    if logit_bias is not None:
        s += logit_bias.reshape(s.shape).astype(xp.float32)
    s -= s.max(axis=-1, keepdims=True)
    p = xp.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    out = xp.matmul(p.astype(v.dtype), v)
    return out.reshape(b, hq, 1, d)


def make_fused(q: Any, kc: Any, ks: Any, vc: Any, vs: Any, bits: int) -> Callable[[], Any]:
    """Timed callable (a): :func:`numba_kv.decode_attention` from the packed codes.

    ``q`` float32 ``(batch, heads, 1, d)``; codes/scales as from :func:`quantize_kv`, on the
    same device (CuPy or Numba device arrays).  ``check_values=False``: the codes come from the
    library's quantizer and the query from a normal draw, so the op's value reads (a pass over
    the scales, ~1/7 of the cache's bytes, and a device-to-host read each) are not timed, as
    the dense baselines validate nothing either; a cache's decode runs the same kernels."""
    def run() -> Any:
        return decode_attention(q, kc, ks, vc, vs, bits=bits, check_values=False)
    return run


def make_dense(xp: Any, q16: Any, k16: Any, v16: Any) -> Callable[[], Any]:
    """Timed callable (b): :func:`dense_attention` over float16 ``q``/K/V in ``xp``."""
    scale = 1.0 / math.sqrt(int(tuple(q16.shape)[-1]))
    return lambda: dense_attention(xp, q16, k16, v16, scale)


def make_dequant_then_attend(xp: Any, q: Any, kc: Any, ks: Any, vc: Any, vs: Any, bits: int,
                             asarray: Callable[[Any], Any] | None = None) -> Callable[[], Any]:
    """Timed callable (c): :func:`numba_kv.dequantize_blocks` of K and V, then
    :func:`dense_attention` in float32.  ``check_values=False``, as the fused side: the scales
    come from :func:`numba_kv.quantize_blocks`, and a pass over them with a device-to-host
    read is not dequantization.

    ``asarray`` turns the dequantized arrays and ``q`` into ``xp`` arrays (default
    ``xp.asarray``: zero-copy for CuPy; the tests pass a device-to-host copy with
    ``xp=numpy``)."""
    conv = asarray or xp.asarray
    scale = 1.0 / math.sqrt(int(tuple(q.shape)[-1]))  # tuple: simulator shapes
    qx = conv(q)

    def run() -> Any:
        k = dequantize_blocks(kc, ks, bits, check_values=False)
        v = dequantize_blocks(vc, vs, bits, check_values=False)
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


def time_torch_ms(torch: Any, fn: Callable[[], Any], repeat: int, warmup: int = 1) -> float:
    """Best of ``repeat`` ``torch.cuda.Event`` timings of ``fn`` (ms) on torch's current stream
    after ``warmup`` untimed calls (as :func:`time_cuda_ms`)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    best = math.inf
    for _ in range(max(1, repeat)):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, float(start.elapsed_time(end)))
    return best


def import_torch() -> Any | None:
    """PyTorch when it is importable and sees a CUDA device, else ``None``.

    PyTorch is never a dependency of the project: without it the torch columns of the GPU
    benchmarks stay empty and the rest runs.
    """
    try:
        import torch  # noqa: PLC0415 - optional: the honest dense baseline when present
    except ImportError:
        return None
    try:
        usable = bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001 - a broken CUDA setup means "no torch baseline"
        usable = False
    return torch if usable else None


def torch_version(torch: Any | None) -> str:
    """``torch.__version__``, or a note why there is no torch baseline (for the provenance)."""
    return str(torch.__version__) if torch is not None else "not importable or no CUDA device"


def torch_supports_gqa(version: str) -> bool:
    """True when torch ``version`` (``"2.11.0+cu130"``) accepts
    ``scaled_dot_product_attention(..., enable_gqa=True)`` (added in 2.5)."""
    m = re.match(r"(\d+)\.(\d+)", str(version))
    return m is not None and (int(m[1]), int(m[2])) >= (2, 5)


def make_sdpa(torch: Any, q: Any, k: Any, v: Any) -> Callable[[], Any]:
    """Callable: one ``torch.nn.functional.scaled_dot_product_attention`` decode step.

    The backend is chosen by the caller (:func:`sdpa_backend`).  GQA reads the KV heads
    directly with ``enable_gqa=True`` where torch has it (:func:`torch_supports_gqa`); older
    versions get K/V expanded to the query heads once, here (outside any timing; 4x the
    memory at 4 groups).  The softmax scale is SDPA's default, ``1/sqrt(head_dim)``, as in the
    other paths.

    Parameters
    ----------
    torch : module
    q : tensor, shape ``(batch, num_kv_heads·groups, 1, d)``
    k, v : tensor, shape ``(batch, num_kv_heads, T, d)``, dtype of ``q``

    Returns
    -------
    callable
        Returns the output tensor, shape and dtype of ``q``.
    """
    sdpa = torch.nn.functional.scaled_dot_product_attention
    hq, hkv = int(q.shape[1]), int(k.shape[1])
    if hq == hkv:
        return lambda: sdpa(q, k, v)
    if torch_supports_gqa(torch.__version__):
        return lambda: sdpa(q, k, v, enable_gqa=True)
    ke, ve = k.repeat_interleave(hq // hkv, dim=1), v.repeat_interleave(hq // hkv, dim=1)
    return lambda: sdpa(q, ke, ve)


@contextlib.contextmanager
def sdpa_backend(torch: Any, name: str) -> Iterator[None]:
    """Context: torch SDPA restricted to one backend of :data:`TORCH_BACKENDS` (``"cudnn"``,
    ``"flash"``), with torch's warnings about why a backend refuses a shape silenced (the
    call then raises ``RuntimeError``).  ``torch.nn.attention`` is loaded by ``import torch``."""
    attention = torch.nn.attention
    backend = {"cudnn": attention.SDPBackend.CUDNN_ATTENTION, "flash": attention.SDPBackend.FLASH_ATTENTION}[name]
    with attention.sdpa_kernel(backend), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


T = TypeVar("T")


def pick_fastest(names: Sequence[str], run_one: Callable[[str], tuple[T, Any]],
                 key: Callable[[T], float] = float) -> tuple[str | None, T | None, Any, dict[str, str]]:
    """Run ``run_one(name)`` for every name and keep the fastest.

    Parameters
    ----------
    names : sequence of str
        Candidates (torch SDPA backends).
    run_one : callable
        ``name -> (timing, output)``; a ``RuntimeError`` (the backend refuses the shape, or
        runs out of memory) skips the candidate.
    key : callable
        ``timing -> float`` to minimize (the timing itself by default).

    Returns
    -------
    name, timing, output
        Of the fastest candidate; ``None`` for all three when every candidate raised.
    errors : dict
        ``{name: first line of the error}`` of the skipped candidates.
    """
    best: tuple[str, T, Any] | None = None
    errors: dict[str, str] = {}
    for name in names:
        try:
            timing, out = run_one(name)
        except RuntimeError as exc:
            errors[name] = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:120]
            continue
        if best is None or key(timing) < key(best[1]):
            best = (name, timing, out)
    if best is None:
        return None, None, None, errors
    return best[0], best[1], best[2], errors


def fastest_sdpa(torch: Any, fn: Callable[[], Any], timer: Callable[[Callable[[], Any]], T],
                 key: Callable[[T], float] = float, backends: Sequence[str] | None = None
                 ) -> tuple[str | None, T | None, Any, dict[str, str]]:
    """Time the SDPA call ``fn`` (:func:`make_sdpa`) under each backend (default
    :data:`TORCH_BACKENDS`) with ``timer`` and keep the fastest (:func:`pick_fastest`); the
    first call under a backend is untimed and gives the output (a backend that cannot run the
    shape raises there and is skipped)."""
    def run_one(name: str) -> tuple[T, Any]:
        with sdpa_backend(torch, name):
            out = fn()
            return timer(fn), out
    return pick_fastest(TORCH_BACKENDS if backends is None else backends, run_one, key)


def errors_note(prefix: str, errors: Mapping[str, str]) -> str:
    """``"prefix: name: error; name: error"`` (empty without errors)."""
    return f"{prefix}: " + "; ".join(f"{k}: {v}" for k, v in errors.items()) if errors else ""


def speedup(baseline_ms: float | None, ms: float | None) -> float | None:
    """``baseline_ms / ms`` (> 1: ``ms`` is faster), ``None`` when either is missing or 0."""
    return baseline_ms / ms if baseline_ms and ms else None


@dataclass
class CudaAttentionRow:
    """One configuration of :func:`run_attention_bench_cuda` (times in ms; ``None``: did not
    fit in device memory, or no torch, see ``note``).

    ``torch_ms`` is the torch SDPA baseline (fastest of :data:`TORCH_BACKENDS`, named in
    ``torch_backend``), ``dense_fp16_ms`` the CuPy one; ``speedup_vs_*`` are baseline time /
    fused time.  ``max_abs_diff_vs_torch``: max |fused - torch| (includes the quantization
    error); ``max_abs_diff_torch_vs_dense``: max |torch - CuPy dense| (both fp16: the two
    baselines compute the same attention).
    """

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
    torch_ms: float | None = None
    torch_backend: str | None = None
    speedup_vs_torch: float | None = None
    max_abs_diff_vs_torch: float | None = None
    max_abs_diff_torch_vs_dense: float | None = None


def make_row(tokens: int, batch: int, bits: int, num_kv_heads: int, groups: int, head_dim: int,
             fused_ms: float | None, dense_ms: float | None, dequant_ms: float | None, peak_gbs: float,
             gpu: str, prov: dict, note: str = "", max_abs_diff: float | None = None, *,
             torch_ms: float | None = None, torch_backend: str | None = None,
             max_abs_diff_torch: float | None = None,
             max_abs_diff_torch_dense: float | None = None) -> CudaAttentionRow:
    """Assemble a row: speedups are baseline time / fused time (:func:`speedup`); packed GB/s
    is :func:`packed_bytes` / fused time; ``max_abs_diff``: max |fused - dequantize-then-attend|,
    ``max_abs_diff_torch``: max |fused - torch SDPA|, ``max_abs_diff_torch_dense``:
    max |torch SDPA - CuPy dense|."""
    nbytes = packed_bytes(tokens, batch, bits, num_kv_heads, groups, head_dim)
    gbs = nbytes / (fused_ms * 1e-3) / 1e9 if fused_ms else None
    return CudaAttentionRow(
        tokens, batch, bits, num_kv_heads, groups, head_dim, fused_ms, dense_ms, dequant_ms,
        speedup(dense_ms, fused_ms), speedup(dequant_ms, fused_ms),
        nbytes, gbs, peak_gbs, 100.0 * gbs / peak_gbs if gbs and peak_gbs else None, gpu, prov, note,
        max_abs_diff, torch_ms, torch_backend if torch_ms is not None else None, speedup(torch_ms, fused_ms),
        max_abs_diff_torch, max_abs_diff_torch_dense)


def gpu_provenance(cupy: Any, props: Mapping[str, Any]) -> dict[str, str]:
    """What a GPU number is labelled with besides :func:`numba_kv.info.provenance`: the GPU, its
    compute capability (the kernels' build for it runs: the tensor-core kernels' sm_90 builds),
    numba-cuda and the CUDA runtime and driver versions (``unknown`` where CuPy cannot say)."""

    def cuda_version(fn: str) -> str:
        try:
            v = int(getattr(cupy.cuda.runtime, fn)())
        except Exception:  # noqa: BLE001 - a runtime without the call: say so, do not fail a benchmark
            return "unknown"
        return f"{v // 1000}.{v % 1000 // 10}"

    try:
        numba_cuda = version("numba-cuda")
    except Exception:  # noqa: BLE001 - not installed under that name
        numba_cuda = "unknown"
    cc = f"{props['major']}.{props['minor']}" if "major" in props and "minor" in props else "unknown"
    return {"gpu": gpu_name(props), "compute_capability": cc, "numba_cuda": numba_cuda,
            "cuda_runtime": cuda_version("runtimeGetVersion"), "cuda_driver": cuda_version("driverGetVersion")}


def gpu_name(props: Mapping[str, Any]) -> str:
    """The ``name`` of CuPy's device properties as text."""
    name = props.get("name", b"unknown GPU")
    return name.decode(errors="replace") if isinstance(name, bytes) else str(name)


def run_attention_bench_cuda(tokens: Sequence[int] = DEFAULT_TOKENS, batch: Sequence[int] = DEFAULT_BATCH,
                             bits: Sequence[int] = DEFAULT_BITS, num_kv_heads: int = 8, groups: int = 4,
                             head_dim: int = 128, repeat: int = 10, seed: int = 0,
                             progress: bool = False, torch_baseline: bool = True) -> list[CudaAttentionRow]:
    """Time fused vs torch SDPA vs CuPy dense fp16 vs dequantize-then-attend decode attention
    on GPU 0.

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
    torch_baseline : bool
        Time torch SDPA when PyTorch with CUDA is importable (:func:`import_torch`); without
        it (or with ``False``) the torch columns are ``None``.

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
    torch = import_torch() if torch_baseline else None
    props = memory_properties(cupy.cuda.runtime, 0)
    peak, gpu = peak_bandwidth_gbs(props), gpu_name(props)
    prov = provenance() | gpu_provenance(cupy, props) | {"peak_hbm_gb_per_s": f"{peak:.1f}",
                           "torch": torch_version(torch) if torch_baseline else "not run (torch_baseline=False)"}
    rng = cupy.random.default_rng(seed)
    rows: list[CudaAttentionRow] = []
    configs = [(t, b) for t in tokens for b in batch]
    for t, b in progress_bar(configs, desc="attention-cuda", disable=not progress, leave=False):
        try:
            rows.extend(_bench_one(cupy, torch, rng, int(t), int(b), bits, num_kv_heads, groups, head_dim, repeat,
                                   peak, gpu, prov))
        except cupy.cuda.memory.OutOfMemoryError as exc:
            rows.extend(make_row(int(t), int(b), int(nb), num_kv_heads, groups, head_dim, None, None, None,
                                 peak, gpu, prov, note=f"out of device memory: {exc}") for nb in bits)
        free_device_memory(cupy, torch)
    return rows


def free_device_memory(cupy: Any, torch: Any | None) -> None:
    """Return the cached blocks of CuPy's pool (and of torch's allocator) to the device."""
    cupy.get_default_memory_pool().free_all_blocks()
    if torch is not None:
        torch.cuda.empty_cache()


def _bench_one(cupy: Any, torch: Any | None, rng: Any, t: int, b: int, bits: Sequence[int], hkv: int,
               groups: int, d: int, repeat: int, peak: float, gpu: str, prov: dict) -> list[CudaAttentionRow]:
    """All bit widths of one (T, batch): K/V made and quantized one sequence at a time (the
    float32 source of one sequence is the only float32 copy alive); torch reads the CuPy
    float16 arrays through DLPack."""
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
    q16 = q.astype(cupy.float16)
    dense = make_dense(cupy, q16, k16, v16)
    dense_ms = time_cuda_ms(cupy, dense, repeat)
    torch_ms, backend, torch_out, torch_note, torch_dense = None, None, None, "", None
    if torch is not None:
        tq, tk, tv = (torch.from_dlpack(a) for a in (q16, k16, v16))  # zero-copy views
        backend, torch_ms, tout, errors = fastest_sdpa(torch, make_sdpa(torch, tq, tk, tv),
                                                       lambda fn: time_torch_ms(torch, fn, repeat))
        torch_note = errors_note("torch SDPA skipped", errors) if backend is None else ""
        if tout is not None:
            torch_out = cupy.from_dlpack(tout).astype(cupy.float32)
            torch_dense = float(cupy.abs(torch_out - dense().astype(cupy.float32)).max())
    rows = []
    for nb in bits:
        kc, vc, ks, vs = codes[nb]
        fused = make_fused(q, kc, ks, vc, vs, nb)
        fused_ms = time_cuda_ms(cupy, fused, repeat)
        fused_out = cupy.asarray(fused())
        diff = None
        diff_torch = None if torch_out is None else float(cupy.abs(fused_out - torch_out).max())
        try:
            deq = make_dequant_then_attend(cupy, q, kc, ks, vc, vs, nb)
            deq_ms = time_cuda_ms(cupy, deq, repeat)
            diff = float(cupy.abs(fused_out - deq()).max())
            note = ""
        except cupy.cuda.memory.OutOfMemoryError:
            deq_ms, note = None, "dequantize-then-attend: out of device memory"
        cupy.get_default_memory_pool().free_all_blocks()
        rows.append(make_row(t, b, nb, hkv, groups, d, fused_ms, dense_ms, deq_ms, peak, gpu, prov,
                             "; ".join(n for n in (note, torch_note) if n), diff, torch_ms=torch_ms,
                             torch_backend=backend, max_abs_diff_torch=diff_torch,
                             max_abs_diff_torch_dense=torch_dense))
    return rows


def rows_as_dicts(rows: Sequence[CudaAttentionRow]) -> list[dict]:
    """JSON-able rows."""
    return [asdict(r) for r in rows]


def fmt(x: float | None, spec: str) -> str:
    """``format(x, spec)``, ``"-"`` for ``None``."""
    return "-" if x is None else format(x, spec)


def render(rows: Sequence[CudaAttentionRow]) -> str:
    """Plain-text table of the rows, labelled with the GPU, peak bandwidth and provenance.

    The baselines come torch SDPA first, then CuPy dense fp16; without torch its columns
    show ``-``."""
    if not rows:
        return "no rows\n"
    p = rows[0].provenance
    peak = f"{rows[0].peak_gb_per_s:.0f} GB/s" if rows[0].peak_gb_per_s else "not reported"
    head = (f"GPU decode attention on {rows[0].gpu} (cc {p.get('compute_capability', '?')}, theoretical peak "
            f"{peak}), {rows[0].num_kv_heads} KV heads x {rows[0].groups} groups, d={rows[0].head_dim}; numba "
            f"{p.get('numba', '?')}, numba-cuda {p.get('numba_cuda', '?')}, CUDA {p.get('cuda_runtime', '?')} "
            f"(driver {p.get('cuda_driver', '?')}), torch {p.get('torch', '?')}, knobs "
            f"{p.get('knobs_env', '?')}, host {p.get('cpu_model', '?')}\n"
            "baselines: torch SDPA fp16 (GQA, fastest of the cuDNN and flash backends), "
            "CuPy dense fp16, dequantize-then-attend (float32)\n")
    cols = ("T", "batch", "bits", "fused ms", "torch sdpa ms", "torch backend", "x torch", "cupy fp16 ms",
            "x cupy", "deq+attend ms", "x deq", "packed GB/s", "% peak", "max |fused-torch|", "max |fused-deq|")
    lines = [head, " | ".join(cols)]
    for r in rows:
        lines.append(" | ".join((str(r.tokens), str(r.batch), str(r.bits), fmt(r.fused_ms, ".3f"),
                                 fmt(r.torch_ms, ".3f"), r.torch_backend or "-", fmt(r.speedup_vs_torch, ".2f"),
                                 fmt(r.dense_fp16_ms, ".3f"), fmt(r.speedup_vs_dense_fp16, ".2f"),
                                 fmt(r.dequant_ms, ".3f"), fmt(r.speedup_vs_dequant, ".2f"),
                                 fmt(r.packed_gb_per_s, ".1f"), fmt(r.pct_of_peak, ".1f"),
                                 fmt(r.max_abs_diff_vs_torch, ".1e"), fmt(r.max_abs_diff_vs_dequant, ".1e")))
                     + (f"  ({r.note})" if r.note else ""))
    return "\n".join(lines) + "\n"
