"""Multi-head latent attention (MLA) caches stored in a :class:`~numba_kv.caches.paged.PagedKVCache`.

:class:`MLACache` — DeepSeek-V2/V3 MLA
    Per token, one joint latent ``c_kv`` (``kv_lora_rank``, 512 in DeepSeek) shared by all
    heads plus one shared, already-rotated RoPE key ``k_pe`` (``qk_rope_head_dim``, 64).
    Per layer, up-projections ``W_UK[h]`` ``(kv_lora_rank, qk_nope_head_dim)`` and
    ``W_UV[h]`` ``(kv_lora_rank, v_head_dim)`` reconstruct, for head ``h``::

        k_h = [c_kv · W_UK[h],  k_pe]          (qk_nope_head_dim + qk_rope_head_dim)
        v_h =  c_kv · W_UV[h]                  (v_head_dim)

    The latent ``[c_kv | k_pe]`` is stored as one key-only paged vector per token
    (``num_kv_heads=1``, ``head_dim = kv_lora_rank + qk_rope_head_dim``, like the
    576-wide DeepSeek cache; FlashInfer's ``ckv``/``kpe`` caches are its two column
    ranges).  Absorbed attention (DeepSeek-V2, arXiv:2405.04434, §2.1.2, "absorb ``W_UK``
    into the query") scores queries against the latent directly::

        q̃_h = q_nope,h · W_UK[h]ᵀ             (kv_lora_rank)
        s_h = softmax_scale · (q̃_h · c_kvᵀ + q_pe,h · k_peᵀ)
        o_h = (softmax(s_h) · c_kv) · W_UV[h]

    so no per-head K/V is ever materialized.

:class:`SimpleMLACache` — the simplified form of the gllm-kernels Rust crate
    One ``down_proj`` ``(D, L)``, ``up_proj`` ``(L, D)`` and ``rope_key`` ``(L, D)`` shared by
    K and V and all heads: ``k_lat = k·down``, ``v_lat = v·down`` (per head and token, stored
    in the paged cache with ``head_dim = L``); ``k = k_lat·(up + rope_key)``,
    ``v = v_lat·up``.  Kept so gllm-kernels' API (and ``KVCacheCompressor.compress_mla_cache``)
    works; it is not DeepSeek's MLA.

Both up-project through :func:`numba_kv.ops.lowrank.reconstruct_into` (CPU twin / CUDA
kernel, the latent broadcast over heads), and the simplified form down-projects through
:func:`numba_kv.ops.lowrank.project_into`.  The least-squares path from full K/V back to a
DeepSeek latent (:meth:`MLACache.append`) and the two attention helpers use array
operations of the input's namespace (NumPy or CuPy): they are reference paths, not kernels.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import _backend
from .._validate import F32_MAX, Q_MAX, check_bool, check_float_array, check_int, check_layer, check_softmax_scale
from ..ops.finite import check_finite, check_finite_stats
from ..ops.gather import to_like
from ..ops.lowrank import project_into, reconstruct_into
from .config import PagedConfig
from .paged import DEFAULT_PAGE_SIZE, PagedKVCache, PageTable

__all__ = ["MLACache", "SimpleMLACache"]


def _per_layer(name: str, w: Any, num_layers: int, tail: tuple[int, ...], labels: str) -> np.ndarray:
    """Host float64 copy of a projection, shape ``(num_layers,) + tail`` (a shared array is
    broadcast to every layer)."""
    if not hasattr(w, "shape"):  # NumPy, CuPy or Numba device arrays; a size or None is a slip
        raise TypeError(f"{name}: expected a float array ({labels}), got {type(w).__name__}")
    a = np.asarray(_backend.to_host(w) if not isinstance(w, np.ndarray) else w)
    if a.dtype.kind != "f":
        raise TypeError(f"{name}: expected a float array, got dtype {a.dtype}")
    if a.shape == tail:
        a = np.broadcast_to(a, (num_layers,) + tail)
    if a.shape != (num_layers,) + tail:
        raise ValueError(f"{name}: expected shape {tail} ({labels}) or {(num_layers,) + tail} "
                         f"([num_layers, {labels}]), got {a.shape}")
    if not np.isfinite(a).all():
        raise ValueError(f"{name}: expected finite values, got NaN or Inf")
    amax = float(np.abs(a).max(initial=0.0))
    if amax > F32_MAX:  # (a float64 projection is stored in float32: it would become inf)
        raise ValueError(f"{name}: expected values within the float32 range (|x| <= {F32_MAX:.6g}), got "
                         f"max |x| = {amax:.6g}")
    return np.array(a, np.float64)


def _check_pool(num_pages: int, num_layers: int, latent: int, page_size: int, storage: Any, what: str) -> None:
    """Validate the page pool's arguments once (:class:`~numba_kv.caches.config.PagedConfig`),
    naming the latent width as the MLA cache's user knows it (``what``) where the pool would
    say ``head_dim``."""
    try:
        PagedConfig(num_pages, num_layers, 1, latent, page_size, v_head_dim=0, storage=storage)
    except ValueError as exc:
        if not str(exc).startswith("head_dim:"):
            raise
        raise ValueError(f"{what}: expected a multiple of 32 for storage={storage!r} (32-value quantization "
                         f"blocks), got {latent}") from None


def _latent_cap(comps: Sequence[np.ndarray], what: str) -> tuple[float, str]:
    """Largest ``|latent|`` whose float32 up-projection through every matrix of ``comps``
    (``[..., latent, out]``) stays finite, and what sets it: each partial sum of
    ``Σ_i c_i·W[i, j]`` is at most ``max|c|·Σ_i |W[i, j]|`` (halved: room for rounding).  The
    latent pages alone would take any float32, and :meth:`get_kv` would return inf."""
    worst = max(float(np.abs(np.asarray(w, np.float64)).sum(axis=-2).max(initial=0.0)) for w in comps)
    return (F32_MAX / (2.0 * worst) if worst > 0 else float("inf")), what


def _paged_attr(name: str, doc: str) -> property:
    """Read-only attribute ``name`` of the wrapped paged cache."""
    return property(lambda self: getattr(self.paged, name), doc=doc)


class _LatentBase:
    """Sequence bookkeeping delegated to the wrapped :class:`PagedKVCache`."""

    paged: PagedKVCache
    num_heads: int

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._geometry()}, {self.paged.pool_summary()})"

    def _geometry(self) -> str:
        raise NotImplementedError

    def allocate_sequence(self) -> int:
        """Create an empty sequence in every layer; return its id."""
        return self.paged.allocate_sequence()

    def free_sequence(self, seq_id: int) -> None:
        """Release the sequence's pages in every layer (``KeyError`` if unknown)."""
        self.paged.free_sequence(seq_id)

    def seq_len(self, layer: int, seq_id: int) -> int:
        """Tokens stored for ``seq_id`` in ``layer``."""
        return self.paged.seq_len(layer, seq_id)

    num_layers = _paged_attr("num_layers", "Layers of the model.")
    num_pages = _paged_attr("num_pages", "Pages in the pool.")
    num_free_pages = _paged_attr("num_free_pages", "Pages not in use.")

    def page_table(self, layer: int, seq_ids: Sequence[int] | None = None,
                   on_device: bool = False) -> PageTable:
        """FlashInfer CSR page table (see :meth:`PagedKVCache.page_table`)."""
        return self.paged.page_table(layer, seq_ids, on_device)

    def memory_usage(self) -> int:
        """Bytes of the latent pages in use."""
        return self.paged.memory_usage()

    @property
    def validate(self) -> str:
        """How input values are checked: the wrapped paged cache's mode (see
        :attr:`PagedKVCache.validate <numba_kv.caches._values.ValueChecks.validate>`),
        applied to the full ``k``/``v`` given to ``append`` and to the stored latents."""
        return self.paged.validate

    @validate.setter
    def validate(self, mode: str) -> None:
        self.paged.validate = mode

    def check_inputs(self) -> None:
        """Raise ``ValueError`` if a value recorded by ``validate="deferred"`` since the last
        call was NaN/Inf or out of range (see :meth:`PagedKVCache.check_inputs`)."""
        self.paged.check_inputs()

    def _check_values(self, name: str, a: Any) -> None:
        """Finite ``a`` (a caller's full ``k``/``v``), as :attr:`validate` says: read now
        (``"sync"``), recorded for :meth:`check_inputs` (``"deferred"``) or not checked."""
        if self.paged.reads_values_now(name, a):
            check_finite(name, a)

    def _head_shape(self, name: str, a: Any, dim: int) -> tuple[int, int, int]:
        """Shape ``(num_heads, new_tokens, dim)`` of a per-head float array given as
        ``[num_heads, new_tokens >= 1, dim]`` or ``[1, num_heads, new_tokens, dim]``."""
        check_float_array(name, a)
        shape = tuple(a.shape)
        if len(shape) == 4 and shape[0] == 1:
            shape = shape[1:]
        if len(shape) != 3 or shape[0] != self.num_heads or shape[2] != dim or shape[1] < 1:
            raise ValueError(f"{name}: expected [num_heads={self.num_heads}, new_tokens >= 1, {dim}], "
                             f"got shape {tuple(a.shape)}")
        return shape

    def _const(self, like: Any, key: tuple, host: np.ndarray) -> Any:
        """Per-device copy of a projection constant (made once per device kind)."""
        kind = _backend.device_of("like", like)
        if kind == _backend.CPU:
            return host
        cache: dict = self.__dict__.setdefault("_dev_consts", {})
        ck = key + (type(like).__module__.split(".")[0],)
        if ck not in cache:
            cache[ck] = to_like(like, host)
        return cache[ck]


class MLACache(_LatentBase):
    """DeepSeek MLA latent cache: one ``[c_kv | k_pe]`` vector per token, shared by heads.

    Parameters
    ----------
    num_pages, num_layers : int
        Pool size and model depth.
    num_heads : int
        Attention heads that read the latent.
    kv_lora_rank : int
        Width of ``c_kv``.
    qk_rope_head_dim : int
        Width of the shared RoPE key ``k_pe``.
    qk_nope_head_dim, v_head_dim : int
        Per-head widths of the non-RoPE key part and of V.
    w_uk : float array, shape ``(num_layers, num_heads, kv_lora_rank, qk_nope_head_dim)``
        Key up-projection (a 3-D array is shared by every layer).
    w_uv : float array, shape ``(num_layers, num_heads, kv_lora_rank, v_head_dim)``
        Value up-projection.
    page_size : int
        Tokens per page.
    storage : {"float32", "pqo2", "pqo3", "pqo4"}
        Page format of the latent (PQO needs ``kv_lora_rank + qk_rope_head_dim`` to be a
        multiple of 32).

    Examples
    --------
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> w_uk = rng.standard_normal((2, 4, 32, 16)).astype(np.float32)
    >>> w_uv = rng.standard_normal((2, 4, 32, 16)).astype(np.float32)
    >>> cache = MLACache(8, 2, 4, 32, 32, 16, 16, w_uk, w_uv)
    >>> s = cache.allocate_sequence()
    >>> cache.append_latent(0, s, np.ones((5, 32), np.float32), np.zeros((5, 32), np.float32))
    >>> [a.shape for a in cache.get_kv(0, s)]
    [(4, 5, 48), (4, 5, 16)]
    """

    def __init__(self, num_pages: int, num_layers: int, num_heads: int, kv_lora_rank: int,
                 qk_rope_head_dim: int, qk_nope_head_dim: int, v_head_dim: int, w_uk: Any, w_uv: Any,
                 page_size: int = DEFAULT_PAGE_SIZE, storage: str = "float32") -> None:
        self.num_heads = check_int("num_heads", num_heads, minimum=1)
        self.kv_lora_rank = check_int("kv_lora_rank", kv_lora_rank, minimum=1)
        self.qk_rope_head_dim = check_int("qk_rope_head_dim", qk_rope_head_dim, minimum=0)
        self.qk_nope_head_dim = check_int("qk_nope_head_dim", qk_nope_head_dim, minimum=1)
        self.v_head_dim = check_int("v_head_dim", v_head_dim, minimum=1)
        nl = check_int("num_layers", num_layers, minimum=1)
        h, r, rope, nope, dv = (self.num_heads, self.kv_lora_rank, self.qk_rope_head_dim,
                                self.qk_nope_head_dim, self.v_head_dim)
        self.w_uk = _per_layer("w_uk", w_uk, nl, (h, r, nope),
                               "num_heads, kv_lora_rank, qk_nope_head_dim").astype(np.float32)
        self.w_uv = _per_layer("w_uv", w_uv, nl, (h, r, dv),
                               "num_heads, kv_lora_rank, v_head_dim").astype(np.float32)
        self.latent_dim = r + rope
        _check_pool(num_pages, nl, self.latent_dim, page_size, storage, "kv_lora_rank + qk_rope_head_dim")
        self.paged = PagedKVCache(num_pages, nl, 1, self.latent_dim, page_size, v_head_dim=0, storage=storage)
        # augmented bases: the stored latent [c_kv | k_pe] times comp_k[h] gives [k_nope | k_pe]
        ck = np.zeros((nl, h, r + rope, nope + rope), np.float32)
        ck[:, :, :r, :nope] = self.w_uk
        ck[:, :, r:, nope:] = np.eye(rope, dtype=np.float32)
        cv = np.zeros((nl, h, r + rope, dv), np.float32)
        cv[:, :, :r, :] = self.w_uv
        self._comp_k, self._comp_v = ck, cv
        self.paged.limit_values(*_latent_cap([ck, cv], "MLA latent pages (up-projected through W_UK / W_UV "
                                                        "in float32 by get_kv)"))
        self._zero_k = np.zeros((1, nope + rope), np.float32)
        self._zero_v = np.zeros((1, dv), np.float32)
        # least squares latent of full K/V: c = [k_nope_h…, v_h…] · pinv([W_UK[h] …, W_UV[h] …])
        self._pinv = []
        for layer in range(nl):
            a = np.concatenate([np.concatenate([self.w_uk[layer, i], self.w_uv[layer, i]], axis=1)
                                for i in range(h)], axis=1).astype(np.float64)  # [r, h·(nope+dv)]
            self._pinv.append(np.linalg.pinv(a))  # [h·(nope+dv), r]

    def _geometry(self) -> str:
        return (f"num_layers={self.num_layers}, num_heads={self.num_heads}, kv_lora_rank={self.kv_lora_rank}, "
                f"qk_rope_head_dim={self.qk_rope_head_dim}, qk_nope_head_dim={self.qk_nope_head_dim}, "
                f"v_head_dim={self.v_head_dim}")

    @property
    def qk_head_dim(self) -> int:
        """Per-head key width ``qk_nope_head_dim + qk_rope_head_dim``."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    # -- latent I/O -------------------------------------------------------------------------
    def append_latent(self, layer: int, seq_id: int, c_kv: Any, k_pe: Any = None) -> None:
        """Append latents of ``new_tokens`` tokens.

        Parameters
        ----------
        layer, seq_id : int
            The model layer and the sequence (an id from :meth:`allocate_sequence`).
        c_kv : float array, shape ``(new_tokens, kv_lora_rank)``
            Or the concatenated ``(new_tokens, kv_lora_rank + qk_rope_head_dim)`` latent
            when ``k_pe`` is ``None`` (the only form accepted for Numba device arrays, which
            cannot be concatenated on the device).
        k_pe : float array, shape ``(new_tokens, qk_rope_head_dim)``, optional
            RoPE-rotated shared key.

        Raises
        ------
        ValueError, TypeError, KeyError, OutOfPagesError
            As :meth:`PagedKVCache.append`; nothing is appended.
        """
        check_float_array("c_kv", c_kv, 2)
        if c_kv.shape[0] < 1:
            raise ValueError(f"c_kv: expected new_tokens >= 1 (axis 0), got shape {tuple(c_kv.shape)}")
        if k_pe is None:
            if c_kv.shape[1] != self.latent_dim:
                raise ValueError(f"c_kv: expected [new_tokens, {self.latent_dim}] (kv_lora_rank + "
                                 f"qk_rope_head_dim, k_pe=None), got shape {tuple(c_kv.shape)}")
            lat = c_kv
        else:
            check_float_array("k_pe", k_pe, 2)
            if c_kv.shape[1] != self.kv_lora_rank:
                raise ValueError(f"c_kv: expected [new_tokens, kv_lora_rank={self.kv_lora_rank}], "
                                 f"got shape {tuple(c_kv.shape)}")
            if tuple(k_pe.shape) != (c_kv.shape[0], self.qk_rope_head_dim):
                raise ValueError(f"k_pe: expected shape {(c_kv.shape[0], self.qk_rope_head_dim)}, "
                                 f"got {tuple(k_pe.shape)}")
            _backend.resolve_device("auto", c_kv=c_kv, k_pe=k_pe)
            xp = _backend.xp_of(c_kv)
            if xp is None:
                raise TypeError("c_kv: Numba device arrays cannot be concatenated on the device; pass the "
                                "concatenated [new_tokens, kv_lora_rank + qk_rope_head_dim] latent with "
                                "k_pe=None")
            lat = xp.concatenate([xp.asarray(c_kv, dtype=xp.float32), xp.asarray(k_pe, dtype=xp.float32)],
                                 axis=1)
        try:
            self.paged.append(layer, seq_id, lat.reshape(1, lat.shape[0], lat.shape[1]))
        except ValueError as e:  # the pages call the latent "k": name the caller's arguments
            msg = str(e)
            if not msg.startswith("k: "):
                raise
            arg = "c_kv" if k_pe is None else "c_kv/k_pe"
            msg = msg[3:].replace("|k|", f"|{arg}|").replace("from k", f"from {arg}")
            raise ValueError(f"{arg}: {msg}") from None

    def get_latent(self, layer: int, seq_id: int) -> tuple[Any, Any]:
        """Stored latents (dequantized for PQO pages).

        Returns
        -------
        c_kv : float32 view, shape ``(seq_len, kv_lora_rank)``
        k_pe : float32 view, shape ``(seq_len, qk_rope_head_dim)``
        """
        lat = self.get_compressed_kv(layer, seq_id)
        return lat[:, : self.kv_lora_rank], lat[:, self.kv_lora_rank:]

    def get_compressed_kv(self, layer: int, seq_id: int) -> Any:
        """Concatenated latent ``[c_kv | k_pe]``, float32 ``(seq_len, kv_lora_rank + qk_rope_head_dim)``."""
        k, _ = self.paged.get_kv(layer, seq_id)
        return k.reshape(k.shape[1], k.shape[2])

    # -- per-head K/V -----------------------------------------------------------------------
    def get_kv(self, layer: int, seq_id: int) -> tuple[Any, Any]:
        """Up-projected per-head keys and values (on the device of the pages).

        Returns
        -------
        k : float32 array, shape ``(num_heads, seq_len, qk_nope_head_dim + qk_rope_head_dim)``
        v : float32 array, shape ``(num_heads, seq_len, v_head_dim)``
        """
        layer = check_layer(layer, self.num_layers)
        lat, _ = self.paged.get_kv(layer, seq_id)  # [1, S, r + rope]
        n = lat.shape[1]
        k = _backend.empty(lat, (self.num_heads, n, self.qk_head_dim), np.float32)
        v = _backend.empty(lat, (self.num_heads, n, self.v_head_dim), np.float32)
        reconstruct_into(lat, self._const(lat, ("zk",), self._zero_k),
                         self._const(lat, ("ck", layer), self._comp_k[layer]), k)
        reconstruct_into(lat, self._const(lat, ("zv",), self._zero_v),
                         self._const(lat, ("cv", layer), self._comp_v[layer]), v)
        return k, v

    def append(self, layer: int, seq_id: int, k: Any, v: Any) -> None:
        """Append full per-head K/V by projecting them back to the latent (least squares).

        ``c_kv = argmin Σ_h ‖c·W_UK[h] − k_nope,h‖² + ‖c·W_UV[h] − v_h‖²`` (via the
        pseudo-inverse) and ``k_pe`` = the mean over heads of the RoPE parts; exact for K/V
        that came from :meth:`get_kv`.  NumPy or CuPy arrays only (reference path).

        Parameters
        ----------
        layer, seq_id : int
            The model layer and the sequence (an id from :meth:`allocate_sequence`).
        k : float array, shape ``(num_heads, new_tokens, qk_nope_head_dim + qk_rope_head_dim)``
            Or ``(1, …)``.
        v : float array, shape ``(num_heads, new_tokens, v_head_dim)``
        """
        layer = check_layer(layer, self.num_layers)
        self.paged.check_sequence(seq_id)
        k3, v3 = self._check_kv_full(k, v)
        xp = _backend.xp_of(k3)
        h, n, _ = k3.shape
        nope = self.qk_nope_head_dim
        y = xp.concatenate([k3[:, :, :nope], v3], axis=2)  # [h, n, nope + dv]
        y = xp.transpose(y, (1, 0, 2)).reshape(n, -1).astype(xp.float64)
        pinv = xp.asarray(self._pinv[layer])
        with np.errstate(over="ignore"):  # a latent beyond float32 is refused by append_latent below
            c = (y @ pinv).astype(xp.float32)
            k_pe = k3[:, :, nope:].astype(xp.float64).mean(axis=0).astype(xp.float32)
        try:
            self.append_latent(layer, seq_id, xp.ascontiguousarray(c), xp.ascontiguousarray(k_pe))
        except ValueError as e:  # the latent is this call's fit, not an argument: name the caller's k / v
            msg = str(e)
            if not msg.startswith("c_kv/k_pe: "):
                raise
            msg = msg[len("c_kv/k_pe: "):].replace("|c_kv/k_pe|", "|latent|")
            raise ValueError(f"k/v: the least-squares latent of k/v is out of range: {msg}") from None

    def _check_kv_full(self, k: Any, v: Any) -> tuple[Any, Any]:
        _backend.resolve_device("auto", k=k, v=v)
        out = []
        for name, a, dim in (("k", k, self.qk_head_dim), ("v", v, self.v_head_dim)):
            shape = self._head_shape(name, a, dim)
            if _backend.xp_of(a) is None:
                raise TypeError(f"{name}: MLACache.append projects with NumPy/CuPy array operations; Numba "
                                "device arrays must go through append_latent")
            self._check_values(name, a)
            out.append(a.reshape(shape))
        if out[0].shape[1] != out[1].shape[1]:
            raise ValueError(f"v: expected {out[0].shape[1]} new tokens (those of k), "
                             f"got shape {tuple(v.shape)}")
        return out[0], out[1]

    # -- attention (reference paths, NumPy/CuPy) ---------------------------------------------
    def _check_q(self, name: str, q: Any, dim: int, q_len: int | None) -> Any:
        check_float_array(name, q, 3)
        if q.shape[0] != self.num_heads or q.shape[2] != dim or (q_len is not None and q.shape[1] != q_len):
            want = q_len if q_len is not None else "q_len"
            raise ValueError(f"{name}: expected [num_heads={self.num_heads}, {want}, {dim}], "
                             f"got shape {tuple(q.shape)}")
        if _backend.xp_of(q) is None:
            raise TypeError(f"{name}: MLA attention helpers use NumPy/CuPy array operations, "
                            "got a Numba device array")
        # the rule of the caches' decode (|q| <= 2**64): with latents inside the float32 range
        # and softmax_scale <= 2**30 the float64 logits stay finite (larger ones gave NaN)
        amax = check_finite_stats(name, q).amax
        if amax > Q_MAX:
            raise ValueError(f"{name}: expected |values| <= 2**64 (logits must stay finite), got max |{name}| = "
                             f"{amax:.6g}")
        return q

    @staticmethod
    def _check_history(n: int, q_len: int, causal: bool) -> None:
        """``ValueError`` naming ``seq_id`` unless every causal query row sees a token: row ``i``
        sits at ``n − q_len + i``, so ``q_len <= n`` (an empty sequence is refused when read)."""
        check_bool("causal", causal)  # ("no" would be truthy)
        if causal and n < q_len:
            raise ValueError(f"seq_id: expected a sequence with at least q_len={q_len} stored tokens "
                             f"(causal), it holds {n}")

    @staticmethod
    def _softmax_av(xp: Any, s: Any, causal: bool, n: int) -> Any:
        if causal:
            q_len = s.shape[1]
            pos_q = n - q_len + xp.arange(q_len)
            mask = xp.arange(n)[None, :] > pos_q[:, None]
            s = xp.where(mask[None], -xp.inf, s)
        s = s - s.max(axis=-1, keepdims=True)
        p = xp.exp(s)
        return p / p.sum(axis=-1, keepdims=True)

    def attend_absorbed(self, layer: int, seq_id: int, q_nope: Any, q_pe: Any, softmax_scale: float,
                        causal: bool = False) -> Any:
        """Attention of every head over the cached latent, without up-projecting K or V.

        Parameters
        ----------
        layer, seq_id : int
            The model layer and the sequence (an id from :meth:`allocate_sequence`).
        q_nope : float array, shape ``(num_heads, q_len, qk_nope_head_dim)``
        q_pe : float array, shape ``(num_heads, q_len, qk_rope_head_dim)``
            RoPE-rotated.
        softmax_scale : float
            Multiplies the logits (usually ``1/sqrt(qk_nope_head_dim + qk_rope_head_dim)``); in
            ``(0, 2**30]``.
        causal : bool
            Query row ``i`` sits at position ``seq_len − q_len + i`` and sees tokens up to it
            (so ``q_len <= seq_len``).

        Returns
        -------
        out : float32 array, shape ``(num_heads, q_len, v_head_dim)``

        Raises
        ------
        ValueError
            A query with a NaN/Inf value or one above ``2**64``, a scale outside ``(0, 2**30]``,
            a sequence with no stored token or, with ``causal``, fewer than ``q_len``: nothing
            is computed.
        """
        layer = check_layer(layer, self.num_layers)
        softmax_scale = check_softmax_scale(softmax_scale)
        self._check_q("q_nope", q_nope, self.qk_nope_head_dim, None)
        self._check_q("q_pe", q_pe, self.qk_rope_head_dim, q_nope.shape[1])
        xp = _backend.xp_of(q_nope)
        lat = self.get_compressed_kv(layer, seq_id)
        self._check_history(lat.shape[0], q_nope.shape[1], causal)
        c_kv = lat[:, : self.kv_lora_rank].astype(xp.float64)
        k_pe = lat[:, self.kv_lora_rank:].astype(xp.float64)
        w_uk = xp.asarray(self.w_uk[layer], dtype=xp.float64)  # [h, r, nope]
        w_uv = xp.asarray(self.w_uv[layer], dtype=xp.float64)
        q_lat = xp.einsum("hqn,hrn->hqr", q_nope.astype(xp.float64), w_uk)  # absorbed W_UK
        s = (q_lat @ c_kv.T + q_pe.astype(xp.float64) @ k_pe.T) * softmax_scale
        p = self._softmax_av(xp, s, causal, lat.shape[0])
        o_lat = p @ c_kv  # [h, q, r]
        return xp.einsum("hqr,hrv->hqv", o_lat, w_uv).astype(xp.float32)

    def attend(self, layer: int, seq_id: int, q: Any, softmax_scale: float, causal: bool = False) -> Any:
        """Reference attention over the up-projected K/V (equals :meth:`attend_absorbed`).

        Parameters
        ----------
        layer, seq_id : int
            The model layer and the sequence (an id from :meth:`allocate_sequence`).
        q : float array, shape ``(num_heads, q_len, qk_nope_head_dim + qk_rope_head_dim)``
        softmax_scale, causal
            As for :meth:`attend_absorbed` (and checked the same way).

        Returns
        -------
        out : float32 array, shape ``(num_heads, q_len, v_head_dim)``
        """
        layer = check_layer(layer, self.num_layers)
        softmax_scale = check_softmax_scale(softmax_scale)
        self._check_q("q", q, self.qk_head_dim, None)
        xp = _backend.xp_of(q)
        k, v = self.get_kv(layer, seq_id)
        self._check_history(k.shape[1], q.shape[1], causal)
        s = xp.einsum("hqd,hkd->hqk", q.astype(xp.float64), k.astype(xp.float64)) * softmax_scale
        p = self._softmax_av(xp, s, causal, k.shape[1])
        return (p @ v.astype(xp.float64)).astype(xp.float32)


class SimpleMLACache(_LatentBase):
    """gllm-kernels' simplified latent cache: per-head latents from one shared projection.

    Parameters
    ----------
    num_pages, num_layers, num_heads : int
    head_dim : int
        ``D``, width of the K/V the model produces.
    latent_dim : int
        ``L``, width of the stored latent.
    down_proj : float array, shape ``(D, L)`` or ``(num_layers, D, L)``
    up_proj : float array, shape ``(L, D)`` or ``(num_layers, L, D)``
    rope_key : float array, shape ``(L, D)`` or ``(num_layers, L, D)``
        gllm-kernels' "decoupled RoPE" map (a second linear map; no rotation is applied).
    page_size : int
    storage : {"float32", "pqo2", "pqo3", "pqo4"}
        PQO needs ``latent_dim`` to be a multiple of 32.
    """

    def __init__(self, num_pages: int, num_layers: int, num_heads: int, head_dim: int, latent_dim: int,
                 down_proj: Any, up_proj: Any, rope_key: Any, page_size: int = DEFAULT_PAGE_SIZE,
                 storage: str = "float32") -> None:
        nl = check_int("num_layers", num_layers, minimum=1)
        self.num_heads = check_int("num_heads", num_heads, minimum=1)
        self.head_dim = check_int("head_dim", head_dim, minimum=1)
        self.latent_dim = check_int("latent_dim", latent_dim, minimum=1)
        d, lat = self.head_dim, self.latent_dim
        down = _per_layer("down_proj", down_proj, nl, (d, lat), "head_dim, latent_dim")
        up = _per_layer("up_proj", up_proj, nl, (lat, d), "latent_dim, head_dim")
        rk = _per_layer("rope_key", rope_key, nl, (lat, d), "latent_dim, head_dim")
        self.down_proj, self.up_proj, self.rope_key = (a.astype(np.float32) for a in (down, up, rk))
        _check_pool(num_pages, nl, lat, page_size, storage, "latent_dim")
        self.paged = PagedKVCache(num_pages, nl, self.num_heads, lat, page_size, storage=storage)
        # components in the [rank, d] layout of the projection op
        self._comp_down = [np.ascontiguousarray(self.down_proj[i].T)[None] for i in range(nl)]  # [1, L, D]
        with np.errstate(over="ignore"):  # (an overflow is refused just below)
            self._comp_k = [np.ascontiguousarray(self.up_proj[i] + self.rope_key[i])[None] for i in range(nl)]
        if not all(np.isfinite(c).all() for c in self._comp_k):  # (the sum is taken in float32)
            raise ValueError("up_proj, rope_key: expected a sum up_proj + rope_key within the float32 range, "
                             "got one that overflows to inf")
        self._comp_v = [np.ascontiguousarray(self.up_proj[i])[None] for i in range(nl)]
        self._zero_d = np.zeros((1, d), np.float32)
        self.paged.limit_values(*_latent_cap(self._comp_k + self._comp_v, "latent pages (up-projected through "
                                                                            "up_proj + rope_key in float32 by get_kv)"))

    def _geometry(self) -> str:
        return (f"num_layers={self.num_layers}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"latent_dim={self.latent_dim}")

    def _check_kv(self, k: Any, v: Any, dim: int, names: tuple[str, str] = ("k", "v")) -> tuple[Any, Any]:
        """``k``/``v`` as ``[num_heads, new_tokens, dim]`` float32, validated under the caller's
        argument ``names``."""
        kn, vn = names
        _backend.resolve_device("auto", **{kn: k, vn: v})
        out = []
        for name, a in ((kn, k), (vn, v)):
            shape = self._head_shape(name, a, dim)
            self._check_values(name, a)
            out.append(_backend.ascontiguous_f32(name, a.reshape(shape)))
        if out[0].shape != out[1].shape:
            raise ValueError(f"{vn}: expected the shape of {kn} {tuple(out[0].shape)}, got {tuple(out[1].shape)}")
        return out[0], out[1]

    def append(self, layer: int, seq_id: int, k: Any, v: Any) -> None:
        """Project ``k``/``v`` ``[num_heads, new_tokens, head_dim]`` to latents and append them."""
        layer = check_layer(layer, self.num_layers)
        self.paged.check_sequence(seq_id)
        k3, v3 = self._check_kv(k, v, self.head_dim)
        h, n, _ = k3.shape
        comp = self._const(k3, ("down", layer), self._comp_down[layer])
        zero = self._const(k3, ("zd",), self._zero_d)
        lats = []
        for x in (k3, v3):
            out = _backend.empty(x, (h, n, self.latent_dim), np.float32)
            project_into(x, zero, comp, out)
            lats.append(out)
        try:
            self.paged.append(layer, seq_id, lats[0], lats[1])
        except ValueError as e:  # the pages validate the latents: name the caller's k / v
            msg = str(e)
            name, arr = ("k", k3) if msg.startswith("k:") else ("v", v3)
            lat = f"{name}·down_proj"
            if "expected finite values" not in msg:  # a range error about the stored latent
                msg = msg.replace(f"|{name}|", f"|{lat}|").replace(f"from {name} ", f"from {lat} ")
                raise ValueError(msg) from None
            xp = _backend.xp_of(arr) or np
            amax = float(xp.abs(_backend.to_host(arr) if xp is np else arr).max())
            raise ValueError(f"{name}: its float32 latent {lat} overflows (max |{name}| = {amax:.6g}); "
                             "nothing was stored") from None

    def append_compressed(self, layer: int, seq_id: int, k_lat: Any, v_lat: Any) -> None:
        """Append latents ``[num_heads, new_tokens, latent_dim]`` as given."""
        k3, v3 = self._check_kv(k_lat, v_lat, self.latent_dim, ("k_lat", "v_lat"))
        self.paged.append(layer, seq_id, k3, v3)

    def get_compressed_kv(self, layer: int, seq_id: int) -> tuple[Any, Any]:
        """Stored latents, float32 ``[num_heads, seq_len, latent_dim]`` each."""
        return self.paged.get_kv(layer, seq_id)

    def get_kv(self, layer: int, seq_id: int) -> tuple[Any, Any]:
        """Up-projected K and V, float32 ``[num_heads, seq_len, head_dim]`` each."""
        layer = check_layer(layer, self.num_layers)
        k_lat, v_lat = self.paged.get_kv(layer, seq_id)
        h, n, _ = k_lat.shape
        zero = self._const(k_lat, ("zd",), self._zero_d)
        k = _backend.empty(k_lat, (h, n, self.head_dim), np.float32)
        v = _backend.empty(k_lat, (h, n, self.head_dim), np.float32)
        reconstruct_into(k_lat, zero, self._const(k_lat, ("ck", layer), self._comp_k[layer]), k)
        reconstruct_into(v_lat, zero, self._const(k_lat, ("cv", layer), self._comp_v[layer]), v)
        return k, v
