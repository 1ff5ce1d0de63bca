"""The one place that inspects array types: device detection, allocation, launch geometry.

An array is **cuda** when it exposes ``__cuda_array_interface__`` (CuPy, Numba device
arrays, any CAI producer) or ``__cuda_ndarray__`` (device arrays of Numba's CUDA
simulator, which lack the interface); it is **cpu** when it is a ``numpy.ndarray``.
Anything else is a ``TypeError`` naming the argument.  Arrays of one call must all live
on one device: mixing raises ``ValueError`` — data is never copied between host and
device behind the caller's back.
"""

from __future__ import annotations

import importlib.util
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
from numba import cuda

from . import _config

# numba still ships its own numba.cuda (deprecated), which lacks what the kernels use
# (cuda.libdevice, inline PTX): without numba-cuda, a core requirement, say so here rather
# than fail on an attribute in some ops module
if importlib.util.find_spec("numba_cuda") is None:
    raise ImportError("numba_kv needs the numba-cuda package (numba's built-in numba.cuda is deprecated and lacks "
                      "what the kernels use): pip install numba-cuda")



def _numpy_compat() -> None:
    """Give numpy ≥ 2.5 back ``np.row_stack`` (an alias of ``np.vstack``, removed there) when it
    lacks it: numba-cuda 0.30 registers an overload of it while it loads its target, at the
    first CUDA compilation, and without it no CUDA kernel compiles ("module 'numpy' has no
    attribute 'row_stack'", seen on numpy 2.5.2)."""
    if not hasattr(np, "row_stack"):
        np.row_stack = np.vstack


_numpy_compat()

CPU = "cpu"
CUDA = "cuda"
_F32 = np.dtype(np.float32)

__all__ = ["CPU", "CUDA", "check_device_f32", "device_of", "resolve_device", "xp_of", "empty", "zeros",
           "to_host", "cuda_grid", "coop_grid", "simulator_enabled", "ascontiguous_f32", "constant",
           "launch_stream_state", "set_launch_stream_state", "step_recorder", "set_step_recorder", "barrier",
           "same_view", "is_cupy"]


def simulator_enabled() -> bool:
    """True when Numba's CUDA simulator is active (``NUMBA_ENABLE_CUDASIM=1``)."""
    return os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")


def device_of(name: str, a: Any) -> str:
    """Return ``"cpu"`` or ``"cuda"`` for array ``a``; ``TypeError`` names ``name`` otherwise."""
    if isinstance(a, np.ndarray):
        return CPU
    if hasattr(a, "__cuda_array_interface__") or hasattr(a, "__cuda_ndarray__"):
        return CUDA
    raise TypeError(
        f"{name}: expected a numpy.ndarray or a CUDA array (CuPy / __cuda_array_interface__), "
        f"got {type(a).__module__}.{type(a).__name__}"
    )


def resolve_device(backend: str = "auto", **arrays: Any) -> str:
    """Return the common device of the named arrays (``None`` values are skipped).

    Parameters
    ----------
    backend : {"auto", "cpu", "cuda"}
        ``"auto"`` picks from the arrays; an explicit value must agree with them (it is a
        check for tests and benchmarks, never a way to move data).
    **arrays
        The arrays of one call, by argument name.

    Raises
    ------
    ValueError
        If two arrays live on different devices, or ``backend`` disagrees with them.
    """
    if backend not in ("auto", CPU, CUDA):
        raise ValueError(f"backend: expected 'auto', 'cpu' or 'cuda', got {backend!r}")
    found: dict[str, str] = {}
    for name, a in arrays.items():
        if a is None:
            continue
        found[name] = device_of(name, a)
    devices = set(found.values())
    if len(devices) > 1:
        (n1, d1), (n2, d2) = [next((n, d) for n, d in found.items() if d == dev)
                              for dev in sorted(devices)]
        raise ValueError(f"{n1} is on {d1} but {n2} is on {d2}: all arrays of one call must "
                         "live on the same device (no implicit host/device copies)")
    dev = devices.pop() if devices else CPU
    if backend != "auto" and backend != dev:
        raise ValueError(f"backend: {backend!r} requested but the arrays are on {dev}")
    return dev


def is_cupy(a: Any) -> bool:
    """Whether ``a`` is a CuPy array (a test only: no CuPy work, so no :func:`barrier`)."""
    return type(a).__module__.split(".")[0] == "cupy"


_is_cupy = is_cupy


def xp_of(a: Any):
    """Array namespace of ``a``: ``numpy`` for host arrays, ``cupy`` for CuPy arrays,
    ``None`` for Numba device arrays (use :func:`empty`).

    For a device array, device work other than a kernel launch usually follows (CuPy work,
    a Numba copy): inside a :class:`numba_kv.StepGraph` step the launches held back go first
    (:func:`barrier`).  A type test that does no such work uses :func:`is_cupy` instead."""
    if isinstance(a, np.ndarray):
        return np
    barrier()
    if _is_cupy(a):
        import cupy  # noqa: PLC0415 - optional dependency (extra "cuda"): imported once a CuPy array is seen

        return cupy
    return None


def empty(like: Any, shape: tuple[int, ...], dtype) -> Any:
    """Uninitialized array of ``shape``/``dtype`` on the device (and namespace) of ``like``."""
    xp = xp_of(like)
    if xp is not None:
        return xp.empty(shape, dtype=dtype)
    barrier()
    return cuda.device_array(shape, dtype=dtype)


def zeros(like: Any, shape: tuple[int, ...], dtype) -> Any:
    """Zero-filled array of ``shape``/``dtype`` on the device of ``like``."""
    xp = xp_of(like)
    if xp is not None:
        return xp.zeros(shape, dtype=dtype)
    barrier()
    return cuda.to_device(np.zeros(shape, dtype=dtype))


def full(like: Any, shape: tuple[int, ...], dtype, value: Any) -> Any:
    """Array of ``shape``/``dtype`` filled with ``value`` on the device of ``like``."""
    xp = xp_of(like)
    if xp is not None:
        return xp.full(shape, value, dtype=dtype)
    barrier()
    return cuda.to_device(np.full(shape, value, dtype=dtype))


#: this thread's CUDA launch stream (``numba_kv.launch_stream``): ``(Numba stream or None for
#: the default one, its cudaStream_t)``
_launch_local = threading.local()


def launch_stream_state() -> tuple[Any, int]:
    """``(Numba stream or None, cudaStream_t)`` this thread's kernels launch on."""
    return getattr(_launch_local, "stream", (None, 0))


def set_launch_stream_state(state: tuple[Any, int]) -> None:
    """Set what :func:`launch_stream_state` returns for this thread."""
    _launch_local.stream = state


def stream_event() -> Any:
    """A CUDA event for ordering two streams (no timing: ``record`` then ``wait`` on another
    stream makes it wait on the device, the host never blocks)."""
    return cuda.event() if simulator_enabled() else cuda.event(timing=False)


#: this thread's deferred step (``numba_kv.StepGraph.run``), or ``None``
_step_local = threading.local()


def step_recorder() -> Any:
    """The recorder of the :class:`numba_kv.StepGraph` step this thread runs, or ``None``."""
    return getattr(_step_local, "recorder", None)


def set_step_recorder(recorder: Any) -> Any:
    """Make ``recorder`` this thread's step recorder; returns the previous one."""
    previous = getattr(_step_local, "recorder", None)
    _step_local.recorder = recorder
    return previous


def barrier() -> None:
    """Device work other than a kernel launch follows (an allocation, a copy, a CuPy
    operation, a host read): inside a :class:`numba_kv.StepGraph` step, the kernel launches it
    holds back are launched first, in order, and the rest of the step runs as launched."""
    rec = getattr(_step_local, "recorder", None)
    if rec is not None:
        rec.flush()


def to_host(a: Any) -> np.ndarray:
    """Copy any supported array to a NumPy array (explicit, for tests and reports).

    Inside ``numba_kv.launch_stream`` the launch stream is synchronized first: the copy runs on
    the default stream (or CuPy's current one), which a non-blocking stream does not wait
    for."""
    if isinstance(a, np.ndarray):
        return a
    barrier()
    stream, handle = launch_stream_state()
    if handle and stream is not None:
        stream.synchronize()
    if _is_cupy(a):
        return a.get()
    return a.copy_to_host()


def check_device_f32(name: str, a: Any) -> None:
    """``TypeError`` naming ``name`` if ``a`` is a Numba device array of another dtype than
    float32 (:func:`ascontiguous_f32` cannot cast those): callers check it before they change
    any state, so such an argument is refused with nothing stored."""
    if not isinstance(a, np.ndarray) and not _is_cupy(a) and np.dtype(a.dtype) != _F32:
        raise TypeError(f"{name}: expected a float32 Numba device array (they are not cast on the device), "
                        f"got dtype {a.dtype}")


def ascontiguous_f32(name: str, a: Any) -> Any:
    """``a`` as a C-contiguous float32 array on its own device.

    Host arrays and CuPy arrays are converted; Numba device arrays must already be
    float32 (no device-side cast: float64 beyond float32 would need a range check), else
    ``TypeError``; a strided float32 one (a slice of a fused QKV projection, say) is copied
    into a new C-contiguous array on the device, as CuPy's are.
    """
    if type(a) is np.ndarray and a.dtype == _F32 and a.flags.c_contiguous:
        return a  # the common case (every decode step's k, v and q): nothing to convert or check
    if _is_cupy(a) and a.dtype == _F32 and a.flags.c_contiguous:
        return a  # the same on a GPU: the very object (a launch's arguments repeat), no CuPy work
    xp = np if isinstance(a, np.ndarray) else xp_of(a) if _is_cupy(a) else None  # Numba: no namespace
    if xp is not None:
        dt = np.dtype(a.dtype)
        if dt.kind not in "fiub":  # complex would lose its imaginary part, objects fail later
            raise TypeError(f"{name}: expected a real (float or integer) array, got dtype {dt}")
        # an overflow to inf is reported just below as a ValueError, not as NumPy's warning
        with np.errstate(over="ignore"):
            out = xp.ascontiguousarray(a, dtype=xp.float32)
        # float64 beyond the float32 range (a rare input: the check reads the converted copy once)
        if (dt.itemsize > 4 and dt.kind == "f" and out.size and not bool(xp.isfinite(out).all())
                and bool(xp.isfinite(a).all())):
            big, f32max = float(xp.abs(a).max()), float(np.finfo(np.float32).max)
            raise ValueError(f"{name}: max |{name}| = {big:.6g} exceeds {f32max:.6g}, the largest float32 "
                             "(computations here run in float32)")
        return out
    check_device_f32(name, a)
    return a if a.is_c_contiguous() else _contiguous_copy(a)


def _contiguous_copy(a: Any) -> Any:
    """A strided float32 Numba device array copied into a new C-contiguous one, on the
    thread's launch stream (in order with the work that produced ``a``; no host sync)."""
    barrier()
    dst = cuda.device_array(tuple(a.shape), np.float32)
    if int(a.size) == 0:
        return dst
    if simulator_enabled():
        dst[...] = a  # (the simulator's arrays are NumPy arrays inside, without a stream)
    else:
        # (Numba's assignment kernel; given a stream it does not synchronize the host)
        dst.setitem(Ellipsis, a, stream=launch_stream_state()[0] or cuda.default_stream())
    return dst


#: views a :func:`same_view` memo keeps (the oldest dropped first)
VIEW_MEMO_LIMIT = 256
#: the largest caller's array whose view :func:`same_view` keeps (a decode step's inputs are
#: far smaller: ``batch · heads · head_dim`` floats)
VIEW_MEMO_MAX_BYTES = 1 << 20


def same_view(memo: dict, role: Any, a: Any, make: Callable[[Any], Any], owned: bool = False) -> Any:
    """``make(a)`` (a view of a device array ``a``: a reshape, a reinterpretation), the very
    object of the previous call with the same ``memo`` and ``role`` while ``a`` is the same
    object with the same shape and dtype.

    A view is a new array object each time it is made; a launch keyed by its arrays' identity
    (prepared launches, :class:`numba_kv.StepGraph`) repeats only when a step passes the same
    objects.  ``memo`` is owned by the caller (a layer's scratch, a cache, an op module); a
    role may include ``id(a)`` (the identity is checked through a weak reference).  A kept
    view keeps its array's memory alive, so a memo keeps at most :data:`VIEW_MEMO_LIMIT`
    views, and of a caller's array only when it is at most :data:`VIEW_MEMO_MAX_BYTES`
    (``owned``: ``a`` is the memo owner's own buffer, e.g. a page pool: any size)."""
    if isinstance(a, np.ndarray) or (not owned and int(a.size) * np.dtype(a.dtype).itemsize > VIEW_MEMO_MAX_BYTES):
        return make(a)
    hit = memo.get(role)
    if hit is not None and hit[0]() is a and hit[1] == (tuple(a.shape), a.dtype):
        return hit[2]
    view = make(a)
    try:
        memo[role] = (weakref.ref(a), (tuple(a.shape), a.dtype), view)
    except TypeError:  # not weakly referable: a new view every time
        memo.pop(role, None)
        return view
    while len(memo) > VIEW_MEMO_LIMIT:
        try:
            memo.pop(next(iter(memo)), None)
        except (RuntimeError, StopIteration):  # changed by another thread meanwhile: next time
            break
    return view


def cuda_grid(n: int, threads: int | None = None) -> tuple[int, int]:
    """Launch geometry ``(blocks, threads)`` covering ``n`` independent work items.

    Under the simulator the block is kept small (every simulated thread is an OS thread).
    """
    if threads is None:
        threads = _config.get("cuda_threads_sim" if simulator_enabled() else "cuda_threads")
    n = max(int(n), 1)
    threads = max(1, min(int(threads), n if simulator_enabled() else threads))
    return (n + threads - 1) // threads, threads


def coop_grid(n_rows: int, width: int) -> tuple[int, int]:
    """Launch geometry ``(blocks, threads)`` of a block-cooperative kernel: one block per row
    (grid-stride beyond ``2**16`` rows), at most ``width`` threads per block (the work items
    of one row), capped by the ``cuda_threads`` knob (``cuda_threads_sim`` under the simulator)."""
    cap = _config.get("cuda_threads_sim" if simulator_enabled() else "cuda_threads")
    return max(1, min(int(n_rows), 1 << 16)), max(1, min(int(width), int(cap)))


_CONST_CACHE: dict = {}


def _device_id(like: Any, kind: str) -> int:
    """Ordinal of the GPU that holds ``like`` (CuPy) or of the current context (Numba)."""
    if kind == "cupy":
        return int(like.device.id)

    return int(getattr(cuda.get_current_device(), "id", 0) or 0)  # the simulator's device has no id


def constant(like: Any, host: np.ndarray) -> Any:
    """``host`` (a long-lived read-only NumPy constant: signs, codebooks) on the device of
    ``like``.  Device copies are made once per array namespace and GPU and reused, so a
    steady-state call uploads nothing."""
    if isinstance(like, np.ndarray):
        return host
    kind = "cupy" if _is_cupy(like) else "numba"
    key = (kind, _device_id(like, kind), id(host))
    hit = _CONST_CACHE.get(key)
    if hit is not None and hit[0] is host:
        return hit[1]
    barrier()
    if kind == "cupy":
        with like.device:  # the constant lives on the GPU of ``like``
            dev = xp_of(like).asarray(host)
    else:
        dev = cuda.to_device(np.ascontiguousarray(host))
    _CONST_CACHE[key] = (host, dev)
    return dev
