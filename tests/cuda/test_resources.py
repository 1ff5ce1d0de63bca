"""The CUDA kernels as ptxas builds them (nvJitLink, no GPU): no register spills, no local
memory, and every kernel launches with the largest block the ``cuda_threads`` knob allows,
on every architecture of ``ARCHS``.

The occupancy arithmetic is checked against cases worked by hand from the CUDA occupancy
calculator's rules.  Registers go to warps in units of 256, split over four sub-partitions
of 16,384 registers.  Shared memory goes to blocks in units of 128 B, plus 1 KiB reserved
per block.  On a real GPU (``gpu_only``) the driver's own figures for each kernel are
compared with the static ones.

cc 8.6 and 8.9 (``RETARGETED``): NVVM emits the same PTX for them as for 8.0 (the same
instructions; only the ``.target`` line and generated symbol names differ), so ``make test``
links the cached sm_80 PTX, its target set to ``sm_86``/``sm_89``, with that architecture's
ptxas: the machine code, registers, spills and shared memory of each are checked as before,
without two more 5-20 s NVVM compiles per kernel.  ``make test-ptx-all``
(``NUMBA_KV_PTX_ALL_ARCHS=1``) compiles them from Python for 8.6 and 8.9 as well, and checks
that premise: that PTX equals the retargeted one, and so do the resources.
"""

import dataclasses
import os
import re

import pytest

from numba_kv import _config
from numba_kv._cuda_resources import (
    ARCHS,
    KernelResources,
    kernel_ptx,
    kernel_resources,
    link_log,
    max_block_threads,
    occupancy,
    parse_link_log,
    ptx_max_threads,
)
from numba_kv.ops import TWINS

#: kernels that declare shared memory: their launch also depends on the SM's shared memory,
#: which differs between architectures (100 KiB on 8.6/8.9), so they are checked on all four
SHARED_MEMORY_KERNELS = ("decode_attention", "decode_attention_warp", "decode_attention_warp_vq",
                         "decode_attention_mma", "decode_attention_mma_vq", "paged_decode_attention",
                         "paged_decode_attention_warp", "paged_decode_attention_mma", "merge_partitions", "rotate_head",
                         "quantize_head", "quantize_head_pair", "dequantize_head", "quantize_headvq",
                         "dequantize_headvq", "slide_windows8", "decode_attention_mma_d64",
                         "decode_attention_mma_vq_d64", "paged_decode_attention_mma_d64")
#: kernels allowed local memory (spills, stack, local arrays), with the reason
LOCAL_EXCEPTIONS: dict[str, str] = {}
#: kernels launched with a block size of their own instead of the ``cuda_threads`` knob (their
#: launch bounds), with it
OWN_BLOCK: dict[str, int] = {"decode_attention_mma": 128, "decode_attention_mma_vq": 128,
                             "paged_decode_attention_mma": 128, "decode_attention_mma_d64": 128,
                             "decode_attention_mma_vq_d64": 128, "paged_decode_attention_mma_d64": 128}
CASES = [(name, cc) for name in sorted(TWINS) for cc in ((8, 0), (9, 0))]
CASES += [(name, cc) for name in SHARED_MEMORY_KERNELS for cc in ((8, 6), (8, 9))]
#: architectures built from the sm_80 PTX with its target changed (see the module docstring)
RETARGETED = ((8, 6), (8, 9))
#: ``make test-ptx-all``: compile RETARGETED from Python too, and check the two builds agree
ALL_ARCHS = os.environ.get("NUMBA_KV_PTX_ALL_ARCHS", "0") not in ("", "0")


def retargeted_ptx(name: str, cc: tuple[int, int]) -> str:
    """The sm_80 PTX of ``name`` (cached: the sm_80 cases compile it anyway), its ``.target``
    line set to ``sm_<cc>``."""
    ptx, n = re.subn(r"^\.target\s+sm_80\b", f".target sm_{cc[0]}{cc[1]}", kernel_ptx(name, (8, 0)), flags=re.M)
    assert n == 1, f"{name}: expected one '.target sm_80' line in its sm_80 PTX, found {n}"
    return ptx


def retargeted_resources(name: str, cc: tuple[int, int]):
    """What ptxas for ``sm_<cc>`` makes of :func:`retargeted_ptx` (as ``kernel_resources``)."""
    ptx = retargeted_ptx(name, cc)
    return dataclasses.replace(parse_link_log(link_log(ptx, cc)), max_threads=ptx_max_threads(ptx))


def resources(name: str, cc: tuple[int, int]):
    if cc in RETARGETED and not ALL_ARCHS:
        return retargeted_resources(name, cc)
    return kernel_resources(name, cc)

LOG = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_Z6kernelPf' for 'sm_90'
ptxas info    : Function properties for _Z6kernelPf
ptxas         .     16 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads
ptxas info    : Function properties for _Z6helperv
ptxas         .     0 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 126 registers, used 1 barriers
info    : 8 bytes gmem
info    : Function properties for '_Z6kernelPf':
info    : used 126 registers, used 1 barriers, 16 stack, 47104 bytes smem, 2424 bytes cmem[0], 24 bytes lmem
"""


def res(registers, shared=0):
    return KernelResources(registers=registers, spill_stores=0, spill_loads=0, stack=0, local=0, shared=shared)


def test_parse_link_log():
    r = parse_link_log(LOG)
    assert r == KernelResources(registers=126, spill_stores=12, spill_loads=16, stack=16, local=24, shared=47104)


def test_parse_link_log_wants_one_kernel():
    with pytest.raises(ValueError, match="exactly one kernel, found 0"):
        parse_link_log("ptxas info    : Used 12 registers\n")
    two = LOG + LOG.splitlines()[-2].replace("kernel", "other") + "\n" + LOG.splitlines()[-1] + "\n"
    with pytest.raises(ValueError, match="found 2"):
        parse_link_log(two)
    with pytest.raises(ValueError, match="no 'used N registers"):
        parse_link_log("info    : Function properties for 'k':\n")


def test_occupancy_worked_examples():
    # 126 registers -> 4,096 per warp (126·32 = 4,032 rounded to 256): 16,384 // 4,096 = 4 warps per
    # sub-partition, 16 per SM, 4 blocks of 4 warps.  Shared: 47,104 + 1,024 = 48,128 B a block,
    # 233,472 // 48,128 = 4 blocks.  Both limit: 16 of 64 warps.
    o = occupancy(res(126, 47104), 128, (9, 0))
    assert (o.blocks_per_sm, o.warps_per_sm, o.fraction, set(o.limiters)) == (4, 16, 0.25, {"registers", "shared"})
    # 8.0 has 164 KiB: 167,936 // 48,128 = 3 blocks
    assert occupancy(res(126, 47104), 128, (8, 0)).blocks_per_sm == 3
    # 32 registers, 1,024 threads on 8.6: 1,024 registers a warp, 64 warps by registers, but the SM
    # holds 48 warps: 1 block of 32 warps
    o = occupancy(res(32), 1024, (8, 6))
    assert (o.blocks_per_sm, o.warps_per_sm, o.limiters) == (1, 32, ("warps",))
    assert o.fraction == pytest.approx(32 / 48)
    # tiny blocks hit the blocks-per-SM cap (16 on 8.6, 24 on 8.9, 32 on 8.0/9.0)
    assert [occupancy(res(16), 32, cc).blocks_per_sm for cc in ((8, 6), (8, 9), (8, 0))] == [16, 24, 32]


def test_launch_limits():
    # 130 registers -> 4,352 a warp (4,160 rounded up); 512 threads = 16 warps = 69,632 > 65,536
    assert occupancy(res(130), 512, (8, 0)).blocks_per_sm == 0
    assert occupancy(res(130), 384, (8, 0)).blocks_per_sm == 1
    assert max_block_threads(res(130), (8, 0)) == 384
    # the register ceiling: 255 registers -> 8,192 a warp; 8 warps use all 65,536
    assert max_block_threads(res(255), (9, 0)) == 256
    # 9 warps are checked as 12 (rounded to the 4 sub-partitions): 98,304 registers
    assert occupancy(res(255), 288, (9, 0)).blocks_per_sm == 0
    # 100 registers -> 3,328 a warp (3,200 rounded up), 4 per sub-partition: 16 warps (53,248
    # registers) fit; 544 threads (17 warps) are checked as 20 warps: 66,560 registers
    assert max_block_threads(res(100), (9, 0)) == 512
    assert max_block_threads(res(16), (9, 0)) == 1024
    # static shared memory over 48 KiB never launches
    assert occupancy(res(16, 48 * 1024 + 4), 32, (9, 0)).blocks_per_sm == 0
    assert occupancy(res(16, 48 * 1024), 32, (9, 0)).blocks_per_sm > 0
    with pytest.raises(ValueError, match="cc: limits are known for"):
        occupancy(res(16), 32, (7, 5))
    with pytest.raises(ValueError, match=r"^threads: expected an int >= 1, got 0"):
        occupancy(res(16), 0, (9, 0))
    # a fractional block gave fractional blocks, a negative dynamic shared size negative ones
    with pytest.raises(TypeError, match=r"^threads: expected an int, got float 128\.5"):
        occupancy(res(16), 128.5, (9, 0))
    with pytest.raises(ValueError, match=r"^dynamic_shared: expected an int >= 0, got -1000000"):
        occupancy(res(16), 128, (9, 0), dynamic_shared=-10 ** 6)
    assert occupancy(res(16), 128, (9, 0), dynamic_shared=0) == occupancy(res(16), 128, (9, 0))


def test_kernel_ptx_names_a_malformed_compute_capability():
    for cc in ((9,), (9, 0, 1), "90", 90):
        with pytest.raises(ValueError, match=r"^cc: expected a \(major, minor\) compute capability"):
            kernel_ptx("pack_bits", cc)


def test_launch_bounds_cap_the_block():
    """``.maxntid`` (a kernel's launch bounds) caps the block however few registers it uses."""
    assert ptx_max_threads(".entry k(\n)\n.maxntid 256, 1, 1\n.minnctapersm 2\n{") == 256
    assert ptx_max_threads(".maxntid 16, 4, 2") == 128
    assert ptx_max_threads(".maxntid 96") == 96
    assert ptx_max_threads(".entry k()\n{") == 1024
    capped = KernelResources(16, 0, 0, 0, 0, 0, max_threads=256)
    assert max_block_threads(capped, (9, 0)) == 256
    assert occupancy(capped, 288, (9, 0)).blocks_per_sm == 0


@pytest.mark.ptx
def test_decode_attention_is_built_for_its_launch_bounds():
    """The flat attention kernel is compiled with launch bounds (256 threads, 2 blocks per
    SM): ptxas keeps it within 128 registers, and a block above 256 threads would not launch."""
    r = kernel_resources("decode_attention", (9, 0))
    assert r.max_threads == _config.MAX_CUDA_THREADS
    assert r.registers <= 128
    assert max_block_threads(r, (9, 0)) == _config.MAX_CUDA_THREADS


def test_every_arch_launches_any_kernel_at_the_knob_maximum():
    """The bound the knob relies on: 255 registers and 48 KiB of static shared memory (the
    most ptxas gives a kernel) still launch with MAX_CUDA_THREADS everywhere."""
    for cc in ARCHS:
        assert occupancy(res(255, 48 * 1024), _config.MAX_CUDA_THREADS, cc).blocks_per_sm >= 1, cc


@pytest.mark.ptx
@pytest.mark.parametrize("name", ["decode_attention_mma", "decode_attention_mma_vq", "paged_decode_attention_mma",
                                  "decode_attention_mma_d64", "decode_attention_mma_vq_d64",
                                  "paged_decode_attention_mma_d64"])
def test_mma_attention_keeps_four_blocks_per_h100_sm(name):
    """The tensor-core kernels' sm_90 builds (launch bounds: 128 threads, 4 blocks per SM;
    ``Twin.build_for``) fit 128 registers there without a spill, so 4 blocks (16 warps) fit
    an SM to hide the latency of their loads and table reads (on an H200 such a build was
    4-9 % faster than 3 blocks at batch >= 8).  A change that adds registers past the limit
    fails here (a spill, by the test below) rather than on a GPU."""
    r = kernel_resources(name, (9, 0))
    assert r.max_threads == 128 and r.registers <= 128, r
    assert occupancy(r, 128, (9, 0)).blocks_per_sm >= 4


@pytest.mark.ptx
@pytest.mark.parametrize("name", ["decode_attention_mma", "paged_decode_attention_mma", "decode_attention_mma_d64",
                                  "paged_decode_attention_mma_d64"])
def test_mma_attention_default_build_keeps_three_blocks_per_h100_sm(name):
    """The default build (launch bounds of 2 blocks, for every other capability) holds at most
    168 registers on sm_90 too: 3 blocks an SM on a Hopper GPU that runs it (the A/B builds of
    ``benchmarks/gpu_mma_check.py`` compare against it)."""
    from numba import cuda

    from numba_kv._jit import device_functions_for

    twin = TWINS[name]
    with device_functions_for((9, 0)):
        ptx, _ = cuda.compile_ptx(twin.cuda.py_func, twin.signatures[0], cc=(9, 0),
                                  launch_bounds=twin.cuda.launch_bounds)
    r = parse_link_log(link_log(ptx, (9, 0)))
    assert r.registers <= 168 and (r.spill_stores, r.spill_loads) == (0, 0), r


def test_exception_list_names_registered_kernels():
    for name in (*LOCAL_EXCEPTIONS, *SHARED_MEMORY_KERNELS, *OWN_BLOCK):
        assert name in TWINS, name


@pytest.mark.ptx
@pytest.mark.parametrize("name, cc", CASES, ids=[f"{n}-sm{c[0]}{c[1]}" for n, c in CASES])
def test_kernel_builds_without_spills_and_launches(name, cc):
    r = resources(name, cc)
    if name not in LOCAL_EXCEPTIONS:
        assert (r.spill_stores, r.spill_loads, r.local, r.stack) == (0, 0, 0, 0), (
            f"{name} on sm_{cc[0]}{cc[1]}: {r} (register spills or local memory: off-chip traffic per thread)")
    assert r.shared <= ARCHS[cc].static_smem_per_block
    block = OWN_BLOCK.get(name, _config.MAX_CUDA_THREADS)
    assert max_block_threads(r, cc) >= block, f"{name} on sm_{cc[0]}{cc[1]}: {r}"
    assert occupancy(r, OWN_BLOCK.get(name, _config.DEFAULTS["cuda_threads"]), cc).blocks_per_sm >= 1
    if name not in SHARED_MEMORY_KERNELS:
        assert r.shared == 0, f"{name}: declares {r.shared} B of shared memory; add it to SHARED_MEMORY_KERNELS"


def _normalized(ptx: str) -> str:
    """PTX without what differs between two compiles of one kernel: the target line, the
    generated symbol names (their ABI tag encodes the target) and shared-array counters."""
    ptx = re.sub(r"^\.target\s+sm_\d+\b", ".target sm_XX", ptx, flags=re.M)
    return re.sub(r"_cudapy_smem_\d+", "_cudapy_smem_N", re.sub(r"_ZN\w+", "_ZN_SYMBOL", ptx))


def test_normalized_ptx_ignores_target_and_symbol_names_only():
    body = "(\n.shared .b8 _cudapy_smem_{}[16];\nadd.f32 %f1;"
    a = ".target sm_80\n.visible .entry _ZN8numba_kv3opsB2v1B104cw5NgoKE5Array" + body.format(1)
    b = ".target sm_86\n.visible .entry _ZN8numba_kv3opsB3v34B104cw5NgpqE5Array" + body.format(7)
    assert _normalized(a) == _normalized(b)
    assert _normalized(a) != _normalized(b.replace("[16]", "[32]"))
    assert _normalized(a) != _normalized(b.replace("add.f32", "fma.rn.f32"))


@pytest.mark.ptx
@pytest.mark.skipif(not ALL_ARCHS, reason="compiles for sm_86/sm_89 from Python: `make test-ptx-all`")
@pytest.mark.parametrize("name", SHARED_MEMORY_KERNELS)
@pytest.mark.parametrize("cc", RETARGETED, ids=lambda cc: f"sm{cc[0]}{cc[1]}")
def test_retargeted_sm80_ptx_is_the_native_build(name, cc):
    """The premise of RETARGETED: NVVM's PTX for 8.6/8.9 is the sm_80 PTX but for its target
    and symbol names, and ptxas builds both into the same resources."""
    assert _normalized(kernel_ptx(name, cc)) == _normalized(retargeted_ptx(name, cc))
    assert kernel_resources(name, cc) == retargeted_resources(name, cc)


@pytest.mark.ptx
@pytest.mark.parametrize("name", ["decode_attention", "paged_decode_attention"])
def test_attention_kernels_keep_four_blocks_per_h100_sm(name):
    """At the default 128 threads the attention kernels hold 4 blocks (16 warps) per sm_90 SM,
    bounded by registers and shared memory alike; a change that adds either loses a block."""
    o = occupancy(kernel_resources(name, (9, 0)), _config.DEFAULTS["cuda_threads"], (9, 0))
    assert o.blocks_per_sm >= 4, o


@pytest.mark.gpu_only
@pytest.mark.parametrize("name", sorted(TWINS))
def test_driver_build_keeps_the_static_guarantees(name):
    """The kernel as the GPU's own toolchain builds it keeps what the static checks promise:
    no local memory (unless listed), a MAX_CUDA_THREADS block launches, shared memory
    within the static limit.  Register and shared-memory counts themselves are not
    compared: the driver's JIT and nvJitLink are different ptxas versions (on an H200 with
    driver 580 they differed by up to 40 registers and 1 KiB of shared memory per kernel)."""
    from numba import cuda

    cc = cuda.get_current_device().compute_capability
    if tuple(cc) not in ARCHS:
        pytest.skip(f"no limits table for compute capability {cc}")
    kernel = TWINS[name].build_for(tuple(cc)).compile(TWINS[name].signatures[0])  # (the build this GPU runs)
    static = kernel_resources(name, tuple(cc))
    figures = (f"driver: {kernel.regs_per_thread} registers, {kernel.shared_mem_per_block} B shared, "
               f"{kernel.local_mem_per_thread} B local; static: {static}")
    if name not in LOCAL_EXCEPTIONS:
        assert kernel.local_mem_per_thread == 0, figures
    assert kernel.max_threads_per_block >= OWN_BLOCK.get(name, _config.MAX_CUDA_THREADS), figures
    assert kernel.shared_mem_per_block <= ARCHS[tuple(cc)].static_smem_per_block, figures
