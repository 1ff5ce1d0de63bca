"""The wave model of the tensor-core decode kernel's partition lengths (:func:`mma_partition_size`).

Host-side planning only (no device code): the plan (:mod:`numba_kv.ops.attention.plan`) asks it
for each step's partition length; :mod:`numba_kv.ops.attention.mma` re-exports it.
"""

from __future__ import annotations

import functools
import math

__all__ = ["MERGE_COST_TOKENS", "MERGE_PARTS_PER_SQRT_TOKEN", "MMA_PART_RANGE", "PART_COST_TOKENS",
           "WAVE_WARPS_PER_BLOCK", "mma_partition_size"]

#: partitions a block of the tensor-core kernel runs (one a warp: ``mma.MMA_THREADS // 32``)
WAVE_WARPS_PER_BLOCK = 4


#: at most ``MERGE_PARTS_PER_SQRT_TOKEN · √T`` partitions per KV row: the merge's cost grows
#: with a row's partitions (its last block reads them all), a partition's with its tokens,
#: so their sum is least near ``√(a·T/b)`` partitions.  On an H200 (batch 1, T = 4K and 32K,
#: ``benchmarks/gpu_results/h200-2026-11-30/kernel_times.log``) ``a`` ≈ 0.068 µs a token a
#: warp and ``b`` ≈ 2.5 µs a partition with the serial merge of then (about 16 dependent L2
#: round trips a partition, 0.16 µs each); ``merge.py``'s waits for about 0.6, so ``b`` ≈
#: 0.1 µs and ``√(0.068/0.1) ≈ 0.8``.  Not yet timed (``benchmarks/gpu_step_kernels.py``).
MERGE_PARTS_PER_SQRT_TOKEN = 0.8


#: the wave model of :func:`mma_partition_size`, in tokens of one warp's tile loop: what a
#: partition costs besides its tokens (the prologue's pair tables and staged queries, the
#: epilogue's stored row: about two tiles), and what one more partition adds to its row's
#: merge (``b/a`` of :data:`MERGE_PARTS_PER_SQRT_TOKEN`: 0.1 µs against 0.068 µs a token)
PART_COST_TOKENS = 32
MERGE_COST_TOKENS = 1.5
#: the partition lengths the wave model chooses from: multiples of 64 in this range
MMA_PART_RANGE = (128, 8192)


@functools.lru_cache(maxsize=4096)  # (a step asks each time: the search is 100+ candidates)
def mma_partition_size(n_tokens: int, n_rows_kv: int, n_exact: int = 0, resident_blocks: int | None = None,
                       warps_per_block: int = WAVE_WARPS_PER_BLOCK) -> int:
    """Tokens per partition (one warp each) of the tensor-core kernel.

    Parameters
    ----------
    n_tokens : int
        Compressed tokens of a KV row (the longest row's).
    n_rows_kv : int
        KV rows times query-row chunks: the grid's blocks per partition group.
    n_exact : int
        Exact tokens of a row: their partitions have the same length and share the blocks.
    resident_blocks : int, optional
        Blocks of the kernel the GPU holds at once (its occupancy times the SMs:
        :meth:`AttentionPlan.resident_blocks`).  Without it, the rule before the wave model:
        about 3,200 warps in all (two waves of an H100's 12 a SM), no more than
        :data:`MERGE_PARTS_PER_SQRT_TOKEN` ``· √T`` partitions a row, multiples of 64 in
        [128, 2048].
    warps_per_block : int
        Partitions a block runs (one a warp).

    Returns
    -------
    int
        A multiple of 64 in :data:`MMA_PART_RANGE` (no longer than the row rounded up to 64).
        With ``resident_blocks``, the length ``L`` with the least modelled time ``waves·(L +``
        :data:`PART_COST_TOKENS` ``) +`` :data:`MERGE_COST_TOKENS` ``· P``, where ``P`` is the
        row's partitions (compressed and exact), ``waves = ceil(rows·ceil(P/warps) /
        resident_blocks)``: every wave takes as long as its longest partition, so a grid
        of 1.2 waves costs two.  The longest of equal costs wins (fewer partitions to
        merge).  FlashInfer's decode plan (arXiv 2501.01005) splits the KV so that the grid
        fits one wave of the resident blocks (the driver's occupancy times the SMs); this
        weighs the lengths of more waves, and the merge, too (the H200 case behind it: the
        Kernels page, "Partition lengths by whole waves").
    """
    n_tokens = max(n_tokens, 1)
    if resident_blocks is None or resident_blocks <= 0:
        per = -(-max(n_rows_kv, 1) * n_tokens // 3200)
        max_parts = max(1, math.ceil(MERGE_PARTS_PER_SQRT_TOKEN * math.sqrt(n_tokens)))
        per = max(per, -(-n_tokens // max_parts))
        return int(min(2048, max(128, -(-per // 64) * 64)))
    lo, hi = MMA_PART_RANGE
    hi = max(lo, min(hi, -(-n_tokens // 64) * 64))
    best, best_cost = lo, None
    for size in range(lo, hi + 1, 64):
        parts = -(-n_tokens // size) + -(-max(n_exact, 0) // size)
        waves = -(-max(n_rows_kv, 1) * -(-parts // warps_per_block) // resident_blocks)
        cost = waves * (size + PART_COST_TOKENS) + MERGE_COST_TOKENS * parts
        if best_cost is None or cost <= best_cost:
            best, best_cost = size, cost
    return int(best)
