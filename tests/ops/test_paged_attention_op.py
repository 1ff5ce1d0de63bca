"""``paged_decode_attention`` as an op: pool arrays and a page table in, no cache object."""

import numpy as np
import pytest

from numba_kv import PagedKVCache, reference
from numba_kv.ops.attention.paged import paged_decode_attention


def _cache(storage, lens, rng, d=64):
    c = PagedKVCache(num_pages=24, num_layers=1, num_kv_heads=2, head_dim=d, page_size=8, storage=storage)
    for n in lens:
        c.append(0, c.allocate_sequence(), *rng.standard_normal((2, 2, n, d)).astype(np.float32))
    return c


def _pool_kwargs(c):
    p = c.pools
    if not c.bits:
        return {"k_pages": p["k_pages"], "v_pages": p["v_pages"]}
    return {**{n: p[n] for n in ("k_codes", "k_scales", "v_codes", "v_scales")},
            "k_codebook": c.codebooks["k"], "v_codebook": c.codebooks["v"]}


@pytest.mark.parametrize("storage", ["float32", "pqo3", "pqo-k4v2"])
def test_pools_and_page_table_match_the_cache_and_the_oracle(storage):
    """Ragged lengths, sequences in a custom order, seq_lens read from the page table."""
    rng = np.random.default_rng(3)
    c = _cache(storage, (7, 30, 16, 1), rng)
    order = [2, 0, 1]
    q = rng.standard_normal((3, 6, 1, 64)).astype(np.float32)
    out = paged_decode_attention(q, c.page_table(0, order), **_pool_kwargs(c), partition_size=8)
    np.testing.assert_array_equal(out, c.decode_attention(0, q, order, partition_size=8))
    for i, s in enumerate(order):
        K, V = c.get_kv(0, s)
        ref = reference.attention(q[i:i + 1], K[None], V[None], 0.125, causal_offset=K.shape[1] - 1)
        np.testing.assert_allclose(out[i:i + 1], ref, rtol=1e-5, atol=1e-5)


def test_explicit_seq_lens_and_non_causal():
    rng = np.random.default_rng(4)
    c = _cache("pqo3", (9, 20), rng)
    q = rng.standard_normal((2, 2, 3, 64)).astype(np.float32)
    table = c.page_table(0)
    a = paged_decode_attention(q, table, **_pool_kwargs(c), seq_lens=[9, 20], causal=False)
    b = paged_decode_attention(q, table, **_pool_kwargs(c), causal=False)
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("change, word", [
    (lambda kw: {**kw, "k_pages": np.zeros((24, 2, 8, 64), np.float32)}, "k_pages"),  # both kinds
    (lambda kw: {}, "k_pages"),                                                          # neither kind
    (lambda kw: {**kw, "k_codebook": None}, "k_codebook"),
    (lambda kw: {**kw, "v_codes": kw["v_codes"][..., :8]}, "v_codes"),                 # wrong width
])
def test_bad_pools(change, word):
    rng = np.random.default_rng(5)
    c = _cache("pqo3", (5,), rng)
    q = rng.standard_normal((1, 2, 1, 64)).astype(np.float32)
    with pytest.raises(ValueError, match=word):
        paged_decode_attention(q, c.page_table(0), **change(_pool_kwargs(c)))


@pytest.mark.parametrize("kw, exc, word", [
    (dict(softmax_scale=float("nan")), ValueError, r"^softmax_scale: expected a float in \(0, 2\*\*30\]"),
    (dict(softmax_scale=1e38), ValueError, r"^softmax_scale: expected a float in \(0, 2\*\*30\]"),
    (dict(partition_size=0), ValueError, r"^partition_size: expected an int >= 1"),
    (dict(partition_size=True), TypeError, r"^partition_size: expected an int >= 1"),
])
def test_bad_scale_and_partition_size_name_the_argument(kw, exc, word):
    # (a NaN scale returned zeros, 1e38 NaN, partition_size=0 a ZeroDivisionError), through the
    # op and through the cache's own decode_attention
    rng = np.random.default_rng(9)
    c = _cache("pqo3", (5,), rng)
    q = rng.standard_normal((1, 2, 1, 64)).astype(np.float32)
    with pytest.raises(exc, match=word):
        paged_decode_attention(q, c.page_table(0), **_pool_kwargs(c), **kw)
    with pytest.raises(exc, match=word):
        c.decode_attention(0, q, **kw)


def test_bad_table_rows():
    rng = np.random.default_rng(6)
    c = _cache("float32", (5, 6), rng)
    with pytest.raises(ValueError, match="q"):
        paged_decode_attention(np.zeros((3, 2, 1, 64), np.float32), c.page_table(0), **_pool_kwargs(c))
