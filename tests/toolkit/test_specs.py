"""The command line's cache lists (``numba_kv.toolkit.specs``): the list separator lives there,
each cache is read by the library's grammar (``tests/caches/test_spec.py``)."""

import pytest

from numba_kv.toolkit.specs import EvalConfigError, check_text_file, split_cache_list


def test_the_list_separator_is_the_command_lines():
    assert split_cache_list("dense, pqo3:r=32,s=4,pqo4") == ["dense", "pqo3:r=32,s=4", "pqo4"]
    assert split_cache_list("pqo3,key_center=true") == ["pqo3:key_center=true"]
    with pytest.raises(EvalConfigError, match="^--modes: option"):
        split_cache_list("r=3,pqo3", "--modes")


def test_a_text_file_must_be_a_non_empty_regular_file(tmp_path):
    # /dev/null and a directory were "file ... not found"
    (tmp_path / "empty.txt").write_text("")
    for path, why in ((tmp_path / "nope.txt", "not found"), (tmp_path, "is a directory"),
                      ("/dev/null", "is not a regular file"), (tmp_path / "empty.txt", "is empty")):
        with pytest.raises(EvalConfigError, match=f"^--text: file {str(path)!r} {why}$"):
            check_text_file(path)
    (tmp_path / "t.txt").write_text("Some prose.")
    assert check_text_file(str(tmp_path / "t.txt"), "--x") == tmp_path / "t.txt"
