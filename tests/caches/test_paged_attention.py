"""Fused decode attention over the paged cache (float32 and PQO pages) through the page table."""

import numpy as np
import pytest

from numba_kv import PagedKVCache, reference


def rel_err(out, ref):
    return float(np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-30))


@pytest.mark.parametrize("storage", ["float32", "pqo2", "pqo3", "pqo4", "pqo-k4v3", "pqo-k3v2"])
@pytest.mark.parametrize("groups, q_len", [(1, 1), (3, 1), (4, 3)])
def test_matches_reference_over_get_kv(storage, groups, q_len):
    rng = np.random.default_rng(groups * 10 + q_len)
    c = PagedKVCache(num_pages=80, num_layers=2, num_kv_heads=2, head_dim=64, page_size=16, storage=storage)
    seqs = [c.allocate_sequence() for _ in range(4)]
    for s, n in zip(seqs, (5, 40, 17, 300)):
        for chunk in np.array_split(np.arange(n), 3):  # appends that straddle pages
            if len(chunk):
                c.append(1, s, *rng.standard_normal((2, 2, len(chunk), 64)).astype(np.float32))
    c.free_sequence(seqs[1])  # churn: freed pages get reused below
    s_new = c.allocate_sequence()
    c.append(1, s_new, *rng.standard_normal((2, 2, 33, 64)).astype(np.float32))
    order = [seqs[3], s_new, seqs[0], seqs[2]]
    q = rng.standard_normal((4, 2 * groups, q_len, 64)).astype(np.float32)
    out = c.decode_attention(1, q, order)
    assert out.shape == q.shape
    for i, s in enumerate(order):
        K, V = c.get_kv(1, s)
        ref = reference.attention(q[i:i + 1], K[None], V[None], 0.125, causal_offset=K.shape[1] - q_len)
        assert rel_err(out[i:i + 1], ref) < 1e-5


def test_partition_size_and_default_order():
    rng = np.random.default_rng(0)
    c = PagedKVCache(num_pages=40, num_layers=1, num_kv_heads=1, head_dim=32, page_size=8, storage="pqo3")
    for n in (100, 60):
        c.append(0, c.allocate_sequence(), *rng.standard_normal((2, 1, n, 32)).astype(np.float32))
    q = rng.standard_normal((2, 2, 1, 32)).astype(np.float32)
    a = c.decode_attention(0, q, partition_size=16)
    b = c.decode_attention(0, q, partition_size=1024)
    assert rel_err(a, b) < 1e-5


@pytest.mark.parametrize("make_q, seq_ids, word", [
    (lambda: np.zeros((2, 3, 1, 64), np.float32), None, "q"),      # 3 heads, 2 KV heads
    (lambda: np.zeros((3, 2, 1, 64), np.float32), None, "q"),      # 3 rows, 2 sequences
    (lambda: np.zeros((2, 2, 1, 32), np.float32), None, "q"),      # wrong head_dim
    (lambda: np.full((2, 2, 1, 64), np.nan, np.float32), None, "q"),
    (lambda: np.zeros((1, 2, 1, 64), np.float32), [7], "seq"),      # unknown sequence
])
def test_bad_input(make_q, seq_ids, word):
    rng = np.random.default_rng(0)
    c = PagedKVCache(num_pages=8, num_layers=1, num_kv_heads=2, head_dim=64, storage="pqo3")
    for _ in range(2):
        c.append(0, c.allocate_sequence(), *rng.standard_normal((2, 2, 5, 64)).astype(np.float32))
    before = c.memory_usage()
    with pytest.raises((ValueError, KeyError, IndexError), match=word):
        c.decode_attention(0, make_q(), seq_ids)
    assert c.memory_usage() == before


def test_empty_pool_is_an_error():
    c = PagedKVCache(num_pages=8, num_layers=1, num_kv_heads=2, head_dim=64, storage="pqo3")
    with pytest.raises(ValueError, match="cache"):
        c.decode_attention(0, np.zeros((1, 2, 1, 64), np.float32))


@pytest.mark.parametrize("freed", [False, True], ids=["seq_ids=[]", "every sequence freed"])
def test_no_sequence_to_attend_over_is_named(freed):
    """No sequence (an empty ``seq_ids``, or the default once every sequence is freed) is a
    ``ValueError`` naming ``seq_ids`` (it was "min() arg is an empty sequence")."""
    rng = np.random.default_rng(0)
    c = PagedKVCache(num_pages=8, num_layers=1, num_kv_heads=2, head_dim=64, page_size=4, storage="pqo3")
    s = c.allocate_sequence()
    c.append(0, s, *rng.standard_normal((2, 2, 3, 64)).astype(np.float32))
    if freed:
        c.free_sequence(s)
    with pytest.raises(ValueError, match="seq_ids: expected at least one sequence"):
        c.decode_attention(0, np.zeros((0, 2, 1, 64), np.float32), None if freed else [])
