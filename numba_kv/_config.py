"""Every tunable knob in one place.

Values come from ``NUMBA_KV_<NAME>`` environment variables when set, else from
``DEFAULTS``.  Tests may override with :func:`set` and restore with :func:`reset`.  Every
value is checked (:data:`RANGES`): a bad one raises ``ValueError`` naming the knob (or the
environment variable) and the allowed range, never a failed launch later.

:func:`get` runs on every kernel launch (a decode step launches a dozen), so it is cheap:
the environment is read live on every call (a variable set or changed at run time takes
effect at once), but through the raw mapping behind ``os.environ`` with the key encoded
once, and the checked value is cached per raw string.  ``os.environ.get`` encodes the key
and decodes the value on every call, which cost more than the rest of a launch.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

DEFAULTS: dict[str, Any] = {
    # threads per CUDA block of the 1-D grids Twin.launch computes (one work item per thread)
    "cuda_threads": 128,
    # the same under the simulator, where each thread is an OS thread
    "cuda_threads_sim": 32,
    # growth rule of per-layer storage: capacity = needed + max(needed*num//den, min_extra)
    "growth_min_extra": 128,
    "growth_fraction": 0.25,
    # below this many scalar operations a CPU twin runs serially (no parallel region):
    # one decode step of a small model must not pay thread wake-ups
    "cpu_parallel_min_work": 1 << 18,
    # CUDA fused decode attention: 1 = one warp per partition where it applies (no logit
    # bias or QJL correction, head_dim 32/64/128), 0 = always the block kernel
    "cuda_warp_attention": 1,
    # CUDA fused decode attention on tensor cores (mma.sync) where it applies (head_dim 128,
    # 2-4-bit codes of one width and codebook, the head VQ code too, no logit bias or QJL
    # correction); 0 = the warp (or block) kernel
    "cuda_mma_attention": 1,
    # CUDA decode attention: 1 = the last partition block to finish merges the partitions
    # (one launch fewer per step), 0 = a separate merge_partitions launch (A/B on a GPU)
    "cuda_merge_last_block": 1,
    # CUDA decode attention: 1 = the partition kernel rotates the queries in its prologue (one
    # launch fewer per step), 0 = a separate rotation launch before it (A/B on a GPU)
    "cuda_fused_query_rotation": 1,
    # CUDA decode attention on tensor cores: 1 = partition lengths from the wave model over the
    # resident blocks (the driver's occupancy; mma.mma_partition_size), 0 = the rule before it
    # (about 3,200 warps; A/B on a GPU)
    "cuda_wave_partitions": 1,
    # CUDA launches: 1 = a launch that repeats an earlier one (same kernel, geometry, array
    # objects and scalars) reuses the parameters Numba converted then (numba_kv._launch),
    # 0 = every launch through Numba's typing and conversion
    "cuda_prepared_launch": 1,
    # CUDA launches: 1 = a prepared launch's repeat calls the driver with a parameter buffer
    # packed once (numba_kv._launch), 0 = through cuda.core's launch, which packs it per call
    "cuda_direct_launch": 1,
}

#: most threads per CUDA block the package launches.  Any kernel can launch with 256: a block
#: of 8 warps at the 255-register ceiling needs 8 · 8192 = 65,536 registers, what an SM
#: gives one block.  ``tests/cuda/test_resources.py`` checks every registered kernel
#: against it on every architecture of :data:`numba_kv._cuda_resources.ARCHS`.
MAX_CUDA_THREADS = 256
#: largest head_dim of the CUDA kernels that hold a head vector in static shared memory (the
#: decode attention's merge, the whole-head rotation): the one source of that limit
MAX_HEAD_DIM = 512

#: allowed values: (type, smallest, largest, step)
RANGES: dict[str, tuple[type, float, float, int]] = {
    # whole warps: a partial warp leaves lanes idle in every cooperative loop
    "cuda_threads": (int, 32, MAX_CUDA_THREADS, 32),
    "cuda_threads_sim": (int, 1, MAX_CUDA_THREADS, 1),
    "growth_min_extra": (int, 0, 1 << 40, 1),
    "growth_fraction": (float, 0.0, 16.0, 0),
    "cpu_parallel_min_work": (int, 0, 1 << 62, 1),
    "cuda_warp_attention": (int, 0, 1, 1),
    "cuda_mma_attention": (int, 0, 1, 1),
    "cuda_merge_last_block": (int, 0, 1, 1),
    "cuda_fused_query_rotation": (int, 0, 1, 1),
    "cuda_wave_partitions": (int, 0, 1, 1),
    "cuda_prepared_launch": (int, 0, 1, 1),
    "cuda_direct_launch": (int, 0, 1, 1),
}

_overrides: dict[str, Any] = {}
# the open knobs() blocks of each knob, oldest first: [token, value]; and the override each knob
# had before its first open block.  Blocks of several threads may close in any order: the
# newest block still open sets the value, and the override from before comes back when the
# last one closes (restoring what each block saw on entry would leave one thread's value
# behind once blocks overlap)
_blocks: dict[str, list[list[Any]]] = {}
_before_blocks: dict[str, Any] = {}
_NONE = object()
_blocks_lock = threading.Lock()

#: knob -> environment variable name
_ENV_NAMES: dict[str, str] = {name: "NUMBA_KV_" + name.upper() for name in DEFAULTS}
# knob -> the key of the variable in ``os.environ``'s raw mapping (``os.environ._data``:
# bytes on POSIX, upper-case str on Windows), encoded once by ``os.environ.encodekey``
_RAW_KEYS: dict[str, Any] = {}
try:
    _RAW_KEYS = {name: os.environ.encodekey(env) for name, env in _ENV_NAMES.items()}
except AttributeError:  # an os.environ without the CPython internals: plain os.environ.get
    pass
# knob -> (raw environment value, checked value) of the last read
_parsed: dict[str, tuple[Any, Any]] = {}
_RAW_KEY_LIST = tuple(_RAW_KEYS.values()) if len(_RAW_KEYS) == len(DEFAULTS) else ()
#: bumped by every :func:`set`, :func:`knobs` entry and exit and :func:`reset` (:func:`state_key`)
_generation = 0


def _env_raw(name: str) -> Any:
    """Raw value of knob ``name``'s environment variable (``None`` when unset), read live.

    ``os.environ`` keeps its variables in a private dict ``_data`` (raw keys and values);
    ``setenv``/``putenv`` through ``os.environ`` (and pytest's ``monkeypatch.setenv``)
    update it.  Reading it directly skips the per-call key encoding; a replaced
    ``os.environ`` (any other mapping) is read through its ``get``."""
    env = os.environ
    data = getattr(env, "_data", None)
    key = _RAW_KEYS.get(name)
    if data is None or key is None or not isinstance(data, dict):
        return env.get(_ENV_NAMES[name])
    return data.get(key)


def _is_bool(value: Any) -> bool:
    """Whether ``value`` is a Python or NumPy bool (``numpy.bool_`` is no ``bool`` subclass;
    its ``dtype`` says it, with no NumPy import here)."""
    return isinstance(value, bool) or getattr(getattr(value, "dtype", None), "kind", "") == "b"


def _checked(name: str, value: Any, source: str) -> Any:
    """``value`` as knob ``name``'s type, or ``ValueError`` naming ``source``.

    Booleans are refused for every knob; an int knob takes only integral values (``int()``
    alone truncated ``numpy.float32(64.5)``, ``Decimal("64.5")`` or ``Fraction(129, 2)``
    to 64 silently, and raised ``OverflowError`` for an infinite NumPy float)."""
    kind, lo, hi, step = RANGES[name]
    try:
        if _is_bool(value):
            raise ValueError
        v = kind(value)
        if kind is int and not isinstance(value, str) and v != value:  # a fractional part was dropped
            raise ValueError
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{source}: expected {kind.__name__}, got {value!r}") from None
    if not lo <= v <= hi or (step > 1 and v % step):
        every = f" in steps of {step}" if step > 1 else ""
        raise ValueError(f"{source}: expected {lo} <= value <= {hi}{every}, got {value!r}")
    return v


def get(name: str) -> Any:
    """Current value of knob ``name``."""
    if name in _overrides:
        return _overrides[name]
    if name not in DEFAULTS:
        raise KeyError(f"name: unknown numba_kv config knob {name!r}; known: {sorted(DEFAULTS)}")
    raw = _env_raw(name)
    if raw is None:
        return DEFAULTS[name]
    hit = _parsed.get(name)
    if hit is not None and hit[0] == raw:
        return hit[1]
    env = raw if isinstance(raw, str) else os.environ.decodevalue(raw)
    value = _checked(name, env, _ENV_NAMES[name])  # a bad value raises on every read: nothing cached
    _parsed[name] = (raw, value)
    return value


def set(name: str, value: Any) -> None:  # noqa: A001 - deliberate, mirrors get()
    """Override knob ``name`` for this process (``ValueError`` outside :data:`RANGES`)."""
    if name not in DEFAULTS:
        raise KeyError(f"name: unknown numba_kv config knob {name!r}; known: {sorted(DEFAULTS)}")
    _overrides[name] = _checked(name, value, name)
    _bump()


def _bump() -> None:
    global _generation  # noqa: PLW0603 - the module's one counter of override changes
    _generation += 1


def state_key() -> tuple:
    """A key that changes whenever any knob's value may have: the overrides' generation and
    the raw values of every knob's environment variable, read live (cheap: one dict lookup
    per knob).  Equal keys, equal values — what a step that skips its Python
    (:class:`numba_kv.DecodeStep`) checks instead of asking for every knob."""
    data = getattr(os.environ, "_data", None)
    if data is None or not _RAW_KEY_LIST:
        return _generation, tuple(os.environ.get(env) for env in _ENV_NAMES.values())
    return _generation, tuple(map(data.get, _RAW_KEY_LIST))


@contextlib.contextmanager
def knobs(**values: Any) -> Iterator[None]:
    """Override knobs inside a ``with`` block: ``with numba_kv.knobs(cuda_threads=64): ...``.

    Every value is checked first (``KeyError`` for an unknown knob, ``TypeError`` for a bool
    or a string, ``ValueError`` outside :data:`RANGES`; nothing changes then).  The previous
    overrides come back on exit, also when the block raises.  The overrides are process-wide,
    not per thread: while blocks of several threads overlap, the newest one still open sets a
    knob they share, and the override from before the first comes back when the last closes,
    in whatever order they close.
    """
    checked = {}
    for name, value in values.items():
        if name not in DEFAULTS:
            raise KeyError(f"{name}: unknown numba_kv config knob; known: {sorted(DEFAULTS)}")
        if _is_bool(value) or isinstance(value, (str, bytes)):  # (strings are for the environment)
            raise TypeError(f"{name}: expected {RANGES[name][0].__name__}, got {type(value).__name__} {value!r}")
        checked[name] = _checked(name, value, name)
    token = object()
    with _blocks_lock:
        for name, value in checked.items():
            if not _blocks.get(name):
                _before_blocks[name] = _overrides.get(name, _NONE)
            _blocks.setdefault(name, []).append([token, value])
            _overrides[name] = value
        _bump()
    try:
        yield
    finally:
        with _blocks_lock:
            for name in checked:
                open_blocks = [b for b in _blocks.get(name, []) if b[0] is not token]
                _blocks[name] = open_blocks
                if open_blocks:
                    _overrides[name] = open_blocks[-1][1]
                    continue
                before = _before_blocks.pop(name, _NONE)
                if before is _NONE:
                    _overrides.pop(name, None)
                else:
                    _overrides[name] = before
            _bump()


def reset() -> None:
    """Drop every override made with :func:`set`."""
    _overrides.clear()
    _bump()
