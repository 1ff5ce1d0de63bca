"""The partition merge (both twins): combine the split-K partitions of every query row.

Partition ``p`` of query row ``(g, r)`` left ``(m, l, acc)`` (the decode kernels of
:mod:`numba_kv.ops.attention.kernels`).  The merge takes their log-sum-exp, inverse-rotates the
sum of the compressed partitions (they accumulated in the rotated domain: per 32-block or over
the whole head), adds the exact partitions (window, sinks) and normalizes.  Both twins run the
cores of :mod:`numba_kv.ops.attention.cores` in the same order, so they round alike.
"""

from __future__ import annotations

import numpy as np
from numba import cuda, float32, prange

from ..._config import MAX_HEAD_DIM
from ..._jit import cpu_kernel, cuda_device, cuda_kernel, twin
from .._borrow import borrowed, keep_alive
from .._registry import register
from .cores import (
    COLUMN_LANES,
    DENOM_LANES,
    NEG_INF,
    block_signs_cpu,
    block_signs_dev,
    butterfly_pairs_cpu,
    butterfly_pairs_dev,
    inverse_scale_cpu,
    inverse_scale_dev,
    lane_tree_cpu,
    lane_tree_dev,
    merge_column_dev,
    merge_denom_lane_cpu,
    merge_denom_lane_dev,
    merge_max_cpu,
    merge_max_dev,
    merge_weights_cpu,
    merge_weights_dev,
)

__all__ = ["MERGE_CHUNK", "MERGE_PARTITIONS", "MERGE_SCRATCH", "merge_if_last", "merge_rows_dev"]

#: partitions whose merge weights one merge block holds at a time
MERGE_CHUNK = 256
#: shared float32 entries a partition kernel lends :func:`merge_if_last` (the row buffer,
#: the weights, the last-block flag)
MERGE_SCRATCH = MAX_HEAD_DIM + MERGE_CHUNK + 1


def _merge_row(part_m, part_l, part_acc, g, r, n_comp_parts, signs, head_rot, hsigns, wbuf, buf, lanes, dlanes, out):
    """Combine the partitions of query row ``(g, r)`` into ``out[g, r]`` (CPU twin; the CUDA
    kernel runs the same cores, in the same order, with a block of threads).

    The compressed partitions accumulated in the rotated domain: their sum is
    inverse-rotated per 32-block (``head_rot`` false, signs ``signs``) or over the whole
    head (signs ``hsigns``); the exact partitions are added after it, then the row is
    normalized.  ``wbuf`` holds ``n_parts`` floats, ``buf`` ``d``, ``lanes``
    ``COLUMN_LANES × d`` and ``dlanes`` ``DENOM_LANES``.
    """
    n_parts = part_m.shape[1]
    d = out.shape[2]
    m_star = merge_max_cpu(part_m, g, r, 0, n_parts, 1)
    if m_star == NEG_INF:  # no visible token (cannot happen with causal decode)
        for j in range(d):
            out[g, r, j] = float32(0.0)
        return
    merge_weights_cpu(part_m, g, r, 0, n_parts, 1, m_star, wbuf, 0)
    for j in range(d):
        buf[j] = float32(0.0)
    _add_partitions(part_acc, g, r, 0, n_comp_parts, wbuf, lanes, buf)
    if n_comp_parts > 0:
        if not head_rot:
            block_signs_cpu(buf, d, 0, 1, signs)
        h = 1
        while h < (d if head_rot else 32):
            butterfly_pairs_cpu(buf, h, d, 0, 1)
            h *= 2
        inverse_scale_cpu(buf, d, 0, 1, head_rot, hsigns)
    # the denominator's lanes past the partitions are +0, and the terms are >= 0: the device's
    # tree over all 32 lanes adds exact zeros to the tree over the first power of two that
    # holds the partitions (the same bits, a few adds for a few partitions)
    n_lanes = 1
    while n_lanes < min(n_parts, DENOM_LANES):
        n_lanes *= 2
    for k in range(n_lanes):
        dlanes[k] = merge_denom_lane_cpu(part_m, part_l, g, r, k, n_parts, m_star)
    inv = float32(1.0) / lane_tree_cpu(dlanes, 0, n_lanes)
    _add_partitions(part_acc, g, r, n_comp_parts, n_parts, wbuf, lanes, buf)
    orow = out[g, r]
    for j in range(d):
        orow[j] = buf[j] * inv


def _add_partitions(part_acc, g, r, p_lo, p_hi, wbuf, lanes, buf):
    """``buf += Σ_{p_lo <= p < p_hi} wbuf[p] · acc_p`` for row ``(g, r)``: the device's
    :func:`~numba_kv.ops.attention.cores.merge_column` for every column at once (CPU), in its
    order: per :data:`MERGE_CHUNK` partitions, :data:`COLUMN_LANES` interleaved lane sums
    (partition-major over each contiguous row, so that the loop over the columns vectorizes),
    added pairwise into ``buf``; partitions of weight 0 add nothing.  Only the lanes a chunk
    uses are read: a lane that took no partition is +0 on the device, and its pairwise sum
    with +0 lanes is the short one plus +0 (the same value), so a merge of a few partitions
    (the CPU's usual) costs about what its partitions do.  (A lane's first term is set, not
    added to 0: the same value, signed zeros aside.)"""
    d = buf.shape[0]
    for c0 in range(p_lo, p_hi, MERGE_CHUNK):
        c1 = min(p_hi, c0 + MERGE_CHUNK)
        n_lanes = min(COLUMN_LANES, c1 - c0)
        for p in range(c0, c0 + n_lanes):  # each lane's first partition sets it (0 + x)
            k = p - c0
            w = wbuf[p]
            src = part_acc[g, p, r]
            if w != float32(0.0):
                for j in range(d):
                    lanes[k, j] = w * src[j]
            else:
                for j in range(d):
                    lanes[k, j] = float32(0.0)
        for p in range(c0 + n_lanes, c1):
            w = wbuf[p]
            if w != float32(0.0):
                k = (p - c0) & (COLUMN_LANES - 1)
                src = part_acc[g, p, r]
                for j in range(d):
                    lanes[k, j] += w * src[j]
        if n_lanes <= 2:
            if n_lanes == 1:
                for j in range(d):
                    buf[j] = buf[j] + (lanes[0, j] + float32(0.0))
            else:
                for j in range(d):
                    buf[j] = buf[j] + ((lanes[0, j] + lanes[1, j]) + float32(0.0))
        elif n_lanes <= 4:
            for j in range(d):
                a = lanes[0, j] + lanes[1, j]
                b = lanes[2, j] + lanes[3, j] if n_lanes == 4 else lanes[2, j] + float32(0.0)
                buf[j] = buf[j] + ((a + b) + float32(0.0))
        else:
            for j in range(d):
                x = (lanes[0, j] + lanes[1, j]) + (lanes[2, j] + lanes[3, j])
                y4 = lanes[4, j]
                y5 = lanes[5, j] if n_lanes > 5 else float32(0.0)
                y6 = lanes[6, j] if n_lanes > 6 else float32(0.0)
                y7 = lanes[7, j] if n_lanes > 7 else float32(0.0)
                buf[j] = buf[j] + (x + ((y4 + y5) + (y6 + y7)))


add_partitions_cpu = twin(_add_partitions, inline=True)[0]
merge_row_cpu = twin(_merge_row, inline=True)[0]


@cpu_kernel
def _merge_partitions_cpu(part_m, part_l, part_acc, n_comp_parts, signs, head_rot, hsigns, out):
    """CPU twin of the merge: one work item per KV row (``prange``), its query rows in turn
    (its scratch allocated per KV row, not per query row: at decode sizes an allocation per
    query row cost as much as its merge)."""
    n_g, n_parts, rows = part_m.shape
    d = out.shape[2]
    # borrowed views (numba_kv.ops._borrow): the row merge and its rotation make many views
    part_m, part_l, part_acc = borrowed(part_m), borrowed(part_l), borrowed(part_acc)
    signs, hsigns, out = borrowed(signs), borrowed(hsigns), borrowed(out)
    for g in prange(n_g):
        wown = np.empty(n_parts, dtype=np.float32)
        own = np.empty(d, dtype=np.float32)
        lown = np.empty((COLUMN_LANES, d), dtype=np.float32)
        down = np.empty(DENOM_LANES, dtype=np.float32)
        wbuf, buf, lanes, dlanes = borrowed(wown), borrowed(own), borrowed(lown), borrowed(down)
        for r in range(rows):
            merge_row_cpu(part_m, part_l, part_acc, g, r, n_comp_parts, signs, head_rot, hsigns, wbuf, buf, lanes,
                          dlanes, out)
        keep_alive(wown)
        keep_alive(own)
        keep_alive(lown)
        keep_alive(down)


def _row_max(part_m, g, r, n_parts, wbuf, tid, nth):
    """Block-cooperative: the largest running max of row ``(g, r)`` (exact in any order):
    the first ``min(nth, MERGE_CHUNK)`` threads each take a strided share of the partitions
    into shared ``wbuf``, then every thread reads the shares.  Barriers before (the caller's
    last use of ``wbuf``) and after."""
    nred = min(nth, MERGE_CHUNK)
    cuda.syncthreads()
    if tid < nred:
        wbuf[tid] = merge_max_dev(part_m, g, r, tid, n_parts, nred)
    cuda.syncthreads()
    m_star = NEG_INF
    for t in range(nred):
        m_star = max(m_star, wbuf[t])
    return m_star


def _row_denom(part_m, part_l, g, r, n_parts, m_star, wbuf, tid, nth):
    """Block-cooperative: the softmax denominator of row ``(g, r)`` in the CPU twin's order
    (:data:`DENOM_LANES` lanes, one per thread where there are enough, then thread 0 adds
    them pairwise in shared ``wbuf``).  Barriers before and after."""
    cuda.syncthreads()
    for k in range(tid, DENOM_LANES, nth):
        wbuf[k] = merge_denom_lane_dev(part_m, part_l, g, r, k, n_parts, m_star)
    cuda.syncthreads()
    if tid == 0:
        lane_tree_dev(wbuf, 0, DENOM_LANES)
    cuda.syncthreads()
    return wbuf[0]


row_max_dev = cuda_device(_row_max)
row_denom_dev = cuda_device(_row_denom)


def _merge_rows(part_m, part_l, part_acc, g, r_lo, r_hi, n_comp_parts, signs, head_rot, hsigns, out, buf, wbuf, tid,
                nth):
    """Merge query rows ``r_lo … r_hi − 1`` of KV row ``g`` into ``out`` with the whole block
    (block-cooperative: every thread of the block calls it with the same rows).

    Each thread owns the columns ``j = tid, tid + nth, …`` of the shared row buffer ``buf``
    (at least ``d`` floats); the row's maximum and softmax denominator are block reductions
    through the shared ``wbuf`` (:data:`MERGE_CHUNK` floats), the partition weights are
    computed :data:`MERGE_CHUNK` at a time into it, each column's weighted sum runs in
    :data:`COLUMN_LANES` interleaved lanes, and the inverse rotation of the compressed sum
    runs as butterfly stages over ``buf`` (one pair per thread and step, ``syncthreads``
    between stages).  Same cores in the same order as the CPU twin's :func:`_merge_row`,
    whatever ``nth``, so the MERGE_PARTITIONS kernel and a partition kernel's last block
    (:func:`merge_if_last`) write the same bits.  (It was one thread's serial loop per
    maximum, column and denominator: at batch 1 and 256 partitions a row, each partition
    cost the merging block about 2 µs, most of an H200 step at T = 32K.)  The caller puts a
    block barrier between its own use of ``buf`` / ``wbuf`` and this call.
    """
    n_parts = part_m.shape[1]
    d = out.shape[2]
    for r in range(r_lo, r_hi):
        m_star = row_max_dev(part_m, g, r, n_parts, wbuf, tid, nth)
        if m_star == NEG_INF:  # the whole block agrees: every thread read the same maxima
            for j in range(tid, d, nth):
                out[g, r, j] = float32(0.0)
            continue
        for j in range(tid, d, nth):
            buf[j] = float32(0.0)
        for c0 in range(0, n_comp_parts, MERGE_CHUNK):
            c1 = min(n_comp_parts, c0 + MERGE_CHUNK)
            cuda.syncthreads()
            merge_weights_dev(part_m, g, r, c0 + tid, c1, nth, m_star, wbuf, c0)
            cuda.syncthreads()
            for j in range(tid, d, nth):
                buf[j] = merge_column_dev(wbuf, part_acc, g, r, j, c0, c1, c0, buf[j])
        if n_comp_parts > 0:
            cuda.syncthreads()
            if not head_rot:
                block_signs_dev(buf, d, tid, nth, signs)
                cuda.syncthreads()
            h = 1
            h_end = d if head_rot else 32
            while h < h_end:
                butterfly_pairs_dev(buf, h, d, tid, nth)
                cuda.syncthreads()
                h *= 2
            inverse_scale_dev(buf, d, tid, nth, head_rot, hsigns)
        inv = float32(1.0) / row_denom_dev(part_m, part_l, g, r, n_parts, m_star, wbuf, tid, nth)
        for c0 in range(n_comp_parts, n_parts, MERGE_CHUNK):
            c1 = min(n_parts, c0 + MERGE_CHUNK)
            cuda.syncthreads()
            merge_weights_dev(part_m, g, r, c0 + tid, c1, nth, m_star, wbuf, c0)
            cuda.syncthreads()
            for j in range(tid, d, nth):
                buf[j] = merge_column_dev(wbuf, part_acc, g, r, j, c0, c1, c0, buf[j])
        for j in range(tid, d, nth):
            out[g, r, j] = buf[j] * inv


#: the row merge, called by the MERGE_PARTITIONS kernel and the partition kernels' epilogue
#: (:func:`merge_if_last`): a device function compiled once and linked (NVVM inlines it),
#: not copied into each caller's Numba IR like the small cores
merge_rows_dev = cuda.jit(device=True)(_merge_rows)


@cuda_kernel
def _merge_partitions_cuda(part_m, part_l, part_acc, n_comp_parts, signs, head_rot, hsigns, out):
    """Cooperative merge of the partitions (log-sum-exp).

    Launch contract: grid ``(n_g, rows)``, any block size.  Block ``(g, r)`` merges query
    row ``(g, r)`` (:func:`_merge_rows`, the device function the partition kernels' last
    block runs too).
    """
    buf = cuda.shared.array(MAX_HEAD_DIM, dtype=float32)
    wbuf = cuda.shared.array(MERGE_CHUNK, dtype=float32)
    r = cuda.blockIdx.y
    merge_rows_dev(part_m, part_l, part_acc, cuda.blockIdx.x, r, r + 1, n_comp_parts, signs, head_rot, hsigns, out, buf,
                   wbuf, cuda.threadIdx.x, cuda.blockDim.x)


@cuda_device
def merge_if_last(merge_last, part_m, part_l, part_acc, g, r0, rb, n_comp_parts, signs, head_rot, hsigns, out, counter,
                  scratch, tid, nth):
    """Epilogue of a partition kernel: the last block of row chunk ``(g, blockIdx.z)`` to
    finish merges its rows ``r0 … r0 + rb − 1`` (issue 27: no MERGE_PARTITIONS launch).

    Launch contract (the partition kernels'): every thread of the block calls it after the
    block stored its partitions' ``(m, l, acc)``, the grid's y axis spans the partitions of
    a row chunk (``gridDim.y`` blocks arrive per chunk), ``counter`` (int32, at least
    ``n_g · gridDim.z`` entries) is zero for this chunk at launch and left zero at exit.
    ``scratch``: shared float32, at least :data:`MAX_HEAD_DIM` + :data:`MERGE_CHUNK` + 1
    entries, free for the epilogue.  Does nothing when ``merge_last`` is false (the host
    launches MERGE_PARTITIONS) or ``rb <= 0``.

    Memory ordering (release / acquire through fences, the CUDA programming guide's
    last-block pattern): every thread fences its partial results before the block barrier
    that precedes thread 0's ``atomic.add`` (release, cumulative through the barrier); the
    block that sees ``gridDim.y − 1`` fences again before any thread reads the other blocks'
    partials (acquire; ``membar.gl`` also discards stale L1 lines).  It resets the counter
    (no other block of the launch touches it again), so no memset launch precedes a step
    and a CUDA graph replays the launch as is.  A single block per chunk (one partition, or
    one block of warps holding every partition) merges without the counter.
    """
    if not merge_last or rb <= 0:
        return
    if cuda.gridDim.y > 1:
        cuda.threadfence()  # release: this thread's partials before the block's arrival
        cuda.syncthreads()
        if tid == 0:
            slot = g * cuda.gridDim.z + cuda.blockIdx.z
            last = cuda.atomic.add(counter, slot, 1) == cuda.gridDim.y - 1
            if last:
                counter[slot] = 0
            scratch[MAX_HEAD_DIM + MERGE_CHUNK] = float32(1.0) if last else float32(0.0)
        cuda.syncthreads()
        if scratch[MAX_HEAD_DIM + MERGE_CHUNK] == float32(0.0):  # block-uniform: one shared flag
            return
        cuda.threadfence()  # acquire: every other block's partials
    cuda.syncthreads()  # the kernel's own use of the scratch buffer is over
    merge_rows_dev(part_m, part_l, part_acc, g, r0, r0 + rb, n_comp_parts, signs, head_rot, hsigns, out,
                   scratch[:MAX_HEAD_DIM], scratch[MAX_HEAD_DIM:MAX_HEAD_DIM + MERGE_CHUNK], tid, nth)


_MSIG = ("void(float32[:, :, ::1], float32[:, :, ::1], float32[:, :, :, ::1], int64, float32[::1], boolean, "
         "float32[::1], float32[:, :, ::1])")
MERGE_PARTITIONS = register("merge_partitions", _merge_partitions_cpu, _merge_partitions_cuda, [_MSIG])
