"""``numba_kv.ops.memory.slide_windows``: one window store of both sides against a NumPy
oracle written from its docstring (the ranges it copies, in that order), for slides longer
and shorter than the kernel's batches of sixteen, evictions of one and of more tokens, new
sinks and float32 and float16 (``uint16`` bit patterns) windows; CPU, and the CUDA kernel
(simulator or GPU) where one runs."""

from __future__ import annotations

import numpy as np
import pytest

from numba_kv._backend import simulator_enabled, to_host
from numba_kv.ops.memory import slide_windows

ROWS, WIDTH, CAP = 2, 5, 48

#: (a, s_at, e_new, sinks, e_old, keep_old, keep_new): a full window of 20 evicting 1 (19 slide: a
#: batch of sixteen, ``memory.SHIFT_BATCH``, and three), 3 (17 slide), 17 (more than a batch: the
#: reads run ahead of the writes), a window filling (no eviction), new sinks, a slide shorter than a
#: batch, 40 (two batches and eight), 31 (``pqo3``'s window of 32 evicting one: a batch and a last one of
#: fifteen, whose loads past the slide read its last token and whose stores stop at it), 15 by 2 (one
#: short batch, its sources overlapping its destinations)
CASES = [(0, 0, 0, 4, 1, 19, 1), (0, 0, 0, 4, 3, 17, 3), (0, 0, 0, 2, 17, 20, 17), (0, 0, 0, 4, 0, 7, 2),
         (2, 1, 0, 4, 2, 16, 2), (0, 0, 1, 3, 4, 8, 0), (0, 0, 0, 0, 1, 40, 1), (0, 0, 0, 4, 1, 31, 1),
         (0, 0, 0, 1, 2, 15, 2)]


def _oracle(x, ex, ev, a, s_at, e_new, sinks, e_old, keep_old, keep_new, f16):
    """The store of one side in float64/NumPy, range by range as the docstring orders them."""
    ex, ev = ex.copy(), ev.copy()
    conv = (lambda v: v.astype(np.float16).view(np.uint16)) if f16 else (lambda v: v.astype(np.float32))
    back = (lambda b: b.view(np.float16).astype(np.float32)) if f16 else (lambda b: b)
    ex[:, s_at:s_at + a] = conv(x[:, :a])
    ev[:, :e_old] = back(ex[:, sinks:sinks + e_old])
    ev[:, e_old:e_old + e_new] = x[:, a:a + e_new]
    if e_old:
        ex[:, sinks:sinks + keep_old] = ex[:, sinks + e_old:sinks + e_old + keep_old].copy()
    ex[:, sinks + keep_old:sinks + keep_old + keep_new] = conv(x[:, a + e_new:a + e_new + keep_new])
    return ex, ev


def _devices():
    yield "cpu", np.asarray
    if simulator_enabled():
        from numba import cuda

        yield "cuda", cuda.to_device


@pytest.mark.parametrize("f16", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_slide_windows_matches_the_numpy_oracle(case, f16):
    a, s_at, e_new, sinks, e_old, keep_old, keep_new = case
    rng = np.random.default_rng(sum(case))
    n = a + e_new + keep_new
    xk, xv = (rng.standard_normal((ROWS, max(n, 1), WIDTH)).astype(np.float32) for _ in range(2))
    fill = rng.standard_normal((2, ROWS, CAP, WIDTH)).astype(np.float32)
    exk, exv = (f.astype(np.float16).view(np.uint16) if f16 else f for f in fill)
    evk, evv = (np.full((ROWS, max(e_old + e_new, 1), WIDTH), np.nan, np.float32) for _ in range(2))
    want = [_oracle(x, ex, ev, *case, f16) for x, ex, ev in ((xk, exk, evk), (xv, exv, evv))]
    for dev, put in _devices():
        bufs = [put(b.copy()) for b in (exk, exv, evk, evv)]
        pos = put(np.zeros(64, np.int32))
        slide_windows(put(xk), put(xv), *bufs, *case, pos, sinks, 100, keep_old + keep_new)
        got = [to_host(b) for b in bufs]
        for side, (wex, wev) in enumerate(want):
            np.testing.assert_array_equal(got[side], wex, err_msg=f"{dev} ex, side {side}")
            np.testing.assert_array_equal(got[2 + side][:, :e_old + e_new], wev[:, :e_old + e_new],
                                          err_msg=f"{dev} ev, side {side}")
        want_pos = np.r_[np.arange(sinks), 100 + np.arange(keep_old + keep_new)]
        np.testing.assert_array_equal(to_host(pos)[:want_pos.size], want_pos)
