"""Lists of caches on the command line (``numba-kv eval --cache``, ``generate --cache``,
``bench modes --modes``): the list separator lives here; each cache's text is parsed by the
library's one grammar, :func:`numba_kv.caches.spec.parse_cache_spec`.

The defaults the command line shows in its help live here too: this module needs no package of
the ``tools`` extra, so ``numba-kv --help`` works in a bare install (the modules that use
them, ``evaluation.evaluate`` and ``bench_step``, import rich and tqdm)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from numba_kv.caches.spec import FILE_OPTIONS, CacheSpec, parse_cache_spec

__all__ = ["DEFAULT_CACHES", "DEFAULT_STEPS", "DEFAULT_TEXT", "DEFAULT_WARMUP", "CacheSpec", "EvalConfigError",
           "check_text_file", "output_file_error", "parse_cache_specs", "split_cache_list"]

#: Real English prose every Debian system ships (base-files); read at run time, never copied.
DEFAULT_TEXT = "/usr/share/common-licenses/GPL-3"

#: Default ``--cache`` list of ``numba-kv eval``.
DEFAULT_CACHES = "dense,pqo3,pqo4"

#: Timed and untimed steps of ``numba-kv bench decode-step``.
DEFAULT_STEPS = 20
DEFAULT_WARMUP = 3


class EvalConfigError(ValueError):
    """Bad user input of a command (cache list, text file, token counts, threads).

    The message names the command-line argument (``--cache``, ``--text``, ...).
    """


def check_text_file(path: str | Path, arg: str = "--text") -> Path:
    """``path`` as a :class:`~pathlib.Path` when it names a non-empty regular file.

    Raises
    ------
    EvalConfigError
        Naming ``arg`` and what is wrong: the file is not found, is a directory, is not a
        regular file (``/dev/null``, a pipe) or is empty.
    """
    p = Path(path)
    if p.is_file() and p.stat().st_size:
        return p
    why = ("not found" if not p.exists() else "is a directory" if p.is_dir()
           else "is not a regular file" if not p.is_file() else "is empty")
    raise EvalConfigError(f"{arg}: file {str(p)!r} {why}")


def output_file_error(dest: Any, arg: str) -> str | None:
    """Why ``dest``, the file an option such as ``--json FILE`` writes, cannot be written.

    Checked before a command runs, so that a long run does not end in a traceback when it
    writes its result.

    Parameters
    ----------
    dest : str or None
        The option's value; ``None`` (not given) and ``"-"`` (stdout) are fine.
    arg : str
        The option's name, for the message.

    Returns
    -------
    str or None
        The message (naming ``arg``: an empty name, a folder, a folder that does not exist, a
        file that cannot be opened for writing), or ``None``.
    """
    if not isinstance(dest, str) or dest == "-":
        return None
    if not dest:
        return f"{arg}: expected a file name, got ''"
    if os.path.isdir(dest):
        return f"{arg}: {dest!r} is a folder, expected a file name"
    if not os.path.isdir(os.path.dirname(dest) or "."):
        return f"{arg}: the folder of {dest!r} does not exist"
    # open it for appending (an existing file keeps its bytes; a new one is removed again): the
    # folder tests above pass for /proc, a read-only folder or one the user may not write to
    existed = os.path.exists(dest)
    try:
        with open(dest, "a", encoding="utf-8"):
            pass
    except OSError as exc:
        return f"{arg}: {dest!r} cannot be written ({exc.strerror or exc})"
    if not existed:
        with contextlib.suppress(OSError):
            os.remove(dest)
    return None


def split_cache_list(text: str, arg: str = "--cache") -> list[str]:
    """Split a comma-separated cache list into one text per cache.

    An item ``NAME`` or ``NAME:KEY=VALUE`` starts a new cache; an item ``KEY=VALUE`` adds
    an option to the cache before it, so ``"pqo3:r=32,s=4,pqo4"`` is two caches,
    ``"pqo3:r=32,s=4"`` and ``"pqo4"``.

    Parameters
    ----------
    text : str
        The argument.
    arg : str
        Argument name used in error messages.

    Returns
    -------
    list of str
        In the given order, each in the grammar of :func:`~numba_kv.caches.spec.parse_cache_spec`.

    Raises
    ------
    EvalConfigError
        Empty list or entry, an option before any cache name.

    Examples
    --------
    >>> split_cache_list("dense, pqo3:r=32,s=4,pqo4")
    ['dense', 'pqo3:r=32,s=4', 'pqo4']
    """
    if not isinstance(text, str) or not text.strip():
        raise EvalConfigError(f"{arg}: expected a comma-separated list of caches, got {text!r}")
    out: list[str] = []
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            raise EvalConfigError(f"{arg}: empty entry in {text!r}")
        if "=" in item and ":" not in item:
            if not out:
                raise EvalConfigError(f"{arg}: option {item!r} comes before any cache name in {text!r}")
            out[-1] += ("," if ":" in out[-1] else ":") + item
        else:
            out.append(item)
    return out


def parse_cache_specs(text: str, *, residual_length: int | None = None, sink_tokens: int | None = None,
                      arg: str = "--cache") -> list[CacheSpec]:
    """Parse a ``--cache`` argument into validated :class:`~numba_kv.caches.spec.CacheSpec` objects.

    Grammar: a comma-separated list (:func:`split_cache_list`) of caches in the library's
    grammar (:mod:`numba_kv.caches.spec`): ``NAME[-rR][-gG][-sS][:KEY=VALUE[,KEY=VALUE...]]``,
    ``KEY`` a cache option (``residual_length``, ``sink_tokens``, ``window_dtype``,
    ``norm_mode``, ``decode_output``, ``dtype`` for dense; aliases ``r`` and ``s``).

    Parameters
    ----------
    text : str
        The argument, e.g. ``"dense,pqo3,pqo3:residual_length=32,sink_tokens=4"``.
    residual_length, sink_tokens : int, optional
        Applied to every compressed (non-dense) cache that does not set its own.
    arg : str
        Argument name used in error messages.

    Returns
    -------
    list of CacheSpec
        In the given order.

    Raises
    ------
    EvalConfigError
        Empty list or entry, malformed option, unknown cache name or option, invalid
        option value, duplicate cache; the message starts with ``arg``.

    Examples
    --------
    >>> [s.label for s in parse_cache_specs("dense,pqo3-r32-s4,pqo4:r=16")]
    ['dense', 'pqo3-r32-s4', 'pqo4-r16-s4']
    >>> [s.label for s in parse_cache_specs("dense,pqo3", residual_length=32)]
    ['dense', 'pqo3-r32-s4']
    """
    defaults: dict[str, Any] = {}
    if residual_length is not None:
        defaults["residual_length"] = residual_length
    if sink_tokens is not None:
        defaults["sink_tokens"] = sink_tokens
    specs: list[CacheSpec] = []
    seen: dict[str, str] = {}
    for item in split_cache_list(text, arg):
        try:
            spec = parse_cache_spec(item, defaults)
        except ValueError as exc:
            raise EvalConfigError(f"{arg}: {exc}") from None
        try:  # validate name and options now, on a tiny geometry (the layer / head maps of
            # "@FILE" options name the model's layers and heads: checked when its cache is built)
            CacheSpec(spec.name, {k: v for k, v in spec.options.items() if k not in FILE_OPTIONS}).make(
                num_layers=1, num_kv_heads=1, head_dim=64)
        except (ValueError, TypeError) as exc:
            head = item.partition(":")[0].strip()
            raise EvalConfigError(f"{arg}: invalid cache {head!r} with options {dict(spec.options)}: "
                                  f"{exc}") from None
        if spec.label in seen:
            raise EvalConfigError(f"{arg}: cache {spec.label!r} listed twice "
                                  f"({seen[spec.label]!r} and {item!r})")
        seen[spec.label] = item
        specs.append(spec)
    return specs
