"""Fused decode attention over paged K/V pools, read through a FlashInfer-style page table.

A page pool holds either PQO-compressed tokens (``k_codes``/``k_scales``/``v_codes``/
``v_scales`` ``[num_pages, H, page_size, ·]``, one binary16 scale per 32-block) or float32
tokens (``k_pages``/``v_pages`` ``[num_pages, H, page_size, d]``).  Token ``t`` of batch
sequence ``i`` lives at page ``kv_indices[kv_indptr[i] + t // page_size]``, slot
``t % page_size``; sequence ``i`` holds ``(n_pages_i − 1)·page_size + kv_last_page_len[i]``
tokens.  The math is that of :mod:`numba_kv.ops.attention` (rotated queries against
codebook values, rotated-domain value accumulation, split-K partitions merged by
log-sum-exp) and so are the cores and the merge kernel; only the token addressing differs.
Each sequence may have its own length; its ``q_len`` new queries sit at its last ``q_len``
positions (causal).  :meth:`numba_kv.PagedKVCache.decode_attention` calls this with its
own pools and page table.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numba import cuda, float32, int64, prange, uint8, uint32

from ... import _backend
from ..._jit import FASTMATH_REDUCE, cpu_kernel, cpu_serial, cuda_kernel
from ..._validate import check_float_array
from .._registry import register
from ..finite import check_finite
from ..hadamard import SIGNS32, rotate32, rotate32_rows
from .cores import (
    NEG_INF,
    coop_init_rows_dev,
    coop_load_rows_dev,
    coop_pv_dev,
    coop_softmax_rows_dev,
    coop_store_rows_dev,
    coop_tile_paged_dev,
    dot_shared_dev,
    paged_bounds_cpu,
    paged_bounds_dev,
    visible_dev,
)
from .cpu import decode_tile_simd_cpu, softmax_tile_cpu, tile_pv_cpu, tile_scores_cpu
from .flat import (
    F16_ABS_TABLE,
    CodeLayout,
    default_partition_size,
    launch_attention,
    launch_merge,
    mma_operands,
    use_mma_kernel,
    use_warp_kernel,
)
from .kernels import (
    CPU_TILE,
    MAX_BLOCK_ROWS,
    SMEM_ROWS,
    SMEM_SCORES,
    SMEM_TILE,
    tile_tokens_dev,
)
from .mma import (
    MMA_BLOCKS_PER_SM,
    MMA_TAB_WORDS,
    MMA_THREADS,
    build_tables,
    mma_partition,
    mma_partition_size,
)
from .warp import (
    SIMULATED,
    VROW,
    WARP_PW,
    WARP_QS,
    WARP_ROWS,
    WARP_STATE,
    WARP_VALUES,
    WARP_VRAW,
    WARP_VSC,
    XBUF,
    init_state,
    paged_compressed_tiles,
    paged_float_tiles,
    row_limits,
    stage_queries,
    store_partition,
    warp_geometry,
)

__all__ = ["paged_decode_attention"]


def _paged_tile(codes, scales, pages, compressed, kv_indices, first, page_size, h, t0, nt, cent, bits, nb,
                    scale_table, buf):
    """Tokens ``t0 … t0 + nt − 1`` into the rows of ``buf`` (CPU): decoded (or copied) one run
    of consecutive page slots at a time."""
    d = buf.shape[1]
    tt = 0
    while tt < nt:
        page = kv_indices[first + (t0 + tt) // page_size]
        slot = (t0 + tt) % page_size
        run = min(nt - tt, page_size - slot)
        if compressed:
            decode_tile_simd_cpu(codes[page, h], scales[page, h], slot, run, cent, bits, nb, 0, scale_table, buf, tt)
        else:
            for i in range(run):
                for j in range(d):
                    buf[tt + i, j] = pages[page, h, slot + i, j]
        tt += run


paged_tile_cpu = cpu_serial(_paged_tile)


@cpu_kernel(fastmath=FASTMATH_REDUCE)
def _paged_decode_attention_cpu(qr, q, kc, ks, vc, vs, kp, vp, compressed, kv_indptr, kv_indices,
                                kv_last_page_len, page_size, n_kv_heads, kcent, vcent, kbits, koff, vbits, voff,
                                scale_table, softmax_scale, q_len, causal, part_size, part_m, part_l, part_acc):
    """CPU twin: one work item per (sequence·KV head ``g``, partition ``p``) (``prange``),
    the tile loop of the flat CPU twin with page-table addressing (uniform widths: the
    SIMD decoders read ``kcent[0]``/``kbits[0]``)."""
    n_g, rows, d = qr.shape
    nb = d // 32
    n_parts = part_m.shape[1]
    kcent0 = kcent[0]
    vcent0 = vcent[0]
    kb0 = kbits[0]
    vb0 = vbits[0]
    for item in prange(n_g * n_parts):
        g = item // n_parts
        p = item - g * n_parts
        seq = g // n_kv_heads
        h = g - seq * n_kv_heads
        first, T, t_lo, t_hi = paged_bounds_cpu(seq, p, part_size, kv_indptr, kv_last_page_len, page_size)
        q_pos0 = T - q_len
        buf = np.empty((CPU_TILE, d), dtype=np.float32)
        sc = np.empty((rows, CPU_TILE), dtype=np.float32)
        acc = np.zeros((rows, d), dtype=np.float32)
        m = np.full(rows, NEG_INF, dtype=np.float32)
        l = np.zeros(rows, dtype=np.float32)
        no_bias = np.zeros((1, 1, 1), dtype=np.float32)
        no_pos = np.zeros(1, dtype=np.int32)
        qsrc = qr[g] if compressed else q[g]
        for t0 in range(t_lo, t_hi, CPU_TILE):
            nt = min(CPU_TILE, t_hi - t0)
            paged_tile_cpu(kc, ks, kp, compressed, kv_indices, first, page_size, h, t0, nt, kcent0, kb0, nb,
                           scale_table, buf)
            tile_scores_cpu(qsrc, buf, nt, sc)
            softmax_tile_cpu(sc, nt, softmax_scale, g, False, no_bias, causal and t0 + nt - 1 > q_pos0, q_pos0,
                             q_len, t0, no_pos, False, 0, m, l, acc)
            # values of the tile into the same buffer
            paged_tile_cpu(vc, vs, vp, compressed, kv_indices, first, page_size, h, t0, nt, vcent0, vb0, nb,
                           scale_table, buf)
            tile_pv_cpu(sc, buf, nt, acc)
        for r in range(rows):
            part_m[g, p, r] = m[r]
            part_l[g, p, r] = l[r]
            for j in range(d):
                part_acc[g, p, r, j] = acc[r, j]


@cuda_kernel
def _paged_decode_attention_cuda(qr, q, kc, ks, vc, vs, kp, vp, compressed, kv_indptr, kv_indices,
                                 kv_last_page_len, page_size, n_kv_heads, kcent, vcent, kbits, koff, vbits, voff,
                                 scale_table, softmax_scale, q_len, causal, part_size, part_m, part_l, part_acc):
    """Cooperative paged partition kernel (the flat kernel's tile loop, page addressing).

    Launch contract: grid ``(n_seq·num_kv_heads, n_parts, n_chunks)``, any block size (128
    on a GPU).  Block ``(g, p, c)`` runs query rows ``c·rb … c·rb + rb − 1`` of sequence·KV
    head ``g`` over the tokens of partition ``p`` of that sequence (none when the sequence
    is shorter): per tile the K then the V tokens are decoded (or copied) once into shared
    memory, one group of eight values per thread, and shared by every query row of the
    GQA group; scores one (row, token) per thread, the softmax step one row per thread,
    ``P·V`` one (row, column) per thread into shared accumulators.
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
    g = cuda.blockIdx.x
    p = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    nth = cuda.blockDim.x
    rb = (rows + cuda.gridDim.z - 1) // cuda.gridDim.z
    r0 = cuda.blockIdx.z * rb
    rb = min(rb, rows - r0)
    if rb <= 0:
        return
    seq = g // n_kv_heads
    h = g - seq * n_kv_heads
    first, T, t_lo, t_hi = paged_bounds_dev(seq, p, part_size, kv_indptr, kv_last_page_len, page_size)
    q_pos0 = T - q_len
    stride = d + 1
    nt_max = tile_tokens_dev(d)
    coop_load_rows_dev(qs, qr if compressed else q, g, r0, rb, d, tid, nth)
    coop_init_rows_dev(acc, m, lsum, rb, d, tid, nth)
    cuda.syncthreads()
    for t0 in range(t_lo, t_hi, nt_max):
        nt = min(nt_max, t_hi - t0)
        coop_tile_paged_dev(kc, ks, kp, compressed, kv_indices, first, page_size, h, t0, nt, nb, kcent, kbits, koff,
                            scale_table, kv, stride, tid, nth)
        cuda.syncthreads()
        for u in range(tid, rb * nt, nth):
            r = u // nt
            tt = u - r * nt
            s = dot_shared_dev(qs, r * d, kv, tt * stride, d) * softmax_scale
            sc[u] = s if visible_dev(t0 + tt, q_pos0, r0 + r, q_len, causal) else NEG_INF
        cuda.syncthreads()
        coop_softmax_rows_dev(sc, nt, rb, m, lsum, alpha, tid, nth)
        cuda.syncthreads()
        coop_tile_paged_dev(vc, vs, vp, compressed, kv_indices, first, page_size, h, t0, nt, nb, vcent, vbits, voff,
                            scale_table, kv, stride, tid, nth)
        cuda.syncthreads()
        coop_pv_dev(sc, kv, stride, nt, rb, d, alpha, acc, tid, nth)
        cuda.syncthreads()
    coop_store_rows_dev(acc, m, lsum, rb, d, g, p, r0, part_m, part_l, part_acc, tid, nth)


@cuda_kernel
def _paged_decode_attention_warp_cuda(qr, q, kc, ks, vc, vs, kp, vp, compressed, kv_indptr, kv_indices,
                                      kv_last_page_len, page_size, n_kv_heads, kcent, vcent, kbits, koff, vbits, voff,
                                      scale_table, softmax_scale, q_len, causal, part_size, part_m, part_l, part_acc):
    """Warp-per-partition paged kernel (the flat warp kernel's tiles, page addressing).

    Launch contract: grid ``(n_seq·num_kv_heads, ceil(n_parts / warps per block),
    n_chunks)`` with whole warps per block, ``head_dim`` in 32, 64, 128 and at most
    :data:`WARP_ROWS` query rows per chunk.  Warp ``w`` of block ``(g, y, c)`` runs
    partition ``y·warps + w`` of sequence·KV head ``g`` (empty past the sequence's end: it
    stores ``m = -inf``) as the flat warp kernel does (:mod:`numba_kv.ops.attention.warp`).
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
    seq = g // n_kv_heads
    h = g - seq * n_kv_heads
    first, T, t_lo, t_hi = paged_bounds_dev(seq, min(p, n_parts - 1), part_size, kv_indptr, kv_last_page_len,
                                            page_size)
    if not active or t_hi < t_lo:
        t_hi = t_lo
    stage_queries(qs, qr, q, g, r0, rows, d, tid)
    st = cuda.local.array(WARP_STATE, dtype=float32)
    acc = cuda.local.array(WARP_VALUES, dtype=float32)
    sc = cuda.local.array(WARP_ROWS, dtype=float32)
    tmp = cuda.local.array(WARP_ROWS, dtype=float32)
    lim = cuda.local.array(WARP_ROWS, dtype=int64)
    init_state(st, acc, sc)
    row_limits(lim, rb, r0, T - q_len, q_len, causal)
    span = part_size if SIMULATED else t_hi - t_lo
    if compressed:
        paged_compressed_tiles(kc, ks, vc, vs, h, kv_indices, first, page_size, kbits, koff, vbits, voff, kcent, vcent,
                               scale_table, t_lo, t_hi, span, qs, lim, softmax_scale, st, acc, sc, tmp, vraw, vsc, pw,
                               xbuf, tid)
    else:
        paged_float_tiles(kp, vp, h, kv_indices, first, page_size, t_lo, t_hi, span, qs, WARP_ROWS * d, d, lim,
                          softmax_scale, st, acc, sc, tmp, pw, xbuf, tid)
    store_partition(st, acc, active, rb, g, p, r0, d, part_m, part_l, part_acc, xbuf, tid)


@cuda_kernel(launch_bounds=(MMA_THREADS, MMA_BLOCKS_PER_SM))
def _paged_decode_attention_mma_cuda(qr, q, kc, ks, vc, vs, kp, vp, compressed, kv_indptr, kv_indices,
                                     kv_last_page_len, page_size, n_kv_heads, kcent, vcent, kbits, koff, vbits, voff,
                                     scale_table, softmax_scale, q_len, causal, part_size, part_m, part_l, part_acc):
    """Tensor-core paged kernel: the flat tensor-core kernel's tiles
    (:func:`~numba_kv.ops.attention.mma.mma_partition`) with page addressing.

    Launch contract: as :func:`_paged_decode_attention_warp_cuda` with blocks of
    :data:`~numba_kv.ops.attention.mma.MMA_THREADS` threads, PQO codes (``compressed``)
    of one width each in :data:`~numba_kv.ops.attention.mma.MMA_BITS` with one codebook,
    ``head_dim`` = :data:`~numba_kv.ops.attention.mma.MMA_HEAD_DIM` and ``kc``/``vc`` viewed
    as ``uint32`` words (``[pages, num_kv_heads, page_size, width / 4]``).
    """
    qs = cuda.shared.array(WARP_QS, dtype=float32)
    tab = cuda.shared.array(MMA_TAB_WORDS, dtype=uint32)
    rows = qr.shape[1]
    d = qr.shape[2]
    n_parts = part_m.shape[1]
    g, tid, p, rb, r0, active = warp_geometry(rows, n_parts)
    seq = g // n_kv_heads
    h = g - seq * n_kv_heads
    first, T, t_lo, t_hi = paged_bounds_dev(seq, min(p, n_parts - 1), part_size, kv_indptr, kv_last_page_len,
                                            page_size)
    if not active or t_hi < t_lo:
        t_hi = t_lo
    kb, vb, kf, vf = build_tables(tab, kcent, vcent, kbits, vbits, tid, cuda.blockDim.x)
    stage_queries(qs, qr, q, g, r0, rows, d, tid)  # (ends with the block barrier)
    # an empty partition past the sequence's end stores m = -inf like the other kernels
    mma_partition(kb, vb, kc, ks, vc, vs, g, h, True, kv_indices, first, page_size, t_lo, t_hi, 0, T - q_len, q_len,
                  causal, 0, tab, kf, vf, qs, d, rb, r0, softmax_scale, active, p, part_m, part_l, part_acc, tid & 31)


_PSIG = ("void(float32[:, :, ::1], float32[:, :, ::1], uint8[:, :, :, ::1], uint16[:, :, :, ::1], "
         "uint8[:, :, :, ::1], uint16[:, :, :, ::1], float32[:, :, :, ::1], float32[:, :, :, ::1], boolean, "
         "int32[::1], int32[::1], int32[::1], int64, int64, float32[:, ::1], float32[:, ::1], int64[::1], "
         "int64[::1], int64[::1], int64[::1], float32[::1], float32, int64, boolean, int64, float32[:, :, ::1], "
         "float32[:, :, ::1], float32[:, :, :, ::1])")
PAGED_DECODE_ATTENTION = register("paged_decode_attention", _paged_decode_attention_cpu,
                                  _paged_decode_attention_cuda, [_PSIG])
# the same op as one warp per partition (same arguments and partition results)
PAGED_DECODE_ATTENTION_WARP = register("paged_decode_attention_warp", _paged_decode_attention_cpu,
                                       _paged_decode_attention_warp_cuda, [_PSIG])
# on tensor cores, for PQO pools (kc/vc: the packed codes viewed as uint32 words)
PAGED_DECODE_ATTENTION_MMA = register("paged_decode_attention_mma", _paged_decode_attention_cpu,
                                      _paged_decode_attention_mma_cuda,
                                      [_PSIG.replace("uint8[:, :, :, ::1]", "uint32[:, :, :, ::1]")])


def _check_kind(k_pages: Any, v_pages: Any, k_codes: Any, k_scales: Any, v_codes: Any, v_scales: Any) -> None:
    """``ValueError`` unless exactly one kind of pool (float32 pages or PQO codes) is complete."""
    codes = (k_codes, k_scales, v_codes, v_scales)
    if (k_pages is None) == (k_codes is None) or (k_pages is None) != (v_pages is None) or \
            any((a is None) != (k_codes is None) for a in codes):
        raise ValueError("k_pages: expected either k_pages and v_pages (float32 pools) or k_codes, k_scales, "
                         "v_codes and v_scales (PQO pools) with k_codebook and v_codebook")


def _pools(q3: Any, d: int, k_pages: Any, v_pages: Any, k_codes: Any, k_scales: Any, v_codes: Any, v_scales: Any,
           k_codebook: Any, v_codebook: Any) -> tuple:
    """``(compressed, page_size, (kc, ks, vc, vs, kp, vp), klayout, vlayout)`` with placeholders
    for the pool kind not given; validates that exactly one kind is."""
    _check_kind(k_pages, v_pages, k_codes, k_scales, v_codes, v_scales)
    if k_pages is not None:
        for name, a in (("k_pages", k_pages), ("v_pages", v_pages)):
            if len(a.shape) != 4 or int(a.shape[3]) != d or np.dtype(a.dtype) != np.float32:
                raise ValueError(f"{name}: expected float32 [num_pages, num_kv_heads, page_size, {d}], got "
                                 f"{a.dtype} {tuple(a.shape)}")
        kc = vc = _backend.empty(q3, (1, 1, 1, 1), np.uint8)
        ks = vs = _backend.empty(q3, (1, 1, 1, 1), np.uint16)
        return False, int(k_pages.shape[2]), (kc, ks, vc, vs, k_pages, v_pages), None, None
    if k_codebook is None or v_codebook is None:
        raise ValueError("k_codebook: PQO pools need k_codebook and v_codebook")
    lay = [CodeLayout.uniform(cb, d) for cb in (k_codebook, v_codebook)]
    for name, a, width, dt in (("k_codes", k_codes, lay[0].width, np.uint8),
                               ("k_scales", k_scales, d // 32, np.uint16),
                               ("v_codes", v_codes, lay[1].width, np.uint8),
                               ("v_scales", v_scales, d // 32, np.uint16)):
        if len(a.shape) != 4 or int(a.shape[3]) != width or np.dtype(a.dtype) != dt:
            raise ValueError(f"{name}: expected {np.dtype(dt)} [num_pages, num_kv_heads, page_size, {width}], got "
                             f"{a.dtype} {tuple(a.shape)}")
    kp = vp = _backend.empty(q3, (1, 1, 1, 1), np.float32)
    return True, int(k_codes.shape[2]), (k_codes, k_scales, v_codes, v_scales, kp, vp), lay[0], lay[1]


def _seq_lens(page_table: Sequence[Any], page_size: int, seq_lens: Sequence[int] | None) -> list[int]:
    """Tokens of every sequence: ``seq_lens`` when given, else read from the page table
    (a device→host copy when the table lives on the device)."""
    if seq_lens is not None:
        return [int(n) for n in seq_lens]
    indptr, _, last = (_backend.to_host(a) for a in page_table)
    npages = np.diff(indptr.astype(np.int64))
    return [int((n - 1) * page_size + x) if n > 0 else 0 for n, x in zip(npages, last)]


def paged_decode_attention(q: Any, page_table: Sequence[Any], *, k_pages: Any = None, v_pages: Any = None,
                           k_codes: Any = None, k_scales: Any = None, v_codes: Any = None, v_scales: Any = None,
                           k_codebook: Any = None, v_codebook: Any = None, seq_lens: Sequence[int] | None = None,
                           softmax_scale: float | None = None, causal: bool = True,
                           partition_size: int | None = None, check_values: bool = True) -> Any:
    """Attention of new queries over paged K/V pools, read through a page table.

    Parameters
    ----------
    q : float array, shape ``(n_seq, num_heads, q_len, head_dim)``
        One row per sequence of the page table; ``num_heads`` a multiple of the pools'
        ``num_kv_heads`` (contiguous GQA groups).
    page_table : ``(kv_indptr, kv_indices, kv_last_page_len)``
        int32 arrays of shapes ``(n_seq + 1,)``, ``(kv_indptr[-1],)``, ``(n_seq,)`` on the
        device of ``q`` (a :class:`numba_kv.caches.paged.PageTable` fits).
    k_pages, v_pages : float32 array, shape ``(num_pages, num_kv_heads, page_size, head_dim)``
        Float32 pools; or else
    k_codes, v_codes : uint8 array, shape ``(num_pages, num_kv_heads, page_size, head_dim·bits/8)``
    k_scales, v_scales : uint16 array, shape ``(num_pages, num_kv_heads, page_size, head_dim/32)``
        PQO pools (32-block rotation, one binary16 scale per block) decoded with
    k_codebook, v_codebook : Codebook
        The codebooks of the K and V codes.
    seq_lens : sequence of int, optional
        Tokens of every sequence (host ints; default: read from the page table, a
        device→host copy when it lives on the device).
    softmax_scale : float, optional
        Default ``1/sqrt(head_dim)``.
    causal : bool
        The ``q_len`` queries of a sequence sit at its last ``q_len`` positions.
    partition_size : int, optional
        Tokens per split-K partition.
    check_values : bool
        Reject a non-finite ``q`` (on a GPU: one device-to-host read).  ``False`` when the
        caller checked or deferred that itself (:meth:`PagedKVCache.decode_attention`).

    Returns
    -------
    out : float32 array, shape ``(n_seq, num_heads, q_len, head_dim)``, on the device of ``q``.

    Raises
    ------
    ValueError
        Empty sequence, shape/group mismatch, pools of both or neither kind, device mismatch.
    """
    indptr, indices, last = page_table
    dev = _backend.resolve_device("auto", q=q, kv_indptr=indptr, kv_indices=indices, kv_last_page_len=last,
                                  k_pages=k_pages, v_pages=v_pages, k_codes=k_codes, k_scales=k_scales,
                                  v_codes=v_codes, v_scales=v_scales)
    check_float_array("q", q, 4)
    _check_kind(k_pages, v_pages, k_codes, k_scales, v_codes, v_scales)
    n_seq, hq, ql, d = (int(x) for x in q.shape)
    pool = k_pages if k_pages is not None else k_scales
    hkv, pool_d = 0, 0
    if pool is not None and len(pool.shape) == 4:
        hkv = int(pool.shape[1])
        pool_d = int(pool.shape[3]) * (1 if k_pages is not None else 32)
    if d % 32 or d != pool_d or hkv < 1 or hq % hkv:
        raise ValueError(f"q: expected [n_seq, k·{hkv}, q_len, {pool_d}] (the pools' KV heads and head_dim), got "
                         f"shape {(n_seq, hq, ql, d)}")
    if len(last.shape) != 1 or int(last.shape[0]) != n_seq or int(indptr.shape[0]) != n_seq + 1:
        raise ValueError(f"q: expected {int(last.shape[0])} rows (one per sequence of the page table), got {n_seq}")
    if check_values:
        check_finite("q", q)
    g, rows = n_seq * hkv, (hq // hkv) * ql
    q3 = _backend.ascontiguous_f32("q", q).reshape(g, rows, d)
    compressed, page_size, arrays, klay, vlay = _pools(q3, d, k_pages, v_pages, k_codes, k_scales, v_codes, v_scales,
                                                       k_codebook, v_codebook)
    lens = _seq_lens(page_table, page_size, seq_lens)
    if min(lens) < max(1, ql if causal else 1):
        raise ValueError(f"seq_ids: every sequence needs >= max(1, q_len={ql}) stored tokens, got lengths {lens}")
    if not compressed:
        qr = q3
    elif check_values:
        qr = rotate32(q3)  # checks that the rotation stays finite (a host read on the device)
    else:  # the caller vouched for q: no read back
        qr = rotate32_rows(q3.reshape(g * rows, d)).reshape(g, rows, d)
    # the warp kernel stages each token's packed V bytes: at most VROW per token
    warp = use_warp_kernel(dev, d, False, False) and (not compressed or int(arrays[2].shape[3]) <= VROW)
    mma = None  # the pools as the tensor-core kernel reads them, where it runs
    if compressed and warp and use_mma_kernel(dev, d, False, False, klay, vlay):
        mma = mma_operands(*arrays[:4], flat=False)
    if partition_size is None:
        if mma is not None and not _backend.simulator_enabled():
            partition_size = mma_partition_size(max(lens), g)
        else:
            partition_size = default_partition_size(max(lens), g, dev, warp)
    n_parts = max(1, -(-max(lens) // partition_size))
    part_m = _backend.empty(q3, (g, n_parts, rows), np.float32)
    part_l = _backend.empty(q3, (g, n_parts, rows), np.float32)
    part_acc = _backend.empty(q3, (g, n_parts, rows, d), np.float32)
    out = _backend.empty(q3, (g, rows, d), np.float32)
    c = lambda a: _backend.constant(q3, a)  # noqa: E731
    if compressed:
        lay = (c(klay.centroids), c(vlay.centroids), c(klay.bits), c(klay.offsets), c(vlay.bits), c(vlay.offsets))
    else:
        lay = (c(_FLOAT_CENT), c(_FLOAT_CENT), c(_FLOAT_BITS), c(_FLOAT_BITS), c(_FLOAT_BITS), c(_FLOAT_BITS))
    scale = np.float32(d ** -0.5 if softmax_scale is None else softmax_scale)
    args = (qr, q3, *arrays, compressed, indptr, indices, last, page_size, hkv, *lay, c(F16_ABS_TABLE), scale, ql,
            bool(causal), int(partition_size), part_m, part_l, part_acc)
    kernel = PAGED_DECODE_ATTENTION_WARP if warp else PAGED_DECODE_ATTENTION
    if mma is not None:
        kernel = PAGED_DECODE_ATTENTION_MMA
        args = args[:2] + mma + args[6:]
    launch_attention(dev, kernel, args, g, n_parts, rows, d, g * rows * d * sum(lens) // n_seq, warp)
    signs = c(SIGNS32)
    launch_merge(dev, (part_m, part_l, part_acc, n_parts if compressed else 0, signs, False, signs, out), g, rows, d,
                 g * rows * d * n_parts)
    return out.reshape(n_seq, hq, ql, d)


# placeholders of the layout arguments for float32 pools (never read)
_FLOAT_CENT = np.zeros((1, 16), np.float32)
_FLOAT_BITS = np.ones(1, np.int64)
for _a in (_FLOAT_CENT, _FLOAT_BITS):
    _a.flags.writeable = False
