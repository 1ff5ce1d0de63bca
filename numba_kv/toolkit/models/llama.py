"""NumPy forward pass of a Llama-family or Gemma-3 model whose attention goes through any
:class:`~numba_kv.caches.protocol.CompressedKVCache`.

Per block: ``x += W_o · attn(rope(W_q·n), rope(W_k·n), W_v·n)`` with ``n = rmsnorm(x)``,
then ``x += W_down · (silu(W_gate·m) ⊙ W_up·m)`` with ``m = rmsnorm(x)``; finally
``logits = W_out · rmsnorm(x)`` (``W_out`` = token embedding when ``output.weight`` is
absent, i.e. tied embeddings).  Everything is float32, batch 1, matmuls through NumPy's
BLAS.

Attention and the cache
-----------------------
* Prompt tokens go through :meth:`LlamaModel.forward` in chunks of ``chunk_size``; for
  each chunk and layer the model calls ``cache.prefill(layer, k, v, q)`` and attends
  over the returned K/V (the chunk itself for an empty layer, the full history
  otherwise).
* Generated tokens go through ``cache.decode(layer, k, v, q, AttendConfig(1/sqrt(d),
  n_kv_groups))``.  A :class:`~numba_kv.caches.protocol.Fused` result is used as is; for
  :class:`~numba_kv.caches.protocol.Dequantized` the model runs softmax attention
  itself, adding ``logit_bias`` to the scaled logits.
* Causal mask: with ``S`` returned keys and ``T`` new queries, query ``i`` sees keys
  ``0 .. S - T + i``.  It is relative to the returned history, so a cache that evicts
  tokens still gets a correct mask; the RoPE position is ``start_pos + i``, tracked by
  the caller.

RoPE layout
-----------
llama.cpp's ``convert_hf_to_gguf.py`` permutes the rows of ``attn_q``/``attn_k`` of the
``llama`` architecture so that the rotation acts on *adjacent* pairs ``(2i, 2i+1)``
(``LLAMA_ROPE_TYPE_NORM`` in ``llama-model.cpp``), not on split halves (NEOX/HF
``rotate_half``).  Keys are therefore stored in the cache in that permuted layout; this
is an orthogonal per-head permutation of HF's layout, so ``q·k`` is unchanged.

Gemma-3 (``config.arch == "gemma3"``)
--------------------------------------
Gemma-3 technical report (arXiv:2503.19786), as llama.cpp runs it (``gemma3.cpp``)::

    x = embed[ids] · sqrt(dim)
    per block:  n = rmsnorm(x, attn_norm)
                q = rope(rmsnorm_head(W_q·n, q_norm)),  k = rope(rmsnorm_head(W_k·n, k_norm)),  v = W_v·n
                x += rmsnorm(W_o · attn(q, k, v), post_attention_norm)
                m = rmsnorm(x, ffn_norm)
                x += rmsnorm(W_down · (gelu_tanh(W_gate·m) ⊙ W_up·m), post_ffw_norm)
    logits = embed · rmsnorm(x, output_norm)     (soft-capped if the file says so)

* Gemma's RMSNorm multiplies by ``(1 + w)``; llama.cpp's converter stores ``1 + w`` in the
  GGUF (``convert_hf_to_gguf.py``, ``Gemma3Model``: ``norm.weight + 1``), so the weights are
  used as they are (the test suite checks the resulting perplexity against the ``+1``
  alternative).
* RoPE rotates split halves (NEOX, Gemma's converter does not permute Q/K); local layers
  use base ``rope_theta_local`` (10 000), global layers ``rope_theta`` (10⁶).
* Local layers see the last ``sliding_window`` positions, themselves included (query at
  ``p`` sees keys ``p − window < j ≤ p``).  :meth:`LlamaModel.new_cache` builds caches
  that know the windows (``sliding_window=layer_windows``): they store only what a local
  layer can still see and mask inside their (fused) decode, so local layers use
  ``cache.decode`` at any length.  With a cache that does not slide the layer, once its
  history outgrows the window the step stores the token with ``cache.prefill``, which
  returns the full dequantized history, and the model attends with the sliding mask
  (correct for any cache; memory not reduced to the window).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from numba_kv.backend import to_host
from numba_kv.caches.dense import DenseCache
from numba_kv.caches.protocol import AttendConfig, Dequantized, DequantResult, Fused
from numba_kv.caches.spec import make_cache

from .blocks import apply_rope, attention, gelu_tanh, rms_norm, rope_tables
from .calibrations import calibrated_options, model_key
from .gguf_loader import LlamaConfig, LoadedGGUF, load_gguf

__all__ = [
    "LlamaModel",
    "apply_rope",
    "attention",
    "gelu_tanh",
    "rms_norm",
    "rope_tables",
]

#: Default prompt chunk for :meth:`LlamaModel.forward` (tokens per ``cache.prefill`` call).
DEFAULT_CHUNK_SIZE = 256

CacheFactory = Callable[..., Any]


def _host(a: Any) -> np.ndarray:
    """NumPy view/copy of a cache result (CuPy / Numba device arrays are copied back)."""
    return a if isinstance(a, np.ndarray) else to_host(a)


# --------------------------------------------------------------------------------------
# building blocks
# --------------------------------------------------------------------------------------
#: geometry attributes of the library's caches and the :class:`LlamaConfig` fields they must equal
_CACHE_GEOMETRY = (("num_layers", "n_layers"), ("num_kv_heads", "n_kv_heads"), ("head_dim", "head_dim"))


def _check_start_pos(start_pos: Any) -> int:
    """``start_pos`` as an int >= 0 (``TypeError`` for a non-int or a bool, ``ValueError`` below 0)."""
    if isinstance(start_pos, bool) or not isinstance(start_pos, (int, np.integer)):
        raise TypeError(f"start_pos: expected an int >= 0, got {type(start_pos).__name__} {start_pos!r}")
    if start_pos < 0:
        raise ValueError(f"start_pos: expected an int >= 0, got {start_pos!r}")
    return int(start_pos)


def _cache_window(cache: Any, layer: int) -> int | None:
    """Sliding window the cache applies to ``layer`` itself (``None``: it does not slide)."""
    windows = getattr(cache, "layer_windows", None)
    return None if windows is None else windows[layer]


class _ExactPrompt:
    """Full-precision K/V of the tokens of one :meth:`LlamaModel.forward` call, per layer,
    for ``prefill_attention="exact"``: each chunk's attention then reads these instead of the
    cache's stored (for a compressed cache, dequantized) copies of the same tokens."""

    def __init__(self, n_layers: int, n_tokens: int) -> None:
        self.n_tokens = n_tokens
        self.k: list[np.ndarray | None] = [None] * n_layers
        self.v: list[np.ndarray | None] = [None] * n_layers
        self.filled = [0] * n_layers

    def patch(self, li: int, k: np.ndarray, v: np.ndarray, res: DequantResult) -> DequantResult:
        """Record chunk ``k``/``v`` ``[1, kv_heads, T, d]`` of layer ``li`` and return ``res``
        with its newest rows replaced by the exact K/V of this call's tokens (its logit bias,
        the sliding-window mask, depends on positions only and is kept)."""
        if self.k[li] is None:
            shape = (k.shape[0], k.shape[1], self.n_tokens, k.shape[3])
            self.k[li] = np.empty(shape, np.float32)
            self.v[li] = np.empty(shape, np.float32)
        a, t = self.filled[li], k.shape[2]
        self.k[li][:, :, a:a + t] = k
        self.v[li][:, :, a:a + t] = v
        self.filled[li] = a + t
        rk, rv = _host(res.k), _host(res.v)
        s = rk.shape[2]
        # the protocol returns the history in position order, the newest rows last; a cache
        # that evicts (sliding layers) returns fewer rows than were stored
        m = min(a + t, s)
        if m == s:  # every returned row is this call's (a fresh cache, a slid layer): no copy
            return DequantResult(self.k[li][:, :, a + t - s:a + t], self.v[li][:, :, a + t - s:a + t],
                                 res.logit_bias)
        out_k = np.array(rk, dtype=np.float32)
        out_v = np.array(rv, dtype=np.float32)
        out_k[:, :, s - m:] = self.k[li][:, :, a + t - m:a + t]
        out_v[:, :, s - m:] = self.v[li][:, :, a + t - m:a + t]
        return DequantResult(out_k, out_v, res.logit_bias)


# --------------------------------------------------------------------------------------
# model
# --------------------------------------------------------------------------------------
@dataclass
class _Layer:
    attn_norm: np.ndarray
    wq: np.ndarray
    wk: np.ndarray
    wv: np.ndarray
    wo: np.ndarray
    ffn_norm: np.ndarray
    w_gate: np.ndarray
    w_up: np.ndarray
    w_down: np.ndarray
    q_norm: np.ndarray | None = None
    k_norm: np.ndarray | None = None
    post_attn_norm: np.ndarray | None = None
    post_ffn_norm: np.ndarray | None = None


class LlamaModel:
    """Llama-family or Gemma-3 decoder in NumPy; attention through a ``CompressedKVCache``.

    Parameters
    ----------
    config : LlamaConfig
        Hyper-parameters.
    tensors : mapping of str to ndarray
        Float32 weights by GGUF name (``token_embd.weight``, ``blk.{i}.attn_q.weight``,
        ..., ``output_norm.weight``, optional ``output.weight`` and ``rope_freqs.weight``;
        Gemma-3 also ``blk.{i}.attn_q_norm.weight``, ``attn_k_norm``, ``post_attention_norm``
        and ``post_ffw_norm``), matrices ``(out_features, in_features)``.

    Attributes
    ----------
    config : LlamaConfig
    softmax_scale : float
        ``config.softmax_scale`` (``1/sqrt(head_dim)`` for both supported models).
    attend_config : AttendConfig
        Passed to every ``cache.decode`` call.
    layer_windows : list of (int or None)
        Sliding window of each layer (``None``: global attention).
    model_key : str or None
        The toolkit's short name of the model (``"smollm2"``) when it was loaded from that
        model's file (:meth:`from_loaded`), else ``None``: :meth:`new_cache` gives a preset
        the calibration shipped for it.

    Raises
    ------
    KeyError
        A required tensor is missing.
    ValueError
        A tensor has the wrong shape.

    See Also
    --------
    load_gguf : reads and caches the weights.
    sequence_logits, generate : drivers built on :meth:`forward`.

    Examples
    --------
    >>> from numba_kv.toolkit.models import LlamaModel                       # doctest: +SKIP
    >>> model = LlamaModel.from_gguf()                               # SmolLM2-135M
    >>> cache = model.new_cache()                                    # DenseCache
    >>> logits = model.forward([504, 3575, 282, 4649, 314], cache)   # (1, 49152)
    """

    def __init__(self, config: LlamaConfig, tensors: Any) -> None:
        self.config = c = config
        if c.n_heads % c.n_kv_heads:
            raise ValueError(f"config: n_heads={c.n_heads} is not a multiple of n_kv_heads={c.n_kv_heads}")
        self.gemma = c.arch == "gemma3"
        self.attend_config = AttendConfig(softmax_scale=c.softmax_scale,
                                          n_kv_groups=c.n_heads // c.n_kv_heads)
        self.softmax_scale = float(self.attend_config.softmax_scale)
        self.layer_windows: list[int | None] = [c.layer_window(i) for i in range(c.n_layers)]
        self.model_key: str | None = None
        # Gemma scales the embedding by sqrt(dim) in float32 (llama.cpp: sqrtf(n_embd))
        self.embed_scale = np.float32(np.sqrt(np.float32(c.dim))) if self.gemma else None

        def get(name: str, shape: tuple) -> np.ndarray:
            if name not in tensors:
                raise KeyError(f"tensors: missing {name!r}")
            a = np.asarray(tensors[name])
            if a.dtype != np.float32:
                a = a.astype(np.float32)
            if tuple(a.shape) != shape:
                raise ValueError(f"tensors[{name!r}]: expected shape {shape}, got {tuple(a.shape)}")
            return a

        d, hd = c.dim, c.head_dim
        self.tok_embd = get("token_embd.weight", (c.vocab_size, d))
        self.output_norm = get("output_norm.weight", (d,))
        self.output = (get("output.weight", (c.vocab_size, d)) if "output.weight" in tensors
                       else self.tok_embd)
        self.tied_embeddings = "output.weight" not in tensors
        self.freq_factors = (get("rope_freqs.weight", (c.rope_dim // 2,)) if "rope_freqs.weight" in tensors
                             else None)
        self.layers: list[_Layer] = []
        for i in range(c.n_layers):
            p = f"blk.{i}."
            self.layers.append(_Layer(
                attn_norm=get(p + "attn_norm.weight", (d,)),
                wq=get(p + "attn_q.weight", (c.n_heads * hd, d)),
                wk=get(p + "attn_k.weight", (c.n_kv_heads * hd, d)),
                wv=get(p + "attn_v.weight", (c.n_kv_heads * hd, d)),
                wo=get(p + "attn_output.weight", (d, c.n_heads * hd)),
                ffn_norm=get(p + "ffn_norm.weight", (d,)),
                w_gate=get(p + "ffn_gate.weight", (c.ffn_dim, d)),
                w_up=get(p + "ffn_up.weight", (c.ffn_dim, d)),
                w_down=get(p + "ffn_down.weight", (d, c.ffn_dim)),
                **({"q_norm": get(p + "attn_q_norm.weight", (hd,)),
                        "k_norm": get(p + "attn_k_norm.weight", (hd,)),
                        "post_attn_norm": get(p + "post_attention_norm.weight", (d,)),
                        "post_ffn_norm": get(p + "post_ffw_norm.weight", (d,))} if self.gemma else {}),
            ))

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, path: Any = None, cache_dir: Any = None) -> LlamaModel:
        """Model from a GGUF file (default: SmolLM2-135M-Instruct), see :func:`load_gguf`."""
        return cls.from_loaded(load_gguf(path, cache_dir))

    @classmethod
    def from_loaded(cls, loaded: LoadedGGUF) -> LlamaModel:
        """Model from an already loaded :class:`~numba_kv.toolkit.models.gguf_loader.LoadedGGUF`
        (its :attr:`model_key` from the file it came from)."""
        model = cls(loaded.config, loaded.tensors)
        model.model_key = model_key(loaded.source)
        return model

    def new_cache(self, cache_factory: str | CacheFactory | None = None, *, calibrate: bool = True,
                  **options: Any) -> Any:
        """A fresh KV cache with this model's geometry.

        Parameters
        ----------
        cache_factory : str or callable, optional
            ``None`` -> :class:`~numba_kv.caches.dense.DenseCache`; a str ->
            :func:`numba_kv.make_cache` name (both get ``sliding_window=layer_windows``
            for models with local layers, unless given); a callable is called as
            ``cache_factory(num_layers=, num_kv_heads=, head_dim=, **options)``.
        calibrate : bool
            A preset name (``"kv3"``) without ``head_overrides`` gets the per-head widths the
            library ships for this model (:mod:`numba_kv.toolkit.models.calibrations`; on
            SmolLM2-135M ``kv3`` gets ``@kv3-smollm2-135m-retrieval``).  ``False``: the plain
            preset.
        **options
            Forwarded to the factory.
        """
        c = self.config
        geom = {"num_layers": c.n_layers, "num_kv_heads": c.n_kv_heads, "head_dim": c.head_dim}
        # library caches slide local layers themselves (bounded memory, fused decode)
        if (cache_factory is None or isinstance(cache_factory, str)) and any(
                w is not None for w in self.layer_windows):
            options.setdefault("sliding_window", list(self.layer_windows))
        if cache_factory is None:
            return DenseCache(**geom, **options)
        if isinstance(cache_factory, str):
            if calibrate:
                options = calibrated_options(cache_factory, options, self.model_key)
            return make_cache(cache_factory, **geom, **options)
        if not callable(cache_factory):
            raise TypeError("cache_factory: expected None, a str or a callable, "
                            f"got {type(cache_factory).__name__}")
        return cache_factory(**geom, **options)

    # -- forward --------------------------------------------------------------------------
    def check_cache(self, cache: Any) -> None:
        """Check that ``cache`` has this model's geometry before anything is stored in it.

        Of ``num_layers``, ``num_kv_heads`` and ``head_dim`` (which every library cache
        exposes) each attribute the cache has must equal ``config.n_layers``,
        ``config.n_kv_heads`` and ``config.head_dim``; a duck-typed cache without them is
        taken as it is (a wrong one then fails at its own ``prefill``/``decode``).

        Raises
        ------
        ValueError
            Naming ``cache``, with the expected and the found geometry.
        """
        c = self.config
        got = {attr: getattr(cache, attr, None) for attr, _ in _CACHE_GEOMETRY}
        if all(got[attr] is None or got[attr] == getattr(c, field) for attr, field in _CACHE_GEOMETRY):
            return
        expected = ", ".join(f"{attr}={getattr(c, field)}" for attr, field in _CACHE_GEOMETRY)
        found = ", ".join(f"{attr}={got[attr]!r}" for attr, _ in _CACHE_GEOMETRY if got[attr] is not None)
        raise ValueError(f"cache: expected this model's geometry ({expected}), got {found} "
                         f"({type(cache).__name__}; see new_cache)")

    def check_tokens(self, tokens: Any, name: str = "tokens") -> np.ndarray:
        """``tokens`` as a 1-D int64 array of valid ids; ``ValueError`` naming ``name`` otherwise."""
        ids = np.asarray(tokens)
        if ids.ndim == 0:
            ids = ids.reshape(1)
        if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"{name}: expected a non-empty 1-D sequence of ints, got shape {ids.shape} "
                             f"dtype {ids.dtype}")
        if ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise ValueError(f"{name}: ids must be in [0, {self.config.vocab_size}), got "
                             f"[{int(ids.min())}, {int(ids.max())}]")
        return ids.astype(np.int64)

    def step(self, tokens: Any, cache: Any, start_pos: int, use_decode: bool,
             logits: str = "last", *, _exact: _ExactPrompt | None = None) -> np.ndarray | None:
        """One pass of ``T`` new tokens through all layers (one cache call per layer).

        Parameters
        ----------
        tokens : sequence of int, length ``T``
        cache : CompressedKVCache
            Checked by :meth:`check_cache`.
        start_pos : int
            Absolute position of ``tokens[0]`` (RoPE), an int >= 0.
        use_decode : bool
            ``True``: ``cache.decode``; ``False``: ``cache.prefill``.  A sliding-window
            layer whose history would exceed its window uses ``cache.prefill`` (the
            dequantized history) and the sliding mask in either case, unless the cache
            slides that layer itself (``cache.layer_windows``).
        logits : {"last", "all", "none"}
            Which rows of logits to compute.

        Returns
        -------
        ndarray, shape ``(1, vocab)`` / ``(T, vocab)``, float32, or None
        """
        c = self.config
        ids = self.check_tokens(tokens)
        start_pos = _check_start_pos(start_pos)
        if logits not in ("last", "all", "none"):
            raise ValueError(f"logits: expected 'last', 'all' or 'none', got {logits!r}")
        self.check_cache(cache)
        tables = self.rope_tables_at(np.arange(start_pos, start_pos + ids.size))
        x = self.embed(ids)
        for li, L in enumerate(self.layers):
            cos, sin = tables[c.layer_rope_theta(li)]
            q, k, v = self.qkv(L, rms_norm(x, L.attn_norm, c.rms_eps), cos, sin)
            self.finish_block(L, x, self._cache_attention(li, cache, q, k, v, use_decode, _exact))
        return self.output_logits(x, logits)

    def decode_layer_major(self, tokens: Any, cache: Any, start_pos: int, logits: str = "all",
                           logits_chunk: int = 256) -> np.ndarray | None:
        """Teacher-forced decode of ``T`` known tokens, layer by layer: every layer's
        projections and feed-forward run once over all ``T`` tokens (matrix products instead
        of ``T`` matrix-vector products), while the cache still sees one ``cache.decode(layer,
        k, v, q)`` per token, in token order, exactly as ``T`` calls of :meth:`step` with
        ``use_decode=True`` would make them (per layer; the layers are visited one after the
        other, which a cache with per-layer state cannot tell apart).

        A token's hidden state at layer ``l`` depends only on earlier layers of itself and of
        earlier tokens, so the order changes no value; the logits equal those of the
        token-by-token loop up to the rounding of BLAS matrix–matrix against matrix–vector
        products (a test checks both orders agree).

        Parameters
        ----------
        tokens : sequence of int, length ``T``
        cache : CompressedKVCache
            Checked by :meth:`check_cache`.
        start_pos : int
            Absolute position of ``tokens[0]`` (RoPE), an int >= 0.
        logits : {"all", "none"}
            Logits of every position (row ``j`` predicts the token after ``tokens[j]``) or none.
        logits_chunk : int
            Rows of the output projection computed at once (bounds its temporaries), an int >= 1.

        Returns
        -------
        ndarray, shape ``(T, vocab)``, float32, or None
        """
        c = self.config
        ids = self.check_tokens(tokens)
        start_pos = _check_start_pos(start_pos)
        if logits not in ("all", "none"):
            raise ValueError(f"logits: expected 'all' or 'none', got {logits!r}")
        # (0 and negatives became 1 and floats were truncated, silently)
        if isinstance(logits_chunk, bool) or not isinstance(logits_chunk, (int, np.integer)) or logits_chunk < 1:
            raise ValueError(f"logits_chunk: expected an int >= 1, got {logits_chunk!r}")
        self.check_cache(cache)
        t, nh, hd = ids.size, c.n_heads, c.head_dim
        tables = self.rope_tables_at(np.arange(start_pos, start_pos + t))
        x = self.embed(ids)
        for li, L in enumerate(self.layers):
            cos, sin = tables[c.layer_rope_theta(li)]
            q, k, v = self.qkv(L, rms_norm(x, L.attn_norm, c.rms_eps), cos, sin)
            o = np.empty((1, nh, t, hd), dtype=np.float32)
            for j in range(t):
                o[:, :, j:j + 1] = self._cache_attention(
                    li, cache, np.ascontiguousarray(q[:, :, j:j + 1]), np.ascontiguousarray(k[:, :, j:j + 1]),
                    np.ascontiguousarray(v[:, :, j:j + 1]), True)
            self.finish_block(L, x, o)
        if logits == "none":
            return None
        out = np.empty((t, c.vocab_size), dtype=np.float32)
        step = int(logits_chunk)
        for a in range(0, t, step):
            out[a:a + step] = self.output_logits(x[a:a + step], "all")
        return out

    def rope_tables_at(self, positions: np.ndarray) -> dict[float, tuple[np.ndarray, np.ndarray]]:
        """RoPE tables of ``positions`` (ints, ``(T,)``) for every base the layers use: a dict
        ``{theta: (cos, sin)}``, each ``(T, rope_dim // 2)`` float32; layer ``i`` uses
        ``config.layer_rope_theta(i)`` (public, with :meth:`embed`, :meth:`qkv` and
        :meth:`finish_block`, so that other forward passes, such as the one-pass engine of
        :mod:`numba_kv.toolkit.evaluation.simulate`, run this model's own block code)."""
        c = self.config
        return {theta: rope_tables(positions, c.rope_dim, theta, self.freq_factors)
                for theta in {c.layer_rope_theta(i) for i in range(c.n_layers)}}

    def embed(self, ids: np.ndarray) -> np.ndarray:
        """Hidden states ``[T, dim]`` float32 of token ids ``ids`` (int ndarray ``(T,)``; a
        writable copy, scaled by ``sqrt(dim)`` for Gemma)."""
        x = self.tok_embd[ids]  # fancy indexing copies, so x is writable
        if self.embed_scale is not None:
            x *= self.embed_scale
        return x

    def finish_block(self, L: _Layer, x: np.ndarray, o: np.ndarray) -> None:
        """The rest of block ``L`` after attention, in place on ``x`` ``[T, dim]``: output
        projection of ``o`` ``[1, H, T, hd]``, post-attention norm, residual, feed-forward."""
        c = self.config
        t = x.shape[0]
        a = o[0].transpose(1, 0, 2).reshape(t, c.n_heads * c.head_dim) @ L.wo.T
        if L.post_attn_norm is not None:
            a = rms_norm(a, L.post_attn_norm, c.rms_eps)
        x += a
        x += self._ffn(L, rms_norm(x, L.ffn_norm, c.rms_eps))

    def qkv(self, L: _Layer, h: np.ndarray, cos: np.ndarray,
             sin: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Queries ``[1, H, T, hd]`` and keys / values ``[1, KVH, T, hd]`` (float32) of layer ``L``
        from the normed hidden states ``h`` ``[T, dim]``: projections, QK-norm, RoPE (``cos``/``sin``)."""
        c = self.config
        t, hd, nh, nkv = h.shape[0], c.head_dim, c.n_heads, c.n_kv_heads
        # [T, H*hd] -> [1, H, T, hd]
        q = (h @ L.wq.T).reshape(t, nh, hd).transpose(1, 0, 2)[None]
        k = (h @ L.wk.T).reshape(t, nkv, hd).transpose(1, 0, 2)[None]
        v = np.ascontiguousarray((h @ L.wv.T).reshape(t, nkv, hd).transpose(1, 0, 2)[None])
        if L.q_norm is not None:  # QK-norm: RMSNorm over each head's vector, before RoPE
            q = rms_norm(q, L.q_norm, c.rms_eps)
            k = rms_norm(k, L.k_norm, c.rms_eps)
        q = apply_rope(q, cos, sin, c.rope_neox)
        k = apply_rope(k, cos, sin, c.rope_neox)
        return q, k, v

    def _cache_attention(self, li: int, cache: Any, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                         use_decode: bool, exact: _ExactPrompt | None = None) -> np.ndarray:
        """Store ``k``/``v`` of layer ``li`` in ``cache`` and attend with ``q`` (see :meth:`step`);
        the attention output ``[1, H, T, hd]`` float32, its shape checked."""
        t = q.shape[2]
        window = self.layer_windows[li]
        # a local layer whose history outgrows its window cannot use the cache's own
        # (full-history) attention: store through prefill, which returns the whole
        # dequantized history, and apply the sliding mask here
        windowed = (window is not None and int(cache.seq_len(li)) + t > window
                    and _cache_window(cache, li) != window)
        if use_decode and not windowed:
            res = cache.decode(li, k, v, q, self.attend_config)
            if isinstance(res, Fused):
                o = np.asarray(_host(res.out), dtype=np.float32)
            elif isinstance(res, Dequantized):
                o = self._attend(q, res.result, window)
            else:
                raise TypeError(f"cache.decode returned {type(res).__name__}, "
                                "expected Fused or Dequantized")
        else:
            res = cache.prefill(li, k, v, q)
            if not isinstance(res, DequantResult):
                raise TypeError(f"cache.prefill returned {type(res).__name__}, expected DequantResult")
            if exact is not None:
                res = exact.patch(li, k, v, res)
            o = self._attend(q, res, window)
        expected = (1, self.config.n_heads, t, self.config.head_dim)
        if o.shape != expected:
            raise ValueError(f"cache layer {li}: attention output has shape {o.shape}, "
                             f"expected {expected}")
        return o

    def _ffn(self, L: _Layer, h: np.ndarray) -> np.ndarray:
        """Feed-forward output ``[T, dim]`` of layer ``L`` from the normed hidden states ``h``:
        SwiGLU (Llama) or GeGLU with tanh-GELU (Gemma), then the optional post-FFN norm."""
        c = self.config
        g = h @ L.w_gate.T
        u = h @ L.w_up.T
        if self.gemma:
            g = gelu_tanh(g)
        else:
            # silu(g)·u with sigmoid(g) = (1 + tanh(g/2)) / 2: no exp overflow warnings
            s = np.tanh(g * np.float32(0.5))
            s += 1.0
            s *= np.float32(0.5)
            g *= s
        g *= u
        f = g @ L.w_down.T
        if L.post_ffn_norm is not None:
            f = rms_norm(f, L.post_ffn_norm, c.rms_eps)
        return f

    def _attend(self, q: np.ndarray, r: DequantResult, window: int | None = None) -> np.ndarray:
        bias = None if r.logit_bias is None else _host(r.logit_bias)
        return attention(q, _host(r.k), _host(r.v), self.softmax_scale, self.config.n_kv_groups, bias, window)

    def output_logits(self, x: np.ndarray, which: str) -> np.ndarray | None:
        """Logits of hidden states ``x`` ``[n, dim]`` (final norm, output matrix, soft-cap):
        ``which`` = ``"all"`` (``[n, vocab]``), ``"last"`` (``[1, vocab]``) or ``"none"``."""
        if which == "none":
            return None
        if which == "last":
            x = x[-1:]
        h = rms_norm(x, self.output_norm, self.config.rms_eps)
        out = h @ self.output.T
        cap = self.config.final_softcap
        if cap:
            out = np.float32(cap) * np.tanh(out / np.float32(cap))
        return out

    def forward(self, tokens: Any, cache: Any, start_pos: int | None = None, *, mode: str = "prefill",
                chunk_size: int | None = DEFAULT_CHUNK_SIZE, logits: str = "last",
                prefill_attention: str = "cache") -> np.ndarray | None:
        """Feed ``tokens`` through the model, storing their K/V in ``cache``.

        Parameters
        ----------
        tokens : sequence of int, length ``N``
        cache : CompressedKVCache
            Any cache with this model's geometry (see :meth:`new_cache`), checked by
            :meth:`check_cache` before anything is stored (a duck-typed cache without
            ``num_layers``/``num_kv_heads``/``head_dim`` is taken as it is).
        start_pos : int, optional
            Absolute position of ``tokens[0]``, an int >= 0; default ``cache.seq_len(0)``.
            Pass it explicitly for caches that evict tokens.
        mode : {"prefill", "decode"}
            ``"prefill"``: chunks of ``chunk_size`` tokens through ``cache.prefill``;
            ``"decode"``: one token at a time through ``cache.decode``.
        chunk_size : int or None
            Prefill chunk; ``None`` = all tokens in one chunk.
        logits : {"last", "all", "none"}
            Logits of the last position, of every position, or none.
        prefill_attention : {"cache", "exact"}
            What a prefill chunk attends over.  ``"cache"`` (default): the history the
            cache returns, so later chunks read earlier ones through the cache's codes (a
            chunked prefill that streams into a compressed cache).  ``"exact"``: this
            call's earlier tokens at full precision (kept aside for the call, as much
            memory as their dense K/V), older history still through the cache — the
            protocol of KIVI (arXiv 2402.02750) and TurboQuant (arXiv 2504.19874) and what
            the transformers integration does: the prompt's attention runs on the
            originals and the cache serves the decode steps.  The cache then stores the
            codes of exactly the K/V a dense prefill computes (with ``"cache"``, later
            chunks' K/V already carry the earlier chunks' coding error).  Only with
            ``mode="prefill"``.

        Returns
        -------
        ndarray, shape ``(1, vocab)`` or ``(N, vocab)``, float32, or None
            Row ``j`` holds the next-token logits after ``tokens[: j + 1]``.

        Raises
        ------
        ValueError
            Bad ``tokens``, ``cache`` (geometry), ``start_pos``, ``mode``, ``chunk_size``,
            ``logits`` or ``prefill_attention``; raised before the cache is touched.
        TypeError
            ``start_pos`` is not an int (a float, a bool).
        """
        ids = self.check_tokens(tokens)
        if mode not in ("prefill", "decode"):
            raise ValueError(f"mode: expected 'prefill' or 'decode', got {mode!r}")
        if logits not in ("last", "all", "none"):
            raise ValueError(f"logits: expected 'last', 'all' or 'none', got {logits!r}")
        if prefill_attention not in ("cache", "exact"):
            raise ValueError(f"prefill_attention: expected 'cache' or 'exact', got {prefill_attention!r}")
        if prefill_attention == "exact" and mode != "prefill":
            raise ValueError("prefill_attention='exact' applies to mode='prefill' only")
        self.check_cache(cache)
        exact = _ExactPrompt(self.config.n_layers, ids.size) if prefill_attention == "exact" else None
        pos = int(cache.seq_len(0)) if start_pos is None else _check_start_pos(start_pos)
        if mode == "decode":
            step = 1
        else:
            ok = chunk_size is None or (isinstance(chunk_size, (int, np.integer)) and not isinstance(chunk_size, bool)
                                        and chunk_size >= 1)
            if not ok:  # (a float was truncated: 2.7 ran chunks of 2)
                raise ValueError(f"chunk_size: expected None or an int >= 1, got {chunk_size!r}")
            step = ids.size if chunk_size is None else int(chunk_size)
        rows = []
        for a in range(0, ids.size, step):
            chunk = ids[a:a + step]
            last = a + step >= ids.size
            want = logits if logits == "all" else ("last" if (last and logits == "last") else "none")
            out = self.step(chunk, cache, pos + a, use_decode=(mode == "decode"), logits=want, _exact=exact)
            if out is not None:
                rows.append(out)
        if logits == "none":
            return None
        return rows[0] if len(rows) == 1 else np.concatenate(rows, axis=0)
