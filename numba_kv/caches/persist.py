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

The file is a cache's :meth:`state_dict` (:class:`~numba_kv.caches.state.CacheState`):
``config`` and ``state`` as JSON, ``tensors`` as they are.  Loading checks the format name
and version, the class and the SHA-256, then hands the state to the class's
``from_state_dict``, which checks every counter and every tensor's dtype and shape against
what the configuration implies before building anything.  The layer and page counts are
checked against the state before anything is allocated, and every stored float (binary16
scales included) must be finite.  Any mismatch raises :class:`CacheFileError` (a
``ValueError``), so a truncated or corrupted file never yields a half-loaded cache.  Loaded
caches live on the host (NumPy arrays).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from ._format import FORMAT_NAME, FORMAT_VERSION, cache_path, digest, safetensors_module, save_cache
from .dense import DenseCache
from .mixed import MixedCache
from .paged import PagedKVCache
from .polarquant import PolarQuantCache
from .state import CacheFileError, CacheState
from .turboquant import TurboQuantCache

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "CacheFileError", "load_cache", "save_cache"]

#: the classes a cache file may hold, by the name it stores
CLASSES: dict[str, type] = {c.__name__: c for c in (DenseCache, PolarQuantCache, TurboQuantCache, PagedKVCache,
                                                     MixedCache)}


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


#: options older versions stored that no longer exist: the value that meant "off" (dropped on
#: load, so those files still load) and why any other value cannot be honoured
_REMOVED_OPTIONS = {
    "key_scale": ("none", "per-channel key scaling was removed (it raised perplexity by 9 %)"),
}


#: options added later whose default changed what older files mean, keyed by a field
#: ``marker`` every such configuration has: the value an older file (which lacks the option)
#: was written with where ``marker`` is ``when``, and elsewhere the constructor's default (the
#: option changes nothing there, and the file describes the same cache as one built today)
_ADDED_OPTIONS = {
    # int8 windows were stored unrotated; a float window is never rotated
    "window_rotation": ("window_dtype", "int8", False, True),
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
    for key, (marker, when, old, default) in _ADDED_OPTIONS.items():
        if marker in cfg and key not in cfg:
            out[key] = old if cfg[marker] == when else default
    for key, val in cfg.items():
        if key in _REMOVED_OPTIONS:
            off, why = _REMOVED_OPTIONS[key]
            if val != off:
                raise CacheFileError(f"config: {key}={val!r} cannot be loaded: {why}")
            continue
        out[key] = _without_removed_options(val)
    return out


#: float tensors and binary16 numbers stored as uint16 bits (block / window scales, TurboQuant
#: residual norms): every store rejects non-finite input, so a file can hold only finite ones
_BINARY16_BITS = ("_scales", "_exact_scale", "_rnorm")


def _check_finite(tensors: dict[str, np.ndarray]) -> None:
    """``CacheFileError`` naming the first tensor holding a NaN or infinity (a cache never
    stores one; a NaN key was silently skipped by attention instead of failing the load)."""
    for name in sorted(tensors):
        t = tensors[name]
        if t.dtype == np.uint16 and name.endswith(_BINARY16_BITS):
            t = t.view(np.float16)
        if t.dtype.kind == "f" and not np.isfinite(t).all():
            raise CacheFileError(f"tensors: {name} holds NaN or infinite values; a cache stores only finite ones")


def load_cache(path: Any, expect: Any | None = None) -> Any:
    """Load a cache written by ``cache.save(path)``.

    Parameters
    ----------
    path : str, bytes or os.PathLike
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
        version, a configuration that does not match ``expect`` or the stored tensors (or
        declares more layers or pages than its state holds), a NaN or infinity in a stored
        tensor, or a configuration that needs more memory than is available.
    TypeError
        ``expect`` is neither a cache class nor a cache (checked before the file is read).
    FileNotFoundError
        ``path`` does not exist.
    ImportError
        ``safetensors`` is not installed.
    """
    if expect is not None:
        kinds = tuple(CLASSES.values())
        if not ((isinstance(expect, type) and issubclass(expect, kinds)) or isinstance(expect, kinds)):
            raise TypeError(f"expect: expected a cache class or a cache ({', '.join(sorted(CLASSES))}), got "
                            f"{type(expect).__name__} {expect!r}")
    path = cache_path(path)
    meta, tensors = _read(path)
    if meta.get("format") != FORMAT_NAME:
        raise CacheFileError(f"path: {path!r} is not a numba_kv cache file (format {meta.get('format')!r})")
    if meta.get("format_version") != str(FORMAT_VERSION):
        raise CacheFileError(f"path: {path!r} has format version {meta.get('format_version')!r}; this numba_kv "
                             f"reads version {FORMAT_VERSION}")
    config, state = meta.get("config", ""), meta.get("state", "")
    if meta.get("sha256") != digest(config, state, tensors):
        raise CacheFileError(f"path: {path!r} fails its SHA-256 check (corrupted file)")
    name = meta.get("cache_class")
    if name not in CLASSES:
        raise CacheFileError(f"path: {path!r} holds an unknown cache class {name!r}")
    cls = CLASSES[name]
    try:
        cfg, st = json.loads(config), json.loads(state)
    except ValueError as exc:
        raise CacheFileError(f"path: {path!r} has malformed metadata: {exc}") from exc
    for field, value in (("config", cfg), ("state", st)):
        if not isinstance(value, dict):
            raise CacheFileError(f"path: {path!r} has malformed metadata: its {field} is a JSON "
                                 f"{type(value).__name__}, expected an object")
    cfg = _without_removed_options(cfg)
    _check_finite(tensors)
    if expect is not None:
        want = expect if isinstance(expect, type) else type(expect)
        if cls is not want:
            raise CacheFileError(f"expect: the file holds a {name}, expected a {want.__name__}")
        if not isinstance(expect, type):
            mine = json.loads(json.dumps(expect.config_dict(), sort_keys=True))
            diff = sorted(k for k in set(mine) | set(cfg) if mine.get(k) != cfg.get(k))
            if diff:
                raise CacheFileError(f"expect: configuration mismatch in {diff}: file "
                                     f"{ {k: cfg.get(k) for k in diff} }, expected { {k: mine.get(k) for k in diff} }")
    try:
        return cls.from_state_dict(CacheState(cfg, st, tensors))
    except CacheFileError:
        raise
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError) as exc:
        # (nested metadata of the wrong JSON type: a list or null where a part's object is read;
        # an infinite JSON number where an int is read)
        raise CacheFileError(f"path: {path!r} holds an invalid {name} configuration or state: {exc}") from exc
    except MemoryError as exc:  # (e.g. a window or head count far beyond what its tensors hold)
        raise CacheFileError(f"path: {path!r}: its {name} configuration needs more memory than is available "
                             f"({exc})") from exc
