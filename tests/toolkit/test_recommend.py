"""The measured recommendation table (`numba_kv.toolkit.recommend`, `numba-kv bench modes`): a tiny run."""

import json
import math

import numpy as np
import pytest

from numba_kv.toolkit import recommend
from numba_kv.toolkit.cli import main

MODES = ["pqo3", "pqo2", "tq3", "pqo3-eden"]


@pytest.fixture(scope="module")
def rows():
    pytest.importorskip("faiss")
    return recommend.run(MODES, T=256, faiss_specs=["HR,EDEN3"], num_kv_heads=8, queries_per_head=64)


def _by_mode(rows):
    return {r["mode"]: r for r in rows}


def test_schema(rows):
    assert [r["mode"] for r in rows] == MODES + ["faiss HR,EDEN3"]
    keys = {"bits_k", "bits_v", "bits_avg", "nmse_k", "nmse_v", "slope", "slope_raw", "top1"}
    for s in ("s1", "s3"):
        keys |= {f"logit_err_std_{s}", f"kl_{s}", f"out_err_{s}"}
    for r in rows:
        assert r["error"] is None, r
        assert keys <= set(r), keys - set(r)
        assert all(math.isfinite(r[k]) for k in keys), r
        assert 0.0 <= r["top1"] <= 1.0
        assert r["kl_s1"] >= 0 and r["kl_s3"] > r["kl_s1"]
        assert r["logit_err_std_s3"] == pytest.approx(3 * r["logit_err_std_s1"])
    json.dumps(recommend.to_json(rows, {"T": 256}))


def test_bits_and_slopes(rows):
    by = _by_mode(rows)
    pqo3 = by["pqo3"]
    assert (pqo3["bits_k"], pqo3["bits_v"], pqo3["bits_avg"]) == (3.5, 3.5, 3.5)
    assert pqo3["bits_measured"] == pytest.approx(3.5)
    assert by["tq3"]["bits_avg"] == pytest.approx(3.5625)
    assert 0.95 <= by["tq3"]["slope"] <= 1.05  # QJL: unbiased
    assert 0.97 <= by["pqo3-eden"]["slope"] <= 1.03  # unbiased rescale
    assert by["pqo2"]["slope"] < 0.93  # MSE-only 2-bit: visibly shrunk
    # 3 bits beat 2 bits; QJL (2-bit base + sketch) has more logit error than MSE-only 3-bit
    assert by["pqo3"]["kl_s1"] < by["pqo2"]["kl_s1"]
    assert by["pqo3"]["logit_err_std_s1"] < by["tq3"]["logit_err_std_s1"]


def test_faiss_row(rows):
    f = _by_mode(rows)["faiss HR,EDEN3"]
    assert f["source"] == "faiss" and f["bits_avg"] == pytest.approx(3.5)
    assert 0.97 <= f["slope"] <= 1.03


def test_markdown(rows):
    md = recommend.to_markdown(rows + [{"mode": "bad", "error": "ValueError: x | y"}])
    lines = md.strip().splitlines()
    assert len(lines) == 2 + len(rows) + 1
    ncol = lines[0].count("|")
    assert all(line.count("|") == ncol for line in lines)
    assert "| pqo3 | 3.500 | 3.500 | 3.500 |" in md and "faiss HR,EDEN3" in md


def test_bad_mode_is_reported_not_raised():
    (row,) = recommend.run(["pqo9"], T=64, faiss_specs=None, num_kv_heads=1, queries_per_head=2)
    assert row["error"].startswith("ValueError") and "slope" not in row


def test_synthetic_data_model():
    d = recommend.synthetic_kv(T=512, num_kv_heads=2, queries_per_head=8, seed=3)
    logits = np.einsum("hgd,htd->hgt", d.q.astype(np.float64), d.k) / np.sqrt(128)
    np.testing.assert_allclose(logits.std(axis=2), 1.0, rtol=1e-4)
    rms = np.sqrt((d.k.astype(np.float64) ** 2).mean(axis=1))  # [H, d]
    for h in range(2):
        out = d.outliers[h]
        assert len(out) == 4 and rms[h, out].min() > 4 * np.median(rms[h])
    again = recommend.synthetic_kv(T=512, num_kv_heads=2, queries_per_head=8, seed=3)
    np.testing.assert_array_equal(d.k, again.k)


def test_cli_bench_modes(tmp_path, capsys):
    js, md = tmp_path / "r.json", tmp_path / "r.md"
    assert main(["bench", "modes", "--tokens", "64", "--modes", "pqo3", "--faiss", "", "--json", str(js),
                 "--markdown", str(md), "--no-progress"]) == 0
    doc = json.loads(js.read_text())
    assert doc["config"]["tokens"] == 64 and [r["mode"] for r in doc["rows"]] == ["pqo3"]
    assert md.read_text().startswith("| mode |")
    assert "pqo3" in capsys.readouterr().out
