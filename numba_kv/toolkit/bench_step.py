"""GPU decode-step benchmark (``numba-kv bench decode-step --device cuda``).

What one decode step of one layer costs a user: the host wall time of a steady-state
``cache.decode(...)`` call on CuPy arrays, next to one torch SDPA call over the same history.

Per configuration (``T`` history tokens, ``batch`` sequences, ``num_kv_heads`` KV heads x
``groups`` query heads each, ``head_dim``) and cache mode (any name of
:func:`numba_kv.make_cache`; ``dense``, ``pqo3``, ``kv4`` by default):

1. random float32 K/V of ``T`` tokens are prefilled into a fresh one-layer cache
   (``make_cache(mode, num_layers=1, ...)``, ``cache.prefill(0, k, v)``);
2. ``warmup`` untimed decode steps, then ``steps`` timed ones, each
   ``cache.decode(0, k1, v1, q, AttendConfig(1/sqrt(d), groups))`` with one new token per
   sequence.  A cache that returns :class:`~numba_kv.Dequantized` (``dense``) leaves attention
   to the caller, so its step also runs dense attention over the returned history (CuPy,
   float32, :func:`numba_kv.toolkit.bench_cuda.dense_attention`), as a user would;
3. each step is timed on the host clock, from a synchronized device to the device
   synchronized again (``cupy.cuda.Device().synchronize()``), so launch overhead, validation
   and Python work count as much as kernel time.  Reported: median and min in ms.  A cache
   that attends itself (``Fused``) writes into one output array passed as ``out=`` every
   step (the documented allocation-free step);
4. for those caches the same steps again through a :class:`numba_kv.StepGraph`
   (:data:`GRAPH_WARMUP` untimed steps: the graph is captured on the third): the ``graph``
   columns, and how many timed steps replayed the graph;
5. and once more through a :class:`numba_kv.DecodeStep` bound to the step's arrays
   (:data:`BOUND_WARMUP` untimed steps: from the fifth on, a steady step is one graph launch
   and its Python is skipped): the ``bound`` columns, and how many timed steps skipped
   their Python.

The history is not reset between steps: it grows by one token per step, so the timed steps
see ``T + warmup + 1`` ... ``T + warmup + steps`` tokens, and the graph and bound steps of a
fused cache run on after them (``tokens_after`` in a row: 23 tokens more than ``T`` with the
defaults for a dequantized cache, 23 + 23 + 26 = 72 for a fused one, under 1.8 % at ``T`` =
4096).  That is the steady state of
generation, including the occasional flush of a full-precision window into codes (the median
shows the typical step, the min the cheapest).

The dense baseline, when PyTorch with CUDA is importable: one
``torch.nn.functional.scaled_dot_product_attention`` call over float16 q/K/V of ``T`` tokens
(the same random data, shared with CuPy through DLPack), GQA via ``enable_gqa=True``, timed
the same way under the cuDNN and the flash backend; the faster (by median) is reported and
named.  It does not append the new token to a KV cache (a static fp16 cache's append is one
small copy).  Every row carries :func:`numba_kv.info.provenance`, the GPU name and the torch
version.

:func:`time_wall_ms` and :func:`make_decode_step` take the synchronization and the attention
of dequantized outputs as arguments, so the tests run them on Numba device arrays under
``NUMBA_ENABLE_CUDASIM=1``.
"""

from __future__ import annotations

import io
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table

from numba_kv import AttendConfig, DecodeStep, Dequantized, StepGraph, make_cache
from numba_kv.info import provenance

from .bench_cuda import (
    dense_attention,
    errors_note,
    fastest_sdpa,
    fmt,
    free_device_memory,
    gpu_name,
    gpu_provenance,
    import_torch,
    make_sdpa,
    memory_properties,
    require_cupy,
    speedup,
    torch_version,
)
from .progress import progress_bar
from .specs import DEFAULT_STEPS, DEFAULT_WARMUP

DEFAULT_MODES = ("dense", "pqo3", "kv4")
DEFAULT_TOKENS = (4096, 16384, 65536, 131072)
DEFAULT_BATCH = (1,)
#: untimed steps through a StepGraph before its timed ones (launched, launched, captured)
GRAPH_WARMUP = 3
#: untimed steps through a DecodeStep before its timed ones (launched, launched, captured,
#: replayed twice: armed; the graph may be captured again on the new step's own StepGraph)
BOUND_WARMUP = 6

#: ``attend(q, k, v, softmax_scale, logit_bias)`` -> output: the caller's attention over a
#: :class:`~numba_kv.Dequantized` history
Attend = Callable[[Any, Any, Any, float, Any], Any]


@dataclass
class DecodeStepRow:
    """One (mode, T, batch) of :func:`run_decode_step_bench` (times in ms; ``None``: not
    measured, see ``note``).

    ``step_ms_*``: one ``cache.decode`` step (plus the caller's attention when ``output`` is
    ``"dequantized+attend"``); ``torch_ms_*``: one torch SDPA call (fp16, GQA) over ``tokens``
    tokens with ``torch_backend``; ``speedup_vs_torch`` = torch median / step median (> 1: the
    cache's step is faster); ``graph_ms_*``: the step through a :class:`numba_kv.StepGraph`
    (fused output only), ``graph_replayed`` of its timed steps replayed the captured graph;
    ``bound_ms_*``: the step through a :class:`numba_kv.DecodeStep` (fused output only),
    ``bound_skipped`` of its timed steps skipped their Python (one graph launch);
    ``tokens_after``: the history after the last timed step.
    """

    mode: str
    tokens: int
    batch: int
    num_kv_heads: int
    groups: int
    head_dim: int
    output: str | None
    step_ms_median: float | None
    step_ms_min: float | None
    torch_ms_median: float | None
    torch_ms_min: float | None
    torch_backend: str | None
    speedup_vs_torch: float | None
    kv_mb: float | None
    tokens_after: int
    steps: int
    warmup: int
    gpu: str
    provenance: dict = field(default_factory=dict)
    note: str = ""
    graph_ms_median: float | None = None
    graph_ms_min: float | None = None
    graph_replayed: int | None = None
    bound_ms_median: float | None = None
    bound_ms_min: float | None = None
    bound_skipped: int | None = None


def make_row(mode: str, tokens: int, batch: int, num_kv_heads: int, groups: int, head_dim: int,
             output: str | None, step: tuple[float, float] | None, torch_ms: tuple[float, float] | None,
             torch_backend: str | None, kv_mb: float | None, steps: int, warmup: int, gpu: str, prov: dict,
             note: str = "", graph: tuple[float, float] | None = None,
             graph_replayed: int | None = None, bound: tuple[float, float] | None = None,
             bound_skipped: int | None = None) -> DecodeStepRow:
    """Assemble a row from ``(median, min)`` timings (``None``: not measured); the speedup is
    torch median / step median (:func:`numba_kv.toolkit.bench_cuda.speedup`).  ``graph``:
    the steps through a :class:`numba_kv.StepGraph` (:data:`GRAPH_WARMUP` + ``steps`` more);
    ``bound``: through a :class:`numba_kv.DecodeStep` (:data:`BOUND_WARMUP` + ``steps`` more)."""
    med, mn = step if step is not None else (None, None)
    tmed, tmin = torch_ms if torch_ms is not None else (None, None)
    gmed, gmin = graph if graph is not None else (None, None)
    bmed, bmin = bound if bound is not None else (None, None)
    after = tokens + (warmup + steps if step is not None else 0) + (GRAPH_WARMUP + steps if graph is not None else 0) \
        + (BOUND_WARMUP + steps if bound is not None else 0)
    return DecodeStepRow(mode, tokens, batch, num_kv_heads, groups, head_dim, output, med, mn, tmed, tmin,
                         torch_backend if tmed is not None else None, speedup(tmed, med), kv_mb,
                         after, steps, warmup, gpu, prov, note, gmed, gmin, graph_replayed, bmed, bmin, bound_skipped)


def time_wall_ms(fn: Callable[[], Any], steps: int, warmup: int, sync: Callable[[], Any]) -> tuple[float, float]:
    """Median and min host wall time (ms) of ``fn`` followed by ``sync``.

    ``warmup`` untimed calls first; each timed call starts on a synchronized device and ends
    when ``sync()`` (e.g. ``cupy.cuda.Device().synchronize``) returns.

    Returns
    -------
    median_ms, min_ms : float
    """
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(max(1, steps)):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), min(times)


def make_decode_step(cache: Any, k1: Any, v1: Any, q: Any, config: AttendConfig,
                     attend: Attend | None = None, out: Any = None,
                     graph: StepGraph | None = None) -> Callable[[], Any]:
    """Callable: one decode step of layer 0 (store ``k1``/``v1``, attend with ``q``).

    Returns the attention output: ``Fused.out``, or for a :class:`~numba_kv.Dequantized`
    result ``attend(q, k, v, softmax_scale, logit_bias)`` over the returned history (the
    caller's attention; without ``attend`` the :class:`~numba_kv.Dequantized` itself).
    ``out``: the output array every step writes (a cache that returns ``Fused``); ``graph``:
    each step runs through it (:meth:`numba_kv.StepGraph.run`).
    """
    kw = {} if out is None else {"out": out}
    decode = cache.decode if graph is None else \
        (lambda *args, **kwargs: graph.run(cache.decode, *args, **kwargs))

    def step() -> Any:
        res = decode(0, k1, v1, q, config, **kw)
        if isinstance(res, Dequantized):
            if attend is None:
                return res
            r = res.result
            return attend(q, r.k, r.v, config.softmax_scale, r.logit_bias)
        return res.out
    return step


def output_kind(result: Any) -> str:
    """``"dequantized+attend"`` for a :class:`~numba_kv.Dequantized` decode result (the step
    includes the caller's attention), else ``"fused"``."""
    return "dequantized+attend" if isinstance(result, Dequantized) else "fused"


def run_decode_step_bench(modes: Sequence[str] = DEFAULT_MODES, tokens: Sequence[int] = DEFAULT_TOKENS,
                          batch: Sequence[int] = DEFAULT_BATCH, num_kv_heads: int = 8, groups: int = 4,
                          head_dim: int = 128, steps: int = DEFAULT_STEPS, warmup: int = DEFAULT_WARMUP,
                          seed: int = 0, progress: bool = False, torch_baseline: bool = True
                          ) -> list[DecodeStepRow]:
    """Time one steady-state ``cache.decode`` step per mode on GPU 0 against torch SDPA.

    Parameters
    ----------
    modes : sequence of str
        Cache names of :func:`numba_kv.make_cache` (grammar of :mod:`numba_kv.caches.spec`).
    tokens, batch : sequences of int
        History length after prefill and sequences; every combination is one row per mode.
    num_kv_heads, groups, head_dim : int
        KV heads, query heads per KV head, head dimension (a multiple of 32).
    steps, warmup : int
        Timed and untimed (at least 1) decode steps (the history grows by one token per step).
    seed : int
        Seed of CuPy's generator for K, V, q and the new tokens (standard normal).
    progress : bool
        A progress bar over the (T, batch) configurations.
    torch_baseline : bool
        Time torch SDPA when PyTorch with CUDA is importable; else its columns are ``None``.

    Returns
    -------
    rows : list of :class:`DecodeStepRow`
        In the order (T, batch, mode).  A mode that fails (out of device memory, or an
        error of the cache) gets ``None`` times and a ``note`` (``"error: ..."`` for the
        latter).

    Raises
    ------
    CudaBenchUnavailable
        Without CuPy or a GPU.
    """
    cupy = require_cupy()
    warmup = max(1, int(warmup))  # the first warm-up step also tells the output kind
    torch = import_torch() if torch_baseline else None
    props = memory_properties(cupy.cuda.runtime, 0)
    gpu = gpu_name(props)
    prov = provenance() | gpu_provenance(cupy, props) | {"torch": torch_version(torch) if torch_baseline else
                                                         "not run"}
    rng = cupy.random.default_rng(seed)
    device = cupy.cuda.Device()
    geometry = (num_kv_heads, groups, head_dim)
    rows: list[DecodeStepRow] = []
    configs = [(int(t), int(b)) for t in tokens for b in batch]
    for t, b in progress_bar(configs, desc="decode-step", disable=not progress, leave=False):
        try:
            rows.extend(_bench_config(cupy, torch, rng, device.synchronize, t, b, modes, geometry, steps, warmup,
                                      gpu, prov))
        except cupy.cuda.memory.OutOfMemoryError as exc:
            rows.extend(make_row(m, t, b, *geometry, None, None, None, None, None, steps, warmup, gpu, prov,
                                 note=f"out of device memory: {exc}") for m in modes)
        free_device_memory(cupy, torch)
    return rows


def _bench_config(cupy: Any, torch: Any | None, rng: Any, sync: Callable[[], Any], t: int, b: int,
                  modes: Sequence[str], geometry: tuple[int, int, int], steps: int, warmup: int, gpu: str,
                  prov: dict) -> list[DecodeStepRow]:
    """Every mode at one (T, batch): the torch baseline first, then one fresh cache per mode
    prefilled with the same K/V."""
    hkv, groups, d = geometry
    f32 = cupy.float32
    k = rng.standard_normal((b, hkv, t, d), dtype=f32)
    v = rng.standard_normal((b, hkv, t, d), dtype=f32)
    q = rng.standard_normal((b, hkv * groups, 1, d), dtype=f32)
    k1 = rng.standard_normal((b, hkv, 1, d), dtype=f32)
    v1 = rng.standard_normal((b, hkv, 1, d), dtype=f32)
    torch_ms, backend, torch_note = None, None, ""
    if torch is not None:
        k16, v16, q16 = k.astype(cupy.float16), v.astype(cupy.float16), q.astype(cupy.float16)
        fn = make_sdpa(torch, *(torch.from_dlpack(a) for a in (q16, k16, v16)))
        backend, torch_ms, _, errors = fastest_sdpa(torch, fn, lambda f: time_wall_ms(f, steps, warmup, sync),
                                                    key=lambda timing: timing[0])
        torch_note = errors_note("torch SDPA skipped", errors) if backend is None else ""
        del fn, k16, v16, q16
        free_device_memory(cupy, torch)
    cfg = AttendConfig(d ** -0.5, groups)

    def attend(qq: Any, kk: Any, vv: Any, scale: float, bias: Any) -> Any:
        return dense_attention(cupy, qq, kk, vv, scale, bias)

    rows = []
    for mode in modes:
        note, step_ms, kind, kv_mb, graph_ms, graph, bound = torch_note, None, None, None, None, None, (None, None)
        try:
            cache = make_cache(mode, num_layers=1, num_kv_heads=hkv, head_dim=d)
            cache.prefill(0, k, v)
            sync()
            kind = output_kind(cache.decode(0, k1, v1, q, cfg))  # the first warm-up step
            out = cupy.empty(q.shape, f32) if kind == "fused" else None  # the step's output, reused
            step_ms = time_wall_ms(make_decode_step(cache, k1, v1, q, cfg, attend, out), steps, warmup - 1, sync)
            if out is not None:
                graph = StepGraph()
                graph_ms = time_wall_ms(make_decode_step(cache, k1, v1, q, cfg, attend, out, graph), steps,
                                        GRAPH_WARMUP, sync)
                bound = time_bound_step(DecodeStep(cache, 0, k1, v1, q, cfg, out=out), steps, sync)
            kv_mb = cache.memory_usage() / 1e6
            del cache
        except cupy.cuda.memory.OutOfMemoryError as exc:
            note = "; ".join(n for n in (f"out of device memory: {exc}", torch_note) if n)
        except Exception as exc:  # noqa: BLE001 - one failing mode is a row with the error, not a lost run
            first = (str(exc).strip().splitlines() or [""])[0][:160]
            note = "; ".join(n for n in (f"error: {type(exc).__name__}: {first}", torch_note) if n)
        free_device_memory(cupy, None)
        rows.append(make_row(mode, t, b, hkv, groups, d, kind, step_ms, torch_ms, backend, kv_mb,
                             steps, warmup, gpu, prov, note, graph_ms,
                             None if graph_ms is None else graph.stats()["replayed"], *bound))
    return rows


def time_bound_step(step: DecodeStep, steps: int, sync: Callable[[], Any]) -> tuple[tuple[float, float], int]:
    """``((median, min), skipped)``: :func:`time_wall_ms` of ``step`` after :data:`BOUND_WARMUP`
    untimed calls, and how many of the timed calls skipped their Python."""
    for _ in range(BOUND_WARMUP):
        step()
    before = step.stats()["bound"]
    timing = time_wall_ms(lambda: step().out, steps, 0, sync)
    return timing, step.stats()["bound"] - before


def rows_as_dicts(rows: Sequence[DecodeStepRow]) -> list[dict]:
    """JSON-able rows."""
    return [asdict(r) for r in rows]


def failed(rows: Sequence[DecodeStepRow]) -> list[DecodeStepRow]:
    """Rows whose mode raised an error other than running out of device memory."""
    return [r for r in rows if "error:" in r.note]


def render(rows: Sequence[DecodeStepRow]) -> str:
    """The rows as a rich table (plain text), titled with the GPU, geometry, timing method and
    provenance; without torch its columns show ``-``."""
    if not rows:
        return "no rows\n"
    r0, p = rows[0], rows[0].provenance
    title = (f"one decode step (cache.decode of 1 layer, + the caller's attention for dequantized output) on "
             f"{r0.gpu}, {r0.num_kv_heads} KV heads x {r0.groups} query heads, d={r0.head_dim}; host wall "
             f"clock to device synchronize, median/min of {r0.steps} steps after {r0.warmup} warm-up (history "
             f"grows by 1 token per step; fused output into one out= array; graph: the same steps through a "
             f"numba_kv.StepGraph; bound: through a numba_kv.DecodeStep, skipped: steps without their Python); "
             f"baseline: one torch SDPA call, fp16, GQA, fastest of cuDNN/flash "
             f"(torch {p.get('torch', '?')}); numba {p.get('numba', '?')}, numba-cuda {p.get('numba_cuda', '?')}, "
             f"cc {p.get('compute_capability', '?')}, CUDA {p.get('cuda_runtime', '?')} (driver "
             f"{p.get('cuda_driver', '?')}), knobs {p.get('knobs_env', '?')}, host {p.get('cpu_model', '?')}")
    table = Table(title=title)
    for col in ("mode", "T", "batch", "output", "step ms (median)", "step ms (min)", "torch sdpa ms (median)",
                "torch ms (min)", "torch backend", "x torch", "graph ms (median)", "graph ms (min)",
                "replayed", "bound ms (median)", "bound ms (min)", "skipped", "KV MB", "note"):
        table.add_column(col, justify="left" if col in ("mode", "output", "torch backend", "note") else "right")
    for r in rows:
        table.add_row(r.mode, str(r.tokens), str(r.batch), r.output or "-", fmt(r.step_ms_median, ".3f"),
                      fmt(r.step_ms_min, ".3f"), fmt(r.torch_ms_median, ".3f"), fmt(r.torch_ms_min, ".3f"),
                      r.torch_backend or "-", fmt(r.speedup_vs_torch, ".2f"), fmt(r.graph_ms_median, ".3f"),
                      fmt(r.graph_ms_min, ".3f"), "-" if r.graph_replayed is None else f"{r.graph_replayed}/{r.steps}",
                      fmt(r.bound_ms_median, ".3f"), fmt(r.bound_ms_min, ".3f"),
                      "-" if r.bound_skipped is None else f"{r.bound_skipped}/{r.steps}", fmt(r.kv_mb, ".1f"), r.note)
    buf = io.StringIO()
    Console(file=buf, width=260, force_terminal=False, color_system=None).print(table)
    return buf.getvalue()
