"""A steady decode step replayed as one CUDA graph (issue 27, item 3).

A steady step launches the same kernels with the same arguments every time
(``tests/cuda/test_sim_graph_replay.py``): device arrays by address, scalars by value, the
same grids.  Such a sequence can be captured once into a CUDA graph and replayed with one
``cuGraphLaunch`` instead of one launch per kernel.  What a graph cannot replay is the
host-side bookkeeping of a step (token counts, window positions, the plan): it lives in
Python and must advance with every step.  :class:`StepGraph` therefore runs the step's
Python code every time and only holds its kernel launches back:

1. Inside :meth:`StepGraph.run`, every launch that has a prepared entry (``_launch``: its
   parameters converted once, its arrays still the very objects of that entry) is held back
   instead of launched.  A launch without one goes through Numba as usual.
2. Any other device work of the step — an allocation, a copy, CuPy work, a read to the host,
   a launch through Numba — first launches what is held back, in order
   (:func:`numba_kv._backend.barrier`, called by ``_backend``'s allocation and copy helpers
   and by ``xp_of`` of a device array, which CuPy work and Numba copies begin with); the
   rest of the step then launches as it goes.
   Stream order is therefore the order the step's code asked for, whatever it does.
3. At the end of a step whose launches were all held back: when they are the very entries
   of the captured graph, in order, the graph is launched; when they repeat the previous
   such step's, they are captured into a new graph (``cuda.core`` ``GraphBuilder``), which
   is launched; otherwise they are launched one by one.  Non-steady steps (a buffer that
   grows, a window that fills, a page that opens) allocate, upload or change an argument:
   they run as launched, and the next steady sequence is captured after it repeats once.

Entries are compared by identity: an entry exists for one kernel, geometry, stream, set of
array objects (held by weak references) and scalar values, so the same entries in the same
order are the same launches a graph holds.  Graphs are launched on the stream the step's
launches would have used (``numba_kv.launch_stream``, default: the default stream).

In Numba's CUDA simulator the entries are the simulator's launches held back and a "graph"
launches its captured entries in order, so the bookkeeping above is tested without a GPU
(``tests/cuda/test_sim_step_graph.py``); the capture itself runs on a GPU only
(``tests/gpu/test_device_step_graph.py``).

Launch contract: as the launches of ``fn``, on the calling thread's launch stream; the
launches of other threads are not held back.
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any

from . import _backend, _launch
from ._validate import check_bool

__all__ = ["StepGraph"]

_SCALARS = _launch.SCALAR_TYPES
#: simulator entries kept (the oldest goes first), as ``_launch.MAX_ENTRIES``
_SIM_MAX = 1024
_sim_entries: dict[tuple, _SimEntry] = {}
_sim_lock = threading.Lock()


class _SimEntry:
    """A simulator launch held like a prepared entry: the kernel, geometry, weak references to
    its arrays and its scalars."""

    __slots__ = ("dispatcher", "geometry", "handle", "refs", "scalars")

    def __init__(self, dispatcher: Any, geometry: tuple, args: tuple) -> None:
        self.dispatcher = dispatcher
        self.handle = _backend.launch_stream_state()[1]
        self.geometry = geometry
        self.refs = tuple(None if isinstance(a, _SCALARS) else weakref.ref(a) for a in args)
        self.scalars = tuple(a if isinstance(a, _SCALARS) else None for a in args)

    def holds(self, args: tuple) -> bool:
        return _launch.refs_hold(self.refs, args)

    def run(self) -> None:
        args = tuple(s if r is None else r() for r, s in zip(self.refs, self.scalars))
        self.dispatcher[self.geometry](*args)


def _sim_entry(dispatcher: Any, grid: Any, block: Any, args: tuple) -> _SimEntry | None:
    stream = _backend.launch_stream_state()[0]
    geometry = (grid, block) if stream is None else (grid, block, stream)
    try:
        key = (id(stream), *_launch.launch_key(dispatcher, grid, block, args))
        entry = _sim_entries.get(key)
        if entry is not None and entry.holds(args):
            return entry
        entry = _SimEntry(dispatcher, geometry, args)
    except TypeError:  # an unhashable or unweakrefable argument: launched as it comes
        return None
    with _sim_lock:
        _sim_entries.pop(key, None)
        while len(_sim_entries) >= _SIM_MAX:
            _sim_entries.pop(next(iter(_sim_entries)))
        _sim_entries[key] = entry
    return entry


class _Recorder:
    """One step's held-back launches (``pending``, with their arguments kept alive until
    launched) and whether the step has run as launched (``eager``)."""

    __slots__ = ("eager", "keep", "pending")

    def __init__(self) -> None:
        self.pending: list = []
        self.keep: list = []
        self.eager = False

    def defer(self, dispatcher: Any, grid: Any, block: Any, args: tuple) -> bool:
        """Hold the launch back (``True``) or, when it cannot be, launch what is held and let
        the caller launch it through Numba (``False``)."""
        if self.eager:
            return False
        entry = (_sim_entry if _backend.simulator_enabled() else _launch.entry_for)(dispatcher, grid, block, args)
        if entry is None:
            self.flush()
            self.eager = True
            return False
        self.pending.append(entry)
        self.keep.append(args)
        return True

    def flush(self) -> None:
        """Launch what is held back, in order; the rest of the step launches as it goes."""
        if not self.pending:
            return
        self.eager = True
        pending, self.pending = self.pending, []
        for entry in pending:
            entry.run()
        self.keep.clear()


class _SimGraph:
    """The simulator's stand-in for a CUDA graph: its captured entries, launched in order."""

    def __init__(self, entries: tuple) -> None:
        self.entries = entries

    def launch(self, stream: Any) -> None:
        for entry in self.entries:
            entry.run()

    def close(self) -> None:
        self.entries = ()


def _capture(entries: tuple) -> Any:
    """A ``cuda.core`` graph of ``entries``' launches, captured on a stream of its own."""
    if _backend.simulator_enabled():
        return _SimGraph(entries)
    from cuda.core import Device  # noqa: PLC0415 - a numba-cuda dependency, needed on a GPU only

    device = Device()
    device.set_current()
    builder = device.create_graph_builder()
    builder.begin_building("thread_local")
    try:
        for entry in entries:
            entry.capture(builder)
    finally:
        builder.end_building()
    graph = builder.complete()
    builder.close()
    return graph


class StepGraph:
    """Replay the kernel launches of a repeated step as one CUDA graph.

    ``graph.run(fn, *args, **kwargs)`` calls ``fn(*args, **kwargs)`` — a decode step, e.g.
    ``cache.decode`` — and returns its result.  The step's host-side bookkeeping runs every
    time; its kernel launches are held back and, when they are the launches of the previous
    steps (same kernels, geometry, array objects and scalars, in order), launched as one CUDA
    graph, captured the second time a sequence repeats.  A step that does other device work
    (allocates, copies, reads to the host, launches something new) runs as launched, in
    order.  On NumPy arrays ``fn`` just runs.

    For a steady decode step to repeat, pass the same arrays every step: copy each step's
    ``k``, ``v`` and ``q`` into fixed device buffers and pass a fixed ``out=``.

    Parameters
    ----------
    capture : bool, default True
        ``False`` holds launches back and launches them one by one (for comparisons).

    Notes
    -----
    ``fn`` must do its device work through numba_kv (a cache, an op): work of its own on a
    GPU array between two numba_kv launches (a CuPy or torch operation) would run before the
    launches held back.  One step at a time per graph (a lock); the launches of other
    threads are not held back.

    Examples
    --------
    >>> import numpy as np, numba_kv
    >>> cache = numba_kv.make_cache("pqo3", num_layers=1, num_kv_heads=2, head_dim=64)
    >>> graph = numba_kv.StepGraph()
    >>> k = np.ones((1, 2, 1, 64), np.float32)
    >>> q = np.ones((1, 4, 1, 64), np.float32)
    >>> res = graph.run(cache.decode, 0, k, k, q, numba_kv.AttendConfig(0.125, n_kv_groups=2))
    >>> graph.stats()["host"]  # NumPy arrays: no launch to hold back
    1
    """

    def __init__(self, *, capture: bool = True) -> None:
        self._capture = check_bool("capture", capture)
        self._lock = threading.Lock()
        self._graph: Any = None
        self._graph_entries: tuple = ()
        self._candidate: tuple | None = None
        self._counts: Counter = Counter()
        self.error: str | None = None
        #: what the last :meth:`run` did: a key of :meth:`stats` ("replayed", "captured", ...)
        self.last: str | None = None
        #: bumped whenever the captured graph changes (captured, dropped)
        self.generation = 0

    def run(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, its kernel launches replayed as a graph when they repeat.

        Parameters
        ----------
        fn : callable
            The step, e.g. ``cache.decode`` (its device work through numba_kv only).
        *args, **kwargs
            Its arguments: for a steady step to repeat, the same array objects every step
            (fixed input buffers, ``out=``).

        Returns
        -------
        What ``fn`` returns.  Its kernels are launched (or the graph is) on the thread's
        launch stream before this returns; as for any launch, they may still be running.

        Raises
        ------
        RuntimeError
            Inside another :meth:`run` on the same thread (steps do not nest).
        Exception
            Whatever ``fn`` raises, after the launches it made were launched.
        """
        if _backend.step_recorder() is not None:
            raise RuntimeError("StepGraph.run: already inside a StepGraph step on this thread (steps do not nest)")
        with self._lock:
            rec = _Recorder()
            _backend.set_step_recorder(rec)
            try:
                result = fn(*args, **kwargs)
            except BaseException:
                _backend.set_step_recorder(None)
                rec.flush()  # what the step launched before failing still runs, in order
                self._candidate = None
                self._counts["failed"] += 1
                self.last = "failed"
                raise
            _backend.set_step_recorder(None)
            self._finish(rec)
            return result

    def _finish(self, rec: _Recorder) -> None:
        self.last = self._outcome(rec)
        self._counts["steps"] += 1
        self._counts[self.last] += 1

    def _outcome(self, rec: _Recorder) -> str:
        entries = tuple(rec.pending)
        if rec.eager:
            rec.flush()
            self._candidate = None
            return "eager"
        if not entries:
            return "host"
        if self._graph is not None and _same(entries, self._graph_entries) and self._launch(entries):
            return "replayed"
        if self._capture and self.error is None and self._candidate is not None and _same(entries, self._candidate):
            try:
                graph = _capture(entries)
            except Exception as exc:  # noqa: BLE001 - no graph on this system: launch one by one from now on
                self.error = f"{type(exc).__name__}: {exc}"
            else:
                self.reset()
                self._graph, self._graph_entries = graph, entries
                if self._launch(entries):
                    return "captured"
        rec.flush()
        self._candidate = entries
        return "launched"

    def replay(self, generation: int) -> bool:
        """Launch the captured graph again without running a step (what
        :class:`numba_kv.DecodeStep` does for a step whose Python it skips), when it is
        still the graph of ``generation`` (:attr:`generation`) and is launched on the
        calling thread's launch stream as captured.  Counted as ``replayed`` (and ``bound``).
        ``False`` (nothing launched) otherwise; a failed launch also drops the graph."""
        with self._lock:
            if self._graph is None or generation != self.generation or _backend.step_recorder() is not None:
                return False
            if _backend.launch_stream_state()[1] != _handle_of(self._graph_entries[0]):
                return False
            if not self._launch(self._graph_entries):
                return False
            self.last = "replayed"
            self._counts.update(("steps", "replayed", "bound"))
            return True

    def captured_arrays(self) -> tuple | None:
        """The arrays of the captured graph's launches (strong references: a caller that keeps
        them keeps the graph's device memory alive), or ``None`` when there is no graph or
        one of them is gone."""
        with self._lock:
            arrays = []
            for entry in self._graph_entries:
                for ref in entry.refs:
                    if ref is not None:
                        a = ref()
                        if a is None:
                            return None
                        arrays.append(a)
            return tuple(arrays) if self._graph is not None else None

    def _launch(self, entries: tuple) -> bool:
        """Launch the graph on the entries' stream; ``False`` (and no graph from now on) when
        that fails before anything was launched."""
        try:
            self._graph.launch(_stream_of(entries[0]))
        except Exception as exc:  # noqa: BLE001 - the step's launches go one by one instead
            self.error = f"{type(exc).__name__}: {exc}"
            self.reset()
            return False
        return True

    def reset(self) -> None:
        """Drop the captured graph (the next repeated step captures again)."""
        if self._graph is not None:
            self._graph.close()
        self._graph, self._graph_entries, self._candidate = None, (), None
        self.generation += 1

    def stats(self) -> dict[str, int]:
        """Steps so far: ``steps``; ``replayed`` (the captured graph launched), ``captured``
        (a graph captured and launched), ``launched`` (held back, then launched one by one:
        the first time a sequence is seen), ``eager`` (the step did other device work or a
        launch through Numba), ``host`` (no CUDA launch), ``failed`` (``fn`` raised);
        ``bound``: of the replayed steps, those launched by :meth:`replay` (a
        :class:`numba_kv.DecodeStep` step that skipped its Python).  Why
        no graph is captured any more, when a capture or a graph launch failed: ``error``."""
        keys = ("steps", "replayed", "captured", "launched", "eager", "host", "failed", "bound")
        return {key: self._counts[key] for key in keys}


def _same(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def _stream_of(entry: Any) -> Any:
    return getattr(entry, "stream", None)


def _handle_of(entry: Any) -> int:
    """The launch-stream handle ``entry`` was made for (``launch_stream_state()[1]``)."""
    return getattr(entry, "handle", 0)
