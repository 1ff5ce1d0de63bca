"""Helpers of the real-model tests: a random tiny Llama written as GGUF, and an
independent float64 reference forward in the Hugging Face weight layout."""

from __future__ import annotations

import numpy as np


def bytes_to_unicode():
    """GPT-2's byte -> printable unicode map (byte-level BPE alphabet)."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


TINY = {"n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 32, "dim": 128, "ffn_dim": 192,
        "theta": 10000.0, "eps": 1e-5}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "a t", "e r", "Ġ s"]


def tiny_vocab():
    alphabet = sorted(set(bytes_to_unicode().values()), key=lambda ch: ord(ch))
    merged = [m.replace(" ", "") for m in MERGES]
    tokens = SPECIALS + alphabet + merged
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, types


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Row permutation of ``convert_hf_to_gguf.py`` (``LlamaModel.permute``) for Q/K."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def write_tiny_gguf(path, seed: int = 0, tied: bool = True, quant: bool = False):
    """Write a random tiny Llama GGUF; return the HF-layout weights."""
    import gguf

    c = TINY
    rng = np.random.default_rng(seed)
    tokens, types = tiny_vocab()
    vocab = len(tokens)
    d, hd, nh, nkv, f = c["dim"], c["head_dim"], c["n_heads"], c["n_kv_heads"], c["ffn_dim"]

    def mat(o, i, scale=None):
        return (rng.standard_normal((o, i)) * (scale or i ** -0.5)).astype(np.float32)

    hf = {"embed": mat(vocab, d, 1.0), "norm": (1 + 0.1 * rng.standard_normal(d)).astype(np.float32),
          "layers": []}
    if not tied:
        hf["lm_head"] = mat(vocab, d)
    for _ in range(c["n_layers"]):
        hf["layers"].append({
            "in_norm": (1 + 0.1 * rng.standard_normal(d)).astype(np.float32),
            "q": mat(nh * hd, d), "k": mat(nkv * hd, d), "v": mat(nkv * hd, d), "o": mat(d, nh * hd),
            "post_norm": (1 + 0.1 * rng.standard_normal(d)).astype(np.float32),
            "gate": mat(f, d), "up": mat(f, d), "down": mat(d, f),
        })

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-test-llama")
    w.add_block_count(c["n_layers"])
    w.add_context_length(256)
    w.add_embedding_length(d)
    w.add_feed_forward_length(f)
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_rope_freq_base(c["theta"])
    w.add_layer_norm_rms_eps(c["eps"])
    w.add_rope_dimension_count(hd)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)

    def put(name, a, q=False):
        if q:
            qt = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(name, gguf.quants.quantize(a, qt), raw_dtype=qt)
        else:
            w.add_tensor(name, a)

    put("token_embd.weight", hf["embed"], quant)
    put("output_norm.weight", hf["norm"])
    if not tied:
        put("output.weight", hf["lm_head"], quant)
    for i, L in enumerate(hf["layers"]):
        p = f"blk.{i}."
        put(p + "attn_norm.weight", L["in_norm"])
        put(p + "attn_q.weight", llama_cpp_permute(L["q"], nh), quant)
        put(p + "attn_k.weight", llama_cpp_permute(L["k"], nkv), quant)
        put(p + "attn_v.weight", L["v"], quant)
        put(p + "attn_output.weight", L["o"], quant)
        put(p + "ffn_norm.weight", L["post_norm"])
        put(p + "ffn_gate.weight", L["gate"], quant)
        put(p + "ffn_up.weight", L["up"], quant)
        put(p + "ffn_down.weight", L["down"], quant)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


def hf_reference_logits(hf, ids):
    """Independent float64 forward in the Hugging Face layout (NEOX ``rotate_half`` RoPE)."""
    c = TINY
    hd, nh, nkv = c["head_dim"], c["n_heads"], c["n_kv_heads"]
    t = len(ids)

    def norm(x, w):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + c["eps"]) * w

    inv = c["theta"] ** (-np.arange(0, hd, 2) / hd)
    ang = np.arange(t)[:, None] * inv[None]
    cos = np.concatenate([np.cos(ang)] * 2, -1)
    sin = np.concatenate([np.sin(ang)] * 2, -1)

    def rope(x):  # [heads, t, hd]
        rot = np.concatenate([-x[..., hd // 2:], x[..., : hd // 2]], -1)
        return x * cos + rot * sin

    x = hf["embed"][np.asarray(ids)].astype(np.float64)
    for L in hf["layers"]:
        h = norm(x, L["in_norm"])
        q = rope((h @ L["q"].T).reshape(t, nh, hd).transpose(1, 0, 2))
        k = rope((h @ L["k"].T).reshape(t, nkv, hd).transpose(1, 0, 2))
        v = (h @ L["v"].T).reshape(t, nkv, hd).transpose(1, 0, 2)
        k = np.repeat(k, nh // nkv, axis=0)
        v = np.repeat(v, nh // nkv, axis=0)
        s = q @ k.transpose(0, 2, 1) / np.sqrt(hd)
        s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        x = x + (p @ v).transpose(1, 0, 2).reshape(t, nh * hd) @ L["o"].T
        h = norm(x, L["post_norm"])
        g = h @ L["gate"].T
        x = x + ((g / (1 + np.exp(-g))) * (h @ L["up"].T)) @ L["down"].T
    out = hf.get("lm_head", hf["embed"])
    return norm(x, hf["norm"]) @ out.T


