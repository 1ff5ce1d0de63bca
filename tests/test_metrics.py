"""``numba_kv.metrics``: argument checks and the edge cases of the formulas (masked / zero
entries), against plain NumPy formulas written here.  The statistics of ``compare_logits`` on
ordinary logits are tested in ``tests/toolkit/evaluation/test_eval.py``."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from numba_kv.metrics import LogitScorer, compare_logits, kl_rows, log_softmax, nmse, top1_agreement, top_k_indices


def _logits(n: int = 20, vocab: int = 10, seed: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    ref = rng.standard_normal((n, vocab))
    return ref, ref + 0.1 * rng.standard_normal((n, vocab)), rng.integers(0, vocab, n)


def _kl_direct(ref: np.ndarray, cur: np.ndarray) -> np.ndarray:
    """Per-row KL(softmax(ref) ‖ softmax(cur)) summed over the entries with p > 0 only."""
    out = []
    for r, c in zip(ref, cur):
        p = np.exp(r - r.max())
        p /= p.sum()
        q = np.exp(c - c.max())
        q /= q.sum()
        keep = p > 0
        out.append(float(np.sum(p[keep] * np.log(p[keep] / q[keep]))))
    return np.array(out)


# -- chunk (F1) --------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk", [0, -1, -128, 2.0, True, "4", None])
def test_bad_chunk_is_rejected(chunk):
    ref, est, t = _logits()
    with pytest.raises(ValueError, match="chunk: expected an int >= 1"):
        compare_logits(ref, est, t, chunk=chunk)
    with pytest.raises(ValueError, match="chunk: expected an int >= 1"):
        LogitScorer(ref, t, chunk=chunk)


@pytest.mark.parametrize("chunk", [1, 3, np.int64(7), 10_000])
def test_valid_chunks_give_the_same_statistics(chunk):
    ref, est, t = _logits()
    want = compare_logits(ref, est, t)
    got = compare_logits(ref, est, t, chunk=chunk)
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-12, abs=1e-15, nan_ok=True), key
    scored = LogitScorer(ref, t, chunk=chunk)(est)
    assert scored["ppl"] == pytest.approx(want["ppl"], rel=1e-12)
    assert scored["kl_mean"] == pytest.approx(want["kl_mean"], rel=1e-12)


# -- targets (F2) ------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [-100, -1, 200, 201])
def test_targets_out_of_range_are_rejected(bad):
    ref, est, t = _logits(vocab=200)
    t = t.copy()
    t[3] = bad
    with pytest.raises(ValueError, match=r"targets: .*\[0, 200\)"):
        compare_logits(ref, est, t)
    with pytest.raises(ValueError, match=r"targets: .*\[0, 200\)"):
        LogitScorer(ref, t)


@pytest.mark.parametrize("targets", [np.zeros(20), np.zeros(20, dtype=bool)])
def test_non_integer_targets_are_rejected(targets):
    ref, est, _ = _logits()
    with pytest.raises(ValueError, match="targets"):
        compare_logits(ref, est, targets)
    with pytest.raises(ValueError, match="targets"):
        LogitScorer(ref, targets)


def test_targets_at_the_edges_of_the_vocabulary_are_scored():
    ref, est, _ = _logits(vocab=10)
    t = np.array([0, 9] * 10, dtype=np.uint16)
    lp = ref - np.log(np.exp(ref).sum(-1, keepdims=True))
    want = float(np.exp(-lp[np.arange(20), t.astype(np.int64)].mean()))
    assert compare_logits(ref, est, t)["ppl_ref"] == pytest.approx(want, rel=1e-12)
    assert LogitScorer(ref, t)(est)["ppl_ref"] == pytest.approx(want, rel=1e-12)


# -- nmse (F3, F4) -----------------------------------------------------------------------------
def test_nmse_zero_vector_counts_its_absolute_error():
    x, x_hat = np.zeros((1, 3)), np.ones((1, 3))
    assert nmse(x, x_hat) == pytest.approx(3.0)
    rng = np.random.default_rng(0)
    X = rng.standard_normal((1000, 64))
    Xh = X + 0.01 * rng.standard_normal(X.shape)
    X[0], Xh[0] = 0.0, 1e-3
    ratios = np.sum((X[1:] - Xh[1:]) ** 2, -1) / np.sum(X[1:] ** 2, -1)
    zero_err = np.sum((X[0] - Xh[0]) ** 2)  # the zero vector: absolute squared error 64e-6
    assert nmse(X, Xh) == pytest.approx((ratios.sum() + zero_err) / 1000, rel=1e-12)
    assert nmse(X[:1], Xh[:1]) == pytest.approx(64e-6, rel=1e-12)


def test_nmse_eps_is_a_threshold_and_ordinary_vectors_are_unchanged():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 5, 8))
    x_hat = x + 0.1 * rng.standard_normal(x.shape)
    want = np.sum((x - x_hat) ** 2, -1) / np.sum(x ** 2, -1)
    np.testing.assert_array_equal(nmse(x, x_hat, axis=None), want.mean())
    np.testing.assert_array_equal(nmse(x, x_hat, axis=1), want.mean(axis=1))
    small = np.array([[1e-3, 0.0]])  # ‖x‖² = 1e-6
    assert nmse(small, small + 1.0, eps=1e-5) == pytest.approx(np.sum(((small + 1.0) - small) ** 2))
    assert nmse(small, small + 1.0, eps=1e-7) == pytest.approx(2.0 / 1e-6)


@pytest.mark.parametrize("shape", [(10, 1, 8), (1, 8), (10, 4), (8,)])
def test_nmse_rejects_a_mismatched_shape(shape):
    x = np.ones((10, 8))
    with pytest.raises(ValueError, match="x_hat"):
        nmse(x, np.ones(shape))


# -- top1_agreement (F4) -----------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(1, 10), (20, 1), (20, 10, 1)])
def test_top1_agreement_rejects_a_mismatched_shape(shape):
    ref = np.random.default_rng(0).standard_normal((20, 10))
    with pytest.raises(ValueError, match="est"):
        top1_agreement(ref, np.zeros(shape))


def test_top1_agreement_counts_rows():
    ref = np.random.default_rng(0).standard_normal((20, 10))
    est = ref.copy()
    est[:5] = -est[:5]
    want = np.mean(ref.argmax(-1) == est.argmax(-1))
    assert top1_agreement(ref, est) == want
    assert top1_agreement(ref.T, est.T, axis=0) == want


# -- kl_rows with zero probabilities (F5) ------------------------------------------------------
def test_kl_rows_zero_reference_entries_contribute_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "invalid value" RuntimeWarning either
        got = kl_rows(log_softmax([0.0, -np.inf]), log_softmax([0.0, 0.0]))
        assert got == pytest.approx(np.log(2.0), rel=1e-15)
        both = log_softmax([[0.0, -np.inf, 1.0]])
        assert kl_rows(both, both)[0] == 0.0
    # p > 0 where q == 0: +inf, as the formula says
    assert kl_rows(log_softmax([0.0, 0.0]), log_softmax([0.0, -np.inf])) == np.inf
    # p underflows to 0.0 (log p = -800 is finite) where q == 0: still +inf
    assert kl_rows(np.array([0.0, -800.0]), np.array([0.0, -np.inf])) == np.inf
    # a NaN in the estimate stays NaN, even against p == 0
    assert np.isnan(kl_rows(log_softmax([0.0, -np.inf]), np.array([0.0, np.nan])))


def test_kl_rows_masked_matches_direct_formula():
    rng = np.random.default_rng(5)
    s = rng.standard_normal((6, 9))
    sh = s + 0.3 * rng.standard_normal(s.shape)
    causal = np.tril(np.ones((6, 9), dtype=bool), k=3)
    s[~causal], sh[~causal] = -np.inf, -np.inf
    want = _kl_direct(s, sh)
    np.testing.assert_allclose(kl_rows(log_softmax(s), log_softmax(sh), causal), want, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(kl_rows(log_softmax(s), log_softmax(sh)), want, rtol=1e-12, atol=1e-15)
    s2 = s.copy()
    s2[:, 0] = -np.inf  # p == 0 where q > 0
    np.testing.assert_allclose(kl_rows(log_softmax(s2), log_softmax(sh)), _kl_direct(s2, sh), rtol=1e-12,
                               atol=1e-15)


def test_compare_logits_kl_with_a_masked_reference_entry():
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((8, 16))
    ref[:, 3] = -np.inf
    est = ref + 0.2 * rng.standard_normal(ref.shape)
    est[:, 3] = rng.standard_normal(8)  # the estimate does not mask it
    t = np.zeros(8, dtype=np.int64)
    same = compare_logits(ref, ref.copy(), t)
    assert same["kl_mean"] == 0.0 and same["kl_max"] == 0.0
    m = compare_logits(ref, est, t, chunk=3)
    kl = np.maximum(_kl_direct(ref, est), 0.0)
    assert m["kl_mean"] == pytest.approx(kl.mean(), rel=1e-12)
    assert m["kl_max"] == pytest.approx(kl.max(), rel=1e-12)
    assert m["kl_p99"] == pytest.approx(np.percentile(kl, 99), rel=1e-12)
    scored = LogitScorer(ref, t, chunk=3)(est)
    assert scored["kl_mean"] == m["kl_mean"] and scored["kl_max"] == m["kl_max"]


# -- top_k_indices (F9) ------------------------------------------------------------------------
@pytest.mark.parametrize("k", [0, -2, 6, 2.0, True])
def test_top_k_indices_rejects_bad_k(k):
    x = np.random.default_rng(0).standard_normal((3, 5))
    with pytest.raises(ValueError, match=r"k: expected an int in \[1, vocab\]"):
        top_k_indices(x, k)


def test_top_k_indices_rejects_non_2d_input():
    with pytest.raises(ValueError, match="x: expected shape"):
        top_k_indices(np.zeros(5), 1)


@pytest.mark.parametrize("k", [1, 3, 5, np.int32(2)])
def test_top_k_indices_valid_k(k):
    x = np.random.default_rng(0).standard_normal((3, 5))
    x[1, :4] = 0.5  # a tie: smaller id first
    want = np.array([sorted(range(5), key=lambda j: (-row[j], j))[: int(k)] for row in x])
    np.testing.assert_array_equal(top_k_indices(x, k), want)
