"""Ours vs the seed's simplistic methods (reimplemented in ``seed_reference``) and vs PQO3,
on realistic synthetic K/V (low-rank structure, outlier channels, outlier tokens).

Each comparison asserts *strictly lower NMSE at equal or fewer bytes*.  The README table
comes from ``python -m tests.compressor.report_numbers`` (larger shapes, same code).
"""

import numpy as np
import pytest

import numba_kv
from numba_kv.compressor import Hybrid, KVCacheCompressor, LowRank, VectorQuantization

from . import seed_reference as seed
from .synth import nmse, synth_kv


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(2024)
    return {"k": synth_kv(rng, 2, 1024, 64, "k"), "v": synth_kv(rng, 2, 1024, 64, "v")}


def ours(method, x, quant_bits=8):
    comp = KVCacheCompressor(method, quant_bits)
    c = comp.compress_kv_3d(x, x)
    xh, _ = comp.decompress_kv_3d(c)
    return nmse(x, xh), c.k.nbytes


def _better(mine, base):
    (e1, b1), (e0, b0) = mine, base
    assert b1 <= b0, f"ours uses more bytes: {b1} > {b0}"
    assert e1 < e0, f"ours is not better: NMSE {e1:.4g} >= {e0:.4g}"


@pytest.mark.parametrize("part", ["k", "v"])
def test_lowrank_beats_channel_selection(data, part):
    x = data[part]
    base = seed.lowrank(x, 16)
    _better(ours(LowRank(16), x), (nmse(x, base[0]), base[1]))  # both with the 0.9 rule
    base = seed.lowrank(x, 16, energy=False)
    _better(ours(LowRank(16, energy=None), x), (nmse(x, base[0]), base[1]))  # same rank


@pytest.mark.parametrize("part", ["k", "v"])
@pytest.mark.parametrize("k_size, bits", [(64, 8), (16, 4)])
def test_vq_beats_two_iteration_kmeans(data, part, k_size, bits):
    x = data[part]
    base = seed.vq(x, k_size, bits)
    _better(ours(VectorQuantization(k_size), x, bits), (nmse(x, base[0]), base[1]))


def _fit_bytes(make, x, budget, rank):
    """``ours(make(r))`` for a rank ``r <= rank`` whose bytes fit ``budget``.  Bytes grow about
    linearly with ``r`` (plus a small fixed part), so ``budget / (bytes / r)`` never
    overshoots the largest fitting rank: one or two compressions instead of a search."""
    r = rank
    while r > 1:
        mine = ours(make(r), x)
        if mine[1] <= budget:
            return mine
        r = max(1, min(r - 1, int(budget * r / mine[1])))
    return ours(make(1), x)


@pytest.mark.parametrize("part", ["k", "v"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("energy", [True, False], ids=["seed-0.9-rule", "fixed-rank"])
def test_hybrid_beats_per_tensor_int(data, part, bits, energy):
    x = data[part]
    base = seed.hybrid(x, 16, bits, energy=energy)
    b0 = (nmse(x, base[0]), base[1])
    # same rank cap; ours also stores a basis, so take the largest rank that fits the seed's bytes
    _better(_fit_bytes(lambda r: Hybrid(r, bits, energy=None), x, b0[1], 16), b0)


def test_hybrid_beats_pqo3_on_keys_at_equal_bytes(data):
    x = data["k"]
    codes, scales = numba_kv.quantize_blocks(x, 3)
    pqo3 = (nmse(x, numba_kv.dequantize_blocks(codes, scales, 3)), codes.nbytes + scales.nbytes)
    assert 8 * pqo3[1] / x.size == 3.5
    mine = ours(Hybrid(24, 4, energy=None), x)
    _better(mine, pqo3)
