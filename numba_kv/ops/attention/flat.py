"""Decode attention computed straight from packed codes (no dequantized K/V in memory).

Math.  With the forward block rotation ``F = D_s H`` and a
stored token ``k̂_b = |a_b| Fᵀ c[idx_b]`` per 32-block ``b``:

* ``⟨q_b, k̂_b⟩ = |a_b| ⟨F q_b, c[idx_b]⟩`` — rotate each query block **once** and score
  tokens against codebook values, never inverse-rotating a key;
* ``Σ_t p_t v̂_{t,b} = Fᵀ Σ_t p_t |a^v_{t,b}| c[idx^v_{t,b}]`` — accumulate weighted
  centroids in the rotated domain and inverse-rotate once per block at the end.

Work decomposition (flash-decoding): for every KV row ``g`` (= batch × KV head) the
tokens are cut into partitions; each work item runs an online softmax for all
``G·q_len`` query rows of that KV head over one partition (GQA: a token's codes are
unpacked once and reused by the whole group) and writes ``(m, l, acc)`` (Dao et al.,
"Flash-Decoding"; the online softmax of Milakov & Gimelshein, arXiv:1805.02867).  A merge step
combines partitions by log-sum-exp, inverse-rotates the compressed part, adds the exact
part (full-precision window/sink tokens, accumulated unrotated) and normalizes.

Every token carries an absolute position: compressed tokens are ``comp_pos0 + t``, exact
tokens read theirs from ``exact_pos``.  Query row ``r`` sits at position
``q_pos0 + r % q_len``; with ``causal`` it sees tokens at positions ``<=`` its own.
``logit_bias[g, r, pos]`` is added to the scaled logit (``softmax_scale · q·k``).

This module is the flat front end: :func:`decode_attention` validates its arguments and
:func:`fused_attention_rows` (the caches' entry, which validates nothing) runs the
:class:`~numba_kv.ops.attention.plan.AttentionPlan` of its shapes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ... import _backend
from ..._config import MAX_HEAD_DIM
from ..._validate import Q_MAX, check_bool, check_float_array, check_partition_size, check_shape, check_softmax_scale
from ..codebook import Codebook, get_codebook
from ..finite import all_finite, check_finite, check_finite_stats, check_rotation_input
from ..gather import to_like
from ..hadamard import rotate32
from ..headquant import head_signs, rotate_head
from ..lowrank import project_into
from ..qjl import qjl_constant, sketch_arg
from .layout import CodeLayout
from .plan import attention_plan

__all__ = ["decode_attention", "fused_attention_rows"]

#: Largest ``|k_exact|``, ``|v_exact|`` the op takes: the compressed caches' input limit.  With
#: ``|q| <= 2**64`` (:data:`~numba_kv._validate.Q_MAX`), ``head_dim <= 512`` and a scale
#: ``<= 2**30``, a logit stays below ``2**124``, and a value sum over ``< 2**32`` tokens below
#: ``2**53``: float32 holds both.
EXACT_MAX = float(2 ** 21)


def fused_attention_rows(qr: Any, q: Any, kc: Any, ks: Any, vc: Any, vs: Any, n_comp: int, comp_pos0: int,
                         ke: Any, ve: Any, n_exact: int, exact_pos: Any, klayout: CodeLayout, vlayout: CodeLayout,
                         softmax_scale: float, bias: Any, q_pos0: int, q_len: int, causal: bool = True,
                         part_size: int | None = None, head_signs: Any = None, qjl: Any = None,
                         exact_rotated: bool = False, exact_scales: tuple | None = None) -> Any:
    """Fused decode attention over compressed + exact tokens, in the ``[g, rows, d]`` layout.

    No validation (callers validate): ``qr``/``q`` ``[n_g, rows, d]`` float32 (rotated and
    raw queries), codes/scales ``[n_g, capacity, ·]`` with ``n_comp`` live tokens laid out
    as ``klayout``/``vlayout``, exact ``ke``/``ve`` ``[n_g, >= n_exact, d]`` (first
    ``n_exact`` live; float32, binary16 as ``float16`` or ``uint16`` bits, or int8 with
    ``exact_scales`` = ``(k_scales, v_scales)``, uint16 binary16 ``[n_g, >= n_exact, 1]``,
    value ``int8 · scale``; read in that form by the kernel, no float32 copy) with int32
    positions ``exact_pos``, ``bias`` ``[n_g, rows,
    total_positions]`` or ``None``.  ``head_signs`` (float32 ``[d]``): the compressed
    tokens use the whole-head rotation with these signs (``None``: 32-block rotation).
    ``qjl`` = ``(sq, signs, norms, const)``: add the QJL correction ``const·‖r_t‖·⟨sq,
    σ_t⟩`` (``sq`` ``[n_g, rows, m]`` = ``S q``, ``signs`` uint8 ``[n_g, capacity, m/8]``,
    ``norms`` uint16 ``[n_g, capacity]``) to every compressed token's ``q·k``.
    ``exact_rotated``: ``ke``/``ve`` are in the compressed tokens' rotated domain (a rotated
    int8 window) and ``q`` is ``qr``; the merge then rotates every partition's sum back, the
    exact ones included.  Returns ``out`` ``[n_g, rows, d]`` float32 on the device of ``qr``.
    """
    n_g, rows, d = (int(x) for x in qr.shape)
    plan = attention_plan(qr, paged=False, n_g=n_g, rows=rows, d=d, klayout=klayout, vlayout=vlayout,
                          v_width=int(vc.shape[2]), has_bias=bias is not None, has_qjl=qjl is not None)
    return plan.run_flat(qr, q, kc, ks, vc, vs, n_comp, comp_pos0, ke, ve, n_exact, exact_pos, softmax_scale, bias,
                         q_pos0, q_len, causal, part_size, head_signs, qjl, exact_rotated, exact_scales)


def _codebook_for(side: str, name: str, bits: Any, norm_mode: str, codebook: Any, block: int = 32,
                  head: bool = False):
    """The codebook of side ``side`` (``"k"``/``"v"``): ``codebook`` (``{side}_codebook``) if
    given, else the width ``bits`` of argument ``name`` (``bits``, ``k_bits`` or ``v_bits``)."""
    if codebook is not None:
        if not isinstance(codebook, Codebook):
            raise TypeError(f"{side}_codebook: expected a Codebook, got {type(codebook).__name__}")
        return codebook
    top = 5 if head else 4  # 5-bit codebooks: whole-head codes only
    where = " with rotation='head'" if top == 5 else " (5 needs rotation='head')"
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)):
        raise TypeError(f"{name}: expected an int in 1..{top}{where}, got {type(bits).__name__} {bits!r}")
    if not 1 <= int(bits) <= top:
        raise ValueError(f"{name}: expected an int in 1..{top}{where}, got {bits!r}")
    return get_codebook(int(bits), norm_mode, block=block)


def decode_attention(q: Any, k_codes: Any, k_scales: Any, v_codes: Any, v_scales: Any, *, bits: int = 3,
                     norm_mode: str = "maxnorm", k_bits: int | None = None, v_bits: int | None = None,
                     k_codebook: Any = None, v_codebook: Any = None, softmax_scale: float | None = None,
                     logit_bias: Any = None, causal: bool = True, k_exact: Any = None, v_exact: Any = None,
                     exact_positions: Any = None, partition_size: int | None = None,
                     rotation: str = "block", k_qjl: tuple | None = None, check_values: bool = True,
                     backend: str = "auto") -> Any:
    """Softmax attention computed directly from block-quantized K/V codes.

    Parameters
    ----------
    q : float array, shape ``(batch, num_heads, q_len, head_dim)``
        Queries; ``num_heads`` a multiple of ``num_kv_heads`` (contiguous GQA groups);
        finite, ``|q| <= 2**64``.
    k_codes, v_codes : uint8 array, shape ``(batch, num_kv_heads, T, head_dim·bits/8)``
    k_scales, v_scales : uint16 array, shape ``(batch, num_kv_heads, T, head_dim/32)``
        As returned by :func:`numba_kv.quantize_blocks` on ``[batch, num_kv_heads, T, d]``
        (with ``rotation="head"``: ``(…, T, 1)`` from :func:`numba_kv.quantize_head`); no
        Inf/NaN binary16 pattern.
        Compressed token ``t`` sits at position ``t`` (after any exact tokens, see below).
    bits, norm_mode, k_bits, v_bits, k_codebook, v_codebook
        Codebooks of K and V (``k_bits``/``v_bits`` default to ``bits``).
    softmax_scale : float, optional
        Defaults to ``1/sqrt(head_dim)``; in ``(0, 2**30]`` (larger ones could overflow the
        float32 logits).
    logit_bias : float array, shape ``(batch, num_heads, q_len, total_tokens)``, optional
        Added to the scaled logits (units of ``softmax_scale·q·k``), indexed by position;
        finite (``finfo(float32).min`` works as an additive mask). A sum beyond the float32
        range is clamped to ``±finfo(float32).max``, so the output stays finite.
    causal : bool
        Query ``i`` sits at position ``total_tokens − q_len + i`` and sees positions ``<=``
        its own (speculative-decoding verification); ``False`` = every query sees all.
    k_exact, v_exact : float array, shape ``(batch, num_kv_heads, E, head_dim)``, optional
        Extra full-precision tokens (a recent window, sinks) joined in the same softmax;
        finite, ``|x| <= 2**21`` (:data:`EXACT_MAX`, the compressed caches' input limit: logits
        and sums stay finite in float32).
    exact_positions : int array, shape ``(E,)``, optional
        Positions of the exact tokens, each in ``[0, T+E)`` (compressed token ``t`` sits at
        ``t``; tokens may share a position, and its mask and bias); default ``T, T+1, …`` (a
        window after the codes).
    partition_size : int, optional
        Tokens per split-K partition, >= 1 (default: enough partitions for every thread).
    rotation : {"block", "head"}
        How the codes were made: :func:`numba_kv.quantize_blocks` (32-block rotation, one
        scale per block) or :func:`numba_kv.quantize_head` (whole-head rotation, one norm
        per vector, L2 codebooks for ``head_dim`` dimensions; ``norm_mode`` is ignored).
    k_qjl : tuple ``(signs, norms, sketch)``, optional
        TurboQuant's QJL correction of the keys, added to every compressed token's ``q·k``
        inside the kernel: ``signs`` uint8 ``(batch, num_kv_heads, T, m/8)`` and ``norms``
        uint16 ``(batch, num_kv_heads, T)`` from :func:`numba_kv.qjl_quantize` of the key
        residuals ``k − k̂``, and the ``sketch`` float32 ``(m, head_dim)`` they were made
        with (``None``: :func:`numba_kv.make_sketch`).
    check_values : bool
        Read the values the ranges above constrain: ``q``, the exact tokens, the logit bias,
        the scale / norm patterns (one pass over each; on a GPU each ends with a
        device-to-host read, and the scales are about a seventh of a 3-bit cache's bytes).
        ``False`` when the caller vouches for them (codes and scales from
        :func:`numba_kv.quantize_blocks` / :func:`numba_kv.quantize_head`, queries it checked):
        the kernels then read what they are given.  Shapes, dtypes, devices and
        ``exact_positions`` (they address memory) are checked either way.
    backend : {"auto", "cpu", "cuda"}
        Check that the data lives where expected (never moves it).

    Returns
    -------
    out : float32 array, shape ``(batch, num_heads, q_len, head_dim)``, on the device of
        ``q``.

    Raises
    ------
    ValueError, TypeError
        Mismatched shapes, group counts, dtypes or devices; values outside the ranges above
        (NaN/Inf, ``|q| > 2**64``, exact tokens beyond ``2**21``, Inf/NaN scale patterns,
        positions outside ``[0, T+E)``); the message names the argument.

    Examples
    --------
    >>> import numpy as np, numba_kv as nk
    >>> rng = np.random.default_rng(0)
    >>> k, v = rng.standard_normal((2, 1, 2, 100, 64)).astype(np.float32)
    >>> kc, ks = nk.quantize_blocks(k, 3); vc, vs = nk.quantize_blocks(v, 3)
    >>> q = rng.standard_normal((1, 4, 1, 64)).astype(np.float32)
    >>> decode_attention(q, kc, ks, vc, vs).shape
    (1, 4, 1, 64)
    """
    _backend.resolve_device(backend, q=q, k_codes=k_codes, k_scales=k_scales, v_codes=v_codes,
                            v_scales=v_scales, logit_bias=logit_bias, k_exact=k_exact, v_exact=v_exact,
                            exact_positions=exact_positions)
    check_float_array("q", q, 4)
    check_values, causal = check_bool("check_values", check_values), check_bool("causal", causal)
    b, hq, ql, d = (int(s) for s in q.shape)
    if d % 32 or d == 0:
        raise ValueError(f"q: expected head_dim a positive multiple of 32, got shape {(b, hq, ql, d)}")
    if rotation not in ("block", "head"):
        raise ValueError(f"rotation: expected 'block' or 'head', got {rotation!r}")
    head = rotation == "head"
    if head and (d & (d - 1) or d > MAX_HEAD_DIM):
        raise ValueError(f"q: rotation='head' needs a power-of-two head_dim <= {MAX_HEAD_DIM}, got {d}")
    cb_mode, cb_block = ("l2", d) if head else (norm_mode, 32)
    kcb = _codebook_for("k", "bits" if k_bits is None else "k_bits", bits if k_bits is None else k_bits, cb_mode,
                        k_codebook, cb_block, head)
    vcb = _codebook_for("v", "bits" if v_bits is None else "v_bits", bits if v_bits is None else v_bits, cb_mode,
                        v_codebook, cb_block, head)
    n_scales = 1 if head else d // 32
    hkv, T = _check_codes((b, hq, ql, d), k_codes, k_scales, v_codes, v_scales, kcb.bits, vcb.bits, n_scales)
    n_exact = _check_exact(k_exact, v_exact, b, hkv, d, check_values)
    total = T + n_exact
    if total == 0:
        raise ValueError("k_codes: expected at least one token (T + E >= 1), got 0")
    if ql > total and causal:
        raise ValueError(f"q: expected q_len <= total tokens {total} with causal=True, got {ql}")
    epos = _exact_positions(exact_positions, q, T, n_exact)
    if check_values:
        for name, a in (("k_scales", k_scales), ("v_scales", v_scales)):
            check_f16_bits(name, a)
    softmax_scale = d ** -0.5 if softmax_scale is None else check_softmax_scale(softmax_scale)
    partition_size = check_partition_size(partition_size)
    if check_values:
        check_rotation_input("q", q, d if head else 32)  # finite, and its rotation fits float32
        _check_max("q", q, Q_MAX, "2**64")
    g = b * hkv
    rows = (hq // hkv) * ql
    q3 = _backend.ascontiguous_f32("q", q).reshape(g, rows, d)
    bias3 = None
    if logit_bias is not None:
        check_float_array("logit_bias", logit_bias, 4)
        check_shape("logit_bias", logit_bias, (b, hq, ql, total), ("batch", "num_heads", "q_len", "total_tokens"))
        if check_values:
            check_finite("logit_bias", logit_bias)
        bias3 = _backend.ascontiguous_f32("logit_bias", logit_bias).reshape(g, rows, total)
    if n_exact:
        ke = _flat(_backend.ascontiguous_f32("k_exact", k_exact), g, d)
        ve = _flat(_backend.ascontiguous_f32("v_exact", v_exact), g, d)
    else:
        ke = ve = _backend.empty(q3, (g, 0, d), np.float32)
    qjl = None if k_qjl is None else _qjl_args(k_qjl, q3, b, hkv, T, d, check_values)
    if head:
        qr = rotate_head(q3)  # the whole-head rotation of the queries, once per step
        hs = _backend.constant(q3, head_signs(d))
    else:
        qr = rotate32(q3)  # forward-rotate every 32-block of the queries, once per step
        hs = None
    sgroup = d // 32 if head else 1
    out = fused_attention_rows(qr, q3, _flat(k_codes, g, int(k_codes.shape[3])), _flat(k_scales, g, n_scales),
                               _flat(v_codes, g, int(v_codes.shape[3])), _flat(v_scales, g, n_scales), T, 0, ke, ve,
                               n_exact, epos, CodeLayout.uniform(kcb, d, sgroup), CodeLayout.uniform(vcb, d, sgroup),
                               softmax_scale, bias3, total - ql, ql, causal, partition_size, head_signs=hs, qjl=qjl)
    return out.reshape(b, hq, ql, d)


def _flat(a: Any, g: int, w: int) -> Any:
    """``[batch, heads, n, w]`` -> ``[batch·heads, n, w]`` (contiguous, on its device)."""
    xp = _backend.xp_of(a)
    a = xp.ascontiguousarray(a) if xp is not None else a
    return a.reshape(g, int(a.shape[2]), w)


def _check_codes(qshape: tuple, k_codes: Any, k_scales: Any, v_codes: Any, v_scales: Any, kbits: int, vbits: int,
                 n_scales: int) -> tuple[int, int]:
    """Validate the packed K/V of :func:`decode_attention`; returns ``(num_kv_heads, T)``."""
    b, hq, _, d = qshape
    if len(k_codes.shape) != 4:
        raise ValueError(f"k_codes: expected 4-D [batch, num_kv_heads, T, packed], got shape {tuple(k_codes.shape)}")
    hkv, T = int(k_codes.shape[1]), int(k_codes.shape[2])
    if hkv < 1:
        raise ValueError(f"k_codes: expected num_kv_heads >= 1 (axis 1), got shape {tuple(k_codes.shape)}")
    if hq % hkv:
        raise ValueError(f"q: expected num_heads to be a multiple of num_kv_heads={hkv}, got shape {qshape}")
    for name, a, width, dt in (("k_codes", k_codes, d * kbits // 8, np.uint8),
                               ("k_scales", k_scales, n_scales, np.uint16),
                               ("v_codes", v_codes, d * vbits // 8, np.uint8),
                               ("v_scales", v_scales, n_scales, np.uint16)):
        if np.dtype(a.dtype) != dt:
            raise TypeError(f"{name}: expected dtype {np.dtype(dt)}, got {a.dtype}")
        check_shape(name, a, (b, hkv, T, width), ("batch", "num_kv_heads", "T", "width"))
    return hkv, T


def _check_exact(k_exact: Any, v_exact: Any, b: int, hkv: int, d: int, check_values: bool) -> int:
    """Validate the exact tokens of :func:`decode_attention`; returns their count ``E``."""
    if (k_exact is None) != (v_exact is None):
        given, missing = ("k_exact", "v_exact") if v_exact is None else ("v_exact", "k_exact")
        raise ValueError(f"{missing}: expected an array given together with {given}, got None")
    if k_exact is None:
        return 0
    for name, a in (("k_exact", k_exact), ("v_exact", v_exact)):
        check_float_array(name, a, 4)
        check_shape(name, a, (b, hkv, None, d), ("batch", "num_kv_heads", "E", "head_dim"))
        if check_values:
            _check_max(name, a, EXACT_MAX, "2**21")
    n_exact = int(k_exact.shape[2])
    if int(v_exact.shape[2]) != n_exact:
        raise ValueError(f"v_exact: expected E={n_exact} tokens like k_exact, got shape {tuple(v_exact.shape)}")
    return n_exact


def _exact_positions(exact_positions: Any, q: Any, T: int, n_exact: int) -> Any:
    """The exact tokens' positions as an int array on the device of ``q`` (default ``T, T+1, …``)."""
    if exact_positions is None:
        pos = np.arange(T, T + n_exact, dtype=np.int32)
        return to_like(q, pos if pos.size else np.zeros(1, np.int32))  # never read when E = 0
    if np.dtype(exact_positions.dtype).kind not in "iu":  # (the library's rule: dtype → TypeError)
        raise TypeError(f"exact_positions: expected an int array of shape ({n_exact},), got "
                        f"{exact_positions.dtype} {tuple(exact_positions.shape)}")
    if tuple(exact_positions.shape) != (n_exact,):
        raise ValueError(f"exact_positions: expected an int array of shape ({n_exact},), got "
                         f"{exact_positions.dtype} {tuple(exact_positions.shape)}")
    # the kernels index the logit bias by position (and mask by it): a position outside
    # [0, total) read out of bounds (tokens may share a position: they share its mask and bias)
    host = _backend.to_host(exact_positions)
    if host.size and not (0 <= int(host.min()) and int(host.max()) < T + n_exact):
        raise ValueError(f"exact_positions: expected positions in [0, {T + n_exact}) (the total tokens), got "
                         f"values from {int(host.min())} to {int(host.max())}")
    xp = _backend.xp_of(exact_positions)
    return exact_positions.astype(np.int32) if xp is not None else exact_positions


def _check_max(name: str, a: Any, limit: float, label: str) -> None:
    """``ValueError`` naming ``name`` unless ``a`` is finite with ``|a| <= limit``."""
    amax = check_finite_stats(name, a).amax
    if amax > limit:
        raise ValueError(f"{name}: expected |{name}| <= {label} (logits and sums stay finite in float32), "
                         f"got max {amax:.6g}")


def check_f16_bits(name: str, a: Any) -> None:
    """``ValueError`` naming ``name`` if the binary16 bit patterns ``a`` (uint16: scales, norms;
    the sign bit may be a flag) hold an Inf or NaN pattern: decoded as finite garbage otherwise."""
    if not all_finite(a.view(np.float16)):
        raise ValueError(f"{name}: expected finite binary16 bit patterns, got an Inf or NaN pattern")


def _qjl_args(k_qjl: Any, q3: Any, b: int, hkv: int, T: int, d: int, check_values: bool) -> tuple:
    """Validate ``k_qjl = (signs, norms, sketch)`` and project the queries: the ``qjl``
    argument of :func:`fused_attention_rows`."""
    if not isinstance(k_qjl, tuple) or len(k_qjl) != 3:
        raise TypeError("k_qjl: expected a tuple (signs, norms, sketch), got "
                        f"{type(k_qjl).__name__}")
    signs, norms, sketch = k_qjl
    _backend.resolve_device("auto", q=q3, **{"k_qjl[0]": signs, "k_qjl[1]": norms, "k_qjl[2]": sketch})
    if np.dtype(signs.dtype) != np.uint8:
        raise TypeError(f"k_qjl[0]: expected signs of dtype uint8, got {signs.dtype}")
    if np.dtype(norms.dtype) != np.uint16:
        raise TypeError(f"k_qjl[1]: expected norms of dtype uint16 (binary16 bits), got {norms.dtype}")
    if len(signs.shape) != 4 or int(signs.shape[3]) < 1:
        raise ValueError(f"k_qjl[0]: expected signs of shape (batch, num_kv_heads, T, m/8), got {tuple(signs.shape)}")
    mb = int(signs.shape[3])
    check_shape("k_qjl[0]", signs, (b, hkv, T, mb), ("batch", "num_kv_heads", "T", "m/8"))
    check_shape("k_qjl[1]", norms, (b, hkv, T), ("batch", "num_kv_heads", "T"))
    if check_values:
        check_f16_bits("k_qjl[1]", norms)
    m = 8 * mb
    sk = sketch_arg(sketch, d, m, q3, "k_qjl[2]")
    g, rows, _ = q3.shape
    xp = _backend.xp_of(q3)
    contig = (lambda a: xp.ascontiguousarray(a)) if xp is not None else (lambda a: a)
    sq = _backend.empty(q3, (g, rows, m), np.float32)
    project_into(q3, _backend.zeros(q3, (1, d), np.float32), sk.reshape(1, m, d), sq)
    return sq, contig(signs).reshape(g, T, mb), contig(norms).reshape(g, T), np.float32(qjl_constant(m))

