"""Quality metrics of a compressed cache against the exact computation: one module for the
tools and the tests.

NumPy only, float64 throughout; imports nothing of ``numba_kv`` (like the oracles in
:mod:`numba_kv.reference`), so a metric cannot inherit a bug of what it measures.

* :func:`log_softmax`, :func:`kl_rows`: row-wise log-probabilities and ``KL(p ‖ q)``.
* :func:`nmse`: normalized squared reconstruction error of vectors.
* :func:`top_k_indices`, :func:`top1_agreement`.
* :func:`compare_logits` and :class:`LogitScorer`: the statistics llama.cpp's
  ``llama-perplexity --kl-divergence`` prints (KL mean / median / percentiles / max, "same
  top p", perplexity change with its standard error).
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["LogitScorer", "compare_logits", "kl_rows", "log_softmax", "nmse", "top1_agreement",
           "top_k_indices"]


def log_softmax(x: np.ndarray) -> np.ndarray:
    """Log-softmax over the last axis, in float64.

    Parameters
    ----------
    x : array_like, shape ``(..., n)``
        Logits; ``-inf`` entries (masked) get ``-inf``, if at least one entry of the row is finite.

    Returns
    -------
    ndarray of float64, shape ``(..., n)``

    Examples
    --------
    >>> np.exp(log_softmax([0.0, np.log(3.0)])).round(3).tolist()
    [0.25, 0.75]
    """
    x = np.asarray(x, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    z = x - m
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def kl_rows(logp: np.ndarray, logq: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    """``KL(p ‖ q) = Σ p·(log p − log q)`` over the last axis, in nats, not clamped.

    Parameters
    ----------
    logp, logq : array_like, shape ``(..., n)``
        Log-probabilities (:func:`log_softmax`) of the reference ``p`` and the estimate ``q``;
        computed in float64 whatever their dtype.
    mask : ndarray of bool, broadcastable to ``(..., n)``, optional
        Entries that take part; the others (masked, ``-inf`` in both) contribute 0.

    Returns
    -------
    ndarray of float64, shape ``(...)``
        Tiny negative values are possible from rounding; callers that report a KL clamp at 0.

    Notes
    -----
    With the convention ``0·log 0 = 0``, an entry where ``p == 0`` (``log p = -inf``, e.g. a
    masked logit of the reference) contributes 0 whatever ``q`` is, with or without ``mask``;
    an entry where ``p > 0`` and ``q == 0`` makes the KL ``+inf``.  A NaN in an entry that
    takes part gives NaN.

    Examples
    --------
    >>> float(kl_rows(log_softmax([0.0, -np.inf]), log_softmax([0.0, 0.0]))) == float(np.log(2.0))
    True
    """
    # float64 whatever the inputs' dtype (as documented): float16/float32 log-probabilities would
    # otherwise sum the terms, and return the KL, in their own precision
    logp, logq = np.asarray(logp, dtype=np.float64), np.asarray(logq, dtype=np.float64)
    with np.errstate(invalid="ignore"):  # -inf - -inf and 0·inf: resolved below
        if mask is None:
            diff = logp - logq
        else:  # zero the masked entries on both sides first
            diff = np.where(mask, logp, 0.0) - np.where(mask, logq, 0.0)
        terms = np.exp(logp) * diff
    out = terms.sum(axis=-1)
    if np.isnan(out).any():  # 0·(±inf), -inf - -inf: only where p is 0 (the other terms are untouched)
        bad = np.isnan(terms)
        zero = bad & np.isneginf(logp) & ~np.isnan(logq)  # p == 0: 0·log 0 = 0
        inf = bad & np.isposinf(diff) & np.isfinite(logp)  # p > 0 underflowed to 0.0 while q == 0
        out = np.where(zero, 0.0, np.where(inf, np.inf, terms)).sum(axis=-1)
    return out


def nmse(x: np.ndarray, x_hat: np.ndarray, axis: int | None = None, eps: float = 1e-30) -> float | np.ndarray:
    """Mean over vectors (the last axis) of ``‖x − x̂‖² / ‖x‖²``.

    Parameters
    ----------
    x, x_hat : array_like, shape ``(..., d)``
        Exact and reconstructed vectors, of the same shape (no broadcasting).
    axis : int, optional
        Axis of the per-vector ratios (shape ``(...)``) to average; ``None`` averages all of
        them and returns a float.
    eps : float
        Threshold of ``‖x‖²``: a vector with ``‖x‖² < eps`` (an all-zero vector) counts its
        absolute squared error ``‖x − x̂‖²`` instead of the ratio.

    Returns
    -------
    float or ndarray of float64

    Raises
    ------
    ValueError
        ``x_hat`` does not have the shape of ``x``.

    Examples
    --------
    >>> nmse(np.array([[1.0, 0.0], [0.0, 2.0]]), np.array([[1.0, 0.5], [0.0, 2.0]]))
    0.125
    """
    x = np.asarray(x, dtype=np.float64)
    x_hat = np.asarray(x_hat, dtype=np.float64)
    if x_hat.shape != x.shape:
        raise ValueError(f"x_hat: expected the shape of x {x.shape}, got {x_hat.shape}")
    # each vector pair scaled by a power of two (exact) putting its largest |value| near 1:
    # squares of |x| above ~1.3e154 overflow float64, and inf / inf was a NaN
    big = np.maximum(np.abs(x).max(axis=-1, initial=0.0), np.abs(x_hat).max(axis=-1, initial=0.0))
    scale = np.ldexp(1.0, np.frexp(np.where(np.isfinite(big) & (big > 0), big, 1.0))[1])[..., None]
    xs, hs = x / scale, x_hat / scale
    num = np.sum((xs - hs) ** 2, axis=-1)
    den = np.sum(xs ** 2, axis=-1)
    with np.errstate(over="ignore"):  # (‖x‖² past float64 is inf, never below eps; so is such an absolute error)
        s2 = scale[..., 0] ** 2
        tiny = den * s2 < eps
        ratio = np.where(tiny, num * s2, num / np.where(den > 0, den, 1.0))
    return float(ratio.mean()) if axis is None else ratio.mean(axis=axis)


def top_k_indices(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``k`` largest entries of each row (ties: smaller index first).

    Parameters
    ----------
    x : array_like, shape ``(n, vocab)``
        Any real dtype (integers and bools are ranked as float64).
    k : int
        ``1 <= k <= vocab``.

    Returns
    -------
    ndarray of int64, shape ``(n, k)``
        By decreasing value; NaN ranks above every number (as in ``numpy.argmax``, so
        ``top_k_indices(x, 1)[:, 0] == x.argmax(-1)``), NaNs among themselves by index.

    Raises
    ------
    ValueError
        ``x`` is not 2-D, or ``k`` is not an int in ``[1, vocab]``.
    """
    x = np.asarray(x)
    if x.ndim != 2:
        raise ValueError(f"x: expected shape (n, vocab), got {x.shape}")
    if not _is_int(k) or not 1 <= k <= x.shape[1]:
        raise ValueError(f"k: expected an int in [1, vocab] = [1, {x.shape[1]}], got {k!r}")
    if x.dtype.kind != "f":
        x = x.astype(np.float64)  # -x below wraps for unsigned integers and raises for bools
    # a stable sort of -x puts equal values in id order; argpartition first keeps it O(vocab)
    part = np.argpartition(-x, k - 1, axis=-1)[:, :k]
    kth = np.take_along_axis(x, part, axis=-1).min(axis=-1, keepdims=True)
    nan = np.isnan(x)
    out = np.empty((x.shape[0], k), dtype=np.int64)
    for i in range(x.shape[0]):
        if nan[i].any():  # the k-th value may be NaN (no candidate >= it): NaNs first, then by value
            out[i] = np.lexsort((-np.where(nan[i], 0.0, x[i]), ~nan[i]))[:k]  # stable: ties by id
            continue
        cand = np.flatnonzero(x[i] >= kth[i])  # every entry >= the k-th value, id order
        out[i] = cand[np.argsort(-x[i, cand], kind="stable")[:k]]
    return out


def top1_agreement(ref: np.ndarray, est: np.ndarray, axis: int = -1) -> float:
    """Fraction of rows whose argmax along ``axis`` is the same in ``ref`` and ``est``.

    Parameters
    ----------
    ref, est : array_like
        Reference and estimate, of the same shape (no broadcasting).
    axis : int
        Axis of the argmax.

    Returns
    -------
    float

    Raises
    ------
    ValueError
        ``est`` does not have the shape of ``ref``.
    """
    ref, est = np.asarray(ref), np.asarray(est)
    if est.shape != ref.shape:
        raise ValueError(f"est: expected the shape of ref {ref.shape}, got {est.shape}")
    return float(np.mean(ref.argmax(axis) == est.argmax(axis)))


def _is_int(v: object) -> bool:
    """``v`` is a Python or NumPy integer, not a bool."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _check_chunk(chunk: object) -> None:
    """ValueError unless ``chunk`` is an int >= 1."""
    if not _is_int(chunk) or chunk < 1:
        raise ValueError(f"chunk: expected an int >= 1, got {chunk!r}")


def _check_targets(targets: np.ndarray, vocab: int) -> None:
    """ValueError unless ``targets`` are integers in ``[0, vocab)`` (the shape is checked by the callers)."""
    if not np.issubdtype(targets.dtype, np.integer):
        raise ValueError(f"targets: expected integer token ids, got dtype {targets.dtype}")
    lo, hi = int(targets.min()), int(targets.max())
    if lo < 0 or hi >= vocab:
        raise ValueError(f"targets: expected token ids in [0, vocab) = [0, {vocab}), got min {lo}, max {hi} "
                         f"(drop ignored positions, e.g. label -100, before scoring)")


def compare_logits(ref: np.ndarray, logits: np.ndarray, targets: np.ndarray,
                   chunk: int = 128, top_k: int = 5) -> dict[str, float]:
    """Quality of ``logits`` against the reference ``ref`` on the same positions.

    The statistics are those llama.cpp's ``llama-perplexity --kl-divergence`` prints
    (``tools/perplexity``): KL divergence mean / median / 99th percentile / max, "same top
    p" (top-1 agreement), and the perplexity change with its standard error.

    Parameters
    ----------
    ref, logits : ndarray, shape ``(n, vocab)``
        Next-token logits of the reference (dense) and of the evaluated cache.
    targets : ndarray of int, shape ``(n,)``
        The actual next tokens, in ``[0, vocab)``.
    chunk : int
        Rows per float64 block (bounds the temporary memory), ``>= 1``.
    top_k : int
        ``k`` of the top-k overlap, ``>= 1`` (a ``k`` above ``vocab`` counts the whole vocabulary).

    Returns
    -------
    dict
        ``ppl`` and ``ppl_ref`` (``exp`` of the mean negative log-likelihood of
        ``targets``); ``ppl_change_pct`` = ``100·(ppl/ppl_ref − 1)`` and
        ``ppl_change_pct_se``, its standard error (below); ``top1_agreement`` (fraction of
        rows with the same argmax) and ``top1_se`` = ``sqrt(p(1−p)/n)``; ``top5_overlap``
        (mean over rows of ``|top-k(ref) ∩ top-k(logits)| / k``; ties at the k-th logit
        are broken by token id); ``kl_mean``, ``kl_mean_se``, ``kl_median``, ``kl_p95``,
        ``kl_p99``, ``kl_max`` (per-row ``KL(softmax(ref) ‖ softmax(logits))`` in nats;
        percentiles linearly interpolated, NumPy's default).

    Raises
    ------
    ValueError
        Shapes do not match or ``n == 0``; ``targets`` are not integers in ``[0, vocab)``;
        ``chunk`` or ``top_k`` is not an int ``>= 1``.

    Notes
    -----
    Standard error of the perplexity change: with per-token log-likelihood differences
    ``d_i = nll_i − nll_ref,i``, ``ppl/ppl_ref = exp(mean d)``; ``se(mean d) = std(d, ddof=1)/sqrt(n)``
    and, by the delta method, ``se(ppl_change_pct) = 100·exp(mean d)·se(mean d)`` (llama.cpp
    reports ``Mean ln(PPL(Q)/PPL(base))`` with the same error).  Pairing the two runs token
    by token removes the (large) variance of the text itself; neighbouring tokens are
    correlated, so the error is a lower bound on the true uncertainty.  ``kl_mean_se`` is
    ``std(KL, ddof=1)/sqrt(n)``.  With ``n == 1`` the standard errors are NaN.  NaN logits (a
    broken cache) give NaN perplexities and KL statistics, not an exception.
    """
    ref, logits, targets = np.asarray(ref), np.asarray(logits), np.asarray(targets)
    if ref.shape != logits.shape or ref.ndim != 2 or targets.shape != (ref.shape[0],) or ref.shape[0] == 0:
        raise ValueError(f"logits: expected ref, logits (n, vocab) and targets (n,) with n >= 1, got "
                         f"{ref.shape}, {logits.shape}, {targets.shape}")
    _check_chunk(chunk)
    if not _is_int(top_k) or top_k < 1:  # (int(top_k) used to turn 0 or -3 into 1 and 2.7 into 2)
        raise ValueError(f"top_k: expected an int >= 1, got {top_k!r}")
    n, vocab = ref.shape
    _check_targets(targets, vocab)
    k = min(int(top_k), vocab)
    nll, nll_ref, kl, overlap = np.empty(n), np.empty(n), np.empty(n), np.empty(n)
    rows = np.arange(n)
    for a in range(0, n, chunk):
        b = min(a + chunk, n)
        lp_r, lp_c = log_softmax(ref[a:b]), log_softmax(logits[a:b])
        t = targets[a:b]
        nll_ref[a:b] = -lp_r[rows[: b - a], t]
        nll[a:b] = -lp_c[rows[: b - a], t]
        kl[a:b] = np.maximum(kl_rows(lp_r, lp_c), 0.0)
        overlap[a:b] = [len(set(x) & set(y)) / k
                        for x, y in zip(top_k_indices(ref[a:b], k), top_k_indices(logits[a:b], k))]
    top1 = top1_agreement(ref, logits)
    d = nll - nll_ref
    ratio = float(np.exp(d.mean()))
    d_se = float(d.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan")
    kl_se = float(kl.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan")
    return {"ppl": float(np.exp(nll.mean())), "ppl_ref": float(np.exp(nll_ref.mean())),
            "ppl_change_pct": 100.0 * (ratio - 1.0), "ppl_change_pct_se": 100.0 * ratio * d_se,
            "top1_agreement": top1, "top1_se": math.sqrt(top1 * (1.0 - top1) / n),
            "top5_overlap": float(overlap.mean()),
            "kl_mean": float(kl.mean()), "kl_mean_se": kl_se, "kl_median": float(np.median(kl)),
            "kl_p95": float(np.percentile(kl, 95)), "kl_p99": float(np.percentile(kl, 99)),
            "kl_max": float(kl.max())}


class LogitScorer:
    """:func:`compare_logits` against one fixed reference, many times.

    The reference's log-softmax is computed once; every call then performs exactly the
    operations of ``compare_logits`` (same chunks, same float64 formulas), so the results
    are identical to it, at about half the cost.

    Parameters
    ----------
    ref : array_like, shape ``(n, vocab)``
        Reference logits.
    targets : ndarray of int, shape ``(n,)``
        The actual next tokens, in ``[0, vocab)``.
    chunk : int
        Rows per float64 block, as in :func:`compare_logits`, ``>= 1``.

    Raises
    ------
    ValueError
        ``ref`` is not ``(n, vocab)`` with ``n >= 1``, ``targets`` not ``(n,)`` integers in
        ``[0, vocab)``, or ``chunk`` not an int ``>= 1``.
    """

    def __init__(self, ref: np.ndarray, targets: np.ndarray, chunk: int = 128) -> None:
        ref = np.asarray(ref)  # (as compare_logits: a list of rows is accepted, not an AttributeError)
        self.ref, self.targets, self.chunk = ref, np.asarray(targets), chunk
        if ref.ndim != 2 or ref.shape[0] == 0 or self.targets.shape != (ref.shape[0],):
            raise ValueError(f"ref: expected (n, vocab) with targets (n,), got {ref.shape}, "
                             f"{self.targets.shape}")
        _check_chunk(chunk)
        _check_targets(self.targets, ref.shape[1])
        self.spans = [(a, min(a + chunk, ref.shape[0])) for a in range(0, ref.shape[0], chunk)]
        self.lp_ref = [log_softmax(ref[a:b]) for a, b in self.spans]
        rows = np.arange(ref.shape[0])
        self.nll_ref = np.concatenate([-lp[rows[: b - a], self.targets[a:b]]
                                       for lp, (a, b) in zip(self.lp_ref, self.spans)])
        self.argmax_ref = ref.argmax(-1)

    def __call__(self, logits: np.ndarray) -> dict[str, float]:
        """``ppl``, ``ppl_ref``, ``top1_agreement``, ``kl_mean``, ``kl_p95``, ``kl_max`` of
        ``logits`` (shape of the reference), as :func:`compare_logits` computes them."""
        logits = np.asarray(logits)
        if logits.shape != self.ref.shape:
            raise ValueError(f"logits: expected shape {self.ref.shape}, got {logits.shape}")
        n = logits.shape[0]
        nll, kl = np.empty(n), np.empty(n)
        rows = np.arange(n)
        for lp_r, (a, b) in zip(self.lp_ref, self.spans):
            lp_c = log_softmax(logits[a:b])
            nll[a:b] = -lp_c[rows[: b - a], self.targets[a:b]]
            kl[a:b] = np.maximum(kl_rows(lp_r, lp_c), 0.0)
        return {"ppl": float(np.exp(nll.mean())), "ppl_ref": float(np.exp(self.nll_ref.mean())),
                "top1_agreement": float(np.mean(self.argmax_ref == logits.argmax(-1))),
                "kl_mean": float(kl.mean()), "kl_p95": float(np.percentile(kl, 95)),
                "kl_max": float(kl.max())}
