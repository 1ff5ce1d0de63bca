"""A measured recommendation table of every compression mode (``numba-kv bench modes``).

For every cache mode (and a few FAISS quantizers as external anchors) on the same
synthetic keys/values with realistic outlier channels, this reports

* stored bits per value: keys, values, average (from the cache's own accounting; FAISS:
  ``sa_code_size()·8/d``, plus 16 bits per vector where the FAISS code keeps no norm);
* NMSE of K and of V: mean over vectors of ``‖x − x̂‖² / ‖x‖²`` (for TurboQuant the key
  NMSE is that of the stored ``b − 1``-bit reconstruction ``k̂``; the QJL sketch only
  enters the logits);
* the inner-product slope of the key estimate, ``Σ est·true / Σ true²`` over all
  query–key logits, each query's logits centred over the tokens first (softmax ignores a
  per-query constant; ``slope_raw`` in the JSON is the uncentred one).  ``est`` includes
  TurboQuant's QJL logit bias.  1 = unbiased; < 1 = shrunk logits (a slightly higher
  softmax temperature);
* at two query temperatures σ (exact scaled logits with std σ over the tokens): the
  logit-error std (per-query-centred, RMS over queries),
  mean ``KL(p‖p̂)`` of the attention distribution over the T tokens (``p̂`` from ``k̂``
  plus the QJL bias; only keys matter) and the relative attention-output error
  ``‖p V − p̂ V̂‖ / ‖p V‖`` (keys *and* values quantized);
* top-1 agreement of the argmax token between exact and estimated logits — one number:
  the σ-queries are the same directions scaled (and the QJL bias is linear in ``q``), so
  the argmax does not depend on σ.

Synthetic data model (:func:`synthetic_kv`), per KV head, seeded:

* keys: ``d − n_outliers`` ordinary channels ``N(0, s_c²)`` with a mild per-channel scale
  ``s_c = exp(0.25·N(0,1))``; ``n_outliers`` (default 4 of 128) outlier channels at random
  positions with a large constant offset ``±U(5, 9)`` plus fluctuation of std ``U(1.5, 3)``
  — RMS 5–10× the ordinary channels, mostly a constant, which is what the slowly rotating
  low-frequency RoPE pairs of LLM keys look like;
* values: ``N(0, s_c²)`` with ``s_c = exp(0.3·N(0,1))``, no offsets (LLM values are much
  closer to Gaussian);
* queries: isotropic Gaussian directions, each rescaled so that its exact scaled logits
  ``q·k/√d`` have std exactly 1 over the T tokens; the σ-temperature query is ``σ·q``.
  The logit bias of TurboQuant is linear in ``q``, so it is computed once and scaled.

Caches run with ``decode_output="dequantized"`` and, unless the mode names a window,
``residual_length=0, sink_tokens=0``; a preset (``kv4``, ``kv5``) keeps the window it sizes
for its budget, as :func:`~numba_kv.make_cache` builds it, and ``dense`` is the exact
reference (its window tokens are reconstructed too: ``bits_measured``, from
``memory_usage()``, counts them where ``bits_avg`` counts the codes).  The T
tokens are prefilled (one chunk, which also fixes per-layer statistics such as the
outlier-channel split of ``pqo2.5``), then one decode step with the queries as GQA heads
returns ``k̂``, ``v̂`` and the logit bias over all tokens; the decoded extra token is
dropped.  FAISS indexes are trained per KV head on the vectors they encode (EDEN trains a
mean, i.e. it centres the keys; compare with ``pqo3:key_center=true``).

Calibration: with ``n_outliers=0`` the harness reproduces the project's reference
values for i.i.d. Gaussian data (σ = 1 logit-error std / KL: PQO3 0.177 / 0.016, PQO4 0.090 /
0.004, PQO3 L2 0.179 / 0.016, TQ3 L2 0.416 / 0.087; 2-bit MSE-only slope 0.895).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

try:  # rich is optional here: without it the table is printed as markdown
    from rich.console import Console
    from rich.table import Table
except ModuleNotFoundError:  # pragma: no cover - depends on the environment
    Console = Table = None

from numba_kv.caches.protocol import AttendConfig, Dequantized
from numba_kv.caches.spec import make_cache, parse_cache_spec
from numba_kv.metrics import kl_rows, log_softmax, nmse

__all__ = ["DEFAULT_FAISS", "DEFAULT_MODES", "SIGMAS", "SyntheticKV", "render", "run",
           "synthetic_kv", "to_json", "to_markdown"]

DEFAULT_MODES: tuple[str, ...] = (
    "pq3", "pqo2", "pqo3", "pqo4", "pqo2.5", "pqo3.5", "pqo3-l2", "pqo3-head", "pqo3-eden", "pqo3-head-eden",
    "pqo2-eden", "tq2", "tq3", "tq4", "tq3-l2", "pqo-k4v3", "pqo-k4v2", "pqo3:key_center=true",
)
# FAISS 1.15 index_factory strings.  SQtqmse<b>: TurboQuant_mse for *unit* vectors (no norm
# in the code: we normalize and add a float16 norm); SQtq<b>: FAISS's QJL variant (biased
# reconstruction); EDEN<b>: unbiased-scale EDEN with a trained centre.
DEFAULT_FAISS: tuple[str, ...] = ("HR,SQtqmse3", "HR,EDEN3", "HR,SQtq3", "HR,EDEN2", "HR,EDEN4")
SIGMAS: tuple[float, ...] = (1.0, 3.0)
#: window options of a compressed mode that names none (not of a preset, nor of ``dense``)
NO_WINDOW: dict[str, int] = {"residual_length": 0, "sink_tokens": 0}


# -- data ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class SyntheticKV:
    """One synthetic attention problem (float32 arrays, one row per KV head).

    Attributes
    ----------
    k, v : ``[H, T, d]``
        Keys and values.
    q : ``[H, G, d]``
        Queries normalized so that ``q·k/√d`` has std 1 over the T tokens (per query).
    extra_k, extra_v : ``[H, 1, d]``
        The token stored by the measuring decode step (dropped from every metric).
    outliers : ``[H, n_outliers]`` int
        The outlier channels of each head's keys.
    """

    k: np.ndarray
    v: np.ndarray
    q: np.ndarray
    extra_k: np.ndarray
    extra_v: np.ndarray
    outliers: np.ndarray

    @property
    def softmax_scale(self) -> float:
        return self.k.shape[2] ** -0.5


def _keys(rng: np.random.Generator, shape: tuple[int, int, int],
          n_outliers: int) -> tuple[np.ndarray, np.ndarray]:
    H, T, d = shape
    scale = np.exp(0.25 * rng.standard_normal((H, 1, d)))
    k = rng.standard_normal((H, T, d)) * scale
    outl = np.sort(np.stack([rng.choice(d, n_outliers, replace=False) for _ in range(H)]), axis=1) \
        if n_outliers else np.zeros((H, 0), np.int64)
    for h in range(H):
        for c in outl[h]:
            offset = rng.choice((-1.0, 1.0)) * rng.uniform(5.0, 9.0)
            k[h, :, c] = offset + rng.uniform(1.5, 3.0) * rng.standard_normal(T)
    return k, outl


def synthetic_kv(T: int = 2048, head_dim: int = 128, num_kv_heads: int = 8, queries_per_head: int = 256,
                 seed: int = 0, n_outliers: int = 4) -> SyntheticKV:
    """Seeded keys/values/queries with realistic outlier channels (see the module docstring).

    Examples
    --------
    >>> data = synthetic_kv(T=64, num_kv_heads=2, queries_per_head=4)
    >>> data.k.shape, data.q.shape
    ((2, 64, 128), (2, 4, 128))
    """
    if T < 2 or head_dim < 1 or num_kv_heads < 1 or queries_per_head < 1 or not 0 <= n_outliers <= head_dim:
        raise ValueError(f"synthetic_kv: bad geometry T={T}, head_dim={head_dim}, "
                         f"num_kv_heads={num_kv_heads}, "
                         f"queries_per_head={queries_per_head}, n_outliers={n_outliers}")
    rng = np.random.default_rng(seed)
    H, d = num_kv_heads, head_dim
    k_all, outl = _keys(rng, (H, T + 1, d), n_outliers)
    v_all = rng.standard_normal((H, T + 1, d)) * np.exp(0.3 * rng.standard_normal((H, 1, d)))
    k, v = k_all[:, :T], v_all[:, :T]
    z = rng.standard_normal((H, queries_per_head, d))
    logits = np.einsum("hgd,htd->hgt", z, k) * d ** -0.5
    q = z / logits.std(axis=2, keepdims=True)
    f32 = np.float32
    return SyntheticKV(k.astype(f32), v.astype(f32), q.astype(f32), k_all[:, T:].astype(f32),
                       v_all[:, T:].astype(f32), outl)


# -- reconstructions -------------------------------------------------------------------------
@dataclass
class _Recon:
    k_hat: np.ndarray            # [H, T, d]
    v_hat: np.ndarray
    bias: np.ndarray | None   # [H, G, T] scaled-logit units for the unit-temperature queries
    bits_k: float
    bits_v: float
    bits_avg: float
    extra: dict[str, Any]


def _cache_recon(mode: str, data: SyntheticKV) -> _Recon:
    # no window unless the mode asks for one; a preset keeps the window it sizes for its
    # budget (the row measures what ``make_cache(mode)`` builds), and ``dense`` takes no
    # window or output options (it always returns its exact history)
    spec = parse_cache_spec(mode, defaults=NO_WINDOW)
    H, T, d = data.k.shape
    G = data.q.shape[1]
    opts = dict(spec.options)
    if not spec.is_dense:
        opts.setdefault("decode_output", "dequantized")
    c = make_cache(spec.name, num_layers=1, num_kv_heads=H, head_dim=d, **opts)
    c.prefill(0, data.k[None], data.v[None])
    out = c.decode(0, data.extra_k[None], data.extra_v[None], data.q.reshape(1, H * G, 1, d),
                   AttendConfig(data.softmax_scale, G))
    if not isinstance(out, Dequantized):
        raise TypeError(f"{mode}: decode returned {type(out).__name__}, expected Dequantized")
    r = out.result
    k_hat = np.asarray(r.k, dtype=np.float32)[0, :, :T]
    v_hat = np.asarray(r.v, dtype=np.float32)[0, :, :T]
    bias = None
    if r.logit_bias is not None:
        bias = np.asarray(r.logit_bias, dtype=np.float64)[0, :, 0, :T].reshape(H, G, T)
    measured = c.memory_usage() * 8.0 / (2 * H * (T + 1) * d)
    bits = float(c.bits_per_value)  # (dense stores keys and values alike and has no per-side figures)
    return _Recon(k_hat, v_hat, bias, float(getattr(c, "k_bits_per_value", bits)),
                  float(getattr(c, "v_bits_per_value", bits)), bits, {"cache_name": c.name, "bits_measured": measured})


def _faiss_keeps_norm(faiss: Any, spec: str, d: int) -> bool:
    """True if the FAISS code reconstructs the scale of its input (SQtqmse does not:
    it quantizes unit vectors)."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((256, d)).astype(np.float32)
    ix = faiss.index_factory(d, spec)
    if not ix.is_trained:
        ix.train(x)
    y1 = ix.sa_decode(ix.sa_encode(x))
    y5 = ix.sa_decode(ix.sa_encode(5 * x))
    ratio = float(np.linalg.norm(y5) / max(np.linalg.norm(y1), 1e-30))
    return abs(ratio - 5.0) < 0.5


def _faiss_recon(spec: str, data: SyntheticKV) -> _Recon:
    import faiss  # noqa: PLC0415 - optional dependency (the bench extra): the caller reports its absence in the rows

    H, _T, d = data.k.shape
    keeps_norm = _faiss_keeps_norm(faiss, spec, d)
    out = {}
    code_size = 0
    for name, x in (("k", data.k), ("v", data.v)):
        rec = np.empty_like(x)
        for h in range(H):
            xh = np.ascontiguousarray(x[h], dtype=np.float32)
            norms = None
            if not keeps_norm:
                norms = np.linalg.norm(xh, axis=1, keepdims=True).astype(np.float16).astype(np.float32)
                xh = np.ascontiguousarray(xh / np.maximum(norms, 1e-30), dtype=np.float32)
            ix = faiss.index_factory(d, spec)
            if not ix.is_trained:
                ix.train(xh)
            code_size = int(ix.sa_code_size())
            y = ix.sa_decode(ix.sa_encode(xh))
            rec[h] = y if norms is None else y * norms
        out[name] = rec
    bits = code_size * 8.0 / d + (0.0 if keeps_norm else 16.0 / d)
    return _Recon(out["k"], out["v"], None, bits, bits, bits,
                  {"faiss_code_bytes": code_size, "faiss_norm_added": not keeps_norm})


# -- metrics --------------------------------------------------------------------------------
class _Reference:
    """Exact logits / attention of a :class:`SyntheticKV`, computed once."""

    def __init__(self, data: SyntheticKV, sigmas: Sequence[float]) -> None:
        self.data = data
        self.sigmas = tuple(float(s) for s in sigmas)
        self.q = data.q.astype(np.float64)
        self.v = data.v.astype(np.float64)
        self.logits = self.logits_of(data.k)  # [H, G, T], std 1 per query
        self.centered = self.logits - self.logits.mean(axis=2, keepdims=True)
        self.top = self.logits.argmax(axis=2)
        self.per_sigma = {}
        for s in self.sigmas:
            logp = log_softmax(s * self.logits)
            p = np.exp(logp)
            o = np.einsum("hgt,htd->hgd", p, self.v)
            self.per_sigma[s] = (logp, p, o)

    def logits_of(self, k: np.ndarray) -> np.ndarray:
        return np.einsum("hgd,htd->hgt", self.q, k.astype(np.float64)) * self.data.softmax_scale


def _metrics(ref: _Reference, rec: _Recon) -> dict[str, float]:
    est = ref.logits_of(rec.k_hat)
    if rec.bias is not None:
        est = est + rec.bias
    est_c = est - est.mean(axis=2, keepdims=True)
    err = est - ref.logits
    err_c = err - err.mean(axis=2, keepdims=True)
    row: dict[str, float] = {
        "nmse_k": nmse(ref.data.k, rec.k_hat, eps=1e-300),
        "nmse_v": nmse(ref.data.v, rec.v_hat, eps=1e-300),
        "slope": float((est_c * ref.centered).sum() / (ref.centered ** 2).sum()),
        "slope_raw": float((est * ref.logits).sum() / (ref.logits ** 2).sum()),
    }
    err_std = float(np.sqrt((err_c ** 2).mean()))
    # argmax is invariant under q -> σ·q (the QJL bias is linear in q): one top-1 for all σ
    row["top1"] = float((est.argmax(axis=2) == ref.top).mean())
    v_hat = rec.v_hat.astype(np.float64)
    for s in ref.sigmas:
        logp, _p, o = ref.per_sigma[s]
        logq = log_softmax(s * est)
        o_hat = np.einsum("hgt,htd->hgd", np.exp(logq), v_hat)
        tag = f"s{s:g}"
        row[f"logit_err_std_{tag}"] = s * err_std
        row[f"kl_{tag}"] = float(kl_rows(logp, logq).mean())
        row[f"out_err_{tag}"] = float(np.sqrt(((o - o_hat) ** 2).sum() / (o ** 2).sum()))
    return row


# -- driver ---------------------------------------------------------------------------------
def run(modes: Sequence[str] = DEFAULT_MODES, T: int = 2048, *,
        faiss_specs: Sequence[str] | None = DEFAULT_FAISS, head_dim: int = 128, num_kv_heads: int = 8,
        queries_per_head: int = 256, sigmas: Sequence[float] = SIGMAS,
        seed: int = 0, n_outliers: int = 4, progress: bool = False) -> list[dict[str, Any]]:
    """Measure every mode (and FAISS spec) on one synthetic problem; one dict per row.

    A mode is one cache in the grammar of :func:`numba_kv.caches.spec.parse_cache_spec`
    (``NAME[-rR][-sS][:KEY=VALUE[,KEY=VALUE...]]``); the window defaults to none here.
    ``faiss_specs`` are ``faiss.index_factory`` strings (``None`` or empty: no FAISS rows;
    skipped with a row ``error`` if FAISS is missing).
    A mode that raises gives a row with ``error`` set and no metrics; a row whose metrics
    are not finite gets ``error`` too.

    Row keys: ``mode``, ``source`` (``"numba_kv"``/``"faiss"``), ``bits_k``, ``bits_v``,
    ``bits_avg``, ``nmse_k``, ``nmse_v``, ``slope``, ``slope_raw``, ``top1``, for every σ
    ``logit_err_std_s<σ>``, ``kl_s<σ>``, ``out_err_s<σ>``; ``seconds``,
    ``error``, plus source-specific extras (``cache_name``, ``bits_measured`` — from
    ``memory_usage``, incl. per-layer constants —, ``faiss_code_bytes``,
    ``faiss_norm_added``).
    """
    data = synthetic_kv(T, head_dim, num_kv_heads, queries_per_head, seed, n_outliers)
    ref = _Reference(data, sigmas)
    jobs = [(m, "numba_kv") for m in modes] + [(f, "faiss") for f in (faiss_specs or ())]
    rows: list[dict[str, Any]] = []
    for mode, source in jobs:
        t0 = time.perf_counter()
        row: dict[str, Any] = {"mode": mode if source == "numba_kv" else f"faiss {mode}", "source": source}
        try:
            rec = (_cache_recon if source == "numba_kv" else _faiss_recon)(mode, data)
            row.update(bits_k=rec.bits_k, bits_v=rec.bits_v, bits_avg=rec.bits_avg)
            row.update(_metrics(ref, rec))
            row.update(rec.extra)
            bad = [k for k, val in row.items() if isinstance(val, float) and not math.isfinite(val)]
            row["error"] = f"non-finite: {', '.join(bad)}" if bad else None
        except Exception as exc:  # noqa: BLE001 - reported in the row, the table goes on
            row["error"] = f"{type(exc).__name__}: {exc}"
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
        if progress:
            msg = row["error"] or f"avg {row['bits_avg']:.3f} b/v, slope {row['slope']:.3f}"
            sys.stderr.write(f"[bench modes] {row['mode']}: {msg} ({row['seconds']:.1f} s)\n")
    return rows


def to_json(rows: Sequence[dict[str, Any]], config: dict[str, Any] | None = None) -> dict[str, Any]:
    """``{"config": ..., "rows": [...]}`` (JSON-serializable)."""
    return {"config": dict(config or {}), "rows": [dict(r) for r in rows]}


def _sigmas_of(rows: Sequence[dict[str, Any]]) -> list[str]:
    tags = []
    for r in rows:
        for key in r:
            if key.startswith("kl_s") and key[3:] not in tags:
                tags.append(key[3:])
    return tags


def to_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a GitHub markdown table.

    Columns: mode, bits K / V / avg (the codes), bits of ``memory_usage()`` (windows, sinks
    and per-layer constants included; ``-`` for FAISS), NMSE K / V, slope, top-1, per σ
    logit-error std / KL, then per σ the attention-output relative error.
    """
    tags = _sigmas_of(rows)
    head = ["mode", "bits K", "bits V", "bits avg", "bits (memory)", "NMSE K", "NMSE V", "slope", "top-1"]
    for t in tags:
        s = t[1:]
        head += [f"σ={s} logit err", f"σ={s} KL"]
    head += [f"σ={t[1:]} out err" for t in tags]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join([" --- "] + [" ---: "] * (len(head) - 1)) + "|"]
    for r in rows:
        if "slope" not in r:
            msg = str(r.get("error")).replace("|", "/").replace("\n", " ")
            lines.append(f"| {r['mode']} | error: {msg} |" + " |" * (len(head) - 2))
            continue
        cells = [r["mode"] + (" ⚠" if r.get("error") else ""), f"{r['bits_k']:.3f}", f"{r['bits_v']:.3f}",
                 f"{r['bits_avg']:.3f}", "-" if r.get("bits_measured") is None else f"{r['bits_measured']:.3f}",
                 f"{r['nmse_k']:.4f}", f"{r['nmse_v']:.4f}", f"{r['slope']:.3f}",
                 f"{r['top1']:.3f}"]
        for t in tags:
            cells += [f"{r[f'logit_err_std_{t}']:.3f}", f"{r[f'kl_{t}']:.4f}"]
        cells += [f"{r[f'out_err_{t}']:.3f}" for t in tags]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def render(rows: Sequence[dict[str, Any]], title: str) -> None:
    """Print the table with rich (plain markdown if rich is unavailable)."""
    if Console is None:
        sys.stdout.write(title + "\n" + to_markdown(rows))
        return
    md = to_markdown(rows).splitlines()
    head = [c.strip() for c in md[0].strip("|").split("|")]
    table = Table(title=title)
    for i, c in enumerate(head):
        table.add_column(c, justify="left" if i == 0 else "right")
    for line in md[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        table.add_row(*(cells + [""] * (len(head) - len(cells)))[:len(head)])
    Console(width=220).print(table)
