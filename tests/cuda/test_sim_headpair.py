"""``quantize_head_pair`` (both sides of a whole-head store in one launch, either code per
side, binary16 or 8-bit norms): the CUDA kernel (simulator or GPU) against the bytes of the
single-side CPU ops (``tests/ops/test_headpair.py`` holds the CPU twin to the same bytes)."""

import numpy as np
import pytest

from numba_kv._backend import to_host
from numba_kv.ops.headpair import quantize_head_pair_into

from ..conftest import runner_params, to_device
from ..ops.test_headpair import CODES, code_of, grid_base, inputs, single_side


def _quantize_pair(rng):
    """Every code pair of ``CODES`` with both norm widths, at a token offset; then the count
    updates folded in (``lens[i] += delta``; the offset read on the device)."""
    rows, n, cap, t0 = 2, 2, 5, 1
    for d, kkind, vkind in CODES:
        xk, xv = inputs(rng, rows, n, d)
        (kcode, kw), (vcode, vw) = code_of(kkind, d), code_of(vkind, d)
        for base16 in (None, grid_base(xk, xv)):
            want = (*single_side(xk, kcode, kw, cap, t0, True, base16),
                    *single_side(xv, vcode, vw, cap, t0, True, base16))
            bufs = [to_device(np.zeros_like(a)) for a in want]
            quantize_head_pair_into(to_device(xk), to_device(xv), *bufs, t0, kcode, vcode, True, base16=base16)
            for name, g, w in zip(("kcodes", "knorms", "vcodes", "vnorms"), bufs, want):
                np.testing.assert_array_equal(to_host(g), w, err_msg=f"{name} {d} {kkind} {vkind} {base16}")
            if kkind[0] != vkind[0] and base16 is not None:  # a mixed pair: the count updates too
                for at, lens, add_at, after in ((t0, [3, 4, 5], (1, 2), [3, 6, 5]),
                                                (0, [t0, 7], (1, n, 0), [t0, t0 + n])):
                    lens = to_device(np.array(lens, np.int32))
                    bufs = [to_device(np.zeros_like(a)) for a in want]
                    quantize_head_pair_into(to_device(xk), to_device(xv), *bufs, at, kcode, vcode, True,
                                            add_at=(lens, *add_at), base16=base16)
                    for g, w in zip(bufs, want):
                        np.testing.assert_array_equal(to_host(g), w)
                    assert to_host(lens).tolist() == after


RUNNERS = {"quantize_head_pair": _quantize_pair}


@pytest.mark.cuda
@pytest.mark.parametrize("runner", runner_params(RUNNERS))
def test_cuda_kernel_matches_cpu_twin(runner):
    runner(np.random.default_rng(17))
