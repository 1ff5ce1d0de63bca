"""``TurboQuantCache``: TurboQuant_prod (PolarQuant + a 1-bit QJL sketch of the key
residual), implemented as the paper defines it (Zandieh et al., arXiv:2504.19874) — not as
turboquant-rs (the Rust implementation whose tq3_0 block format this package follows) ships it.

Per compressed key, at ``k_bits = b``:

* the block quantizer (:class:`~numba_kv.caches.polarquant.PolarQuantCache`, any norm
  mode) with the ``b − 1``-bit codebook, stored in ``b − 1``-bit slots (turboquant-rs wastes
  a bit per index by storing them in ``b``-bit slots);
* the residual ``r = k − k̂`` sketched as ``σ = sign(S r)`` (``m = head_dim`` bits,
  packed) plus ``‖r‖`` as binary16.  ``S`` is an ``m × d`` matrix of i.i.d. ``N(0, 1)``
  entries from NumPy's PCG64 with its own seed (``qjl_seed``), independent of the fixed
  block rotation — turboquant-rs's ``±1`` hash alternates and some forks reused the rotation
  seed, which correlates the sketch with the quantization error;
* the estimator ``q·k ≈ q·k̂ + ‖r‖·√(π/2)/m·⟨S q, σ⟩`` (unbiased for Gaussian ``S``;
  QJL, Zandieh, Daliri, Han, arXiv:2406.03482).

Values get **no** QJL and all ``v_bits`` go to the MSE quantizer (PQO, ``v_bits``-bit
codebook): attention outputs are softmax-weighted averages of values, whose error is set
by the values' MSE — an unbiased inner product buys nothing there.  (turboquant-rs gives
values only the ``b − 1``-bit codebook, so its TQ3 has worse values than PQO3 and costs
more.)  TQ3 at ``head_dim = 128`` therefore stores keys at ``2 + 0.5 + 1 + 16/128 =
3.625`` bits/value and values at ``3.5``: 3.5625 on average.

The correction is a logit term.  With ``decode_output="fused"`` (default) the kernels add
it inside the attention loop (CPU twin: one extra small GEMM per tile on the unpacked
signs; CUDA: one signed sum per token).  With ``decode_output="dequantized"`` the cache
returns ``k̂`` and ``logit_bias = softmax_scale · ‖r_t‖·√(π/2)/m·⟨S q, σ_t⟩`` for the
compressed tokens (0 for window/sink tokens), in the units of the scaled logits (see
:mod:`numba_kv.caches.protocol`).  The first prefill returns the original K/V and no bias
(nothing was lost yet); a later prefill returns the bias only if ``q`` is passed (with
the softmax scale ``1/√head_dim``: prefill has no :class:`AttendConfig`).

Why it is not the default: QJL turns a small, uniform shrinkage of the logits (which acts
like a slightly higher softmax temperature and keeps the ranking) into more *random* logit
error, which softmax exponentiates.  The paper's own bounds show it: at 3 bits in total
TurboQuant_prod's inner-product distortion (≈ 0.18/d, arXiv:2504.19874 Theorem 2) is about
six times the ≈ 0.03/d of spending all 3 bits on the MSE quantizer (Theorem 1).  At equal bytes PQO / the
unbiased rescale (``unbiased=True``) are better; the README's recommendation table has the
numbers.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import _backend
from ..ops.qjl import make_sketch, qjl_constant, qjl_scores_into, qjl_signs_into
from ._layer import BufferSpec, LayerState, add_bias, finite_astype
from .config import PolarQuantConfig, TurboQuantConfig, TurboQuantFields
from .polarquant import PolarQuantCache
from .protocol import AttendConfig, DecodeOutput, Dequantized, DequantResult

__all__ = ["TurboQuantCache"]


class TurboQuantCache(TurboQuantFields, PolarQuantCache):
    """TurboQuant_prod KV cache: ``(b−1)``-bit keys + 1-bit QJL residual sketch, ``b``-bit
    MSE values, fused decode attention with the QJL correction inside the kernel.

    Parameters
    ----------
    num_layers, num_kv_heads, head_dim : int
        Model geometry; ``head_dim`` a positive multiple of 32.
    bits : {2, 3, 4, 5}
        Budget ``b``: keys use the ``b − 1``-bit codebook + 1 QJL bit, values ``b`` bits; 5
        only with ``rotation="head"`` (the 32-block codebooks stop at 4 bits).
    k_bits, v_bits : {2, 3, 4, 5}, optional
        Separate budgets for keys and values (5 as for ``bits``).
    **options
        The fields of :class:`~numba_kv.caches.config.TurboQuantConfig`: ``qjl_seed``
        (seed of the Gaussian sketch, default :data:`numba_kv.ops.qjl.SKETCH_SEED`),
        ``qjl_dim`` (sketch rows ``m``: bits per key residual; default ``head_dim``; a
        multiple of 8), and everything of :class:`~numba_kv.caches.polarquant.PolarQuantCache`
        (``norm_mode``, ``rotation``, ``unbiased``, ``residual_length``, ``sink_tokens``,
        ``key_center``, ``decode_output``, ...) except ``mode``, ``outlier_channels``, ``vq``
        and ``norm_bits=8`` (``ValueError``).
        The validated configuration is ``cache.config``.

    Notes
    -----
    Extra storage per layer: ``k_qjl`` uint8 ``[rows, capacity, m/8]`` and ``k_rnorm``
    uint16 (binary16 bits) ``[rows, capacity, 1]``, counted by ``memory_usage``.  NumPy and
    CuPy arrays only (the residual is formed with array arithmetic).

    Examples
    --------
    >>> import numpy as np
    >>> cache = TurboQuantCache(num_layers=1, num_kv_heads=2, head_dim=128, bits=3)
    >>> cache.k_bits_per_value, cache.v_bits_per_value
    (3.625, 3.5)
    """

    config_class = TurboQuantConfig
    config: TurboQuantConfig

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, bits: int = 3, **options: Any) -> None:
        super().__init__(num_layers, num_kv_heads, head_dim, bits, **options)

    def _setup(self, cfg: PolarQuantConfig) -> None:
        super()._setup(cfg)
        self.sketch = make_sketch(self.head_dim, self.qjl_dim, self.qjl_seed)

    def _buffer_spec(self) -> BufferSpec:
        spec = super()._buffer_spec()
        spec["k_qjl"] = (self.qjl_dim // 8, np.uint8, None)
        spec["k_rnorm"] = (1, np.uint16, None)
        return spec

    def _append(self, st: LayerState, dev: str, k: Any, v: Any) -> int:
        if _backend.xp_of(k) is None:
            raise TypeError("k: TurboQuantCache needs NumPy or CuPy arrays, got a Numba device array")
        return super()._append(st, dev, k, v)

    def _steady_regime(self, st: LayerState, n: int) -> Any:
        """``None``: no step of this cache is a replay of its launches alone (its key residual
        and projected queries are CuPy arithmetic between them), so a
        :class:`numba_kv.DecodeStep` runs every step in full."""
        return None

    def _norms2d(self, st: LayerState) -> Any:
        nb = st.buffers["k_rnorm"]
        return nb.reshape(nb.shape[0], nb.shape[1])

    def _compress(self, st: LayerState, name: str, x3: Any, t0: int) -> None:
        super()._compress(st, name, x3, t0)
        if name != "k":
            return
        xp = _backend.xp_of(x3)
        xhat = xp.empty(x3.shape, dtype=np.float32)
        self._decompress(st, "k", t0, xhat)
        r = xp.ascontiguousarray(x3 - xhat, dtype=np.float32)
        qjl_signs_into(r, _backend.constant(r, self.sketch), st.buffers["k_qjl"], self._norms2d(st), t0)

    def _projected_queries(self, st: LayerState, q3: Any) -> Any:
        """``S q`` ``[rows, G·q_len, m]`` for queries already in the keys' stored domain."""
        xp = _backend.xp_of(q3)
        return xp.ascontiguousarray(q3 @ _backend.constant(q3, self.sketch).T, dtype=np.float32)

    def _qjl_args(self, st: LayerState, q3: Any) -> Any:
        return (self._projected_queries(st, q3), st.buffers["k_qjl"], self._norms2d(st),
                np.float32(qjl_constant(self.qjl_dim)))

    def _logit_bias(self, st: LayerState, q: Any, softmax_scale: float) -> Any:
        """QJL logit bias ``[batch, num_heads, q_len, seq_len]`` (float32, scaled-logit
        units) of query ``q`` against the layer's stored tokens."""
        b, hq, ql, d = (int(s) for s in q.shape)
        rows = (hq // self.num_kv_heads) * ql
        g = b * self.num_kv_heads
        q3 = self._query_in(st, _backend.ascontiguous_f32("q", q).reshape(g, rows, d))
        xp = _backend.xp_of(q3)
        n_comp, n_sink = st.meta.get("n_comp", 0), st.meta.get("n_sink", 0)
        bias = xp.zeros((g, rows, st.seq_len), dtype=np.float32)
        if n_comp:
            corr = xp.empty((g, rows, n_comp), dtype=np.float32)
            qjl_scores_into(self._projected_queries(st, q3), st.buffers["k_qjl"], self._norms2d(st), n_comp,
                            self.qjl_dim, corr)
            bias[:, :, n_sink:n_sink + n_comp] = corr * np.float32(softmax_scale)
        return bias.reshape(b, hq, ql, st.seq_len)

    def _prefill_result(self, st: LayerState, q: Any, dtype: Any) -> DequantResult:
        hk, hv = self._history(st, dtype)
        if q is None:
            return DequantResult(hk, hv)
        return DequantResult(hk, hv, finite_astype(self._logit_bias(st, q, self.head_dim ** -0.5), dtype))

    def _decode_output(self, st: LayerState, q: Any, config: AttendConfig, dtype: Any, out: Any = None) -> DecodeOutput:
        if self.decode_output != "dequantized":
            return super()._decode_output(st, q, config, dtype, out)
        hk, hv = self._history(st, dtype)
        bias = self._logit_bias(st, q, config.softmax_scale)
        win = self._window_bias(st, q)
        if win is not None:  # sliding mask of a multi-token decode on a sliding layer
            bias = add_bias(bias, win.reshape(bias.shape))
        return Dequantized(DequantResult(hk, hv, finite_astype(bias, dtype)))

    def config_dict(self) -> dict[str, Any]:
        """Constructor arguments (JSON types) that rebuild this cache's configuration."""
        cfg = super().config_dict()
        for key in ("mode", "outlier_channels", "outlier_bits"):
            del cfg[key]
        return cfg
