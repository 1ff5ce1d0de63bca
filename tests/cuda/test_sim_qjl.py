"""QJL sketch kernels: CUDA kernel (simulator or GPU) vs the CPU twin."""

import numpy as np
import pytest

from numba_kv._backend import to_host
from numba_kv.ops.qjl import make_sketch, qjl_inner_product, qjl_quantize, qjl_scores_into, qjl_signs_into

from ..conftest import SIM, runner_params, to_device


def _check_signs(got_s, got_n, want_s, want_n, r2, S):
    """Bit-exact under the simulator.  On a GPU, NVVM's FMA contraction may move a float32
    sum by an ulp: only projections within rounding of 0 may flip, norms by one binary16 ulp."""
    if SIM or (np.array_equal(got_s, want_s) and np.array_equal(got_n, want_n)):
        assert np.array_equal(got_s, want_s) and np.array_equal(got_n, want_n)
        return
    m = S.shape[0]
    flips = np.unpackbits((got_s ^ want_s).reshape(-1, m // 8), axis=-1, bitorder="little").astype(bool)
    p64 = np.abs(r2.astype(np.float64) @ S.T.astype(np.float64))
    tol = 1e-5 * np.linalg.norm(r2.astype(np.float64), axis=1, keepdims=True) * np.sqrt(r2.shape[1])
    assert (p64[flips] <= np.broadcast_to(tol, p64.shape)[flips]).all()
    assert np.abs(got_n.astype(np.int64) - want_n.astype(np.int64)).max() <= 1


def _signs(rng):
    for d, m in ((40, 24), (64, 16)):
        r = rng.standard_normal((2, 5, d)).astype(np.float32)
        r[1, 2] = 0.0  # all projections 0: every bit set, norm 0
        S = make_sketch(d, m, seed=3)
        signs = np.full((2, 9, m // 8), 0xAA, np.uint8)
        norms = np.full((2, 9), 7, np.uint16)
        ds, dn = to_device(signs), to_device(norms)
        qjl_signs_into(r, S, signs, norms, 3)
        qjl_signs_into(to_device(r), to_device(S), ds, dn, 3)
        gs, gn = to_host(ds), to_host(dn)
        for a, b in ((gs, signs), (gn, norms)):  # tokens outside 3..7 untouched
            assert np.array_equal(a[:, :3], b[:, :3]) and np.array_equal(a[:, 8:], b[:, 8:])
        _check_signs(gs[:, 3:8], gn[:, 3:8], signs[:, 3:8], norms[:, 3:8], r.reshape(-1, d), S)
        # public API with the default-seed sketch copied to the device once
        x = rng.standard_normal((3, 64)).astype(np.float32)
        hs, hn = qjl_quantize(x)
        gs, gn = qjl_quantize(to_device(x))
        _check_signs(to_host(gs), to_host(gn), hs, hn, x, make_sketch(64))


def _scores(rng):
    g, rows, cap, n, m = 2, 3, 7, 5, 16
    sq = rng.standard_normal((g, rows, m)).astype(np.float32)
    signs = rng.integers(0, 256, (g, cap, m // 8), dtype=np.uint8)
    norms = rng.uniform(0, 3, (g, cap)).astype(np.float16).view(np.uint16)
    out = np.zeros((g, rows, n), np.float32)
    dout = to_device(out)
    qjl_scores_into(sq, signs, norms, n, m, out)
    qjl_scores_into(to_device(sq), to_device(signs), to_device(norms), n, m, dout)
    np.testing.assert_allclose(to_host(dout), out, rtol=1e-6, atol=1e-6)
    # public API end to end (projection on the device too)
    S = make_sketch(32, 16, seed=5)
    r = rng.standard_normal((4, 32)).astype(np.float32)
    y = rng.standard_normal((2, 32)).astype(np.float32)
    hs, hn = qjl_quantize(r, S)
    ref = qjl_inner_product(y, hs, hn, S)
    dev = qjl_inner_product(to_device(y), to_device(hs), to_device(hn), to_device(S))
    np.testing.assert_allclose(to_host(dev), ref, rtol=1e-5, atol=1e-5)


RUNNERS = {"qjl_signs": _signs, "qjl_scores": _scores}


@pytest.mark.cuda
@pytest.mark.parametrize("runner", runner_params(RUNNERS))
def test_cuda_kernel_matches_cpu_twin(runner):
    runner(np.random.default_rng(7))
