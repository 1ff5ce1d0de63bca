"""Per-KV-head configuration: ``make_cache(..., head_overrides={layer: {kv_head: {...}}})``.

Expected values never come from the split-layer code itself: every KV head of a split layer
must answer exactly (bit for bit) what a plain one-head cache built with that head's options
answers when fed just that head's slice (the block rotation's signs, the whole-head signs
and the QJL sketch depend on ``head_dim`` only, never on the head index or the head count,
so a part with two heads stores each one as a one-head cache would); ``memory_usage`` is
counted by hand; bad arguments and bad inputs name the argument and change nothing.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from numba_kv import AttendConfig, CacheFileError, Dequantized, Fused, PolarQuantCache, make_cache
from numba_kv.caches._pieces import PER_HEAD_OPTIONS
from numba_kv.caches.mixed import MixedCache
from numba_kv.caches.state import CacheState

D, NKV, G = 64, 3, 2  # head_dim, KV heads, query heads per KV head (GQA: Hq = 6)
HQ = NKV * G
CFG = AttendConfig.for_shapes(D, HQ, NKV)
GEOM = {"num_kv_heads": NKV, "head_dim": D}
SPLIT = {0: {1: {"bits": 4}}}  # layer 0: heads 0 and 2 at 3 bits, head 1 at 4 bits


def _kv(rng, t, batch=2, heads=NKV):
    return tuple(rng.standard_normal((batch, h, t, D)).astype(np.float32) for h in (heads, heads, heads * G))


def _arrays(res):
    """Every array of a protocol result, in a fixed order (None for a missing bias)."""
    if isinstance(res, Fused):
        return [res.out]
    r = res.result if isinstance(res, Dequantized) else res
    return [r.k, r.v, r.logit_bias]


def _head_slices(res, h):
    """Head ``h``'s share of a full result: its KV head of K/V, its query heads of the rest."""
    if isinstance(res, Fused):
        return [res.out[:, h * G:(h + 1) * G]]
    r = res.result if isinstance(res, Dequantized) else res
    bias = None if r.logit_bias is None else r.logit_bias[:, h * G:(h + 1) * G]
    return [r.k[:, h:h + 1], r.v[:, h:h + 1], bias]


def _assert_same(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        if b is None:
            assert a is None or not np.any(a)  # a piece without a bias is zeros in the full one
            continue
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)


# -- equivalence with plain one-head caches ---------------------------------------------------
CASES = [
    # (base name, options, layer_overrides, head_overrides, reference per (layer, head): name, options)
    ("pqo3", {"decode_output": "fused"}, {}, {0: {1: {"bits": 4}}, -1: {0: {"k_bits": 4}, -1: {"v_bits": 2}}},
     [["pqo3", "pqo4", "pqo3"], ["pqo-k4v3", "pqo3", "pqo-k3v2"]]),
    ("pqo3", {"decode_output": "dequantized"}, {1: {"sliding_window": 6}}, {0: {1: {"bits": 4}}, 1: {2: {"bits": 2}}},
     [["pqo3", "pqo4", "pqo3"], ["pqo3", "pqo3", "pqo2"]]),
    ("pqo-k4v3-head-eden", {"window_dtype": "int8", "key_center": True}, {}, {0: {0: {"v_bits": 2}, 2: {"v_bits": 2}}},
     [["pqo-k4v2-head-eden", "pqo-k4v3-head-eden", "pqo-k4v2-head-eden"]] + [["pqo-k4v3-head-eden"] * 3]),
    ("tq3", {"decode_output": "dequantized", "residual_length": 4, "sink_tokens": 1}, {}, {1: {1: {"bits": 4}}},
     [["tq3"] * 3, ["tq3", "tq4", "tq3"]]),
    # other per-vector code options: a channel split's widths, the norm mode
    ("pqo3.5", {"residual_length": 2}, {}, {0: {1: {"bits": 2}}, 1: {0: {"bits": 2}, 2: {"bits": 2}}},
     [["pqo3.5", "pqo2.5", "pqo3.5"], ["pqo2.5", "pqo3.5", "pqo2.5"]]),
    ("pqo3", {}, {}, {1: {2: {"norm_mode": "l2"}}}, [["pqo3"] * 3, ["pqo3", "pqo3", "pqo3-l2"]]),
    # the head VQ code per head (a 3-bit side keeps the scalar code)
    ("pqo-k4v3-head-eden", {"window_dtype": "int8", "key_center": True, "residual_length": 2},
     {}, {0: {1: {"vq": True}}, 1: {0: {"v_bits": 2, "vq": True}, 2: {"vq": True}}},
     [["pqo-k4v3-head-eden", "pqo-k4v3-head-eden-vq", "pqo-k4v3-head-eden"],
      ["pqo-k4v2-head-eden-vq", "pqo-k4v3-head-eden", "pqo-k4v3-head-eden-vq"]]),
]


@pytest.mark.parametrize(("base", "opts", "layers", "heads", "ref"), CASES)
def test_each_head_answers_like_its_own_plain_cache(rng, base, opts, layers, heads, ref):
    mixed = make_cache(base, num_layers=2, **GEOM, layer_overrides=layers, head_overrides=heads, **opts)
    assert isinstance(mixed, MixedCache)
    windows = [layers.get(i, {}).get("sliding_window") for i in range(2)]
    plain = [[make_cache(ref[i][h], num_layers=1, num_kv_heads=1, head_dim=D, sliding_window=windows[i], **opts)
              for h in range(NKV)] for i in range(2)]
    for step, t in enumerate((7, 3, 1, 1, 2, 1)):  # prefill, chunked prefill, decode steps (one with 2 tokens)
        k, v, q = _kv(rng, t)
        for i in range(2):
            if step < 2:
                got = mixed.prefill(i, k, v, q if step else None)
                want = [plain[i][h].prefill(0, k[:, h:h + 1], v[:, h:h + 1], q[:, h * G:(h + 1) * G] if step else None)
                        for h in range(NKV)]
            else:
                got = mixed.decode(i, k, v, q, CFG)
                want = [plain[i][h].decode(0, k[:, h:h + 1], v[:, h:h + 1], q[:, h * G:(h + 1) * G], CFG)
                        for h in range(NKV)]
            if step == 0:
                assert got.k is k and got.v is v  # an empty layer returns the prompt itself
            assert type(got) is type(want[0])
            for h in range(NKV):
                _assert_same(_head_slices(got, h), _arrays(want[h]))
            assert mixed.seq_len(i) == plain[i][0].seq_len(0) and mixed.stored_len(i) == plain[i][0].stored_len(0)
    assert mixed.memory_usage() == sum(p.memory_usage() for row in plain for p in row)
    assert mixed.fp16_bytes() == sum(p.fp16_bytes() for row in plain for p in row)


def test_no_effective_head_override_gives_the_plain_cache():
    same = make_cache("pqo3", num_layers=2, **GEOM, head_overrides={0: {1: {"bits": 3}}})
    assert type(same) is PolarQuantCache
    assert type(make_cache("pqo3", num_layers=2, **GEOM, head_overrides={})) is PolarQuantCache


def test_layout_name_and_negative_keys():
    a = make_cache("pqo3", num_layers=3, **GEOM, head_overrides={0: {1: {"bits": 4}}, 2: {1: {"bits": 4}}})
    b = make_cache("pqo3", num_layers=3, **GEOM, head_overrides={-3: {-2: {"bits": 4}}, -1: {1: {"bits": 4}}})
    assert a.config_dict() == b.config_dict()
    # parts group equal configurations of equal head count: heads {0, 2} of layers 0 and 2 share one part
    assert [(p.bits, p.num_layers, p.num_kv_heads) for p in a.parts] == [(3, 2, 2), (4, 2, 1), (3, 1, 3)]
    assert a.name == "mixed[pqo3-r32-s4{0,2}+pqo4-r32-s4{1},pqo3-r32-s4,pqo3-r32-s4{0,2}+pqo4-r32-s4{1}]"
    assert [heads for _, _, heads in a.layer_pieces(0)] == [(0, 2), (1,)]
    assert a.layer_cache(1).num_kv_heads == NKV
    with pytest.raises(ValueError, match="layer 0 is split over KV heads"):
        a.layer_cache(0)
    one = a.empty_layer(0)
    assert isinstance(one, MixedCache) and one.num_layers == 1 and one.num_kv_heads == NKV
    assert type(a.empty_layer(1)) is PolarQuantCache


def test_layer_and_head_overrides_combine():
    """A head's options are its layer's (base + layer_overrides) updated by its own override;
    ``bits`` replaces the layer's k_bits/v_bits as in layer_overrides."""
    c = make_cache("pqo-k4v3", num_layers=2, **GEOM, layer_overrides={1: {"residual_length": 0}},
                   head_overrides={1: {0: {"bits": 2}, 2: {"v_bits": 4}}})
    got = {heads: (p.k_bits, p.v_bits, p.residual_length) for p, _, heads in c.layer_pieces(1)}
    assert got == {(0,): (2, 2, 0), (1,): (4, 3, 0), (2,): (4, 4, 0)}


# -- bytes by formula ---------------------------------------------------------------------------
def _vec(bits: int) -> int:
    """Bytes of one compressed PQO vector: bits per index plus one binary16 scale per 32 values."""
    return D * bits // 8 + 2 * D // 32


@pytest.mark.parametrize(("r", "s", "t"), [(0, 0, 10), (8, 2, 40), (8, 2, 5)])
def test_memory_usage_by_formula(rng, r, s, t):
    batch = 2
    cache = make_cache("pqo3", num_layers=2, **GEOM, residual_length=r, sink_tokens=s,
                       head_overrides={0: {1: {"bits": 4}}, 1: {0: {"k_bits": 4, "v_bits": 2}}})
    for layer in range(2):
        k, v, _ = _kv(rng, t, batch)
        cache.prefill(layer, k, v)
    exact = min(t, r + s)  # float16 window and sink tokens, K and V
    widths = [(3, 3), (4, 4), (3, 3), (4, 2), (3, 3), (3, 3)]  # (k, v) bits of layer 0 heads 0-2, layer 1 heads 0-2
    want = sum(batch * ((t - exact) * (_vec(kb) + _vec(vb)) + exact * 2 * D * 2) for kb, vb in widths)
    assert cache.memory_usage() == want


# -- bad arguments -------------------------------------------------------------------------------
@pytest.mark.parametrize(("heads", "err", "match"), [
    ({0: {1: {"bitz": 4}}}, ValueError, r"head_overrides\[0\]\[1\]: unknown option 'bitz'"),
    ({0: {1: {"residual_length": 4}}}, ValueError, r"head_overrides\[0\]\[1\]: option 'residual_length' cannot differ"),
    ({0: {1: {"sink_tokens": 0}}}, ValueError, "option 'sink_tokens' cannot differ"),
    ({0: {1: {"sliding_window": 8}}}, ValueError, "option 'sliding_window' cannot differ"),
    ({0: {1: {"rotation": "head"}}}, ValueError, "option 'rotation' cannot differ"),
    ({0: {1: {"window_dtype": "int8"}}}, ValueError, "option 'window_dtype' cannot differ"),
    ({0: {1: {"num_kv_heads": 1}}}, ValueError, "unknown option 'num_kv_heads'"),
    ({0: {3: {"bits": 4}}}, ValueError, r"head_overrides\[0\]: KV head 3 is out of range for 3 KV heads"),
    ({0: {-4: {"bits": 4}}}, ValueError, "KV head -4 is out of range"),
    ({0: {"1": {"bits": 4}}}, TypeError, "KV head keys must be ints"),
    ({0: {True: {"bits": 4}}}, TypeError, "KV head keys must be ints"),
    ({2: {0: {"bits": 4}}}, ValueError, "head_overrides: layer 2 is out of range"),
    ({"0": {0: {"bits": 4}}}, TypeError, "head_overrides: layer keys must be ints"),
    ({0: [1]}, TypeError, r"head_overrides\[0\]: expected a dict"),
    ({0: {1: 4}}, TypeError, r"head_overrides\[0\]\[1\]: expected a dict"),
    ([0], TypeError, "head_overrides: expected a dict"),
    ({0: {1: {"bits": 4}, -2: {"bits": 2}}}, ValueError, "KV head 1 is given twice"),
    ({0: {1: {"bits": 4}}, -2: {0: {"bits": 2}}}, ValueError, "layer 0 is given twice"),
    ({0: {1: {"bits": 7}}}, ValueError, r"head_overrides: layer 0 KV heads \[1\]: bits"),
])
def test_bad_head_overrides(heads, err, match):
    with pytest.raises(err, match=match):
        make_cache("pqo3", num_layers=2, **GEOM, head_overrides=heads)


def test_dense_has_no_per_head_bits():
    with pytest.raises(ValueError, match="unknown option 'bits'"):
        make_cache("dense", num_layers=2, **GEOM, head_overrides={0: {1: {"bits": 4}}})


def _state(cache, layer):
    return [(part.seq_len(j), part.stored_len(j), [np.array(a) for a in part.live_arrays(j)])
            for part, j, _ in cache.layer_pieces(layer)]


@pytest.mark.parametrize("bad", ["nan_second_piece", "huge_second_piece", "heads", "q_heads", "config"])
def test_bad_input_leaves_the_split_layer_unchanged(rng, bad):
    """The second piece (head 1) is the one that fails: had the first piece been stored before
    the second was checked, the layer would be left half-written."""
    cache = make_cache("pqo3", num_layers=1, **GEOM, residual_length=2, sink_tokens=1, head_overrides=SPLIT)
    k, v, q = _kv(rng, 5)
    cache.prefill(0, k, v)
    before, ref = _state(cache, 0), cache.fork()
    k, v, q = _kv(rng, 1)
    cfg = CFG
    if bad == "nan_second_piece":
        v[1, 1, 0, 3] = np.nan
        err, match = ValueError, "v"
    elif bad == "huge_second_piece":
        k[0, 1, 0, 0] = 3e6  # above the 2**21 a compressed cache stores
        err, match = ValueError, "k"
    elif bad == "heads":
        k, v = k[:, :2], v[:, :2]
        err, match = ValueError, "k: expected num_kv_heads"
    elif bad == "q_heads":
        q = q[:, :5]
        err, match = ValueError, "q: "
    else:
        cfg, err, match = "cfg", TypeError, "config"
    with pytest.raises(err, match=match):
        cache.decode(0, k, v, q, cfg)
    after = _state(cache, 0)
    assert [s[:2] for s in after] == [s[:2] for s in before]
    for (_, _, a), (_, _, b) in zip(after, before):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)
    k, v, q = _kv(rng, 1)
    for a, b in zip(_arrays(cache.decode(0, k, v, q, CFG)), _arrays(ref.decode(0, k, v, q, CFG))):
        np.testing.assert_array_equal(a, b)


# -- lifecycle ------------------------------------------------------------------------------------
def _decode_all(cache, rng_seed, batch=2):
    rng = np.random.default_rng(rng_seed)
    outs = []
    for layer in range(cache.num_layers):
        k, v, q = _kv(rng, 1, batch)
        outs.append(_arrays(cache.decode(layer, k, v, q, CFG)))
    return outs


def _assert_outs(a, b):
    for x, y in zip(a, b):
        for u, w in zip(x, y):
            np.testing.assert_array_equal(u, w)


def test_lifecycle_and_save_load(rng, tmp_path):
    pytest.importorskip("safetensors")
    from numba_kv import load_cache

    heads = {0: {1: {"bits": 4}}, 1: {0: {"bits": 2}, 2: {"bits": 4}}}
    # no recent window: a crop back over a step then restores exactly the state before it
    cache = make_cache("tq3", num_layers=3, **GEOM, residual_length=0, layer_overrides={1: {"sliding_window": 5}},
                       head_overrides=heads)
    for layer in range(3):
        k, v, _ = _kv(rng, 8)
        cache.prefill(layer, k, v)
    ref = cache.fork()
    _decode_all(cache, 1)
    _decode_all(cache, 2)
    cache.crop(9)  # back over the last step
    assert [cache.seq_len(i) for i in range(3)] == [9, 9, 9]
    assert {part.seq_len(j) for part, j, _ in cache.layer_pieces(1)} == {9}
    _assert_outs(_decode_all(cache, 3), _decode_all(_replayed(ref), 3))
    with pytest.raises(ValueError, match="evicted"):
        cache.crop(6)  # the sliding layer evicted what that needs: checked before any part changes
    assert [cache.seq_len(i) for i in range(3)] == [10, 10, 10]

    path = tmp_path / "split.safetensors"
    cache.save(path)
    loaded = load_cache(path, expect=cache)
    assert isinstance(loaded, MixedCache) and loaded.name == cache.name
    assert loaded.layer_map == cache.layer_map and loaded.memory_usage() == cache.memory_usage()
    with pytest.raises(CacheFileError, match="configuration mismatch"):
        load_cache(path, expect=make_cache("tq3", num_layers=3, **GEOM, residual_length=0,
                                           layer_overrides={1: {"sliding_window": 5}},
                                           head_overrides={0: {2: {"bits": 4}}}))
    _assert_outs(_decode_all(loaded, 4), _decode_all(cache, 4))
    fork = cache.fork()
    # select_batch: row 1 alone answers what row 1 of the full batch answers
    fork.select_batch([1])
    rng2 = np.random.default_rng(5)
    for layer in range(3):
        k, v, q = _kv(rng2, 1)
        full = _arrays(loaded.decode(layer, k, v, q, CFG))
        one = _arrays(fork.decode(layer, k[1:], v[1:], q[1:], CFG))
        for a, b in zip(one, full):
            if b is not None:
                np.testing.assert_array_equal(a, b[1:])
    with pytest.raises(ValueError, match="indices"):
        fork.select_batch([3])
    loaded.reset()
    assert loaded.memory_usage() == 0 and loaded.seq_len(0) == 0


def _replayed(ref):
    """``ref`` (a fork from before the first decode step) after step 1: what crop(9) returns to."""
    c = ref.fork()
    _decode_all(c, 1)
    return c


def test_old_layer_map_format_loads(rng, tmp_path):
    """Files written before head_overrides hold ``[part, layer]`` per layer; a cache without
    split layers still writes exactly that, and such states load."""
    pytest.importorskip("safetensors")
    from numba_kv import load_cache

    cache = make_cache("pqo3", num_layers=2, **GEOM, layer_overrides={0: {"bits": 4}})
    k, v, _ = _kv(rng, 6)
    for layer in range(2):
        cache.prefill(layer, k, v)
    sd = cache.state_dict()
    assert sd.config["layer_map"] == [[0, 0], [1, 0]]
    old = CacheState({**sd.config, "layer_map": [[0, 0], [1, 0]]}, sd.state, sd.tensors)
    loaded = MixedCache.from_state_dict(old)
    assert loaded.memory_usage() == cache.memory_usage()
    cache.save(tmp_path / "old.safetensors")
    _assert_outs(_decode_all(load_cache(tmp_path / "old.safetensors"), 7), _decode_all(cache, 7))


@pytest.mark.parametrize(("layer_map", "match"), [
    ([[[0, 0, [0, 0]], [1, 0, [1]]], [2, 0]], r"hold KV heads \[0, 0, 1\], expected each of 0 .. 2 once"),
    ([[[0, 0, [0, 2]], [1, 0, [1, 1]]], [2, 0]], "one num_kv_heads for every layer"),
    ([[[0, 0, [0, 2]], [1, 0, [1]]], [[2, 0, [0, 1, 2]]], [2, 0]], "exactly once"),
    ([[[1, 0, [0, 2]], [0, 0, [1]]], [2, 0]], "holds 2 KV heads in part 1"),
    ([[0, 0, [0, 2]], [2, 0]], "expected a piece"),
])
def test_bad_layer_maps_are_refused(layer_map, match):
    cache = make_cache("pqo3", num_layers=2, **GEOM, head_overrides=SPLIT)
    sd = cache.state_dict()
    with pytest.raises((ValueError, TypeError), match=match):
        MixedCache.from_state_dict(CacheState({**sd.config, "layer_map": layer_map}, sd.state, sd.tensors))


def test_pieces_of_a_layer_must_share_their_sequence_options():
    parts = [PolarQuantCache(1, 2, D, bits=3), PolarQuantCache(1, 1, D, bits=4, residual_length=0)]
    with pytest.raises(ValueError, match="differ in more than the per-KV-head options"):
        MixedCache(parts, [[(0, 0, (0, 2)), (1, 0, (1,))]])


# -- threads ----------------------------------------------------------------------------------------
def test_threads_on_split_layers_equal_sequential_calls():
    """Four threads, one layer each (three of them split), released together before every
    call; results and final state equal the same calls made one after another."""
    heads = {0: {1: {"bits": 4}}, 1: {0: {"bits": 2}}, 3: {2: {"k_bits": 4}, 0: {"k_bits": 4}}}
    steps = 4
    data = []
    for i in range(4):
        rng = np.random.default_rng(50 + i)
        data.append([_kv(rng, 9)] + [_kv(rng, 1) for _ in range(steps)])

    def run(cache, layer):
        out = [_arrays(cache.prefill(layer, data[layer][0][0], data[layer][0][1]))]
        for k, v, q in data[layer][1:]:
            barrier.wait(timeout=60)
            out.append(_arrays(cache.decode(layer, k, v, q, CFG)))
        return out

    seq = make_cache("pqo3", num_layers=4, **GEOM, residual_length=4, head_overrides=heads)
    par = seq.fork()
    barrier = threading.Barrier(1)
    want = [run(seq, i) for i in range(4)]
    barrier = threading.Barrier(4)
    got: list = [None] * 4
    errors = []

    def work(i):
        try:
            got[i] = run(par, i)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i in range(4):
        _assert_outs(got[i], want[i])
    assert par.memory_usage() == seq.memory_usage()


def test_threads_on_one_split_layer_keep_its_pieces_in_step(rng):
    """Calls on one layer are not promised to be concurrent, but a split layer's own lock keeps
    them whole: its pieces always hold the same number of tokens, and a lifecycle call
    (fork, crop_range) never sees them apart."""
    cache = make_cache("pqo3", num_layers=1, **GEOM, residual_length=2, head_overrides=SPLIT)
    k, v, _ = _kv(rng, 4)
    cache.prefill(0, k, v)
    tokens = [_kv(rng, 1) for _ in range(8)]
    errors = []

    def decoder(part):
        try:
            for k1, v1, q1 in tokens[part::2]:
                cache.decode(0, k1, v1, q1, CFG)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    def watcher():
        try:
            for _ in range(20):
                f = cache.fork()
                assert len({p.seq_len(j) for p, j, _ in f.layer_pieces(0)}) == 1
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=decoder, args=(i,)) for i in range(2)] + [threading.Thread(target=watcher)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert [p.seq_len(j) for p, j, _ in cache.layer_pieces(0)] == [12, 12]


# -- presets ----------------------------------------------------------------------------------------
def test_a_preset_carries_head_overrides(rng, monkeypatch):
    """A preset's head_overrides split its layers, count in its budget head by head, and merge
    with the caller's (the caller's options of a head win)."""
    from numba_kv.caches.presets import BUDGET_TOKENS, PRESETS, Preset, preset_bytes

    preset = Preset("kvtest", "pqo-k4v3-head-eden", {"key_center": True, "window_dtype": "int8"}, 4.0,
                    head_overrides={-1: {0: {"v_bits": 4}}})
    monkeypatch.setitem(PRESETS, "kvtest", preset)
    geo = {"num_layers": 3, "num_kv_heads": 2, "head_dim": D}
    cache = make_cache("kvtest", **geo)
    assert len(cache.layer_map[0]) == 1 and len(cache.layer_map[2]) == 2
    assert {heads: p.v_bits for p, _, heads in cache.layer_pieces(2)} == {(0,): 4, (1,): 3}
    r = cache.layer_pieces(0)[0][0].residual_length
    k = rng.standard_normal((1, 2, BUDGET_TOKENS, D)).astype(np.float32)
    for layer in range(3):
        cache.prefill(layer, k, k)
    assert cache.memory_usage() == preset_bytes("kvtest", **geo, residual_length=r)
    assert cache.memory_usage() * 8 <= 4.0 * 2 * 3 * 2 * D * BUDGET_TOKENS
    # the wider head costs window tokens: without it the same budget buys a longer window
    monkeypatch.setitem(PRESETS, "kvtest", Preset("kvtest", preset.base, preset.options, 4.0))
    assert make_cache("kvtest", **geo).residual_length > r
    monkeypatch.setitem(PRESETS, "kvtest", preset)
    mine = make_cache("kvtest", **geo, head_overrides={2: {0: {"k_bits": 3}}, 0: {1: {"bits": 2}}})
    assert {heads: (p.k_bits, p.v_bits) for p, _, heads in mine.layer_pieces(2)} == {(0,): (3, 4), (1,): (4, 3)}
    assert {heads: (p.k_bits, p.v_bits) for p, _, heads in mine.layer_pieces(0)} == {(0,): (4, 3), (1,): (2, 2)}


def test_every_listed_per_head_option_is_taken_per_head():
    """``PER_HEAD_OPTIONS`` (also the rule of a loaded file's split layers) listed ``mode``,
    which ``head_overrides`` refuses as unknown: the list and the check must agree."""
    for key in PER_HEAD_OPTIONS:
        try:
            make_cache("pqo3", num_layers=1, num_kv_heads=2, head_dim=64, head_overrides={0: {0: {key: None}}})
        except (TypeError, ValueError) as exc:
            assert "unknown option" not in str(exc), (key, exc)
