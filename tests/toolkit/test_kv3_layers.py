"""``benchmarks/kv3_layers.py`` (sensitivity-based widths per layer): the allocation against
exhaustive search, and a run of the script on the tiny model."""

from __future__ import annotations

import importlib.util
import itertools
import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def kl():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("kv3_layers", ROOT / "benchmarks" / "kv3_layers.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_allocate_is_the_exhaustive_optimum(kl):
    rng = np.random.default_rng(0)
    for trial in range(5):
        n = 4
        # convex decreasing costs per layer (as distortion against width is): c * 4**-b, scaled per layer
        sk = rng.random((n, 1)) * 4.0 ** -np.arange(len(kl.K_WIDTHS))[None, :]
        sv = rng.random((n, 1)) * 4.0 ** -np.arange(len(kl.V_WIDTHS))[None, :]
        sens = {"k": {b: sk[:, i] for i, b in enumerate(kl.K_WIDTHS)},
                "v": {b: sv[:, i] for i, b in enumerate(kl.V_WIDTHS)}}
        budget = 3.0 + 0.25 * (trial % 3)
        got = kl.allocate(sens, budget)
        assert np.mean([(k + v) / 2 for k, v in got]) <= budget + 1e-9
        best = min((sum(sk[i, a] + sv[i, b] for i, (a, b) in enumerate(combo)), combo)
                   for combo in itertools.product(itertools.product(range(3), range(3)), repeat=n)
                   if np.mean([(kl.K_WIDTHS[a] + kl.V_WIDTHS[b]) / 2 for a, b in combo]) <= budget + 1e-9)
        cost = kl.cost_of(sens, got)
        assert cost == pytest.approx(sum(sk[i, kl.K_WIDTHS.index(k)] + sv[i, kl.V_WIDTHS.index(v)]
                                         for i, (k, v) in enumerate(got)))
        # a Lagrangian sweep reaches the convex hull's points: within 10 % of the exhaustive optimum here
        assert cost <= best[0] * 1.10 + 1e-12, (trial, cost, best)
    with pytest.raises(ValueError, match="budget"):
        kl.allocate(sens, 2.0)


def test_script_on_the_tiny_model(kl, tiny_gguf, tmp_path):
    path, _ = tiny_gguf
    out, sens = tmp_path / "rows.jsonl", tmp_path / "sens.npz"
    assert kl.main(["--model", str(path), "--tokens", "96", "--prefill", "32", "--window", "4",
                    "--budget", "3.0", "--sens", str(sens), "--json", str(out)]) == 0
    z = np.load(sens)
    assert sorted(z.files) == ["k3", "k4", "k5", "v2", "v3", "v4"] and z["k3"].shape == (2,)
    # (the tiny model's random weights put almost all mass on one token: KL ~1e-13, no ordering to test)
    assert all(np.all(np.isfinite(z[f])) and np.all(z[f] > -1e-9) for f in z.files)
    again = tmp_path / "again.jsonl"  # a saved table is loaded; only the widths it lacks are measured
    assert kl.main(["--model", str(path), "--tokens", "96", "--prefill", "32", "--window", "4", "--budget", "3.0",
                    "--k-widths", "2,3,4,5", "--sens", str(sens), "--json", str(again)]) == 0
    z2 = np.load(sens)
    assert sorted(z2.files) == ["k2", "k3", "k4", "k5", "v2", "v3", "v4"]
    assert all(np.array_equal(z[f], z2[f]) for f in z.files)
    old = tmp_path / "old.npz"  # the first format: [n_layers, 3] per side
    np.savez(old, k=np.stack([z["k3"], z["k4"], z["k5"]], 1), v=np.stack([z["v2"], z["v3"], z["v4"]], 1))
    back = kl.load_sens(old)
    assert all(np.array_equal(back["k"][b], z[f"k{b}"]) for b in (3, 4, 5))
    cal = tmp_path / "cal.jsonl"  # sensitivities from another text (the essays), the evaluation unchanged
    assert kl.main(["--model", str(path), "--tokens", "96", "--prefill", "32", "--window", "4",
                    "--budget", "3.0", "--calib-essays", "80", "--json", str(cal)]) == 0
    assert {r["calib_essays"] for r in map(json.loads, cal.read_text().splitlines())} == {80}
    rows = {r["arm"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(rows) == {"layers", "uniform k4v2", "uniform k3v3"}
    assert rows["layers"]["code_bits"] <= 3.0 + 16 / 32 + 1e-9
    assert rows["layers"]["predicted_kl"] <= min(r["predicted_kl"] for r in rows.values()) + 1e-12


def test_layer_windows_keep_the_exact_tokens(kl):
    sens = {"k": {4: np.array([1e-4, 4e-4, 1e-6, 9e-4])}, "v": {2: np.array([1e-4, 0.0, 1e-6, 0.0])}}
    alloc = [(4, 2)] * 4
    for alpha in (0.0, 0.5, 1.0):
        w = kl.layer_windows(sens, alloc, 10, alpha)
        assert sum(w) == 40 and min(w) >= 1
    assert kl.layer_windows(sens, alloc, 10, 0.0) == [10, 10, 10, 10]
    w = kl.layer_windows(sens, alloc, 10, 1.0)
    assert w[3] > w[1] > w[0] > w[2]  # in the order of the layers' costs (9e-4, 4e-4, 2e-4, 2e-6)


def test_one_window_everywhere_is_the_one_pass_engine(kl, tiny):
    model, tok, _ = tiny
    ids = np.asarray(tok.encode("the quick brown fox jumps over the lazy dog " * 8)[:80], dtype=np.int64)
    n_layers = model.config.n_layers
    kq = [kl.head_quantizer(4, None)] * n_layers
    vq = [kl.head_quantizer(2, None)] * n_layers
    ref = kl.simulate_logits(model, ids, 24, k_quant=kq, v_quant=vq, residual_length=6, sink_tokens=2)
    got = kl.simulate_layer_windows(model, ids, 24, kq, vq, [6] * n_layers, 2)
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()
    other = kl.simulate_layer_windows(model, ids, 24, kq, vq, [6, 20], 2)
    assert np.abs(other - ref).max() > 1e-4  # the second layer's window is read


def test_heads_quantizer_codes_only_the_named_heads(kl):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((1, 3, 20, 32)).astype(np.float32)
    y = kl.heads_quantizer([None, 3, None], None)(x)
    assert np.array_equal(y[:, 0], x[:, 0]) and np.array_equal(y[:, 2], x[:, 2])
    one = kl.head_quantizer(3, None)(np.ascontiguousarray(x[:, 1:2]))
    assert np.array_equal(y[:, 1:2], one) and not np.array_equal(y[:, 1], x[:, 1])


def test_per_head_script_on_the_tiny_model(kl, tiny_gguf, tmp_path):
    path, _ = tiny_gguf
    out, sens = tmp_path / "rows.jsonl", tmp_path / "sens.npz"
    assert kl.main(["--model", str(path), "--tokens", "96", "--prefill", "32", "--window", "4", "--per-head",
                    "--budget", "3.0", "--k-widths", "3,4", "--v-widths", "2,3", "--sens", str(sens),
                    "--json", str(out)]) == 0
    z = np.load(sens)
    assert sorted(z.files) == ["k3", "k4", "v2", "v3"] and z["k3"].shape == (2 * 2,)  # 2 layers x 2 KV heads
    rows = {r["arm"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(rows) == {"heads", "uniform k4v2", "uniform k3v3"} and len(rows["heads"]["alloc"]) == 4
    with pytest.raises(SystemExit):
        kl.main(["--model", str(path), "--per-head", "--window-alpha", "1"])


def test_code_option_picks_the_group_code_where_a_group_is_one_byte(kl, tiny_gguf, tmp_path, monkeypatch):
    import kv3_vq
    monkeypatch.setattr(kv3_vq, "SPHERE_VECTORS", 2_000)
    rng = np.random.default_rng(6)
    x = rng.standard_normal((1, 2, 30, 32)).astype(np.float32)
    mu = rng.standard_normal((2, 32)).astype(np.float32)
    monkeypatch.setattr(kl, "CODE", "vqb")
    vq4k = kv3_vq.vq_quantizer(kv3_vq.sphere_codebook(4, 2, 32)[0], mu)(x)
    vq2v = kv3_vq.vq_quantizer(kv3_vq.sphere_codebook(2, 4, 32)[0], None)(x)
    assert np.array_equal(kl.head_quantizer(4, mu)(x), vq4k)  # 4-bit keys: pairs, one byte each
    assert np.array_equal(kl.head_quantizer(2, None)(x), vq2v)  # 2-bit values: quads
    assert np.array_equal(kl.head_quantizer(3, mu)(x), kl._scalar_quantizer(3, mu)(x))  # 6-bit pairs: scalar
    monkeypatch.setattr(kl, "CODE", "vq")
    assert not np.array_equal(kl.head_quantizer(3, mu)(x), kl._scalar_quantizer(3, mu)(x))
    path, _ = tiny_gguf
    out = tmp_path / "rows.jsonl"
    assert kl.main(["--model", str(path), "--tokens", "96", "--prefill", "32", "--window", "4", "--per-head",
                    "--budget", "3.0", "--k-widths", "3,4", "--v-widths", "2,3", "--code", "vqb", "--norm8",
                    "--json", str(out)]) == 0
    rows = {r["arm"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert rows["uniform k4v2"]["code"] == "vqb" and rows["uniform k4v2"]["norm8"]
    assert rows["uniform k4v2"]["code_bits"] == pytest.approx(3.0 + 8 / 32)  # an 8-bit norm at d = 32
    monkeypatch.setattr(kl, "CODE", "head")
    monkeypatch.setattr(kl, "NORM8", False)


def test_alloc_overrides_are_the_caches_maps(kl):
    """An allocation as head_overrides / layer_overrides: units layer-major, base widths left out, and
    the map builds a cache whose heads have the allocated widths."""
    from numba_kv import make_cache

    alloc = [(4, 2), (3, 3), (4, 3), (4, 2), (3, 2), (4, 2)]  # 2 layers x 3 KV heads
    heads = kl.alloc_overrides(alloc, 3, True)
    assert heads == {"0": {"1": {"k_bits": 3, "v_bits": 3}, "2": {"k_bits": 4, "v_bits": 3}},
                     "1": {"1": {"k_bits": 3, "v_bits": 2}}}
    cache = make_cache("pqo-k4v2-head", num_layers=2, num_kv_heads=3, head_dim=64,
                       head_overrides={int(k): {int(h): o for h, o in v.items()} for k, v in heads.items()})
    got = [None] * 6
    for layer in range(2):
        for part, _, hs in cache.layer_pieces(layer):
            for h in hs:
                got[layer * 3 + h] = (part.k_bits, part.v_bits)
    assert got == alloc
    assert kl.alloc_overrides([(4, 2), (3, 3)], 3, False) == {"1": {"k_bits": 3, "v_bits": 3}}


def test_shipped_smollm2_calibration_is_the_allocation(kl):
    """``numba_kv/caches/calibrations/kv3-smollm2-135m.json`` is the mean-3.0 per-KV-head allocation of
    the sensitivities measured on another text (the essays; the table under benchmarks/results),
    and on SmolLM2's geometry it keeps ``kv3``'s mean width, so the preset's window is unchanged."""
    from numba_kv.caches.presets import resolve_preset

    sens = kl.load_sens(ROOT / "benchmarks/results/kv3-2026-11-27-round4-sens-smollm2-heads-essays-vqb8-w44.npz")
    alloc = kl.allocate(sens, 3.0)
    shipped = json.loads((ROOT / "numba_kv/caches/calibrations/kv3-smollm2-135m.json").read_text())
    assert kl.alloc_overrides(alloc, 3, True) == shipped
    assert len(alloc) == 90 and np.mean([(k + v) / 2 for k, v in alloc]) == 3.0
    heads = {int(k): {int(h): o for h, o in v.items()} for k, v in shipped.items()}
    plain = resolve_preset("kv3", num_layers=30, num_kv_heads=3, head_dim=64)[1]
    assert resolve_preset("kv3", num_layers=30, num_kv_heads=3, head_dim=64, head_overrides=heads)[1] == plain
