"""Decode attention straight from packed codes: one package, read top-down.

Reading order (each module imports only those below it):

* this module: the public names (``decode_attention``, ``fused_attention_rows``,
  ``paged_decode_attention``, ``CodeLayout``, ``AttentionPlan``, …), re-exported from
* :mod:`.flat` / :mod:`.paged`: the two front ends (flat caches and the ``decode_attention``
  op; paged pools read through a page table): they validate what they are given, get the
  plan of their shapes and run it;
* :mod:`.plan`: :class:`AttentionPlan`, every per-shape decision (head-dim legality, code
  layouts on the device, kernel variant, partitioning, grid, workspace), built once and
  cached, then run per step;
* :mod:`.layout`: :class:`CodeLayout` (the byte layout of a compressed vector) and the views
  the tensor-core kernels read;
* :mod:`.kernels`: the partition kernels, every registered twin (the CPU tile loop and the CUDA
  block, warp and tensor-core kernels), each one source compiled for flat caches and for
  paged pools (the addressing cores of :mod:`.cores` are the only difference); :mod:`.merge`:
  the partition merge;
* :mod:`.cores` (single-source cores both twins run), :mod:`.cpu` (the CPU twin's SIMD tile
  helpers), :mod:`.warp` (the warp kernel's lane layouts and shuffles), :mod:`.mma` (the
  tensor-core tiles; :mod:`.mma_vq` their head VQ tables, :mod:`.mma_dims` their build for
  each head_dim) and :mod:`.ptx` (their inline-PTX intrinsics with simulator twins).

The math (rotated queries against codebook values, rotated-domain value accumulation,
flash-decoding partitions merged by log-sum-exp) is described in :mod:`.flat`.
"""

from __future__ import annotations

from ..._config import MAX_HEAD_DIM
from .flat import decode_attention, fused_attention_rows
from .kernels import rows_per_block
from .layout import F16_ABS_TABLE, CodeLayout, code_words, mma_layout_ok, mma_operands, unit_axis
from .paged import paged_decode_attention
from .plan import AttentionPlan, attention_plan, default_partition_size, use_mma_kernel, use_warp_kernel

__all__ = ["AttentionPlan", "CodeLayout", "F16_ABS_TABLE", "MAX_HEAD_DIM", "attention_plan", "code_words",
           "decode_attention", "default_partition_size", "fused_attention_rows",
           "mma_layout_ok", "mma_operands", "paged_decode_attention", "rows_per_block", "unit_axis", "use_mma_kernel",
           "use_warp_kernel"]
