"""The command line's cache lists (``numba_kv.toolkit.specs``): the list separator lives there,
each cache is read by the library's grammar (``tests/caches/test_spec.py``)."""

import pytest

from numba_kv.toolkit.specs import EvalConfigError, split_cache_list


def test_the_list_separator_is_the_command_lines():
    assert split_cache_list("dense, pqo3:r=32,s=4,pqo4") == ["dense", "pqo3:r=32,s=4", "pqo4"]
    assert split_cache_list("pqo3,key_center=true") == ["pqo3:key_center=true"]
    with pytest.raises(EvalConfigError, match="^--modes: option"):
        split_cache_list("r=3,pqo3", "--modes")
