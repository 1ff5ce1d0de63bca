"""Range statistics kernel (finite count, max |x|, max vector norm): CUDA (simulator or GPU) vs CPU twin."""

import numpy as np
import pytest

from numba_kv.ops.finite import range_stats

from ..conftest import runner_params, to_device


def _range(rng):
    for dt in (np.float16, np.float32, np.float64):
        x = (rng.standard_normal((3, 5, 64)) * 10.0).astype(dt)
        x[1, 2, 7] = -6e4 if dt == np.float16 else -7e4  # the largest |x| and the largest norm
        big = float(np.abs(x[1, 2, 7]))
        want_norm = float(np.sqrt((x.astype(np.float64) ** 2).sum(-1).max()))
        for got in (range_stats(x), range_stats(to_device(x))):
            assert got.nonfinite == 0 and got.amax == big
            assert got.max_norm == pytest.approx(want_norm, rel=1e-6)
        y = x.copy()
        y[0, 0, 0], y[2, 4, 63] = np.nan, -np.inf
        cpu, dev = range_stats(y), range_stats(to_device(y))
        assert cpu.nonfinite == dev.nonfinite == 1
        z = x.copy()
        z[2, 4, 63] = np.inf
        assert range_stats(z).nonfinite == range_stats(to_device(z)).nonfinite == 1


RUNNERS = {"range_stats": _range}


@pytest.mark.cuda
@pytest.mark.parametrize("runner", runner_params(RUNNERS))
def test_cuda_kernel_matches_cpu_twin(runner):
    runner(np.random.default_rng(5))
