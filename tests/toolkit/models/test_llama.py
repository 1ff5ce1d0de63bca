"""Forward pass of ``LlamaModel`` through the cache protocol.

Tolerance convention: logits are compared with ``max|a - b| <= 1e-4 · max|b|`` (max abs
error relative to the largest reference logit; SmolLM2's logits reach ~30, and the
measured error of incremental vs one-shot float32 evaluation is ~3e-6 of that).
"""

from __future__ import annotations

import numpy as np
import pytest

from numba_kv import reference
from numba_kv.caches.dense import DenseCache
from numba_kv.caches.mixed import MixedCache
from numba_kv.caches.protocol import AttendConfig, Dequantized, DequantResult, Fused
from numba_kv.toolkit.models import attention, generate, sequence_logits

from .tiny_llama import hf_reference_logits

RTOL = 1e-4

TEXT = ("The quick brown fox jumps over the lazy dog. Numba compiles Python functions to "
        "machine code, and KV caches store keys and values for attention.")


def assert_close(a, b, rtol=RTOL):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape
    err = np.abs(a - b).max()
    assert err <= rtol * np.abs(b).max(), f"max abs err {err:.3g} vs scale {np.abs(b).max():.3g}"


# -- protocol wrappers ----------------------------------------------------------------------
def naive_attention(q, k, v, scale, groups):
    """The float64 dense reference (:func:`numba_kv.reference.attention`), causal relative to
    the end of the history; ``groups`` is implied by the head counts (contiguous GQA)."""
    assert q.shape[1] == k.shape[1] * groups
    return reference.attention(q, k, v, scale, causal_offset=k.shape[2] - q.shape[2]).astype(np.float32)


class _Wrapper:
    def __init__(self, inner):
        self.inner = inner
        self.decode_calls = 0
        self.prefill_calls = 0

    def prefill(self, layer, k, v, q=None):
        self.prefill_calls += 1
        return self.inner.prefill(layer, k, v, q)

    def seq_len(self, layer):
        return self.inner.seq_len(layer)

    def reset(self):
        self.inner.reset()

    def memory_usage(self):
        return self.inner.memory_usage()


class FusedDense(_Wrapper):
    """Computes attention itself and returns ``Fused``."""

    def decode(self, layer, k, v, q, config):
        self.decode_calls += 1
        r = self.inner.decode(layer, k, v, q, config).result
        return Fused(naive_attention(q, r.k, r.v, config.softmax_scale, config.n_kv_groups))


class RowBiasDense(_Wrapper):
    """Adds a random constant per (batch, head, query) row as ``logit_bias`` (softmax is
    shift invariant per row, so the logits must not change)."""

    def __init__(self, inner, seed=0):
        super().__init__(inner)
        self.rng = np.random.default_rng(seed)

    def _bias(self, q, kv_len):
        b, h, t, _ = q.shape
        c = self.rng.normal(0.0, 5.0, size=(b, h, t, 1)).astype(np.float32)
        return np.broadcast_to(c, (b, h, t, kv_len)).copy()

    def prefill(self, layer, k, v, q=None):
        self.prefill_calls += 1
        r = self.inner.prefill(layer, k, v, q)
        return DequantResult(r.k, r.v, self._bias(q, r.k.shape[2]))

    def decode(self, layer, k, v, q, config):
        self.decode_calls += 1
        r = self.inner.decode(layer, k, v, q, config).result
        return Dequantized(DequantResult(r.k, r.v, self._bias(q, r.k.shape[2])))


# -- attention building block (no model needed) ------------------------------------------
@pytest.mark.parametrize("t,s", [(1, 1), (1, 9), (4, 4), (3, 10)])
def test_attention_matches_naive(rng, t, s):
    q = rng.standard_normal((2, 6, t, 32)).astype(np.float32)
    k = rng.standard_normal((2, 2, s, 32)).astype(np.float32)
    v = rng.standard_normal((2, 2, s, 32)).astype(np.float32)
    got = attention(q, k, v, 32 ** -0.5, 3)
    np.testing.assert_allclose(got, naive_attention(q, k, v, 32 ** -0.5, 3), rtol=1e-5, atol=1e-5)


def test_attention_logit_bias_is_added_to_scaled_logits(rng):
    q = rng.standard_normal((1, 2, 1, 32)).astype(np.float32)
    k = rng.standard_normal((1, 1, 5, 32)).astype(np.float32)
    v = rng.standard_normal((1, 1, 5, 32)).astype(np.float32)
    # a huge negative bias on keys 0 and 3 == attending over keys 1, 2, 4 only
    bias = np.zeros((1, 2, 1, 5), np.float32)
    bias[..., [0, 3]] = -1e9
    got = attention(q, k, v, 0.125, 2, logit_bias=bias)
    keep = [1, 2, 4]
    want = attention(q, k[:, :, keep], v[:, :, keep], 0.125, 2)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # a bias of log(w) reweights the keys: exact check against a manual softmax
    w = rng.uniform(0.5, 2.0, size=(1, 2, 1, 5)).astype(np.float32)
    got = attention(q, k, v, 0.125, 2, logit_bias=np.log(w))
    z = 0.125 * np.einsum("hd,sd->hs", q[0, :, 0], k[0, 0]) + np.log(w[0, :, 0])
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(got[0, :, 0], p @ v[0, 0], rtol=1e-5, atol=1e-6)


def test_attention_rejects_bad_shapes(rng):
    q = np.zeros((1, 4, 3, 32), np.float32)
    k = np.zeros((1, 2, 2, 32), np.float32)
    with pytest.raises(ValueError, match="kv_len"):
        attention(q, k, k, 0.1, 2)
    with pytest.raises(ValueError, match="n_kv_groups"):
        attention(q, np.zeros((1, 3, 5, 32), np.float32), np.zeros((1, 3, 5, 32), np.float32), 0.1, 2)
    with pytest.raises(ValueError, match="logit_bias"):
        attention(q, np.zeros((1, 2, 5, 32), np.float32), np.zeros((1, 2, 5, 32), np.float32), 0.1, 2,
                  logit_bias=np.zeros((1, 4, 3, 4), np.float32))


# -- tiny synthetic model (fast, no download) ----------------------------------------------
def test_tiny_matches_hf_layout_reference(tiny):
    """GGUF-permuted Q/K + adjacent-pair RoPE == HF layout + rotate_half RoPE."""
    model, tok, hf = tiny
    ids = tok.encode("the cat sat in the hat; 12345 tokens, and then some more text at the end")
    got = model.forward(ids, model.new_cache(), logits="all", chunk_size=None)
    assert_close(got, hf_reference_logits(hf, ids))


def test_tiny_config_and_tied_embeddings(tiny):
    model, _, _ = tiny
    c = model.config
    assert (c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.dim, c.ffn_dim) == (2, 4, 2, 32, 128, 192)
    assert model.tied_embeddings and model.output is model.tok_embd
    assert model.attend_config == AttendConfig(32 ** -0.5, 2)


def test_tiny_decode_and_chunks_match_one_shot(tiny):
    model, tok, _ = tiny
    ids = tok.encode("in the heat at the theater, the seas are at their best " * 2)
    ref = model.forward(ids, model.new_cache(), logits="all", chunk_size=None)
    assert_close(sequence_logits(model, ids, model.new_cache(), 5), ref)
    assert_close(model.forward(ids, model.new_cache(), logits="all", chunk_size=4), ref)
    assert_close(model.forward(ids, model.new_cache(), logits="all", mode="decode"), ref)
    # decode of several tokens in one protocol call (q_len > 1) is causal too
    cache = model.new_cache()
    model.forward(ids[:6], cache)
    out = model.step(ids[6:11], cache, 6, use_decode=True, logits="all")
    assert_close(out, ref[6:11])


def test_tiny_wrappers(tiny):
    model, tok, _ = tiny
    ids = tok.encode("the heat in the sea at the end")
    ref = sequence_logits(model, ids, model.new_cache(), 3, chunk_size=2)
    for cls in (FusedDense, RowBiasDense):
        cache = cls(model.new_cache())
        assert_close(sequence_logits(model, ids, cache, 3, chunk_size=2), ref)
        assert cache.decode_calls == (len(ids) - 3) * model.config.n_layers
        assert cache.prefill_calls == 2 * model.config.n_layers


def test_sequence_logits_rows(tiny):
    model, tok, _ = tiny
    ids = tok.encode("at the sea the heat")
    n = len(ids)
    full = sequence_logits(model, ids, model.new_cache(), 4)
    tail = sequence_logits(model, ids, model.new_cache(), 4, include_prefill=False)
    assert full.shape == (n, model.config.vocab_size) and full.dtype == np.float32
    assert tail.shape == (n - 3, model.config.vocab_size)
    assert_close(tail, full[3:])
    with pytest.raises(ValueError, match="n_prefill"):
        sequence_logits(model, ids, model.new_cache(), 0)
    with pytest.raises(ValueError, match="n_prefill"):
        sequence_logits(model, ids, model.new_cache(), n + 1)


def test_forward_rejects_bad_arguments(tiny):
    model, _, _ = tiny
    cache = model.new_cache()
    with pytest.raises(ValueError, match="tokens"):
        model.forward([], cache)
    with pytest.raises(ValueError, match="tokens"):
        model.forward([model.config.vocab_size], cache)
    with pytest.raises(ValueError, match="mode"):
        model.forward([1], cache, mode="sideways")
    for chunk in (0, 2.7, True, "4"):  # a float was truncated (2.7 ran chunks of 2)
        with pytest.raises(ValueError, match=r"^chunk_size: expected None or an int >= 1"):
            model.forward([1, 2, 3], cache, chunk_size=chunk)
    with pytest.raises(ValueError, match="logits"):
        model.forward([1], cache, logits="some")
    assert cache.seq_len(0) == 0


def _wrong_geometry_caches():
    """Caches that do not fit the tiny model (2 layers, 2 KV heads, head_dim 32), by label."""
    three = DenseCache(3, 2, 32)
    return {
        "fewer layers": DenseCache(1, 2, 32),  # raised IndexError after layer 0 had stored the tokens
        "more layers": DenseCache(3, 2, 32),  # was taken: the tokens went into layers 0-1 only
        "kv heads": DenseCache(2, 1, 32),
        "head_dim": DenseCache(2, 2, 64),
        "mixed": MixedCache([three], [(0, 0), (0, 1), (0, 2)]),
    }


@pytest.mark.parametrize("label", list(_wrong_geometry_caches()))
@pytest.mark.parametrize("entry", ["forward", "forward decode", "step", "decode_layer_major", "generate"])
def test_a_cache_of_another_geometry_is_rejected_before_anything_is_stored(tiny, label, entry):
    model, tok, _ = tiny
    cache = _wrong_geometry_caches()[label]
    calls = {
        "forward": lambda: model.forward([5, 6, 7], cache),
        "forward decode": lambda: model.forward([5, 6, 7], cache, 0, mode="decode"),
        "step": lambda: model.step([5, 6], cache, 0, use_decode=False),
        "decode_layer_major": lambda: model.decode_layer_major([5, 6], cache, 0),
        "generate": lambda: generate(model, tok, [5, 6], 2, cache=cache),
    }
    with pytest.raises(ValueError, match=r"^cache: expected this model's geometry \(num_layers=2, num_kv_heads=2, "
                                         r"head_dim=32\), got num_layers="):
        calls[entry]()
    assert cache.memory_usage() == 0
    assert [cache.seq_len(i) for i in range(cache.num_layers)] == [0] * cache.num_layers


def test_a_cache_without_geometry_attributes_is_taken_as_it_is(tiny):
    """Duck-typed caches (wrappers, recorders) need only the protocol's methods."""
    model, _, _ = tiny
    inner = model.new_cache()
    duck = _Wrapper(inner)
    duck.decode = inner.decode
    assert not any(hasattr(duck, a) for a in ("num_layers", "num_kv_heads", "head_dim"))
    ref = model.forward([5, 6, 7, 8], model.new_cache(), logits="all")
    assert_close(model.forward([5, 6, 7, 8], duck, logits="all"), ref)
    model.check_cache(duck)
    model.check_cache(model.new_cache())
    with pytest.raises(ValueError, match=r"got num_kv_heads=1 \(Partial; see new_cache\)$"):
        model.check_cache(type("Partial", (_Wrapper,), {"num_kv_heads": 1})(inner))


@pytest.mark.parametrize("start_pos, error", [(1.5, TypeError), (1.0, TypeError), (True, TypeError),
                                              (np.float32(2), TypeError), ("1", TypeError), (-1, ValueError)])
def test_start_pos_is_an_int_of_at_least_zero(tiny, start_pos, error):
    # forward(start_pos=1.5) ran at position 1 (int() truncated it)
    model, _, _ = tiny
    cache = model.new_cache()
    for call in (lambda: model.forward([5, 6], cache, start_pos),
                 lambda: model.forward([5, 6], cache, start_pos, mode="decode"),
                 lambda: model.step([5, 6], cache, start_pos, use_decode=True),
                 lambda: model.decode_layer_major([5, 6], cache, start_pos)):
        with pytest.raises(error, match="^start_pos: expected an int >= 0, got"):
            call()
    assert cache.seq_len(0) == 0 and cache.memory_usage() == 0
    assert_close(model.forward([5, 6], cache, np.int64(3)), model.forward([5, 6], model.new_cache(), 3))


def test_bad_cache_outputs_are_reported(tiny):
    model, _, _ = tiny

    class Broken(_Wrapper):
        def decode(self, layer, k, v, q, config):
            return self.inner.decode(layer, k, v, q, config).result  # not wrapped

    cache = Broken(model.new_cache())
    model.forward([5, 6], cache)
    with pytest.raises(TypeError, match="Fused or Dequantized"):
        model.forward([7], cache, mode="decode")


def test_new_cache_factories(tiny):
    model, _, _ = tiny
    assert isinstance(model.new_cache(), DenseCache)
    c = model.new_cache(DenseCache, dtype=np.float64)
    assert c.dtype == np.float64 and c.num_layers == 2 and c.num_kv_heads == 2 and c.head_dim == 32
    with pytest.raises(TypeError, match="cache_factory"):
        model.new_cache(3)


def test_generate_tiny(tiny):
    model, tok, _ = tiny
    g = generate(model, tok, "the", max_new_tokens=5, stop_at_eos=False)
    assert len(g.new_ids) == 5 and g.prompt_ids == tok.encode("the")
    assert g.cache.seq_len(0) == len(g.prompt_ids) + 4  # the last token is never fed back
    # greedy is deterministic and independent of the cache wrapper
    g2 = generate(model, tok, g.prompt_ids, 5, cache=FusedDense(model.new_cache()), stop_at_eos=False)
    assert g2.new_ids == g.new_ids
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, tok, "the", 0)


# -- SmolLM2-135M (real model) ------------------------------------------------------------
@pytest.fixture(scope="module")
def smol_ids(smollm2):
    _, tok = smollm2
    return tok.encode(TEXT)


@pytest.fixture(scope="module")
def smol_ref(smollm2, smol_ids):
    model, _ = smollm2
    return model.forward(smol_ids, model.new_cache(), logits="all", chunk_size=None)


@pytest.mark.slow
def test_smollm2_config(smollm2):
    model, _tok = smollm2
    c = model.config
    assert (c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.dim, c.ffn_dim) == (30, 9, 3, 64, 576, 1536)
    assert c.vocab_size == 49152 and c.rope_theta == 100000.0 and model.tied_embeddings


@pytest.mark.slow
def test_smollm2_incremental_decode_matches_one_shot(smollm2, smol_ids, smol_ref):
    model, _ = smollm2
    got = sequence_logits(model, smol_ids, model.new_cache(), 8)
    assert_close(got, smol_ref)


@pytest.mark.slow
def test_smollm2_chunked_prefill_matches_one_shot(smollm2, smol_ids, smol_ref):
    model, _ = smollm2
    assert_close(model.forward(smol_ids, model.new_cache(), logits="all", chunk_size=7), smol_ref)


@pytest.mark.slow
def test_smollm2_fused_and_bias_caches(smollm2, smol_ids, smol_ref):
    model, _ = smollm2
    ids = smol_ids[:20]
    ref = smol_ref[:20]
    for cls in (FusedDense, RowBiasDense):
        cache = cls(model.new_cache())
        assert_close(sequence_logits(model, ids, cache, 9, chunk_size=4), ref)


@pytest.mark.slow
def test_smollm2_paris(smollm2):
    model, tok = smollm2
    g = generate(model, tok, "The capital of France is", max_new_tokens=6)
    assert "Paris" in g.text, g.text


@pytest.mark.slow
def test_smollm2_chat(smollm2):
    model, tok = smollm2
    g = generate(model, tok, "What is the capital of France?", max_new_tokens=16, chat=True)
    assert "Paris" in g.text, g.text


class Recording(_Wrapper):
    """Records the order of ``decode`` calls as ``(layer, seq_len before the call)``."""

    def __init__(self, inner):
        super().__init__(inner)
        self.calls = []

    def decode(self, layer, k, v, q, config):
        self.calls.append((layer, self.inner.seq_len(layer)))
        self.decode_calls += 1
        return self.inner.decode(layer, k, v, q, config)


@pytest.mark.parametrize("wrap", [None, FusedDense, RowBiasDense])
def test_layer_major_decode_matches_the_token_loop(tiny, wrap):
    """``decode_layer_major`` gives the logits of one ``step`` per token (the float64
    one-shot forward is the independent reference), with one ``decode`` per token and layer
    in token order, layers one after the other."""
    model, tok, _ = tiny
    ids = np.asarray(tok.encode(TEXT), dtype=np.int64)[:40]
    p, n_layers = 12, model.config.n_layers
    ref = model.forward(ids, model.new_cache(dtype="float64"), logits="all", chunk_size=None)
    cache = Recording(model.new_cache() if wrap is None else wrap(model.new_cache()))
    model.forward(ids[:p], cache, chunk_size=5, logits="none")
    out = model.decode_layer_major(ids[p:], cache, p, logits_chunk=7)  # chunked output rows
    assert out.shape == (ids.size - p, model.config.vocab_size) and out.dtype == np.float32
    assert_close(out, ref[p:])
    t = ids.size - p
    assert cache.calls == [(li, p + j) for li in range(n_layers) for j in range(t)]
    assert [cache.seq_len(li) for li in range(n_layers)] == [ids.size] * n_layers
    assert model.decode_layer_major(ids[:3], model.new_cache(), 0, logits="none") is None


def test_layer_major_decode_through_a_compressed_cache(tiny):
    """A compressed cache sees the same keys and values in both orders, so it stores the same
    codes: its logits match the token loop's to float rounding, not just statistically."""
    model, tok, _ = tiny
    ids = np.asarray(tok.encode(TEXT), dtype=np.int64)[:48]
    p = 16
    a, b = model.new_cache("pqo3-r4-s2"), model.new_cache("pqo3-r4-s2")
    model.forward(ids[:p], a, logits="none")
    model.forward(ids[:p], b, logits="none")
    loop = np.stack([model.step(ids[j:j + 1], a, j, use_decode=True)[0] for j in range(p, ids.size)])
    out = model.decode_layer_major(ids[p:], b, p)
    assert_close(out, loop)
    dense = model.forward(ids, model.new_cache(), logits="all", chunk_size=None)[p:]
    assert np.abs(out - dense).max() > 100 * RTOL * np.abs(dense).max()  # the codes did change the logits
    assert a.memory_usage() == b.memory_usage()


def test_layer_major_decode_rejects_bad_arguments(tiny):
    model, _, _ = tiny
    cache = model.new_cache()
    with pytest.raises(ValueError, match="logits"):
        model.decode_layer_major([1, 2], cache, 0, logits="last")
    with pytest.raises(ValueError, match="tokens"):
        model.decode_layer_major([], cache, 0)
    assert cache.seq_len(0) == 0
