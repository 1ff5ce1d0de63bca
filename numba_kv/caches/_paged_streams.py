"""Stream order of a :class:`~numba_kv.caches.paged.PagedKVCache`'s page reuse on a GPU.

A page that a sequence gives up (``free_sequence``, ``crop``, ``select_batch``, ``reset``)
is free at once, while kernels queued on the releasing thread's launch stream
(:func:`numba_kv.launch_stream`) may still read it.  On one stream that is safe: the next
write into the page queues behind them.  A thread that launches on another stream and takes
the page would not wait, and its append could overwrite tokens a queued ``decode_attention``
has yet to read.  So a release on a device records an event on its stream and marks the
pages; taking marked pages on another stream makes that stream wait for the event
(``cuStreamWaitEvent``: on the device, the host never blocks), once per releasing stream.
Pages released and taken on one stream cost nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .. import _backend

__all__ = ["PageStreamOrder"]


class PageStreamOrder:
    """Which launch stream last released each page, and an event per stream marking its
    latest release (used under the paged cache's lock)."""

    def __init__(self) -> None:
        self._events: dict[int, Any] = {}  # launch-stream handle → event of its latest release
        self._released_on: dict[int, int] = {}  # page → handle of the stream that released it

    def released(self, pages: Iterable[int], on_device: bool) -> None:
        """Mark ``pages`` as released by this thread's launch stream (device pools only).
        Kernel launches a :class:`numba_kv.StepGraph` step holds back go first, so the event
        follows every read of the pages."""
        pages = list(pages)
        if not on_device or not pages:
            return
        _backend.barrier()
        stream, handle = _backend.launch_stream_state()
        event = self._events.get(handle)
        if event is None:
            event = self._events[handle] = _backend.stream_event()
        event.record(stream or 0)
        for page in pages:
            self._released_on[page] = handle

    def taken(self, pages: Iterable[int]) -> None:
        """``pages`` are about to be written on this thread's launch stream: make the stream
        wait for the latest release on every other stream that released one of them."""
        if not self._released_on:
            return
        stream, handle = _backend.launch_stream_state()
        others = {self._released_on.pop(p) for p in pages if p in self._released_on} - {handle}
        if others:
            _backend.barrier()
        for other in sorted(others):
            self._events[other].wait(stream or 0)
