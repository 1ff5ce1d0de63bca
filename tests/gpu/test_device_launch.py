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
    else:  # (the repeats by the driver, from the parameter buffer the entry packed once)
        assert after["prepared"] - before["prepared"] == 1 and after["repeated"] - before["repeated"] == 2
        assert after["direct"] - before["direct"] == 2
    # another scalar: through Numba again, the right result
    _launch.launch(axpy, 3, 128, (x_dev, y_dev, np.float32(-2.0), out))
    np.testing.assert_allclose(dev.get(out), xs[-1] - 2 * y, rtol=1e-6)


def test_kernels_run_on_the_launch_stream(dev):
    """An op inside ``launch_stream`` (a stream of the array kind's library) gives the result it
    gives on the default stream."""
    import numba_kv
    from numba_kv.ops.blockquant import quantize_blocks

    x = np.random.default_rng(1).standard_normal((2, 3, 64)).astype(np.float32)
    c, s = quantize_blocks(x, 3)
    stream = dev.cupy.cuda.Stream(non_blocking=True) if dev.kind == "cupy" else cuda.stream()
    with numba_kv.launch_stream(stream):
        cd, sd = quantize_blocks(dev.put(x), 3)
    stream.synchronize()
    assert np.array_equal(dev.get(cd), c) and np.array_equal(dev.get(sd), s)


def test_repeats_on_a_launch_stream_run_there_in_order(dev):
    """Repeats inside ``launch_stream`` (on a GPU: the driver's launch from the packed buffer,
    on that stream) run in the order launched: each reads what the one before wrote."""
    import numba_kv

    n = 1000
    x = dev.put(np.ones(n, np.float32))
    out = dev.put(np.zeros(n, np.float32))
    stream = dev.cupy.cuda.Stream(non_blocking=True) if dev.kind == "cupy" else cuda.stream()
    _launch.clear()
    with numba_kv.launch_stream(stream):
        for _ in range(5):  # out = x + 1·out, five times in a row: 5
            _launch.launch(axpy, 8, 128, (x, out, np.float32(1.0), out))
    stream.synchronize()
    np.testing.assert_array_equal(dev.get(out), np.full(n, 5, np.float32))
    if not _backend.simulator_enabled():
        assert _launch.stats()["direct"] >= 4
