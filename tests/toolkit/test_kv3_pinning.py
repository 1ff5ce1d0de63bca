"""``benchmarks/kv3_pinning.py`` (the token-level ``kv3`` lever): the causal pinned set against
its definition by brute force, the per-head engine against the one-pass engine when nothing is
pinned, and a run of the script on the tiny model."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from numba_kv.toolkit.evaluation.simulate import simulate_logits

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def kp():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("kv3_pinning", ROOT / "benchmarks" / "kv3_pinning.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _brute(p, exact_after, n_prefill, window, pinned, score):
    """At each query ``i``: the ``pinned`` best-scored tokens among those that left the window by
    ``i``, where a token's score may use only the ``window`` queries before it left (and, for the
    prompt, the prompt's last ``window`` queries); ties to the earlier exit (heap order)."""
    n = p.shape[0]
    sc = np.zeros(n)
    for j in range(n):
        obs = [i for i in range(n) if j <= i < exact_after[j] and i >= exact_after[j] - window
               and i >= n_prefill - window]
        vals = [p[i, j] for i in obs]
        sc[j] = (sum(vals) if score == "sum" else max(vals, default=0.0))
    out = np.zeros((n, n), dtype=bool)
    for i in range(n):
        # replay the heap: tokens enter in exit order; the set at i is what survived every entry <= i
        alive: list[int] = []
        for j in sorted(range(n), key=lambda t: (exact_after[t], t)):
            if exact_after[j] > i:
                break
            alive.append(j)
            if len(alive) > pinned:
                alive.remove(min(alive, key=lambda t: (sc[t], t)))
        out[i, alive] = True
    return out


@pytest.mark.parametrize("score", ["sum", "max"])
def test_pin_mask_matches_its_definition(kp, score):
    rng = np.random.default_rng(3)
    n, P, W, H = 40, 12, 5, 3
    p = np.tril(rng.random((n, n)))
    p /= p.sum(1, keepdims=True)
    exact_after = np.array([n if j < 2 else (P if j < P - W else j + W) for j in range(n)])
    exact_after = np.minimum(exact_after, n)
    got = kp.pin_mask(p, exact_after, P, W, H, score)
    assert np.array_equal(got, _brute(p, exact_after, P, W, H, score))
    assert got.sum(1).max() == H and not got[:P].any()  # H per query once tokens have left; none before
    assert not kp.pin_mask(p, exact_after, P, W, 0, score).any()


def test_unpinned_engine_is_the_one_pass_engine(kp, tiny):
    model, tok, _ = tiny
    ids = np.asarray(tok.encode("the quick brown fox jumps over the lazy dog " * 8)[:80], dtype=np.int64)
    c = model.config
    kq = [kp.head_quantizer(4, None) for _ in range(c.n_layers)]
    vq = [kp.head_quantizer(2, None) for _ in range(c.n_layers)]
    ref = simulate_logits(model, ids, 24, k_quant=kq, v_quant=vq, residual_length=6, sink_tokens=2)
    eng = kp.PinnedEngine(model, ids, 24, 6, 2, 0, "sum")
    got = eng.logits(kq, vq)
    assert got.shape == ref.shape
    assert np.abs(got - ref).max() <= 2e-3 * np.abs(ref).max()
    pinned = kp.PinnedEngine(model, ids, 24, 6, 2, 4, "sum")
    other = pinned.logits(kq, vq)
    assert pinned.pinned_pairs > 0 and np.abs(other - ref).max() > 1e-3  # pinning changes what is read


def test_script_on_the_tiny_model(kp, tiny_gguf, tmp_path):
    path, _ = tiny_gguf
    out = tmp_path / "rows.jsonl"
    assert kp.main(["--model", str(path), "--tokens", "96", "--prefill", "32", "--arms", "8:0,4:4",
                    "--score", "oracle", "--json", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["window"], r["pinned"]) for r in rows] == [(8, 0), (4, 4)]
    assert all(r["kl_mean"] > 0 and 0 < r["top1"] <= 1 for r in rows)
