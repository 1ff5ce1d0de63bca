"""``numba_kv.ops._registry``: a twin's builds for one compute capability each (``cuda_cc``),
the one its launch runs on a device of that capability, and the checks at registration."""

import numpy as np
import pytest
from numba import cuda

from numba_kv import _launch
from numba_kv._jit import cuda_kernel
from numba_kv.ops import TWINS
from numba_kv.ops._registry import Twin, register


def _source(out):
    out[0] = 1.0


def _other(out):
    out[0] = 2.0


def test_build_for_picks_the_build_of_the_capability():
    default, sm90 = cuda.jit(_source), cuda.jit(_source)
    twin = Twin("x", None, default, (), cuda_cc=(((9, 0), sm90),))
    assert twin.build_for((9, 0)) is sm90
    assert twin.build_for((8, 0)) is default and twin.build_for(None) is default
    assert Twin("y", None, default, ()).build_for((9, 0)) is default


def test_register_wants_the_same_source_for_every_build():
    with pytest.raises(ValueError, match=r"cuda_cc: the build for \(9, 0\) of 'z_test' must compile the same source"):
        register("z_test", None, cuda.jit(_source), [], cuda_cc={(9, 0): cuda.jit(_other)})
    assert "z_test" not in TWINS


def test_launch_runs_the_build_of_the_callers_capability(monkeypatch):
    """``Twin.launch(..., cc=...)`` hands the build for ``cc`` to the launch, the default
    build without ``cc`` or for another capability."""
    ran = []
    monkeypatch.setattr(_launch, "launch", lambda dispatcher, grid, block, args: ran.append(dispatcher))
    default, sm90 = cuda.jit(_source), cuda.jit(_source)
    twin = Twin("x", None, default, (), cuda_cc=(((9, 0), sm90),))
    out = np.zeros(1, np.float32)
    for cc in ((9, 0), (8, 0), None):
        twin.launch("cuda", 1, out, grid=(1, 1), cc=cc)
    assert ran == [sm90, default, default]


@pytest.mark.parametrize("name", ["decode_attention_mma", "paged_decode_attention_mma", "decode_attention_mma_vq",
                                  "decode_attention_mma_d64", "decode_attention_mma_vq_d64",
                                  "paged_decode_attention_mma_d64"])
def test_tensor_core_kernels_have_sm90_builds_of_four_blocks(name):
    """The tensor-core kernels run a build with launch bounds of 4 blocks (128 threads) on
    sm_90 and one of 2 blocks elsewhere, both of the same source; each build has its own
    name, which keeps them apart in Numba's on-disk cache (its key has no launch bounds)."""
    from numba_kv.ops.attention.mma import MMA_BLOCKS_PER_SM, MMA_BLOCKS_PER_SM_SM90, MMA_THREADS

    twin = TWINS[name]
    sm90 = twin.build_for((9, 0))
    assert sm90 is not twin.cuda and twin.build_for((8, 0)) is twin.cuda
    assert sm90.py_func.__code__ is twin.cuda.py_func.__code__
    assert sm90.py_func.__qualname__ != twin.cuda.py_func.__qualname__
    assert sm90.launch_bounds == (MMA_THREADS, MMA_BLOCKS_PER_SM_SM90) == (128, 4)
    assert twin.cuda.launch_bounds == (MMA_THREADS, MMA_BLOCKS_PER_SM) == (128, 2)


def test_a_kernel_without_builds_launches_its_own(monkeypatch):
    ran = []
    monkeypatch.setattr(_launch, "launch", lambda dispatcher, grid, block, args: ran.append(dispatcher))
    twin = Twin("x", None, cuda_kernel(_source), ())
    twin.launch("cuda", 1, np.zeros(1, np.float32), grid=(1, 1), cc=(9, 0))
    assert ran == [twin.cuda]
