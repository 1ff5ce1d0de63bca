"""The partition kernels of the decode attention, flat and paged (every registered twin).

Flat caches (``decode_attention``, ``decode_attention_warp``, ``decode_attention_mma``) and
paged pools (``paged_decode_attention*``) run the same kernels: a CPU twin (tile loops tuned
for caches and SIMD, :mod:`numba_kv.ops.attention.cpu`) and three CUDA variants: the
cooperative block kernel (one thread block per (KV row, partition[, row chunk]) with the
decoded tile, the query rows, the scores and the accumulators in shared memory), the warp
kernel (one warp per partition, :mod:`numba_kv.ops.attention.warp`) and the tensor-core
kernel (:mod:`numba_kv.ops.attention.mma`).  Each is ONE source with one argument list,
compiled twice (:func:`_compile`, :func:`numba_kv._jit.specialize`): with the flat cache's
addressing and with a page table's.  How a token is found — the partition's bounds, a
token's ``(page, slot)``, the ``[slots, ·]`` plane of an array — is the only difference, in
the addressing cores of :mod:`numba_kv.ops.attention.cores` (:func:`~numba_kv.ops.attention.cores.addressing`);
``PAGED`` is a compile-time constant, so each variant compiles only its own branch.  All
run the single-source cores of :mod:`numba_kv.ops.attention.cores` for everything they
share; the :class:`~numba_kv.ops.attention.plan.AttentionPlan` picks the variant and the
grid.  The merge of the partitions is :mod:`numba_kv.ops.attention.merge`.
"""

from __future__ import annotations

import numpy as np
from numba import cuda, float32, int64, prange, uint8, uint32

from ..._config import MAX_CUDA_THREADS
from ..._jit import FASTMATH_REDUCE, cpu_kernel, cpu_serial, cuda_kernel, specialize, twin
from .._borrow import borrowed, keep_alive
from .._registry import register
from .cores import (
    EXACT_F32,
    F32_MAX,
    NEG_INF,
    addressing,
    coop_init_rows_dev,
    coop_load_rows_dev,
    coop_pv_dev,
    coop_softmax_rows_dev,
    coop_store_rows_dev,
    dot_shared_dev,
    is_uniform_cpu,
    qjl_dot_dev,
    visible_dev,
)
from .cpu import (
    NIBBLE_TABLE,
    decode_tile_mixed_cpu,
    decode_tile_simd_cpu,
    decode_tile_vq_cpu,
    exact_tile_cpu,
    nibble_lut_cpu,
    softmax_tile_cpu,
    tile_pv_cpu,
    tile_scores_cpu,
    unpack_signs_tile_cpu,
)
from .merge import MERGE_SCRATCH, merge_if_last
from .mma import (
    MMA_BLOCKS_PER_SM,
    MMA_BLOCKS_PER_SM_SM90,
    MMA_TAB_SHARED_WORDS,
    MMA_THREADS,
    build_tables,
    mma_partition,
    mma_partition_vq,
)
from .mma_dims import mma_partition_for
from .mma_vq import VQ_PAIR_COLUMNS, build_tables_vq
from .qrot import coop_rotate_rows, rotate_rows_cpu
from .warp import (
    SIMULATED,
    WARP_PW,
    WARP_QS,
    WARP_ROWS,
    WARP_STATE,
    WARP_VALUES,
    WARP_VRAW,
    WARP_VSC,
    XBUF,
    compressed_tiles,
    exact_tiles,
    init_state,
    row_limits,
    stage_queries,
    store_partition,
    warp_geometry,
    warp_tiles,
)

#: tokens per CPU tile: a decoded 32-token × d=128 float tile is 16 KiB, stays in L1 while
#: the score and P·V loops sweep it
CPU_TILE = 32
# Static shared memory of the cooperative CUDA kernels (float32 elements), 45 KiB in all,
# under the 48 KiB a block may declare statically:
#: query rows and accumulators of a block: ``rows_per_block · head_dim`` each
SMEM_ROWS = 4096
#: one decoded K or V tile: ``tile_tokens · (head_dim + 1)`` (16 tokens at d = 128)
SMEM_TILE = 2112
#: scores / weights: ``rows_per_block · tile_tokens``
SMEM_SCORES = 1024
#: most query rows per block (running max, sum and rescale factor of each)
MAX_BLOCK_ROWS = 64
#: most tokens per CUDA tile
MAX_TILE_TOKENS = 32
# the last block's merge borrows the block kernel's tile buffer and the warp kernels' weights
if min(SMEM_TILE, WARP_PW) < MERGE_SCRATCH:
    raise ImportError("numba_kv.ops.attention.kernels: the merge's scratch does not fit the kernels' shared buffers")


def _tile_tokens(d):
    """Tokens per CUDA tile at head_dim ``d``: as many as fit :data:`SMEM_TILE` with the
    padded row stride ``d + 1`` (at most :data:`MAX_TILE_TOKENS`)."""
    return min(MAX_TILE_TOKENS, SMEM_TILE // (d + 1))


_, tile_tokens_dev = twin(_tile_tokens)


def rows_per_block(d: int) -> int:
    """Most query rows one CUDA block of the decode kernels handles at head_dim ``d`` (more
    rows are split over ``ceil(rows / rows_per_block)`` blocks along the grid's z axis)."""
    return min(MAX_BLOCK_ROWS, SMEM_ROWS // d, SMEM_SCORES // _tile_tokens(d))


# --- one source, two addressings ----------------------------------------------------------
# Every kernel below takes the same arguments for flat caches and paged pools, and each (the CPU
# twin, the block, warp and tensor-core kernels) is ONE source compiled twice (:func:`_compile`): with the flat
# addressing (KV row ``g`` of ``[n_g, capacity, ·]`` arrays: compressed partitions, then the
# exact ones, at ``comp_pos0 + t`` and ``exact_pos[t]``) and with a page table (sequence·KV head
# ``g``: codes ``[pages, heads, page_size, ·]``, or float32 pools passed as the exact tokens
# ``ke``/``ve``; token ``t`` at position ``t``; no logit bias, no QJL correction).  The names
# below are what the sources call to find a token (:func:`~numba_kv.ops.attention.cores.addressing`);
# at module level the flat ones.  ``PAGED`` is a compile-time constant: the paged variant's
# branch folds away in the flat one and vice versa.
_FLAT = addressing(False)
PAGED = _FLAT["PAGED"]
row_bounds_cpu, row_bounds_dev = _FLAT["row_bounds_cpu"], _FLAT["row_bounds_dev"]
token_slot_cpu, plane_cpu, coop_tile_dev = _FLAT["token_slot_cpu"], _FLAT["plane_cpu"], _FLAT["coop_tile_dev"]


def _kv_tile(codes, scales, exact, exact_scales, exact_kind, compressed, uniform, cent, bits, off, sshift, table,
             kv_indices, first, page_size, g, h, t0, nt, dst, lut):
    """Tokens ``t0 … t0 + nt − 1`` of KV row ``g`` into the rows of ``dst`` (CPU), one run of
    consecutive slots at a time (a flat row is one run; a pool's run ends with its page):
    decoded by the SIMD decoders (one width: ``cent[0]``, ``bits[0]``), the mixed-width one or
    the head VQ one (a table wider than 32 columns, :func:`~numba_kv.ops.attention.cpu.decode_tile_vq_cpu`;
    one test per run), or read from the exact tokens in their stored dtype."""
    nb = bits.shape[0]
    tt = 0
    while tt < nt:
        page, slot, room = token_slot_cpu(kv_indices, first, page_size, g, t0 + tt)
        run = min(nt - tt, room)
        if not compressed:
            # (the scales' plane of int8 tokens only: elsewhere a placeholder)
            exs = plane_cpu(exact_scales, page, h) if exact_kind == 2 else plane_cpu(exact_scales, 0, 0)
            exact_tile_cpu(plane_cpu(exact, page, h), exs, exact_kind, slot, run, table, dst, tt)
        elif cent.shape[1] > 32:
            decode_tile_vq_cpu(plane_cpu(codes, page, h), plane_cpu(scales, page, h), slot, run, cent[0], bits[0], nb,
                               sshift, table, dst, tt)
        elif uniform:
            decode_tile_simd_cpu(plane_cpu(codes, page, h), plane_cpu(scales, page, h), slot, run, cent[0], bits[0],
                                 nb, sshift, table, dst, tt, lut)
        else:
            decode_tile_mixed_cpu(plane_cpu(codes, page, h), plane_cpu(scales, page, h), slot, run, cent, bits, off,
                                  sshift, table, dst, tt)
        tt += run


def _tile_tables(kcent, vcent, kbits, vbits, k_uniform, v_uniform):
    """The CPU twin's constant tables, float32 ``[3, 256, 2]``: the byte tables of 4-bit K and V
    codes of one width (:func:`~numba_kv.ops.attention.cpu.nibble_lut_cpu`; filled only at that
    width on hosts that decode through them, :data:`~numba_kv.ops.attention.cpu.NIBBLE_TABLE`,
    else never read) and, in ``[2, 0]``, the ±1 codebook of a QJL sign bit."""
    tables = np.empty((3, 256, 2), dtype=np.float32)
    if NIBBLE_TABLE and k_uniform and kbits[0] == 4:
        nibble_lut_cpu(kcent[0], tables[0])
    if NIBBLE_TABLE and v_uniform and vbits[0] == 4:
        nibble_lut_cpu(vcent[0], tables[1])
    tables[2, 0, 0] = float32(-1.0)
    tables[2, 0, 1] = float32(1.0)
    return tables


tile_tables_cpu = cpu_serial(_tile_tables)


# --- CPU twin: partitions in parallel; per tile, register-blocked score and P·V loops -----
def _partition_cpu(qr, q, kc, ks, vc, vs, n_comp, comp_pos0, ke, ve, n_exact, exact_pos, kes, ves, exact_kind, kcent,
                   vcent, kbits, koff, vbits, voff, sshift, scale_table, softmax_scale, bias, has_bias, has_qjl, sq,
                   qsig, qnorm, qjl_const, q_pos0, q_len, causal, part_size, n_comp_parts, kv_indptr, kv_indices,
                   kv_last_page_len, page_size, n_kv_heads, part_m, part_l, part_acc,
                   merge_last, n_rot, msigns, head_rot, hsigns, out, counter, rotate_q):
    """CPU twin: one work item per (KV row ``g``, partition ``p``) (``prange``); per tile of
    :data:`CPU_TILE` tokens the keys are decoded into an L1-resident buffer (SIMD decoders),
    scored for every query row of the GQA group, then the values decoded into the same
    buffer and accumulated (register-blocked loops, fast-math reductions).  The merge's
    arguments (``merge_last`` … ``counter``, the CUDA kernels' last-block merge) are not
    read: on the CPU the host runs MERGE_PARTITIONS after it.  With ``rotate_q`` each work item
    of a partition ``p < n_rot`` rotates ``q[g]`` itself (:func:`~numba_kv.ops.attention.qrot.rotate_rows_cpu`,
    the rotation ops' row cores: the bits of a rotated ``qr``), as the CUDA kernels do."""
    n_g, rows, d = qr.shape
    m_qjl = sq.shape[2]
    n_parts = part_m.shape[1]
    if PAGED:  # a pool: tokens at 0, 1, …, one scale per 32-block, float32 tokens (constants)
        comp_pos0, sshift, exact_kind = 0, 0, EXACT_F32
    # one width for every block (the common case): the specialized loader, ~1.5x faster
    k_uniform = is_uniform_cpu(kbits)
    v_uniform = is_uniform_cpu(vbits)
    # everything the per-tile calls read or write, borrowed (numba_kv.ops._borrow: no reference
    # counting per call; the arguments outlive the call, the buffers are kept alive to the end)
    qr, q, kc, ks, vc, vs, ke, ve = (borrowed(qr), borrowed(q), borrowed(kc), borrowed(ks), borrowed(vc),
                                     borrowed(vs), borrowed(ke), borrowed(ve))
    kes, ves, exact_pos, kcent, vcent, kbits, koff, vbits, voff = (
        borrowed(kes), borrowed(ves), borrowed(exact_pos), borrowed(kcent), borrowed(vcent), borrowed(kbits),
        borrowed(koff), borrowed(vbits), borrowed(voff))
    scale_table, bias, sq, qsig, qnorm, kv_indices = (borrowed(scale_table), borrowed(bias), borrowed(sq),
                                                     borrowed(qsig), borrowed(qnorm), borrowed(kv_indices))
    tables = tile_tables_cpu(kcent, vcent, kbits, vbits, k_uniform, v_uniform)
    klut, vlut, pm1 = borrowed(tables[0]), borrowed(tables[1]), borrowed(tables[2, 0])
    # the serial compilation (SERIAL_TWIN, a step's few work items) runs every item in one
    # chunk that allocates its buffers once: per item they cost ~10 % of a small
    # step's kernel.  The parallel one gives each item its own chunk (prange cannot tell
    # which thread runs it without a call that Numba's cache cannot store)
    n_items = n_g * n_parts
    n_chunks = 1 if SERIAL_TWIN else n_items
    for chunk in prange(n_chunks):
        own = (np.empty((CPU_TILE, d), dtype=np.float32), np.empty((rows, CPU_TILE), dtype=np.float32),
               np.empty((CPU_TILE if has_qjl else 1, m_qjl), dtype=np.float32),
               np.empty((rows, CPU_TILE if has_qjl else 1), dtype=np.float32), np.empty((rows, d), dtype=np.float32),
               np.empty((2, rows), dtype=np.float32), np.empty((rows + 1 if rotate_q else 1, d), dtype=np.float32))
        kt, sc, stq, corr, acc = borrowed(own[0]), borrowed(own[1]), borrowed(own[2]), borrowed(own[3]), \
            borrowed(own[4])
        m, l = borrowed(own[5][0]), borrowed(own[5][1])
        qrot = borrowed(own[6])
        for item in range(chunk, n_items, n_chunks):
            g = item // n_parts
            p = item - g * n_parts
            compressed, t_lo, t_hi, pos_q, first, h = row_bounds_cpu(g, p, n_comp_parts, part_size, n_comp, n_exact,
                                                                    q_pos0, q_len, kv_indptr, kv_last_page_len,
                                                                    page_size, n_kv_heads)
            # token t sits at comp_pos0 + t (compressed tokens, every token of a pool) or at
            # exact_pos[t] (a flat cache's exact tokens)
            sequential = compressed or PAGED
            for r in range(rows):
                m[r] = NEG_INF
                l[r] = float32(0.0)
                for j in range(d):
                    acc[r, j] = float32(0.0)
            qsrc = qr[g] if compressed else q[g]
            if rotate_q and p < n_rot:  # (row `rows` of qrot: the rotation's scratch)
                rotate_rows_cpu(q[g], rows, d, head_rot, hsigns, msigns, qrot[rows], qrot)
                qsrc = qrot[:rows]
            for t0 in range(t_lo, t_hi, CPU_TILE):
                nt = min(CPU_TILE, t_hi - t0)
                kv_tile_cpu(kc, ks, ke, kes, exact_kind, compressed, k_uniform, kcent, kbits, koff, sshift,
                            scale_table, kv_indices, first, page_size, g, h, t0, nt, kt, klut)
                tile_scores_cpu(qsrc, kt, nt, sc)
                if compressed and has_qjl and not PAGED:
                    # QJL correction c_t·<S q, σ_t>, in q·k units: signs unpacked to ±1 by the
                    # 1-bit vector decoder, then scored like keys
                    unpack_signs_tile_cpu(qsig[g], t0, nt, m_qjl, pm1, stq)
                    tile_scores_cpu(sq[g], stq, nt, corr)
                    for tt in range(nt):
                        c = qjl_const * scale_table[qnorm[g, t0 + tt]]
                        for r in range(rows):
                            sc[r, tt] += c * corr[r, tt]
                last_pos = comp_pos0 + t0 + nt - 1 if sequential else -1
                need_mask = causal and (not sequential or last_pos > pos_q)
                softmax_tile_cpu(sc, nt, softmax_scale, g, has_bias and not PAGED, bias, need_mask, pos_q, q_len,
                                 comp_pos0 + t0 if sequential else 0, exact_pos, not sequential, t0, m, l, acc)
                # the value tile reuses the key tile's buffer: one L1-sized buffer per thread
                kv_tile_cpu(vc, vs, ve, ves, exact_kind, compressed, v_uniform, vcent, vbits, voff, sshift,
                            scale_table, kv_indices, first, page_size, g, h, t0, nt, kt, vlut)
                tile_pv_cpu(sc, kt, nt, acc)
            for r in range(rows):
                part_m[g, p, r] = m[r]
                part_l[g, p, r] = l[r]
                for j in range(d):
                    part_acc[g, p, r, j] = acc[r, j]
        keep_alive(own)
    keep_alive(tables)


# --- CUDA kernels ------------------------------------------------------------------------
def _partition_block_cuda(qr, q, kc, ks, vc, vs, n_comp, comp_pos0, ke, ve, n_exact, exact_pos, kes, ves, exact_kind,
                          kcent, vcent, kbits, koff, vbits, voff, sshift, scale_table, softmax_scale, bias, has_bias,
                          has_qjl, sq, qsig, qnorm, qjl_const, q_pos0, q_len, causal, part_size, n_comp_parts,
                          kv_indptr, kv_indices, kv_last_page_len, page_size, n_kv_heads, part_m, part_l, part_acc,
                          merge_last, n_rot, msigns, head_rot, hsigns, out, counter, rotate_q):
    """Cooperative flash-decoding partition kernel.

    Launch contract: grid ``(n_g, n_parts, n_chunks)``, any block size (128 on a GPU).
    Block ``(g, p, c)`` runs the online softmax of query rows ``c·rb … c·rb + rb − 1``
    (``rb = ceil(rows / n_chunks)`` <= :func:`rows_per_block`) of KV row ``g`` over the
    tokens of partition ``p`` (none past a paged sequence's end) and writes their ``(m, l,
    acc)``.  Per tile of :func:`_tile_tokens` tokens the block decodes the K codes once into
    shared memory (one group of eight values per thread), scores every (row, token) pair
    from shared memory (one pair per thread), runs the per-row softmax step (one row per
    thread), decodes the V tile into the same buffer and accumulates ``P·V`` into the shared
    accumulators (one ``(row, column)`` per thread).  Reductions stay inside one thread: no
    warp shuffles.  With ``merge_last`` the last block of each ``(g, c)`` to finish merges
    its rows into ``out`` (:func:`~numba_kv.ops.attention.merge.merge_if_last`: ``counter``
    zero at launch, left zero).  With ``rotate_q`` the block rotates its raw query rows ``q``
    itself when its partition is in the rotated domain (``p < n_rot``: the compressed ones, the
    exact ones too where ``n_rot`` counts them; :func:`~numba_kv.ops.attention.qrot.coop_rotate_rows`)
    and ``qr`` is not read (any array of ``q``'s shape, ``q`` itself).
    """
    qs = cuda.shared.array(SMEM_ROWS, dtype=float32)
    acc = cuda.shared.array(SMEM_ROWS, dtype=float32)
    kv = cuda.shared.array(SMEM_TILE, dtype=float32)
    sc = cuda.shared.array(SMEM_SCORES, dtype=float32)
    m = cuda.shared.array(MAX_BLOCK_ROWS, dtype=float32)
    lsum = cuda.shared.array(MAX_BLOCK_ROWS, dtype=float32)
    alpha = cuda.shared.array(MAX_BLOCK_ROWS, dtype=float32)
    rows = qr.shape[1]
    d = qr.shape[2]
    nb = d // 32
    m_qjl = sq.shape[2]
    g = cuda.blockIdx.x
    p = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    nth = cuda.blockDim.x
    rb = (rows + cuda.gridDim.z - 1) // cuda.gridDim.z
    r0 = cuda.blockIdx.z * rb
    rb = min(rb, rows - r0)
    if rb <= 0:
        return
    if PAGED:  # a pool: tokens at 0, 1, …, one scale per 32-block, float32 tokens (constants)
        comp_pos0, sshift, exact_kind = 0, 0, EXACT_F32
    stride = d + 1
    nt_max = tile_tokens_dev(d)
    compressed, t_lo, t_hi, pos_q, first, h = row_bounds_dev(g, p, n_comp_parts, part_size, n_comp, n_exact, q_pos0,
                                                            q_len, kv_indptr, kv_last_page_len, page_size, n_kv_heads)
    coop_load_rows_dev(qs, q if rotate_q else qr if compressed else q, g, r0, rb, d, tid, nth)
    coop_init_rows_dev(acc, m, lsum, rb, d, tid, nth)
    cuda.syncthreads()
    if rotate_q and p < n_rot:  # block-uniform: the partition's tokens are in the rotated domain
        coop_rotate_rows(qs, 0, rb, d, head_rot, hsigns, msigns, tid, nth)
    for t0 in range(t_lo, t_hi, nt_max):
        nt = min(nt_max, t_hi - t0)
        coop_tile_dev(kc, ks, ke, kes, exact_kind, kv_indices, first, page_size, g, h, t0, nt, nb, compressed, kcent,
                      kbits, koff, sshift, scale_table, kv, stride, tid, nth)
        cuda.syncthreads()
        for u in range(tid, rb * nt, nth):
            r = u // nt
            t = t0 + (u - r * nt)
            s = dot_shared_dev(qs, r * d, kv, (u - r * nt) * stride, d)
            if compressed or PAGED:
                pos = comp_pos0 + t
                if has_qjl and not PAGED:
                    s += qjl_const * scale_table[qnorm[g, t]] * qjl_dot_dev(sq[g, r0 + r], qsig[g, t], m_qjl)
            else:
                pos = int64(exact_pos[t])
            s = s * softmax_scale
            if has_bias and not PAGED:
                s = min(max(s + bias[g, r0 + r, pos], -F32_MAX), F32_MAX)  # (finite: cores.F32_MAX)
            sc[u] = s if visible_dev(pos, pos_q, r0 + r, q_len, causal) else NEG_INF
        cuda.syncthreads()
        coop_softmax_rows_dev(sc, nt, rb, m, lsum, alpha, tid, nth)
        cuda.syncthreads()
        coop_tile_dev(vc, vs, ve, ves, exact_kind, kv_indices, first, page_size, g, h, t0, nt, nb, compressed, vcent,
                      vbits, voff, sshift, scale_table, kv, stride, tid, nth)
        cuda.syncthreads()
        coop_pv_dev(sc, kv, stride, nt, rb, d, alpha, acc, tid, nth)
        cuda.syncthreads()
    coop_store_rows_dev(acc, m, lsum, rb, d, g, p, r0, part_m, part_l, part_acc, tid, nth)
    # the decoded tile's buffer is free: the merge's scratch if this block finishes last
    merge_if_last(merge_last, part_m, part_l, part_acc, g, r0, rb, n_rot, msigns, head_rot, hsigns, out, counter, kv,
                  tid, nth)


def _partition_warp_cuda(qr, q, kc, ks, vc, vs, n_comp, comp_pos0, ke, ve, n_exact, exact_pos, kes, ves, exact_kind,
                         kcent, vcent, kbits, koff, vbits, voff, sshift, scale_table, softmax_scale, bias, has_bias,
                         has_qjl, sq, qsig, qnorm, qjl_const, q_pos0, q_len, causal, part_size, n_comp_parts, kv_indptr,
                         kv_indices, kv_last_page_len, page_size, n_kv_heads, part_m, part_l, part_acc,
                         merge_last, n_rot, msigns, head_rot, hsigns, out, counter, rotate_q):
    """Warp-per-partition flash-decoding kernel (no logit bias, no QJL correction).

    Launch contract: grid ``(n_g, ceil(n_parts / warps per block), n_chunks)`` with whole
    warps per block, ``head_dim`` in 32, 64, 128 (:func:`warp_ok`) and at most
    :data:`WARP_ROWS` query rows per chunk.  Warp ``w`` of block ``(g, y, c)`` runs
    partition ``p = y·warps + w`` of KV row ``g`` (empty past a paged sequence's end: it
    stores ``m = -inf``) for query rows ``c·rb …`` and writes its ``(m, l, acc)`` like the
    block kernel, 32 tokens at a time: lane ``ℓ`` scores token ``t0 + ℓ`` against every row
    and stages its V bytes; the tile's softmax is two warp butterflies; then each lane
    accumulates ``p·v`` for its 4 coordinates over the tile (layouts in
    :mod:`numba_kv.ops.attention.warp`).  ``has_bias`` and ``has_qjl`` must be false (the
    host launches the block kernel for those).  With ``merge_last`` the last block of each
    ``(g, c)`` to finish merges its rows into ``out`` (as the block kernel).  With ``rotate_q``
    the block stages its query rows rotated from ``q`` itself (:func:`stage_queries`; ``qr``
    is not read).
    """
    xbuf = cuda.shared.array(XBUF, dtype=float32)  # the simulator's exchanges only
    qs = cuda.shared.array(WARP_QS, dtype=float32)
    vraw = cuda.shared.array(WARP_VRAW, dtype=uint8)
    vsc = cuda.shared.array(WARP_VSC, dtype=float32)
    pw = cuda.shared.array(WARP_PW, dtype=float32)
    rows = qr.shape[1]
    d = qr.shape[2]
    n_parts = part_m.shape[1]
    g, tid, p, rb, r0, active = warp_geometry(rows, n_parts)
    if PAGED:  # a pool: tokens at 0, 1, …, one scale per 32-block, float32 tokens (constants)
        comp_pos0, sshift, exact_kind = 0, 0, EXACT_F32
    compressed, t_lo, t_hi, pos_q, first, h = row_bounds_dev(g, min(p, n_parts - 1), n_comp_parts, part_size, n_comp,
                                                            n_exact, q_pos0, q_len, kv_indptr, kv_last_page_len,
                                                            page_size, n_kv_heads)
    if not active or t_hi < t_lo:
        t_hi = t_lo
    stage_queries(qs, qr, q, g, r0, rows, d, tid, rotate_q, n_rot > n_comp_parts, head_rot, hsigns, msigns)
    st = cuda.local.array(WARP_STATE, dtype=float32)  # per row: m, l, alpha
    acc = cuda.local.array(WARP_VALUES, dtype=float32)
    sc = cuda.local.array(WARP_ROWS, dtype=float32)
    tmp = cuda.local.array(WARP_ROWS, dtype=float32)
    lim = cuda.local.array(WARP_ROWS, dtype=int64)
    init_state(st, acc, sc)
    row_limits(lim, rb, r0, pos_q, q_len, causal)
    # simulator: every warp of the block takes the same number of tiles (block barriers)
    span = part_size if SIMULATED else t_hi - t_lo
    addr = (kv_indices, first, page_size, g, h)
    # one loop per token kind: each keeps only its own arrays' addressing live
    if compressed:
        compressed_tiles(kc, ks, vc, vs, addr, kbits, koff, vbits, voff, kcent, vcent, sshift, scale_table, t_lo, t_hi,
                         span, comp_pos0, qs, lim, softmax_scale, st, acc, sc, tmp, vraw, vsc, pw, xbuf, tid)
    else:
        exact_tiles(ke, ve, kes, ves, exact_kind, exact_pos, addr, scale_table, t_lo, t_hi, span, qs, WARP_ROWS * d, d,
                    lim, softmax_scale, st, acc, sc, tmp, pw, xbuf, tid)
    store_partition(st, acc, active, rb, g, p, r0, d, part_m, part_l, part_acc, xbuf, tid)
    # the tile weights' buffer is free: the merge's scratch if this block finishes last
    merge_if_last(merge_last, part_m, part_l, part_acc, g, r0, rb, n_rot, msigns, head_rot, hsigns, out, counter, pw,
                  tid, cuda.blockDim.x)


def _compile(fn, paged, wrap, build="", vq=False, **names):
    """``wrap`` (a decorator) of kernel source ``fn`` with the flat or the paged addressing
    (``build``: a tag for a second build of the same source, e.g. other launch bounds; its
    own name keeps it apart in Numba's on-disk cache, whose key has no launch bounds;
    ``vq``: the warp tiles that also decode the head VQ code, :func:`warp_tiles`; ``names``:
    further globals rebound, :func:`~numba_kv._jit.specialize`)."""
    suffix = "_paged" if paged else "_flat"
    # named as the registered twins (_<op>_cpu, _<op>[_<variant>]_cuda; tests/test_conventions.py)
    name = fn.__name__.replace("_block", "").replace("_partition", "_paged_decode_attention" if paged
                                                     else "_decode_attention")
    if build:
        name = name.replace("_cuda", f"_{build}_cuda")
    return wrap(specialize(fn, suffix, name=name, kv_tile_cpu=_KV_TILE[paged], **addressing(paged),
                           **warp_tiles(paged, vq), **names))


# a real call, not inlined into the kernel: inlined, each of its ten array arguments cost an
# atomic NRT incref/decref pair per tile (a call's own pairs are fewer: Numba prunes some)
_KV_TILE = {paged: cpu_serial(specialize(_kv_tile, "_paged" if paged else "_flat", **addressing(paged)))
            for paged in (False, True)}
kv_tile_cpu = _KV_TILE[False]
#: False in the parallel compilation of the CPU twin, True in its ``.serial`` one (a compile-time constant)
SERIAL_TWIN = False
_decode_attention_cpu, _paged_decode_attention_cpu = (
    _compile(_partition_cpu, paged, cpu_kernel(fastmath=FASTMATH_REDUCE, serial_globals={"SERIAL_TWIN": True}))
    for paged in (False, True))
# Launch bounds: blocks of at most MAX_CUDA_THREADS (256, the cuda_threads knob's ceiling),
# at least 2 of them resident per SM, caps ptxas at 128 registers per thread, so 4 blocks of
# the default 128 threads stay resident on an H100 SM (unbounded, ptxas took 132 once the
# exact tokens were read in their stored dtypes, and the SM held 3); no spills at the cap
# (tests/cuda/test_resources.py).
_decode_attention_cuda, _paged_decode_attention_cuda = (
    _compile(_partition_block_cuda, paged, cuda_kernel(launch_bounds=(MAX_CUDA_THREADS, 2))) for paged in (False, True))
# Warp kernel: no launch bounds (ptxas keeps it spill-free on sm_80 and sm_90 unbounded); its
# resources are checked with every kernel's in tests/cuda/test_resources.py.
_decode_attention_warp_cuda, _paged_decode_attention_warp_cuda = (
    _compile(_partition_warp_cuda, paged, cuda_kernel) for paged in (False, True))
# ... and its build for head VQ layouts (flat caches only: pools store no head VQ code)
_decode_attention_warp_vq_cuda = _compile(_partition_warp_cuda, False, cuda_kernel, build="vq", vq=True)


def _partition_mma_cuda(qr, q, kc, ks, vc, vs, n_comp, comp_pos0, ke, ve, n_exact, exact_pos, kes, ves, exact_kind,
                        kcent, vcent, kbits, koff, vbits, voff, sshift, scale_table, softmax_scale, bias, has_bias,
                        has_qjl, sq, qsig, qnorm, qjl_const, q_pos0, q_len, causal, part_size, n_comp_parts, kv_indptr,
                        kv_indices, kv_last_page_len, page_size, n_kv_heads, part_m, part_l, part_acc,
                        merge_last, n_rot, msigns, head_rot, hsigns, out, counter, rotate_q):
    """Tensor-core flash-decoding kernel: the warp kernel's grid and partitions, its compressed
    partitions on ``mma.sync`` (:mod:`numba_kv.ops.attention.mma`).

    Launch contract: as :func:`_partition_warp_cuda` with blocks of
    :data:`~numba_kv.ops.attention.mma.MMA_THREADS` threads (its launch bounds), plus ``head_dim`` =
    :data:`~numba_kv.ops.attention.mma.MMA_HEAD_DIM`, K and V codes each of one width in
    :data:`~numba_kv.ops.attention.mma.MMA_BITS` with one codebook for every block (row 0
    of ``kcent``/``vcent`` is read), ``kc``/``vc`` the packed codes viewed as ``uint32`` words
    and every code and scale array 4-D: a pool's ``[pages, num_kv_heads, page_size, ·]``, a
    flat cache's viewed with a unit axis (``[n_g, 1, capacity, ·]``: KV row ``g`` is "page"
    ``g``, head 0; :func:`~numba_kv.ops.attention.mma.token_address`).  A pool's pages hold a
    power of two ``>= 16`` tokens and ``part_size`` is a multiple of 16 (a 16-token tile is on
    one page).  A flat cache's exact
    partitions (sinks, window) run the warp kernel's tiles; a pool is all codes.  The block
    builds the two pair tables in shared memory once.  With ``merge_last`` the last block of
    each ``(g, c)`` to finish merges its rows into ``out`` (as the block kernel); with
    ``rotate_q`` it rotates its query rows itself (as the warp kernel).  The VQ build
    (``decode_attention_mma_vq``: ``mma_partition_vq``, ``build_tables_vq``) also takes head VQ
    layouts (pairs at 4 bits, quads at 2; ``kcent``/``vcent`` rows of 512 / 1024 values with
    every ``|value| <= 1``) and uint8 scale planes (8-bit norms through ``scale_table``), with one
    scale a token (``sshift`` = 2).
    """
    xbuf = cuda.shared.array(XBUF, dtype=float32)  # the simulator's exchanges only
    qs = cuda.shared.array(WARP_QS, dtype=float32)
    pw = cuda.shared.array(WARP_PW, dtype=float32)
    tab = cuda.shared.array(MMA_TAB_SHARED_WORDS, dtype=uint32)  # (the tables realigned inside: aligned_table)
    rows = qr.shape[1]
    d = qr.shape[2]
    n_parts = part_m.shape[1]
    g, tid, p, rb, r0, active = warp_geometry(rows, n_parts)
    if PAGED:  # a pool: tokens at 0, 1, …, one scale per 32-block, float32 tokens (constants)
        comp_pos0, sshift, exact_kind = 0, 0, EXACT_F32
    compressed, t_lo, t_hi, pos_q, first, h = row_bounds_dev(g, min(p, n_parts - 1), n_comp_parts, part_size, n_comp,
                                                            n_exact, q_pos0, q_len, kv_indptr, kv_last_page_len,
                                                            page_size, n_kv_heads)
    if not active or t_hi < t_lo:
        t_hi = t_lo
    kb, vb, kf, vf = build_tables(tab, kcent, vcent, kbits, vbits, tid, cuda.blockDim.x)
    # (ends with the block barrier)
    stage_queries(qs, qr, q, g, r0, rows, d, tid, rotate_q, n_rot > n_comp_parts, head_rot, hsigns, msigns)
    if PAGED or compressed:
        # (an empty partition past a sequence's end stores m = -inf like the other kernels)
        mma_partition(kb, vb, kcent.shape[1] > VQ_PAIR_COLUMNS, vcent.shape[1] > VQ_PAIR_COLUMNS, kc, ks, vc, vs,
                      g, h, PAGED, kv_indices, first, page_size, t_lo, t_hi, comp_pos0, pos_q, q_len, causal, sshift,
                      scale_table, tab, kf, vf, qs, d, rb, r0, softmax_scale, active, p, part_m, part_l, part_acc,
                      tid & 31)
    else:
        st = cuda.local.array(WARP_STATE, dtype=float32)
        acc = cuda.local.array(WARP_VALUES, dtype=float32)
        sc = cuda.local.array(WARP_ROWS, dtype=float32)
        tmp = cuda.local.array(WARP_ROWS, dtype=float32)
        lim4 = cuda.local.array(WARP_ROWS, dtype=int64)
        init_state(st, acc, sc)
        row_limits(lim4, rb, r0, pos_q, q_len, causal)
        exact_tiles(ke, ve, kes, ves, exact_kind, exact_pos, (kv_indices, first, page_size, g, h), scale_table, t_lo,
                    t_hi, t_hi - t_lo, qs, WARP_ROWS * d, d, lim4, softmax_scale, st, acc, sc, tmp, pw, xbuf, tid)
        store_partition(st, acc, active, rb, g, p, r0, d, part_m, part_l, part_acc, xbuf, tid)
    merge_if_last(merge_last, part_m, part_l, part_acc, g, r0, rb, n_rot, msigns, head_rot, hsigns, out, counter, pw,
                  tid, cuda.blockDim.x)


_decode_attention_mma_cuda, _paged_decode_attention_mma_cuda = (
    _compile(_partition_mma_cuda, paged, cuda_kernel(launch_bounds=(MMA_THREADS, MMA_BLOCKS_PER_SM)))
    for paged in (False, True))
# ... and for sm_90 with launch bounds of MMA_BLOCKS_PER_SM_SM90 blocks (128 registers, no
# spill there; sm_80's ptxas spills under them): 16 warps an H100/H200 SM instead of 12
_decode_attention_mma_sm90_cuda, _paged_decode_attention_mma_sm90_cuda = (
    _compile(_partition_mma_cuda, paged, cuda_kernel(launch_bounds=(MMA_THREADS, MMA_BLOCKS_PER_SM_SM90)), "sm90")
    for paged in (False, True))
# ... and the build for the head VQ code and 8-bit norms (kv3; flat caches: pools store neither):
# its tables and quad tiles (mma_vq), one scale a token; the exact tiles are the warp VQ build's
_MMA_VQ = dict(vq=True, mma_partition=mma_partition_vq, build_tables=build_tables_vq)
_decode_attention_mma_vq_cuda, _decode_attention_mma_vq_sm90_cuda = (
    _compile(_partition_mma_cuda, False, cuda_kernel(launch_bounds=(MMA_THREADS, blocks)), build=build, **_MMA_VQ)
    for blocks, build in ((MMA_BLOCKS_PER_SM, "vq"), (MMA_BLOCKS_PER_SM_SM90, "vq_sm90")))
# ... and all of them for head_dim 64 (mma_dims: the same tiles with a lane's share of a head
# halved), the ops *_d64: (flat, paged, VQ) × (any GPU, sm_90)
_MMA64 = {(paged, vq, cc90): _compile(_partition_mma_cuda, paged,
                                      cuda_kernel(launch_bounds=(MMA_THREADS, MMA_BLOCKS_PER_SM_SM90 if cc90
                                                                 else MMA_BLOCKS_PER_SM)),
                                      build=("vq_d64" if vq else "d64") + ("_sm90" if cc90 else ""),
                                      **{**(_MMA_VQ if vq else {}), "mma_partition": mma_partition_for(64, vq)})
          for paged, vq in ((False, False), (True, False), (False, True)) for cc90 in (False, True)}


def _signature(codes: str, exact: str, exact_scales: str, ndim: int, scales: str = "uint16") -> str:
    """Signature of the partition kernels: codes of ``codes`` (``uint8`` packed bytes or
    ``uint32`` words) with scales of ``scales`` (binary16 bits, or ``uint8`` 8-bit norms)
    ``ndim``-D, exact tokens ``exact`` with scales ``exact_scales``."""
    cd = "[" + ", ".join([":"] * (ndim - 1)) + ", ::1]"
    return (f"void(float32[:, :, ::1], float32[:, :, ::1], {codes}{cd}, {scales}{cd}, {codes}{cd}, {scales}{cd}, "
            f"int64, int64, {exact}, {exact}, int64, int32[::1], {exact_scales}, {exact_scales}, int64, "
            "float32[:, ::1], float32[:, ::1], int64[::1], int64[::1], int64[::1], int64[::1], int64, "
            "float32[::1], float32, float32[:, :, ::1], boolean, boolean, float32[:, :, ::1], uint8[:, :, ::1], "
            "uint16[:, ::1], float32, int64, int64, boolean, int64, int64, int32[::1], int32[::1], int32[::1], "
            "int64, int64, float32[:, :, ::1], float32[:, :, ::1], float32[:, :, :, ::1], boolean, int64, "
            "float32[::1], boolean, float32[::1], float32[:, :, ::1], int32[::1], boolean)")


# flat: exact tokens as float32 (the decode_attention op, float32 windows) and as int8 (the
# caches' int8 windows; binary16 windows compile the same code for uint16)
_ASIG = [_signature("uint8", f"{dt}[:, :, ::1]", "uint16[:, :, ::1]", 3) for dt in ("float32", "int8")]
# ... and a norm_bits=8 cache's uint8 norm planes (read through the layer's scale table)
_ASIG_N8 = [*_ASIG, _signature("uint8", "int8[:, :, ::1]", "uint16[:, :, ::1]", 3, scales="uint8")]
# tensor cores: kc/vc are the packed codes viewed as uint32 words, every code array with a
# unit head axis ([n_g, 1, capacity, ·]: the paged addressing, mma.token_address)
_ASIG_MMA = [_signature("uint32", f"{dt}[:, :, ::1]", "uint16[:, :, ::1]", 4) for dt in ("float32", "int8")]
# paged: pools [pages, heads, page_size, ·]; float32 pools are the exact tokens
_PSIG = _signature("uint8", "float32[:, :, :, ::1]", "uint16[:, :, :, ::1]", 4)
DECODE_ATTENTION = register("decode_attention", _decode_attention_cpu, _decode_attention_cuda, _ASIG_N8)
# the same op as one warp per partition (same arguments and partition results; the CPU twin
# is the same tile loop), and on tensor cores
DECODE_ATTENTION_WARP = register("decode_attention_warp", _decode_attention_cpu, _decode_attention_warp_cuda,
                                 _ASIG_N8)
# the warp kernel's build that also decodes the head VQ code (kv3): its own kernel, so the
# scalar build's hot loop keeps its SASS size and registers
DECODE_ATTENTION_WARP_VQ = register("decode_attention_warp_vq", _decode_attention_cpu, _decode_attention_warp_vq_cuda,
                                    _ASIG_N8)
DECODE_ATTENTION_MMA = register("decode_attention_mma", _decode_attention_cpu, _decode_attention_mma_cuda, _ASIG_MMA,
                                cuda_cc={(9, 0): _decode_attention_mma_sm90_cuda})
# the tensor-core build for the head VQ code and 8-bit norms (kv3): binary16 or uint8 scales
DECODE_ATTENTION_MMA_VQ = register(
    "decode_attention_mma_vq", _decode_attention_cpu, _decode_attention_mma_vq_cuda,
    [*_ASIG_MMA, _signature("uint32", "int8[:, :, ::1]", "uint16[:, :, ::1]", 4, scales="uint8")],
    cuda_cc={(9, 0): _decode_attention_mma_vq_sm90_cuda})
# head_dim 64 (the same arguments)
DECODE_ATTENTION_MMA_D64 = register("decode_attention_mma_d64", _decode_attention_cpu, _MMA64[False, False, False],
                                    _ASIG_MMA, cuda_cc={(9, 0): _MMA64[False, False, True]})
DECODE_ATTENTION_MMA_VQ_D64 = register("decode_attention_mma_vq_d64", _decode_attention_cpu, _MMA64[False, True, False],
                                       DECODE_ATTENTION_MMA_VQ.signatures, cuda_cc={(9, 0): _MMA64[False, True, True]})
PAGED_DECODE_ATTENTION = register("paged_decode_attention", _paged_decode_attention_cpu,
                                  _paged_decode_attention_cuda, [_PSIG])
PAGED_DECODE_ATTENTION_WARP = register("paged_decode_attention_warp", _paged_decode_attention_cpu,
                                       _paged_decode_attention_warp_cuda, [_PSIG])
# on tensor cores, for PQO pools (kc/vc: the packed codes viewed as uint32 words)
PAGED_DECODE_ATTENTION_MMA = register("paged_decode_attention_mma", _paged_decode_attention_cpu,
                                      _paged_decode_attention_mma_cuda,
                                      [_signature("uint32", "float32[:, :, :, ::1]", "uint16[:, :, :, ::1]", 4)],
                                      cuda_cc={(9, 0): _paged_decode_attention_mma_sm90_cuda})
PAGED_DECODE_ATTENTION_MMA_D64 = register("paged_decode_attention_mma_d64", _paged_decode_attention_cpu,
                                          _MMA64[True, False, False], PAGED_DECODE_ATTENTION_MMA.signatures,
                                          cuda_cc={(9, 0): _MMA64[True, False, True]})
#: the tensor-core twins by (head_dim, paged, head VQ build)
MMA_TWINS = {(128, False, False): DECODE_ATTENTION_MMA, (128, True, False): PAGED_DECODE_ATTENTION_MMA,
             (128, False, True): DECODE_ATTENTION_MMA_VQ, (64, False, False): DECODE_ATTENTION_MMA_D64,
             (64, True, False): PAGED_DECODE_ATTENTION_MMA_D64, (64, False, True): DECODE_ATTENTION_MMA_VQ_D64}
