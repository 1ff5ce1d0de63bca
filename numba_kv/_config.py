"""Every tunable knob in one place.

Values come from ``NUMBA_KV_<NAME>`` environment variables when set, else from
``DEFAULTS``.  Tests may override with :func:`set` and restore with :func:`reset`.
"""

from __future__ import annotations

import os
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
}

_overrides: dict[str, Any] = {}


def get(name: str) -> Any:
    """Current value of knob ``name``."""
    if name in _overrides:
        return _overrides[name]
    if name not in DEFAULTS:
        raise KeyError(f"name: unknown numba_kv config knob {name!r}; known: {sorted(DEFAULTS)}")
    env = os.environ.get("NUMBA_KV_" + name.upper())
    if env is not None:
        return type(DEFAULTS[name])(env)
    return DEFAULTS[name]


def set(name: str, value: Any) -> None:  # noqa: A001 - deliberate, mirrors get()
    """Override knob ``name`` for this process."""
    if name not in DEFAULTS:
        raise KeyError(f"name: unknown numba_kv config knob {name!r}; known: {sorted(DEFAULTS)}")
    _overrides[name] = value


def reset() -> None:
    """Drop every override made with :func:`set`."""
    _overrides.clear()
