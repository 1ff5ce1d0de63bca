"""The only place where Numba decorators are configured.

* :func:`cpu_kernel` — CPU twins: ``njit(parallel=True, nogil=True, cache=True)``.
  ``nogil`` lets calls for different cache layers really run in parallel.
* :func:`cuda_kernel` — lazy ``cuda.jit`` kernels (no signature strings: an eager
  signature needs a driver at import).  ``fastmath`` stays off by default on both twins
  so they compute the same thing; a CPU twin compared only within round-off may opt into
  :data:`FASTMATH_REDUCE`.
* :func:`twin` — compiles one plain-Python scalar/row *core* twice: as a CPU function
  (``njit``) and as a CUDA device function (:func:`cuda_device`).  Cores call
  other cores by their plain names; each compiled variant sees the matching variant of
  its callees (the CPU core calls CPU cores, the device core calls device cores).
* :func:`specialize` — one source, variants that differ in the globals it calls (the flat and
  paged decode attention kernels: how a token is found).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import pathlib
import types
from collections.abc import Callable

from llvmlite import binding as llvm_binding
from numba import cuda, njit
from numba.core import config as numba_config
from numba.cuda import dispatcher as _cuda_dispatcher

from . import _backend, _config

__all__ = ["CORES", "FASTMATH_REDUCE", "cpu_call", "cpu_kernel", "cpu_serial", "cuda_device", "cuda_kernel",
           "device_functions_for", "specialize", "twin"]

# plain function -> (cpu variant, device variant)
CORES: dict[Callable, tuple[Callable, Callable]] = {}


@functools.lru_cache(maxsize=1)
def kernel_sources_digest() -> str:
    """SHA-256 of every source a kernel can compile in: ``ops/**/*.py`` (subpackages such as
    ``ops/attention/`` included) and this file."""
    root = pathlib.Path(__file__).parent
    h = hashlib.sha256()
    for path in sorted([root / "_jit.py", *root.joinpath("ops").rglob("*.py")]):
        h.update(path.relative_to(root).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _restamp(dispatcher: Callable) -> Callable:
    """Key ``dispatcher``'s on-disk cache on all kernel sources, not only its own file.

    Numba revalidates a cached kernel against the source file that defines it; our kernels
    inline cores from other modules (``_rotate_head_inverse`` into the attention merge, the
    binary16 helpers into every quantizer), so editing a core would otherwise leave other
    modules' cached kernels stale and silently wrong.  Uses Numba's cache-file stamp (a
    private attribute, present in numba 0.6x and numba-cuda); without it nothing changes.
    """
    cache_file = getattr(getattr(dispatcher, "_cache", None), "_cache_file", None)
    if cache_file is not None and hasattr(cache_file, "_source_stamp"):
        cache_file._source_stamp = (cache_file._source_stamp,  # noqa: SLF001 - Numba's own (see above)
                                    kernel_sources_digest())
    return dispatcher


def codegen_has_avx512() -> bool:
    """True when Numba's CPU code generation in this process targets AVX-512 (and with it
    32 vector registers, against 16 with AVX2): ``NUMBA_CPU_FEATURES`` when it is set (the
    ``+avx512f`` flag), else the host's features when ``NUMBA_CPU_NAME`` is unset or
    ``host``; a CPU named without features counts as without AVX-512 (the choice that stays
    fast on either register file).  Register-blocked CPU loops use it to pick their block
    size at import; Numba's on-disk cache keys entries on the same target name and
    features, so a cached kernel always holds the variant of its own target."""
    return _codegen_has("avx512f")


def _codegen_has(flag: str) -> bool:
    """Whether Numba's CPU target has LLVM feature ``flag``: ``NUMBA_CPU_FEATURES`` when it is
    set, else the host's features when ``NUMBA_CPU_NAME`` is unset or ``host``; a CPU named
    without features counts as without it."""
    features = numba_config.CPU_FEATURES
    if features:
        return f"+{flag}" in features.replace(" ", "").split(",")
    name = numba_config.CPU_NAME
    if name and name != "host":
        return False
    return bool(llvm_binding.get_host_cpu_features().get(flag, False))


#: LLVM host cores whose 8-lane lane-crossing permutes are slow (AMD Zen 1: ``vpermps`` is 3
#: micro-ops, one per 4 cycles, against 1 micro-op elsewhere since Haswell / Zen 2)
SLOW_PERMUTE_HOSTS = frozenset({"znver1"})


def codegen_permutes_fast() -> bool:
    """True when the CPU code is generated with AVX2 (``+avx2`` in ``NUMBA_CPU_FEATURES`` when
    it is set, else the host's features when ``NUMBA_CPU_NAME`` is unset or ``host``) and
    runs on a host whose 8-lane permutes are fast (not in :data:`SLOW_PERMUTE_HOSTS`).  The
    decode of 4-bit codes picks its loop by it at import (see
    :func:`numba_kv.ops.attention.cpu._decode_tile_simd`); a CPU named without features counts as
    without AVX2 (the byte table, which every target runs well)."""
    return llvm_binding.get_host_cpu_name() not in SLOW_PERMUTE_HOSTS and _codegen_has("avx2")


#: LLVM fast-math flags a CPU twin may opt into: reassociation and contraction let float
#: reductions (dot products) vectorize and fuse into FMAs.  Never ``nnan``/``ninf``: kernels
#: mask with ``-inf`` and must keep IEEE semantics for it.
FASTMATH_REDUCE = frozenset({"reassoc", "contract", "nsz", "arcp"})


def cpu_kernel(fn: Callable | None = None, *, fastmath: bool | set | frozenset = False,
               serial_globals: dict | None = None) -> Callable:
    """CPU twin of a kernel: parallel, GIL-free, cached.

    The returned dispatcher carries a serial compilation of the same body as ``.serial``
    (``prange`` runs as ``range``): for small inputs (one decode step) opening a parallel
    region costs more than the work, and on a busy machine far more.  :func:`cpu_call`
    picks between the two by work size.

    Use as ``@cpu_kernel`` or ``@cpu_kernel(fastmath=FASTMATH_REDUCE)``: ``fastmath`` (a
    bool or a set of LLVM flags, default off) applies to the CPU twin only, for kernels
    whose results are compared within float round-off (never for bit-exact quantizers).
    ``serial_globals`` rebinds globals of the serial compilation only (compile-time
    constants, see :func:`specialize`), e.g. a flag that lets the body allocate its buffers
    once instead of once per ``prange`` iteration.
    """
    if fn is None:
        return functools.partial(cpu_kernel, fastmath=fastmath, serial_globals=serial_globals)
    fm = set(fastmath) if not isinstance(fastmath, bool) else fastmath
    par = _restamp(njit(parallel=True, nogil=True, cache=True, fastmath=fm)(fn))
    # a distinct qualname keeps the two compilations apart in Numba's on-disk cache
    g = {**fn.__globals__, **serial_globals} if serial_globals else fn.__globals__
    ser = types.FunctionType(fn.__code__, g, fn.__name__, fn.__defaults__, fn.__closure__)
    ser.__qualname__ = fn.__qualname__ + "__serial"
    ser.__module__ = fn.__module__
    par.serial = _restamp(njit(parallel=False, nogil=True, cache=True, fastmath=fm)(ser))
    return par


def cpu_call(kernel: Callable, work: int, *args):
    """Run CPU twin ``kernel`` in parallel, or its serial compilation when ``work`` (scalar
    operations, roughly) is below the ``cpu_parallel_min_work`` knob of :mod:`numba_kv._config`."""
    if work < _config.get("cpu_parallel_min_work"):
        return kernel.serial(*args)
    return kernel(*args)


def cpu_serial(fn: Callable | None = None, *, fastmath: bool | set | frozenset = False,
               inline: bool = False) -> Callable:
    """Serial jitted CPU helper (host-side glue that must not open a parallel region);
    ``fastmath`` as for :func:`cpu_kernel`, ``inline`` as for :func:`twin` (for helpers
    called per block or per value inside a hot loop)."""
    if fn is None:
        return functools.partial(cpu_serial, fastmath=fastmath, inline=inline)
    fm = set(fastmath) if not isinstance(fastmath, bool) else fastmath
    opts = {"inline": "always"} if inline else {}
    return _restamp(njit(parallel=False, nogil=True, cache=True, fastmath=fm, **opts)(fn))


def cuda_kernel(fn: Callable | None = None, *, launch_bounds: tuple[int, int] | None = None) -> Callable:
    """CUDA kernel, compiled lazily on first launch (or by ``compile_ptx``).

    Use as ``@cuda_kernel`` or ``@cuda_kernel(launch_bounds=(max_threads, min_blocks))``:
    the PTX ``.maxntid``/``.minnctapersm`` directives, which let ptxas budget registers for
    ``min_blocks`` resident blocks of ``max_threads`` (and make a larger block fail to
    launch).  Kept on the dispatcher as ``.launch_bounds`` (``None`` when not given), so
    the static resource checks compile the same PTX; the simulator ignores it.
    """
    if fn is None:
        return functools.partial(cuda_kernel, launch_bounds=launch_bounds)
    opts = {} if launch_bounds is None or _backend.simulator_enabled() else {"launch_bounds": tuple(launch_bounds)}
    kernel = _restamp(cuda.jit(fn, cache=True, **opts))
    kernel.launch_bounds = None if launch_bounds is None else tuple(launch_bounds)
    return kernel


def cuda_device(fn: Callable, *, ir_inline: bool = False) -> Callable:
    """CUDA device function, inlined into its callers by NVVM (``forceinline``: LLVM's
    ``alwaysinline``); also the device side of :func:`twin`, and what CUDA-only helpers
    (block-cooperative stages that call ``cuda.syncthreads``, the tensor-core tiles) use.

    Why NVVM and not Numba's IR inliner (``inline="always"``): the IR inliner deep-copies the
    callee's IR block by block, each copy taking the callee's whole variable scope along, once
    per call site and nesting level, and re-types the result inside every caller: the 3-bit
    pair quantizer spent 44 s of its 47 s build in Numba (about two thirds of it in the
    inliner, by ``cProfile``) and 3 s in NVVM; built with NVVM inlining it takes 4 s, the
    decode attention kernels 8-16 s instead of 20-31 s (``benchmarks/compile_times.py``,
    a 2-vCPU AMD EPYC).  An NVVM-inlined function is typed and
    lowered once per signature and process, shared by every kernel that calls it, and
    inlined before NVVM optimizes the kernel.  It compiles for the current device's
    capability (:func:`device_functions_for` supplies one to ``compile_ptx`` without a
    driver).

    The kernels' hot loops stay within 2 % of the IR-inlined build's SASS (sm_90;
    ``tests/cuda/test_sass.py`` holds their budgets), but for ``copy_tokens`` (+6 %) and the
    int8 exact-window loop of the warp and tensor-core kernels (+36 %: NVVM unrolls its inner
    loops further).
    Inlining small cores at the IR level as well was tried and is worse: NVVM then optimizes
    the NVVM-inlined callers differently (the tensor-core kernel's loop 1,170 -> 1,680).

    ``ir_inline``: inline at the Numba IR level instead, for a helper that returns a view of
    an argument array (a cache plane), which a CUDA device function cannot (Numba returns
    only an argument itself); keep such a helper to one line.  The simulator's ``jit`` takes
    no ``forceinline``.
    """
    if ir_inline:
        return cuda.jit(device=True, inline="always")(fn)
    if _backend.simulator_enabled():
        return cuda.jit(device=True)(fn)
    return cuda.jit(device=True, forceinline=True)(fn)


@contextlib.contextmanager
def device_functions_for(cc: tuple[int, int]):
    """Compile the NVVM-inlined device functions (:func:`cuda_device`) a kernel calls for
    ``sm_<cc>`` while ``compile_ptx`` builds it without a GPU: numba-cuda compiles such a
    function for the *current device*'s compute capability, which needs a driver.  Only the
    PTX tooling uses it; launches on a GPU compile as usual."""
    class _Device:
        compute_capability = tuple(cc)

    saved = _cuda_dispatcher.get_current_device
    _cuda_dispatcher.get_current_device = _Device
    try:
        yield
    finally:
        _cuda_dispatcher.get_current_device = saved


def _rebind(fn: Callable, which: int) -> Callable:
    g = dict(fn.__globals__)
    for name, val in fn.__globals__.items():
        try:
            hit = callable(val) and val in CORES
        except TypeError:  # unhashable callable
            hit = False
        if hit:
            g[name] = CORES[val][which]
    new = types.FunctionType(fn.__code__, g, fn.__name__, fn.__defaults__, fn.__closure__)
    new.__qualname__ = fn.__qualname__ + ("_cpu" if which == 0 else "_dev")
    new.__module__ = fn.__module__
    new.__doc__ = fn.__doc__
    return new


def specialize(fn: Callable, suffix: str, *, name: str | None = None, **names) -> Callable:
    """``fn``'s code with the globals ``names`` rebound: one source compiled into variants.

    Numba reads a function's globals as compile-time constants, so a variant that binds
    ``PAGED = True`` and the paged pool's addressing cores compiles only those (the branch
    on a constant folds away, the other cores are never typed).  ``suffix`` is appended to
    the qualified name, which keeps the variants apart in Numba's on-disk cache; ``name``, if
    given, replaces the name and the qualified name instead (a registered kernel's
    ``_<op>_cpu`` / ``_<op>[_<variant>]_cuda``).
    """
    g = dict(fn.__globals__)
    g.update(names)
    new = types.FunctionType(fn.__code__, g, name or fn.__name__, fn.__defaults__, fn.__closure__)
    new.__qualname__ = name or fn.__qualname__ + suffix
    new.__module__ = fn.__module__
    new.__doc__ = fn.__doc__
    return new


def twin(fn: Callable, *, inline: bool = False, device: Callable | None = None,
         returns_view: bool = False) -> tuple[Callable, Callable]:
    """Compile core ``fn`` for the CPU and as a CUDA device function.

    Parameters
    ----------
    fn : plain Python function
        The core.
    inline : bool
        Inline the CPU variant into its callers at the Numba IR level
        (``njit(inline="always")``).  A call from one ``njit`` function to another is left
        to LLVM, which sees the callee (Numba links its module into the caller's) but
        inlines by its own cost model; a call it keeps costs as much as the work of a small
        core (a group of 8 indices, one binary16 conversion) and keeps the caller's loop
        from vectorizing.  Use it for small cores called per value or per item, whose
        inlining must not depend on that model.  The device variant is always inlined, by NVVM
        (:func:`cuda_device`).  On the CPU an inlined core that takes an array
        costs an atomic NRT incref/decref pair per call wherever Numba's reference-count
        pruning cannot pair them (a call inside a loop nest): in per-token loops hand such
        cores scalars, or write the one line out (the CPU tile loops of
        :mod:`numba_kv.ops.attention.cpu` do).
    device : device function, optional
        Use this as the device variant instead of compiling ``fn`` (a libdevice intrinsic
        with the semantics of ``fn``, such as ``fmul_rn`` for a product that must not be
        contracted into an FMA).
    returns_view : bool
        ``fn`` returns a view of an argument array (a cache plane), which a CUDA device
        function cannot: its device variant is inlined at the Numba IR level instead
        (``cuda_device(..., ir_inline=True)``).

    Returns
    -------
    (cpu, dev) : tuple of dispatchers
        ``cpu`` is callable from ``njit`` code (and from Python), ``dev`` from CUDA kernels.
    """
    opts = {"inline": "always"} if inline else {}
    cpu = _restamp(njit(nogil=True, cache=True, fastmath=False, **opts)(_rebind(fn, 0)))
    dev = cuda_device(_rebind(fn, 1), ir_inline=returns_view) if device is None else device
    CORES[fn] = (cpu, dev)
    return cpu, dev
