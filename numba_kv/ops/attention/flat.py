"""Decode attention computed straight from packed codes (no dequantized K/V in memory).

Math.  With the forward block rotation ``F = D_s H`` and a
stored token ``k̂_b = |a_b| Fᵀ c[idx_b]`` per 32-block ``b``:

* ``⟨q_b, k̂_b⟩ = |a_b| ⟨F q_b, c[idx_b]⟩`` — rotate each query block **once** and score
  tokens against codebook values, never inverse-rotating a key;
* ``Σ_t p_t v̂_{t,b} = Fᵀ Σ_t p_t |a^v_{t,b}| c[idx^v_{t,b}]`` — accumulate weighted
  centroids in the rotated domain and inverse-rotate once per block at the end.

Work decomposition (flash-decoding): for every KV row ``g`` (= batch × KV head) the
tokens are cut into partitions; each work item runs an online softmax for all
``G·q_len`` query rows of that KV head over one partition (GQA: a token's codes are
unpacked once and reused by the whole group) and writes ``(m, l, acc)`` (Dao et al.,
"Flash-Decoding"; the online softmax of Milakov & Gimelshein, arXiv:1805.02867).  A merge step
combines partitions by log-sum-exp, inverse-rotates the compressed part, adds the exact
part (full-precision window/sink tokens, accumulated unrotated) and normalizes.

Every token carries an absolute position: compressed tokens are ``comp_pos0 + t``, exact
tokens read theirs from ``exact_pos``.  Query row ``r`` sits at position
``q_pos0 + r % q_len``; with ``causal`` it sees tokens at positions ``<=`` its own.
``logit_bias[g, r, pos]`` is added to the scaled logit (``softmax_scale · q·k``).

Modules: this one is the host API (validation, layouts, launch); the kernels live in
:mod:`numba_kv.ops.attention.kernels` (flat decode and merge, both twins), their shared
cores in :mod:`numba_kv.ops.attention.cores` and the CPU-only SIMD helpers in
:mod:`numba_kv.ops.attention.cpu`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numba
import numpy as np

from ... import _backend, _config
from ..._validate import check_float_array, check_shape
from ..codebook import Codebook, get_codebook
from ..finite import check_finite, check_rotation_input
from ..gather import to_like
from ..hadamard import SIGNS32, rotate32
from ..headquant import head_signs, rotate_head
from ..lowrank import project_into
from ..qjl import qjl_constant, sketch_arg
from .cores import EXACT_F16, EXACT_F32, EXACT_I8
from .kernels import (
    DECODE_ATTENTION,
    DECODE_ATTENTION_MMA,
    DECODE_ATTENTION_WARP,
    MAX_HEAD_DIM,
    MERGE_PARTITIONS,
    rows_per_block,
)
from .mma import MMA_BITS, MMA_HEAD_DIM, MMA_THREADS, mma_partition_size
from .warp import VROW, WARP_ROWS, warp_ok

__all__ = ["CodeLayout", "F16_ABS_TABLE", "code_words", "decode_attention", "default_partition_size",
           "fused_attention_rows", "mma_layout_ok", "mma_operands", "unit_axis", "use_mma_kernel"]

TILE = 128  # tokens per partition granule (partition sizes are multiples of it)
#: |binary16| -> float32 for every bit pattern (exact; 256 KiB, stays in L2): scale decoding
F16_ABS_TABLE = np.abs(np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32))
F16_ABS_TABLE[~np.isfinite(F16_ABS_TABLE)] = 0.0
F16_ABS_TABLE.flags.writeable = False


def cuda_block_threads() -> int:
    """Threads per block of the cooperative attention kernels (the ``cuda_threads`` knob;
    ``cuda_threads_sim`` under the simulator, where every thread is an OS thread)."""
    return int(_config.get("cuda_threads_sim" if _backend.simulator_enabled() else "cuda_threads"))


def check_cuda_head_dim(d: int) -> None:
    """``ValueError`` unless the CUDA kernels' shared-memory buffers hold head_dim ``d``."""
    if d > MAX_HEAD_DIM:
        raise ValueError(f"q: the CUDA decode attention kernels support head_dim <= {MAX_HEAD_DIM} "
                         f"(static shared memory), got {d}")


def use_warp_kernel(dev: str, d: int, has_bias: bool, has_qjl: bool) -> bool:
    """Whether a decode on ``dev`` runs a warp kernel (flat or paged) instead of a block kernel.

    Parameters
    ----------
    dev : {"cpu", "cuda"}
    d : int
        head_dim (the warp kernels take 32, 64 and 128).
    has_bias, has_qjl : bool
        A logit bias or the QJL correction (only the block kernels apply them).

    Returns
    -------
    bool
        CUDA, the ``cuda_warp_attention`` knob on, neither extra, a head_dim and a block size
        (whole warps) the warp kernels take."""
    return (dev == _backend.CUDA and not has_bias and not has_qjl and bool(_config.get("cuda_warp_attention"))
            and warp_ok(d, cuda_block_threads()))


def mma_layout_ok(layout: CodeLayout) -> bool:
    """Whether the tensor-core kernels read codes of ``layout``.

    Parameters
    ----------
    layout : CodeLayout
        ``bits`` int64 ``(head_dim / 32,)``, ``centroids`` float32 ``(head_dim / 32, 16)``.

    Returns
    -------
    bool
        Every block of one width in :data:`~numba_kv.ops.attention.mma.MMA_BITS` with one
        codebook (the kernels build their pair table from row 0 of the centroids).  Cached per
        layout object."""
    return _mma_layout_ok(layout)


@functools.lru_cache(maxsize=256)  # (layouts hash by identity and are immutable)
def _mma_layout_ok(layout: CodeLayout) -> bool:
    bits = layout.bits
    return (len(bits) > 0 and int(bits[0]) in MMA_BITS and bool(np.all(bits == bits[0]))
            and bool(np.all(layout.centroids == layout.centroids[0])))


def code_words(codes: Any) -> Any:
    """Packed codes as little-endian 32-bit words, without a copy.

    Parameters
    ----------
    codes : uint8 array, shape ``(..., width)``
        NumPy, CuPy or Numba device array whose last axis is contiguous.

    Returns
    -------
    uint32 array, shape ``(..., width / 4)``, or None
        A view on the same device; ``None`` where the array cannot be viewed so (``width``
        not a multiple of 4, or an array type that refuses the view)."""
    shape = tuple(int(x) for x in codes.shape)
    if shape[-1] % 4:
        return None
    try:
        w = codes.view(np.uint32)
    except (ValueError, TypeError, AttributeError, NotImplementedError):
        return None
    return w if tuple(w.shape) == (*shape[:-1], shape[-1] // 4) else None


def unit_axis(a: Any) -> Any:
    """A flat cache's array in the paged pools' ``[page, head, slot, ·]`` addressing, which the
    tensor-core tiles use for both.

    Parameters
    ----------
    a : array, shape ``(n, m, w)``
        Any dtype; NumPy, CuPy or Numba device array.

    Returns
    -------
    array, shape ``(n, 1, m, w)``, or None
        A view of ``a`` (``None`` where the array type cannot give one)."""
    try:
        return a[:, None]  # NumPy, CuPy: a view whatever the strides
    except (TypeError, IndexError, ValueError, NotImplementedError):
        pass
    try:  # Numba device arrays (contiguous ones)
        return a.reshape(int(a.shape[0]), 1, int(a.shape[1]), int(a.shape[2]))
    except (ValueError, TypeError, AttributeError, NotImplementedError):
        return None


def mma_operands(kc: Any, ks: Any, vc: Any, vs: Any, flat: bool) -> tuple | None:
    """The codes and scales as the tensor-core kernels read them.

    Parameters
    ----------
    kc, vc : uint8 array, shape ``(n_g, capacity, width)`` (flat) or ``(pages, num_kv_heads,
        page_size, width)`` (paged)
    ks, vs : uint16 array, the same leading shape, last axis the stored binary16 scales
    flat : bool
        Flat cache arrays (they get a unit head axis, :func:`unit_axis`).

    Returns
    -------
    tuple ``(kc32, ks, vc32, vs)`` of 4-D views, or None
        Codes as uint32 words (:func:`code_words`); ``None`` where one array cannot be viewed
        so (the caller then runs the warp kernel)."""
    kw, vw = code_words(kc), code_words(vc)
    out = (kw, ks, vw, vs)
    if flat and kw is not None and vw is not None:
        out = tuple(unit_axis(a) for a in out)
    return None if any(a is None for a in out) else out


def use_mma_kernel(dev: str, d: int, has_bias: bool, has_qjl: bool, klayout: CodeLayout,
                   vlayout: CodeLayout) -> bool:
    """Whether a flat decode on ``dev`` runs the tensor-core kernel (``decode_attention_mma``).

    Parameters
    ----------
    dev : {"cpu", "cuda"}
    d : int
        head_dim (the kernel takes :data:`~numba_kv.ops.attention.mma.MMA_HEAD_DIM`).
    has_bias, has_qjl : bool
        A logit bias or the QJL correction (only the block kernels apply them).
    klayout, vlayout : CodeLayout
        The code layouts of K and V (:func:`mma_layout_ok`).

    Returns
    -------
    bool
        The warp kernel would run (:func:`use_warp_kernel`), the ``cuda_mma_attention`` knob
        is on, ``d`` is 128 and both layouts are uniform with a pair table."""
    return (d == MMA_HEAD_DIM and bool(_config.get("cuda_mma_attention"))
            and use_warp_kernel(dev, d, has_bias, has_qjl) and mma_layout_ok(klayout) and mma_layout_ok(vlayout))


def launch_attention(dev: str, twin: Any, args: tuple, n_g: int, n_parts: int, rows: int, d: int,
                     work: int, warp: bool = False) -> None:
    """Run a partition kernel (flat or paged) on ``dev``: CPU ``work`` scalar operations, or
    the cooperative CUDA grid ``(n_g, n_parts, row chunks)`` (KV rows on x, which allows
    2**31 − 1 blocks; y and z allow 65535); ``warp``: the warp kernel's grid ``(n_g,
    ceil(n_parts / warps per block), ceil(rows / WARP_ROWS))``."""
    grid = None  # (the CPU twin needs no geometry: not computed per decode step)
    if dev == _backend.CUDA:
        check_cuda_head_dim(d)
        threads = cuda_block_threads()
        if warp:
            if twin.name.endswith("_mma"):
                # its launch bounds; in the simulator one warp per block (its simulated warp
                # primitives need every lane of a block together)
                threads = 32 if _backend.simulator_enabled() else MMA_THREADS
            grid = ((n_g, -(-n_parts // (threads // 32)), -(-rows // WARP_ROWS)), threads)
        else:
            grid = ((n_g, n_parts, -(-rows // rows_per_block(min(d, MAX_HEAD_DIM)))), threads)
    twin.launch(dev, n_g * n_parts, *args, work=work, grid=grid)


def launch_merge(dev: str, margs: tuple, n_g: int, rows: int, d: int, work: int) -> None:
    """Run the partition merge on ``dev``: grid ``(n_g, rows)`` on CUDA."""
    grid = ((n_g, rows), cuda_block_threads()) if dev == _backend.CUDA else None
    MERGE_PARTITIONS.launch(dev, n_g * rows, *margs, work=work, grid=grid)


def default_partition_size(n_tokens: int, n_rows_kv: int, device: str, warp: bool = False) -> int:
    """Tokens per partition: enough partitions to occupy the machine, at least one tile.

    ``warp``: for the warp kernels (one warp per partition), about ``n_rows_kv · n_tokens /
    16384`` tokens per warp (about 16K warps, some 120 queued per SM of an H100) in
    multiples of 32 between 64 and 1024: much longer partitions would leave SMs idle at
    small batch, shorter ones make the merge's partial sums a larger share of the bytes
    read."""
    if device == _backend.CPU:
        want = 4 * numba.get_num_threads()
        per = -(-n_tokens // max(1, -(-want // max(n_rows_kv, 1))))
        return int(max(4 * TILE, -(-per // TILE) * TILE))
    if _backend.simulator_enabled():
        return 64
    if warp:
        per = -(-max(n_rows_kv, 1) * n_tokens // 16384)
        return int(min(1024, max(64, -(-per // 32) * 32)))
    return 256


@dataclass(frozen=True, eq=False)
class CodeLayout:
    """Byte layout of one compressed vector, as the fused kernels read it.

    Block ``b`` (32 rotated coordinates) holds ``bits[b]``-bit indices at bytes
    ``offsets[b] .. offsets[b] + 4·bits[b]`` and decodes through ``centroids[b]``;
    ``scale_group`` consecutive blocks share one stored binary16 scale (1 for the
    32-block rotation, ``head_dim / 32`` for the whole-head rotation).

    Attributes
    ----------
    bits, offsets : int64 arrays, shape ``(head_dim / 32,)``
    centroids : float32 array, shape ``(head_dim / 32, 16)`` (row ``b`` padded with zeros)
    scale_group : int
    """

    bits: np.ndarray
    offsets: np.ndarray
    centroids: np.ndarray
    scale_group: int = 1

    @property
    def width(self) -> int:
        """Packed bytes per vector."""
        return int(4 * self.bits.sum())

    @property
    def scale_shift(self) -> int:
        """``log2(scale_group)`` (the kernels shift instead of dividing)."""
        return int(self.scale_group).bit_length() - 1

    @property
    def num_scales(self) -> int:
        """Stored scales per vector."""
        return len(self.bits) // self.scale_group

    @classmethod
    def from_blocks(cls, codebooks: Sequence[Any], scale_group: int = 1) -> CodeLayout:
        """Layout with one codebook per 32-block (``codebooks[b]``), blocks packed back to back."""
        nb = len(codebooks)
        bits = np.array([cb.bits for cb in codebooks], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(4 * bits)[:-1]]).astype(np.int64)
        cents = np.zeros((nb, 16), dtype=np.float32)
        for i, cb in enumerate(codebooks):
            cents[i, :cb.centroids.shape[0]] = cb.centroids
        for a in (bits, offsets, cents):
            a.flags.writeable = False
        if scale_group < 1 or scale_group & (scale_group - 1) or nb % scale_group:
            raise ValueError(f"scale_group: expected a power of two dividing the {nb} blocks, got {scale_group}")
        return cls(bits, offsets, cents, int(scale_group))

    @classmethod
    def uniform(cls, codebook: Any, head_dim: int, scale_group: int = 1) -> CodeLayout:
        """Every block with the same codebook (cached per codebook and geometry)."""
        return _uniform_layout(codebook, int(head_dim), int(scale_group))


@functools.cache
def _uniform_layout(codebook: Any, head_dim: int, scale_group: int) -> CodeLayout:
    return CodeLayout.from_blocks([codebook] * (head_dim // 32), scale_group)


# Placeholders for the kernel arguments of an absent QJL correction and logit bias (never
# read: the kernels test ``has_qjl``/``has_bias``), made once and reused per device through
# ``_backend.constant`` instead of allocated per decode step.  Left writable: the kernels
# are compiled for the writable array types of the real arguments.
_NO_QJL = (np.zeros((1, 1, 8), np.float32), np.zeros((1, 1, 1), np.uint8), np.zeros((1, 1), np.uint16))
_NO_BIAS = np.zeros((1, 1, 1), np.float32)
_NO_SCALES = np.zeros((1, 1, 1), np.uint16)


def _no_qjl(like: Any) -> tuple:
    return tuple(_backend.constant(like, a) for a in _NO_QJL) + (np.float32(0.0),)


def _exact_args(like: Any, ke: Any, ve: Any, exact_scales: tuple | None) -> tuple:
    """``(ke, ve, kes, ves, exact_kind)`` of the fused kernel for exact tokens stored as
    float32, binary16 (``float16`` or its ``uint16`` bit patterns) or int8 (with
    ``exact_scales`` = the per-token binary16 scales ``[n_g, >= n_exact, 1]`` uint16)."""
    dt = np.dtype(ke.dtype)
    if dt == np.int8:
        if exact_scales is None:
            raise ValueError("exact_scales: int8 exact tokens need their binary16 scales, got None")
        return ke, ve, exact_scales[0], exact_scales[1], EXACT_I8
    kes = ves = _backend.constant(like, _NO_SCALES)
    if dt == np.float32:
        return ke, ve, kes, ves, EXACT_F32
    if dt == np.float16:
        ke, ve = ke.view(np.uint16), ve.view(np.uint16)
        dt = np.dtype(np.uint16)
    if dt == np.uint16:
        return ke, ve, kes, ves, EXACT_F16
    raise TypeError(f"k_exact: expected float32, float16 (or its uint16 bits) or int8 tokens, got {dt}")


def fused_attention_rows(qr: Any, q: Any, kc: Any, ks: Any, vc: Any, vs: Any, n_comp: int, comp_pos0: int,
                         ke: Any, ve: Any, n_exact: int, exact_pos: Any, klayout: CodeLayout, vlayout: CodeLayout,
                         softmax_scale: float, bias: Any, q_pos0: int, q_len: int, causal: bool = True,
                         part_size: int | None = None, head_signs: Any = None, qjl: Any = None,
                         exact_rotated: bool = False, exact_scales: tuple | None = None) -> Any:
    """Fused decode attention over compressed + exact tokens, in the ``[g, rows, d]`` layout.

    No validation (callers validate): ``qr``/``q`` ``[n_g, rows, d]`` float32 (rotated and
    raw queries), codes/scales ``[n_g, capacity, ·]`` with ``n_comp`` live tokens laid out
    as ``klayout``/``vlayout``, exact ``ke``/``ve`` ``[n_g, >= n_exact, d]`` (first
    ``n_exact`` live; float32, binary16 as ``float16`` or ``uint16`` bits, or int8 with
    ``exact_scales`` = ``(k_scales, v_scales)``, uint16 binary16 ``[n_g, >= n_exact, 1]``,
    value ``int8 · scale``; read in that form by the kernel, no float32 copy) with int32
    positions ``exact_pos``, ``bias`` ``[n_g, rows,
    total_positions]`` or ``None``.  ``head_signs`` (float32 ``[d]``): the compressed
    tokens use the whole-head rotation with these signs (``None``: 32-block rotation).
    ``qjl`` = ``(sq, signs, norms, const)``: add the QJL correction ``const·‖r_t‖·⟨sq,
    σ_t⟩`` (``sq`` ``[n_g, rows, m]`` = ``S q``, ``signs`` uint8 ``[n_g, capacity, m/8]``,
    ``norms`` uint16 ``[n_g, capacity]``) to every compressed token's ``q·k``.
    ``exact_rotated``: ``ke``/``ve`` are in the compressed tokens' rotated domain (a rotated
    int8 window) and ``q`` is ``qr``; the merge then rotates every partition's sum back, the
    exact ones included.  Returns ``out`` ``[n_g, rows, d]`` float32 on the device of ``qr``.
    """
    n_g, rows, d = qr.shape
    dev = _backend.device_of("q", qr)
    n_exact = int(n_exact)
    # (the warp kernel stages each token's packed V bytes: at most VROW per token)
    warp = use_warp_kernel(dev, d, bias is not None, qjl is not None) and int(vc.shape[2]) <= VROW
    words = None  # codes and scales as the tensor-core kernel reads them, where it runs
    if warp and use_mma_kernel(dev, d, bias is not None, qjl is not None, klayout, vlayout):
        words = mma_operands(kc, ks, vc, vs, flat=True)
    if part_size is None:
        if words is not None and not _backend.simulator_enabled():
            part_size = mma_partition_size(max(n_comp, n_exact, 1), n_g)
        else:
            part_size = default_partition_size(max(n_comp, n_exact, 1), n_g, dev, warp)
    n_cp = -(-n_comp // part_size)
    n_ep = -(-n_exact // part_size)
    n_parts = max(n_cp + n_ep, 1)
    if n_cp + n_ep == 0:
        raise ValueError("k: expected at least one stored token to attend over, got none")
    part_m = _backend.empty(qr, (n_g, n_parts, rows), np.float32)
    part_l = _backend.empty(qr, (n_g, n_parts, rows), np.float32)
    part_acc = _backend.empty(qr, (n_g, n_parts, rows, d), np.float32)
    out = _backend.empty(qr, (n_g, rows, d), np.float32)
    has_bias = bias is not None
    if bias is None:
        bias = _backend.constant(qr, _NO_BIAS)
    has_qjl = qjl is not None
    sq, qsig, qnorm, qconst = qjl if has_qjl else _no_qjl(qr)
    c = functools.partial(_backend.constant, qr)
    ke, ve, kes, ves, exact_kind = _exact_args(qr, ke, ve, exact_scales)
    args = (qr, q, kc, ks, vc, vs, int(n_comp), int(comp_pos0), ke, ve, n_exact, exact_pos, kes, ves, exact_kind,
            c(klayout.centroids), c(vlayout.centroids), c(klayout.bits), c(klayout.offsets), c(vlayout.bits),
            c(vlayout.offsets), klayout.scale_shift, c(F16_ABS_TABLE), np.float32(softmax_scale), bias, has_bias,
            has_qjl, sq, qsig, qnorm, np.float32(qconst), int(q_pos0), int(q_len), bool(causal), int(part_size),
            int(n_cp), part_m, part_l, part_acc)
    kernel = DECODE_ATTENTION_WARP if warp else DECODE_ATTENTION
    if words is not None:
        kernel = DECODE_ATTENTION_MMA
        args = args[:2] + words + args[6:]
    head_rot = head_signs is not None
    # the merge rotates partitions [0, n_rot) back: the compressed ones, and the exact ones too
    # when they were attended in the rotated domain
    n_rot = n_parts if exact_rotated else n_cp
    margs = (part_m, part_l, part_acc, int(n_rot), c(SIGNS32), head_rot,
             head_signs if head_rot else c(SIGNS32))
    work = n_g * rows * d * (n_comp + n_exact)
    launch_attention(dev, kernel, args, n_g, n_parts, rows, d, work, warp)
    launch_merge(dev, margs + (out,), n_g, rows, d, work // max(n_comp + n_exact, 1) * n_parts)
    return out


def _codebook_for(name: str, bits: Any, norm_mode: str, codebook: Any, block: int = 32):
    if codebook is not None:
        if not isinstance(codebook, Codebook):
            raise TypeError(f"{name}_codebook: expected a Codebook, got {type(codebook).__name__}")
        return codebook
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or not 1 <= int(bits) <= 4:
        raise ValueError(f"{name}_bits: expected an int in 1..4, got {bits!r}")
    return get_codebook(int(bits), norm_mode, block=block)


def decode_attention(q: Any, k_codes: Any, k_scales: Any, v_codes: Any, v_scales: Any, *, bits: int = 3,
                     norm_mode: str = "maxnorm", k_bits: int | None = None, v_bits: int | None = None,
                     k_codebook: Any = None, v_codebook: Any = None, softmax_scale: float | None = None,
                     logit_bias: Any = None, causal: bool = True, k_exact: Any = None, v_exact: Any = None,
                     exact_positions: Any = None, partition_size: int | None = None,
                     rotation: str = "block", k_qjl: tuple | None = None, backend: str = "auto") -> Any:
    """Softmax attention computed directly from block-quantized K/V codes.

    Parameters
    ----------
    q : float array, shape ``(batch, num_heads, q_len, head_dim)``
        Queries; ``num_heads`` a multiple of ``num_kv_heads`` (contiguous GQA groups).
    k_codes, v_codes : uint8 array, shape ``(batch, num_kv_heads, T, head_dim·bits/8)``
    k_scales, v_scales : uint16 array, shape ``(batch, num_kv_heads, T, head_dim/32)``
        As returned by :func:`numba_kv.quantize_blocks` on ``[batch, num_kv_heads, T, d]``
        (with ``rotation="head"``: ``(…, T, 1)`` from :func:`numba_kv.quantize_head`).
        Compressed token ``t`` sits at position ``t`` (after any exact tokens, see below).
    bits, norm_mode, k_bits, v_bits, k_codebook, v_codebook
        Codebooks of K and V (``k_bits``/``v_bits`` default to ``bits``).
    softmax_scale : float, optional
        Defaults to ``1/sqrt(head_dim)``.
    logit_bias : float array, shape ``(batch, num_heads, q_len, total_tokens)``, optional
        Added to the scaled logits (units of ``softmax_scale·q·k``), indexed by position.
    causal : bool
        Query ``i`` sits at position ``total_tokens − q_len + i`` and sees positions ``<=``
        its own (speculative-decoding verification); ``False`` = every query sees all.
    k_exact, v_exact : float array, shape ``(batch, num_kv_heads, E, head_dim)``, optional
        Extra full-precision tokens (a recent window, sinks) joined in the same softmax.
    exact_positions : int array, shape ``(E,)``, optional
        Positions of the exact tokens; default ``T, T+1, …`` (a window after the codes).
    partition_size : int, optional
        Tokens per split-K partition (default: enough partitions for every thread).
    rotation : {"block", "head"}
        How the codes were made: :func:`numba_kv.quantize_blocks` (32-block rotation, one
        scale per block) or :func:`numba_kv.quantize_head` (whole-head rotation, one norm
        per vector, L2 codebooks for ``head_dim`` dimensions; ``norm_mode`` is ignored).
    k_qjl : tuple ``(signs, norms, sketch)``, optional
        TurboQuant's QJL correction of the keys, added to every compressed token's ``q·k``
        inside the kernel: ``signs`` uint8 ``(batch, num_kv_heads, T, m/8)`` and ``norms``
        uint16 ``(batch, num_kv_heads, T)`` from :func:`numba_kv.qjl_quantize` of the key
        residuals ``k − k̂``, and the ``sketch`` float32 ``(m, head_dim)`` they were made
        with (``None``: :func:`numba_kv.make_sketch`).

    Returns
    -------
    out : float32 array, shape ``(batch, num_heads, q_len, head_dim)``, on the device of
        ``q``.

    Raises
    ------
    ValueError, TypeError
        Mismatched shapes, group counts, dtypes or devices; the message names the argument.

    Examples
    --------
    >>> import numpy as np, numba_kv as nk
    >>> rng = np.random.default_rng(0)
    >>> k, v = rng.standard_normal((2, 1, 2, 100, 64)).astype(np.float32)
    >>> kc, ks = nk.quantize_blocks(k, 3); vc, vs = nk.quantize_blocks(v, 3)
    >>> q = rng.standard_normal((1, 4, 1, 64)).astype(np.float32)
    >>> decode_attention(q, kc, ks, vc, vs).shape
    (1, 4, 1, 64)
    """
    _backend.resolve_device(backend, q=q, k_codes=k_codes, k_scales=k_scales, v_codes=v_codes,
                            v_scales=v_scales, logit_bias=logit_bias, k_exact=k_exact, v_exact=v_exact,
                            exact_positions=exact_positions)
    check_float_array("q", q, 4)
    b, hq, ql, d = (int(s) for s in q.shape)
    if d % 32 or d == 0:
        raise ValueError(f"q: expected head_dim a positive multiple of 32, got shape {(b, hq, ql, d)}")
    if rotation not in ("block", "head"):
        raise ValueError(f"rotation: expected 'block' or 'head', got {rotation!r}")
    head = rotation == "head"
    if head and (d & (d - 1) or d > MAX_HEAD_DIM):
        raise ValueError(f"q: rotation='head' needs a power-of-two head_dim <= {MAX_HEAD_DIM}, got {d}")
    cb_mode, cb_block = ("l2", d) if head else (norm_mode, 32)
    kcb = _codebook_for("k", bits if k_bits is None else k_bits, cb_mode, k_codebook, cb_block)
    vcb = _codebook_for("v", bits if v_bits is None else v_bits, cb_mode, v_codebook, cb_block)
    n_scales = 1 if head else d // 32
    hkv, T = _check_codes((b, hq, ql, d), k_codes, k_scales, v_codes, v_scales, kcb.bits, vcb.bits, n_scales)
    n_exact = _check_exact(k_exact, v_exact, b, hkv, d)
    total = T + n_exact
    if total == 0:
        raise ValueError("k_codes: expected at least one token (T + E >= 1), got 0")
    if ql > total and causal:
        raise ValueError(f"q: expected q_len <= total tokens {total} with causal=True, got {ql}")
    epos = _exact_positions(exact_positions, q, T, n_exact)
    if softmax_scale is None:
        softmax_scale = d ** -0.5
    check_rotation_input("q", q, d if head else 32)  # finite, and its rotation fits float32
    g = b * hkv
    rows = (hq // hkv) * ql
    q3 = _backend.ascontiguous_f32("q", q).reshape(g, rows, d)
    bias3 = None
    if logit_bias is not None:
        check_float_array("logit_bias", logit_bias, 4)
        check_shape("logit_bias", logit_bias, (b, hq, ql, total), ("batch", "num_heads", "q_len", "total_tokens"))
        check_finite("logit_bias", logit_bias)
        bias3 = _backend.ascontiguous_f32("logit_bias", logit_bias).reshape(g, rows, total)
    if n_exact:
        ke = _flat(_backend.ascontiguous_f32("k_exact", k_exact), g, d)
        ve = _flat(_backend.ascontiguous_f32("v_exact", v_exact), g, d)
    else:
        ke = ve = _backend.empty(q3, (g, 0, d), np.float32)
    qjl = None if k_qjl is None else _qjl_args(k_qjl, q3, b, hkv, T, d)
    if head:
        qr = rotate_head(q3)  # the whole-head rotation of the queries, once per step
        hs = _backend.constant(q3, head_signs(d))
    else:
        qr = rotate32(q3)  # forward-rotate every 32-block of the queries, once per step
        hs = None
    sgroup = d // 32 if head else 1
    out = fused_attention_rows(qr, q3, _flat(k_codes, g, int(k_codes.shape[3])), _flat(k_scales, g, n_scales),
                               _flat(v_codes, g, int(v_codes.shape[3])), _flat(v_scales, g, n_scales), T, 0, ke, ve,
                               n_exact, epos, CodeLayout.uniform(kcb, d, sgroup), CodeLayout.uniform(vcb, d, sgroup),
                               softmax_scale, bias3, total - ql, ql, causal, partition_size, head_signs=hs, qjl=qjl)
    return out.reshape(b, hq, ql, d)


def _flat(a: Any, g: int, w: int) -> Any:
    """``[batch, heads, n, w]`` -> ``[batch·heads, n, w]`` (contiguous, on its device)."""
    xp = _backend.xp_of(a)
    a = xp.ascontiguousarray(a) if xp is not None else a
    return a.reshape(g, int(a.shape[2]), w)


def _check_codes(qshape: tuple, k_codes: Any, k_scales: Any, v_codes: Any, v_scales: Any, kbits: int, vbits: int,
                 n_scales: int) -> tuple[int, int]:
    """Validate the packed K/V of :func:`decode_attention`; returns ``(num_kv_heads, T)``."""
    b, hq, _, d = qshape
    if len(k_codes.shape) != 4:
        raise ValueError(f"k_codes: expected 4-D [batch, num_kv_heads, T, packed], got shape {tuple(k_codes.shape)}")
    hkv, T = int(k_codes.shape[1]), int(k_codes.shape[2])
    if hkv < 1 or hq % hkv:
        raise ValueError(f"q: expected num_heads to be a multiple of num_kv_heads={hkv}, got shape {qshape}")
    for name, a, width, dt in (("k_codes", k_codes, d * kbits // 8, np.uint8),
                               ("k_scales", k_scales, n_scales, np.uint16),
                               ("v_codes", v_codes, d * vbits // 8, np.uint8),
                               ("v_scales", v_scales, n_scales, np.uint16)):
        if np.dtype(a.dtype) != dt:
            raise TypeError(f"{name}: expected dtype {np.dtype(dt)}, got {a.dtype}")
        check_shape(name, a, (b, hkv, T, width), ("batch", "num_kv_heads", "T", "width"))
    return hkv, T


def _check_exact(k_exact: Any, v_exact: Any, b: int, hkv: int, d: int) -> int:
    """Validate the exact tokens of :func:`decode_attention`; returns their count ``E``."""
    if (k_exact is None) != (v_exact is None):
        raise ValueError("k_exact: k_exact and v_exact must be given together")
    if k_exact is None:
        return 0
    for name, a in (("k_exact", k_exact), ("v_exact", v_exact)):
        check_float_array(name, a, 4)
        check_shape(name, a, (b, hkv, None, d), ("batch", "num_kv_heads", "E", "head_dim"))
        check_finite(name, a)
    n_exact = int(k_exact.shape[2])
    if int(v_exact.shape[2]) != n_exact:
        raise ValueError(f"v_exact: expected E={n_exact} tokens like k_exact, got shape {tuple(v_exact.shape)}")
    return n_exact


def _exact_positions(exact_positions: Any, q: Any, T: int, n_exact: int) -> Any:
    """The exact tokens' positions as an int array on the device of ``q`` (default ``T, T+1, …``)."""
    if exact_positions is None:
        pos = np.arange(T, T + n_exact, dtype=np.int32)
        return to_like(q, pos if pos.size else np.zeros(1, np.int32))  # never read when E = 0
    if tuple(exact_positions.shape) != (n_exact,) or np.dtype(exact_positions.dtype).kind not in "iu":
        raise ValueError(f"exact_positions: expected an int array of shape ({n_exact},), got "
                         f"{exact_positions.dtype} {tuple(exact_positions.shape)}")
    xp = _backend.xp_of(exact_positions)
    return exact_positions.astype(np.int32) if xp is not None else exact_positions


def _qjl_args(k_qjl: Any, q3: Any, b: int, hkv: int, T: int, d: int) -> tuple:
    """Validate ``k_qjl = (signs, norms, sketch)`` and project the queries: the ``qjl``
    argument of :func:`fused_attention_rows`."""
    if not isinstance(k_qjl, tuple) or len(k_qjl) != 3:
        raise TypeError("k_qjl: expected a tuple (signs, norms, sketch), got "
                        f"{type(k_qjl).__name__}")
    signs, norms, sketch = k_qjl
    _backend.resolve_device("auto", q=q3, k_qjl_signs=signs, k_qjl_norms=norms, k_qjl_sketch=sketch)
    if np.dtype(signs.dtype) != np.uint8:
        raise TypeError(f"k_qjl: expected signs of dtype uint8, got {signs.dtype}")
    if np.dtype(norms.dtype) != np.uint16:
        raise TypeError(f"k_qjl: expected norms of dtype uint16 (binary16 bits), got {norms.dtype}")
    if len(signs.shape) != 4 or int(signs.shape[3]) < 1:
        raise ValueError(f"k_qjl: expected signs of shape (batch, num_kv_heads, T, m/8), got {tuple(signs.shape)}")
    mb = int(signs.shape[3])
    check_shape("k_qjl signs", signs, (b, hkv, T, mb), ("batch", "num_kv_heads", "T", "m/8"))
    check_shape("k_qjl norms", norms, (b, hkv, T), ("batch", "num_kv_heads", "T"))
    m = 8 * mb
    sk = sketch_arg(sketch, d, m, q3)
    g, rows, _ = q3.shape
    xp = _backend.xp_of(q3)
    contig = (lambda a: xp.ascontiguousarray(a)) if xp is not None else (lambda a: a)
    sq = _backend.empty(q3, (g, rows, m), np.float32)
    project_into(q3, _backend.zeros(q3, (1, d), np.float32), sk.reshape(1, m, d), sq)
    return sq, contig(signs).reshape(g, T, mb), contig(norms).reshape(g, T), np.float32(qjl_constant(m))

