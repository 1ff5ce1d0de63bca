"""Warp-level device helpers of the warp-per-partition CUDA decode attention.

The kernel (:func:`numba_kv.ops._attention_kernels` ``_decode_attention_warp_cuda``) gives
each warp one partition of one KV row.  A token is spread over ``L = head_dim / 8`` lanes,
each lane holding one group of eight coordinates (the unit of the code packing: ``bits``
bytes), so a warp works on ``32 / L`` tokens per step; scores are summed over the ``L``
lanes of a token by xor butterflies, and the query rows, running maxima, sums and
accumulators stay in registers.  No shared memory, no block barrier: nothing but the warp
synchronizes, and a warp streams its tokens with its K and V bytes loaded together.

Numba's CUDA simulator has no warp shuffles.  Under it (``NUMBA_ENABLE_CUDASIM=1``, read
once at import) :func:`lanes_reduce` exchanges through shared memory between two block
barriers instead and sums in the butterfly's order, which gives the same values as long
as every thread of the block calls it the same number of times (the kernel keeps its
loops block-uniform there).  Everything else -- decoding, masking, the online softmax --
is the same code in both builds.
"""

from __future__ import annotations

import math

from numba import cuda, float32, int64

from .. import _backend
from .._jit import cuda_device
from ._attention_cores import NEG_INF, exact_scale_dev, exact_value_dev

__all__ = ["LOOP_ANY", "LOOP_K2V2", "LOOP_K3V3", "LOOP_K4V3", "LOOP_K4V4", "SIMULATED", "VPL", "WARP_QS", "WARP_ROWS",
           "WARP_STATE", "WARP_VALUES", "XBUF", "compressed_loop", "exact_lane", "fold_token",
           "init_state", "lanes_reduce", "merge_slots", "reduce_scores", "row_limits", "softmax_rows", "uniform_widths",
           "warp_ok"]

#: the simulator build (shared-memory exchanges, block-uniform loops)
SIMULATED = _backend.simulator_enabled()
#: coordinates per lane: half a packing group (a group of eight indices is ``bits`` bytes);
#: four keep a lane's accumulators at 16 registers
VPL = 4
#: query rows a warp keeps in registers (8 values each per lane; more rows run as more
#: row chunks of the grid's z axis)
WARP_ROWS = 4
#: register values of a lane for all its rows (query or accumulator)
WARP_VALUES = WARP_ROWS * VPL
#: online-softmax state of a lane's rows: m, l and a scratch value per row
WARP_STATE = WARP_ROWS * 4
#: shared floats of a block's query rows: rotated and raw, head_dim <= 128
WARP_QS = 2 * WARP_ROWS * 128
_FULL = 0xFFFFFFFF


def warp_ok(d: int, threads: int) -> bool:
    """Whether the warp kernel handles head_dim ``d`` with ``threads`` per block: ``VPL``
    coordinates per lane, a power-of-two number of lanes per token, at most a warp (``d``
    in 32, 64, 128) and whole warps."""
    return d in (32, 64, 128) and threads % 32 == 0


#: per-thread float32 slots of the simulator's exchange buffer (the kernel declares
#: ``XBUF`` floats of shared memory: one in the GPU build, where it is never touched)
XBUF_SLOTS = 8
XBUF = 1 if not SIMULATED else 256 * XBUF_SLOTS


def _reduce_shfl(vals, o, n, h0, h1, is_max, xbuf, tid):
    for j in range(n):
        x = vals[o + j]
        h = h0
        while h < h1:
            y = cuda.shfl_xor_sync(_FULL, x, h)
            x = max(x, y) if is_max else x + y
            h *= 2
        vals[o + j] = x


def _reduce_shared(vals, o, n, h0, h1, is_max, xbuf, tid):
    # the same tree as the butterfly (pairs at lane distance h0, then 2·h0, ...; + and max
    # are commutative, so every lane of the group gets the butterfly's value bit for bit),
    # through shared memory between two barriers per call instead of per level
    cuda.syncthreads()
    for j in range(n):
        xbuf[tid * XBUF_SLOTS + j] = vals[o + j]
    cuda.syncthreads()
    if h0 >= h1:
        return
    base = tid - (tid & (h1 - h0))  # this lane with the reduced lane bits cleared
    n_m = h1 // h0
    tmp = cuda.local.array(32, dtype=float32)
    for j in range(n):
        for i in range(n_m):
            tmp[i] = xbuf[(base + i * h0) * XBUF_SLOTS + j]
        step = 1
        while step < n_m:
            for i in range(0, n_m, 2 * step):
                tmp[i] = max(tmp[i], tmp[i + step]) if is_max else tmp[i] + tmp[i + step]
            step *= 2
        vals[o + j] = tmp[0]


#: ``vals[o:o + n]``, each reduced (sum, or max with ``is_max``) over the lanes that differ
#: from this one in the lane bits ``h0 … h1/2`` (powers of two; xor butterfly on a GPU:
#: every lane of the group ends with the same value).  Every lane of the warp calls it;
#: in the simulator build every thread of the block (see the module docstring).
lanes_reduce = cuda_device(_reduce_shared if SIMULATED else _reduce_shfl)


@cuda_device
def decode_lane(crow, p, bits, cent, sa, dst):
    """``dst[k] = sa · cent[idx_k]``, ``k < 8``: one group of eight ``bits``-wide indices
    packed LSB first in ``crow[p:p + bits]`` -- the generic branch of
    :func:`numba_kv.ops._attention_cores._decode8` (the same values), one code path for
    every width: the kernel decodes a block of any width per lane (mixed widths) without
    the registers of four specialized decoders."""
    w = int64(0)
    for j in range(bits):
        w |= int64(crow[p + j]) << (8 * j)
    mask = (int64(1) << bits) - 1
    for k in range(8):
        dst[k] = cent[(w >> (bits * k)) & mask] * sa


def _make_compressed_loop(nbk: int, nbv: int):
    """The token loop of a compressed partition for K codes ``nbk`` and V codes ``nbv`` bits
    wide in every block (constant shifts and masks), or of any layout (``0``: each lane's
    block width ``kb``/``vb`` at run time; mixed widths, 1 bit).

    A token's packed bytes and scales are loaded first (K and V together), then each value
    is decoded as it is used: the score of every row as one K value at a time is formed, and
    the accumulators as one V value at a time is formed -- no decoded token is held in
    registers (same products and sums, in the same order, as the decoded-tile kernels)."""

    def loop(kcg, ksg, vcg, vsg, ko, vo, kb, vb, kct, vct, sb, table, t_lo, t_hi, span, slot, comp_pos0, qs, qo, d,
             lim, softmax_scale, st, acc, nl, half, xbuf, tid):
        kbits = nbk if nbk else kb
        vbits = nbv if nbv else vb
        ksh = half * VPL * kbits  # this lane's half of the group
        vsh = half * VPL * vbits
        kmask = (int64(1) << kbits) - 1
        vmask = (int64(1) << vbits) - 1
        for step in range(0, span, 32 // nl):
            t = t_lo + step + slot
            valid = t < t_hi
            kw = int64(0)
            vw = int64(0)
            ksa = float32(0.0)
            vsa = float32(0.0)
            if valid:  # K and V bytes of the token loaded together
                for j in range(kbits):
                    kw |= int64(kcg[t, ko + j]) << (8 * j)
                for j in range(vbits):
                    vw |= int64(vcg[t, vo + j]) << (8 * j)
                ksa = table[ksg[t, sb]]
                vsa = table[vsg[t, sb]]
            salt = t >> 62  # 0; keeps the query loads per token (see fold_token)
            for r in range(WARP_ROWS):
                st[4 * r + 2] = float32(0.0)
            for k in range(VPL):
                x = kct[(kw >> (ksh + kbits * k)) & kmask] * ksa
                for r in range(WARP_ROWS):
                    st[4 * r + 2] += qs[qo + salt + r * d + k] * x
            softmax_rows(valid, comp_pos0 + t, lim, softmax_scale, st, nl, xbuf, tid)
            for k in range(VPL):
                y = vct[(vw >> (vsh + vbits * k)) & vmask] * vsa
                for r in range(WARP_ROWS):
                    acc[r * VPL + k] = acc[r * VPL + k] * st[4 * r + 2] + st[4 * r + 3] * y

    loop.__name__ = loop.__qualname__ = f"compressed_loop_k{nbk}v{nbv}"
    return cuda_device(loop)


@cuda_device
def exact_lane(exact, exact_scales, exact_kind, g, t, sub, table, dst):
    """``dst[0:VPL]`` = coordinates ``VPL·sub …`` of exact token ``t`` of KV row ``g``, read
    in its stored dtype (:func:`numba_kv.ops._attention_cores._exact_value`)."""
    es = exact_scale_dev(exact_scales, g, t, exact_kind, table)
    for k in range(VPL):
        dst[k] = exact_value_dev(exact[g, t, sub * VPL + k], exact_kind, es, table)


@cuda_device
def init_state(st, acc, kx, vx):
    """Empty online-softmax state of every row: ``m = -inf``, ``l = 0``, ``acc = 0``; zero
    token values (a masked step reads finite stale values, never uninitialized ones)."""
    for k in range(VPL):
        kx[k] = float32(0.0)
        vx[k] = float32(0.0)
    for r in range(WARP_ROWS):
        st[4 * r] = NEG_INF
        st[4 * r + 1] = float32(0.0)
        for k in range(VPL):
            acc[r * VPL + k] = float32(0.0)


@cuda_device
def fold_token(kx, vx, valid, pos, qs, qo, salt, d, lim, softmax_scale, st, acc, nl, xbuf, tid):
    """Fold this lane group's token (its K and V values ``kx``/``vx``, position ``pos``; none
    unless ``valid``) into the online softmax of every row.  ``salt`` is 0, computed from
    the token index: the compiler then reads the query values from shared memory per token
    instead of hoisting all of them into registers (40 registers more, seen in ptxas)."""
    for r in range(WARP_ROWS):
        s = float32(0.0)
        for k in range(VPL):
            s += qs[qo + salt + r * d + k] * kx[k]
        st[4 * r + 2] = s
    softmax_rows(valid, pos, lim, softmax_scale, st, nl, xbuf, tid)
    for r in range(WARP_ROWS):
        for k in range(VPL):
            acc[r * VPL + k] = acc[r * VPL + k] * st[4 * r + 2] + st[4 * r + 3] * (vx[k] if valid else float32(0.0))


@cuda_device
def softmax_rows(valid, pos, lim, softmax_scale, st, nl, xbuf, tid):
    """Online-softmax step of one token for every row (Milakov & Gimelshein,
    arXiv:1805.02867): the partial scores ``st[4·r + 2]`` are summed over the token's ``nl``
    lanes, scaled, masked unless ``valid`` and ``pos <= lim[r]`` (:func:`row_limits`); the
    running ``m``/``l`` (``st[4·r]``, ``st[4·r + 1]``) move on and ``st[4·r + 2]``,
    ``st[4·r + 3]`` become the accumulator's rescale ``alpha = exp(m_old − m_new)`` and the
    token's weight ``p = exp(s − m_new)`` (exact zeros for a masked token or an empty state,
    never NaN)."""
    reduce_scores(st, nl, xbuf, tid)
    for r in range(WARP_ROWS):
        s = st[4 * r + 2] * softmax_scale
        if not (valid and pos <= lim[r]):
            s = NEG_INF
        m_old = st[4 * r]
        m_new = max(m_old, s)
        alpha = math.exp(m_old - m_new) if m_old != NEG_INF else float32(0.0)
        w = math.exp(s - m_new) if s != NEG_INF else float32(0.0)
        st[4 * r] = m_new
        st[4 * r + 1] = st[4 * r + 1] * alpha + w
        st[4 * r + 2] = alpha
        st[4 * r + 3] = w


@cuda_device
def row_limits(lim, rb, r0, q_pos0, q_len, causal):
    """``lim[r]``: the last position query row ``r0 + r`` sees (the causal rule of
    :func:`numba_kv.ops._attention_cores._visible`, its modulo hoisted out of the token
    loop); ``-1`` for a row past ``rb`` (sees nothing)."""
    for r in range(WARP_ROWS):
        if r >= rb:
            lim[r] = int64(-1)
        elif causal:
            lim[r] = int64(q_pos0) + (r0 + r) % q_len
        else:
            lim[r] = int64(0x7FFFFFFFFFFFFFFF)


@cuda_device
def reduce_scores(st, nl, xbuf, tid):
    """The rows' partial scores ``st[4·r + 2]`` summed over the token's ``nl`` lanes."""
    sc = cuda.local.array(WARP_ROWS, dtype=float32)
    for r in range(WARP_ROWS):
        sc[r] = st[4 * r + 2]
    lanes_reduce(sc, 0, WARP_ROWS, 1, nl, False, xbuf, tid)
    for r in range(WARP_ROWS):
        st[4 * r + 2] = sc[r]


@cuda_device
def merge_slots(st, acc, nl, xbuf, tid):
    """Merge the online-softmax states of the warp's token slots (lane bits ``nl … 16``):
    every lane ends with its partition's ``m``/``l`` in ``st[4·r]``/``st[4·r + 1]`` and its
    eight accumulator columns in ``acc``."""
    sc = cuda.local.array(WARP_ROWS, dtype=float32)
    for r in range(WARP_ROWS):
        sc[r] = st[4 * r]
    lanes_reduce(sc, 0, WARP_ROWS, nl, 32, True, xbuf, tid)
    for r in range(WARP_ROWS):
        f = math.exp(st[4 * r] - sc[r]) if st[4 * r] != NEG_INF else float32(0.0)
        st[4 * r] = sc[r]
        st[4 * r + 1] = st[4 * r + 1] * f
        for k in range(VPL):
            acc[r * VPL + k] = acc[r * VPL + k] * f
    for r in range(WARP_ROWS):
        sc[r] = st[4 * r + 1]
    lanes_reduce(sc, 0, WARP_ROWS, nl, 32, False, xbuf, tid)
    for r in range(WARP_ROWS):
        st[4 * r + 1] = sc[r]
        lanes_reduce(acc, r * VPL, VPL, nl, 32, False, xbuf, tid)


#: compressed-partition loops: K and V both 2, 3 or 4 bits in every block, K 4 / V 3 bits,
#: and any layout (mixed widths per block, 1 bit)
LOOP_K2V2 = _make_compressed_loop(2, 2)
LOOP_K3V3 = _make_compressed_loop(3, 3)
LOOP_K4V4 = _make_compressed_loop(4, 4)
LOOP_K4V3 = _make_compressed_loop(4, 3)
LOOP_ANY = _make_compressed_loop(0, 0)


@cuda_device
def compressed_loop(uniform, kb, vb, kcg, ksg, vcg, vsg, ko, vo, kct, vct, sb, table, t_lo, t_hi, span, slot,
                    comp_pos0, qs, qo, d, lim, softmax_scale, st, acc, nl, half, xbuf, tid):
    """The token loop of a compressed partition, specialized by width when every block of K
    has width ``kb`` and every block of V ``vb`` (``uniform``; the same branch for every
    lane of the block, so the warp's shuffles stay converged)."""
    if uniform and kb == 3 and vb == 3:
        LOOP_K3V3(kcg, ksg, vcg, vsg, ko, vo, kb, vb, kct, vct, sb, table, t_lo, t_hi, span, slot, comp_pos0, qs, qo,
                  d, lim, softmax_scale, st, acc, nl, half, xbuf, tid)
    elif uniform and kb == 4 and vb == 4:
        LOOP_K4V4(kcg, ksg, vcg, vsg, ko, vo, kb, vb, kct, vct, sb, table, t_lo, t_hi, span, slot, comp_pos0, qs, qo,
                  d, lim, softmax_scale, st, acc, nl, half, xbuf, tid)
    elif uniform and kb == 4 and vb == 3:
        LOOP_K4V3(kcg, ksg, vcg, vsg, ko, vo, kb, vb, kct, vct, sb, table, t_lo, t_hi, span, slot, comp_pos0, qs, qo,
                  d, lim, softmax_scale, st, acc, nl, half, xbuf, tid)
    elif uniform and kb == 2 and vb == 2:
        LOOP_K2V2(kcg, ksg, vcg, vsg, ko, vo, kb, vb, kct, vct, sb, table, t_lo, t_hi, span, slot, comp_pos0, qs, qo,
                  d, lim, softmax_scale, st, acc, nl, half, xbuf, tid)
    else:
        LOOP_ANY(kcg, ksg, vcg, vsg, ko, vo, kb, vb, kct, vct, sb, table, t_lo, t_hi, span, slot, comp_pos0, qs, qo,
                 d, lim, softmax_scale, st, acc, nl, half, xbuf, tid)


@cuda_device
def uniform_widths(kbits, vbits):
    """Whether every block of K has one width and every block of V one width."""
    ok = True
    for b in range(1, kbits.shape[0]):
        ok = ok and kbits[b] == kbits[0] and vbits[b] == vbits[0]
    return ok
