"""Decode attention computed straight from packed codes (no dequantized K/V in memory).

Math.  With the forward block rotation ``F = D_s H`` and a
stored token ``k̂_b = |a_b| Fᵀ c[idx_b]`` per 32-block ``b``:

* ``⟨q_b, k̂_b⟩ = |a_b| ⟨F q_b, c[idx_b]⟩`` — rotate each query block **once** and score
  tokens against codebook values, never inverse-rotating a key;
* ``Σ_t p_t v̂_{t,b} = Fᵀ Σ_t p_t |a^v_{t,b}| c[idx^v_{t,b}]`` — accumulate weighted
  centroids in the rotated domain and inverse-rotate once per block at the end.

Work decomposition (flash-decoding): for every KV row ``g`` (= batch × KV head) the
tokens are cut into partitions; each work item runs an online softmax for all
``G·q_len`` query rows of that KV head over one partition (GQA: a token's codes are
unpacked once and reused by the whole group) and writes ``(m, l, acc)``.  A merge step
combines partitions by log-sum-exp, inverse-rotates the compressed part, adds the exact
part (full-precision window/sink tokens, accumulated unrotated) and normalizes.

Every token carries an absolute position: compressed tokens are ``comp_pos0 + t``, exact
tokens read theirs from ``exact_pos``.  Query row ``r`` sits at position
``q_pos0 + r % q_len``; with ``causal`` it sees tokens at positions ``<=`` its own.
``logit_bias[g, r, pos]`` is added to the scaled logit (``softmax_scale · q·k``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from llvmlite import ir
from numba import cuda, float32, int32, int64, prange, types
from numba.core.extending import intrinsic

from .. import _backend
from .._jit import FASTMATH_REDUCE, cpu_call, cpu_kernel, cpu_serial, cuda_kernel, twin
from ._registry import register
from .hadamard import SIGNS32, _rotate32_inverse, rotate32
from .headquant import _rotate_head_inverse

TILE = 128  # tokens per partition granule (partition sizes are multiples of it)
#: tokens per CPU tile: a decoded 32-token × d=128 float tile is 16 KiB, stays in L1 while
#: the score and P·V loops sweep it
CPU_TILE = 32
MAX_HEAD_DIM = 512  # CUDA per-thread accumulator size
NEG_INF = np.float32(-np.inf)
#: |binary16| -> float32 for every bit pattern (exact; 256 KiB, stays in L2): scale decoding
F16_ABS_TABLE = np.abs(np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32))
F16_ABS_TABLE[~np.isfinite(F16_ABS_TABLE)] = 0.0
F16_ABS_TABLE.flags.writeable = False


# --- single-source cores -------------------------------------------------------------
# --- CPU-only vector decoding ---------------------------------------------------------------
_F32 = ir.FloatType()
_I32 = ir.IntType(32)
_V8F = ir.VectorType(_F32, 8)
_V8I = ir.VectorType(_I32, 8)


def _splat(builder, value, vty):
    v = builder.insert_element(ir.Constant(vty, ir.Undefined), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vty, ir.Undefined), ir.Constant(_V8I, [0] * 8))


def _decode8_codegen(nbits):
    def codegen(context, builder, signature, args):
        w, cent, sa, dst, off = args
        centarr = context.make_array(signature.args[1])(context, builder, cent)
        dstarr = context.make_array(signature.args[3])(context, builder, dst)
        cptr = builder.bitcast(centarr.data, _V8F.as_pointer())
        clo = builder.load(cptr, align=4, typ=_V8F)
        chi = None
        if nbits == 4:
            chi = builder.load(builder.gep(cptr, [ir.Constant(_I32, 1)], source_etype=_V8F), align=4, typ=_V8F)
        idx = builder.lshr(_splat(builder, builder.trunc(w, _I32), _V8I),
                           ir.Constant(_V8I, [nbits * k for k in range(8)]))
        idx = builder.and_(idx, ir.Constant(_V8I, [7] * 8))
        vec = ir.Constant(_V8F, ir.Undefined)
        for k in range(8):
            i = builder.extract_element(idx, ir.Constant(_I32, k))
            e = builder.extract_element(clo, i)
            vec = builder.insert_element(vec, e, ir.Constant(_I32, k))
        if nbits == 4:
            # 16 centroids: look up both halves with the low 3 bits, pick by bit 3
            hib = builder.lshr(_splat(builder, builder.trunc(w, _I32), _V8I),
                               ir.Constant(_V8I, [4 * k + 3 for k in range(8)]))
            hib = builder.icmp_unsigned("!=", builder.and_(hib, ir.Constant(_V8I, [1] * 8)),
                                        ir.Constant(_V8I, [0] * 8))
            vhi = ir.Constant(_V8F, ir.Undefined)
            for k in range(8):
                i = builder.extract_element(idx, ir.Constant(_I32, k))
                vhi = builder.insert_element(vhi, builder.extract_element(chi, i), ir.Constant(_I32, k))
            vec = builder.select(hib, vhi, vec)
        vec = builder.fmul(vec, _splat(builder, sa, _V8F))
        dptr = builder.gep(dstarr.data, [off], source_etype=_F32)
        builder.store(vec, builder.bitcast(dptr, _V8F.as_pointer()), align=4)
        return context.get_dummy_value()
    return codegen


def _decode8_typer(nbits):
    def typer(typingctx, w, cent, sa, dst, off):
        ok = (isinstance(w, types.Integer) and isinstance(off, types.Integer) and sa == types.float32
              and all(isinstance(a, types.Array) and a.dtype == types.float32 and a.ndim == 1 and a.layout == "C"
                      for a in (cent, dst)))
        if not ok:
            return None
        return types.void(types.int64, cent, types.float32, dst, types.int64), _decode8_codegen(nbits)
    return typer


# ``dst[off:off+8] = sa · cent[(w >> (b·k)) & (2**b − 1)]``, k = 0..7, in one 8-lane vector: the
# lookup is a build-vector of variable extracts, which x86 code generation lowers to a
# variable permute (``vpermps``: the <= 16-entry codebook lives in one or two registers) —
# no gather, no per-code table load.  ``cent`` needs 8 (3 bits) or 16 (4 bits) readable
# floats; C-contiguous float32 arrays only (typing fails otherwise).
_decode8_3bit = intrinsic(_decode8_typer(3))
_decode8_4bit = intrinsic(_decode8_typer(4))


def _decode_tile_simd(codes, scales, t0, nt, cent, bits, nb, sshift, scale_table, dst, d0):
    """``dst[d0 + tt] = `` token ``t0 + tt`` of ``codes``/``scales`` (``[tokens, ·]``), ``tt < nt``,
    decoded like :func:`_load_token_fast` (same values; CPU only): 3- and 4-bit codes eight
    at a time by :func:`_decode8_3bit`/:func:`_decode8_4bit` (``cent`` C-contiguous float32
    with ``2**bits`` or more entries), other widths by the scalar loader.  One call per tile
    keeps the per-token call overhead out of the hot loop."""
    if bits == 3:
        for tt in range(nt):
            crow = codes[t0 + tt]
            srow = scales[t0 + tt]
            drow = dst[d0 + tt]
            for b in range(nb):
                sa = scale_table[srow[b >> sshift]]
                p = b * 12
                for g in range(4):
                    w = int64(crow[p]) | (int64(crow[p + 1]) << 8) | (int64(crow[p + 2]) << 16)
                    _decode8_3bit(w, cent, sa, drow, b * 32 + g * 8)
                    p += 3
    elif bits == 4:
        for tt in range(nt):
            crow = codes[t0 + tt]
            srow = scales[t0 + tt]
            drow = dst[d0 + tt]
            for b in range(nb):
                sa = scale_table[srow[b >> sshift]]
                p = b * 16
                for g in range(4):
                    w = (int64(crow[p]) | (int64(crow[p + 1]) << 8) | (int64(crow[p + 2]) << 16)
                         | (int64(crow[p + 3]) << 24))
                    _decode8_4bit(w, cent, sa, drow, b * 32 + g * 8)
                    p += 4
    else:
        for tt in range(nt):
            load_token_fast_cpu(codes[t0 + tt], scales[t0 + tt], cent, bits, nb, sshift, scale_table, dst[d0 + tt])


def _load_token_fast(crow, srow, cent, bits, nb, sshift, scale_table, dst):
    """``dst[0:32·nb] = |a| · c[idx_j]`` for one token whose blocks all have width ``bits``
    and codebook ``cent``; byte-wise unpacking for 2/3/4 bits, scales (one per
    ``2**sshift`` blocks: a shift, a 64-bit division per block costs ~25 % of the kernel)
    decoded through the exact binary16 table ``scale_table``."""
    for b in range(nb):
        sa = scale_table[srow[b >> sshift]]
        o = b * 32
        if bits == 3:
            p = b * 12
            for g in range(4):
                w = int64(crow[p]) | (int64(crow[p + 1]) << 8) | (int64(crow[p + 2]) << 16)
                for k in range(8):
                    dst[o + g * 8 + k] = cent[(w >> (3 * k)) & 7] * sa
                p += 3
        elif bits == 4:
            p = b * 16
            for i in range(16):
                byte = int64(crow[p + i])
                dst[o + 2 * i] = cent[byte & 15] * sa
                dst[o + 2 * i + 1] = cent[byte >> 4] * sa
        elif bits == 2:
            p = b * 8
            for i in range(8):
                byte = int64(crow[p + i])
                dst[o + 4 * i] = cent[byte & 3] * sa
                dst[o + 4 * i + 1] = cent[(byte >> 2) & 3] * sa
                dst[o + 4 * i + 2] = cent[(byte >> 4) & 3] * sa
                dst[o + 4 * i + 3] = cent[byte >> 6] * sa
        else:  # any other width: generic group-of-8 unpacking, bit by bit
            for g in range(4):
                w = int64(0)
                for j in range(bits):
                    w |= int64(crow[b * 4 * bits + g * bits + j]) << (8 * j)
                mask = (int64(1) << bits) - 1
                for k in range(8):
                    dst[o + g * 8 + k] = cent[(w >> (bits * k)) & mask] * sa


def _load_token(crow, srow, cent2, bits_b, off_b, sshift, nb, scale_table, dst):
    """``dst[0:32·nb] = |a| · c_b[idx_j]`` for one token of a :class:`CodeLayout`: block
    ``b`` has its own width ``bits_b[b]``, byte offset ``off_b[b]`` and codebook row
    ``cent2[b]``; ``2**sshift`` consecutive blocks share one stored scale (0 = one scale
    per 32-block, ``log2(nb)`` = one per vector)."""
    for b in range(nb):
        sa = scale_table[srow[b >> sshift]]
        o = b * 32
        bits = bits_b[b]
        p = off_b[b]
        if bits == 3:
            for g in range(4):
                w = int64(crow[p]) | (int64(crow[p + 1]) << 8) | (int64(crow[p + 2]) << 16)
                for k in range(8):
                    dst[o + g * 8 + k] = cent2[b, (w >> (3 * k)) & 7] * sa
                p += 3
        elif bits == 4:
            for i in range(16):
                byte = int64(crow[p + i])
                dst[o + 2 * i] = cent2[b, byte & 15] * sa
                dst[o + 2 * i + 1] = cent2[b, byte >> 4] * sa
        elif bits == 2:
            for i in range(8):
                byte = int64(crow[p + i])
                dst[o + 4 * i] = cent2[b, byte & 3] * sa
                dst[o + 4 * i + 1] = cent2[b, (byte >> 2) & 3] * sa
                dst[o + 4 * i + 2] = cent2[b, (byte >> 4) & 3] * sa
                dst[o + 4 * i + 3] = cent2[b, byte >> 6] * sa
        else:
            mask = (int64(1) << bits) - 1
            for g in range(4):
                w = int64(0)
                for j in range(bits):
                    w |= int64(crow[p + g * bits + j]) << (8 * j)
                for k in range(8):
                    dst[o + g * 8 + k] = cent2[b, (w >> (bits * k)) & mask] * sa


def _online_update(s, m, lsum, acc, vrow, d):
    """One token of an online softmax (CUDA kernels, one query row per thread): fold the
    scaled logit ``s`` and value row ``vrow`` into the running max ``m``, sum ``lsum`` and
    accumulator ``acc``; returns the new ``(m, lsum)``."""
    m_new = max(m, s)
    alpha = math.exp(m - m_new) if m != NEG_INF else float32(0.0)
    w = math.exp(s - m_new)
    for j in range(d):
        acc[j] = acc[j] * alpha + w * vrow[j]
    return m_new, lsum * alpha + w


def _is_uniform(bits_b):
    """True when every block has the same width."""
    for b in range(1, bits_b.shape[0]):
        if bits_b[b] != bits_b[0]:
            return False
    return True


def _qjl_dot(sqrow, sigrow, m):
    """``Σ_j sqrow[j] · σ_j`` with the packed signs ``σ`` (bit set = +1, LSB first)."""
    s = float32(0.0)
    for j in range(m):
        if (sigrow[j >> 3] >> (j & 7)) & 1:
            s += sqrow[j]
        else:
            s -= sqrow[j]
    return s


def _visible(pos, q_pos0, r, q_len, causal):
    return (not causal) or pos <= q_pos0 + (r % q_len)


def _merge_row(part_m, part_l, part_acc, g, r, n_comp_parts, n_parts, signs, head_rot, hsigns, buf, out):
    """Combine the partitions of query row ``(g, r)`` into ``out[g, r]``.

    The compressed partitions accumulated in the rotated domain: their sum is
    inverse-rotated per 32-block (``head_rot`` false) or over the whole head with the
    signs ``hsigns`` (``head_rot`` true).  ``buf`` holds at least ``d`` floats.
    """
    d = out.shape[2]
    m_star = NEG_INF
    for p in range(n_parts):
        m_star = max(m_star, part_m[g, p, r])
    denom = float32(0.0)
    for j in range(d):
        out[g, r, j] = float32(0.0)
    if m_star == NEG_INF:  # no visible token (cannot happen with causal decode)
        return
    # compressed partitions: rescale and sum in the rotated domain, then inverse-rotate
    if n_comp_parts > 0:
        for j in range(d):
            buf[j] = float32(0.0)
        for p in range(n_comp_parts):
            w = part_m[g, p, r]
            if w != NEG_INF:
                f = math.exp(w - m_star)
                for j in range(d):
                    buf[j] += f * part_acc[g, p, r, j]
        if head_rot:
            _rotate_head_inverse(buf, d, hsigns)
        else:
            for b in range(d // 32):
                _rotate32_inverse(buf[b * 32:b * 32 + 32], signs)
        for j in range(d):
            out[g, r, j] = buf[j]
    # exact partitions: already in the original domain
    for p in range(n_comp_parts, n_parts):
        w = part_m[g, p, r]
        if w != NEG_INF:
            f = math.exp(w - m_star)
            for j in range(d):
                out[g, r, j] += f * part_acc[g, p, r, j]
    for p in range(n_parts):
        w = part_m[g, p, r]
        if w != NEG_INF:
            denom += math.exp(w - m_star) * part_l[g, p, r]
    inv = float32(1.0) / denom
    for j in range(d):
        out[g, r, j] = out[g, r, j] * inv


load_token_fast_cpu, load_token_fast_dev = twin(_load_token_fast)
decode_tile_simd_cpu = cpu_serial(_decode_tile_simd)
load_token_cpu, load_token_dev = twin(_load_token)
qjl_dot_cpu, qjl_dot_dev = twin(_qjl_dot)
is_uniform_cpu, is_uniform_dev = twin(_is_uniform)
online_update_cpu, online_update_dev = twin(_online_update)
visible_cpu, visible_dev = twin(_visible)
merge_row_cpu, merge_row_dev = twin(_merge_row)


@intrinsic
def _f32_from_bits(typingctx, i):
    """Reinterpret the bits of an ``int32`` as a ``float32`` (an LLVM ``bitcast``: one
    register move, vectorizable; there is no scalar bit-cast in Numba otherwise)."""
    if not isinstance(i, types.Integer) or i.bitwidth != 32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(i), codegen


# Cephes ``expf`` constants: log2(e), ln 2 split in two (Cody–Waite: C1 has few mantissa
# bits, so n·C1 is exact for |n| <= 128) and the minimax polynomial of e^r on |r| <= ln2/2.
_LOG2E = np.float32(1.44269504088896341)
_EXP_C1 = np.float32(0.693359375)
_EXP_C2 = np.float32(-2.12194440e-4)
_EXP_HI = np.float32(88.72283)  # above: +inf
_EXP_LO = np.float32(-87.33654)  # below: 0 (also -inf)


def _exp_f32(x):
    """``e**x`` in float32 without branches or libm (vectorizes inside a loop).

    Cephes ``expf``: ``n = round(x·log2 e)``, ``r = x − n·ln 2`` in two steps, a degree-5
    polynomial for ``e**r`` and the scale ``2**n`` built from exponent bits (in two halves,
    so that no half over- or underflows).  Max relative error ~2 ulp on
    ``[-87.3, 88.7]``; exactly 0 below (``-inf`` included), ``+inf`` above, NaN stays NaN.
    Compiled without fast-math so the range reduction keeps its order when inlined into
    fast-math kernels.
    """
    xc = min(max(x, _EXP_LO), _EXP_HI)
    # round to nearest by truncating a positive number (t + 128.5 > 0 on the clamped range)
    n = np.int32(xc * _LOG2E + np.float32(128.5)) - np.int32(128)
    fn = np.float32(n)
    r = xc - fn * _EXP_C1
    r = r - fn * _EXP_C2
    z = r * r
    y = np.float32(1.9875691500e-4) * r + np.float32(1.3981999507e-3)
    y = y * r + np.float32(8.3334519073e-3)
    y = y * r + np.float32(4.1665795894e-2)
    y = y * r + np.float32(1.6666665459e-1)
    y = y * r + np.float32(5.0000001201e-1)
    y = y * z + r + np.float32(1.0)
    n1 = np.int32(n >> 1)
    n2 = np.int32(n - n1)
    y = y * _f32_from_bits(np.int32((n1 + 127) << 23)) * _f32_from_bits(np.int32((n2 + 127) << 23))
    y = np.float32(0.0) if x < _EXP_LO else y
    y = np.float32(np.inf) if x > _EXP_HI else y
    return x if math.isnan(x) else y


exp_f32_cpu = cpu_serial(_exp_f32)


def _softmax_tile(sc, nt, softmax_scale, g, has_bias, bias, need_mask, q_pos0, q_len, pos_base, exact_pos,
                  use_exact_pos, t0, m, l, acc):
    """Online-softmax step of one tile (CPU): scale, bias and mask the scores ``sc``
    ``[rows, nt]`` in place, turn them into weights ``exp(s − m_new)``, rescale ``acc`` and
    update the running max ``m`` and sum ``l``.  The caller then adds ``sc @ V_tile``.

    Token ``tt`` of the tile sits at ``exact_pos[t0 + tt]`` if ``use_exact_pos`` else at
    ``pos_base + tt``.  Branch-free inner loops (selects, :func:`_exp_f32`) so they
    vectorize; masked scores are ``-inf`` and their weights exactly 0.
    """
    rows = sc.shape[0]
    n4 = nt - nt % 4
    for r in range(rows):
        srow = sc[r]
        # scale, bias, mask: a vertical loop (selects, no branches)
        if has_bias or need_mask:
            lim = q_pos0 + (r % q_len)
            for tt in range(nt):
                pos = int64(exact_pos[t0 + tt]) if use_exact_pos else pos_base + tt
                s = srow[tt] * softmax_scale
                if has_bias:
                    s += bias[g, r, pos]
                srow[tt] = NEG_INF if need_mask and pos > lim else s
        else:
            for tt in range(nt):
                srow[tt] = srow[tt] * softmax_scale
        # tile max: four independent chains (a float max reduction does not vectorize
        # without no-NaN semantics; one chain would be latency-bound)
        m0 = NEG_INF
        m1 = NEG_INF
        m2 = NEG_INF
        m3 = NEG_INF
        for tt in range(0, n4, 4):
            m0 = srow[tt] if srow[tt] > m0 else m0
            m1 = srow[tt + 1] if srow[tt + 1] > m1 else m1
            m2 = srow[tt + 2] if srow[tt + 2] > m2 else m2
            m3 = srow[tt + 3] if srow[tt + 3] > m3 else m3
        for tt in range(n4, nt):
            m0 = srow[tt] if srow[tt] > m0 else m0
        tile_max = max(max(m0, m1), max(m2, m3))
        if tile_max == NEG_INF:
            for tt in range(nt):
                srow[tt] = float32(0.0)
            continue
        m_old = m[r]
        m_new = max(m_old, tile_max)
        alpha = exp_f32_cpu(m_old - m_new)  # exactly 0 while m_old is -inf
        for tt in range(nt):  # vectorized exp; masked (-inf) scores give exactly 0
            srow[tt] = exp_f32_cpu(srow[tt] - m_new)
        lsum = float32(0.0)
        for tt in range(nt):
            lsum += srow[tt]
        arow = acc[r]
        for j in range(arow.shape[0]):
            arow[j] *= alpha
        l[r] = l[r] * alpha + lsum
        m[r] = m_new


softmax_tile_cpu = cpu_serial(_softmax_tile, fastmath=FASTMATH_REDUCE)


def _tile_scores(qsrc, kt, nt, sc):
    """``sc[r, tt] = qsrc[r] · kt[tt]`` for ``tt < nt`` (CPU, fast-math: the dot products
    vectorize as reductions; L1-resident tile, no BLAS call).  Four query rows per pass
    over a key row: each key vector is loaded once for four FMAs."""
    rows, d = qsrc.shape
    r4 = rows - rows % 4
    for tt in range(nt):
        krow = kt[tt]
        for r in range(0, r4, 4):
            q0 = qsrc[r]
            q1 = qsrc[r + 1]
            q2 = qsrc[r + 2]
            q3 = qsrc[r + 3]
            s0 = float32(0.0)
            s1 = float32(0.0)
            s2 = float32(0.0)
            s3 = float32(0.0)
            for j in range(d):
                k = krow[j]
                s0 += q0[j] * k
                s1 += q1[j] * k
                s2 += q2[j] * k
                s3 += q3[j] * k
            sc[r, tt] = s0
            sc[r + 1, tt] = s1
            sc[r + 2, tt] = s2
            sc[r + 3, tt] = s3
        for r in range(r4, rows):
            qrow = qsrc[r]
            s = float32(0.0)
            for j in range(d):
                s += qrow[j] * krow[j]
            sc[r, tt] = s


def _tile_pv(sc, vt, nt, acc):
    """``acc[r] += Σ_tt sc[r, tt] · vt[tt]`` (CPU): four tokens per pass, so each
    accumulator vector is loaded and stored once per four value rows."""
    rows, d = acc.shape
    n4 = nt - nt % 4
    for r in range(rows):
        arow = acc[r]
        srow = sc[r]
        for tt in range(0, n4, 4):
            w0 = srow[tt]
            w1 = srow[tt + 1]
            w2 = srow[tt + 2]
            w3 = srow[tt + 3]
            v0 = vt[tt]
            v1 = vt[tt + 1]
            v2 = vt[tt + 2]
            v3 = vt[tt + 3]
            for j in range(d):
                arow[j] += (w0 * v0[j] + w1 * v1[j]) + (w2 * v2[j] + w3 * v3[j])
        for tt in range(n4, nt):
            w = srow[tt]
            v = vt[tt]
            for j in range(d):
                arow[j] += w * v[j]


tile_scores_cpu = cpu_serial(_tile_scores, fastmath=FASTMATH_REDUCE)
tile_pv_cpu = cpu_serial(_tile_pv, fastmath=FASTMATH_REDUCE)


# --- CPU twin: partitions in parallel; per tile, register-blocked score and P·V loops -----
@cpu_kernel(fastmath=FASTMATH_REDUCE)
def _decode_attention_cpu(qr, q, kc, ks, vc, vs, n_comp, comp_pos0, ke, ve, n_exact, exact_pos, kcent, vcent,
                          kbits, koff, vbits, voff, sshift, scale_table, softmax_scale, bias, has_bias, has_qjl, sq,
                          qsig, qnorm, qjl_const, q_pos0, q_len, causal, part_size, n_comp_parts, part_m, part_l,
                          part_acc):
    n_g, rows, d = qr.shape
    nb = d // 32
    m_qjl = sq.shape[2]
    n_parts = part_m.shape[1]
    # one width for every block (the common case): the specialized loader, ~1.5x faster
    k_uniform = is_uniform_cpu(kbits)
    v_uniform = is_uniform_cpu(vbits)
    kb0 = kbits[0]
    vb0 = vbits[0]
    kcent0 = kcent[0]
    vcent0 = vcent[0]
    for item in prange(n_g * n_parts):
        g = item // n_parts
        p = item - g * n_parts
        compressed = p < n_comp_parts
        if compressed:
            t_lo = p * part_size
            t_hi = min(n_comp, t_lo + part_size)
        else:
            t_lo = (p - n_comp_parts) * part_size
            t_hi = min(n_exact, t_lo + part_size)
        kt = np.empty((CPU_TILE, d), dtype=np.float32)
        sc = np.empty((rows, CPU_TILE), dtype=np.float32)
        stq = np.empty((CPU_TILE if has_qjl else 1, m_qjl), dtype=np.float32)
        corr = np.empty((rows, CPU_TILE if has_qjl else 1), dtype=np.float32)
        acc = np.zeros((rows, d), dtype=np.float32)
        m = np.full(rows, NEG_INF, dtype=np.float32)
        l = np.zeros(rows, dtype=np.float32)
        qsrc = qr[g] if compressed else q[g]
        for t0 in range(t_lo, t_hi, CPU_TILE):
            nt = min(CPU_TILE, t_hi - t0)
            if compressed:
                if k_uniform:
                    decode_tile_simd_cpu(kc[g], ks[g], t0, nt, kcent0, kb0, nb, sshift, scale_table, kt, 0)
                else:
                    for tt in range(nt):
                        load_token_cpu(kc[g, t0 + tt], ks[g, t0 + tt], kcent, kbits, koff, sshift, nb, scale_table,
                                       kt[tt])
                tile_scores_cpu(qsrc, kt, nt, sc)
            else:
                tile_scores_cpu(qsrc, ke[g, t0:t0 + nt], nt, sc)
            if compressed and has_qjl:
                # QJL correction c_t·<S q, σ_t>, in q·k units: signs unpacked to ±1 byte by
                # byte as 2·bit − 1 through int32 (a select on a bit picked by j >> 3 / j & 7
                # vectorizes only with AVX-512; this form is a broadcast + shift per 8 lanes)
                for tt in range(nt):
                    sig = qsig[g, t0 + tt]
                    for jb in range(m_qjl >> 3):
                        byte = int32(sig[jb])
                        for k in range(8):
                            stq[tt, (jb << 3) + k] = float32((byte >> k) & 1) * float32(2.0) - float32(1.0)
                tile_scores_cpu(sq[g], stq, nt, corr)
                for tt in range(nt):
                    c = qjl_const * scale_table[qnorm[g, t0 + tt]]
                    for r in range(rows):
                        sc[r, tt] += c * corr[r, tt]
            last_pos = comp_pos0 + t0 + nt - 1 if compressed else -1
            need_mask = causal and (not compressed or last_pos > q_pos0)
            softmax_tile_cpu(sc, nt, softmax_scale, g, has_bias, bias, need_mask, q_pos0, q_len,
                             comp_pos0 + t0 if compressed else 0, exact_pos, not compressed, t0, m, l, acc)
            if compressed:
                # the value tile reuses the key tile's buffer: one L1-sized buffer per thread
                if v_uniform:
                    decode_tile_simd_cpu(vc[g], vs[g], t0, nt, vcent0, vb0, nb, sshift, scale_table, kt, 0)
                else:
                    for tt in range(nt):
                        load_token_cpu(vc[g, t0 + tt], vs[g, t0 + tt], vcent, vbits, voff, sshift, nb, scale_table,
                                       kt[tt])
                tile_pv_cpu(sc, kt, nt, acc)
            else:
                tile_pv_cpu(sc, ve[g, t0:t0 + nt], nt, acc)
        for r in range(rows):
            part_m[g, p, r] = m[r]
            part_l[g, p, r] = l[r]
            for j in range(d):
                part_acc[g, p, r, j] = acc[r, j]


@cpu_kernel
def _merge_partitions_cpu(part_m, part_l, part_acc, n_comp_parts, signs, head_rot, hsigns, out):
    n_g, n_parts, rows = part_m.shape
    d = out.shape[2]
    for item in prange(n_g * rows):
        g = item // rows
        r = item - g * rows
        buf = np.empty(d, dtype=np.float32)
        merge_row_cpu(part_m, part_l, part_acc, g, r, n_comp_parts, n_parts, signs, head_rot, hsigns, buf, out)


# --- CUDA kernels ------------------------------------------------------------------------
@cuda_kernel
def _decode_attention_cuda(qr, q, kc, ks, vc, vs, n_comp, comp_pos0, ke, ve, n_exact, exact_pos, kcent, vcent,
                           kbits, koff, vbits, voff, sshift, scale_table, softmax_scale, bias, has_bias, has_qjl, sq,
                           qsig, qnorm, qjl_const, q_pos0, q_len, causal, part_size, n_comp_parts, part_m, part_l,
                           part_acc):
    """One thread per (KV row g, partition p, query row r): grid-stride over all of them.

    Threads of one block share g and p for consecutive r, so their code reads coincide
    (broadcast through L1).  Per-thread accumulators live in local memory (d <= 512).
    """
    n_g, rows, d = qr.shape
    nb = d // 32
    m_qjl = sq.shape[2]
    n_parts = part_m.shape[1]
    k_uniform = is_uniform_dev(kbits)
    v_uniform = is_uniform_dev(vbits)
    kb0 = kbits[0]
    vb0 = vbits[0]
    kcent0 = kcent[0]
    vcent0 = vcent[0]
    kbuf = cuda.local.array(MAX_HEAD_DIM, dtype=float32)
    vbuf = cuda.local.array(MAX_HEAD_DIM, dtype=float32)
    acc = cuda.local.array(MAX_HEAD_DIM, dtype=float32)
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    for item in range(start, n_g * n_parts * rows, stride):
        r = item % rows
        gp = item // rows
        g = gp // n_parts
        p = gp - g * n_parts
        compressed = p < n_comp_parts
        if compressed:
            t_lo = p * part_size
            t_hi = min(n_comp, t_lo + part_size)
        else:
            t_lo = (p - n_comp_parts) * part_size
            t_hi = min(n_exact, t_lo + part_size)
        for j in range(d):
            acc[j] = float32(0.0)
        m = NEG_INF
        lsum = float32(0.0)
        for t in range(t_lo, t_hi):
            if compressed:
                pos = comp_pos0 + t
            else:
                pos = int64(exact_pos[t])
            if not visible_dev(pos, q_pos0, r, q_len, causal):
                continue
            s = float32(0.0)
            if compressed:
                if k_uniform:
                    load_token_fast_dev(kc[g, t], ks[g, t], kcent0, kb0, nb, sshift, scale_table, kbuf)
                else:
                    load_token_dev(kc[g, t], ks[g, t], kcent, kbits, koff, sshift, nb, scale_table, kbuf)
                for j in range(d):
                    s += qr[g, r, j] * kbuf[j]
                if has_qjl:
                    s += qjl_const * scale_table[qnorm[g, t]] * qjl_dot_dev(sq[g, r], qsig[g, t], m_qjl)
            else:
                for j in range(d):
                    s += q[g, r, j] * ke[g, t, j]
            s = s * softmax_scale
            if has_bias:
                s += bias[g, r, pos]
            if compressed:
                if v_uniform:
                    load_token_fast_dev(vc[g, t], vs[g, t], vcent0, vb0, nb, sshift, scale_table, vbuf)
                else:
                    load_token_dev(vc[g, t], vs[g, t], vcent, vbits, voff, sshift, nb, scale_table, vbuf)
                m, lsum = online_update_dev(s, m, lsum, acc, vbuf, d)
            else:
                m, lsum = online_update_dev(s, m, lsum, acc, ve[g, t], d)
        part_m[g, p, r] = m
        part_l[g, p, r] = lsum
        for j in range(d):
            part_acc[g, p, r, j] = acc[j]


@cuda_kernel
def _merge_partitions_cuda(part_m, part_l, part_acc, n_comp_parts, signs, head_rot, hsigns, out):
    """One thread per (KV row, query row)."""
    n_g, n_parts, rows = part_m.shape
    buf = cuda.local.array(MAX_HEAD_DIM, dtype=float32)
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    for item in range(start, n_g * rows, stride):
        g = item // rows
        r = item - g * rows
        merge_row_dev(part_m, part_l, part_acc, g, r, n_comp_parts, n_parts, signs, head_rot, hsigns, buf, out)


_ASIG = ("void(float32[:, :, ::1], float32[:, :, ::1], uint8[:, :, ::1], uint16[:, :, ::1], uint8[:, :, ::1], "
         "uint16[:, :, ::1], int64, int64, float32[:, :, ::1], float32[:, :, ::1], int64, int32[::1], "
         "float32[:, ::1], float32[:, ::1], int64[::1], int64[::1], int64[::1], int64[::1], int64, "
         "float32[::1], float32, float32[:, :, ::1], boolean, "
         "boolean, float32[:, :, ::1], uint8[:, :, ::1], uint16[:, ::1], float32, "
         "int64, int64, boolean, int64, int64, "
         "float32[:, :, ::1], float32[:, :, ::1], float32[:, :, :, ::1])")
_MSIG = ("void(float32[:, :, ::1], float32[:, :, ::1], float32[:, :, :, ::1], int64, float32[::1], boolean, "
         "float32[::1], float32[:, :, ::1])")
register("decode_attention", _decode_attention_cpu, _decode_attention_cuda, [_ASIG])
register("merge_partitions", _merge_partitions_cpu, _merge_partitions_cuda, [_MSIG])


# --- dispatch ------------------------------------------------------------------------------
def default_partition_size(n_tokens: int, n_rows_kv: int, device: str) -> int:
    """Tokens per partition: enough partitions to occupy the machine, at least one tile."""
    if device == _backend.CPU:
        import numba  # noqa: PLC0415

        want = 4 * numba.get_num_threads()
        per = -(-n_tokens // max(1, -(-want // max(n_rows_kv, 1))))
        return int(max(4 * TILE, -(-per // TILE) * TILE))
    return 64 if _backend.simulator_enabled() else 256


@dataclass(frozen=True, eq=False)
class CodeLayout:
    """Byte layout of one compressed vector, as the fused kernels read it.

    Block ``b`` (32 rotated coordinates) holds ``bits[b]``-bit indices at bytes
    ``offsets[b] .. offsets[b] + 4·bits[b]`` and decodes through ``centroids[b]``;
    ``scale_group`` consecutive blocks share one stored binary16 scale (1 for the
    32-block rotation, ``head_dim / 32`` for the whole-head rotation).

    Attributes
    ----------
    bits, offsets : int64 arrays, shape ``(head_dim / 32,)``
    centroids : float32 array, shape ``(head_dim / 32, 16)`` (row ``b`` padded with zeros)
    scale_group : int
    """

    bits: np.ndarray
    offsets: np.ndarray
    centroids: np.ndarray
    scale_group: int = 1

    @property
    def width(self) -> int:
        """Packed bytes per vector."""
        return int(4 * self.bits.sum())

    @property
    def scale_shift(self) -> int:
        """``log2(scale_group)`` (the kernels shift instead of dividing)."""
        return int(self.scale_group).bit_length() - 1

    @property
    def num_scales(self) -> int:
        """Stored scales per vector."""
        return len(self.bits) // self.scale_group

    @classmethod
    def from_blocks(cls, codebooks: Sequence[Any], scale_group: int = 1) -> CodeLayout:
        """Layout with one codebook per 32-block (``codebooks[b]``), blocks packed back to back."""
        nb = len(codebooks)
        bits = np.array([cb.bits for cb in codebooks], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(4 * bits)[:-1]]).astype(np.int64)
        cents = np.zeros((nb, 16), dtype=np.float32)
        for i, cb in enumerate(codebooks):
            cents[i, :cb.centroids.shape[0]] = cb.centroids
        for a in (bits, offsets, cents):
            a.flags.writeable = False
        if scale_group < 1 or scale_group & (scale_group - 1) or nb % scale_group:
            raise ValueError(f"scale_group: expected a power of two dividing the {nb} blocks, got {scale_group}")
        return cls(bits, offsets, cents, int(scale_group))

    @classmethod
    def uniform(cls, codebook: Any, head_dim: int, scale_group: int = 1) -> CodeLayout:
        """Every block with the same codebook (cached per codebook and geometry)."""
        return _uniform_layout(codebook, int(head_dim), int(scale_group))


@functools.cache
def _uniform_layout(codebook: Any, head_dim: int, scale_group: int) -> CodeLayout:
    return CodeLayout.from_blocks([codebook] * (head_dim // 32), scale_group)


def _no_qjl(like: Any) -> tuple:
    return (_backend.empty(like, (1, 1, 8), np.float32), _backend.empty(like, (1, 1, 1), np.uint8),
            _backend.empty(like, (1, 1), np.uint16), np.float32(0.0))


def fused_attention_rows(qr: Any, q: Any, kc: Any, ks: Any, vc: Any, vs: Any, n_comp: int, comp_pos0: int,
                         ke: Any, ve: Any, n_exact: int, exact_pos: Any, klayout: CodeLayout, vlayout: CodeLayout,
                         softmax_scale: float, bias: Any, q_pos0: int, q_len: int, causal: bool = True,
                         part_size: int | None = None, head_signs: Any = None, qjl: Any = None) -> Any:
    """Fused decode attention over compressed + exact tokens, in the ``[g, rows, d]`` layout.

    No validation (callers validate): ``qr``/``q`` ``[n_g, rows, d]`` float32 (rotated and
    raw queries), codes/scales ``[n_g, capacity, ·]`` with ``n_comp`` live tokens laid out
    as ``klayout``/``vlayout``, exact ``ke``/``ve`` ``[n_g, >= n_exact, d]`` float32 (first
    ``n_exact`` live) with int32 positions ``exact_pos``, ``bias`` ``[n_g, rows,
    total_positions]`` or ``None``.  ``head_signs`` (float32 ``[d]``): the compressed
    tokens use the whole-head rotation with these signs (``None``: 32-block rotation).
    ``qjl`` = ``(sq, signs, norms, const)``: add the QJL correction ``const·‖r_t‖·⟨sq,
    σ_t⟩`` (``sq`` ``[n_g, rows, m]`` = ``S q``, ``signs`` uint8 ``[n_g, capacity, m/8]``,
    ``norms`` uint16 ``[n_g, capacity]``) to every compressed token's ``q·k``.  Returns
    ``out`` ``[n_g, rows, d]`` float32 on the device of ``qr``.
    """
    n_g, rows, d = qr.shape
    dev = _backend.device_of("q", qr)
    n_exact = int(n_exact)
    if part_size is None:
        part_size = default_partition_size(max(n_comp, n_exact, 1), n_g, dev)
    n_cp = -(-n_comp // part_size)
    n_ep = -(-n_exact // part_size)
    n_parts = max(n_cp + n_ep, 1)
    if n_cp + n_ep == 0:
        raise ValueError("k: expected at least one stored token to attend over, got none")
    part_m = _backend.empty(qr, (n_g, n_parts, rows), np.float32)
    part_l = _backend.empty(qr, (n_g, n_parts, rows), np.float32)
    part_acc = _backend.empty(qr, (n_g, n_parts, rows, d), np.float32)
    out = _backend.empty(qr, (n_g, rows, d), np.float32)
    has_bias = bias is not None
    if bias is None:
        bias = _backend.empty(qr, (1, 1, 1), np.float32)
    has_qjl = qjl is not None
    sq, qsig, qnorm, qconst = qjl if has_qjl else _no_qjl(qr)
    c = functools.partial(_backend.constant, qr)
    args = (qr, q, kc, ks, vc, vs, int(n_comp), int(comp_pos0), ke, ve, n_exact, exact_pos,
            c(klayout.centroids), c(vlayout.centroids), c(klayout.bits), c(klayout.offsets), c(vlayout.bits),
            c(vlayout.offsets), klayout.scale_shift, c(F16_ABS_TABLE), np.float32(softmax_scale), bias, has_bias,
            has_qjl, sq, qsig, qnorm, np.float32(qconst), int(q_pos0), int(q_len), bool(causal), int(part_size),
            int(n_cp), part_m, part_l, part_acc)
    head_rot = head_signs is not None
    margs = (part_m, part_l, part_acc, int(n_cp), c(SIGNS32), head_rot,
             head_signs if head_rot else c(SIGNS32))
    if dev == _backend.CPU:
        work = n_g * rows * d * (n_comp + n_exact)
        cpu_call(_decode_attention_cpu, work, *args)
        cpu_call(_merge_partitions_cpu, work // max(n_comp + n_exact, 1) * n_parts, *margs, out)
    else:
        if d > MAX_HEAD_DIM:
            raise ValueError(f"head_dim: the CUDA decode kernel supports head_dim <= {MAX_HEAD_DIM}, got {d}")
        blocks, threads = _backend.cuda_grid(n_g * n_parts * rows, threads=max(32, min(rows, 128)))
        _decode_attention_cuda[blocks, threads](*args)
        blocks, threads = _backend.cuda_grid(n_g * rows)
        _merge_partitions_cuda[blocks, threads](*margs, out)
    return out


def _codebook_for(name: str, bits: Any, norm_mode: str, codebook: Any, block: int = 32):
    from .codebook import Codebook, get_codebook  # noqa: PLC0415

    if codebook is not None:
        if not isinstance(codebook, Codebook):
            raise TypeError(f"{name}_codebook: expected a Codebook, got {type(codebook).__name__}")
        return codebook
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or not 1 <= int(bits) <= 4:
        raise ValueError(f"{name}_bits: expected an int in 1..4, got {bits!r}")
    return get_codebook(int(bits), norm_mode, block=block)


def decode_attention(q: Any, k_codes: Any, k_scales: Any, v_codes: Any, v_scales: Any, *, bits: int = 3,
                     norm_mode: str = "maxnorm", k_bits: int | None = None, v_bits: int | None = None,
                     k_codebook: Any = None, v_codebook: Any = None, softmax_scale: float | None = None,
                     logit_bias: Any = None, causal: bool = True, k_exact: Any = None, v_exact: Any = None,
                     exact_positions: Any = None, partition_size: int | None = None,
                     rotation: str = "block", k_qjl: tuple | None = None, backend: str = "auto") -> Any:
    """Softmax attention computed directly from block-quantized K/V codes.

    Parameters
    ----------
    q : float array, shape ``(batch, num_heads, q_len, head_dim)``
        Queries; ``num_heads`` a multiple of ``num_kv_heads`` (contiguous GQA groups).
    k_codes, v_codes : uint8 array, shape ``(batch, num_kv_heads, T, head_dim·bits/8)``
    k_scales, v_scales : uint16 array, shape ``(batch, num_kv_heads, T, head_dim/32)``
        As returned by :func:`numba_kv.quantize_blocks` on ``[batch, num_kv_heads, T, d]``
        (with ``rotation="head"``: ``(…, T, 1)`` from :func:`numba_kv.quantize_head`).
        Compressed token ``t`` sits at position ``t`` (after any exact tokens, see below).
    bits, norm_mode, k_bits, v_bits, k_codebook, v_codebook
        Codebooks of K and V (``k_bits``/``v_bits`` default to ``bits``).
    softmax_scale : float, optional
        Defaults to ``1/sqrt(head_dim)``.
    logit_bias : float array, shape ``(batch, num_heads, q_len, total_tokens)``, optional
        Added to the scaled logits (units of ``softmax_scale·q·k``), indexed by position.
    causal : bool
        Query ``i`` sits at position ``total_tokens − q_len + i`` and sees positions ``<=``
        its own (speculative-decoding verification); ``False`` = every query sees all.
    k_exact, v_exact : float array, shape ``(batch, num_kv_heads, E, head_dim)``, optional
        Extra full-precision tokens (a recent window, sinks) joined in the same softmax.
    exact_positions : int array, shape ``(E,)``, optional
        Positions of the exact tokens; default ``T, T+1, …`` (a window after the codes).
    partition_size : int, optional
        Tokens per split-K partition (default: enough partitions for every thread).
    rotation : {"block", "head"}
        How the codes were made: :func:`numba_kv.quantize_blocks` (32-block rotation, one
        scale per block) or :func:`numba_kv.quantize_head` (whole-head rotation, one norm
        per vector, L2 codebooks for ``head_dim`` dimensions; ``norm_mode`` is ignored).
    k_qjl : tuple ``(signs, norms, sketch)``, optional
        TurboQuant's QJL correction of the keys, added to every compressed token's ``q·k``
        inside the kernel: ``signs`` uint8 ``(batch, num_kv_heads, T, m/8)`` and ``norms``
        uint16 ``(batch, num_kv_heads, T)`` from :func:`numba_kv.qjl_quantize` of the key
        residuals ``k − k̂``, and the ``sketch`` float32 ``(m, head_dim)`` they were made
        with (``None``: :func:`numba_kv.make_sketch`).

    Returns
    -------
    out : float32 array, shape ``(batch, num_heads, q_len, head_dim)``, on the device of
        ``q``.

    Raises
    ------
    ValueError, TypeError
        Mismatched shapes, group counts, dtypes or devices; the message names the argument.

    Examples
    --------
    >>> import numpy as np, numba_kv as nk
    >>> rng = np.random.default_rng(0)
    >>> k, v = rng.standard_normal((2, 1, 2, 100, 64)).astype(np.float32)
    >>> kc, ks = nk.quantize_blocks(k, 3); vc, vs = nk.quantize_blocks(v, 3)
    >>> q = rng.standard_normal((1, 4, 1, 64)).astype(np.float32)
    >>> decode_attention(q, kc, ks, vc, vs).shape
    (1, 4, 1, 64)
    """
    from .._validate import check_finite, check_float_array, check_rotation_input, check_shape  # noqa: PLC0415

    dev = _backend.resolve_device(backend, q=q, k_codes=k_codes, k_scales=k_scales, v_codes=v_codes,
                                  v_scales=v_scales, logit_bias=logit_bias, k_exact=k_exact, v_exact=v_exact,
                                  exact_positions=exact_positions)
    check_float_array("q", q, 4)
    b, hq, ql, d = (int(s) for s in q.shape)
    if d % 32 or d == 0:
        raise ValueError(f"q: expected head_dim a positive multiple of 32, got shape {(b, hq, ql, d)}")
    if rotation not in ("block", "head"):
        raise ValueError(f"rotation: expected 'block' or 'head', got {rotation!r}")
    head = rotation == "head"
    if head and (d & (d - 1) or d > MAX_HEAD_DIM):
        raise ValueError(f"q: rotation='head' needs a power-of-two head_dim <= {MAX_HEAD_DIM}, got {d}")
    cb_mode, cb_block = ("l2", d) if head else (norm_mode, 32)
    kcb = _codebook_for("k", bits if k_bits is None else k_bits, cb_mode, k_codebook, cb_block)
    vcb = _codebook_for("v", bits if v_bits is None else v_bits, cb_mode, v_codebook, cb_block)
    n_scales = 1 if head else d // 32
    if len(k_codes.shape) != 4:
        raise ValueError(f"k_codes: expected 4-D [batch, num_kv_heads, T, packed], got shape {tuple(k_codes.shape)}")
    hkv, T = int(k_codes.shape[1]), int(k_codes.shape[2])
    if hkv < 1 or hq % hkv:
        raise ValueError(f"q: expected num_heads to be a multiple of num_kv_heads={hkv}, got shape {(b, hq, ql, d)}")
    for name, a, width, dt in (("k_codes", k_codes, d * kcb.bits // 8, np.uint8),
                               ("k_scales", k_scales, n_scales, np.uint16),
                               ("v_codes", v_codes, d * vcb.bits // 8, np.uint8),
                               ("v_scales", v_scales, n_scales, np.uint16)):
        if np.dtype(a.dtype) != dt:
            raise TypeError(f"{name}: expected dtype {np.dtype(dt)}, got {a.dtype}")
        check_shape(name, a, (b, hkv, T, width), ("batch", "num_kv_heads", "T", "width"))
    n_exact = 0
    if (k_exact is None) != (v_exact is None):
        raise ValueError("k_exact: k_exact and v_exact must be given together")
    if k_exact is not None:
        for name, a in (("k_exact", k_exact), ("v_exact", v_exact)):
            check_float_array(name, a, 4)
            check_shape(name, a, (b, hkv, None, d), ("batch", "num_kv_heads", "E", "head_dim"))
            check_finite(name, a)
        n_exact = int(k_exact.shape[2])
        if int(v_exact.shape[2]) != n_exact:
            raise ValueError(f"v_exact: expected E={n_exact} tokens like k_exact, got shape {tuple(v_exact.shape)}")
    total = T + n_exact
    if total == 0:
        raise ValueError("k_codes: expected at least one token (T + E >= 1), got 0")
    if ql > total and causal:
        raise ValueError(f"q: expected q_len <= total tokens {total} with causal=True, got {ql}")
    if exact_positions is None:
        pos = np.arange(T, T + n_exact, dtype=np.int32)
        xp = _backend.xp_of(q)
        if dev == _backend.CPU:
            exact_positions = pos
        elif xp is not None:
            exact_positions = xp.asarray(pos)
        else:
            from numba import cuda as _cuda  # noqa: PLC0415

            exact_positions = _cuda.to_device(pos if pos.size else np.zeros(1, np.int32))
    elif tuple(exact_positions.shape) != (n_exact,) or np.dtype(exact_positions.dtype).kind not in "iu":
        raise ValueError(f"exact_positions: expected an int array of shape ({n_exact},), got "
                         f"{exact_positions.dtype} {tuple(exact_positions.shape)}")
    if softmax_scale is None:
        softmax_scale = d ** -0.5
    check_rotation_input("q", q, d if head else 32)  # finite, and its rotation fits float32
    g = b * hkv
    rows = (hq // hkv) * ql
    q3 = _backend.ascontiguous_f32("q", q).reshape(g, rows, d)
    bias3 = None
    if logit_bias is not None:
        check_float_array("logit_bias", logit_bias, 4)
        check_shape("logit_bias", logit_bias, (b, hq, ql, total), ("batch", "num_heads", "q_len", "total_tokens"))
        check_finite("logit_bias", logit_bias)
        bias3 = _backend.ascontiguous_f32("logit_bias", logit_bias).reshape(g, rows, total)
    xp = _backend.xp_of(q)

    def flat(a, w):
        a = xp.ascontiguousarray(a) if xp is not None else a
        return a.reshape(g, int(a.shape[2]), w)

    if n_exact:
        ke = flat(_backend.ascontiguous_f32("k_exact", k_exact), d)
        ve = flat(_backend.ascontiguous_f32("v_exact", v_exact), d)
        epos = exact_positions.astype(np.int32) if xp is not None else exact_positions
    else:
        ke = ve = _backend.empty(q3, (g, 0, d), np.float32)
        epos = exact_positions
    qjl = None
    if k_qjl is not None:
        qjl = _qjl_args(k_qjl, q3, b, hkv, T, d)
    sgroup = d // 32 if head else 1
    if head:
        from .headquant import head_signs, rotate_head  # noqa: PLC0415

        qr = rotate_head(q3)  # the whole-head rotation of the queries, once per step
        hs = _backend.constant(q3, head_signs(d))
    else:
        qr = rotate32(q3)  # forward-rotate every 32-block of the queries, once per step
        hs = None
    out = fused_attention_rows(qr, q3, flat(k_codes, int(k_codes.shape[3])), flat(k_scales, n_scales),
                               flat(v_codes, int(v_codes.shape[3])), flat(v_scales, n_scales), T, 0, ke, ve, n_exact,
                               epos, CodeLayout.uniform(kcb, d, sgroup), CodeLayout.uniform(vcb, d, sgroup),
                               softmax_scale, bias3, total - ql, ql, causal, partition_size, head_signs=hs, qjl=qjl)
    return out.reshape(b, hq, ql, d)


def _qjl_args(k_qjl: Any, q3: Any, b: int, hkv: int, T: int, d: int) -> tuple:
    """Validate ``k_qjl = (signs, norms, sketch)`` and project the queries: the ``qjl``
    argument of :func:`fused_attention_rows`."""
    from .._validate import check_shape  # noqa: PLC0415
    from .lowrank import project_into  # noqa: PLC0415
    from .qjl import _sketch_arg, qjl_constant  # noqa: PLC0415

    if not isinstance(k_qjl, tuple) or len(k_qjl) != 3:
        raise TypeError("k_qjl: expected a tuple (signs, norms, sketch), got "
                        f"{type(k_qjl).__name__}")
    signs, norms, sketch = k_qjl
    _backend.resolve_device("auto", q=q3, k_qjl_signs=signs, k_qjl_norms=norms, k_qjl_sketch=sketch)
    if np.dtype(signs.dtype) != np.uint8:
        raise TypeError(f"k_qjl: expected signs of dtype uint8, got {signs.dtype}")
    if np.dtype(norms.dtype) != np.uint16:
        raise TypeError(f"k_qjl: expected norms of dtype uint16 (binary16 bits), got {norms.dtype}")
    if len(signs.shape) != 4 or int(signs.shape[3]) < 1:
        raise ValueError(f"k_qjl: expected signs of shape (batch, num_kv_heads, T, m/8), got {tuple(signs.shape)}")
    mb = int(signs.shape[3])
    check_shape("k_qjl signs", signs, (b, hkv, T, mb), ("batch", "num_kv_heads", "T", "m/8"))
    check_shape("k_qjl norms", norms, (b, hkv, T), ("batch", "num_kv_heads", "T"))
    m = 8 * mb
    sk = _sketch_arg(sketch, d, m, q3)
    g, rows, _ = q3.shape
    xp = _backend.xp_of(q3)
    contig = (lambda a: xp.ascontiguousarray(a)) if xp is not None else (lambda a: a)
    sq = _backend.empty(q3, (g, rows, m), np.float32)
    project_into(q3, _backend.zeros(q3, (1, d), np.float32), sk.reshape(1, m, d), sq)
    return sq, contig(signs).reshape(g, T, mb), contig(norms).reshape(g, T), np.float32(qjl_constant(m))

