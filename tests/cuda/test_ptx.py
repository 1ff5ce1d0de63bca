"""Every registered CUDA kernel compiles to PTX for cc 8.0 and 9.0 without a GPU.

Catches the typing errors the simulator cannot see.  Float32 kernels must not contain
``.f64`` instructions (a stray Python float literal would promote).
"""

import re

import pytest

from numba_kv.ops import TWINS

CCS = [(8, 0), (9, 0)]
CASES = [(name, sig, cc) for name, t in sorted(TWINS.items()) for sig in t.signatures for cc in CCS]


@pytest.mark.ptx
def test_numba_cuda_is_the_nvidia_target():
    from numba import cuda

    assert getattr(cuda, "implementation", None) == "NVIDIA"


@pytest.mark.ptx
@pytest.mark.parametrize("name, sig, cc", CASES, ids=[f"{n}-{i}-sm{c[0]}{c[1]}" for i, (n, s, c) in
                                                      enumerate(CASES)])
def test_compiles_to_ptx(name, sig, cc):
    from numba import cuda

    twin = TWINS[name]
    ptx, _ = cuda.compile_ptx(twin.cuda.py_func, sig, cc=cc)
    assert f".target sm_{cc[0]}{cc[1]}" in ptx
    if twin.float32_only:
        f64 = [line for line in ptx.splitlines() if re.search(r"\.f64\b", line)]
        assert not f64, f"{name}: float64 instructions in a float32 kernel: {f64[:3]}"
