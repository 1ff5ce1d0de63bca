"""``benchmarks/kv3_retrieval.py`` (retrieval heads' keys at more bits): the score against the
softmax formula on planted keys, the calibration prompt, the overrides and the pinned
allocation."""

from __future__ import annotations

import importlib.util
import itertools
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def rt():
    return _load("kv3_retrieval")


@pytest.fixture(scope="module")
def kl():
    return _load("kv3_layers")


class _PlantedModel:
    """Two layers, two KV heads, two query heads each; forward() hands the cache fixed q/k/v:
    in layer 1, query head 2 (KV head 1) points at the needle's keys with a logit margin of
    ``MARGIN``; every other query is zero (uniform attention).  Layer 0 slides (window 4)."""

    MARGIN = 3.0

    def __init__(self, n: int, start: int, n_needle: int) -> None:
        self.config = SimpleNamespace(n_layers=2, n_kv_heads=2, n_heads=4, head_dim=32)
        self.softmax_scale = 1.0
        self.layer_windows = [4, None]
        self.q = np.zeros((2, 1, 4, n, 32), np.float32)
        self.k = np.zeros((2, 1, 2, n, 32), np.float32)
        self.k[1, 0, 1, start:start + n_needle, 0] = 1.0
        self.q[1, 0, 2, :, 0] = self.MARGIN

    def forward(self, ids, cache, logits="none", chunk_size=None):
        for layer in range(2):
            cache.prefill(layer, self.k[layer], self.k[layer].copy(), self.q[layer])


def test_score_is_the_softmax_mass_on_the_needle(rt):
    n, start, n_needle, ans = 40, 10, 3, 30
    model = _PlantedModel(n, start, n_needle)
    got = rt.retrieval_scores(model, list(range(n)), start, n_needle, ans)
    qpos = np.arange(ans - 1, n - 1)  # the queries predicting the answer's tokens
    # uniform attention over the causal prefix: n_needle / (p + 1) at each position p
    uniform = np.mean(n_needle / (qpos + 1))
    # planted: weight e^m on each needle token, 1 elsewhere
    e = np.exp(_PlantedModel.MARGIN)
    planted = np.mean(n_needle * e / (n_needle * e + (qpos + 1 - n_needle)))
    assert got.shape == (2, 2)
    assert got[1, 0] == pytest.approx(uniform, rel=1e-6)
    assert got[1, 1] == pytest.approx(planted, rel=1e-6)  # max over the group: the planted head
    assert np.all(got[0] == 0.0)  # a window of 4 never reaches the needle (20 tokens back)


def test_calibration_prompt_holds_its_own_needle(rt, tiny):
    _, tok, _ = tiny
    hay = tok.encode("The cat sat on the mat. The dog ran in the park. " * 60, add_bos=False)
    ids, start, n_needle, ans = rt.prompt_ids(tok, hay, 200, 0.4)
    needle = tok.encode(rt.CAL_NEEDLE, add_bos=False)
    answer = tok.encode(rt.CAL_ANSWER, add_bos=False)
    assert ans == 200 and len(ids) == 200 + len(answer) and n_needle == len(needle)
    assert ids[start:start + n_needle] == needle and ids[ans:] == answer
    assert "." in tok.decode([ids[start - 1]])  # at a sentence end
    from numba_kv.toolkit.evaluation import needle as ev_needle
    assert rt.CAL_NEEDLE != ev_needle.NEEDLE and "Dolores" not in rt.CAL_NEEDLE  # not the test's needle


def test_overrides_raise_the_top_heads_keys_over_a_base(rt):
    scores = np.array([[0.1, 0.9, 0.0], [0.5, 0.2, 0.3]])
    base = {"0": {"1": {"k_bits": 3, "v_bits": 3}}, "1": {"2": {"k_bits": 4, "v_bits": 3}}}
    got = rt.overrides(scores, 2, 5, base)
    assert got == {"0": {"1": {"k_bits": 5, "v_bits": 3}}, "1": {"0": {"k_bits": 5}, "2": {"k_bits": 4, "v_bits": 3}}}
    assert base["0"]["1"]["k_bits"] == 3  # the base is not modified
    both = rt.overrides(scores, 2, 5, base, v_bits=3)  # values widened, never narrowed
    assert both == {"0": {"1": {"k_bits": 5, "v_bits": 3}}, "1": {"0": {"k_bits": 5, "v_bits": 3},
                                                                   "2": {"k_bits": 4, "v_bits": 3}}}


def test_pinned_allocation_is_the_constrained_optimum(kl):
    rng = np.random.default_rng(3)
    n = 4
    sk = rng.random((n, 1)) * 4.0 ** -np.arange(len(kl.K_WIDTHS))[None, :]
    sv = rng.random((n, 1)) * 4.0 ** -np.arange(len(kl.V_WIDTHS))[None, :]
    sens = {"k": {b: sk[:, i] for i, b in enumerate(kl.K_WIDTHS)},
            "v": {b: sv[:, i] for i, b in enumerate(kl.V_WIDTHS)}}
    pins = {1: 5, 3: 5}
    got = kl.allocate(sens, 3.25, min_k=pins)
    assert got[1][0] == 5 and got[3][0] == 5
    assert np.mean([(k + v) / 2 for k, v in got]) <= 3.25 + 1e-9
    best = min(sum(sk[i, a] + sv[i, b] for i, (a, b) in enumerate(combo))
               for combo in itertools.product(itertools.product(range(3), range(3)), repeat=n)
               if all(kl.K_WIDTHS[combo[u][0]] >= k for u, k in pins.items())
               and np.mean([(kl.K_WIDTHS[a] + kl.V_WIDTHS[b]) / 2 for a, b in combo]) <= 3.25 + 1e-9)
    assert kl.cost_of(sens, got) <= best * 1.10 + 1e-12
    with pytest.raises(ValueError, match="min_k"):
        kl.allocate(sens, 3.25, min_k={0: 6})


def test_script_writes_a_pinned_allocation(rt, tmp_path):
    scores = np.zeros((3, 2))
    scores[2, 1], scores[0, 0] = 0.8, 0.6
    np.save(tmp_path / "s.npy", scores)
    sens = {f"k{b}": np.full(6, 4.0 ** -b) for b in (3, 4)} | {f"v{b}": np.full(6, 4.0 ** -b) for b in (2, 3)}
    np.savez(tmp_path / "sens.npz", **sens)
    out = tmp_path / "o.json"
    assert rt.main(["--scores", str(tmp_path / "s.npy"), "--top", "2", "--sens", str(tmp_path / "sens.npz"),
                    "--budget", "3.0", "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    widths = {(int(li), int(h)): (o["k_bits"], o.get("v_bits", 2)) for li, hs in got.items() for h, o in hs.items()}
    alloc = [widths.get((u // 2, u % 2), (4, 2)) for u in range(6)]
    assert alloc[5][0] == 5 and alloc[0][0] == 5  # the two retrieval heads
    assert np.mean([(k + v) / 2 for k, v in alloc]) <= 3.0 + 1e-9  # the others paid for them


def test_shipped_smollm2_retrieval_calibration_is_the_pinned_allocation(rt):
    """``kv3-smollm2-135m-retrieval`` is the KL allocation (mean 3.0 code bits, the essays' table)
    with the five best-scoring retrieval heads of the saved scores pinned to 5-bit keys; it keeps
    ``kv3``'s window on SmolLM2's geometry (the other heads paid for the pins)."""
    from numba_kv.caches.presets import resolve_preset
    from numba_kv.caches.spec import load_overrides

    scores = np.load(ROOT / "benchmarks/results/kv3-2026-11-27-round6-retrieval-scores-smollm2.npy")
    sens = ROOT / "benchmarks/results/kv3-2026-11-27-round4-sens-smollm2-heads-essays-vqb8-w44.npz"
    shipped = json.loads((ROOT / "numba_kv/caches/calibrations/kv3-smollm2-135m-retrieval.json").read_text())
    assert rt.pinned_allocation(scores, 5, 5, str(sens), 3.0) == shipped
    heads = load_overrides("head_overrides", "kv3-smollm2-135m-retrieval")
    widths = [heads.get(li, {}).get(h, {}) for li in range(30) for h in range(3)]
    assert np.mean([(w.get("k_bits", 4) + w.get("v_bits", 2)) / 2 for w in widths]) <= 3.0
    assert sum(w.get("k_bits") == 5 for w in widths) == 5
    plain = resolve_preset("kv3", num_layers=30, num_kv_heads=3, head_dim=64)[1]
    assert resolve_preset("kv3", num_layers=30, num_kv_heads=3, head_dim=64, head_overrides=heads)[1] == plain
