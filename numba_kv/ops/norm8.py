"""8-bit log-domain vector norms (``norm_bits=8``) of the whole-head-rotation caches, as twins.

A vector norm ``n`` (the binary16 norm the head quantizers produce) is stored as one byte on
a grid of 1/16 octave with a per-layer base ``b = base16 / 16`` (``base16`` an integer):

* ``k = 0``: a zero norm;
* ``k in 1 … 255``: ``n̂ = 2**(b + k/16)``, with ``k = round(16·log2 n − base16)``
  clamped to ``[1, 255]``.

In range the relative error is at most half a step, ``|n̂/n − 1| <= 2**(1/32) − 1``
(2.19 %), against the binary16 norm; the caches reject norms above the grid's top before
storing (:func:`norm8_top`), so the clamp at 255 only catches a window token whose stored
copy rounds past the top by its own rounding.  Measured (benchmarks/results/
kv3-2026-11-27-round4.md, section 3) the 1/16-octave grid costs nothing measurable in
attention quality and saves one byte per vector (0.125 bit/value at ``head_dim = 64``).

Encoding reads a table of ``round(16·log2 h)`` over every finite binary16 magnitude
:data:`LOG16` (exact: ``16·log2`` of a binary16 number is never a half-integer, so no
rounding tie exists, and float64 resolves every case), so the CPU and CUDA twins give the
same bytes without a ``log2`` call whose last bit could differ between the two.

Decoding goes through a float32 table: the 256 entries of :func:`norm8_decode_table`, which
the fused attention kernels read at :data:`~numba_kv.ops.attention.layout.NORM8_SLOT0` of a
layer's scale table (:func:`norm8_scale_table`: ``F16_ABS_TABLE`` followed by the 256
entries; the kernels add that offset for a uint8 scale plane, see
:mod:`numba_kv.ops.attention.cores`).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from numba import cuda, int64, prange, uint8

from .. import _backend
from .._jit import cpu_kernel, cuda_kernel, twin
from .._validate import check_span
from ._registry import register
from .attention.layout import F16_ABS_TABLE, NORM8_SLOT0

__all__ = ["LOG16", "NORM8_SLOT0", "NORM8_STEPS", "STORE_NORM8", "norm8_base16", "norm8_codes", "norm8_decode_table",
           "norm8_scale_rows_into", "norm8_scale_table", "norm8_store_into", "norm8_top"]

#: grid steps per octave
NORM8_STEPS = 16
#: codes above the base: 1 … 255 (0 is a zero norm)
_TOP = 255
#: ``base16`` of a first store: its median norm sits 128 steps (8 octaves) above the base …
_MEDIAN_STEP = 128
#: … unless its largest norm would then sit less than 64 steps (4 octaves) below the top
_HEADROOM = 64


def _log16_table() -> np.ndarray:
    """``round(16·log2 h)`` for every binary16 magnitude pattern ``h`` (int16; 0 for ``h = 0``
    and for inf/NaN patterns, which the encoder never reads: the caches store finite norms)."""
    h = np.arange(1 << 15, dtype=np.uint16)
    val = h.view(np.float16).astype(np.float64)
    out = np.zeros(1 << 15, dtype=np.int16)
    ok = (val > 0) & np.isfinite(val)
    out[ok] = np.round(NORM8_STEPS * np.log2(val[ok])).astype(np.int16)
    return out


#: ``round(16·log2 h)`` per binary16 magnitude (int16 ``[32768]``, read-only)
LOG16 = _log16_table()
LOG16.flags.writeable = False


def norm8_codes(h: Any, base16: int) -> np.ndarray:
    """Unclamped grid codes of binary16 norms (what the range check compares with 255).

    Parameters
    ----------
    h : uint16 array, any shape
        Binary16 bit patterns of the norms (the sign bit is ignored).
    base16 : int
        The grid's base in 1/16 octaves.

    Returns
    -------
    int64 array, the shape of ``h``
        ``round(16·log2 n) − base16``; ``-2**31`` for zero norms.
    """
    h = np.asarray(h, dtype=np.uint16) & 0x7FFF
    k = LOG16[h].astype(np.int64) - int(base16)
    return np.where(h == 0, np.int64(-2 ** 31), k)


def norm8_top(base16: int) -> float:
    """The largest norm the grid of ``base16`` stores (code 255), as float64."""
    return float(2.0 ** ((int(base16) + _TOP) / NORM8_STEPS))


def norm8_base16(h: Any) -> int:
    """``base16`` (int) of a layer's first store from its binary16 norms ``h`` (uint16 bit
    patterns, any shape).

    The median of the nonzero norms sits 8 octaves above the base (the grid spans 8 octaves
    each side of it), unless the largest norm would then be less than 4 octaves below the
    top: the grid then moves up so it is exactly 4 octaves below (measured, a KV head's norms
    span at most 4.7 octaves over 1,024 tokens and later tokens exceed the prompt's largest
    by at most 0.55 octave; the top's headroom matters more than the bottom, where a norm
    256× below the median is clamped up with an absolute error that small).  All-zero
    norms give base16 = 0.
    """
    h = np.asarray(h, dtype=np.uint16).ravel() & 0x7FFF
    h = h[h != 0]
    if not h.size:
        return 0
    med = int(np.round(NORM8_STEPS * np.log2(np.median(h.view(np.float16).astype(np.float64)))))
    return max(med - _MEDIAN_STEP, int(LOG16[h].max()) + _HEADROOM - _TOP)


@functools.lru_cache(maxsize=64)
def norm8_decode_table(base16: int) -> np.ndarray:
    """``table[k] = 2**((base16 + k)/16)`` for ``k = 1 … 255``, ``table[0] = 0`` (float32
    ``[256]``, read-only, one object per ``base16``)."""
    k = np.arange(_TOP + 1, dtype=np.float64)
    table = np.exp2((int(base16) + k) / NORM8_STEPS).astype(np.float32)
    table[0] = 0.0
    table.flags.writeable = False
    return table


@functools.lru_cache(maxsize=64)
def norm8_scale_table(base16: int) -> np.ndarray:
    """The fused attention kernels' scale table of a norm8 layer: ``F16_ABS_TABLE`` (the
    binary16 window scales and values still read through it) followed by
    :func:`norm8_decode_table` at :data:`NORM8_SLOT0` (float32 ``[65792]``, read-only)."""
    table = np.concatenate([F16_ABS_TABLE, norm8_decode_table(base16)])
    table.flags.writeable = False
    return table


# --- cores --------------------------------------------------------------------------------
def _norm8_code(h16, log16, base16):
    """The grid code of binary16 norm bits ``h16`` (int64): 0 for a zero norm, else the grid
    code clamped to 1 … 255."""
    h = h16 & 0x7FFF
    k = int64(0)
    if h != 0:
        # below the grid (256× or more under the first store's median, or 2**12 under its largest
        # norm): clamped up to code 1, an absolute error that small next to the layer's norms;
        # above it: clamped to 255, which only a window token's re-rounded copy can reach (the
        # caches reject larger norms before storing)
        k = min(max(int64(log16[h]) - base16, int64(1)), int64(255))
    return k


norm8_code_cpu, norm8_code_dev = twin(_norm8_code, inline=True)


def _store_vector(src_codes, src_norms, log16, base16, s0, t0, codes, norms8, r, s):
    """Vector ``(r, s0 + s)`` of the scratch planes into token ``t0 + s``: its code bytes
    copied, its binary16 norm encoded (:func:`_norm8_code`)."""
    w = src_codes.shape[2]
    for j in range(w):
        codes[r, t0 + s, j] = src_codes[r, s0 + s, j]
    norms8[r, t0 + s, 0] = uint8(_norm8_code(int64(src_norms[r, s0 + s, 0]), log16, base16))


def _scale_vector(norms8, table8, t0, out, r, s):
    """``out[r, s, :] *= table8[norms8[r, t0 + s, 0]]`` (float32)."""
    a = table8[int64(norms8[r, t0 + s, 0])]
    for j in range(out.shape[2]):
        out[r, s, j] = out[r, s, j] * a


store_vector_cpu, store_vector_dev = twin(_store_vector)
scale_vector_cpu, scale_vector_dev = twin(_scale_vector)


@cpu_kernel
def _norm8_store_cpu(src_codes, src_norms, log16, base16, s0, n, t0, codes, norms8):
    """CPU twin: one ``prange`` iteration stores one (row, token) vector."""
    rows = src_codes.shape[0]
    for i in prange(rows * n):
        r = i // n
        store_vector_cpu(src_codes, src_norms, log16, base16, s0, t0, codes, norms8, r, i - r * n)


@cpu_kernel
def _norm8_scale_rows_cpu(norms8, table8, t0, out):
    """CPU twin: one ``prange`` iteration scales one (row, token) vector."""
    rows, n = out.shape[0], out.shape[1]
    for i in prange(rows * n):
        r = i // n
        scale_vector_cpu(norms8, table8, t0, out, r, i - r * n)


@cuda_kernel
def _norm8_store_cuda(src_codes, src_norms, log16, base16, s0, n, t0, codes, norms8):
    """Launch contract: 1-D grid, any size; thread ``i`` (grid-stride) stores vector
    ``(i // n, s0 + i % n)`` of the scratch planes ``[rows, ·, ·]`` (``n`` tokens a row)."""
    rows = src_codes.shape[0]
    for i in range(cuda.grid(1), rows * n, cuda.gridsize(1)):
        r = i // n
        store_vector_dev(src_codes, src_norms, log16, base16, s0, t0, codes, norms8, r, i - r * n)


@cuda_kernel
def _norm8_scale_rows_cuda(norms8, table8, t0, out):
    """Launch contract: 1-D grid, any size; thread ``i`` (grid-stride) scales vector
    ``(i // n, i % n)`` of ``out`` ``[rows, n, d]``."""
    rows, n = out.shape[0], out.shape[1]
    for i in range(cuda.grid(1), rows * n, cuda.gridsize(1)):
        r = i // n
        scale_vector_dev(norms8, table8, t0, out, r, i - r * n)


_STORE = register("norm8_store", _norm8_store_cpu, _norm8_store_cuda,
                  ["void(uint8[:, :, ::1], uint16[:, :, ::1], int16[::1], int64, int64, int64, int64, "
                   "uint8[:, :, ::1], uint8[:, :, ::1])"])
#: the registered store (its ``.cpu.serial`` runs inside other serial CPU cores)
STORE_NORM8 = _STORE
_SCALE = register("norm8_scale_rows", _norm8_scale_rows_cpu, _norm8_scale_rows_cuda,
                  ["void(uint8[:, :, ::1], float32[::1], int64, float32[:, :, ::1])"])


def norm8_store_into(src_codes: Any, src_norms: Any, base16: int, t0: int, codes: Any, norms8: Any,
                     s0: int = 0, n: int | None = None) -> None:
    """Store scratch-quantized vectors with 8-bit norms (no validation).

    Parameters
    ----------
    src_codes : uint8 array, shape ``(rows, m, width)``, C-contiguous
        Packed codes of ``m`` vectors per row; tokens ``s0 : s0 + n`` are copied to
        ``codes[:, t0 : t0 + n]``.
    src_norms : uint16 array, shape ``(rows, m, 1)``, C-contiguous
        Their binary16 norms, encoded into ``norms8[:, t0 : t0 + n]`` (see the module).
    base16 : int
        The layer's grid base in 1/16 octaves.
    t0 : int
        First destination token.
    codes : uint8 array, shape ``(rows, capacity, width)``
    norms8 : uint8 array, shape ``(rows, capacity, 1)``
    s0, n : int, optional
        First source token and tokens stored (default: all ``m``).
    """
    rows, m, w = (int(s) for s in src_codes.shape)
    n = m - int(s0) if n is None else int(n)
    if rows * n:
        s0 = int(s0)
        if s0 < 0 or n < 0 or s0 + n > m:
            raise ValueError(f"s0, n: tokens {s0}..{s0 + n - 1} do not fit src_codes's {m} tokens")
        t0 = check_span(t0, n, codes.shape[1], "codes")
        _STORE.launch(_backend.device_of("src_codes", src_codes), rows * n, src_codes, src_norms,
                      _backend.constant(src_codes, LOG16), int(base16), s0, n, int(t0), codes, norms8,
                      work=rows * n * w)


def norm8_scale_rows_into(norms8: Any, base16: int, t0: int, out: Any) -> None:
    """Scale dequantized vectors by their decoded 8-bit norms (no validation).

    Parameters
    ----------
    norms8 : uint8 array, shape ``(rows, capacity, 1)``
        Norm codes; tokens ``t0 … t0 + n − 1`` are read.
    base16 : int
        The grid's base in 1/16 octaves.
    t0 : int
        First token.
    out : float32 array, shape ``(rows, n, d)``, C-contiguous, on the device of ``norms8``
        Unit-norm reconstructions; ``out[r, s, :] *= norm8_decode_table(base16)[norms8[r, t0 + s, 0]]``.
    """
    rows, n, d = (int(s) for s in out.shape)
    if rows * n:
        t0 = check_span(t0, n, norms8.shape[1], "norms8")
        _SCALE.launch(_backend.device_of("out", out), rows * n, norms8,
                      _backend.constant(out, norm8_decode_table(int(base16))), int(t0), out, work=rows * n * d)
