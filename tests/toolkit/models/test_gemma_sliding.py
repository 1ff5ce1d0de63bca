"""Gemma-3's local layers through caches that slide them (``sliding_window``): the tiny
random Gemma against the independent float64 reference at lengths far beyond its window,
local layers on the (fused) decode path at any length, memory bounded by the window."""

from __future__ import annotations

import numpy as np
import pytest

from numba_kv.toolkit.models import sequence_logits

from ..conftest import need_model_packages
from .test_llama import _Wrapper, assert_close
from .tiny_gemma import gemma_reference_logits, load_tiny_gemma


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory):
    need_model_packages()
    model, _, hf = load_tiny_gemma(tmp_path_factory.mktemp("tiny_gemma_sliding"))
    return model, hf


class Counting(_Wrapper):
    """Counts calls per layer and exposes the inner cache's windows."""

    def __init__(self, inner):
        super().__init__(inner)
        self.layer_windows = inner.layer_windows
        self.prefill_layers = []

    def prefill(self, layer, k, v, q=None):
        self.prefill_layers.append(layer)
        return super().prefill(layer, k, v, q)

    def decode(self, layer, k, v, q, config):
        self.decode_calls += 1
        return self.inner.decode(layer, k, v, q, config)


def test_new_cache_slides_local_layers_and_matches_reference(tiny_gemma):
    model, hf = tiny_gemma
    w = model.config.sliding_window
    ids = np.random.default_rng(7).integers(0, model.config.vocab_size, 4 * w)
    ref = gemma_reference_logits(hf, ids)
    cache = Counting(model.new_cache())
    assert cache.layer_windows == model.layer_windows
    assert_close(sequence_logits(model, ids, cache, 3), ref)
    # after the prompt every layer decodes, local ones too (no prefill fallback past the window)
    assert cache.prefill_layers == list(range(model.config.n_layers))
    assert cache.decode_calls == (ids.size - 3) * model.config.n_layers
    inner = cache.inner
    assert inner.seq_len(0) == ids.size and inner.stored_len(0) == w and inner.stored_len(5) == ids.size
    # chunked prefill and several tokens per decode call, beyond the window
    assert_close(model.forward(ids, model.new_cache(), logits="all", chunk_size=3), ref)
    c2 = model.new_cache()
    model.forward(ids[:9], c2)
    assert_close(model.step(ids[9:16], c2, 9, use_decode=True, logits="all"), ref[9:16])


class Tee(_Wrapper):
    """Feeds every call's K/V/Q to two caches: ``inner`` slides the model's local layers itself
    (fused decode); ``full`` does not, and its local layers go through the model's own
    fallback (``prefill`` of the whole dequantized history + sliding mask).  The model runs on
    ``inner``'s outputs, so both paths see the same K/V/Q at every layer and step: the two
    outputs are compared call by call, with no feedback of one path's rounding into the next
    layer's re-quantization (which makes whole-model logits diverge chaotically at 4 bits)."""

    def __init__(self, inner, full, model):
        super().__init__(inner)
        self.full, self.model = full, model
        self.layer_windows = inner.layer_windows
        self.errors = []  # (layer, fallback used, max |a − b| / max |b|)

    def prefill(self, layer, k, v, q=None):
        self.full.prefill(layer, k, v, q)
        return super().prefill(layer, k, v, q)

    def decode(self, layer, k, v, q, config):
        from numba_kv.caches.protocol import Dequantized, Fused

        self.decode_calls += 1
        window = self.model.layer_windows[layer]
        fallback = window is not None and self.full.seq_len(layer) + q.shape[2] > window
        if fallback:
            b = self.model._attend(q, self.full.prefill(layer, k, v, q), window)
        else:
            rb = self.full.decode(layer, k, v, q, config)
            b = rb.out if isinstance(rb, Fused) else self.model._attend(q, rb.result, window)
        ra = self.inner.decode(layer, k, v, q, config)
        assert isinstance(ra, (Fused, Dequantized))
        a = ra.out if isinstance(ra, Fused) else self.model._attend(q, ra.result, window)
        a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
        self.errors.append((layer, fallback, float(np.abs(a64 - b64).max() / np.abs(b64).max())))
        return ra


@pytest.mark.parametrize("name", ["pqo4", "tq4", "pq3"])
def test_compressed_sliding_cache_matches_the_masking_fallback(tiny_gemma, name):
    """The fused sliding path attends over the same compressed tokens as the model's own
    masking of a non-sliding cache's full history: same K/V/Q into both, every layer and step
    (far beyond the window, with a window of exact tokens and groups of several tokens)."""
    model, _ = tiny_gemma
    w = model.config.sliding_window
    ids = np.random.default_rng(8).integers(0, model.config.vocab_size, 4 * w)
    opts = {"residual_length": 2, "sink_tokens": 0}
    slide = model.new_cache(name, **opts)
    full = model.new_cache(name, sliding_window=None, **opts)
    tee = Tee(slide, full, model)
    model.forward(ids[:4], tee)
    model.step(ids[4:7], tee, 4, use_decode=True)  # q_len = 3 across the window's edge
    for p in range(7, ids.size):
        model.step(ids[p:p + 1], tee, p, use_decode=True)
    n_layers = model.config.n_layers
    assert tee.decode_calls == (ids.size - 4 - 2) * n_layers
    local = [e for e in tee.errors if model.layer_windows[e[0]] is not None]
    assert sum(f for _, f, _ in local) >= (ids.size - w - 1) * len({e[0] for e in local}), \
        "the fallback (history beyond the window) was not exercised"
    worst = max(err for _, _, err in tee.errors)
    assert worst <= 2e-6, f"fused sliding path and masking fallback differ by {worst:.3g} (relative)"
    assert slide.memory_usage() < full.memory_usage()


def test_per_layer_overrides_through_the_model(tiny_gemma):
    """A mixed cache (per-layer options) keeps the model's windows and its exactness."""
    model, hf = tiny_gemma
    ids = np.random.default_rng(9).integers(0, model.config.vocab_size, 13)
    cache = model.new_cache("dense", layer_overrides={0: {"dtype": "float64"}, -1: {"dtype": "float64"}})
    assert type(cache).__name__ == "MixedCache" and cache.layer_windows == model.layer_windows
    assert_close(sequence_logits(model, ids, cache, 2), gemma_reference_logits(hf, ids))
    w = model.config.sliding_window
    assert cache.stored_len(0) == w and cache.stored_len(model.config.n_layers - 1) == ids.size


@pytest.mark.parametrize("name", ["dense", "pqo3"])
def test_eval_caches_slide_like_the_model(tiny_gemma, name):
    """``numba-kv eval`` / ``generate`` build their caches with the model's local-layer
    windows: a local layer stores only its window, a global layer every token."""
    from numba_kv.caches.spec import parse_cache_spec
    from numba_kv.toolkit.evaluation.evaluate import model_cache_options

    model, _ = tiny_gemma
    c = model.config
    opts = model_cache_options(model)
    assert opts == {"sliding_window": list(model.layer_windows)}
    cache = parse_cache_spec(name).make(c.n_layers, c.n_kv_heads, c.head_dim, **opts)
    ids = np.random.default_rng(10).integers(0, c.vocab_size, 13)
    sequence_logits(model, ids, cache, 2)
    w = c.sliding_window
    assert w == 5 and cache.stored_len(0) == w and cache.stored_len(c.n_layers - 1) == ids.size


@pytest.mark.parametrize("sliding", [True, False])
def test_layer_major_decode_beyond_the_window(tiny_gemma, sliding):
    """``decode_layer_major`` far beyond the local layers' window, with a cache that slides
    them and with one that does not (the model's prefill-and-mask fallback, taken per layer
    once that layer's history outgrows the window): the float64 reference's logits."""
    model, hf = tiny_gemma
    w = model.config.sliding_window
    ids = np.random.default_rng(11).integers(0, model.config.vocab_size, 3 * w)
    ref = gemma_reference_logits(hf, ids)
    cache = Counting(model.new_cache() if sliding else model.new_cache(sliding_window=None))
    model.forward(ids[:3], cache, logits="none")
    assert_close(model.decode_layer_major(ids[3:], cache, 3), ref[3:])
    n_local = sum(x is not None for x in model.layer_windows)
    fallbacks = len(cache.prefill_layers) - model.config.n_layers
    assert fallbacks == (0 if sliding else n_local * (ids.size - w))
