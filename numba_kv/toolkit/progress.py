"""Progress of the toolkit's long loops: a tqdm bar on a terminal, one line per stage in a log.

tqdm redraws its bar with ``\\r`` several times a second; written to a file (``make demo > log``,
CI logs) that is hundreds of frames of noise.  :func:`progress_bar` therefore draws the tqdm bar
only when stderr is a terminal; otherwise it prints one line when the stage ends (its name, the
count and the seconds), and with ``disable=True`` (``--no-progress``) nothing at all.

:func:`third_party_bars` does the same for the bars that transformers and huggingface_hub draw
while loading a model (the GGUF tensor conversion among them).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, TextIO

from tqdm.auto import tqdm


def draws_bars(stream: TextIO | None = None) -> bool:
    """Whether ``stream`` (default: ``sys.stderr``) is a terminal, where a redrawn bar belongs."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


class StageLine:
    """The non-terminal stand-in of a tqdm bar: counts like one (iteration, ``update``,
    ``close``, context manager) and writes one line to stderr when the stage ends."""

    def __init__(self, iterable: Iterable[Any] | None = None, *, total: float | None = None, desc: str | None = None,
                 unit: str = "it", file: TextIO | None = None) -> None:
        self.iterable = iterable
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)  # type: ignore[arg-type]
        self.total, self.desc, self.unit, self.file = total, (desc or "").strip(), unit, file
        self.n, self.t0, self.closed = 0, time.perf_counter(), False

    def __iter__(self) -> Iterator[Any]:
        if self.iterable is None:
            raise TypeError("StageLine: nothing to iterate (made with total= only)")
        try:
            for item in self.iterable:
                yield item
                self.n += 1
        finally:
            self.close()

    def __len__(self) -> int:
        return int(self.total or 0)

    def update(self, n: float = 1) -> None:
        self.n += n

    def set_postfix(self, *args: Any, **kwargs: Any) -> None:
        """Accepted and ignored (a log line carries the count and the time only)."""

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        count = f"{self.n:g}" if self.total is None else f"{self.n:g}/{self.total:g}"
        name = f"{self.desc}: " if self.desc else ""
        out = sys.stderr if self.file is None else self.file
        out.write(f"{name}{count} {self.unit} in {time.perf_counter() - self.t0:.1f} s\n")
        out.flush()

    def __enter__(self) -> StageLine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def progress_bar(iterable: Iterable[Any] | None = None, *, total: float | None = None, desc: str | None = None,
                 disable: bool = False, leave: bool = False, unit: str = "it", file: TextIO | None = None) -> Any:
    """A tqdm bar (arguments as tqdm's) when stderr is a terminal, else a :class:`StageLine`.

    ``disable=True`` (the commands' ``--no-progress``) gives a tqdm that draws nothing, on a
    terminal or not, so the caller's ``update`` / ``close`` / iteration stay as they are.
    """
    if disable or draws_bars(file):
        return tqdm(iterable, total=total, desc=desc, disable=disable, leave=leave, unit=unit, file=file)
    return StageLine(iterable, total=total, desc=desc, unit=unit, file=file)


@contextlib.contextmanager
def third_party_bars(progress: bool) -> Iterator[bool]:
    """Within the block, transformers' and huggingface_hub's tqdm bars draw only when
    ``progress`` is on and stderr is a terminal; yields whether they draw.

    transformers' own switch (``transformers.utils.logging.disable_progress_bar``, which also
    turns off huggingface_hub's) does not reach the GGUF loader's "Converting and de-quantizing
    GGUF tensors" bar: that module calls ``tqdm.auto.tqdm`` directly, so its name is rebound to
    a disabled tqdm for the block.  Both are restored on exit.
    """
    on = bool(progress) and draws_bars()
    if on:
        yield True
        return
    import transformers.utils.logging as hf_logging  # noqa: PLC0415 (hf extra: only its callers load it)

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    gguf_utils = sys.modules.get("transformers.modeling_gguf_pytorch_utils")
    if gguf_utils is None:
        with contextlib.suppress(ImportError):  # a transformers without GGUF support
            import transformers.modeling_gguf_pytorch_utils as gguf_utils  # noqa: PLC0415 (hf extra, as above)
    original = getattr(gguf_utils, "tqdm", None)
    if original is not None:
        gguf_utils.tqdm = functools.partial(original, disable=True)
    try:
        yield False
    finally:
        if original is not None:
            gguf_utils.tqdm = original
        if was_on:
            hf_logging.enable_progress_bar()
