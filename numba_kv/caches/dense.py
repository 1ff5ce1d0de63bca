"""``DenseCache``: the exact, uncompressed reference cache under the same protocol."""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import _backend
from .._validate import F16_MAX, F32_MAX, check_magnitude
from ..ops.memory import copy_tokens
from ._layer import BufferSpec, LayeredCache, LayerState, shift_front


class DenseCache(LayeredCache):
    """Uncompressed K/V storage (exact reference for every compressed cache).

    Parameters
    ----------
    num_layers, num_kv_heads, head_dim : int
        Model geometry; ``head_dim`` a multiple of 32.
    dtype : {None, float16, float32, float64}
        Storage dtype; ``None`` (default) keeps float32.  ``memory_usage()`` counts it.
    sliding_window : None, int, sequence or dict, optional
        Per-layer sliding windows (``None``: every layer global; an int: every layer; a
        list of ``num_layers`` ints/None; ``{layer: window}``, negative layers from the
        end).  A sliding layer stores only what its queries can still see (see
        :class:`~numba_kv.caches._layer.LayeredCache`).

    Notes
    -----
    ``decode`` returns :class:`~numba_kv.caches.protocol.Dequantized` holding the exact
    history.  Storage is ``[batch·num_kv_heads, capacity, head_dim]`` per layer for K and V.
    """

    name = "dense"

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: Any | None = None,
                 sliding_window: Any = None) -> None:
        super().__init__(num_layers, num_kv_heads, head_dim, sliding_window)
        try:
            dt = np.dtype(np.float32 if dtype is None else dtype)
        except TypeError:  # (NumPy's message does not name the argument)
            raise TypeError(f"dtype: expected None, float16, float32 or float64, got {dtype!r}") from None
        if dt not in (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)):
            raise TypeError(f"dtype: expected None, float16, float32 or float64, got {dt}")
        self.dtype = dt

    @property
    def bits_per_value(self) -> float:
        """Stored bits per K or V value."""
        return 8.0 * self.dtype.itemsize

    def _buffer_spec(self) -> BufferSpec:
        return {"k": (self.head_dim, self.dtype, None), "v": (self.head_dim, self.dtype, None)}

    def _input_limit(self) -> tuple[float, str]:
        limit = {2: F16_MAX, 4: F32_MAX}.get(self.dtype.itemsize, float("inf"))  # float64: any finite value
        return limit, f"dtype={self.dtype.name} storage"

    def _check_range(self, st: LayerState, k: Any, v: Any, stats: Any) -> None:
        if self.dtype.itemsize < 8:  # float16 / float32 storage: larger finite inputs would become inf
            limit = F16_MAX if self.dtype.itemsize == 2 else F32_MAX
            for name, rs in zip(("k", "v"), stats):
                check_magnitude(name, rs.amax, limit, f"dtype={self.dtype.name} storage")

    def _check_device_inputs(self, k: Any, v: Any) -> None:
        """A Numba device array must already be C-contiguous in the storage dtype (checked with
        the shapes: refused only at the store, a sliding layer had already evicted)."""
        self._check_device_input("k", k)
        self._check_device_input("v", v)

    def _check_device_input(self, name: str, a: Any) -> None:
        if _backend.xp_of(a) is None and (np.dtype(a.dtype) != self.dtype or not a.is_c_contiguous()):
            got = a.dtype if np.dtype(a.dtype) != self.dtype else f"a strided {a.dtype} array"
            raise TypeError(f"{name}: Numba device arrays must be C-contiguous {self.dtype} (the storage "
                            f"dtype; they are not cast or copied on the device), got {got}")

    def _flat(self, name: str, a: Any) -> Any:
        xp = _backend.xp_of(a)
        if xp is None:  # Numba device array: must already be in the storage dtype
            self._check_device_input(name, a)
            return a.reshape(a.shape[0] * a.shape[1], a.shape[2], a.shape[3])
        a = xp.ascontiguousarray(a, dtype=self.dtype)
        return a.reshape(a.shape[0] * a.shape[1], a.shape[2], a.shape[3])

    def _store(self, st: LayerState, k: Any, v: Any) -> None:
        t0, s = st.seq_len, int(k.shape[2])
        for name, a in (("k", k), ("v", v)):
            src = self._flat(name, a)
            dst = st.buffers[name]
            if _backend.xp_of(dst) is not None:
                dst[:, t0:t0 + s] = src
            else:  # Numba device arrays: per-row contiguous copies
                for r in range(src.shape[0]):
                    dst[r, t0:t0 + s].copy_to_device(src[r])

    def _history(self, st: LayerState, dtype: Any) -> tuple[Any, Any]:
        out = []
        for name in ("k", "v"):
            buf = st.buffers[name]
            xp = _backend.xp_of(buf)
            live = buf[:, : st.seq_len]
            # a copy, never a view: sliding layers shift their buffers in place
            if xp is not None:
                flat = live.copy()
            elif np.dtype(buf.dtype) == np.float32:  # Numba device array: copied on the device
                flat = _backend.empty(buf, (int(buf.shape[0]), st.seq_len, int(buf.shape[2])), np.float32)
                copy_tokens(buf, 0, st.seq_len, flat, 0)
            else:  # float16/float64 (no copy kernel): a device-to-device copy per row, not via the host
                flat = _backend.empty(buf, (int(buf.shape[0]), st.seq_len, int(buf.shape[2])), buf.dtype)
                for r in range(int(buf.shape[0])):
                    flat[r].copy_to_device(buf[r, : st.seq_len])
            out.append(self._reshape_out(flat, st.batch, dtype))
        return out[0], out[1]

    def _evict(self, st: LayerState, e: int) -> None:
        for name in ("k", "v"):
            shift_front(st.buffers[name], e, st.seq_len)
        st.seq_len -= e

    def config_dict(self) -> dict[str, Any]:
        """Constructor arguments (JSON types) that rebuild this cache's configuration."""
        return {"num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
                "dtype": self.dtype.name, **self._window_config()}
