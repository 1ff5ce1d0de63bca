"""Fused decode attention over paged K/V pools, read through a FlashInfer-style page table.

A page pool holds either PQO-compressed tokens (``k_codes``/``k_scales``/``v_codes``/
``v_scales`` ``[num_pages, H, page_size, ·]``, one binary16 scale per 32-block) or float32
tokens (``k_pages``/``v_pages`` ``[num_pages, H, page_size, d]``).  Token ``t`` of batch
sequence ``i`` lives at page ``kv_indices[kv_indptr[i] + t // page_size]``, slot
``t % page_size``; sequence ``i`` holds ``(n_pages_i − 1)·page_size + kv_last_page_len[i]``
tokens.  The math is that of :mod:`numba_kv.ops.attention` (rotated queries against
codebook values, rotated-domain value accumulation, split-K partitions merged by
log-sum-exp) and so are the cores and the merge kernel; only the token addressing differs.
Each sequence may have its own length; its ``q_len`` new queries sit at its last ``q_len``
positions (causal).  :meth:`numba_kv.PagedKVCache.decode_attention` calls this with its
own pools and page table.

Two entries: :func:`paged_decode_attention`, the public op, validates everything it is given
(devices, dtypes, shapes, pool kind, the page table's values, sequence lengths, the values of
the queries and pools) once and then runs
:func:`paged_attention_rows`, the trusted entry, which validates nothing (the paged cache
calls it directly every step: its configuration and its own entry checks vouch for the
arrays).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ... import _backend
from ..._validate import Q_MAX, check_bool, check_float_array, check_out, check_partition_size, check_softmax_scale
from ..finite import check_finite_stats
from ..hadamard import rotate32, rotate32_rows
from .flat import EXACT_MAX, check_f16_bits
from .layout import CodeLayout
from .plan import attention_plan

__all__ = ["paged_attention_rows", "paged_decode_attention", "pool_arrays"]

# Kernel arguments of the pool kind not used (float32 pages or PQO codes): never read (the
# kernels test ``compressed``), put on a device once.  Writable: the kernels are compiled for
# the writable array types of the real pools.
_NO_CODES = np.zeros((1, 1, 1, 1), np.uint8)
_NO_SCALES = np.zeros((1, 1, 1, 1), np.uint16)
_NO_PAGES = np.zeros((1, 1, 1, 1), np.float32)
#: the same views of the same query and output arrays (a steady step's launch repeats, issue 27)
_VIEWS: dict = {}


def pool_arrays(like: Any, k_pages: Any = None, v_pages: Any = None, k_codes: Any = None, k_scales: Any = None,
                v_codes: Any = None, v_scales: Any = None) -> tuple:
    """``(kc, ks, vc, vs, kp, vp)``, the pool arguments of the paged kernels, with
    placeholders (on the device of ``like``, made once) for the kind not given; checks
    nothing (float32 pools when ``k_pages`` is given, else PQO pools).

    Parameters
    ----------
    like : array
        Any array on the pools' device (NumPy or CUDA); the placeholders are put there.
    k_pages, v_pages : arrays ``[num_pages, num_kv_heads, page_size, head_dim]`` float32, optional
        Float32 pools.
    k_codes, v_codes : arrays ``[num_pages, num_kv_heads, page_size, width]`` uint8, optional
        PQO pools' packed codes (``width`` bytes per token, :class:`~numba_kv.ops.attention.layout.CodeLayout`).
    k_scales, v_scales : arrays ``[num_pages, num_kv_heads, page_size, head_dim // 32]`` uint16, optional
        PQO pools' binary16 block scales.

    Returns
    -------
    tuple
        ``(kc, ks, vc, vs, kp, vp)`` in the kernels' argument order.
    """
    if k_pages is not None:
        kc = _backend.constant(like, _NO_CODES)
        ks = _backend.constant(like, _NO_SCALES)
        return kc, ks, kc, ks, k_pages, v_pages
    kp = _backend.constant(like, _NO_PAGES)
    return k_codes, k_scales, v_codes, v_scales, kp, kp


def _check_kind(k_pages: Any, v_pages: Any, k_codes: Any, k_scales: Any, v_codes: Any, v_scales: Any) -> None:
    """``ValueError`` unless exactly one kind of pool (float32 pages or PQO codes) is complete."""
    codes = (k_codes, k_scales, v_codes, v_scales)
    if (k_pages is None) == (k_codes is None) or (k_pages is None) != (v_pages is None) or \
            any((a is None) != (k_codes is None) for a in codes):
        raise ValueError("k_pages: expected either k_pages and v_pages (float32 pools) or k_codes, k_scales, "
                         "v_codes and v_scales (PQO pools) with k_codebook and v_codebook")


def _pools(q: Any, d: int, k_pages: Any, v_pages: Any, k_codes: Any, k_scales: Any, v_codes: Any, v_scales: Any,
           k_codebook: Any, v_codebook: Any) -> tuple:
    """``(compressed, page_size, (kc, ks, vc, vs, kp, vp), klayout, vlayout)`` with placeholders
    for the pool kind not given; validates that exactly one kind is."""
    _check_kind(k_pages, v_pages, k_codes, k_scales, v_codes, v_scales)
    if k_pages is not None:
        for name, a in (("k_pages", k_pages), ("v_pages", v_pages)):
            if len(a.shape) != 4 or int(a.shape[3]) != d or np.dtype(a.dtype) != np.float32:
                # (a dtype problem is a TypeError, a shape problem a ValueError)
                raise (TypeError if np.dtype(a.dtype) != np.float32 else ValueError)(
                    f"{name}: expected float32 [num_pages, num_kv_heads, page_size, {d}], got {a.dtype} "
                    f"{tuple(a.shape)}")
        _same_pages(("k_pages", k_pages), ("v_pages", v_pages))
        return False, int(k_pages.shape[2]), pool_arrays(q, k_pages, v_pages), None, None
    if k_codebook is None or v_codebook is None:
        raise ValueError("k_codebook: PQO pools need k_codebook and v_codebook")
    lay = [CodeLayout.uniform(cb, d) for cb in (k_codebook, v_codebook)]
    for name, a, width, dt in (("k_codes", k_codes, lay[0].width, np.uint8),
                               ("k_scales", k_scales, d // 32, np.uint16),
                               ("v_codes", v_codes, lay[1].width, np.uint8),
                               ("v_scales", v_scales, d // 32, np.uint16)):
        if len(a.shape) != 4 or int(a.shape[3]) != width or np.dtype(a.dtype) != dt:
            raise (TypeError if np.dtype(a.dtype) != dt else ValueError)(
                f"{name}: expected {np.dtype(dt)} [num_pages, num_kv_heads, page_size, {width}], got {a.dtype} "
                f"{tuple(a.shape)}")
    _same_pages(("k_codes", k_codes), ("k_scales", k_scales), ("v_codes", v_codes), ("v_scales", v_scales))
    arrays = pool_arrays(q, k_codes=k_codes, k_scales=k_scales, v_codes=v_codes, v_scales=v_scales)
    return True, int(k_codes.shape[2]), arrays, lay[0], lay[1]


def _same_pages(*pools: tuple[str, Any]) -> None:
    """``ValueError`` unless every pool has the first one's ``(num_pages, num_kv_heads,
    page_size)``: the kernels address them all with the same page and slot."""
    (name0, a0), *rest = pools
    want = tuple(int(x) for x in a0.shape[:3])
    for name, a in rest:
        if tuple(int(x) for x in a.shape[:3]) != want:
            raise ValueError(f"{name}: expected [num_pages, num_kv_heads, page_size] = {list(want)} like {name0}, "
                             f"got shape {tuple(a.shape)}")


def _table_lens(page_table: Sequence[Any], num_pages: int, page_size: int, seq_lens: Sequence[int] | None
                ) -> list[int]:
    """Tokens of every sequence, read from the page table after checking that it addresses only
    the pools: the kernels index the pools with it unchecked (a page outside them read memory
    that is not the pool's, or crashed).  A device→host copy when the table lives on the device;
    ``seq_lens``, when given, must agree."""
    names = ("kv_indptr", "kv_indices", "kv_last_page_len")
    host = []
    for name, a in zip(names, page_table):
        if np.dtype(a.dtype) != np.int32 or len(a.shape) != 1:
            raise TypeError(f"{name}: expected a 1-D int32 array, got {a.dtype} {tuple(a.shape)}")
        host.append(_backend.to_host(a).astype(np.int64))
    indptr, indices, last = host
    if indptr[0] != 0 or np.any(np.diff(indptr) < 1) or indptr[-1] != indices.shape[0]:
        raise ValueError(f"kv_indptr: expected 0 = kv_indptr[0] < kv_indptr[1] < … < kv_indptr[-1] = "
                         f"len(kv_indices) = {indices.shape[0]} (every sequence at least one page), got "
                         f"{indptr.tolist()[:16]}")
    if indices.size and (indices.min() < 0 or indices.max() >= num_pages):
        raise ValueError(f"kv_indices: expected pages in [0, {num_pages}) (the pools' pages), got values from "
                         f"{int(indices.min())} to {int(indices.max())}")
    if last.min() < 1 or last.max() > page_size:
        raise ValueError(f"kv_last_page_len: expected values in [1, page_size={page_size}], got values from "
                         f"{int(last.min())} to {int(last.max())}")
    lens = [int((n - 1) * page_size + x) for n, x in zip(np.diff(indptr), last)]
    if seq_lens is not None and [int(n) for n in seq_lens] != lens:
        raise ValueError(f"seq_lens: expected the page table's lengths {lens[:16]}, got {list(seq_lens)[:16]}")
    return lens


def _check_pool_values(k_pages: Any, v_pages: Any, k_scales: Any, v_scales: Any) -> None:
    """Finite float32 pages within ``|x| <= 2**21`` (the caches' limit: the logits of any
    accepted query and the value sums stay finite in float32), or PQO scales without an
    Inf/NaN binary16 pattern (they decode as finite garbage).  One read of every pool."""
    for name, a in (("k_pages", k_pages), ("v_pages", v_pages)):
        if a is not None:
            amax = check_finite_stats(name, a).amax
            if amax > EXACT_MAX:
                raise ValueError(f"{name}: expected |{name}| <= 2**21 (logits and sums stay finite in float32), "
                                 f"got max {amax:.6g}")
    for name, a in (("k_scales", k_scales), ("v_scales", v_scales)):
        if a is not None:
            check_f16_bits(name, a)


def paged_decode_attention(q: Any, page_table: Sequence[Any], *, k_pages: Any = None, v_pages: Any = None,
                           k_codes: Any = None, k_scales: Any = None, v_codes: Any = None, v_scales: Any = None,
                           k_codebook: Any = None, v_codebook: Any = None, seq_lens: Sequence[int] | None = None,
                           softmax_scale: float | None = None, causal: bool = True,
                           partition_size: int | None = None, check_values: bool = True, out: Any = None) -> Any:
    """Attention of new queries over paged K/V pools, read through a page table.

    Parameters
    ----------
    q : float array, shape ``(n_seq, num_heads, q_len, head_dim)``
        One row per sequence of the page table; ``num_heads`` a multiple of the pools'
        ``num_kv_heads`` (contiguous GQA groups).
    page_table : ``(kv_indptr, kv_indices, kv_last_page_len)``
        int32 arrays of shapes ``(n_seq + 1,)``, ``(kv_indptr[-1],)``, ``(n_seq,)`` on the
        device of ``q`` (a :class:`numba_kv.caches.paged.PageTable` fits): ``kv_indptr``
        strictly increasing from 0 (every sequence at least one page), pages in
        ``[0, num_pages)``, last-page lengths in ``[1, page_size]``.  Read on the host to
        check it (a device→host copy when it lives on the device).
    k_pages, v_pages : float32 array, shape ``(num_pages, num_kv_heads, page_size, head_dim)``
        Float32 pools; or else
    k_codes, v_codes : uint8 array, shape ``(num_pages, num_kv_heads, page_size, head_dim·bits/8)``
    k_scales, v_scales : uint16 array, shape ``(num_pages, num_kv_heads, page_size, head_dim/32)``
        PQO pools (32-block rotation, one binary16 scale per block) decoded with
    k_codebook, v_codebook : Codebook
        The codebooks of the K and V codes.
    seq_lens : sequence of int, optional
        Tokens of every sequence (host ints): must equal the page table's.
    softmax_scale : float, optional
        Default ``1/sqrt(head_dim)``; in ``(0, 2**30]`` (larger ones could overflow the float32
        logits).
    causal : bool
        The ``q_len`` queries of a sequence sit at its last ``q_len`` positions.
    partition_size : int, optional
        Tokens per split-K partition, >= 1.
    check_values : bool
        Reject a non-finite ``q`` or ``|q| > 2**64``, float32 pages that are not finite or
        beyond ``|x| <= 2**21`` (logits and sums stay finite in float32) and Inf/NaN scale
        patterns (one read of ``q`` and of every pool; on a GPU one device-to-host read
        each).  ``False`` when the caller vouches for them.
    out : float32 array, shape ``(n_seq, num_heads, q_len, head_dim)``, optional
        Written and returned instead of a new array (C-contiguous, on the device of ``q``,
        sharing no memory with ``q`` or the pools): a decode step that allocates nothing.

    Returns
    -------
    out : float32 array, shape ``(n_seq, num_heads, q_len, head_dim)``, on the device of ``q``.

    Raises
    ------
    ValueError
        Empty sequence, shape/group mismatch, pools of both or neither kind or of different
        page geometry, device mismatch, a page table that addresses outside the pools,
        values outside the ranges above, a bad ``out``; the message names the argument.
    TypeError
        A page table that is not three 1-D int32 arrays, ``out`` of another dtype.
    """
    if not isinstance(page_table, (tuple, list)) or len(page_table) != 3:
        raise TypeError(f"page_table: expected a tuple (kv_indptr, kv_indices, kv_last_page_len), got "
                        f"{type(page_table).__name__} {page_table!r:.80}")
    indptr, indices, last = page_table
    _backend.resolve_device("auto", q=q, kv_indptr=indptr, kv_indices=indices, kv_last_page_len=last,
                                  k_pages=k_pages, v_pages=v_pages, k_codes=k_codes, k_scales=k_scales,
                                  v_codes=v_codes, v_scales=v_scales)
    check_float_array("q", q, 4)
    _check_kind(k_pages, v_pages, k_codes, k_scales, v_codes, v_scales)
    n_seq, hq, ql, d = (int(x) for x in q.shape)
    pool = k_pages if k_pages is not None else k_scales
    hkv, pool_d = 0, 0
    if pool is not None and len(pool.shape) == 4:
        hkv = int(pool.shape[1])
        pool_d = int(pool.shape[3]) * (1 if k_pages is not None else 32)
    if d % 32 or d != pool_d or hkv < 1 or hq % hkv:
        raise ValueError(f"q: expected [n_seq, k·{hkv}, q_len, {pool_d}] (the pools' KV heads and head_dim), got "
                         f"shape {(n_seq, hq, ql, d)}")
    if len(last.shape) != 1 or int(last.shape[0]) != n_seq or int(indptr.shape[0]) != n_seq + 1:
        raise ValueError(f"q: expected {int(last.shape[0])} rows (one per sequence of the page table), got {n_seq}")
    softmax_scale = None if softmax_scale is None else check_softmax_scale(softmax_scale)
    partition_size = check_partition_size(partition_size)
    check_values, causal = check_bool("check_values", check_values), check_bool("causal", causal)
    if out is not None:
        check_out(out, (n_seq, hq, ql, d), np.float32, _backend.device_of("q", q),
                  "the attention output (float32, shaped like q)",
                  inputs=(("q", q), ("k_pages", k_pages), ("v_pages", v_pages), ("k_codes", k_codes),
                          ("k_scales", k_scales), ("v_codes", v_codes), ("v_scales", v_scales)))
    if check_values:
        q_max = check_finite_stats("q", q).amax
        if q_max > Q_MAX:
            raise ValueError(f"q: expected |q| <= 2**64 (logits stay finite in float32), got max |q| = {q_max:.6g}")
    compressed, page_size, arrays, klay, vlay = _pools(q, d, k_pages, v_pages, k_codes, k_scales, v_codes, v_scales,
                                                       k_codebook, v_codebook)
    if check_values:
        _check_pool_values(k_pages, v_pages, k_scales, v_scales)
    lens = _table_lens(page_table, int((k_pages if k_pages is not None else k_codes).shape[0]), page_size, seq_lens)
    if min(lens) < max(1, ql if causal else 1):
        raise ValueError(f"page_table: every sequence needs >= max(1, q_len={ql}) stored tokens, got lengths {lens}")
    return paged_attention_rows(q, (indptr, indices, last), arrays, klay, vlay, n_kv_heads=hkv, page_size=page_size,
                                seq_lens=lens, softmax_scale=softmax_scale, causal=causal,
                                partition_size=partition_size, check_values=check_values, out=out)


def paged_attention_rows(q: Any, page_table: Sequence[Any], arrays: tuple, klayout: CodeLayout | None,
                         vlayout: CodeLayout | None, *, n_kv_heads: int, page_size: int, seq_lens: Sequence[int],
                         softmax_scale: float | None = None, causal: bool = True, partition_size: int | None = None,
                         check_values: bool = False, out: Any = None) -> Any:
    """The trusted entry of paged decode attention: validates nothing.

    The caller vouches for every argument (:func:`paged_decode_attention` after its checks;
    :meth:`numba_kv.PagedKVCache.decode_attention` after its configuration's and its entry's).

    Parameters
    ----------
    q : float array, shape ``(n_seq, num_heads, q_len, head_dim)``
        ``num_heads`` a multiple of ``n_kv_heads``; ``head_dim`` a multiple of 32; on the
        device of the pools.
    page_table : ``(kv_indptr, kv_indices, kv_last_page_len)``
        int32, on that device.
    arrays : tuple
        ``(kc, ks, vc, vs, kp, vp)`` from :func:`pool_arrays`.
    klayout, vlayout : CodeLayout or None
        The layouts of the K/V codes (``CodeLayout.uniform(codebook, head_dim)``); ``None``
        for float32 pools.
    n_kv_heads, page_size : int
        The pools' KV heads and tokens per page.
    seq_lens : sequence of int
        Tokens of every sequence (each ``>= max(1, q_len)`` when ``causal``).
    softmax_scale, causal, partition_size
        As for :func:`paged_decode_attention`.
    check_values : bool
        Let the query rotation check that it stays finite (a host read on a GPU).
    out : float32 array, shape ``(n_seq, num_heads, q_len, head_dim)``, optional
        C-contiguous, on the device of ``q``: written and returned instead of a new array.

    Returns
    -------
    out : float32 array, shape ``(n_seq, num_heads, q_len, head_dim)``, on the device of ``q``.
    """
    n_seq, hq, ql, d = (int(x) for x in q.shape)
    g, rows = n_seq * n_kv_heads, (hq // n_kv_heads) * ql
    # the same views of the same arrays (a steady step's launches repeat, issue 27)
    q3 = _backend.same_view(_VIEWS, ("q", id(q)), _backend.ascontiguous_f32("q", q), lambda a: a.reshape(g, rows, d))
    compressed = klayout is not None
    plan = attention_plan(q3, paged=True, n_g=g, rows=rows, d=d, klayout=klayout, vlayout=vlayout,
                          v_width=int(arrays[2].shape[3]) if compressed else 0)
    # on a GPU the partition kernel rotates the queries of a compressed pool in its prologue
    # (issue 27: no rotation launch, no rotated copy) unless the rotation is checked
    rotate_q = compressed and not check_values and plan.rotate_q
    if not compressed or rotate_q:
        qr = q3
    elif check_values:
        qr = rotate32(q3)  # checks that the rotation stays finite (a host read on the device)
    else:  # the caller vouched for q: no read back
        qr = rotate32_rows(q3.reshape(g * rows, d)).reshape(g, rows, d)
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    lens = [int(n) for n in seq_lens]
    res = plan.run_paged(qr, q3, arrays, tuple(page_table), page_size, n_kv_heads, max(lens), sum(lens), n_seq,
                         scale, ql, causal, partition_size, rotate_q,
                         None if out is None else _backend.same_view(_VIEWS, ("out", id(out)), out,
                                                                      lambda a: a.reshape(g, rows, d)))
    return out if out is not None else res.reshape(n_seq, hq, ql, d)
