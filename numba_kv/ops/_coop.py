"""Block-cooperative CUDA device helpers: one thread block works on one row in shared memory.

A thread-per-row kernel that needs the whole row at once (the ``d``-point Walsh–Hadamard
butterfly of :mod:`numba_kv.ops.headquant`) must keep ``d`` floats per thread, which the
compiler places in local memory (off-chip, 2 KB per thread at ``d = 512``).  Here the row
lives once in shared memory and the ``nt`` threads of the block share every stage:

* element-wise steps: thread ``tid`` owns values ``tid, tid + nt, tid + 2·nt, …``;
* butterfly stage ``h``: the ``d/2`` pairs ``(j, j + h)`` (``j`` with bit ``h`` clear) are
  dealt out the same way, one ``cuda.syncthreads()`` between stages.

Only barriers and shared memory are used (no warp shuffles), so the kernels run under
Numba's CUDA simulator too.  Every value goes through the same float32 operations in the
same order as in the CPU twin's butterfly, so results are bit-identical to it.

These helpers are CUDA-only (they call ``cuda.syncthreads``); every thread of the block
must call them (the barrier is block-wide).
"""

from __future__ import annotations

from numba import cuda

from .._jit import cuda_device

__all__ = ["coop_butterflies", "coop_butterflies_within"]


def _coop_butterflies_within(t, d, width, tid, nt):
    """The ``log2(width)`` unnormalized radix-2 stages (strides ``1, 2, …, width/2``) on
    ``t[0:d]`` (shared float32), shared by the ``nt`` threads of the block; ``tid`` is this
    thread.  ``width = d``: the ``d``-point transform; ``width = 32``: the ``d/32``
    independent 32-point transforms of the 32-block rotation (a stage of stride ``h < 32``
    never pairs values of two blocks).

    Synchronizes before the first stage (the caller's writes to ``t`` become visible) and
    after the last one (every value is final when it returns).
    """
    # stage order h = 1, 2, 4, ..., width/2 is part of the float32 result (as on the CPU): keep it
    h = 1
    while h < width:
        cuda.syncthreads()
        for p in range(tid, d // 2, nt):
            # the p-th index with bit h clear: p + (p & -h) = (p // h)·2h + p % h for a power
            # of two h, without an integer division
            j = p + (p & -h)
            a = t[j]
            b = t[j + h]
            t[j] = a + b
            t[j + h] = a - b
        h = h * 2
    cuda.syncthreads()


coop_butterflies_within = cuda_device(_coop_butterflies_within)


def _coop_butterflies(t, d, tid, nt):
    """The ``log2(d)`` stages of the ``d``-point transform on ``t[0:d]``
    (:func:`coop_butterflies_within` with ``width = d``)."""
    coop_butterflies_within(t, d, d, tid, nt)


coop_butterflies = cuda_device(_coop_butterflies)
