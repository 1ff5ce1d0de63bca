"""``quantize_head_pair_into`` (both sides of a whole-head store in one call) against the
single-side ops it stands for: per side the scalar head code (``quantize_head_into``) or the
head VQ code (``quantize_headvq_into``), with binary16 norms or 8-bit norms
(``norm8_store_into`` of the single-side op's scratch planes) — bit for bit, at a token
offset, nothing else written.  The single-side ops are checked against the NumPy reference
in ``test_headquant.py``, ``test_headvq.py`` and ``test_norm8.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

from numba_kv.ops.headpair import quantize_head_pair_into
from numba_kv.ops.headquant import head_codebook, quantize_head_into
from numba_kv.ops.headvq import headvq_centroids, quantize_headvq_into
from numba_kv.ops.norm8 import norm8_base16, norm8_store_into

#: (d, key code, value code): ("s", bits) the scalar head code, ("vq", bits) the head VQ code
CODES = [(64, ("s", 4), ("s", 3)), (64, ("vq", 4), ("vq", 2)), (64, ("vq", 4), ("s", 3)),
         (32, ("s", 2), ("vq", 2)), (128, ("vq", 2), ("vq", 4))]
CODE_IDS = ["s4-s3", "vq4-vq2", "vq4-s3", "s2-vq2", "vq2-vq4"]


def code_of(kind: tuple, d: int):
    """The op's code argument and the width of a vector's code bytes."""
    name, bits = kind
    return (head_codebook(bits, d), d * bits // 8) if name == "s" else (headvq_centroids(bits, d), d * bits // 8)


def single_side(x3, code, width: int, cap: int, t0: int, unbiased: bool, base16: int | None):
    """The codes and norms ``[rows, cap, ·]`` one side's own ops store at ``t0``."""
    rows, n, _ = x3.shape
    quantize = quantize_head_into if not isinstance(code, np.ndarray) else quantize_headvq_into
    codes = np.zeros((rows, cap, width), np.uint8)
    if base16 is None:
        norms = np.zeros((rows, cap, 1), np.uint16)
        quantize(x3, codes, norms, t0, code, unbiased)
        return codes, norms
    tc, tn = np.zeros((rows, n, width), np.uint8), np.zeros((rows, n, 1), np.uint16)
    quantize(x3, tc, tn, 0, code, unbiased)
    norms = np.zeros((rows, cap, 1), np.uint8)
    norm8_store_into(tc, tn, base16, t0, codes, norms)
    return codes, norms


def inputs(rng, rows: int, n: int, d: int):
    xk = rng.standard_normal((rows, n, d)).astype(np.float32) * 3
    xv = rng.standard_normal((rows, n, d)).astype(np.float32)
    xk[1, 0] = 0.0  # a zero vector: norm (and its grid code) 0
    xv[0, n - 1] *= 1e-4  # far below the grid's base with 8-bit norms: clamped up to code 1
    return xk, xv


def grid_base(xk, xv) -> int:
    """A grid base from the inputs' norms in binary16 (as a layer's first store fixes it)."""
    h = np.linalg.norm(np.concatenate([xk, xv], axis=1), axis=-1, keepdims=True).astype(np.float16)
    return norm8_base16(h.view(np.uint16))


@pytest.mark.parametrize("norm8", [False, True], ids=["norm16", "norm8"])
@pytest.mark.parametrize("d, kkind, vkind", CODES, ids=CODE_IDS)
def test_pair_stores_the_single_side_bytes(d, kkind, vkind, norm8):
    rng = np.random.default_rng(d + 7 * norm8)
    rows, n, cap, t0 = 3, 2, 6, 1
    xk, xv = inputs(rng, rows, n, d)
    base16 = grid_base(xk, xv) if norm8 else None
    (kcode, kw), (vcode, vw) = code_of(kkind, d), code_of(vkind, d)
    for unbiased in (False, True):
        want = (*single_side(xk, kcode, kw, cap, t0, unbiased, base16),
                *single_side(xv, vcode, vw, cap, t0, unbiased, base16))
        got = [np.zeros_like(a) for a in want]
        quantize_head_pair_into(xk, xv, *got, t0, kcode, vcode, unbiased, base16=base16)
        for name, g, w in zip(("kcodes", "knorms", "vcodes", "vnorms"), got, want):
            np.testing.assert_array_equal(g, w, err_msg=name)
        # the premise: the tokens written, nothing else, and the clamps exercised with 8-bit norms
        assert want[0][:, t0:t0 + n].any() and not want[0][:, :t0].any() and not want[0][:, t0 + n:].any()
        assert want[1][1, t0, 0] == 0
        if norm8:
            assert want[3][0, t0 + n - 1, 0] == 1


@pytest.mark.parametrize("d, kkind, vkind", CODES[1:3], ids=CODE_IDS[1:3])
def test_pair_count_updates(d, kkind, vkind):
    """The count update folded in: ``lens[i] += delta`` at the offset given, or the offset
    read from ``lens[r]`` (``t0`` passed as 0) and ``lens[i] = lens[r] + delta``; the same
    bytes either way."""
    rng = np.random.default_rng(11)
    rows, n, cap, t0 = 2, 2, 5, 2
    xk, xv = inputs(rng, rows, n, d)
    (kcode, kw), (vcode, vw) = code_of(kkind, d), code_of(vkind, d)
    base16 = grid_base(xk, xv)
    want = (*single_side(xk, kcode, kw, cap, t0, True, base16), *single_side(xv, vcode, vw, cap, t0, True, base16))
    for at, lens, add_at, after in ((t0, [3, 4, 5], (1, 2), [3, 6, 5]), (0, [t0, 7], (1, n, 0), [t0, t0 + n])):
        lens = np.array(lens, np.int32)
        got = [np.zeros_like(a) for a in want]
        quantize_head_pair_into(xk, xv, *got, at, kcode, vcode, True, add_at=(lens, *add_at), base16=base16)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)
        assert lens.tolist() == after


def test_pair_checks_its_span():
    d = 64
    xk = np.ones((1, 3, d), np.float32)
    planes = [np.zeros((1, 4, d // 2), np.uint8), np.zeros((1, 4, 1), np.uint16)] * 2
    with pytest.raises(ValueError, match="kcodes"):
        quantize_head_pair_into(xk, xk, *planes, 2, head_codebook(4, d), headvq_centroids(4, d), False)
