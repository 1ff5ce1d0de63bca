"""Tensor-core tiles of the compressed decode attention (kernel ``decode_attention_mma``).

One warp walks one partition of one KV row, 16 tokens per tile, with ``mma.sync`` m16n8k16
(binary16 operands, float32 accumulation; :mod:`numba_kv.ops.attention.ptx`) for both products; scores
never leave the registers (FlashAttention-2, Dao, arXiv:2307.08691, §3.1).  Dequantization
happens in registers straight into the A fragments (BitDecoding, arXiv:2503.18773; pairs of
binary16 as in QServe, arXiv:2405.04532):

* **pair tables** (:mod:`numba_kv.ops.attention.pairtab`): a block's codebook expands to
  ``4**bits`` entries, one per pair of adjacent codes ``(c_j, c_{j+1})``, each the ``.f16x2``
  word ``(cent[c_j], cent[c_{j+1}])``.
  The packing stores code ``j`` of a block at bit ``bits·j`` (LSB first), so the ``2·bits``
  bits at ``2·bits·i`` are the table index of pair ``i``: one shared-memory load decodes two
  values.  Each table is replicated ``rep`` times (``rep·4**bits`` = :data:`TAB_SLOTS`) and
  lane ``ℓ`` reads replica ``ℓ mod rep``: 32 replicas (3 bits and fewer) make every lane hit
  its own bank, so the random indices cost no bank conflicts.

Both products are *transposed* (``Sᵀ``-style: the 16-row side of ``m16n8k16`` is the tokens or
the coordinates, the 8-column side the query rows, of which a warp has at most
:data:`~numba_kv.ops.attention.warp.WARP_ROWS`): every A register holds decoded codes, no
register is a zero, and a 16-token tile takes 8 + 8 products where the first build (query
rows as A, half of them zeros) took 16 + 16.

* **scores** ``S = K·Qᵀ`` per 16 tokens: ``A`` = the keys, lane ``(gid, tig)`` decoding block
  ``tig`` (32 coordinates) of tokens ``gid`` and ``gid + 8``, ``B`` = the query fragments
  (column ``gid`` = query row ``gid``, zero past the warp's rows).  The reduction order inside
  a product is free, so the k-slots of k-step ``j`` are mapped to the coordinate pairs ``2j``
  and ``2j + 1`` of each lane's block, which lie next to each other in the packed bytes (the
  query fragments are permuted the same way once per partition): one table read decodes an
  A register.  The key's block scale multiplies the decoded pair (``mul.rn.f16x2``).
* **one scale a token** (whole-head codes: the ``kv4``/``kv5`` presets): the scale leaves
  the k-sums, so the codes go into the products unscaled and the float32 scores of token
  ``t`` are multiplied by its key scale, its weights by its value scale before they are
  packed (``p·s_v`` ≤ 65504 for weights ≤ 1: finite).  The lane's scores and weights are of
  its tokens ``gid`` and ``gid + 8``, so it reads two value scales a tile instead of four,
  and the ``mul.rn.f16x2`` of each of a tile's 64 table reads is gone (a 4-bit key / 3-bit
  value pass: 550 → 490 SASS instructions on sm_90), for 8 float32 multiplies.  The scales
  are also applied in float32 instead of rounded into binary16 products.  The flat kernel
  compiles both loops (:func:`mma_tiles` with ``tok`` constant at each call); a pool's
  scales are per block.
* **softmax**: lane ``(gid, tig)`` holds the scores of tokens ``gid`` and ``gid + 8`` for query
  rows ``2tig`` and ``2tig + 1``; a row's tile maximum and, at the end, its sum are three
  xor shuffles over the 8 lanes of one ``tig``.  Scores are kept in base-2 units (the
  queries are pre-multiplied by ``softmax_scale·log2 e``), the stored maximum goes back to
  natural units for the merge.  The accumulators are rescaled only in a tile where a row's
  maximum moved (``alpha`` is exactly 1 otherwise).
* **values** ``Oᵀ += Vᵀ·Pᵀ``: ``B`` = the weights, packed to ``.f16x2`` and transposed in
  registers by ``movmatrix`` (lane ``(gid, tig)`` then holds row ``gid``'s weights of tokens
  ``2tig, 2tig+1`` and ``2tig+8, 2tig+9``); ``A`` = 16 coordinates × 16 tokens per product:
  lane ``(gid, tig)`` decodes coordinates ``16·gid … 16·gid + 15`` of those four tokens as
  same-token pairs (product ``j``: coordinates ``16·gid + 2j`` in A row ``gid`` and ``+ 1`` in
  row ``gid + 8``) and regroups two tokens' halves into one A register (a byte permutation);
  8 products cover ``head_dim = 128``.
* **addresses**: codes and scales are read by global byte address
  (:func:`~numba_kv.ops.attention.ptx.ldg_u32`, ``ldg_u16``): a token row is one multiply-add
  of 32-bit factors onto the array's address (instead of four 64-bit strides, or Numba's
  index × itemsize + data pointer per word) and a row's further words ride in the loads'
  immediate offsets; a table entry's shared address is cut from the packed words already
  shifted to its byte offset and OR-ed with the lane's replica and the tables' base (one
  funnel shift, one mask-and-or, the load: :func:`~numba_kv.ops.attention.ptx.lds_u32`).
  The tables start at a 16 KiB-aligned shared-window address inside a 32 KiB array
  (:func:`aligned_table`; a CTA's user arrays start 0x400 bytes into its window), so the
  base has the offset bits clear; indexing the array cost a multiply-add more per read on
  sm_90 (64 of a 3-bit pass's 679 SASS instructions then).

Range: binary16 holds the operands exactly as far as it can — the queries of a row are scaled
by a power of two that puts their largest magnitude in ``[2**13, 2**14)`` (undone on the
float32 scores), codebook values lie in ``[-1, 1]`` and scales are binary16 already, weights
are in ``[0, 1]``: finite inputs stay finite.

Head VQ code and 8-bit norms: :data:`mma_partition_vq` is :func:`mma_partition` with
:data:`VQ_BUILD` bound True (kernel ``decode_attention_mma_vq``, flat caches): quad tiles and
tables of :mod:`numba_kv.ops.attention.mma_vq` on a side that holds VQ quads (VQ pairs read as a
4-bit pair table), token scales read as binary16 or as 8-bit norm codes
(:func:`_scale_f32`), the token-scale loop only.  The scalar build compiles none of it.

Flat and paged: :func:`mma_partition` is the whole compressed partition of the one tensor-core
kernel source, compiled for flat caches (``decode_attention_mma``) and paged pools
(``paged_decode_attention_mma``); :func:`token_address` is the only place they differ (a flat
cache's arrays are viewed as ``[rows, 1, capacity, ·]``, a pool's are
``[pages, heads, page_size, ·]``), read once per 16-token tile (:func:`_tile_rows`: a pool's
pages hold a power of two ``>= 16`` tokens and partitions start at multiples of 16, so a
tile's tokens share a page).

Simulator: the primitives of :mod:`numba_kv.ops.attention.ptx` exchange lanes between block barriers,
so the kernel is launched there with one warp per block (every lane of a block reaches each
exchange together).
"""

from __future__ import annotations

from numba import cuda, float32, int32, int64, uint32, uint64

from ..._jit import cuda_device, specialize
from .cores import NEG_INF, NORM8_SLOT0
from .mma_vq import key_tile_quads, quad_slot, value_tile_quads
from .pairtab import (
    MMA_TAB_SHARED_WORDS,
    MMA_TAB_WORDS,
    TAB_BYTES,
    TAB_SLOTS,
    aligned_table,
    bits_at,
    build_pair_table,
    build_tables,
    field,
    pair_table_replicas,
    pair_table_replicas_dev,
)
from .ptx import (
    exp2_ftz,
    global_address,
    half_f32,
    high_halves,
    hmul2,
    ldg_u8,
    ldg_u16,
    ldg_u32,
    lds_u32,
    low_halves,
    mma_16816,
    movmatrix_trans,
    pack_half2,
    shfl_idx_f32,
    shfl_xor_f32,
    static_itemsize,
)

# (the wave model of the partition lengths, re-exported: the plan's and the benchmarks' name)
from .waves import (
    MERGE_COST_TOKENS,
    MERGE_PARTS_PER_SQRT_TOKEN,
    MMA_PART_RANGE,
    PART_COST_TOKENS,
    WAVE_WARPS_PER_BLOCK,
    mma_partition_size,
)

__all__ = ["LN2", "LOG2E", "MERGE_COST_TOKENS", "MERGE_PARTS_PER_SQRT_TOKEN", "MMA_BITS", "MMA_BLOCKS_PER_SM",
           "MMA_BLOCKS_PER_SM_SM90", "MMA_HEAD_DIM", "MMA_HEAD_DIMS",
           "HEAD_DIM", "MMA_PART_RANGE", "MMA_TAB_SHARED_WORDS", "MMA_TAB_WORDS",
           "MMA_THREADS", "MMA_TILE", "PART_COST_TOKENS", "TAB_BYTES", "TAB_SLOTS", "aligned_table",
           "VQ_BUILD", "build_pair_table", "build_tables", "key_tile", "mma_partition", "mma_partition_size",
           "mma_partition_vq", "mma_tiles", "mma_tiles_vq",
           "head_dim_names", "key_at", "load_key", "load_value", "make_key_tile", "make_value_tile",
           "pair_table_replicas", "stage_query_fragments", "store_mma_partition", "value_at",
           "token_address", "value_tile"]

#: the head_dim of the tensor-core kernel's first build (4 blocks of 32: one per lane of a quad)
MMA_HEAD_DIM = 128
#: the head_dims with a tensor-core build (:mod:`numba_kv.ops.attention.mma_dims`: the same
#: source with :data:`HEAD_DIM` bound)
MMA_HEAD_DIMS = (64, 128)
#: the head_dim this build's tiles are compiled for (a compile-time constant, rebound by
#: :func:`~numba_kv._jit.specialize`): a lane of a quad scores ``HEAD_DIM / 4`` coordinates of
#: a key (``HEAD_DIM / 16`` k-steps), a lane of a column group decodes ``HEAD_DIM / 8`` of a
#: value (``HEAD_DIM / 16`` products), and holds ``HEAD_DIM / 4`` output sums
HEAD_DIM = MMA_HEAD_DIM
#: a lane's query fragment words and output sums at :data:`HEAD_DIM` (local array sizes must be
#: plain constants: rebound with it, :func:`head_dim_names`)
_QA_WORDS, _OUT_SUMS = HEAD_DIM // 8, HEAD_DIM // 4

#: tokens per tile (the A rows of a score product and the k-slots of a value product)
MMA_TILE = 16
#: threads per block of the kernel and its launch bounds' blocks per SM: ptxas takes 154 and
#: 167 registers on sm_90 for the flat and the paged kernel, so 3 blocks (12 warps) fit an SM
#: (``tests/cuda/test_resources.py``).  Bounds of 3 blocks would force that but make sm_80
#: spill; the build timed on an H100 (189 registers by the driver's ptxas) ran 2 blocks
MMA_THREADS = 128
assert MMA_THREADS == 32 * WAVE_WARPS_PER_BLOCK  # (the wave model's default)
MMA_BLOCKS_PER_SM = 2
#: launch bounds' blocks per SM of the kernels' sm_90 builds (``Twin.cuda_cc``): ptxas holds
#: both to 128 registers there without a spill, so 4 blocks (16 warps) fit an H100/H200 SM.
#: On an H200 (2026-11-30, 3 bits, GPU time, `benchmarks/gpu_mma_check.py --device-time`,
#: ``mma lb(128,4)``) they were 4–9 % faster at T = 32K × 32, 128K × 8 and 128K × 32 (2.33
#: against 2.50 ms) and 5 % slower at 32K × 8 with the partition rule of then (1.3 waves of
#: 3 blocks an SM, 1 of 4); sm_80's ptxas spills under them (212/236 B flat, 72/96 B paged)
MMA_BLOCKS_PER_SM_SM90 = 4
#: code widths with a pair table (``4**bits`` entries)
MMA_BITS = (2, 3, 4)
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def head_dim_names(d: int) -> dict:
    """The globals that make this module's tiles a build for head_dim ``d``.

    Parameters
    ----------
    d : int
        One of :data:`MMA_HEAD_DIMS`.

    Returns
    -------
    dict
        ``{name: value}`` for :func:`~numba_kv._jit.specialize` (:data:`HEAD_DIM` and the
        local array sizes that follow from it)."""
    return {"HEAD_DIM": d, "_QA_WORDS": d // 8, "_OUT_SUMS": d // 4}


@cuda_device
def _abs_bits(raw):
    """``|scale|`` of a stored binary16 scale, as binary16 bits (infinities and NaNs read as 0,
    like the kernels' binary16 table)."""
    h = uint32(raw) & uint32(0x7FFF)
    return uint32(0) if h >= uint32(0x7C00) else h


@cuda_device
def _abs_half2(raw):
    """:func:`_abs_bits` in both halves of a ``.f16x2`` word (a block scale of the codes)."""
    h = _abs_bits(raw)
    return h | (h << uint32(16))


@cuda_device
def _abs_f32(raw):
    """:func:`_abs_bits` as float32 (a token scale of the scores and weights; exact)."""
    return half_f32(_abs_bits(raw))


@cuda_device
def _row(arr, page, h, slot):
    """Global byte address of ``arr[page, h, slot, 0]`` in a C-contiguous array
    (``mma_operands`` hands the kernels C-contiguous views only), from its shape: one 64-bit
    multiply-add of 32-bit factors for the page's rows, one 32-bit product for the slot (a
    page's or a flat cache's KV row's bytes, ``page_size`` or capacity × row bytes, are far below
    ``2**32``, and so are ``pages × heads``).  The strides would do for any view, but keeping
    them live costs the paged kernel 37 registers (205: 2 blocks per sm_90 SM instead of 3)."""
    w = uint32(arr.shape[3] * arr.itemsize)
    prow = uint32(uint32(page) * uint32(arr.shape[1]) + uint32(h))
    return global_address(arr) + uint64(prow) * uint64(uint32(arr.shape[2]) * w) + uint64(uint32(slot) * w)


@cuda_device
def token_address(paged, kv_indices, first, psh, g, t):
    """``(page, slot)`` of token ``t`` (``int32``): ``(g, t)`` in a flat cache (its codes viewed
    as ``[n_g, 1, capacity, ·]``), slot ``t mod page_size`` of page ``kv_indices[first + t //
    page_size]`` in a paged pool (``[pages, num_kv_heads, page_size, ·]``) whose page size is
    ``2**psh`` (the plan runs the tensor-core kernel for power-of-two page sizes only: a shift
    and a mask instead of a checked division).  The one place the two token spaces differ."""
    if paged:
        return uint64(kv_indices[first + (t >> psh)]), uint32(t & ((int32(1) << psh) - int32(1)))
    return uint64(g), uint32(t)


@cuda_device
def _tile_rows(kc32, ks, base, sbase, paged, kv_indices, first, psh, h, t):
    """Byte addresses in a code and its scale array from which the tokens of the 16-token tile
    whose first token (clamped) is ``t`` lie :func:`_tile_slot` rows on: a flat cache's KV row
    (``base``, ``sbase``, computed once per partition), a pool's page of ``t`` (one page-table
    read a tile, not one a token: a tile is on one page, the plan's condition)."""
    if paged:
        page, _ = token_address(paged, kv_indices, first, psh, 0, t)
        return _row(kc32, page, h, 0), _row(ks, page, h, 0)
    return base, sbase


@cuda_device
def _tile_slot(paged, psh, t):
    """Token ``t``'s row from its tile's :func:`_tile_rows`: ``t`` (flat), ``t mod 2**psh`` (pool)."""
    if paged:
        return uint32(t & ((int32(1) << psh) - int32(1)))
    return uint32(t)


@cuda_device
def _token_rows(kc32, ks, base, sbase, t):
    """Byte addresses of row ``t`` of a code and its scale array from ``base``, ``sbase``
    (:func:`_tile_rows`, :func:`_tile_slot`): one multiply-add each."""
    return (base + uint64(uint32(t) * uint32(4 * kc32.shape[3])),
            sbase + uint64(uint32(t) * uint32(static_itemsize(ks) * ks.shape[3])))


@cuda_device
def load_key(kc32, ks, ko, so, tig, kb, sshift):
    """Lane ``(·, tig)``'s code bits of coordinates ``HEAD_DIM/4 · tig … + HEAD_DIM/4 − 1`` of
    the token whose rows start at byte addresses ``ko`` (codes) and ``so`` (scales), LSB first
    in four words (the words past them 0), and the stored bits of their block's scale.  At
    head_dim 128 that is block ``tig``, its ``kb`` words; at 64 half of block ``tig >> 1``,
    ``16·kb`` bits from bit ``16·kb·tig`` of the row (two words shifted into place: at 3 bits
    the half starts mid-word on odd lanes)."""
    if HEAD_DIM == 64:
        bit = uint32(16 * kb) * uint32(tig)
        base = ko + uint64(4 * (bit >> uint32(5)))
        lo = ldg_u32(kc32, base)
        hi = ldg_u32(kc32, base + uint64(4)) if kb > 2 else uint32(0)
        x = ((uint64(hi) << uint64(32)) | uint64(lo)) >> uint64(bit & uint32(31))
        return (uint32(x & uint64(0xFFFFFFFF)), uint32(x >> uint64(32)), uint32(0), uint32(0),
                _ldg_scale(ks, so + uint64(static_itemsize(ks) * ((tig >> 1) >> sshift))))
    base = ko + uint64(4 * tig * kb)
    w0 = ldg_u32(kc32, base)
    w1 = ldg_u32(kc32, base + uint64(4)) if kb > 1 else uint32(0)
    w2 = ldg_u32(kc32, base + uint64(8)) if kb > 2 else uint32(0)
    w3 = ldg_u32(kc32, base + uint64(12)) if kb > 3 else uint32(0)
    return w0, w1, w2, w3, _ldg_scale(ks, so + uint64(static_itemsize(ks) * (tig >> sshift)))


@cuda_device
def load_value(vc32, vs, vo, so, gid, vb, sshift):
    """Lane ``(gid, ·)``'s ``s·vb`` code bits of coordinates ``s·gid … + s − 1`` (``s =
    HEAD_DIM / 8``) of the token whose rows start at byte addresses ``vo`` and ``so`` (LSB
    first, in a ``uint64``) and the stored bits of their block's scale (a load nothing uses is
    dropped: the token-scale tiles')."""
    span = HEAD_DIM // 8
    start = span * vb * gid
    base = vo + uint64(4 * (start >> 5))
    w0 = ldg_u32(vc32, base)
    if HEAD_DIM == 64:
        # (8 coordinates: 16, 24 or 32 bits; at 3 bits a lane whose 24 cross a word reads the
        # next, the others read theirs again, not past the row's last word)
        w1 = ldg_u32(vc32, base + (uint64(4) if (start & 31) > 8 else uint64(0))) if vb == 3 else uint32(0)
    else:  # (16 coordinates span two words above 2 bits)
        w1 = ldg_u32(vc32, base + uint64(4)) if vb > 2 else uint32(0)
    x = ((uint64(w1) << uint64(32)) | uint64(w0)) >> uint64(start & 31)
    return x, _ldg_scale(vs, so + uint64(static_itemsize(vs) * (((span * gid) >> 5) >> sshift)))


@cuda_device
def key_at(kc32, ks, krow, ksrow, t, tig, kb, sshift):
    """:func:`load_key` of the token at row ``t`` from its tile's rows ``krow``, ``ksrow``."""
    ko, so = _token_rows(kc32, ks, krow, ksrow, t)
    return load_key(kc32, ks, ko, so, tig, kb, sshift)


@cuda_device
def value_at(vc32, vs, vrow, vsrow, t, gid, vb, sshift):
    """:func:`load_value` of the token at row ``t`` from its tile's rows ``vrow``, ``vsrow``."""
    vo, so = _token_rows(vc32, vs, vrow, vsrow, t)
    return load_value(vc32, vs, vo, so, gid, vb, sshift)


@cuda_device
def _ldg_scale(arr, addr):
    """The stored scale at byte address ``addr`` of ``arr``: binary16 bits (a uint16 plane) or
    an 8-bit norm's code (uint8: ``norm_bits=8``; the itemsize is a constant of the type)."""
    return ldg_u8(arr, addr) if static_itemsize(arr) == 1 else ldg_u16(arr, addr)


@cuda_device
def _scale_f32(arr, raw, table):
    """A token's one scale as float32 from its stored bits ``raw`` (:func:`_ldg_scale`):
    :func:`_abs_f32` of binary16 bits, or an 8-bit norm decoded by the layer's scale table at
    ``NORM8_SLOT0 + code`` (:mod:`numba_kv.ops.norm8`)."""
    if static_itemsize(arr) == 1:
        return table[NORM8_SLOT0 + int32(raw)]
    return _abs_f32(raw)


@cuda_device
def _token_scale(vs, vsrow, slot, tok, table):
    """``|scale|`` (float32) of the value token at row ``slot`` from the scale array's byte
    address ``vsrow`` if ``tok`` (its one scale), else 1 (a constant at each call: no load).
    An 8-bit norm comes halved: it can decode to ``2**16``, past binary16's largest finite
    number, and ``p·scale`` is rounded to binary16 (:func:`mma_partition` doubles the factor
    that multiplies the output back)."""
    if tok:
        raw = _ldg_scale(vs, vsrow + uint64(uint32(slot) * uint32(static_itemsize(vs) * vs.shape[3])))
        return _scale_f32(vs, raw, table) * float32(0.5 if static_itemsize(vs) == 1 else 1.0)
    return float32(1.0)


def make_key_tile(kb: int, d: int = MMA_HEAD_DIM):
    """Scores ``S = K·Qᵀ`` of a 16-token tile: ``A`` = the keys (token ``gid`` in the words
    ``a0…a3`` with block scale ``sa``, token ``gid + 8`` in ``b0…b3`` with ``sb``: block
    ``tig``), ``B`` = the staged query fragments ``qa``.  With ``scaled`` false the codes go
    unscaled (a token's one scale multiplies its scores instead: :func:`_make_tiles`).
    Returns this lane's ``D`` fragment: tokens ``gid`` (rows ``2tig``, ``2tig+1``) and ``gid +
    8`` (the same rows).  ``d``: the head_dim, ``d / 16`` k-steps (the lane's ``d / 4``
    coordinates, at most 128 bits of ``a0…a3``)."""
    pb = 2 * kb
    rep = min(32, TAB_SLOTS >> pb)
    rsh = rep.bit_length() - 1

    def key_tile(a0, a1, a2, a3, sa, b0, b1, b2, b3, sb, slot, tab, qa, scaled):
        c0 = c1 = c2 = c3 = float32(0.0)
        e0 = e1 = e2 = e3 = float32(0.0)
        for j in range(0, d // 16, 2):
            # k-step j: pairs 2j (k-slots 2tig, 2tig+1) and 2j + 1 (2tig+8, 2tig+9) of each
            # token; two accumulator chains (even and odd k-steps) hide the mma latency
            x0 = _scale2(lds_u32(tab, field(a0, a1, a2, a3, pb * (2 * j), pb, rsh + 2) | slot), sa, scaled)
            x1 = _scale2(lds_u32(tab, field(b0, b1, b2, b3, pb * (2 * j), pb, rsh + 2) | slot), sb, scaled)
            x2 = _scale2(lds_u32(tab, field(a0, a1, a2, a3, pb * (2 * j + 1), pb, rsh + 2) | slot), sa, scaled)
            x3 = _scale2(lds_u32(tab, field(b0, b1, b2, b3, pb * (2 * j + 1), pb, rsh + 2) | slot), sb, scaled)
            c0, c1, c2, c3 = mma_16816(x0, x1, x2, x3, qa[2 * j], qa[2 * j + 1], c0, c1, c2, c3)
            x0 = _scale2(lds_u32(tab, field(a0, a1, a2, a3, pb * (2 * j + 2), pb, rsh + 2) | slot), sa, scaled)
            x1 = _scale2(lds_u32(tab, field(b0, b1, b2, b3, pb * (2 * j + 2), pb, rsh + 2) | slot), sb, scaled)
            x2 = _scale2(lds_u32(tab, field(a0, a1, a2, a3, pb * (2 * j + 3), pb, rsh + 2) | slot), sa, scaled)
            x3 = _scale2(lds_u32(tab, field(b0, b1, b2, b3, pb * (2 * j + 3), pb, rsh + 2) | slot), sb, scaled)
            e0, e1, e2, e3 = mma_16816(x0, x1, x2, x3, qa[2 * j + 2], qa[2 * j + 3], e0, e1, e2, e3)
        return c0 + e0, c1 + e1, c2 + e2, c3 + e3

    key_tile.__name__ = key_tile.__qualname__ = f"key_tile_k{kb}" + ("" if d == MMA_HEAD_DIM else f"_d{d}")
    return cuda_device(key_tile)


@cuda_device
def _scale2(x, s, scaled):
    """``x·s`` (``mul.rn.f16x2``) if ``scaled``, else ``x`` (a constant after inlining: no
    instruction)."""
    return hmul2(x, s) if scaled else x


_KEY_TILE_2, _KEY_TILE_3, _KEY_TILE_4 = (make_key_tile(kb) for kb in MMA_BITS)


@cuda_device
def key_tile(kb, a0, a1, a2, a3, sa, b0, b1, b2, b3, sb, slot, tab, qa, scaled):
    """:func:`make_key_tile` for the width ``kb`` (the same branch on every lane)."""
    if kb == 3:
        return _KEY_TILE_3(a0, a1, a2, a3, sa, b0, b1, b2, b3, sb, slot, tab, qa, scaled)
    if kb == 4:
        return _KEY_TILE_4(a0, a1, a2, a3, sa, b0, b1, b2, b3, sb, slot, tab, qa, scaled)
    return _KEY_TILE_2(a0, a1, a2, a3, sa, b0, b1, b2, b3, sb, slot, tab, qa, scaled)


def make_value_tile(vb: int, d: int = MMA_HEAD_DIM):
    """``Oᵀ += Vᵀ·Pᵀ`` over one 16-token tile: ``A`` = the values (lane ``(gid, tig)`` holds the
    code bits of coordinates ``16·gid … + 15`` of tokens ``2tig, 2tig+1`` in ``xa``, ``xb`` and
    ``2tig+8, 2tig+9`` in ``xc``, ``xd``, block scales ``sa … sd``; unscaled with ``scaled``
    false: the weights carry a token's one scale), ``B`` = the weights ``pb0``, ``pb1``.
    Product ``j`` maps row ``gid`` of ``A`` to coordinate ``16·gid + 2j`` and row ``gid + 8``
    to ``16·gid + 2j + 1``: one pair-table entry of a token is both rows, and two tokens'
    entries regroup into two A registers by a byte permutation.  ``d``: the head_dim, ``d / 16``
    products (at 64: rows ``gid``, ``gid + 8`` are coordinates ``8·gid + 2j`` and ``+ 1``)."""
    pb = 2 * vb
    rep = min(32, TAB_SLOTS >> pb)
    rsh = rep.bit_length() - 1

    def value_tile(xa, xb, xc, xd, sa, sb, sc, sd, slot, tab, pb0, pb1, oacc, scaled):
        for j in range(d // 16):
            ha = _scale2(lds_u32(tab, bits_at(xa, pb * j, pb, rsh + 2) | slot), sa, scaled)
            hb = _scale2(lds_u32(tab, bits_at(xb, pb * j, pb, rsh + 2) | slot), sb, scaled)
            hc = _scale2(lds_u32(tab, bits_at(xc, pb * j, pb, rsh + 2) | slot), sc, scaled)
            hd = _scale2(lds_u32(tab, bits_at(xd, pb * j, pb, rsh + 2) | slot), sd, scaled)
            oacc[4 * j], oacc[4 * j + 1], oacc[4 * j + 2], oacc[4 * j + 3] = mma_16816(
                low_halves(ha, hb), high_halves(ha, hb), low_halves(hc, hd), high_halves(hc, hd),
                pb0, pb1, oacc[4 * j], oacc[4 * j + 1], oacc[4 * j + 2], oacc[4 * j + 3])

    value_tile.__name__ = value_tile.__qualname__ = f"value_tile_v{vb}" + ("" if d == MMA_HEAD_DIM else f"_d{d}")
    return cuda_device(value_tile)


_VALUE_TILE_2, _VALUE_TILE_3, _VALUE_TILE_4 = (make_value_tile(vb) for vb in MMA_BITS)


@cuda_device
def value_tile(vb, xa, xb, xc, xd, sa, sb, sc, sd, slot, tab, pb0, pb1, oacc, scaled):
    """:func:`make_value_tile` for the width ``vb`` (the same branch on every lane)."""
    if vb == 3:
        _VALUE_TILE_3(xa, xb, xc, xd, sa, sb, sc, sd, slot, tab, pb0, pb1, oacc, scaled)
    elif vb == 4:
        _VALUE_TILE_4(xa, xb, xc, xd, sa, sb, sc, sd, slot, tab, pb0, pb1, oacc, scaled)
    else:
        _VALUE_TILE_2(xa, xb, xc, xd, sa, sb, sc, sd, slot, tab, pb0, pb1, oacc, scaled)


@cuda_device
def _quad_max(x):
    x = max(x, shfl_xor_f32(x, 1))
    return max(x, shfl_xor_f32(x, 2))


@cuda_device
def _column_max(x):
    """Maximum over the 8 lanes of this lane's ``tig`` (lane bits 2–4: a product's tokens)."""
    x = max(x, shfl_xor_f32(x, 4))
    x = max(x, shfl_xor_f32(x, 8))
    return max(x, shfl_xor_f32(x, 16))


@cuda_device
def _column_sum(x):
    x = x + shfl_xor_f32(x, 4)
    x = x + shfl_xor_f32(x, 8)
    return x + shfl_xor_f32(x, 16)


def _stage_query_fragments(qs, d, gid, tig, rb, scale, qa):
    """This lane's B fragments of the query row ``gid`` (``qs[gid·d + s·tig + …]``, ``s =
    HEAD_DIM / 4``: the coordinates of :func:`load_key`): ``qa[2s] = (y[4s], y[4s+1])``,
    ``qa[2s+1] = (y[4s+2], y[4s+3])`` with ``y = q·scale·2**k``, the power of two ``2**k`` of
    the row putting ``max|y|`` in ``[2**13, 2**14)``; zero rows past ``rb``.  Returns ``2**-k``
    (multiplies the scores back)."""
    o = gid * d + (HEAD_DIM // 4) * tig
    amax = float32(0.0)
    if gid < rb:
        for j in range(HEAD_DIM // 4):
            amax = max(amax, abs(qs[o + j]))
    amax = _quad_max(amax) * abs(scale)
    f = float32(1.0)
    if amax > float32(0.0):
        # bounded: a finite float32 needs at most ~280 halvings or doublings
        while amax * f >= float32(16384.0) and f > float32(1e-30):
            f *= float32(0.5)
        while amax * f < float32(8192.0) and f < float32(1e30):
            f *= float32(2.0)
    k = scale * f
    for s in range(HEAD_DIM // 16):
        if gid < rb:
            qa[2 * s] = pack_half2(qs[o + 4 * s] * k, qs[o + 4 * s + 1] * k)
            qa[2 * s + 1] = pack_half2(qs[o + 4 * s + 2] * k, qs[o + 4 * s + 3] * k)
        else:
            qa[2 * s] = uint32(0)
            qa[2 * s + 1] = uint32(0)
    return float32(1.0) / f


@cuda_device
def _masked(x, t, t_hi, pos0, lim):
    """``x`` where token ``t`` (``int32``, as ``t_hi``, ``pos0`` and ``lim``: positions stay
    below ``2**31``) is in the partition and its position visible, else ``-inf``."""
    # (Numba widens int32 sums to 64 bits: the casts keep the comparisons 32-bit)
    return x if t < t_hi and int32(pos0 + t) <= lim else NEG_INF


@cuda_device
def _online_softmax(xa, xb, m, lsum):
    """One row's step of the online softmax (base 2) over this lane's two scores ``xa``,
    ``xb`` of the tile: returns ``(alpha, pa, pb, m_new, lsum_new)``; an all-masked row so
    far keeps ``m = -inf``, its weights and rescale exact zeros."""
    m_new = max(m, _column_max(max(xa, xb)))
    m_use = m_new if m_new != NEG_INF else float32(0.0)
    alpha = exp2_ftz(m - m_use)
    pa = exp2_ftz(xa - m_use)
    pb = exp2_ftz(xb - m_use)
    return alpha, pa, pb, m_new, lsum * alpha + (pa + pb)


#: the build for the head VQ code (:data:`mma_partition_vq`: quad tables on either side, 8-bit
#: norms); False here, so that the scalar build compiles none of it
VQ_BUILD = False


def _mma_tiles(kb, vb, kq, vq, kc32, ks, vc32, vs, g, h, paged, kv_indices, first, page_size, t_lo, t_hi, pos0, lim0,
               lim1, sshift, tab, qa, inv0, inv1, oacc, lane, table, tok):
    """The 16-token tiles of a compressed partition ``[t_lo, t_hi)`` of KV row ``g`` (layouts in
    the module docstring; token ``t`` sits at position ``pos0 + t`` and lives where
    :func:`token_address` says: KV head ``h`` of a flat cache's row ``g`` or of a paged
    sequence whose page list starts at ``kv_indices[first]``); this lane's rows are ``2tig``
    and ``2tig + 1``, with the last positions ``lim0``, ``lim1`` they see and score factors
    ``inv0``, ``inv1``.  ``oacc`` (32 float32: product ``j``'s ``D`` at ``4j … 4j + 3``) and the
    returned ``(m0, m1, l0, l1)`` (base 2; ``l`` this lane's share of the row sums) start from
    an empty state.  ``tok`` (a constant at each call: two loops): one scale a token, which
    multiplies its float32 scores and weights instead of its decoded codes (no ``mul.rn.f16x2``
    a table read: 64 fewer instructions a tile).  In the VQ build (:data:`VQ_BUILD`) ``kq`` /
    ``vq`` say that a side holds VQ quads (:mod:`numba_kv.ops.attention.mma_vq`), and the
    scales may be 8-bit norms decoded through ``table``.

    Loads run ahead of their use, so that a warp waits for memory at most once per tile: a
    tile's value words are requested before its keys are scored, and the next tile's key
    words before this tile's softmax and ``P·V`` (tokens past the partition read its last
    token, whose weights are exact zeros)."""
    gid = lane >> 2
    tig = lane & 3
    for i in range(HEAD_DIM // 4):
        oacc[i] = float32(0.0)
    m0 = m1 = NEG_INF
    l0 = l1 = float32(0.0)
    # token indices in 32 bits (a cache holds fewer than 2**31 tokens): one-instruction clamps
    # (Numba widens int32 sums to 64 bits; each is cast back so that the compares stay 32-bit)
    t_hi32 = int32(t_hi)
    t_last = max(int32(t_hi32 - 1), int32(0))
    pos32 = int32(pos0)
    # a flat cache's KV row starts here in each array (unused by a pool: per-token pages)
    kb0 = _row(kc32, g, h, 0)
    ksb0 = _row(ks, g, h, 0)
    vb0 = _row(vc32, g, h, 0)
    vsb0 = _row(vs, g, h, 0)
    psh = int32(0)  # log2 of a pool's page size (a power of two: the plan's condition)
    while paged and (int64(1) << psh) < page_size:
        psh += int32(1)
    addr = (paged, kv_indices, first, psh, h)
    slot_of = (paged, psh)  # (a token's row from its tile's rows: _tile_slot)
    # each lane's replica of the two pair tables (TAB_SLOTS: the V table) as the shared address
    # of its entry 0: a table read is this OR the entry's byte offset (aligned_table), from the
    # widths read at run time (a constant mask would fold into every read: two instructions)
    _, base = aligned_table(tab)
    kslot = ((uint32(lane) & uint32(pair_table_replicas_dev(kb) - 1)) << uint32(2)) | base
    vslot = (((uint32(lane) & uint32(pair_table_replicas_dev(vb) - 1)) | uint32(TAB_SLOTS)) << uint32(2)) | base
    if VQ_BUILD:
        kslot = quad_slot(lane, base, False) if kq else kslot
        vslot = quad_slot(lane, base, True) if vq else vslot
    t_lo32 = int32(t_lo)
    # (tokens clamped to the partition's last share the page of their tile's first, clamped)
    krow, ksrow = _tile_rows(kc32, ks, kb0, ksb0, *addr, min(t_lo32, t_last))
    a0, a1, a2, a3, as2 = key_at(kc32, ks, krow, ksrow, _tile_slot(*slot_of, min(int32(t_lo32 + gid), t_last)),
                                  tig, kb, sshift)
    b0, b1, b2, b3, bs2 = key_at(kc32, ks, krow, ksrow, _tile_slot(*slot_of, min(int32(t_lo32 + 8 + gid), t_last)),
                                  tig, kb, sshift)
    for t0 in range(t_lo32, t_hi32, int32(16)):
        u = int32(t0 + 2 * tig)
        ta = int32(t0 + gid)
        vrow, vsrow = _tile_rows(vc32, vs, vb0, vsb0, *addr, min(t0, t_last))
        xa, sa = value_at(vc32, vs, vrow, vsrow, _tile_slot(*slot_of, min(u, t_last)), gid, vb, sshift)
        xb, sb = value_at(vc32, vs, vrow, vsrow, _tile_slot(*slot_of, min(int32(u + 1), t_last)), gid, vb, sshift)
        xc, sc = value_at(vc32, vs, vrow, vsrow, _tile_slot(*slot_of, min(int32(u + 8), t_last)), gid, vb, sshift)
        xd, sd = value_at(vc32, vs, vrow, vsrow, _tile_slot(*slot_of, min(int32(u + 9), t_last)), gid, vb, sshift)
        # one scale a token: those of this lane's score tokens ta, ta + 8 (1 with block scales)
        va = _token_scale(vs, vsrow, _tile_slot(*slot_of, min(ta, t_last)), tok, table)
        vb8 = _token_scale(vs, vsrow, _tile_slot(*slot_of, min(int32(ta + 8), t_last)), tok, table)
        ka = _scale_f32(ks, as2, table) if tok else float32(1.0)
        kb8 = _scale_f32(ks, bs2, table) if tok else float32(1.0)
        if VQ_BUILD and kq:
            s00, s01, s10, s11 = key_tile_quads(a0, a1, b0, b1, kslot, tab, qa)
        else:
            s00, s01, s10, s11 = key_tile(kb, a0, a1, a2, a3, _abs_half2(as2), b0, b1, b2, b3, _abs_half2(bs2), kslot,
                                          tab, qa, not tok)
        krow, ksrow = _tile_rows(kc32, ks, kb0, ksb0, *addr, min(int32(t0 + 16), t_last))
        a0, a1, a2, a3, as2 = key_at(kc32, ks, krow, ksrow, _tile_slot(*slot_of, min(int32(ta + 16), t_last)),
                                      tig, kb, sshift)
        b0, b1, b2, b3, bs2 = key_at(kc32, ks, krow, ksrow, _tile_slot(*slot_of, min(int32(ta + 24), t_last)),
                                      tig, kb, sshift)
        alpha0, p00, p10, m0, l0 = _online_softmax(_masked(s00 * (inv0 * ka), ta, t_hi32, pos32, lim0),
                                                   _masked(s10 * (inv0 * kb8), int32(ta + 8), t_hi32, pos32, lim0),
                                                   m0, l0)
        alpha1, p01, p11, m1, l1 = _online_softmax(_masked(s01 * (inv1 * ka), ta, t_hi32, pos32, lim1),
                                                   _masked(s11 * (inv1 * kb8), int32(ta + 8), t_hi32, pos32, lim1),
                                                   m1, l1)
        if alpha0 != float32(1.0) or alpha1 != float32(1.0):
            # (exactly 1 while a row's maximum stands: in a long partition most tiles skip
            # the 32 multiplies; FlashAttention-3's rescaling rule, arXiv 2407.08608 §3)
            for i in range(HEAD_DIM // 16):
                oacc[4 * i] *= alpha0
                oacc[4 * i + 1] *= alpha1
                oacc[4 * i + 2] *= alpha0
                oacc[4 * i + 3] *= alpha1
        # the weights (times a token's value scale) as B of P·V: (token gid, rows 2tig, 2tig+1)
        # transposed to (row gid, tokens 2tig, 2tig+1), and the same for tokens 8-15
        if VQ_BUILD and vq:
            value_tile_quads(xa, xb, xc, xd, vslot, tab, movmatrix_trans(pack_half2(p00 * va, p01 * va)),
                             movmatrix_trans(pack_half2(p10 * vb8, p11 * vb8)), oacc)
        else:
            value_tile(vb, xa, xb, xc, xd, _abs_half2(sa), _abs_half2(sb), _abs_half2(sc), _abs_half2(sd), vslot, tab,
                       movmatrix_trans(pack_half2(p00 * va, p01 * va)),
                       movmatrix_trans(pack_half2(p10 * vb8, p11 * vb8)), oacc, not tok)
    return m0, m1, l0, l1


def _mma_partition(kb, vb, kq, vq, kc32, ks, vc32, vs, g, h, paged, kv_indices, first, page_size, t_lo, t_hi, pos0,
                   lim_base, q_len, causal, sshift, table, tab, kf, vf, qs, d, rb, r0, softmax_scale, active, p,
                   part_m, part_l, part_acc, lane):
    """A compressed partition on tensor cores, from the staged query rows ``qs`` to its stored
    ``(m, l, acc)`` (shared by the flat and the paged kernel; ``lim_base``: the position of the
    first query row of a causal group, ``kf``/``vf``: the pair tables' factors, ``kq``/``vq``:
    VQ quads on a side, ``table``: the layer's scale table; the VQ build reads one scale a
    token only, the layouts of the head VQ code's)."""
    qa = cuda.local.array(_QA_WORDS, dtype=uint32)
    oacc = cuda.local.array(_OUT_SUMS, dtype=float32)
    gid = lane >> 2
    tig = lane & 3
    inv = stage_query_fragments(qs, d, gid, tig, rb, softmax_scale * float32(LOG2E), qa) * kf
    # this lane's output rows 2tig, 2tig+1 take their factors from the quads that staged them
    inv0 = shfl_idx_f32(inv, 8 * tig)
    inv1 = shfl_idx_f32(inv, 8 * tig + 4)
    lim0 = lim1 = int32(0x7FFFFFFF)
    if causal:
        lim0 = int32(lim_base + (r0 + 2 * tig) % q_len)
        lim1 = int32(lim_base + (r0 + 2 * tig + 1) % q_len)
    tiles = (kb, vb, kq, vq, kc32, ks, vc32, vs, g, h, paged, kv_indices, first, page_size, t_lo, t_hi, pos0, lim0,
             lim1, sshift, tab, qa, inv0, inv1, oacc, lane, table)
    if VQ_BUILD:
        m0, m1, l0, l1 = mma_tiles(*tiles, True)
        vf = vf * float32(2.0 if static_itemsize(vs) == 1 else 1.0)  # (8-bit norms: halved in the weights)
    elif (int32(1) << sshift) >= HEAD_DIM // 32:  # (every 32-block shares a scale: one a token)
        m0, m1, l0, l1 = mma_tiles(*tiles, True)
    else:
        m0, m1, l0, l1 = mma_tiles(*tiles, False)
    store_mma_partition(m0, l0, oacc, 0, vf, active, rb, g, p, r0, lane, part_m, part_l, part_acc)
    store_mma_partition(m1, l1, oacc, 1, vf, active, rb, g, p, r0, lane, part_m, part_l, part_acc)


def _store_mma_partition(m, lsum, oacc, k, vf, active, rb, g, p, r0, lane, part_m, part_l, part_acc):
    """Partition ``p``'s ``(m, l, acc)`` of this lane's row ``2tig + k`` (``k`` 0 or 1; ``m``
    back to natural units, ``acc`` — coordinates ``s·gid + 2j`` and ``+ 1`` at ``oacc[4j +
    k]``, ``oacc[4j + 2 + k]``, ``s = HEAD_DIM / 8`` — times ``vf``, the V table's factor) if
    it is below ``rb``.
    Every lane calls it (the row sum is a shuffle over the lanes of one ``tig``)."""
    gid = lane >> 2
    rr = 2 * (lane & 3) + k
    lrow = _column_sum(lsum)
    if active and rr < rb:
        r = r0 + rr
        for j in range(HEAD_DIM // 16):
            part_acc[g, p, r, (HEAD_DIM // 8) * gid + 2 * j] = oacc[4 * j + k] * vf
            part_acc[g, p, r, (HEAD_DIM // 8) * gid + 2 * j + 1] = oacc[4 * j + 2 + k] * vf
        if gid == 0:
            part_m[g, p, r] = m * float32(LN2) if m != NEG_INF else NEG_INF
            part_l[g, p, r] = lrow


stage_query_fragments = cuda_device(_stage_query_fragments)
store_mma_partition = cuda_device(_store_mma_partition)
mma_tiles = cuda_device(_mma_tiles)
mma_partition = cuda_device(_mma_partition)
#: the partition of the head VQ build (``decode_attention_mma_vq``): :data:`VQ_BUILD` bound
#: True, one scale a token
mma_tiles_vq = cuda_device(specialize(_mma_tiles, "_vq", VQ_BUILD=True))
mma_partition_vq = cuda_device(specialize(_mma_partition, "_vq", VQ_BUILD=True, mma_tiles=mma_tiles_vq))
