"""All-finite check for input validation (NaN / Inf detection), as twins.

``count = #{i : not |x_i| < inf}`` counts the non-finite values (NaN fails every
comparison, ``±Inf`` is not below ``inf``) with one compare per element — branch-free,
vectorizable, free of floating-point exceptions, and the same for every float dtype.
The CPU twin is a parallel reduction that reads the input once (``numpy.isfinite(x).all()``
writes a boolean temporary as large as ``x`` first); the CUDA kernel checks device arrays
in place instead of copying them to the host.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from numba import cuda, float32, int64, prange, uint64

from .. import _backend
from .._jit import cpu_kernel, cpu_serial, cuda_device, cuda_kernel
from .._validate import F32_MAX
from ._registry import register

__all__ = ["FOLD_SIG", "NO_FOLD_ACC", "NO_FOLD_BITS", "DeferredRange", "RangeStats", "all_finite", "check_finite",
           "check_finite_stats", "check_rotation_input", "fold_absbits_cpu", "fold_absbits_dev", "no_fold",
           "range_stats"]

_CHUNK = 1 << 14  # elements per CPU work item
_INF = float32(np.inf)  # float32: no float64 compare in float32 kernels (exact for float64 ones)
_F32 = np.dtype(np.float32)


# --- CPU twin ---------------------------------------------------------------------------
@cpu_kernel
def _count_nonfinite_cpu(x, out):
    n = x.shape[0]
    bad = 0
    for c in prange((n + _CHUNK - 1) // _CHUNK):
        # a view indexed from 0: no negative-index wraparound check, so the loop vectorizes
        xc = x[c * _CHUNK:min(n, (c + 1) * _CHUNK)]
        k = 0
        for i in range(xc.shape[0]):
            v = xc[i]
            if not abs(v) < _INF:
                k += 1
        bad += k
    out[0] = bad


# --- CUDA kernel: grid-stride, one atomic add per thread that found something ----------
@cuda_kernel
def _count_nonfinite_cuda(x, out):
    n = x.shape[0]
    k = int64(0)
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    for i in range(start, n, stride):
        v = x[i]
        if not abs(v) < _INF:
            k += 1
    if k:
        cuda.atomic.add(out, 0, k)


_COUNT = register("count_nonfinite", _count_nonfinite_cpu, _count_nonfinite_cuda,
         ["void(float32[::1], int64[::1])", "void(float64[::1], int64[::1])"], float32_only=False)


# --- public helper ----------------------------------------------------------------------
def all_finite(a: Any) -> bool:
    """True when array ``a`` (NumPy or CUDA, any shape) holds no NaN and no Inf.

    C-contiguous float32/float64 arrays are checked by the twins; anything else (float16,
    strided views) falls back to ``isfinite(a).all()`` in the array's own namespace.
    """
    dt = np.dtype(a.dtype)
    if a.size == 0 or dt.kind in "iub":
        return True
    fast = dt in (np.dtype(np.float32), np.dtype(np.float64))
    xp = _backend.xp_of(a)
    if isinstance(a, np.ndarray):
        if fast and a.flags.c_contiguous:
            out = np.zeros(1, np.int64)
            _COUNT.launch(_backend.CPU, a.size, a.reshape(-1), out)
            return int(out[0]) == 0
    elif xp is None and fast and getattr(a, "is_c_contiguous", lambda: False)():  # Numba device array
        out = _backend.zeros(a, (1,), np.int64)
        _COUNT.launch(_backend.CUDA, (a.size + 255) // 256, a.reshape(a.size), out)  # ~256 elements per thread
        return int(_backend.to_host(out)[0]) == 0
    if xp is None:  # other Numba device arrays: on the host
        return bool(np.isfinite(_backend.to_host(a)).all())
    return bool(xp.isfinite(a).all())  # NumPy fallback, CuPy


# --- range statistics: finiteness and max |x| in one integer pass; vector norms on demand --
# Caches store binary16 numbers (float16 windows, block scales, vector norms): before they
# store anything they need to know whether the input's magnitude fits.  For IEEE floats
# without the sign bit, the bit pattern read as an unsigned integer grows with |x|, and
# every pattern at or above the exponent mask is Inf or NaN.  So one *integer* max over
# ``bits & ~sign`` gives both answers: exact (no rounding), vectorized like the count above
# (an integer max reduction needs no reassociation of float sums), and it works for
# float16 too.  The largest vector L2 norm is needed only when ``√d · max|x|`` does not
# already prove a bound; :attr:`RangeStats.max_norm` computes it on first use.
@cpu_kernel
def _absbits_max_cpu(u, mask, out):
    n = u.shape[0]
    nch = out.shape[0]
    per = (n + nch - 1) // nch
    for c in prange(nch):
        uc = u[c * per:min(n, (c + 1) * per)]
        m = mask ^ mask  # zero of the mask's type (``mask & 0`` mixes in int64: float64 in Numba)
        for i in range(uc.shape[0]):
            m = max(m, uc[i] & mask)
        out[c] = m


@cuda_kernel
def _absbits_max_cuda(u, mask, out):
    m = mask ^ mask  # zero of the mask's type (``mask & 0`` mixes in int64: float64 in Numba)
    for i in range(cuda.grid(1), u.shape[0], cuda.gridsize(1)):
        m = max(m, u[i] & mask)
    cuda.atomic.max(out, 0, uint64(m))


_RANGE = register("range_stats", _absbits_max_cpu, _absbits_max_cuda,
         ["void(uint16[::1], uint16, uint64[::1])", "void(uint32[::1], uint32, uint64[::1])",
          "void(uint64[::1], uint64, uint64[::1])"])

@cpu_kernel
def _absbits_max3_cpu(u0, m0, o0, u1, m1, o1, u2, m2, o2):
    """CPU twin of the three-array range check: ``o_i[0] = max(o_i[0], max(u_i & m_i))`` for
    each array in turn (serial: the host checks its values synchronously, this twin serves
    the simulator's comparison)."""
    a = m0 ^ m0
    for i in range(u0.shape[0]):
        a = max(a, u0[i] & m0)
    o0[0] = max(o0[0], uint64(a))
    b = m1 ^ m1
    for i in range(u1.shape[0]):
        b = max(b, u1[i] & m1)
    o1[0] = max(o1[0], uint64(b))
    c = m2 ^ m2
    for i in range(u2.shape[0]):
        c = max(c, u2[i] & m2)
    o2[0] = max(o2[0], uint64(c))


@cuda_kernel
def _absbits_max3_cuda(u0, m0, o0, u1, m1, o1, u2, m2, o2):
    """Three range checks in one launch (a decode step's ``k``, ``v`` and ``q``).

    Launch contract: any 1-D grid (``ceil(max size / 256)`` threads: ~256 elements of the
    largest array per thread).  Each thread folds its grid-stride share of ``u0``, ``u1`` and
    ``u2`` (``bits & mask``) and does one ``atomic.max`` into each accumulator.  Accumulators
    may coincide, and an array may be passed twice: a max is idempotent."""
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    a = m0 ^ m0
    for i in range(start, u0.shape[0], stride):
        a = max(a, u0[i] & m0)
    cuda.atomic.max(o0, 0, uint64(a))
    b = m1 ^ m1
    for i in range(start, u1.shape[0], stride):
        b = max(b, u1[i] & m1)
    cuda.atomic.max(o1, 0, uint64(b))
    c = m2 ^ m2
    for i in range(start, u2.shape[0], stride):
        c = max(c, u2[i] & m2)
    cuda.atomic.max(o2, 0, uint64(c))


# --- the deferred range check folded into a kernel that runs anyway (issue 27: a decode step
# within 3 launches): each of up to three arrays is read by ``ceil(size / 256)`` threads of the
# host kernel's 1-D grid (coalesced, grid-stride over the array), each with one atomic max:
# as many atomics as ``range_stats3`` makes.  A mask of 0 marks an unused slot (its arrays are
# placeholders, never read or written); every real mask is nonzero.
def _fold_absbits_cpu(u, m, o):
    if m != 0:
        a = m ^ m
        for i in range(u.shape[0]):
            a = max(a, u[i] & m)
        o[0] = max(o[0], uint64(a))


def _fold_absbits_dev(u, m, o, t, nt):
    if m != 0:
        p = min(nt, (u.shape[0] + 255) // 256)
        if t < p:
            a = m ^ m
            for i in range(t, u.shape[0], p):
                a = max(a, u[i] & m)
            cuda.atomic.max(o, 0, uint64(a))


#: ``fold_absbits_cpu(bits, mask, acc)``: ``acc[0] = max(acc[0], max(bits & mask))`` (serial;
#: nothing when ``mask`` is 0) — the CPU twin's half of :func:`fold_absbits_dev`
fold_absbits_cpu = cpu_serial(_fold_absbits_cpu, inline=True)
#: ``fold_absbits_dev(bits, mask, acc, thread, threads)``: thread ``thread`` of a 1-D grid of
#: ``threads`` folds its share of ``bits & mask`` into ``acc[0]`` (``atomic.max``; see above)
fold_absbits_dev = cuda_device(_fold_absbits_dev)

#: the nine trailing fold arguments of a kernel with nothing to fold (mask 0: never read)
NO_FOLD_BITS = np.zeros(1, np.uint32)
NO_FOLD_ACC = np.zeros(1, np.uint64)
#: their Numba types, three ``(bits, mask, accumulator)`` triples, for kernel signatures
FOLD_SIG = ", ".join(["uint32[::1], uint32, uint64[::1]"] * 3)


def no_fold(like: Any) -> tuple:
    """The nine fold arguments that fold nothing, on the device of ``like``."""
    u, acc = _backend.constant(like, NO_FOLD_BITS), _backend.constant(like, NO_FOLD_ACC)
    z = np.uint32(0)
    return (u, z, acc) * 3


_RANGE3 = register("range_stats3", _absbits_max3_cpu, _absbits_max3_cuda,
                   ["void(uint32[::1], uint32, uint64[::1], uint32[::1], uint32, uint64[::1], uint32[::1], uint32, "
                    "uint64[::1])",
                    "void(uint16[::1], uint16, uint64[::1], uint16[::1], uint16, uint64[::1], uint16[::1], uint16, "
                    "uint64[::1])"])

# (unsigned view dtype, |x| mask, first non-finite pattern) per float dtype
_BITS = {np.dtype(np.float16): (np.uint16, 0x7FFF, 0x7C00),
         np.dtype(np.float32): (np.uint32, 0x7FFFFFFF, 0x7F800000),
         np.dtype(np.float64): (np.uint64, 0x7FFFFFFFFFFFFFFF, 0x7FF0000000000000)}
# the |x| masks as the kernels' unsigned scalars, made once
_MASKS = {dt: udt(mask) for dt, (udt, mask, _) in _BITS.items()}


class RangeStats:
    """What :func:`range_stats` measured: ``nonfinite`` (1 if ``a`` holds NaN or Inf, else
    0), ``amax`` (largest ``|x|`` of the finite values; exact), and ``max_norm`` (largest L2
    norm of the length-``d`` vectors), computed on first access."""

    __slots__ = ("nonfinite", "amax", "_a", "_d", "_norm")

    def __init__(self, nonfinite: int, amax: float, a: Any = None, d: int = 1) -> None:
        self.nonfinite, self.amax, self._a, self._d, self._norm = int(nonfinite), float(amax), a, int(d), None

    @property
    def max_norm(self) -> float:
        """Largest vector L2 norm (float64-safe; ``inf`` when ``a`` is not finite)."""
        if self._norm is None:
            self._norm = _max_vector_norm(self._a, self._d, self.amax) if self._a is not None else 0.0
            self._a = None
        return self._norm

    def __repr__(self) -> str:
        return f"RangeStats(nonfinite={self.nonfinite}, amax={self.amax!r})"


def _max_vector_norm(a: Any, d: int, amax: float) -> float:
    if a.size == 0:
        return 0.0
    if not math.isfinite(amax):
        return math.inf
    xp = _backend.xp_of(a)
    if xp is None:  # Numba device array
        a, xp = _backend.to_host(a), np
    # float32 squares of 2**-60 .. 2**59 summed over <= 2**9 values stay normal and finite
    dt = xp.float32 if 2.0 ** -60 <= amax <= 2.0 ** 59 and d <= 512 else xp.float64
    x = xp.asarray(a, dtype=dt).reshape(-1, d)
    return math.sqrt(float(xp.einsum("ij,ij->i", x, x).max()))


def range_stats(a: Any, d: int | None = None) -> RangeStats:
    """Non-finite flag and largest ``|x|`` of ``a`` in one read; the largest L2 norm of its
    length-``d`` vectors (the last axis by default) on demand (:class:`RangeStats`).

    C-contiguous float16/32/64 NumPy and Numba device arrays run on the twins (an integer
    max over the bit patterns, see above); strided views and CuPy arrays use their own
    namespace's reductions.
    """
    d = int(tuple(a.shape)[-1]) if d is None else int(d)  # tuple: simulator shapes reject a[-1]
    if a.size == 0 or d == 0:
        return RangeStats(0, 0.0)
    dt = a.dtype if isinstance(a, np.ndarray) else np.dtype(a.dtype)
    bits_of = _BITS.get(dt)
    if bits_of is not None and isinstance(a, np.ndarray) and a.flags.c_contiguous and a.size <= _CHUNK:
        # one decode step's K, V or q: the serial compilation straight away (no dispatch knob)
        udt, mask, inf_bits = bits_of
        out = np.zeros(1, np.uint64)
        _RANGE.cpu.serial(a.reshape(-1).view(udt), _MASKS[dt], out)
        bits = int(out[0])
        if bits >= inf_bits:
            return RangeStats(1, math.inf)
        return RangeStats(0, float(udt(bits).view(dt)), a, d)
    xp = _backend.xp_of(a)
    if bits_of is not None:
        udt, mask, inf_bits = bits_of
        bits = None
        if isinstance(a, np.ndarray) and a.flags.c_contiguous:
            u = a.reshape(-1).view(udt)
            nch = max(1, min(64, a.size // _CHUNK))
            out = np.zeros(nch, np.uint64)
            if nch == 1:  # the serial compilation, no dispatch knob
                _RANGE.cpu.serial(u, udt(mask), out)
            else:
                _RANGE.launch(_backend.CPU, a.size, u, udt(mask), out)
            bits = int(out[0]) if nch == 1 else int(out.max())
        elif xp is None and getattr(a, "is_c_contiguous", lambda: False)():  # Numba device array
            out = _backend.zeros(a, (1,), np.uint64)
            _RANGE.launch(_backend.CUDA, (a.size + 255) // 256, a.reshape(a.size).view(udt), udt(mask), out)
            bits = int(_backend.to_host(out)[0])
        if bits is not None:
            if bits >= inf_bits:
                return RangeStats(1, math.inf)
            amax = float(udt(bits).view(dt))
            return RangeStats(0, amax, a, d)
    if xp is None:
        a, xp = _backend.to_host(a), np
    if np.dtype(a.dtype).kind in "iu":  # (abs of the most negative int overflows back to itself)
        m = max(abs(float(a.min())), abs(float(a.max())))
    else:
        m = float(xp.abs(a).max())  # NaN or Inf propagate into the max
    if not math.isfinite(m):
        return RangeStats(1, math.inf)
    return RangeStats(0, m, a, d)


# --- value checks (they read the data through the kernels above) -------------------------
def check_finite(name: str, a: Any) -> None:
    """``ValueError`` if ``a`` holds NaN or Inf."""
    if not all_finite(a):
        raise ValueError(f"{name}: expected finite values, got NaN or Inf")


def check_finite_stats(name: str, a: Any, d: int | None = None) -> RangeStats:
    """:func:`check_finite` that also returns the range numbers it measured in the same pass.

    ``TypeError`` first for a complex (or object) array: its magnitudes would pass the range
    check, and only the float32 conversion after it would refuse it (with a NumPy
    ``ComplexWarning`` on the way)."""
    dt = np.dtype(a.dtype)
    if dt.kind not in "fiub":
        raise TypeError(f"{name}: expected a real (float or integer) array, got dtype {dt}")
    st = range_stats(a, d)
    if st.nonfinite:
        raise ValueError(f"{name}: expected finite values, got NaN or Inf")
    return st


def check_rotation_input(name: str, x: Any, block: int) -> None:
    """``ValueError`` if a ``block``-value rotation of ``x`` (last axis) could leave float32:
    a rotated value is at most its block's L2 norm, so blocks with norm above the float32
    maximum are rejected (one pass, :func:`range_stats`)."""
    st = check_finite_stats(name, x, block)
    if not st.max_norm <= F32_MAX:
        raise ValueError(f"{name}: a {block}-value block has L2 norm {st.max_norm:.6g}, above {F32_MAX:.6g} "
                         f"(the largest float32): its rotation cannot be represented")


class DeferredRange:
    """Range checks of device arrays without a host synchronization per call.

    :meth:`record` launches the bit-pattern max of :func:`range_stats` into a small device
    accumulator (an ``atomic.max``, no read-back); :meth:`read` copies the accumulators to
    the host once and resets them.  So a caller can validate many steps' inputs with one
    synchronization when it chooses to, instead of one per call.  Accumulators are per
    ``(slot, dtype)`` (bit patterns of different float widths do not compare).  Thread-safe
    (cache layers are called from several threads).
    """

    def __init__(self) -> None:
        self._acc: dict[tuple[str, np.dtype], Any] = {}
        self._lock = threading.Lock()
        self._views: dict = {}  # flat views of the recorded arrays (_bits_view)

    def __deepcopy__(self, memo: dict[int, Any]) -> DeferredRange:
        """An independent record holding what this one holds: the accumulators are copied
        device to device (no host read), so a forked cache reports the inputs its copied
        tokens came from, and reading one record does not reset the other."""
        new = DeferredRange()
        memo[id(self)] = new
        with self._lock:
            for key, acc in self._acc.items():
                xp = _backend.xp_of(acc)
                if xp is not None:
                    new._acc[key] = acc.copy()
                else:  # a Numba device array
                    new._acc[key] = _backend.empty(acc, tuple(acc.shape), acc.dtype)
                    new._acc[key].copy_to_device(acc)
        return new

    def state_token(self) -> object:
        """An object that stays the very same while the accumulators do (a :meth:`read`
        replaces them): what a replayed launch that folds records into them relies on
        (:class:`numba_kv.DecodeStep` compares it by identity)."""
        return self._acc

    def holding(self) -> threading.Lock:
        """The record's lock, for a caller that compares :meth:`state_token` and then launches
        into the accumulators it names (a replayed graph): held across both, no :meth:`read`
        takes them in between (and records into an accumulator nobody reads again)."""
        return self._lock

    def record(self, slot: str, a: Any) -> bool:
        """Fold ``|a|`` (a CUDA float16/32/64 array) into accumulator ``slot``; ``False`` when
        ``a`` cannot be read in place (a strided Numba device array: check it synchronously)."""
        dt = np.dtype(a.dtype)
        if dt not in _BITS or a.size == 0:
            return dt in _BITS
        if _backend.is_cupy(a):
            if not a.flags.c_contiguous:
                a = _backend.xp_of(a).ascontiguousarray(a)  # a device-side copy
        elif not getattr(a, "is_c_contiguous", lambda: False)():
            return False
        udt, mask, _ = _BITS[dt]
        key = (slot, dt)
        u = self._bits_view(a, udt)
        with self._lock:  # the launch too: read() must not drop an accumulator being written
            acc = self._acc.get(key)
            if acc is None:
                acc = self._acc[key] = _backend.zeros(a, (1,), np.uint64)
            _RANGE.launch(_backend.CUDA, (a.size + 255) // 256, u, udt(mask), acc)
        return True

    def _bits_view(self, a: Any, udt: Any) -> Any:
        """``a`` flat as unsigned integers of its width: the same view object for the same
        array (a step's launch then repeats: prepared launches, ``StepGraph``)."""
        return _backend.same_view(self._views, (id(a), udt), a, lambda x: x.reshape(x.size).view(udt))

    def record_many(self, items: Sequence[tuple[str, Any]]) -> list[bool]:
        """:meth:`record` of several ``(slot, array)`` pairs, three to a launch (a decode
        step's ``k``, ``v`` and ``q``: one launch instead of three).  Returns what
        :meth:`record` would for each."""
        ok, todo = self.plan_many(items)
        self.launch(todo)
        return ok

    def plan_many(self, items: Sequence[tuple[str, Any]]) -> tuple[list[bool], list[tuple]]:
        """What :meth:`record_many` would record, without launching: ``(ok, todo)``, ``ok``
        as :meth:`record_many` returns it, ``todo`` the pending records for :meth:`launch`
        or :meth:`folded` (which must follow before the arrays change)."""
        ok: list[bool] = []
        todo: list[tuple[tuple[str, np.dtype], Any, Any]] = []
        for slot, a in items:
            dt = np.dtype(a.dtype)
            if dt not in _BITS or a.size == 0:
                ok.append(dt in _BITS)  # nothing to read (or not a float: the caller checks it)
                continue
            if _backend.is_cupy(a):
                if not a.flags.c_contiguous:
                    a = _backend.xp_of(a).ascontiguousarray(a)  # a device-side copy
            elif not getattr(a, "is_c_contiguous", lambda: False)():
                ok.append(False)  # a strided Numba device array: the caller reads it synchronously
                continue
            udt, mask, _ = _BITS[dt]
            todo.append(((slot, dt), self._bits_view(a, udt), udt(mask)))
            ok.append(True)
        return ok, todo

    def _fold_args(self, group: Sequence[tuple]) -> list[tuple[Any, Any, Any]]:
        """``(bits, mask, accumulator)`` of up to three pending records, padded to three by
        repeating the first (a repeated array changes no max); under the lock."""
        args = []
        for key, u, mask in group:
            acc = self._acc.get(key)
            if acc is None:
                acc = self._acc[key] = _backend.zeros(u, (1,), np.uint64)
            args.append((u, mask, acc))
        return args + [args[0]] * (3 - len(args))

    def launch(self, todo: Sequence[tuple]) -> None:
        """Record the pending records of :meth:`plan_many`, three to a launch."""
        with self._lock:  # the launches too: read() must not drop an accumulator being written
            for lo in range(0, len(todo), 3):
                args = self._fold_args(todo[lo:lo + 3])
                n = max(int(u.size) for u, _, _ in args)
                _RANGE3.launch(_backend.CUDA, (n + 255) // 256, *args[0], *args[1], *args[2])

    @contextlib.contextmanager
    def folded(self, todo: Sequence[tuple]) -> Iterator[tuple | None]:
        """The pending records of :meth:`plan_many` as the nine trailing arguments
        ``(bits, mask, accumulator) × 3`` of a kernel that folds them into its own launch
        (:func:`fold_absbits_dev`, issue 27: no launch of their own), or ``None`` when they
        do not fold (more than three, or not float32: then launched here, as :meth:`launch`).
        The caller launches its kernel inside the ``with``, which holds the record's lock
        (as :meth:`launch` does: :meth:`read` must not take an accumulator being written)."""
        if not todo:
            yield None
            return
        if len(todo) > 3 or any(key[1] != _F32 for key, _, _ in todo):
            self.launch(todo)
            yield None
            return
        with self._lock:
            args = self._fold_args(todo)
            yield (*args[0], *args[1], *args[2])

    def read(self) -> dict[str, RangeStats]:
        """Per slot, what was recorded since the last :meth:`read` (``nonfinite``, ``amax``);
        one device-to-host copy per accumulator, which resets it."""
        out: dict[str, RangeStats] = {}
        with self._lock:
            taken, self._acc = self._acc, {}
        for (slot, dt), acc in taken.items():
            bits = int(_backend.to_host(acc)[0])
            udt, _, inf_bits = _BITS[dt]
            if bits >= inf_bits:
                st = RangeStats(1, math.inf)
            else:
                st = RangeStats(0, float(np.array([bits], udt).view(dt)[0]))
            old = out.get(slot)
            if old is None or st.nonfinite > old.nonfinite or (st.nonfinite == old.nonfinite and st.amax > old.amax):
                out[slot] = st
        return out
