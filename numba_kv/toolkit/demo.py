"""Synthetic KV-stream demo: memory, ratio, quality and speed of every cache.

A KV stream shaped like a real model's (layers × KV heads × tokens × head_dim) with the
structure real keys have — a few large outlier channels, channel-wise scales, a
low-rank component and a slowly drifting mean — is pushed through each cache with
chunked prefill, then one decode step returns the full history, which is compared with
the originals.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from numba_kv.caches.protocol import AttendConfig, Dequantized
from numba_kv.caches.spec import make_cache, parse_cache_spec
from numba_kv.metrics import nmse

from .progress import progress_bar


@dataclass
class DemoRow:
    """One line of the demo table."""

    cache: str
    bits_per_value: float
    bytes: int
    fp16_bytes: int
    ratio_vs_fp16: float
    nmse_k: float
    nmse_v: float
    store_vectors_per_s: float


def synthetic_layer(rng: np.random.Generator, num_kv_heads: int, tokens: int, head_dim: int,
                    outlier_channels: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """One layer of synthetic keys/values ``[1, num_kv_heads, tokens, head_dim]`` float32.

    Keys: channel scales drawn log-normally, ``outlier_channels`` channels per head ×15,
    a rank-8 component and a drifting per-channel mean (as RoPE'd keys show).  Values:
    closer to isotropic with mild channel scaling.
    """
    h, t, d = num_kv_heads, tokens, head_dim
    chan = np.exp(rng.normal(0.0, 0.5, size=(h, 1, d)))
    for i in range(h):
        chan[i, 0, rng.choice(d, outlier_channels, replace=False)] *= 15.0
    basis = rng.standard_normal((h, 8, d)) / np.sqrt(8)
    coef = rng.standard_normal((h, t, 8)) * 2.0
    drift = np.cumsum(rng.standard_normal((h, t, d)) * 0.02, axis=1)
    k = (rng.standard_normal((h, t, d)) + coef @ basis + drift) * chan
    v = rng.standard_normal((h, t, d)) * np.exp(rng.normal(0.0, 0.25, size=(h, 1, d)))
    return k[None].astype(np.float32), v[None].astype(np.float32)


def _make(name: str, num_kv_heads: int, head_dim: int, num_layers: int = 1) -> Any:
    """Cache for the demo; compressed caches return their history from ``decode`` so the
    reconstruction error can be measured (fused attention is benchmarked separately).

    ``name`` is one cache in the grammar of :func:`numba_kv.caches.spec.parse_cache_spec`; its
    own options are kept, except a ``decode_output`` other than ``"dequantized"`` (a
    ``ValueError``: the demo measures the reconstruction).  Dense is told by the parsed name,
    so ``dense:dtype=float16`` is dense too (it takes no ``decode_output``)."""
    try:
        spec = parse_cache_spec(name)
    except ValueError as exc:  # as make_cache words it
        raise ValueError(f"name: {exc}") from None
    opts = dict(spec.options)
    if not spec.is_dense:
        if opts.setdefault("decode_output", "dequantized") != "dequantized":
            raise ValueError(f"decode_output: the demo measures the reconstruction, expected 'dequantized', "
                             f"got {opts['decode_output']!r}")
    return make_cache(spec.name, num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, **opts)


def check_config(caches: str, num_layers: int, num_kv_heads: int, head_dim: int, tokens: int) -> list[str]:
    """The cache names of ``--caches``, each built once on the demo's geometry, before any work.

    Returns
    -------
    list of str
        The names (:func:`iter_names`).

    Raises
    ------
    ValueError
        Naming the option: ``--caches`` empty, or a cache the demo cannot build (unknown
        name or option, a geometry it does not take, ``decode_output`` other than
        ``dequantized``); ``--tokens`` below 2 (the first ``tokens - 1`` are prefilled, the
        last one decoded).
    """
    names = list(iter_names(caches))
    if not names:
        raise ValueError(f"--caches: expected comma-separated cache names, got {caches!r}")
    if tokens < 2:
        raise ValueError(f"--tokens: expected an int >= 2 (tokens - 1 prefilled, the last one decoded), "
                         f"got {tokens}")
    for name in names:
        try:
            _make(name, num_kv_heads, head_dim, num_layers)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"--caches: {name!r}: {exc}") from None
    return names


def run_demo(caches: Sequence[str] = ("dense", "pq3", "pqo3", "pqo4"), num_layers: int = 8,
             num_kv_heads: int = 8, head_dim: int = 128, tokens: int = 4096, chunk: int = 512, seed: int = 0,
             progress: bool = True) -> list[DemoRow]:
    """Run the synthetic demo and return one :class:`DemoRow` per cache.

    Parameters
    ----------
    caches : sequence of str
        Cache names for :func:`numba_kv.make_cache`.
    num_layers, num_kv_heads, head_dim, tokens : int
        Shape of the stream.
    chunk : int
        Prefill chunk length (chunked prefill exercises history reconstruction too).
    """

    layers = [synthetic_layer(np.random.default_rng(seed + i), num_kv_heads, tokens, head_dim)
              for i in range(num_layers)]
    q = np.random.default_rng(seed).standard_normal((1, num_kv_heads, 1, head_dim)).astype(np.float32)
    cfg = AttendConfig(head_dim ** -0.5, 1)
    # compile (or load from Numba's cache) every kernel variant outside the timed region: the
    # timed loop on layer 0 of a one-layer cache, so the same chunk sizes and the same buffer
    # growths (their copy kernels: serial for small, parallel for large histories) run first
    for name in caches:
        w = _make(name, num_kv_heads, head_dim)
        _store_layer(w, 0, *layers[0], chunk)
        w.decode(0, layers[0][0][:, :, -1:], layers[0][1][:, :, -1:], q, cfg)
    rows = []
    bar = progress_bar(total=len(caches) * num_layers, desc="caches x layers", disable=not progress, leave=False)
    for name in caches:
        cache = _make(name, num_kv_heads, head_dim, num_layers)
        store_time, err_k, err_v = 0.0, [], []
        for li, (k, v) in enumerate(layers):
            store_time += _store_layer(cache, li, k, v, chunk)
            out = cache.decode(li, k[:, :, -1:], v[:, :, -1:], q, cfg)
            res = out.result if isinstance(out, Dequantized) else None
            if res is not None:  # a sliding layer returns its newest tokens only: compare those
                n = int(res.k.shape[2])
                err_k.append(nmse(k[:, :, -n:], res.k))
                err_v.append(nmse(v[:, :, -n:], res.v))
            bar.update(1)
        vectors = 2 * num_layers * num_kv_heads * (tokens - 1)
        mem, fp16 = cache.memory_usage(), cache.fp16_bytes()
        rows.append(DemoRow(name, float(cache.bits_per_value), mem, fp16, fp16 / mem,
                            float(np.mean(err_k)) if err_k else float("nan"),
                            float(np.mean(err_v)) if err_v else float("nan"), vectors / store_time))
    bar.close()
    return rows


def _store_layer(cache: Any, layer: int, k: np.ndarray, v: np.ndarray, chunk: int) -> float:
    """Prefill all but the last token of ``k``/``v`` into ``layer`` in chunks; the seconds it took."""
    tokens = int(k.shape[2])
    t0 = time.perf_counter()
    for s in range(0, tokens - 1, chunk):
        e = min(s + chunk, tokens - 1)
        cache.prefill(layer, k[:, :, s:e], v[:, :, s:e])
    return time.perf_counter() - t0


def render_table(rows: Sequence[DemoRow], title: str) -> None:
    """Print the demo rows as a rich table."""

    table = Table(title=title)
    for col in ("cache", "bits/value", "KV bytes", "ratio vs fp16", "NMSE K", "NMSE V", "prefill M vec/s"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r.cache, f"{r.bits_per_value:.3f}", f"{r.bytes:,}", f"{r.ratio_vs_fp16:.2f}x",
                      f"{r.nmse_k:.5f}", f"{r.nmse_v:.5f}", f"{r.store_vectors_per_s / 1e6:.2f}")
    Console(width=140).print(table)


def rows_as_dicts(rows: Sequence[DemoRow]) -> list[dict]:
    """Rows as plain dicts (for ``--json``)."""
    return [asdict(r) for r in rows]


def iter_names(text: str) -> Iterator[str]:
    """Split a ``--caches a,b,c`` argument."""
    return (s.strip() for s in text.split(",") if s.strip())
