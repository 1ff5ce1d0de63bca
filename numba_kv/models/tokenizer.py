"""Byte-level BPE tokenizer rebuilt from GGUF ``tokenizer.ggml.*`` metadata.

The vocabulary and merges come from the GGUF file; the pre-tokenizer is chosen from
``tokenizer.ggml.pre`` to reproduce llama.cpp's regex rules
(``llama-vocab.cpp``, ``llm_tokenizer_bpe`` constructor):

=====================================  ==================================================
``tokenizer.ggml.pre``                 pre-tokenizer
=====================================  ==================================================
``smollm``, ``starcoder``, ``refact``, split every digit (``\\p{N}``), then the GPT-2
``command-r``, ``codeshell``,          regex (HF: ``Digits(individual_digits=True)`` +
``exaone``, ``minerva``                ``ByteLevel``) — SmolLM2's ``tokenizer.json``
``gpt-2``, ``mpt``, ``olmo``, ``jais`` the GPT-2 regex (HF ``ByteLevel(use_regex=True)``)
``llama-bpe``, ``llama3``              the Llama-3 regex (digits in groups of ≤ 3)
``qwen2``, ``stablelm2``               the Llama-3 regex with single digits
=====================================  ==================================================

Control tokens (``tokenizer.ggml.token_type == 3``) and user-defined tokens (4) become
special added tokens, so ``"<|im_start|>"`` in a chat prompt is one token.
"""

from __future__ import annotations

from typing import Any, Iterable, List, Mapping, Optional, Sequence

__all__ = ["GGUFTokenizer", "PRE_TOKENIZERS"]

_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
_GPT2 = ("gpt-2", "gpt2", "mpt", "olmo", "jais")
_LLAMA3 = ("llama-bpe", "llama3")
_QWEN2 = ("qwen2", "stablelm2")
#: ``tokenizer.ggml.pre`` values this module knows how to reproduce.
PRE_TOKENIZERS = _DIGITS_THEN_GPT2 + _GPT2 + _LLAMA3 + _QWEN2

_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_REGEX = _LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")

# GGUF token types (llama.cpp ``llama_token_type``)
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4


def _import_tokenizers():
    try:
        import tokenizers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("the GGUF tokenizer needs the 'tokenizers' package: "
                          "`pip install tokenizers` (or `pip install numba-kv[models]`)") from exc
    return tokenizers


def _pre_tokenizer(pre: str):
    tk = _import_tokenizers()
    pt = tk.pre_tokenizers
    if pre in _DIGITS_THEN_GPT2:
        return pt.Sequence([pt.Digits(individual_digits=True),
                            pt.ByteLevel(add_prefix_space=False, use_regex=True)])
    if pre in _GPT2:
        return pt.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _LLAMA3 or pre in _QWEN2:
        regex = _LLAMA3_REGEX if pre in _LLAMA3 else _QWEN2_REGEX
        return pt.Sequence([pt.Split(tk.Regex(regex), behavior="isolated", invert=False),
                            pt.ByteLevel(add_prefix_space=False, use_regex=False)])
    raise ValueError(f"tokenizer.ggml.pre: expected one of {PRE_TOKENIZERS}, got {pre!r} "
                     "(pass pre=... to override)")


class GGUFTokenizer:
    """Byte-level BPE tokenizer (``tokenizer.ggml.model == "gpt2"``) from GGUF metadata.

    Parameters
    ----------
    metadata : mapping
        ``tokenizer.*`` metadata with the ``"tokenizer."`` prefix stripped, as in
        :attr:`numba_kv.models.gguf_loader.LoadedGGUF.tokenizer_metadata`; needs
        ``ggml.model``, ``ggml.tokens``, ``ggml.merges`` and optionally
        ``ggml.token_type``, ``ggml.pre``, ``ggml.bos_token_id``, ``ggml.eos_token_id``,
        ``ggml.add_bos_token``, ``ggml.add_eos_token``, ``chat_template``.
    pre : str, optional
        Overrides ``ggml.pre`` (one of :data:`PRE_TOKENIZERS`).

    Attributes
    ----------
    bos_id, eos_id : int or None
        Special token ids.
    add_bos, add_eos : bool
        Whether :meth:`encode` adds BOS/EOS by default (SmolLM2: neither).
    vocab_size : int
        Number of tokens.
    chat_template : str or None
        The Jinja chat template from the file (only ChatML is rendered, see
        :meth:`apply_chat_template`).

    Raises
    ------
    ValueError
        Unsupported ``ggml.model`` or ``ggml.pre``.

    Examples
    --------
    >>> from numba_kv.models import load_gguf, GGUFTokenizer   # doctest: +SKIP
    >>> tok = GGUFTokenizer(load_gguf().tokenizer_metadata)    # doctest: +SKIP
    >>> tok.decode(tok.encode("Hello world"))                   # doctest: +SKIP
    'Hello world'
    """

    def __init__(self, metadata: Mapping[str, Any], pre: Optional[str] = None) -> None:
        tk = _import_tokenizers()
        model = metadata.get("ggml.model")
        if model != "gpt2":
            raise ValueError("tokenizer.ggml.model: only byte-level BPE ('gpt2') is supported, "
                             f"got {model!r}")
        tokens: List[str] = list(metadata["ggml.tokens"])
        merges_raw: Sequence[str] = metadata["ggml.merges"]
        types: Sequence[int] = metadata.get("ggml.token_type") or [1] * len(tokens)
        self.pre = pre if pre is not None else str(metadata.get("ggml.pre", "gpt-2"))
        self.vocab_size = len(tokens)
        self.bos_id: Optional[int] = metadata.get("ggml.bos_token_id")
        self.eos_id: Optional[int] = metadata.get("ggml.eos_token_id")
        self.add_bos = bool(metadata.get("ggml.add_bos_token", False))
        self.add_eos = bool(metadata.get("ggml.add_eos_token", False))
        self.chat_template: Optional[str] = metadata.get("chat_template")
        self.tokens = tokens

        vocab = {t: i for i, t in enumerate(tokens)}
        # byte-level tokens never contain a real space (it is mapped to "Ġ"), so each
        # merge "a b" splits unambiguously at its single space
        merges = [tuple(m.split(" ", 1)) for m in merges_raw]
        bpe = tk.models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
        tok = tk.Tokenizer(bpe)
        tok.pre_tokenizer = _pre_tokenizer(self.pre)
        tok.decoder = tk.decoders.ByteLevel()
        specials = [tk.AddedToken(tokens[i], special=True, normalized=False)
                    for i, t in enumerate(types) if t in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED)]
        if specials:
            tok.add_special_tokens(specials)
        #: ids of control / user-defined tokens
        self.special_ids = frozenset(i for i, t in enumerate(types)
                                     if t in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED))
        self._tok = tok

    @classmethod
    def from_gguf(cls, path: Optional[Any] = None, cache_dir: Optional[Any] = None,
                  pre: Optional[str] = None) -> "GGUFTokenizer":
        """Tokenizer of a GGUF file (default: SmolLM2), via :func:`load_gguf`'s cache."""
        from .gguf_loader import load_gguf

        return cls(load_gguf(path, cache_dir).tokenizer_metadata, pre=pre)

    @property
    def backend(self):
        """The underlying :class:`tokenizers.Tokenizer`."""
        return self._tok

    def encode(self, text: str, add_bos: Optional[bool] = None, add_eos: Optional[bool] = None) -> List[int]:
        """Token ids of ``text``.

        Parameters
        ----------
        text : str
            Input; special-token strings such as ``"<|im_start|>"`` map to their ids.
        add_bos, add_eos : bool, optional
            Prepend BOS / append EOS; default from the GGUF metadata.

        Returns
        -------
        list of int
        """
        if not isinstance(text, str):
            raise TypeError(f"text: expected str, got {type(text).__name__}")
        ids = list(self._tok.encode(text, add_special_tokens=False).ids)
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids.insert(0, int(self.bos_id))
        if (self.add_eos if add_eos is None else add_eos) and self.eos_id is not None:
            ids.append(int(self.eos_id))
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids`` (byte-exact inverse of :meth:`encode` for valid UTF-8 text)."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_strings(self, ids: Iterable[int]) -> List[str]:
        """Raw vocabulary strings of ``ids`` (byte-level, ``"Ġ"`` = space)."""
        return [self.tokens[int(i)] for i in ids]

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]],
                            add_generation_prompt: bool = True) -> str:
        """Render a conversation with the model's ChatML template.

        Only ChatML (``<|im_start|>role\\ncontent<|im_end|>\\n``) is supported, which is
        what SmolLM2 uses; its template's default system prompt is inserted when the
        first message is not a system message.

        Parameters
        ----------
        messages : sequence of {"role": str, "content": str}
        add_generation_prompt : bool
            Append ``"<|im_start|>assistant\\n"``.

        Returns
        -------
        str
            The prompt text (encode it with :meth:`encode`).

        Raises
        ------
        NotImplementedError
            The file's template is not ChatML.
        """
        tpl = self.chat_template or ""
        if "<|im_start|>" not in tpl:
            raise NotImplementedError("apply_chat_template: only ChatML templates are supported")
        out = []
        default_system = _default_system_prompt(tpl)
        for i, m in enumerate(messages):
            if i == 0 and m["role"] != "system" and default_system is not None:
                out.append(f"<|im_start|>system\n{default_system}<|im_end|>\n")
            out.append(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n")
        if add_generation_prompt:
            out.append("<|im_start|>assistant\n")
        return "".join(out)


def _default_system_prompt(template: str) -> Optional[str]:
    """The literal system prompt a ChatML template inserts, if any."""
    import re

    # the newline may be literal or escaped ("\\n") depending on how the template was stored
    m = re.search(r"<\|im_start\|>system(?:\n|\\n)(.*?)<\|im_end\|>", template, flags=re.S)
    return m.group(1) if m else None
