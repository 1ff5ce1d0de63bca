"""The tensor-core decode kernel's pair tables in shared memory (:mod:`numba_kv.ops.attention.mma`).

A block's codebook of ``bits``-wide codes expands to ``4**bits`` entries, one per pair of
adjacent codes ``(c_j, c_{j+1})``, each the ``.f16x2`` word ``(cent[c_j], cent[c_{j+1}])``
times a power of two that keeps every ``|centroid|`` at most 1: one shared-memory load decodes
two values.  Each table is replicated ``rep`` times (``rep·4**bits`` = :data:`TAB_SLOTS`) and
lane ``ℓ`` reads replica ``ℓ mod rep``: with 32 replicas (3 bits and fewer) every lane hits its
own bank, so random indices cost no bank conflicts.  The K table sits at word ``w0`` and the V
table at ``w0 +`` :data:`TAB_SLOTS` of a shared array, ``w0`` the first word whose
shared-window address is a multiple of :data:`TAB_BYTES` (:func:`aligned_table`), so that a
read's address is the table base OR-ed with the entry's byte offset and the lane's replica.
"""

from __future__ import annotations

from numba import cuda, float32, int32, uint32, uint64

from ..._jit import cuda_device
from .ptx import pack_half2, shared_base32

__all__ = ["MMA_TAB_SHARED_WORDS", "MMA_TAB_WORDS", "TAB_BYTES", "TAB_SLOTS", "aligned_table", "bits_at",
           "build_pair_table", "build_tables", "build_tables_py", "field", "pair_table_replicas",
           "pair_table_replicas_dev", "replicate_pair_table"]

#: 32-bit words per pair table in shared memory (8 KiB): entries × replicas
TAB_SLOTS = 2048
#: log2 of :data:`TAB_SLOTS`: a ``bits``-wide table has ``2**min(5, 11 − 2·bits)`` replicas
_TAB_SHIFT = TAB_SLOTS.bit_length() - 1
#: the block's two tables (K at word 0, V at word TAB_SLOTS)
MMA_TAB_WORDS = 2 * TAB_SLOTS
#: bytes of the two tables, and the alignment of their start in the shared window: the table
#: offsets then fill bits 2-13 of an address whose higher bits are the start's, so that the
#: kernel makes each read's address by ORs (:func:`aligned_table`)
TAB_BYTES = 4 * MMA_TAB_WORDS
#: words of the shared array that holds the tables: twice the tables, so that a TAB_BYTES-aligned
#: start lies inside it wherever the array lands (no declared alignment reaches the window
#: address: sm_80 and sm_90 put user shared arrays 0x400 bytes into it)
MMA_TAB_SHARED_WORDS = 2 * MMA_TAB_WORDS


def pair_table_replicas(bits: int) -> int:
    """Replicas of a ``bits``-wide pair table in :data:`TAB_SLOTS` words (at most 32, one per
    lane)."""
    return min(32, TAB_SLOTS >> (2 * bits))


@cuda_device
def pair_table_replicas_dev(bits):
    """:func:`pair_table_replicas` on the device."""
    return min(int32(32), int32(int32(TAB_SLOTS) >> int32(2 * int32(bits))))


@cuda_device
def build_pair_table(tab, o, cent, bits, tid, nth):
    """Replica 0: ``tab[o + e·rep] = f·(cent[e mod 2**bits], cent[e >> bits])`` as ``.f16x2``
    for every pair index ``e < 4**bits`` (block-cooperative, thread ``tid`` of ``nth``), ``f``
    the power of two bringing the largest ``|centroid|`` to at most 1 (``f·c·scale`` stays in
    binary16 for every binary16 scale).  Returns ``1/f`` (exact), to multiply back."""
    b = int32(bits)
    mask = int32(int32(1) << b) - int32(1)
    cmax = float32(0.0)
    for i in range(mask + 1):
        cmax = max(cmax, abs(cent[0, i]))
    f = float32(1.0)
    while cmax * f > float32(1.0):
        f *= float32(0.5)
    # (32-bit shifts: Numba's int64 floor division by the run-time rep made a word ~95 SASS)
    rsh = min(int32(5), int32(_TAB_SHIFT - 2 * b))
    e = int32(tid)
    while e < int32(int32(1) << int32(2 * b)):
        tab[uint32(o + int32(e << rsh))] = pack_half2(cent[0, uint32(e & mask)] * f, cent[0, uint32(e >> b)] * f)
        e = int32(e + int32(nth))
    return float32(1.0) / f


@cuda_device
def replicate_pair_table(tab, o, bits, tid, nth):
    """``tab[o + e·rep + r] = tab[o + e·rep]`` for every entry's replicas ``r = 1 … rep − 1``
    (block-cooperative, after the barrier that published :func:`build_pair_table`'s replica 0;
    the caller's next barrier publishes these): 10 SASS instructions a word on sm_90, where
    packing each from the codebook took 37."""
    rsh = min(int32(5), int32(_TAB_SHIFT - 2 * int32(bits)))
    keep = ~int32(int32(int32(1) << rsh) - int32(1))
    i = int32(tid)
    while i < int32(int32(1) << int32(2 * int32(bits) + rsh)):
        # (replica 0 too, with the value it holds: no branch; unsigned indices: no wraparound)
        tab[uint32(o + i)] = tab[uint32(o + (i & keep))]
        i = int32(i + int32(nth))


@cuda_device
def aligned_table(tab):
    """``(w0, base)``: the word of ``tab`` (a :data:`MMA_TAB_SHARED_WORDS`-word shared array)
    where the two tables start, the first whose shared-window address is a multiple of
    :data:`TAB_BYTES`, and that address (:func:`~numba_kv.ops.attention.ptx.shared_base32`,
    realigned).  A table read's address is then ``base | byte offset``: one mask-and-or that
    also adds the lane's replica."""
    raw = shared_base32(tab)
    base = uint32(uint32(raw + uint32(TAB_BYTES - 1)) & uint32(0x100000000 - TAB_BYTES))
    return int32(uint32(base - raw) >> uint32(2)), base


@cuda_device
def _replicate_side(tab, o, cent, bits, tid, nth):
    """:func:`replicate_pair_table` with a side's codebook (the signature the VQ build's tables
    share: ``numba_kv.ops.attention.mma_vq``)."""
    replicate_pair_table(tab, o, bits, tid, nth)


def build_tables_py(tab, kcent, vcent, kbits, vbits, tid, nth):
    """The block's two pair tables (K at word ``w0``, V at ``w0 +`` :data:`TAB_SLOTS`, ``w0``
    from :func:`aligned_table`) from row 0 of each codebook; returns ``(kb, vb, kf, vf)``: the
    widths and the factors to multiply back (:func:`build_pair_table`).  Every thread of the
    block calls it (a barrier inside); the caller's next block barrier publishes them.  The
    source of :func:`build_tables`, and of the VQ build's tables with the two per-side steps
    rebound (``side_table``, ``side_replicate``)."""
    kb = kbits[0]
    vb = vbits[0]
    w0, _ = aligned_table(tab)
    kf = side_table(tab, w0, kcent, kb, tid, nth)
    vf = side_table(tab, int32(w0 + TAB_SLOTS), vcent, vb, tid, nth)
    cuda.syncthreads()
    side_replicate(tab, w0, kcent, kb, tid, nth)
    side_replicate(tab, int32(w0 + TAB_SLOTS), vcent, vb, tid, nth)
    return kb, vb, kf, vf


side_table, side_replicate = build_pair_table, _replicate_side
build_tables = cuda_device(build_tables_py)


@cuda_device
def field(w0, w1, w2, w3, pos, width, at):
    """Bits ``[pos, pos + width)`` of the little-endian 128-bit word ``w3:w2:w1:w0``, moved to
    bit ``at`` (``pos``, ``width``, ``at`` constants after unrolling: the selects fold, and
    the move and the mask become one funnel shift and one mask, where shifting down, masking
    and shifting up would cost three instructions)."""
    wi = pos >> 5
    off = pos & 31
    lo = w0 if wi == 0 else (w1 if wi == 1 else (w2 if wi == 2 else w3))
    hi = w1 if wi == 0 else (w2 if wi == 1 else (w3 if wi == 2 else uint32(0)))
    return bits_at((uint64(hi) << uint64(32)) | uint64(lo), off, width, at)


@cuda_device
def bits_at(x, pos, width, at):
    """Bits ``[pos, pos + width)`` of the ``uint64`` ``x`` at bit ``at`` of a ``uint32``."""
    if pos >= at:
        y = x >> uint64(pos - at)
    else:
        y = x << uint64(at - pos)
    return uint32(y) & uint32(((1 << width) - 1) << at)
