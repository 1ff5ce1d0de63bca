"""``benchmarks/preset_sweep.py`` on the tiny random model: rows written, the dense reference
kept and reused, trial presets sized to their budget."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from numba_kv import info as env_info
from numba_kv.caches import presets

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def sweep():
    spec = importlib.util.spec_from_file_location("preset_sweep", ROOT / "benchmarks" / "preset_sweep.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    before = dict(presets.PRESETS)
    yield mod
    presets.PRESETS.clear()  # trial presets stay in this test (the table is shared by reference)
    presets.PRESETS.update(before)


def test_sweep_rows_reference_and_trial_preset(sweep, tiny_gguf, tmp_path):
    path, _ = tiny_gguf
    out, ref_dir = tmp_path / "rows.jsonl", tmp_path / "ref"
    trial = json.dumps({"name": "pqo-k4v3-head-eden", "options": {"key_center": True, "window_dtype": "int8",
                                                                   "layer_overrides": {"-1": {"v_bits": 4}},
                                                                   "head_overrides": {"0": {"-1": {"k_bits": 3}}}},
                        "budget": 5.0, "sink_tokens": 2})
    args = ["--model", str(path), "--tokens", "48", "--prefill", "8", "--out", str(out), "--ref-dir", str(ref_dir)]
    assert sweep.main([*args, "p3=pqo3-r4-s2", f"trial={trial}"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["label"] for r in rows] == ["dense", "p3", "trial"]
    assert rows[0]["ppl_change_pct"] == 0 and rows[0]["top1_agreement"] == 1
    assert rows[1]["cache_name"] == "pqo3-r4-s2"
    for key in ("llvm_host_cpu", "codegen_target", "threads", "numba"):  # the row's provenance
        assert rows[1]["env"][key] == env_info.collect()[key]
    assert 0 < rows[1]["top1_agreement"] <= 1 and rows[1]["kl_mean"] > 0
    # the trial preset: registered with its overrides, the last layer's values 4-bit
    assert presets.PRESETS["trial"].layer_overrides == {-1: {"v_bits": 4}}
    assert presets.PRESETS["trial"].head_overrides == {0: {-1: {"k_bits": 3}}}
    assert presets.PRESETS["trial"].budget == 5.0 and presets.PRESETS["trial"].sink_tokens == 2
    name = rows[2]["cache_name"]
    assert name.startswith("mixed[pqo-k4v3-head-eden") and "pqo4-head-eden" in name
    assert "{0}+pqo3-head-eden" in name  # layer 0's last KV head with 3-bit keys (head_overrides)
    assert (ref_dir / f"{path.stem}-48-8.npy").exists()
    # second run: the dense pass is read back, not repeated; same scores for the same cache
    assert sweep.main([*args, "p3=pqo3-r4-s2"]) == 0
    again = [json.loads(line) for line in out.read_text().splitlines()][3:]
    assert [r["label"] for r in again] == ["p3"]
    assert again[0]["kl_mean"] == pytest.approx(rows[1]["kl_mean"], rel=1e-6)
    assert again[0]["ppl"] == pytest.approx(rows[1]["ppl"], rel=1e-6)
