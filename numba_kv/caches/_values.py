"""How a cache checks the *values* of its inputs: the ``validate`` modes shared by every
cache (layered, paged, MLA).

Shapes and dtypes are always checked.  Reading values (NaN/Inf, magnitude limits) costs a
device-to-host read per argument on a GPU, which stalls a decode step; ``"deferred"`` folds
them into a device-side accumulator (:class:`~numba_kv.ops.finite.DeferredRange`) that
:meth:`ValueChecks.check_inputs` reads when the caller asks.
"""

from __future__ import annotations

import threading
from typing import Any

from .. import _backend
from .._validate import F32_MAX, Q_MAX
from ..ops.finite import DeferredRange

__all__ = ["VALIDATE_MODES", "ValueChecks"]

_DEFER_LOCK = threading.Lock()

#: values of :attr:`ValueChecks.validate`
VALIDATE_MODES = ("auto", "sync", "deferred", "off")


class ValueChecks:
    """Mixin: the ``validate`` attribute, :meth:`check_inputs` and the deferred record.

    A cache calls :meth:`_value_mode` with the device of a call's arrays and then checks
    synchronously (``"sync"``), records with :meth:`_defer` (``"deferred"``; ``False`` back
    means "read it synchronously instead") or skips (``"off"``).  :meth:`_input_limit` is
    the largest ``|k|``/``|v|`` its storage holds (override it).  State lives in
    ``__dict__`` (``_validate_mode``, ``_deferred``) so subclasses need no ``__init__``
    call; ``reset`` should drop ``_deferred``.
    """

    @property
    def validate(self) -> str:
        """How the *values* of ``k``/``v``/``q`` are checked (shapes and dtypes always are).

        * ``"sync"``: every call reads its inputs (NaN/Inf, magnitude limits of the storage,
          binary16 scale saturation) and raises ``ValueError`` before anything is stored —
          the cache stays untouched.  On a GPU each check reads a result back to the host:
          one synchronization per argument and call.
        * ``"deferred"`` (CUDA arrays; host arrays are checked as with ``"sync"``): each call
          only folds ``max |x|`` and a NaN/Inf flag into a device-side accumulator (no host
          round trip); :meth:`check_inputs` reads it when the caller asks and raises if a
          value since the last check was non-finite or beyond the storage's limit.  Such a
          value *was* stored: the affected tokens are garbage and the caller should
          reset or crop.  Binary16 scale saturation is not detected.
        * ``"off"``: values are not checked (garbage in, garbage out).
        * ``"auto"`` (default): ``"sync"`` for host arrays, ``"deferred"`` for CUDA arrays.
        """
        return self.__dict__.get("_validate_mode", "auto")

    @validate.setter
    def validate(self, mode: str) -> None:
        if mode not in VALIDATE_MODES:
            raise ValueError(f"validate: expected one of {list(VALIDATE_MODES)}, got {mode!r}")
        self.__dict__["_validate_mode"] = mode

    def _value_mode(self, dev: str) -> str:
        mode = self.validate
        if mode == "auto" or (mode == "deferred" and dev == _backend.CPU):
            return "sync" if dev == _backend.CPU else "deferred"
        return mode

    def reads_values_now(self, slot: str, a: Any) -> bool:
        """Whether the caller must check ``a``'s values itself, now: :attr:`validate` resolves
        to ``"sync"`` for ``a``'s device, or to ``"deferred"`` and ``a`` cannot be recorded
        in place (a strided Numba device array).  ``False``: recorded under ``slot`` for
        :meth:`check_inputs` (see :meth:`_defer` for the slots), or not checked (``"off"``).
        """
        mode = self._value_mode(_backend.device_of(slot, a))
        return mode == "sync" or (mode == "deferred" and not self._defer(slot, a))

    def _check_device_inputs(self, k: Any, v: Any) -> None:
        """``TypeError`` naming ``k`` or ``v`` unless the store can take a Numba device array
        of that kind (base: float32; the store copies a strided one on the device).  Checked
        with the shapes, before a sliding layer evicts or a deferred record is planned."""
        _backend.check_device_f32("k", k)
        _backend.check_device_f32("v", v)

    def _input_limit(self) -> tuple[float, str]:
        """Largest ``|k|``, ``|v|`` this cache stores faithfully, and what sets it (for
        :meth:`check_inputs`; the synchronous checks are :meth:`_check_range`)."""
        return F32_MAX, "float32 storage"

    def check_inputs(self) -> None:
        """Raise ``ValueError`` if an input recorded by ``validate="deferred"`` since the last
        call was NaN/Inf or out of range (one device-to-host read per accumulator; a no-op
        when nothing was deferred)."""
        rec = self.__dict__.get("_deferred")
        if rec is None:
            return
        limit, what = self._input_limit()
        for slot, rs in sorted(rec.read().items()):
            names = "k or v" if slot == "kv" else slot
            if rs.nonfinite:
                raise ValueError(f"{names}: expected finite values, got NaN or Inf in a call since the last "
                                 "check_inputs() (validate='deferred': those tokens were stored)")
            if slot not in ("q", "kv"):
                continue  # another argument (an MLA cache's full k/v): only finiteness is checked
            lim, lim_what = (Q_MAX, "a query") if slot == "q" else (limit, what)
            if not rs.amax <= lim:
                raise ValueError(f"{names}: max |{names}| = {rs.amax:.6g} exceeds {lim:.6g}, the largest value "
                                 f"{lim_what} can hold, in a call since the last check_inputs() "
                                 "(validate='deferred': those tokens were stored)")

    def _deferred_record(self) -> DeferredRange:
        rec = self.__dict__.get("_deferred")
        if rec is None:
            with _DEFER_LOCK:  # layers of one cache may be called from several threads
                rec = self.__dict__.setdefault("_deferred", DeferredRange())
        return rec

    def _defer(self, slot: str, a: Any) -> bool:
        """Record ``a`` (a CUDA array) under ``slot`` for :meth:`check_inputs`: ``"kv"`` is held
        to :meth:`_input_limit`, ``"q"`` to ``|q| <= 2**64``, any other slot to finiteness
        only.  ``False``: ``a`` cannot be read in place (check it synchronously)."""
        return self._deferred_record().record(slot, a)

    def _defer_many(self, items: list[tuple[str, Any]]) -> list[bool]:
        """:meth:`_defer` of each ``(slot, array)``, three to a kernel launch
        (:meth:`~numba_kv.ops.finite.DeferredRange.record_many`)."""
        return self._deferred_record().record_many(items)

