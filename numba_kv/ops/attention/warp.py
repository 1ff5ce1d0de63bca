"""Warp-level device helpers of the warp-per-partition CUDA decode attention.

The kernel (``_partition_warp_cuda`` in :mod:`numba_kv.ops.attention.kernels`, one source for
flat caches and paged pools) gives each warp one partition of one KV row and walks it in
tiles of 32 tokens, in two layouts (the split of FlashDecoding-style GPU decode kernels):

* **scores, one token per lane**: lane ``ℓ`` decodes the whole K vector of token ``t0 + ℓ``
  (the packed bytes of its own row; mixed widths cost nothing extra, every lane is at the
  same block) and forms the scores of all :data:`WARP_ROWS` query rows against the query
  rows staged in shared memory (every lane reads the same address: a broadcast).  The
  tile's softmax statistics are then two butterflies over the warp.  The lane also copies
  its token's packed V bytes and decoded V scales to the warp's shared staging area;
* **values, coordinates per lane**: lane ``ℓ`` owns coordinates ``4·(ℓ mod L) … + 3``
  (``L = head_dim / 4`` lanes per token) of token slot ``ℓ // L`` and accumulates
  ``p_u · v_u`` over the tile's tokens ``u ≡ slot (mod 32 / L)``, decoding its four V
  values from the staged bytes; the slots are summed at the end of the partition.

Per token, a lane does the work of one token, not a 1/32 share of every token's softmax,
and the accumulators are 16 registers.  Numba's CUDA simulator has no warp shuffles or
warp barrier: there (``NUMBA_ENABLE_CUDASIM=1``, read once at import) :func:`lanes_reduce`
exchanges through shared memory between block barriers and :func:`warp_sync` is a block
barrier, so the kernel keeps every such call block-uniform in that build.

The tile loops (:func:`_compressed_tiles`, :func:`_exact_tiles`) are compiled once per
addressing (:func:`warp_tiles`): a token's row is found by the addressing cores of
:mod:`numba_kv.ops.attention.cores`, a flat cache's row or a page table's slot.
"""

from __future__ import annotations

import math

from numba import cuda, float32, int32, int64

from ... import _backend
from ..._jit import cuda_device, specialize
from .cores import NEG_INF, addressing, exact_value_dev, scale_slot_dev
from .qrot import coop_rotate_rows, warp_stage_rotated

_FLAT = addressing(False)

__all__ = ["SIMULATED", "TILE", "VPL", "VROW", "VSC", "WARP_PW", "WARP_QS", "WARP_ROWS", "WARP_STATE", "WARP_VALUES",
           "WARP_VRAW", "WARP_VSC", "XBUF", "compressed_tiles", "exact_tiles", "init_state", "lanes_reduce",
           "merge_slots", "publish_weights",
           "pv_compressed", "pv_compressed_vq", "pv_exact", "row_limits", "scores_compressed",
           "scores_compressed_vq", "scores_exact", "stage_queries",
           "stage_values", "store_partition", "tile_softmax", "uniform_widths", "vq_group", "warp_geometry", "warp_ok",
           "warp_sync", "warp_tiles"]

#: the simulator build (shared-memory exchanges, block-uniform barriers)
SIMULATED = _backend.simulator_enabled()
#: tokens per warp tile (one per lane in the score layout)
TILE = 32
#: coordinates per lane in the value layout
VPL = 4
#: query rows a warp works on (more rows run as more row chunks of the grid's z axis)
WARP_ROWS = 4
#: log2 of :data:`WARP_ROWS` (a power of two: the staged rows are found by shifts)
_WARP_ROWS_SHIFT = WARP_ROWS.bit_length() - 1
#: a lane's accumulators (value layout) and online-softmax state (m, l, alpha, spare per row)
WARP_VALUES = WARP_ROWS * VPL
WARP_STATE = WARP_ROWS * 4
#: largest head_dim (32 lanes × 4 coordinates)
MAX_WARP_HEAD_DIM = 128
#: staged packed V bytes per token (head_dim 128 at 4 bits) and decoded scales per token
VROW = MAX_WARP_HEAD_DIM // 2
VSC = MAX_WARP_HEAD_DIM // 32
_MAX_WARPS = 8  # MAX_CUDA_THREADS / 32
#: static shared memory of a block: query rows (rotated and raw), per-warp staged V bytes,
#: V scales and the tile's weights
WARP_QS = 2 * WARP_ROWS * MAX_WARP_HEAD_DIM
WARP_VRAW = _MAX_WARPS * TILE * VROW
WARP_VSC = _MAX_WARPS * TILE * VSC
WARP_PW = _MAX_WARPS * WARP_ROWS * TILE
_FULL = 0xFFFFFFFF
#: per-thread float32 slots of the simulator's exchange buffer (one float in the GPU build,
#: where it is never touched)
XBUF_SLOTS = 8
XBUF = 1 if not SIMULATED else 256 * XBUF_SLOTS


def warp_ok(d: int, threads: int) -> bool:
    """Whether the warp kernel handles head_dim ``d`` with ``threads`` per block: a power of
    two up to 32 lanes of :data:`VPL` coordinates per token (``d`` in 32, 64, 128), whole
    warps."""
    return d in (32, 64, 128) and threads % 32 == 0


# --- warp primitives (shuffles on a GPU, shared memory in the simulator) -------------------
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
    # the butterfly's tree (pairs at lane distance h0, then 2·h0, ...; + and max are
    # commutative, so every lane gets the butterfly's value bit for bit) through shared
    # memory, two barriers per call
    cuda.syncthreads()
    for j in range(n):
        xbuf[tid * XBUF_SLOTS + j] = vals[o + j]
    cuda.syncthreads()
    if h0 >= h1:
        return
    base = tid - (tid & (h1 - h0))
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
#: from this one in lane bits ``h0 … h1/2`` (powers of two; an xor butterfly on a GPU, after
#: which every lane of the group holds the same value).  Every lane of the warp calls it.
lanes_reduce = cuda_device(_reduce_shared if SIMULATED else _reduce_shfl)


def _sync_warp():
    cuda.syncwarp(_FULL)


def _sync_block():
    cuda.syncthreads()


#: the warp's shared-memory writes become visible to its lanes (``__syncwarp``; a block
#: barrier in the simulator build)
warp_sync = cuda_device(_sync_block if SIMULATED else _sync_warp)


# --- kernel set-up --------------------------------------------------------------------------
@cuda_device
def warp_geometry(rows, n_parts):
    """``(g, tid, p, rb, r0, active)`` of this thread under the warp kernels' launch contract:
    KV row ``g`` (grid x), partition ``p`` (grid y · warps per block + warp), the ``rb`` query
    rows from ``r0`` of this row chunk (grid z), and whether the warp has work."""
    g = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    p = cuda.blockIdx.y * (cuda.blockDim.x >> 5) + (tid >> 5)
    rb = (rows + cuda.gridDim.z - 1) // cuda.gridDim.z
    r0 = cuda.blockIdx.z * rb
    rb = min(rb, rows - r0)
    return g, tid, p, rb, r0, p < n_parts and rb > 0


def _stage_queries(qs, qr, q, g, r0, rows, d, tid, rotate_q, both, head_rot, hsigns, msigns):
    """The block's query rows ``r0 …`` of KV row ``g`` into shared memory: rotated
    (``qs[0:WARP_ROWS·d]``, for compressed tokens) and raw (``qs[WARP_ROWS·d:]``, for
    float tokens); rows past ``rows`` repeat the last one (their scores are masked).  With
    ``rotate_q`` the rotated half is ``q`` rotated here (whole head with ``hsigns`` if
    ``head_rot``, else per 32-block with ``msigns``; ``qr`` is not read), and with ``both``
    the raw half too (exact tokens stored rotated).  Every thread of the block calls it;
    ends with a block barrier, the only one (on a GPU a warp rotates a row with shuffles,
    :func:`~numba_kv.ops.attention.qrot.warp_stage_rotated`)."""
    n_rot = (2 if both else 1) * WARP_ROWS if rotate_q else 0
    # slot u is (half, row, column) by shifts in 32-bit integers: d is 32, 64 or 128 here
    # (warp_ok), a power of two; Numba's int64 floor division and modulo by the run-time d cost
    # three calls of the 64-bit division routine a value (some 400 SASS instructions a slot
    # on sm_90, 4 slots a thread at 128 threads)
    dsh = int32(5)
    while (int32(1) << dsh) < d:
        dsh += int32(1)
    u = int32(n_rot * d + tid)
    end = int32(2 * WARP_ROWS * d)
    while u < end:
        half = int32(u >> int32(dsh + _WARP_ROWS_SHIFT))
        r = int32(u >> dsh) & int32(WARP_ROWS - 1)
        qs[u] = (q if half or rotate_q else qr)[g, min(r0 + r, rows - 1), u & int32(d - 1)]
        u = int32(u + int32(cuda.blockDim.x))
    if n_rot:
        warp_stage_rotated(qs, q, g, r0, rows, d, 0, n_rot, WARP_ROWS, head_rot, hsigns, msigns, tid)
    cuda.syncthreads()


def _stage_queries_sim(qs, qr, q, g, r0, rows, d, tid, rotate_q, both, head_rot, hsigns, msigns):
    # the simulator build (no warp shuffles): every row staged raw, then rotated by the whole
    # block in shared memory (the same values as the GPU build's shuffles)
    n_rot = (2 if both else 1) * WARP_ROWS if rotate_q else 0
    for u in range(tid, 2 * WARP_ROWS * d, cuda.blockDim.x):
        half = u // (WARP_ROWS * d)
        r = (u - half * WARP_ROWS * d) // d
        qs[u] = (q if half or rotate_q else qr)[g, min(r0 + r, rows - 1), u % d]
    cuda.syncthreads()
    if n_rot:
        coop_rotate_rows(qs, 0, n_rot, d, head_rot, hsigns, msigns, tid, cuda.blockDim.x)


#: see :func:`_stage_queries` (the simulator build: :func:`_stage_queries_sim`)
stage_queries = cuda_device(_stage_queries_sim if SIMULATED else _stage_queries)


# --- state --------------------------------------------------------------------------------
@cuda_device
def init_state(st, acc, sc):
    """Empty online-softmax state of every row: ``m = -inf``, ``l = 0``, ``acc = 0`` (and
    zero scores: a masked lane never reads an uninitialized value)."""
    for r in range(WARP_ROWS):
        sc[r] = float32(0.0)
        st[4 * r] = NEG_INF
        st[4 * r + 1] = float32(0.0)
        for k in range(VPL):
            acc[r * VPL + k] = float32(0.0)


@cuda_device
def row_limits(lim, rb, r0, q_pos0, q_len, causal):
    """``lim[r]``: the last position query row ``r0 + r`` sees (the causal rule of
    ``_visible`` in :mod:`numba_kv.ops.attention.cores`, its modulo out of the token loop);
    ``-1`` for a row past ``rb`` (sees nothing)."""
    for r in range(WARP_ROWS):
        if r >= rb:
            lim[r] = int64(-1)
        elif causal:
            lim[r] = int64(q_pos0) + (r0 + r) % q_len
        else:
            lim[r] = int64(0x7FFFFFFFFFFFFFFF)


# --- score layout: one token per lane -------------------------------------------------------
def _make_scores(nbits: int):
    """Scores of one compressed token against every row: ``sc[r] = Σ_j q_r[j] · k[j]`` in
    coordinate order, ``k`` decoded block by block (``nbits`` wide everywhere, or ``0``: each
    block's own width).  Constant widths give constant shifts and masks."""

    def scores(krow, ksrow, kbits, koff, kcent, sshift, table, qs, qo, d, sc):
        for r in range(WARP_ROWS):
            sc[r] = float32(0.0)
        for b in range(d // 32):
            bits = nbits if nbits else kbits[b]
            mask = (int64(1) << bits) - 1
            sa = table[scale_slot_dev(ksrow, ksrow[b >> sshift])]
            o = koff[b]
            for grp in range(4):
                w = int64(0)
                for j in range(bits):
                    w |= int64(krow[o + grp * bits + j]) << (8 * j)
                for k in range(8):
                    x = kcent[b, (w >> (bits * k)) & mask] * sa
                    jj = qo + b * 32 + grp * 8 + k
                    for r in range(WARP_ROWS):
                        sc[r] += qs[jj + r * d] * x

    scores.__name__ = scores.__qualname__ = f"scores_k{nbits}"
    return cuda_device(scores)


_SCORES_ANY, _SCORES_3, _SCORES_4 = (_make_scores(n) for n in (0, 3, 4))


def _make_scores_vq(m: int):
    """:func:`_make_scores` for K in the head VQ code of ``m`` coordinates per point
    (:meth:`~numba_kv.ops.attention.layout.CodeLayout.head_vq`): byte ``i`` of block ``b``
    (at ``koff[b]``) is the index of the point of coordinates ``32·b + m·i … + m − 1``, whose
    values are ``kcent[b, m·idx … m·idx + m − 1]`` (every row holds the whole codebook)."""

    def scores(krow, ksrow, kbits, koff, kcent, sshift, table, qs, qo, d, sc):
        for r in range(WARP_ROWS):
            sc[r] = float32(0.0)
        for b in range(d // 32):
            sa = table[scale_slot_dev(ksrow, ksrow[b >> sshift])]
            o = koff[b]
            for i in range(32 // m):
                p = int64(krow[o + i]) * m
                for c in range(m):
                    x = kcent[b, p + c] * sa
                    jj = qo + b * 32 + i * m + c
                    for r in range(WARP_ROWS):
                        sc[r] += qs[jj + r * d] * x

    scores.__name__ = scores.__qualname__ = f"scores_vq{m}"
    return cuda_device(scores)


_SCORES_VQ2, _SCORES_VQ4 = (_make_scores_vq(m) for m in (2, 4))


@cuda_device
def vq_group(cent):
    """The head VQ code's coordinates per point of a layout with centroid rows ``cent``
    (``[blocks, 256·m]``), or 0 for a scalar code (rows of ``2**bits <= 32`` values)."""
    return cent.shape[1] >> 8


@cuda_device
def scores_compressed_vq(uniform, krow, ksrow, kbits, koff, kcent, sshift, table, qs, qo, d, sc):
    """:func:`scores_compressed` of the warp kernel's build for head VQ layouts: K in the head
    VQ code (:func:`_make_scores_vq`), or a scalar code (a cache with VQ values only)."""
    m = vq_group(kcent)
    if m == 2:
        _SCORES_VQ2(krow, ksrow, kbits, koff, kcent, sshift, table, qs, qo, d, sc)
    elif m == 4:
        _SCORES_VQ4(krow, ksrow, kbits, koff, kcent, sshift, table, qs, qo, d, sc)
    else:
        scores_compressed(uniform, krow, ksrow, kbits, koff, kcent, sshift, table, qs, qo, d, sc)


@cuda_device
def scores_compressed(uniform, krow, ksrow, kbits, koff, kcent, sshift, table, qs, qo, d, sc):
    """:func:`_make_scores` with constant widths for uniform 3- and 4-bit K codes (the same
    branch on every lane: all lanes read the same layout)."""
    if uniform and kbits[0] == 3:
        _SCORES_3(krow, ksrow, kbits, koff, kcent, sshift, table, qs, qo, d, sc)
    elif uniform and kbits[0] == 4:
        _SCORES_4(krow, ksrow, kbits, koff, kcent, sshift, table, qs, qo, d, sc)
    else:
        _SCORES_ANY(krow, ksrow, kbits, koff, kcent, sshift, table, qs, qo, d, sc)


@cuda_device
def uniform_widths(kbits):
    """Whether every block of K has the same width."""
    ok = True
    for b in range(1, kbits.shape[0]):
        ok = ok and kbits[b] == kbits[0]
    return ok


@cuda_device
def scores_exact(erow, es, exact_kind, table, qs, qo, d, sc):
    """Scores of the exact token ``erow`` (read in its stored dtype; ``es``: its scale)
    against every row."""
    for r in range(WARP_ROWS):
        sc[r] = float32(0.0)
    for j in range(d):
        x = exact_value_dev(erow[j], exact_kind, es, table)
        for r in range(WARP_ROWS):
            sc[r] += qs[qo + j + r * d] * x


@cuda_device
def stage_values(vrow, vsrow, nbytes, nb, sshift, table, vraw, vo, vsc, so):
    """Copy this lane's token's packed V bytes (``nbytes``) to ``vraw[vo:]`` and its ``nb``
    block scales, decoded, to ``vsc[so:]`` (one per 32-coordinate block)."""
    for j in range(nbytes):
        vraw[vo + j] = vrow[j]
    for b in range(nb):
        vsc[so + b] = table[scale_slot_dev(vsrow, vsrow[b >> sshift])]


@cuda_device
def tile_softmax(sc, valid, pos, lim, softmax_scale, st, tmp, xbuf, tid):
    """Online-softmax step of a tile (Milakov & Gimelshein, arXiv:1805.02867): this lane's
    logits ``sc[r]`` (scaled; ``-inf`` unless ``valid`` and ``pos <= lim[r]``) against the
    warp's tile max; ``st[4·r]``/``st[4·r + 1]`` (``m``, ``l``, the same on every lane) move
    on, ``st[4·r + 2]`` becomes the accumulators' rescale ``alpha = exp(m_old − m_new)`` and
    ``sc[r]`` this lane's weight ``p = exp(s − m_new)`` (exact zeros for a masked token or
    an empty state, never NaN)."""
    for r in range(WARP_ROWS):
        s = sc[r] * softmax_scale
        sc[r] = s if valid and pos <= lim[r] else NEG_INF
        tmp[r] = sc[r]
    lanes_reduce(tmp, 0, WARP_ROWS, 1, 32, True, xbuf, tid)
    for r in range(WARP_ROWS):
        m_old = st[4 * r]
        m_new = max(m_old, tmp[r])
        st[4 * r] = m_new
        st[4 * r + 2] = math.exp(m_old - m_new) if m_old != NEG_INF else float32(0.0)
        sc[r] = math.exp(sc[r] - m_new) if sc[r] != NEG_INF else float32(0.0)
        tmp[r] = sc[r]
    lanes_reduce(tmp, 0, WARP_ROWS, 1, 32, False, xbuf, tid)
    for r in range(WARP_ROWS):
        st[4 * r + 1] = st[4 * r + 1] * st[4 * r + 2] + tmp[r]


@cuda_device
def publish_weights(sc, valid, pos, lim, softmax_scale, st, tmp, pw, pbase, xbuf, tid):
    """:func:`tile_softmax`, then this lane's weights to the warp's ``pw[pbase + r·TILE +
    lane]`` for the value layout (visible to the warp when it returns)."""
    tile_softmax(sc, valid, pos, lim, softmax_scale, st, tmp, xbuf, tid)
    for r in range(WARP_ROWS):
        pw[pbase + r * TILE + (tid & 31)] = sc[r]
    warp_sync()


# --- value layout: coordinates per lane ---------------------------------------------------
def _make_pv_vq(m: int):
    """The ``Σ_u p_u,r · v_u`` part of :func:`pv_compressed` for V in the head VQ code of
    ``m`` (2 or 4) coordinates per point: this lane's coordinates ``4·sub … 4·sub + 3`` are
    the ``4 / m`` whole points at staged bytes ``voff[b] + (4 / m)·(sub mod 8) + i``."""

    def pv(n_tok, slot, tpw, sub, voff, vcent, vraw, vbase, vsc, sbase, pw, pbase, acc):
        b = sub >> 3
        o = voff[b] + (4 // m) * (sub & 7)
        for u in range(slot, n_tok, tpw):
            sa = vsc[sbase + u * VSC + b]
            for i in range(VPL // m):
                p = int64(vraw[vbase + u * VROW + o + i]) * m
                for c in range(m):
                    y = vcent[b, p + c] * sa
                    for r in range(WARP_ROWS):
                        acc[r * VPL + i * m + c] += pw[pbase + r * TILE + u] * y

    pv.__name__ = pv.__qualname__ = f"pv_vq{m}"
    return cuda_device(pv)


_PV_VQ2, _PV_VQ4 = (_make_pv_vq(m) for m in (2, 4))


@cuda_device
def pv_compressed(n_tok, slot, tpw, sub, vbits, voff, vcent, vraw, vbase, vsc, sbase, pw, pbase, st, acc):
    """``acc[r] = alpha_r·acc[r] + Σ_u p_u,r · v_u`` over the tile's staged tokens ``u =
    slot, slot + tpw, … < n_tok`` for this lane's coordinates ``4·sub … 4·sub + 3`` (half of
    packing group ``(sub >> 1) & 3`` of block ``sub >> 3``)."""
    b = sub >> 3
    bits = vbits[b]
    mask = (int64(1) << bits) - 1
    o = voff[b] + ((sub >> 1) & 3) * bits
    sh = (sub & 1) * VPL * bits
    for r in range(WARP_ROWS):
        for k in range(VPL):
            acc[r * VPL + k] = acc[r * VPL + k] * st[4 * r + 2]
    for u in range(slot, n_tok, tpw):
        w = int64(0)
        for j in range(bits):
            w |= int64(vraw[vbase + u * VROW + o + j]) << (8 * j)
        sa = vsc[sbase + u * VSC + b]
        for k in range(VPL):
            y = vcent[b, (w >> (sh + bits * k)) & mask] * sa
            for r in range(WARP_ROWS):
                acc[r * VPL + k] += pw[pbase + r * TILE + u] * y


@cuda_device
def pv_compressed_vq(n_tok, slot, tpw, sub, vbits, voff, vcent, vraw, vbase, vsc, sbase, pw, pbase, st, acc):
    """:func:`pv_compressed` of the warp kernel's build for head VQ layouts: V in the head VQ
    code (:func:`_make_pv_vq`), or a scalar code (a cache with VQ keys only)."""
    m = vq_group(vcent)
    if m != 2 and m != 4:
        pv_compressed(n_tok, slot, tpw, sub, vbits, voff, vcent, vraw, vbase, vsc, sbase, pw, pbase, st, acc)
        return
    for r in range(WARP_ROWS):
        for k in range(VPL):
            acc[r * VPL + k] = acc[r * VPL + k] * st[4 * r + 2]
    if m == 2:
        _PV_VQ2(n_tok, slot, tpw, sub, voff, vcent, vraw, vbase, vsc, sbase, pw, pbase, acc)
    else:
        _PV_VQ4(n_tok, slot, tpw, sub, voff, vcent, vraw, vbase, vsc, sbase, pw, pbase, acc)


def _pv_exact(n_tok, slot, tpw, sub, ve, ves, exact_kind, addr, t0, table, pw, pbase, st, acc):
    """:func:`pv_compressed` for exact tokens ``t0 + u``, read from ``ve`` in their stored
    dtype where the addressing says (``addr``: see :func:`_compressed_tiles`)."""
    kv_indices, first, page_size, g, h = addr
    for r in range(WARP_ROWS):
        for k in range(VPL):
            acc[r * VPL + k] = acc[r * VPL + k] * st[4 * r + 2]
    for u in range(slot, n_tok, tpw):
        page, ps, _ = token_slot_dev(kv_indices, first, page_size, g, t0 + u)
        es = exact_scale_at_dev(ves, page, h, ps, exact_kind, table)
        vrow = plane_dev(ve, page, h)[ps]
        for k in range(VPL):
            y = exact_value_dev(vrow[sub * VPL + k], exact_kind, es, table)
            for r in range(WARP_ROWS):
                acc[r * VPL + k] += pw[pbase + r * TILE + u] * y


@cuda_device
def merge_slots(acc, nl, xbuf, tid):
    """Sum the accumulators of the warp's token slots (lane bits ``nl … 16``): the slots
    share ``m`` and ``l``, so their sums add up."""
    for r in range(WARP_ROWS):
        lanes_reduce(acc, r * VPL, VPL, nl, 32, False, xbuf, tid)


# --- the tile loops: one source for flat caches and paged pools -----------------------------
# ``addr = (kv_indices, first, page_size, g, h)`` says where KV row ``g``'s tokens are (a tuple:
# at most 30 arguments per call, CPython passes more as ``*args``, which Numba cannot inline);
# ``token_slot_dev``/``plane_dev`` are bound per addressing (:func:`warp_tiles`,
# :func:`~numba_kv.ops.attention.cores.addressing`); at module level the flat ones.
PAGED = _FLAT["PAGED"]
token_slot_dev, plane_dev, exact_scale_at_dev = (_FLAT[k] for k in ("token_slot_dev", "plane_dev",
                                                                  "exact_scale_at_dev"))


def _compressed_tiles(kc, ks, vc, vs, addr, kbits, koff, vbits, voff, kcent, vcent, sshift, table, t_lo, t_hi, span,
                      pos0, qs, lim, softmax_scale, st, acc, sc, tmp, vraw, vsc, pw, xbuf, tid):
    """The tiles of a compressed partition ``[t_lo, t_hi)`` of one KV row (token ``t`` at
    position ``pos0 + t``; head_dim ``32 · len(kbits)``): scores (token per lane), the tile
    softmax, the staged V bytes, then ``p·v`` (coordinates per lane)."""
    kv_indices, first, page_size, g, h = addr
    d = kbits.shape[0] * 32
    k_uniform = uniform_widths(kbits)
    nl = d // VPL
    lane = tid & 31
    slot = lane // nl
    sub = lane - slot * nl
    wid = tid >> 5
    vbase, sbase, pbase = wid * TILE * VROW, wid * TILE * VSC, wid * WARP_ROWS * TILE
    for t0 in range(t_lo, t_lo + span, TILE):
        t = t0 + lane
        valid = t < t_hi
        if valid:
            page, ps, _ = token_slot_dev(kv_indices, first, page_size, g, t)
            vrow = plane_dev(vc, page, h)[ps]
            scores_compressed(k_uniform, plane_dev(kc, page, h)[ps], plane_dev(ks, page, h)[ps], kbits, koff, kcent,
                              sshift, table, qs, 0, d, sc)
            stage_values(vrow, plane_dev(vs, page, h)[ps], vrow.shape[0], d // 32, sshift, table, vraw,
                         vbase + lane * VROW, vsc, sbase + lane * VSC)
        publish_weights(sc, valid, pos0 + t, lim, softmax_scale, st, tmp, pw, pbase, xbuf, tid)
        pv_compressed(min(TILE, t_hi - t0), slot, 32 // nl, sub, vbits, voff, vcent, vraw, vbase, vsc, sbase, pw,
                      pbase, st, acc)
        warp_sync()  # before the next tile overwrites the staging area


def _exact_tiles(ke, ve, kes, ves, exact_kind, exact_pos, addr, table, t_lo, t_hi, span, qs, qo, d, lim,
                 softmax_scale, st, acc, sc, tmp, pw, xbuf, tid):
    """:func:`_compressed_tiles` for the exact tokens (a flat cache's sinks and window at
    ``exact_pos[t]``, a float32 pool's tokens at ``t``) in their stored dtype, against the
    raw query rows at ``qs[qo:]``; the same barriers per tile."""
    kv_indices, first, page_size, g, h = addr
    nl = d // VPL
    lane = tid & 31
    slot = lane // nl
    sub = lane - slot * nl
    pbase = (tid >> 5) * WARP_ROWS * TILE
    for t0 in range(t_lo, t_lo + span, TILE):
        t = t0 + lane
        valid = t < t_hi
        pos = int64(0)
        if valid:
            page, ps, _ = token_slot_dev(kv_indices, first, page_size, g, t)
            es = exact_scale_at_dev(kes, page, h, ps, exact_kind, table)
            scores_exact(plane_dev(ke, page, h)[ps], es, exact_kind, table, qs, qo, d, sc)
            pos = int64(t) if PAGED else int64(exact_pos[t])
        publish_weights(sc, valid, pos, lim, softmax_scale, st, tmp, pw, pbase, xbuf, tid)
        pv_exact(min(TILE, t_hi - t0), slot, 32 // nl, sub, ve, ves, exact_kind, addr, t0, table, pw, pbase, st, acc)
        warp_sync()


def warp_tiles(paged: bool, vq: bool = False) -> dict:
    """``{"compressed_tiles": …, "exact_tiles": …}``: the tile loops compiled for the flat or
    the paged addressing (the names the warp kernel's source calls); ``vq``: the build whose
    compressed tiles also decode the head VQ code (:func:`scores_compressed_vq`,
    :func:`pv_compressed_vq`: a kernel of its own, so the scalar build's hot loop keeps its
    size and registers)."""
    return _TILES[bool(paged), bool(vq)]


def _tiles(paged, vq):
    names = addressing(paged)
    suffix = ("_paged" if paged else "_flat") + ("_vq" if vq else "")
    pv = cuda_device(specialize(_pv_exact, suffix, **names))
    codes = {"scores_compressed": scores_compressed_vq, "pv_compressed": pv_compressed_vq} if vq else {}
    return {"compressed_tiles": cuda_device(specialize(_compressed_tiles, suffix, **names, **codes)),
            "exact_tiles": cuda_device(specialize(_exact_tiles, suffix, pv_exact=pv, **names)), "pv_exact": pv}


_TILES = {(paged, vq): _tiles(paged, vq) for paged in (False, True) for vq in (False, True)}
compressed_tiles, exact_tiles, pv_exact = (_TILES[False, False][k] for k in ("compressed_tiles", "exact_tiles",
                                                                             "pv_exact"))


@cuda_device
def store_partition(st, acc, active, rb, g, p, r0, d, part_m, part_l, part_acc, xbuf, tid):
    """Sum the token slots' accumulators (:func:`merge_slots`), then lane group 0 writes
    partition ``p``'s ``(m, l, acc)`` of rows ``r0 … r0 + rb − 1`` of KV row ``g``."""
    nl = d // VPL
    merge_slots(acc, nl, xbuf, tid)
    lane = tid & 31
    sub = lane % nl
    if active and lane < nl:
        for r in range(WARP_ROWS):
            if r < rb:
                for k in range(VPL):
                    part_acc[g, p, r0 + r, sub * VPL + k] = acc[r * VPL + k]
                if sub == 0:
                    part_m[g, p, r0 + r] = st[4 * r]
                    part_l[g, p, r0 + r] = st[4 * r + 1]
