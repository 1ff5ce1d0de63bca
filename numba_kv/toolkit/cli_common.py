"""Helpers shared by the ``numba-kv`` subcommands (:mod:`numba_kv.toolkit.cli`): one-line user
errors, the ``--json`` convention, option lists and the files the options write."""

from __future__ import annotations

import json
import sys
from typing import Any

from .models.gguf_loader import ModelFileError, ModelNotFoundError
from .specs import EvalConfigError

__all__ = ["HF_EXTRA", "TOOLS_EXTRA", "OutputError", "int_list", "missing_extra", "table_or_json", "user_call",
           "user_error", "write_json", "write_text"]

#: the packages of the ``tools`` extra (setup.cfg): a subcommand that misses one says so in one line
TOOLS_EXTRA = ("tqdm", "rich", "gguf", "tokenizers", "matplotlib")
#: packages of the ``hf`` extra (``eval --engine transformers``)
HF_EXTRA = ("torch", "transformers")


class OutputError(EvalConfigError):
    """A file an option writes (``--json``, ``--markdown``, ``--plot``) could not be written."""


def write_json(text: str, dest: str) -> None:
    """``text`` to stdout (``dest`` ``"-"``) or to the file ``dest``."""
    if dest == "-":
        sys.stdout.write(text + "\n")
    else:
        write_text(dest, text + "\n", "--json")


def write_text(dest: str, text: str, arg: str) -> None:
    """``text`` into the file ``dest`` (the value of option ``arg``), then ``wrote DEST`` on
    stderr; :class:`OutputError` naming ``arg`` where it cannot be written (``main`` checked
    the file before the run, but a disk can fill up or a folder vanish meanwhile)."""
    try:
        with open(dest, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as exc:
        raise OutputError(f"{arg}: {dest!r} could not be written ({exc.strerror or exc})") from exc
    sys.stderr.write(f"wrote {dest}\n")


def user_error(command: str, exc: str | BaseException) -> int:
    sys.stderr.write(f"numba-kv {command}: error: {exc}\n")
    return 2


def missing_extra(exc: ModuleNotFoundError) -> str | None:
    """Message for a missing package of the ``tools`` or ``hf`` extra, else None."""
    package = (exc.name or "").split(".")[0]
    for extra, packages in (("tools", TOOLS_EXTRA), ("hf", HF_EXTRA)):
        if package in packages:
            return f"needs the {extra} extra (missing package '{package}'): pip install \"numba-kv[{extra}]\""
    return None


def user_call(command: str, fn: Any, errors: tuple[type[BaseException], ...] = ()) -> tuple[Any, int | None]:
    """``(fn(), None)``; or ``(None, 2)`` after reporting a user error on stderr: a bad
    configuration, a missing model or a file that is not one, or one of ``errors`` (a missing
    package of the ``tools`` extra is reported by :func:`main`).  Any other exception propagates."""
    try:
        return fn(), None
    except (EvalConfigError, ModelNotFoundError, ModelFileError, *errors) as exc:
        return None, user_error(command, exc)


def int_list(text: str, arg: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise EvalConfigError(f"{arg}: expected comma-separated ints, got {text!r}") from None
    if not out:  # ('' ran the default grid, or nothing at all, and reported success)
        raise EvalConfigError(f"{arg}: expected at least one int, got {text!r}")
    return out


def table_or_json(doc: Any, dest: str | None, render: Any, indent: int = 2) -> None:
    """The ``--json`` convention of every subcommand: ``doc`` as JSON on stdout instead of the
    table when ``dest`` is ``"-"``; else the table (``render()``) and, when ``dest`` names a
    file, ``doc`` written there as JSON too.  Values JSON does not know (paths, ...) are written
    as their ``str``."""
    if dest == "-":
        write_json(json.dumps(doc, indent=indent, default=str), dest)
        return
    render()
    if dest:
        write_json(json.dumps(doc, indent=indent, default=str), dest)
