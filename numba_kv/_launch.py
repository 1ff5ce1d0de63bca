"""CUDA launches whose parameters were converted once: the repeat of a launch skips Numba's
per-argument typing and conversion.

Numba launches ``kernel[grid, block](*args)`` by typing every argument (``typeof``; for a
CuPy array through its ``__cuda_array_interface__`` dict), resolving the overload, and
converting every argument into the kernel's parameters (a device-array view per array, with
a stream synchronization for interface arrays, then the pointer, shape and strides).  On an
H100 that is 0.15–0.4 ms of host time per launch of the decode attention's ~45 arguments, 36
µs for a 6-array kernel with Numba device arrays and 147 µs with CuPy ones — while the
kernels of a steady decode step run for microseconds.  Those launches repeat step after step
with the same arrays and scalars (``tests/cuda/test_sim_graph_replay.py``), so their
parameters can be converted once: the plan/run split of FlashInfer, at the level of a launch.

:func:`launch` keys a launch by the kernel, the geometry and its arguments: each array by its
identity and shape (CuPy lets a contiguous array change its shape in place), every other
argument by its type and value.  The first launch with a key goes through Numba as before; a
pre-launch callback of that launch hands over the compiled kernel, and Numba's own argument
conversion (``_Kernel._prepare_args``) turns the arguments into the kernel's parameters once.
A later launch with the same key, whose arrays are still the very objects of the first (held
by weak references: a freed array's id may be reused, and a cache entry must not keep device
memory alive), passes those parameters straight to ``cuda.core.launch``, the call Numba's
launch ends in.  What a repeat skips, besides the typing: Numba's stream synchronization of
interface arrays — the package launches every kernel on the default stream, in order with the
work that produced its inputs.

Anything unexpected — the simulator, a Numba without the callback, an argument that cannot be
weakly referenced, host arrays that Numba copies, a failure while preparing — leaves the
launch to Numba, as before.  The knob ``cuda_prepared_launch`` (default 1;
``NUMBA_KV_CUDA_PREPARED_LAUNCH=0``) turns the cache off.  Entries are kept for the 1024 most
recent keys.

**The parameter buffer, built once.**  ``cuda.core``'s ``launch`` packs its arguments into a
new ``ParamHolder`` (the ``void*`` array ``cuLaunchKernelEx`` reads) on every call: an
isinstance chain and a copy per parameter.  The tensor-core attention kernel has 328
parameters (an array is ``5 + 2·ndim`` of them), and packing them costs about 19 µs on a
2-vCPU AMD EPYC (``benchmarks/launch_params.py``), a repeat's largest cost after Numba's
typing is gone.  An
entry therefore packs its parameters once into a ``ParamHolder`` of its own and a repeat
calls the driver's ``cuLaunchKernel`` with that buffer (which the driver copies at the call;
``cuda.core`` launches the same ``CUkernel`` handle the same way).  Not for cooperative
launches; a failed call falls back to ``cuda.core``'s launch for good.  The knob
``cuda_direct_launch`` (default 1) turns it off.

**Streams.** By default every kernel launches on the default stream.  Inside ``with
numba_kv.launch_stream(stream):`` this thread's launches go to ``stream`` instead (a Numba
stream, a CuPy stream — also made CuPy's current stream for the block, so that the package's
CuPy work inside a step runs there too —, a torch stream, or a raw ``cudaStream_t`` handle):
the caller's own stream, e.g. torch's, without a synchronization between the two, and a
non-default stream is what a CUDA graph capture needs.  Prepared launches are kept per stream.

Launch contract: as ``dispatcher[grid, block, stream](*args)``, ``stream`` that of the
innermost :func:`launch_stream` of the calling thread (default: the default stream).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
from numba import cuda

from . import _backend, _config

try:  # the module whose launch this repeats (numba-cuda; its names as Numba uses them)
    from numba.cuda import dispatcher as _nd
except ImportError:  # pragma: no cover - numba-cuda is a core dependency
    _nd = None
try:  # the driver's launch, and the parameter packing of cuda.core's (numba-cuda's dependencies)
    from cuda.bindings import driver as _drv
    from cuda.core._kernel_arg_handler import ParamHolder as _ParamHolder
except ImportError:  # pragma: no cover - a numba-cuda without them: repeats through cuda.core's launch
    _drv = _ParamHolder = None
try:
    from numba.cuda._compat import CUDA_CORE_GE_1_0 as _CORE_GE_1_0
except ImportError:  # pragma: no cover - older numba-cuda: the 1.0 keyword
    _CORE_GE_1_0 = True

__all__ = ["MAX_ENTRIES", "SCALAR_TYPES", "clear", "current_stream", "entry_for", "launch", "launch_key",
           "launch_stream", "refs_hold", "stats"]

#: cache entries kept (the oldest goes first)
MAX_ENTRIES = 1024

#: what a launch passes by value (any other argument is an array, keyed by identity)
SCALAR_TYPES = (bool, int, float, np.generic)
_entries: dict[tuple, _Entry] = {}
_lock = threading.Lock()
_counts = {"prepared": 0, "repeated": 0, "direct": 0, "numba": 0}


def _handle(stream: Any) -> int:
    """The ``cudaStream_t`` of a Numba, CuPy or torch stream, or of a raw handle."""
    if _backend.simulator_enabled() and isinstance(stream, cuda.stream):
        return id(stream)  # the simulator's streams have no handle (and launch in order anyway)
    for attr in ("cuda_stream", "ptr"):  # torch, CuPy
        if hasattr(stream, attr):
            return int(getattr(stream, attr))
    if hasattr(stream, "handle"):  # Numba
        h = stream.handle
        return int(getattr(h, "value", h) or 0)
    if isinstance(stream, int) and not isinstance(stream, bool):
        return stream
    raise TypeError(f"stream: expected a Numba, CuPy or torch CUDA stream or a cudaStream_t handle, got "
                    f"{type(stream).__name__}")


@contextlib.contextmanager
def launch_stream(stream: Any) -> Iterator[Any]:
    """Launch this thread's numba_kv CUDA kernels on ``stream`` inside the block.

    Parameters
    ----------
    stream : Numba stream, CuPy stream, torch stream or int
        The stream (an ``int`` is a raw ``cudaStream_t``; 0 the default stream).  A CuPy
        stream also becomes CuPy's current stream for the block.

    Yields
    ------
    The Numba stream the kernels launch on.

    Raises
    ------
    TypeError
        For anything else, before the block runs.

    Examples
    --------
    >>> import numba_kv
    >>> with numba_kv.launch_stream(0):  # the default stream, as outside the block
    ...     pass
    """
    handle = _handle(stream)
    if hasattr(stream, "handle") or (_backend.simulator_enabled() and handle):
        numba_stream = stream  # a Numba stream (the simulator has no external streams)
    elif handle == 0:
        numba_stream = None
    else:
        numba_stream = cuda.external_stream(handle)
    previous = _backend.launch_stream_state()
    _backend.set_launch_stream_state((numba_stream, handle))
    try:
        with stream if hasattr(stream, "ptr") and hasattr(stream, "__enter__") else contextlib.nullcontext():
            yield numba_stream
    finally:
        _backend.set_launch_stream_state(previous)


def current_stream() -> tuple[Any, int]:
    """``(Numba stream or None for the default one, cudaStream_t)`` this thread launches on."""
    return _backend.launch_stream_state()


class _Entry:
    """A launch converted once: weak references to its arrays (``None`` for scalars), the
    stream (and the launch-stream handle it was keyed by), ``cuda.core`` launch
    configuration, kernel and parameters."""

    __slots__ = ("config", "direct", "handle", "kernel", "params", "refs", "stream")

    def __init__(self, refs: tuple, stream: Any, config: Any, kernel: Any, params: tuple,
                 direct: tuple | None = None) -> None:
        self.refs = refs
        self.stream = stream
        self.handle = _backend.launch_stream_state()[1]
        self.config = config
        self.kernel = kernel
        self.params = params
        #: ``(cuLaunchKernel, its arguments, the ParamHolder they point into)`` or ``None``
        self.direct = direct

    def holds(self, args: tuple) -> bool:
        """Whether every array of ``args`` is the very object this entry was prepared from."""
        return refs_hold(self.refs, args)

    def run(self) -> None:
        """Launch on the entry's stream from its converted parameters: the driver's launch from
        the buffer packed once when there is one (and the knob allows), else ``cuda.core``'s."""
        direct = self.direct
        if direct is not None and _config.get("cuda_direct_launch"):
            err = direct[0](*direct[1])[0]
            if int(err) == 0:  # CUDA_SUCCESS
                _counts["direct"] += 1
                return
            self.direct = None  # (cuda.core's launch below raises what the failure is, if it persists)
        _core()[0](self.stream, self.config, self.kernel, *self.params)

    def capture(self, builder: Any) -> None:
        """Add the launch to ``builder`` (a ``cuda.core`` graph builder that is building)."""
        _core()[0](builder, self.config, self.kernel, *self.params)


def refs_hold(refs: tuple, args: tuple) -> bool:
    """Whether each weak reference of ``refs`` (``None``: a scalar) is to the very object at its
    place in ``args``."""
    for ref, a in zip(refs, args):
        if ref is not None and ref() is not a:
            return False
    return True


def entry_for(dispatcher: Any, grid: Any, block: Any, args: tuple) -> _Entry | None:
    """The prepared entry of this launch on this thread's launch stream, when there is one
    whose arrays are still the very objects of ``args`` (else ``None``: the launch must go
    through Numba)."""
    if _backend.simulator_enabled() or not _config.get("cuda_prepared_launch"):
        return None
    try:
        entry = _entries.get((_backend.launch_stream_state()[1], *launch_key(dispatcher, grid, block, args)))
    except TypeError:
        return None
    return entry if entry is not None and entry.holds(args) else None


def launch_key(dispatcher: Any, grid: Any, block: Any, args: tuple) -> tuple:
    """A launch's key (without the stream): kernel, geometry, each array by identity and
    shape, each scalar by type and value.  ``TypeError`` for an unhashable argument."""
    return (id(dispatcher), grid, block,
            tuple((type(a), a) if isinstance(a, SCALAR_TYPES) else (id(a), getattr(a, "shape", None)) for a in args))


def _core() -> tuple[Any, Any, bool] | None:
    """``(launch, LaunchConfig, is_cooperative keyword)`` of ``cuda.core`` as Numba uses them,
    or ``None`` where this Numba does not launch through ``cuda.core``."""
    core_launch = getattr(_nd, "launch", None)
    config = getattr(_nd, "LaunchConfig", None)
    if core_launch is None or config is None:
        return None
    return core_launch, config, _CORE_GE_1_0


def _prepare(kernel: Any, cfg: Any, args: tuple) -> _Entry | None:
    """The entry of a launch Numba just made with ``kernel`` (its ``_Kernel``) and ``cfg`` (its
    launch configuration), or ``None`` where it cannot be repeated safely."""
    core = _core()
    if core is None or getattr(kernel, "debug", True):
        return None
    _, config_cls, ge_1_0 = core
    refs = tuple(None if isinstance(a, SCALAR_TYPES) else weakref.ref(a) for a in args)
    params: list = []
    written_back: list = []
    for t, v in zip(kernel.argument_types, args, strict=True):
        kernel._prepare_args(t, v, cfg.stream, written_back, params)  # noqa: SLF001 - Numba's own conversion
    if written_back:  # host arrays Numba copies to the device and back: not a pure launch
        return None
    cufunc = kernel._codelibrary.get_cufunc()  # noqa: SLF001 - the function Numba launches
    coop = {"is_cooperative" if ge_1_0 else "cooperative_launch": bool(getattr(kernel, "cooperative", False))}
    config = config_cls(grid=cfg.griddim, block=cfg.blockdim, shmem_size=cfg.sharedmem, **coop)
    direct = None if any(coop.values()) else _direct(cufunc.kernel, cfg, params)
    return _Entry(refs, cfg.stream, config, cufunc.kernel, tuple(params), direct)


def _dim3(x: Any) -> tuple[int, int, int]:
    """A launch dimension (an int or a tuple of up to three) as three ints."""
    t = (int(x),) if isinstance(x, (int, np.integer)) else tuple(int(v) for v in x)
    if not 1 <= len(t) <= 3:
        raise ValueError(f"a launch dimension of 1 to 3 ints, got {x!r}")
    return (*t, *(1,) * (3 - len(t)))


def _driver() -> tuple[Any, Any, Any, Any] | None:
    """``(cuLaunchKernel, ParamHolder, CUfunction, CUstream)`` of ``cuda.bindings`` and
    ``cuda.core`` (numba-cuda's own dependencies), or ``None`` where one is missing."""
    if _drv is None or _ParamHolder is None:  # pragma: no cover - numba-cuda depends on both
        return None
    return _drv.cuLaunchKernel, _ParamHolder, _drv.CUfunction, _drv.CUstream


def _direct(kernel: Any, cfg: Any, params: list) -> tuple | None:
    """The driver launch of a prepared entry: ``(cuLaunchKernel, its arguments, holder)`` with
    the parameters packed once into a ``ParamHolder`` (``holder``, which the arguments' buffer
    address points into and the tuple keeps alive), ``kernel``'s ``CUkernel`` handle and the
    stream handle of ``cfg`` (Numba's launch configuration).  ``None`` where any of it is
    unavailable (the repeat then goes through ``cuda.core``'s launch)."""
    drv = _driver()
    handle = getattr(getattr(cfg.stream, "handle", None), "__int__", None)
    if drv is None or handle is None or not hasattr(kernel, "handle"):
        return None
    launch_kernel, param_holder, function, stream = drv
    holder = param_holder(params)
    args = (function(int(kernel.handle)), *_dim3(cfg.griddim), *_dim3(cfg.blockdim), int(cfg.sharedmem or 0),
            stream(handle()), holder.ptr, 0)
    return launch_kernel, args, holder


def launch(dispatcher: Any, grid: Any, block: Any, args: tuple) -> None:
    """``dispatcher[grid, block](*args)``, from parameters converted by an earlier launch with
    the same kernel, geometry, arrays and scalars when there is one.

    Parameters
    ----------
    dispatcher : numba CUDA dispatcher
        The kernel (``Twin.cuda``).
    grid, block : int or tuple of int
        Launch geometry, as Numba takes it.
    args : tuple
        The kernel's arguments: device arrays (Numba, CuPy, any ``__cuda_array_interface__``
        object) and scalars.
    """
    recorder = _backend.step_recorder()
    if recorder is not None and recorder.defer(dispatcher, grid, block, args):
        return  # held back by a StepGraph step (launched with the step, or replayed as a graph)
    stream, handle = _backend.launch_stream_state()
    geometry = (grid, block) if stream is None else (grid, block, stream)
    if _backend.simulator_enabled() or not _config.get("cuda_prepared_launch"):
        dispatcher[geometry](*args)
        return
    try:
        key = (handle, *launch_key(dispatcher, grid, block, args))
        entry = _entries.get(key)
    except TypeError:  # an unhashable scalar-like argument: Numba's launch as before
        dispatcher[geometry](*args)
        return
    if entry is not None and entry.holds(args):
        entry.run()
        _counts["repeated"] += 1
        return
    cfg = dispatcher[geometry]
    seen: list = []
    callbacks = getattr(cfg, "pre_launch_callbacks", None)
    if callbacks is not None:
        callbacks.append(lambda kernel, _config: seen.append(kernel))
    cfg(*args)  # Numba's launch: typing, compilation when new, conversion
    _counts["numba"] += 1
    if len(seen) != 1:
        return
    try:
        entry = _prepare(seen[0], cfg, args)
    except Exception:  # noqa: BLE001 - an internal Numba API changed: keep launching through Numba
        entry = None
    if entry is None:
        return
    with _lock:
        _entries.pop(key, None)
        while len(_entries) >= MAX_ENTRIES:
            _entries.pop(next(iter(_entries)))
        _entries[key] = entry
        _counts["prepared"] += 1


def clear() -> None:
    """Forget every prepared launch (the next launch of each key goes through Numba)."""
    with _lock:
        _entries.clear()


def stats() -> dict[str, int]:
    """Launches so far: ``prepared`` (entries made), ``repeated`` (launched from an entry),
    ``direct`` (of the entries' launches, those by the driver from a buffer packed once: a
    repeat, or a :class:`numba_kv.StepGraph` step's launch held back), ``numba`` (through
    Numba's launch, once the cache was asked), and ``entries`` (kept now).
    The counters are not locked: exact from one thread, approximate under concurrent
    launches."""
    return {**_counts, "entries": len(_entries)}
