"""Adversarial cache files: re-hashed files (a valid SHA-256, so only the deliberate edit
differs) whose sizes, numbers or payload no cache can have written must raise
CacheFileError quickly, without allocating what the header claims."""

import json
import time

import numpy as np
import pytest

from numba_kv import CacheFileError, PagedKVCache, load_cache, make_cache

pytest.importorskip("safetensors")

H, D = 2, 64


def _resave(tmp_path, cache, edit_config=None, edit_state=None, edit_tensors=None):
    """``cache`` written with its config / state / tensors edited in place, re-hashed."""
    import safetensors.numpy

    from numba_kv.caches import _format

    sd = cache.state_dict()
    cfg, st, tensors = json.loads(json.dumps(sd.config)), json.loads(json.dumps(sd.state)), dict(sd.tensors)
    for edit, obj in ((edit_config, cfg), (edit_state, st), (edit_tensors, tensors)):
        if edit is not None:
            edit(obj)
    config, state = json.dumps(cfg, sort_keys=True), json.dumps(st, sort_keys=True)
    path = tmp_path / "edited.safetensors"
    safetensors.numpy.save_file(tensors, str(path), metadata={
        "format": _format.FORMAT_NAME, "format_version": "1", "cache_class": type(cache).__name__,
        "config": config, "state": state, "sha256": _format.digest(config, state, tensors)})
    return path


def _dense(rng, layers=2):
    cache = make_cache("dense", num_layers=layers, num_kv_heads=H, head_dim=D)
    k = rng.standard_normal((1, H, 5, D)).astype(np.float32)
    cache.prefill(0, k, k)
    return cache


def _paged(rng):
    cache = PagedKVCache(num_pages=6, num_layers=2, num_kv_heads=H, head_dim=D, page_size=4)
    s = cache.allocate_sequence()
    for layer in range(2):
        k = rng.standard_normal((H, 5, D)).astype(np.float32)
        cache.append(layer, s, k, k)
    return cache


@pytest.mark.parametrize("layers", [10**6, 2**63])
def test_a_header_claiming_many_layers_allocates_nothing(tmp_path, rng, layers):
    """``num_layers`` far above the state's 2 layers: rejected before the constructor builds
    per-layer state (10**7 took 24 s and 6 GB; 2**63 raised OverflowError)."""
    path = _resave(tmp_path, _dense(rng), edit_config=lambda c: c.update(num_layers=layers))
    t0 = time.perf_counter()
    with pytest.raises(CacheFileError, match=r"num_layers=\d+ does not match the 2 layers"):
        load_cache(path)
    assert time.perf_counter() - t0 < 2.0


@pytest.mark.parametrize(("key", "value", "match"), [
    ("num_pages", 10**7, r"num_pages=\d+ does not match the 6 pages"),
    ("num_layers", 10**6, r"num_layers=\d+ does not match the 2 layers"),
])
def test_a_paged_header_claiming_many_pages_or_layers_allocates_nothing(tmp_path, rng, key, value, match):
    """6 pages (2 in use per layer, 2 free) in the state: a configuration of 10**7 pages
    built a 10**7-entry free list before the state was rejected (10**12 ran out of memory)."""
    path = _resave(tmp_path, _paged(rng), edit_config=lambda c: c.update({key: value}))
    with pytest.raises(CacheFileError, match=match):
        load_cache(path)


@pytest.mark.parametrize(("kind", "key", "value", "match"), [
    ("dense", "num_layers", 2**63, r"num_layers=\d+ does not match the 2 layers"),
    ("paged", "num_pages", 10**12, r"num_pages=\d+ does not match the 6 pages"),
    ("paged", "num_layers", 2**63, r"num_layers=\d+ does not match the 2 layers"),
    ("mixed", "num_layers", 2**63, r"num_layers=\d+ does not match the 1 layers"),
])
def test_from_state_dict_checks_declared_sizes_before_building(rng, kind, key, value, match):
    """The same headers handed to ``from_state_dict`` directly (no file): only ``load_cache``
    checked them, so the constructor ran first and raised OverflowError / MemoryError (or,
    for 10**7 layers, spent 32 s and gigabytes) before the state was compared."""
    from numba_kv.caches.state import CacheState

    if kind == "mixed":
        cache = make_cache("pqo3", num_layers=2, num_kv_heads=H, head_dim=D, layer_overrides={0: {"bits": 4}})
        sd = cache.state_dict()
        cfg = json.loads(json.dumps(sd.config))
        cfg["parts"][0]["config"][key] = value
    else:
        cache = _dense(rng) if kind == "dense" else _paged(rng)
        sd = cache.state_dict()
        cfg = {**sd.config, key: value}
    with pytest.raises(CacheFileError, match=match):
        type(cache).from_state_dict(CacheState(cfg, sd.state, sd.tensors))


@pytest.mark.parametrize("where", ["next_seq", "free", "lens"])
def test_an_infinite_number_in_a_paged_state_is_a_cache_file_error(tmp_path, rng, where):
    """JSON ``Infinity`` where the paged state reads an int raised OverflowError."""
    def edit(st):
        if where == "next_seq":
            st["next_seq"] = float("inf")
        elif where == "free":
            st["free"][0] = float("inf")
        else:
            st["lens"][0]["0"] = float("inf")
    path = _resave(tmp_path, _paged(rng), edit_state=edit)
    with pytest.raises(CacheFileError):
        load_cache(path)


def test_a_window_beyond_memory_is_a_cache_file_error(tmp_path, rng):
    """``residual_length=10**12`` with a 4-token window in the state: the restored window
    buffer cannot be allocated; a CacheFileError (it was a bare MemoryError)."""
    cache = make_cache("pqo3", num_layers=1, num_kv_heads=H, head_dim=D, residual_length=4, sink_tokens=2)
    k = rng.standard_normal((1, H, 20, D)).astype(np.float32)
    cache.prefill(0, k, k)
    path = _resave(tmp_path, cache, edit_config=lambda c: c.update(residual_length=10**12))
    with pytest.raises(CacheFileError, match="more memory than is available"):
        load_cache(path)


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_a_non_finite_dense_value_is_rejected(tmp_path, rng, value):
    """Every store rejects NaN / inf, so a file holding one was not written by a cache (a NaN
    key loaded and was then skipped by attention: finite, wrong output)."""
    def edit(tensors):
        t = tensors["layers.0.k"].copy()
        t[1, 3, 7] = value
        tensors["layers.0.k"] = t
    path = _resave(tmp_path, _dense(rng), edit_tensors=edit)
    with pytest.raises(CacheFileError, match="layers.0.k holds NaN or infinite"):
        load_cache(path)


@pytest.mark.parametrize(("name", "bits"), [("k_exact", None), ("k_scales", 0x7C00), ("v_scales", 0x7E00)])
def test_non_finite_binary16_windows_and_scales_are_rejected(tmp_path, rng, name, bits):
    """A float16 window value, or the binary16 bits of a block scale (stored as uint16:
    0x7C00 = +inf, 0x7E00 = NaN), that is not finite: no cache."""
    cache = make_cache("pqo3", num_layers=1, num_kv_heads=H, head_dim=D, residual_length=4, sink_tokens=2)
    k = rng.standard_normal((1, H, 20, D)).astype(np.float32)
    cache.prefill(0, k, k)

    def edit(tensors):
        t = tensors[f"layers.0.{name}"].copy()
        t.reshape(-1)[5] = np.float16(np.nan) if bits is None else bits
        tensors[f"layers.0.{name}"] = t
    path = _resave(tmp_path, cache, edit_tensors=edit)
    with pytest.raises(CacheFileError, match=f"layers.0.{name} holds NaN or infinite"):
        load_cache(path)
    # the unedited file still loads, bit for bit
    cache.save(tmp_path / "ok.safetensors")
    back = load_cache(tmp_path / "ok.safetensors", expect=cache)
    for n, t in cache.state_dict().tensors.items():
        assert np.array_equal(back.state_dict().tensors[n], t)
