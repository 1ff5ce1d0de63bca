"""Decode-attention benchmark shared by ``numba-kv bench attention`` and ``benchmarks/``.

One decode step, batch 1, 8 KV heads x 4 query heads each, d = 128: fused attention from
packed codes vs (a) NumPy dense float32 attention over the uncompressed K/V (``q @ K.T``,
softmax, ``@ V`` per KV-head group) with one BLAS thread, (b) the same with as many BLAS
threads as the fused kernel has Numba threads (``numba.get_num_threads()``; "best vs best"),
(c) dequantize-then-attend.  All of them run in one process on the same data, interleaved round by round, so
the ratios are measured, not assembled; the packed bytes the fused kernel reads per second
are reported next to a STREAM-style copy bandwidth measured in the same run
(:func:`numba_kv.info.stream_copy_gbs`), and every table and JSON carries
:func:`numba_kv.info.provenance`.

The BLAS thread count is switched with ``threadpoolctl`` (the ``bench`` extra).  Without it
both dense columns run with whatever ``OPENBLAS_NUM_THREADS`` says; run a second invocation
with ``OPENBLAS_NUM_THREADS`` set to the Numba threads for the best-vs-best column.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numba
import numpy as np
from rich.console import Console
from rich.table import Table

from .progress import progress_bar

try:  # optional (the bench extra): without it the environment's BLAS thread count is used
    from threadpoolctl import threadpool_info, threadpool_limits
except ImportError:  # pragma: no cover - depends on the environment
    threadpool_info = threadpool_limits = None

from numba_kv.caches.protocol import AttendConfig
from numba_kv.info import provenance, provenance_line, stream_copy_gbs
from numba_kv.ops.attention import decode_attention
from numba_kv.ops.blockquant import dequantize_blocks, quantize_blocks

from .specs import parse_cache_specs


def dense_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, softmax_scale: float) -> np.ndarray:
    """NumPy float32 attention for one decode step.

    Parameters
    ----------
    q : ``[1, num_heads, 1, d]``; k, v : ``[1, num_kv_heads, T, d]`` float32.

    Returns
    -------
    out : ``[1, num_heads, 1, d]`` float32.
    """
    hq, hkv = q.shape[1], k.shape[1]
    g = hq // hkv
    out = np.empty((1, hq, 1, q.shape[3]), np.float32)
    for h in range(hkv):
        qs = q[0, h * g:(h + 1) * g, 0]
        s = (qs @ k[0, h].T) * np.float32(softmax_scale)
        s -= s.max(1, keepdims=True)
        p = np.exp(s)
        p /= p.sum(1, keepdims=True)
        out[0, h * g:(h + 1) * g, 0] = p @ v[0, h]
    return out


@dataclass
class AttentionCase:
    """Inputs of one benchmark case (dense and compressed views of the same K/V)."""

    tokens: int
    bits: int
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    kc: np.ndarray
    ks: np.ndarray
    vc: np.ndarray
    vs: np.ndarray

    @property
    def compressed_bytes(self) -> int:
        """Bytes of codes + scales that fused attention reads."""
        return int(self.kc.nbytes + self.ks.nbytes + self.vc.nbytes + self.vs.nbytes)

    @property
    def dense_bytes(self) -> int:
        return int(self.k.nbytes + self.v.nbytes)

    def fused(self) -> np.ndarray:
        return decode_attention(self.q, self.kc, self.ks, self.vc, self.vs, bits=self.bits)

    def dense(self) -> np.ndarray:
        return dense_attention(self.q, self.k, self.v, self.q.shape[3] ** -0.5)

    def dequant_then_attend(self) -> np.ndarray:
        kh = dequantize_blocks(self.kc, self.ks, self.bits)
        vh = dequantize_blocks(self.vc, self.vs, self.bits)
        return dense_attention(self.q, kh, vh, self.q.shape[3] ** -0.5)


def make_case(tokens: int, bits: int, num_kv_heads: int = 8, num_heads: int = 32, head_dim: int = 128,
              seed: int = 0) -> AttentionCase:
    """Random keys/values with a few outlier key channels, quantized once."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((1, num_kv_heads, tokens, head_dim)).astype(np.float32)
    k[..., [3, 17, 64 % head_dim]] *= 6.0
    v = rng.standard_normal((1, num_kv_heads, tokens, head_dim)).astype(np.float32)
    q = rng.standard_normal((1, num_heads, 1, head_dim)).astype(np.float32)
    kc, ks = quantize_blocks(k, bits)
    vc, vs = quantize_blocks(v, bits)
    return AttentionCase(tokens, bits, q, k, v, kc, ks, vc, vs)


def blas_threads_limited(n: int | None) -> contextlib.AbstractContextManager:
    """Context manager: BLAS limited to ``n`` threads (``threadpoolctl``); a no-op when ``n``
    is ``None`` or threadpoolctl is not installed (then :func:`blas_control` is False)."""
    if n is None or not blas_control():
        return contextlib.nullcontext()
    return threadpool_limits(limits=int(n), user_api="blas")


def bench_provenance() -> dict[str, str]:
    """:func:`numba_kv.info.provenance`, with the BLAS threads counted where no variable sets
    them: ``"default: 2 (openblas)"`` (threadpoolctl) instead of a bare ``"default"``, which
    hid how many threads the environment's dense baselines ran with."""
    prov = provenance()
    if prov.get("blas_threads") == "default" and threadpool_info is not None:
        blas = [p for p in threadpool_info() if p.get("user_api") == "blas"]
        if blas:
            # (one entry per distinct library: NumPy and SciPy may each load their own OpenBLAS)
            counts = dict.fromkeys(f"{p.get('num_threads')} ({p.get('internal_api')})" for p in blas)
            prov["blas_threads"] = "default: " + ", ".join(counts)
    return prov


def blas_control() -> bool:
    """True when the BLAS thread count can be switched inside the process (threadpoolctl)."""
    return threadpool_limits is not None


@dataclass
class AttentionRow:
    """Timings (best of ``repeat``, milliseconds) of one case.

    ``dense_ms`` is dense float32 attention with one BLAS thread, ``dense_blas2_ms`` with
    ``dense_best_threads`` BLAS threads (``None`` when threadpoolctl is missing: then both
    run with the environment's BLAS threads), ``dense_best_ms`` the faster of the two (more
    BLAS threads are not always faster on a small or shared machine): best vs best.
    """

    tokens: int
    bits: int
    fused_ms: float
    dense_ms: float
    dense_blas2_ms: float
    dense_best_ms: float
    dequant_attend_ms: float
    speedup_vs_dense: float
    speedup_vs_dense_best: float
    speedup_vs_dequant: float
    fused_gb_per_s: float
    stream_copy_gb_per_s: float
    compressed_mb: float
    dense_mb: float
    max_rel_err_vs_dequant: float
    dense_best_threads: int | None = None


#: seconds of idle time before each timed call of :func:`run_attention_bench`: longer than
#: OpenBLAS's worker spin timeout (2**28 cycles, ~0.1 s) and OpenMP's spin count, so that the
#: threads the previous contender left spinning (2 BLAS threads of the "best dense" round,
#: Numba's OpenMP workers after a fused call) are parked and do not steal the 2 cores
ATTENTION_PAUSE_S = 0.15


def _interleaved_best(fns: Sequence[Callable[[], object]], repeat: int, pause_s: float = 0.0,
                      blas: Sequence[int | None] | None = None) -> list[float]:
    """Best wall time of each function, measured round-robin (one timed call of each per
    round), so that load changes on a shared machine hit every contender alike.

    With ``pause_s``, each timed call follows ``pause_s`` of sleep and then one untimed call
    of the same function: the sleep parks the threads the previous contender left spinning,
    the untimed call wakes this contender's own threads and warms its caches — the state of
    a decode loop, where steps run back to back.  Without it the timed call would also pay
    for waking idle threads, which a loop never sees (``benchmarks/idle_wake.py``: on a
    2-vCPU VM the fused call at 4K tokens took ~1.5 ms after 0.05 s idle, ~0.75 ms warm).

    ``blas`` gives each contender's BLAS thread count (``None``: left as it is).  The count
    is switched around the contender's pause, untimed and timed call, never inside the timed
    region: threadpoolctl's switch scans the process's loaded libraries, about a millisecond
    a call, which would be charged to the dense baselines (a 4K-token dense step takes a few).

    Raises
    ------
    ValueError
        ``repeat`` < 1 (no timed call: every time would be infinite), or ``blas`` of another
        length than ``fns``.
    """
    if int(repeat) < 1:
        raise ValueError(f"repeat: expected an int >= 1, got {repeat}")
    limits = [None] * len(fns) if blas is None else list(blas)
    if len(limits) != len(fns):
        raise ValueError(f"blas: expected {len(fns)} thread counts, one per function, got {len(limits)}")
    for fn, n in zip(fns, limits):
        with blas_threads_limited(n):
            fn()  # compile / warm up
    best = [float("inf")] * len(fns)
    for _ in range(int(repeat)):
        for i, (fn, n) in enumerate(zip(fns, limits)):
            with blas_threads_limited(n):
                if pause_s:
                    time.sleep(pause_s)
                    fn()
                t = time.perf_counter()
                fn()
                best[i] = min(best[i], time.perf_counter() - t)
    return best


def best_blas_threads(threads: int | None = None) -> int:
    """BLAS threads of the "best dense" column: ``threads``, by default the Numba threads the
    fused kernel and the cache's step run on (``numba.get_num_threads()``): best vs best on any
    machine (it was 2, which on a 16-core host set 2 BLAS threads against 16 Numba threads)."""
    return int(threads) if threads is not None else int(numba.get_num_threads())


def _best(fn: Callable[[], object], repeat: int) -> float:
    return _interleaved_best([fn], repeat)[0]


def run_attention_bench(tokens: Sequence[int] = (4096, 32768, 131072), bits: Sequence[int] = (3, 4),
                        repeat: int = 5, progress: bool = True, best_threads: int | None = None,
                        stream_gbs: float | None = None) -> list[AttentionRow]:
    """Time fused vs dense (1 and ``best_threads`` BLAS threads; default the Numba threads the
    fused kernel runs on) vs dequantize-then-attend for every (tokens, bits); ``stream_gbs``
    (default: measured now) is the copy bandwidth.  ``max_rel_err_vs_dequant`` is normwise:
    ``max|fused − ref| / max|ref|``."""
    best_threads = best_blas_threads(best_threads)


    if stream_gbs is None:
        stream_gbs = stream_copy_gbs()
    ctl = blas_control()
    rows = []
    for t, b in progress_bar([(t, b) for t in tokens for b in bits], desc="attention", disable=not progress,
                             leave=False):
        c = make_case(t, b)
        fused = c.fused()
        ref = c.dequant_then_attend()
        err = float(np.abs(fused - ref).max() / np.abs(ref).max())
        tf, td, tb, tq = _interleaved_best([c.fused, c.dense, c.dense, c.dequant_then_attend], repeat,
                                           ATTENTION_PAUSE_S, blas=[None, 1, best_threads, 1])
        tbest = min(td, tb)
        rows.append(AttentionRow(t, b, tf * 1e3, td * 1e3, tb * 1e3, tbest * 1e3, tq * 1e3, td / tf, tbest / tf,
                                 tq / tf, c.compressed_bytes / tf / 1e9, stream_gbs, c.compressed_bytes / 1e6,
                                 c.dense_bytes / 1e6, err, best_threads if ctl else None))
        del c
    return rows


#: the best configuration at <= 4 bits/value measured on SmolLM2 (README, "Evaluating on a real model")
BEST_LE4_SPEC = "pqo-k4v3-head-eden:key_center=true,window_dtype=int8"
DECODE_SPECS = ("pqo3", "tq3", BEST_LE4_SPEC)


@dataclass
class DecodeRow:
    """``cache.decode`` of one token after a ``tokens``-token prefill (best of ``repeat``).

    ``dense_ms``: dense float32 attention over the same history with one BLAS thread;
    ``dense_blas2_ms`` with ``dense_best_threads`` (``None`` without threadpoolctl: then both
    run with the environment's BLAS threads), ``dense_best_ms`` the faster of the two, as in
    :class:`AttentionRow` (the cache's step runs on every Numba thread: best vs best).
    """

    cache: str
    tokens: int
    decode_ms: float
    dense_ms: float
    speedup_vs_dense: float
    kv_mb: float
    dense_blas2_ms: float | None = None
    dense_best_ms: float | None = None
    speedup_vs_dense_best: float | None = None
    dense_best_threads: int | None = None


def run_decode_bench(specs: Sequence[str] = DECODE_SPECS, tokens: int = 32768, repeat: int = 5,
                     num_kv_heads: int = 8, num_heads: int = 32, head_dim: int = 128,
                     progress: bool = True, best_threads: int | None = None) -> list[DecodeRow]:
    """Time ``cache.decode`` of one token (append + fused attention) for each cache spec
    (:func:`numba_kv.toolkit.specs.parse_cache_specs` grammar, the caches' default windows), next to
    NumPy dense float32 attention over the same history with one and with ``best_threads``
    BLAS threads (default: the Numba threads the cache's step runs on), interleaved."""
    best_threads = best_blas_threads(best_threads)

    rng = np.random.default_rng(0)
    k = rng.standard_normal((1, num_kv_heads, tokens, head_dim)).astype(np.float32)
    k[..., [3, 17, 64 % head_dim]] *= 6.0
    v = rng.standard_normal((1, num_kv_heads, tokens, head_dim)).astype(np.float32)
    q = rng.standard_normal((1, num_heads, 1, head_dim)).astype(np.float32)
    k1 = rng.standard_normal((1, num_kv_heads, 1, head_dim)).astype(np.float32)
    cfg = AttendConfig(head_dim ** -0.5, num_heads // num_kv_heads)
    kd = np.concatenate([k, k1], 2)
    vd = np.concatenate([v, k1], 2)
    rows = []
    for spec in progress_bar(specs, desc="cache.decode", disable=not progress, leave=False):
        cs = parse_cache_specs(spec, arg="specs")[0]
        cache = cs.make(num_layers=1, num_kv_heads=num_kv_heads, head_dim=head_dim)
        cache.prefill(0, k, v)
        # decode appends: time it on a cache that is one token longer each call (as in generation)
        def step(cache: Any = cache) -> object:
            return cache.decode(0, k1, k1, q, cfg)

        def dense() -> object:
            return dense_attention(q, kd, vd, cfg.softmax_scale)

        # BLAS threads switched outside the timed calls; the pause as in the attention table
        # (the untimed call after it appends a token too: the history grows by 1 + 2·repeat
        # tokens over the run, < 0.1 % at the default 32K)
        td, tdn, tb = _interleaved_best([step, dense, dense], repeat, ATTENTION_PAUSE_S,
                                        blas=[None, 1, best_threads])
        tbest = min(tdn, tb)
        rows.append(DecodeRow(cs.label, tokens, td * 1e3, tdn * 1e3, tdn / td, cache.memory_usage() / 1e6,
                              tb * 1e3, tbest * 1e3, tbest / td, best_threads if blas_control() else None))
    return rows


def _best_label(rows: Sequence[Any]) -> str:
    """The "best dense" column's header: its BLAS threads (``env`` without threadpoolctl)."""
    n = next((r.dense_best_threads for r in rows if r.dense_best_threads), None)
    return f"dense ms ({n} BLAS)" if n else "dense ms (env BLAS)"


def render_attention(rows: Sequence[AttentionRow], title: str) -> None:
    """Print attention rows as a rich table."""

    table = Table(title=title)
    for col in ("T", "bits", "fused ms", "dense f32 ms (1 BLAS)", _best_label(rows), "deq+attend ms", "vs dense",
                "vs best dense", "vs deq", "fused GB/s", "copy GB/s", "KV MB (packed/f32)",
                "err max|d|/max|ref|"):
        table.add_column(col, justify="right")
    for r in rows:
        best = f"{r.dense_blas2_ms:.2f}" + ("" if r.dense_best_threads else " (env)")
        table.add_row(str(r.tokens), str(r.bits), f"{r.fused_ms:.2f}", f"{r.dense_ms:.2f}", best,
                      f"{r.dequant_attend_ms:.2f}", f"{r.speedup_vs_dense:.2f}x", f"{r.speedup_vs_dense_best:.2f}x",
                      f"{r.speedup_vs_dequant:.2f}x", f"{r.fused_gb_per_s:.2f}", f"{r.stream_copy_gb_per_s:.1f}",
                      f"{r.compressed_mb:.1f}/{r.dense_mb:.1f}", f"{r.max_rel_err_vs_dequant:.1e}")
    Console(width=200).print(table)


def render_decode(rows: Sequence[DecodeRow], title: str) -> None:
    """Print ``cache.decode`` rows as a rich table."""

    table = Table(title=title)
    for col in ("cache", "T", "decode ms", "dense f32 ms (1 BLAS)", _best_label(rows), "vs dense", "vs best dense",
                "KV MB"):
        table.add_column(col, justify="right")
    for r in rows:
        env = "" if r.dense_best_threads else " (env)"
        best = "-" if r.dense_blas2_ms is None else f"{r.dense_blas2_ms:.2f}{env}"
        vs_best = "-" if r.speedup_vs_dense_best is None else f"{r.speedup_vs_dense_best:.2f}x"
        table.add_row(r.cache, str(r.tokens), f"{r.decode_ms:.2f}", f"{r.dense_ms:.2f}", best,
                      f"{r.speedup_vs_dense:.2f}x", vs_best, f"{r.kv_mb:.1f}")
    Console(width=200).print(table)


def attention_report(tokens: Sequence[int], bits: Sequence[int], repeat: int, progress: bool = True,
                     decode_tokens: int | None = 32768, decode_specs: Sequence[str] = DECODE_SPECS
                     ) -> dict[str, Any]:
    """Everything ``numba-kv bench attention`` prints, as one JSON-able dict: ``provenance``
    (:func:`numba_kv.info.provenance`), ``provenance_line``, ``stream_copy_gb_per_s``,
    ``blas_control`` (threadpoolctl present), ``rows`` (fused vs dense vs dequantize) and
    ``decode`` (``cache.decode`` rows; empty when ``decode_tokens`` is ``None``)."""

    prov = bench_provenance()
    gbs = stream_copy_gbs()
    rows = run_attention_bench(tokens, bits, repeat, progress=progress, stream_gbs=gbs)
    dec = [] if decode_tokens is None else run_decode_bench(decode_specs, decode_tokens, repeat, progress=progress)
    return {"provenance": prov, "provenance_line": provenance_line(prov), "stream_copy_gb_per_s": gbs,
            "blas_control": blas_control(), "rows": rows_as_dicts(rows), "decode": rows_as_dicts(dec),
            "_rows": rows, "_decode": dec}


def print_attention_report(rep: dict[str, Any]) -> None:
    """Render :func:`attention_report` as tables labelled with the provenance line."""
    label = rep["provenance_line"]
    note = "" if rep["blas_control"] else " [threadpoolctl missing: 'best' = environment's BLAS threads]"
    render_attention(rep["_rows"], f"fused decode attention, batch 1, 8 KV heads x 4 query heads, d=128{note}\n{label}")
    if rep["_decode"]:
        render_decode(rep["_decode"], f"cache.decode of one token, 8 KV heads x 4 query heads, d=128\n{label}")


def rows_as_dicts(rows: Sequence[object]) -> list[dict]:
    """Dataclass rows as plain dicts (for ``--json``)."""
    return [asdict(r) for r in rows]
