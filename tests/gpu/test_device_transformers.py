"""The transformers integration on CUDA tensors: a tiny random Llama generating with a ``kv4``
cache on a non-default torch stream gives the tokens it gives on the default stream, and
logits within the CPU run's float round-off.  Needs a GPU, CuPy and a CUDA build of torch
(skipped otherwise; the CPU integration tests are ``tests/integrations/``)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu_only


@pytest.mark.parametrize("attn", ["numba_kv", "sdpa"])
def test_generate_on_a_cuda_stream(attn):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA build of torch and a GPU")
    from transformers import LlamaConfig, LlamaForCausalLM

    from numba_kv.integrations.transformers import NumbaKVCache

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=256)
    model = LlamaForCausalLM(cfg).eval()
    model.set_attn_implementation(attn)
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(0))
    kw = {"max_new_tokens": 8, "do_sample": False, "attention_mask": torch.ones_like(ids), "pad_token_id": 0,
          "output_logits": True, "return_dict_in_generate": True}
    cpu = model.generate(ids, past_key_values=NumbaKVCache.from_model(model, "kv4"), **kw)
    model = model.cuda()
    outs = []
    for stream in (torch.cuda.current_stream(), torch.cuda.Stream()):
        with torch.cuda.stream(stream), torch.no_grad():
            outs.append(model.generate(ids.cuda(), past_key_values=NumbaKVCache.from_model(model, "kv4"),
                                       **{**kw, "attention_mask": kw["attention_mask"].cuda()}))
        torch.cuda.synchronize()
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    for a, b, c in zip(outs[0].logits, outs[1].logits, cpu.logits):
        np.testing.assert_array_equal(a.cpu().numpy(), b.cpu().numpy())
        np.testing.assert_allclose(a.cpu().numpy(), c.numpy(), rtol=1e-3, atol=1e-3)
