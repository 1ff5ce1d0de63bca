"""``numba-kv eval --engine transformers`` on a tiny random Llama built from a config (seconds,
offline; skipped without torch / transformers)."""

from __future__ import annotations

import importlib.util
import json
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from numba_kv.toolkit import cli  # noqa: E402
from numba_kv.toolkit.evaluation import transformers_engine as te  # noqa: E402
from numba_kv.toolkit.specs import EvalConfigError  # noqa: E402

VOCAB = 128
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 64


class _ByteTokenizer:
    """Bytes modulo the vocabulary: enough for the text pass (no generation)."""

    def __call__(self, text: str, **_: object) -> types.SimpleNamespace:
        return types.SimpleNamespace(input_ids=[b % VOCAB for b in text.encode()])

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("latin-1")


@pytest.fixture
def tiny(monkeypatch, tmp_path):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                      max_position_embeddings=256)
    model = LlamaForCausalLM(cfg).eval()
    monkeypatch.setattr(te, "load_hf_model", lambda path=None: (model, _ByteTokenizer()))
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 4)
    return text


def test_cli_engine_transformers_json(tiny, tmp_path):
    out = tmp_path / "eval.json"
    assert cli.main(["eval", "--engine", "transformers", "--cache", "kv4,pqo4:residual_length=0,sink_tokens=0",
                     "--text", str(tiny), "--tokens", "48", "--prefill", "16", "--gen-tokens", "0",
                     "--no-progress", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["schema"] == "numba_kv.eval/1" and doc["config"]["engine"] == "transformers"
    assert doc["config"]["scored_positions"] == 48 - 16 - 1
    rows = {r["cache"]: r for r in doc["rows"]}
    assert list(rows) == ["dense", "kv4", "pqo4-r0-s0"]
    dense = rows["dense"]
    # DynamicCache holds float32 K and V of every token: exactly 32 bits per value
    assert dense["kv_bytes"] == 2 * LAYERS * KV_HEADS * HEAD_DIM * 48 * 4
    assert dense["bits_per_value"] == 32.0 and dense["attn"] == "sdpa"
    assert dense["ppl_change_pct"] == 0.0 and dense["kl_max"] == 0.0 and dense["top1_agreement"] == 1.0
    full = rows["pqo4-r0-s0"]  # every token compressed: about 4 bits + norms, far below float32
    assert full["attn"] == "numba_kv" and 4.0 < full["bits_per_value"] < 6.0
    assert 0.0 < full["kl_mean"] < 0.05 and full["top1_agreement"] > 0.8
    for r in doc["rows"]:
        assert r["decode_tokens_per_s"] > 0 and r["peak_rss_mib"] > 0 and r["rss_growth_mib"] >= 0
        assert np.isfinite(r["ppl"])


def test_bad_hf_cache_names_the_problem(capsys):
    with pytest.raises(EvalConfigError, match="hf-<backend><bits>"):
        te.parse_engine_caches("dense,hf-nosuch4")
    if importlib.util.find_spec("hqq") is None:
        assert cli.main(["eval", "--engine", "transformers", "--cache", "hf-hqq4"]) == 2
        assert "missing package 'hqq'" in capsys.readouterr().err
