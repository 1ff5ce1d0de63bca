"""Single-source cores of the fused decode attention, compiled for the CPU and for CUDA.

Shared by the partition kernels of both targets (:mod:`numba_kv.ops.attention.kernels`), which
are one source each for flat caches and paged pools:

* token decoding: :func:`_decode8` (eight packed indices → scaled centroids), on top of it
  :func:`_load_token_fast` (every block of one width; the CPU twins decode with the vector
  decoders of :mod:`numba_kv.ops.attention.cpu`, mixed widths included);
* the partition bounds of the flat (:func:`_partition_bounds`) and the paged
  (:func:`_paged_bounds`) token spaces, and on top of them the two *addressings* the kernel
  sources are compiled with (:func:`addressing`: a KV row's bounds, a token's page and slot,
  an array's plane; the only place flat and paged differ), the causal visibility rule (:func:`_visible`),
  the QJL sign decoding (:func:`_sign_pm1`, :func:`_qjl_dot`) and the online-softmax state
  update (:func:`_rescale`, :func:`_online_update`; the CPU twins compute ``alpha`` with
  their vectorized ``exp`` instead of :func:`_rescale`);
* the merge of the split-K partitions (log-sum-exp, flash-decoding): one term of a column
  sum (:func:`_column_term`; the lanes of the sums are the merge module's) or one
  butterfly stage of the inverse rotation (:func:`_butterfly_pairs`) per call, so that a
  CUDA block spreads a row over its threads and the CPU twin runs the same arithmetic with one "thread";
* the cooperative stages of the CUDA tile loop (``tid``/``nth``: the calling thread and the
  number of threads sharing the work; the kernels put ``cuda.syncthreads()`` between stages).
"""

from __future__ import annotations

import math

import numpy as np
from numba import float32, int32, int64

from ..._jit import specialize, twin
from .._headquant_lanes import head_scale

NEG_INF = np.float32(-np.inf)
#: a biased logit is clamped to ``±F32_MAX``: the scaled logits stay within ``2**124`` (the
#: input limits), but a finite bias near the float32 maximum (``finfo.min`` as an additive
#: mask) could still round the sum to ±inf, and ``inf − inf`` made the row's output NaN
F32_MAX = np.float32(np.finfo(np.float32).max)
#: where a norm8 layer's scale table (``numba_kv.ops.norm8.norm8_scale_table``) holds its 256
#: decoded norms, after ``F16_ABS_TABLE``: the kernels read a uint8 scale plane's entry ``k``
#: at ``NORM8_SLOT0 + k`` (:func:`_scale_slot`)
NORM8_SLOT0 = 1 << 16


# --- token decoding ----------------------------------------------------------------------
def _decode8(crow, p, bits, cent, sa, dst, o):
    """``dst[o + k] = sa · cent[idx_k]``, ``k < 8``: the ``bits``-wide indices packed LSB
    first in the ``bits`` bytes ``crow[p:p + bits]`` (one group of eight of the packing)."""
    if bits == 3:
        w = int64(crow[p]) | (int64(crow[p + 1]) << 8) | (int64(crow[p + 2]) << 16)
        for k in range(8):
            dst[o + k] = cent[(w >> (3 * k)) & 7] * sa
    elif bits == 4:
        w = (int64(crow[p]) | (int64(crow[p + 1]) << 8) | (int64(crow[p + 2]) << 16)
             | (int64(crow[p + 3]) << 24))
        for k in range(8):
            dst[o + k] = cent[(w >> (4 * k)) & 15] * sa
    elif bits == 2:
        w = int64(crow[p]) | (int64(crow[p + 1]) << 8)
        for k in range(8):
            dst[o + k] = cent[(w >> (2 * k)) & 3] * sa
    else:  # any other width: bit by bit
        w = int64(0)
        for j in range(bits):
            w |= int64(crow[p + j]) << (8 * j)
        mask = (int64(1) << bits) - 1
        for k in range(8):
            dst[o + k] = cent[(w >> (bits * k)) & mask] * sa


def _decode8_vq(crow, p, bits, cent, sa, dst, o):
    """Head VQ code (:mod:`numba_kv.ops.headvq`): ``dst[o + m·i + j] = sa · cent[m·byte_i + j]``
    for the ``bits`` bytes ``byte_i = crow[p + i]``, ``m = 8 / bits`` coordinates per byte
    (pairs at 4 bits, quads at 2): the same eight values and bytes as :func:`_decode8`,
    ``cent`` the flattened ``[256, m]`` codebook."""
    if bits == 4:
        for i in range(4):
            c = int64(crow[p + i]) << 1
            dst[o + 2 * i] = cent[c] * sa
            dst[o + 2 * i + 1] = cent[c + 1] * sa
    else:
        for i in range(2):
            c = int64(crow[p + i]) << 2
            for j in range(4):
                dst[o + 4 * i + j] = cent[c + j] * sa


def _scale_slot(splane, s):
    """Index in the kernels' scale table of entry ``s`` of the compressed-scale plane
    ``splane``: the binary16 pattern itself for a uint16 plane, ``NORM8_SLOT0 + s`` for the
    8-bit norm codes of a uint8 plane (``norm_bits=8``, whose layer passes
    ``numba_kv.ops.norm8.norm8_scale_table``: ``F16_ABS_TABLE`` then the 256 decoded norms).
    The itemsize is a constant of the compiled plane type, so the offset folds away: one
    source serves both planes, and the exact window's binary16 scales keep reading the
    table's first part."""
    return int64(s) + NORM8_SLOT0 * (2 - splane.itemsize)


def _load_token_fast(crow, srow, cent, bits, nb, sshift, scale_table, dst):
    """``dst[0:32·nb] = |a| · c[idx_j]`` for one token whose blocks all have width ``bits``
    and codebook ``cent``; scales (one per ``2**sshift`` blocks: a shift, a 64-bit division
    per block costs ~25 % of the CPU kernel) decoded through the exact binary16 table
    ``scale_table``."""
    for b in range(nb):
        sa = scale_table[_scale_slot(srow, srow[b >> sshift])]
        for grp in range(4):
            _decode8(crow, (4 * b + grp) * bits, bits, cent, sa, dst, b * 32 + grp * 8)


def _is_uniform(bits_b):
    """True when every block has the same width."""
    for b in range(1, bits_b.shape[0]):
        if bits_b[b] != bits_b[0]:
            return False
    return True


# --- scores, visibility, softmax ---------------------------------------------------------
def _sign_pm1(byte, k):
    """QJL sign decoding: bit ``k`` of a packed sign byte as ``±1.0`` (bit set = +1, LSB
    first), computed as ``2·bit − 1`` (a shift per lane: vectorizes on the CPU)."""
    return float32((int32(byte) >> k) & 1) * float32(2.0) - float32(1.0)


def _qjl_dot(sqrow, sigrow, m):
    """``Σ_j sqrow[j] · σ_j`` with the packed signs ``σ`` of :func:`_sign_pm1`: the QJL
    estimate of ``⟨q, r⟩`` up to its constant (Zandieh et al., arXiv:2406.03482)."""
    s = float32(0.0)
    for j in range(m):
        s += sqrow[j] * _sign_pm1(sigrow[j >> 3], j & 7)
    return s


def _visible(pos, q_pos0, r, q_len, causal):
    """Causal rule: query row ``r`` (position ``q_pos0 + r % q_len``) sees token position
    ``pos`` iff ``pos`` is not after it (always, without ``causal``)."""
    return (not causal) or pos <= q_pos0 + (r % q_len)


def _rescale(m_old, m_new):
    """Online-softmax factor ``exp(m_old − m_new)`` of the running sum and accumulator when
    the running max moves from ``m_old`` to ``m_new``; exactly 0 while ``m_old`` is ``-inf``
    (nothing accumulated yet; avoids ``exp(-inf + inf)``)."""
    return math.exp(m_old - m_new) if m_old != NEG_INF else float32(0.0)


def _online_update(m, l, r, m_new, alpha, tile_sum):
    """Fold one tile into query row ``r``'s online-softmax state (Milakov & Gimelshein,
    arXiv:1805.02867): ``l[r] = alpha·l[r] + tile_sum``, ``m[r] = m_new``, where ``alpha =
    exp(m[r] − m_new)`` (see :func:`_rescale`) also rescales the row's accumulator and
    ``tile_sum = Σ exp(s − m_new)`` over the tile."""
    l[r] = l[r] * alpha + tile_sum
    m[r] = m_new


def _partition_bounds(p, n_comp_parts, part_size, n_comp, n_exact):
    """``(compressed, t_lo, t_hi)`` of partition ``p`` of the flat token space: the first
    ``n_comp_parts`` partitions cover the ``n_comp`` compressed tokens, the rest the
    ``n_exact`` exact ones (each range indexes its own buffers)."""
    if p < n_comp_parts:
        t_lo = int64(p) * part_size
        return True, t_lo, min(int64(n_comp), t_lo + part_size)
    t_lo = int64(p - n_comp_parts) * part_size
    return False, t_lo, min(int64(n_exact), t_lo + part_size)


def _paged_bounds(seq, p, part_size, kv_indptr, kv_last_page_len, page_size):
    """``(first, T, t_lo, t_hi)`` of partition ``p`` of sequence ``seq`` in a page table:
    its first entry in ``kv_indices``, its length and the partition's token range."""
    first = int64(kv_indptr[seq])
    npages = int64(kv_indptr[seq + 1]) - first
    T = int64(0)
    if npages > 0:
        T = (npages - 1) * page_size + int64(kv_last_page_len[seq])
    t_lo = int64(p) * part_size
    return first, T, t_lo, min(T, t_lo + part_size)


# --- merge of the partitions ---------------------------------------------------------------
def _merge_max(part_m, g, r, p0, n_parts, pstep):
    """Largest running max of query row ``(g, r)`` over partitions ``p0, p0 + pstep, … <
    n_parts`` (a thread's share; the maximum is exact in any order)."""
    m_star = NEG_INF
    for p in range(p0, n_parts, pstep):
        m_star = max(m_star, part_m[g, p, r])
    return m_star


#: the partition merge's softmax denominator is summed in this many interleaved lanes (lane
#: ``k`` adds the partitions ``p ≡ k``, in order), then by :func:`_lane_tree`: a fixed order
#: that does not depend on the threads, and independent loads in flight on a GPU (issue 27:
#: one serial sum over 256 partitions was most of a batch-1 step)
DENOM_LANES = 32
#: the column sums' interleaved lanes (registers per thread on a GPU)
COLUMN_LANES = 8


def _merge_denom_lane(part_m, part_l, g, r, k, n_parts, m_star):
    """Lane ``k`` of the softmax denominator of row ``(g, r)``: ``Σ exp(m_p − m*) · l_p`` over
    the non-empty partitions ``p = k, k + DENOM_LANES, … < n_parts``, in that order."""
    denom = float32(0.0)
    for p in range(k, n_parts, DENOM_LANES):
        w = part_m[g, p, r]
        if w != NEG_INF:
            denom += math.exp(w - m_star) * part_l[g, p, r]
    return denom


def _lane_tree(a, o, n):
    """``a[o] + … + a[o + n − 1]`` (``n`` a power of two) as a pairwise tree, in place:
    ``a[o + k] += a[o + k + h]`` for ``h = n/2 … 1``; returns ``a[o]``."""
    h = n >> 1
    while h > 0:
        for k in range(h):
            a[o + k] = a[o + k] + a[o + k + h]
        h >>= 1
    return a[o]


def _merge_weights(part_m, g, r, p0, p1, pstep, m_star, wbuf, base):
    """``wbuf[p − base] = exp(m_p − m*)`` (0 for an empty partition) for ``p = p0, p0 + pstep, … < p1``."""
    for p in range(p0, p1, pstep):
        w = part_m[g, p, r]
        wbuf[p - base] = math.exp(w - m_star) if w != NEG_INF else float32(0.0)


def _column_term(wbuf, part_acc, g, p, r, j, p_hi, base, s):
    """``s + wbuf[p − base] · acc_p[j]`` where ``p < p_hi`` and the weight is not 0 (an empty
    or vanishing partition adds nothing, not even a signed zero), else ``s``."""
    if p < p_hi:
        w = wbuf[p - base]
        if w != float32(0.0):
            s += w * part_acc[g, p, r, j]
    return s


def _butterfly_pairs(buf, h, d, i0, istep):
    """Pairs ``i0, i0 + istep, … < d/2`` of the radix-2 stage of stride ``h``: pair ``i``
    maps ``(buf[a], buf[a + h]) → (x + y, x − y)`` at ``a = (i // h)·2h + i % h``.  Stages
    ``h = 1 … 16`` are the 32-block Walsh–Hadamard transform of every block, ``h = 1 … d/2``
    the whole-head one; stage order is part of the float32 result (as in the rotation ops)."""
    for i in range(i0, d >> 1, istep):
        # (i // h)·2h + i % h without a division (h is a power of two): no floor-division
        # fix-ups per pair
        a = i + (i & -h)
        x = buf[a]
        y = buf[a + h]
        buf[a] = x + y
        buf[a + h] = x - y


def _inverse_scale(buf, d, j0, jstep, head_rot, hsigns):
    """Last step of the inverse rotation after the butterflies: ``buf[j] ·= 1/√d · s_j``
    (whole head) or ``buf[j] ·= 1/√32`` (32-blocks, signs applied before), ``j = j0, j0 + jstep, …``."""
    if head_rot:
        sc = head_scale(d)
        for j in range(j0, d, jstep):
            buf[j] = buf[j] * (sc * hsigns[j])
    else:
        for j in range(j0, d, jstep):
            buf[j] = buf[j] * float32(0.17677669529663687)


def _block_signs(buf, d, j0, jstep, signs):
    """First step of the inverse 32-block rotation: ``buf[j] ·= s_{j mod 32}``."""
    for j in range(j0, d, jstep):
        buf[j] = buf[j] * signs[j & 31]


# --- exact (sink and window) tokens, read in the dtype they are stored in ---------------
#: ``exact_kind`` of the kernels: float32 exact tokens, binary16 bit patterns (uint16), or
#: int8 with one binary16 scale per token (the caches' window dtypes); decoding them in
#: the kernel spares the caller a float32 copy of the whole window per decode step
EXACT_F32, EXACT_F16, EXACT_I8 = 0, 1, 2


def _exact_value(x, kind, s, table):
    """float32 value of one stored exact element ``x``: ``x`` (float32), the binary16
    pattern ``x`` (``EXACT_F16``), or ``x·s`` for int8 ``x`` and its token's scale ``s``
    (``EXACT_I8``; the caches' int8 window stores ``round(x / s)``).  ``table`` is the
    kernels' ``|binary16| → float32`` table (``F16_ABS_TABLE``): one load instead of the
    select chain of the arithmetic decode (2 registers fewer in the CUDA kernel)."""
    if kind == 1:
        h = int32(x)
        v = table[h & 0x7FFF]
        return -v if h & 0x8000 else v
    if kind == 2:
        return float32(x) * s
    return float32(x)


def _exact_scale(splane, slot, kind, table):
    """Scale of int8 exact token ``slot`` of a plane of scales ``splane`` ``[slots, 1]``: its
    binary16 pattern through ``table`` (``EXACT_I8``; positive); 1 for the other kinds,
    whose scales are a placeholder never read."""
    if kind == 2:
        return table[splane[slot, 0]]
    return float32(1.0)


# --- cooperative stages of the CUDA tile loop --------------------------------------------
# Shared-memory layout of a block (``rb`` query rows, ``nt`` tokens, head_dim ``d``):
# ``qs[r·d + j]`` (queries), ``kv[tt·stride + j]`` (the decoded K or V tile; ``stride = d + 1``
# so that threads reading token rows ``tt, tt + 1, …`` at the same ``j`` hit distinct banks),
# ``sc[r·nt + tt]`` (scores, then weights), ``acc[r·d + j]`` and ``m``/``l``/``alpha[r]``.
def _coop_load_rows(dst, src, g, r0, rb, d, tid, nth):
    """``dst[r·d + j] = src[g, r0 + r, j]`` for ``r < rb`` (the block's query rows)."""
    for u in range(tid, rb * d, nth):
        r = u // d
        dst[u] = src[g, r0 + r, u - r * d]


def _coop_init_rows(acc, m, l, rb, d, tid, nth):
    """Empty online-softmax state of ``rb`` rows: ``acc = 0``, ``m = -inf``, ``l = 0``."""
    for u in range(tid, rb * d, nth):
        acc[u] = float32(0.0)
    for r in range(tid, rb, nth):
        m[r] = NEG_INF
        l[r] = float32(0.0)


def _dot_shared(qs, qo, kv, ko, d):
    """``Σ_j qs[qo + j] · kv[ko + j]`` (one score from shared memory)."""
    s = float32(0.0)
    for j in range(d):
        s += qs[qo + j] * kv[ko + j]
    return s


def _coop_softmax_rows(sc, nt, rb, m, l, alpha, tid, nth):
    """Online-softmax step of one tile, one thread per query row: the logits
    ``sc[r·nt : r·nt + nt]`` (``-inf`` = masked) become the weights ``exp(s − m_new)``, the
    running max ``m[r]`` and sum ``l[r]`` move on and ``alpha[r]`` is the factor that
    rescales the row's accumulator (1 for a fully masked tile: nothing changes)."""
    for r in range(tid, rb, nth):
        o = r * nt
        tile_max = NEG_INF
        for tt in range(nt):
            tile_max = max(tile_max, sc[o + tt])
        if tile_max == NEG_INF:
            for tt in range(nt):
                sc[o + tt] = float32(0.0)
            alpha[r] = float32(1.0)
            continue
        m_old = m[r]
        m_new = max(m_old, tile_max)
        a = _rescale(m_old, m_new)
        lsum = float32(0.0)
        for tt in range(nt):
            w = math.exp(sc[o + tt] - m_new)  # masked (-inf) logits give exactly 0
            sc[o + tt] = w
            lsum += w
        _online_update(m, l, r, m_new, a, lsum)
        alpha[r] = a


def _coop_pv(sc, kv, stride, nt, rb, d, alpha, acc, tid, nth):
    """``acc[r, j] = alpha[r]·acc[r, j] + Σ_tt sc[r, tt] · kv[tt, j]``, one ``(r, j)`` per
    thread and step (consecutive threads read consecutive ``j``: no bank conflicts)."""
    for u in range(tid, rb * d, nth):
        r = u // d
        j = u - r * d
        a = acc[u] * alpha[r]
        o = r * nt
        for tt in range(nt):
            a += sc[o + tt] * kv[tt * stride + j]
        acc[u] = a


def _coop_store_rows(acc, m, l, rb, d, g, p, r0, part_m, part_l, part_acc, tid, nth):
    """The block's partial results ``(m, l, acc)`` of partition ``p`` to global memory."""
    for u in range(tid, rb * d, nth):
        r = u // d
        part_acc[g, p, r0 + r, u - r * d] = acc[u]
    for r in range(tid, rb, nth):
        part_m[g, p, r0 + r] = m[r]
        part_l[g, p, r0 + r] = l[r]


def _coop_tile(codes, scales, exact, exact_scales, exact_kind, kv_indices, first, page_size, g, h, t0, nt, nb,
               compressed, cent2, bits_b, off_b, sshift, scale_table, kv, stride, tid, nth):
    """Tokens ``t0 … t0 + nt − 1`` of KV row ``g`` (KV head ``h`` of a paged sequence whose page
    list starts at ``kv_indices[first]``) into ``kv`` (row stride ``stride``), found where
    ``token_slot`` and ``plane`` say (bound per addressing, :func:`addressing`): decoded from
    ``codes``/``scales`` laid out as ``(cent2, bits_b, off_b, sshift)``, or read from the exact
    tokens ``exact`` (``exact_kind``, :func:`_exact_value`; ``exact_scales``: the int8
    tokens' binary16 scales); one group of eight values per thread and step.  A codebook
    table wider than 32 columns is a head VQ layout (:func:`_decode8_vq`; a uniform branch)."""
    units = nb * 4
    vq = cent2.shape[1] > 32
    for u in range(tid, nt * units, nth):
        tt = u // units
        grp = u - tt * units
        o = tt * stride + grp * 8
        page, slot, _ = token_slot(kv_indices, first, page_size, g, t0 + tt)
        if compressed:
            b = grp >> 2
            bits = bits_b[b]
            splane = plane(scales, page, h)
            sa = scale_table[_scale_slot(splane, splane[slot, b >> sshift])]
            if vq:
                _decode8_vq(plane(codes, page, h)[slot], off_b[b] + (grp & 3) * bits, bits, cent2[b], sa, kv, o)
            else:
                _decode8(plane(codes, page, h)[slot], off_b[b] + (grp & 3) * bits, bits, cent2[b], sa, kv, o)
        else:
            es = exact_scale_at(exact_scales, page, h, slot, exact_kind, scale_table)
            erow = plane(exact, page, h)[slot]
            for k in range(8):
                kv[o + k] = _exact_value(erow[grp * 8 + k], exact_kind, es, scale_table)


# --- token addressing: flat cache rows or a paged pool's page table -------------------------
# One kernel source serves both (:mod:`numba_kv.ops.attention.kernels`); these cores are the
# only place they differ.  A flat cache's KV row ``g`` is one "page" of its whole capacity
# (``[n_g, capacity, ·]``: page ``g``, slot ``t``); a paged pool's token ``t`` of sequence
# ``g // n_kv_heads`` is slot ``t % page_size`` of page ``kv_indices[first + t // page_size]``,
# KV head ``g % n_kv_heads`` (``[pages, heads, page_size, ·]``).  :func:`addressing` binds one
# set under the names the kernel bodies call; the unused set is never compiled into a kernel.
def _flat_row(g, p, n_comp_parts, part_size, n_comp, n_exact, q_pos0, q_len, kv_indptr, kv_last_page_len, page_size,
              n_kv_heads):
    """``(compressed, t_lo, t_hi, q_pos0, first, h)`` of partition ``p`` of flat KV row ``g``
    (:func:`_partition_bounds`; the queries' first position as given, no page list, head 0).
    The compressed tokens are ``n_comp + kv_last_page_len[0]``: a count passed by value, or
    one that an earlier launch left on the device (the plan's placeholder holds 0), so that a
    steady step's launch does not change from step to step (a CUDA graph; issue 27)."""
    n_live = int64(n_comp) + int64(kv_last_page_len[0])
    compressed, t_lo, t_hi = _partition_bounds(p, n_comp_parts, part_size, n_live, n_exact)
    return compressed, t_lo, t_hi, int64(q_pos0), int64(0), int64(0)


def _paged_row(g, p, n_comp_parts, part_size, n_comp, n_exact, q_pos0, q_len, kv_indptr, kv_last_page_len, page_size,
               n_kv_heads):
    """``(compressed, t_lo, t_hi, q_pos0, first, h)`` of partition ``p`` of sequence·KV head
    ``g`` of a page table (:func:`_paged_bounds`; ``t_hi < t_lo`` past the sequence's end):
    compressed pools have ``n_comp_parts`` >= every partition, float32 pools 0; the ``q_len``
    queries sit at the sequence's last positions."""
    seq = g // n_kv_heads
    first, T, t_lo, t_hi = _paged_bounds(seq, p, part_size, kv_indptr, kv_last_page_len, page_size)
    return p < n_comp_parts, t_lo, t_hi, T - q_len, first, int64(g - seq * n_kv_heads)


def _flat_slot(kv_indices, first, page_size, g, t):
    """``(page, slot, room)`` of token ``t`` of flat KV row ``g``: ``(g, t)``, and the tokens
    from it to the end of its "page" (unbounded)."""
    return int64(g), int64(t), int64(0x7FFFFFFFFFFFFFFF)


def _paged_slot(kv_indices, first, page_size, g, t):
    """``(page, slot, room)`` of token ``t`` of a sequence whose page list starts at
    ``kv_indices[first]``; ``room``: the tokens from it to the end of its page."""
    i = t // page_size
    slot = t - i * page_size
    return int64(kv_indices[first + i]), slot, page_size - slot


def _flat_plane(a, page, h):
    """The ``[slots, ·]`` plane of flat ``a`` ``[n_g, capacity, ·]`` that holds ``page``."""
    return a[page]


def _paged_plane(a, page, h):
    """The ``[slots, ·]`` plane of pool ``a`` ``[pages, heads, page_size, ·]``: page ``page``,
    KV head ``h``."""
    return a[page, h]


def _exact_scale_at(scales, page, h, slot, kind, table):
    """:func:`_exact_scale` of the exact token at ``(page, h, slot)``: the plane is formed for
    int8 tokens only (elsewhere ``scales`` is a placeholder, and the simulator checks bounds)."""
    if kind == 2:
        return table[plane(scales, page, h)[slot, 0]]
    return float32(1.0)


#: the names :func:`_coop_tile` and :func:`_exact_scale_at` call, rebound per addressing
#: (:func:`addressing`); the flat ones here
token_slot, plane, exact_scale_at = _flat_slot, _flat_plane, _exact_scale_at


scale_slot_cpu, scale_slot_dev = twin(_scale_slot, inline=True)
decode8_cpu, decode8_dev = twin(_decode8)
decode8_vq_cpu, decode8_vq_dev = twin(_decode8_vq)
load_token_fast_cpu, _ = twin(_load_token_fast)
is_uniform_cpu, _ = twin(_is_uniform)
sign_pm1_cpu, _ = twin(_sign_pm1)
_, qjl_dot_dev = twin(_qjl_dot)
visible_cpu, visible_dev = twin(_visible)
twin(_rescale)
online_update_cpu, _ = twin(_online_update)
partition_bounds_cpu, partition_bounds_dev = twin(_partition_bounds)
paged_bounds_cpu, paged_bounds_dev = twin(_paged_bounds)
exact_value_cpu, exact_value_dev = twin(_exact_value, inline=True)
exact_scale_cpu, exact_scale_dev = twin(_exact_scale, inline=True)
merge_max_cpu, merge_max_dev = twin(_merge_max, inline=True)
merge_denom_lane_cpu, merge_denom_lane_dev = twin(_merge_denom_lane, inline=True)
lane_tree_cpu, lane_tree_dev = twin(_lane_tree, inline=True)
merge_weights_cpu, merge_weights_dev = twin(_merge_weights, inline=True)
_, column_term_dev = twin(_column_term, inline=True)
butterfly_pairs_cpu, butterfly_pairs_dev = twin(_butterfly_pairs, inline=True)
inverse_scale_cpu, inverse_scale_dev = twin(_inverse_scale, inline=True)
block_signs_cpu, block_signs_dev = twin(_block_signs, inline=True)
# the cooperative stages run on the device only
coop_load_rows_dev, coop_init_rows_dev, dot_shared_dev, coop_softmax_rows_dev, coop_pv_dev, coop_store_rows_dev = (
    twin(f)[1] for f in (_coop_load_rows, _coop_init_rows, _dot_shared, _coop_softmax_rows, _coop_pv, _coop_store_rows))


def _compile_addressing(paged, row_bounds, token_slot, plane):
    """The compiled cores of one addressing, under the names the kernel sources call."""
    (rb_cpu, rb_dev), (ts_cpu, ts_dev) = (twin(f, inline=True) for f in (row_bounds, token_slot))
    pl_cpu, pl_dev = twin(plane, inline=True, returns_view=True)
    suffix = "_paged" if paged else "_flat"
    scale_at = specialize(_exact_scale_at, suffix, plane=plane)
    es_cpu, es_dev = twin(scale_at, inline=True)
    _, tile_dev = twin(specialize(_coop_tile, suffix, token_slot=token_slot, plane=plane, exact_scale_at=scale_at))
    return {"PAGED": paged, "row_bounds_cpu": rb_cpu, "row_bounds_dev": rb_dev, "token_slot_cpu": ts_cpu,
            "token_slot_dev": ts_dev, "plane_cpu": pl_cpu, "plane_dev": pl_dev, "exact_scale_at_cpu": es_cpu,
            "exact_scale_at_dev": es_dev, "coop_tile_dev": tile_dev}


_ADDRESSING = {False: _compile_addressing(False, _flat_row, _flat_slot, _flat_plane),
               True: _compile_addressing(True, _paged_row, _paged_slot, _paged_plane)}


def addressing(paged: bool) -> dict:
    """The names the partition kernels' single source calls to find a token (see the section
    "token addressing"), bound for flat cache rows or a paged pool: ``PAGED`` and the CPU
    (``*_cpu``) and device (``*_dev``) variants of ``row_bounds``, ``token_slot``, ``plane``,
    ``exact_scale_at`` and ``coop_tile`` (for :func:`numba_kv._jit.specialize`)."""
    return dict(_ADDRESSING[bool(paged)])
