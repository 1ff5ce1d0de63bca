"""``paged_decode_attention`` as an op: pool arrays and a page table in, no cache object."""

import re

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


def _table(indptr, indices, last):
    return tuple(np.array(a, np.int32) for a in (indptr, indices, last))


@pytest.mark.parametrize("table, word", [
    # pages outside the pool of 24: read memory that is not the pool's (10**9 crashed)
    (_table([0, 2, 3], [0, 24, 1], [3, 4]), r"^kv_indices: expected pages in \[0, 24\)"),
    (_table([0, 2, 3], [0, -1, 1], [3, 4]), r"^kv_indices: expected pages in \[0, 24\)"),
    (_table([0, 2, 3], [0, 10 ** 9, 1], [3, 4]), r"^kv_indices: expected pages in \[0, 24\)"),
    # a last page longer than a page, or empty: silently other tokens
    (_table([0, 2, 3], [0, 2, 1], [9, 4]), r"^kv_last_page_len: expected values in \[1, page_size=8\]"),
    (_table([0, 2, 3], [0, 2, 1], [0, 4]), r"^kv_last_page_len: expected values in \[1, page_size=8\]"),
    # kv_indptr past kv_indices (NaN), not from 0, a sequence without a page
    (_table([0, 2, 5], [0, 2, 1], [3, 4]), r"^kv_indptr: expected 0 = kv_indptr\[0\] <"),
    (_table([1, 2, 3], [0, 2, 1], [3, 4]), r"^kv_indptr: expected 0 = kv_indptr\[0\] <"),
    (_table([0, 3, 3], [0, 2, 1], [3, 4]), r"^kv_indptr: expected 0 = kv_indptr\[0\] <"),
])
def test_page_tables_that_address_outside_the_pools_are_refused(table, word):
    rng = np.random.default_rng(6)
    c = _cache("float32", (5,), rng)
    q = rng.standard_normal((2, 2, 1, 64)).astype(np.float32)
    with pytest.raises(ValueError, match=word):
        paged_decode_attention(q, table, **_pool_kwargs(c))


def test_page_table_types_pool_geometry_and_seq_lens_are_checked():
    rng = np.random.default_rng(7)
    c = _cache("pqo3", (5, 9), rng)
    q = rng.standard_normal((2, 2, 1, 64)).astype(np.float32)
    kw = _pool_kwargs(c)
    table = c.page_table(0)
    with pytest.raises(TypeError, match=r"^page_table: expected a tuple \(kv_indptr, kv_indices"):
        paged_decode_attention(q, table[:2], **kw)  # was "not enough values to unpack"
    with pytest.raises(TypeError, match=r"^kv_indices: expected a 1-D int32 array, got float32"):
        paged_decode_attention(q, (table[0], table[1].astype(np.float32), table[2]), **kw)
    with pytest.raises(ValueError, match=r"^v_scales: expected \[num_pages, num_kv_heads, page_size\]"):
        paged_decode_attention(q, table, **{**kw, "v_scales": kw["v_scales"][:20]})
    with pytest.raises(ValueError, match=r"^seq_lens: expected the page table's lengths \[5, 9\], got \[5, 16\]"):
        paged_decode_attention(q, table, **kw, seq_lens=[5, 16])


@pytest.mark.parametrize("storage", ["float32", "pqo3"])
def test_pool_values_that_would_leave_float32_are_refused(storage):
    """Float32 pages beyond 2**21 (3e38 values gave inf), NaN pages (finite garbage), Inf/NaN
    scale patterns, a query beyond 2**64: named, unless ``check_values=False``."""
    rng = np.random.default_rng(8)
    c = _cache(storage, (5,), rng)
    q = rng.standard_normal((1, 2, 1, 64)).astype(np.float32)
    table = c.page_table(0)
    page = int(table[1][0])
    bad = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in _pool_kwargs(c).items()}
    if storage == "float32":
        bad["v_pages"][page, 1, 2, 3] = 3e38
        word = r"^v_pages: expected \|v_pages\| <= 2\*\*21"
        nan = {**bad, "v_pages": _pool_kwargs(c)["v_pages"].copy()}
        nan["v_pages"][page, 0, 0, 0] = np.nan
        with pytest.raises(ValueError, match=r"^v_pages: expected finite values"):
            paged_decode_attention(q, table, **nan)
    else:
        bad["k_scales"][page, 0, 1, 0] = 0x7C00
        word = r"^k_scales: expected finite binary16 bit patterns"
    with pytest.raises(ValueError, match=word):
        paged_decode_attention(q, table, **bad)
    paged_decode_attention(q, table, **bad, check_values=False)  # the caller vouches: not read
    big = q * np.float32(2.0 ** 70)  # the message says how large q is, as decode_attention's does
    said = re.escape(f"got max |q| = {np.abs(big).max():.6g}")
    with pytest.raises(ValueError, match=rf"^q: expected \|q\| <= 2\*\*64 .*, {said}$"):
        paged_decode_attention(big, table, **_pool_kwargs(c))



def test_a_query_longer_than_a_sequence_names_the_page_table():
    """The op has no ``seq_ids`` argument (the cache's ``decode_attention`` has): the lengths
    come from ``page_table``, which the message now names."""
    pages = np.zeros((2, 1, 4, 32), np.float32)
    table = (np.array([0, 1], np.int32), np.array([0], np.int32), np.array([2], np.int32))  # 2 tokens
    with pytest.raises(ValueError, match=r"^page_table: every sequence needs >= max\(1, q_len=3\) stored tokens"):
        paged_decode_attention(np.zeros((1, 1, 3, 32), np.float32), table, k_pages=pages, v_pages=pages)


@pytest.mark.parametrize("causal", ["no", 1])
def test_causal_must_be_a_bool(causal):
    rng = np.random.default_rng(5)
    c = _cache("pqo3", (9, 4), rng)
    q = rng.standard_normal((2, 4, 2, 64)).astype(np.float32)
    with pytest.raises(TypeError, match="causal: expected a bool"):
        paged_decode_attention(q, c.page_table(0), **_pool_kwargs(c), causal=causal)
    with pytest.raises(TypeError, match="causal: expected a bool"):
        c.decode_attention(0, q, causal=causal)


def test_pools_of_the_wrong_dtype_are_a_typeerror(rng):
    """A float64 page pool or int16 codes: ``TypeError`` naming the pool (a dtype problem; a
    wrong width stays a ``ValueError``). They were ``ValueError``s."""
    from numba_kv import PagedKVCache

    c = PagedKVCache(4, 1, 2, 32, page_size=4, storage="float32")
    x = rng.standard_normal((2, 5, 32)).astype(np.float32)
    c.append(0, c.allocate_sequence(), x, x)
    table = c.page_table(0)
    q = rng.standard_normal((1, 4, 1, 32)).astype(np.float32)
    pools = _pool_kwargs(c)
    with pytest.raises(TypeError, match=r"^k_pages: expected float32 \[num_pages, .*, 32\], got float64"):
        paged_decode_attention(q, table, **{**pools, "k_pages": pools["k_pages"].astype(np.float64)})
    with pytest.raises(ValueError, match=r"^v_pages: expected float32 .*, got float32 \(4, 2, 4, 16\)"):
        paged_decode_attention(q, table, **{**pools, "v_pages": pools["v_pages"][..., :16].copy()})
