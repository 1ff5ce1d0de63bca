"""QA of the NumPy model's side paths against independent references: the analysis' one-pass
engine on a Gemma-3 model (the tiny random Gemma of ``models/tiny_gemma.py`` and its float64
reference forward), the per-layer attention statistics of sliding-window layers, and the
evaluation harness' Gemma-specific choices (prompts, context limits, attention scale).

Tolerance convention as in ``models/test_llama.py``: ``max|a - b| <= 1e-4 · max|b|``.
"""

from __future__ import annotations

import types

import numpy as np
import pytest

from numba_kv import DenseCache, PolarQuantCache
from numba_kv.metrics import compare_logits
from numba_kv.toolkit.evaluation.analysis import _layer_stats
from numba_kv.toolkit.evaluation.kv_split import KVSplitCache
from numba_kv.toolkit.evaluation.simulate import simulate_logits
from numba_kv.toolkit.models import sequence_logits

from .conftest import need_model_packages
from .models.test_llama import assert_close
from .models.tiny_gemma import TINY_GEMMA, gemma_reference_logits, load_tiny_gemma


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory):
    """``(model, hf_weights)`` of the random tiny Gemma-3 (6 layers, window 5, layer 5 global)."""
    need_model_packages()
    model, _, hf = load_tiny_gemma(tmp_path_factory.mktemp("qa_tiny_gemma"))
    return model, hf


# -- the one-pass engine (simulate_logits) on Gemma-3 -------------------------------------------
@pytest.mark.parametrize("cs", [None, 4])
def test_simulate_logits_is_the_gemma_forward(tiny_gemma, cs):
    """Unquantized, the one-pass engine is the model: on Gemma-3 it must scale the embedding,
    QK-norm, use NEOX RoPE with the local / global bases, the post-norms, GELU-tanh and the
    sliding window (20 tokens, window 5).  It ran SmolLM2's Llama block instead (logits off by
    hundreds on Gemma-3-270M, top-1 agreement 0)."""
    model, hf = tiny_gemma
    ids = np.random.default_rng(3).integers(4, model.config.vocab_size, 20)
    p = 8
    assert ids.size - p > TINY_GEMMA["window"]  # decode rows whose local layers' window binds
    sim = simulate_logits(model, ids, p, chunk_size=cs)
    assert_close(sim, gemma_reference_logits(hf, ids)[p - 1:])


def test_simulate_logits_matches_the_gemma_protocol_when_quantized(tiny_gemma):
    """Quantized keys (3 bits, window 3 + 2 sinks) through the protocol (a non-sliding
    PolarQuantCache, as ``analyze_kv`` builds them: the model masks the local layers' history)
    and through the one-pass engine: the same distributions (KL between them a thousandth of
    their KL to dense, logits within 2e-2 as the Llama test of ``test_analysis.py``)."""
    model, _ = tiny_gemma
    c = model.config
    geom = (c.n_layers, c.n_kv_heads, c.head_dim)
    ids = np.random.default_rng(5).integers(4, c.vocab_size, 24)
    p = 10
    dense = sequence_logits(model, ids, DenseCache(*geom), p, chunk_size=4, include_prefill=False)
    cache = KVSplitCache(PolarQuantCache(*geom, bits=3, residual_length=3, sink_tokens=2,
                                         decode_output="dequantized"), DenseCache(*geom), "k")
    a = sequence_logits(model, ids, cache, p, chunk_size=4, include_prefill=False)
    b = simulate_logits(model, ids, p, chunk_size=4, k_quant=3, residual_length=3, sink_tokens=2)
    kl_between = compare_logits(a[1:-1], b[1:-1], ids[p + 1:])["kl_mean"]
    kl_dense = compare_logits(dense[1:-1], a[1:-1], ids[p + 1:])["kl_mean"]
    assert kl_dense > 1e-3  # the quantization is visible, so the agreement means something
    assert kl_between <= 1e-3 * kl_dense
    np.testing.assert_allclose(a, b, atol=2e-2)


def test_layer_stats_of_a_sliding_layer_see_only_the_window():
    """The attention errors of a sliding-window layer's last query over the whole history with
    ``sliding_window=W`` equal those over just its last ``W`` keys (no window: the layer's
    queries never see the rest); before, every key of the history was counted."""
    rng = np.random.default_rng(7)
    t, w, hd, groups = 24, 6, 32, 2
    q = rng.standard_normal((1, 2 * groups, t, hd)).astype(np.float32)
    k = rng.standard_normal((1, 2, t, hd)).astype(np.float32) * 3
    v = rng.standard_normal((1, 2, t, hd)).astype(np.float32)
    scale = hd ** -0.5
    got = _layer_stats(q, k, v, t - 1, (3,), [(0, 0)], scale, groups, sliding_window=w)["attn"]["pqo3-r0-s0"]
    tail = slice(t - w, t)
    ref = _layer_stats(q[:, :, tail], k[:, :, tail], v[:, :, tail], w - 1, (3,), [(0, 0)], scale,
                       groups)["attn"]["pqo3-r0-s0"]
    full = _layer_stats(q, k, v, t - 1, (3,), [(0, 0)], scale, groups)["attn"]["pqo3-r0-s0"]
    for key in ("kl", "logit_err_std", "logit_std", "k_out_err", "v_out_err"):
        np.testing.assert_allclose(got[key], ref[key], rtol=1e-9, atol=1e-12, err_msg=key)
    assert not np.allclose(full["kl"], ref["kl"], rtol=1e-3)  # the window changes the answer



# -- the transformers engine on a Gemma-3 model ----------------------------------------------------
def test_transformers_engine_asks_gemma3_its_own_prompts(monkeypatch, tmp_path):
    """``--engine transformers`` with a Gemma-3 model must greedy-decode :data:`GEMMA3_PROMPTS`
    (the Q/A frame of the Paris check) as the NumPy engine does; it always took SmolLM2's
    prompts (``default_prompts(None)``), so Gemma-3-270M's Paris check failed by construction."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from numba_kv.toolkit.evaluation import transformers_engine as te
    from numba_kv.toolkit.evaluation.evaluate import DEFAULT_PROMPTS, GEMMA3_PROMPTS

    vocab = 96

    class ByteTokenizer:
        def __call__(self, text, return_tensors=None, **_):
            ids = [2] + [4 + b % (vocab - 4) for b in text.encode()]
            return types.SimpleNamespace(input_ids=torch.tensor([ids]) if return_tensors == "pt" else ids)

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    torch.manual_seed(0)
    cfg = transformers.Gemma3TextConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=4,
                                        max_position_embeddings=128)
    model = transformers.Gemma3ForCausalLM(cfg).eval()
    text = tmp_path / "text.txt"
    text.write_text("A short text for the tiny model. " * 3)
    res = te.run_eval_transformers([], model=model, tokenizer=ByteTokenizer(), text_path=text, tokens=12, prefill=6,
                                   gen_tokens=1, progress=False)
    assert res.config["prompts"] == list(GEMMA3_PROMPTS)
    assert [g["prompt"] for g in res.rows[0].generations] == list(GEMMA3_PROMPTS)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=128))
    assert te.default_prompts(llama) == DEFAULT_PROMPTS


# -- Gemma-3 hyper-parameters --------------------------------------------------------------------
@pytest.mark.parametrize("layers,dim,heads,head_dim,scalar", [
    (62, 5376, 32, 128, 168),   # gemma-3-27b: query_pre_attn_scalar = dim / heads = 168, not head_dim
    (26, 1152, 4, 256, 256),    # gemma-3-1b: head_dim (dim / heads would be 288)
    (18, 640, 4, 256, 256),     # gemma-3-270m
])
def test_gemma3_attention_scale_follows_query_pre_attn_scalar(layers, dim, heads, head_dim, scalar):
    """A Gemma-3 file without ``attention.scale`` scales q·k by the HF config's
    ``query_pre_attn_scalar^-1/2`` (llama.cpp: ``1/sqrt(n_embd / n_head)`` on the 27B, identified by
    its 62 layers, ``1/sqrt(head_dim)`` otherwise); the 27B got ``1/sqrt(128)``."""
    from numba_kv.toolkit.models.gguf_loader import _config_from_metadata

    meta = {"general.architecture": "gemma3", "gemma3.block_count": layers, "gemma3.embedding_length": dim,
            "gemma3.feed_forward_length": 4 * dim, "gemma3.attention.head_count": heads,
            "gemma3.attention.head_count_kv": max(1, heads // 2), "gemma3.attention.key_length": head_dim,
            "gemma3.attention.sliding_window": 512}
    c = _config_from_metadata(meta, {"token_embd.weight": (1000, dim)})
    assert c.softmax_scale == pytest.approx(scalar ** -0.5, rel=1e-12)


# -- bad arguments name themselves -----------------------------------------------------------------
def test_count_arguments_name_themselves(tiny):
    """``None`` as ``n_prefill`` / ``max_new_tokens`` was an unnamed ``TypeError`` from ``int()``;
    ``logits_chunk`` of 0, -5 or 2.5 ran silently (as 1, 1 and 2 rows)."""
    from numba_kv.toolkit.models import generate

    model, tok, _ = tiny
    ids = [5, 6, 7, 8]
    for bad in (None, "2", float("nan"), True):
        with pytest.raises(ValueError, match="n_prefill"):
            sequence_logits(model, ids, model.new_cache(), bad)
        with pytest.raises(ValueError, match="max_new_tokens"):
            generate(model, tok, ids, bad)
    assert sequence_logits(model, ids, model.new_cache(), 2.0).shape == (4, model.config.vocab_size)
    for bad in (0, -5, 2.5, "a", None, True):
        with pytest.raises(ValueError, match="logits_chunk"):
            model.decode_layer_major(ids, model.new_cache(), 0, logits_chunk=bad)


def test_tokenizer_refuses_ids_outside_the_vocabulary(tiny):
    """An id past the vocabulary decoded to ``""``, ``-1`` overflowed inside ``tokenizers`` and, in
    ``token_strings``, silently named the last token."""
    _, tok, _ = tiny
    n = tok.vocab_size
    assert tok.decode(tok.encode("the cat")) == "the cat"
    for bad in ([n], [3, -1], [n + 10**6]):
        with pytest.raises(ValueError, match=r"ids: expected token ids in \[0, "):
            tok.decode(bad)
        with pytest.raises(ValueError, match="ids"):
            tok.token_strings(bad)
    assert tok.token_strings([n - 1]) == [tok.tokens[n - 1]]
