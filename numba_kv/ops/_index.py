"""Flat work-item indices → array coordinates: the one place where a kernel's item number
is split into (row, token, lane)-style coordinates.

Every grid-stride kernel and every ``prange`` CPU twin walks a flat item index ``e`` over a
C-ordered box of items (``[R, n]``, ``[R, n, M]``, ...); the cores below turn ``e`` back
into coordinates with one division per axis and a multiply-subtract for the remainder
(cheaper than ``%``, and the same integer arithmetic on both targets).  Twinned cores: the
CPU variants inline into their callers (they run once per item), the device variants are
always inlined.
"""

from __future__ import annotations

from .._jit import twin

__all__ = ["unravel2_cpu", "unravel2_dev", "unravel3_cpu", "unravel3_dev"]


def unravel2(e, m):
    """``(i, j)`` of flat index ``e`` over a C-ordered ``[·, m]`` box (``e >= 0``)."""
    i = e // m
    return i, e - i * m


def unravel3(e, n, m):
    """``(i, j, k)`` of flat index ``e`` over a C-ordered ``[·, n, m]`` box (``e >= 0``)."""
    i = e // (n * m)
    rem = e - i * (n * m)
    j = rem // m
    return i, j, rem - j * m


unravel2_cpu, unravel2_dev = twin(unravel2, inline=True)
unravel3_cpu, unravel3_dev = twin(unravel3, inline=True)
