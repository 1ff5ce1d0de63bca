"""Print the README table: NMSE and bits/value of every method vs the seed baselines and PQO3.

Run: ``.venv/bin/python -m tests.compressor.report_numbers [heads seq head_dim]``
(default 8 heads × 2048 tokens × 128 dims; K and V from :mod:`tests.compressor.synth`).
"""

from __future__ import annotations

import sys
import time

import numba
import numpy as np

import numba_kv
from numba_kv.compressor import Hybrid, KVCacheCompressor, LowRank, VectorQuantization

from . import seed_reference as seed
from .synth import nmse, synth_kv


def ours(method, quant_bits=8):
    def run(x):
        comp = KVCacheCompressor(method, quant_bits)
        c = comp._compress(x, "x")  # one tensor (the public API compresses a K/V pair)
        return comp._decompress(c), c.nbytes
    return run


def pqo3(x):
    codes, scales = numba_kv.quantize_blocks(x, 3)
    return numba_kv.dequantize_blocks(codes, scales, 3), codes.nbytes + scales.nbytes


def fit_rank(make, x, budget, rank):
    """Largest ``r <= rank`` whose compressed bytes fit ``budget`` (bisection)."""
    lo, hi, best = 1, rank, 1
    while lo <= hi:
        r = (lo + hi) // 2
        if ours(make(r))(x)[1] <= budget:
            best, lo = r, r + 1
        else:
            hi = r - 1
    return best


def main(heads=8, seq=2048, head_dim=128):
    rng = np.random.default_rng(2024)
    data = {"K": synth_kv(rng, heads, seq, head_dim, "k"), "V": synth_kv(rng, heads, seq, head_dim, "v")}
    rows = []

    def add(label, fns):
        """fns: one callable for both tensors, or a dict per tensor."""
        cells = []
        t = time.perf_counter()
        for name, x in data.items():
            fn = fns[name] if isinstance(fns, dict) else fns
            xh, nb = fn(x)
            cells += [nmse(x, np.asarray(xh).reshape(x.shape)), 8.0 * nb / x.size]
        rows.append((label, cells, time.perf_counter() - t))

    add("PQO3 (`quantize_blocks(x, 3)`)", pqo3)
    r = 32
    add(f"seed LowRank({r}) — top-energy channels, f32, 0.9 rule", lambda x: seed.lowrank(x, r))
    add(f"**ours** LowRank({r}) — PCA, f16, 0.9 rule", ours(LowRank(r)))
    add(f"seed LowRank({r}) — fixed rank", lambda x: seed.lowrank(x, r, energy=False))
    add(f"**ours** LowRank({r}, energy=None)", ours(LowRank(r, energy=None)))
    for k_size, bits in ((256, 8), (16, 4)):
        add(f"seed VQ({k_size}) {bits}-bit — first-K init, 2 Lloyd iters", lambda x, k=k_size, b=bits: seed.vq(x, k, b))
        add(f"**ours** VQ({k_size}) {bits}-bit — k-means++, converged", ours(VectorQuantization(k_size), bits))
    add("**ours** VQ(256, subvector_dim=4) — product quantization", ours(VectorQuantization(256, subvector_dim=4)))
    for bits in (4, 8):
        add(f"seed Hybrid({r}, INT{bits}) — channels, per-tensor scale, 0.9 rule",
            lambda x, b=bits: seed.hybrid(x, r, b))
        add(f"**ours** Hybrid({r}, INT{bits}) — PCA, per-channel scales, 0.9 rule", ours(Hybrid(r, bits)))
        add(f"seed Hybrid({r}, INT{bits}) — fixed rank", lambda x, b=bits: seed.hybrid(x, r, b, energy=False))
        add(f"**ours** Hybrid({r}, INT{bits}, energy=None)", ours(Hybrid(r, bits, energy=None)))
        fits = {name: fit_rank(lambda q, b=bits: Hybrid(q, b, energy=None), x,
                               seed.hybrid(x, r, bits, energy=False)[1], r) for name, x in data.items()}
        add(f"**ours** Hybrid(r, INT{bits}, energy=None), r ≤ {r} fitting the seed's bytes "
            f"(K: r={fits['K']}, V: r={fits['V']})",
            {n: ours(Hybrid(fits[n], bits, energy=None)) for n in data})
    budget = {n: pqo3(x)[1] for n, x in data.items()}
    for bits, g in ((4, None), (4, 64), (8, None)):
        def make(q, bits=bits, g=g):
            return Hybrid(q, bits, group_size=g, energy=None)

        fits = {n: fit_rank(make, x, budget[n], head_dim) for n, x in data.items()}
        add(f"**ours** Hybrid(r, INT{bits}, group_size={g}) at ≤ 3.5 bits/value (K: r={fits['K']}, "
            f"V: r={fits['V']})", {n: ours(Hybrid(fits[n], bits, group_size=g, energy=None)) for n in data})

    print(f"data: tests/compressor/synth.py, K and V each {heads} heads × {seq} tokens × {head_dim} dims; "
          f"numba {numba.__version__}, {numba.get_num_threads()} threads ({numba.threading_layer()})\n")
    print("| method | K NMSE | K bits/value | V NMSE | V bits/value | time (s) |")
    print("|---|---|---|---|---|---|")
    for label, c, dt in rows:
        print(f"| {label} | {c[0]:.3g} | {c[1]:.3f} | {c[2]:.3g} | {c[3]:.3f} | {dt:.1f} |")


if __name__ == "__main__":
    main(*[int(a) for a in sys.argv[1:]])
