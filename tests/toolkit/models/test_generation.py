"""``generate``: the prompt is checked like ``LlamaModel.forward``'s tokens (the tiny model)."""

from __future__ import annotations

import numpy as np
import pytest

from numba_kv.toolkit.models import generate


@pytest.mark.parametrize("prompt, message", [
    ([5.9, 6.2], "expected a non-empty 1-D sequence of ints, got shape \\(2,\\) dtype float64"),  # was [5, 6]
    (np.array([5.0, 6.0]), "expected a non-empty 1-D sequence of ints"),
    ([True, False], "expected a non-empty 1-D sequence of ints"),
    ([], "expected a non-empty 1-D sequence of ints"),
    ([[5, 6]], "expected a non-empty 1-D sequence of ints"),
    ([5, -1], "ids must be in"),
    ("", "the text '' encodes to no tokens"),
])
def test_bad_prompts_are_value_errors_naming_prompt(tiny, prompt, message):
    model, tok, _ = tiny
    cache = model.new_cache()
    with pytest.raises(ValueError, match=f"^prompt: {message}"):
        generate(model, tok, prompt, 2, cache=cache)
    assert cache.seq_len(0) == 0


def test_prompt_ids_in_the_vocabulary_of_any_int_type_are_kept_as_python_ints(tiny):
    model, tok, _ = tiny
    with pytest.raises(ValueError, match=f"^prompt: ids must be in \\[0, {model.config.vocab_size}\\)"):
        generate(model, tok, [5, model.config.vocab_size], 2)
    ref = generate(model, tok, [5, 6, 7], 3, stop_at_eos=False)
    for prompt in (np.array([5, 6, 7], np.int32), (np.int64(5), 6, 7)):
        g = generate(model, tok, prompt, 3, stop_at_eos=False)
        assert g.prompt_ids == [5, 6, 7] and all(type(i) is int for i in g.prompt_ids)
        assert g.new_ids == ref.new_ids
