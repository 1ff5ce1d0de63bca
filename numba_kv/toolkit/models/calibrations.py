"""The calibrations the library ships for the toolkit's models, applied to presets by name.

A preset such as ``kv3`` is sized for any geometry, but below 4 bits a model's KV heads differ
enough that per-head widths measured on that model (``head_overrides``, the files of
``numba_kv/caches/calibrations``) move its quality: on SmolLM2-135M plain ``kv3`` misses
top-1 ≥ 0.95 at 1,024 tokens (0.947), ``kv3`` with the shipped ``kv3-smollm2-135m-retrieval``
widths passes it (0.953) and has the lower KL at 1K and 8K (the benchmarks page, "Below 4
bits", which also has the needles neither finds).  So the toolkit, which knows the model,
gives a preset the model's shipped calibration whenever the cache names none — visibly: the
cache's label and JSON carry ``head_overrides=@NAME``.  ``--no-calibration`` (command line) or ``calibrate=False``
(:meth:`~numba_kv.toolkit.models.LlamaModel.new_cache`) keeps the plain preset.  The library's
own :func:`numba_kv.make_cache` never does this: it does not know the model.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from numba_kv.caches.presets import PRESETS
from numba_kv.caches.spec import CALIBRATIONS, CacheSpec, FileOverrides, load_overrides

from .gguf_loader import MODEL_NAMES, ModelNotFoundError, smollm2_path

__all__ = ["PRESET_CALIBRATIONS", "calibrated_options", "calibrated_specs", "model_key"]

#: ``{model short name: {preset: shipped calibration name}}``: the ``head_overrides`` a preset
#: gets on that model (``@NAME``: ``numba_kv/caches/calibrations/NAME.json``)
PRESET_CALIBRATIONS: Mapping[str, Mapping[str, str]] = {
    "smollm2": {"kv3": "kv3-smollm2-135m-retrieval"},
}


def model_key(model: Any) -> str | None:
    """The short name (:data:`~numba_kv.toolkit.models.MODEL_NAMES`) of a ``--model`` argument.

    Parameters
    ----------
    model : None, str or os.PathLike
        ``None`` (SmolLM2, the default model), a short name, or a GGUF file.

    Returns
    -------
    str or None
        The short name; for a file, the short name of the model file it is, ``None`` for any
        other (or missing) file.
    """
    if model is None:
        return "smollm2"
    text = os.fspath(model)
    if text in MODEL_NAMES:
        return text
    try:
        return "smollm2" if os.path.samefile(text, smollm2_path()) else None
    except (OSError, ModelNotFoundError):  # not a file, or the SmolLM2 package is not installed
        return None


def _shipped(name: str, key: str | None) -> str | None:
    """The calibration of preset ``name`` on model ``key``, or ``None``."""
    preset = name.strip().lower()
    return PRESET_CALIBRATIONS.get(key or "", {}).get(preset) if preset in PRESETS else None


def calibrated_options(name: str, options: Mapping[str, Any], key: str | None) -> dict[str, Any]:
    """``options`` of cache ``name`` with the model's shipped ``head_overrides`` added when
    ``name`` is a preset that has one on model ``key`` and ``options`` give none.

    Parameters
    ----------
    name : str
        A :func:`~numba_kv.make_cache` name (any case for a preset).
    options : mapping
        Its keyword options (not modified).
    key : str or None
        The model's short name (:func:`model_key`).

    Returns
    -------
    dict
        A copy of ``options``, with ``head_overrides`` (a
        :class:`~numba_kv.caches.spec.FileOverrides` named ``@NAME``) when one applies.

    Examples
    --------
    >>> calibrated_options("kv3", {}, "smollm2")
    {'head_overrides': @kv3-smollm2-135m-retrieval}
    >>> calibrated_options("kv3", {}, "gemma3-270m"), calibrated_options("kv4", {}, "smollm2")
    ({}, {})
    """
    out = dict(options)
    shipped = _shipped(name, key)
    if shipped is not None and "head_overrides" not in out:
        # the shipped file itself (a local file of that name would win for a name a user types)
        data = load_overrides("head_overrides", str(CALIBRATIONS / f"{shipped}.json"))
        out["head_overrides"] = FileOverrides(dict(data), shipped)
    return out


def calibrated_specs(specs: list[CacheSpec], model: Any) -> list[CacheSpec]:
    """The ``--cache`` list with each preset given the shipped calibration of ``model`` when
    it names none: its label then shows it (``kv3:head_overrides=@kv3-smollm2-135m-retrieval``).

    Parameters
    ----------
    specs : list of CacheSpec
        The parsed ``--cache`` list.
    model : None, str or os.PathLike
        The ``--model`` argument (:func:`model_key`).

    Returns
    -------
    list of CacheSpec
        New specs, in order; the others' options unchanged.
    """
    key = model_key(model)
    return [CacheSpec(s.name, calibrated_options(s.name, s.options, key)) for s in specs]
