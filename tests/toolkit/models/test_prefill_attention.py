"""``LlamaModel.forward(..., prefill_attention="exact")``: a chunked prompt attends over its
own tokens at full precision while the cache stores its codes (KIVI / TurboQuant protocol)."""

from __future__ import annotations

import numpy as np
import pytest

from numba_kv.caches.protocol import DequantResult
from numba_kv.toolkit.evaluation.long_context import dense_history
from numba_kv.toolkit.models import generate

from .test_gemma_sliding import tiny_gemma  # noqa: F401  (fixture)
from .test_llama import RTOL, assert_close
from .tiny_gemma import gemma_reference_logits
from .tiny_llama import hf_reference_logits

# a cache whose history is almost all 2-bit codes: no sinks, a 2-token float window
CODED = "pqo2:residual_length=2,sink_tokens=0"


def _err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.abs(a - b).max() / np.abs(b).max()


@pytest.mark.parametrize("chunk", [5, 16])
def test_exact_prefill_logits_equal_the_dense_reference(tiny, chunk):
    """Every prompt row equals the independent float64 forward (no cache involved), while the
    same chunked prefill through the codes is visibly off, so the test can tell the two apart."""
    model, _, hf = tiny
    ids = np.random.default_rng(3).integers(0, model.config.vocab_size, 48)
    ref = hf_reference_logits(hf, ids)
    exact = model.forward(ids, model.new_cache(CODED), logits="all", chunk_size=chunk, prefill_attention="exact")
    assert_close(exact, ref)
    coded = model.forward(ids, model.new_cache(CODED), logits="all", chunk_size=chunk)
    assert _err(coded, ref) > 100 * RTOL
    # one chunk: both modes attend over the chunk itself, so they agree
    one = model.forward(ids, model.new_cache(CODED), logits="all", chunk_size=None)
    assert_close(one, ref)


def test_exact_prefill_stores_the_codes_of_the_dense_keys_and_values(tiny):
    """After an exact prefill the cache holds what prefilling it directly with the dense
    model's K/V leaves in it: the next store returns the same dequantized history."""
    model, _, _ = tiny
    c = model.config
    ids = np.random.default_rng(4).integers(0, c.vocab_size, 40)
    via_model = model.new_cache(CODED)
    model.forward(ids, via_model, logits="none", chunk_size=8, prefill_attention="exact")
    rec = dense_history(model, ids, 8)  # same chunks: the same float sums, bit for bit
    direct = model.new_cache(CODED)
    rng = np.random.default_rng(5)
    for li in range(c.n_layers):
        for a in range(0, ids.size, 8):
            direct.prefill(li, rec.k[li][:, :, a:a + 8].copy(), rec.v[li][:, :, a:a + 8].copy())
        k1 = rng.standard_normal((1, c.n_kv_heads, 1, c.head_dim)).astype(np.float32)
        v1 = rng.standard_normal((1, c.n_kv_heads, 1, c.head_dim)).astype(np.float32)
        r_model, r_direct = via_model.prefill(li, k1, v1), direct.prefill(li, k1.copy(), v1.copy())
        np.testing.assert_array_equal(np.asarray(r_model.k), np.asarray(r_direct.k))
        np.testing.assert_array_equal(np.asarray(r_model.v), np.asarray(r_direct.v))


class _OldCodedNewExact:
    """Reference cache view: stores into ``inner`` and returns its first ``n_old`` (coded) rows
    followed by the exact K/V of every token stored since."""

    def __init__(self, inner, n_old):
        self.inner, self.n_old, self.new = inner, n_old, {}

    def seq_len(self, layer):
        return self.inner.seq_len(layer)

    def prefill(self, layer, k, v, q=None):
        r = self.inner.prefill(layer, k, v, q)
        ks, vs = self.new.setdefault(layer, ([], []))
        ks.append(np.array(k))
        vs.append(np.array(v))
        return DequantResult(np.concatenate([np.asarray(r.k)[:, :, :self.n_old], *ks], axis=2),
                             np.concatenate([np.asarray(r.v)[:, :, :self.n_old], *vs], axis=2))


def test_exact_prefill_with_history_before_the_call(tiny):
    """Tokens stored by an earlier call stay in their coded form, the call's own tokens are
    exact."""
    model, _, hf = tiny
    ids = np.random.default_rng(6).integers(0, model.config.vocab_size, 40)
    a, b = model.new_cache(CODED), model.new_cache(CODED)
    for c in (a, b):
        model.forward(ids[:24], c, logits="none", chunk_size=8)
    two = model.forward(ids[24:], a, logits="all", chunk_size=4, prefill_attention="exact")
    ref = model.forward(ids[24:], _OldCodedNewExact(b, 24), logits="all", chunk_size=4)
    assert_close(two, ref)
    assert _err(two, hf_reference_logits(hf, ids)[24:]) > 100 * RTOL  # the old history is coded


def test_exact_prefill_on_sliding_layers(tiny_gemma):  # noqa: F811
    """Gemma-3: local layers the cache slides return only their window; the exact rows are
    its newest ones and the prompt still equals the independent reference."""
    model, hf = tiny_gemma
    w = model.config.sliding_window
    ids = np.random.default_rng(7).integers(0, model.config.vocab_size, 3 * w)
    ref = gemma_reference_logits(hf, ids)
    cache = model.new_cache(CODED)
    assert any(x is not None for x in cache.layer_windows)
    assert_close(model.forward(ids, cache, logits="all", chunk_size=3, prefill_attention="exact"), ref)
    assert _err(model.forward(ids, model.new_cache(CODED), logits="all", chunk_size=3), ref) > 100 * RTOL


def test_generate_passes_prefill_attention(tiny):
    model, tok, hf = tiny
    ids = [int(i) for i in np.random.default_rng(8).integers(0, model.config.vocab_size, 30)]
    g = generate(model, tok, ids, 1, cache=model.new_cache(CODED), chunk_size=7, stop_at_eos=False,
                 prefill_attention="exact")
    assert g.new_ids == [int(np.argmax(hf_reference_logits(hf, ids)[-1]))]


def test_prefill_attention_errors(tiny):
    model, _, _ = tiny
    cache = model.new_cache(CODED)
    with pytest.raises(ValueError, match="prefill_attention: expected 'cache' or 'exact', got 'dense'"):
        model.forward([1, 2, 3], cache, prefill_attention="dense")
    with pytest.raises(ValueError, match="prefill_attention='exact' applies to mode='prefill' only"):
        model.forward([1, 2, 3], cache, mode="decode", prefill_attention="exact")
    assert cache.seq_len(0) == 0
