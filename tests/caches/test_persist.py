"""save / load_cache: bit-identical round trips, and every damaged or mismatched file
raises CacheFileError without returning a cache."""

import json
import struct

import numpy as np
import pytest

from numba_kv import (
    AttendConfig,
    CacheFileError,
    DenseCache,
    Dequantized,
    Fused,
    PagedKVCache,
    PolarQuantCache,
    TurboQuantCache,
    load_cache,
    make_cache,
)

pytest.importorskip("safetensors")

H, D, G = 2, 64, 2
CFG = AttendConfig(0.125, G)
CASES = [
    ("dense", {}),
    ("dense", {"dtype": np.float16}),
    ("pqo3", {}),
    ("pqo3", {"residual_length": 8, "sink_tokens": 3, "window_dtype": "int8", "key_center": True}),
    ("pqo3.5", {"residual_length": 6, "sink_tokens": 1}),
    ("pqo-k4v3-head-eden", {"residual_length": 7, "sink_tokens": 2}),
    ("pq3", {"residual_length": 0, "sink_tokens": 0, "key_center": True, "window_dtype": "float32"}),
    ("tq3", {"residual_length": 6, "sink_tokens": 2}),
    ("tq3", {"decode_output": "dequantized", "qjl_dim": 32, "qjl_seed": 7}),
]
IDS = [f"{n}-{'-'.join(f'{k}={v}' for k, v in o.items())}" for n, o in CASES]


def _rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def _outputs(res):
    if isinstance(res, Fused):
        return [res.out]
    r = res.result if isinstance(res, Dequantized) else res
    return [a for a in (r.k, r.v, r.logit_bias) if a is not None]


def _filled(name, opts, rng, layers=3):
    cache = make_cache(name, num_layers=layers, num_kv_heads=H, head_dim=D, **opts)
    k, v = _rand(rng, 2, H, 45, D), _rand(rng, 2, H, 45, D)
    cache.prefill(0, k[:, :, :20], v[:, :, :20])
    cache.prefill(0, k[:, :, 20:], v[:, :, 20:])
    cache.prefill(1, k[:, :, :3], v[:, :, :3])  # layer 2 stays empty
    return cache


@pytest.mark.parametrize("name,opts", CASES, ids=IDS)
def test_round_trip_decodes_bit_identically(tmp_path, name, opts):
    rng = np.random.default_rng(0)
    a = _filled(name, opts, rng)
    path = tmp_path / "c.safetensors"
    a.save(path)
    b = load_cache(path, expect=a)
    assert type(b) is type(a) and b.name == a.name
    # the payload is exactly the live bytes
    data = path.read_bytes()
    assert len(data) == 8 + _header(data)[0] + a.memory_usage()
    assert b.memory_usage() == a.memory_usage()
    assert [b.seq_len(i) for i in range(3)] == [45, 3, 0]
    for la, lb in zip(a._layers, b._layers):
        for n in la.buffers:
            nl = la.live_count(n)
            np.testing.assert_array_equal(la.buffers[n][:, :nl], lb.buffers[n][:, :nl])
    for step in range(2):  # continue both: window sliding, compression, a new layer
        q, k1 = _rand(rng, 2, H * G, 2, D), _rand(rng, 2, H, 2, D)
        for layer in range(3):
            if layer == 2 and step == 0:
                for x, y in zip(_outputs(a.prefill(2, k1, k1)), _outputs(b.prefill(2, k1, k1))):
                    np.testing.assert_array_equal(x, y)
                continue
            for x, y in zip(_outputs(a.decode(layer, k1, k1, q, CFG)), _outputs(b.decode(layer, k1, k1, q, CFG)),
                            strict=True):
                np.testing.assert_array_equal(x, y)
    if name != "dense":  # the dequantized view too (fused caches: a history via a forced dequantized decode)
        ha = a._history(a._layers[0], np.float32)
        hb = b._history(b._layers[0], np.float32)
        for x, y in zip(ha, hb):
            np.testing.assert_array_equal(x, y)
    assert b.memory_usage() == a.memory_usage()


def test_empty_cache_round_trip(tmp_path):
    a = PolarQuantCache(2, H, D)
    a.save(tmp_path / "e.safetensors")
    b = load_cache(tmp_path / "e.safetensors", expect=PolarQuantCache)
    assert b.memory_usage() == 0 and b.seq_len(1) == 0


@pytest.mark.parametrize("storage", ["float32", "pqo3", "pqo-k4v3"])
def test_paged_round_trip(tmp_path, storage):
    rng = np.random.default_rng(1)
    a = PagedKVCache(num_pages=20, num_layers=2, num_kv_heads=H, head_dim=D, page_size=4, storage=storage)
    s0, s1, s2 = a.allocate_sequence(), a.allocate_sequence(), a.allocate_sequence()
    for layer in range(2):
        a.append(layer, s0, _rand(rng, H, 9, D), _rand(rng, H, 9, D))
        a.append(layer, s2, _rand(rng, H, 5, D), _rand(rng, H, 5, D))
    a.free_sequence(s1)
    a.save(tmp_path / "p.safetensors")
    b = load_cache(tmp_path / "p.safetensors", expect=a)
    assert b.sequences == a.sequences and b.num_free_pages == a.num_free_pages
    assert b.memory_usage() == a.memory_usage()
    for layer in range(2):
        for s in (s0, s2):
            assert b.block_table(layer, s) == a.block_table(layer, s)
            for x, y in zip(a.get_kv(layer, s), b.get_kv(layer, s)):
                np.testing.assert_array_equal(x, y)
    q = _rand(rng, 2, H * G, 1, D)
    np.testing.assert_array_equal(a.decode_attention(1, q), b.decode_attention(1, q))
    # both keep allocating the same pages and ids
    k = _rand(rng, H, 6, D)
    for c in (a, b):
        c.append(0, s2, k, k)
        assert c.allocate_sequence() == 3
    assert a.block_table(0, s2) == b.block_table(0, s2)


# -- damaged and mismatched files ---------------------------------------------------------------
@pytest.fixture
def saved(tmp_path):
    cache = _filled("pqo3", {"residual_length": 4, "sink_tokens": 2}, np.random.default_rng(2))
    path = tmp_path / "c.safetensors"
    cache.save(path)
    return cache, path


def _header(data):
    n = struct.unpack("<Q", data[:8])[0]
    return n, json.loads(data[8:8 + n])


def _rewrite(path, mutate):
    data = path.read_bytes()
    n, hdr = _header(data)
    mutate(hdr)
    raw = json.dumps(hdr).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])


@pytest.mark.parametrize("cut", [1, 7, 100, 0.5, -1])
def test_truncated_file(saved, cut):
    _, path = saved
    data = path.read_bytes()
    n = int(len(data) * cut) if isinstance(cut, float) else (len(data) + cut if cut < 0 else cut)
    path.write_bytes(data[:n])
    with pytest.raises(CacheFileError):
        load_cache(path)


def test_every_flipped_payload_byte_is_caught(saved):
    """A flipped bit anywhere in the tensor payload (sampled) or the header fails the load."""
    _, path = saved
    data = path.read_bytes()
    n, _ = _header(data)
    rng = np.random.default_rng(3)
    positions = list(rng.integers(8 + n, len(data), 40)) + list(rng.integers(8, 8 + n, 40)) + [len(data) - 1]
    for pos in positions:
        bad = bytearray(data)
        bad[pos] ^= 1 << int(rng.integers(0, 8))
        path.write_bytes(bytes(bad))
        with pytest.raises(CacheFileError):
            load_cache(path)


def test_unknown_version_and_format(saved):
    _, path = saved
    _rewrite(path, lambda h: h["__metadata__"].update(format_version="2"))
    with pytest.raises(CacheFileError, match="version"):
        load_cache(path)
    _rewrite(path, lambda h: h["__metadata__"].update(format="other", format_version="1"))
    with pytest.raises(CacheFileError, match="not a numba_kv cache"):
        load_cache(path)


def test_edited_config_fails_checksum(saved):
    _, path = saved

    def edit(h):
        cfg = json.loads(h["__metadata__"]["config"])
        cfg["residual_length"] = 5
        h["__metadata__"]["config"] = json.dumps(cfg, sort_keys=True)
    _rewrite(path, edit)
    with pytest.raises(CacheFileError, match="SHA-256"):
        load_cache(path)


def test_mismatched_expectation(saved, tmp_path):
    _, path = saved
    with pytest.raises(CacheFileError, match="TurboQuantCache"):
        load_cache(path, expect=TurboQuantCache)
    with pytest.raises(CacheFileError, match="DenseCache"):
        load_cache(path, expect=DenseCache(3, H, D))
    other = PolarQuantCache(3, H, D, residual_length=8, sink_tokens=2)
    with pytest.raises(CacheFileError, match="residual_length"):
        load_cache(path, expect=other)
    assert load_cache(path, expect=PolarQuantCache(3, H, D, residual_length=4, sink_tokens=2)).seq_len(0) == 45
    # a name is neither a class nor a cache: TypeError naming expect (was a CacheFileError about the file)
    for bad in ("pqo3", int, 3):
        with pytest.raises(TypeError, match="expect: expected a cache class or a cache"):
            load_cache(path, expect=bad)


def test_consistent_but_wrong_tensors_are_rejected(saved, tmp_path):
    """A file whose (re-hashed) tensors do not match its configuration: no cache."""
    from numba_kv.caches import _format

    cache, _ = saved
    sd = cache.state_dict()
    meta_state, tensors = sd.state, dict(sd.tensors)
    tensors["layers.0.k_codes"] = np.ascontiguousarray(tensors["layers.0.k_codes"][:, :-1])
    config = json.dumps(cache.config_dict(), sort_keys=True)
    state = json.dumps(meta_state, sort_keys=True)
    import safetensors.numpy

    path = tmp_path / "w.safetensors"
    safetensors.numpy.save_file(tensors, str(path), metadata={
        "format": _format.FORMAT_NAME, "format_version": "1", "cache_class": "PolarQuantCache", "config": config,
        "state": state, "sha256": _format.digest(config, state, tensors)})
    with pytest.raises(CacheFileError, match="k_codes"):
        load_cache(path)


@pytest.mark.parametrize("value", ["none", "channel"])
def test_removed_option(saved, tmp_path, value):
    """A file written by an older version with the removed ``key_scale`` option (re-hashed, so
    only the option differs): off (``"none"``, what every older file stores) loads as the same
    cache; on (``"channel"``) does not load silently — the error names the option."""
    import safetensors.numpy

    from numba_kv.caches import _format

    cache, _ = saved
    sd = cache.state_dict()
    state_obj, tensors = sd.state, dict(sd.tensors)
    config = json.dumps({**cache.config_dict(), "key_scale": value}, sort_keys=True)
    state = json.dumps(state_obj, sort_keys=True)
    path = tmp_path / "old.safetensors"
    safetensors.numpy.save_file(tensors, str(path), metadata={
        "format": _format.FORMAT_NAME, "format_version": "1", "cache_class": "PolarQuantCache", "config": config,
        "state": state, "sha256": _format.digest(config, state, tensors)})
    if value == "none":
        back = load_cache(path, expect=cache)
        assert back.config == cache.config and back.memory_usage() == cache.memory_usage()
        return
    with pytest.raises(CacheFileError, match="key_scale='channel' cannot be loaded"):
        load_cache(path)


def test_older_int8_window_files_load_unrotated(tmp_path, rng):
    """Files written before ``window_rotation`` existed lack it and hold unrotated int8
    windows: they load with ``window_rotation=False`` and decode exactly as saved (re-hashed
    file whose config lacks the option)."""
    import safetensors.numpy

    from numba_kv.caches import _format

    cache = make_cache("pqo3", num_layers=1, num_kv_heads=2, head_dim=64, residual_length=6, sink_tokens=2,
                       window_dtype="int8", window_rotation=False, decode_output="dequantized")
    k = rng.standard_normal((1, 2, 12, 64)).astype(np.float32)
    cache.prefill(0, k, k)
    sd = cache.state_dict()
    state_obj, tensors = sd.state, dict(sd.tensors)
    cfg = {key: val for key, val in cache.config_dict().items() if key != "window_rotation"}
    assert len(cfg) == len(cache.config_dict()) - 1
    state = json.dumps(state_obj, sort_keys=True)

    def write(cfg_obj, name):
        config = json.dumps(cfg_obj, sort_keys=True)
        path = tmp_path / name
        safetensors.numpy.save_file(tensors, str(path), metadata={
            "format": _format.FORMAT_NAME, "format_version": "1", "cache_class": "PolarQuantCache",
            "config": config, "state": state, "sha256": _format.digest(config, state, tensors)})
        return path

    back = load_cache(write(cfg, "old.safetensors"), expect=cache)
    assert back.window_rotation is False and back.config == cache.config
    k1 = rng.standard_normal((1, 2, 1, 64)).astype(np.float32)
    q = rng.standard_normal((1, 4, 1, 64)).astype(np.float32)
    a = cache.decode(0, k1, k1, q, AttendConfig(0.125, 2)).result
    b = back.decode(0, k1, k1, q, AttendConfig(0.125, 2)).result
    assert np.array_equal(a.k, b.k) and np.array_equal(a.v, b.v)
    # the same bytes read as a rotated window decode to other vectors: the default matters
    wrong = load_cache(write({**cfg, "window_rotation": True}, "wrong.safetensors"))
    c = wrong.decode(0, k1, k1, q, AttendConfig(0.125, 2)).result
    assert np.abs(c.k[:, :, :2] - a.k[:, :, :2]).max() > 0.1


@pytest.mark.parametrize("window_dtype", ["float16", "float32"])
def test_older_float_window_files_match_a_cache_built_today(tmp_path, rng, window_dtype):
    """A float window is never rotated, so an older file without ``window_rotation`` is today's
    default cache: ``load_cache(expect=...)`` against one built today must accept it (it
    reported a ``window_rotation`` mismatch: the int8 files' old value was applied to every
    window dtype)."""
    import safetensors.numpy

    from numba_kv.caches import _format

    cache = make_cache("pqo3", num_layers=1, num_kv_heads=2, head_dim=64, residual_length=6, sink_tokens=2,
                       window_dtype=window_dtype)
    k = rng.standard_normal((1, 2, 12, 64)).astype(np.float32)
    cache.prefill(0, k, k)
    sd = cache.state_dict()
    tensors = dict(sd.tensors)
    config = json.dumps({key: val for key, val in cache.config_dict().items() if key != "window_rotation"},
                        sort_keys=True)
    state = json.dumps(sd.state, sort_keys=True)
    path = tmp_path / "old.safetensors"
    safetensors.numpy.save_file(tensors, str(path), metadata={
        "format": _format.FORMAT_NAME, "format_version": "1", "cache_class": "PolarQuantCache",
        "config": config, "state": state, "sha256": _format.digest(config, state, tensors)})
    back = load_cache(path, expect=cache)
    assert back.config == cache.config and back.window_rotation is True


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_cache(tmp_path / "nope.safetensors")


@pytest.mark.parametrize("edit", ["n_win", "n_sink", "live"])
def test_consistent_but_impossible_counters_are_rejected(saved, tmp_path, edit):
    """Counters the kernels would trust (re-hashed, so only a deliberate edit gets here) must
    describe a reachable state: otherwise no cache."""
    import safetensors.numpy

    from numba_kv.caches import _format

    cache, _ = saved
    sd = cache.state_dict()
    state_obj, tensors = sd.state, dict(sd.tensors)
    lay = state_obj["layers"][0]
    if edit == "live":
        lay["live"]["k_exact"] -= 1
        tensors["layers.0.k_exact"] = np.ascontiguousarray(tensors["layers.0.k_exact"][:, :-1])
    else:
        lay["meta"][edit] -= 1
        lay["seq_len"] -= 1
    config = json.dumps(cache.config_dict(), sort_keys=True)
    state = json.dumps(state_obj, sort_keys=True)
    path = tmp_path / "w.safetensors"
    safetensors.numpy.save_file(tensors, str(path), metadata={
        "format": _format.FORMAT_NAME, "format_version": "1", "cache_class": "PolarQuantCache", "config": config,
        "state": state, "sha256": _format.digest(config, state, tensors)})
    with pytest.raises(CacheFileError, match="inconsistent"):
        load_cache(path)


def _resave(tmp_path, cache, config, state, cls):
    """``cache``'s tensors under metadata ``config``/``state`` (JSON text), re-hashed."""
    import safetensors.numpy

    from numba_kv.caches import _format

    tensors = dict(cache.state_dict().tensors)
    path = tmp_path / "w.safetensors"
    safetensors.numpy.save_file(tensors, str(path), metadata={
        "format": _format.FORMAT_NAME, "format_version": "1", "cache_class": cls, "config": config,
        "state": state, "sha256": _format.digest(config, state, tensors)})
    return path


@pytest.mark.parametrize("mixed", [False, True], ids=["plain", "mixed"])
@pytest.mark.parametrize(("field", "value"), [("config", "null"), ("state", "[]"), ("state", "null"),
                                              ("state", '{"parts": [null, []]}'), ("state", '{"layers": [null]}')])
def test_metadata_of_the_wrong_json_type_is_a_cache_file_error(tmp_path, rng, mixed, field, value):
    """Re-hashed metadata that parses but is not the objects the loader reads (a list or null
    where an object belongs, at the top or in a part) is a ``CacheFileError`` like any other
    malformed file (it was an ``AttributeError``)."""
    opts = {"layer_overrides": {1: {"bits": 4}}} if mixed else {}
    cache = _filled("pqo3", opts, rng, layers=2)
    config = json.dumps(cache.config_dict(), sort_keys=True)
    state = json.dumps(cache.state_dict().state, sort_keys=True)
    config, state = (value, state) if field == "config" else (config, value)
    path = _resave(tmp_path, cache, config, state, type(cache).__name__)
    with pytest.raises(CacheFileError):
        load_cache(path)


@pytest.mark.parametrize(("name", "opts"), CASES, ids=IDS)
def test_state_dict_round_trip_without_a_file(name, opts, rng):
    """The public pair a file is made of: ``from_state_dict(state_dict())`` is an equal cache
    (same configuration, counters and live bytes) that decodes exactly like the original,
    and the state is plain data (JSON types, host arrays)."""
    cache = _filled(name, opts, rng)
    sd = cache.state_dict()
    assert json.loads(json.dumps(sd.config)) == sd.config and json.loads(json.dumps(sd.state)) == sd.state
    assert all(type(t) is np.ndarray for t in sd.tensors.values())
    back = type(cache).from_state_dict(sd)
    assert back.config_dict() == cache.config_dict() and back.memory_usage() == cache.memory_usage()
    again = back.state_dict()
    assert again.state == sd.state and sorted(again.tensors) == sorted(sd.tensors)
    assert all(np.array_equal(again.tensors[n], t) for n, t in sd.tensors.items())
    k1, q = _rand(rng, 2, H, 1, D), _rand(rng, 2, H * G, 1, D)
    for a, b in zip(_outputs(cache.decode(0, k1, k1, q, CFG)), _outputs(back.decode(0, k1, k1, q, CFG))):
        assert np.array_equal(a, b)


def test_from_state_dict_rejects_and_builds_nothing(rng):
    """A state the class cannot have written raises CacheFileError (naming what is wrong)."""
    from numba_kv.caches.state import CacheState

    cache = _filled("pqo3", {"residual_length": 4, "sink_tokens": 2}, rng)
    sd = cache.state_dict()
    bad = dict(sd.tensors)
    bad["layers.0.k_codes"] = bad["layers.0.k_codes"][:, :-1]
    with pytest.raises(CacheFileError, match="layers.0.k_codes"):
        PolarQuantCache.from_state_dict(CacheState(sd.config, sd.state, bad))
    with pytest.raises(CacheFileError, match="unexpected"):
        extra = {**sd.tensors, "layers.9.x": bad["layers.0.k_codes"]}
        PolarQuantCache.from_state_dict(CacheState(sd.config, sd.state, extra))
    mixed = make_cache("pqo3", num_layers=2, num_kv_heads=H, head_dim=D, layer_overrides={0: {"bits": 4}})
    msd = mixed.state_dict()
    with pytest.raises(CacheFileError, match="outside the parts"):
        type(mixed).from_state_dict(CacheState(msd.config, msd.state, {"x": np.zeros(1)}))
