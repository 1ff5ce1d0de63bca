"""``GGUFTokenizer``: byte-level BPE rebuilt from GGUF metadata."""

from __future__ import annotations

from pathlib import Path

import pytest

from numba_kv.toolkit.models import GGUFTokenizer

pytest.importorskip("tokenizers", reason="needs the 'tokenizers' package (pip install tokenizers)")

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
