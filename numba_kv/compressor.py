"""``KVCacheCompressor``: whole-tensor K/V codecs with the API of gllm-kernels
(the Rust crate's ``KVCacheCompressor``), with real methods behind it.

Methods (:class:`CompressionMethod`)
------------------------------------
``LowRank(rank)``
    Per row (one (batch, head) pair) a PCA basis fitted on the data: channel mean ``μ``
    plus the top principal axes of the centred tokens (eigenvectors of the centred Gram
    matrix, :mod:`numba_kv.ops.lowrank`), coefficients ``(x − μ)·Bᵀ`` stored in float16
    (default; over a power of two per row, so any finite scale keeps binary16's relative
    precision) or float32.  The rank is gllm-kernels' automatic rule — the smallest rank that
    captures ``energy`` (0.9) of the energy — capped by ``rank``; ``energy=None`` keeps
    ``rank``.  gllm-kernels instead keeps the highest-energy *channels* in float32.
``VectorQuantization(codebook_size)``
    k-means with k-means++ seeding run to convergence (relative inertia decrease below
    ``tol`` or an unchanged assignment, at most ``max_iter`` Lloyd steps;
    :mod:`numba_kv.ops.vq`), codebooks stored in float16 over a power of two per codebook
    set (input beyond ±65504 is a ``ValueError``), codes packed in ``quant_bits`` (4 or 8) bits, tokens whose squared
    distance exceeds ``mean + 3·std`` stored exactly.
    Whole-vector VQ over the whole tensor by default (gllm-kernels' layout);
    ``subvector_dim`` turns it into product quantization and ``per_head`` fits one
    codebook set per row.  gllm-kernels runs 2 Lloyd steps from the first ``K`` tokens.
``Hybrid(rank, quant_bits)``
    The LowRank projection, then INT4/INT8 of the coefficients with one scale per
    coefficient channel (or per channel and ``group_size`` tokens), values beyond the
    channel's ``median + 6·MAD`` kept exactly as sparse outliers
    (:mod:`numba_kv.ops.intquant`).  gllm-kernels uses one scale for the whole tensor.

Every heavy step (statistics, projection, reconstruction, distance/assignment, centroid
accumulation, INT quantize + pack, decode) is a CPU twin / CUDA kernel pair dispatched by
the device of the input: NumPy in, NumPy payload; CUDA arrays in, payload on the device.
Fitting reads back only small statistics (``R·d²`` Gram entries, ``K·d`` centroid sums,
per-token distances); the eigen-decomposition and the k-means++ draws run on the host.

Layouts: :meth:`KVCacheCompressor.compress_kv` takes
``[batch, num_heads, seq_len, head_dim]``, :meth:`~KVCacheCompressor.compress_kv_3d`
``[num_heads, seq_len, head_dim]``; the layout is remembered and checked on the way back.
K and V are compressed independently; they must agree on ``batch``, ``num_heads`` and
``seq_len`` (their ``head_dim`` may differ, as in MLA where K carries the RoPE part).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import _backend
from ._validate import F16_MAX, F32_MAX, check_bool, check_float_array, check_float_at_least
from .caches.mla import MLACache, SimpleMLACache
from .caches.paged import PagedKVCache
from .ops import intquant, lowrank, vq
from .ops.bitpack import pack_bits, unpack_bits
from .ops.finite import check_finite_stats
from .ops.gather import gather_rows, scatter_rows, to_like

__all__ = ["CompressionMethod", "LowRank", "VectorQuantization", "Hybrid", "CompressedTensor", "CompressedKV",
           "KVCacheCompressor", "OUTLIER_STD_FACTOR", "VQ_MAX_ABS", "lowrank_max_abs"]

OUTLIER_STD_FACTOR = 3.0
# VectorQuantization's range: its binary16 codebooks carry a power of two per codebook set (any
# scale keeps binary16's relative precision), but k-means sums float32 squared distances, which
# this bound keeps far from overflow; data beyond it is a ValueError.
VQ_MAX_ABS = F16_MAX
"""Largest ``|x|`` :class:`VectorQuantization` takes (65504, the largest finite float16)."""
_DTYPES = ("float16", "float32")


def _int_arg(name: str, value: Any, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        rng = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"
        raise ValueError(f"{name}: expected an int {rng}, got {value}")
    return int(value)


def _energy_arg(energy: Any) -> None:
    # NumPy scalars are accepted (np.float32 is no Python float); NaN fails the range test
    if energy is not None and (isinstance(energy, (bool, np.bool_)) or not isinstance(energy, numbers.Real)):
        raise TypeError(f"energy: expected None or a float in (0, 1], got {type(energy).__name__} {energy!r}")
    if energy is not None and not 0.0 < float(energy) <= 1.0:
        raise ValueError(f"energy: expected None or a float in (0, 1], got {energy!r}")


def lowrank_max_abs(head_dim: int) -> float:
    """Largest ``|x|`` the low-rank methods take for ``head_dim`` channels:
    ``float32 max / (4·√head_dim)``.

    A centred value is at most ``2·max|x|``, so a coefficient (a dot product with a unit
    basis row) and every partial sum of the projection and of the reconstruction are at most
    ``(2·√head_dim + 1)·max|x|``: the factor 4 keeps them finite in float32 with room for
    rounding and a float16 basis that is not exactly orthonormal.
    """
    return F32_MAX / (4.0 * float(np.sqrt(head_dim)))


def _dtype_arg(name: str, value: Any) -> None:
    if value not in _DTYPES:
        raise ValueError(f"{name}: expected one of {list(_DTYPES)}, got {value!r}")


# --- methods -------------------------------------------------------------------------------
@dataclass(frozen=True)
class LowRank:
    """Per-head PCA projection (see module docstring).

    Parameters
    ----------
    rank : int
        Upper bound on the kept rank (``>= 1``).
    energy : float or None
        Automatic-rank energy fraction (gllm-kernels: 0.9); ``None`` keeps ``min(rank, head_dim)``.
    dtype : {"float16", "float32"}
        Storage of coefficients and basis (the mean is float32).  float16 coefficients are
        stored over a power of two per row (:func:`numba_kv.ops.lowrank.pow2_row_scales` of a
        bound of ``‖x − μ‖``, 4 bytes a row): binary16's relative precision, 2**-11, at any
        finite scale, down to ``2**-29`` of the row's bound.

    Notes
    -----
    The statistics are summed pre-scaled (:func:`numba_kv.ops.lowrank.stats_into`), so the fit
    holds at any finite scale; input with ``max|x| > float32 max / (4·√head_dim)``
    (:func:`lowrank_max_abs`, ``7.5e36`` at ``head_dim=128``) is a ``ValueError`` naming
    ``k``/``v``: its float32 coefficients could overflow.  :class:`Hybrid` likewise.
    """

    rank: int
    energy: float | None = lowrank.ENERGY_FRACTION
    dtype: str = "float16"

    def __post_init__(self) -> None:
        _int_arg("rank", self.rank, 1)
        _energy_arg(self.energy)
        _dtype_arg("dtype", self.dtype)


@dataclass(frozen=True)
class VectorQuantization:
    """k-means++ / Lloyd vector quantization (see module docstring).

    Parameters
    ----------
    codebook_size : int
        Codewords per codebook, ``1..256`` (``<= 2**quant_bits`` of the compressor).
    subvector_dim : int, optional
        Sub-vector width for product quantization (must divide ``head_dim``); ``None``:
        whole vectors.
    per_head : bool
        One codebook set per (batch, head) row instead of one for the whole tensor.
    max_iter : int
        Most Lloyd iterations.
    tol : float
        Stop when the inertia decreases by less than this fraction.
    seed : int
        Seed of the k-means++ draws.

    Notes
    -----
    Codebooks are stored in float16 over a power of two per codebook set (4 bytes a set), so
    small data keeps binary16's relative precision.  Input with ``max|x|`` above
    :data:`VQ_MAX_ABS` (65504) is a ``ValueError`` naming ``k``/``v`` (k-means' float32 squared
    distances stay far from overflow).  Scale such data down first, or use
    :class:`LowRank` / :class:`Hybrid`.
    """

    codebook_size: int
    subvector_dim: int | None = None
    per_head: bool = False
    max_iter: int = vq.KMEANS_MAX_ITER
    tol: float = vq.KMEANS_TOL
    seed: int = 0

    def __post_init__(self) -> None:
        _int_arg("codebook_size", self.codebook_size, 1, 256)
        if self.subvector_dim is not None:
            _int_arg("subvector_dim", self.subvector_dim, 1)
        check_bool("per_head", self.per_head)  # a truthy string must not switch per-head codebooks on
        _int_arg("max_iter", self.max_iter, 1)
        check_float_at_least("tol", self.tol)  # (NaN would silently disable the inertia stop rule)
        _int_arg("seed", self.seed, 0)


@dataclass(frozen=True)
class Hybrid:
    """Low-rank projection then INT4/INT8 coefficients with exact outliers.

    Parameters
    ----------
    rank : int
        As for :class:`LowRank`: upper bound on the kept rank (``>= 1``).
    quant_bits : {0, 4, 8}
        Integer width; 0 uses the compressor's ``quant_bits`` (as in gllm-kernels).
    group_size : int, optional
        Tokens per scale within a coefficient channel (even); ``None``: one scale per
        channel.
    energy : float or None
        As for :class:`LowRank` (automatic rank).
    basis_dtype : {"float16", "float32"}
        Storage of the basis.
    """

    rank: int
    quant_bits: int = 0
    group_size: int | None = None
    energy: float | None = lowrank.ENERGY_FRACTION
    basis_dtype: str = "float16"

    def __post_init__(self) -> None:
        _int_arg("rank", self.rank, 1)
        if isinstance(self.quant_bits, (bool, np.bool_)) or not isinstance(self.quant_bits, (int, np.integer)):
            raise TypeError(f"quant_bits: expected 0 (compressor default), 4 or 8, got "
                            f"{type(self.quant_bits).__name__} {self.quant_bits!r}")
        if self.quant_bits not in (0, 4, 8):
            raise ValueError(f"quant_bits: expected 0 (compressor default), 4 or 8, got {self.quant_bits!r}")
        if self.group_size is not None:
            intquant.check_group(self.group_size, 2)
        _energy_arg(self.energy)
        _dtype_arg("basis_dtype", self.basis_dtype)


class CompressionMethod:
    """Namespace mirroring the ``CompressionMethod`` enum of gllm-kernels.

    ``CompressionMethod.LowRank(rank=16)``, ``CompressionMethod.VectorQuantization(
    codebook_size=256)``, ``CompressionMethod.Hybrid(rank=32, quant_bits=4)``.
    """

    LowRank = LowRank
    VectorQuantization = VectorQuantization
    Hybrid = Hybrid


Method = LowRank | VectorQuantization | Hybrid


# --- compressed containers ------------------------------------------------------------------
def _nbytes(a: Any) -> int:
    return int(np.prod(tuple(a.shape))) * np.dtype(a.dtype).itemsize


@dataclass
class CompressedTensor:
    """One compressed ``[rows, seq_len, head_dim]`` tensor.

    Attributes
    ----------
    method : str
        ``"lowrank"``, ``"vq"`` or ``"hybrid"``.
    shape : tuple of int
        ``(rows, seq_len, head_dim)`` with ``rows = batch·num_heads``.
    arrays : dict of str to array
        Everything stored (on the device of the input); :attr:`nbytes` sums them.
    meta : dict
        Small Python scalars needed to decode (rank, bits, group, …; not counted).
    """

    method: str
    shape: tuple[int, int, int]
    arrays: dict[str, Any]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Exact bytes of every stored array."""
        return sum(_nbytes(a) for a in self.arrays.values())

    @property
    def num_values(self) -> int:
        """Values of the original tensor."""
        r, n, d = self.shape
        return r * n * d

    @property
    def bits_per_value(self) -> float:
        """Stored bits per original value (side data included)."""
        return 8.0 * self.nbytes / max(self.num_values, 1)


@dataclass
class CompressedKV:
    """Compressed K and V of one call, with the layout they came in.

    Attributes
    ----------
    k, v : CompressedTensor
    layout : tuple
        ``("batched", batch, num_heads, seq_len)`` or ``("unbatched", num_heads, seq_len)``.
    original_nbytes : int
        Bytes of the input K and V in their own dtypes.
    """

    k: CompressedTensor
    v: CompressedTensor
    layout: tuple
    original_nbytes: int

    @property
    def batched(self) -> bool:
        """True for the 4-D layout."""
        return self.layout[0] == "batched"

    @property
    def nbytes(self) -> int:
        """Exact stored bytes of K and V (codes, scales, bases, codebooks, outliers)."""
        return self.k.nbytes + self.v.nbytes

    @property
    def compression_ratio(self) -> float:
        """``original_nbytes / nbytes``."""
        return self.original_nbytes / max(self.nbytes, 1)

    @property
    def bits_per_value(self) -> float:
        """Stored bits per K or V value."""
        return 8.0 * self.nbytes / max(self.k.num_values + self.v.num_values, 1)


# --- the compressor ---------------------------------------------------------------------------
class KVCacheCompressor:
    """Compress K/V tensors with a low-rank, vector-quantization or hybrid method.

    Parameters
    ----------
    method : LowRank, VectorQuantization or Hybrid
        See :class:`CompressionMethod`.
    quant_bits : {4, 8}
        Default integer width (VQ code width; Hybrid's when its ``quant_bits`` is 0).

    Raises
    ------
    ValueError
        ``quant_bits`` not 4/8, or ``codebook_size > 2**quant_bits``.
    TypeError
        ``method`` of another type.

    Examples
    --------
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> k = rng.standard_normal((2, 64, 32)).astype(np.float32)
    >>> c = KVCacheCompressor(CompressionMethod.Hybrid(rank=16, quant_bits=8))
    >>> ck = c.compress_kv_3d(k, k)
    >>> k_hat, _ = c.decompress_kv_3d(ck)
    >>> k_hat.shape, ck.compression_ratio > 1
    ((2, 64, 32), True)
    """

    def __init__(self, method: Method, quant_bits: int = 8) -> None:
        if not isinstance(method, (LowRank, VectorQuantization, Hybrid)):
            raise TypeError(f"method: expected CompressionMethod.LowRank, VectorQuantization or Hybrid, "
                            f"got {type(method).__name__}")
        if isinstance(quant_bits, (bool, np.bool_)) or not isinstance(quant_bits, (int, np.integer)):
            raise TypeError(f"quant_bits: expected 4 or 8, got {type(quant_bits).__name__} {quant_bits!r}")
        if quant_bits not in intquant.SUPPORTED_BITS:
            raise ValueError(f"quant_bits: expected 4 or 8, got {quant_bits!r}")
        if isinstance(method, VectorQuantization) and method.codebook_size > (1 << int(quant_bits)):
            raise ValueError(f"codebook_size: expected <= {1 << int(quant_bits)} for "
                             f"quant_bits={quant_bits}, got {method.codebook_size}")
        self._method = method
        self._quant_bits = int(quant_bits)

    @property
    def method(self) -> Method:
        """The compression method."""
        return self._method

    @property
    def quant_bits(self) -> int:
        """Default integer width."""
        return self._quant_bits

    def __repr__(self) -> str:
        return f"KVCacheCompressor(method={self._method!r}, quant_bits={self._quant_bits})"

    # -- validation -------------------------------------------------------------------------
    def _check_pair(self, k: Any, v: Any, ndim: int) -> tuple[Any, Any]:
        labels = ("batch", "num_heads", "seq_len", "head_dim")[4 - ndim:]
        _backend.resolve_device("auto", k=k, v=v)
        for name, a in (("k", k), ("v", v)):
            check_float_array(name, a, ndim)
            if min(tuple(a.shape)) < 1:
                raise ValueError(f"{name}: expected a non-empty [{', '.join(labels)}] tensor, got shape "
                                 f"{tuple(a.shape)}")
        if tuple(k.shape)[:-1] != tuple(v.shape)[:-1]:
            raise ValueError(f"v: expected [{', '.join(labels[:-1])}] = {tuple(k.shape)[:-1]} (those of k), "
                             f"got shape {tuple(v.shape)}")
        if isinstance(self._method, VectorQuantization) and self._method.subvector_dim is not None:
            for name, a in (("k", k), ("v", v)):
                if tuple(a.shape)[-1] % self._method.subvector_dim:
                    raise ValueError(f"{name}: expected head_dim divisible by subvector_dim="
                                     f"{self._method.subvector_dim}, got shape {tuple(a.shape)}")
        for name, a in (("k", k), ("v", v)):
            self._check_range(name, check_finite_stats(name, a).amax, int(tuple(a.shape)[-1]))
        return k, v

    def _check_range(self, name: str, amax: float, d: int) -> None:
        """``ValueError`` naming ``name`` when its largest ``|x|`` (``amax``, finite) is beyond what
        the method stores: the float16 codebook of VQ (:data:`VQ_MAX_ABS`), or the float32
        projection and reconstruction of the low-rank methods (:func:`lowrank_max_abs`)."""
        if isinstance(self._method, VectorQuantization):
            limit, why = VQ_MAX_ABS, "VectorQuantization's range"
        else:
            limit = lowrank_max_abs(d)
            why = f"float32 max / (4·√head_dim), head_dim={d}: low-rank coefficients are float32 sums"
        if amax > limit:
            raise ValueError(f"{name}: expected max |{name}| <= {limit:.6g} ({why}), got {amax:.6g}")

    # -- public API ---------------------------------------------------------------------------
    def compress_kv(self, k: Any, v: Any) -> CompressedKV:
        """Compress batched K/V.

        Parameters
        ----------
        k : float array, shape ``(batch, num_heads, seq_len, head_dim)``
            float16/32/64, finite; NumPy → CPU twins, CUDA array → CUDA kernels.
        v : float array, shape ``(batch, num_heads, seq_len, v_head_dim)``

        Returns
        -------
        CompressedKV
            Layout ``("batched", batch, num_heads, seq_len)``.

        Raises
        ------
        ValueError, TypeError
            Wrong rank, empty or mismatched shapes, non-finite values, mixed devices; values
            beyond the method's range (:class:`VectorQuantization`: ``|x| <= 65504``; low rank:
            :func:`lowrank_max_abs`), named ``k`` or ``v``, before any work.
        """
        return self._compress_pair(k, v, 4)

    def compress_kv_3d(self, k: Any, v: Any) -> CompressedKV:
        """Compress unbatched K/V: :meth:`compress_kv` without the batch axis (``k``
        ``(num_heads, seq_len, head_dim)``, ``v`` ``(num_heads, seq_len, v_head_dim)``); the
        result has the layout ``("unbatched", num_heads, seq_len)``."""
        return self._compress_pair(k, v, 3)

    def decompress_kv(self, compressed: CompressedKV) -> tuple[Any, Any]:
        """Reconstruct batched K/V, float32 ``[batch, num_heads, seq_len, head_dim]``.

        Raises
        ------
        ValueError
            ``compressed`` came from :meth:`compress_kv_3d` ("expected batched layout").
        """
        return self._decompress_pair(compressed, batched=True)

    def decompress_kv_3d(self, compressed: CompressedKV) -> tuple[Any, Any]:
        """Reconstruct unbatched K/V, float32 ``[num_heads, seq_len, head_dim]``: the
        :meth:`decompress_kv` of :meth:`compress_kv_3d` results (``ValueError`` "expected
        unbatched layout" for those of :meth:`compress_kv`)."""
        return self._decompress_pair(compressed, batched=False)

    def compress_paged_cache(self, cache: PagedKVCache, layer: int, seq_id: int) -> CompressedKV:
        """Compress one sequence of a :class:`~numba_kv.caches.paged.PagedKVCache` layer.

        Gathers ``get_kv(layer, seq_id)`` (``[num_kv_heads, seq_len, head_dim]``) and runs
        :meth:`compress_kv_3d`.
        """
        if not isinstance(cache, PagedKVCache):
            raise TypeError(f"cache: expected a PagedKVCache, got {type(cache).__name__}")
        k, v = cache.get_kv(layer, seq_id)
        if v is None:
            raise ValueError("cache: expected a cache that stores values (v_head_dim > 0), "
                             "got a key-only cache")
        return self.compress_kv_3d(k, v)

    def decompress_to_paged_cache(self, compressed: CompressedKV, cache: PagedKVCache, layer: int,
                                  seq_id: int) -> None:
        """Decompress and append the tokens to ``seq_id`` of ``cache`` in ``layer``.

        Raises
        ------
        ValueError
            Unbatched layout expected; head count / widths must match the cache.
        OutOfPagesError, KeyError
            From :meth:`PagedKVCache.append` (nothing appended).
        """
        if not isinstance(cache, PagedKVCache):
            raise TypeError(f"cache: expected a PagedKVCache, got {type(cache).__name__}")
        self._check_compressed(compressed, batched=False)
        self._check_target(compressed, cache.num_kv_heads, cache.head_dim, cache.v_head_dim)
        cache.seq_len(layer, seq_id)  # validates layer and seq_id before the work
        k, v = self.decompress_kv_3d(compressed)
        cache.append(layer, seq_id, k, v)

    def compress_mla_cache(self, cache: MLACache | SimpleMLACache, layer: int,
                           seq_id: int) -> CompressedKV:
        """Compress one sequence of an MLA cache from its up-projected K/V: :meth:`compress_kv_3d`
        of ``cache.get_kv(layer, seq_id)`` (``[num_heads, seq_len, ·]`` each)."""
        if not isinstance(cache, (MLACache, SimpleMLACache)):
            raise TypeError(f"cache: expected an MLACache or SimpleMLACache, got {type(cache).__name__}")
        k, v = cache.get_kv(layer, seq_id)
        return self.compress_kv_3d(k, v)

    def decompress_to_mla_cache(self, compressed: CompressedKV, cache: MLACache | SimpleMLACache,
                                layer: int, seq_id: int) -> None:
        """Decompress and append to an MLA cache (which re-projects K/V to its latent)."""
        if not isinstance(cache, (MLACache, SimpleMLACache)):
            raise TypeError(f"cache: expected an MLACache or SimpleMLACache, got {type(cache).__name__}")
        self._check_compressed(compressed, batched=False)
        if isinstance(cache, MLACache):
            self._check_target(compressed, cache.num_heads, cache.qk_head_dim, cache.v_head_dim)
        else:
            self._check_target(compressed, cache.num_heads, cache.head_dim, cache.head_dim)
        cache.seq_len(layer, seq_id)
        k, v = self.decompress_kv_3d(compressed)
        cache.append(layer, seq_id, k, v)

    # -- helpers ----------------------------------------------------------------------------
    @staticmethod
    def _check_compressed(compressed: Any, batched: bool) -> None:
        if not isinstance(compressed, CompressedKV):
            raise TypeError(f"compressed: expected a CompressedKV, got {type(compressed).__name__}")
        if compressed.batched != batched:
            want = "batched" if batched else "unbatched"
            raise ValueError(f"compressed: expected {want} layout, got {compressed.layout[0]} "
                             f"(use {'decompress_kv' if compressed.batched else 'decompress_kv_3d'})")

    @staticmethod
    def _check_target(compressed: CompressedKV, heads: int, kd: int, vd: int) -> None:
        got = (compressed.layout[1], compressed.k.shape[2], compressed.v.shape[2])
        if got != (heads, kd, vd):
            raise ValueError(f"compressed: expected num_heads={heads}, k head_dim={kd}, v head_dim={vd} "
                             f"(those of the cache), got {got}")

    def _compress_pair(self, k: Any, v: Any, ndim: int) -> CompressedKV:
        """Check, then compress K/V with ``ndim`` axes (4: batched, 3: unbatched); the layout
        keeps the leading axes."""
        self._check_pair(k, v, ndim)
        layout = ("batched" if ndim == 4 else "unbatched", *(int(x) for x in tuple(k.shape)[:ndim - 1]))
        orig = sum(_nbytes(a) for a in (k, v))
        ck = self._compress(k, "k")
        cv = self._compress(v, "v")
        return CompressedKV(ck, cv, layout, orig)

    def _compress(self, x: Any, name: str) -> CompressedTensor:
        shape = tuple(int(s) for s in x.shape)
        rows = int(np.prod(shape[:-2]))
        x3 = _backend.ascontiguous_f32(name, x).reshape(rows, shape[-2], shape[-1])
        m = self._method
        if isinstance(m, LowRank):
            return _compress_lowrank(x3, m, name)
        if isinstance(m, VectorQuantization):
            return _compress_vq(x3, m, self._quant_bits)
        return _compress_hybrid(x3, m, m.quant_bits or self._quant_bits)

    def _decompress_pair(self, compressed: Any, batched: bool) -> tuple[Any, Any]:
        """Check the layout, then reconstruct K and V (batched: with the batch axis back)."""
        self._check_compressed(compressed, batched=batched)
        k = self._decompress(compressed.k)
        v = self._decompress(compressed.v)
        if not batched:
            return k, v
        _, b, h, s = compressed.layout
        return k.reshape(b, h, s, k.shape[2]), v.reshape(b, h, s, v.shape[2])

    @staticmethod
    def _decompress(c: CompressedTensor) -> Any:
        if c.method == "lowrank":
            return _decompress_lowrank(c)
        if c.method == "vq":
            return _decompress_vq(c)
        return _decompress_hybrid(c)


# --- method implementations ---------------------------------------------------------------------
def _fit_basis(x3: Any, rank: int, energy: float | None, dtype: str) -> tuple[Any, Any, Any, np.ndarray]:
    """Mean (device, float32), basis as stored (f16 bits or f32) and as used (float32), and a
    bound of every row's coefficients (host float64 ``[R]``: ``‖x − μ‖ <= ‖amax + |μ|‖``, and
    the basis rows have norm at most ``1 + 2**-9`` after binary16 rounding)."""
    rows, n, d = x3.shape
    mean = _backend.empty(x3, (rows, d), np.float32)
    amax = _backend.empty(x3, (rows, d), np.float32)
    gram = _backend.empty(x3, (rows, d, d), np.float32)
    lowrank.stats_into(x3, mean, amax, gram)  # Gram pre-scaled per row: finite for any finite x3
    mean_h = _backend.to_host(mean).astype(np.float64)
    comp, _ = lowrank.fit_components(mean_h, _backend.to_host(gram), n, rank, energy)
    bound = np.linalg.norm(_backend.to_host(amax).astype(np.float64) + np.abs(mean_h), axis=1) * (1 + 2.0 ** -8)
    if dtype == "float16":
        stored = to_like(x3, lowrank.f16_encode(comp))  # host conversion, saturating like the twin
        used = lowrank.f16_decode(stored)  # project with exactly the basis the decoder will see
    else:
        stored = to_like(x3, comp)
        used = stored
    return mean, stored, used, bound


def _basis_used(c: CompressedTensor, name: str = "components") -> Any:
    a = c.arrays[name]
    return lowrank.f16_decode(a) if np.dtype(a.dtype) == np.uint16 else a


def _compress_lowrank(x3: Any, m: LowRank, name: str) -> CompressedTensor:
    rows, n, d = x3.shape
    mean, stored, used, bound = _fit_basis(x3, m.rank, m.energy, m.dtype)
    coef = _backend.empty(x3, (rows, n, used.shape[1]), np.float32)
    lowrank.project_into(x3, mean, used, coef)
    arrays = {"mean": mean, "components": stored, "coef": coef}
    if m.dtype == "float16":
        # binary16 coefficients over a power of two per row that brings the row's bound to 2**15:
        # no saturation at any scale, and binary16's relative precision down to 2**-29 of the
        # bound (without it, data below ~1e-7 lost its coefficients to binary16's subnormals)
        scale = lowrank.pow2_row_scales(bound)
        arrays["coef"] = lowrank.f16_encode(coef, scale)
        arrays["coef_scale"] = to_like(x3, scale)
    return CompressedTensor("lowrank", (rows, n, d), arrays, {"rank": int(used.shape[1])})


def _decompress_lowrank(c: CompressedTensor) -> Any:
    rows, n, d = c.shape
    coef = c.arrays["coef"]
    if np.dtype(coef.dtype) == np.uint16:
        coef = lowrank.f16_decode(coef, c.arrays["coef_scale"])
    out = _backend.empty(coef, (rows, n, d), np.float32)
    lowrank.reconstruct_into(coef, c.arrays["mean"], _basis_used(c), out)
    return out


def _compress_hybrid(x3: Any, m: Hybrid, bits: int) -> CompressedTensor:
    rows, n, d = x3.shape
    mean, stored, used, _ = _fit_basis(x3, m.rank, m.energy, m.basis_dtype)
    coef = _backend.empty(x3, (rows, n, used.shape[1]), np.float32)
    lowrank.project_into(x3, mean, used, coef)
    q = intquant.quantize_int(coef, bits, intquant.check_group(m.group_size, n))
    arrays = {"mean": mean, "components": stored, "packed": q.packed, "scales": q.scales,
              "outlier_idx": q.outlier_idx, "outlier_vals": q.outlier_vals}
    meta = {"rank": int(used.shape[1]), "bits": q.bits, "group": q.group, "num_outliers": q.num_outliers}
    return CompressedTensor("hybrid", (rows, n, d), arrays, meta)


def _decompress_hybrid(c: CompressedTensor) -> Any:
    rows, n, d = c.shape
    a = c.arrays
    q = intquant.IntQuantized(a["packed"], a["scales"], a["outlier_idx"], a["outlier_vals"], c.meta["bits"],
                              c.meta["group"], (rows, n, c.meta["rank"]))
    coef = intquant.dequantize_int(q)
    out = _backend.empty(coef, (rows, n, d), np.float32)
    lowrank.reconstruct_into(coef, a["mean"], _basis_used(c), out)
    return out


def _compress_vq(x3: Any, m: VectorQuantization, bits: int) -> CompressedTensor:
    rows, n, d = x3.shape
    ds = d if m.subvector_dim is None else int(m.subvector_dim)
    m_sub = d // ds
    cb, iters = vq.kmeans(x3, m.codebook_size, ds, bool(m.per_head), max_iter=m.max_iter, tol=m.tol,
                          seed=m.seed)
    # binary16 codewords over a power of two per codebook set (its largest |value| brought to
    # 2**15): full relative precision at any scale of the data (without it, data below ~1e-5
    # lost precision to binary16's subnormals)
    cb_scale = lowrank.pow2_row_scales(np.abs(_backend.to_host(cb)).reshape(cb.shape[0], -1).max(axis=1))
    cb16 = to_like(x3, lowrank.f16_encode(cb, cb_scale))
    cb_used = lowrank.f16_decode(cb16, cb_scale)  # assign against the codebook the decoder will see
    total = rows * n * m_sub
    padded = -(-total // 8) * 8 if bits == 4 else total
    buf = _backend.zeros(x3, (padded,), np.uint8)
    codes = buf[:total].reshape(rows, n, m_sub)
    dist = _backend.empty(x3, (rows, n, m_sub), np.float32)
    vq.assign_into(x3, cb_used, codes, dist)
    # outlier tokens (squared distance to their codewords above mean + OUTLIER_STD_FACTOR·std): stored exactly
    tok = _backend.to_host(dist).astype(np.float64).sum(axis=2).reshape(-1)
    thr = tok.mean() + OUTLIER_STD_FACTOR * tok.std()
    out_idx = np.nonzero(tok > thr)[0].astype(np.int32)
    idx = to_like(x3, out_idx)
    vals = _backend.empty(x3, (out_idx.shape[0], d), np.float32)
    if out_idx.shape[0]:
        gather_rows(x3.reshape(rows * n, d), idx, vals)
    packed = pack_bits(buf.reshape(1, padded), 4).reshape(-1) if bits == 4 else buf
    arrays = {"codes": packed, "codebooks": cb16, "codebook_scale": to_like(x3, cb_scale), "outlier_idx": idx,
              "outlier_vals": vals}
    meta = {"bits": bits, "subvectors": m_sub, "codebook_size": m.codebook_size, "iterations": iters,
            "num_outliers": int(out_idx.shape[0])}
    return CompressedTensor("vq", (rows, n, d), arrays, meta)


def _decompress_vq(c: CompressedTensor) -> Any:
    rows, n, d = c.shape
    a = c.arrays
    m_sub = c.meta["subvectors"]
    total = rows * n * m_sub
    codes = a["codes"]
    if c.meta["bits"] == 4:
        codes = unpack_bits(codes.reshape(1, codes.shape[0]), 4).reshape(-1)
    codes = codes[:total].reshape(rows, n, m_sub)
    out = _backend.empty(codes, (rows, n, d), np.float32)
    vq.decode_into(codes, lowrank.f16_decode(a["codebooks"], a["codebook_scale"]), out)
    m = a["outlier_idx"].shape[0]
    if m:
        scatter_rows(a["outlier_vals"], a["outlier_idx"], out.reshape(rows * n, d))
    return out
