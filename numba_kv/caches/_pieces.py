"""Layers split over KV heads (``make_cache(..., head_overrides=...)``): the routing of one
model layer to several *pieces*, each a layer of a part cache holding some of its KV heads.

A piece's part is an ordinary cache built with ``num_kv_heads = len(piece.heads)``, so the
kernels never see a head index: the mixed cache gathers the piece's KV heads out of ``k``/
``v`` and the matching query heads out of ``q`` (GQA: query head ``h`` reads KV head
``h // n_kv_groups``), lets every part run as usual, and scatters the parts' outputs back
into the full head axis.  Heads of one piece need not be contiguous; the gather works on
contiguous *runs* of heads so that NumPy and CuPy inputs are sliced (a view when the piece
is one run) and concatenated in their own namespace: no index upload, no host round trip.
Numba device arrays have neither fancy indexing nor ``concatenate``: their rows move through
the row gather/scatter kernels of :mod:`numba_kv.ops.gather`.

A call on a split layer validates every piece (shapes, values, the parts' range checks)
before any piece stores anything, so a bad input leaves the layer unchanged, as the protocol
promises; the caller (:class:`~numba_kv.caches.mixed.MixedCache`) holds the layer's own lock
around the call, so two calls on one layer cannot interleave their pieces.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from .. import _backend
from .._validate import check_kv_shapes, check_q_shape
from ..ops.gather import gather_rows, scatter_rows, to_like
from ._layer import LayeredCache
from .protocol import AttendConfig, DecodeOutput, Dequantized, DequantResult, Fused

__all__ = ["PER_HEAD_OPTIONS", "Piece", "head_runs", "put_heads", "split_call", "take_heads"]

#: the options a KV head may set on its own (``head_overrides``): choices of each vector's
#: code only.  Everything that decides which tokens a layer stores where (window, sinks,
#: sliding window, the window's dtype and rotation, key centering, the decode output) must be
#: the same for every head of a layer: its pieces share one sequence bookkeeping.
PER_HEAD_OPTIONS = ("bits", "k_bits", "v_bits", "norm_mode", "unbiased", "outlier_bits", "vq", "norm_bits")


class Piece(NamedTuple):
    """Where some KV heads of a model layer live.

    Attributes
    ----------
    part : int
        Index of the part cache.
    layer : int
        Layer inside the part.
    heads : tuple of int
        The model layer's KV heads this piece stores, in the part's head order.
    """

    part: int
    layer: int
    heads: tuple[int, ...]


def head_runs(heads: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """``heads`` as ``(first, end)`` runs of consecutive heads, in order
    (``(0, 2, 3, 5)`` -> ``((0, 1), (2, 4), (5, 6))``)."""
    runs: list[list[int]] = []
    for h in heads:
        if runs and runs[-1][1] == h:
            runs[-1][1] = h + 1
        else:
            runs.append([h, h + 1])
    return tuple((a, b) for a, b in runs)


def _row_index(runs: tuple[tuple[int, int], ...], group: int, batch: int, total: int) -> np.ndarray:
    """Rows of ``[batch·total·group, ...]`` that the heads of ``runs`` (each standing for
    ``group`` consecutive heads of the axis) occupy, batch row by batch row."""
    own = [h for a, b in runs for h in range(a * group, b * group)]
    return np.array([r * total * group + h for r in range(batch) for h in own], dtype=np.int32)


def take_heads(a: Any, runs: tuple[tuple[int, int], ...], group: int, name: str) -> Any:
    """The heads ``runs`` of ``a`` ``[batch, heads·group, ...]`` (``group`` consecutive heads of
    the axis per entry of ``runs``: 1 for K/V, ``n_kv_groups`` for queries), in the array's
    namespace: a view for one run of a NumPy/CuPy array, else a copy."""
    xp = _backend.xp_of(a)
    if xp is not None:
        views = [a[:, lo * group:hi * group] for lo, hi in runs]
        return views[0] if len(views) == 1 else xp.concatenate(views, axis=1)
    a = _backend.ascontiguous_f32(name, a)  # what the parts demand of Numba device arrays anyway
    shape = tuple(int(s) for s in a.shape)
    width = int(np.prod(shape[2:]))
    idx = _row_index(runs, group, shape[0], shape[1] // group)
    out = _backend.empty(a, (idx.size, width), a.dtype)
    gather_rows(a.reshape(shape[0] * shape[1], width), to_like(a, idx), out)
    return out.reshape(shape[0], idx.size // shape[0], *shape[2:])


def put_heads(outs: Sequence[Any], runs: Sequence[tuple[tuple[int, int], ...]], group: int, total: int) -> Any:
    """The inverse of :func:`take_heads`: one array ``[batch, total·group, ...]`` holding every
    piece's output ``outs[i]`` at the heads ``runs[i]``; ``None`` outputs (a piece without a
    logit bias) leave zeros.  ``None`` when every output is ``None``."""
    first = next((o for o in outs if o is not None), None)
    if first is None:
        return None
    fill = _backend.zeros if any(o is None for o in outs) else _backend.empty
    shape = (int(first.shape[0]), total * group, *(int(s) for s in first.shape[2:]))
    xp = _backend.xp_of(first)
    if xp is not None:
        full = fill(first, shape, first.dtype)
        for o, rs in zip(outs, runs):
            off = 0
            for lo, hi in rs if o is not None else ():
                n = (hi - lo) * group
                full[:, lo * group:hi * group] = o[:, off:off + n]
                off += n
        return full
    width = int(np.prod(shape[2:]))
    full = fill(first, (shape[0] * shape[1], width), first.dtype)
    for o, rs in zip(outs, runs):
        if o is not None:
            idx = _row_index(rs, group, shape[0], total)
            scatter_rows(o.reshape(idx.size, width), to_like(first, idx), full)
    return full.reshape(*shape)


class _Call(NamedTuple):
    """One piece's share of a call, validated: its part, the part's layer state, the device,
    the range statistics and the piece's arrays."""

    part: LayeredCache
    st: Any
    dev: str
    stats: Any
    k: Any
    v: Any
    q: Any
    runs: tuple[tuple[int, int], ...]


def _validated(pieces: Sequence[tuple[LayeredCache, int, tuple[int, ...]]], num_kv_heads: int, head_dim: int,
               k: Any, v: Any, q: Any, config: AttendConfig | None, decode: bool) -> tuple[list[_Call], int]:
    """Check the full arrays' shapes (a piece's share of a wrong-sized array could look right),
    then gather and validate every piece's share as its part would; return the shares and the
    GQA group size."""
    # the batch a filled layer holds, checked here too: the pieces' own check would show their share's shape
    part, j, _ = pieces[0]
    st = part._layers[j]  # noqa: SLF001
    dev = check_kv_shapes(k, v, num_kv_heads, head_dim, batch=st.batch if st.seq_len > 0 else None)
    group = 1
    if q is not None or decode:
        if q is None:
            raise ValueError("q: expected an array [batch, num_heads, q_len, head_dim], got None")
        group = check_q_shape(q, k.shape[0], num_kv_heads, head_dim, None if config is None else config.n_kv_groups,
                              q_len=k.shape[2], device=dev)
    calls = []
    for part, j, heads in pieces:
        runs = head_runs(heads)
        kp, vp = take_heads(k, runs, 1, "k"), take_heads(v, runs, 1, "v")
        qp = None if q is None else take_heads(q, runs, group, "q")
        # the halves of LayeredCache.prefill/decode, run over every piece before any stores
        _, pdev, stats = part._validate(j, kp, vp, qp, config, need_q=decode)  # noqa: SLF001
        calls.append(_Call(part, part._layers[j], pdev, stats, kp, vp, qp, runs))  # noqa: SLF001
    return calls, group


def split_call(pieces: Sequence[tuple[LayeredCache, int, tuple[int, ...]]], num_kv_heads: int, head_dim: int,
               k: Any, v: Any, q: Any, config: AttendConfig | None, out: Any = None) -> DequantResult | DecodeOutput:
    """``prefill`` (``config`` ``None``) or ``decode`` of a layer split into ``pieces``
    ``(part, part layer, heads)``: every piece validated first (under all the pieces' locks
    the parts' range checks too), then every piece stores and answers; the answers are put
    back together on the full head axis (and copied into a decode's ``out``, checked with
    the rest before anything is stored).  The caller holds the model layer's lock."""
    decode = config is not None
    if out is not None and q is not None:  # (a missing q: _validated names it)
        # the shapes first (out is checked against q), then every piece must fuse and out fit the whole layer
        dev = check_kv_shapes(k, v, num_kv_heads, head_dim)
        check_q_shape(q, k.shape[0], num_kv_heads, head_dim, config.n_kv_groups, q_len=k.shape[2], device=dev)
        for part, _, _ in pieces:
            part._check_decode_out(out, q, k, v)  # noqa: SLF001
    calls, group = _validated(pieces, num_kv_heads, head_dim, k, v, q, config, decode)
    with contextlib.ExitStack() as stack:
        for c in calls:
            stack.enter_context(c.st.lock)
        for c in calls:
            if c.stats is not None:
                c.part._check_range(c.st, c.k, c.v, c.stats)  # noqa: SLF001
        # nothing below raises on validated input (every piece shares the configuration that
        # decides what _append accepts, so a refusal there comes from the first piece)
        if decode:
            res = [c.part._decode_checked(c.st, c.dev, c.k, c.v, c.q, config) for c in calls]  # noqa: SLF001
        else:
            res = [c.part._prefill_checked(c.st, c.dev, c.k, c.v, c.q) for c in calls]  # noqa: SLF001
    runs = [c.runs for c in calls]
    if decode and isinstance(res[0], Fused):
        full = put_heads([r.out for r in res], runs, group, num_kv_heads)
        if out is None:
            return Fused(full)
        if _backend.xp_of(out) is None:  # a Numba device array: a device-to-device copy
            out.copy_to_device(full)
        else:
            out[...] = full
        return Fused(out)
    dq = [r.result if decode else r for r in res]
    if not decode and all(r.k is c.k and r.v is c.v for r, c in zip(dq, calls)):
        return DequantResult(k, v)  # the layer was empty: the input itself, as a plain cache returns it
    out = DequantResult(put_heads([r.k for r in dq], runs, 1, num_kv_heads),
                        put_heads([r.v for r in dq], runs, 1, num_kv_heads),
                        put_heads([r.logit_bias for r in dq], runs, group, num_kv_heads))
    return Dequantized(out) if decode else out
