"""QA of the paged and MLA caches: a fork's write buffers, latents whose float32 up-projection
would overflow, reprs, and page accounting through the lifecycle (expected values from plain
NumPy and the geometry, not from the caches)."""

import dataclasses

import numpy as np
import pytest

from numba_kv import CacheFileError
from numba_kv._backend import to_host
from numba_kv._validate import F32_MAX
from numba_kv.caches.mla import MLACache, SimpleMLACache
from numba_kv.caches.paged import PagedKVCache

from ..conftest import to_device


@pytest.mark.cuda
def test_fork_has_its_own_write_buffers(rng):
    """A fork's append between this cache's quantize and scatter must not overwrite its codes
    (the small-write buffers of a device cache were shared by ``fork()``)."""
    c = PagedKVCache(8, 1, 1, 32, page_size=4, storage="pqo3")
    s = c.allocate_sequence()
    x0 = rng.standard_normal((1, 7, 32)).astype(np.float32)
    for a, b in ((0, 2), (2, 5), (5, 7)):  # the 3-token run crosses a page: buffered write
        c.append(0, s, to_device(x0[:, a:b]), to_device(x0[:, a:b]))
    f = c.fork()
    xa, xb = (rng.standard_normal((1, 3, 32)).astype(np.float32) for _ in range(2))
    scatter = c._scatter_codes

    def interleaved(part, codes, scales, idx):  # another thread appends to the fork meanwhile
        if part == "k" and not interleaved.done:
            interleaved.done = True
            f.append(0, s, to_device(xb), to_device(xb))
        scatter(part, codes, scales, idx)

    interleaved.done = False
    c._scatter_codes = interleaved
    c.append(0, s, to_device(xa), to_device(xa))
    assert interleaved.done
    ref = PagedKVCache(8, 1, 1, 32, page_size=4, storage="pqo3")
    r = ref.allocate_sequence()
    for a, b in ((0, 2), (2, 5), (5, 7)):
        ref.append(0, r, x0[:, a:b], x0[:, a:b])
    ref_f = ref.fork()
    ref.append(0, r, xa, xa)
    ref_f.append(0, r, xb, xb)
    for cache, want in ((c, ref), (f, ref_f)):
        k, v = cache.get_kv(0, s)
        np.testing.assert_array_equal(to_host(k), want.get_kv(0, r)[0])
        np.testing.assert_array_equal(to_host(v), want.get_kv(0, r)[1])


def _mla(rng, storage="float32"):
    h, r, rope, nope, dv = 2, 32, 32, 8, 8
    w_uk = rng.standard_normal((h, r, nope)).astype(np.float32)
    w_uv = rng.standard_normal((h, r, dv)).astype(np.float32)
    # every output of get_kv is Σ_i c_i·W[i, j]: finite while max|c|·Σ_i |W[i, j]| is
    colsum = max(np.abs(w_uk.astype(np.float64)).sum(1).max(), np.abs(w_uv.astype(np.float64)).sum(1).max(), 1.0)
    return MLACache(8, 1, h, r, rope, nope, dv, w_uk, w_uv, page_size=4, storage=storage), F32_MAX / (2 * colsum)


def test_mla_latent_beyond_float32_up_projection_is_refused(rng):
    cache, limit = _mla(rng)
    s = cache.allocate_sequence()
    ok = np.full((2, 64), limit * 0.99, np.float32)
    cache.append_latent(0, s, ok)
    k, v = cache.get_kv(0, s)
    assert np.isfinite(k).all() and np.isfinite(v).all()
    big = np.full((2, 64), 1e38, np.float32)  # finite, but c·W_UK overflows float32
    with pytest.raises(ValueError, match=r"^c_kv: max \|c_kv\| = 1e\+38 exceeds"):
        cache.append_latent(0, s, big)
    assert cache.seq_len(0, s) == 2 and cache.num_free_pages == 7
    # full K/V whose least-squares latent is out of range: named as the caller's k / v
    kf, vf = (np.ascontiguousarray(a[:, :1]) * np.float32(1.5) for a in (k, v))  # latent 1.5 · 0.99 · limit
    assert np.isfinite(kf).all() and np.isfinite(vf).all()
    with pytest.raises(ValueError, match=r"^k/v: the least-squares latent"):
        cache.append(0, s, kf, vf)
    assert cache.seq_len(0, s) == 2


def test_simple_mla_latent_beyond_float32_up_projection_is_refused():
    d, lat = 4, 2
    down = np.eye(d, lat, dtype=np.float32)
    up = np.full((lat, d), 1e34, np.float32)  # finite weights: k_lat·(up + rope_key) overflows past |k_lat| ~ 8.5e3
    cache = SimpleMLACache(8, 1, 1, d, lat, down, up, up)
    s = cache.allocate_sequence()
    cache.append_compressed(0, s, np.full((1, 1, lat), 1e3, np.float32), np.full((1, 1, lat), 1e3, np.float32))
    k, v = cache.get_kv(0, s)
    np.testing.assert_allclose(k, np.full((1, 1, d), 2 * 2e37), rtol=1e-6)  # 2 latents · (1e34 + 1e34) · 1e3
    # below the pages' own 2**21, but its up-projection (4e38) is beyond float32
    with pytest.raises(ValueError, match=r"^k: max \|k\| = 10000 exceeds"):
        cache.append_compressed(0, s, np.full((1, 1, lat), 1e4, np.float32), np.ones((1, 1, lat), np.float32))
    assert cache.seq_len(0, s) == 1


def test_reprs_name_geometry_and_pool(rng):
    c = PagedKVCache(8, 2, 2, 64, page_size=4, v_head_dim=32, storage="pqo3")
    s = c.allocate_sequence()
    c.append(0, s, np.ones((2, 5, 64), np.float32), np.ones((2, 5, 32), np.float32))
    assert repr(c) == ("PagedKVCache(num_layers=2, num_kv_heads=2, head_dim=64, v_head_dim=32, num_pages=8, "
                       "page_size=4, storage='pqo3', sequences=1, free_pages=6)")
    mla, _ = _mla(rng)
    assert repr(mla) == ("MLACache(num_layers=1, num_heads=2, kv_lora_rank=32, qk_rope_head_dim=32, "
                         "qk_nope_head_dim=8, v_head_dim=8, num_pages=8, page_size=4, storage='float32', "
                         "sequences=0, free_pages=8)")
    simple = SimpleMLACache(4, 1, 2, 8, 4, np.ones((8, 4)), np.ones((4, 8)), np.ones((4, 8)))
    assert repr(simple) == ("SimpleMLACache(num_layers=1, num_heads=2, head_dim=8, latent_dim=4, num_pages=4, "
                            "page_size=16, storage='float32', sequences=0, free_pages=4)")


@pytest.mark.parametrize("storage", ["float32", "pqo3"])
def test_page_accounting_through_the_lifecycle(rng, storage):
    """Pages owned after appends of exactly full pages, crop, fork, select_batch and reset:
    the free list and the block tables always partition the pool; bytes = pages · formula."""
    ps, h, d = 4, 2, 32
    c = PagedKVCache(16, 2, h, d, page_size=ps, storage=storage)
    per_page = 2 * h * ps * (d * 4 if storage == "float32" else d * 3 // 8 + 2 * (d // 32))
    assert c.bytes_per_page == per_page

    def owned():
        pages = [p for layer in range(2) for s in c.sequences for p in c.block_table(layer, s)]
        assert sorted(pages + [p for p in range(16) if p not in pages]) == list(range(16))
        assert len(pages) == len(set(pages)) == 16 - c.num_free_pages
        assert c.memory_usage() == len(pages) * per_page
        return len(pages)

    a, b = c.allocate_sequence(), c.allocate_sequence()
    x = rng.standard_normal((h, 2 * ps, d)).astype(np.float32)
    c.append(0, a, x, x)  # exactly two full pages
    c.append(1, a, x[:, :1], x[:, :1])
    c.append(0, b, x[:, :ps + 1], x[:, :ps + 1])
    assert owned() == 2 + 1 + 2
    assert c.page_table(0, [a, b]).kv_last_page_len.tolist() == [ps, 1]
    c.crop(a, 1)
    assert owned() == 1 + 1 + 2 and c.seq_len(0, a) == 1
    f = c.fork_sequence(b)
    assert owned() == 2 + 2 + 2
    np.testing.assert_array_equal(c.get_kv(0, f)[0], c.get_kv(0, b)[0])
    assert c.select_batch([f, f, a]) == [f, f + 1, a]
    assert owned() == 2 + 2 + 2 and b not in c.sequences
    c.reset()
    assert owned() == 0 and c.sequences == []


def test_a_device_page_table_before_the_first_append_is_refused():
    """``page_table(on_device=True)`` returned host arrays while the pool had no device yet."""
    cache = PagedKVCache(4, 1, 1, 32, page_size=4)
    s = cache.allocate_sequence()
    with pytest.raises(ValueError, match=r"on_device: the page pool has no device before the first append"):
        cache.page_table(0, on_device=True)
    with pytest.raises(TypeError, match=r"on_device: expected a bool"):
        cache.page_table(0, on_device="yes")
    cache.append(0, s, np.ones((1, 2, 32), np.float32), np.ones((1, 2, 32), np.float32))
    table = cache.page_table(0, on_device=True)
    assert isinstance(table.kv_indices, np.ndarray) and table.kv_indptr.tolist() == [0, 1]
    assert table.kv_last_page_len.tolist() == [2]


@pytest.mark.parametrize("edit", [{"next_seq": -1}, "negative id"])
def test_a_file_with_negative_sequence_ids_is_refused(edit):
    """Sequence ids count up from 0: a state with ``next_seq = -1`` (no live sequence) or a
    negative live id loaded, and the next ``allocate_sequence`` handed out an id below 0."""
    cache = PagedKVCache(4, 1, 1, 32, page_size=4)
    s = cache.allocate_sequence()
    if edit == "negative id":
        cache.append(0, s, np.ones((1, 2, 32), np.float32), np.ones((1, 2, 32), np.float32))
    state = cache.state_dict()
    st = dict(state.state)
    if edit == "negative id":
        st["tables"] = [{-1: pages} for t in st["tables"] for pages in t.values()]
        st["lens"] = [{-1: n} for d in st["lens"] for n in d.values()]
        st["next_seq"] = 0
    else:
        st = {**st, "tables": [{}], "lens": [{}], "free": list(range(4)), **edit}
    with pytest.raises(CacheFileError, match=r"state: .*next_seq.* (is not above the live sequence ids|expected an "
                                             r"int >= 0, got -1)"):
        PagedKVCache.from_state_dict(dataclasses.replace(state, state=st))


@pytest.mark.parametrize("bad", [1.5, True, float("inf"), "2"])
def test_a_paged_state_number_must_be_a_json_int(bad):
    """The paged state's numbers went through ``int()``: 1.5 and true loaded as 1, infinity
    raised ``OverflowError``."""
    cache = PagedKVCache(4, 1, 1, 32, page_size=4)
    s = cache.allocate_sequence()
    cache.append(0, s, np.ones((1, 2, 32), np.float32), np.ones((1, 2, 32), np.float32))
    state = cache.state_dict()
    st = {**state.state, "lens": [{k: bad for k in d} for d in state.state["lens"]]}
    with pytest.raises(CacheFileError, match=r"state: .*a length: expected an int >= 0"):
        PagedKVCache.from_state_dict(dataclasses.replace(state, state=st))
