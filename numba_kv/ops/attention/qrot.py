"""The query rotation in the partition kernels' prologue (issue 27: no rotation launch per step).

A decode step's compressed tokens are scored against the queries rotated like them (per
32-block, :func:`~numba_kv.ops.hadamard.rotate32_rows`, or over the whole head,
:func:`~numba_kv.ops.headquant.rotate_head_rows`).  With ``rotate_q`` the partition kernels
take the raw queries and rotate the rows a partition needs while staging them: every block
(or warp) of a split re-does the same few rows (``d <= 256``), which costs less than a launch
and a global round trip of the rotated rows.

The arithmetic is the rotation ops', value for value: the same products by the signs, the
same butterfly stages in the same order (``h = 1, 2, …``; each pair's ``(a + b, a − b)``), the
same final scale, so the rotated rows carry the bits the ops write (the CPU twin calls the
ops' own row cores).  Three forms:

* :func:`coop_rotate_rows`: the block's threads over rows in shared memory, a barrier per
  stage (the block kernel; the warp kernels in the simulator build);
* :func:`warp_stage_rotated`: one warp per row, its ``d/32`` values per lane in registers
  at ``lane + 32·k``, the stages below 32 as xor shuffles and the others within the lane
  (the warp and tensor-core kernels on a GPU: no block barrier, so their only barrier
  before the token loop stays the one after staging);
* :func:`rotate_rows_cpu`: the CPU twin's, through the ops' row cores.
"""

from __future__ import annotations

from numba import cuda, float32

from ..._jit import cpu_serial, cuda_device
from .._exact import mul_rn_dev
from .._headquant_lanes import head_scale_dev, rotate_head_row_cpu
from ..hadamard import load_rotate_store_cpu

__all__ = ["BLOCK_SCALE", "coop_rotate_rows", "rotate_rows_cpu", "warp_stage_rotated"]

#: 1/√32 in float32, the 32-block rotation's scale (as :func:`numba_kv.ops.hadamard._wht32_lanes`)
BLOCK_SCALE = 0.17677669529663687
_FULL = 0xFFFFFFFF


@cuda_device
def coop_rotate_rows(buf, o, n_rows, d, head_rot, hsigns, msigns, tid, nth):
    """Rows ``buf[o + r·d : o + (r + 1)·d]``, ``r < n_rows``, rotated forward in place.

    Whole head (``head_rot``: ``H_d D_s / √d`` with signs ``hsigns``, as ``rotate_head_rows``)
    or per 32-block (``D_s H / √32`` with ``msigns``, as ``rotate32_rows``).  Launch contract:
    every thread of the block calls it (``tid`` of ``nth``) after a barrier that made the rows
    visible; it ends with a barrier."""
    n = n_rows * d
    if head_rot:
        for u in range(tid, n, nth):
            r = u // d
            buf[o + u] = buf[o + u] * hsigns[u - r * d]
        cuda.syncthreads()
    half = d >> 1
    h = 1
    h_end = d if head_rot else 32
    while h < h_end:  # (stage order is part of the float32 result, as in the rotation ops)
        for u in range(tid, n_rows * half, nth):
            r = u // half
            i = u - r * half
            a = o + r * d + i + (i & -h)  # pair i of the stage: (i // h)·2h + i % h
            x = buf[a]
            y = buf[a + h]
            buf[a] = x + y
            buf[a + h] = x - y
        cuda.syncthreads()
        h *= 2
    if head_rot:
        sc = head_scale_dev(d)
        for u in range(tid, n, nth):
            buf[o + u] = buf[o + u] * sc
    else:
        for u in range(tid, n, nth):  # (d is a multiple of 32: the sign of column u mod 32)
            buf[o + u] = mul_rn_dev(buf[o + u] * float32(BLOCK_SCALE), msigns[u & 31])
    cuda.syncthreads()


@cuda_device
def _bfly(x, h, lane):
    """One butterfly pair across lanes ``lane`` and ``lane ^ h``: the lower lane gets
    ``a + b``, the upper ``a − b`` (``a`` the lower lane's value)."""
    y = cuda.shfl_xor_sync(_FULL, x, h)
    return y - x if lane & h else x + y


@cuda_device
def warp_stage_rotated(qs, src, g, r0, rows, d, s_lo, s_hi, row_stride, head_rot, hsigns, msigns, tid):
    """Slots ``s_lo … s_hi − 1`` of ``qs`` (slot ``s`` at ``qs[s·d]``, query row
    ``r0 + s mod row_stride`` of KV row ``g`` of ``src``, the last row for rows past
    ``rows``) ← those rows rotated as :func:`coop_rotate_rows` does, one warp per row.

    Launch contract: every lane of every warp of the block calls it (whole warps, ``d`` in
    32, 64, 128); no barrier: the caller's makes the slots visible.  Lane ``ℓ`` holds values
    ``ℓ + 32·k`` (``k < d/32``) in registers: stages ``h < 32`` pair lanes (xor shuffles),
    stages 32 and 64 pair a lane's own values."""
    lane = tid & 31
    v = d >> 5
    for s in range(s_lo + (tid >> 5), s_hi, cuda.blockDim.x >> 5):  # warp-uniform
        row = src[g, min(r0 + s % row_stride, rows - 1)]
        x0 = row[lane]
        x1 = row[lane + 32] if v > 1 else float32(0.0)
        x2 = row[lane + 64] if v > 2 else float32(0.0)
        x3 = row[lane + 96] if v > 2 else float32(0.0)
        if head_rot:
            x0 = x0 * hsigns[lane]
            if v > 1:
                x1 = x1 * hsigns[lane + 32]
            if v > 2:
                x2 = x2 * hsigns[lane + 64]
                x3 = x3 * hsigns[lane + 96]
        h = 1
        while h < 32:
            x0 = _bfly(x0, h, lane)
            x1 = _bfly(x1, h, lane)
            x2 = _bfly(x2, h, lane)
            x3 = _bfly(x3, h, lane)
            h *= 2
        if head_rot:
            if v > 1:  # h = 32
                x0, x1 = x0 + x1, x0 - x1
                x2, x3 = x2 + x3, x2 - x3
            if v > 2:  # h = 64
                x0, x2 = x0 + x2, x0 - x2
                x1, x3 = x1 + x3, x1 - x3
            sc = head_scale_dev(d)
            x0, x1, x2, x3 = x0 * sc, x1 * sc, x2 * sc, x3 * sc
        else:
            sg = msigns[lane]
            x0 = mul_rn_dev(x0 * float32(BLOCK_SCALE), sg)
            x1 = mul_rn_dev(x1 * float32(BLOCK_SCALE), sg)
            x2 = mul_rn_dev(x2 * float32(BLOCK_SCALE), sg)
            x3 = mul_rn_dev(x3 * float32(BLOCK_SCALE), sg)
        o = s * d + lane
        qs[o] = x0
        if v > 1:
            qs[o + 32] = x1
        if v > 2:
            qs[o + 64] = x2
            qs[o + 96] = x3


def _rotate_rows(src, n_rows, d, head_rot, hsigns, msigns, buf, out):
    """``out[r]`` ← row ``src[r]`` rotated forward (``r < n_rows``) by the rotation ops' own
    row cores (``buf``: ``d`` floats of scratch)."""
    for r in range(n_rows):
        if head_rot:
            rotate_head_row_cpu(src, r, d, hsigns, False, buf, out)
        else:
            for b in range(d // 32):
                load_rotate_store_cpu(src, r, b, msigns, False, buf, out)


rotate_rows_cpu = cpu_serial(_rotate_rows)
