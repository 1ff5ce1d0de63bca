"""The ``*_into`` entry points (what a cache calls) refuse a token span outside their buffers.

Their kernels do not bound-check: a negative ``t0`` wrapped to the buffer's end on the CPU
(silently overwriting the last tokens) and would write out of bounds on a GPU.  Each case
builds buffers of 5 tokens and 3 new ones: ``t0 = 2`` fits, ``-1`` and ``3`` do not, ``2.0``
is no int; a refused call leaves the buffers as they were.
"""

from __future__ import annotations

import numpy as np
import pytest

from numba_kv.ops import blockquant, headpair, headquant, headvq, norm8, qjl
from numba_kv.ops.codebook import get_codebook
from numba_kv.ops.headquant import head_codebook
from numba_kv.ops.headvq import headvq_centroids

D, CAP, N = 64, 5, 3


def _x(rng):
    return rng.standard_normal((2, N, D)).astype(np.float32)


def _cases(rng):
    """(name, call(t0), buffers written or read) per entry point."""
    x, x2 = _x(rng), _x(rng)
    cb3, hcb = get_codebook(3, "l2"), head_codebook(4, D)
    w3, wh = D * 3 // 8, D // 2
    codes, scales = np.zeros((2, CAP, w3), np.uint8), np.zeros((2, CAP, D // 32), np.uint16)
    vcodes, vscales = np.zeros_like(codes), np.zeros_like(scales)
    hcodes, hnorms = np.zeros((2, CAP, wh), np.uint8), np.zeros((2, CAP, 1), np.uint16)
    vhcodes, vhnorms = np.zeros_like(hcodes), np.zeros_like(hnorms)
    out = np.zeros((2, N, D), np.float32)
    n8 = np.zeros((2, CAP, 1), np.uint8)
    sketch = rng.standard_normal((64, D)).astype(np.float32)
    signs, qnorms = np.zeros((2, CAP, 8), np.uint8), np.zeros((2, CAP), np.uint16)
    cents = headvq_centroids(4, D)
    return [
        ("quantize_into", lambda t0: blockquant.quantize_into(x, codes, scales, t0, cb3, False), (codes, scales)),
        ("quantize_pair_into", lambda t0: blockquant.quantize_pair_into(x, x2, codes, scales, vcodes, vscales, t0,
                                                                        cb3, cb3, False), (codes, vcodes)),
        ("dequantize_into", lambda t0: blockquant.dequantize_into(codes, scales, t0, cb3, out), (out,)),
        ("quantize_head_into", lambda t0: headquant.quantize_head_into(x, hcodes, hnorms, t0, hcb, False),
         (hcodes, hnorms)),
        ("quantize_head_pair_into", lambda t0: headpair.quantize_head_pair_into(
            x, x2, hcodes, hnorms, vhcodes, vhnorms, t0, hcb, cents, False), (hcodes, vhcodes)),
        ("dequantize_head_into", lambda t0: headquant.dequantize_head_into(hcodes, hnorms, t0, hcb, out), (out,)),
        ("quantize_headvq_into", lambda t0: headvq.quantize_headvq_into(x, hcodes, hnorms, t0, cents, True),
         (hcodes, hnorms)),
        ("dequantize_headvq_into", lambda t0: headvq.dequantize_headvq_into(hcodes, hnorms, t0, cents, out), (out,)),
        ("norm8_store_into", lambda t0: norm8.norm8_store_into(hcodes[:, :N].copy(), hnorms[:, :N].copy(), 100, t0,
                                                               vhcodes, n8), (vhcodes, n8)),
        ("norm8_scale_rows_into", lambda t0: norm8.norm8_scale_rows_into(n8, 100, t0, out), (out,)),
        ("qjl_signs_into", lambda t0: qjl.qjl_signs_into(x, sketch, signs, qnorms, t0), (signs, qnorms)),
    ]


@pytest.mark.parametrize("i", range(11))
def test_into_refuses_a_span_outside_the_buffers(i):
    rng = np.random.default_rng(i)
    name, call, bufs = _cases(rng)[i]
    call(2)  # fits: tokens 2..4 of 5
    before = [b.copy() for b in bufs]
    with pytest.raises(ValueError, match=r"^t0: expected an int >= 0, got -1"):
        call(-1)
    with pytest.raises(ValueError, match=r"^t0: tokens 3\.\.5 do not fit \w+'s 5 tokens"):
        call(3)
    with pytest.raises(TypeError, match=r"^t0: expected an int, got float 2.0"):
        call(2.0)
    for b, was in zip(bufs, before):
        np.testing.assert_array_equal(b, was, err_msg=name)
