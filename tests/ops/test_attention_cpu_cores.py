"""CPU-only cores of the fused decode attention: the branch-free float32 exp, the vector
(8-codes-at-a-time) tile decoder and the register-blocked score and P·V loops, against
independent NumPy computations."""

import numpy as np
import pytest
from numba import njit

import numba_kv._jit as jit_module
from numba_kv._jit import cpu_serial, specialize
from numba_kv.ops.attention import F16_ABS_TABLE
from numba_kv.ops.attention import cpu as attention_cpu
from numba_kv.ops.attention.cores import load_token_fast_cpu
from numba_kv.ops.attention.cpu import (
    PV_BLOCK_ROWS,
    decode_tile_mixed_cpu,
    decode_tile_simd_cpu,
    exp_f32_cpu,
    nibble_lut_cpu,
    tile_pv_cpu,
    tile_pv_rows2_cpu,
    tile_pv_rows4_cpu,
    tile_scores_cpu,
    unpack_signs_tile_cpu,
)
from numba_kv.ops.blockquant import dequantize_blocks, quantize_blocks
from numba_kv.ops.codebook import get_codebook
from numba_kv.ops.hadamard import rotate32


@njit
def _exp_all(x, out):
    for i in range(x.shape[0]):  # a loop: the vectorized form of the core
        out[i] = exp_f32_cpu(x[i])


def test_exp_f32_accuracy_over_whole_range():
    """Max relative error vs float64 ``np.exp`` a few ulp wherever the float32 result is normal."""
    x = np.linspace(-87.3, 88.7, 3_000_001, dtype=np.float32)
    x = np.concatenate([x, np.float32([-1e-30, 1e-30, -1e-7, 1e-7, np.float32(0.5) * np.float32(np.log(2.0))])])
    out = np.empty_like(x)
    _exp_all(x, out)
    ref = np.exp(x.astype(np.float64))
    normal = (ref >= np.finfo(np.float32).tiny) & (ref <= np.finfo(np.float32).max)
    rel = np.abs(out[normal].astype(np.float64) - ref[normal]) / ref[normal]
    assert normal.sum() > 3_000_000
    assert rel.max() <= 3 * 2.0 ** -24  # <= 3 ulp (half-ulp units of 2**-24 relative)


def test_exp_f32_special_values():
    x = np.float32([0.0, -0.0, -np.inf, -88.0, -100.0, -1e30, 89.0, np.inf, np.nan, 1.0])
    out = np.empty_like(x)
    _exp_all(x, out)
    assert out[0] == 1.0 and out[1] == 1.0
    assert np.all(out[2:6] == 0.0)  # masked scores (-inf) and underflow give exactly 0
    assert np.isposinf(out[6]) and np.isposinf(out[7])
    assert np.isnan(out[8])
    assert abs(out[9] - np.e) <= 2 * np.spacing(np.float32(np.e))


def _strided(a: np.ndarray) -> np.ndarray:
    """``a`` as a view whose rows have stride 2 (every other byte of a buffer twice as wide)."""
    buf = np.zeros((a.shape[0], 2 * a.shape[1]), a.dtype)
    buf[:, ::2] = a
    return buf[:, ::2]


#: the tile decoder with the other 4-bit loop than this host's (byte table / permutes): both
#: are tested on every host, whichever one it runs
OTHER_DECODE_TILE = cpu_serial(specialize(attention_cpu._decode_tile_simd, "_other_nibble_loop",
                                          NIBBLE_TABLE=not attention_cpu.NIBBLE_TABLE))


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("t0, nt", [(0, 32), (5, 17), (40, 1)])
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("decode_tile", [decode_tile_simd_cpu, OTHER_DECODE_TILE], ids=["this_host", "other_loop"])
def test_decode_tile_matches_dequantize(bits, t0, nt, strided, decode_tile):
    """Token rows decoded by the vector decoder are the rotated-domain values of
    :func:`dequantize_blocks` (which inverse-rotates): rotating those forward gives them back.
    Code rows that are not unit-stride (the scalar fallback) decode the same.  Either 4-bit
    loop (the byte table of Zen 1 hosts, the permutes elsewhere) gives the same bits."""
    rng = np.random.default_rng(bits * 100 + t0)
    d, T = 128, 48
    x = rng.standard_normal((T, d)).astype(np.float32) * rng.uniform(0.1, 10, (T, 1)).astype(np.float32)
    codes, scales = quantize_blocks(x, bits)
    if strided:
        codes = _strided(codes)
    cent = np.zeros(16, np.float32)
    cb = get_codebook(bits, "maxnorm").centroids
    cent[:len(cb)] = cb
    dst = np.full((32, d), np.nan, np.float32)
    lut = np.full((256, 2), np.nan, np.float32)
    nibble_lut_cpu(cent, lut)  # the byte table of 4-bit codes (read only at 4 bits)
    decode_tile(codes, scales, t0, nt, cent, bits, d // 32, 0, F16_ABS_TABLE, dst, 0, lut)
    want = rotate32(dequantize_blocks(codes, scales, bits)[t0:t0 + nt])
    np.testing.assert_allclose(dst[:nt], want, rtol=2e-6, atol=2e-6 * float(np.abs(want).max()))
    assert np.all(np.isnan(dst[nt:]))  # rows past nt untouched
    scalar = np.empty((nt, d), np.float32)
    for tt in range(nt):  # the scalar loader the CUDA kernels use: bit-identical values
        load_token_fast_cpu(codes[t0 + tt], scales[t0 + tt], cent, bits, d // 32, 0, F16_ABS_TABLE, scalar[tt])
    assert np.array_equal(dst[:nt], scalar)


def test_nibble_lut_holds_both_codes_of_every_byte():
    """Entry ``c`` of the 4-bit byte table is the pair (low nibble, high nibble) of centroids,
    the order in which :mod:`numba_kv.ops.bitpack` packs two 4-bit codes into a byte."""
    cent = np.arange(16, dtype=np.float32) * np.float32(0.25) - np.float32(2.0)
    lut = np.full((256, 2), np.nan, np.float32)
    nibble_lut_cpu(cent, lut)
    c = np.arange(256)
    assert np.array_equal(lut[:, 0], cent[c % 16]) and np.array_equal(lut[:, 1], cent[c // 16])


@pytest.mark.parametrize("widths", [(2, 3, 3, 2), (4, 1, 3, 2), (3, 4, 4, 3)])
@pytest.mark.parametrize("t0, nt", [(0, 32), (7, 9)])
@pytest.mark.parametrize("strided", [False, True])
def test_decode_tile_mixed_matches_dequantize(widths, t0, nt, strided):
    """Blocks of different widths (pqo2.5 / pqo3.5 style layouts): each block decodes to the
    rotated-domain values of :func:`dequantize_blocks` of that block alone, at its byte offset."""
    rng = np.random.default_rng(sum(widths) + t0)
    T = 48
    x = rng.standard_normal((T, 32 * len(widths))).astype(np.float32) * 3
    codes, scales, want, cent2 = [], [], [], np.zeros((len(widths), 16), np.float32)
    for b, bits in enumerate(widths):
        c, s = quantize_blocks(x[:, 32 * b:32 * (b + 1)], bits)
        codes.append(c)
        scales.append(s)
        want.append(rotate32(dequantize_blocks(c, s, bits)))
        cb = get_codebook(bits, "maxnorm").centroids
        cent2[b, :len(cb)] = cb
    bits_b = np.asarray(widths, np.int64)
    off_b = np.concatenate([[0], np.cumsum(4 * bits_b)[:-1]]).astype(np.int64)
    dst = np.full((32, x.shape[1]), np.nan, np.float32)
    codes, scales = (np.ascontiguousarray(np.concatenate(a, 1)) for a in (codes, scales))
    if strided:
        codes = _strided(codes)
    decode_tile_mixed_cpu(codes, scales, t0, nt, cent2, bits_b, off_b, 0, F16_ABS_TABLE, dst)
    want = np.concatenate(want, 1)[t0:t0 + nt]
    np.testing.assert_allclose(dst[:nt], want, rtol=2e-6, atol=2e-6 * float(np.abs(want).max()))
    assert np.all(np.isnan(dst[nt:]))


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("nt", [32, 17, 3, 1])
def test_tile_scores_match_numpy(rows, nt):
    """Scores of every (query row, token) of a tile — the 4 × 2 blocks, the odd token and the
    rows beyond a multiple of four — are the float64 dot products to float32 accuracy."""
    rng = np.random.default_rng(rows * 100 + nt)
    q = rng.standard_normal((rows, 128)).astype(np.float32)
    kt = rng.standard_normal((32, 128)).astype(np.float32)
    sc = np.full((rows, 32), np.nan, np.float32)
    tile_scores_cpu(q, kt, nt, sc)
    want = q.astype(np.float64) @ kt[:nt].astype(np.float64).T
    np.testing.assert_allclose(sc[:, :nt], want, rtol=0, atol=1e-5 * np.abs(q).sum(1).max() * np.abs(kt).max())
    assert np.all(np.isnan(sc[:, nt:]))  # columns past nt untouched


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("nt", [32, 17, 3, 1])
def test_tile_pv_matches_numpy(rows, nt):
    """``acc += w @ V`` over a tile: the selected P·V (blocks of ``PV_BLOCK_ROWS`` rows) and
    both register blocks (four and two rows) on their own, against float64 NumPy."""
    rng = np.random.default_rng(rows * 100 + nt + 7)
    w = rng.uniform(0, 1, (rows, 32)).astype(np.float32)
    vt = rng.standard_normal((32, 128)).astype(np.float32)
    acc0 = rng.standard_normal((rows, 128)).astype(np.float32)
    want = acc0.astype(np.float64) + w[:, :nt].astype(np.float64) @ vt[:nt].astype(np.float64)
    tol = 1e-5 * (1 + nt)
    acc = acc0.copy()
    tile_pv_cpu(w, vt, nt, acc)
    np.testing.assert_allclose(acc, want, rtol=0, atol=tol)
    for block, fn in ((4, tile_pv_rows4_cpu), (2, tile_pv_rows2_cpu)):
        acc = acc0.copy()
        for r in range(0, rows - rows % block, block):
            fn(w, vt, nt, acc, r)
        done = rows - rows % block
        np.testing.assert_allclose(acc[:done], want[:done], rtol=0, atol=tol)
        assert np.array_equal(acc[done:], acc0[done:])  # rows outside the blocks untouched


def test_pv_block_follows_the_code_generation_target():
    """Four-row P·V blocks exactly when the code generation has AVX-512 (32 registers)."""
    assert PV_BLOCK_ROWS == (4 if jit_module.codegen_has_avx512() else 2)


@pytest.mark.parametrize("m", [8, 32, 40, 128, 136])
@pytest.mark.parametrize("strided", [False, True])
def test_unpack_signs_tile_matches_unpackbits(m, strided):
    """Packed QJL signs (LSB first, bit set = +1) unpacked to ±1.0 — the 1-bit block decoder
    for each 32 signs, bytes past a multiple of 32 and non-unit-stride rows one by one —
    equal ``2·np.unpackbits(bitorder="little") − 1``."""
    rng = np.random.default_rng(m)
    signs = rng.integers(0, 256, (48, m // 8), dtype=np.uint8)
    if strided:
        signs = _strided(signs)
    pm1 = np.array([-1.0, 1.0], np.float32)
    dst = np.full((32, m), np.nan, np.float32)
    unpack_signs_tile_cpu(signs, 5, 17, m, pm1, dst)
    want = 2.0 * np.unpackbits(signs[5:22], axis=1, bitorder="little").astype(np.float32) - 1.0
    assert np.array_equal(dst[:17], want)
    assert np.all(np.isnan(dst[17:]))
