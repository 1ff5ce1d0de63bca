"""Does the order of the 32-block rotation matter on real keys and values?

The block quantizer (:func:`numba_kv.quantize_blocks`) rotates each 32-value block as
``D_s·H``: Hadamard first, then the fixed signs (the llama.cpp ``tq3_0`` order).  ``H`` maps a
constant vector to one coordinate, so a block whose channels share an offset stays a spike
after the rotation; the usual randomized Hadamard ``H·D_s`` (signs first) spreads it.  On
synthetic data that costs a lot (``--synthetic``); this script measures what it costs on the
K and V a real model writes to its cache.

Each model reads the first ``--tokens`` tokens of the evaluation text in one prefill with a
``dense`` cache; the queries, post-RoPE keys and values each layer stores are recorded.  For
each layer, at each width: the NMSE (``Σ(x̂ − x)² / Σx²``) of the quantize round trip as
shipped (keys also centered per channel first, their error still over ``Σk²``) and with
random ±1 signs applied per channel before it and undone after (signs first, the mean over
``--draws`` sign draws), and the relative L2 error of the attention output (float64, causal,
the layer's window, ``--queries`` real query positions from the last three quarters, every
query head) with both K and V quantized.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python benchmarks/rotation_order.py [--models smollm2,gemma3-270m]
    .venv/bin/python benchmarks/rotation_order.py --synthetic
"""

from __future__ import annotations

import argparse

import numpy as np

import numba_kv as nk
from numba_kv.info import provenance_line


def round_trip(x: np.ndarray, bits: int, signs: np.ndarray | None = None) -> np.ndarray:
    """``x`` through ``quantize_blocks``/``dequantize_blocks``, optionally signs first."""
    y = x if signs is None else x * signs
    codes, scales = nk.quantize_blocks(np.ascontiguousarray(y, np.float32), bits)
    out = nk.dequantize_blocks(codes, scales, bits)
    return out if signs is None else out * signs


def nmse(x: np.ndarray, xh: np.ndarray) -> float:
    return float(((xh.astype(np.float64) - x) ** 2).sum() / (x.astype(np.float64) ** 2).sum())


def attention(q, k, v, scale, pos, window):
    """Causal attention of query rows ``pos`` (float64): ``q [H, T, d]``, ``k``/``v [G, T, d]``."""
    groups = q.shape[0] // k.shape[0]
    j = np.arange(k.shape[1])
    mask = j[None, :] <= pos[:, None]
    if window:
        mask &= j[None, :] > pos[:, None] - window
    out = []
    for h in range(q.shape[0]):
        logits = np.where(mask, q[h, pos].astype(np.float64) @ k[h // groups].T.astype(np.float64) * scale, -np.inf)
        p = np.exp(logits - logits.max(1, keepdims=True))
        out.append((p / p.sum(1, keepdims=True)) @ v[h // groups].astype(np.float64))
    return np.stack(out)


def capture(name: str, tokens: int) -> tuple[list, float, list]:
    """Per layer ``(q [H, T, d], k [G, T, d], v [G, T, d])`` of one prefill of the eval text."""
    from numba_kv.toolkit.models import load_model
    from numba_kv.toolkit.specs import DEFAULT_TEXT

    model, tok = load_model(name)
    with open(DEFAULT_TEXT, encoding="utf-8") as f:
        ids = tok.encode(f.read())[:tokens]
    rec: dict[int, tuple] = {}
    inner = model._cache_attention  # the one place a layer hands its q, k, v to the cache

    def hook(li, cache, q, k, v, use_decode, exact=None):
        rec[li] = (np.array(q[0], np.float32), np.array(k[0], np.float32), np.array(v[0], np.float32))
        return inner(li, cache, q, k, v, use_decode, exact)

    model._cache_attention = hook
    model.forward(ids, model.new_cache("dense"), 0, chunk_size=None, logits="none")
    return [rec[i] for i in range(len(rec))], model.softmax_scale, list(model.layer_windows)


def measure(name: str, a: argparse.Namespace) -> None:
    layers, scale, windows = capture(name, a.tokens)
    rng = np.random.default_rng(0)
    d, t = layers[0][1].shape[-1], layers[0][1].shape[1]
    draws = [rng.choice(np.array([-1.0, 1.0], np.float32), size=d) for _ in range(a.draws)]
    pos = np.sort(rng.choice(np.arange(t // 4, t), size=min(a.queries, t - t // 4), replace=False))
    print(f"\n{name}: {len(layers)} layers, {t} tokens, d = {d}; NMSE and attention error, shipped (D_s·H) "
          f"/ signs first (H·D_s, mean of {a.draws} draws)")
    print("| bits | K NMSE | K NMSE, keys centered | V NMSE | attention rel. error | K ratio per layer "
          "| attention ratio per layer |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for bits in a.bits:
        rows = []
        for (q, k, v), w in zip(layers, windows):
            exact = attention(q, k, v, scale, pos, w)
            kh, vh = round_trip(k, bits), round_trip(v, bits)
            ks = [round_trip(k, bits, s) for s in draws]
            vs = [round_trip(v, bits, s) for s in draws]
            kc = k - k.mean(1, keepdims=True)  # keys centered per channel (what ``key_center`` removes)
            rel = float((kc.astype(np.float64) ** 2).sum() / (k.astype(np.float64) ** 2).sum())
            rows.append((nmse(k, kh), np.mean([nmse(k, y) for y in ks]), nmse(v, vh), np.mean([nmse(v, y) for y in vs]),
                         nmse(exact, attention(q, kh, vh, scale, pos, w)) ** 0.5,
                         np.mean([nmse(exact, attention(q, y, z, scale, pos, w)) ** 0.5 for y, z in zip(ks, vs)]),
                         nmse(kc, round_trip(kc, bits)) * rel,
                         np.mean([nmse(kc, round_trip(kc, bits, s)) for s in draws]) * rel))
        r = np.array(rows)
        m = r.mean(0)
        kr, ar = r[:, 1] / r[:, 0], r[:, 5] / r[:, 4]
        print(f"| {bits} | {m[0]:.4f} / {m[1]:.4f} | {m[6]:.4f} / {m[7]:.4f} | {m[2]:.4f} / {m[3]:.4f} "
              f"| {m[4]:.3f} / {m[5]:.3f} | {kr.min():.2f}–{kr.max():.2f} | {ar.min():.2f}–{ar.max():.2f} |")


def synthetic(a: argparse.Namespace) -> None:
    """N(0, 1) blocks plus a common offset of ``c`` σ on every channel of a block."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4096, 128)).astype(np.float32)
    draws = [rng.choice(np.array([-1.0, 1.0], np.float32), size=128) for _ in range(a.draws)]
    print("| bits | offset (σ) | NMSE shipped | NMSE signs first |")
    print("| --- | --- | --- | --- |")
    for bits in a.bits:
        for c in (0.0, 0.5, 1.0, 2.0, 4.0):
            y = x + np.float32(c)
            sf = np.mean([nmse(y, round_trip(y, bits, s)) for s in draws])
            print(f"| {bits} | {c:g} | {nmse(y, round_trip(y, bits)):.3f} | {sf:.3f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="smollm2,gemma3-270m", help="comma-separated model names")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--bits", type=lambda s: [int(b) for b in s.split(",")], default=[3, 4])
    p.add_argument("--draws", type=int, default=4, help="sign draws for the signs-first arm")
    p.add_argument("--queries", type=int, default=128, help="query positions per layer")
    p.add_argument("--synthetic", action="store_true", help="the block-offset experiment instead")
    a = p.parse_args()
    print(provenance_line())
    if a.synthetic:
        synthetic(a)
        return
    for name in a.models.split(","):
        measure(name, a)


if __name__ == "__main__":
    main()
