"""The Examples sections of the public docstrings run and give what they show."""

import doctest
import importlib
import pkgutil

import pytest

import numba_kv

MODULES = sorted(m.name for m in pkgutil.walk_packages(numba_kv.__path__, "numba_kv.")
                 if not m.name.endswith("__main__"))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    mod = importlib.import_module(name)
    res = doctest.testmod(mod, optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS, verbose=False)
    assert res.failed == 0, f"{res.failed} of {res.attempted} docstring examples failed in {name}"
