"""``GGUFTokenizer``: byte-level BPE rebuilt from GGUF metadata."""

from __future__ import annotations

from pathlib import Path

import pytest

from numba_kv.toolkit.models import GGUFTokenizer

pytest.importorskip("tokenizers", reason="needs the 'tokenizers' package (pip install tokenizers)")

from .tiny_gemma import tiny_spm_vocab
from .tiny_llama import MERGES, SPECIALS

GPL3 = Path("/usr/share/common-licenses/GPL-3")


# -- tiny vocabulary (fast) ------------------------------------------------------------------
def test_tiny_merges_and_specials(tiny):
    _, tok, _ = tiny
    assert tok.token_strings(tok.encode("the hat")) == ["t", "he", "Ġ", "h", "at"]  # no "t he" merge
    # "Ġt he" is a merge, so " the" is one token
    assert tok.token_strings(tok.encode(" the")) == ["Ġthe"]
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == SPECIALS.index("<|im_start|>") and ids[-1] == SPECIALS.index("<|im_end|>")
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"
    assert len(MERGES) + 256 + len(SPECIALS) == tok.vocab_size


def test_tiny_digits_are_split(tiny):
    _, tok, _ = tiny
    assert tok.token_strings(tok.encode("2024")) == ["2", "0", "2", "4"]


@pytest.mark.parametrize("text", [
    "Hello, world!", "  leading and trailing spaces  ", "tabs\tand\nnewlines\r\n\n",
    "Ünïcödé – “quotes” — 日本語のテキスト 🙂🚀", "x = f(3.14159) ** 2  # code", "",
])
def test_tiny_round_trip(tiny, text):
    _, tok, _ = tiny
    assert tok.decode(tok.encode(text)) == text


def test_bos_eos_flags(tiny):
    _, tok, _ = tiny
    assert not tok.add_bos and tok.bos_id == 1 and tok.eos_id == 2
    assert tok.encode("at", add_bos=True, add_eos=True) == [1, *tok.encode("at"), 2]
    with pytest.raises(TypeError, match="text"):
        tok.encode(b"bytes")


def test_unsupported_metadata():
    meta = {"ggml.model": "bert", "ggml.tokens": ["a"], "ggml.merges": []}  # ("llama" = SentencePiece)
    with pytest.raises(ValueError, match="ggml.model"):
        GGUFTokenizer(meta)
    meta = {"ggml.model": "gpt2", "ggml.tokens": ["a"], "ggml.merges": [], "ggml.pre": "klingon"}
    with pytest.raises(ValueError, match="klingon"):
        GGUFTokenizer(meta)
    GGUFTokenizer(meta, pre="gpt-2")  # override works


@pytest.mark.parametrize("pre", ["gpt-2", "llama-bpe", "qwen2", "smollm"])
def test_every_pre_tokenizer_round_trips(tiny, pre):
    _, tok, _ = tiny
    meta = {"ggml.model": "gpt2", "ggml.tokens": tok.tokens, "ggml.merges": MERGES, "ggml.pre": pre}
    t = GGUFTokenizer(meta)
    text = "It's 12345 o'clock;\n\n  the end 🙂"
    assert t.decode(t.encode(text)) == text


def test_chat_template_requires_chatml(tiny):
    _, tok, _ = tiny
    with pytest.raises(NotImplementedError, match="ChatML"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


# -- SmolLM2 vocabulary --------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_known_tokenizations(smollm2):
    _, tok = smollm2
    assert tok.pre == "smollm" and not tok.add_bos and tok.eos_id == 2
    assert tok.encode("Hello world") == [19556, 905]
    assert tok.token_strings(tok.encode("The capital of France is")) == \
        ["The", "Ġcapital", "Ġof", "ĠFrance", "Ġis"]
    # the "smollm" pre-tokenizer isolates every digit
    assert tok.token_strings(tok.encode("in 2024")) == ["in", "Ġ", "2", "0", "2", "4"]
    assert tok.encode("<|im_start|>") == [1] and tok.encode("<|im_end|>") == [2]


@pytest.mark.slow
def test_smollm2_round_trip_gpl3(smollm2):
    if not GPL3.is_file():
        pytest.skip(f"{GPL3} not present")
    _, tok = smollm2
    text = GPL3.read_text(encoding="utf-8")
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    # English prose compresses to roughly 4 characters per token
    assert 3.0 < len(text) / len(ids) < 6.0


@pytest.mark.slow
def test_smollm2_round_trip_unicode(smollm2):
    _, tok = smollm2
    text = ("Ünïcödé – “quotes” — 日本語のテキスト 🙂🚀\n"
            "\tx = f(3.14159) ** 2  # code\r\n")
    assert tok.decode(tok.encode(text)) == text


@pytest.mark.slow
def test_smollm2_chat_template(smollm2):
    _, tok = smollm2
    s = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert s == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                 "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    s = tok.apply_chat_template(msgs, add_generation_prompt=False)
    assert s == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"


# -- transformers' conversion of the same GGUF files, aligned ----------------------------------
def _hf_tokenizer(name):
    """transformers' tokenizer converted from the installed GGUF ``name``, and that path, or skip."""
    pytest.importorskip("transformers", reason="needs transformers (the hf extra)")
    from transformers import AutoTokenizer

    from numba_kv.toolkit.models import ModelNotFoundError, model_path
    try:
        path = model_path(name)
    except ModelNotFoundError as exc:
        pytest.skip(f"{name} not installed ({exc})")
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name), path


# text where transformers' conversion splits otherwise: whitespace before a digit (SmolLM2's
# "smollm" rule isolates digits first), runs of spaces (Gemma-3's user-defined pieces)
_SPLIT_TEXT = "TERMS AND CONDITIONS\n\n  0. Definitions.\n  32K x 8" + " " * 33 + "# a comment\n" + " " * 32 + "y"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2", "gemma3-270m"])
def test_align_makes_transformers_split_as_llama_cpp(name):
    hf, path = _hf_tokenizer(name)
    tok = GGUFTokenizer.from_gguf(path)
    texts = [_SPLIT_TEXT] + ([GPL3.read_text(encoding="utf-8")[:20000]] if GPL3.is_file() else [])
    before = [list(hf(t).input_ids) for t in texts]
    assert before[0] != tok.encode(_SPLIT_TEXT)  # the conversion's own split differs (else nothing to test)
    n_vocab = len(hf)
    assert tok.align(hf) is hf and len(hf) == n_vocab  # no new ids: the pieces keep theirs
    for t in texts:
        ids = list(hf(t).input_ids)
        assert ids == tok.encode(t)
        assert hf.decode(ids, skip_special_tokens=True) == t
    if name == "smollm2":  # whitespace before a digit: one token, as SmolLM2's tokenizer.json splits it
        assert tok.token_strings(tok.encode("\n\n  0"))[-1] == "0"
    else:  # a run of 33 spaces: the longest piece (31) first, as llama.cpp and SentencePiece match
        assert [len(s) for s in tok.token_strings(tok.encode("x" + " " * 33 + "y", add_bos=False))[1:3]] == [31, 2]


class _VocabOnly:
    """Stands in for a transformers tokenizer of the vocabulary ``vocab`` (what ``align`` checks first)."""

    def __init__(self, vocab):
        self.vocab = vocab

    def get_vocab(self):
        return dict(self.vocab)


@pytest.fixture
def tiny_gemma_tok():
    """The tiny SentencePiece vocabulary of the Gemma tests as a tokenizer (no file)."""
    tokens, scores, types = tiny_spm_vocab()
    return GGUFTokenizer({"ggml.model": "llama", "ggml.tokens": tokens, "ggml.scores": scores,
                          "ggml.token_type": types})


def test_align_refuses_another_vocabulary(tiny, tiny_gemma_tok):
    _, tok, _ = tiny
    with pytest.raises(ValueError, match=rf"hf_tokenizer: expected a tokenizer of the same GGUF vocabulary "
                                         rf"\({tok.vocab_size} tokens\), got 3 tokens"):
        tok.align(_VocabOnly({"a": 0, "b": 1, "c": 2}))
    # the same size, but the user-defined pieces are not where the GGUF file has them
    spm = tiny_gemma_tok
    with pytest.raises(ValueError, match="hf_tokenizer: expected the user-defined piece"):
        spm.align(_VocabOnly({f"t{i}": i for i in range(spm.vocab_size)}))
