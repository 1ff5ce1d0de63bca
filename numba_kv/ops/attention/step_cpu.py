"""A flat decode step on the CPU in one compiled call: query rotation, partitions, merge.

At decode sizes (a layer of a few KV heads, ~100 tokens) the kernels' arithmetic costs a few
tens of microseconds, and each of the three Python-level dispatches of a step (rotating the
queries, the partition kernel, the merge) costs several more in argument typing and the
Python around it.  :func:`flat_step_serial` and :func:`flat_step_parallel` run the three in
one call: the same compiled twins (:data:`~numba_kv.ops.attention.kernels.DECODE_ATTENTION`,
:data:`~numba_kv.ops.attention.merge.MERGE_PARTITIONS` and the rotation twins of
:mod:`numba_kv.ops.headquant` / :mod:`numba_kv.ops.hadamard`) on the same arrays in the same
order, so every output bit is the one the op-by-op path gives (Numba links a callee's module
into its caller's and LLVM optimizes them together, but the twins are large calls, not
inlined; ``tests/caches/test_fused.py`` holds the two paths bit for bit).  The
two differ only in the partition kernel they call: its serial compilation, or its parallel
one (one work item per partition; the rotation and the merge, a few microseconds, stay
serial), which wakes the threads once per step.

:class:`~numba_kv.ops.attention.plan.FlatStep` calls one of them for every NumPy step whose
queries it rotates, by the ``cpu_parallel_min_work`` knob like every CPU twin.  (A parallel
call for steps below it, tried at 2**15 on 2 threads, saved ~15 µs of a ~250 µs ``kv4`` step
in some runs and cost ~30 µs in others — the thread wake-ups; the serial call is steady.)
"""

from __future__ import annotations

from ..._jit import cpu_serial, specialize
from .. import hadamard as _hadamard  # noqa: F401 - registers the rotation twins read below
from .. import headquant as _headquant  # noqa: F401 - (same)
from .._registry import TWINS
from .kernels import DECODE_ATTENTION
from .merge import MERGE_PARTITIONS

__all__ = ["ROTATE_BLOCK", "ROTATE_HEAD", "ROTATE_NONE", "flat_step_parallel", "flat_step_serial"]

#: how :func:`flat_step_serial` makes the rotated queries ``qr`` first
ROTATE_NONE, ROTATE_HEAD, ROTATE_BLOCK = 0, 1, 2

_partition_serial = DECODE_ATTENTION.cpu.serial
_partition_parallel = DECODE_ATTENTION.cpu
_partition = _partition_serial  # (rebound per compiled entry below)
_merge_serial = MERGE_PARTITIONS.cpu.serial
_rotate_head_serial = TWINS["rotate_head"].cpu.serial
_rotate32_serial = TWINS["rotate32"].cpu.serial


def _flat_step(rotate, q_in, rsigns, qr2, qr, q, kc, ks, vc, vs, n_comp, comp_pos0, ke, ve, n_exact, exact_pos, kes,
               ves, exact_kind, kcent, vcent, kbits, koff, vbits, voff, sshift, scale_table, softmax_scale, bias,
               has_bias, has_qjl, sq, qsig, qnorm, qjl_const, q_pos0, q_len, causal, part_size, n_comp_parts,
               kv_indptr, kv_indices, kv_last_page_len, page_size, n_kv_heads, part_m, part_l, part_acc, n_rot,
               msigns, head_rot, hsigns, out):
    """``qr2`` (``qr`` as ``[n_g·rows, d]``) ← the rotation ``rotate`` of ``q_in`` (none, whole
    head with signs ``rsigns``, or per 32-block), then the partition kernel's arguments
    (``qr`` … ``part_acc``; ``_partition``: its serial or parallel compilation) and the
    merge's (``n_rot``, ``msigns``, ``head_rot``, ``hsigns``, ``out``)."""
    if rotate == 1:
        _rotate_head_serial(q_in, rsigns, False, qr2)
    elif rotate == 2:
        _rotate32_serial(q_in, rsigns, False, qr2)
    # False as a plain bool: a literal False typed the partition kernel's arguments
    # Literal[bool](False), a compilation of its own beside the one Python's bools give (the
    # op-by-op path), ~13 s more a signature for its parallel twin on 2 cores
    off = rotate < 0
    _partition(qr, q, kc, ks, vc, vs, n_comp, comp_pos0, ke, ve, n_exact, exact_pos, kes, ves, exact_kind, kcent, vcent,
               kbits, koff, vbits, voff, sshift, scale_table, softmax_scale, bias, has_bias, has_qjl, sq, qsig, qnorm,
               qjl_const, q_pos0, q_len, causal, part_size, n_comp_parts, kv_indptr, kv_indices, kv_last_page_len,
               page_size, n_kv_heads, part_m, part_l, part_acc, off, n_rot, msigns, head_rot, hsigns, out,
               kv_indptr, off)  # (merge_last false: the CPU twin leaves the merge to the call below; kv_indptr
    # stands in for the CUDA kernels' merge counter, which it never reads; rotate_q false: qr2 is rotated above)
    _merge_serial(part_m, part_l, part_acc, n_rot, msigns, head_rot, hsigns, out)


#: the compiled entries (arguments as :func:`_flat_step`'s; no validation): the partitions
#: serially, or in parallel (one work item per partition)
flat_step_serial = cpu_serial(specialize(_flat_step, "", name="_flat_step_cpu", _partition=_partition_serial))
flat_step_parallel = cpu_serial(specialize(_flat_step, "", name="_flat_step_parallel_cpu",
                                           _partition=_partition_parallel))
