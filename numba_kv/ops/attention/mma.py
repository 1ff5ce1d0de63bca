"""Tensor-core tiles of the compressed decode attention (kernel ``decode_attention_mma``).

One warp walks one partition of one KV row, 16 tokens per tile, with ``mma.sync`` m16n8k16
(binary16 operands, float32 accumulation; :mod:`numba_kv.ops.attention.ptx`) for both products, in the
FlashAttention-2 register layout (Dao, arXiv:2307.08691, §3.1): the score accumulators of
``Q·Kᵀ`` are, packed to binary16 pairs, exactly the A fragments of ``P·V``, so scores never
leave the registers.  Dequantization happens in registers straight into the B fragments
(BitDecoding, arXiv:2503.18773; pairs of binary16 as in QServe, arXiv:2405.04532):

* **pair tables**: a block's codebook expands to ``4**bits`` entries, one per pair of
  adjacent codes ``(c_j, c_{j+1})``, each the ``.f16x2`` word ``(cent[c_j], cent[c_{j+1}])``.
  The packing stores code ``j`` of a block at bit ``bits·j`` (LSB first), so the ``2·bits``
  bits at ``2·bits·i`` are the table index of pair ``i``: one shared-memory load decodes two
  values.  Each table is replicated ``rep`` times (``rep·4**bits`` = :data:`TAB_SLOTS`) and
  lane ``ℓ`` reads replica ``ℓ mod rep``: 32 replicas (3 bits and fewer) make every lane hit
  its own bank, so the random indices cost no bank conflicts.
* **scores** ``S = Q·Kᵀ`` per 8 tokens: ``A`` = the query rows (row ``gid``; rows past
  :data:`~numba_kv.ops.attention.warp.WARP_ROWS` are zero), ``B`` = 8 tokens' keys, one
  token per lane quad (token ``gid``), lane ``tig`` holding the 32 coordinates of block
  ``tig`` (the reduction order inside a product is free, so the k-slots of the fragments are
  mapped to the coordinates that lie next to each other in the packed bytes: the query
  fragments are permuted the same way once per partition).  The key's block scale multiplies
  the decoded pair (``mul.rn.f16x2``).
* **softmax**: lane ``(gid, tig)`` holds the scores of row ``gid`` for tokens ``2tig, 2tig+1``
  of each 8-token chunk; the tile's row maximum is two xor shuffles over the quad; the row
  sums stay per lane until the end of the partition.  Scores are kept in base-2 units (the
  queries are pre-multiplied by ``softmax_scale·log2 e``), the stored maximum goes back to
  natural units for the merge.
* **values** ``O += P·V``: ``A`` = the weights (from the score registers), ``B`` = 16 tokens
  × 8 coordinates per product; lane ``(gid, tig)`` decodes coordinates ``16·gid … 16·gid + 15``
  of tokens ``2tig, 2tig+1, 2tig+8, 2tig+9`` as same-token pairs and regroups two tokens'
  halves into one B register (a byte permutation); 16 products cover ``head_dim = 128``.

Range: binary16 holds the operands exactly as far as it can — the queries of a row are scaled
by a power of two that puts their largest magnitude in ``[2**13, 2**14)`` (undone on the
float32 scores), codebook values lie in ``[-1, 1]`` and scales are binary16 already, weights
are in ``[0, 1]``: finite inputs stay finite.

Flat and paged: :func:`mma_partition` is the whole compressed partition of the one tensor-core
kernel source, compiled for flat caches (``decode_attention_mma``) and paged pools
(``paged_decode_attention_mma``); :func:`token_address` is the only place they differ (a flat
cache's arrays are viewed as ``[rows, 1, capacity, ·]``, a pool's are
``[pages, heads, page_size, ·]``).

Simulator: the primitives of :mod:`numba_kv.ops.attention.ptx` exchange lanes between block barriers,
so the kernel is launched there with one warp per block (every lane of a block reaches each
exchange together).
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int64, uint32, uint64

from ..._jit import cuda_device_ll as cuda_device
from .cores import NEG_INF
from .ptx import hmul2, mma_16816, pack_half2, shfl_xor_f32

__all__ = ["LN2", "LOG2E", "MMA_BITS", "MMA_BLOCKS_PER_SM", "MMA_HEAD_DIM", "MMA_TAB_WORDS", "MMA_THREADS", "MMA_TILE",
           "TAB_SLOTS", "build_pair_table", "build_tables", "key_chunk", "load_key", "load_value", "mma_partition",
           "mma_partition_size", "mma_tiles", "pair_table_replicas", "reference_pair_table", "stage_query_fragments",
           "store_mma_partition", "token_address", "value_tile"]

#: the head_dim of the tensor-core kernel (4 blocks of 32: one per lane of a quad)
MMA_HEAD_DIM = 128
#: tokens per tile (two 8-token score products, one 16-token value product)
MMA_TILE = 16
#: threads per block of the kernel and its launch bounds' blocks per SM: ptxas takes 183
#: registers on sm_90 (2 blocks, 8 warps per SM).  Bounds of 3 blocks hold sm_90 at 168
#: registers without a spill but make sm_80 spill (``benchmarks/gpu_mma_check.py`` times both)
MMA_THREADS = 128
MMA_BLOCKS_PER_SM = 2
#: code widths with a pair table (``4**bits`` entries)
MMA_BITS = (2, 3, 4)
#: 32-bit words per pair table in shared memory (8 KiB): entries × replicas
TAB_SLOTS = 2048
#: the block's two tables (K at word 0, V at word TAB_SLOTS)
MMA_TAB_WORDS = 2 * TAB_SLOTS
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def mma_partition_size(n_tokens: int, n_rows_kv: int) -> int:
    """Tokens per partition (one warp each) of the tensor-core kernel: about 3,200 warps in all
    (some 24 per SM of an H100, two waves of its 12 resident ones), in multiples of 64 between
    128 and 2048.  Longer than the warp kernel's: a block builds its pair tables once, and
    at small batch the merge then reads a few hundred partitions per row, not thousands."""
    per = -(-max(n_rows_kv, 1) * max(n_tokens, 1) // 3200)
    return int(min(2048, max(128, -(-per // 64) * 64)))


def pair_table_replicas(bits: int) -> int:
    """Replicas of a ``bits``-wide pair table in :data:`TAB_SLOTS` words (at most 32, one per
    lane)."""
    return min(32, TAB_SLOTS >> (2 * bits))


@cuda_device
def build_pair_table(tab, o, cent, bits, tid, nth):
    """``tab[o + e·rep + r] = f·(cent[e mod 2**bits], cent[e >> bits])`` as ``.f16x2`` for every
    pair index ``e < 4**bits`` and replica ``r < rep`` (block-cooperative: thread ``tid`` of
    ``nth``; the caller puts a block barrier after it), with ``f`` the power of two that
    brings the largest ``|centroid|`` to at most 1 (so ``f·c·scale`` stays inside binary16 for
    every binary16 scale).  Returns ``1/f`` (exact), which the caller multiplies back."""
    n = 1 << (2 * bits)
    rep = min(32, TAB_SLOTS >> (2 * bits))
    mask = (1 << bits) - 1
    cmax = float32(0.0)
    for i in range(mask + 1):
        cmax = max(cmax, abs(cent[0, i]))
    f = float32(1.0)
    while cmax * f > float32(1.0):
        f *= float32(0.5)
    for i in range(tid, n * rep, nth):
        e = i // rep
        tab[o + i] = pack_half2(cent[0, e & mask] * f, cent[0, e >> bits] * f)
    return float32(1.0) / f


@cuda_device
def build_tables(tab, kcent, vcent, kbits, vbits, tid, nth):
    """The block's two pair tables (K at word 0, V at :data:`TAB_SLOTS`) from row 0 of each
    codebook; returns ``(kb, vb, kf, vf)``: the widths and the factors to multiply back
    (:func:`build_pair_table`).  The caller's next block barrier publishes them."""
    kb = kbits[0]
    vb = vbits[0]
    kf = build_pair_table(tab, 0, kcent, kb, tid, nth)
    vf = build_pair_table(tab, TAB_SLOTS, vcent, vb, tid, nth)
    return kb, vb, kf, vf


@cuda_device
def _field(w0, w1, w2, w3, pos, width):
    """Bits ``[pos, pos + width)`` of the little-endian 128-bit word ``w3:w2:w1:w0`` (scalars
    and selects, never an indexed array: a loop that stays rolled keeps them in registers)."""
    wi = pos >> 5
    off = pos & 31
    lo = w0 if wi == 0 else (w1 if wi == 1 else (w2 if wi == 2 else w3))
    hi = w1 if wi == 0 else (w2 if wi == 1 else (w3 if wi == 2 else uint32(0)))
    x = (uint64(hi) << uint64(32)) | uint64(lo)
    return uint32((x >> uint64(off)) & uint64((1 << width) - 1))


@cuda_device
def _abs_half2(raw):
    """``|scale|`` of a stored binary16 scale in both halves of a ``.f16x2`` word (infinities
    and NaNs read as 0, like the kernels' binary16 table)."""
    h = uint32(raw) & uint32(0x7FFF)
    h = uint32(0) if h >= uint32(0x7C00) else h
    return h | (h << uint32(16))


@cuda_device
def token_address(paged, kv_indices, first, page_size, g, t):
    """``(page, slot)`` of token ``t``: ``(g, t)`` in a flat cache (its codes viewed as
    ``[n_g, 1, capacity, ·]``), slot ``t mod page_size`` of page ``kv_indices[first + t //
    page_size]`` in a paged pool (``[pages, num_kv_heads, page_size, ·]``).  The one place the
    two token spaces differ."""
    if paged:
        i = t // page_size
        return int64(kv_indices[first + i]), t - i * page_size
    return int64(g), t


@cuda_device
def load_key(kc32, ks, page, h, slot, tig, kb, sshift):
    """Lane ``(·, tig)``'s packed words of the token at ``(page, h, slot)``, block ``tig`` (``kb``
    words; the others 0) and its scale (:func:`_abs_half2`), loaded ahead of their use (see
    :func:`mma_tiles`)."""
    base = tig * kb
    w0 = kc32[page, h, slot, base]
    w1 = kc32[page, h, slot, base + 1] if kb > 1 else uint32(0)
    w2 = kc32[page, h, slot, base + 2] if kb > 2 else uint32(0)
    w3 = kc32[page, h, slot, base + 3] if kb > 3 else uint32(0)
    return w0, w1, w2, w3, _abs_half2(ks[page, h, slot, tig >> sshift])


@cuda_device
def load_value(vc32, vs, page, h, slot, gid, vb, sshift):
    """Lane ``(gid, ·)``'s ``16·vb`` code bits of coordinates ``16·gid … + 15`` of the token at
    ``(page, h, slot)`` (LSB first, in a ``uint64``) and the scale of their block."""
    start = 16 * vb * gid
    wi = start >> 5
    w0 = vc32[page, h, slot, wi]
    w1 = vc32[page, h, slot, wi + 1] if vb > 2 else uint32(0)  # (16 coordinates span two words)
    x = ((uint64(w1) << uint64(32)) | uint64(w0)) >> uint64(start & 31)
    return x, _abs_half2(vs[page, h, slot, (gid >> 1) >> sshift])


@cuda_device
def _load_value_at(vc32, vs, paged, kv_indices, first, page_size, g, h, t, gid, vb, sshift):
    page, slot = token_address(paged, kv_indices, first, page_size, g, t)
    return load_value(vc32, vs, page, h, slot, gid, vb, sshift)


@cuda_device
def _load_key_at(kc32, ks, paged, kv_indices, first, page_size, g, h, t, tig, kb, sshift):
    page, slot = token_address(paged, kv_indices, first, page_size, g, t)
    return load_key(kc32, ks, page, h, slot, tig, kb, sshift)


def _make_key_chunk(kb: int):
    """Scores of the 8 tokens of one chunk: lane ``(gid, tig)`` decodes its token's block
    ``tig`` (``kb``-bit codes in the words ``w0…w3``, scale ``s2``) into B fragments and gets
    back its row ``gid``'s scores of the chunk's tokens ``2tig`` and ``2tig + 1``."""
    pb = 2 * kb
    rep = min(32, TAB_SLOTS >> pb)

    def key_chunk(w0, w1, w2, w3, s2, lane, tab, qa):
        slot = lane & (rep - 1)
        c0 = c1 = c2 = c3 = float32(0.0)
        e0 = e1 = e2 = e3 = float32(0.0)
        for s in range(0, 8, 2):
            # two independent accumulator chains (even and odd k-steps) hide the mma latency
            b0 = hmul2(tab[_field(w0, w1, w2, w3, pb * (2 * s), pb) * rep + slot], s2)
            b1 = hmul2(tab[_field(w0, w1, w2, w3, pb * (2 * s + 1), pb) * rep + slot], s2)
            c0, c1, c2, c3 = mma_16816(qa[2 * s], uint32(0), qa[2 * s + 1], uint32(0), b0, b1, c0, c1, c2, c3)
            b0 = hmul2(tab[_field(w0, w1, w2, w3, pb * (2 * s + 2), pb) * rep + slot], s2)
            b1 = hmul2(tab[_field(w0, w1, w2, w3, pb * (2 * s + 3), pb) * rep + slot], s2)
            e0, e1, e2, e3 = mma_16816(qa[2 * s + 2], uint32(0), qa[2 * s + 3], uint32(0), b0, b1, e0, e1, e2, e3)
        return c0 + e0, c1 + e1

    key_chunk.__name__ = key_chunk.__qualname__ = f"key_chunk_k{kb}"
    return cuda_device(key_chunk)


_KEY_CHUNK_2, _KEY_CHUNK_3, _KEY_CHUNK_4 = (_make_key_chunk(kb) for kb in MMA_BITS)


@cuda_device
def key_chunk(kb, w0, w1, w2, w3, s2, lane, tab, qa):
    """:func:`_make_key_chunk` for the width ``kb`` (the same branch on every lane)."""
    if kb == 3:
        return _KEY_CHUNK_3(w0, w1, w2, w3, s2, lane, tab, qa)
    if kb == 4:
        return _KEY_CHUNK_4(w0, w1, w2, w3, s2, lane, tab, qa)
    return _KEY_CHUNK_2(w0, w1, w2, w3, s2, lane, tab, qa)


def _make_value_tile(vb: int):
    """``O += P·V`` over one 16-token tile: lane ``(gid, tig)`` holds the code bits of
    coordinates ``16·gid … + 15`` of tokens ``2tig, 2tig+1`` (``xa``, ``xb``: the first B
    register) and ``2tig+8, 2tig+9`` (``xc``, ``xd``: the second) and decodes them through
    the pair table; product ``j`` covers coordinates ``16·n + j``."""
    pb = 2 * vb
    rep = min(32, TAB_SLOTS >> pb)
    pmask = (1 << pb) - 1

    def value_tile(xa, xb, xc, xd, sa, sb, sc, sd, lane, tab, o, pa0, pa2, oacc):
        slot = lane & (rep - 1)
        for i in range(8):
            sh = uint64(pb * i)
            ha = hmul2(tab[o + uint32((xa >> sh) & uint64(pmask)) * rep + slot], sa)
            hb = hmul2(tab[o + uint32((xb >> sh) & uint64(pmask)) * rep + slot], sb)
            hc = hmul2(tab[o + uint32((xc >> sh) & uint64(pmask)) * rep + slot], sc)
            hd = hmul2(tab[o + uint32((xd >> sh) & uint64(pmask)) * rep + slot], sd)
            lo16 = uint32(0xFFFF)
            hi16 = uint32(0xFFFF0000)
            # coordinate 2i: the low halves of two tokens; coordinate 2i + 1: the high halves
            b0 = (ha & lo16) | (hb << uint32(16))
            b1 = (hc & lo16) | (hd << uint32(16))
            oacc[4 * i], oacc[4 * i + 1], _, _ = mma_16816(pa0, uint32(0), pa2, uint32(0), b0, b1, oacc[4 * i],
                                                          oacc[4 * i + 1], float32(0.0), float32(0.0))
            b0 = (ha >> uint32(16)) | (hb & hi16)
            b1 = (hc >> uint32(16)) | (hd & hi16)
            oacc[4 * i + 2], oacc[4 * i + 3], _, _ = mma_16816(pa0, uint32(0), pa2, uint32(0), b0, b1,
                                                              oacc[4 * i + 2], oacc[4 * i + 3], float32(0.0),
                                                              float32(0.0))

    value_tile.__name__ = value_tile.__qualname__ = f"value_tile_v{vb}"
    return cuda_device(value_tile)


_VALUE_TILE_2, _VALUE_TILE_3, _VALUE_TILE_4 = (_make_value_tile(vb) for vb in MMA_BITS)


@cuda_device
def value_tile(vb, xa, xb, xc, xd, sa, sb, sc, sd, lane, tab, o, pa0, pa2, oacc):
    """:func:`_make_value_tile` for the width ``vb`` (the same branch on every lane)."""
    if vb == 3:
        _VALUE_TILE_3(xa, xb, xc, xd, sa, sb, sc, sd, lane, tab, o, pa0, pa2, oacc)
    elif vb == 4:
        _VALUE_TILE_4(xa, xb, xc, xd, sa, sb, sc, sd, lane, tab, o, pa0, pa2, oacc)
    else:
        _VALUE_TILE_2(xa, xb, xc, xd, sa, sb, sc, sd, lane, tab, o, pa0, pa2, oacc)


@cuda_device
def _quad_max(x):
    x = max(x, shfl_xor_f32(x, 1))
    return max(x, shfl_xor_f32(x, 2))


@cuda_device
def _quad_sum(x):
    x = x + shfl_xor_f32(x, 1)
    return x + shfl_xor_f32(x, 2)


@cuda_device
def stage_query_fragments(qs, d, gid, tig, rb, scale, qa):
    """This lane's A fragments of the query row ``gid`` (``qs[gid·d + 32·tig + …]``, block
    ``tig``): ``qa[2s] = (y[4s], y[4s+1])``, ``qa[2s+1] = (y[4s+2], y[4s+3])`` with ``y =
    q·scale·2**k``, the power of two ``2**k`` of the row putting ``max|y|`` in ``[2**13,
    2**14)``; zero rows past ``rb``.  Returns ``2**-k`` (multiplies the scores back)."""
    o = gid * d + 32 * tig
    amax = float32(0.0)
    if gid < rb:
        for j in range(32):
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
    for s in range(8):
        if gid < rb:
            qa[2 * s] = pack_half2(qs[o + 4 * s] * k, qs[o + 4 * s + 1] * k)
            qa[2 * s + 1] = pack_half2(qs[o + 4 * s + 2] * k, qs[o + 4 * s + 3] * k)
        else:
            qa[2 * s] = uint32(0)
            qa[2 * s + 1] = uint32(0)
    return float32(1.0) / f


@cuda_device
def _masked(x, t, t_hi, pos0, lim):
    return x if t < t_hi and pos0 + t <= lim else NEG_INF


@cuda_device
def mma_tiles(kb, vb, kc32, ks, vc32, vs, g, h, paged, kv_indices, first, page_size, t_lo, t_hi, pos0, lim, sshift,
              tab, qa, inv_f, oacc, lane):
    """The 16-token tiles of a compressed partition ``[t_lo, t_hi)`` of KV row ``g`` (layouts in
    the module docstring; token ``t`` sits at position ``pos0 + t`` and lives where
    :func:`token_address` says: KV head ``h`` of a flat cache's row ``g`` or of a paged
    sequence whose page list starts at ``kv_indices[first]``); ``lim``: the last position row
    ``gid`` sees.  ``oacc`` (32 float32: product ``j``'s ``c0, c1`` at ``2j, 2j + 1``) and the
    returned ``(m, l)`` (base 2; ``l`` this lane's share of the row sum) start from an empty
    state.

    Loads run ahead of their use, so that a warp waits for memory at most once per tile: a
    tile's value words are requested before its keys are scored, and the next tile's key
    words before this tile's softmax and ``P·V`` (tokens past the partition read its last
    token, whose weights are exact zeros)."""
    gid = lane >> 2
    tig = lane & 3
    for i in range(32):
        oacc[i] = float32(0.0)
    m = NEG_INF
    lsum = float32(0.0)
    t_last = max(t_hi - 1, int64(0))
    a0, a1, a2, a3, as2 = _load_key_at(kc32, ks, paged, kv_indices, first, page_size, g, h, min(t_lo + gid, t_last),
                                       tig, kb, sshift)
    b0, b1, b2, b3, bs2 = _load_key_at(kc32, ks, paged, kv_indices, first, page_size, g, h,
                                       min(t_lo + 8 + gid, t_last), tig, kb, sshift)
    for t0 in range(t_lo, t_hi, 16):
        u = t0 + 2 * tig
        xa, sa = _load_value_at(vc32, vs, paged, kv_indices, first, page_size, g, h, min(u, t_last), gid, vb, sshift)
        xb, sb = _load_value_at(vc32, vs, paged, kv_indices, first, page_size, g, h, min(u + 1, t_last), gid, vb,
                                sshift)
        xc, sc = _load_value_at(vc32, vs, paged, kv_indices, first, page_size, g, h, min(u + 8, t_last), gid, vb,
                                sshift)
        xd, sd = _load_value_at(vc32, vs, paged, kv_indices, first, page_size, g, h, min(u + 9, t_last), gid, vb,
                                sshift)
        x00, x01 = key_chunk(kb, a0, a1, a2, a3, as2, lane, tab, qa)
        x10, x11 = key_chunk(kb, b0, b1, b2, b3, bs2, lane, tab, qa)
        a0, a1, a2, a3, as2 = _load_key_at(kc32, ks, paged, kv_indices, first, page_size, g, h,
                                           min(t0 + 16 + gid, t_last), tig, kb, sshift)
        b0, b1, b2, b3, bs2 = _load_key_at(kc32, ks, paged, kv_indices, first, page_size, g, h,
                                           min(t0 + 24 + gid, t_last), tig, kb, sshift)
        x00 = _masked(x00 * inv_f, u, t_hi, pos0, lim)
        x01 = _masked(x01 * inv_f, u + 1, t_hi, pos0, lim)
        x10 = _masked(x10 * inv_f, u + 8, t_hi, pos0, lim)
        x11 = _masked(x11 * inv_f, u + 9, t_hi, pos0, lim)
        m_new = max(m, _quad_max(max(max(x00, x01), max(x10, x11))))
        # an all-masked row so far keeps m = -inf: its weights and rescale are exact zeros
        m_use = m_new if m_new != NEG_INF else float32(0.0)
        alpha = math.exp2(m - m_use)
        p00 = math.exp2(x00 - m_use)
        p01 = math.exp2(x01 - m_use)
        p10 = math.exp2(x10 - m_use)
        p11 = math.exp2(x11 - m_use)
        lsum = lsum * alpha + ((p00 + p01) + (p10 + p11))
        m = m_new
        for i in range(32):
            oacc[i] *= alpha
        value_tile(vb, xa, xb, xc, xd, sa, sb, sc, sd, lane, tab, TAB_SLOTS, pack_half2(p00, p01),
                   pack_half2(p10, p11), oacc)
    return m, lsum


@cuda_device
def mma_partition(kb, vb, kc32, ks, vc32, vs, g, h, paged, kv_indices, first, page_size, t_lo, t_hi, pos0, lim_base,
                  q_len, causal, sshift, tab, kf, vf, qs, d, rb, r0, softmax_scale, active, p, part_m, part_l,
                  part_acc, lane):
    """A compressed partition on tensor cores, from the staged query rows ``qs`` to its stored
    ``(m, l, acc)`` (shared by the flat and the paged kernel; ``lim_base``: the position of the
    first query row of a causal group, ``kf``/``vf``: the pair tables' factors)."""
    qa = cuda.local.array(16, dtype=uint32)
    oacc = cuda.local.array(32, dtype=float32)
    gid = lane >> 2
    inv_f = stage_query_fragments(qs, d, gid, lane & 3, rb, softmax_scale * float32(LOG2E), qa) * kf
    lim = int64(0x7FFFFFFFFFFFFFFF)
    if causal:
        lim = int64(lim_base) + (r0 + gid) % q_len
    m, lsum = mma_tiles(kb, vb, kc32, ks, vc32, vs, g, h, paged, kv_indices, first, page_size, t_lo, t_hi, pos0, lim,
                        sshift, tab, qa, inv_f, oacc, lane)
    store_mma_partition(m, lsum, oacc, vf, active, rb, g, p, r0, lane, part_m, part_l, part_acc)


@cuda_device
def store_mma_partition(m, lsum, oacc, vf, active, rb, g, p, r0, lane, part_m, part_l, part_acc):
    """Partition ``p``'s ``(m, l, acc)`` of rows ``r0 … r0 + rb − 1`` (row ``gid`` from lane quad
    ``gid``; ``m`` back to natural units, ``acc`` times ``vf``, the V table's factor).  Every
    lane calls it (the row sum is a quad shuffle)."""
    gid = lane >> 2
    tig = lane & 3
    lrow = _quad_sum(lsum)
    if active and gid < rb:
        r = r0 + gid
        for j in range(16):
            part_acc[g, p, r, 32 * tig + j] = oacc[2 * j] * vf
            part_acc[g, p, r, 32 * tig + 16 + j] = oacc[2 * j + 1] * vf
        if tig == 0:
            part_m[g, p, r] = m * float32(LN2) if m != NEG_INF else NEG_INF
            part_l[g, p, r] = lrow


def reference_pair_table(cent: np.ndarray, bits: int) -> tuple[np.ndarray, float]:
    """The pair table of codebook ``cent`` (one replica, ``uint32[4**bits]``) and its factor
    ``1/f`` (:func:`build_pair_table`), in NumPy, for tests."""
    c = np.asarray(cent[: 1 << bits], np.float32)
    f = 1.0
    while float(np.abs(c).max()) * f > 1.0:
        f *= 0.5
    e = np.arange(1 << (2 * bits))
    pairs = (np.stack([c[e & ((1 << bits) - 1)], c[e >> bits]], axis=1) * np.float32(f)).astype(np.float16)
    return pairs.view(np.uint32).reshape(-1), 1.0 / f
