"""One-call store into an int8 exact window on the CPU (the window of
:class:`~numba_kv.caches._window.ExactWindow`).

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
codes, scales and evicted vectors are bit-identical to it.  CPU only (NumPy arrays): CUDA
arrays keep the op-by-op path.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._jit import cpu_serial
from ._borrow import borrowed, keep_alive
from ._headquant_lanes import rotate_head_row_cpu
from .absmax8 import dequantize_vector_cpu, quantize_vector_cpu
from .hadamard import load_rotate_store_cpu
from .headquant import QUANTIZE_HEAD

__all__ = ["ROT_BLOCK", "ROT_HEAD", "ROT_NONE", "window8_head_args", "window8_head_step", "window8_store"]

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

# the serial compilation of the head quantizer's CPU twin, called from the serial step below
# (one decode step's few evicted vectors: far below the parallel threshold)
_quantize_head_serial = QUANTIZE_HEAD.cpu.serial


@cpu_serial
def _window8_head_step_cpu(k4, v4, kmean, center, a, e_old, e_new, keep_old, keep_new, sinks, seq_len, t0, n_sink,
                           pos_base, n_win, kex, kexs, vex, vexs, rot, rsigns, qsigns, kbounds, kcents, kbits, vbounds,
                           vcents, vbits, unbiased, kcodes, knorms, vcodes, vnorms, pos):
    """Serial: both sides of one store (see :func:`window8_head_step`)."""
    b, h, n, d = k4.shape
    rows = b * h
    k3 = k4.reshape((rows, n, d))
    v3 = v4.reshape((rows, n, d))
    ne = e_old + e_new
    kx_own = np.empty((rows, n if center else 0, d), dtype=np.float32)
    kx = k3
    if center:  # x − m in float32, as NumPy's broadcast subtraction of the key mean
        kx = kx_own
        for r in range(rows):
            for t in range(n):
                for j in range(d):
                    kx[r, t, j] = k3[r, t, j] - kmean[r, 0, j]
    ev_own = np.empty((2, rows, ne, d), dtype=np.float32)
    # borrowed views (numba_kv.ops._borrow) into the calls below; the owners live to the end
    kx, v3, kev, vev = borrowed(kx), borrowed(v3), borrowed(ev_own[0]), borrowed(ev_own[1])
    _window8_store_cpu(kx, kex, kexs, kev, a, e_old, e_new, keep_old, keep_new, sinks, seq_len, rot, rsigns)
    _window8_store_cpu(v3, vex, vexs, vev, a, e_old, e_new, keep_old, keep_new, sinks, seq_len, rot, rsigns)
    if ne:
        _quantize_head_serial(kev, qsigns, kbounds, kcents, unbiased, kbits, t0, kcodes, knorms)
        _quantize_head_serial(vev, qsigns, vbounds, vcents, unbiased, vbits, t0, vcodes, vnorms)
    # the exact tokens' positions after the store: sinks 0 .. n_sink-1, the window from pos_base
    for i in range(n_sink):
        pos[i] = i
    for i in range(n_win):
        pos[n_sink + i] = pos_base + i
    keep_alive(kx_own)
    keep_alive(ev_own)


def window8_head_args(kex: np.ndarray, kexs: np.ndarray, vex: np.ndarray, vexs: np.ndarray, rot: int,
                      rsigns: np.ndarray, qsigns: np.ndarray, kcb: Any, vcb: Any, unbiased: bool,
                      kcodes: np.ndarray, knorms: np.ndarray, vcodes: np.ndarray, vnorms: np.ndarray,
                      pos: np.ndarray) -> tuple:
    """The arguments of :func:`window8_head_step` that stay the same from step to step while a
    layer's buffers stay put (a cache builds them once per buffer set).

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
        The compressed store (uint8 codes, uint16 norms ``[rows, capacity, 1]``).
    pos : int32 array
        The exact tokens' position buffer (long enough for the window and the sinks).
    """
    return (kex, kexs, vex, vexs, int(rot), rsigns, qsigns, kcb.boundaries, kcb.centroids, int(kcb.bits),
            vcb.boundaries, vcb.centroids, int(vcb.bits), bool(unbiased), kcodes, knorms, vcodes, vnorms, pos)


def window8_head_step(k4: np.ndarray, v4: np.ndarray, kmean: np.ndarray | None, plan: Any, sinks: int, seq_len: int,
                      t0: int, pos_counts: tuple[int, int, int], static: tuple) -> None:
    """One serial call for the whole store of a head-quantized cache with an int8 window:
    keys centered on ``kmean`` (when given), both sides stored into their windows by ``plan``
    (:func:`window8_store`), the tokens leaving the windows quantized by the whole-head
    quantizer into the compressed store at ``t0`` (:func:`~numba_kv.ops.headquant.quantize_head_into`),
    and the exact tokens' positions after the store written.

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
        :func:`window8_head_args` of the layer's buffers.
    """
    a, e_old, e_new, keep_old, keep_new = plan
    center = kmean is not None
    _window8_head_step_cpu(k4, v4, kmean if center else _NO_MEAN, center, a, e_old, e_new, keep_old, keep_new, sinks,
                           seq_len, t0, pos_counts[0], pos_counts[1], pos_counts[2], *static)
