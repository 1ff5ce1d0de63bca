"""One-thread time of each piece of the fused CPU decode attention's tile loop, called the way
the kernel calls it: decoding a tile of K (or V) codes, the scores of the GQA group's query
rows, the online-softmax step and the P·V accumulation, each over every 32-token tile of
``T`` tokens × 8 KV heads (4 query rows per KV head, d = 128), min of ``--repeat`` sweeps.

    .venv/bin/python benchmarks/profile_attention_tiles.py [--tokens 32768] [--bits 3] [--repeat 15]

AVX2 code generation: prefix ``env $(.venv/bin/python -m numba_kv.info --avx2-env)
NUMBA_CACHE_DIR=$PWD/.numba_cache_avx2``.  An older revision: run this file with
``PYTHONPATH`` on a checkout of it (the four helpers kept their names and signatures, but
for the decoder's byte table ``lut`` of 4-bit codes, added later: revisions without it are
called without it).
"""

import argparse
import inspect
import time

import numpy as np
from numba import float32, njit

from numba_kv.info import provenance_line
from numba_kv.ops.attention import F16_ABS_TABLE
from numba_kv.ops.attention.cpu import decode_tile_simd_cpu, softmax_tile_cpu, tile_pv_cpu, tile_scores_cpu
from numba_kv.ops.attention.kernels import CPU_TILE
from numba_kv.ops.blockquant import quantize_blocks
from numba_kv.ops.codebook import get_codebook

HEADS, ROWS, D = 8, 4, 128


#: whether this revision's decoder takes the byte table of 4-bit codes (``lut``, last argument)
HAS_LUT = "lut" in inspect.signature(getattr(decode_tile_simd_cpu, "py_func", decode_tile_simd_cpu)).parameters


@njit
def _decode_lut(codes, scales, cent, bits, table, lut):
    kt = np.empty((CPU_TILE, D), np.float32)
    s = float32(0.0)
    for g in range(codes.shape[0]):
        for t0 in range(0, codes.shape[1], CPU_TILE):
            decode_tile_simd_cpu(codes[g], scales[g], t0, CPU_TILE, cent, bits, D // 32, 0, table, kt, 0, lut)
            s += kt[0, 0]
    return s


@njit
def _decode_plain(codes, scales, cent, bits, table, lut):
    kt = np.empty((CPU_TILE, D), np.float32)
    s = float32(0.0)
    for g in range(codes.shape[0]):
        for t0 in range(0, codes.shape[1], CPU_TILE):
            decode_tile_simd_cpu(codes[g], scales[g], t0, CPU_TILE, cent, bits, D // 32, 0, table, kt, 0)
            s += kt[0, 0]
    return s


_decode = _decode_lut if HAS_LUT else _decode_plain


def byte_table(cent: np.ndarray, bits: int) -> np.ndarray:
    """The decoder's table of 4-bit codes, as the kernel builds it (filled at 4 bits only;
    ``[256, 2]`` float32, never read at other widths)."""
    lut = np.zeros((256, 2), np.float32)
    if bits == 4:
        from numba_kv.ops.attention.cpu import nibble_lut_cpu

        nibble_lut_cpu(cent, lut)
    return lut


@njit
def _scores(q, kt, n_tiles):
    sc = np.empty((ROWS, CPU_TILE), np.float32)
    s = float32(0.0)
    for _ in range(n_tiles):
        tile_scores_cpu(q, kt, CPU_TILE, sc)
        s += sc[0, 0]
    return s


@njit
def _pv(w, kt, n_tiles):
    acc = np.zeros((ROWS, D), np.float32)
    for _ in range(n_tiles):
        tile_pv_cpu(w, kt, CPU_TILE, acc)
    return acc[0, 0]


@njit
def _softmax(sc0, n_tiles):
    sc = sc0.copy()
    acc = np.zeros((ROWS, D), np.float32)
    m = np.full(ROWS, -np.inf, np.float32)
    l = np.zeros(ROWS, np.float32)
    pos = np.zeros(1, np.int32)
    bias = np.zeros((1, 1, 1), np.float32)
    for _ in range(n_tiles):
        sc[:] = sc0
        softmax_tile_cpu(sc, CPU_TILE, float32(D ** -0.5), 0, False, bias, False, 0, 1, 0, pos, False, 0, m, l, acc)
    return l[0]


def _best_ms(fn, args, repeat):
    fn(*args)  # compile
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--bits", type=int, default=3, choices=(1, 2, 3, 4))
    p.add_argument("--repeat", type=int, default=15)
    a = p.parse_args(argv)
    rng = np.random.default_rng(0)
    codes, scales = quantize_blocks(rng.standard_normal((HEADS, a.tokens, D)).astype(np.float32), bits=a.bits)
    cent = np.zeros(16, np.float32)
    cent[:1 << a.bits] = get_codebook(a.bits, "maxnorm").centroids
    table = np.asarray(F16_ABS_TABLE, np.float32)
    q = rng.standard_normal((ROWS, D)).astype(np.float32)
    kt = rng.standard_normal((CPU_TILE, D)).astype(np.float32)
    w = (0.01 * rng.standard_normal((ROWS, CPU_TILE))).astype(np.float32)
    n_tiles = HEADS * a.tokens // CPU_TILE
    print(provenance_line())
    print(f"T = {a.tokens}, {a.bits} bits, {HEADS} KV heads x {ROWS} rows, d = {D}, {n_tiles} tiles; one thread, "
          f"min of {a.repeat} (ms)")
    lut = byte_table(cent, a.bits)
    parts = {"decode K (or V)": _best_ms(_decode, (codes, scales, cent, a.bits, table, lut), a.repeat),
             "scores": _best_ms(_scores, (q, kt, n_tiles), a.repeat),
             "online softmax": _best_ms(_softmax, (w, n_tiles), a.repeat),
             "P.V": _best_ms(_pv, (w, kt, n_tiles), a.repeat)}
    for name, ms in parts.items():
        print(f"  {name:16s} {ms:7.2f}")
    print(f"  {'sum (K and V)':16s} {sum(parts.values()) + parts['decode K (or V)']:7.2f}")


if __name__ == "__main__":
    main()
