"""What a layered cache tells :class:`numba_kv.DecodeStep` about a steady decode step, so that
the step's kernels can be replayed as a CUDA graph without running its Python (issue 27,
item 3: a step of <= 0.10 ms on a GPU, whose Python alone costs ~0.24 ms).

A steady step of a windowed cache on a device launches the very kernels of the step before
(same arrays, same scalars: the counts that move live on the device) and changes the layer's
host bookkeeping by the same amounts: the token count, the compressed count, the live counts
of the buffers, the exact tokens' position key, the device count's host mirror.  So the
layer's state splits into

* **counters**: ``seq_len``, every ``meta`` and ``live`` count, and the integers held in the
  layer's ``scratch`` (an ``int``, a tuple of ints, the ints of a list), read in a fixed
  order (:class:`SteadyMark`.``layout``);
* **identities**: the buffer dict, every other scratch object (bound steps, views, position
  buffer), the cache's deferred-range accumulators: whatever a launch's arguments come from,
  compared by identity (the mark holds them, so none can be freed and its address reused);
* **constants**: batch, device, sliding window, capacity, the validation mode;
* the **regime** (:meth:`SteadyStepMixin._steady_regime`): the cache's own statement that the
  next step of ``n`` tokens stores the way the last one did (for a windowed cache: no new
  sinks, the window full, room in the codes), or ``None`` when it cannot say so.

``DecodeStep`` learns a step's counter delta from two full steps in a row that replayed the
same graph with the same delta, identities, constants and regime; a later step whose state
is exactly the state the last step left (every counter, identity and constant) and whose
regime is the same again launches the graph and adds the delta (:meth:`SteadyStepMixin._steady_step`),
under the layer's lock.  Anything else — a crop, a reset, a decode from elsewhere, a buffer
that grows, a window that is not full — makes the next step a full one.
``DecodeStep(verify=True)`` runs every step in full and checks that the skipped Python would
have left the same state (the tests run it across growth, crops and resets).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, NamedTuple

from .. import _config

#: a :class:`~numba_kv.caches._layer.LayerState` (not imported: ``_layer`` mixes this module's
#: class into its ``LayeredCache``)
LayerState = Any

__all__ = ["SteadyMark", "SteadyStepMixin"]

# where a counter lives (SteadyMark.layout)
_SEQ, _META, _LIVE, _SCRATCH, _TUPLE, _LIST = range(6)


class SteadyMark(NamedTuple):
    """A layer's state between two steps, as :mod:`numba_kv.caches._steady` splits it."""

    layout: tuple  # (where, key, length) of each counter group, in the order of ``values``
    values: tuple  # the counters (ints)
    idents: tuple  # objects compared by identity
    consts: tuple  # values compared by equality
    regime: Any  # what the next step of this many tokens does (None: no steady step)

    def same(self, other: SteadyMark) -> bool:
        """Whether ``other`` is this state: equal counters, constants and regime, the very
        same identities."""
        return (self.values == other.values and self.layout == other.layout and self.consts == other.consts
                and self.regime == other.regime and len(self.idents) == len(other.idents)
                and all(a is b for a, b in zip(self.idents, other.idents)))

    def delta(self, before: SteadyMark) -> tuple | None:
        """The counter change from ``before`` to this state, or ``None`` when anything but the
        counters changed in between (layout, identities, constants)."""
        if self.layout != before.layout or self.consts != before.consts or len(self.idents) != len(before.idents) \
                or not all(a is b for a, b in zip(self.idents, before.idents)):
            return None
        return tuple(a - b for a, b in zip(self.values, before.values))

    def differences(self, other: SteadyMark) -> list[str]:
        """The counters (``(where, key)`` and both values) where this state and ``other`` (of
        one layout) differ."""
        where = []
        for kind, key, n in self.layout:
            where.extend([(kind, key)] * (n if kind == _TUPLE else 1))
        return [f"{w}: {a} (other: {b})" for w, a, b in zip(where, self.values, other.values) if a != b]

    def advanced(self, delta: tuple) -> SteadyMark:
        """This state with ``delta`` added to its counters (its regime to be asked again)."""
        return self._replace(values=tuple(a + b for a, b in zip(self.values, delta)), regime=None)


def _split(st: LayerState) -> tuple[tuple, tuple, list]:
    """``(layout, values, idents)`` of a layer (see the module docstring)."""
    layout: list = [(_SEQ, None, 1)]
    values: list = [st.seq_len]
    idents: list = [st.buffers, st.scratch]
    for where, counts in ((_META, st.meta), (_LIVE, st.live)):
        for key, val in counts.items():
            layout.append((where, key, 1))
            values.append(val)
    for key, val in st.scratch.items():
        kind = type(val)
        if kind is int:
            layout.append((_SCRATCH, key, 1))
            values.append(val)
        elif kind is tuple and all(type(x) is int for x in val):
            layout.append((_TUPLE, key, len(val)))
            values.extend(val)
        elif kind is list:
            idents.append(val)
            for i, x in enumerate(val):
                if type(x) is int:
                    layout.append((_LIST, key, i))
                    values.append(x)
                else:
                    idents.append(x)
        else:
            idents.append(val)
    return tuple(layout), tuple(values), idents


def _write(st: LayerState, layout: tuple, values: tuple) -> None:
    """Store ``values`` into the layer's counters at ``layout`` (:func:`_split`'s)."""
    i = 0
    for where, key, n in layout:
        if where == _SEQ:
            st.seq_len = values[i]
        elif where == _META:
            st.meta[key] = values[i]
        elif where == _LIVE:
            st.live[key] = values[i]
        elif where == _SCRATCH:
            st.scratch[key] = values[i]
        elif where == _TUPLE:
            st.scratch[key] = values[i:i + n]
            i += n
            continue
        else:  # _LIST: n is the element's index
            st.scratch[key][n] = values[i]
        i += 1


class SteadyStepMixin:
    """The hooks of :class:`numba_kv.DecodeStep` on a layered cache (``self._layers``: one
    :class:`~numba_kv.caches._layer.LayerState` per layer).  A cache class that can say
    when its next step is steady overrides :meth:`_steady_regime`; by default no step is."""

    _layers: list[LayerState]

    def _steady_regime(self, st: LayerState, n: int) -> Any:
        """What the next decode step of ``n`` tokens on this layer does, comparable with
        ``==`` and the same for every step of a steady run, or ``None`` when the cache cannot
        say that the step repeats the last one (default: never)."""
        return None

    def _steady_consts(self, st: LayerState) -> tuple:
        """The layer's and cache's settings a step's launches follow (compared by equality),
        the knobs among them (:func:`numba_kv._config.state_key`: an override or environment
        variable that changes makes the next step a full one)."""
        return (st.batch, st.device, st.window, st.capacity, getattr(self, "validate", None), _config.state_key())

    def _steady_idents(self) -> tuple:
        """The cache's own objects a step's launches take (compared by identity): the deferred
        range record's accumulators (a read replaces them)."""
        rec = self.__dict__.get("_deferred")
        return (rec, None if rec is None else rec.state_token())

    def _mark_locked(self, st: LayerState, n: int) -> SteadyMark:
        layout, values, idents = _split(st)
        idents.extend(self._steady_idents())
        return SteadyMark(layout, values, tuple(idents), self._steady_consts(st), self._steady_regime(st, n))

    def _steady_mark(self, layer: int, n: int) -> SteadyMark:
        """The layer's state now, for a step of ``n`` tokens (:class:`SteadyMark`)."""
        st = self._layers[layer]
        with st.lock:
            return self._mark_locked(st, n)

    def _steady_step(self, layer: int, n: int, expect: SteadyMark, delta: tuple,
                     replay: Callable[[], bool] | None) -> SteadyMark | None:
        """Under the layer's lock: when the layer is exactly in state ``expect`` and its next
        step is steady in the same regime, call ``replay`` (launches the step's kernels) and,
        when it launched, add ``delta`` to the counters; return the new state.  ``None``
        (nothing done) otherwise.  ``replay=None``: only say what the state would become."""
        st = self._layers[layer]
        rec = self.__dict__.get("_deferred")
        # the deferred record's lock too (after the layer's, as a full step takes them): between
        # the comparison of its accumulators and the replay that folds into them, a
        # check_inputs() on another thread would take them, and this step's values go unread
        with st.lock, (contextlib.nullcontext() if rec is None or replay is None else rec.holding()):
            now = self._mark_locked(st, n)
            if now.regime is None or not now.same(expect):
                return None
            new = now.advanced(delta)
            if replay is None:
                return new
            if not replay():
                return None
            _write(st, new.layout, new.values)
            # (the regime a steady run stores in is the same every step: the next step's
            # own, asked for then, must equal it)
            return new._replace(regime=now.regime)
