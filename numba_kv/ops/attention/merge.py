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
    column_term_dev,
    inverse_scale_cpu,
    inverse_scale_dev,
    lane_tree_cpu,
    lane_tree_dev,
    merge_denom_lane_cpu,
    merge_denom_lane_dev,
    merge_max_cpu,
    merge_max_dev,
    merge_weights_cpu,
    merge_weights_dev,
)

__all__ = ["MERGE_CHUNK", "MERGE_COLUMNS", "MERGE_PARTITIONS", "MERGE_ROWS", "MERGE_SCRATCH", "merge_if_last",
           "merge_rows_dev"]

#: partitions whose merge weights one merge block holds at a time, per query row (the CPU
#: twin's column lanes restart at each chunk, as the device's)
MERGE_CHUNK = 64
#: query rows a merge block merges side by side (a warp's rows): one barrier and one round of
#: each reduction's loads serve them all
MERGE_ROWS = 4
#: columns one thread sums side by side (:data:`COLUMN_LANES` loads in flight each): one.  The
#: merge is the epilogue of the partition kernels, whose registers are their largest need
#: anywhere: two columns took the tensor-core kernels from 152/168 to 198 registers on sm_90
#: (``numba-kv kernels``: 2 blocks an SM instead of 3), four to 228
MERGE_COLUMNS = 1
#: shared float32 entries a partition kernel lends :func:`merge_if_last`: the rows' buffer
#: (``MERGE_ROWS · d <= MAX_HEAD_DIM``), their weights, the last-block flag
MERGE_SCRATCH = MAX_HEAD_DIM + MERGE_ROWS * MERGE_CHUNK + 1
#: the last-block flag's entry of the scratch
_FLAG = MAX_HEAD_DIM + MERGE_ROWS * MERGE_CHUNK
#: (array sizes as single constants: Numba's typing does not fold a product of globals)
_WBUF = MERGE_ROWS * MERGE_CHUNK
_TERMS = MERGE_COLUMNS * COLUMN_LANES


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
    :func:`_merge_columns` for every column at once (CPU), in its
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


def _merge_columns(wbuf, part_acc, g, r, j0, js, d, p_lo, p_hi, base, buf):
    """``buf[j] += Σ_{p_lo <= p < p_hi} wbuf[p − base] · acc_p[j]`` for the columns ``j = j0,
    j0 + js, …`` (at most :data:`MERGE_COLUMNS`, below ``d``) of row ``(g, r)``, side by side.
    Each column in :data:`COLUMN_LANES` interleaved lanes (lane ``k``: ``p − p_lo ≡ k``, in
    order; :func:`~numba_kv.ops.attention.cores.column_term`) added as ``((l0 + l1) + (l2 +
    l3)) + ((l4 + l5) + (l6 + l7))``, the CPU twin's order (:func:`_add_partitions`): a step
    has ``MERGE_COLUMNS · COLUMN_LANES`` independent loads in flight, where one running sum
    waited for each load in turn."""
    a = cuda.local.array(_TERMS, dtype=float32)  # (constant indices: registers)
    for i in range(MERGE_COLUMNS * COLUMN_LANES):
        a[i] = float32(0.0)
    for p in range(p_lo, p_hi, COLUMN_LANES):
        for k in range(COLUMN_LANES):
            for c in range(MERGE_COLUMNS):
                j = j0 + c * js
                if j < d:
                    a[c * COLUMN_LANES + k] = column_term_dev(wbuf, part_acc, g, p + k, r, j, p_hi, base,
                                                              a[c * COLUMN_LANES + k])
    for c in range(MERGE_COLUMNS):
        j = j0 + c * js
        if j < d:
            o = c * COLUMN_LANES
            buf[j] = buf[j] + (((a[o] + a[o + 1]) + (a[o + 2] + a[o + 3]))
                               + ((a[o + 4] + a[o + 5]) + (a[o + 6] + a[o + 7])))


merge_columns_dev = cuda_device(_merge_columns)


def _merge_chunks(part_m, part_acc, g, r, mine, c, tpr, p_lo, p_hi, m_star, rbuf, wrow, d):
    """Block-cooperative: ``rbuf += Σ_{p_lo <= p < p_hi} exp(m_p − m*) · acc_p`` for this
    thread's row (``mine``; thread ``c`` of its row's ``tpr``), :data:`MERGE_CHUNK`
    partitions at a time (weights into ``wrow``, barriers around them)."""
    for c0 in range(p_lo, p_hi, MERGE_CHUNK):
        c1 = min(p_hi, c0 + MERGE_CHUNK)
        cuda.syncthreads()
        if mine:
            merge_weights_dev(part_m, g, r, c0 + c, c1, tpr, m_star, wrow, c0)
        cuda.syncthreads()
        if mine:
            for j0 in range(c, d, MERGE_COLUMNS * tpr):
                merge_columns_dev(wrow, part_acc, g, r, j0, tpr, d, c0, c1, c0, rbuf)


def _inverse_rotation(rbuf, mine, c, tpr, d, signs, head_rot, hsigns):
    """Block-cooperative: the inverse rotation of this thread's row buffer (per 32-block, or
    over the whole head with ``head_rot``), one butterfly stage per barrier, as the CPU
    twin's :func:`_merge_row` runs its cores."""
    cuda.syncthreads()
    if not head_rot:
        if mine:
            block_signs_dev(rbuf, d, c, tpr, signs)
        cuda.syncthreads()
    h = 1
    h_end = d if head_rot else 32
    while h < h_end:
        if mine:
            butterfly_pairs_dev(rbuf, h, d, c, tpr)
        cuda.syncthreads()
        h *= 2
    if mine:
        inverse_scale_dev(rbuf, d, c, tpr, head_rot, hsigns)


merge_chunks_dev = cuda_device(_merge_chunks)
inverse_rotation_dev = cuda_device(_inverse_rotation)


def _merge_group(part_m, part_l, part_acc, g, ra, nr, n_comp_parts, signs, head_rot, hsigns, out, buf, wbuf, tid,
                 nth):
    """Block-cooperative: query rows ``ra … ra + nr − 1`` of KV row ``g`` side by side, row
    ``s`` by the ``tpr = nth // nr`` threads ``s·tpr …`` (the rest only meet the barriers) in
    ``buf[s·d :]`` with weights in ``wbuf[s·MERGE_CHUNK :]``; each row's maximum, weights,
    column sums, inverse rotation and denominator as :func:`_merge_row` (the cores, their
    order), one barrier for all rows."""
    n_parts = part_m.shape[1]
    d = out.shape[2]
    tpr = nth // nr
    s = tid // tpr
    mine = s < nr
    c = tid - s * tpr
    s = min(s, nr - 1)  # (an idle thread's views: in bounds, never written)
    r = ra + s
    rbuf = buf[s * d:s * d + d]
    wrow = wbuf[s * MERGE_CHUNK:s * MERGE_CHUNK + MERGE_CHUNK]
    nred = min(tpr, MERGE_CHUNK)
    cuda.syncthreads()  # (the caller's, or the previous group's, last use of the buffers)
    if mine and c < nred:  # the row's maximum from strided shares (exact in any order)
        wrow[c] = merge_max_dev(part_m, g, r, c, n_parts, nred)
    cuda.syncthreads()
    m_star = NEG_INF
    for t in range(nred):
        m_star = max(m_star, wrow[t])
    # (a row without a visible token, m* = -inf: every weight and lane is 0, its output 0)
    if mine:
        for j in range(c, d, tpr):
            rbuf[j] = float32(0.0)
    merge_chunks_dev(part_m, part_acc, g, r, mine, c, tpr, 0, n_comp_parts, m_star, rbuf, wrow, d)
    if n_comp_parts > 0:
        inverse_rotation_dev(rbuf, mine, c, tpr, d, signs, head_rot, hsigns)
    cuda.syncthreads()
    if mine:
        for k in range(c, DENOM_LANES, tpr):
            wrow[k] = merge_denom_lane_dev(part_m, part_l, g, r, k, n_parts, m_star)
    cuda.syncthreads()
    if mine and c == 0:
        lane_tree_dev(wrow, 0, DENOM_LANES)
    cuda.syncthreads()
    inv = float32(1.0) / wrow[0] if m_star != NEG_INF else float32(0.0)
    merge_chunks_dev(part_m, part_acc, g, r, mine, c, tpr, n_comp_parts, n_parts, m_star, rbuf, wrow, d)
    if mine:
        for j in range(c, d, tpr):
            out[g, r, j] = rbuf[j] * inv


merge_group_dev = cuda_device(_merge_group)


def _merge_rows(part_m, part_l, part_acc, g, r_lo, r_hi, n_comp_parts, signs, head_rot, hsigns, out, buf, wbuf, tid,
                nth):
    """Merge query rows ``r_lo … r_hi − 1`` of KV row ``g`` into ``out`` with the whole block
    (block-cooperative: every thread of the block calls it with the same rows).

    Up to :data:`MERGE_ROWS` rows at a time side by side (:func:`_merge_group`; fewer when
    ``d`` is large: their buffers share ``buf``, :data:`MAX_HEAD_DIM` floats), each by its
    share of the threads: the row's maximum and softmax denominator are reductions through
    the shared ``wbuf`` (``MERGE_ROWS ·`` :data:`MERGE_CHUNK` floats), the partition weights
    are computed :data:`MERGE_CHUNK` at a time into it, each column's weighted sum runs in
    :data:`COLUMN_LANES` interleaved lanes (:func:`_merge_columns`), and the inverse rotation
    of the compressed sum runs as butterfly stages (``syncthreads`` between stages).  Same
    cores in the same order as the CPU twin's :func:`_merge_row`, whatever ``nth``, so the
    MERGE_PARTITIONS kernel and a partition kernel's last block (:func:`merge_if_last`)
    write the same bits.

    History (issue 27): it was one thread's serial loop per maximum, column and denominator
    (at batch 1 and 256 partitions a row, each partition cost the merging block about 2 µs
    on an H200, most of a step at T = 32K); then lanes, one row at a time.  Side by side, a
    warp's four rows share each barrier and each reduction's round of loads (about 15
    barriers a group instead of a row); the column sums still take ``4·P/8`` rounds of
    loads per thread for ``P`` partitions (four columns of 128 per thread, eight loads in
    flight: the registers the epilogue may take, :data:`MERGE_COLUMNS`).
    """
    d = out.shape[2]
    group = max(1, min(MERGE_ROWS, MAX_HEAD_DIM // d, nth))
    for ra in range(r_lo, r_hi, group):
        merge_group_dev(part_m, part_l, part_acc, g, ra, min(group, r_hi - ra), n_comp_parts, signs, head_rot, hsigns,
                        out, buf, wbuf, tid, nth)


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
    wbuf = cuda.shared.array(_WBUF, dtype=float32)
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
    ``scratch``: shared float32, at least :data:`MERGE_SCRATCH`
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
            scratch[_FLAG] = float32(1.0) if last else float32(0.0)
        cuda.syncthreads()
        if scratch[_FLAG] == float32(0.0):  # block-uniform: one shared flag
            return
        cuda.threadfence()  # acquire: every other block's partials
    cuda.syncthreads()  # the kernel's own use of the scratch buffer is over
    merge_rows_dev(part_m, part_l, part_acc, g, r0, r0 + rb, n_comp_parts, signs, head_rot, hsigns, out,
                   scratch[:MAX_HEAD_DIM], scratch[MAX_HEAD_DIM:_FLAG], tid, nth)


_MSIG = ("void(float32[:, :, ::1], float32[:, :, ::1], float32[:, :, :, ::1], int64, float32[::1], boolean, "
         "float32[::1], float32[:, :, ::1])")
MERGE_PARTITIONS = register("merge_partitions", _merge_partitions_cpu, _merge_partitions_cuda, [_MSIG])
