"""A Hugging Face transformers 5.x ``Cache`` backed by numba_kv caches.

Needs the ``hf`` extra (``pip install numba-kv[hf]``: torch and transformers 5.x); ``import
numba_kv`` never imports this module.

Usage::

    from transformers import AutoModelForCausalLM
    from numba_kv.integrations.transformers import NumbaKVCache

    model = AutoModelForCausalLM.from_pretrained(...)
    cache = NumbaKVCache.from_model(model, "kv4")          # any make_cache name or preset
    out = model.generate(**inputs, cache=cache, max_new_tokens=32)  # past_key_values= before 5.24
    cache.memory_usage()                                    # bytes of live (compressed) K/V

The cache is a list of :class:`NumbaKVLayer` objects (transformers' ``CacheLayerMixin``), one per
decoder layer, each holding a one-layer numba_kv cache configured exactly as the same layer of
``numba_kv.make_cache(name, num_layers=..., ...)`` on the whole model (a preset such as ``"kv4"``
is sized on the whole model's geometry first).  Sliding layers of ``config.layer_types``
(Gemma-3's local layers) become sliding-window numba_kv layers that store only what their
queries can still see; a config with ``sliding_window`` but no ``layer_types`` (Mistral) has
only sliding layers, as in transformers' own ``DynamicCache(config=...)``.

Fused decode: with ``attn_implementation="numba_kv"`` (registered with transformers'
``AttentionInterface`` when this module is imported)::

    model.set_attn_implementation("numba_kv")     # or from_pretrained(..., attn_implementation="numba_kv")
    cache = NumbaKVCache.from_model(model, "kv4")
    out = model.generate(**inputs, cache=cache, max_new_tokens=32)

the prompt still attends over its own exact K/V (through ``sdpa``), and every one-token decode
step runs ``cache.decode`` on the packed codes (:func:`numba_kv_attention_forward`): no
decompressed history is built, and TurboQuant's QJL correction is applied.  A cache follows its
model's current implementation (``from_model`` keeps the config; its decoder's text config,
for a multimodal model), so switching back to ``"sdpa"`` returns to the dequantized path on the
same cache; so does a ``copy.deepcopy`` of the cache, which shares the config.

What ``update`` returns (the *dequantized path*, any other ``attn_implementation``): the prompt's own
K/V on the first call (prompt attention is lossless), afterwards the layer's full history
decompressed, as torch tensors in the input's dtype and device.  The model's attention (sdpa,
eager, ...) runs on them with its usual mask.  With ``"dense"`` this is exactly transformers'
``DynamicCache``.  TurboQuant names (``"tq3"``, ...) lose their QJL logit correction on this path
(it needs the query); the PolarQuant names and presets have none.

Tensors: CPU tensors are shared with NumPy without copies (``Tensor.numpy()`` /
``torch.from_numpy``); float32 and float16 pass as they are, bfloat16 (which NumPy lacks) is
converted to float32 once on the way in and the returned history back to bfloat16.  CUDA tensors
go through DLPack to CuPy and back, and the cache's kernels and CuPy work run on torch's current
stream (:func:`torch_stream`: ordered with the model's work, no host synchronization).  The
CUDA path is written but **untested** (no GPU on the machine that wrote it;
``tests/gpu/test_device_transformers.py`` is for one).

Batches: every row is an independent sequence of equal length.  A left-padded batch works on
the dequantized path (the pad tokens are stored like any token and the model's attention mask
hides them; they do use up a compressed cache's sink tokens); the fused path refuses it with a
``ValueError`` naming :class:`numba_kv.PagedKVCache` (ragged batches), which is not wired into
transformers yet.

Beam search (``num_beams``), ``batch_select_indices``, ``batch_repeat_interleave`` and ``crop``
(rollback of assisted decoding) act on the compressed codes: every per-row state moves with its
row.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

try:
    import torch
    from transformers.cache_utils import Cache, CacheLayerMixin
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("numba_kv.integrations.transformers needs torch and transformers 5.x: "
                      "pip install 'numba-kv[hf]'") from exc

from .._launch import launch_stream
from ..caches.protocol import AttendConfig, Fused
from ..caches.spec import make_cache

__all__ = ["ATTN_IMPLEMENTATION", "NumbaKVCache", "NumbaKVLayer", "model_geometry", "numba_kv_attention_forward",
           "torch_stream"]

#: ``attn_implementation`` of the fused decode path (registered when this module is imported)
ATTN_IMPLEMENTATION = "numba_kv"
#: attribute of a key tensor returned by a fused-mode ``update``: the layer whose decode is pending
_PENDING = "_numba_kv_pending"
#: per thread: the layer whose fused ``update`` handed a token over and whose attention call has
#: not consumed it yet (a model that replaces the key tensor in between loses the tag)
_handoff = threading.local()

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: layer types of ``config.layer_types`` this cache serves
_LAYER_TYPES = ("full_attention", "sliding_attention")


# -- torch <-> NumPy / CuPy ------------------------------------------------------------------------

def _check_tensor(name: str, t: Any) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _DTYPES:
        raise TypeError(f"{name}: expected float16, bfloat16 or float32, got {t.dtype}")
    if t.dim() != 4:
        raise ValueError(f"{name}: expected shape [batch, num_kv_heads, seq_len, head_dim], got {tuple(t.shape)}")


@contextlib.contextmanager
def torch_stream(device: torch.device) -> Iterator[None]:
    """Inside the block, numba_kv's CUDA launches and its CuPy work run on torch's current
    stream of ``device`` (:func:`numba_kv.launch_stream` of a ``cupy.cuda.ExternalStream`` of it,
    which also makes it CuPy's current stream), so they are ordered with the model's own work
    without a host synchronization, and DLPack exchanges (:func:`to_array`, :func:`to_tensor`)
    made in the block are producer and consumer on one stream.  Nothing on the CPU.

    Parameters
    ----------
    device : torch.device
        The device of the tensors the block exchanges (``cuda:N``, or ``cpu``: a no-op).

    Yields
    ------
    None
    """
    if device.type != "cuda":
        yield
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = torch.cuda.current_stream(device)
    with launch_stream(_cupy().cuda.ExternalStream(stream.cuda_stream, index)):
        yield


def _cupy() -> Any:
    """The ``cupy`` module (imported on first use: CUDA tensors only)."""
    import cupy  # noqa: PLC0415 - optional (extra "cuda")

    return cupy


def to_array(t: torch.Tensor) -> Any:
    """``t`` as a NumPy (CPU) or CuPy (CUDA) array sharing its memory; bfloat16 is converted to
    float32 first (one copy: neither NumPy nor numba_kv has bfloat16)."""
    t = t.detach()
    if t.dtype == torch.bfloat16:
        t = t.float()
    if t.device.type == "cpu":
        return t.numpy()
    if t.device.type == "cuda":  # pragma: no cover - needs a GPU
        return _cupy().from_dlpack(t)  # (inside torch_stream: CuPy's current stream is torch's)
    raise TypeError(f"key_states: expected a CPU or CUDA tensor, got device {t.device}")


def to_tensor(a: Any, dtype: torch.dtype) -> torch.Tensor:
    """A NumPy or CuPy array as a torch tensor sharing its memory, converted to ``dtype`` when it
    differs (bfloat16 inputs come back as float32 arrays)."""
    out = torch.from_numpy(a) if isinstance(a, np.ndarray) else torch.from_dlpack(a)
    return out if out.dtype == dtype else out.to(dtype)


# -- geometry ----------------------------------------------------------------------------------------

def _per_layer_configs(config: Any) -> list[Any] | None:
    """The layer configs of a heterogeneous config (transformers' ``per_layer_config``: layers
    may differ in, e.g., ``sliding_window``, and reading such an attribute on the config itself
    raises), else ``None``.  ``ValueError`` where layers differ in their KV geometry: one
    ``NumbaKVCache`` stores one head count and head size."""
    if not getattr(config, "is_heterogeneous", False):
        return None
    layers = list(config.per_layer_config)
    for attr in ("num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size"):
        seen = {getattr(lc, attr, None) for lc in layers}
        if len(seen) > 1:
            raise ValueError(f"config.per_layer_config: layers differ in {attr} ({sorted(seen, key=str)}); "
                             "NumbaKVCache serves one KV geometry for every layer")
    return layers


def _layer_types(config: Any, num_layers: int, per_layer: list[Any] | None = None) -> list[str]:
    """``config.layer_types``, or where a config has none, the types transformers itself infers
    (``get_layer_types_and_kwargs``, which builds ``DynamicCache(config=...)``): every layer
    sliding when ``config.sliding_window`` is set (Mistral, Phi-3: the model then builds sliding
    masks), chunked when ``config.attention_chunk_size`` is, else full — per layer, from its own
    config, for a heterogeneous config (``per_layer``); a layer that reuses another's K/V
    (``config.kv_sharing_modes``, Gemma-3n) is ``"kv_shared"``."""
    types = getattr(config, "layer_types", None)
    if types:
        types = list(types)
    elif per_layer:
        types = ["sliding_attention" if getattr(lc, "sliding_window", None) is not None else
                 "chunked_attention" if getattr(lc, "attention_chunk_size", None) is not None else
                 "full_attention" for lc in per_layer]
    elif getattr(config, "sliding_window", None) is not None:
        types = ["sliding_attention"] * num_layers
    elif getattr(config, "attention_chunk_size", None) is not None:
        types = ["chunked_attention"] * num_layers
    else:
        types = ["full_attention"] * num_layers
    modes = getattr(config, "kv_sharing_modes", None)
    if modes is not None:
        types = ["kv_shared" if mode == "reuse" else t for t, mode in zip(types, modes)]
    return types


def model_geometry(config: Any) -> dict[str, Any]:
    """``num_layers``, ``num_kv_heads``, ``head_dim`` and per-layer ``sliding_window`` (None for
    a global layer) of a transformers model config (the decoder's text config is used).

    The layers are those of transformers' own ``DynamicCache(config=config)``: the types of
    ``config.layer_types``, or without it, every layer sliding when ``config.sliding_window``
    is set (Mistral, Phi-3), else full.

    Raises
    ------
    ValueError
        A layer type other than ``"full_attention"`` / ``"sliding_attention"`` (linear
        attention, chunked attention, KV sharing are not served), or a sliding layer without
        ``config.sliding_window``; a config without attention layers (``num_hidden_layers``,
        ``num_attention_heads``: Mamba, RWKV).
    """
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    missing = [a for a in ("num_hidden_layers", "num_attention_heads") if getattr(config, a, None) is None]
    if missing:  # (an attention-free model: Mamba, RWKV)
        raise ValueError(f"config: expected a transformer decoder with attention layers, {type(config).__name__} "
                         f"has no {' / '.join(missing)}")
    num_layers = int(config.num_hidden_layers)
    per_layer = _per_layer_configs(config)
    first = per_layer[0] if per_layer else config
    num_heads = int(first.num_attention_heads)
    num_kv_heads = int(getattr(first, "num_key_value_heads", None) or num_heads)
    head_dim = getattr(first, "head_dim", None) or first.hidden_size // num_heads
    types = _layer_types(config, num_layers, per_layer)
    if len(types) != num_layers:
        raise ValueError(f"config.layer_types: expected {num_layers} entries, got {len(types)}")
    windows: list[int | None] = []
    for i, kind in enumerate(types):
        if kind not in _LAYER_TYPES:
            raise ValueError(f"config.layer_types: layer {i} is {kind!r}; NumbaKVCache serves {list(_LAYER_TYPES)}")
        if kind == "sliding_attention":
            w = getattr(per_layer[i] if per_layer else config, "sliding_window", None)
            if not w:
                raise ValueError(f"config.sliding_window: layer {i} is a sliding layer but the window is {w!r}")
            windows.append(int(w))
        else:
            windows.append(None)
    return {"num_layers": num_layers, "num_kv_heads": num_kv_heads, "head_dim": int(head_dim),
            "sliding_window": windows}


def _one_layer_caches(full: Any) -> list[Any]:
    """One single-layer cache per layer of ``full``, each configured like that layer of
    ``full`` (its part's constructor arguments and its own sliding window; a split layer of a
    mixed cache, ``head_overrides``, gets a one-layer mixed cache)."""
    return [full.empty_layer(i) for i in range(full.num_layers)]


# -- the layer ---------------------------------------------------------------------------------------

class NumbaKVLayer(CacheLayerMixin):
    """One decoder layer's cache: a one-layer numba_kv cache behind transformers'
    ``CacheLayerMixin`` (see the module docstring).

    Parameters
    ----------
    cache : LayeredCache
        An empty numba_kv cache with ``num_layers == 1`` (``DenseCache``, ``PolarQuantCache``,
        ``TurboQuantCache``); its sliding window, if any, makes this a sliding layer.
    config : transformers.PretrainedConfig, optional
        The model's config: while the ``_attn_implementation`` of its decoder's text config
        (the config the decoder's attention modules read; the config itself for a text-only
        model) is :data:`ATTN_IMPLEMENTATION`, one-token decode steps take the fused path (see
        :meth:`update`).  Held by reference, also by a ``copy.deepcopy`` of the layer, so the
        layer follows ``model.set_attn_implementation``.

    Attributes
    ----------
    cache : LayeredCache
        The numba_kv cache holding this layer's K/V (``keys``/``values`` stay ``None``: the
        history exists only compressed).
    """

    is_compileable = False
    is_croppable = True

    def __init__(self, cache: Any, config: Any = None) -> None:
        super().__init__()
        if getattr(cache, "num_layers", None) != 1:
            raise ValueError(f"cache: expected a one-layer numba_kv cache, got {cache!r}")
        if cache.seq_len(0):
            # the layer learns the dtype, device and batch of its history from its first update:
            # a cache that already holds tokens was taken as empty there, and attention never saw them
            raise ValueError(f"cache: expected an empty cache (the layer's history starts with the model's "
                             f"first update), got one holding {cache.seq_len(0)} tokens")
        self.cache = cache
        # the decoder's own config: a multimodal model's attention modules read its text config,
        # whose implementation may differ from the outer config's
        self.config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        self.sliding_window: int | None = cache.layer_windows[0]
        self.is_sliding = self.sliding_window is not None
        self.dtype: torch.dtype | None = None
        self.device: torch.device | None = None

    def __deepcopy__(self, memo: dict[int, Any]) -> NumbaKVLayer:
        # the config is the model's, not state: a copy (transformers' prompt-reuse recipe is
        # copy.deepcopy(cache)) must keep following the model's attn_implementation, or a switch
        # to "sdpa" would leave it returning fused-path markers that sdpa ignores (wrong logits,
        # the token never stored)
        memo[id(self.config)] = self.config
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            setattr(new, key, copy.deepcopy(value, memo))
        return new

    def __repr__(self) -> str:
        return f"{type(self).__name__}({getattr(self.cache, 'name', type(self.cache).__name__)}" + \
            (f", sliding_window={self.sliding_window})" if self.is_sliding else ")")

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Record the dtype and device of the first tensors (the history comes back in them)."""
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch_size = int(key_states.shape[0])
        self.is_initialized = True

    def _check_input(self, key_states: Any, value_states: Any) -> None:
        _check_tensor("key_states", key_states)
        _check_tensor("value_states", value_states)
        if key_states.shape != value_states.shape:
            raise ValueError(f"value_states: expected the shape of key_states {tuple(key_states.shape)}, "
                             f"got {tuple(value_states.shape)}")
        if value_states.dtype != key_states.dtype or value_states.device != key_states.device:
            raise TypeError(f"value_states: expected {key_states.dtype} on {key_states.device} like key_states, "
                            f"got {value_states.dtype} on {value_states.device}")
        hk, d = int(key_states.shape[1]), int(key_states.shape[3])
        if (hk, d) != (self.cache.num_kv_heads, self.cache.head_dim):
            raise ValueError(f"key_states: expected {self.cache.num_kv_heads} KV heads of head_dim "
                             f"{self.cache.head_dim}, got shape {tuple(key_states.shape)}")
        if not (self.is_initialized and self.get_seq_length()):
            return
        if key_states.dtype != self.dtype or key_states.device != self.device:
            raise TypeError(f"key_states: this layer holds {self.dtype} on {self.device}, got "
                            f"{key_states.dtype} on {key_states.device} (reset() the cache first)")
        if int(key_states.shape[0]) != self.batch_size:  # (a cache re-used for another batch without reset)
            raise ValueError(f"key_states: this layer holds {self.batch_size} sequences, got a batch of "
                             f"{int(key_states.shape[0])} (reset() the cache first)")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens ``[batch, num_kv_heads, new_tokens, head_dim]``; return the keys
        and values attention must see: the inputs themselves on an empty layer, else the
        stored history (a sliding layer: its last ``window − 1`` tokens) plus the new ones,
        decompressed, in the input's dtype and device.

        Fused path (the model's ``attn_implementation`` is ``"numba_kv"``): a one-token step on
        a non-empty layer stores nothing here and returns the inputs marked; the attention
        function :func:`numba_kv_attention_forward` then calls the cache's ``decode``, which
        stores the token and attends from the packed codes (QJL correction included)."""
        self._check_input(key_states, value_states)
        _handoff.layer = None  # (a step that raised before its attention leaves no stale hand-off)
        first = not self.is_initialized or not self.get_seq_length()
        if not first and key_states.shape[2] == 1 and self.fused:
            # fused decode: numba_kv_attention_forward stores the token and attends from the codes
            setattr(key_states, _PENDING, self)
            _handoff.layer = self  # (how the attention call sees a hand-off whose tensor the model replaced)
            return key_states, value_states
        with torch_stream(key_states.device), _caller_names():
            res = self.cache.prefill(0, to_array(key_states), to_array(value_states))
            if first:  # only once the tokens are stored: a refused first call leaves the layer as it was
                self.lazy_initialization(key_states, value_states)
                return key_states, value_states  # the prompt's own K/V
            return to_tensor(res.k, key_states.dtype), to_tensor(res.v, key_states.dtype)

    def _on_stream(self) -> contextlib.AbstractContextManager:
        """:func:`torch_stream` of the layer's device (nothing before its first tokens)."""
        device = getattr(self, "device", None) if self.is_initialized else None
        return torch_stream(device) if isinstance(device, torch.device) else contextlib.nullcontext()

    @property
    def fused(self) -> bool:
        """True while the model's ``attn_implementation`` is :data:`ATTN_IMPLEMENTATION`."""
        return getattr(self.config, "_attn_implementation", None) == ATTN_IMPLEMENTATION

    def get_seq_length(self) -> int:
        """Tokens this layer has seen (a sliding layer stores fewer)."""
        return self.cache.seq_len(0)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` of the keys the next :meth:`update` with ``query_length``
        tokens returns (the convention of transformers' dynamic layers)."""
        seen = self.get_seq_length()
        if not self.is_sliding:
            return seen + query_length, 0
        w = int(self.sliding_window)
        return min(seen, w - 1) + query_length, max(seen - w + 1, 0)

    def get_max_length(self) -> int:
        """``-1`` (no maximum) for a global layer, the window for a sliding layer."""
        return int(self.sliding_window) if self.is_sliding else -1

    def reset(self) -> None:
        """Drop every stored token."""
        self.cache.reset()
        self.is_initialized = False
        self.__dict__.pop("batch_size", None)

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the newest ``-tokens_to_remove`` tokens (a negative int, transformers 5's
        convention), or with a positive int keep the first ``tokens_to_remove`` tokens (the
        legacy ``max_length`` meaning; a no-op when the layer holds no more).  ``0``: nothing.

        Raises
        ------
        TypeError
            Not an int.
        ValueError
            More tokens to remove than the layer holds, or a length a sliding layer can no
            longer return to (it evicted the tokens that position would see again); the layer
            is unchanged.
        """
        target = self.crop_target(tokens_to_remove)
        if target is not None:
            with self._on_stream():
                self.cache.crop(target)

    def crop_target(self, tokens_to_remove: int) -> int | None:
        """The length :meth:`crop` would leave (``None``: nothing to do), or what it raises."""
        if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, (int, np.integer)):
            raise TypeError(f"tokens_to_remove: expected an int, got {type(tokens_to_remove).__name__}")
        n, seen = int(tokens_to_remove), self.get_seq_length()
        if n == 0 or not seen or n >= seen:
            return None
        if -n > seen:
            raise ValueError(f"tokens_to_remove: the layer holds {seen} tokens, cannot remove {-n}")
        target = seen + n if n < 0 else n
        floor, _ = self.cache.crop_range()
        if 0 < target < floor:
            raise ValueError(f"tokens_to_remove: length {target} is inside the evicted horizon of this "
                             f"sliding layer (window {self.sliding_window}); expected 0 or a length >= {floor}")
        return target

    def _select(self, name: str, indices: np.ndarray) -> None:
        """Rows ``indices`` become the batch; ``name`` is the caller's argument, for messages."""
        if self.get_seq_length():
            if not indices.size:  # (the core's message would name its own argument)
                raise ValueError(f"{name}: expected at least one batch row, got none")
            if not (0 <= indices.min() and indices.max() < self.batch_size):
                # checked here too so that the message names the caller's argument
                raise ValueError(f"{name}: expected batch rows in [0, {self.batch_size}), got {indices.tolist()}")
            with self._on_stream():
                self.cache.select_batch(indices)  # validates (rows in range) before changing anything
            self.batch_size = int(indices.size)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row ``i`` becomes row ``beam_idx[i]`` (codes and per-row state move)."""
        self._select("beam_idx", _indices("beam_idx", beam_idx, getattr(self, "batch_size", None)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the batch rows ``indices`` (ints, or a boolean mask of one entry per row), in that order."""
        self._select("indices", _indices("indices", indices, getattr(self, "batch_size", None)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every batch row ``repeats`` times in place (``torch.repeat_interleave``)."""
        if isinstance(repeats, bool) or not isinstance(repeats, (int, np.integer)) or repeats < 1:
            raise ValueError(f"repeats: expected an int >= 1, got {repeats!r}")
        if self.get_seq_length():
            self._select("repeats", np.repeat(np.arange(self.batch_size), int(repeats)))


#: the core's argument names and the names a transformers model passes them under
_CALLER_NAMES = {"k": "key_states", "v": "value_states", "q": "query"}


@contextlib.contextmanager
def _caller_names() -> Iterator[None]:
    """Re-raise a core cache's ``ValueError`` / ``TypeError`` (which name its own arguments
    ``k``, ``v``, ``q``) under the names the model passed them as: ``"k: expected finite
    values"`` becomes ``"key_states (numba_kv's k): expected finite values"``.  The cache
    was left as it was: the core checks before it stores."""
    try:
        yield
    except (ValueError, TypeError) as exc:
        msg = str(exc)
        name, sep, rest = msg.partition(":")
        if type(exc) not in (ValueError, TypeError) or not sep or name not in _CALLER_NAMES:
            raise
        raise type(exc)(f"{_CALLER_NAMES[name]} (numba_kv's {name}):{rest}") from exc


def _indices(name: str, idx: Any, batch: int | None) -> np.ndarray:
    """Batch indices as an int64 NumPy array (a boolean mask, one entry per row of a ``batch``
    of rows when known, becomes its row numbers)."""
    if isinstance(idx, torch.Tensor):
        idx = idx.detach().cpu().numpy()
    arr = np.asarray(idx)
    if arr.dtype == np.bool_:
        if arr.ndim != 1 or (batch is not None and arr.size != batch):
            # (torch's own boolean indexing refuses a mask of another shape too)
            raise ValueError(f"{name}: expected a boolean mask of shape ({batch},), one entry per batch row, "
                             f"got shape {arr.shape}")
        arr = np.flatnonzero(arr)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name}: expected a 1-D integer (or boolean) tensor of batch rows, got "
                        f"dtype {arr.dtype} shape {arr.shape}")
    return arr.astype(np.int64)


# -- the cache -----------------------------------------------------------------------------------------

class NumbaKVCache(Cache):
    """A transformers ``Cache`` whose layers store K/V in numba_kv caches.

    Build it with :meth:`from_model` (or :meth:`from_config`) and pass it to
    ``model.generate(..., cache=cache)`` or ``model(..., cache=cache)`` (transformers 5.24;
    earlier 5.x releases take it as ``past_key_values=``).

    Parameters
    ----------
    layers : list of NumbaKVLayer
        One per decoder layer.
    """

    def __init__(self, layers: list[NumbaKVLayer]) -> None:
        if not layers or not all(isinstance(la, NumbaKVLayer) for la in layers):
            raise TypeError("layers: expected a non-empty list of NumbaKVLayer")
        super().__init__(layers=list(layers))

    @classmethod
    def from_config(cls, config: Any, cache: str = "kv4", **options: Any) -> NumbaKVCache:
        """A cache for a model ``config``.

        Parameters
        ----------
        config : transformers.PretrainedConfig
            The model's config: ``num_hidden_layers``, ``num_key_value_heads``, ``head_dim``
            (or ``hidden_size / num_attention_heads``), ``layer_types`` and ``sliding_window``.
        cache : str
            Any :func:`numba_kv.make_cache` name or preset (``"kv4"``, ``"kv5"``, ``"dense"``,
            ``"pqo3-r32"``, ``"tq4"``, ...).
        **options
            Further :func:`~numba_kv.make_cache` options (``layer_overrides=``,
            ``head_overrides=`` — per-KV-head bit widths, ``{layer: {kv_head: {"bits": 4}}}``
            —, ``residual_length=`` ...); the sliding windows come from ``config``.

        Raises
        ------
        TypeError
            An option the cache class does not take (``sliding_window`` among them: it comes
            from the config), or one of the wrong type.
        ValueError
            An unknown cache name or an option's bad value, a head_dim numba_kv does not serve
            (a multiple of 32), or a layer type other than full / sliding attention.
        """
        geo = model_geometry(config)
        if "sliding_window" in options:
            raise TypeError("sliding_window: taken from config.layer_types / config.sliding_window")
        windows = geo.pop("sliding_window")
        try:
            full = make_cache(cache, **geo, sliding_window=windows if any(w is not None for w in windows) else None,
                              **options)
        except (TypeError, ValueError) as exc:  # make_cache's "name" is this method's "cache"
            msg = str(exc)
            if type(exc) not in (TypeError, ValueError) or not msg.startswith("name: "):
                raise
            raise type(exc)("cache: " + msg[len("name: "):]) from None
        return cls([NumbaKVLayer(c, config) for c in _one_layer_caches(full)])

    @classmethod
    def from_model(cls, model: Any, cache: str = "kv4", **options: Any) -> NumbaKVCache:
        """:meth:`from_config` with ``model.config``."""
        return cls.from_config(model.config, cache, **options)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Store layer ``layer_idx``'s new K/V and return what its attention sees (see
        :meth:`NumbaKVLayer.update`)."""
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, (int, np.integer)):
            raise TypeError(f"layer_idx: expected an int in [0, {len(self.layers)}), got "
                            f"{type(layer_idx).__name__} {layer_idx!r}")
        if not 0 <= layer_idx < len(self.layers):
            raise IndexError(f"layer_idx: expected an int in [0, {len(self.layers)}), got {layer_idx!r}")
        return super().update(key_states, value_states, int(layer_idx), *args, **kwargs)

    def crop(self, tokens_to_remove: int) -> None:
        """:meth:`NumbaKVLayer.crop` on every layer, all or nothing: every layer's target is
        checked before any layer changes."""
        for la in self.layers:  # (raises before any layer changes)
            la.crop_target(tokens_to_remove)
        for la in self.layers:
            la.crop(tokens_to_remove)

    def memory_usage(self) -> int:
        """Bytes of live stored K/V (compressed codes, norms, windows), all layers."""
        return sum(la.cache.memory_usage() for la in self.layers)


# -- fused decode inside transformers ------------------------------------------------------------------

def _all_visible(mask: Any) -> bool:
    """True when an attention mask hides nothing (``None``, all-True bool, or an all-zero
    additive float mask)."""
    if mask is None:
        return True
    return bool(mask.all()) if mask.dtype == torch.bool else bool((mask == 0).all())


def numba_kv_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                               value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
                               scaling: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention function ``"numba_kv"``: decode steps from the packed codes.

    Registered with ``AttentionInterface`` (and ``sdpa``'s mask function under the same name)
    when this module is imported; select it with ``attn_implementation="numba_kv"`` in
    ``from_pretrained`` or ``model.set_attn_implementation("numba_kv")``.  A one-token step on
    a non-empty :class:`NumbaKVLayer` runs ``cache.decode`` (fused attention from the codes for
    the compressed caches, QJL correction included; the dense cache's exact history through
    the same softmax formula); everything else — the prompt over its own exact K/V, several
    tokens at once, other caches — goes to transformers' ``sdpa``.

    Raises
    ------
    ValueError
        A padded batch on a fused step (the mask hides keys: the cache attends every stored
        token of every row; use ``attn_implementation="sdpa"``, where the mask applies, or
        :class:`numba_kv.PagedKVCache` for ragged batches), logit soft-capping, attention sinks
        or dropout, which the fused kernels do not apply, or a ``sliding_window`` the model's
        layer passes that is not the cache layer's (a cache built for another config).
    """
    layer = getattr(key, _PENDING, None)
    pending, _handoff.layer = getattr(_handoff, "layer", None), None
    if layer is None:
        if pending is not None:
            # the layer handed this step's token over on the tensor update returned, but the model
            # attends with another one (JetMoe repeats its keys after the update): sdpa over it
            # would attend the new token alone, and the token would never be stored
            raise ValueError("key: this model changes the key tensor between the cache update and its attention, "
                             "so the fused numba_kv decode cannot take the step over; use attn_implementation="
                             "'sdpa' (the dequantized path) with this model")
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    delattr(key, _PENDING)
    if not _all_visible(attention_mask):
        raise ValueError("attention_mask: the fused numba_kv decode attends every stored token of every row and "
                         "cannot mask padding; use attn_implementation='sdpa' (the dequantized path, which applies "
                         "the mask) or numba_kv.PagedKVCache for ragged batches")
    for name in ("softcap", "s_aux", "sinks"):
        if kwargs.get(name) is not None:
            raise ValueError(f"{name}: not supported by the fused numba_kv decode; use attn_implementation='sdpa'")
    if dropout:
        raise ValueError(f"dropout: the fused numba_kv decode is for inference, got {dropout}")
    # the model's own window, where its attention passes one (Gemma, Mistral, Qwen2): a cache built
    # from another config would attend a different span silently (its window is in its buffers)
    window = kwargs.get("sliding_window")
    if "sliding_window" in kwargs and (int(window) if window else None) != layer.sliding_window:
        raise ValueError(f"sliding_window: this model layer attends a window of {window}, the cache's layer holds "
                         f"{layer.sliding_window} (build the cache with NumbaKVCache.from_model(model))")
    hq, hk = int(query.shape[1]), int(key.shape[1])
    scale = float(scaling) if scaling is not None else float(query.shape[-1]) ** -0.5
    cfg = AttendConfig(softmax_scale=scale, n_kv_groups=hq // hk)
    with torch_stream(query.device):  # on torch's current stream: no host synchronization
        with _caller_names():
            out = layer.cache.decode(0, to_array(key), to_array(value), to_array(query), cfg)
        if isinstance(out, Fused):
            res = to_tensor(out.out, query.dtype)
        else:  # the cache returned its history (dense, decode_output="dequantized"): attend here
            r = out.result
            k, v = (to_tensor(a, torch.float32).repeat_interleave(cfg.n_kv_groups, dim=1) for a in (r.k, r.v))
            scores = torch.matmul(query.float(), k.transpose(2, 3)) * scale
            if r.logit_bias is not None:
                scores = scores + to_tensor(r.logit_bias, torch.float32)
            res = torch.matmul(torch.softmax(scores, dim=-1), v).to(query.dtype)
    return res.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTN_IMPLEMENTATION, numba_kv_attention_forward)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
