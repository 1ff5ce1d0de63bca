"""The 32-block rotation: normalized Walsh–Hadamard transform with a fixed sign pattern.

Each head vector is split into 32-value blocks, each rotated independently
(the tq3_0 block rotation of turboquant-rs):

* forward:  ``y = D_s · H · x``  (Hadamard first, then signs);
* inverse:  ``x = H · D_s · y``  (signs first, then Hadamard);

where ``H`` is the 32×32 Sylvester Hadamard matrix scaled by ``1/√32`` (symmetric,
``H·H = I``) and ``s`` the llama.cpp sign pattern (bit ``j`` of ``0xB1A6D4B2`` set ⇔
``s_j = −1``).  ``H`` is applied as a 5-stage butterfly, never as a matmul.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import cuda, float32, prange

from .. import _backend
from .._jit import cpu_kernel, cuda_kernel, twin
from .._validate import F32_MAX, check_bool, check_float_array
from ._borrow import borrowed, keep_alive
from ._exact import mul_rn
from ._index import unravel2_dev
from ._registry import F32_1D, F32_2D, register
from .finite import check_finite_stats

BLOCK = 32
SIGN_MASK = 0xB1A6D4B2
#: the fixed sign vector ``s`` (float32, length 32)
SIGNS32 = np.array([-1.0 if (SIGN_MASK >> j) & 1 else 1.0 for j in range(BLOCK)], dtype=np.float32)
SIGNS32.flags.writeable = False


# --- single-source cores -------------------------------------------------------------
# Lane layout: ``L`` blocks side by side, value ``j`` of block (lane) ``l`` at
# ``t[j*L + l]``.  The CPU twins pass a constant ``L`` of 64 so every inner loop runs over
# 64 contiguous lanes and vectorizes; the CUDA kernels pass ``L = 1`` (one block per
# thread), which is the plain 32-value buffer.  The arithmetic per value is the same.
def _butterfly32(t, L, h):
    """One radix-2 stage (stride ``h``) of the 32-point butterfly, on ``L`` lanes."""
    for i in range(0, 32, 2 * h):
        for j in range(i, i + h):
            p = j * L
            q = p + h * L
            for l in range(L):
                a = t[p + l]
                b = t[q + l]
                t[p + l] = a + b
                t[q + l] = a - b


twin(_butterfly32)


def _wht32_lanes(t, L):
    """In-place normalized 32-point Walsh–Hadamard transform of ``L`` interleaved blocks."""
    # stage order h = 1, 2, 4, 8, 16 is part of the float32 result: keep it
    _butterfly32(t, L, 1)
    _butterfly32(t, L, 2)
    _butterfly32(t, L, 4)
    _butterfly32(t, L, 8)
    _butterfly32(t, L, 16)
    for m in range(32 * L):
        t[m] = t[m] * float32(0.17677669529663687)


twin(_wht32_lanes)


def rotate32_forward_lanes(t, L, signs):
    """``D_s H`` on ``L`` interleaved blocks (in place)."""
    _wht32_lanes(t, L)
    for j in range(32):
        sj = signs[j]
        for l in range(L):
            t[j * L + l] = mul_rn(t[j * L + l], sj)


def rotate32_inverse_lanes(t, L, signs):
    """``H D_s`` on ``L`` interleaved blocks (in place)."""
    # mul_rn: a product by ±1 is exact, fused into the first butterfly's add or not; the
    # explicit rounding keeps ptxas from fusing it, so the PTX check of exact kernels
    # (tests/cuda/test_ptx.py) needs no exception for it
    for j in range(32):
        sj = signs[j]
        for l in range(L):
            t[j * L + l] = mul_rn(t[j * L + l], sj)
    _wht32_lanes(t, L)


twin(rotate32_forward_lanes)
twin(rotate32_inverse_lanes)


def _wht32(buf):
    """In-place normalized 32-point Walsh–Hadamard butterfly on ``buf[0:32]`` (float32)."""
    _wht32_lanes(buf, 1)


def _rotate32_forward(buf, signs):
    """``buf <- D_s H buf`` (forward block rotation, in place)."""
    rotate32_forward_lanes(buf, 1, signs)


def _rotate32_inverse(buf, signs):
    """``buf <- H D_s buf`` (inverse block rotation, in place)."""
    rotate32_inverse_lanes(buf, 1, signs)


twin(_wht32)
twin(_rotate32_forward)
twin(_rotate32_inverse)


def _load_rotate_store(x, r, b, signs, inverse, buf, out):
    """Rotate block ``b`` of row ``x[r]`` into ``out[r]`` using scratch ``buf``."""
    o = b * 32
    for j in range(32):
        buf[j] = x[r, o + j]
    if inverse:
        _rotate32_inverse(buf, signs)
    else:
        _rotate32_forward(buf, signs)
    for j in range(32):
        out[r, o + j] = buf[j]


load_rotate_store_cpu, load_rotate_store_dev = twin(_load_rotate_store)


# --- CPU twin ---------------------------------------------------------------------------
@cpu_kernel
def _rotate32_cpu(x, signs, inverse, out):
    n, d = x.shape
    nb = d // 32
    xb, sb, ob = borrowed(x), borrowed(signs), borrowed(out)  # (numba_kv.ops._borrow)
    for r in prange(n):
        own = np.empty(32, dtype=np.float32)
        buf = borrowed(own)
        for b in range(nb):
            load_rotate_store_cpu(xb, r, b, sb, inverse, buf, ob)
        keep_alive(own)


# --- CUDA kernel: one thread per 32-block, grid-stride ---------------------------------
@cuda_kernel
def _rotate32_cuda(x, signs, inverse, out):
    n, d = x.shape
    nb = d // 32
    buf = cuda.local.array(32, dtype=float32)
    for t in range(cuda.grid(1), n * nb, cuda.gridsize(1)):
        r, b = unravel2_dev(t, nb)
        load_rotate_store_dev(x, r, b, signs, inverse, buf, out)


#: Signature of the row rotation kernels (``rotate32``, ``rotate_head``): ``(x, signs, inverse, out)``.
ROTATE_SIGNATURE = f"void({F32_2D}, {F32_1D}, boolean, {F32_2D})"
_ROTATE32 = register("rotate32", _rotate32_cpu, _rotate32_cuda, [ROTATE_SIGNATURE])


def rotate32_rows(x2: Any, inverse: bool = False, signs: Any = None) -> Any:
    """Rotate every 32-block of ``x2`` ``[n, d]`` (float32, C-contiguous, ``d`` a multiple of
    32, finite with block norms within float32) into a new array on its device; no
    validation and no host round trip.  ``signs`` defaults to :data:`SIGNS32` (its device
    copy is cached per device)."""
    n, d = (int(s) for s in x2.shape)
    dev = _backend.device_of("x", x2)
    if signs is None:
        signs = _backend.constant(x2, SIGNS32)
    elif dev == _backend.CPU:
        signs = np.ascontiguousarray(signs, dtype=np.float32)
    out = _backend.empty(x2, (n, d), np.float32)
    if n:
        _ROTATE32.launch(dev, n * (d // 32), x2, signs, bool(inverse), out, work=n * d)
    return out


def rotation_prescale(name: str, x: Any, block: int) -> float:
    """The power of two to scale ``x`` by before a ``block``-value rotation (and by its inverse
    after it) so that no float32 sum inside the rotation overflows: ``1.0`` for every block of
    L2 norm ``<= F32_MAX / (2·√block)``, else ``2**-k`` with ``2**k >= 2·√block``.

    Why: the butterfly sums before its final ``1/√block`` multiply, so an intermediate value
    reaches ``√block`` times the block norm (all 32 values ``3e37``: the rotated ``1.7e38``
    is a float32, the sum ``9.6e38`` before the multiply is not) and came back as ``inf``.
    Power-of-two scaling is exact (barring subnormals), so the result is the float32 one.
    ``ValueError`` naming ``name`` for NaN/Inf and for a block norm above float32 (a rotated
    value would be as large), as :func:`~numba_kv.ops.finite.check_rotation_input`."""
    norm = check_finite_stats(name, x, block).max_norm
    if not norm <= F32_MAX:
        raise ValueError(f"{name}: a {block}-value block has L2 norm {norm:.6g}, above {F32_MAX:.6g} "
                         f"(the largest float32): its rotation cannot be represented")
    root = math.sqrt(block)
    if norm * root <= F32_MAX / 2:
        return 1.0
    return 2.0 ** -math.ceil(math.log2(2.0 * root))


def rotate_prescaled(name: str, rows: Any, scale: float, rotate: Any) -> Any:
    """``rotate(rows · scale) / scale`` (``scale`` from :func:`rotation_prescale`, ``rows`` a
    C-contiguous float32 NumPy or CuPy array); ``rotate(rows)`` when ``scale`` is 1.
    ``ValueError`` naming ``name`` when a Numba device array needs the scaling (no device-side
    arithmetic here) or a rotated value still leaves float32 (a block norm within rounding of
    the float32 maximum)."""
    if scale == 1.0:
        return rotate(rows)
    xp = _backend.xp_of(rows)
    if xp is None:
        raise ValueError(f"{name}: block norms this close to the float32 maximum need a rescaled rotation, "
                         "which runs on NumPy and CuPy arrays only (scale the input down)")
    out = rotate(rows * xp.float32(scale))
    out *= xp.float32(1.0 / scale)  # exact: a power of two
    if not bool(xp.isfinite(out).all()):
        raise ValueError(f"{name}: a rotated value exceeds {F32_MAX:.6g}, the largest float32")
    return out


def _check_signs(signs: Any) -> Any:
    """``signs`` as C-contiguous float32 on its device; ``ValueError`` unless it holds ``(32,)``
    values ±1 (``D_s`` is a sign diagonal: other values make the transform non-orthogonal and
    void the overflow bound of :func:`rotation_prescale`)."""
    if tuple(signs.shape) != (32,):
        raise ValueError(f"signs: expected shape (32,), got {tuple(signs.shape)}")
    s = _backend.ascontiguous_f32("signs", signs)  # TypeError for complex / non-float32 device arrays
    host = _backend.to_host(s)  # 32 values
    if not bool(np.all(np.abs(host) == 1.0)):
        bad = host[np.abs(host) != 1.0][0]
        raise ValueError(f"signs: expected 32 values +1 or -1 (the sign diagonal D_s), got {float(bad)!r}")
    return s


def rotate32(x: Any, inverse: bool = False, *, signs: Any = None, backend: str = "auto") -> Any:
    """Rotate every 32-value block of ``x`` (forward ``D_s H`` or inverse ``H D_s``).

    Parameters
    ----------
    x : float16, float32 or float64 array, shape ``(..., d)``
        ``d`` a multiple of 32; finite.  Computed in float32 (a block whose norm is within a
        factor ``2·√32`` of the float32 maximum is rotated scaled by a power of two, so its
        butterfly sums stay finite; NumPy and CuPy arrays only).
    inverse : bool
        Apply the inverse rotation.
    signs : float32 array, shape ``(32,)``, optional
        Sign vector, values ±1; defaults to :data:`SIGNS32`.  Must be on the device of ``x``
        (read back to the host once to check its values).
    backend : {"auto", "cpu", "cuda"}
        Check that the data lives where expected (never moves it).

    Returns
    -------
    y : float32 array, shape of ``x``, on the device of ``x``.

    Raises
    ------
    TypeError
        ``x`` not a float array, ``signs`` not a real array, ``inverse`` not a bool.
    ValueError
        Last axis not a positive multiple of 32, NaN/Inf in ``x``, a 32-block whose rotation
        leaves float32, ``signs`` not 32 values ±1.

    Examples
    --------
    An outlier spreads evenly over its block (every ``|y_j| = 2 / √32``), and the inverse
    brings it back:

    >>> import numpy as np
    >>> x = np.zeros((1, 64), np.float32)
    >>> x[0, 3] = 2.0
    >>> y = rotate32(x)
    >>> bool(np.allclose(np.abs(y[0, :32]), 2 / 32 ** 0.5)), bool(np.all(y[0, 32:] == 0))
    (True, True)
    >>> bool(np.allclose(rotate32(y, inverse=True), x, atol=1e-6))
    True
    """
    check_bool("inverse", inverse)  # (a truthy "no" must not select the inverse)
    if signs is None:  # the device copy is made once per device (_backend.constant), not per call
        signs = _backend.constant(x, SIGNS32) if _backend.device_of("x", x) == _backend.CUDA else SIGNS32
        _backend.resolve_device(backend, x=x, signs=signs)
    else:
        _backend.resolve_device(backend, x=x, signs=signs)
        signs = _check_signs(signs)
    check_float_array("x", x)  # (an int array is no vector to rotate: refused, as by rotate_head)
    shape = tuple(x.shape)  # a tuple: the simulator's shapes reject negative indices
    if len(shape) < 1 or shape[-1] % 32 or shape[-1] == 0:
        raise ValueError(f"x: expected a last axis that is a positive multiple of 32, got shape {shape}")
    scale = rotation_prescale("x", x, 32)  # finite; 1.0 unless a butterfly sum would overflow
    rows = _backend.ascontiguous_f32("x", x).reshape(-1, shape[-1])
    out = rotate_prescaled("x", rows, scale, lambda r: rotate32_rows(r, bool(inverse), signs))
    return out.reshape(shape)
