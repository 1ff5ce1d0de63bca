"""The Examples sections of the public docstrings run and give what they show."""

import doctest
import importlib
import pkgutil

import pytest

import numba_kv

MODULES = sorted(m.name for m in pkgutil.walk_packages(numba_kv.__path__, "numba_kv.")
                 if not m.name.endswith("__main__"))
#: modules that need an optional extra to import at all (skipped without it)
OPTIONAL = {"numba_kv.integrations.transformers": ("torch", "transformers"),
            "numba_kv.toolkit.evaluation.transformers_engine": ("torch", "transformers")}


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    for dep in OPTIONAL.get(name, ()):
        pytest.importorskip(dep)
    mod = importlib.import_module(name)
    res = doctest.testmod(mod, optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS, verbose=False)
    assert res.failed == 0, f"{res.failed} of {res.attempted} docstring examples failed in {name}"
