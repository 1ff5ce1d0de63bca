"""Helpers of the Gemma-3 tests: a random tiny Gemma-3 written as GGUF the way llama.cpp's
converter writes one (``norm.weight + 1``, Q/K not permuted, no merges in the SentencePiece
vocabulary), an independent float64 reference forward written from the architecture
description in the Hugging Face layout, and a naive SentencePiece-BPE segmenter."""

from __future__ import annotations

import numpy as np

SPACE = "\u2581"
TINY_GEMMA = {"n_layers": 6, "n_heads": 4, "n_kv_heads": 2, "head_dim": 32, "dim": 64, "ffn_dim": 96, "window": 5,
                  "theta_global": 1e6, "theta_local": 1e4, "eps": 1e-6}

# control (3), user-defined (4), byte (6), normal (1) pieces; normal pieces scored so
# that the order of merges matters ("▁the" must beat "he" + ...)
CONTROL = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
USER = ["\n", "\n\n", "  "]
PIECES = {  # piece: score (higher merges first)
    "th": -1.0, "he": -2.0, "▁t": -3.0, "▁th": -4.0, "▁the": -0.5, "the": -5.0, "in": -6.0, "er": -7.0,
    "▁a": -8.0, "an": -9.0, "▁an": -9.5, "at": -10.0, "ca": -11.0, "cat": -12.0, "▁cat": -12.5,
    "ab": -13.0, "bc": -14.0, "abc": -15.0, "cd": -16.0, "bcd": -0.25, "é": -20.0,
}
CHARS = [SPACE] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + list("TH,.!?'")


def tiny_spm_vocab():
    """``(tokens, scores, types)`` of the tiny SentencePiece vocabulary."""
    tokens = CONTROL + USER + [f"<0x{b:02X}>" for b in range(256)]
    types = [3] * len(CONTROL) + [4] * len(USER) + [6] * 256
    scores = [-1000.0] * (len(CONTROL) + len(USER)) + [0.0] * 256
    for ch in CHARS:
        tokens.append(ch)
        types.append(1)
        scores.append(-100.0)
    for p, sc in PIECES.items():
        tokens.append(p)
        types.append(1)
        scores.append(sc)
    return tokens, scores, types


def spm_reference_encode(text, tokens, scores, types):
    """Naive SentencePiece-BPE as llama.cpp runs it: user-defined pieces split the raw text
    (longest first), spaces become "▁", then repeatedly join the adjacent pair whose
    concatenation is a normal piece of the highest score (leftmost on ties); symbols
    without a piece become their UTF-8 bytes ``<0xXX>``."""
    ids = {t: i for i, t in reversed(list(enumerate(tokens)))}
    normal = {t: scores[i] for i, t in enumerate(tokens) if types[i] == 1}
    user = sorted((t for i, t in enumerate(tokens) if types[i] == 4), key=len, reverse=True)
    out = []
    frag = ""

    def flush(s):
        syms = list(s.replace(" ", SPACE))
        while True:
            best, where = None, -1
            for i in range(len(syms) - 1):
                sc = normal.get(syms[i] + syms[i + 1])
                if sc is not None and (best is None or sc > best):
                    best, where = sc, i
            if best is None:
                break
            syms[where:where + 2] = [syms[where] + syms[where + 1]]
        for s_ in syms:
            if s_ in normal:
                out.append(ids[s_])
            else:
                out.extend(ids[f"<0x{b:02X}>"] for b in s_.encode("utf-8"))

    i = 0
    while i < len(text):
        m = next((u for u in user if text.startswith(u, i)), None)
        if m is None:
            frag += text[i]
            i += 1
            continue
        flush(frag)
        frag = ""
        out.append(ids[m])
        i += len(m)
    flush(frag)
    return out


def write_tiny_gemma_gguf(path, seed: int = 0):
    """Write a random tiny Gemma-3 GGUF (6 layers, layer 5 global); return the HF-layout weights."""
    import gguf

    c = TINY_GEMMA
    rng = np.random.default_rng(seed)
    tokens, scores, types = tiny_spm_vocab()
    vocab = len(tokens)
    d, hd, nh, nkv, f = c["dim"], c["head_dim"], c["n_heads"], c["n_kv_heads"], c["ffn_dim"]

    def mat(o, i, scale=None):
        return (rng.standard_normal((o, i)) * (scale or i ** -0.5)).astype(np.float32)

    def nw(n):  # Gemma's raw RMSNorm weight w (the norm multiplies by 1 + w)
        return (0.3 * rng.standard_normal(n)).astype(np.float32)

    hf = {"embed": mat(vocab, d, 0.2), "norm": nw(d), "layers": []}
    for _ in range(c["n_layers"]):
        hf["layers"].append({
            "in_norm": nw(d), "q": mat(nh * hd, d), "k": mat(nkv * hd, d), "v": mat(nkv * hd, d), "o": mat(d, nh * hd),
            "q_norm": nw(hd), "k_norm": nw(hd), "post_attn_norm": nw(d), "pre_ffn_norm": nw(d), "post_ffn_norm": nw(d),
            "gate": mat(f, d), "up": mat(f, d), "down": mat(d, f),
        })

    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_name("tiny-test-gemma3")
    w.add_block_count(c["n_layers"])
    w.add_context_length(256)
    w.add_embedding_length(d)
    w.add_feed_forward_length(f)
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_freq_base(c["theta_global"])
    w.add_layer_norm_rms_eps(c["eps"])
    w.add_sliding_window(c["window"])
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)

    def norm(name, a):  # llama.cpp's Gemma converter stores 1 + w
        w.add_tensor(name, (a + 1).astype(np.float32))

    w.add_tensor("token_embd.weight", hf["embed"])
    norm("output_norm.weight", hf["norm"])
    for i, L in enumerate(hf["layers"]):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight", L["in_norm"])
        w.add_tensor(p + "attn_q.weight", L["q"])
        w.add_tensor(p + "attn_k.weight", L["k"])
        w.add_tensor(p + "attn_v.weight", L["v"])
        norm(p + "attn_q_norm.weight", L["q_norm"])
        norm(p + "attn_k_norm.weight", L["k_norm"])
        w.add_tensor(p + "attn_output.weight", L["o"])
        norm(p + "post_attention_norm.weight", L["post_attn_norm"])
        norm(p + "ffn_norm.weight", L["pre_ffn_norm"])
        w.add_tensor(p + "ffn_gate.weight", L["gate"])
        w.add_tensor(p + "ffn_up.weight", L["up"])
        w.add_tensor(p + "ffn_down.weight", L["down"])
        norm(p + "post_ffw_norm.weight", L["post_ffn_norm"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


def load_tiny_gemma(folder):
    """``(model, tokenizer, hf_weights)``: :func:`write_tiny_gemma_gguf` into ``folder``, loaded
    by the toolkit's loader (its converted weights cached there too) — the module fixtures'
    common setup."""
    from numba_kv.toolkit.models import load_model

    hf = write_tiny_gemma_gguf(folder / "tiny-gemma3.gguf")
    model, tok = load_model(folder / "tiny-gemma3.gguf", cache_dir=folder / "cache")
    return model, tok, hf


def gemma_reference_logits(hf, ids, window=None):
    """Independent float64 Gemma-3 forward (HF layout): ``(1 + w)`` RMSNorm, embeddings
    scaled by ``sqrt(dim)``, QK-norm, ``rotate_half`` RoPE with a local and a global base,
    sliding-window mask on layers ``i % 6 != 5``, GELU-tanh gate, post-norms."""
    c = TINY_GEMMA
    hd, nh, nkv, d = c["head_dim"], c["n_heads"], c["n_kv_heads"], c["dim"]
    window = c["window"] if window is None else window
    t = len(ids)

    def norm(x, w):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + c["eps"]) * (1.0 + w.astype(np.float64))

    def rope(x, theta):  # [heads, t, hd]
        inv = theta ** (-np.arange(0, hd, 2) / hd)
        ang = np.arange(t)[:, None] * inv[None]
        cos = np.concatenate([np.cos(ang)] * 2, -1)
        sin = np.concatenate([np.sin(ang)] * 2, -1)
        rot = np.concatenate([-x[..., hd // 2:], x[..., : hd // 2]], -1)
        return x * cos + rot * sin

    def gelu(x):
        return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))

    qi, kj = np.arange(t)[:, None], np.arange(t)[None, :]
    x = hf["embed"][np.asarray(ids)].astype(np.float64) * np.sqrt(d)
    for li, L in enumerate(hf["layers"]):
        local = li % 6 != 5
        theta = c["theta_local"] if local else c["theta_global"]
        visible = (kj <= qi) & ((qi - kj < window) if local else True)
        h = norm(x, L["in_norm"])
        q = rope(norm((h @ L["q"].T).reshape(t, nh, hd).transpose(1, 0, 2), L["q_norm"]), theta)
        k = rope(norm((h @ L["k"].T).reshape(t, nkv, hd).transpose(1, 0, 2), L["k_norm"]), theta)
        v = (h @ L["v"].T).reshape(t, nkv, hd).transpose(1, 0, 2)
        k = np.repeat(k, nh // nkv, axis=0)
        v = np.repeat(v, nh // nkv, axis=0)
        s = q @ k.transpose(0, 2, 1) * hd ** -0.5  # query_pre_attn_scalar = head_dim
        s = np.where(visible, s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        a = (p @ v).transpose(1, 0, 2).reshape(t, nh * hd) @ L["o"].T
        x = x + norm(a, L["post_attn_norm"])
        h = norm(x, L["pre_ffn_norm"])
        m = (gelu(h @ L["gate"].T) * (h @ L["up"].T)) @ L["down"].T
        x = x + norm(m, L["post_ffn_norm"])
    return norm(x, hf["norm"]) @ hf["embed"].T
