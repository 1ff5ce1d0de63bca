"""Bit packing of small unsigned indices (1–8 bits), LSB first.

Layout (the one turboquant-rs uses): indices are packed in groups of 8; a group of 8
``b``-bit values forms the ``8·b``-bit little-endian integer ``w = Σ v_k << (b·k)``,
emitted as ``b`` bytes, least significant byte first.  This single rule gives

* 2-bit: 4 values per byte, element ``4i+k`` in bits ``[2k, 2k+1]``;
* 3-bit: byte-identical to llama.cpp ``tq3_0`` (``[0..7] -> 88 c6 fa``);
* 4-bit: element ``2i`` in the low nibble, ``2i+1`` in the high nibble;
* 1-bit: QJL sign bits, dimension ``j`` in byte ``j // 8``, bit ``j % 8``.

Rows must hold a multiple of 8 indices (head_dim is a multiple of 32 everywhere).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import cuda, int64, prange, uint8

from .. import _backend
from .._jit import cpu_kernel, cuda_kernel, twin
from . import finite as _finite  # noqa: F401 - registers the "range_stats" twin that _check_indices runs
from ._registry import TWINS, register

SUPPORTED_BITS = (1, 2, 3, 4, 5, 6, 7, 8)


# --- single-source cores: the group-of-8 layout, used by every packer of the package -----
def group8_word(idx, i0, stride, bits):
    """The ``8·bits``-bit word ``Σ_k idx[i0 + k·stride] << (bits·k)`` of one group of 8
    indices (``stride`` > 1: indices of interleaved lanes)."""
    w = int64(0)
    for k in range(8):
        w |= int64(idx[i0 + k * stride]) << (bits * k)
    return w


def store_word(w, bits, out, o0):
    """Emit word ``w`` as the ``bits`` bytes ``out[o0:o0+bits]``, least significant first."""
    for j in range(bits):
        out[o0 + j] = uint8((w >> (8 * j)) & 0xFF)


def load_word(packed, p0, bits):
    """The word stored in the ``bits`` bytes ``packed[p0:p0+bits]`` (inverse of :func:`store_word`)."""
    w = int64(0)
    for j in range(bits):
        w |= int64(packed[p0 + j]) << (8 * j)
    return w


def word_index(w, bits, k):
    """Index ``k`` (0..7) of group word ``w``."""
    return (w >> (bits * k)) & ((int64(1) << bits) - 1)


def _pack_group8(idx, i0, bits, out, o0):
    """Pack ``idx[i0:i0+8]`` (``bits`` wide) into ``out[o0:o0+bits]``."""
    store_word(group8_word(idx, i0, 1, bits), bits, out, o0)


def _unpack_group8(packed, p0, bits, out, i0):
    """Unpack ``bits`` bytes at ``packed[p0:]`` into 8 indices ``out[i0:i0+8]``."""
    w = load_word(packed, p0, bits)
    for k in range(8):
        out[i0 + k] = uint8(word_index(w, bits, k))


# inlined on the CPU: per-group calls would cost more than the packing (about 5x here)
for _core in (group8_word, store_word, load_word, word_index):
    twin(_core, inline=True)
pack_group8_cpu, pack_group8_dev = twin(_pack_group8, inline=True)
unpack_group8_cpu, unpack_group8_dev = twin(_unpack_group8, inline=True)


# --- CPU twins -------------------------------------------------------------------------
@cpu_kernel
def _pack_bits_cpu(idx, bits, out):
    """CPU twin of :func:`_pack_bits_cuda`: ``prange`` over the rows, groups in order."""
    n, length = idx.shape
    groups = length // 8
    for r in prange(n):
        for g in range(groups):
            pack_group8_cpu(idx[r], g * 8, bits, out[r], g * bits)


@cpu_kernel
def _unpack_bits_cpu(packed, bits, out):
    """CPU twin of :func:`_unpack_bits_cuda`: ``prange`` over the rows, groups in order."""
    n, length = out.shape
    groups = length // 8
    for r in prange(n):
        for g in range(groups):
            unpack_group8_cpu(packed[r], g * bits, bits, out[r], g * 8)


# --- CUDA kernels (one thread per group of 8 indices, grid-stride) ---------------------
@cuda_kernel
def _pack_bits_cuda(idx, bits, out):
    """1-D grid over the ``rows·length/8`` groups; one thread packs 8 indices into ``bits`` bytes."""
    n, length = idx.shape
    groups = length // 8
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    for t in range(start, n * groups, stride):
        r = t // groups
        g = t - r * groups
        pack_group8_dev(idx[r], g * 8, bits, out[r], g * bits)


@cuda_kernel
def _unpack_bits_cuda(packed, bits, out):
    """1-D grid over the ``rows·length/8`` groups; one thread unpacks ``bits`` bytes into 8 indices."""
    n, length = out.shape
    groups = length // 8
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    for t in range(start, n * groups, stride):
        r = t // groups
        g = t - r * groups
        unpack_group8_dev(packed[r], g * bits, bits, out[r], g * 8)


_PACK_BITS = register("pack_bits", _pack_bits_cpu, _pack_bits_cuda,
         ["void(uint8[:, ::1], int64, uint8[:, ::1])"], float32_only=True)
_UNPACK_BITS = register("unpack_bits", _unpack_bits_cpu, _unpack_bits_cuda,
         ["void(uint8[:, ::1], int64, uint8[:, ::1])"], float32_only=True)


# --- public API ------------------------------------------------------------------------
def _check_bits(bits: Any) -> int:
    if isinstance(bits, (bool, np.bool_)) or not isinstance(bits, (int, np.integer)):
        raise TypeError(f"bits: expected an int in 1..8, got {type(bits).__name__} {bits!r}")
    if int(bits) not in SUPPORTED_BITS:
        raise ValueError(f"bits: expected an int in 1..8, got {bits!r}")
    return int(bits)


def _rows(a: Any):
    shape = tuple(a.shape)
    n = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    return a.reshape(n, shape[-1]), shape[:-1]


def _device_has_wide_index(idx: Any, bits: int) -> bool | None:
    """Whether C-contiguous Numba device array ``idx`` (uint8, size a multiple of 8) holds an
    index ``>= 2**bits``, checked on the device: the ``range_stats`` twin's integer max of
    ``word & mask`` over ``idx`` read as the widest unsigned words its address alignment
    allows, ``mask`` holding the bits ``>= bits`` of every byte (nonzero result: some index
    has one set).  One launch and an 8-byte read back.  ``None`` when the data is not even
    2-byte aligned (the caller then reads it on the host)."""
    cai = getattr(idx, "__cuda_array_interface__", None)  # the simulator's arrays (host memory) have none
    ptr = int(cai["data"][0]) if cai is not None else 0
    high = 0xFF ^ ((1 << bits) - 1)  # the bits of a byte that an index < 2**bits leaves clear
    for udt in (np.uint64, np.uint32, np.uint16):
        width = np.dtype(udt).itemsize
        if ptr % width == 0:
            words = idx.reshape(idx.size).view(udt)
            out = _backend.zeros(idx, (1,), np.uint64)
            mask = udt(int.from_bytes(bytes([high]) * width, "little"))
            TWINS["range_stats"].launch(_backend.CUDA, (words.size + 255) // 256, words, mask, out)
            return int(_backend.to_host(out)[0]) != 0
    return None


def _check_indices(idx: Any, bits: int, xp: Any) -> None:
    """``ValueError`` if an index of ``idx`` is ``>= 2**bits``, for every array kind: NumPy and
    CuPy arrays by their ``max()``, Numba device arrays on the device
    (:func:`_device_has_wide_index`; strided or odd-address views: a host copy).  Nothing to
    check at ``bits = 8``."""
    if bits == 8 or idx.size == 0:
        return
    limit = 1 << bits
    if xp is None:
        wide = None
        if getattr(idx, "is_c_contiguous", lambda: False)():
            wide = _device_has_wide_index(idx, bits)
        if wide is False:
            return
        top = int(_backend.to_host(idx).max())  # strided or odd-address views, and the error message
    else:
        top = int(idx.max())
    if top >= limit:
        raise ValueError(f"idx: expected values < 2**bits = {limit}, got max {top}")


def pack_bits(idx: Any, bits: int, *, backend: str = "auto") -> Any:
    """Pack ``bits``-wide indices, 8 per ``bits`` bytes, LSB first.

    Parameters
    ----------
    idx : uint8 array, shape ``(..., length)``
        Indices ``< 2**bits``; ``length`` a multiple of 8.  NumPy → CPU twin, CUDA
        array → CUDA kernel.
    bits : int
        Index width, 1..8.
    backend : {"auto", "cpu", "cuda"}
        Check that the data lives where expected (never moves it).

    Returns
    -------
    packed : uint8 array, shape ``(..., length * bits // 8)``, on the device of ``idx``.

    Raises
    ------
    ValueError
        ``bits`` outside 1..8, ``length`` not a multiple of 8, or an index ``>= 2**bits``
        (checked for every array kind before anything is packed, except at ``bits = 8``
        where every uint8 fits: NumPy and CuPy arrays by their ``max()``, C-contiguous Numba
        device arrays by one reduction launch on the device, each reading one number back to
        the host; a Numba device view at an odd address is copied to the host for it).
    TypeError
        ``idx`` not uint8 or not an array.

    Examples
    --------
    >>> import numpy as np
    >>> pack_bits(np.arange(8, dtype=np.uint8), 3).tobytes().hex()
    '88c6fa'
    """
    bits = _check_bits(bits)
    dev = _backend.resolve_device(backend, idx=idx)
    if np.dtype(idx.dtype) != np.uint8:
        raise TypeError(f"idx: expected dtype uint8, got {idx.dtype}")
    if len(idx.shape) < 1 or tuple(idx.shape)[-1] % 8:
        raise ValueError(f"idx: expected a last axis that is a multiple of 8, got shape {tuple(idx.shape)}")
    xp = _backend.xp_of(idx)
    _check_indices(idx, bits, xp)
    if xp is not None:
        idx = xp.ascontiguousarray(idx)
    rows, lead = _rows(idx)
    out = _backend.empty(idx, (rows.shape[0], rows.shape[1] * bits // 8), np.uint8)
    if rows.shape[0] and rows.shape[1]:
        _PACK_BITS.launch(dev, rows.shape[0] * rows.shape[1] // 8, rows, bits, out, work=rows.size)
    return out.reshape(tuple(lead) + (out.shape[1],))


def unpack_bits(packed: Any, bits: int, *, backend: str = "auto") -> Any:
    """Inverse of :func:`pack_bits`.

    Parameters
    ----------
    packed : uint8 array, shape ``(..., nbytes)``
        ``nbytes`` a multiple of ``bits``.
    bits : int
        Index width, 1..8.
    backend : {"auto", "cpu", "cuda"}
        Check that the data lives where expected (never moves it).

    Returns
    -------
    idx : uint8 array, shape ``(..., nbytes * 8 // bits)``, on the device of ``packed``.

    Raises
    ------
    ValueError
        ``bits`` outside 1..8, ``nbytes`` not a multiple of ``bits``.
    TypeError
        ``packed`` not uint8 or not an array.
    """
    bits = _check_bits(bits)
    dev = _backend.resolve_device(backend, packed=packed)
    if np.dtype(packed.dtype) != np.uint8:
        raise TypeError(f"packed: expected dtype uint8, got {packed.dtype}")
    if len(packed.shape) < 1 or tuple(packed.shape)[-1] % bits:
        raise ValueError(f"packed: expected a last axis that is a multiple of bits={bits}, "
                         f"got shape {tuple(packed.shape)}")
    xp = _backend.xp_of(packed)
    if xp is not None:
        packed = xp.ascontiguousarray(packed)
    rows, lead = _rows(packed)
    length = rows.shape[1] * 8 // bits
    out = _backend.empty(packed, (rows.shape[0], length), np.uint8)
    if rows.shape[0] and length:
        _UNPACK_BITS.launch(dev, rows.shape[0] * length // 8, rows, bits, out, work=out.size)
    return out.reshape(tuple(lead) + (length,))

