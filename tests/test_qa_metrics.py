"""QA of ``numba_kv.metrics`` and of the ``numba_kv.reference`` oracles, against plain Python /
NumPy written here from the definitions (never from the code under test).

* ``top_k_indices`` on NaN rows (``compare_logits`` of a cache that produced NaN logits
  crashed with a broadcast error) and on unsigned / bool input (``-x`` wrapped);
* ``kl_rows`` returns float64 for float16/float32 log-probabilities, as documented;
* ``compare_logits``'s ``top_k`` is checked (0, negatives and floats were silently changed);
* ``LogitScorer`` accepts a list of rows like ``compare_logits``;
* the oracles: attention against a loop, bit packing against a bit stream, the head signs
  against SplitMix64's published first output.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import numba_kv.reference as R
from numba_kv.metrics import LogitScorer, compare_logits, kl_rows, log_softmax, top_k_indices


def _rank(row: list[float], k: int) -> list[int]:
    """Top-k ids of one row by the documented rule: NaN first (by id), then by decreasing value, ties by id."""
    return sorted(range(len(row)), key=lambda j: (not np.isnan(row[j]), -row[j] if not np.isnan(row[j]) else 0.0,
                                                   j))[:k]


# -- top_k_indices ------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_top_k_indices_ranks_nan_first_like_argmax(k):
    x = np.array([[1.0, np.nan, 2.0, 0.5, np.nan],   # two NaNs: ids 1 then 4
                  [np.nan] * 5,                        # all NaN: ids in order
                  [0.3, 0.1, np.inf, np.nan, -np.inf],
                  [4.0, 1.0, 4.0, 2.0, 3.0]])          # no NaN, a tie
    want = np.array([_rank(r, k) for r in x.tolist()])
    np.testing.assert_array_equal(top_k_indices(x, k), want)
    if k == 1:
        np.testing.assert_array_equal(top_k_indices(x, 1)[:, 0], x.argmax(-1))


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.int8, np.bool_])
def test_top_k_indices_integer_and_bool_input(dtype):
    x = np.array([[0, 1, 2, 1], [1, 0, 0, 1]]).astype(dtype)
    want = np.array([_rank([float(v) for v in r], 2) for r in x.tolist()])
    np.testing.assert_array_equal(top_k_indices(x, 2), want)


def test_compare_logits_with_nan_logits_reports_nan_instead_of_crashing():
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((4, 10))
    est = ref + 0.1 * rng.standard_normal(ref.shape)
    est[1] = np.nan      # a whole row
    est[2, :3] = np.nan  # NaNs among the top 5: the k-th value is NaN
    t = np.array([0, 1, 2, 3])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m = compare_logits(ref, est, t, chunk=3)
    assert np.isnan(m["kl_mean"]) and np.isnan(m["ppl"]) and np.isnan(m["kl_max"])
    assert m["ppl_ref"] == pytest.approx(float(np.exp(-np.mean(
        [r[j] - np.log(np.exp(r).sum()) for r, j in zip(ref, t)]))), rel=1e-12)
    overlap = [len(set(_rank(a, 5)) & set(_rank(b, 5))) / 5 for a, b in zip(ref.tolist(), est.tolist())]
    assert m["top5_overlap"] == pytest.approx(np.mean(overlap), rel=1e-15)
    assert m["top1_agreement"] == np.mean([_rank(a, 1) == _rank(b, 1) for a, b in zip(ref.tolist(), est.tolist())])


# -- kl_rows dtype ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_kl_rows_is_float64_for_narrow_inputs(dtype):
    rng = np.random.default_rng(2)
    lp = log_softmax(rng.standard_normal((3, 50))).astype(dtype)
    lq = log_softmax(rng.standard_normal((3, 50))).astype(dtype)
    got = kl_rows(lp, lq)
    p64, q64 = lp.astype(np.float64), lq.astype(np.float64)
    want = [sum(np.exp(a) * (a - b) for a, b in zip(pr, qr)) for pr, qr in zip(p64.tolist(), q64.tolist())]
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)


# -- compare_logits top_k, LogitScorer input -----------------------------------------------------
@pytest.mark.parametrize("top_k", [0, -3, 2.7, "5", None, True])
def test_compare_logits_rejects_a_bad_top_k(top_k):
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((6, 8))
    with pytest.raises(ValueError, match=r"top_k: expected an int >= 1"):
        compare_logits(ref, ref + 0.1, np.zeros(6, np.int64), top_k=top_k)


@pytest.mark.parametrize("top_k", [1, 3, np.int64(3), 8, 100])
def test_compare_logits_valid_top_k(top_k):
    rng = np.random.default_rng(1)
    ref = rng.standard_normal((6, 8))
    est = ref + 0.5 * rng.standard_normal(ref.shape)
    k = min(int(top_k), 8)
    want = np.mean([len(set(_rank(a, k)) & set(_rank(b, k))) / k for a, b in zip(ref.tolist(), est.tolist())])
    assert compare_logits(ref, est, np.zeros(6, np.int64), top_k=top_k)["top5_overlap"] == pytest.approx(want,
                                                                                                        rel=1e-15)


def test_logit_scorer_accepts_a_list_of_rows():
    rng = np.random.default_rng(3)
    ref = rng.standard_normal((5, 7))
    est = ref + 0.2 * rng.standard_normal(ref.shape)
    t = np.arange(5)
    got = LogitScorer(ref.tolist(), t)(est)
    assert got == LogitScorer(ref, t)(est)
    want_ppl_ref = float(np.exp(-np.mean([r[j] - np.log(np.exp(r).sum()) for r, j in zip(ref, t)])))
    assert got["ppl_ref"] == pytest.approx(want_ppl_ref, rel=1e-12)


# -- the oracles against their definitions -------------------------------------------------------
def test_reference_attention_matches_a_loop():
    """Contiguous GQA (head h reads KV head h // g), additive bias after the scale, causal offset."""
    rng = np.random.default_rng(4)
    b, hq, hkv, ql, T, d, scale, off = 2, 6, 2, 3, 7, 8, 0.3, 4
    q, bias = rng.standard_normal((b, hq, ql, d)), rng.standard_normal((b, hq, ql, T))
    k, v = rng.standard_normal((b, hkv, T, d)), rng.standard_normal((b, hkv, T, d))
    got = R.attention(q, k, v, scale, bias, causal_offset=off)
    for bi in range(b):
        for h in range(hq):
            kv = h // (hq // hkv)
            for i in range(ql):
                seen = range(off + i + 1)
                logit = [scale * float(q[bi, h, i] @ k[bi, kv, t]) + bias[bi, h, i, t] for t in seen]
                w = np.exp(np.array(logit) - max(logit))
                want = sum(w[t] * v[bi, kv, t] for t in seen) / w.sum()
                np.testing.assert_allclose(got[bi, h, i], want, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_reference_pack_bits_is_an_lsb_first_bit_stream(bits):
    idx = np.random.default_rng(bits).integers(0, 1 << bits, (3, 32)).astype(np.uint8)
    stream = [[(int(x) >> j) & 1 for x in row for j in range(bits)] for row in idx]
    want = np.array([[sum(s[8 * n + j] << j for j in range(8)) for n in range(len(s) // 8)] for s in stream])
    np.testing.assert_array_equal(R.pack_bits(idx, bits), want)
    np.testing.assert_array_equal(R.unpack_bits(want.astype(np.uint8), bits), idx)


def _splitmix64(seed: int, n: int) -> list[int]:
    """SplitMix64 (Steele, Lea, Flood 2014; Vigna's C reference), ``n`` outputs."""
    out, m = [], (1 << 64) - 1
    for _ in range(n):
        seed = (seed + 0x9E3779B97F4A7C15) & m
        z = seed
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
        out.append(z ^ (z >> 31))
    return out


@pytest.mark.parametrize("d, seed", [(64, 42), (128, 42), (256, 7)])
def test_reference_head_signs_are_splitmix64(d, seed):
    assert _splitmix64(0, 1) == [0xE220A8397B1DCDAF]  # the published first output for seed 0
    want = [-1.0 if z >> 63 else 1.0 for z in _splitmix64(seed, d)]
    np.testing.assert_array_equal(R.head_sign_vector(d, seed), want)
    np.testing.assert_array_equal(R.head_sign_vector(32), [-1.0 if (0xB1A6D4B2 >> j) & 1 else 1.0 for j in range(32)])
