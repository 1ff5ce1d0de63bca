"""Both sides of a whole-head store in one launch, for every code the head quantizers have.

A decode step of a cache with the whole-head rotation moves one token per KV row out of its
window into the compressed store, on both sides.  :func:`quantize_head_pair_into` quantizes
the keys and the values of such a store in one launch, each side with its own code:

* the scalar head code (:mod:`numba_kv.ops.headquant`, a Lloyd–Max codebook per
  coordinate) or the head VQ code (:mod:`numba_kv.ops.headvq`, a 256-point codebook per
  group of 2 or 4 coordinates, searched on its candidate grid);
* binary16 norms (uint16 planes), or 8-bit norms on a layer's log grid
  (:mod:`numba_kv.ops.norm8`, uint8 planes) written straight from the binary16 norm the
  quantizer computes — no scratch planes, no second launch;

with a layer's device count update folded in (``add_at``, as in
:func:`~numba_kv.ops.blockquant.quantize_pair_into`: the offset read on the device, no
argument that changes from step to step, so a CUDA graph can replay the launch).

Done op by op, the ``kv3`` preset (VQ keys and values, 8-bit norms) took four launches and
four scratch allocations per step for this (a quantization and an 8-bit store per side), and
the op-by-op store left the layer's device count stale, so the next step uploaded it: 6
launches, 4 allocations and 1 transfer per steady step where ``pqo3`` and ``kv4`` take 3, 0
and 0 (``tests/cuda/test_sim_step_budget.py``).

The device kernel runs the single-side kernels' per-vector cores (the same float32
operations in the same order), and its CPU twin the single-side CPU twins then the 8-bit
store, so every byte equals what the single-side ops store (``tests/ops/test_headpair.py``,
``tests/cuda/test_sim_headpair.py``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import cuda, float32, int32, int64, uint8, uint16

from .. import _backend
from .._config import MAX_HEAD_DIM
from .._jit import cpu_kernel, cpu_serial, cuda_device, cuda_kernel, specialize
from .._validate import check_span
from ._registry import F32_1D, F32_2D, F32_3D, U8_3D, register
from .blockquant import count_args
from .codebook import Codebook
from .headquant import QUANTIZE_HEAD, QUANTIZE_HEAD_VEC_DEV, head_signs
from .headvq import (
    CB_SHARED,
    LOAD_CODEBOOK_DEV,
    QUANTIZE_HEADVQ,
    QUANTIZE_HEADVQ_VEC_DEV,
)
from .headvq_grid import search_grid
from .norm8 import LOG16, STORE_NORM8, norm8_code_dev

__all__ = ["HEAD_SIDE_SERIAL", "head_side_args", "quantize_head_pair_into"]

#: the search's work per value relative to the scalar code's (the CPU twin's parallel threshold)
_VQ_WORK = 24

_quantize_head_cpu = QUANTIZE_HEAD.cpu
_quantize_headvq_cpu = QUANTIZE_HEADVQ.cpu
_norm8_store_cpu = STORE_NORM8.cpu


# --- CPU twin ---------------------------------------------------------------------------------
def _side(x, signs, unbiased, t0, vq, bounds, cents, bits, vcents, gpar, slots, goff, gcand, codes, norms, norms8,
          norm8, base16, log16):
    """One side: the scalar or VQ head quantizer's CPU twin into ``codes`` / ``norms`` at
    ``t0``, or with ``norm8`` into scratch planes, then the 8-bit store into ``norms8``."""
    rows, seq, _ = x.shape
    if not norm8:
        if vq:
            _quantize_headvq_cpu(x, signs, vcents, gpar, slots, goff, gcand, unbiased, t0, codes, norms)
        else:
            _quantize_head_cpu(x, signs, bounds, cents, unbiased, bits, t0, codes, norms)
        return
    tc = np.empty((rows, seq, codes.shape[2]), dtype=np.uint8)
    tn = np.empty((rows, seq, 1), dtype=np.uint16)
    if vq:
        _quantize_headvq_cpu(x, signs, vcents, gpar, slots, goff, gcand, unbiased, 0, tc, tn)
    else:
        _quantize_head_cpu(x, signs, bounds, cents, unbiased, bits, 0, tc, tn)
    _norm8_store_cpu(tc, tn, log16, base16, 0, seq, t0, codes, norms8)


# the side with the twins' parallel CPU kernels, and with their serial compilations (for the
# serial compilation of the pair's twin: a decode step's few vectors open no parallel region)
_side_cpu = cpu_serial(_side)
_side_serial = cpu_serial(specialize(_side, "__serial", _quantize_head_cpu=QUANTIZE_HEAD.cpu.serial,
                                     _quantize_headvq_cpu=QUANTIZE_HEADVQ.cpu.serial,
                                     _norm8_store_cpu=STORE_NORM8.cpu.serial))
#: one side's store, serial: ``(x, signs, unbiased, t0, *head_side_args(...)[0], norm8, base16,
#: log16)`` (for fused serial callers: :mod:`numba_kv.ops.window8`'s one-call decode step)
HEAD_SIDE_SERIAL = _side_serial


@cpu_kernel(serial_globals={"_side_cpu": _side_serial})
def _quantize_head_pair_cpu(xk, xv, signs, unbiased, t0, kvq, kbounds, kcents, kbits, kvcents, kgpar, kslots, kgoff,
                            kgcand, kcodes, knorms, knorms8, vvq, vbounds, vcents, vbits, vvcents, vgpar, vslots, vgoff,
                            vgcand, vcodes, vnorms, vnorms8, norm8, base16, log16, lens, li, delta, ri):
    """CPU twin of :func:`_quantize_head_pair_cuda`: the two sides one after the other (on the
    CPU the pair saves nothing; the twin exists for the bit-for-bit comparison), then the
    count update."""
    base = int64(lens[ri]) if ri >= 0 else int64(0)
    t0 = t0 + base
    _side_cpu(xk, signs, unbiased, t0, kvq, kbounds, kcents, kbits, kvcents, kgpar, kslots, kgoff, kgcand, kcodes,
              knorms, knorms8, norm8, base16, log16)
    _side_cpu(xv, signs, unbiased, t0, vvq, vbounds, vcents, vbits, vvcents, vgpar, vslots, vgoff, vgcand, vcodes,
              vnorms, vnorms8, norm8, base16, log16)
    if li >= 0:
        lens[li] = int32((base if ri >= 0 else lens[li]) + delta)


# --- CUDA kernel: one block per vector ------------------------------------------------------
@cuda_device
def _side_vec_dev(xr, signs, unbiased, vq, bounds, cents, bits, cbs, m, gpar, slots, goff, gcand, cb, norms, norms8,
                  norm8, base16, log16, r, ts, hn, t, ib, red):
    """Block-cooperative: vector ``xr`` of one side into the code bytes ``cb`` and the norm of
    token ``(r, ts)`` (``norms``, or its grid code in ``norms8`` with ``norm8``), through the
    side's per-vector core (``vq``: the VQ code with the shared codebook ``cbs``, else the
    scalar code); the core leaves the binary16 norm in the shared ``hn[0, 0, 0]``."""
    if vq:
        QUANTIZE_HEADVQ_VEC_DEV(xr, signs, cbs, m, gpar, slots, goff, gcand, unbiased, cb, hn, 0, 0, t, ib, red)
    else:
        QUANTIZE_HEAD_VEC_DEV(xr, signs, bounds, cents, unbiased, bits, cb, hn, 0, 0, t, ib, red)
    # (the core's last barrier follows thread 0's write of hn, which only thread 0 reads, and
    # only thread 0 writes it again in the next vector's core)
    if cuda.threadIdx.x == 0:
        h = hn[0, 0, 0]
        if norm8:
            norms8[r, ts, 0] = uint8(norm8_code_dev(int64(h), log16, base16))
        else:
            norms[r, ts, 0] = h


@cuda_kernel
def _quantize_head_pair_cuda(xk, xv, signs, unbiased, t0, kvq, kbounds, kcents, kbits, kvcents, kgpar, kslots, kgoff,
                             kgcand, kcodes, knorms, knorms8, vvq, vbounds, vcents, vbits, vvcents, vgpar, vslots,
                             vgoff, vgcand, vcodes, vnorms, vnorms8, norm8, base16, log16, lens, li, delta, ri):
    """Both sides of a store in one launch: keys ``xk[r, s]`` into ``kcodes`` and ``knorms``
    (``knorms8`` with ``norm8``) and values ``xv[r, s]`` into ``vcodes`` and ``vnorms``
    (``vnorms8``) at token ``t0 + s``, each side with its code (``kvq``: the VQ code of
    ``kvcents`` and its candidate grid, else the scalar code of ``kbounds`` / ``kcents`` at
    ``kbits``; the values likewise).

    Launch: ``(blocks, threads)`` from :func:`numba_kv._backend.coop_grid` over ``(2·rows·seq,
    d/2)`` (``xk`` and ``xv`` have one shape): the block first copies the VQ sides' codebooks
    into shared memory, then quantizes flattened vectors ``v = b, b + blocks, …``, ``v <
    rows·seq`` a key and the rest values, each with the whole block (thread ``tid`` takes
    values ``tid, tid + threads, …``, its share of every butterfly stage and of the group
    searches; thread 0 the sums and the norm).  When ``li >= 0``, thread 0 of block 0 also
    does ``lens[li] += delta``, or with ``ri >= 0`` reads its offset ``t0 + lens[ri]`` and
    writes ``lens[li] = lens[ri] + delta`` (``ri != li``), as
    :func:`~numba_kv.ops.blockquant.quantize_pair_into` does.
    """
    rows, seq, d = xk.shape
    base = int64(lens[ri]) if ri >= 0 else int64(0)
    t0 = t0 + base
    nv = rows * seq
    t = cuda.shared.array(MAX_HEAD_DIM, dtype=float32)
    ib = cuda.shared.array(MAX_HEAD_DIM, dtype=uint8)
    red = cuda.shared.array(1, dtype=float32)
    hn = cuda.shared.array((1, 1, 1), dtype=uint16)
    kcbs = cuda.shared.array(CB_SHARED, dtype=float32)
    vcbs = cuda.shared.array(CB_SHARED, dtype=float32)
    if kvq:  # (uniform across the launch: the barrier inside is reached by every thread)
        LOAD_CODEBOOK_DEV(kvcents, kcbs)
    if vvq:
        LOAD_CODEBOOK_DEV(vvcents, vcbs)
    for v in range(cuda.blockIdx.x, 2 * nv, cuda.gridDim.x):
        u = v - nv if v >= nv else v
        r = u // seq
        s = u - r * seq
        if v < nv:  # uniform across the block: one side per vector
            _side_vec_dev(xk[r, s], signs, unbiased, kvq, kbounds, kcents, kbits, kcbs, kvcents.shape[1], kgpar, kslots,
                          kgoff, kgcand, kcodes[r, t0 + s], knorms, knorms8, norm8, base16, log16, r, t0 + s, hn, t,
                          ib, red)
        else:
            _side_vec_dev(xv[r, s], signs, unbiased, vvq, vbounds, vcents, vbits, vcbs, vvcents.shape[1], vgpar, vslots,
                          vgoff, vgcand, vcodes[r, t0 + s], vnorms, vnorms8, norm8, base16, log16, r, t0 + s, hn, t,
                          ib, red)
    if li >= 0 and cuda.blockIdx.x == 0 and cuda.threadIdx.x == 0:
        lens[li] = int32((base if ri >= 0 else lens[li]) + delta)


_U16_3D = "uint16[:, :, ::1]"
_SIDE_SIG = (f"boolean, {F32_1D}, {F32_1D}, int64, {F32_2D}, {F32_1D}, uint8[::1], int32[::1], uint8[::1], {U8_3D}, "
             f"{_U16_3D}, {U8_3D}")
_QPAIR_SIG = (f"void({F32_3D}, {F32_3D}, {F32_1D}, boolean, int64, {_SIDE_SIG}, {_SIDE_SIG}, boolean, int64, "
              f"int16[::1], int32[::1], int64, int64, int64)")
_QUANTIZE_PAIR = register("quantize_head_pair", _quantize_head_pair_cpu, _quantize_head_pair_cuda, [_QPAIR_SIG])

# the arguments of the side a store does not have (never read)
_NO_F32 = np.zeros(1, np.float32)
_NO_CENTS = np.zeros((1, 2), np.float32)
_NO_U8 = np.zeros(1, np.uint8)
_NO_I32 = np.zeros(1, np.int32)
_NO_NORMS16 = np.zeros((1, 1, 1), np.uint16)
_NO_NORMS8 = np.zeros((1, 1, 1), np.uint8)


def head_side_args(like: Any, code: Any, d: int, codes: Any, norms: Any, norm8: bool) -> tuple[tuple, bool]:
    """A side's arguments (``vq … norms8`` of the kernel and of :data:`HEAD_SIDE_SERIAL`).

    Parameters
    ----------
    like : array
        Any array on the device the arguments go to (NumPy: host arrays).
    code : Codebook or float32 array, shape ``(256, m)``
        The scalar head code's ``head_codebook(bits, d)`` or the VQ code's
        ``headvq_centroids(bits, d)`` (its candidate grid is looked up here).
    d : int
        head_dim.
    codes : uint8 array, shape ``(rows, capacity, width)``
    norms : array, shape ``(rows, capacity, 1)``
        uint16 binary16 norms, or with ``norm8`` uint8 grid codes.
    norm8 : bool

    Returns
    -------
    (tuple, bool)
        ``(vq, bounds, cents, bits, vcents, gpar, slots, goff, gcand, codes, norms16, norms8)``
        with placeholders (never read) for what the side does not have, and whether it is the
        VQ code.
    """
    c = _backend.constant
    planes = (c(like, _NO_NORMS16), norms) if norm8 else (norms, c(like, _NO_NORMS8))
    if isinstance(code, Codebook):
        return (False, c(like, code.boundaries), c(like, code.centroids), code.bits, c(like, _NO_CENTS),
                c(like, _NO_F32), c(like, _NO_U8), c(like, _NO_I32), c(like, _NO_U8), codes, *planes), False
    gpar, goff, gcand, slots = search_grid(code, d)
    return (True, c(like, _NO_F32), c(like, _NO_F32), 0, c(like, code), c(like, gpar), c(like, slots), c(like, goff),
            c(like, gcand), codes, *planes), True


def quantize_head_pair_into(xk3: Any, xv3: Any, kcodes: Any, knorms: Any, vcodes: Any, vnorms: Any, t0: int,
                            kcode: Codebook | np.ndarray, vcode: Codebook | np.ndarray, unbiased: bool,
                            add_at: tuple | None = None, base16: int | None = None) -> None:
    """Quantize keys ``xk3`` and values ``xv3`` into their codes and norms at tokens ``t0 :
    t0 + seq``, both sides in one launch (no validation: callers validated).

    Parameters
    ----------
    xk3, xv3 : float32 arrays, shape ``(rows, seq, d)``
        C-contiguous, one shape and device, finite (the stored domain: no rotation yet).
    kcodes, vcodes : uint8 arrays, shape ``(rows, capacity, width)``
        The sides' code planes (``width`` the code's packed bytes per vector).
    knorms, vnorms : arrays, shape ``(rows, capacity, 1)``
        uint16 binary16 norms, or with ``base16`` uint8 grid codes.
    t0 : int
        First token written (``t0 + seq <= capacity``).
    kcode, vcode : Codebook or float32 array ``(256, m)``
        A side's code: the scalar head code's ``head_codebook(bits, d)``, or the head VQ
        code's ``headvq_centroids(bits, d)``.
    unbiased : bool
        The EDEN-style rescaled norms of both codes.
    add_at : tuple, optional
        A count update folded into the launch, as for
        :func:`~numba_kv.ops.blockquant.quantize_pair_into`.
    base16 : int, optional
        8-bit norms on the grid of this base (:func:`~numba_kv.ops.norm8.norm8_base16`); by
        default binary16 norms.

    Notes
    -----
    The same bytes as quantizing each side on its own (``quantize_head_into`` or
    ``quantize_headvq_into``, then ``norm8_store_into`` with ``base16``).
    """
    rows, seq, d = xk3.shape
    if rows == 0 or seq == 0:
        return
    t0 = check_span(t0, seq, kcodes.shape[1], "kcodes")
    norm8 = base16 is not None
    kargs, kvq = head_side_args(xk3, kcode, d, kcodes, knorms, norm8)
    vargs, vvq = head_side_args(xk3, vcode, d, vcodes, vnorms, norm8)
    c = _backend.constant
    _QUANTIZE_PAIR.launch(_backend.device_of("xk3", xk3), 2 * rows * seq, xk3, xv3, c(xk3, head_signs(d)),
                          bool(unbiased), int(t0), *kargs, *vargs, norm8, int(base16 or 0), c(xk3, LOG16),
                          *count_args(xk3, add_at),
                          work=rows * seq * d * ((_VQ_WORK if kvq else 1) + (_VQ_WORK if vvq else 1)),
                          coop=(2 * rows * seq, d // 2))
