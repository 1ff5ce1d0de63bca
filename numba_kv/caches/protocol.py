"""The ``CompressedKVCache`` protocol: the contract between an inference engine and a
compression method.

This is the Python rendering of the ``CompressedKVCache`` trait of the Rust crate
mistralrs-kv-cache 0.3, as implemented by turboquant-rs 0.3.

Layout
------
All key/value arrays are ``[batch, num_kv_heads, seq_len, head_dim]`` ("HND" plus a
batch axis).  Queries are ``[batch, num_heads, q_len, head_dim]`` where ``num_heads`` is
the number of attention (query) heads.  Rows of the batch are independent sequences of
equal length.

GQA uses contiguous grouping: attention head ``h`` reads KV head ``h // n_kv_groups``.

``logit_bias`` units
--------------------
A ``logit_bias`` returned in :class:`DequantResult` is expressed **in the units of the
logits that enter softmax**, i.e. it is added *after* the scores have been multiplied by
``softmax_scale``::

    p = softmax(softmax_scale * q @ k.T + logit_bias)

(turboquant-rs 0.3, the Rust implementation whose block format this package follows,
returned an un-scaled correction, too large by ``1/softmax_scale``.)  Its shape is
``[batch, num_heads, q_len, kv_len]``.

Thread safety
-------------
Every method may be called concurrently for *different* layers from different Python
threads: implementations keep one lock per layer and run their jitted kernels with
``nogil=True``.  Concurrent ``parallel=True`` Numba calls require the ``omp`` or ``tbb``
threading layer; Numba's ``workqueue`` layer aborts the process when two threads enter
a parallel region at once.  ``python -m numba_kv.info`` prints the active layer, and
:func:`numba_kv.check_threading_layer` raises if it is ``workqueue``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from .._validate import check_int, check_softmax_scale

__all__ = [
    "AttendConfig",
    "CompressedKVCache",
    "DecodeOutput",
    "Dequantized",
    "DequantResult",
    "Fused",
]


@dataclass(frozen=True)
class DequantResult:
    """Decompressed keys and values of one layer, plus an optional logit bias.

    Attributes
    ----------
    k, v : array, shape ``(batch, num_kv_heads, total_seq_len, head_dim)``
        Keys and values in the dtype of the call's input.
    logit_bias : array or None, shape ``(batch, num_heads, q_len, total_seq_len)``
        Added to the *scaled* logits before softmax (units of ``softmax_scale·q·k``).
        ``None`` for methods without a correction.
    """

    k: Any
    v: Any
    logit_bias: Any | None = None


@dataclass(frozen=True)
class Fused:
    """Decode output when the cache computed attention itself.

    Attributes
    ----------
    out : array, shape ``(batch, num_heads, q_len, head_dim)``
        Attention output for every query head and position.
    """

    out: Any


@dataclass(frozen=True)
class Dequantized:
    """Decode output when the caller runs attention (SDPA) itself.

    Attributes
    ----------
    result : DequantResult
        Full decompressed history of the layer, including the tokens just stored.
    """

    result: DequantResult


DecodeOutput = Fused | Dequantized


@dataclass(frozen=True)
class AttendConfig:
    """Attention parameters passed to :meth:`CompressedKVCache.decode`.

    Frozen; new fields are added with defaults so existing callers keep working.

    Attributes
    ----------
    softmax_scale : float
        Multiplier of ``q·k`` before softmax, typically ``1/sqrt(head_dim)``; a real number
        in ``(0, 2**30]`` (larger ones could overflow the float32 logits), stored as a float.
    n_kv_groups : int
        GQA group size ``num_heads // num_kv_heads`` (1 for MHA), an int >= 1.  Validated
        against the shapes of ``q`` and ``k`` by every cache.

    Raises
    ------
    TypeError, ValueError
        Naming the field, for anything else.
    """

    softmax_scale: float
    n_kv_groups: int = 1

    if TYPE_CHECKING:  # what the constructor takes (NumPy scalars too); the fields hold float and int
        def __init__(self, softmax_scale: float | np.floating[Any], n_kv_groups: int | np.integer[Any] = 1) -> None:
            ...

    def __post_init__(self) -> None:
        # stored as a float and an int (a NumPy scalar or a float32 stays usable as a key)
        object.__setattr__(self, "softmax_scale", check_softmax_scale(self.softmax_scale))
        g = self.n_kv_groups
        if isinstance(g, bool) or not isinstance(g, (int, np.integer)):
            raise TypeError(f"n_kv_groups: expected an int >= 1, got {type(g).__name__} {g!r}")
        if g < 1:
            raise ValueError(f"n_kv_groups: expected an int >= 1, got {g!r}")
        object.__setattr__(self, "n_kv_groups", int(g))

    @classmethod
    def for_shapes(cls, head_dim: int, num_heads: int, num_kv_heads: int) -> AttendConfig:
        """Standard config: ``softmax_scale = 1/sqrt(head_dim)``, groups from head counts.

        Raises
        ------
        TypeError, ValueError
            Naming the argument, unless all three are ints >= 1 and ``num_heads`` is a
            multiple of ``num_kv_heads``.
        """
        # (checked first: 0 or a negative head_dim gave ZeroDivisionError or a complex scale)
        head_dim = check_int("head_dim", head_dim, minimum=1)
        num_heads = check_int("num_heads", num_heads, minimum=1)
        num_kv_heads = check_int("num_kv_heads", num_kv_heads, minimum=1)
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads: expected a multiple of num_kv_heads={num_kv_heads}, got {num_heads}"
            )
        return cls(softmax_scale=head_dim ** -0.5, n_kv_groups=num_heads // num_kv_heads)


@runtime_checkable
class CompressedKVCache(Protocol):
    """Contract between an inference engine and a KV-cache compression method.

    Semantics:

    * ``prefill`` stores all new tokens.  If the layer was empty it returns the
      *original* ``k``/``v`` (prompt attention is lossless); otherwise it returns the full
      dequantized history of the layer (chunked prefill).
    * ``decode`` stores the new token(s) first, then attends over everything stored and
      returns :class:`Fused` or :class:`Dequantized`.
    * ``seq_len(layer)`` is the number of tokens the layer has seen (``IndexError`` for a
      layer out of range, like every other method; turboquant-rs silently returns 0).
      That is the number of stored tokens, except on sliding-window layers, which drop
      tokens no later query can see (``stored_len(layer)`` of the library's caches).
    * ``reset()`` drops every layer; ``memory_usage()`` is then 0.
    * ``memory_usage()`` is the exact number of bytes of live (compressed) data.

    Bad input raises ``ValueError``/``TypeError``/``IndexError`` naming the argument and
    leaves the cache exactly as it was.
    """

    def prefill(self, layer: int, k: Any, v: Any, q: Any = None) -> DequantResult:
        """Store ``k``/``v`` ``[batch, num_kv_heads, new_tokens, head_dim]``; return K/V."""
        ...

    def decode(self, layer: int, k: Any, v: Any, q: Any, config: AttendConfig, *, out: Any = None) -> DecodeOutput:
        """Store the new token(s) and attend with ``q`` ``[batch, num_heads, q_len, head_dim]``.

        ``out`` (keyword, optional): an array shaped like ``q`` that a cache returning
        :class:`Fused` writes its output into (``Fused.out is out``: no allocation per
        step); a bad ``out``, or ``out`` for a cache returning :class:`Dequantized`, raises
        ``TypeError``/``ValueError`` naming ``out`` and leaves the cache as it was.
        Without it every call returns a new array."""
        ...

    def seq_len(self, layer: int) -> int:
        """Tokens ``layer`` has seen (stored, plus any a sliding-window layer evicted)."""
        ...

    def reset(self) -> None:
        """Drop all stored tokens of every layer."""
        ...

    def memory_usage(self) -> int:
        """Bytes of live stored data, summed over layers."""
        ...
