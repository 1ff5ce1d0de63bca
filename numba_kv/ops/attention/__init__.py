"""Decode attention straight from packed codes: one package, read top-down.

Reading order (each module imports only those below it):

* this module: the public names (``decode_attention``, ``fused_attention_rows``,
  ``paged_decode_attention``, ``CodeLayout``, …), re-exported from
* :mod:`.flat` / :mod:`.paged`: the two front ends (flat caches and the ``decode_attention``
  op; paged pools read through a page table): they validate what they are given and run
  the kernels;
* :mod:`.kernels`: every registered twin (CPU tile loop, the CUDA block, warp and tensor-core
  kernels, flat and paged, and the partition merge);
* :mod:`.cores` (single-source cores both twins run), :mod:`.cpu` (the CPU twin's SIMD tile
  helpers), :mod:`.warp` (the warp kernel's lane layouts and shuffles), :mod:`.mma` (the
  tensor-core tiles) and :mod:`.ptx` (their inline-PTX intrinsics with simulator twins).

The math (rotated queries against codebook values, rotated-domain value accumulation,
flash-decoding partitions merged by log-sum-exp) is described in :mod:`.flat`.
"""

from __future__ import annotations

from .flat import (
    F16_ABS_TABLE,
    CodeLayout,
    check_cuda_head_dim,
    code_words,
    cuda_block_threads,
    decode_attention,
    default_partition_size,
    fused_attention_rows,
    launch_attention,
    launch_merge,
    mma_layout_ok,
    mma_operands,
    unit_axis,
    use_mma_kernel,
    use_warp_kernel,
)
from .kernels import MAX_HEAD_DIM, rows_per_block
from .paged import paged_decode_attention

__all__ = ["CodeLayout", "F16_ABS_TABLE", "MAX_HEAD_DIM", "check_cuda_head_dim", "code_words", "cuda_block_threads",
           "decode_attention", "default_partition_size", "fused_attention_rows", "launch_attention", "launch_merge",
           "mma_layout_ok", "mma_operands", "paged_decode_attention", "rows_per_block", "unit_axis", "use_mma_kernel",
           "use_warp_kernel"]
