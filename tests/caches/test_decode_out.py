"""``decode(..., out=)``: the fused output written into the caller's array (issue 27, item 3:
a decode step that allocates nothing), checked before anything is stored."""

from __future__ import annotations

import numpy as np
import pytest

from numba_kv import AttendConfig, Fused, make_cache
from numba_kv.caches.paged import PagedKVCache

H, G, D = 2, 2, 64


def _step(rng, t=1, batch=1, dtype=np.float32):
    k = rng.standard_normal((batch, H, t, D)).astype(dtype)
    v = rng.standard_normal((batch, H, t, D)).astype(dtype)
    q = rng.standard_normal((batch, H * G, t, D)).astype(dtype)
    return k, v, q


@pytest.mark.parametrize("name, opts", [("pqo3", {}), ("kv4", {}), ("pqo3", {"outlier_channels": 32}),
                                        ("pqo3", {"head_overrides": {0: {1: {"bits": 4}}}})])
def test_out_is_the_output_and_equals_a_new_array(name, opts):
    rng = np.random.default_rng(3)
    a, b = (make_cache(name, num_layers=1, num_kv_heads=H, head_dim=D, **opts) for _ in range(2))
    k, v, _ = _step(rng, 40)
    a.prefill(0, k, v)
    b.prefill(0, k, v)
    cfg = AttendConfig(D ** -0.5, n_kv_groups=G)
    out = np.full((1, H * G, 1, D), np.nan, np.float32)
    for _ in range(3):
        k, v, q = _step(rng)
        got = a.decode(0, k, v, q, cfg, out=out)
        want = b.decode(0, k, v, q, cfg).out
        assert isinstance(got, Fused) and got.out is out
        np.testing.assert_array_equal(out, want)


def test_out_of_another_dtype_follows_k():
    rng = np.random.default_rng(4)
    a, b = (make_cache("pqo3", num_layers=1, num_kv_heads=H, head_dim=D) for _ in range(2))
    k, v, _ = _step(rng, 40, dtype=np.float64)
    a.prefill(0, k, v)
    b.prefill(0, k, v)
    k, v, q = _step(rng, dtype=np.float64)
    cfg = AttendConfig(D ** -0.5, n_kv_groups=G)
    out = np.empty((1, H * G, 1, D), np.float64)
    assert a.decode(0, k, v, q, cfg, out=out).out is out
    np.testing.assert_array_equal(out, b.decode(0, k, v, q, cfg).out)


def _bad_outs():
    shape = (1, H * G, 1, D)
    ro = np.zeros(shape, np.float32)
    ro.flags.writeable = False
    return [(np.zeros(shape, np.float64), TypeError, "out: expected dtype float32"),
            (np.zeros((1, H * G, 2, D), np.float32), ValueError, r"out: expected shape \(1, 4, 1, 64\)"),
            (np.zeros((1, H * G, 1, 2 * D), np.float32)[..., ::2], ValueError, "out: expected a C-contiguous"),
            (ro, ValueError, "out: expected a writable"),
            ([[0.0]], TypeError, "out: expected a numpy.ndarray")]


def _prefilled(seed):
    """A ``pqo3`` layer holding 40 tokens and a copy of everything a refused call must keep."""
    rng = np.random.default_rng(seed)
    cache = make_cache("pqo3", num_layers=1, num_kv_heads=H, head_dim=D)
    k, v, _ = _step(rng, 40)
    cache.prefill(0, k, v)
    return rng, cache, (cache.seq_len(0), cache.memory_usage(), [a.copy() for a in cache.live_arrays(0)])


def _assert_unchanged(cache, before):
    assert (cache.seq_len(0), cache.memory_usage()) == before[:2]
    assert all(np.array_equal(x, y) for x, y in zip(cache.live_arrays(0), before[2]))


@pytest.mark.parametrize("case", range(5))
def test_a_bad_out_is_refused_before_anything_is_stored(case):
    bad, exc, msg = _bad_outs()[case]
    rng, cache, before = _prefilled(5)
    k, v, q = _step(rng)
    with pytest.raises(exc, match=msg):
        cache.decode(0, k, v, q, AttendConfig(D ** -0.5, n_kv_groups=G), out=bad)
    _assert_unchanged(cache, before)


@pytest.mark.parametrize("name", ["dense", "pqo3:decode_output=dequantized"])
def test_out_is_refused_by_a_cache_that_returns_dequantized(name):
    rng = np.random.default_rng(6)
    cache = make_cache(name, num_layers=1, num_kv_heads=H, head_dim=D)
    k, v, q = _step(rng)
    with pytest.raises(TypeError, match="out: .*returns Dequantized"):
        cache.decode(0, k, v, q, AttendConfig(D ** -0.5, n_kv_groups=G), out=np.empty(q.shape, np.float32))
    assert cache.seq_len(0) == 0


def test_paged_decode_attention_writes_out():
    rng = np.random.default_rng(7)
    cache = PagedKVCache(8, 1, H, D, page_size=8, storage="pqo3")
    sid = cache.allocate_sequence()
    k = rng.standard_normal((H, 5, D)).astype(np.float32)
    cache.append(0, sid, k, k)
    q = rng.standard_normal((1, H * G, 1, D)).astype(np.float32)
    out = np.empty(q.shape, np.float32)
    assert cache.decode_attention(0, q, [sid], out=out) is out
    np.testing.assert_array_equal(out, cache.decode_attention(0, q, [sid]))
    with pytest.raises(ValueError, match=r"out: expected shape \(1, 4, 1, 64\)"):
        cache.decode_attention(0, q, [sid], out=np.empty((1, H * G, 2, D), np.float32))
    with pytest.raises(TypeError, match="out: expected dtype float32"):
        cache.decode_attention(0, q, [sid], out=np.empty(q.shape, np.float16))


@pytest.mark.parametrize("alias", ["q", "k", "v"])
def test_an_out_that_shares_memory_with_an_input_is_refused_before_anything_is_stored(alias):
    # on a GPU the kernel writes out while it reads q: an aliased out would read its own output
    rng, cache, before = _prefilled(8)
    k, v, q = _step(rng)
    out = q
    if alias != "q":  # k, v are [1, H, 1, D]: make one of them a view of the out buffer (shaped like q)
        out = np.zeros(q.shape, np.float32)
        out[:, :H] = k if alias == "k" else v
        k, v = (out[:, :H], v) if alias == "k" else (k, out[:, :H])
    with pytest.raises(ValueError, match=f"out: expected an array that shares no memory with {alias} "
                                         f".*overlaps {alias}"):
        cache.decode(0, k, v, q, AttendConfig(D ** -0.5, n_kv_groups=G), out=out)
    _assert_unchanged(cache, before)
    # the same arrays with a separate out: accepted
    sep = np.empty(q.shape, np.float32)
    assert cache.decode(0, k.copy(), v.copy(), q.copy(), AttendConfig(D ** -0.5, n_kv_groups=G), out=sep).out is sep


def test_byte_ranges_of_cuda_arrays_decide_their_overlap():
    # CUDA arrays (no numpy.shares_memory): the byte ranges their elements span, from
    # __cuda_array_interface__ (data pointer, shape, strides, itemsize)
    from numba_kv._validate import overlaps

    class Dev:
        def __init__(self, ptr, shape, typestr="<f4", strides=None):
            self.__cuda_array_interface__ = {"data": (ptr, False), "shape": shape, "typestr": typestr,
                                             "strides": strides, "version": 3}

    a = Dev(1000, (2, 4))  # bytes [1000, 1032)
    assert overlaps(a, Dev(1028, (1,)))  # its last element
    assert not overlaps(a, Dev(1032, (8,)))  # right after it
    assert not overlaps(Dev(968, (8,)), a)  # right before it
    assert overlaps(a, Dev(1016, (2,), "<f8"))
    down = Dev(1000, (4,), strides=(-8,))  # elements at 1000, 992, 984, 976: bytes [976, 1004)
    assert overlaps(down, Dev(976, (1,))) and overlaps(down, Dev(1000, (1,)))
    assert not overlaps(down, Dev(972, (1,))) and not overlaps(down, Dev(1004, (1,)))
    assert not overlaps(a, Dev(1000, (0,)))  # no element, no overlap
