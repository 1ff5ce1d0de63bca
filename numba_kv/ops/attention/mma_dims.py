"""The tensor-core partition for each head_dim of :data:`~numba_kv.ops.attention.mma.MMA_HEAD_DIMS`.

:mod:`numba_kv.ops.attention.mma` is written for one head_dim, the compile-time constant
:data:`~numba_kv.ops.attention.mma.HEAD_DIM` (128 there).  Its tiles keep their shape at any
multiple of 64 — a 16-token tile is ``d / 16`` k-steps of ``m16n8k16`` for the scores and
``d / 16`` products for the values — and only the share of a head each lane decodes changes:

==========  ======================================  =============================  ================
head_dim    a key's coordinates per lane (``tig``)  a value's per lane (``gid``)   output sums
==========  ======================================  =============================  ================
128         32: block ``tig``                        16: ``16·gid …``               32
64          16: half of block ``tig >> 1``           8: ``8·gid …``                 16
==========  ======================================  =============================  ================

Here every function whose code depends on it is re-bound with the head_dim (and the
functions that call those, down to the partition), as :func:`~numba_kv._jit.specialize` builds
the VQ build and the paged kernel: one source, and each build compiles only its own
geometry.  Head_dim 256 would also need the warp kernel's exact tiles (the window's and the
sinks' partitions) at 256, which take at most 128.
"""

from __future__ import annotations

from collections.abc import Callable

from ..._jit import cuda_device, specialize
from . import mma, mma_vq
from .mma import MMA_BITS, MMA_HEAD_DIM, MMA_HEAD_DIMS

__all__ = ["mma_partition_for"]


def _py(fn: Callable) -> Callable:
    """The Python source function of a device function (or ``fn`` itself)."""
    return getattr(fn, "py_func", fn)


def _bind(fn: Callable, suffix: str, **names) -> Callable:
    return cuda_device(specialize(_py(fn), suffix, **names))


def _build(d: int, vq: bool) -> Callable:
    """The partition device function of head_dim ``d`` (the VQ build with ``vq``)."""
    sfx = f"_d{d}" + ("_vq" if vq else "")
    geo = mma.head_dim_names(d)
    load_key = _bind(mma.load_key, sfx, **geo)
    load_value = _bind(mma.load_value, sfx, **geo)
    key_tiles = {f"_KEY_TILE_{b}": mma.make_key_tile(b, d) for b in MMA_BITS}
    value_tiles = {f"_VALUE_TILE_{b}": mma.make_value_tile(b, d) for b in MMA_BITS}
    tiles = _bind(mma.mma_tiles, sfx, **geo, VQ_BUILD=vq,
                  key_at=_bind(mma.key_at, sfx, load_key=load_key),
                  value_at=_bind(mma.value_at, sfx, load_value=load_value),
                  key_tile=_bind(mma.key_tile, sfx, **key_tiles),
                  value_tile=_bind(mma.value_tile, sfx, **value_tiles),
                  key_tile_quads=_bind(mma_vq.key_tile_quads, sfx, HEAD_DIM=d),
                  value_tile_quads=_bind(mma_vq.value_tile_quads, sfx, HEAD_DIM=d))
    return _bind(mma.mma_partition, sfx, **geo, VQ_BUILD=vq, mma_tiles=tiles,
                 stage_query_fragments=_bind(mma.stage_query_fragments, sfx, **geo),
                 store_mma_partition=_bind(mma.store_mma_partition, sfx, **geo))


_PARTITIONS = {(MMA_HEAD_DIM, False): mma.mma_partition, (MMA_HEAD_DIM, True): mma.mma_partition_vq}
_PARTITIONS.update({(d, vq): _build(d, vq) for d in MMA_HEAD_DIMS if d != MMA_HEAD_DIM for vq in (False, True)})


def mma_partition_for(d: int, vq: bool = False) -> Callable:
    """The tensor-core partition (:func:`~numba_kv.ops.attention.mma.mma_partition`) compiled
    for head_dim ``d`` (one of :data:`~numba_kv.ops.attention.mma.MMA_HEAD_DIMS`), the VQ build
    with ``vq`` (:data:`~numba_kv.ops.attention.mma.mma_partition_vq`)."""
    return _PARTITIONS[(int(d), bool(vq))]
