"""The head VQ code on tensor cores: the tables and tiles of ``decode_attention_mma_vq``.

The head VQ code (:mod:`numba_kv.ops.headvq`: one byte indexes a one-byte codebook of pairs
of rotated coordinates at 4 bits a value, or of quads at 2 bits) packs byte ``i`` of a
32-block as the code of its coordinates ``m·i … m·i + m − 1`` — where the scalar code of the
same width puts those coordinates' indices.  So the tensor-core tiles of
:mod:`numba_kv.ops.attention.mma` read it with the same loads and the same bit fields; only
the table the fields index differs:

* **pairs** (``m = 2``, 4 bits a value): the codebook *is* a pair table, entry ``e`` the
  ``.f16x2`` word ``(cent[e, 0], cent[e, 1])``, 256 entries as the scalar 4-bit table's: the
  4-bit tiles read it unchanged (8 replicas).
* **quads** (``m = 4``, 2 bits a value): entry ``e`` is two words, ``(cent[e, 0], cent[e,
  1])`` and ``(cent[e, 2], cent[e, 3])``, read by one ``ld.shared.v2.u32``
  (:func:`~numba_kv.ops.attention.ptx.lds_u32x2`): one load decodes four values, where the
  scalar 2-bit tiles take two.  4 replicas of 256 entries fill the table's 2,048 words; lane
  ``ℓ`` reads replica ``ℓ mod 4``.  :func:`key_tile_quads` and :func:`value_tile_quads` are
  the scalar tiles with each pair of table reads made one.

Either side may be a scalar code instead (a cache with VQ keys and scalar values): its pair
table as :func:`~numba_kv.ops.attention.pairtab.build_pair_table` builds it.  The codebook of
the head VQ code holds rotated coordinates of unit vectors, so every ``|centroid| <= 1`` and the
table needs no power-of-two factor (:func:`~numba_kv.ops.attention.layout.mma_layout_ok`
checks it on the host).

Both tables share the word layout ``o + 8·e + 2·r + h`` (quads) / ``o + 8·e + r`` (pairs):
an entry's byte offset is its index times 32, so a table read's address is the byte's field
moved to bit 5, OR-ed with the lane's replica and the realigned base (as the scalar tables'
reads, :func:`~numba_kv.ops.attention.pairtab.aligned_table`).
"""

from __future__ import annotations

from numba import float32, int32, uint32

from ..._jit import cuda_device, specialize
from .pairtab import TAB_SLOTS, bits_at, build_pair_table, build_tables_py, field, replicate_pair_table
from .ptx import high_halves, lds_u32x2, low_halves, mma_16816, pack_half2

__all__ = ["VQ_PAIR_COLUMNS", "VQ_QUAD_COLUMNS", "build_tables_vq", "key_tile_quads", "quad_slot",
           "value_tile_quads"]

#: codebook columns (256 codes × group) of the head VQ code's pairs and quads; a scalar
#: codebook has at most 32
VQ_PAIR_COLUMNS = 512
VQ_QUAD_COLUMNS = 1024
#: bit of a table read's address where the entry's index goes (32 bytes an entry)
_ENTRY_SHIFT = 5
#: the head_dim the quad tiles are compiled for (:data:`numba_kv.ops.attention.mma.HEAD_DIM`,
#: rebound with it by :mod:`numba_kv.ops.attention.mma_dims`)
HEAD_DIM = 128


@cuda_device
def _vq_table(tab, o, cent, tid, nth):
    """Replica 0 of a head VQ codebook's table at word ``o`` (block-cooperative): word ``w`` of
    the flattened codebook's ``.f16x2`` pairs, ``(cent[0, 2w], cent[0, 2w + 1])``, at ``o +
    8·e + h`` for entry ``e`` and half ``h`` (``w = e`` for pairs, ``2e + h`` for quads)."""
    quads = cent.shape[1] > VQ_PAIR_COLUMNS
    sh = int32(1) if quads else int32(0)
    w = int32(tid)
    while w < int32(cent.shape[1] >> 1):
        tab[uint32(o + ((w >> sh) << 3) + (w & sh))] = pack_half2(cent[0, 2 * w], cent[0, 2 * w + 1])
        w = int32(w + int32(nth))


@cuda_device
def _replicate_vq(tab, o, cent, tid, nth):
    """``tab[o + i] = tab[o + (i with the replica bits cleared)]`` for the table's 2,048 words
    (after the barrier that published :func:`_vq_table`): replica bits 0-2 (pairs), 1-2
    (quads)."""
    keep = ~int32(6) if cent.shape[1] > VQ_PAIR_COLUMNS else ~int32(7)
    i = int32(tid)
    while i < int32(TAB_SLOTS):
        tab[uint32(o + i)] = tab[uint32(o + (i & keep))]
        i = int32(i + int32(nth))


@cuda_device
def _side_table(tab, o, cent, bits, tid, nth):
    """One side's replica 0: the VQ table for a head VQ codebook (more than 32 columns), else
    the scalar pair table; returns the factor to multiply back (1 for VQ)."""
    if cent.shape[1] > 32:
        _vq_table(tab, o, cent, tid, nth)
        return float32(1.0)
    return build_pair_table(tab, o, cent, bits, tid, nth)


@cuda_device
def _side_replicate(tab, o, cent, bits, tid, nth):
    if cent.shape[1] > 32:
        _replicate_vq(tab, o, cent, tid, nth)
    else:
        replicate_pair_table(tab, o, bits, tid, nth)


#: :func:`~numba_kv.ops.attention.pairtab.build_tables` for sides of the head VQ code or the
#: scalar code (K at word ``w0``, V at ``w0 +`` :data:`TAB_SLOTS`); returns ``(kb, vb, kf, vf)``
build_tables_vq = cuda_device(specialize(build_tables_py, "_vq", side_table=_side_table,
                                         side_replicate=_side_replicate))


@cuda_device
def quad_slot(lane, base, v):
    """The shared address of entry 0 in lane ``lane``'s replica (``lane mod 4``) of the K
    (``v`` false) or V quad table, from the realigned ``base``."""
    off = (uint32(lane) & uint32(3)) << uint32(3)
    return (off | uint32(4 * TAB_SLOTS)) | base if v else off | base


def _key_tile_quads(a0, a1, b0, b1, slot, tab, qa):
    """:func:`~numba_kv.ops.attention.mma.key_tile` of keys in VQ quads (token ``gid``'s block
    ``tig`` in ``a0, a1``, token ``gid + 8``'s in ``b0, b1``: 8 code bytes each): k-step ``j``
    takes pairs ``2j`` and ``2j + 1`` of a block, which are quad ``j``'s two words — one
    ``ld.shared.v2.u32`` a token and k-step (``HEAD_DIM / 16`` k-steps: at 64 a lane's 4 code
    bytes in ``a0``, ``b0``).  Codes unscaled (a token's one norm multiplies its scores)."""
    c0 = c1 = c2 = c3 = float32(0.0)
    e0 = e1 = e2 = e3 = float32(0.0)
    z = uint32(0)
    for j in range(0, HEAD_DIM // 16, 2):
        x0, x2 = lds_u32x2(tab, field(a0, a1, z, z, 8 * j, 8, _ENTRY_SHIFT) | slot)
        x1, x3 = lds_u32x2(tab, field(b0, b1, z, z, 8 * j, 8, _ENTRY_SHIFT) | slot)
        c0, c1, c2, c3 = mma_16816(x0, x1, x2, x3, qa[2 * j], qa[2 * j + 1], c0, c1, c2, c3)
        x0, x2 = lds_u32x2(tab, field(a0, a1, z, z, 8 * j + 8, 8, _ENTRY_SHIFT) | slot)
        x1, x3 = lds_u32x2(tab, field(b0, b1, z, z, 8 * j + 8, 8, _ENTRY_SHIFT) | slot)
        e0, e1, e2, e3 = mma_16816(x0, x1, x2, x3, qa[2 * j + 2], qa[2 * j + 3], e0, e1, e2, e3)
    return c0 + e0, c1 + e1, c2 + e2, c3 + e3


def _value_tile_quads(xa, xb, xc, xd, slot, tab, pb0, pb1, oacc):
    """:func:`~numba_kv.ops.attention.mma.value_tile` of values in VQ quads (each of the four
    tokens' coordinates ``16·gid … + 15``: 4 code bytes at the low bits of ``xa … xd``):
    products ``2i`` and ``2i + 1`` take pairs ``2i`` and ``2i + 1``, quad ``i``'s two words —
    one ``ld.shared.v2.u32`` a token for two products (at head_dim 64: coordinates ``8·gid …
    + 7``, 2 bytes).  Codes unscaled (the weights carry a token's one norm)."""
    for i in range(HEAD_DIM // 32):
        ha0, ha1 = lds_u32x2(tab, bits_at(xa, 8 * i, 8, _ENTRY_SHIFT) | slot)
        hb0, hb1 = lds_u32x2(tab, bits_at(xb, 8 * i, 8, _ENTRY_SHIFT) | slot)
        hc0, hc1 = lds_u32x2(tab, bits_at(xc, 8 * i, 8, _ENTRY_SHIFT) | slot)
        hd0, hd1 = lds_u32x2(tab, bits_at(xd, 8 * i, 8, _ENTRY_SHIFT) | slot)
        j = 2 * i
        oacc[4 * j], oacc[4 * j + 1], oacc[4 * j + 2], oacc[4 * j + 3] = mma_16816(
            low_halves(ha0, hb0), high_halves(ha0, hb0), low_halves(hc0, hd0), high_halves(hc0, hd0),
            pb0, pb1, oacc[4 * j], oacc[4 * j + 1], oacc[4 * j + 2], oacc[4 * j + 3])
        j = 2 * i + 1
        oacc[4 * j], oacc[4 * j + 1], oacc[4 * j + 2], oacc[4 * j + 3] = mma_16816(
            low_halves(ha1, hb1), high_halves(ha1, hb1), low_halves(hc1, hd1), high_halves(hc1, hd1),
            pb0, pb1, oacc[4 * j], oacc[4 * j + 1], oacc[4 * j + 2], oacc[4 * j + 3])


key_tile_quads = cuda_device(_key_tile_quads)
value_tile_quads = cuda_device(_value_tile_quads)
