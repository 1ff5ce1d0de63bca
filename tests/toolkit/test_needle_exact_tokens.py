"""``benchmarks/needle_exact_tokens.py`` (round 8's diagnosis): exact positions reach every
attention, the question's choice finds planted keys, the ``--keep`` grammar."""

from __future__ import annotations

import numpy as np
import pytest

from numba_kv.toolkit.models import sequence_logits

from .models.test_llama import RTOL, assert_close
from .test_kv3_retrieval import _load

CODED = "pqo2:residual_length=2,sink_tokens=0"


@pytest.fixture(scope="module")
def ne():
    return _load("needle_exact_tokens")


def test_every_position_exact_is_dense(ne, tiny):
    """With every position exact the 2-bit cache's logits are dense's, over prefill chunks and
    teacher-forced decode steps; with none they are the plain cache's and far from dense."""
    model, tok, _ = tiny
    c = model.config
    ids = np.random.default_rng(1).integers(0, c.vocab_size, 48)
    dense = sequence_logits(model, ids, model.new_cache("dense"), 32, chunk_size=8)

    def logits(keep):
        w = ne.ExactTokens(model.new_cache(CODED), model.new_cache("dense"), keep)
        out = sequence_logits(model, ids, w, 32, chunk_size=8)
        assert w.seq_len(0) == ids.size and w.memory_usage() < 2 * c.n_layers * c.n_kv_heads * c.head_dim * 48
        return out

    assert_close(logits(np.arange(48)), dense)
    plain = sequence_logits(model, ids, model.new_cache(CODED), 32, chunk_size=8)
    none = logits([])
    assert_close(none, plain, rtol=1e-3)
    assert np.abs(none - dense).max() > 100 * RTOL * np.abs(dense).max()


def test_question_choice_finds_the_keys_the_last_queries_attend_to(ne):
    rng = np.random.default_rng(0)
    s, d = 64, 16
    k = rng.standard_normal((1, 2, s, d)).astype(np.float32) * 0.1
    q = np.zeros((1, 4, s, d), np.float32)
    k[0, 0, 10, 0] = k[0, 1, 40, 1] = 8.0      # KV head 0 -> position 10, head 1 -> 40
    q[0, :2, -4:, 0] = q[0, 2:, -4:, 1] = 4.0  # the last 4 queries of each group look there
    chosen = ne.question_choice(4, 1, 1)(k, q)
    np.testing.assert_array_equal(chosen, [10, 40])
    assert {10, 40} <= set(ne.question_choice(4, 3, 3)(k, q).tolist())  # smoothed, still among the top 3


def test_keep_rule(ne):
    assert ne.keep_rule("none", 5, 3, 20) == ([], None)
    assert ne.keep_rule("needle:2", 5, 3, 20) == ([3, 4, 5, 6, 7, 8, 9], None)
    assert ne.keep_rule("needle:0", 18, 5, 20)[0] == [18, 19]
    keep, choose = ne.keep_rule("question:8:4:3", 5, 3, 20)
    assert keep == [] and callable(choose)
    with pytest.raises(ValueError, match="--keep: expected none, needle:PAD or question:W:K:POOL, got 'all'"):
        ne.keep_rule("all", 5, 3, 20)
