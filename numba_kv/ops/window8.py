"""One-call store into an int8 exact window (the window of
:class:`~numba_kv.caches._window.ExactWindow`): serial calls on the CPU, and
:func:`slide_windows8`, one launch for both sides on any device (a twin).

A decode step of a cache with an int8 window (the ``kv4``/``kv5`` presets) stores one token
per KV row and evicts the oldest window token into the compressed store.  Done op by op that
is four kernel launches per side (int8 read, inverse rotation, forward rotation, int8 write)
plus NumPy moves, each paying a dispatch that costs more than its work.  :func:`window8_store`
does the whole window part of a store in one serial call: the new sinks, the evicted tokens
(read back and rotated back, for the caller to compress), the slide of the surviving window
tokens and the new window tokens.

It runs the very cores of the op-by-op path (:mod:`numba_kv.ops.absmax8`'s vector codec,
the head rotation of :mod:`numba_kv.ops.headquant`, the 32-block rotation of
:mod:`numba_kv.ops.hadamard`) on the same float32 values in the same order, so the stored
codes, scales and evicted vectors are bit-identical to it.  :func:`window8_store` and
:func:`window8_head_step` are CPU only (NumPy arrays); a device decode step stores through
:func:`slide_windows8` (the section below), whose CPU twin runs the same serial cores.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import cuda, float32, int8, int64

from .. import _backend, _config
from .._config import MAX_CUDA_THREADS, MAX_HEAD_DIM
from .._jit import cpu_kernel, cpu_serial, cuda_device, cuda_kernel
from ._borrow import borrowed, keep_alive
from ._coop import coop_butterflies_within
from ._exact import mul_rn_dev
from ._headquant_lanes import head_scale_dev, rotate_head_row_cpu
from ._registry import register
from .absmax8 import dequantize_vector_cpu, quantize_vector_cpu, rint_dev, scale_bits_dev
from .finite import FOLD_SIG
from .hadamard import load_rotate_store_cpu
from .half import f16_bits_to_f32_dev
from .headpair import HEAD_SIDE_SERIAL, head_side_args
from .headquant import QUANTIZE_HEAD
from .memory import check_store_plan, shift_column_dev, store_launch_args, store_tail_cpu, store_tail_dev
from .norm8 import LOG16

__all__ = ["ROT_BLOCK", "ROT_HEAD", "ROT_NONE", "slide_windows8", "window8_codes_args", "window8_head_args",
           "window8_head_step", "window8_store"]

#: rotation of the stored int8 vectors: none, whole head, per 32-block
ROT_NONE, ROT_HEAD, ROT_BLOCK = 0, 1, 2


@cpu_serial
def _rotate_rows(x2, rot, signs, inverse, buf, out):
    """``out[r] = rotation of x2[r]`` for every row (``x2``, ``out`` float32 ``[rows, d]``)."""
    rows, d = x2.shape
    for r in range(rows):
        if rot == ROT_HEAD:
            rotate_head_row_cpu(x2, r, d, signs, inverse, buf, out)
        elif rot == ROT_BLOCK:
            for b in range(d // 32):
                load_rotate_store_cpu(x2, r, b, signs, inverse, buf, out)
        else:
            for j in range(d):
                out[r, j] = x2[r, j]


@cpu_serial
def _put_tokens(x3, s0, n, ex, exs, d0, rot, signs, src, buf, rot3):
    """Exact tokens ``d0 : d0+n`` ← ``x3[:, s0 : s0+n]`` rotated, as int8 with binary16 scales."""
    rows, _, d = x3.shape
    rot2 = rot3[:, 0, :]
    for t in range(n):
        for r in range(rows):
            for j in range(d):
                src[r, j] = x3[r, s0 + t, j]
        _rotate_rows(src, rot, signs, False, buf, rot2)
        for r in range(rows):
            quantize_vector_cpu(rot3, r, 0, ex, exs, d0 + t)


@cpu_serial
def _window8_store_cpu(x3, ex, exs, ev, a, e_old, e_new, keep_old, keep_new, sinks, seq_len, rot, signs):
    """Serial: the window part of one store (see :func:`window8_store`)."""
    rows, _, d = x3.shape
    # borrowed views (numba_kv.ops._borrow): each rotation makes ~190 slice views of ``buf``
    x3, ex, exs, ev, signs = borrowed(x3), borrowed(ex), borrowed(exs), borrowed(ev), borrowed(signs)
    src_own = np.empty((rows, d), dtype=np.float32)
    out_own = np.empty((rows, d), dtype=np.float32)
    rot3_own = np.empty((rows, 1, d), dtype=np.float32)
    buf_own = np.empty(d, dtype=np.float32)
    src, out, rot3, buf = borrowed(src_own), borrowed(out_own), borrowed(rot3_own), borrowed(buf_own)
    # the first new tokens become sinks
    _put_tokens(x3, 0, a, ex, exs, seq_len, rot, signs, src, buf, rot3)
    # window tokens leaving the window, read back (and rotated back) into ev[:, :e_old]
    for t in range(e_old):
        for r in range(rows):
            dequantize_vector_cpu(ex, exs, r, 0, sinks + t, rot3, 0)
            for j in range(d):
                src[r, j] = rot3[r, 0, j]
        _rotate_rows(src, rot, signs, True, buf, out)
        for r in range(rows):
            for j in range(d):
                ev[r, t, j] = out[r, j]
    # new tokens that skip the window follow them
    for t in range(e_new):
        for r in range(rows):
            for j in range(d):
                ev[r, e_old + t, j] = x3[r, a + t, j]
    # the surviving window tokens slide to the window's front (ascending: the target is lower)
    if e_old:
        for r in range(rows):
            for t in range(keep_old):
                for j in range(d):
                    ex[r, sinks + t, j] = ex[r, sinks + e_old + t, j]
                exs[r, sinks + t, 0] = exs[r, sinks + e_old + t, 0]
    # the rest of the new tokens enter the window after them
    _put_tokens(x3, a + e_new, keep_new, ex, exs, sinks + keep_old, rot, signs, src, buf, rot3)
    keep_alive(src_own)
    keep_alive(out_own)
    keep_alive(rot3_own)
    keep_alive(buf_own)


def window8_store(x3: np.ndarray, ex: np.ndarray, exs: np.ndarray, plan: Any, sinks: int, seq_len: int,
                  rot: int, signs: np.ndarray) -> np.ndarray:
    """Store new tokens into an int8 window by ``plan`` and return the evicted tokens.

    Parameters
    ----------
    x3 : float32 array, shape ``(rows, n, d)``, C-contiguous
        The new tokens (stored domain, finite: the caller validated them).
    ex : int8 array, shape ``(rows, S + R, d)``
    exs : uint16 array, shape ``(rows, S + R, 1)``
        The window's codes and binary16 scales (sinks at ``[0, n_sink)``, the window from
        ``sinks``), updated in place.
    plan : StorePlan
        ``(sinks, evict_old, evict_new, keep_old, keep_new)`` of
        :func:`~numba_kv.caches._window.plan_store`.
    sinks : int
        Sink tokens of the layer (where the window starts).
    seq_len : int
        Tokens stored before this call (where new sinks go).
    rot : {ROT_NONE, ROT_HEAD, ROT_BLOCK}
        Rotation of the stored vectors.
    signs : float32 array
        ``head_signs(d)`` (``ROT_HEAD``) or ``SIGNS32`` (``ROT_BLOCK``; any float32 array
        for ``ROT_NONE``).

    Returns
    -------
    numpy.ndarray
        float32 ``(rows, evict_old + evict_new, d)``: the tokens leaving the window, oldest
        first, in the stored (unrotated) domain, for the caller to compress.
    """
    a, e_old, e_new, keep_old, keep_new = (int(c) for c in plan)
    ev = np.empty((x3.shape[0], e_old + e_new, x3.shape[2]), dtype=np.float32)
    _window8_store_cpu(x3, ex, exs, ev, a, e_old, e_new, keep_old, keep_new, int(sinks), int(seq_len), int(rot),
                       signs)
    return ev


_NO_MEAN = np.zeros((1, 1, 1), np.float32)  # the key mean's placeholder without key centering (never read)

# the serial compilations of the head quantizers' and the 8-bit norm store's CPU twins, called
# from the serial step below (one decode step's few evicted vectors: far below the parallel threshold)
_quantize_head_serial = QUANTIZE_HEAD.cpu.serial
_head_side_serial = HEAD_SIDE_SERIAL


@cpu_serial
def _windows_store_cpu(k4, v4, kmean, center, a, e_old, e_new, keep_old, keep_new, sinks, seq_len, n_sink, pos_base,
                       n_win, kex, kexs, vex, vexs, rot, rsigns, pos):
    """Serial: keys centered on ``kmean`` when ``center``, both sides stored into their windows,
    and the exact tokens' positions after the store written.  Returns the tokens leaving the
    windows, float32 ``[2 (K, V), rows, e_old + e_new, d]``, for the caller to quantize."""
    b, h, n, d = k4.shape
    rows = b * h
    kx_own = np.empty((rows, n if center else 0, d), dtype=np.float32)
    ev_own = np.empty((2, rows, e_old + e_new, d), dtype=np.float32)
    k3 = k4.reshape((rows, n, d))
    v3 = v4.reshape((rows, n, d))
    kx = k3
    if center:  # x − m in float32, as NumPy's broadcast subtraction of the key mean
        kx = kx_own
        for r in range(rows):
            for t in range(n):
                for j in range(d):
                    kx[r, t, j] = k3[r, t, j] - kmean[r, 0, j]
    # borrowed views (numba_kv.ops._borrow) into the calls below; the caller keeps the owners
    kx, v3, kev, vev = borrowed(kx), borrowed(v3), borrowed(ev_own[0]), borrowed(ev_own[1])
    _window8_store_cpu(kx, kex, kexs, kev, a, e_old, e_new, keep_old, keep_new, sinks, seq_len, rot, rsigns)
    _window8_store_cpu(v3, vex, vexs, vev, a, e_old, e_new, keep_old, keep_new, sinks, seq_len, rot, rsigns)
    # the exact tokens' positions after the store: sinks 0 .. n_sink-1, the window from pos_base
    for i in range(n_sink):
        pos[i] = i
    for i in range(n_win):
        pos[n_sink + i] = pos_base + i
    keep_alive(kx_own)
    return ev_own


@cpu_serial
def _window8_head_step_cpu(k4, v4, kmean, center, a, e_old, e_new, keep_old, keep_new, sinks, seq_len, t0, n_sink,
                           pos_base, n_win, base16, kex, kexs, vex, vexs, rot, rsigns, qsigns, kbounds, kcents, kbits,
                           vbounds, vcents, vbits, unbiased, kcodes, knorms, vcodes, vnorms, pos):
    """Serial: both sides of one store, the scalar head code with binary16 norms (see
    :func:`window8_head_step`; ``base16`` unused).  Its own signature, without the 8-bit
    planes: every argument of a call costs its unboxing, in ``kv4``'s every decode step."""
    ev_own = _windows_store_cpu(k4, v4, kmean, center, a, e_old, e_new, keep_old, keep_new, sinks, seq_len, n_sink,
                                pos_base, n_win, kex, kexs, vex, vexs, rot, rsigns, pos)
    if e_old + e_new:
        _quantize_head_serial(borrowed(ev_own[0]), qsigns, kbounds, kcents, unbiased, kbits, t0, kcodes, knorms)
        _quantize_head_serial(borrowed(ev_own[1]), qsigns, vbounds, vcents, unbiased, vbits, t0, vcodes, vnorms)
    keep_alive(ev_own)


@cpu_serial
def _window8_codes_step_cpu(k4, v4, kmean, center, a, e_old, e_new, keep_old, keep_new, sinks, seq_len, t0, n_sink,
                            pos_base, n_win, base16, kex, kexs, vex, vexs, rot, rsigns, qsigns, unbiased, kvq,
                            kbounds, kcents, kbits, kvcents, kgpar, kslots, kgoff, kgcand, kcodes, knorms, knorms8,
                            vvq, vbounds, vcents, vbits, vvcents, vgpar, vslots, vgoff, vgcand, vcodes, vnorms,
                            vnorms8, norm8, log16, pos):
    """Serial: both sides of one store, each with either whole-head code (the scalar code or
    the VQ code), binary16 norms or 8-bit norms on the grid of base ``base16`` (see
    :func:`window8_head_step`; a side's arguments as :func:`~numba_kv.ops.headpair.head_side_args`
    gives them)."""
    ev_own = _windows_store_cpu(k4, v4, kmean, center, a, e_old, e_new, keep_old, keep_new, sinks, seq_len, n_sink,
                                pos_base, n_win, kex, kexs, vex, vexs, rot, rsigns, pos)
    if e_old + e_new:
        _head_side_serial(borrowed(ev_own[0]), qsigns, unbiased, t0, kvq, kbounds, kcents, kbits, kvcents, kgpar,
                          kslots, kgoff, kgcand, kcodes, knorms, knorms8, norm8, base16, log16)
        _head_side_serial(borrowed(ev_own[1]), qsigns, unbiased, t0, vvq, vbounds, vcents, vbits, vvcents, vgpar,
                          vslots, vgoff, vgcand, vcodes, vnorms, vnorms8, norm8, base16, log16)
    keep_alive(ev_own)


def window8_head_args(kex: np.ndarray, kexs: np.ndarray, vex: np.ndarray, vexs: np.ndarray, rot: int,
                      rsigns: np.ndarray, qsigns: np.ndarray, kcb: Any, vcb: Any, unbiased: bool,
                      kcodes: np.ndarray, knorms: np.ndarray, vcodes: np.ndarray, vnorms: np.ndarray,
                      pos: np.ndarray) -> tuple:
    """The arguments of :func:`window8_head_step` that stay the same from step to step while a
    layer's buffers stay put (a cache builds them once per buffer set), for the scalar head
    code with binary16 norms on both sides (``kv4``; its own step function, whose argument list
    is the shortest: every argument of a call costs its unboxing, in every decode step).

    Parameters
    ----------
    kex, kexs, vex, vexs
        The int8 windows and their binary16 scales (as for :func:`window8_store`).
    rot, rsigns
        The window's rotation (as for :func:`window8_store`) and its signs.
    qsigns : float32 array, shape ``(d,)``
        ``head_signs(d)``, the quantizer's rotation.
    kcb, vcb : Codebook
        The L2 head codebooks of K and V (``head_codebook(bits, d)``).
    unbiased : bool
        The EDEN rescale of the stored norms.
    kcodes, knorms, vcodes, vnorms
        The compressed store (uint8 codes; uint16 norms ``[rows, capacity, 1]``).
    pos : int32 array
        The exact tokens' position buffer (long enough for the window and the sinks).

    Returns
    -------
    tuple
        The ``static`` argument of :func:`window8_head_step`.
    """
    return (_window8_head_step_cpu, kex, kexs, vex, vexs, int(rot), rsigns, qsigns, kcb.boundaries, kcb.centroids,
            int(kcb.bits), vcb.boundaries, vcb.centroids, int(vcb.bits), bool(unbiased), kcodes, knorms, vcodes,
            vnorms, pos)


def window8_codes_args(kex: np.ndarray, kexs: np.ndarray, vex: np.ndarray, vexs: np.ndarray, rot: int,
                       rsigns: np.ndarray, qsigns: np.ndarray, kcode: Any, vcode: Any, unbiased: bool,
                       kcodes: np.ndarray, knorms: np.ndarray, vcodes: np.ndarray, vnorms: np.ndarray,
                       pos: np.ndarray, norm8: bool = False) -> tuple:
    """:func:`window8_head_args` for any whole-head code on either side: the scalar code or the
    head VQ code, binary16 or 8-bit norms (``kv3``: VQ on both sides, 8-bit norms).

    Parameters
    ----------
    kex, kexs, vex, vexs, rot, rsigns, qsigns
        As for :func:`window8_head_args`: the int8 windows (int8 ``[rows, S + R, d]``) and
        their binary16 scales (uint16 ``[rows, S + R, 1]``), the window's rotation and signs,
        and ``head_signs(d)``.
    kcode, vcode : Codebook or float32 array, shape ``(256, m)``
        A side's code: ``head_codebook(bits, d)`` (the scalar code) or
        :func:`~numba_kv.ops.headvq.headvq_centroids` (the VQ code, whose candidate grid is
        looked up here).
    unbiased, kcodes, vcodes, pos
        As for :func:`window8_head_args` (codes uint8 ``[rows, capacity, width]``).
    knorms, vnorms : arrays, shape ``(rows, capacity, 1)``
        uint16 binary16 norms, or with ``norm8`` uint8 grid codes.
    norm8 : bool
        8-bit norms (``norm_bits=8``), encoded on the grid whose base the step is given
        (:func:`window8_head_step`'s ``base16``).

    Returns
    -------
    tuple
        The ``static`` argument of :func:`window8_head_step`.
    """
    d = int(kex.shape[2])
    kside, _ = head_side_args(kex, kcode, d, kcodes, knorms, norm8)
    vside, _ = head_side_args(kex, vcode, d, vcodes, vnorms, norm8)
    return (_window8_codes_step_cpu, kex, kexs, vex, vexs, int(rot), rsigns, qsigns, bool(unbiased), *kside, *vside,
            bool(norm8), LOG16, pos)


def window8_head_step(k4: np.ndarray, v4: np.ndarray, kmean: np.ndarray | None, plan: Any, sinks: int, seq_len: int,
                      t0: int, pos_counts: tuple[int, int, int], static: tuple, base16: int = 0) -> None:
    """One serial call for the whole store of a head-quantized cache with an int8 window:
    keys centered on ``kmean`` (when given), both sides stored into their windows by ``plan``
    (:func:`window8_store`), the tokens leaving the windows quantized by the whole-head
    quantizer into the compressed store at ``t0`` (:func:`~numba_kv.ops.headquant.quantize_head_into`,
    or per side the code :func:`window8_codes_args` gives, as
    :func:`~numba_kv.ops.headpair.quantize_head_pair_into` stores it), and
    the exact tokens' positions after the store written.

    For one decode step's few tokens: done op by op these are two NumPy operations and four
    kernel dispatches with their Python around them, each costing more than its work.  The
    same cores run on the same float32 values in the same order, so every stored byte is
    bit-identical to the op-by-op path.  CPU only, serial (callers keep it to small stores).

    Parameters
    ----------
    k4, v4 : float32 arrays, shape ``(batch, heads, n, d)``, C-contiguous
        The new tokens (finite: the caller validated them), keys before centering; the rows
        are ``batch·heads``.
    kmean : float32 array, shape ``(rows, 1, d)``, or None
        The frozen key mean (key centering), or none.
    plan : StorePlan
        ``(sinks, evict_old, evict_new, keep_old, keep_new)`` of
        :func:`~numba_kv.caches._window.plan_store`.
    sinks, seq_len : int
        As for :func:`window8_store`.
    t0 : int
        Compressed tokens before this store (where the evicted tokens go).
    pos_counts : (n_sink, first window position, n_win)
        After the store: ``pos[:n_sink + n_win]`` ← ``0, …, n_sink − 1, first, …, first + n_win − 1``.
    static : tuple
        :func:`window8_head_args` (the scalar code, binary16 norms) or
        :func:`window8_codes_args` (any code, either norm width) of the layer's buffers.
    base16 : int
        The layer's 8-bit norm grid base (1/16 octaves; read only with ``norm8``).
    """
    a, e_old, e_new, keep_old, keep_new = plan
    center = kmean is not None
    step, args = static[0], static[1:]  # (a serial CPU core, not a kernel launch)
    step(k4, v4, kmean if center else _NO_MEAN, center, a, e_old, e_new, keep_old, keep_new, sinks, seq_len, t0,
         pos_counts[0], pos_counts[1], pos_counts[2], int(base16), *args)


# --- the store of a decode step into int8 windows in one launch, on any device ----------------
# A device decode step of an int8-window cache (``kv4``/``kv5``) stored op by op is an int8
# read, an inverse rotation, a forward rotation and an int8 write per side, the slide of the
# surviving tokens through a temporary, a launch for the positions, and the key centering in
# CuPy: eight launches or more, an allocation per temporary, and CuPy work between launches,
# which keeps the step from being replayed as a CUDA graph (issue 27).  Here both sides, the
# key centering, the positions, the deferred range records and the step state's count copy
# are one launch.  One thread block stores one (side, row): the vector being rotated lives
# once in shared memory, the block's threads share each element-wise step and every
# butterfly stage (ops._coop), and a tree reduction gives the absmax.  Every value goes
# through the float32 operations of the CPU cores above in their order (a maximum is exact in
# any order), so codes, scales and evicted vectors are bit-identical to the CPU twin, which
# runs those cores.  Threads own the channels ``tid, tid + nt, …`` in every step, so the slide
# of a column and the new tokens written after it are ordered within one thread.


@cpu_kernel
def _slide8_cpu(xk, xv, kmean, center, exk, exv, exks, exvs, evk, evv, a, s_at, e_new, sinks, e_old, keep_old,
                keep_new, rot, signs, pos, n_pos, pos_sinks, pos_base, u0, m0, o0, u1, m1, o1, u2, m2, o2, cnt, cr,
                cw):
    """CPU twin of :func:`_slide8_cuda`: the serial window store of each side (its cores),
    then the positions, the folded range records and the count copy."""
    rows, n, d = xk.shape
    pos_base = pos_base + (int64(cnt[cr]) if cr >= 0 else int64(0))
    kx = xk
    if center:  # x − m in float32, as NumPy's broadcast subtraction of the key mean
        kx = np.empty((rows, n, d), dtype=np.float32)
        for r in range(rows):
            for t in range(n):
                for j in range(d):
                    kx[r, t, j] = xk[r, t, j] - kmean[r, 0, j]
    _window8_store_cpu(kx, exk, exks, evk, a, e_old, e_new, keep_old, keep_new, sinks, s_at, rot, signs)
    _window8_store_cpu(xv, exv, exvs, evv, a, e_old, e_new, keep_old, keep_new, sinks, s_at, rot, signs)
    store_tail_cpu(pos, n_pos, pos_sinks, pos_base, u0, m0, o0, u1, m1, o1, u2, m2, o2, cnt, cr, cw)


@cuda_device
def _put8_dev(x, ti, r, kmean, cen, rot, signs, t, red, ex, exs, dst):
    """Block-cooperative: token ``x[r, ti]`` (minus ``kmean[r, 0]`` when ``cen``) rotated by
    ``rot`` into ``ex[r, dst]`` as int8 with its binary16 scale in ``exs[r, dst, 0]``, as
    :func:`~numba_kv.ops.absmax8.quantize_vector_cpu` stores the rotation of
    :func:`_rotate_rows`; ``t`` (float32[d]) and ``red`` (float32[blockDim], a power of
    two) are the block's shared scratch.  Every thread of the block calls it."""
    d = ex.shape[2]
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    for w in range(tid, d, nt):
        v = x[r, ti, w]
        if cen:
            v = v - kmean[r, 0, w]
        if rot == ROT_HEAD:
            v = v * signs[w]
        t[w] = v
    if rot == ROT_HEAD:  # H_d D_s x / sqrt(d) (rotate_head_forward)
        coop_butterflies_within(t, d, d, tid, nt)
        sc = head_scale_dev(d)
        for w in range(tid, d, nt):
            t[w] = t[w] * sc
    elif rot == ROT_BLOCK:  # D_s H x per 32-block (rotate32_forward)
        coop_butterflies_within(t, d, 32, tid, nt)
        for w in range(tid, d, nt):
            t[w] = mul_rn_dev(t[w] * float32(0.17677669529663687), signs[w & 31])
    m = float32(0.0)
    for w in range(tid, d, nt):  # (this thread's own values: written by it above)
        m = max(m, abs(t[w]))
    red[tid] = m
    h = nt >> 1
    while h > 0:  # a tree of maxima: exact in any order
        cuda.syncthreads()
        if tid < h:
            red[tid] = max(red[tid], red[tid + h])
        h = h >> 1
    cuda.syncthreads()
    q = scale_bits_dev(red[0])
    s = f16_bits_to_f32_dev(q)
    for w in range(tid, d, nt):
        v = rint_dev(t[w] / s)
        ex[r, dst, w] = int8(min(max(v, float32(-127.0)), float32(127.0)))
    if tid == 0:
        exs[r, dst, 0] = q
    cuda.syncthreads()  # red is read by every thread before the next token writes it


@cuda_device
def _get8_dev(ex, exs, r, src, rot, signs, t, ev, ei):
    """Block-cooperative: ``ev[r, ei]`` ← token ``ex[r, src]`` read back and rotated back, as
    :func:`~numba_kv.ops.absmax8.dequantize_vector_cpu` and the inverse of
    :func:`_rotate_rows`; ``t`` is the block's shared float32[d].  Every thread calls it."""
    d = ex.shape[2]
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    s = f16_bits_to_f32_dev(exs[r, src, 0])
    if rot == ROT_HEAD:  # D_s H_d y / sqrt(d) (rotate_head_inverse)
        for w in range(tid, d, nt):
            t[w] = float32(ex[r, src, w]) * s
        coop_butterflies_within(t, d, d, tid, nt)
        sc = head_scale_dev(d)
        for w in range(tid, d, nt):
            ev[r, ei, w] = t[w] * (sc * signs[w])
    elif rot == ROT_BLOCK:  # H D_s y per 32-block (rotate32_inverse)
        for w in range(tid, d, nt):
            t[w] = mul_rn_dev(float32(ex[r, src, w]) * s, signs[w & 31])
        coop_butterflies_within(t, d, 32, tid, nt)
        for w in range(tid, d, nt):
            ev[r, ei, w] = t[w] * float32(0.17677669529663687)
    else:
        for w in range(tid, d, nt):
            ev[r, ei, w] = float32(ex[r, src, w]) * s
    cuda.syncthreads()  # t is free again


@cuda_kernel
def _slide8_cuda(xk, xv, kmean, center, exk, exv, exks, exvs, evk, evv, a, s_at, e_new, sinks, e_old, keep_old,
                 keep_new, rot, signs, pos, n_pos, pos_sinks, pos_base, u0, m0, o0, u1, m1, o1, u2, m2, o2, cnt, cr,
                 cw):
    """Launch contract: ``(blocks, threads)``, ``threads`` a power of two ≤ 256; block ``b``
    stores (side, row) ``b, b + blocks, …`` of the ``2·rows`` (k rows, then v rows) in the
    order of :func:`_window8_store_cpu`; then every thread (global index, grid-stride) writes
    its positions, folds its share of the range records
    (:func:`~numba_kv.ops.finite.fold_absbits_dev`), and thread 0 copies ``cnt[cr]`` into
    ``cnt[cw]`` (``cw >= 0``).  The window's first position is ``pos_base + cnt[cr]``
    (``cr >= 0``)."""
    t = cuda.shared.array(MAX_HEAD_DIM, dtype=float32)
    red = cuda.shared.array(MAX_CUDA_THREADS, dtype=float32)
    rows, d = exk.shape[0], exk.shape[2]
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    pos_base = pos_base + (int64(cnt[cr]) if cr >= 0 else int64(0))
    for j in range(cuda.blockIdx.x, 2 * rows, cuda.gridDim.x):
        r = j % rows
        x, ex, exs, ev = (xk, exk, exks, evk) if j < rows else (xv, exv, exvs, evv)
        cen = center != 0 and j < rows
        for i in range(a):  # new sinks
            _put8_dev(x, i, r, kmean, cen, rot, signs, t, red, ex, exs, s_at + i)
        for i in range(e_old):  # window tokens leaving the window, read back
            _get8_dev(ex, exs, r, sinks + i, rot, signs, t, ev, i)
        for i in range(e_new):  # new tokens that skip the window follow them
            for w in range(tid, d, nt):
                v = x[r, a + i, w]
                ev[r, e_old + i, w] = v - kmean[r, 0, w] if cen else v
        if e_old:  # the survivors slide to the front (ascending per column: the target is lower)
            for w in range(tid, d, nt):  # (SHIFT_BATCH loads in flight: memory.shift_column)
                shift_column_dev(ex, r, w, sinks, sinks + e_old, keep_old)
            if tid == nt - 1:  # (the scales by another warp than thread 0's columns, where there is one)
                shift_column_dev(exs, r, 0, sinks, sinks + e_old, keep_old)
        cuda.syncthreads()
        for i in range(keep_new):  # the rest of the new tokens enter the window after them
            _put8_dev(x, a + e_new + i, r, kmean, cen, rot, signs, t, red, ex, exs, sinks + keep_old + i)
    store_tail_dev(pos, n_pos, pos_sinks, pos_base, u0, m0, o0, u1, m1, o1, u2, m2, o2, cnt, cr, cw,
                   cuda.blockIdx.x * nt + tid, cuda.gridDim.x * nt)


_F3, _I3, _U3 = "float32[:, :, ::1]", "int8[:, :, ::1]", "uint16[:, :, ::1]"
_SLIDE8 = register("slide_windows8", _slide8_cpu, _slide8_cuda,
                   [f"void({_F3}, {_F3}, {_F3}, int64, {_I3}, {_I3}, {_U3}, {_U3}, {_F3}, {_F3}, int64, int64, int64, "
                    f"int64, int64, int64, int64, int64, float32[::1], int32[::1], int64, int64, int64, {FOLD_SIG}, "
                    "int32[::1], int64, int64)"])


def _block_threads(d: int) -> int:
    """Threads of a block of :func:`_slide8_cuda`: the largest power of two ≤ ``d`` and the
    ``cuda_threads`` knob (under the simulator ``cuda_threads_sim``)."""
    knob = "cuda_threads_sim" if _backend.simulator_enabled() else "cuda_threads"
    cap = min(int(d), int(_config.get(knob)))
    return 1 << (max(cap, 1).bit_length() - 1)


def slide_windows8(xk: Any, xv: Any, kmean: Any, exk: Any, exks: Any, exv: Any, exvs: Any, evk: Any, evv: Any,
                   plan: Any, s_at: int, sinks: int, rot: int, signs: Any, pos: Any, pos_counts: tuple[int, int, int],
                   ranges: tuple | None = None, count: tuple[Any, int, int] | None = None) -> None:
    """The store of new tokens into the int8 windows of both sides (keys centered on
    ``kmean`` first, when given), the exact tokens' positions after it, and optionally the
    call's deferred range records and the layer's count copy: one launch on a device, one
    call on the CPU.  The int8 counterpart of :func:`~numba_kv.ops.memory.slide_windows`,
    for a decode step's few tokens (each block loops over its side's tokens).

    Per side and row, in this order (as :func:`window8_store`): the ``plan.sinks`` first new
    tokens into tokens ``s_at …`` (rotated, int8 with a binary16 absmax scale); the
    ``plan.evict_old`` window tokens from ``sinks`` read back and rotated back into
    ``ev[:, :evict_old]``, the ``plan.evict_new`` new tokens that skip the window after them
    (unrotated: the stored domain, for the caller to compress); the ``plan.keep_old``
    survivors slide to the window's front (codes and scales); the ``plan.keep_new`` last new
    tokens enter the window after them.

    Parameters
    ----------
    xk, xv : float32 arrays, shape ``(rows, n, d)``, C-contiguous
        The new tokens (finite: the caller validated them); keys before centering.
    kmean : float32 array, shape ``(rows, 1, d)``, or None
        The frozen per-channel key mean (key centering: the keys stored are ``xk − kmean``),
        or none.
    exk, exv : int8 arrays, shape ``(rows, capacity, d)``, C-contiguous
    exks, exvs : uint16 arrays, shape ``(rows, capacity, 1)``
        The windows' codes and binary16 scales (sinks first, the window from ``sinks``).
    evk, evv : float32 arrays, shape ``(rows, >= evict_old + evict_new, d)``, C-contiguous
        The eviction buffers (their first ``evict_old + evict_new`` tokens are written).
    plan : StorePlan
        ``(sinks, evict_old, evict_new, keep_old, keep_new)`` of
        :func:`~numba_kv.caches._window.plan_store`.
    s_at, sinks : int
        Where the new sinks go, and where the window starts.
    rot : {ROT_NONE, ROT_HEAD, ROT_BLOCK}
        Rotation of the stored vectors (``ROT_HEAD``: ``d`` a power of two ≤ 512;
        ``ROT_BLOCK``: ``d`` a multiple of 32).
    signs : float32 array
        ``head_signs(d)`` (``ROT_HEAD``) or ``SIGNS32`` (otherwise), on the arrays' device.
    pos : int32 array, shape ``(>= n_sink + n_win,)``
    pos_counts : (n_sink, base, n_win)
        ``pos[:n_sink + n_win]`` ← ``0, …, n_sink − 1, b, …, b + n_win − 1`` with ``b = base``
        (plus ``cnt[read]`` with ``count``).
    ranges : tuple, optional
        ``(bits, mask, accumulator) × 3`` folded into the launch, as for
        :func:`~numba_kv.ops.memory.slide_windows`.
    count : tuple ``(cnt, read, write)``, optional
        ``cnt[write] = cnt[read]`` by one thread, as for :func:`~numba_kv.ops.memory.slide_windows`.
    """
    dev = _backend.resolve_device("auto", xk=xk, xv=xv, exk=exk, exv=exv, evk=evk, evv=evv, pos=pos)
    rows, cap, d = (int(s) for s in exk.shape)
    n, n_ev = int(xk.shape[1]), int(evk.shape[1])
    a, e_old, e_new, keep_old, keep_new = (int(c) for c in plan)
    want = {"xk": (xk, np.float32, n, d), "xv": (xv, np.float32, n, d), "exv": (exv, np.int8, cap, d),
            "exk": (exk, np.int8, cap, d), "exks": (exks, np.uint16, cap, 1), "exvs": (exvs, np.uint16, cap, 1),
            "evk": (evk, np.float32, n_ev, d), "evv": (evv, np.float32, n_ev, d)}
    for name, (arr, dt, length, width) in want.items():
        if np.dtype(arr.dtype) != dt or tuple(int(s) for s in arr.shape) != (rows, length, width):
            raise ValueError(f"{name}: expected {np.dtype(dt)} ({rows}, {length}, {width}), got {arr.dtype} "
                             f"{tuple(arr.shape)}")
    counts = (a, int(s_at), e_new, int(sinks), e_old, keep_old, keep_new)
    check_store_plan("plan", counts, n, n_ev, cap)
    if rot not in (ROT_NONE, ROT_HEAD, ROT_BLOCK) or (rot == ROT_HEAD and (d & (d - 1) or d > 512)) \
            or (rot != ROT_HEAD and d % 32):
        raise ValueError(f"rot: expected ROT_NONE, ROT_HEAD (d a power of two <= 512) or ROT_BLOCK (d a multiple "
                         f"of 32), got {rot} with d = {d}")
    # the kernels index signs without bounds checks: a short table reads past its end
    n_signs = d if rot == ROT_HEAD else 32
    if np.dtype(signs.dtype) != np.float32 or tuple(int(s) for s in signs.shape) != (n_signs,):
        raise ValueError(f"signs: expected float32 ({n_signs},) (head_signs(d) for ROT_HEAD, else SIGNS32), got "
                         f"{signs.dtype} {tuple(signs.shape)}")
    mean, tail = store_launch_args(xk, rows, d, kmean, pos, pos_counts, ranges, count)
    work = 2 * rows * d * 16 * (a + e_new + keep_new + e_old + keep_old + 1) + tail[1]
    _SLIDE8.launch(dev, 0, xk, xv, *mean, exk, exv, exks, exvs, evk, evv, *counts, int(rot), signs, *tail, work=work,
                   grid=(max(1, min(2 * rows, 1 << 16)), _block_threads(d)))
