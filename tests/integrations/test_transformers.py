"""numba_kv.integrations.transformers on tiny random transformers models (offline, CPU, float32).

Skipped when torch or transformers (the ``hf`` extra) is missing.
"""

from __future__ import annotations

import inspect
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers import DynamicCache, Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM  # noqa: E402

from numba_kv.integrations.transformers import NumbaKVCache, NumbaKVLayer, to_array, to_tensor  # noqa: E402

VOCAB = 128
WINDOW = 8  # Gemma-3's sliding layers: short, so the prompts below overflow it
#: KL(dense ‖ kv4) of the next-token distribution, per row and decode step: the tests' bound.
#: Measured with kv4 at residual_length=0 (everything past the 4 sinks compressed; 48-token
#: prompt, 8 steps): max 5.0e-5 (Llama), 1.9e-4 (Gemma-3); kv4's own window gives 2e-6 / 1.2e-5.
#: The bound leaves a 5x margin over the worst and sits 8x below the same cache with random
#: codes (KL 0.008-0.023 per row, see test_a_broken_cache_fails_the_kl_bound).
KL_BOUND = 1e-3


def _llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).eval()


def _gemma3() -> Gemma3ForCausalLM:
    torch.manual_seed(1)
    cfg = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=64, query_pre_attn_scalar=64,
                           sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
                           max_position_embeddings=256)
    return Gemma3ForCausalLM(cfg).eval()


MODELS = {"llama": _llama, "gemma3": _gemma3}
#: the cache keyword of forward/generate: ``cache`` since transformers 5.24 (``past_key_values``
#: deprecated there), ``past_key_values`` before
CACHE = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request):
    return MODELS[request.param]()


def _ids(batch: int = 2, n: int = 20, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _run(model, cache, ids: torch.Tensor, steps: int = 6) -> list[torch.Tensor]:
    """Logits of the prompt's last position, then of ``steps`` one-token decode steps (the
    tokens are fixed, not sampled, so two caches see the same inputs)."""
    out = [model(ids, **{CACHE: cache}).logits[:, -1]]
    nxt = _ids(ids.shape[0], steps, seed=99)
    for t in range(steps):
        out.append(model(nxt[:, t:t + 1], **{CACHE: cache}).logits[:, -1])
    return out


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    lp, lq = torch.log_softmax(p_logits.double(), -1), torch.log_softmax(q_logits.double(), -1)
    return (lp.exp() * (lp - lq)).sum(-1)


# -- the dense cache is transformers' DynamicCache ------------------------------------------------------

def test_dense_equals_dynamic_cache_exactly(model):
    """Bit for bit: the dense cache stores float32 K/V unchanged and hands back the same values
    (the prompt's own tensors, then copies of the history), so the model computes the same
    thing; on Gemma-3 the prompt (20) and decode overflow the sliding window (8)."""
    ref = _run(model, DynamicCache(config=model.config), _ids())
    got = _run(model, NumbaKVCache.from_model(model, "dense"), _ids())
    for a, b in zip(ref, got):
        assert torch.equal(a, b)


def test_dense_generate_and_beam_search_match_dynamic_cache(model):
    ids = _ids(n=12)
    mask = torch.ones_like(ids)
    kw = {"max_new_tokens": 6, "do_sample": False, "attention_mask": mask, "pad_token_id": 0}
    greedy = model.generate(ids, **{CACHE: NumbaKVCache.from_model(model, "dense")}, **kw)
    assert torch.equal(greedy, model.generate(ids, **kw))
    cache = NumbaKVCache.from_model(model, "dense")
    beams = model.generate(ids, **{CACHE: cache}, num_beams=2, **kw)
    assert torch.equal(beams, model.generate(ids, num_beams=2, **kw))
    assert cache.get_seq_length() == beams.shape[1] - 1  # the last token is not run through the model


def test_left_padding_works_on_the_dequantized_path(model):
    """Pad tokens are stored like any other and the model's mask hides them: dense equals
    DynamicCache on a left-padded batch, and kv4 generates from it."""
    ids = _ids(n=12)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    ids[0, :5] = 0
    kw = {"max_new_tokens": 4, "do_sample": False, "attention_mask": mask, "pad_token_id": 0}
    ref = model.generate(ids, **kw)
    assert torch.equal(model.generate(ids, **{CACHE: NumbaKVCache.from_model(model, "dense")}, **kw), ref)
    out = model.generate(ids, **{CACHE: NumbaKVCache.from_model(model, "kv4")}, **kw)
    assert out.shape == ref.shape


# -- kv4: close to dense ------------------------------------------------------------------------------

def test_kv4_stays_within_the_kl_bound_of_dense(model):
    ref = _run(model, NumbaKVCache.from_model(model, "dense"), _ids(n=48), steps=8)
    cache = NumbaKVCache.from_model(model, "kv4", residual_length=0)  # everything past the sinks compressed
    got = _run(model, cache, _ids(n=48), steps=8)
    assert torch.equal(ref[0], got[0])  # the prompt attends over its own exact K/V
    kls = torch.stack([_kl(a, b) for a, b in zip(ref[1:], got[1:])])
    assert kls.max().item() < KL_BOUND, kls.max().item()
    assert kls.max().item() > 0  # really compressed
    dense_bytes = NumbaKVCache.from_model(model, "dense")
    _run(model, dense_bytes, _ids(n=48), steps=8)
    assert cache.memory_usage() < dense_bytes.memory_usage() / 3


def test_kv3_inside_transformers(model):
    """``kv3`` (VQ codes, 8-bit norms, a window that grows with the history) through the
    integration: the prompt's logits equal dense's, later steps stay close, and each layer is
    the preset's configuration (every layer grows its window as its own R / 1024 of the history)."""
    ref = _run(model, NumbaKVCache.from_model(model, "dense"), _ids(n=48), steps=4)
    cache = NumbaKVCache.from_model(model, "kv3", residual_length=0)  # everything past the sinks compressed
    got = _run(model, cache, _ids(n=48), steps=4)
    assert torch.equal(ref[0], got[0])
    kls = torch.stack([_kl(a, b) for a, b in zip(ref[1:], got[1:])])
    assert 0 < kls.max().item() < 10 * KL_BOUND, kls.max().item()
    sized = NumbaKVCache.from_model(model, "kv3")
    for la in sized.layers:
        part = la.cache
        assert part.norm_bits == 8 and part.vq and part.sink_tokens in (0, 16)
        assert part.residual_fraction == part.residual_length / 1024


def test_a_broken_cache_fails_the_kl_bound(model):
    """The bound discriminates: the same cache with its compressed codes replaced by random
    bytes after the prompt exceeds it."""
    ref = _run(model, NumbaKVCache.from_model(model, "dense"), _ids(n=48), steps=3)
    cache = NumbaKVCache.from_model(model, "kv4", residual_length=0)
    ids = _ids(n=48)
    with torch.no_grad():
        model(ids, **{CACHE: cache})
    rng = np.random.default_rng(0)
    for layer in cache.layers:
        for st in layer.cache._layers:  # test-only access: scramble every code buffer
            for buf in st.buffers.values():
                if buf.dtype == np.uint8:
                    buf[...] = rng.integers(0, 256, buf.shape, dtype=np.uint8)
    nxt = _ids(2, 3, seed=99)
    with torch.no_grad():
        got = model(nxt[:, :1], **{CACHE: cache}).logits[:, -1]
    assert _kl(ref[1], got).max().item() > KL_BOUND


# -- lifecycle ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["dense", "kv4"])
def test_crop_rolls_back_exactly(model, name):
    """Crop the last 2 tokens and run them again: the same logits as before (the stored codes
    of the kept tokens are untouched).  A positive argument is the legacy absolute length."""
    ids, nxt = _ids(n=20), _ids(2, 4, seed=5)
    cache = NumbaKVCache.from_model(model, name)
    with torch.no_grad():
        model(ids, **{CACHE: cache})
        model(nxt[:, :2], **{CACHE: cache})
        want = model(nxt[:, 2:], **{CACHE: cache}).logits
        cache.crop(-2)
        assert cache.get_seq_length() == 22
        assert torch.equal(model(nxt[:, 2:], **{CACHE: cache}).logits, want)
        cache.crop(22)  # legacy: keep the first 22 tokens
        assert cache.get_seq_length() == 22
        cache.crop(40)  # legacy, longer than the cache: nothing happens
        assert torch.equal(model(nxt[:, 2:], **{CACHE: cache}).logits, want)
    with pytest.raises(ValueError, match="tokens_to_remove"):
        cache.crop(-100)
    with pytest.raises(TypeError, match="tokens_to_remove"):
        cache.crop(1.5)
    assert cache.get_seq_length() == 24


def test_crop_into_an_evicted_window_raises():
    model = _gemma3()
    cache = NumbaKVCache.from_model(model, "dense")
    with torch.no_grad():
        model(_ids(n=20), **{CACHE: cache})
        model(_ids(2, 1, seed=3), **{CACHE: cache})  # the sliding layer evicts down to WINDOW - 1 old tokens
    with pytest.raises(ValueError, match="length"):
        cache.crop(-10)
    assert [la.get_seq_length() for la in cache.layers] == [21, 21]


@pytest.mark.parametrize("name", ["dense", "kv4"])
def test_reorder_select_and_repeat_move_rows(model, name):
    """After reorder_cache / batch_select_indices / batch_repeat_interleave, decoding gives the
    rows of a cache that was never reordered, permuted the same way."""
    ids, nxt = _ids(n=20), _ids(2, 1, seed=7)
    ref = NumbaKVCache.from_model(model, name)
    cache = NumbaKVCache.from_model(model, name)
    with torch.no_grad():
        model(ids, **{CACHE: ref})
        model(ids, **{CACHE: cache})
        cache.reorder_cache(torch.tensor([1, 0]))
        want = model(nxt, **{CACHE: ref}).logits
        got = model(nxt.flip(0), **{CACHE: cache}).logits
        # fp32 round-off only: torch's CPU GEMMs may sum a row differently at another batch position
        assert torch.allclose(got, want.flip(0), rtol=0, atol=1e-5), (got - want.flip(0)).abs().max()
        assert not torch.allclose(got, want, rtol=0, atol=1e-2)  # the rows did move
        cache.batch_select_indices(torch.tensor([1]))  # row 1 now holds original row 0
        assert cache.batch_size == 1
        cache.batch_repeat_interleave(3)
        assert cache.batch_size == 3
        again = model(_ids(3, 1, seed=8)[:1].expand(3, 1), **{CACHE: cache}).logits
        assert torch.allclose(again[0], again[1]) and torch.allclose(again[0], again[2])
    with pytest.raises(ValueError, match="beam_idx"):
        cache.reorder_cache(torch.tensor([0, 5]))
    assert cache.batch_size == 3


def test_sliding_layers_follow_config_layer_types():
    model = _gemma3()
    cache = NumbaKVCache.from_model(model, "kv4")
    assert [la.is_sliding for la in cache.layers] == [True, False]
    assert cache.is_sliding == [True, False]
    assert [la.get_max_length() for la in cache.layers] == [WINDOW, -1]
    with torch.no_grad():
        model(_ids(n=20), **{CACHE: cache})
        model(_ids(2, 1, seed=3), **{CACHE: cache})
    sliding, glob = (la.cache for la in cache.layers)
    assert sliding.stored_len(0) == WINDOW and glob.stored_len(0) == 21
    assert cache.layers[0].get_mask_sizes(1) == (WINDOW, 21 - WINDOW + 1)
    assert cache.layers[1].get_mask_sizes(1) == (22, 0)


def test_reset_empties_the_cache(model):
    cache = NumbaKVCache.from_model(model, "kv4")
    _run(model, cache, _ids(), steps=1)
    assert cache.memory_usage() > 0
    cache.reset()
    assert cache.memory_usage() == 0 and cache.get_seq_length() == 0
    assert torch.equal(_run(model, cache, _ids(), steps=0)[0], _run(model, DynamicCache(), _ids(), steps=0)[0])


# -- tensors in and out ---------------------------------------------------------------------------------

def test_cpu_tensors_are_shared_without_copies():
    t = torch.randn(1, 2, 3, 32)
    a = to_array(t)
    assert isinstance(a, np.ndarray) and np.shares_memory(a, t.numpy())
    back = to_tensor(a, torch.float32)
    assert back.data_ptr() == t.data_ptr()
    layer = NumbaKVCache.from_config(_llama().config, "dense").layers[0]
    k = torch.randn(1, 2, 3, 64)
    rk, rv = layer.update(k, k + 1)
    assert rk is k  # the prompt's own tensors


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_dtypes_in_and_out(dtype):
    cache = NumbaKVCache.from_config(_llama().config, "pqo4")
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(2, 2, 40, 64, generator=g).to(dtype) for _ in range(2))
    cache.update(k, v, 0)
    k1, v1 = (torch.randn(2, 2, 1, 64, generator=g).to(dtype) for _ in range(2))
    hk, hv = cache.update(k1, v1, 0)
    assert hk.dtype == dtype and hv.dtype == dtype and hk.shape == (2, 2, 41, 64)
    # the newest token is in the window (float16 storage: exact for float16/bfloat16 inputs, ulp-close for float32)
    assert torch.allclose(hk[:, :, -1:].float(), k1.float(), rtol=1e-3, atol=1e-3)
    err = (hk[:, :, :40].float() - k.float()).norm() / k.float().norm()
    assert err < 0.15, err.item()


# -- bad input ------------------------------------------------------------------------------------------

def test_bad_input_raises_clear_errors_and_changes_nothing():
    cache = NumbaKVCache.from_config(_llama().config, "kv4")
    k = torch.randn(1, 2, 4, 64)
    with pytest.raises(TypeError, match="key_states: expected float16, bfloat16 or float32"):
        cache.update(k.double(), k.double(), 0)
    with pytest.raises(TypeError, match="key_states: expected a torch.Tensor"):
        cache.update(k.numpy(), k.numpy(), 0)
    with pytest.raises(ValueError, match="key_states: expected 2 KV heads of head_dim 64"):
        cache.update(torch.randn(1, 2, 4, 32), torch.randn(1, 2, 4, 32), 0)
    with pytest.raises(ValueError, match="key_states: expected shape"):
        cache.update(k[0], k[0], 0)
    with pytest.raises(ValueError, match="value_states: expected the shape"):
        cache.update(k, k[:, :, :2], 0)
    with pytest.raises(IndexError, match="layer_idx"):
        cache.update(k, k, 2)
    with pytest.raises(TypeError, match=r"^layer_idx: expected an int in \[0, 2\), got float 1.0$"):
        cache.update(k, k, 1.0)
    assert cache.get_seq_length() == 0 and cache.memory_usage() == 0
    cache.update(k, k, 0)
    with pytest.raises(TypeError, match="holds torch.float32"):
        cache.update(k.half(), k.half(), 0)
    assert cache.layers[0].get_seq_length() == 4
    with pytest.raises(ValueError, match="^cache: unknown preset 'kv9x'"):  # from_config's argument, not make_cache's
        NumbaKVCache.from_config(_llama().config, "kv9x")
    with pytest.raises(TypeError, match="layers"):
        NumbaKVCache([])


def test_unsupported_layer_types_are_named():
    cfg = _gemma3().config
    cfg.layer_types = ["chunked_attention", "full_attention"]
    with pytest.raises(ValueError, match="layer 0 is 'chunked_attention'"):
        NumbaKVCache.from_config(cfg, "dense")


def test_layers_are_one_layer_caches_like_make_cache():
    """Each layer is configured like that layer of make_cache on the whole model (the kv4
    preset sizes its window on the whole geometry: the sliding layer gets its own)."""
    import numba_kv
    model = _gemma3()
    cache = NumbaKVCache.from_model(model, "kv4")
    full = numba_kv.make_cache("kv4", num_layers=2, num_kv_heads=1, head_dim=64, sliding_window=[WINDOW, None])
    for i, layer in enumerate(cache.layers):
        assert isinstance(layer, NumbaKVLayer) and layer.cache.num_layers == 1
        part = full.layer_cache(i)
        assert layer.cache.residual_length == part.residual_length


def test_import_numba_kv_does_not_import_the_integration():
    code = "import sys, numba_kv; print('numba_kv.integrations' in sys.modules or 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# -- fused decode: attn_implementation="numba_kv" -------------------------------------------------------

@pytest.fixture()
def fused(model):
    model.set_attn_implementation("numba_kv")
    yield model
    model.set_attn_implementation("sdpa")


@pytest.mark.parametrize("name", ["dense", "kv4"])
def test_fused_decode_equals_the_dequantized_path(model, name):
    """The fused kernels compute what sdpa computes on the decompressed history: equal to fp32
    round-off (measured max 2.1e-7 on these logits; summation order differs), the prompt
    bit for bit (it runs through sdpa on its own K/V in both)."""
    opts = {"residual_length": 0} if name == "kv4" else {}
    ref = _run(model, NumbaKVCache.from_model(model, name, **opts), _ids(n=48))
    model.set_attn_implementation("numba_kv")
    try:
        cache = NumbaKVCache.from_model(model, name, **opts)
        assert all(la.fused for la in cache.layers)
        got = _run(model, cache, _ids(n=48))
    finally:
        model.set_attn_implementation("sdpa")
    assert torch.equal(ref[0], got[0])
    for a, b in zip(ref[1:], got[1:]):
        assert torch.allclose(a, b, rtol=0, atol=2e-6), (a - b).abs().max()
    assert not any(la.fused for la in cache.layers)  # follows the model's implementation


def test_fused_turboquant_applies_its_qjl_correction(fused):
    """tq4's fused decode adds the QJL logit correction the dequantized path cannot (it needs
    the query): the logits differ from that path's, and stay within the KL bound of dense."""
    ids = _ids(n=48)
    got = _run(fused, NumbaKVCache.from_model(fused, "tq4"), ids)
    fused.set_attn_implementation("sdpa")
    plain = _run(fused, NumbaKVCache.from_model(fused, "tq4"), ids)
    dense = _run(fused, NumbaKVCache.from_model(fused, "dense"), ids)
    assert all((a - b).abs().max() > 1e-4 for a, b in zip(got[1:], plain[1:]))
    assert max(_kl(a, b).max().item() for a, b in zip(dense[1:], got[1:])) < KL_BOUND


def test_fused_generate_and_beam_search(fused):
    ids = _ids(n=12)
    kw = {"max_new_tokens": 5, "do_sample": False, "attention_mask": torch.ones_like(ids), "pad_token_id": 0}
    fused.set_attn_implementation("sdpa")
    ref = fused.generate(ids, num_beams=2, **kw)
    fused.set_attn_implementation("numba_kv")
    assert torch.equal(fused.generate(ids, **{CACHE: NumbaKVCache.from_model(fused, "dense")}, num_beams=2, **kw), ref)
    out = fused.generate(ids, **{CACHE: NumbaKVCache.from_model(fused, "kv4")}, num_beams=2, **kw)
    assert out.shape == ref.shape


def test_fused_decode_refuses_a_padded_batch(fused):
    ids = _ids(n=12)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    cache = NumbaKVCache.from_model(fused, "kv4")
    with torch.no_grad():
        fused(ids, attention_mask=mask, **{CACHE: cache})
        with pytest.raises(ValueError, match="PagedKVCache"):
            fused(ids[:, :1], attention_mask=torch.cat([mask, mask[:, :1]], 1), **{CACHE: cache})
    assert [la.get_seq_length() for la in cache.layers] == [12, 12]  # nothing stored


def test_a_layer_split_over_kv_heads():
    """head_overrides: the split layer is a one-layer mixed cache; its fused decode equals its
    dequantized path (to fp32 round-off) and beam search reorders its pieces together."""
    from numba_kv import MixedCache

    model = _llama()  # 2 KV heads, 4 query heads
    opts = {"residual_length": 0, "head_overrides": {0: {1: {"bits": 4}}}}
    cache = NumbaKVCache.from_model(model, "pqo3", **opts)
    first = cache.layers[0].cache
    assert isinstance(first, MixedCache) and [h for _, _, h in first.layer_pieces(0)] == [(0,), (1,)]
    assert not isinstance(cache.layers[1].cache, MixedCache)
    ref = _run(model, cache, _ids(n=48))
    model.set_attn_implementation("numba_kv")
    try:
        got = _run(model, NumbaKVCache.from_model(model, "pqo3", **opts), _ids(n=48))
        ids = _ids(n=12)
        out = model.generate(ids, max_new_tokens=4, num_beams=2, do_sample=False, attention_mask=torch.ones_like(ids),
                             pad_token_id=0, **{CACHE: NumbaKVCache.from_model(model, "pqo3", **opts)})
    finally:
        model.set_attn_implementation("sdpa")
    assert torch.equal(ref[0], got[0])
    for a, b in zip(ref[1:], got[1:]):
        assert torch.allclose(a, b, rtol=0, atol=2e-6), (a - b).abs().max()
    assert out.shape == (2, 16)


def test_cuda_work_runs_on_torchs_current_stream(monkeypatch):
    """``torch_stream``: on a CUDA device the block launches on torch's current stream (a CuPy
    ``ExternalStream`` of its handle, on the tensor's device, entered as CuPy's current stream
    and passed to ``numba_kv.launch_stream``); nothing on the CPU.  With stand-ins for CuPy and
    torch's stream (no GPU here; ``tests/gpu/test_device_transformers.py`` runs the real one)."""
    import types

    from numba_kv._launch import current_stream
    from numba_kv.integrations.transformers import torch_stream

    events = []

    class FakeStream:  # a CuPy ExternalStream: its handle as ``ptr``, a context manager
        def __init__(self, ptr, device):
            self.ptr, self.device = ptr, device

        def __enter__(self):
            events.append(("enter", self.ptr, self.device))
            return self

        def __exit__(self, *exc):
            events.append("exit")

    fake_cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(ExternalStream=FakeStream))
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    seen = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: seen.append(device)
                        or types.SimpleNamespace(cuda_stream=0))
    with torch_stream(torch.device("cpu")):
        assert not events and current_stream() == (None, 0)
    with torch_stream(torch.device("cuda", 1)):
        assert events == [("enter", 0, 1)] and seen == [torch.device("cuda", 1)]
        assert current_stream() == (None, 0)  # handle 0: the legacy default stream
    assert events[-1] == "exit"
