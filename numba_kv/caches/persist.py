"""Saving and loading caches: one safetensors file per cache.

File layout (safetensors: an 8-byte header length, a JSON header, then the raw tensors)
-------------------------------------------------------------------------------------
* ``__metadata__`` (string → string):

  - ``format``: ``"numba_kv.cache"``; ``format_version``: ``"1"``;
  - ``cache_class``: ``"DenseCache"``, ``"PolarQuantCache"``, ``"TurboQuantCache"``,
    ``"PagedKVCache"`` or ``"MixedCache"`` (per-layer configurations: ``config`` holds
    every part's class and configuration plus the layer map, ``state`` every part's
    state, tensors are named ``parts.<p>.layers.<i>.<buffer>``);
  - ``config``: JSON of the constructor arguments;
  - ``state``: JSON of the bookkeeping (per layer: ``seq_len``, ``batch``, counters and live
    token counts of every buffer; for the paged cache: page tables, lengths, free list);
  - ``sha256``: hex SHA-256 of the ``config``/``state`` JSON and of every tensor (name,
    dtype, shape and bytes, in name order).

* tensors: ``layers.<i>.<buffer>`` — the live part ``[batch·num_kv_heads, live_tokens,
  width]`` of each buffer of a non-empty layer — or ``pool.<name>`` for the paged cache
  (the whole page pool).

Loading checks the format name and version, the class, the SHA-256 and every tensor's
dtype and shape against what the configuration implies before building anything; any
mismatch raises :class:`CacheFileError` (a ``ValueError``), so a truncated or corrupted
file never yields a half-loaded cache.  Loaded caches live on the host (NumPy arrays).
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from ._format import FORMAT_NAME, FORMAT_VERSION, digest, safetensors_module, save_cache
from ._layer import LayerState, grown_capacity
from .dense import DenseCache
from .mixed import MixedCache
from .paged import PagedKVCache
from .polarquant import PolarQuantCache
from .turboquant import TurboQuantCache

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "CacheFileError", "load_cache", "save_cache"]

_META_INTS = ("n_comp", "n_sink", "n_win", "n_evicted", "kmean_set", "kperm_set", "vperm_set")


class CacheFileError(ValueError):
    """A cache file that cannot be loaded: unreadable, truncated, corrupted (checksum), of an
    unknown format version, or not matching the expected class / configuration."""


def _classes() -> dict[str, type]:
    return {c.__name__: c for c in (DenseCache, PolarQuantCache, TurboQuantCache, PagedKVCache, MixedCache)}


_PART_CLASSES = ("DenseCache", "PolarQuantCache", "TurboQuantCache")


def _build_mixed(cfg: dict[str, Any], state: dict[str, Any], tensors: dict[str, np.ndarray]) -> Any:
    classes = _classes()
    parts_cfg, states = cfg.get("parts"), state.get("parts")
    if not isinstance(parts_cfg, list) or not isinstance(states, list) or len(parts_cfg) != len(states):
        raise CacheFileError("config: a MixedCache needs matching lists of parts and part states")
    parts = []
    for p, (pc, ps) in enumerate(zip(parts_cfg, states)):
        if not isinstance(pc, dict) or pc.get("cache_class") not in _PART_CLASSES:
            raise CacheFileError(f"config: part {p} has an unknown cache class")
        prefix = f"parts.{p}."
        own = {n[len(prefix):]: t for n, t in tensors.items() if n.startswith(prefix)}
        parts.append(_build_layered(classes[pc["cache_class"]], pc.get("config"), ps, own))
    used = sum(1 for p in range(len(parts)) for n in tensors if n.startswith(f"parts.{p}."))
    if used != len(tensors):
        raise CacheFileError("tensors: unexpected tensors outside the parts")
    return MixedCache(parts, [tuple(m) for m in cfg.get("layer_map", [])])


# -- loading --------------------------------------------------------------------------------
def _read(path: str) -> tuple[dict[str, str], dict[str, np.ndarray]]:
    st = safetensors_module()
    try:
        with st.safe_open(path, framework="np") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is not a dict
    except FileNotFoundError:
        raise
    except Exception as exc:  # SafetensorError, OSError, JSON/UTF-8 errors of a damaged header
        raise CacheFileError(f"path: {path!r} is not a readable safetensors cache file "
                             f"(truncated or corrupted?): {exc}") from exc
    return meta, tensors


def _check_int(where: str, v: Any, lo: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise CacheFileError(f"{where}: expected an int >= {lo}, got {v!r}")
    return v


def _check_counters(cache: Any, i: int, seq_len: int, meta: dict[str, Any], live: dict[str, Any]) -> None:
    """The layer's counters must describe a state the cache can reach (kernels trust them)."""
    window = cache.layer_windows[i]
    if meta.get("n_evicted", 0) and window is None:
        raise CacheFileError(f"state: layer {i} has evicted tokens but is not a sliding-window layer")
    meta = {k: v for k, v in meta.items() if k != "n_evicted"}
    if not hasattr(cache, "_set_live"):  # dense: every buffer holds seq_len tokens
        if meta or live:
            raise CacheFileError(f"state: layer {i} of a {type(cache).__name__} has counters {meta} / {live}")
        return
    n_sink, n_comp, n_win = (meta.get(k, 0) for k in ("n_sink", "n_comp", "n_win"))
    S, R = (0 if window is not None else cache.sink_tokens), cache.residual_length
    ok = n_sink + n_comp + n_win == seq_len and n_sink <= S and n_win <= R and (n_sink == S or n_comp + n_win == 0)
    if not cache.windowed:
        ok = ok and n_comp == seq_len
    probe = LayerState(seq_len=seq_len, meta=dict(meta))
    cache._set_live(probe)
    if not ok or probe.live != live:
        raise CacheFileError(f"state: layer {i} counters {meta} / live {live} are inconsistent with seq_len "
                             f"{seq_len} and the configuration (sinks {S}, window {R})")


def _build_layered(cls: type, cfg: dict[str, Any], state: dict[str, Any], tensors: dict[str, np.ndarray]) -> Any:
    cache = cls(**cfg)
    layers = state.get("layers")
    if not isinstance(layers, list) or len(layers) != cache.num_layers:
        raise CacheFileError(f"state: expected {cache.num_layers} layers, got {layers!r:.80}")
    if hasattr(cache, "window_dtype"):
        cache._exact_dtype = cache.window_dtype  # host arrays: the configured window storage
    spec = cache._buffer_spec()
    used = set()
    built = []
    for i, lay in enumerate(layers):
        if lay is None:
            built.append(None)
            continue
        if not isinstance(lay, dict):
            raise CacheFileError(f"state: layer {i} is not an object")
        seq_len = _check_int(f"layer {i} seq_len", lay.get("seq_len"), 1)
        batch = _check_int(f"layer {i} batch", lay.get("batch"), 1)
        meta, live = lay.get("meta", {}), lay.get("live", {})
        if not isinstance(meta, dict) or not isinstance(live, dict):
            raise CacheFileError(f"state: layer {i} meta/live are not objects")
        for k, v in meta.items():
            if k not in _META_INTS:
                raise CacheFileError(f"state: layer {i} has an unknown counter {k!r}")
            _check_int(f"layer {i} {k}", v)
        if not set(live) <= set(spec):
            raise CacheFileError(f"state: layer {i} counts buffers {sorted(live)}, the configuration has "
                                 f"{sorted(spec)}")
        rows = batch * cache.num_kv_heads
        bufs = {}
        grow_needed = 0
        for n, (width, dtype, fixed) in spec.items():
            key = f"layers.{i}.{n}"
            if key not in tensors:
                raise CacheFileError(f"tensors: {key} is missing")
            t = tensors[key]
            nl = _check_int(f"layer {i} live {n}", live.get(n, seq_len))
            if t.dtype != np.dtype(dtype) or t.shape != (rows, nl, width):
                raise CacheFileError(f"tensors: {key} is {t.dtype} {t.shape}, the configuration expects "
                                     f"{np.dtype(dtype)} {(rows, nl, width)}")
            if fixed is not None and nl > fixed:
                raise CacheFileError(f"tensors: {key} holds {nl} tokens, more than its capacity {fixed}")
            used.add(key)
            bufs[n] = (t, nl, width, dtype, fixed)
            if fixed is None:
                grow_needed = max(grow_needed, nl)
        _check_counters(cache, i, seq_len, meta, live)
        built.append((seq_len, batch, dict(meta), {n: int(v) for n, v in live.items()}, bufs, grow_needed))
    extra = set(tensors) - used
    if extra:
        raise CacheFileError(f"tensors: unexpected {sorted(extra)[:5]}")
    for st, item in zip(cache._layers, built):
        if item is None:
            continue
        seq_len, batch, meta, live, bufs, grow_needed = item
        cap = grown_capacity(grow_needed)
        st.buffers = {}
        for n, (t, nl, width, dtype, fixed) in bufs.items():
            buf = np.zeros((batch * cache.num_kv_heads, fixed if fixed is not None else cap, width), dtype)
            buf[:, :nl] = t
            st.buffers[n] = buf
        st.capacity, st.seq_len, st.batch, st.device = cap, seq_len, batch, "cpu"
        st.meta, st.live = meta, live
    return cache


def _build_paged(cls: type, cfg: dict[str, Any], state: dict[str, Any], tensors: dict[str, np.ndarray]) -> Any:
    cache = cls(**cfg)
    try:
        tables = [{int(s): [int(p) for p in pages] for s, pages in t.items()} for t in state["tables"]]
        lens = [{int(s): int(n) for s, n in d.items()} for d in state["lens"]]
        free = [int(p) for p in state["free"]]
        next_seq = int(state["next_seq"])
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CacheFileError(f"state: malformed paged-cache state: {exc}") from exc
    if len(tables) != cache.num_layers or len(lens) != cache.num_layers:
        raise CacheFileError(f"state: expected {cache.num_layers} layers of page tables")
    seqs = set(tables[0])
    owned = list(free)
    for layer, (t, ln) in enumerate(zip(tables, lens)):
        if set(t) != seqs or set(ln) != seqs:
            raise CacheFileError(f"state: layer {layer} has different sequences than layer 0")
        for s, pages in t.items():
            if not 0 <= ln[s] <= len(pages) * cache.page_size or len(pages) != -(-ln[s] // cache.page_size):
                raise CacheFileError(f"state: sequence {s} in layer {layer}: {ln[s]} tokens in {len(pages)} pages")
            owned.extend(pages)
    if sorted(owned) != list(range(cache.num_pages)):
        raise CacheFileError("state: page tables and free list do not partition the page pool")
    if seqs and next_seq <= max(seqs):
        raise CacheFileError(f"state: next_seq {next_seq} is not above the live sequence ids")
    spec = cache._pool_spec()
    pools = {}
    if tensors:
        if set(tensors) != {f"pool.{n}" for n in spec}:
            raise CacheFileError(f"tensors: expected {sorted(spec)} pools, got {sorted(tensors)}")
        for n, (shape, dt) in spec.items():
            t = tensors[f"pool.{n}"]
            if t.dtype != np.dtype(dt) or t.shape != shape:
                raise CacheFileError(f"tensors: pool.{n} is {t.dtype} {t.shape}, the configuration expects "
                                     f"{np.dtype(dt)} {shape}")
            pools[n] = np.array(t)  # writable copy
    elif len(free) != cache.num_pages:
        raise CacheFileError("tensors: pages are in use but the file holds no page pool")
    cache._pools = pools
    cache._device = "cpu" if pools else None
    cache._tables, cache._lens, cache._free, cache._next_seq = tables, lens, free, next_seq
    return cache


#: options older versions stored that no longer exist: the value that meant "off" (dropped on
#: load, so those files still load) and why any other value cannot be honoured
_REMOVED_OPTIONS = {
    "key_scale": ("none", "per-channel key scaling was removed (it raised perplexity by 9 %)"),
}


#: options added later whose default changed what older files mean: the value an older file
#: (which lacks the option) was written with, keyed by a field every such configuration has
_ADDED_OPTIONS = {
    "window_rotation": ("window_dtype", False),  # int8 windows were stored unrotated
}


def _without_removed_options(cfg: Any) -> Any:
    """``cfg`` with removed options that were off dropped (recursively: mixed caches nest the
    configurations of their parts); a removed option that was on raises ``CacheFileError``;
    options added since then get the value older files were written with."""
    if isinstance(cfg, list):
        return [_without_removed_options(c) for c in cfg]
    if not isinstance(cfg, dict):
        return cfg
    out = {}
    for key, (marker, old) in _ADDED_OPTIONS.items():
        if marker in cfg and key not in cfg:
            out[key] = old
    for key, val in cfg.items():
        if key in _REMOVED_OPTIONS:
            off, why = _REMOVED_OPTIONS[key]
            if val != off:
                raise CacheFileError(f"config: {key}={val!r} cannot be loaded: {why}")
            continue
        out[key] = _without_removed_options(val)
    return out


def load_cache(path: Any, expect: Any | None = None) -> Any:
    """Load a cache written by ``cache.save(path)``.

    Parameters
    ----------
    path : str or os.PathLike
    expect : cache class or cache instance, optional
        A class: the file must hold a cache of exactly that class.  An instance: the
        file's class and full configuration must equal the instance's (its contents do not
        matter), e.g. to check that a stored prompt cache fits the running model.

    Returns
    -------
    DenseCache, PolarQuantCache, TurboQuantCache, PagedKVCache or MixedCache
        On the host (NumPy buffers); decodes bit-identically to the saved cache.

    Raises
    ------
    CacheFileError (a ValueError)
        Unreadable / truncated file, checksum mismatch (a flipped byte), unknown format or
        version, a configuration that does not match ``expect`` or the stored tensors.
    FileNotFoundError
        ``path`` does not exist.
    ImportError
        ``safetensors`` is not installed.
    """
    path = os.fspath(path)
    meta, tensors = _read(path)
    if meta.get("format") != FORMAT_NAME:
        raise CacheFileError(f"path: {path!r} is not a numba_kv cache file (format {meta.get('format')!r})")
    if meta.get("format_version") != str(FORMAT_VERSION):
        raise CacheFileError(f"path: {path!r} has format version {meta.get('format_version')!r}; this numba_kv "
                             f"reads version {FORMAT_VERSION}")
    config, state = meta.get("config", ""), meta.get("state", "")
    if meta.get("sha256") != digest(config, state, tensors):
        raise CacheFileError(f"path: {path!r} fails its SHA-256 check (corrupted file)")
    classes = _classes()
    name = meta.get("cache_class")
    if name not in classes:
        raise CacheFileError(f"path: {path!r} holds an unknown cache class {name!r}")
    cls = classes[name]
    try:
        cfg, st = json.loads(config), json.loads(state)
    except ValueError as exc:
        raise CacheFileError(f"path: {path!r} has malformed metadata: {exc}") from exc
    cfg = _without_removed_options(cfg)
    if expect is not None:
        want = expect if isinstance(expect, type) else type(expect)
        if cls is not want:
            raise CacheFileError(f"expect: the file holds a {name}, expected a {want.__name__}")
        if not isinstance(expect, type):
            mine = json.loads(json.dumps(expect._lifecycle_config(), sort_keys=True))
            diff = sorted(k for k in set(mine) | set(cfg) if mine.get(k) != cfg.get(k))
            if diff:
                raise CacheFileError(f"expect: configuration mismatch in {diff}: file "
                                     f"{ {k: cfg.get(k) for k in diff} }, expected { {k: mine.get(k) for k in diff} }")
    try:
        if name == "PagedKVCache":
            return _build_paged(cls, cfg, st, tensors)
        if name == "MixedCache":
            return _build_mixed(cfg, st, tensors)
        return _build_layered(cls, cfg, st, tensors)
    except CacheFileError:
        raise
    except (TypeError, ValueError, KeyError) as exc:
        raise CacheFileError(f"path: {path!r} holds an invalid {name} configuration or state: {exc}") from exc
