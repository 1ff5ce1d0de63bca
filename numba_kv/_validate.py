"""Argument validation shared by caches and ops: types, shapes, dtypes, magnitudes.

Every check raises an exception whose message names the argument, what was expected and
what was received.  Checks run *before* any storage is touched, so a failed call leaves a
cache exactly as it was.

Layering: this module sits below :mod:`numba_kv.ops` (ops import it at module level) and
imports nothing of ``ops``.  The checks that need a kernel to read the values (NaN/Inf,
range statistics: :func:`~numba_kv.ops.finite.check_finite`,
:func:`~numba_kv.ops.finite.check_finite_stats`,
:func:`~numba_kv.ops.finite.check_rotation_input`) live next to their kernels in
:mod:`numba_kv.ops.finite`; import them from there.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np

from ._backend import CPU, check_device_f32, device_of, to_host

FLOAT_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))
F16_MAX = 65504.0  # largest finite binary16
F32_MAX = float(np.finfo(np.float32).max)
Q_MAX = 2.0 ** 64  # largest accepted |query| value
#: largest accepted ``softmax_scale``: with ``|q| <= Q_MAX`` the logits ``q·k`` are at most
#: ``2**96`` (see ``caches._layer.check_q_values``), so ``2**30`` times that (and ``log2 e``,
#: the tensor-core kernel's base-2 scores) stays below float32's ``2**128``
SOFTMAX_SCALE_MAX = 2.0 ** 30


def check_softmax_scale(value: Any) -> float:
    """``value`` as a float; ``TypeError``/``ValueError`` naming ``softmax_scale`` unless it is
    a real number in ``(0, 2**30]`` (finite logits for every accepted query,
    :data:`SOFTMAX_SCALE_MAX`)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"softmax_scale: expected a float in (0, 2**30], got {type(value).__name__} {value!r}")
    s = float(value)
    if not (0.0 < s <= SOFTMAX_SCALE_MAX):  # (NaN fails too)
        raise ValueError(f"softmax_scale: expected a float in (0, 2**30] (logits stay finite in float32), "
                         f"got {value!r}")
    return s


#: CUDA's limit on a grid's y and z dimensions (x allows 2**31 - 1)
MAX_GRID_YZ = 65535


def check_grid(dims: tuple[int, int, int], n_parts: int, rows: int) -> tuple[int, int, int]:
    """``dims`` of an attention kernel's grid (KV rows, partition blocks, query-row blocks),
    or ``ValueError`` naming what to change when y or z passes :data:`MAX_GRID_YZ` (a launch
    would fail with a driver error, after the work before it ran)."""
    if dims[1] > MAX_GRID_YZ:
        raise ValueError(f"partition_size: {n_parts} partitions a KV row need {dims[1]} blocks on the grid's y "
                         f"axis, CUDA allows {MAX_GRID_YZ}: a larger partition_size (or None, the plan's choice)")
    if dims[2] > MAX_GRID_YZ:
        raise ValueError(f"q: {rows} query rows a KV head need {dims[2]} blocks on the grid's z axis, CUDA allows "
                         f"{MAX_GRID_YZ}: fewer query positions a call")
    return dims


def check_partition_size(value: Any) -> int | None:
    """``value`` as an int (``None`` stays ``None``: the plan's choice); ``TypeError``/``ValueError``
    naming ``partition_size`` unless it is an integer >= 1."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"partition_size: expected an int >= 1 or None, got {type(value).__name__} {value!r}")
    if int(value) < 1:
        raise ValueError(f"partition_size: expected an int >= 1 or None (tokens per partition), got {value}")
    return int(value)


def check_layer(layer: Any, num_layers: int) -> int:
    """Return ``layer`` as int; ``IndexError`` if outside ``[0, num_layers)``."""
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
        raise TypeError(f"layer: expected an int in [0, {num_layers}), got {type(layer).__name__} {layer!r}")
    if not 0 <= int(layer) < num_layers:
        raise IndexError(f"layer: expected an int in [0, {num_layers}), got {layer}")
    return int(layer)


def check_float_array(name: str, a: Any, ndim: int | None = None) -> str:
    """Check dtype (float16/32/64) and ndim; return the device."""
    dev = device_of(name, a)
    dt = np.dtype(a.dtype)
    if dt not in FLOAT_DTYPES:
        check_device_f32(name, a)  # (a Numba device array can only be float32: say that)
        raise TypeError(f"{name}: expected dtype float16, float32 or float64, got {dt}")
    if ndim is not None and len(a.shape) != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D array, got shape {tuple(a.shape)} ({len(a.shape)}-D)")
    return dev


def check_magnitude(name: str, amax: float, limit: float, what: str) -> None:
    """``ValueError`` if ``amax`` (the largest ``|value|`` of argument ``name``) exceeds
    ``limit``; ``what`` says which storage sets the limit."""
    if not amax <= limit:
        raise ValueError(f"{name}: max |{name}| = {amax:.6g} exceeds {limit:.6g}, the largest value {what} "
                         f"can hold; nothing was stored")


def check_stored_f16(name: str, stored: Any, amax: float, max_norm: float, note: str = "") -> None:
    """``ValueError`` if any binary16 number (uint16 bit pattern) in ``stored`` reached the
    binary16 limit: a block scale or vector norm derived from argument ``name`` saturated.
    ``note``: what else went into the stored values, appended to the message (a cache's key
    mean, subtracted before quantization)."""
    host = to_host(stored)
    if host.size and int((host & 0x7FFF).max()) >= 0x7BFF:  # 65504, inf or NaN
        raise ValueError(f"{name}: a block scale or vector norm derived from {name} (max |{name}| = "
                         f"{amax:.6g}, largest vector L2 norm {max_norm:.6g}{note}) does not fit binary16 "
                         f"(limit {F16_MAX:g}); nothing was stored")


def check_f16_result(name: str, *f16_bits: Any) -> None:
    """For stateless quantizers, after quantizing argument ``name``: ``ValueError`` if a
    binary16 number they produced (uint16 bit patterns: block scales, norms) reached 65504,
    i.e. saturated instead of holding the true value."""
    for bits in f16_bits:
        host = to_host(bits)
        if host.size and int((host & 0x7FFF).max()) >= 0x7BFF:
            raise ValueError(f"{name}: a binary16 scale or norm derived from {name} reaches {F16_MAX:g}, the "
                             f"largest binary16 value: {name} is out of range for this op")


def check_shape(name: str, a: Any, expected: Sequence[int | None], labels: Sequence[str]) -> None:
    """Compare ``a.shape`` with ``expected`` (``None`` = any), naming the mismatching axis."""
    shape = tuple(a.shape)
    if len(shape) != len(expected):
        raise ValueError(f"{name}: expected {len(expected)}-D [{', '.join(labels)}], got shape {shape}")
    for ax, (got, want, lab) in enumerate(zip(shape, expected, labels)):
        if want is not None and got != want:
            raise ValueError(f"{name}: expected {lab}={want} (axis {ax}) for shape "
                             f"[{', '.join(labels)}], got shape {shape}")


def check_kv_shapes(k: Any, v: Any, num_kv_heads: int, head_dim: int, batch: int | None = None) -> str:
    """Dtype, device and shape checks of a K/V pair ``[batch, num_kv_heads, new_tokens,
    head_dim]`` (values are not read); return the device."""
    labels = ("batch", "num_kv_heads", "new_tokens", "head_dim")
    dk = check_float_array("k", k, 4)
    dv = check_float_array("v", v, 4)
    if dk != dv:
        raise ValueError(f"k is on {dk} but v is on {dv}: both must live on the same device")
    if np.dtype(v.dtype) != np.dtype(k.dtype):  # (the outputs take k's dtype: a mixed pair is a caller's slip)
        raise TypeError(f"v: expected the dtype of k ({np.dtype(k.dtype)}), got {np.dtype(v.dtype)}")
    check_shape("k", k, (batch, num_kv_heads, None, head_dim), labels)
    if k.shape[2] < 1:
        raise ValueError(f"k: expected new_tokens >= 1, got shape {tuple(k.shape)}")
    if k.shape[0] < 1:
        raise ValueError(f"k: expected batch >= 1, got shape {tuple(k.shape)}")
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v: expected the shape of k {tuple(k.shape)}, got {tuple(v.shape)}")
    return dk


def check_q_shape(q: Any, batch: int, num_kv_heads: int, head_dim: int, n_kv_groups: int | None = None,
                  q_len: int | None = None, device: str = CPU) -> int:
    """Dtype, device and shape checks of a query ``[batch, num_heads, q_len, head_dim]``
    (values are not read); return the group size ``num_heads // num_kv_heads``."""
    dq = check_float_array("q", q, 4)
    check_device_f32("q", q)  # (converted only after the store: refused here, before it)
    if dq != device:
        raise ValueError(f"q is on {dq} but k is on {device}: all arrays must live on the same device")
    labels = ("batch", "num_heads", "q_len", "head_dim")
    check_shape("q", q, (batch, None, q_len, head_dim), labels)
    hq = q.shape[1]
    if hq < num_kv_heads or hq % num_kv_heads:
        raise ValueError(f"q: expected num_heads to be a positive multiple of num_kv_heads={num_kv_heads}, "
                         f"got shape {tuple(q.shape)}")
    groups = hq // num_kv_heads
    if n_kv_groups is not None and n_kv_groups != groups:
        raise ValueError(f"config.n_kv_groups: expected {groups} (= num_heads {hq} / num_kv_heads "
                         f"{num_kv_heads}), got {n_kv_groups}")
    return groups


def check_bool(name: str, value: Any) -> bool:
    """``TypeError`` naming ``name`` unless ``value`` is a bool (Python's or NumPy's): a truthy
    string such as ``"no"`` must not switch a flag on."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__} {value!r}")
    return bool(value)


def check_int(name: str, value: Any, allowed: Sequence[int] | None = None, minimum: int | None = None) -> int:
    """Integer argument check with allowed set or minimum."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    value = int(value)
    if allowed is not None and value not in allowed:
        raise ValueError(f"{name}: expected one of {list(allowed)}, got {value}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return value


def check_real(name: str, value: Any, expected: str) -> float:
    """``float(value)`` of a real number (Python's or NumPy's); ``TypeError`` naming ``name``
    and saying ``expected`` for a bool or anything else (a string would fail in ``float()``
    with a message that names no argument)."""
    if not isinstance(value, numbers.Real) or isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected {expected}, got {type(value).__name__} {value!r}")
    return float(value)


def check_float_at_least(name: str, value: Any, minimum: float = 0.0) -> float:
    """A real number ``>= minimum`` (``TypeError`` for a bool or a non-number; ``ValueError``
    below it, NaN included: ``value < minimum`` alone would let NaN through)."""
    if not check_real(name, value, f"a float >= {minimum:g}") >= minimum:
        raise ValueError(f"{name}: expected a float >= {minimum:g}, got {value!r}")
    return float(value)


def check_span(t0: Any, n: int, capacity: int, buffer: str) -> int:
    """``t0`` of an ``*_into`` op that reads or writes tokens ``t0 .. t0+n-1`` of ``buffer``
    (``capacity`` tokens): an int with the span inside it.  The kernels do not bound-check:
    a negative ``t0`` would wrap to the buffer's end on the CPU and write out of bounds on a
    GPU."""
    t0 = check_int("t0", t0, minimum=0)
    if t0 + int(n) > int(capacity):
        raise ValueError(f"t0: tokens {t0}..{t0 + int(n) - 1} do not fit {buffer}'s {int(capacity)} tokens")
    return t0


def check_head_dim(head_dim: Any) -> int:
    """``head_dim`` must be a positive multiple of 32 (the rotation block)."""
    hd = check_int("head_dim", head_dim, minimum=1)
    if hd % 32:
        raise ValueError(f"head_dim: expected a positive multiple of 32 (the rotation block), got {hd}")
    return hd



def is_c_contiguous(a: Any) -> bool:
    """Whether ``a`` is C-contiguous: a NumPy or CuPy array (``flags.c_contiguous``), a Numba
    device array (whose ``flags`` is a dict keyed ``"C_CONTIGUOUS"``) or any other array that
    has ``is_c_contiguous()``; ``False`` for anything that says nothing."""
    flags = getattr(a, "flags", None)
    if isinstance(flags, dict):
        return bool(flags.get("C_CONTIGUOUS", False))
    if flags is not None and hasattr(flags, "c_contiguous"):
        return bool(flags.c_contiguous)
    return bool(getattr(a, "is_c_contiguous", lambda: False)())


def _byte_span(a: Any) -> tuple[int, int] | None:
    """``[lo, hi)``: the bytes a CUDA array's elements span (from its
    ``__cuda_array_interface__``), or ``None`` for an array without one or with no element."""
    cai = getattr(a, "__cuda_array_interface__", None)
    if cai is None:
        return None
    shape = tuple(int(s) for s in cai["shape"])
    if any(s == 0 for s in shape):
        return None
    item = np.dtype(cai["typestr"]).itemsize
    strides = cai.get("strides")
    if strides is None:  # C-contiguous
        strides = tuple(int(np.prod(shape[i + 1:], dtype=np.int64)) * item for i in range(len(shape)))
    lo = hi = int(cai["data"][0])
    for n, st in zip(shape, strides):
        reach = (n - 1) * int(st)
        lo, hi = (lo + reach, hi) if reach < 0 else (lo, hi + reach)
    return lo, hi + item


def overlaps(a: Any, b: Any) -> bool:
    """Whether arrays ``a`` and ``b`` may share memory: exactly for NumPy arrays
    (``numpy.shares_memory``; a problem too hard to settle counts as shared), by the byte
    ranges their elements span for CUDA arrays (a strided view interleaved with another
    array counts as overlapping it)."""
    if a is b:
        return True
    # the CUDA simulator's arrays have no __cuda_array_interface__: their NumPy arrays inside
    a, b = (getattr(x, "_ary", x) if type(x).__name__ == "FakeCUDAArray" else x for x in (a, b))
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        if not np.may_share_memory(a, b):
            return False
        try:
            return bool(np.shares_memory(a, b, max_work=100_000))
        except np.exceptions.TooHardError:
            return True
    sa, sb = _byte_span(a), _byte_span(b)
    return sa is not None and sb is not None and sa[0] < sb[1] and sb[0] < sa[1]


def check_out(out: Any, shape: Sequence[int], dtype: Any, device: str, what: str,
              inputs: Sequence[tuple[str, Any]] = ()) -> None:
    """``TypeError``/``ValueError`` naming ``out`` unless it can take a result of ``shape`` and
    ``dtype`` on ``device``: an array of exactly that shape and dtype, C-contiguous (the
    kernels write it as flat rows) and writable, on the device of the call's other arrays,
    sharing no memory with the call's ``inputs`` (``(name, array)`` pairs: a kernel that
    writes ``out`` while it reads them would read its own output; :func:`overlaps`).
    ``what`` names the result in the message (``"the attention output"``)."""
    dev = device_of("out", out)
    want = tuple(int(s) for s in shape)
    if dev != device:
        raise ValueError(f"out: expected an array on {device} (the device of q) for {what}, got one on {dev}")
    dt = np.dtype(out.dtype)
    if dt != np.dtype(dtype):
        raise TypeError(f"out: expected dtype {np.dtype(dtype)} for {what}, got {dt}")
    got = tuple(int(s) for s in out.shape)
    if got != want:
        raise ValueError(f"out: expected shape {want} for {what}, got {got}")
    if not is_c_contiguous(out):
        raise ValueError(f"out: expected a C-contiguous array for {what}, got a strided view")
    if isinstance(out, np.ndarray) and not out.flags.writeable:
        raise ValueError(f"out: expected a writable array for {what}, got a read-only one")
    for name, a in inputs:
        if a is not None and overlaps(out, a):
            raise ValueError(f"out: expected an array that shares no memory with {name} for {what}, got one that "
                             f"overlaps {name}")
