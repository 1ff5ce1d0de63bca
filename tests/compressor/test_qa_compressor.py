"""QA of the compressor and its ops: argument checks that used to let bad values through,
and round trips against plain NumPy (SVD, codeword lookup)."""

import numpy as np
import pytest

from numba_kv.compressor import KVCacheCompressor, LowRank, VectorQuantization
from numba_kv.ops import lowrank, vq


def test_vq_decode_checks_codes_and_codebooks(rng):
    cb = rng.standard_normal((2, 4, 3)).astype(np.float32)  # G = M = 2 shared tables, K = 4, ds = 3
    codes = rng.integers(0, 4, (3, 5, 2)).astype(np.uint8)
    want = np.concatenate([cb[0][codes[..., 0]], cb[1][codes[..., 1]]], axis=-1)
    np.testing.assert_array_equal(vq.decode(codes, cb), want)
    bad = codes.copy()
    bad[1, 2, 1] = 4  # one past the codebook: the kernel would read beyond it
    with pytest.raises(ValueError, match=r"^codes: expected values < K=4 .*got 4"):
        vq.decode(bad, cb)
    with pytest.raises(ValueError, match=r"^codebooks: expected \(G, K, ds\) with G = M = 2"):
        vq.decode(codes, cb[:1])  # one table for two sub-spaces
    with pytest.raises(ValueError, match=r"^codebooks: expected \(G, K, ds\)"):
        vq.decode(codes, cb[0])  # 2-D


def test_method_flags_and_tolerance_are_checked():
    with pytest.raises(TypeError, match=r"^per_head: expected a bool, got str 'no'"):
        VectorQuantization(4, per_head="no")  # truthy: it switched per-head codebooks on
    with pytest.raises(ValueError, match=r"^tol: expected a float >= 0, got nan"):
        VectorQuantization(4, tol=float("nan"))  # NaN disabled the inertia stop rule silently
    assert VectorQuantization(4, per_head=np.bool_(True)).per_head


def test_numpy_energy_is_an_energy(rng):
    """``energy=np.float32(0.5)`` was refused as "expected a float in (0, 1]"; it picks the rank
    NumPy's SVD says captures half of the variance."""
    x = rng.standard_normal((1, 1, 64, 8)).astype(np.float32) * np.geomspace(8, 1, 8).astype(np.float32)
    c = KVCacheCompressor(LowRank(8, energy=np.float32(0.5), dtype="float32"))
    s2 = np.linalg.svd(x[0, 0] - x[0, 0].mean(0), compute_uv=False).astype(np.float64) ** 2
    want = int(np.argmax(np.cumsum(s2) >= 0.5 * s2.sum())) + 1
    assert c.compress_kv(x, x).k.meta["rank"] == want


def test_lowrank_ops_name_the_bad_argument(rng):
    x = rng.standard_normal((2, 5, 8)).astype(np.float32)
    mean, gram = lowrank.channel_stats(x)
    comp, _ = lowrank.fit_components(mean, gram, 5, 3, energy=None)
    coef = lowrank.project(x, mean, comp)
    with pytest.raises(ValueError, match=r"^mean: expected a 2-D array"):
        lowrank.reconstruct(coef, mean[0], comp)  # was blamed on coef ("leading axis of 1 or 8")
    with pytest.raises(ValueError, match=r"^rows: expected an int >= 0, got -1"):
        lowrank.reconstruct(coef[:1], mean[:1], comp[:1], rows=-1)
    with pytest.raises(ValueError, match=r"^rank: expected an int >= 1, got 0"):
        lowrank.fit_components(mean, gram, 5, 0)  # returned an empty basis
    with pytest.raises(ValueError, match=r"^energy: expected None or a float in \(0, 1\]"):
        lowrank.fit_components(mean, gram, 5, 2, energy=2.0)


@pytest.mark.parametrize("r", [1, 3, 8])
def test_lowrank_is_the_truncated_svd(rng, r):
    """float32 LowRank with a fixed rank reconstructs each (batch, head) row as NumPy's rank-r
    truncated SVD of the centred tokens plus the mean (Eckart–Young)."""
    x = rng.standard_normal((2, 3, 40, 8)).astype(np.float32) * np.geomspace(4, 0.5, 8).astype(np.float32)
    c = KVCacheCompressor(LowRank(r, energy=None, dtype="float32"))
    xh, _ = c.decompress_kv(c.compress_kv(x, x))
    for b in range(2):
        for h in range(3):
            a = x[b, h].astype(np.float64)
            mu = a.mean(0)
            u, s, vt = np.linalg.svd(a - mu, full_matrices=False)
            np.testing.assert_allclose(xh[b, h], mu + (u[:, :r] * s[:r]) @ vt[:r], rtol=0, atol=2e-5)
