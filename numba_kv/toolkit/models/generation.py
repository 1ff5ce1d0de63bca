"""Drivers of :class:`~.llama.LlamaModel`: teacher-forced next-token logits through a cache
(:func:`sequence_logits`, the evaluation protocol) and greedy generation (:func:`generate`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .llama import DEFAULT_CHUNK_SIZE, CacheFactory, LlamaModel

__all__ = ["Generation", "generate", "sequence_logits"]


def _is_whole(x: Any) -> bool:
    """``x`` is a whole number (an int, or a float equal to one), not a bool: what a count argument
    accepts.  ``None``, a str or NaN is not (``int(x)`` raised an unnamed ``TypeError`` for ``None``)."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, float, np.integer, np.floating)):
        return False
    return bool(np.isfinite(x)) and int(x) == x


def sequence_logits(model: LlamaModel, tokens: Sequence[int], cache: Any, n_prefill: int, *,
                    chunk_size: int | None = DEFAULT_CHUNK_SIZE, include_prefill: bool = True,
                    progress: Callable[[int, int], None] | None = None,
                    prefill_attention: str = "cache") -> np.ndarray:
    """Next-token logits of every position of ``tokens``: ``n_prefill`` tokens prefilled,
    the rest fed one at a time through ``cache.decode`` (teacher forcing).

    This is the measurement behind perplexity / KL / top-1 agreement of a compressed
    cache against :class:`~numba_kv.caches.dense.DenseCache`: run it once per cache on
    the same tokens and compare the rows.

    Parameters
    ----------
    model : LlamaModel
    tokens : sequence of int, length ``N``
    cache : CompressedKVCache
        Should be empty (positions start at ``cache.seq_len(0)``).
    n_prefill : int
        Prompt tokens, ``1 <= n_prefill <= N``, stored through ``cache.prefill`` in chunks
        of ``chunk_size``.
    chunk_size : int or None
        Prefill chunk (``None``: one chunk).
    include_prefill : bool
        Return rows for the prefilled positions too.
    progress : callable, optional
        ``progress(done, total)`` after every decoded token.
    prefill_attention : {"cache", "exact"}
        What the prompt's chunks attend over, see :meth:`LlamaModel.forward`.

    Returns
    -------
    ndarray, float32
        ``include_prefill=True``: shape ``(N, vocab)``, row ``i`` = logits of the token at
        position ``i + 1`` given ``tokens[: i + 1]``.  ``include_prefill=False``: shape
        ``(N - n_prefill + 1, vocab)``, rows for positions ``n_prefill - 1 .. N - 1`` (the
        first row comes from the last prefill position, i.e. an uncompressed history;
        every later row attends over what the cache stored).  The last row predicts a
        token beyond the sequence; for perplexity use ``rows[:-1]`` against
        ``tokens[start + 1:]``.

    Raises
    ------
    ValueError
        ``n_prefill`` out of range.

    Examples
    --------
    >>> dense = sequence_logits(model, ids, model.new_cache(), 64)           # doctest: +SKIP
    >>> pq = sequence_logits(model, ids, model.new_cache("pqo3"), 64)        # doctest: +SKIP
    >>> top1 = (dense[64:].argmax(-1) == pq[64:].argmax(-1)).mean()          # doctest: +SKIP
    """
    ids = model.check_tokens(tokens)
    n = ids.size
    if not _is_whole(n_prefill) or not 1 <= n_prefill <= n:
        raise ValueError(f"n_prefill: expected an int in [1, {n}], got {n_prefill!r}")
    n_prefill = int(n_prefill)
    start = int(cache.seq_len(0))
    vocab = model.config.vocab_size
    first = 0 if include_prefill else n_prefill - 1
    out = np.empty((n - first, vocab), dtype=np.float32)
    pre = model.forward(ids[:n_prefill], cache, start, mode="prefill", chunk_size=chunk_size,
                        logits="all" if include_prefill else "last", prefill_attention=prefill_attention)
    out[: pre.shape[0]] = pre
    row = pre.shape[0]
    for j in range(n_prefill, n):
        out[row] = model.step(ids[j:j + 1], cache, start + j, use_decode=True, logits="last")[0]
        row += 1
        if progress is not None:
            progress(j - n_prefill + 1, n - n_prefill)
    return out


@dataclass
class Generation:
    """Result of :func:`generate`.

    Attributes
    ----------
    text : str
        Decoded new tokens (without the prompt; special tokens skipped).
    prompt_ids, new_ids : list of int
        Prompt tokens and generated tokens (a final EOS included when it was produced).
    prefill_s, decode_s : float
        Wall time of the prompt pass and of the token-by-token loop.
    cache : CompressedKVCache
        The cache after generation (for ``memory_usage()`` etc.).
    """

    text: str
    prompt_ids: list[int]
    new_ids: list[int]
    prefill_s: float
    decode_s: float
    cache: Any = field(repr=False, default=None)

    @property
    def decode_tokens_per_s(self) -> float:
        """Generated tokens per second of the decode loop (first token excluded); NaN when the
        loop decoded none (one new token, or EOS first): there is no speed to report."""
        n = max(len(self.new_ids) - 1, 0)
        return n / self.decode_s if n and self.decode_s > 0 else float("nan")

    def __str__(self) -> str:
        return self.text


def generate(model: LlamaModel, tokenizer: Any, prompt: str | Sequence[int], max_new_tokens: int = 32,
             cache_factory: str | CacheFactory | None = None, *, chat: bool = False,
             stop_at_eos: bool = True, chunk_size: int | None = DEFAULT_CHUNK_SIZE,
             cache: Any = None, prefill_attention: str = "cache") -> Generation:
    """Greedy generation: prefill the prompt, then decode one token at a time.

    Parameters
    ----------
    model : LlamaModel
    tokenizer : GGUFTokenizer
    prompt : str or sequence of int
        Text (encoded with ``tokenizer``, at least one token) or token ids (ints in the
        model's vocabulary, see :meth:`LlamaModel.check_tokens`).
    max_new_tokens : int
        Upper bound on generated tokens (``>= 1``).
    cache_factory : str or callable, optional
        Cache to use, see :meth:`LlamaModel.new_cache` (default: ``DenseCache``).
    chat : bool
        Wrap a text prompt in the model's chat template as one user message.
    stop_at_eos : bool
        Stop after the tokenizer's EOS or an end-of-turn token (``tokenizer.eog_ids``: Gemma's
        ``<end_of_turn>``, ChatML's ``<|im_end|>``).
    chunk_size : int or None
        Prefill chunk.
    cache : CompressedKVCache, optional
        Use this (empty) cache instead of creating one.
    prefill_attention : {"cache", "exact"}
        What the prompt's chunks attend over, see :meth:`LlamaModel.forward`.

    Returns
    -------
    Generation

    Raises
    ------
    ValueError
        Bad ``max_new_tokens`` or ``prompt`` (no tokens, ids that are not ints or out of the
        vocabulary), or a ``cache`` without the model's geometry (before anything is stored).

    Examples
    --------
    >>> g = generate(model, tok, "The capital of France is", 8)   # doctest: +SKIP
    >>> "Paris" in g.text                                         # doctest: +SKIP
    True
    """
    if not _is_whole(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected an int >= 1, got {max_new_tokens!r}")
    if isinstance(prompt, str):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
        ids = tokenizer.encode(text)
        if len(ids) == 0:
            raise ValueError(f"prompt: the text {prompt!r} encodes to no tokens")
    else:
        ids = prompt
    ids = model.check_tokens(ids, "prompt").tolist()  # ints in the vocabulary (floats are not truncated)
    if cache is None:
        cache = model.new_cache(cache_factory)
    pos = int(cache.seq_len(0))
    # a generation ends on EOS or an end-of-turn token (Gemma's <end_of_turn>: its EOS is <eos>)
    eog = getattr(tokenizer, "eog_ids", None) or {getattr(tokenizer, "eos_id", None)} - {None}
    t0 = time.perf_counter()
    logits = model.forward(ids, cache, pos, mode="prefill", chunk_size=chunk_size, logits="last",
                           prefill_attention=prefill_attention)
    t1 = time.perf_counter()
    pos += len(ids)
    new: list[int] = []
    while True:
        nxt = int(np.argmax(logits[-1]))
        new.append(nxt)
        if len(new) >= max_new_tokens or (stop_at_eos and nxt in eog):
            break
        logits = model.step([nxt], cache, pos, use_decode=True, logits="last")
        pos += 1
    t2 = time.perf_counter()
    text = tokenizer.decode(new, skip_special_tokens=True)
    return Generation(text=text, prompt_ids=list(ids), new_ids=new, prefill_s=t1 - t0, decode_s=t2 - t1,
                      cache=cache)
