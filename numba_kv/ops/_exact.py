"""Float32 arithmetic that rounds the same way in both twins.

The GPU compiler contracts ``s + a*b`` into one fused multiply-add, rounded once, by
default (NVVM's ``-fma=1``).  The CPU twins are compiled without fast-math, so LLVM does
not contract, and ``s += a*b`` is rounded twice.  A sum of products therefore can differ in
its last bit between the twins.  That one ulp can move a value across a decision boundary:
a codebook boundary, an outlier threshold, the sign of a QJL projection, or the nearest
codeword.  Then the integer outputs differ, and the package promises those are
bit-identical on every device.

:func:`mul_rn` is ``a·b`` rounded on its own, never fused into a following add.  CPU
cores call it as a plain, inlined product.  On the GPU it is libdevice's ``__nv_fmul_rn``,
which is exempt from contraction.  Under the simulator (Python floats in NumPy float32, no
FMA and no libdevice) it is the plain Python function.  ``tests/cuda/test_ptx.py`` checks the
PTX of every kernel outside its ``NOT_BIT_EXACT`` list: no FMA, no approximate or
flush-to-zero instruction, and no add of a plain ``mul.f32`` result (which ptxas may still
fuse), unless the product is by a power-of-two immediate.
"""

from __future__ import annotations

from numba import cuda

from .. import _backend
from .._jit import twin

__all__ = ["mul_rn", "mul_rn_cpu", "mul_rn_dev"]


def mul_rn(a, b):
    """``a·b`` rounded on its own (single-source cores call this; see the module docstring)."""
    return a * b


# the simulator runs device code as Python: the plain function itself, without the
# per-call cost of a simulated device function (a product in the innermost loops)
_device = mul_rn if _backend.simulator_enabled() else cuda.libdevice.fmul_rn
#: the CPU variant, and the device variant for CUDA-only kernels (which are not rebound)
mul_rn_cpu, mul_rn_dev = twin(mul_rn, inline=True, device=_device)
