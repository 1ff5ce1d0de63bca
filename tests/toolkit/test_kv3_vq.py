"""``benchmarks/kv3_vq.py`` (vector quantization of the rotated coordinates, issue 29): the
product codebook against the library's scalar codebook, Lloyd's conditions and the gain of a
2-D code over the scalar one on a fresh sample, the round trip against the library's
``quantize_head``, and a run of the script on the tiny model."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from numba_kv.ops.headquant import dequantize_head, head_codebook, quantize_head

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def vq():
    spec = importlib.util.spec_from_file_location("kv3_vq", ROOT / "benchmarks" / "kv3_vq.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.SPHERE_VECTORS = 4_000  # small fits: seconds, not minutes
    return mod


def test_product_codebook(vq):
    c = np.asarray(head_codebook(2, 64).centroids) * 8.0
    p = vq.product_codebook(2, 2, 64)
    assert p.shape == (16, 2)
    assert sorted(map(tuple, p)) == sorted((a, b) for a in c for b in c)


def test_kmeans_lloyd_conditions_and_gain(vq):
    x = vq.sphere_groups(64, 2, 4_000, seed=3)
    init = vq.product_codebook(2, 2, 64)
    cb, mse = vq.kmeans(x, init)
    idx = vq.nearest(x, cb)
    # centroid condition: every point is (after the last step, nearly) the mean of its cell
    for j in range(cb.shape[0]):
        cell = x[idx == j]
        assert cell.size and np.abs(cell.mean(0) - cb[j]).max() < 0.02
    # nearest-neighbour condition, brute force
    d2 = ((x[:500, None, :] - cb[None]) ** 2).sum(-1)
    assert np.array_equal(np.argmin(d2, 1), idx[:500])
    # on a fresh sample the 2-D code beats the scalar (product) code by ≥ 0.25 dB at 2 bits;
    # the scalar code's MSE is near Max's (1960) 0.1175 for N(0, 1) (the sphere's marginal at
    # d = 64 is a little lighter-tailed)
    y = vq.sphere_groups(64, 2, 4_000, seed=4)
    e_scalar = ((y - init[vq.nearest(y, init)]) ** 2).mean()
    e_vq = ((y - cb[vq.nearest(y, cb)]) ** 2).mean()
    assert e_scalar == pytest.approx(0.1175, rel=0.05)
    assert 10 * np.log10(e_scalar / e_vq) > 0.25


def test_round_trip_with_the_product_codebook_is_the_library_head_code(vq):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 2, 50, 64)).astype(np.float32)
    mu = rng.standard_normal((2, 64)).astype(np.float32)
    for bits in (2, 4):
        codes, norms = quantize_head(x - mu[None, :, None, :], bits, unbiased=True)
        lib = np.asarray(dequantize_head(codes, norms, bits)) + mu[None, :, None, :]
        ours = vq.vq_quantizer(vq.product_codebook(bits, 2, 64), mu)(x)
        assert np.abs(ours - lib).max() <= 2e-3 * np.abs(lib).max(), bits
    # and a fitted 2-D code is closer to the input than the scalar one
    e_vq = np.mean((vq.vq_quantizer(vq.sphere_codebook(2, 2, 64)[0], None)(x) - x) ** 2)
    e_sc = np.mean((vq.vq_quantizer(vq.product_codebook(2, 2, 64), None)(x) - x) ** 2)
    assert e_vq < e_sc


def test_group_sizes(vq):
    assert vq.group_sizes("head") == (0, 0)
    assert vq.group_sizes("vq4") == (0, 4)
    assert vq.group_sizes("vq2-4") == (2, 4)
    assert vq.group_sizes("fit1") == (1, 1)
    assert vq.group_sizes("fit2-4") == (2, 4)


def test_script_on_the_tiny_model(vq, tiny_gguf, tmp_path, capsys):
    path, _ = tiny_gguf
    out = tmp_path / "rows.jsonl"
    assert vq.main(["--model", str(path), "--tokens", "96", "--prefill", "32", "--window", "4", "--arms",
                    "head:4:2,vq2:4:2,vq2-2:x:2,fit1:4:2,fit2:4:2", "--json", str(out)]) == 0
    rows = {r["arm"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert list(rows) == ["head:4:2", "vq2:4:2", "vq2-2:x:2", "fit1:4:2", "fit2:4:2"]
    assert all(r["kl_mean"] > 0 for r in rows.values())
    assert rows["vq2:4:2"]["kl_mean"] != rows["head:4:2"]["kl_mean"]  # another value code
    assert rows["fit2:4:2"]["code_bits"] == pytest.approx(3.0 + 16 / 32)
    assert rows["vq2-2:x:2"]["code_bits"] == pytest.approx((32 + 2 + 16 / 32) / 2)
    assert "top-1" in capsys.readouterr().out


def test_the_usage_line_runs_and_an_oversized_codebook_is_refused_before_the_model_loads(vq, monkeypatch):
    """The docstring's usage line named ``fit4:4:2``: 4-bit keys in groups of 4, a 2^16-point
    codebook whose all-pairs search asked for 32 GiB.  Its arms must fit; that one is refused
    by name before anything loads."""
    usage = vq.__doc__.split("Usage::")[1]
    arms = usage.split("--arms ")[1].split()[0]
    for arm in arms.split(","):
        kind, kb, vb = arm.split(":")
        assert all(m <= 1 or int(w) * m <= vq.MAX_CODEBOOK_BITS for m, w in zip(vq.group_sizes(kind), (kb, vb))), arm
    monkeypatch.setattr(vq.models, "load_model", lambda *a: pytest.fail("loaded the model"))
    with pytest.raises(SystemExit) as e:
        vq.main(["--arms", "head:4:2,fit4:4:2"])
    assert e.value.code == 2
