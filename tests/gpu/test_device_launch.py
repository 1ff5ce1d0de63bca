"""Prepared launches (``numba_kv/_launch.py``) with real kernels and device arrays: a repeat
launches from the parameters converted the first time, reads the arrays' current contents,
and gives what Numba's own launch gives.  On a GPU (CuPy and Numba device arrays); under the
simulator every launch goes through Numba, which the same test checks."""

from __future__ import annotations

import numpy as np
from numba import cuda

from numba_kv import _backend, _launch


@cuda.jit
def axpy(x, y, a, out):
    i = cuda.grid(1)
    if i < out.shape[0]:
        out[i] = x[i] + a * y[i]


def test_repeated_launch_reads_current_contents(dev):
    rng = np.random.default_rng(0)
    n = 300
    xs = [rng.standard_normal(n).astype(np.float32) for _ in range(3)]
    y = rng.standard_normal(n).astype(np.float32)
    x_dev, y_dev, out = dev.put(xs[0]), dev.put(y), dev.put(np.zeros(n, np.float32))
    _launch.clear()
    before = _launch.stats()
    for step, x in enumerate(xs):
        if step:  # new contents in the same buffer: a repeat must read them, not a copy
            if dev.kind == "cupy":
                x_dev[...] = dev.cupy.asarray(x)
            else:
                x_dev.copy_to_device(x)
        _launch.launch(axpy, 3, 128, (x_dev, y_dev, np.float32(0.5), out))
        np.testing.assert_allclose(dev.get(out), x + np.float32(0.5) * y, rtol=1e-6)
    after = _launch.stats()
    if _backend.simulator_enabled():
        assert after["repeated"] == before["repeated"] and after["entries"] == 0
    else:
        assert after["prepared"] - before["prepared"] == 1 and after["repeated"] - before["repeated"] == 2
    # another scalar: through Numba again, the right result
    _launch.launch(axpy, 3, 128, (x_dev, y_dev, np.float32(-2.0), out))
    np.testing.assert_allclose(dev.get(out), xs[-1] - 2 * y, rtol=1e-6)
