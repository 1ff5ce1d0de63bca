"""``benchmarks/kv3_transform.py`` (the ``kv3`` lever experiments): its Gaussian Lloyd–Max
tables against Max (1960), the bit allocation, the fitted transform code's round trip, the
fractional head code against the library's ``quantize_head`` at whole widths, and a run of the
script on the tiny model."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from numba_kv.ops.headquant import dequantize_head, quantize_head

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def kt():
    spec = importlib.util.spec_from_file_location("kv3_transform", ROOT / "benchmarks" / "kv3_transform.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gaussian_lloyd_max_matches_max_1960(kt):
    # J. Max, "Quantizing for minimum distortion", IRE Trans. IT-6 (1960), Table I: MSE of N(0, 1)
    for bits, mse in ((1, 0.3634), (2, 0.1175), (3, 0.03454), (4, 0.009497)):
        assert kt.DIST[bits] == pytest.approx(mse, rel=2e-3), bits
    c, b, _ = kt._LM[1]
    assert c == pytest.approx([-np.sqrt(2 / np.pi), np.sqrt(2 / np.pi)], abs=1e-4)  # ±E|X|
    assert np.all(np.diff(kt.DIST) < 0)


def test_allocate(kt):
    w = np.array([100.0, 10.0, 1.0, 0.1])
    bits = kt.allocate(w, 2.0)
    assert bits.sum() == 8 and np.all(np.diff(bits) <= 0) and bits[0] > bits[-1]
    assert kt.allocate(np.ones(8), 3.0).tolist() == [3] * 8
    assert kt.allocate(w, 2.0, min_bits=1).min() >= 1
    # reverse water-filling: 4x the variance (6 dB) is worth one more bit at high rate, so 64x
    # is worth 3 (integer bits and Lloyd-Max's distortion off the 6 dB/bit line: 3 or 4)
    b = kt.allocate(np.array([4.0 ** 3, 1.0]), 4.0)
    assert b.sum() == 8 and b[0] - b[1] in (3, 4)


def test_klt_roundtrip(kt):
    rng = np.random.default_rng(0)
    d, n = 128, 4000
    q, _ = np.linalg.qr(rng.standard_normal((d, d)))
    sigma = np.geomspace(2.0, 0.5, d)
    x = (rng.standard_normal((n, d)) * sigma) @ q.T
    bits = kt.allocate(sigma ** 2, 3.0)
    err = x - kt.klt_roundtrip(x, q, sigma, bits)
    # per coordinate: ≈ σ_i² D(b_i) (the per-row scale, ‖y‖ / ‖σ‖, adds a little)
    per = ((err @ q) ** 2).mean(0) / sigma ** 2
    assert per == pytest.approx(kt.DIST[bits], rel=0.15)
    unb = kt.klt_roundtrip(x, q, sigma, bits, eden=True)
    assert abs(np.mean((unb * x).sum(1) / (x * x).sum(1)) - 1) < 1e-3  # unbiased along the row


def test_split_head_code_equals_the_library_at_whole_widths(kt):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 2, 50, 64)).astype(np.float32)
    for bits in (2, 3, 4):
        codes, norms = quantize_head(x, bits, unbiased=True)
        lib = np.asarray(dequantize_head(codes, norms, bits))
        ours = kt.split_head_quantizer(float(bits), None)(x)
        assert np.abs(ours - lib).max() <= 2e-3 * np.abs(lib).max(), bits
    half = kt.split_head_quantizer(2.5, None)(x)
    e2, e25, e3 = (np.mean((f - x) ** 2) for f in (kt.split_head_quantizer(2.0, None)(x), half,
                                                  kt.split_head_quantizer(3.0, None)(x)))
    assert e3 < e25 < e2


def test_script_on_the_tiny_model(kt, tiny_gguf, tmp_path, capsys):
    path, _ = tiny_gguf
    out = tmp_path / "rows.jsonl"
    assert kt.main(["--model", str(path), "--tokens", "96", "--prefill", "32", "--window", "4", "--arms",
                    "head:4:2,split:4:2,split8:4:2.5,klt:4:2,hk:4:2", "--eden", "--json", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["arm"] for r in rows] == ["head:4:2", "split:4:2", "split8:4:2.5", "klt:4:2", "hk:4:2"]
    head, split = rows[0], rows[1]
    assert head["kl_mean"] > 0 and split["kl_mean"] == pytest.approx(head["kl_mean"], rel=0.2)
    assert rows[2]["code_bits"] == pytest.approx(3.25 + 8 / 32)  # d = 32: an 8-bit norm is 0.25 bit
    assert "top-1" in capsys.readouterr().out


def test_pair_side_keeps_rope_pairs_and_the_budget(kt, tiny):
    model, tok, _ = tiny
    ids = np.asarray(tok.encode("the quick brown fox jumps over the lazy dog " * 6)[:64], dtype=np.int64)
    fit = kt.Fit(model, ids, 32, False)
    d = model.config.head_dim
    for _mu, basis, sigma, bits in fit.pair_side(0, 3.0):
        assert np.array_equal(basis, np.eye(d))
        assert bits.sum() == 3 * d  # the budget, in whole bits
        assert np.array_equal(bits[0::2], bits[1::2]) and np.array_equal(sigma[0::2], sigma[1::2])
    mu0, _, sig0, _ = fit.pair_side(0, 3.0)[0]
    assert mu0 == pytest.approx(fit.k[0][0].mean(0))
    xc = fit.k[0][0] - fit.k[0][0].mean(0)
    assert sig0[:2] == pytest.approx(np.sqrt((xc[:, :2] ** 2).mean())), "σ of a pair: RMS over both coordinates"


def test_group_code_error_falls_with_width(kt, tiny):
    model, tok, _ = tiny
    ids = np.asarray(tok.encode("the quick brown fox jumps over the lazy dog " * 6)[:64], dtype=np.int64)
    fit = kt.Fit(model, ids, 64, True)
    x = np.stack(fit.k[1])[None].astype(np.float32)
    err = [np.mean((kt.group_quantizer(fit, 1, b, (16, 16))(x) - x) ** 2) for b in (2.0, 3.0, 4.0)]
    assert err[0] > err[1] > err[2] > 0
    # each width step cuts the error by about the Gaussian Lloyd-Max ratio (D(b+1)/D(b) ≈ 0.29-0.33)
    assert 0.15 < err[2] / err[1] < 0.5


def test_script_new_arms_on_the_tiny_model(kt, tiny_gguf, tmp_path):
    path, _ = tiny_gguf
    out = tmp_path / "rows.jsonl"
    assert kt.main(["--model", str(path), "--tokens", "96", "--prefill", "32", "--window", "4", "--arms",
                    "head:x:2,head:4:x,head:x:x,pair:4:2,grp16-16:4:2", "--json", str(out)]) == 0
    rows = {r["arm"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert rows["head:x:x"]["kl_mean"] == pytest.approx(0.0, abs=1e-9)  # nothing quantized: the reference
    assert rows["head:x:2"]["kl_mean"] > 0 and rows["head:4:x"]["kl_mean"] > 0
    assert rows["head:x:2"]["code_bits"] == pytest.approx((32 + 2 + 16 / 32) / 2)
    assert rows["pair:4:2"]["code_bits"] == rows["grp16-16:4:2"]["code_bits"] == pytest.approx(3.0 + 16 / 32)
