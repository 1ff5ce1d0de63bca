"""numba_kv.integrations.transformers: what a user meets outside the common path — configs that
declare sliding layers without ``layer_types``, multimodal configs, copied caches, refused
inputs — each checked against transformers' own ``DynamicCache`` on the same tiny random model.

Skipped when torch or transformers (the ``hf`` extra) is missing.
"""

from __future__ import annotations

import copy
import inspect

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    DynamicCache,
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3nTextConfig,
    Gemma3TextConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    SiglipVisionConfig,
)

from numba_kv import make_cache  # noqa: E402
from numba_kv.integrations.transformers import NumbaKVCache, model_geometry  # noqa: E402

from .test_transformers import VOCAB, _llama  # noqa: E402  (the same tiny random Llama)

WINDOW = 8
CACHE = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"


def _ids(batch: int = 2, n: int = 20, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, n), generator=torch.Generator().manual_seed(seed))


def _mistral() -> MistralForCausalLM:
    """A config with ``sliding_window`` and no ``layer_types`` (Mistral-7B-v0.1's form)."""
    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
                        sliding_window=WINDOW)
    return MistralForCausalLM(cfg).eval()


def _gemma3_vlm() -> Gemma3ForConditionalGeneration:
    """Gemma-3 with a vision tower: the decoder's attention reads ``config.text_config``."""
    torch.manual_seed(1)
    text = Gemma3TextConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=64, query_pre_attn_scalar=64,
                            sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
                            max_position_embeddings=256)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    cfg = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=299,
                       boi_token_index=297, eoi_token_index=298)
    return Gemma3ForConditionalGeneration(cfg).eval()


@torch.no_grad()
def _run(model, cache, ids: torch.Tensor, steps: int = 4) -> list[torch.Tensor]:
    """Last-position logits of the prompt, then of ``steps`` fixed one-token decode steps."""
    out = [model(input_ids=ids, **{CACHE: cache}).logits[:, -1]]
    nxt = _ids(ids.shape[0], steps, seed=99)
    for t in range(steps):
        out.append(model(input_ids=nxt[:, t:t + 1], **{CACHE: cache}).logits[:, -1])
    return out


# -- layer types -----------------------------------------------------------------------------------------

def test_sliding_window_without_layer_types_gives_sliding_layers():
    """Mistral's config has ``sliding_window`` but no ``layer_types``; transformers then makes every
    layer sliding (``DynamicCache(config=...)``, the model's sliding masks).  The cache has the same
    layers, equals DynamicCache bit for bit past the window, and its fused decode runs (it raised
    the padded-batch error: the sliding mask hid keys that full layers had kept)."""
    model = _mistral()
    ref_cache = DynamicCache(config=model.config)
    cache = NumbaKVCache.from_model(model, "dense")
    assert cache.is_sliding == ref_cache.is_sliding == [True, True]
    assert [la.get_max_length() for la in cache.layers] == [la.get_max_length() for la in ref_cache.layers]
    ref = _run(model, ref_cache, _ids())  # 20-token prompt + 4 steps: over the window of 8
    got = _run(model, cache, _ids())
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    assert cache.layers[0].cache.stored_len(0) == WINDOW  # stores only what its queries can see
    model.set_attn_implementation("numba_kv")
    try:
        fused = _run(model, NumbaKVCache.from_model(model, "dense"), _ids())
    finally:
        model.set_attn_implementation("sdpa")
    for a, b in zip(ref, fused):
        assert torch.allclose(a, b, rtol=0, atol=2e-6), (a - b).abs().max()


def test_kv_sharing_layers_are_refused_by_name():
    """Gemma-3n's later layers reuse earlier layers' K/V (``kv_sharing_modes``): not served, said
    up front instead of building layers the model never fills."""
    cfg = Gemma3nTextConfig()
    with pytest.raises(ValueError, match="'kv_shared'"):
        model_geometry(cfg)
    with pytest.raises(ValueError, match="'kv_shared'"):
        NumbaKVCache.from_config(cfg, "dense")


def test_an_attention_free_config_is_refused_by_name():
    """A state-space model's config (Mamba: no attention heads) is refused with a ValueError that
    says why, not an AttributeError from inside."""
    cfg = transformers.MambaConfig(num_hidden_layers=2)
    with pytest.raises(ValueError, match="num_attention_heads"):
        model_geometry(cfg)
    with pytest.raises(ValueError, match="attention layers"):
        NumbaKVCache.from_config(cfg, "dense")


# -- which attn_implementation the cache follows ---------------------------------------------------------

def test_fused_follows_the_decoders_text_config():
    """A multimodal model's decoder attention reads ``config.text_config._attn_implementation``.
    Text config ``numba_kv`` (outer ``sdpa``): the layers take the fused path.  The reverse: the
    dequantized path, equal to DynamicCache (before: fused markers that sdpa ignored, a crash)."""
    model = _gemma3_vlm()
    ids = _ids(vocab=290)
    ref = _run(model, DynamicCache(config=model.config), ids)
    model.set_attn_implementation({"": "sdpa", "text_config": "numba_kv", "vision_config": "sdpa"})
    cache = NumbaKVCache.from_model(model, "dense")
    assert all(la.fused for la in cache.layers)
    for a, b in zip(ref, _run(model, cache, ids)):
        assert torch.allclose(a, b, rtol=0, atol=2e-6), (a - b).abs().max()
    model.set_attn_implementation({"": "numba_kv", "text_config": "sdpa", "vision_config": "sdpa"})
    cache = NumbaKVCache.from_model(model, "dense")
    assert not any(la.fused for la in cache.layers)
    for a, b in zip(ref, _run(model, cache, ids)):
        assert torch.equal(a, b)


def test_a_deep_copy_follows_the_model_too():
    """transformers' prompt-reuse recipe: ``copy.deepcopy`` of a prefilled cache.  The copy shares
    the model's config, so after ``set_attn_implementation("sdpa")`` it takes the dequantized path
    (a copied config kept it on the fused path: sdpa attended the new token alone, which was never
    stored); it holds its own K/V, the original is untouched."""
    model = _llama()
    ids, nxt = _ids(), _ids(2, 1, seed=4)
    model.set_attn_implementation("numba_kv")
    try:
        base = NumbaKVCache.from_model(model, "dense")
        with torch.no_grad():
            model(ids, **{CACHE: base})
        copied = copy.deepcopy(base)
        assert copied.layers[0].config is model.config and copied.layers[0].cache is not base.layers[0].cache
    finally:
        model.set_attn_implementation("sdpa")
    ref = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, **{CACHE: ref})
        want = model(nxt, **{CACHE: ref}).logits
        got = model(nxt, **{CACHE: copied}).logits
    assert torch.equal(got, want)
    assert copied.get_seq_length() == 21 and base.get_seq_length() == 20


# -- refused input changes nothing ---------------------------------------------------------------------

def test_a_refused_first_update_leaves_the_layer_empty():
    """NaN keys on an empty layer are refused by the numba_kv cache; the layer must not look
    initialized afterwards (``Cache.batch_size`` / ``is_initialized`` reported the refused batch)."""
    cache = NumbaKVCache.from_config(_llama().config, "kv4")
    k = torch.randn(3, 2, 5, 64)
    k[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="finite"):
        cache.update(k, k, 0)
    layer = cache.layers[0]
    assert not layer.is_initialized and layer.dtype is None and not hasattr(layer, "batch_size")
    assert cache.batch_size == -1 and cache.get_seq_length() == 0 and cache.memory_usage() == 0
    good = torch.randn(2, 2, 5, 64, dtype=torch.float16)
    rk, _ = cache.update(good, good, 0)
    assert rk is good and cache.batch_size == 2 and layer.dtype == torch.float16


def test_batch_errors_name_the_argument_and_change_nothing():
    cache = NumbaKVCache.from_config(_llama().config, "kv4")
    k = torch.randn(2, 2, 6, 64)
    cache.update(k, k, 0)
    with pytest.raises(ValueError, match=r"beam_idx: expected batch rows in \[0, 2\)"):
        cache.reorder_cache(torch.tensor([0, 5]))
    with pytest.raises(ValueError, match=r"indices: expected a boolean mask of shape \(2,\)"):
        cache.batch_select_indices(torch.tensor([True]))  # taken as "keep row 0" before
    with pytest.raises(ValueError, match=r"key_states: this layer holds 2 sequences, got a batch of 3 \(reset"):
        cache.update(torch.randn(3, 2, 1, 64), torch.randn(3, 2, 1, 64), 0)
    assert cache.batch_size == 2 and cache.get_seq_length() == 6
    cache.batch_select_indices(torch.tensor([False, True]))  # a mask of one entry per row still works
    assert cache.batch_size == 1


def test_core_errors_name_the_models_arguments():
    """The core cache names its arguments ``k`` / ``v``; through the transformers cache the error
    names what the model passed (``key_states`` / ``value_states``), keeps the core's reason, and
    nothing is stored."""
    cache = NumbaKVCache.from_config(_llama().config, "kv4")
    k = torch.randn(1, 2, 6, 64)
    cache.update(k, k, 0)
    bad = torch.randn(1, 2, 3, 64)
    bad[0, 1, 2, 5] = float("inf")
    with pytest.raises(ValueError, match=r"^key_states \(numba_kv's k\): .*finite") as err:
        cache.update(bad, k[:, :, :3], 0)
    assert isinstance(err.value.__cause__, ValueError) and str(err.value.__cause__).startswith("k: ")
    with pytest.raises(ValueError, match=r"^value_states \(numba_kv's v\): .*finite"):
        cache.update(k[:, :, :3], bad, 0)
    assert cache.get_seq_length() == 6


def test_a_cache_built_for_another_window_is_refused_on_the_fused_path():
    """A cache made from a config with another ``sliding_window`` than the model's would attend
    another span (its window lives in its buffers): the fused step raises, naming both windows."""
    model = _mistral()
    model.set_attn_implementation("numba_kv")
    other = copy.deepcopy(model.config)  # (another model's config, also on the fused path)
    other.sliding_window = 2 * WINDOW
    cache = NumbaKVCache.from_config(other, "dense")
    try:
        with torch.no_grad():
            model(input_ids=_ids(n=4), **{CACHE: cache})  # the prompt goes through sdpa
            with pytest.raises(ValueError, match=rf"sliding_window: .*window of {WINDOW}, .*holds {2 * WINDOW}"):
                model(input_ids=_ids(n=1, seed=5), **{CACHE: cache})
        # the same model with a cache of its own runs the fused step
        with torch.no_grad():
            own = NumbaKVCache.from_model(model, "dense")
            model(input_ids=_ids(n=4), **{CACHE: own})
            model(input_ids=_ids(n=1, seed=5), **{CACHE: own})
        assert own.get_seq_length() == 5
    finally:
        model.set_attn_implementation("sdpa")


def test_a_model_that_replaces_its_keys_after_the_update_is_refused_on_the_fused_path():
    """JetMoe repeats its key tensor after ``cache.update``: the fused step's hand-off (an
    attribute on the returned tensor) was lost, sdpa attended the new token alone and the token
    was never stored — 9e-2 off transformers' own cache at every step, no error.  Now the
    attention call raises, naming the way out, and the cache keeps its prompt."""
    from transformers import JetMoeConfig, JetMoeForCausalLM

    torch.manual_seed(0)
    cfg = JetMoeConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_key_value_heads=2, kv_channels=32,
                       intermediate_size=64, num_local_experts=2, num_experts_per_tok=2, max_position_embeddings=64)
    model = JetMoeForCausalLM(cfg).eval()
    ids, nxt = _ids(batch=1, n=8), _ids(batch=1, n=1, seed=3)
    with torch.no_grad():
        model.set_attn_implementation("numba_kv")
        try:
            cache = NumbaKVCache.from_model(model, "dense")
            model(ids, **{CACHE: cache})  # the prompt goes through sdpa
            with pytest.raises(ValueError, match=r"^key: this model changes the key tensor .*attn_implementation="
                                                 r"'sdpa'"):
                model(nxt, **{CACHE: cache})
            assert cache.get_seq_length() == 8
        finally:
            model.set_attn_implementation("sdpa")
        # the dequantized path serves the same model exactly
        ref = DynamicCache(config=model.config)
        model(ids, **{CACHE: ref})
        ours = NumbaKVCache.from_model(model, "dense")
        model(ids, **{CACHE: ours})
        want = model(nxt, **{CACHE: ref}).logits
        got = model(nxt, **{CACHE: ours}).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert ours.get_seq_length() == 9


def test_a_layer_refuses_a_cache_that_already_holds_tokens():
    """The layer learns dtype, device and batch from its first update: a non-empty cache (one
    restored with ``load_cache``, a fork) was taken as empty there, and attention never saw its
    history (0.64 off the original cache's logits, no error)."""
    from numba_kv.integrations.transformers import NumbaKVLayer

    model = _llama()
    held = make_cache("kv4", num_layers=1, num_kv_heads=2, head_dim=64)
    k = np.random.default_rng(0).standard_normal((1, 2, 5, 64)).astype(np.float32)
    held.prefill(0, k, k)
    with pytest.raises(ValueError, match=r"^cache: expected an empty cache .* holding 5 tokens"):
        NumbaKVLayer(held, model.config)
    held.reset()
    assert NumbaKVLayer(held, model.config).get_seq_length() == 0


def test_an_empty_beam_index_names_beam_idx():
    cache = NumbaKVCache.from_config(_llama().config, "kv4")
    k = torch.randn(2, 2, 6, 64)
    cache.update(k, k, 0)
    with pytest.raises(ValueError, match=r"^beam_idx: expected at least one batch row"):
        cache.reorder_cache(torch.tensor([], dtype=torch.long))
    assert cache.batch_size == 2 and cache.get_seq_length() == 6


def test_per_layer_sliding_windows_of_a_heterogeneous_config():
    """transformers' ``per_layer_config`` (layers with their own ``sliding_window``): reading
    ``config.sliding_window`` raises there, and ``from_model`` failed with transformers'
    ``AmbiguousGlobalPerLayerAttributeError``.  The layers now take their own windows, those
    of ``DynamicCache(config=...)``.  (Mistral's own forward still reads the global window,
    so this model cannot run yet: the layers are compared, not logits.)"""
    cfg = MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
                        sliding_window=4, per_layer_config={1: {"sliding_window": 8}, 2: {"sliding_window": None}})
    ref = DynamicCache(config=cfg)
    want = [getattr(la, "sliding_window", None) for la in ref.layers]
    assert want == [4, 8, None]
    assert model_geometry(cfg)["sliding_window"] == want
    assert [la.sliding_window for la in NumbaKVCache.from_config(cfg, "kv4").layers] == want


def test_a_heterogeneous_config_with_layers_of_other_kv_geometry_is_refused():
    cfg = MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                        per_layer_config={1: {"num_key_value_heads": 1}})
    with pytest.raises(ValueError, match=r"^config\.per_layer_config: layers differ in num_key_value_heads"):
        model_geometry(cfg)
