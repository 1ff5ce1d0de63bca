"""The cache file format's writing side: format constants, the checksum, state collection
and :func:`save_cache` (the format itself is described in :mod:`numba_kv.caches.persist`,
which reads it).

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

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "SAVEABLE", "digest", "layered_state", "mixed_state", "paged_state",
           "safetensors_module", "save_cache"]

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


def mixed_state(cache: Any) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """State JSON and tensors (``parts.<p>.layers.<i>.<buffer>``) of a ``MixedCache``."""
    states, tensors = [], {}
    for p, part in enumerate(cache.parts):
        st, ts = layered_state(part)
        states.append(st)
        tensors.update({f"parts.{p}.{n}": t for n, t in ts.items()})
    return {"parts": states}, tensors


def _to_host(a: Any) -> np.ndarray:
    return np.ascontiguousarray(_backend.to_host(a))


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


# -- collecting state -----------------------------------------------------------------------
def layered_state(cache: Any) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """State JSON (per layer: ``seq_len``, ``batch``, counters, live counts) and the live
    part of every buffer (``layers.<i>.<buffer>``, on the host) of a layered cache."""
    layers, tensors = [], {}
    with cache._all_locks():
        for i, st in enumerate(cache._layers):
            if not st.seq_len:
                layers.append(None)
                continue
            layers.append({"seq_len": st.seq_len, "batch": st.batch, "meta": dict(st.meta), "live": dict(st.live)})
            for n, b in st.buffers.items():
                # whole buffer to the host first: device slices are not contiguous
                tensors[f"layers.{i}.{n}"] = np.ascontiguousarray(_to_host(b)[:, :st.live_count(n)])
    return {"layers": layers}, tensors


def paged_state(cache: Any) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """State JSON (page tables, lengths, free list) and the page pools of a ``PagedKVCache``."""
    with cache._lock:
        state = {"tables": [{str(s): list(p) for s, p in t.items()} for t in cache._tables],
                 "lens": [{str(s): int(n) for s, n in d.items()} for d in cache._lens],
                 "free": list(cache._free), "next_seq": cache._next_seq}
        tensors = {f"pool.{n}": _to_host(a) for n, a in cache._pools.items()}
    return state, tensors


def save_cache(cache: Any, path: Any) -> None:
    """Write ``cache`` to ``path`` (see the module docstring for the format).

    The file is written next to ``path`` and renamed over it, so an interrupted save never
    leaves a partial file under ``path``.
    """
    st = safetensors_module()
    name = type(cache).__name__
    if SAVEABLE.get(name) != type(cache).__module__:
        raise TypeError(f"cache: saving supports {sorted(SAVEABLE)}, got {type(cache).__name__}")
    config = json.dumps(cache._lifecycle_config(), sort_keys=True)
    if name == "MixedCache":
        state_obj, tensors = mixed_state(cache)
    else:
        state_obj, tensors = paged_state(cache) if name == "PagedKVCache" else layered_state(cache)
    state = json.dumps(state_obj, sort_keys=True)
    meta = {"format": FORMAT_NAME, "format_version": str(FORMAT_VERSION), "cache_class": name,
            "config": config, "state": state, "sha256": digest(config, state, tensors)}
    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
    try:
        st.numpy.save_file(tensors, tmp, metadata=meta)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
