"""Tokenizers rebuilt from GGUF ``tokenizer.ggml.*`` metadata: byte-level BPE (``ggml.model ==
"gpt2"``, SmolLM2) and SentencePiece BPE (``"llama"``, Gemma-3).

SentencePiece (``"llama"``)
---------------------------
The file holds pieces, scores and types but no merges.  llama.cpp's SPM tokenizer
(``llm_tokenizer_spm``) starts from UTF-8 characters and repeatedly joins the adjacent
pair whose concatenation is a vocabulary piece of the highest score; characters left
without a piece become byte tokens ``<0xXX>``.  That is a BPE whose merge list holds
every split ``(left, right)`` of every normal piece (both halves pieces themselves),
ranked by the score of the joined piece — the construction of Hugging Face's
``SentencePieceExtractor`` — with ``byte_fallback``.  Spaces are written ``"▁"`` (U+2581);
no space is prepended when ``ggml.add_space_prefix`` is false (Gemma).  Control tokens
(type 3) are special tokens; user-defined tokens (type 4: ``"\n"``, runs of spaces,
HTML tags, ...) are matched in the raw text first, as llama.cpp does.

Byte-level BPE (``"gpt2"``)
---------------------------
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

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .gguf_loader import read_tokenizer_metadata, require_package

__all__ = ["END_OF_TURN", "PRE_TOKENIZERS", "GGUFTokenizer"]

_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
_GPT2 = ("gpt-2", "gpt2", "mpt", "olmo", "jais")
_LLAMA3 = ("llama-bpe", "llama3")
_QWEN2 = ("qwen2", "stablelm2")
#: control tokens that end a turn in the chat formats (Gemma, ChatML, Llama 3, Phi-3, ...):
#: a generation stops on them as on EOS (:attr:`GGUFTokenizer.eog_ids`)
END_OF_TURN = frozenset({"<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|end|>", "<|endoftext|>", "<|eom_id|>"})
#: ``tokenizer.ggml.pre`` values this module knows how to reproduce.
PRE_TOKENIZERS = _DIGITS_THEN_GPT2 + _GPT2 + _LLAMA3 + _QWEN2

_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_REGEX = _LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")

# GGUF token types (llama.cpp ``llama_token_type``)
_TOKEN_NORMAL = 1
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4
_SPM_SPACE = "\u2581"


def _import_tokenizers():
    return require_package("tokenizers", "the GGUF tokenizer")


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


def _spm_merges(tokens: Sequence[str], scores: Sequence[float], types: Sequence[int]) -> list[tuple]:
    """BPE merges equivalent to SentencePiece-BPE segmentation by piece scores.

    Every normal piece ``p`` contributes each split ``(p[:i], p[i:])`` whose halves are
    pieces too; merges are ordered by the score of ``p`` (highest first), ties by the ids
    of the halves (Hugging Face ``SentencePieceExtractor.extract``).
    """
    vocab = {t: i for i, t in enumerate(tokens)}
    entries = []
    for i, (piece, score, typ) in enumerate(zip(tokens, scores, types)):
        if typ != _TOKEN_NORMAL or len(piece) < 2:
            continue
        local = []
        for j in range(1, len(piece)):
            left, right = piece[:j], piece[j:]
            li, ri = vocab.get(left), vocab.get(right)
            if li is not None and ri is not None:
                local.append((li, ri, left, right))
        local.sort()
        for li, ri, left, right in local:
            entries.append((-float(score), i, li, ri, left, right))
    entries.sort(key=lambda e: (e[0], e[1]))
    return [(e[4], e[5]) for e in entries]


class GGUFTokenizer:
    """Byte-level BPE (``ggml.model == "gpt2"``) or SentencePiece-BPE (``"llama"``) tokenizer
    from GGUF metadata.

    Parameters
    ----------
    metadata : mapping
        ``tokenizer.*`` metadata with the ``"tokenizer."`` prefix stripped, as in
        :attr:`numba_kv.toolkit.models.gguf_loader.LoadedGGUF.tokenizer_metadata`; needs
        ``ggml.model``, ``ggml.tokens``, ``ggml.merges`` (``"gpt2"``) or ``ggml.scores``
        (``"llama"``), and optionally ``ggml.token_type``, ``ggml.pre``, ``ggml.bos_token_id``,
        ``ggml.eos_token_id``, ``ggml.unknown_token_id``, ``ggml.add_bos_token``,
        ``ggml.add_eos_token``, ``ggml.add_space_prefix``, ``chat_template``.
    pre : str, optional
        Overrides ``ggml.pre`` (one of :data:`PRE_TOKENIZERS`; byte-level BPE only).

    Attributes
    ----------
    bos_id, eos_id : int or None
        Special token ids.
    eog_ids : frozenset of int
        The ids that end a generation: ``eos_id``, the file's ``ggml.eot_token_id`` /
        ``ggml.eom_token_id``, and the end-of-turn control tokens of the chat formats
        (:data:`END_OF_TURN`: Gemma's ``<end_of_turn>``, ChatML's ``<|im_end|>``, ...), as
        llama.cpp stops on them.
    add_bos, add_eos : bool
        Whether :meth:`encode` adds BOS/EOS by default (SmolLM2: neither; Gemma-3: BOS).
    kind : str
        ``"bpe"`` (byte-level) or ``"spm"`` (SentencePiece BPE).
    vocab_size : int
        Number of tokens.
    chat_template : str or None
        The Jinja chat template from the file (ChatML and Gemma's turn format are
        rendered, see :meth:`apply_chat_template`).

    Raises
    ------
    ValueError
        Unsupported ``ggml.model`` or ``ggml.pre``.

    Examples
    --------
    >>> from numba_kv.toolkit.models import load_gguf, GGUFTokenizer   # doctest: +SKIP
    >>> tok = GGUFTokenizer(load_gguf().tokenizer_metadata)    # doctest: +SKIP
    >>> tok.decode(tok.encode("Hello world"))                   # doctest: +SKIP
    'Hello world'
    """

    def __init__(self, metadata: Mapping[str, Any], pre: str | None = None) -> None:
        tk = _import_tokenizers()
        model = metadata.get("ggml.model")
        if model not in ("gpt2", "llama"):
            raise ValueError("tokenizer.ggml.model: only byte-level BPE ('gpt2') and SentencePiece BPE "
                             "('llama') "
                             f"are supported, got {model!r}")
        tokens: list[str] = list(metadata["ggml.tokens"])
        types: Sequence[int] = metadata.get("ggml.token_type") or [1] * len(tokens)
        self.kind = "bpe" if model == "gpt2" else "spm"
        default_pre = "gpt-2" if model == "gpt2" else "default"
        self.pre = pre if pre is not None else str(metadata.get("ggml.pre", default_pre))
        self.vocab_size = len(tokens)
        self.bos_id: int | None = metadata.get("ggml.bos_token_id")
        self.eos_id: int | None = metadata.get("ggml.eos_token_id")
        self.add_bos = bool(metadata.get("ggml.add_bos_token", model == "llama"))
        self.add_eos = bool(metadata.get("ggml.add_eos_token", False))
        self.chat_template: str | None = metadata.get("chat_template")
        self.tokens = tokens
        eog = {metadata.get(k) for k in ("ggml.eos_token_id", "ggml.eot_token_id", "ggml.eom_token_id")}
        eog.update(i for i, t in enumerate(tokens) if t in END_OF_TURN and types[i] != _TOKEN_NORMAL)
        self.eog_ids: frozenset[int] = frozenset(int(i) for i in eog if i is not None)

        if model == "gpt2":
            vocab = {t: i for i, t in enumerate(tokens)}
            # byte-level tokens never contain a real space (it is mapped to "Ġ"), so each
            # merge "a b" splits unambiguously at its single space
            merges = [tuple(m.split(" ", 1)) for m in metadata["ggml.merges"]]
            bpe = tk.models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
            tok = tk.Tokenizer(bpe)
            tok.pre_tokenizer = _pre_tokenizer(self.pre)
            tok.decoder = tk.decoders.ByteLevel()
            user = []
        else:
            scores = metadata.get("ggml.scores")
            if scores is None:
                raise ValueError("tokenizer.ggml.scores: required for a SentencePiece ('llama') vocabulary")
            # the vocabulary may repeat a string (e.g. unused control slots): the first id wins
            vocab = {}
            for i, t in enumerate(tokens):
                vocab.setdefault(t, i)
            unk_id = metadata.get("ggml.unknown_token_id")
            unk = tokens[int(unk_id)] if unk_id is not None else None
            bpe = tk.models.BPE(vocab=vocab, merges=_spm_merges(tokens, scores, types), unk_token=unk,
                                fuse_unk=True, byte_fallback=True)
            tok = tk.Tokenizer(bpe)
            norms = [tk.normalizers.Replace(" ", _SPM_SPACE)]
            if metadata.get("ggml.add_space_prefix", True):
                norms.insert(0, tk.normalizers.Prepend(_SPM_SPACE))
            tok.normalizer = tk.normalizers.Sequence(norms)
            dec = [tk.decoders.Replace(_SPM_SPACE, " "), tk.decoders.ByteFallback(), tk.decoders.Fuse()]
            if metadata.get("ggml.add_space_prefix", True):
                dec.append(tk.decoders.Strip(" ", 1, 0))
            tok.decoder = tk.decoders.Sequence(dec)
            # user-defined pieces ("\n", runs of spaces, ...) are matched in the raw text
            user = [tk.AddedToken(tokens[i], special=False, normalized=False)
                    for i, t in enumerate(types) if t == _TOKEN_USER_DEFINED]
        # byte-level BPE: user-defined tokens are special too (as before); SPM: see `user`
        special_types = (_TOKEN_CONTROL, _TOKEN_USER_DEFINED) if model == "gpt2" else (_TOKEN_CONTROL,)
        specials = [tk.AddedToken(tokens[i], special=True, normalized=False)
                    for i, t in enumerate(types) if t in special_types]
        if specials:
            tok.add_special_tokens(specials)
        if user:
            tok.add_tokens(user)
        #: ids of control / user-defined tokens
        self.special_ids = frozenset(i for i, t in enumerate(types)
                                     if t in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED))
        self._user_ids = [i for i, t in enumerate(types) if t == _TOKEN_USER_DEFINED]
        self._tok = tok

    @classmethod
    def from_gguf(cls, path: Any | None = None, cache_dir: Any | None = None,
                  pre: str | None = None) -> GGUFTokenizer:
        """Tokenizer of a GGUF file (default: SmolLM2): :func:`read_tokenizer_metadata` (the
        converted cache's copy when fresh, else the file's; the weights are not converted)."""
        return cls(read_tokenizer_metadata(path, cache_dir), pre=pre)

    def align(self, hf_tokenizer: Any) -> Any:
        """Make a transformers tokenizer converted from the same GGUF file split text as this one.

        transformers' GGUF conversion (``AutoTokenizer.from_pretrained(..., gguf_file=...)``)
        knows fewer ``tokenizer.ggml.pre`` rules than llama.cpp: a byte-level vocabulary whose
        rule it lacks gets the plain GPT-2 regex (SmolLM2's ``smollm`` rule splits every digit
        first, so ``"\\n\\n  0"`` became three tokens where the model's own ``tokenizer.json``
        and llama.cpp make two), and a SentencePiece vocabulary's user-defined pieces are not
        matched first (Gemma-3: a run of 33 spaces became 16 + 17 spaces, not 31 + 2).  This
        gives ``hf_tokenizer`` this tokenizer's pre-tokenizer (byte-level) or adds the
        user-defined pieces as added tokens under their own ids (SentencePiece); the ids,
        BOS handling and decoding stay transformers'.

        Parameters
        ----------
        hf_tokenizer : transformers tokenizer
            A fast tokenizer of the same vocabulary (``backend_tokenizer``, ``get_vocab``,
            ``add_tokens``).

        Returns
        -------
        transformers tokenizer
            ``hf_tokenizer``, changed in place.

        Raises
        ------
        ValueError
            ``hf_tokenizer``'s vocabulary is not this one's (another size, or a user-defined
            piece missing).
        """
        tk = _import_tokenizers()
        vocab = hf_tokenizer.get_vocab()
        if len(vocab) != self.vocab_size:
            raise ValueError(f"hf_tokenizer: expected a tokenizer of the same GGUF vocabulary ({self.vocab_size} "
                             f"tokens), got {len(vocab)} tokens")
        if self.kind == "bpe":
            hf_tokenizer.backend_tokenizer.pre_tokenizer = _pre_tokenizer(self.pre)
            return hf_tokenizer
        # transformers' vocabulary writes a piece's spaces as "▁" (its normalizer's output):
        # normalized added tokens of those strings match the raw runs under their own ids
        pieces = [self.tokens[i].replace(" ", _SPM_SPACE) for i in self._user_ids]
        wrong = next((p for p, i in zip(pieces, self._user_ids) if vocab.get(p) != i), None)
        if wrong is not None:
            raise ValueError(f"hf_tokenizer: expected the user-defined piece {wrong!r} of the GGUF vocabulary "
                             f"at id {self._user_ids[pieces.index(wrong)]}, got {vocab.get(wrong)}")
        hf_tokenizer.add_tokens([tk.AddedToken(p, special=False, normalized=True) for p in pieces])
        return hf_tokenizer

    @property
    def backend(self):
        """The underlying :class:`tokenizers.Tokenizer`."""
        return self._tok

    def encode(self, text: str, add_bos: bool | None = None, add_eos: bool | None = None) -> list[int]:
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

    def _check_ids(self, ids: Iterable[int]) -> list[int]:
        """``ids`` as ints in ``[0, vocab_size)``; ``ValueError`` naming ``ids`` otherwise (an id past
        the vocabulary decoded to nothing and ``-1`` overflowed in ``decode`` or, in
        :meth:`token_strings`, indexed the last token)."""
        out = [int(i) for i in ids]
        bad = next((i for i in out if not 0 <= i < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"ids: expected token ids in [0, {self.vocab_size}), got {bad}")
        return out

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids`` (byte-exact inverse of :meth:`encode` for valid UTF-8 text); ``ValueError``
        for an id outside the vocabulary."""
        return self._tok.decode(self._check_ids(ids), skip_special_tokens=skip_special_tokens)

    def token_strings(self, ids: Iterable[int]) -> list[str]:
        """Raw vocabulary strings of ``ids`` (byte-level ``"Ġ"`` / SentencePiece ``"▁"`` = space);
        ``ValueError`` for an id outside the vocabulary."""
        return [self.tokens[i] for i in self._check_ids(ids)]

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]],
                            add_generation_prompt: bool = True) -> str:
        """Render a conversation with the model's ChatML or Gemma turn template.

        ChatML (``<|im_start|>role\\ncontent<|im_end|>\\n``) is what SmolLM2 uses; its
        template's default system prompt is inserted when the first message is not a
        system message.  Gemma (a vocabulary with ``<start_of_turn>``, the template may be
        absent from the file): ``<start_of_turn>user\\ncontent<end_of_turn>\\n``, role
        ``assistant`` written ``model``, a system message prepended to the first user turn.

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
            The file's template is neither ChatML nor Gemma's.
        """
        tpl = self.chat_template or ""
        if "<start_of_turn>" in tpl or (not tpl and "<start_of_turn>" in self.tokens[:1024]):
            return self._gemma_chat(messages, add_generation_prompt)
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

    def _gemma_chat(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool) -> str:
        # Gemma-3's template: a leading system message (as it is) prefixes the first turn, each
        # turn's content is trimmed
        out, system = [], ""
        for i, m in enumerate(messages):
            if m["role"] == "system":
                if i:
                    raise ValueError(f"messages[{i}]: Gemma's chat template takes a system message only first")
                system = m["content"] + "\n\n"
                continue
            role = "model" if m["role"] == "assistant" else m["role"]
            out.append(f"<start_of_turn>{role}\n{system}{m['content'].strip()}<end_of_turn>\n")
            system = ""
        if add_generation_prompt:
            out.append("<start_of_turn>model\n")
        return "".join(out)


def _default_system_prompt(template: str) -> str | None:
    """The literal system prompt a ChatML template inserts, if any."""
    # the newline may be literal or escaped ("\\n") depending on how the template was stored
    m = re.search(r"<\|im_start\|>system(?:\n|\\n)(.*?)<\|im_end\|>", template, flags=re.DOTALL)
    return m.group(1) if m else None
