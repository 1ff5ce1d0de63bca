"""CPU-only helpers of the fused decode attention: SIMD token decoding (also of QJL sign
bits), a branch-free ``expf`` and the register-blocked tile loops of the CPU twins (flat and
paged).

Compiled for the CPU only (LLVM intrinsics, fast-math reductions); the CUDA kernels use the
single-source cores of :mod:`numba_kv.ops.attention.cores` and ``math.exp`` instead.
"""

from __future__ import annotations

import math
import sys

import numpy as np
from llvmlite import ir
from numba import float32, int32, int64, types
from numba.core.extending import intrinsic

from ..._jit import FASTMATH_REDUCE, codegen_has_avx512, codegen_permutes_fast, cpu_serial
from ..half import f16_bits_to_f32_cpu
from .cores import (
    F32_MAX,
    NEG_INF,
    decode8_cpu,
    load_token_fast_cpu,
    online_update_cpu,
    scale_slot_cpu,
    sign_pm1_cpu,
    visible_cpu,
)

__all__ = ["decode_tile_mixed_cpu", "decode_tile_simd_cpu", "decode_tile_vq_cpu", "exact_tile_cpu", "exp_f32_cpu",
           "nibble_lut_cpu", "softmax_tile_cpu", "tile_pv_cpu", "tile_scores_cpu", "unpack_signs_tile_cpu"]

_F32 = ir.FloatType()
_I8 = ir.IntType(8)
_I32 = ir.IntType(32)
_V8F = ir.VectorType(_F32, 8)
_V8I = ir.VectorType(_I32, 8)


def _splat(builder, value, vty):
    v = builder.insert_element(ir.Constant(vty, ir.Undefined), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vty, ir.Undefined), ir.Constant(_V8I, [0] * 8))


def _decode8_codegen(nbits):
    def codegen(context, builder, signature, args):
        codes, t, boff, pre, cent, sa, dst, row, off = args
        carr = context.make_array(signature.args[0])(context, builder, codes)
        centarr = context.make_array(signature.args[4])(context, builder, cent)
        darr = context.make_array(signature.args[6])(context, builder, dst)
        i64 = ir.IntType(64)
        # four code bytes at codes[t, boff:boff+4], one unaligned little-endian load (the
        # broadcast reads it straight from memory); addresses from the strides, no views
        cbyte = builder.add(builder.mul(t, builder.extract_value(carr.strides, 0)), boff)
        bptr = builder.gep(builder.bitcast(carr.data, _I8.as_pointer()), [cbyte], source_etype=_I8)
        w = builder.load(builder.bitcast(bptr, _I32.as_pointer()), align=1, typ=_I32)
        if sys.byteorder == "big":
            w = builder.call(builder.module.declare_intrinsic("llvm.bswap", [_I32]), [w])
        wv = _splat(builder, w, _V8I)
        cptr = builder.bitcast(centarr.data, _V8F.as_pointer())
        if nbits < 3:  # a 2- or 4-entry codebook: load only the floats it has
            vty = ir.VectorType(_F32, 1 << nbits)
            clo = builder.load(builder.bitcast(centarr.data, vty.as_pointer()), align=4, typ=vty)
        else:
            clo = builder.load(cptr, align=4, typ=_V8F)
        shift = builder.add(_splat(builder, builder.trunc(pre, _I32), _V8I),
                            ir.Constant(_V8I, [nbits * k for k in range(8)]))
        idx = builder.and_(builder.lshr(wv, shift), ir.Constant(_V8I, [min(7, (1 << nbits) - 1)] * 8))
        vec = ir.Constant(_V8F, ir.Undefined)
        for k in range(8):
            i = builder.extract_element(idx, ir.Constant(_I32, k))
            vec = builder.insert_element(vec, builder.extract_element(clo, i), ir.Constant(_I32, k))
        if nbits == 4:
            # 16 centroids: look up both halves with the low 3 bits, pick by bit 3
            chi = builder.load(builder.gep(cptr, [ir.Constant(_I32, 1)], source_etype=_V8F), align=4, typ=_V8F)
            hib = builder.lshr(wv, builder.add(shift, ir.Constant(_V8I, [3] * 8)))
            hib = builder.icmp_unsigned("!=", builder.and_(hib, ir.Constant(_V8I, [1] * 8)),
                                        ir.Constant(_V8I, [0] * 8))
            vhi = ir.Constant(_V8F, ir.Undefined)
            for k in range(8):
                i = builder.extract_element(idx, ir.Constant(_I32, k))
                vhi = builder.insert_element(vhi, builder.extract_element(chi, i), ir.Constant(_I32, k))
            vec = builder.select(hib, vhi, vec)
        vec = builder.fmul(vec, _splat(builder, sa, _V8F))
        dbyte = builder.add(builder.mul(row, builder.extract_value(darr.strides, 0)),
                            builder.mul(off, ir.Constant(i64, 4)))
        dptr = builder.gep(builder.bitcast(darr.data, _I8.as_pointer()), [dbyte], source_etype=_I8)
        builder.store(vec, builder.bitcast(dptr, _V8F.as_pointer()), align=4)
        return context.get_dummy_value()
    return codegen


def _decode8_typer(nbits):
    def typer(typingctx, codes, t, boff, pre, cent, sa, dst, row, off):
        ok = (isinstance(codes, types.Array) and codes.dtype == types.uint8 and codes.ndim == 2
              and all(isinstance(a, types.Integer) for a in (t, boff, pre, row, off)) and sa == types.float32
              and isinstance(cent, types.Array) and cent.dtype == types.float32 and cent.ndim == 1
              and cent.layout == "C" and isinstance(dst, types.Array) and dst.dtype == types.float32
              and dst.ndim == 2 and dst.layout == "C")
        if not ok:
            return None
        i64 = types.int64
        return types.void(codes, i64, i64, i64, cent, types.float32, dst, i64, i64), _decode8_codegen(nbits)
    return typer


# ``dst[row, off:off+8] = sa · cent[(w >> (pre + b·k)) & (2**b − 1)]``, k = 0..7, with ``w`` the four
# bytes ``codes[t, boff:boff+4]`` read as one little-endian uint32, in one 8-lane vector.  The
# word is broadcast straight from memory (assembling it from byte loads and moving it from a
# general register to a vector one cost ~40 % more per 8 codes), and both addresses come
# from the arrays' strides (row views per token cost another ~40 %); the lookup is a
# build-vector of variable extracts, which x86 code generation lowers to a variable permute
# (``vpermps``: the <= 16-entry codebook lives in one or two registers) — no gather, no
# per-code table load.  The caller keeps ``boff + 4 <= codes.shape[1]``, ``codes`` rows of
# unit stride and ``off + 8 <= dst.shape[1]`` (none is checked); ``cent`` needs 8 (3 bits)
# or 16 (4 bits) readable floats (2 or 4 for 1 or 2 bits); ``cent`` and ``dst``
# C-contiguous float32 (typing fails otherwise).
_decode8_1bit = intrinsic(_decode8_typer(1))
_decode8_2bit = intrinsic(_decode8_typer(2))
_decode8_3bit = intrinsic(_decode8_typer(3))
_decode8_4bit = intrinsic(_decode8_typer(4))


def _decode8_5bit(codes, t, p, cent, sa, dst, row, o):
    """``dst[row, o + k] = sa · cent[idx_k]``, ``k < 8``: the eight 5-bit indices packed LSB
    first in the five bytes ``codes[t, p:p + 5]``.  Constant shifts and masks (the
    bit-by-bit core's loops over a run-time width cost ~4× here); a 32-entry codebook
    takes four 8-lane permutes and three blends per 8 codes, so the lookups stay scalar
    loads from the 128-byte table, which any target runs well."""
    w = (int64(codes[t, p]) | (int64(codes[t, p + 1]) << 8) | (int64(codes[t, p + 2]) << 16)
         | (int64(codes[t, p + 3]) << 24) | (int64(codes[t, p + 4]) << 32))
    for k in range(8):
        dst[row, o + k] = cent[(w >> (5 * k)) & 31] * sa


decode8_5bit_cpu = cpu_serial(_decode8_5bit, inline=True)


def _decode_block(codes, t, p, bits, cent, sa, dst, row, o):
    """The 32 codes of one block of token ``t`` (``4·bits`` bytes at ``codes[t, p:]``) into
    ``dst[row, o:o+32]``, eight per :func:`_decode8_1bit` ... :func:`_decode8_4bit` /
    :func:`_decode8_5bit` call,
    every 4-byte read inside the block: a 3-bit block's last group (bytes 9..11) is read
    from byte 8, shifted by 8."""
    if bits == 3:
        _decode8_3bit(codes, t, p, 0, cent, sa, dst, row, o)
        _decode8_3bit(codes, t, p + 3, 0, cent, sa, dst, row, o + 8)
        _decode8_3bit(codes, t, p + 6, 0, cent, sa, dst, row, o + 16)
        _decode8_3bit(codes, t, p + 8, 8, cent, sa, dst, row, o + 24)
    elif bits == 4:
        _decode8_4bit(codes, t, p, 0, cent, sa, dst, row, o)
        _decode8_4bit(codes, t, p + 4, 0, cent, sa, dst, row, o + 8)
        _decode8_4bit(codes, t, p + 8, 0, cent, sa, dst, row, o + 16)
        _decode8_4bit(codes, t, p + 12, 0, cent, sa, dst, row, o + 24)
    elif bits == 2:
        _decode8_2bit(codes, t, p, 0, cent, sa, dst, row, o)
        _decode8_2bit(codes, t, p, 16, cent, sa, dst, row, o + 8)
        _decode8_2bit(codes, t, p + 4, 0, cent, sa, dst, row, o + 16)
        _decode8_2bit(codes, t, p + 4, 16, cent, sa, dst, row, o + 24)
    elif bits == 1:
        _decode8_1bit(codes, t, p, 0, cent, sa, dst, row, o)
        _decode8_1bit(codes, t, p, 8, cent, sa, dst, row, o + 8)
        _decode8_1bit(codes, t, p, 16, cent, sa, dst, row, o + 16)
        _decode8_1bit(codes, t, p, 24, cent, sa, dst, row, o + 24)
    else:  # 5 bits
        for grp in range(4):
            decode8_5bit_cpu(codes, t, p + 5 * grp, cent, sa, dst, row, o + grp * 8)


decode_block_cpu = cpu_serial(_decode_block, inline=True)


def _nibble_lut(cent, lut):
    """``lut[c] = (cent[c & 15], cent[c >> 4])``, ``c < 256``: the two 4-bit codes of a byte
    (low nibble first, the order of :func:`_decode8_4bit`), for :func:`_decode_tile_simd`."""
    for c in range(256):
        lut[c, 0] = cent[c & 15]
        lut[c, 1] = cent[c >> 4]


nibble_lut_cpu = cpu_serial(_nibble_lut)


#: 4-bit codes through the byte table (:func:`_decode_tile_simd`) rather than two permutes and a
#: blend per 8 codes: where permutes are slow or absent (:func:`numba_kv._jit.codegen_permutes_fast`)
NIBBLE_TABLE = not codegen_permutes_fast()


def _decode_tile_simd(codes, scales, t0, nt, cent, bits, nb, sshift, scale_table, dst, d0, lut):
    """``dst[d0 + tt] = `` token ``t0 + tt`` of ``codes``/``scales`` (``[tokens, ·]``), ``tt < nt``,
    decoded like :func:`_load_token_fast` (same values; CPU only): 1- to 5-bit codes a block
    at a time by :func:`_decode_block` (``cent`` C-contiguous float32 with ``2**bits`` or
    more entries, ``dst`` C-contiguous) — 4-bit codes, where :data:`NIBBLE_TABLE`, a byte at
    a time through ``lut`` (:func:`_nibble_lut` of ``cent``, float32 ``[256, 2]``) —, code
    rows that are not unit-stride by the scalar loader.  One call per tile keeps the
    per-token call overhead out of the hot loop.

    Why a table for 4 bits on some hosts: a 16-entry codebook needs two 8-lane permutes and
    a blend per 8 codes (:func:`_decode8_4bit`), and a lane-crossing permute is slow on AMD
    Zen 1 (3 micro-ops, one per 4 cycles); there a byte's two values, one 8-byte load from a
    2 KB table, took a 64-value token from 51 to 33 ns.  Where permutes are fast (one
    micro-op: Intel since Haswell, AMD since Zen 2) the permutes win: on Zen 4 the table made
    4-bit tiles 1.7–1.9× the 3-bit ones, natively and with AVX2 code generation, the
    permutes 1.1–1.2× (``benchmarks/results/nibble-ab-2026-12-01-znver4.txt``).  The
    products ``centroid · scale`` are the same float32 multiplications either way: same
    bits."""
    fast = codes.strides[1] == 1
    # one loop per width, so the width test stays out of the per-block code
    if bits == 4 and fast and NIBBLE_TABLE:
        for tt in range(nt):
            t = t0 + tt
            for b in range(nb):
                sa = scale_table[scale_slot_cpu(scales, scales[t, b >> sshift])]
                for i in range(16):
                    c = codes[t, b * 16 + i]
                    dst[d0 + tt, b * 32 + 2 * i] = lut[c, 0] * sa
                    dst[d0 + tt, b * 32 + 2 * i + 1] = lut[c, 1] * sa
    elif bits == 4 and fast:
        for tt in range(nt):
            t = t0 + tt
            for b in range(nb):
                sa = scale_table[scale_slot_cpu(scales, scales[t, b >> sshift])]
                decode_block_cpu(codes, t, b * 16, 4, cent, sa, dst, d0 + tt, b * 32)
    elif bits == 3 and fast:
        for tt in range(nt):
            t = t0 + tt
            for b in range(nb):
                sa = scale_table[scale_slot_cpu(scales, scales[t, b >> sshift])]
                decode_block_cpu(codes, t, b * 12, 3, cent, sa, dst, d0 + tt, b * 32)
    elif bits == 2 and fast:
        for tt in range(nt):
            t = t0 + tt
            for b in range(nb):
                sa = scale_table[scale_slot_cpu(scales, scales[t, b >> sshift])]
                decode_block_cpu(codes, t, b * 8, 2, cent, sa, dst, d0 + tt, b * 32)
    elif bits == 1 and fast:
        for tt in range(nt):
            t = t0 + tt
            for b in range(nb):
                sa = scale_table[scale_slot_cpu(scales, scales[t, b >> sshift])]
                decode_block_cpu(codes, t, b * 4, 1, cent, sa, dst, d0 + tt, b * 32)
    elif bits == 5 and fast:
        for tt in range(nt):
            t = t0 + tt
            for b in range(nb):
                sa = scale_table[scale_slot_cpu(scales, scales[t, b >> sshift])]
                for grp in range(4):
                    decode8_5bit_cpu(codes, t, b * 20 + grp * 5, cent, sa, dst, d0 + tt, b * 32 + grp * 8)
    else:
        for tt in range(nt):
            load_token_fast_cpu(codes[t0 + tt], scales[t0 + tt], cent, bits, nb, sshift, scale_table, dst[d0 + tt])


decode_tile_simd_cpu = cpu_serial(_decode_tile_simd, inline=True)


def _decode_tile_mixed(codes, scales, t0, nt, cent2, bits_b, off_b, sshift, scale_table, dst, d0=0):
    """``dst[d0 + tt] = `` token ``t0 + tt`` of a :class:`~numba_kv.ops.attention.CodeLayout` whose
    blocks differ in width (``bits_b``, byte offsets ``off_b``, codebook rows ``cent2``
    ``[nb, 16]`` C-contiguous), ``tt < nt``; ``2**sshift`` consecutive blocks share a scale.
    A block at a time by :func:`_decode_block` (CPU only); code rows that are not
    unit-stride by the single-source group-of-8 core, ~4× slower."""
    nb = bits_b.shape[0]
    fast = codes.strides[1] == 1
    for tt in range(nt):
        t = t0 + tt
        for b in range(nb):
            sa = scale_table[scale_slot_cpu(scales, scales[t, b >> sshift])]
            if fast:
                decode_block_cpu(codes, t, off_b[b], bits_b[b], cent2[b], sa, dst, d0 + tt, b * 32)
            else:
                for grp in range(4):
                    decode8_cpu(codes[t], off_b[b] + grp * bits_b[b], bits_b[b], cent2[b], sa, dst[d0 + tt],
                                b * 32 + grp * 8)


decode_tile_mixed_cpu = cpu_serial(_decode_tile_mixed)


def _decode_tile_vq(codes, scales, t0, nt, cent, bits, nb, sshift, scale_table, dst, d0):
    """``dst[d0 + tt] = `` token ``t0 + tt`` of a head VQ layout
    (:meth:`~numba_kv.ops.attention.CodeLayout.head_vq`), ``tt < nt``: byte ``i`` of block ``b``
    (``4·bits`` bytes per block) gives ``dst[…, 32·b + m·i + j] = sa · cent[m·byte + j]`` with
    ``m = 8 / bits`` (the values of :func:`~numba_kv.ops.attention.cores._decode8_vq`; CPU
    only).  ``cent`` is the flattened ``[256, m]`` codebook; the group size is a constant of
    each loop nest (one per width), so the lookups are two or four loads per byte."""
    if bits == 4:
        for tt in range(nt):
            t = t0 + tt
            for b in range(nb):
                sa = scale_table[scale_slot_cpu(scales, scales[t, b >> sshift])]
                for i in range(16):
                    c = int64(codes[t, b * 16 + i]) << 1
                    dst[d0 + tt, b * 32 + 2 * i] = cent[c] * sa
                    dst[d0 + tt, b * 32 + 2 * i + 1] = cent[c + 1] * sa
    else:
        for tt in range(nt):
            t = t0 + tt
            for b in range(nb):
                sa = scale_table[scale_slot_cpu(scales, scales[t, b >> sshift])]
                for i in range(8):
                    c = int64(codes[t, b * 8 + i]) << 2
                    o = b * 32 + 4 * i
                    dst[d0 + tt, o] = cent[c] * sa
                    dst[d0 + tt, o + 1] = cent[c + 1] * sa
                    dst[d0 + tt, o + 2] = cent[c + 2] * sa
                    dst[d0 + tt, o + 3] = cent[c + 3] * sa


decode_tile_vq_cpu = cpu_serial(_decode_tile_vq, inline=True)


def _exact_tile(ex, exs, kind, t0, nt, table, dst, d0):
    """Exact tokens ``t0 … t0 + nt − 1`` of the plane ``ex`` (``[slots, d]``) as float32 into
    ``dst[d0:d0 + nt]``, from the dtype they are stored in (``kind``, see
    :func:`~numba_kv.ops.attention.cores._exact_value`; ``exs``: the int8 tokens' binary16
    scales ``[slots, 1]``, read for them only; ``table``: ``F16_ABS_TABLE``).  The kind is
    loop-invariant: one loop nest per kind.  Binary16 tokens decode arithmetically
    (branch-free, vectorizes) rather than through the table the CUDA kernels use: the same
    exact values, about 16 % off a ``pqo3`` step's kernel at T = 100.

    The values are :func:`~numba_kv.ops.attention.cores._exact_value` and
    :func:`~numba_kv.ops.attention.cores._exact_scale` written out rather than called: an
    inlined core that takes an array makes an NRT incref/decref pair per call, per token
    here (and so do row views), which cost about a third of a small step's kernel time.
    """
    d = dst.shape[1]
    if kind == 1:
        for tt in range(nt):
            t = t0 + tt
            for j in range(d):
                dst[d0 + tt, j] = f16_bits_to_f32_cpu(ex[t, j])
    elif kind == 2:
        for tt in range(nt):
            t = t0 + tt
            s = table[exs[t, 0]]  # the token's binary16 scale (positive)
            for j in range(d):
                dst[d0 + tt, j] = float32(ex[t, j]) * s
    else:
        for tt in range(nt):
            t = t0 + tt
            for j in range(d):
                dst[d0 + tt, j] = float32(ex[t, j])


exact_tile_cpu = cpu_serial(_exact_tile, inline=True)


def _unpack_signs_tile(signs, t0, nt, m, pm1, dst):
    """``dst[tt, j] = ±1.0`` for the ``m`` packed QJL signs of token ``t0 + tt`` (bit set =
    +1, LSB first — :func:`~numba_kv.ops.attention.cores._sign_pm1`), ``tt < nt``: each 32
    signs by the 1-bit block decoder with the codebook ``pm1 = [-1, +1]`` and scale 1 (exact),
    the bytes past a multiple of 32 signs — or rows that are not unit-stride — one by one."""
    m32 = m - m % 32 if signs.strides[1] == 1 else 0
    for tt in range(nt):
        t = t0 + tt
        for blk in range(m32 >> 5):
            decode_block_cpu(signs, t, blk * 4, 1, pm1, float32(1.0), dst, tt, blk * 32)
        for jb in range(m32 >> 3, m >> 3):
            byte = int32(signs[t, jb])
            for k in range(8):
                dst[tt, (jb << 3) + k] = sign_pm1_cpu(byte, k)


unpack_signs_tile_cpu = cpu_serial(_unpack_signs_tile, inline=True)


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
    # round to nearest by truncating a positive number (t + 128.5 > 0 on the clamped range);
    # n stays int32 (Numba widens int32 − int32 to int64, and int64 → float32 has no AVX2
    # vector instruction: the loop's conversions would go one lane at a time)
    n = np.int32(np.int32(xc * _LOG2E + np.float32(128.5)) - np.int32(128))
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
    # 2-D indexing, no row views: each view costs an atomic NRT incref/decref pair
    n4 = nt - nt % 4
    for r in range(rows):
        # scale, bias, mask: a vertical loop (selects, no branches)
        if has_bias or need_mask:
            for tt in range(nt):
                pos = int64(exact_pos[t0 + tt]) if use_exact_pos else pos_base + tt
                s = sc[r, tt] * softmax_scale
                if has_bias:
                    s = min(max(s + bias[g, r, pos], -F32_MAX), F32_MAX)  # (finite: F32_MAX)
                sc[r, tt] = s if visible_cpu(pos, q_pos0, r, q_len, need_mask) else NEG_INF
        else:
            for tt in range(nt):
                sc[r, tt] = sc[r, tt] * softmax_scale
        # tile max: four independent chains (a float max reduction does not vectorize
        # without no-NaN semantics; one chain would be latency-bound)
        m0 = NEG_INF
        m1 = NEG_INF
        m2 = NEG_INF
        m3 = NEG_INF
        for tt in range(0, n4, 4):
            m0 = sc[r, tt] if sc[r, tt] > m0 else m0
            m1 = sc[r, tt + 1] if sc[r, tt + 1] > m1 else m1
            m2 = sc[r, tt + 2] if sc[r, tt + 2] > m2 else m2
            m3 = sc[r, tt + 3] if sc[r, tt + 3] > m3 else m3
        for tt in range(n4, nt):
            m0 = sc[r, tt] if sc[r, tt] > m0 else m0
        tile_max = max(max(m0, m1), max(m2, m3))
        if tile_max == NEG_INF:
            for tt in range(nt):
                sc[r, tt] = float32(0.0)
            continue
        m_old = m[r]
        m_new = max(m_old, tile_max)
        for tt in range(nt):  # vectorized exp; masked (-inf) scores give exactly 0
            sc[r, tt] = exp_f32_cpu(sc[r, tt] - m_new)
        lsum = float32(0.0)
        for tt in range(nt):
            lsum += sc[r, tt]
        if m_new == m_old:
            # the running max held (most tiles once the first few are in): alpha would be
            # exactly 1, so skip the rescale of the row's d accumulators — same bits
            l[r] += lsum
            continue
        alpha = exp_f32_cpu(m_old - m_new)  # exactly 0 while m_old is -inf
        for j in range(acc.shape[1]):
            acc[r, j] *= alpha
        online_update_cpu(m, l, r, m_new, alpha, lsum)


softmax_tile_cpu = cpu_serial(_softmax_tile, fastmath=FASTMATH_REDUCE)


def _tile_scores(qsrc, kt, nt, sc):
    """``sc[r, tt] = qsrc[r] · kt[tt]`` for ``tt < nt`` (CPU, fast-math: the dot products
    vectorize as reductions; L1-resident tile, no BLAS call).

    Register blocking: four query rows × two key rows per pass, eight accumulators — per
    vector of ``j`` six loads feed eight FMAs (one row × one token needs two per FMA).  Four
    × four would save a little more with AVX-512's 32 vector registers but spills with
    AVX2's 16 (measured 1.7× slower there); four × two fits both.  Rows beyond a multiple
    of four go one at a time."""
    rows, d = qsrc.shape
    # a remainder of 2 or 3 rows runs as a block of four with its last row repeated
    # (clamped indices: the repeated row's dot products are computed and stored twice, the
    # same value); one row left over runs alone
    r4 = rows - rows % 4 if rows % 4 == 1 else rows
    last = rows - 1
    n2 = nt - nt % 2
    for r in range(0, r4, 4):
        r1 = min(r + 1, last)
        r2 = min(r + 2, last)
        r3 = min(r + 3, last)
        for tt in range(0, n2, 2):
            a0 = float32(0.0)
            a1 = float32(0.0)
            a2 = float32(0.0)
            a3 = float32(0.0)
            b0 = float32(0.0)
            b1 = float32(0.0)
            b2 = float32(0.0)
            b3 = float32(0.0)
            for j in range(d):
                x = kt[tt, j]
                y = kt[tt + 1, j]
                a0 += qsrc[r, j] * x
                a1 += qsrc[r1, j] * x
                a2 += qsrc[r2, j] * x
                a3 += qsrc[r3, j] * x
                b0 += qsrc[r, j] * y
                b1 += qsrc[r1, j] * y
                b2 += qsrc[r2, j] * y
                b3 += qsrc[r3, j] * y
            sc[r, tt] = a0
            sc[r1, tt] = a1
            sc[r2, tt] = a2
            sc[r3, tt] = a3
            sc[r, tt + 1] = b0
            sc[r1, tt + 1] = b1
            sc[r2, tt + 1] = b2
            sc[r3, tt + 1] = b3
        for tt in range(n2, nt):
            s0 = float32(0.0)
            s1 = float32(0.0)
            s2 = float32(0.0)
            s3 = float32(0.0)
            for j in range(d):
                k = kt[tt, j]
                s0 += qsrc[r, j] * k
                s1 += qsrc[r1, j] * k
                s2 += qsrc[r2, j] * k
                s3 += qsrc[r3, j] * k
            sc[r, tt] = s0
            sc[r1, tt] = s1
            sc[r2, tt] = s2
            sc[r3, tt] = s3
    for r in range(r4, rows):
        for tt in range(nt):
            s = float32(0.0)
            for j in range(d):
                s += qsrc[r, j] * kt[tt, j]
            sc[r, tt] = s


def _tile_pv_rows4(sc, vt, nt, acc, r):
    """``acc[r:r+4] += sc[r:r+4, :nt] @ vt[:nt]``: four rows × four value rows per pass —
    per vector of ``j`` four accumulator and four value loads feed sixteen FMAs (one row at
    a time reloads the value rows for every row).  The block of AVX-512 targets: sixteen
    weights, four accumulators and four value vectors fit its 32 registers."""
    d = acc.shape[1]
    n4 = nt - nt % 4
    for tt in range(0, n4, 4):
        w0a, w0b, w0c, w0d = sc[r, tt], sc[r, tt + 1], sc[r, tt + 2], sc[r, tt + 3]
        w1a, w1b, w1c, w1d = sc[r + 1, tt], sc[r + 1, tt + 1], sc[r + 1, tt + 2], sc[r + 1, tt + 3]
        w2a, w2b, w2c, w2d = sc[r + 2, tt], sc[r + 2, tt + 1], sc[r + 2, tt + 2], sc[r + 2, tt + 3]
        w3a, w3b, w3c, w3d = sc[r + 3, tt], sc[r + 3, tt + 1], sc[r + 3, tt + 2], sc[r + 3, tt + 3]
        for j in range(d):
            x = vt[tt, j]
            y = vt[tt + 1, j]
            z = vt[tt + 2, j]
            u = vt[tt + 3, j]
            acc[r, j] += (w0a * x + w0b * y) + (w0c * z + w0d * u)
            acc[r + 1, j] += (w1a * x + w1b * y) + (w1c * z + w1d * u)
            acc[r + 2, j] += (w2a * x + w2b * y) + (w2c * z + w2d * u)
            acc[r + 3, j] += (w3a * x + w3b * y) + (w3c * z + w3d * u)
    for tt in range(n4, nt):
        w0, w1, w2, w3 = sc[r, tt], sc[r + 1, tt], sc[r + 2, tt], sc[r + 3, tt]
        for j in range(d):
            x = vt[tt, j]
            acc[r, j] += w0 * x
            acc[r + 1, j] += w1 * x
            acc[r + 2, j] += w2 * x
            acc[r + 3, j] += w3 * x


def _tile_pv_rows2(sc, vt, nt, acc, r):
    """``acc[r:r+2] += sc[r:r+2, :nt] @ vt[:nt]``: two rows × four value rows per pass, the
    block of AVX2 targets: eight weights, two accumulators and four value vectors fit its
    16 registers, where four × four spills the weights.  With AVX2 code generation it is
    the faster block, with AVX-512 the slower (README, "Faster decoder, QJL signs and
    softmax"); a deliberate copy of :func:`_tile_pv_rows4`'s loop at another width."""
    d = acc.shape[1]
    n4 = nt - nt % 4
    for tt in range(0, n4, 4):
        w0a, w0b, w0c, w0d = sc[r, tt], sc[r, tt + 1], sc[r, tt + 2], sc[r, tt + 3]
        w1a, w1b, w1c, w1d = sc[r + 1, tt], sc[r + 1, tt + 1], sc[r + 1, tt + 2], sc[r + 1, tt + 3]
        for j in range(d):
            x = vt[tt, j]
            y = vt[tt + 1, j]
            z = vt[tt + 2, j]
            u = vt[tt + 3, j]
            acc[r, j] += (w0a * x + w0b * y) + (w0c * z + w0d * u)
            acc[r + 1, j] += (w1a * x + w1b * y) + (w1c * z + w1d * u)
    for tt in range(n4, nt):
        w0, w1 = sc[r, tt], sc[r + 1, tt]
        for j in range(d):
            x = vt[tt, j]
            acc[r, j] += w0 * x
            acc[r + 1, j] += w1 * x


#: query rows per register block of the P·V loop: 4 where code generation has AVX-512's 32
#: vector registers, 2 with AVX2's 16 (read at import; a compile-time constant of the loop)
PV_BLOCK_ROWS = 4 if codegen_has_avx512() else 2


def _tile_pv(sc, vt, nt, acc):
    """``acc[r] += Σ_tt sc[r, tt] · vt[tt]`` (CPU): blocks of :data:`PV_BLOCK_ROWS` rows by
    :func:`_tile_pv_rows4` or :func:`_tile_pv_rows2`; the remaining rows one at a time, four
    tokens per pass, so each accumulator vector is loaded and stored once per four value rows."""
    rows, d = acc.shape
    rb = rows - rows % PV_BLOCK_ROWS
    for r in range(0, rb, PV_BLOCK_ROWS):
        if PV_BLOCK_ROWS == 4:
            tile_pv_rows4_cpu(sc, vt, nt, acc, r)
        else:
            tile_pv_rows2_cpu(sc, vt, nt, acc, r)
    n4 = nt - nt % 4
    for r in range(rb, rows):
        for tt in range(0, n4, 4):
            w0 = sc[r, tt]
            w1 = sc[r, tt + 1]
            w2 = sc[r, tt + 2]
            w3 = sc[r, tt + 3]
            for j in range(d):
                acc[r, j] += (w0 * vt[tt, j] + w1 * vt[tt + 1, j]) + (w2 * vt[tt + 2, j] + w3 * vt[tt + 3, j])
        for tt in range(n4, nt):
            w = sc[r, tt]
            for j in range(d):
                acc[r, j] += w * vt[tt, j]


tile_pv_rows4_cpu = cpu_serial(_tile_pv_rows4, fastmath=FASTMATH_REDUCE, inline=True)
tile_pv_rows2_cpu = cpu_serial(_tile_pv_rows2, fastmath=FASTMATH_REDUCE, inline=True)


tile_scores_cpu = cpu_serial(_tile_scores, fastmath=FASTMATH_REDUCE)
tile_pv_cpu = cpu_serial(_tile_pv, fastmath=FASTMATH_REDUCE)
