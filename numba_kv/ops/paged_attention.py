"""Fused decode attention over a paged KV cache, read through a FlashInfer-style page table.

The page pool of :class:`numba_kv.PagedKVCache` holds either PQO-compressed tokens
(``k_codes``/``k_scales``/``v_codes``/``v_scales`` ``[num_pages, H, page_size, ·]``) or
float32 tokens (``k_pages``/``v_pages`` ``[num_pages, H, page_size, d]``).  Token ``t`` of
batch sequence ``i`` lives at page ``kv_indices[kv_indptr[i] + t // page_size]``, slot
``t % page_size``; sequence ``i`` holds ``(n_pages_i − 1)·page_size + kv_last_page_len[i]``
tokens.  The math is that of :mod:`numba_kv.ops.attention` (rotated queries against
codebook values, rotated-domain value accumulation, split-K partitions merged by
log-sum-exp); only the token addressing differs.  Each sequence may have its own length;
its ``q_len`` new queries sit at its last ``q_len`` positions (causal).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numba import cuda, float32, int64, prange

from .. import _backend
from .._jit import FASTMATH_REDUCE, cpu_call, cpu_kernel, cuda_kernel
from ._registry import register
from .attention import (
    CPU_TILE,
    F16_ABS_TABLE,
    MAX_HEAD_DIM,
    NEG_INF,
    _merge_partitions_cpu,
    _merge_partitions_cuda,
    decode_tile_simd_cpu,
    load_token_fast_dev,
    online_update_dev,
    softmax_tile_cpu,
    tile_pv_cpu,
    tile_scores_cpu,
    visible_dev,
)
from .hadamard import SIGNS32, rotate32


@cpu_kernel(fastmath=FASTMATH_REDUCE)
def _paged_decode_attention_cpu(qr, q, kc, ks, vc, vs, kp, vp, compressed, kv_indptr, kv_indices,
                                kv_last_page_len, page_size, n_kv_heads, kcent, vcent, kbits, vbits, scale_table,
                                softmax_scale, q_len, causal, part_size, part_m, part_l, part_acc):
    n_g, rows, d = qr.shape
    nb = d // 32
    n_parts = part_m.shape[1]
    for item in prange(n_g * n_parts):
        g = item // n_parts
        p = item - g * n_parts
        seq = g // n_kv_heads
        h = g - seq * n_kv_heads
        first = kv_indptr[seq]
        npages = kv_indptr[seq + 1] - first
        T = (npages - 1) * page_size + kv_last_page_len[seq] if npages > 0 else 0
        t_lo = p * part_size
        t_hi = min(T, t_lo + part_size)
        q_pos0 = T - q_len
        buf = np.empty((CPU_TILE, d), dtype=np.float32)
        sc = np.empty((rows, CPU_TILE), dtype=np.float32)
        acc = np.zeros((rows, d), dtype=np.float32)
        m = np.full(rows, NEG_INF, dtype=np.float32)
        l = np.zeros(rows, dtype=np.float32)
        no_bias = np.zeros((1, 1, 1), dtype=np.float32)
        no_pos = np.zeros(1, dtype=np.int32)
        qsrc = qr[g] if compressed else q[g]
        for t0 in range(t_lo, t_hi, CPU_TILE):
            nt = min(CPU_TILE, t_hi - t0)
            # keys of the tile, decoded (or copied) into the L1 buffer one run of page slots at a time
            tt = 0
            while tt < nt:
                page = kv_indices[first + (t0 + tt) // page_size]
                slot = (t0 + tt) % page_size
                run = min(nt - tt, page_size - slot)
                if compressed:
                    decode_tile_simd_cpu(kc[page, h], ks[page, h], slot, run, kcent, kbits, nb, 0, scale_table, buf,
                                         tt)
                else:
                    for i in range(run):
                        for j in range(d):
                            buf[tt + i, j] = kp[page, h, slot + i, j]
                tt += run
            tile_scores_cpu(qsrc, buf, nt, sc)
            softmax_tile_cpu(sc, nt, softmax_scale, g, False, no_bias, causal and t0 + nt - 1 > q_pos0, q_pos0,
                             q_len, t0, no_pos, False, 0, m, l, acc)
            # values of the tile into the same buffer
            tt = 0
            while tt < nt:
                page = kv_indices[first + (t0 + tt) // page_size]
                slot = (t0 + tt) % page_size
                run = min(nt - tt, page_size - slot)
                if compressed:
                    decode_tile_simd_cpu(vc[page, h], vs[page, h], slot, run, vcent, vbits, nb, 0, scale_table, buf,
                                         tt)
                else:
                    for i in range(run):
                        for j in range(d):
                            buf[tt + i, j] = vp[page, h, slot + i, j]
                tt += run
            tile_pv_cpu(sc, buf, nt, acc)
        for r in range(rows):
            part_m[g, p, r] = m[r]
            part_l[g, p, r] = l[r]
            for j in range(d):
                part_acc[g, p, r, j] = acc[r, j]


@cuda_kernel
def _paged_decode_attention_cuda(qr, q, kc, ks, vc, vs, kp, vp, compressed, kv_indptr, kv_indices,
                                 kv_last_page_len, page_size, n_kv_heads, kcent, vcent, kbits, vbits, scale_table,
                                 softmax_scale, q_len, causal, part_size, part_m, part_l, part_acc):
    """One thread per (sequence·KV head, partition, query row), grid-stride."""
    n_g, rows, d = qr.shape
    nb = d // 32
    n_parts = part_m.shape[1]
    kbuf = cuda.local.array(MAX_HEAD_DIM, dtype=float32)
    vbuf = cuda.local.array(MAX_HEAD_DIM, dtype=float32)
    acc = cuda.local.array(MAX_HEAD_DIM, dtype=float32)
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    for item in range(start, n_g * n_parts * rows, stride):
        r = item % rows
        gp = item // rows
        g = gp // n_parts
        p = gp - g * n_parts
        seq = g // n_kv_heads
        h = g - seq * n_kv_heads
        first = int64(kv_indptr[seq])
        npages = int64(kv_indptr[seq + 1]) - first
        T = int64(0)
        if npages > 0:
            T = (npages - 1) * page_size + int64(kv_last_page_len[seq])
        t_lo = p * part_size
        t_hi = min(T, t_lo + part_size)
        q_pos0 = T - q_len
        for j in range(d):
            acc[j] = float32(0.0)
        m = NEG_INF
        lsum = float32(0.0)
        for t in range(t_lo, t_hi):
            if not visible_dev(t, q_pos0, r, q_len, causal):
                continue
            page = kv_indices[first + t // page_size]
            slot = t % page_size
            s = float32(0.0)
            if compressed:
                load_token_fast_dev(kc[page, h, slot], ks[page, h, slot], kcent, kbits, nb, 0, scale_table, kbuf)
                load_token_fast_dev(vc[page, h, slot], vs[page, h, slot], vcent, vbits, nb, 0, scale_table, vbuf)
                for j in range(d):
                    s += qr[g, r, j] * kbuf[j]
                m, lsum = online_update_dev(s * softmax_scale, m, lsum, acc, vbuf, d)
            else:
                for j in range(d):
                    s += q[g, r, j] * kp[page, h, slot, j]
                m, lsum = online_update_dev(s * softmax_scale, m, lsum, acc, vp[page, h, slot], d)
        part_m[g, p, r] = m
        part_l[g, p, r] = lsum
        for j in range(d):
            part_acc[g, p, r, j] = acc[j]


_PSIG = ("void(float32[:, :, ::1], float32[:, :, ::1], uint8[:, :, :, ::1], uint16[:, :, :, ::1], "
         "uint8[:, :, :, ::1], uint16[:, :, :, ::1], float32[:, :, :, ::1], float32[:, :, :, ::1], boolean, "
         "int32[::1], int32[::1], int32[::1], int64, int64, float32[::1], float32[::1], int64, int64, float32[::1], "
         "float32, int64, boolean, int64, float32[:, :, ::1], float32[:, :, ::1], float32[:, :, :, ::1])")
register("paged_decode_attention", _paged_decode_attention_cpu, _paged_decode_attention_cuda, [_PSIG])


def paged_decode_attention(q: Any, cache: Any, layer: int, seq_ids: Sequence[int] | None = None, *,
                           softmax_scale: float | None = None, causal: bool = True,
                           partition_size: int | None = None) -> Any:
    """Attention of new queries over the tokens of ``seq_ids`` in a :class:`PagedKVCache`.

    Parameters
    ----------
    q : float array, shape ``(n_seq, num_heads, q_len, head_dim)``
        One row per sequence, on the device of the page pool; ``num_heads`` a multiple of
        the cache's ``num_kv_heads`` (contiguous GQA groups).
    cache : PagedKVCache
        Float32 or PQO pages (``v_head_dim == head_dim``).
    layer : int
    seq_ids : sequence of int, optional
        Sequences in the order of ``q``'s rows (default: every live sequence, ascending).
    softmax_scale : float, optional
        Default ``1/sqrt(head_dim)``.
    causal : bool
        The ``q_len`` queries of a sequence sit at its last ``q_len`` positions.

    Returns
    -------
    out : float32 array, shape ``(n_seq, num_heads, q_len, head_dim)``.

    Raises
    ------
    ValueError
        Empty sequence, shape/group mismatch, no values stored, device mismatch.
    """
    from .._validate import check_finite, check_float_array  # noqa: PLC0415

    pools = cache.pools
    if not pools:
        raise ValueError("cache: expected a paged cache with stored tokens, got an empty pool")
    if not cache.has_values or cache.v_head_dim != cache.head_dim:
        raise ValueError(f"cache: paged attention needs v_head_dim == head_dim ({cache.head_dim}), "
                         f"got {cache.v_head_dim}")
    like = next(iter(pools.values()))
    dev = _backend.resolve_device("auto", q=q, cache=like)
    check_float_array("q", q, 4)
    n_seq, hq, ql, d = (int(x) for x in q.shape)
    hkv = cache.num_kv_heads
    if d != cache.head_dim or hq % hkv:
        raise ValueError(f"q: expected [n_seq, k·{hkv}, q_len, {cache.head_dim}], got shape {(n_seq, hq, ql, d)}")
    table = cache.page_table(layer, seq_ids, on_device=False)
    if len(table.kv_last_page_len) != n_seq:
        raise ValueError(f"q: expected {len(table.kv_last_page_len)} rows (one per sequence), got {n_seq}")
    lens = [cache.seq_len(layer, s) for s in (seq_ids if seq_ids is not None else cache.sequences)]
    if min(lens) < max(1, ql if causal else 1):
        raise ValueError(f"seq_ids: every sequence needs >= max(1, q_len={ql}) stored tokens, got lengths {lens}")
    check_finite("q", q)
    compressed = bool(cache.bits)
    g, rows = n_seq * hkv, (hq // hkv) * ql
    q3 = _backend.ascontiguous_f32("q", q).reshape(g, rows, d)
    qr = rotate32(q3) if compressed else q3
    if partition_size is None:
        from .attention import default_partition_size  # noqa: PLC0415

        partition_size = default_partition_size(max(lens), g, dev)
    n_parts = max(1, -(-max(lens) // partition_size))
    part_m = _backend.empty(q3, (g, n_parts, rows), np.float32)
    part_l = _backend.empty(q3, (g, n_parts, rows), np.float32)
    part_acc = _backend.empty(q3, (g, n_parts, rows, d), np.float32)
    out = _backend.empty(q3, (g, rows, d), np.float32)
    tab = table if dev == _backend.CPU else cache.page_table(layer, seq_ids, on_device=True)
    if compressed:
        kc, ks, vc, vs = pools["k_codes"], pools["k_scales"], pools["v_codes"], pools["v_scales"]
        kp = vp = _backend.empty(q3, (1, 1, 1, 1), np.float32)
        page_size = int(kc.shape[2])
        kcent = _backend.constant(q3, cache.codebooks["k"].centroids)
        vcent = _backend.constant(q3, cache.codebooks["v"].centroids)
        kbits, vbits = cache.k_bits, cache.v_bits
    else:
        kp, vp = pools["k_pages"], pools["v_pages"]
        kc = vc = _backend.empty(q3, (1, 1, 1, 1), np.uint8)
        ks = vs = _backend.empty(q3, (1, 1, 1, 1), np.uint16)
        page_size = int(kp.shape[2])
        kcent = vcent = _backend.constant(q3, np.zeros(2, np.float32))
        kbits = vbits = 1
    scale = np.float32(d ** -0.5 if softmax_scale is None else softmax_scale)
    args = (qr, q3, kc, ks, vc, vs, kp, vp, compressed, tab[0], tab[1], tab[2], page_size, hkv, kcent, vcent,
            kbits, vbits, _backend.constant(q3, F16_ABS_TABLE), scale, ql, bool(causal), int(partition_size), part_m, part_l,
            part_acc)
    signs = _backend.constant(q3, SIGNS32)
    n_comp_parts = n_parts if compressed else 0
    if dev == _backend.CPU:
        cpu_call(_paged_decode_attention_cpu, g * rows * d * sum(lens) // max(n_seq, 1), *args)
        cpu_call(_merge_partitions_cpu, g * rows * d * n_parts, part_m, part_l, part_acc, n_comp_parts, signs, False,
                 signs, out)
    else:
        if d > MAX_HEAD_DIM:
            raise ValueError(f"q: the CUDA kernel supports head_dim <= {MAX_HEAD_DIM}, got {d}")
        blocks, threads = _backend.cuda_grid(g * n_parts * rows, threads=max(32, min(rows, 128)))
        _paged_decode_attention_cuda[blocks, threads](*args)
        blocks, threads = _backend.cuda_grid(g * rows)
        _merge_partitions_cuda[blocks, threads](part_m, part_l, part_acc, n_comp_parts, signs, False, signs, out)
    return out.reshape(n_seq, hq, ql, d)
