"""PagedKVCache: page bookkeeping (hypothesis churn), FlashInfer page tables, float and PQO
pages, bad input leaves the cache unchanged, compressor round trips through pages."""

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import numba_kv
from numba_kv.caches.paged import OutOfPagesError, PagedKVCache
from numba_kv.compressor import Hybrid, KVCacheCompressor, LowRank


def _kv(rng, h, n, d, dv=None):
    return (rng.standard_normal((h, n, d)).astype(np.float32),
            rng.standard_normal((h, n, d if dv is None else dv)).astype(np.float32))


def _snapshot(cache):
    state = (cache.num_free_pages, cache.sequences,
             [[(s, cache.seq_len(layer, s), cache.block_table(layer, s)) for s in cache.sequences]
              for layer in range(cache.num_layers)])
    pools = {k: np.array(v, copy=True) for k, v in cache.pools.items()}
    return state, pools


def _same(cache, snap):
    state, pools = _snapshot(cache)
    assert state == snap[0]
    assert pools.keys() == snap[1].keys()
    for k in pools:
        assert np.array_equal(pools[k], snap[1][k])


def test_basic_bookkeeping_and_page_table(rng):
    cache = PagedKVCache(num_pages=10, num_layers=2, num_kv_heads=2, head_dim=32, page_size=4)
    a, b = cache.allocate_sequence(), cache.allocate_sequence()
    assert (a, b) == (0, 1) and cache.num_free_pages == 10
    k, v = _kv(rng, 2, 9, 32)
    cache.append(0, a, k[:, :3], v[:, :3])
    cache.append(0, a, k[:, 3:], v[:, 3:])  # fills page 1 then allocates 2 more
    cache.append(1, b, k[:, :4], v[:, :4])
    assert cache.seq_len(0, a) == 9 and cache.seq_len(1, a) == 0 and cache.seq_len(1, b) == 4
    assert cache.block_table(0, a) == [9, 8, 7]  # stack: highest free id first
    assert cache.num_free_pages == 6 and cache.num_used_pages == 4
    pt = cache.page_table(0)
    assert pt.kv_indptr.tolist() == [0, 3, 3] and pt.kv_indices.tolist() == [9, 8, 7]
    assert pt.kv_last_page_len.tolist() == [1, 0]
    assert all(a.dtype == np.int32 for a in pt)
    pt1 = cache.page_table(1, [b, a])
    assert pt1.kv_indptr.tolist() == [0, 1, 1] and pt1.kv_last_page_len.tolist() == [4, 0]
    kk, vv = cache.get_kv(0, a)
    assert np.array_equal(kk, k) and np.array_equal(vv, v)
    pages = list(cache.iter_pages(0, a))
    assert [(p, n) for p, n, _, _ in pages] == [(9, 4), (8, 4), (7, 1)]
    assert np.array_equal(np.concatenate([p[2] for p in pages], axis=1), k)
    # the pool holds the data at the page-table addresses (what a paged kernel reads)
    assert np.array_equal(cache.pools["k_pages"][8, :, 1], k[:, 5])
    cache.free_sequence(a)
    assert cache.num_free_pages == 9 and cache.sequences == [b]
    assert cache.memory_usage() == 1 * cache.bytes_per_page == 2 * 4 * 32 * 4 * 2


def test_out_of_pages_appends_nothing(rng):
    cache = PagedKVCache(num_pages=3, num_layers=1, num_kv_heads=1, head_dim=32, page_size=4)
    s = cache.allocate_sequence()
    k, v = _kv(rng, 1, 10, 32)
    cache.append(0, s, k[:, :6], v[:, :6])
    snap = _snapshot(cache)
    with pytest.raises(OutOfPagesError, match=r"needs 2 free pages for 7 new tokens .* only 1 of 3 are free"):
        cache.append(0, s, np.ones((1, 7, 32), np.float32), np.ones((1, 7, 32), np.float32))
    _same(cache, snap)
    cache.append(0, s, k[:, 6:], v[:, 6:])  # 4 more tokens still fit
    assert np.array_equal(cache.get_kv(0, s)[0], k)


def _one_sequence(rng, num_layers):
    """A float32 paged cache (2 KV heads, d = 32) with one sequence of 3 tokens in layer 0:
    ``(cache, seq_id, k, v, snapshot)``."""
    cache = PagedKVCache(num_pages=4, num_layers=num_layers, num_kv_heads=2, head_dim=32)
    s = cache.allocate_sequence()
    k, v = _kv(rng, 2, 3, 32)
    cache.append(0, s, k, v)
    return cache, s, k, v, _snapshot(cache)


def test_bad_input_names_the_argument_and_changes_nothing(rng):
    cache, s, k, v, snap = _one_sequence(rng, num_layers=2)
    nan = k.copy()
    nan[0, 0, 0] = np.nan
    cases = [
        (KeyError, "seq_id: unknown sequence 7", lambda: cache.append(0, 7, k, v)),
        (IndexError, "layer: expected an int in", lambda: cache.append(2, s, k, v)),
        (ValueError, r"k: expected \[num_kv_heads=2, new_tokens, 32\]",
         lambda: cache.append(0, s, k[:1], v[:1])),
        (ValueError, r"v: expected 3 new tokens", lambda: cache.append(0, s, k, v[:, :2])),
        (ValueError, "v: expected .* got None", lambda: cache.append(0, s, k)),
        (ValueError, "k: expected batch 1", lambda: cache.append(0, s, np.stack([k, k]), np.stack([v, v]))),
        (ValueError, "k: expected finite values", lambda: cache.append(0, s, nan, v)),
        (TypeError, "k: expected dtype float16, float32 or float64",
         lambda: cache.append(0, s, k.astype(int), v)),
        (KeyError, "seq_id: unknown sequence 3", lambda: cache.free_sequence(3)),
        (KeyError, "seq_id: unknown sequence 3", lambda: cache.get_kv(0, 3)),
        (ValueError, "seq_id: sequence 0 holds no tokens in layer 1", lambda: cache.get_kv(1, s)),
        # a list of ids names the entry; a lone int is not a list (it was Python's "not iterable")
        (TypeError, r"^seq_ids\[1\]: expected an int, got float 1.0$",
         lambda: cache.decode_attention(0, np.ones((2, 4, 1, 32), np.float32), [s, 1.0])),
        (KeyError, r"seq_ids\[0\]: unknown sequence 9", lambda: cache.page_table(0, [9])),
        (TypeError, "^seq_ids: expected a list of sequence ids, got int 0$",
         lambda: cache.decode_attention(0, np.ones((1, 4, 1, 32), np.float32), s)),
        (TypeError, "^seq_ids: expected a list of sequence ids, got int 0$", lambda: cache.select_batch(s)),
    ]
    for exc, msg, fn in cases:
        with pytest.raises(exc, match=msg):
            fn()
        _same(cache, snap)
    cache.append(0, s, k[None], v[None])  # 4-D with batch 1 is accepted
    assert cache.seq_len(0, s) == 6


def test_float32_pages_hold_what_their_attention_can_sum(rng):
    """Float32 pages that ``decode_attention`` reads take ``|x| <= 2**21`` like PQO pages (a
    value of 3e38 was stored and attended to inf); key-only float32 pages (MLA latents), which
    it never reads, take any float32."""
    cache, s, k, v, snap = _one_sequence(rng, num_layers=1)
    big = v.copy()
    big[1, 2, 3] = 3e38
    with pytest.raises(ValueError, match=r"^v: max \|v\| = 3e\+38 exceeds 2\.09715e\+06, the largest value float32 "
                                         r"pages that decode_attention reads"):
        cache.append(0, s, k, big)
    _same(cache, snap)
    edge = v.copy()
    edge[1, 2, 3] = 2.0 ** 21
    cache.append(0, s, k, edge)
    out = cache.decode_attention(0, rng.standard_normal((1, 4, 1, 32)).astype(np.float32), causal=False)
    assert np.isfinite(out).all()
    keys = PagedKVCache(num_pages=4, num_layers=1, num_kv_heads=1, head_dim=32, v_head_dim=0)
    t = keys.allocate_sequence()
    keys.append(0, t, np.full((1, 2, 32), 3e38, np.float32))
    assert keys.seq_len(0, t) == 2


def test_constructor_validation():
    with pytest.raises(ValueError, match="storage: expected one of"):
        PagedKVCache(4, 1, 1, 32, storage="int4")
    with pytest.raises(ValueError, match="head_dim: expected a multiple of 32 for storage='pqo3'"):
        PagedKVCache(4, 1, 1, 48, storage="pqo3")
    with pytest.raises(ValueError, match="page_size: expected an int >= 1, got 0"):
        PagedKVCache(4, 1, 1, 32, page_size=0)
    with pytest.raises(ValueError, match="num_pages"):
        PagedKVCache(0, 1, 1, 32)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_pqo_pages_are_block_quantizer_codes(rng, bits):
    cache = PagedKVCache(num_pages=6, num_layers=1, num_kv_heads=2, head_dim=64, page_size=8,
                         storage=f"pqo{bits}")
    s = cache.allocate_sequence()
    k, v = _kv(rng, 2, 13, 64)
    k[0, 3, 5] = 30.0
    cache.append(0, s, k[:, :5], v[:, :5])
    cache.append(0, s, k[:, 5:], v[:, 5:])
    codes, scales = numba_kv.quantize_blocks(k, bits)
    pages = cache.block_table(0, s)
    pool_c, pool_s = cache.pools["k_codes"], cache.pools["k_scales"]
    assert pool_c.shape == (6, 2, 8, 64 * bits // 8) and pool_s.shape == (6, 2, 8, 2)
    assert pool_c.dtype == np.uint8 and pool_s.dtype == np.uint16
    for t in range(13):
        p, slot = pages[t // 8], t % 8
        assert np.array_equal(pool_c[p, :, slot], codes[:, t])
        assert np.array_equal(pool_s[p, :, slot], scales[:, t])
    kk, _ = cache.get_kv(0, s)
    assert np.array_equal(kk, numba_kv.dequantize_blocks(codes, scales, bits))
    assert cache.bits_per_value == bits + 0.5


def test_key_only_cache(rng):
    cache = PagedKVCache(num_pages=2, num_layers=1, num_kv_heads=1, head_dim=40, v_head_dim=0)
    s = cache.allocate_sequence()
    k = rng.standard_normal((1, 5, 40)).astype(np.float32)
    cache.append(0, s, k)
    kk, vv = cache.get_kv(0, s)
    assert vv is None and np.array_equal(kk, k)
    with pytest.raises(ValueError, match="v: expected None for a key-only cache"):
        cache.append(0, s, k, k)
    assert set(cache.pools) == {"k_pages"}


class PagedChurn(RuleBasedStateMachine):
    """Random allocate / append / free against a dict-of-lists model."""

    def __init__(self):
        super().__init__()
        self.cache = PagedKVCache(num_pages=12, num_layers=2, num_kv_heads=1, head_dim=8, page_size=3)
        self.model = {}  # seq -> [layer0 tokens, layer1 tokens] (each token an int tag)
        self.tag = 0

    @rule()
    def allocate(self):
        self.model[self.cache.allocate_sequence()] = [[], []]

    @precondition(lambda self: self.model)
    @rule(data=st.data(), layer=st.integers(0, 1), n=st.integers(1, 8))
    def append(self, data, layer, n):
        sid = data.draw(st.sampled_from(sorted(self.model)))
        tags = list(range(self.tag, self.tag + n))
        self.tag += n
        k = np.repeat(np.array(tags, np.float32)[None, :, None], 8, axis=2)
        cur = len(self.model[sid][layer])
        need = -(-(cur + n) // 3) - -(-cur // 3)
        if need > self.cache.num_free_pages:
            with pytest.raises(OutOfPagesError):
                self.cache.append(layer, sid, k, -k)
        else:
            self.cache.append(layer, sid, k, -k)
            self.model[sid][layer].extend(tags)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def free(self, data):
        sid = data.draw(st.sampled_from(sorted(self.model)))
        self.cache.free_sequence(sid)
        del self.model[sid]

    @invariant()
    def pages_are_conserved_and_unique(self):
        owned = [p for layer in range(2) for s in self.model for p in self.cache.block_table(layer, s)]
        assert len(owned) == len(set(owned))
        assert len(owned) + self.cache.num_free_pages == 12
        for layer in range(2):
            for s, toks in self.model.items():
                assert self.cache.seq_len(layer, s) == len(toks[layer])
                assert self.cache.num_seq_pages(layer, s) == -(-len(toks[layer]) // 3)

    @invariant()
    def contents_match(self):
        for s, toks in self.model.items():
            for layer in range(2):
                if toks[layer]:
                    k, v = self.cache.get_kv(layer, s)
                    assert k[0, :, 0].tolist() == toks[layer] and np.array_equal(v, -k)
        if self.model:
            pt = self.cache.page_table(0)
            assert pt.kv_indptr[-1] == len(pt.kv_indices)


TestPagedChurn = PagedChurn.TestCase
TestPagedChurn.settings = settings(max_examples=25, stateful_step_count=15, deadline=None,
                                   suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("storage", ["float32", "pqo4"])
def test_compressor_roundtrip_through_pages(rng, storage):
    cache = PagedKVCache(num_pages=20, num_layers=2, num_kv_heads=2, head_dim=64, page_size=16,
                         storage=storage)
    src, dst = cache.allocate_sequence(), cache.allocate_sequence()
    k, v = _kv(rng, 2, 40, 64)
    cache.append(1, src, k, v)
    comp = KVCacheCompressor(LowRank(64, energy=None, dtype="float32"))
    c = comp.compress_paged_cache(cache, 1, src)
    assert c.layout == ("unbatched", 2, 40)
    comp.decompress_to_paged_cache(c, cache, 1, dst)
    a, b = cache.get_kv(1, src), cache.get_kv(1, dst)
    tol = 1e-4 if storage == "float32" else 0.3  # pqo4: requantized once more
    np.testing.assert_allclose(b[0], a[0], atol=tol)
    # a compressed tensor that does not fit the cache is rejected before anything changes
    other = KVCacheCompressor(Hybrid(4, 8)).compress_kv_3d(k[:1], v[:1])
    snap = _snapshot(cache)
    with pytest.raises(ValueError, match="compressed: expected num_heads=2"):
        comp.decompress_to_paged_cache(other, cache, 1, dst)
    with pytest.raises(KeyError, match="seq_id"):
        comp.decompress_to_paged_cache(c, cache, 1, 99)
    with pytest.raises(TypeError, match="cache: expected a PagedKVCache"):
        comp.compress_paged_cache(object(), 1, src)
    _same(cache, snap)


def test_asymmetric_bits_storage(rng):
    cache = PagedKVCache(num_pages=6, num_layers=1, num_kv_heads=2, head_dim=64, page_size=8, storage="pqo-k4v3")
    assert (cache.k_bits, cache.v_bits) == (4, 3) and cache.bits_per_value == (4.5 + 3.5) / 2
    s = cache.allocate_sequence()
    k, v = _kv(rng, 2, 11, 64)
    cache.append(0, s, k, v)
    assert cache.pools["k_codes"].shape[-1] == 64 * 4 // 8 and cache.pools["v_codes"].shape[-1] == 64 * 3 // 8
    kk, vv = cache.get_kv(0, s)
    kc, ks = numba_kv.quantize_blocks(k, 4)
    vc, vs = numba_kv.quantize_blocks(v, 3)
    assert np.array_equal(kk, numba_kv.dequantize_blocks(kc, ks, 4))
    assert np.array_equal(vv, numba_kv.dequantize_blocks(vc, vs, 3))
    with pytest.raises(ValueError, match="storage"):
        PagedKVCache(4, 1, 1, 32, storage="pqo-k5v3")


def test_validate_modes_on_host_arrays(rng):
    """``validate``: host arrays are read at once under "auto"/"sync"/"deferred" (a rejected
    append or query changes nothing); "off" stores what it is given; the mode is checked."""
    cache = PagedKVCache(num_pages=4, num_layers=1, num_kv_heads=2, head_dim=32, page_size=4, storage="pqo3")
    s = cache.allocate_sequence()
    k, v = _kv(rng, 2, 3, 32)
    cache.append(0, s, k, v)
    q = rng.standard_normal((1, 4, 1, 32)).astype(np.float32)
    bad = v.copy()
    bad[1, 2, 5] = np.nan
    huge_q = np.full_like(q, 2.0 ** 70)
    assert cache.validate == "auto"
    for mode in ("auto", "sync", "deferred"):
        cache.validate = mode
        snap = _snapshot(cache)
        with pytest.raises(ValueError, match="v: expected finite values"):
            cache.append(0, s, k, bad)
        with pytest.raises(ValueError, match=r"k: max \|k\| = 3e\+06 exceeds 2\.09715e\+06"):
            cache.append(0, s, np.full_like(k, 3e6), v)
        with pytest.raises(ValueError, match="q: expected finite values"):
            cache.decode_attention(0, np.where(q > 1, np.inf, q).astype(np.float32), [s])
        with pytest.raises(ValueError, match=r"q: max \|q\| = 1\.18059e\+21 exceeds"):
            cache.decode_attention(0, huge_q, [s])
        _same(cache, snap)
        cache.check_inputs()  # host arrays: nothing was deferred
    with pytest.raises(ValueError, match=r"validate: expected one of \['auto', 'sync', 'deferred', 'off'\]"):
        cache.validate = "lazy"
    assert cache.validate == "deferred"
    cache.validate = "off"  # garbage in, garbage out: stored without a check
    cache.append(0, s, k, bad)
    assert cache.seq_len(0, s) == 6
    cache.check_inputs()
    exact = PagedKVCache(num_pages=2, num_layers=1, num_kv_heads=2, head_dim=32, page_size=4)
    exact.validate = "off"
    exact.append(0, exact.allocate_sequence(), k, bad)
    assert np.isnan(exact.get_kv(0, 0)[1][1, 2, 5])


def test_validate_survives_fork_and_reset(rng):
    cache = PagedKVCache(num_pages=4, num_layers=1, num_kv_heads=1, head_dim=32, page_size=4)
    cache.validate = "off"
    copy = cache.fork()
    assert copy.validate == "off"
    cache.reset()
    assert cache.validate == "off"


@pytest.mark.parametrize("change", ["free", "crop"])
def test_iter_pages_refuses_a_page_the_sequence_no_longer_holds(change):
    """The page list is read once; a page freed meanwhile and taken by another sequence was
    yielded with that sequence's tokens as this one's."""
    c = PagedKVCache(num_pages=4, num_layers=1, num_kv_heads=1, head_dim=32, page_size=4)
    a = c.allocate_sequence()
    zeros = np.zeros((1, 8, 32), np.float32)
    c.append(0, a, zeros, zeros)  # two pages of zeros
    it = c.iter_pages(0, a)
    first = next(it)
    assert first[1] == 4 and not first[2].any()
    if change == "free":
        c.free_sequence(a)
    else:
        c.crop(a, 4)
    b = c.allocate_sequence()
    c.append(0, b, np.ones((1, 8, 32), np.float32), np.ones((1, 8, 32), np.float32))
    with pytest.raises(RuntimeError, match=f"seq_id: sequence {a} changed while its pages were iterated"):
        next(it)


def test_a_pool_beyond_the_32_bit_row_index_is_refused():
    """Pool rows (pages × KV heads × page size) are int32 on every path; a larger pool was
    built, and its rows past 2**31 wrapped: the first append went into another page's storage
    (the device decode path refused such a pool; the appends did not)."""
    from numba_kv.caches.config import MAX_POOL_ROWS

    assert MAX_POOL_ROWS == 2 ** 31 - 1
    with pytest.raises(ValueError, match=r"^num_pages: .* pool rows; at most 2,147,483,647"):
        PagedKVCache(num_pages=2 ** 32 // (32 * 1024) + 1, num_layers=1, num_kv_heads=32, head_dim=32, page_size=1024,
                     v_head_dim=0)
    with pytest.raises(ValueError, match="pool rows"):
        PagedKVCache(num_pages=2 ** 27, num_layers=1, num_kv_heads=1, head_dim=32, page_size=16)


def test_limit_values_checks_its_limit():
    """``limit_values`` takes a real number > 0: a string was Python's own conversion error,
    naming no argument; NaN and 0 are ValueErrors; the limit holds appends to it."""
    cache = PagedKVCache(num_pages=4, num_layers=1, num_kv_heads=1, head_dim=32, page_size=4)
    with pytest.raises(TypeError, match=r"^limit: expected a float > 0, got str 'a'"):
        cache.limit_values("a", "a test")
    for bad in (0.0, float("nan"), -1):
        with pytest.raises(ValueError, match=r"^limit: expected a float > 0"):
            cache.limit_values(bad, "a test")
    cache.limit_values(np.float32(10.0), "a test")
    seq = cache.allocate_sequence()
    x = np.full((1, 2, 32), 11.0, np.float32)
    with pytest.raises(ValueError, match="a test"):
        cache.append(0, seq, x, x)
