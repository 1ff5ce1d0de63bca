"""What the CUDA kernels need from an SM, found without a GPU: registers, spills, shared
memory, the largest block that launches, and the theoretical occupancy.

PTX (``numba.cuda.compile_ptx``) has virtual registers only.  ptxas decides how many physical
registers a thread gets, whether values spill to (off-chip) local memory, and how much
static shared memory a block declares.  A kernel can be correct in the simulator and still
fail on a real GPU with "too many resources requested for launch": its block needs more
registers than an SM has.  nvJitLink (the ``nvidia-nvjitlink`` wheel that
``numba-cuda[cu13]`` installs) runs ptxas in the Python process, without a driver or GPU,
and reports those numbers in its info log.

Occupancy follows the CUDA occupancy calculator (``cuda_occupancy.h`` in the CUDA toolkit).
Registers are allocated per warp in units of 256 and split over the SM's four
sub-partitions.  Shared memory is allocated per block in units of 128 bytes, plus 1 KiB that
the driver reserves for each block (compute capability 8.0 and later).  The per-architecture
limits are those of the CUDA C++ Programming Guide table "Technical Specifications per
Compute Capability".  They are in :data:`ARCHS`.

Used by ``tests/cuda/test_resources.py`` (every registered kernel launches at the largest
block the ``cuda_threads`` knob allows, on every architecture in :data:`ARCHS`, without
spilling) and by ``numba-kv kernels``; :mod:`numba_kv._sass` disassembles the cubin of the
same nvJitLink run (:func:`link_cubin`).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass

from numba import cuda

from ._jit import device_functions_for
from ._validate import check_int
from .ops import TWINS

__all__ = ["ARCHS", "ArchLimits", "KernelResources", "Occupancy", "kernel_ptx", "kernel_resources", "link_cubin",
           "link_log", "max_block_threads", "occupancy", "parse_link_log", "ptx_max_threads"]

WARP = 32


@dataclass(frozen=True)
class ArchLimits:
    """Per-SM limits of one compute capability (CUDA C++ Programming Guide, "Technical
    Specifications per Compute Capability"; allocation units from ``cuda_occupancy.h``).

    Attributes
    ----------
    cc : (int, int)
        Compute capability.
    max_warps_per_sm, max_blocks_per_sm : int
        Resident warps and blocks an SM can hold.
    smem_per_sm : int
        Shared memory of an SM in bytes, at the largest carve-out (the driver's default
        lets a kernel use all of it).
    regs_per_sm, regs_per_block : int
        32-bit registers of an SM, and the most one block may hold.
    max_threads_per_block, max_regs_per_thread : int
        Block size and per-thread register limits.
    static_smem_per_block : int
        Most static (``cuda.shared.array``) shared memory a block may declare.
    reserved_smem_per_block : int
        Shared memory the driver reserves for each block.
    """

    cc: tuple[int, int]
    max_warps_per_sm: int
    max_blocks_per_sm: int
    smem_per_sm: int
    regs_per_sm: int = 65536
    regs_per_block: int = 65536
    max_threads_per_block: int = 1024
    max_regs_per_thread: int = 255
    static_smem_per_block: int = 48 * 1024
    reserved_smem_per_block: int = 1024
    reg_alloc_unit: int = 256
    smem_alloc_unit: int = 128
    sub_partitions: int = 4


#: the architectures the checks cover: A100 (8.0), consumer Ampere (8.6), Ada (8.9), Hopper (9.0)
ARCHS: dict[tuple[int, int], ArchLimits] = {
    (8, 0): ArchLimits((8, 0), max_warps_per_sm=64, max_blocks_per_sm=32, smem_per_sm=164 * 1024),
    (8, 6): ArchLimits((8, 6), max_warps_per_sm=48, max_blocks_per_sm=16, smem_per_sm=100 * 1024),
    (8, 9): ArchLimits((8, 9), max_warps_per_sm=48, max_blocks_per_sm=24, smem_per_sm=100 * 1024),
    (9, 0): ArchLimits((9, 0), max_warps_per_sm=64, max_blocks_per_sm=32, smem_per_sm=228 * 1024),
}


@dataclass(frozen=True)
class KernelResources:
    """What ptxas gave one kernel (per thread unless stated).

    Attributes
    ----------
    registers : int
        32-bit registers per thread.
    spill_stores, spill_loads : int
        Bytes of register spills written to / read from local memory (the kernel and any
        function it calls).
    stack : int
        Stack frame bytes.
    local : int
        Local memory bytes (stack, spills and local arrays).
    shared : int
        Static shared memory per block, bytes.
    max_threads : int
        Largest block the kernel's launch bounds allow (its PTX ``.maxntid``; 1024, the
        hardware's limit, when it has none).
    """

    registers: int
    spill_stores: int
    spill_loads: int
    stack: int
    local: int
    shared: int
    max_threads: int = 1024


@dataclass(frozen=True)
class Occupancy:
    """Theoretical occupancy of one kernel at one block size.

    Attributes
    ----------
    threads : int
        Threads per block.
    blocks_per_sm : int
        Resident blocks per SM (0: the block does not launch).
    warps_per_sm : int
        Resident warps per SM.
    fraction : float
        ``warps_per_sm / max_warps_per_sm``.
    limiters : tuple of str
        What bounds ``blocks_per_sm``: any of ``"registers"``, ``"shared"``, ``"warps"``,
        ``"blocks"``.
    """

    threads: int
    blocks_per_sm: int
    warps_per_sm: int
    fraction: float
    limiters: tuple[str, ...]


_ENTRY = re.compile(r"^info\s*:\s*Function properties for '?(?P<name>[^':\s]+)'?:?\s*$", re.MULTILINE)
_USED = re.compile(r"used (\d+) registers.*?(\d+) stack, (\d+) bytes smem.*?(\d+) bytes lmem")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def parse_link_log(log: str) -> KernelResources:
    """Resources of the one kernel in an nvJitLink ``-verbose`` info log.

    Parameters
    ----------
    log : str
        The log.  nvJitLink ends it with one summary per entry function::

            info    : Function properties for '<entry>':
            info    : used 126 registers, used 1 barriers, 0 stack, 47104 bytes smem, ..., 0 bytes lmem

        and ptxas, before that, with a ``N bytes stack frame, S bytes spill stores, L bytes
        spill loads`` line per compiled function.

    Returns
    -------
    KernelResources
        Spill bytes are summed over every function of the log; the rest is the entry's.

    Raises
    ------
    ValueError
        If the log holds no entry summary, or more than one.
    """
    summaries = [m for m in _ENTRY.finditer(log)]
    if len(summaries) != 1:
        raise ValueError(f"log: expected the summary of exactly one kernel, found {len(summaries)}")
    used = _USED.search(log, summaries[0].end())
    if used is None:
        raise ValueError("log: no 'used N registers, ... bytes smem, ... bytes lmem' line after the kernel summary")
    regs, stack, smem, lmem = (int(x) for x in used.groups())
    spills = [tuple(int(x) for x in m.groups()) for m in _SPILL.finditer(log)]
    return KernelResources(registers=regs, spill_stores=sum(s[1] for s in spills),
                           spill_loads=sum(s[2] for s in spills), stack=stack, local=lmem, shared=smem)


def link_log(ptx: str, cc: tuple[int, int]) -> str:
    """Compile ``ptx`` to machine code for ``sm_<cc>`` with nvJitLink and return its info log.

    Needs no GPU or driver.  ``ImportError`` names the extra to install when
    ``cuda.bindings`` (``numba-cuda[cu13]``) is missing; ``RuntimeError`` carries nvJitLink's
    error log when ptxas rejects the PTX.
    """
    return link_cubin(ptx, cc)[1]


def link_cubin(ptx: str, cc: tuple[int, int]) -> tuple[bytes, str]:
    """Compile ``ptx`` for ``sm_<cc>`` with nvJitLink: the cubin (the machine code that
    ``nvdisasm`` reads) and the info log (:func:`parse_link_log`), from one ptxas run.

    Errors as :func:`link_log`.
    """
    try:
        from cuda.bindings import nvjitlink  # noqa: PLC0415 - optional dependency (the cuda extra)
    except ImportError as e:  # pragma: no cover - the test extra installs it
        raise ImportError("kernel resources need nvJitLink: pip install 'numba-kv[cuda]' "
                          "(numba-cuda[cu13] brings cuda-bindings and nvidia-nvjitlink)") from e
    data = ptx.encode()
    handle = nvjitlink.create(2, [f"-arch=sm_{cc[0]}{cc[1]}", "-verbose"])
    try:
        nvjitlink.add_data(handle, nvjitlink.InputType.PTX, data, len(data), "kernel.ptx")
        try:
            nvjitlink.complete(handle)
        except nvjitlink.nvJitLinkError as e:
            size = nvjitlink.get_error_log_size(handle)
            buf = bytearray(size)
            nvjitlink.get_error_log(handle, buf)
            raise RuntimeError(f"ptxas rejected the PTX for sm_{cc[0]}{cc[1]}: "
                               f"{buf.decode(errors='replace').strip()}") from e
        size = nvjitlink.get_info_log_size(handle)
        buf = bytearray(size)
        nvjitlink.get_info_log(handle, buf)
        cubin = bytearray(nvjitlink.get_linked_cubin_size(handle))
        nvjitlink.get_linked_cubin(handle, cubin)
        return bytes(cubin), buf.decode(errors="replace")
    finally:
        nvjitlink.destroy(handle)


def kernel_ptx(name: str, cc: tuple[int, int] = (9, 0), signature: int = 0) -> str:
    """PTX of registered kernel ``name`` for ``sm_<cc>`` and its ``signature``-th signature,
    of the build a device of that capability runs (``Twin.build_for``;
    ``numba.cuda.compile_ptx``; cached, so the PTX checks and :func:`kernel_resources` compile
    each case once per process, however the arguments are spelled)."""
    # normalized before the cache: ``kernel_ptx(n, (9, 0))`` and ``kernel_ptx(n, [9, 0], 0)``
    # are one compile (a compile of an attention kernel costs 10-30 s)
    if not isinstance(cc, (tuple, list)) or len(cc) != 2:  # ((9,) was an IndexError)
        raise ValueError(f"cc: expected a (major, minor) compute capability such as (9, 0), got {cc!r}")
    return _kernel_ptx(name, (check_int("cc", cc[0]), check_int("cc", cc[1])), check_int("signature", signature))


@functools.cache
def _kernel_ptx(name: str, cc: tuple[int, int], signature: int) -> str:
    if name not in TWINS:
        raise KeyError(f"name: no registered kernel {name!r}; known: {sorted(TWINS)}")
    twin = TWINS[name]
    if not 0 <= signature < len(twin.signatures):
        raise IndexError(f"signature: {name!r} has {len(twin.signatures)} signatures, got index {signature}")
    build = twin.build_for(tuple(cc))  # (the build a device of that capability runs)
    with device_functions_for(tuple(cc)):
        ptx, _ = cuda.compile_ptx(build.py_func, twin.signatures[signature], cc=tuple(cc),
                                  launch_bounds=getattr(build, "launch_bounds", None))
    return ptx


_MAXNTID = re.compile(r"^\s*\.maxntid\s+(\d+)(?:\s*,\s*(\d+))?(?:\s*,\s*(\d+))?", re.MULTILINE)


def ptx_max_threads(ptx: str) -> int:
    """Largest block the ``.maxntid`` directive of ``ptx`` allows (the product of its
    dimensions), or 1024 (the hardware's limit) without one."""
    m = _MAXNTID.search(ptx)
    if m is None:
        return 1024
    n = 1
    for g in m.groups():
        n *= int(g) if g else 1
    return n


def kernel_resources(name: str, cc: tuple[int, int] = (9, 0), signature: int = 0) -> KernelResources:
    """Registers, spills and shared memory of registered kernel ``name`` on ``sm_<cc>``.

    Parameters
    ----------
    name : str
        A key of :data:`numba_kv.ops.TWINS`.
    cc : (int, int)
        Compute capability (any ``numba.cuda.compile_ptx`` accepts).
    signature : int
        Index into the twin's ``signatures``.

    Returns
    -------
    KernelResources
        Cached per kernel, architecture and signature (one PTX compile and one ptxas run:
        0.1–6 s).
    """
    return _kernel_resources(name, (int(cc[0]), int(cc[1])), int(signature))


@functools.cache
def _kernel_resources(name: str, cc: tuple[int, int], signature: int) -> KernelResources:
    ptx = kernel_ptx(name, cc, signature)
    return dataclasses.replace(parse_link_log(link_log(ptx, cc)), max_threads=ptx_max_threads(ptx))


def _round_up(x: int, unit: int) -> int:
    return -(-x // unit) * unit


def _arch(cc: tuple[int, int]) -> ArchLimits:
    if tuple(cc) not in ARCHS:
        raise ValueError(f"cc: limits are known for {sorted(ARCHS)}, got {tuple(cc)}")
    return ARCHS[tuple(cc)]


def occupancy(res: KernelResources, threads: int, cc: tuple[int, int] = (9, 0),
              dynamic_shared: int = 0) -> Occupancy:
    """Resident blocks and warps per SM for ``res`` launched with ``threads`` per block.

    The calculation of ``cudaOccMaxActiveBlocksPerMultiprocessor``: the least of the limits
    set by registers, warps, blocks and shared memory.  ``blocks_per_sm == 0`` means the
    launch fails: the block needs more registers or shared memory than the SM has, or more
    than 1024 threads.

    Parameters
    ----------
    res : KernelResources
    threads : int
        Threads per block (> 0).
    cc : (int, int)
        A key of :data:`ARCHS`.
    dynamic_shared : int
        Dynamic shared memory per block in bytes, >= 0 (the package's kernels declare only
        static).

    Raises
    ------
    TypeError, ValueError
        ``threads`` not an int >= 1, ``dynamic_shared`` not an int >= 0, an unknown ``cc``.
    """
    arch = _arch(cc)
    threads = check_int("threads", threads, minimum=1)  # (a float gave fractional blocks)
    dynamic_shared = check_int("dynamic_shared", dynamic_shared, minimum=0)  # (a negative one, negative blocks)
    warps = -(-threads // WARP)
    regs_per_warp = _round_up(res.registers * WARP, arch.reg_alloc_unit)
    smem = _round_up(res.shared + dynamic_shared + arch.reserved_smem_per_block, arch.smem_alloc_unit)
    fits = (threads <= min(arch.max_threads_per_block, res.max_threads)
            and res.registers <= arch.max_regs_per_thread
            # the hardware checks a block's registers as if its warps filled every sub-partition
            and regs_per_warp * _round_up(warps, arch.sub_partitions) <= arch.regs_per_block
            and res.shared <= arch.static_smem_per_block
            and smem <= arch.smem_per_sm)
    if not fits:
        return Occupancy(threads, 0, 0, 0.0, ())
    if regs_per_warp:
        per_sub = (arch.regs_per_sm // arch.sub_partitions) // regs_per_warp
        by_regs = per_sub * arch.sub_partitions // warps
    else:
        by_regs = arch.max_blocks_per_sm
    limits = {"registers": by_regs, "shared": arch.smem_per_sm // smem, "warps": arch.max_warps_per_sm // warps,
              "blocks": arch.max_blocks_per_sm}
    blocks = min(limits.values())
    return Occupancy(threads, blocks, blocks * warps, blocks * warps / arch.max_warps_per_sm,
                     tuple(k for k, v in limits.items() if v == blocks))


def max_block_threads(res: KernelResources, cc: tuple[int, int] = (9, 0)) -> int:
    """Largest block (a multiple of 32 threads) kernel ``res`` can be launched with on
    ``sm_<cc>`` (0 if none)."""
    arch = _arch(cc)
    for threads in range(arch.max_threads_per_block, 0, -WARP):
        if occupancy(res, threads, cc).blocks_per_sm > 0:
            return threads
    return 0
