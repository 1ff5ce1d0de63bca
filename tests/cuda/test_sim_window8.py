"""The one-launch int8 window store (``slide_windows8``) and the key-mean twins: CUDA
(simulator or GPU) against the CPU twin, bit for bit.  The CPU twins are held to NumPy
oracles in ``tests/ops/test_window8.py`` and ``tests/ops/test_keymean.py``."""

import numpy as np
import pytest

import numba_kv
from numba_kv._backend import to_host

from ..conftest import runner_params, to_device
from ..ops.test_window8 import SLIDE8_CASES, window8_state


def _slide8(rng):
    """Each rotation on one of the cases (a flush with key centering, new sinks, tokens that
    skip the window), the range records and the count copy folded in; blocks of 64 (``d``: a
    GPU's block, every butterfly stage across threads), 32, 4 and 1 threads."""
    from numba_kv.caches._window import StorePlan
    from numba_kv.ops.hadamard import SIGNS32
    from numba_kv.ops.headquant import head_signs
    from numba_kv.ops.window8 import slide_windows8

    rows, cap, d = 2, 22, 64
    for rot, case, threads in ((1, 0, 64), (2, 2, 32), (0, 1, 4), (2, 0, 1)):
        n, plan, s_at, sinks, (p_sink, p_base, p_win) = SLIDE8_CASES[case]
        plan = StorePlan(*plan)
        xk, xv = (rng.standard_normal((2, rows, n, d)) * 2).astype(np.float32)
        xv[0, 0] *= np.float32(5e-6)  # subnormal binary16 scales (ops/absmax8.py: raised a step, or from 0)
        xv[1, -1] *= np.float32(1e-9)
        kmean = (rng.standard_normal((rows, 1, d)) * 0.5).astype(np.float32) if case != 1 else None
        host = [xk, xv, kmean, *window8_state(rng, rows, cap, d), *np.full((2, rows, plan.compressed + 1, d), -9.0,
                                                                              np.float32)]
        pos = np.full(p_sink + p_win + 2, -1, np.int32)
        fold = rng.standard_normal(rows * n * d).astype(np.float32)
        fold[-1] = -1e3  # the largest |x| last: the grid-stride reaches it
        runs = []
        for f in (lambda a: a, to_device):
            arrays = [None if a is None else f(a.copy()) for a in host]
            held = min(p_base, 4)
            p, cnt, acc = f(pos.copy()), f(np.array([-5, held, 3], np.int32)), f(np.array([7], np.uint64))
            bits = f(fold.view(np.uint32).copy())
            ranges = (bits, np.uint32(0x7FFFFFFF), acc) + (bits, np.uint32(0), acc) * 2
            signs = f(head_signs(d) if rot == 1 else SIGNS32)
            with numba_kv.knobs(cuda_threads_sim=threads):
                slide_windows8(*arrays, plan, s_at, sinks, rot, signs, p, (p_sink, p_base - held, p_win), ranges,
                               count=(cnt, 1, 0))
            runs.append([to_host(a) for a in (*arrays[3:], p, cnt, acc)])
        for got, want in zip(runs[1], runs[0]):
            np.testing.assert_array_equal(got, want)
        assert runs[0][-2].tolist() == [held, held, 3]
        assert int(runs[0][-1][0]) == int(np.float32(1e3).view(np.uint32))


def _keymean(rng):
    from numba_kv.ops.keymean import add_channel_into, channel_mean_into

    x = rng.standard_normal((3, 9, 64)).astype(np.float32)
    m = np.empty((3, 1, 64), np.float32)
    channel_mean_into(x, m)
    dm = to_device(np.zeros_like(m))
    channel_mean_into(to_device(x), dm)
    np.testing.assert_array_equal(to_host(dm), m)
    for sign in (-1, 1):
        want = add_channel_into(x, m, sign, np.empty_like(x))
        got = add_channel_into(to_device(x), dm, sign, to_device(np.empty_like(x)))
        np.testing.assert_array_equal(to_host(got), want)


RUNNERS = {"slide_windows8": _slide8, "channel_mean": _keymean, "add_channel": _keymean}


@pytest.mark.cuda
@pytest.mark.parametrize("runner", runner_params(RUNNERS))
def test_cuda_kernel_matches_cpu_twin(runner):
    runner(np.random.default_rng(8))
