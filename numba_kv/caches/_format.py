"""The cache file format's writing side: format constants, the checksum and
:func:`save_cache`, which writes a cache's :meth:`state_dict` (the format itself is described
in :mod:`numba_kv.caches.persist`, which reads it).

Kept apart from the reader so that the caches' ``save`` methods can import it at module
level: this module imports no cache class (it names the saveable classes by module path).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from typing import Any

import numpy as np

from .. import _backend

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "SAVEABLE", "cache_path", "digest", "host_copy", "safetensors_module",
           "save_cache"]

FORMAT_NAME = "numba_kv.cache"
FORMAT_VERSION = 1
#: class name -> defining module of every cache class ``save`` supports
SAVEABLE = {"DenseCache": "numba_kv.caches.dense", "PolarQuantCache": "numba_kv.caches.polarquant",
            "TurboQuantCache": "numba_kv.caches.turboquant", "PagedKVCache": "numba_kv.caches.paged",
            "MixedCache": "numba_kv.caches.mixed"}


def safetensors_module() -> Any:
    """The ``safetensors`` package (an optional dependency: the ``io`` extra)."""
    try:
        import safetensors.numpy  # noqa: PLC0415 - optional dependency (the io extra), needed only to save/load
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("saving and loading caches needs the 'safetensors' package: "
                          "pip install 'numba_kv[io]' (or pip install safetensors)") from exc
    return safetensors


def cache_path(path: Any) -> str:
    """``path`` (str, bytes or ``os.PathLike``) as a str; ``TypeError`` naming ``path`` for
    anything else.  (Bytes are decoded: the temporary name of a save is built from it, and a
    bytes ``path`` gave a name like ``"b'/dir/f'.tmp-1"``.)"""
    try:
        return os.fsdecode(os.fspath(path))
    except TypeError:
        raise TypeError(f"path: expected a str, bytes or os.PathLike, got {type(path).__name__} {path!r}") from None


def host_copy(a: Any, live: int | None = None) -> np.ndarray:
    """A C-contiguous host copy of ``a`` (NumPy, CuPy or Numba device array), or of its first
    ``live`` entries along axis 1.  Always a new array: a NumPy buffer is copied too, so a
    state taken from a cache does not change when the cache stores more (a full window buffer
    was returned as itself)."""
    if isinstance(a, np.ndarray):
        return np.array(a if live is None else a[:, :live], order="C", copy=True)
    h = _backend.to_host(a)  # the whole buffer first: a device slice is not contiguous
    return np.ascontiguousarray(h if live is None else h[:, :live])


def digest(config: str, state: str, tensors: dict[str, np.ndarray]) -> str:
    """Hex SHA-256 of the format, the ``config``/``state`` JSON and every tensor (name,
    dtype, shape, bytes; in name order)."""
    h = hashlib.sha256()
    for part in (FORMAT_NAME, str(FORMAT_VERSION), config, state):
        h.update(part.encode())
        h.update(b"\0")
    for name in sorted(tensors):
        t = np.ascontiguousarray(tensors[name])
        h.update(f"{name}\0{t.dtype.str}\0{t.shape}\0".encode())
        h.update(t.tobytes())
    return h.hexdigest()


def save_cache(cache: Any, path: Any) -> None:
    """Write ``cache`` to ``path`` (see the module docstring for the format).

    The file is written next to ``path`` and renamed over it, so an interrupted save never
    leaves a partial file under ``path``.
    """
    st = safetensors_module()
    name = type(cache).__name__
    if SAVEABLE.get(name) != type(cache).__module__:
        raise TypeError(f"cache: saving supports {sorted(SAVEABLE)}, got {type(cache).__name__}")
    path = cache_path(path)
    # (checked before the host copy; safetensors reported these as a SafetensorError on its temporary name)
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"path: the directory {parent!r} of {path!r} does not exist")
    if os.path.isdir(path):
        raise IsADirectoryError(f"path: {path!r} is a directory, expected a file name")
    sd = cache.state_dict()
    config = json.dumps(sd.config, sort_keys=True)
    state = json.dumps(sd.state, sort_keys=True)
    tensors = sd.tensors
    meta = {"format": FORMAT_NAME, "format_version": str(FORMAT_VERSION), "cache_class": name,
            "config": config, "state": state, "sha256": digest(config, state, tensors)}
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
    try:
        st.numpy.save_file(tensors, tmp, metadata=meta)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
