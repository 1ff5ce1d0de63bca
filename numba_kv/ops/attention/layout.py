"""What the kernels read: the byte layout of a compressed vector and the views of it.

:class:`CodeLayout` (bits, byte offsets and codebook of every 32-block, the scale group) is
made once per cache (or per ``decode_attention`` codebook pair) and is immutable; the
helpers here say whether the tensor-core kernels can read a layout and give the packed
codes as the 32-bit words and 4-D ``[page, head, slot, ·]`` views those kernels take.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..._validate import is_c_contiguous
from ..headvq import GROUP_SIZE, headvq_centroids
from .cores import NORM8_SLOT0
from .mma import MMA_BITS

__all__ = ["CodeLayout", "F16_ABS_TABLE", "NORM8_SLOT0", "code_words", "mma_layout_ok", "mma_operands", "unit_axis"]

#: |binary16| -> float32 for every bit pattern (exact; 256 KiB, stays in L2): scale decoding
F16_ABS_TABLE = np.abs(np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32))
F16_ABS_TABLE[~np.isfinite(F16_ABS_TABLE)] = 0.0
F16_ABS_TABLE.flags.writeable = False


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
    centroids : float32 array, shape ``(head_dim / 32, max(16, 2**max(bits)))`` (row ``b``
        padded with zeros: 16 columns up to 4 bits, 32 with a 5-bit block), or for a head VQ
        layout (:meth:`head_vq`) ``(head_dim / 32, 256·group)``: every row the flattened
        ``[256, group]`` codebook
    scale_group : int
    group : int
        Coordinates per code byte: 1 for scalar codes (``bits``-wide indices), 2 or 4 for the
        head VQ code (:mod:`numba_kv.ops.headvq`: byte ``i`` of a block is the index of its
        coordinates ``group·i .. group·i + group − 1``, decoded as ``centroids[b, group·byte + j]``).
        The kernels tell the two apart by the table's width (more than 32 columns: VQ).
    """

    bits: np.ndarray
    offsets: np.ndarray
    centroids: np.ndarray
    scale_group: int = 1
    group: int = 1

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
        cents = np.zeros((nb, max(16, 1 << int(bits.max()))), dtype=np.float32)
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


    @classmethod
    def head_vq(cls, bits: int, head_dim: int) -> CodeLayout:
        """The head VQ code's layout (:func:`~numba_kv.ops.headvq.quantize_headvq`): every block
        ``bits`` (4 or 2) bytes per 8 values, the codebook :func:`~numba_kv.ops.headvq.headvq_centroids`
        flattened in every row, one norm per vector (cached per geometry)."""
        return _head_vq_layout(int(bits), int(head_dim))


@functools.cache
def _head_vq_layout(bits: int, head_dim: int) -> CodeLayout:
    nb = head_dim // 32
    cents = np.ascontiguousarray(np.broadcast_to(headvq_centroids(bits, head_dim).reshape(1, -1),
                                                 (nb, 256 * GROUP_SIZE[bits])), dtype=np.float32)
    bits_b = np.full(nb, bits, dtype=np.int64)
    offsets = (4 * bits * np.arange(nb)).astype(np.int64)
    for a in (bits_b, offsets, cents):
        a.flags.writeable = False
    return CodeLayout(bits_b, offsets, cents, nb, GROUP_SIZE[bits])


@functools.cache
def _uniform_layout(codebook: Any, head_dim: int, scale_group: int) -> CodeLayout:
    return CodeLayout.from_blocks([codebook] * (head_dim // 32), scale_group)


def mma_layout_ok(layout: CodeLayout) -> bool:
    """Whether the tensor-core kernels read codes of ``layout``.

    Parameters
    ----------
    layout : CodeLayout
        ``bits`` int64 ``(head_dim / 32,)``, ``centroids`` float32 ``(head_dim / 32, 16 or 32)``.

    Returns
    -------
    bool
        Every block of one width in :data:`~numba_kv.ops.attention.mma.MMA_BITS` with one
        codebook (the kernels build their table from row 0 of the centroids): a scalar one, or
        the head VQ code's pairs (4 bits) or quads (2 bits) with every ``|centroid| <= 1``
        (their tables have no scaling factor; ``decode_attention_mma_vq`` reads them, flat
        caches only).  Cached per layout object."""
    return _mma_layout_ok(layout)


@functools.lru_cache(maxsize=256)  # (layouts hash by identity and are immutable)
def _mma_layout_ok(layout: CodeLayout) -> bool:
    bits = layout.bits
    if len(bits) == 0 or int(bits[0]) not in MMA_BITS or not bool(np.all(bits == bits[0])):
        return False
    # (a VQ table holds its centroids unscaled: pairs at 4 bits, quads at 2)
    vq_ok = layout.group == 1 or (layout.group == 8 // int(bits[0]) and float(np.abs(layout.centroids).max()) <= 1.0)
    return vq_ok and bool(np.all(layout.centroids == layout.centroids[0]))


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


def mma_operands(kc: Any, ks: Any, vc: Any, vs: Any, flat: bool, norm8: bool = False) -> tuple | None:
    """The codes and scales as the tensor-core kernels read them.

    Parameters
    ----------
    kc, vc : uint8 array, shape ``(n_g, capacity, width)`` (flat) or ``(pages, num_kv_heads,
        page_size, width)`` (paged)
    ks, vs : uint16 array, the same leading shape, last axis the stored binary16 scales (or,
        with ``norm8``, both uint8: 8-bit norm codes)
    flat : bool
        Flat cache arrays (they get a unit head axis, :func:`unit_axis`).
    norm8 : bool
        Accept uint8 scale planes (``decode_attention_mma_vq`` reads them).

    Returns
    -------
    tuple ``(kc32, ks, vc32, vs)`` of 4-D views, or None
        Codes as uint32 words (:func:`code_words`); ``None`` where one array cannot be viewed
        so, a view is not C-contiguous, or its addresses do not fit the kernels' 32-bit
        factors (the caller then runs the warp kernel)."""
    dt = np.dtype(ks.dtype)
    if dt != np.dtype(vs.dtype) or not (dt == np.uint16 or (norm8 and dt == np.uint8)):
        return None  # 8-bit norms (norm_bits=8): only the VQ build reads them
    kw, vw = code_words(kc), code_words(vc)
    out = (kw, ks, vw, vs)
    if flat and kw is not None and vw is not None:
        out = tuple(unit_axis(a) for a in out)
    # the kernels address them from their shapes (mma._row): C-contiguous views only
    if any(a is None or not is_c_contiguous(a) for a in out):
        return None
    return out if all(_fits_32bit_rows(a) for a in out) else None


def _fits_32bit_rows(a: Any) -> bool:
    """Whether the tensor-core kernels' byte addresses of ``a`` (4-D, C-contiguous) fit their
    32-bit factors (``mma._row``): ``pages × heads`` and a page's (a flat KV row's) bytes below
    ``2**32``."""
    p, h, n, w = (int(x) for x in a.shape)
    return p * h < 2 ** 32 and n * w * np.dtype(a.dtype).itemsize < 2 ** 32
