"""Where does PolarQuant's quality loss come from?  K vs V, per layer, per head.

:func:`analyze_kv` runs a Llama or Gemma-3 GGUF model (SmolLM2-135M by default) over the same text
as ``numba-kv eval`` (:data:`numba_kv.toolkit.evaluation.evaluate.DEFAULT_TEXT`) and measures:

1. **K vs V sensitivity** — perplexity change, top-1 agreement and ``KL(dense ‖ cache)``
   of the decode part (the definitions of :mod:`numba_kv.toolkit.evaluation.evaluate`) when *only the keys*
   or *only the values* are block-quantized, at every bit width, without and with the
   full-precision window.  These rows run through the real protocol path
   (:func:`numba_kv.toolkit.models.sequence_logits` driving a :class:`~.kv_split.KVSplitCache`, which
   takes dequantized keys from a :class:`~numba_kv.caches.polarquant.PolarQuantCache`
   and exact values from a :class:`~numba_kv.caches.dense.DenseCache`, or the other
   way round).  Asymmetric ``pqo-k4v3`` / ``pqo-k3v4`` and symmetric ``pqo3`` /
   ``pqo4`` rows (both sides quantized) are added with the one-pass engine.
2. **Per layer and KV head** — from the dense K, V and the queries recorded during the
   reference run (:class:`~.kv_split.RecordingCache`): NMSE of K and V under block quantization,
   the per-channel RMS profile of the keys (how strong the outlier channels are, and
   which), and the attention error: ``KL(softmax(s) ‖ softmax(ŝ))`` with
   ``s = scale·q·Kᵀ`` and ``ŝ`` from the quantized keys, the standard deviation of the
   logit error ``ŝ − s``, and the relative error of the attention output caused by
   quantized keys (``‖(P̂ − P)V‖ / ‖PV‖``) and by quantized values
   (``‖P(V̂ − V)‖ / ‖PV‖``).
3. **Per-layer sensitivity** — keys (and values) of one layer quantized at a time, the
   others exact, no window: the change of perplexity / KL tells which layers matter.

Engines
-------
``"protocol"`` rows are teacher-forced decode steps through the cache protocol (one
model pass per token; 65–80 ms/token for SmolLM2-135M on one core).  The per-layer
sensitivity needs 30+ runs, so it uses :func:`~.simulate.simulate_logits`, a re-formulation of the
same computation as *one* causal pass over all tokens (~2–4 s at N=512): because the
block quantizer works vector by vector and teacher forcing fixes the tokens, what a
decode step at position ``i`` sees is known in advance — token ``j`` is exact (prompt
pass, sink or window) or its quantized reconstruction, decided per ``(i, j)`` by a mask.

Only the float summation order differs.  With one layer quantized the two engines agree
to ~1e-11 in KL.  With every layer's keys quantized, those rounding differences flip a
few quantization buckets (a key lying on a boundary) and SmolLM2's sensitive heads
amplify the flips: the two runs then differ per position by about a tenth of their
distance to dense, while the aggregate numbers agree (``engine_check``: N=512,
K-only PQO3 KL vs dense 0.340 protocol / 0.345 one-pass; at N=1024 the one-pass
``pqo3-r32-s4`` / ``pqo4-r32-s4`` reproduce the README's ``numba-kv eval`` table
within its noise).

JSON schema (``numba_kv.analysis/1``)
-------------------------------------
The dictionary :func:`analyze_kv` returns (and ``--json`` writes):

``schema`` (:data:`SCHEMA`); ``config`` (``model_name``, ``text``,
``text_sha256``, ``tokens``, ``prefill``, ``scored_positions``, ``bits``,
``residual_length``, ``sink_tokens``, ``chunk_size``, ``n_layers``, ``n_heads``,
``n_kv_heads``, ``head_dim``, ``threads``);

``kv_sensitivity``: list of rows, dense first — ``label`` (e.g. ``"dense"``,
``"k-only pqo3-r0-s0"``, ``"v-only pqo4-r32-s4"``, ``"pqo-k4v3-r32-s4"``),
``quantized`` (``"none"``, ``"k"``, ``"v"`` or ``"kv"``), ``k_bits``, ``v_bits``
(int or null = exact), ``residual_length``, ``sink_tokens``, ``engine``
(``"protocol"`` or ``"simulated"``), ``ppl``, ``ppl_change_pct``,
``top1_agreement``, ``kl_mean``, ``kl_p95``, ``kl_max``, ``k_bits_per_value``,
``v_bits_per_value`` (an exact side: float32 = 32), ``bits_per_value`` (their
mean), ``wall_s``;

``per_layer``: list (one per layer) of ``layer``, ``k_channel_ratio``,
``v_channel_ratio`` (per KV head: max / median of the per-channel RMS over all
tokens), ``k_top_channels``, ``k_top_channel_ratios``, ``v_top_channels``,
``k_token_norm_ratio`` / ``k_token_norm_argmax`` (max / median key norm over
tokens and where), ``k_nmse`` / ``v_nmse`` (``{"pqo3": [per KV head]}``),
``attn`` (``{"pqo3-r0-s0": {"kl", "logit_err_std", "logit_std", "k_out_err",
"v_out_err"}}``, each a list per *query* head over the decode rows; see
:func:`_attention_errors`);

``layer_sensitivity``: ``{"bits", "residual_length": 0, "sink_tokens": 0,
"engine": "simulated", "k": [rows], "v": [rows]}``, a row per layer with
``layer``, ``ppl_change_pct``, ``top1_agreement``, ``kl_mean``;

``engine_check``: the one-pass engine against the protocol rows of the same
configuration (``label``, ``kl_between``, ``top1_between``,
``max_abs_logit_diff``, ``ppl_protocol``, ``ppl_simulated``,
``kl_dense_protocol``, ``kl_dense_simulated``);

``wall_s`` and ``timings`` (seconds per phase).

Command line::

    numba-kv analyze --tokens 512 --json out.json
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from numba_kv.caches.dense import DenseCache
from numba_kv.caches.polarquant import PolarQuantCache
from numba_kv.metrics import LogitScorer, compare_logits, kl_rows, log_softmax, nmse

from ..models import sequence_logits
from ..progress import progress_bar
from ..specs import EvalConfigError
from .evaluate import TextTokens, json_safe, numba_threads, resolve_text, tokenize_text
from .kv_split import KVSplitCache, RecordingCache
from .simulate import polarquant_bits_per_value, pqo_roundtrip, simulate_logits

__all__ = ["SCHEMA", "analyze_kv"]

#: Version tag of the dictionary returned by :func:`analyze_kv` (and of its JSON file).
SCHEMA = "numba_kv.analysis/1"


# --------------------------------------------------------------------------------------
# per-layer statistics
# --------------------------------------------------------------------------------------
def _attention_errors(q: np.ndarray, k: np.ndarray, v: np.ndarray, k_hat: np.ndarray, v_hat: np.ndarray,
                      quant: np.ndarray, causal: np.ndarray, scale: float,
                      groups: int) -> dict[str, np.ndarray]:
    """Attention errors per query head for the decode rows.

    ``q`` ``[H, R, d]`` (the scored rows), ``k``/``v``/hats ``[KVH, T, d]``, masks
    ``[R, T]``.  Returns per query head: ``kl`` (mean over rows of
    ``KL(p ‖ p̂)``), ``logit_err_std`` (over quantized pairs), ``logit_std`` (over visible
    pairs), ``k_out_err`` (``‖(P̂ − P)V‖ / ‖PV‖``), ``v_out_err`` (``‖P(V̂ − V)‖ / ‖PV‖``),
    means over rows.
    """
    h = q.shape[0]
    res = {key: np.empty(h) for key in ("kl", "logit_err_std", "logit_std", "k_out_err", "v_out_err")}
    neg = ~causal
    for hh in range(h):
        g = hh // groups
        qh = q[hh].astype(np.float64)
        kk, kh = k[g].astype(np.float64), k_hat[g].astype(np.float64)
        s = scale * (qh @ kk.T)
        sh = np.where(quant, scale * (qh @ kh.T), s)
        err = (sh - s)[quant]
        res["logit_err_std"][hh] = float(err.std()) if err.size else 0.0
        res["logit_std"][hh] = float(s[causal].std())
        s[neg] = -np.inf
        sh[neg] = -np.inf
        lp, lph = log_softmax(s), log_softmax(sh)
        p, ph = np.exp(lp), np.exp(lph)
        res["kl"][hh] = float(np.maximum(kl_rows(lp, lph, causal), 0.0).mean())
        vv, vh = v[g].astype(np.float64), v_hat[g].astype(np.float64)
        o = p @ vv
        on = np.maximum(np.linalg.norm(o, axis=-1), 1e-30)
        res["k_out_err"][hh] = float((np.linalg.norm(ph @ vv - o, axis=-1) / on).mean())
        # values: the quantized pairs read v_hat, the others the exact value
        ov = (p * quant) @ vh + (p * ~quant) @ vv
        res["v_out_err"][hh] = float((np.linalg.norm(ov - o, axis=-1) / on).mean())
    return res


def _layer_stats(q: np.ndarray, k: np.ndarray, v: np.ndarray, n_prefill: int, bits: Sequence[int],
                 windows: Sequence[tuple[int, int]], scale: float, groups: int,
                 top: int = 4, sliding_window: int | None = None) -> dict[str, Any]:
    """Statistics of one layer from recorded ``q``/``k``/``v`` (``[1, heads, T, d]``); the
    attention errors of a sliding-window layer (``sliding_window``, Gemma-3's local layers) over
    the keys its queries see (``i − sliding_window < j ≤ i``), as the model attends."""
    q, k, v = q[0], k[0], v[0]
    kvh, t, _d = k.shape
    out: dict[str, Any] = {}
    k_rms = np.sqrt(np.mean(k.astype(np.float64) ** 2, axis=1))  # [KVH, d]
    v_rms = np.sqrt(np.mean(v.astype(np.float64) ** 2, axis=1))
    med_k = np.maximum(np.median(k_rms, axis=1), 1e-30)
    med_v = np.maximum(np.median(v_rms, axis=1), 1e-30)
    out["k_channel_ratio"] = (k_rms.max(axis=1) / med_k).tolist()
    out["v_channel_ratio"] = (v_rms.max(axis=1) / med_v).tolist()
    top_k = [np.argsort(-k_rms[g])[:top] for g in range(kvh)]
    out["k_top_channels"] = [t.tolist() for t in top_k]
    out["k_top_channel_ratios"] = [(k_rms[g][top_k[g]] / med_k[g]).tolist() for g in range(kvh)]
    out["v_top_channels"] = [np.argsort(-v_rms[g])[:top].tolist() for g in range(kvh)]
    kn = np.linalg.norm(k.astype(np.float64), axis=-1)
    out["k_token_norm_ratio"] = (kn.max(axis=1) / np.maximum(np.median(kn, axis=1), 1e-30)).tolist()
    out["k_token_norm_argmax"] = kn.argmax(axis=1).tolist()
    rows = np.arange(n_prefill, t)
    qd = q[:, n_prefill:]
    for b in bits:
        kh = pqo_roundtrip(k[None], b)[0]
        vh = pqo_roundtrip(v[None], b)[0]
        key = f"pqo{b}"
        out.setdefault("k_nmse", {})[key] = nmse(k, kh, axis=-1).tolist()
        out.setdefault("v_nmse", {})[key] = nmse(v, vh, axis=-1).tolist()
        for (r, s) in windows:
            j = np.arange(t)[None, :]
            causal = j <= rows[:, None]
            if sliding_window is not None:
                causal &= j > rows[:, None] - sliding_window
            if r or s:
                exact = (j < s) | (j >= np.maximum(s, rows[:, None] + 1 - r))
            else:
                exact = np.zeros_like(causal)
            quant = causal & ~exact
            errs = _attention_errors(qd, k, v, kh, vh, quant, causal, scale, groups)
            wkey = f"{key}-r{r}-s{s}"
            for name, val in errs.items():
                out.setdefault("attn", {}).setdefault(wkey, {})[name] = val.tolist()
    return out


# --------------------------------------------------------------------------------------
# the analysis
# --------------------------------------------------------------------------------------
def _bits_arg(bits: Any) -> tuple[int, ...]:
    if isinstance(bits, (int, np.integer)) and not isinstance(bits, bool):
        bits = (int(bits),)
    out = tuple(int(b) for b in bits)
    if not out or any(b not in (2, 3, 4) for b in out):
        raise ValueError(f"bits: expected bit widths in {{2, 3, 4}}, got {bits!r}")
    return out


def analyze_kv(model: Any, tokenizer: Any, text_path: str | Path | None = None, tokens: int = 512,
               prefill: int = 128, bits: Sequence[int] = (3, 4), residual_length: int = 32,
               sink_tokens: int = 4, progress: bool = True, *, layer_sensitivity: Sequence[str] = ("k",),
               chunk_size: int | None = 256, threads: int | None = None) -> dict[str, Any]:
    """K vs V, per layer, per head: where the quality loss of PQO quantization comes from.

    Parameters
    ----------
    model, tokenizer
        A loaded ``(LlamaModel, GGUFTokenizer)`` (e.g. :func:`numba_kv.toolkit.models.load_smollm2`).
    text_path : str or Path, optional
        English text; default :data:`~numba_kv.toolkit.evaluation.evaluate.DEFAULT_TEXT` (as
        ``numba-kv eval``).
    tokens : int
        ``N``, tokens of the text (``>= prefill + 2``).
    prefill : int
        ``P``, tokens stored through ``cache.prefill``; the ``N − P − 1`` predictions made
        by decode steps are scored (as in :mod:`numba_kv.toolkit.evaluation.evaluate`).
    bits : sequence of int
        PQO bit widths (2–4) to analyse.
    residual_length, sink_tokens : int
        The window of the "with window" rows (``0, 0`` rows are always included).
    progress : bool
        Progress on stderr (a tqdm bar on a terminal, one line per stage otherwise).
    layer_sensitivity : sequence of {"k", "v"}
        Sides of the per-layer sensitivity sweep (``()`` skips it); each side costs one
        one-pass simulation per layer at ``min(bits)`` bits without window (~1 min for
        30 layers at N=512).  Default: keys only (on SmolLM2 a single layer's values
        change the KL by at most ~0.003, its keys by up to ~0.1).
    chunk_size : int or None
        Prefill chunk (as ``numba-kv eval``).
    threads : int, optional
        Numba threads during the run (``None`` keeps the setting).

    Returns
    -------
    dict
        The ``numba_kv.analysis/1`` document (keys and units: *JSON schema* in the module
        docstring), JSON-ready (:func:`~.evaluate.json_safe`).

    Raises
    ------
    numba_kv.toolkit.evaluation.evaluate.EvalConfigError
        Missing or too short text, bad ``tokens``/``prefill``/``threads``.
    ValueError
        Bad ``bits`` or ``layer_sensitivity``.
    """
    t_start = time.perf_counter()
    bits = _bits_arg(bits)
    sides = _check_args(tokens, prefill, residual_length, sink_tokens, layer_sensitivity)
    text = tokenize_text(resolve_text(text_path), tokenizer, tokens)
    windows = [(0, 0)]
    if residual_length or sink_tokens:
        windows.append((int(residual_length), int(sink_tokens)))
    run = _AnalysisRun(model, text.ids, prefill, chunk_size, progress)
    with numba_threads(threads) as n_threads:
        run.warmup(bits)
        rec, ref_all = run.dense_reference()
        proto_logits = run.kv_only_protocol(bits, windows)
        checks, states = run.engine_check(bits, ref_all, proto_logits)
        run.kv_simulated(bits, windows, states)
        sens = run.layer_sensitivity(bits, sides, states)
        per_layer = run.per_layer_stats(rec, bits, windows)

    config = _analysis_config(model.config, text, tokens, prefill, bits, residual_length, sink_tokens, chunk_size,
                              n_threads)
    return json_safe({"schema": SCHEMA, "config": config, "kv_sensitivity": run.rows, "per_layer": per_layer,
                       "layer_sensitivity": sens, "engine_check": checks, "timings": run.timings,
                       "wall_s": time.perf_counter() - t_start})


def _analysis_config(c: Any, text: TextTokens, tokens: int, prefill: int, bits: Sequence[int],
                     residual_length: int, sink_tokens: int, chunk_size: int | None,
                     n_threads: int) -> dict[str, Any]:
    """The ``config`` section of the document (``c``: the model's config)."""
    return {
        "model_name": getattr(c, "name", ""), "text": str(text.file),
        "text_sha256": hashlib.sha256(text.raw).hexdigest(),
        "tokens": int(tokens), "prefill": int(prefill), "scored_positions": int(tokens - prefill - 1),
        "bits": list(bits), "residual_length": int(residual_length), "sink_tokens": int(sink_tokens),
        "chunk_size": chunk_size, "n_layers": c.n_layers, "n_heads": c.n_heads, "n_kv_heads": c.n_kv_heads,
        "head_dim": c.head_dim, "threads": int(n_threads),
    }


def _check_args(tokens: int, prefill: int, residual_length: int, sink_tokens: int,
                layer_sensitivity: Sequence[str]) -> tuple[str, ...]:
    """Validate the arguments of :func:`analyze_kv`; the sides of the layer sweep."""
    sides = tuple(layer_sensitivity)
    if any(s not in ("k", "v") for s in sides):
        raise ValueError(f"layer_sensitivity: expected a sequence of 'k'/'v', got {layer_sensitivity!r}")
    for nm, val, lo in (("tokens", tokens, 3), ("prefill", prefill, 1),
                        ("residual_length", residual_length, 0), ("sink_tokens", sink_tokens, 0)):
        if isinstance(val, bool) or not isinstance(val, (int, np.integer)) or val < lo:
            raise EvalConfigError(f"--{nm.replace('_', '-')}: expected an int >= {lo}, got {val!r}")
    if prefill > tokens - 2:
        raise EvalConfigError(f"--prefill: expected <= --tokens - 2 = {tokens - 2}, got {prefill}")
    return sides


class _AnalysisRun:
    """The stages of :func:`analyze_kv` on one model and token sequence, in the order it calls
    them; collects the ``kv_sensitivity`` rows and the timings."""

    def __init__(self, model: Any, ids: np.ndarray, prefill: int, chunk_size: int | None,
                 progress: bool) -> None:
        self.model, self.ids, self.prefill = model, ids, prefill
        self.chunk_size, self.progress = chunk_size, progress
        c = self.c = model.config
        self.geom = (c.n_layers, c.n_kv_heads, c.head_dim)
        self.targets = ids[prefill + 1:]
        self.values_per_side = c.n_layers * c.n_kv_heads * c.head_dim * len(ids)
        self.rows: list[dict[str, Any]] = []
        self.timings: dict[str, float] = {}
        self.score: LogitScorer | None = None
        self.ref_ppl = float("nan")

    def protocol(self, cache: Any, desc: str) -> np.ndarray:
        tokens = len(self.ids)
        bar = progress_bar(total=tokens - self.prefill, desc=f"{desc:>22}", disable=not self.progress, leave=False,
                   unit="tok")
        out = sequence_logits(self.model, self.ids, cache, self.prefill, chunk_size=self.chunk_size,
                              include_prefill=False, progress=lambda done, total: bar.update(1))
        bar.close()
        return out

    def pq(self, b: int, r: int, s: int, **kw: Any) -> Any:
        return PolarQuantCache(*self.geom, bits=b, residual_length=r, sink_tokens=s, **kw)

    def add_row(self, label: str, quantized: str, kb: int | None, vb: int | None, r: int, s: int,
                engine: str, logits: np.ndarray, kbpv: float, vbpv: float, wall: float) -> dict[str, Any]:
        m = self.score(logits[1:-1])
        row = {"label": label, "quantized": quantized, "k_bits": kb, "v_bits": vb, "residual_length": r,
               "sink_tokens": s, "engine": engine, "ppl": m["ppl"],
               "ppl_change_pct": 100.0 * (m["ppl"] / self.ref_ppl - 1.0),
               "top1_agreement": m["top1_agreement"],
               "kl_mean": m["kl_mean"], "kl_p95": m["kl_p95"], "kl_max": m["kl_max"],
               "k_bits_per_value": kbpv, "v_bits_per_value": vbpv, "bits_per_value": 0.5 * (kbpv + vbpv),
               "wall_s": wall}
        self.rows.append(row)
        return row

    def warmup(self, bits: Sequence[int]) -> None:
        """Compile the kernels outside the timed runs (a short window exercises compression)."""
        t0 = time.perf_counter()
        for b in bits:
            split = KVSplitCache(self.pq(b, 2, 1, decode_output="dequantized"), DenseCache(*self.geom), "k")
            sequence_logits(self.model, self.ids[:8], split, 2, include_prefill=False)
            sequence_logits(self.model, self.ids[:8], self.pq(b, 2, 1), 2, include_prefill=False)
        self.timings["warmup"] = time.perf_counter() - t0

    def dense_reference(self) -> tuple[RecordingCache, np.ndarray]:
        """1. The dense reference, recording q/k/v of every layer; sets the scorer."""
        t0 = time.perf_counter()
        rec = RecordingCache(DenseCache(*self.geom))
        ref_all = self.protocol(rec, "dense (recording)")
        ref = ref_all[1:-1]
        self.score = LogitScorer(ref, self.targets)
        self.ref_ppl = self.score(ref)["ppl"]
        self.add_row("dense", "none", None, None, 0, 0, "protocol", ref_all, 32.0, 32.0,
                     time.perf_counter() - t0)
        self.timings["dense"] = time.perf_counter() - t0
        return rec, ref_all

    def kv_only_protocol(self, bits: Sequence[int],
                         windows: Sequence[tuple[int, int]]) -> dict[str, np.ndarray]:
        """2. K-only / V-only through the protocol; the no-window logits of the first width."""
        t0 = time.perf_counter()
        proto_logits: dict[str, np.ndarray] = {}
        for side in ("k", "v"):
            for b in bits:
                for (r, s) in windows:
                    t1 = time.perf_counter()
                    inner = self.pq(b, r, s, decode_output="dequantized")
                    cache = KVSplitCache(inner, DenseCache(*self.geom), side)
                    label = f"{side}-only pqo{b}-r{r}-s{s}"
                    lg = self.protocol(cache, label)
                    kbytes, vbytes = cache.side_bytes()
                    self.add_row(label, side, b if side == "k" else None, b if side == "v" else None, r, s,
                                 "protocol", lg, 8.0 * kbytes / self.values_per_side,
                                 8.0 * vbytes / self.values_per_side, time.perf_counter() - t1)
                    if r == 0 and s == 0 and b == bits[0]:
                        proto_logits[label] = lg
        self.timings["kv_only_protocol"] = time.perf_counter() - t0
        return proto_logits

    def engine_check(self, bits: Sequence[int], ref_all: np.ndarray,
                     proto_logits: dict[str, np.ndarray]) -> tuple[list[dict[str, Any]], Any]:
        """3a. The one-pass engine against the protocol; the dense states it reuses."""
        t0 = time.perf_counter()
        model, ids, prefill = self.model, self.ids, self.prefill
        sim_dense, states = simulate_logits(model, ids, prefill, chunk_size=self.chunk_size,
                                            return_states=True)
        checks = [{"label": "dense", **_agreement(self.score, ref_all, sim_dense, self.targets)}]
        for label, lg in proto_logits.items():
            side, b = label[0], bits[0]
            sim = simulate_logits(model, ids, prefill, k_quant=b if side == "k" else None,
                                  v_quant=b if side == "v" else None, chunk_size=self.chunk_size,
                                  dense_states=states)
            checks.append({"label": label, **_agreement(self.score, lg, sim, self.targets)})
        self.timings["engine_check"] = time.perf_counter() - t0
        return checks, states

    def kv_simulated(self, bits: Sequence[int], windows: Sequence[tuple[int, int]], states: Any) -> None:
        """3b. Symmetric and asymmetric K/V widths with the one-pass engine."""
        t0 = time.perf_counter()
        tokens = len(self.ids)
        combos = [(kb, vb) for kb in bits for vb in bits if kb != vb] + [(b, b) for b in bits]
        for (kb, vb) in combos:
            for (r, s) in windows:
                t1 = time.perf_counter()
                lg = simulate_logits(self.model, self.ids, self.prefill, k_quant=kb, v_quant=vb,
                                     residual_length=r, sink_tokens=s, chunk_size=self.chunk_size,
                                     dense_states=states)
                name = f"pqo{kb}" if kb == vb else f"pqo-k{kb}v{vb}"
                bpv = polarquant_bits_per_value(tokens, self.c.head_dim, kb, vb, r, s)
                self.add_row(f"{name}-r{r}-s{s}", "kv", kb, vb, r, s, "simulated", lg, bpv["k"], bpv["v"],
                             time.perf_counter() - t1)
        self.timings["kv_simulated"] = time.perf_counter() - t0

    def layer_sensitivity(self, bits: Sequence[int], sides: Sequence[str], states: Any) -> dict[str, Any]:
        """3c. One layer quantized at a time (the narrowest width, no window)."""
        t0 = time.perf_counter()
        n_layers = self.c.n_layers
        sens: dict[str, Any] = {"bits": min(bits), "residual_length": 0, "sink_tokens": 0,
                                "engine": "simulated"}
        for side in sides:
            out_rows = []
            bar = progress_bar(total=n_layers, desc=f"{side}: one layer at a time", disable=not self.progress,
                       leave=False)
            for li in range(n_layers):
                spec = [None] * n_layers
                spec[li] = min(bits)
                lg = simulate_logits(self.model, self.ids, self.prefill,
                                     k_quant=spec if side == "k" else None,
                                     v_quant=spec if side == "v" else None, chunk_size=self.chunk_size,
                                     dense_states=states)
                m = self.score(lg[1:-1])
                out_rows.append({"layer": li, "ppl_change_pct": 100.0 * (m["ppl"] / self.ref_ppl - 1.0),
                                 "top1_agreement": m["top1_agreement"], "kl_mean": m["kl_mean"]})
                bar.update(1)
            bar.close()
            sens[side] = out_rows
        self.timings["layer_sensitivity"] = time.perf_counter() - t0
        return sens

    def per_layer_stats(self, rec: RecordingCache, bits: Sequence[int],
                        windows: Sequence[tuple[int, int]]) -> list[dict[str, Any]]:
        """4. Per-layer statistics from the recorded dense q/k/v."""
        t0 = time.perf_counter()
        per_layer = []
        for li in range(self.c.n_layers):
            q, k, v = rec.recorded(li)
            st = _layer_stats(q, k, v, self.prefill, bits, windows, self.model.softmax_scale,
                              self.c.n_kv_groups, sliding_window=self.model.layer_windows[li])
            per_layer.append({"layer": li, **st})
        self.timings["per_layer_stats"] = time.perf_counter() - t0
        return per_layer


def _agreement(score: LogitScorer, a: np.ndarray, b: np.ndarray, targets: np.ndarray) -> dict[str, float]:
    """Protocol logits ``a`` vs one-pass logits ``b`` (rows as ``sequence_logits``), and both vs dense."""
    ma = compare_logits(a[1:-1], b[1:-1], targets)
    return {"kl_between": ma["kl_mean"], "top1_between": ma["top1_agreement"],
            "max_abs_logit_diff": float(np.max(np.abs(a.astype(np.float64) - b))),
            "ppl_protocol": ma["ppl_ref"], "ppl_simulated": ma["ppl"],
            "kl_dense_protocol": score(a[1:-1])["kl_mean"], "kl_dense_simulated": score(b[1:-1])["kl_mean"]}

