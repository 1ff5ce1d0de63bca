"""numba_kv — compressed KV caches for transformer LLMs, with CPU twins and CUDA kernels
from one pure-Python (Numba) code base.

Quick start (needs only the core install: ``pip install numba-kv``)::

    import numpy as np, numba_kv
    cache = numba_kv.make_cache("kv4", num_layers=30, num_kv_heads=3, head_dim=64)
    k, v = np.random.randn(2, 1, 3, 100, 64).astype(np.float32)  # [batch, num_kv_heads, seq, head_dim]
    res = cache.prefill(0, k, v)
    q1 = np.random.randn(1, 9, 1, 64).astype(np.float32)          # [batch, num_heads, 1, head_dim]
    out = cache.decode(0, k[:, :, -1:], v[:, :, -1:], q1, numba_kv.AttendConfig(0.125, n_kv_groups=3))
"""

__version__ = "0.1.0"

from ._config import knobs
from ._graph import StepGraph
from ._launch import launch_stream
from .caches.config import PolarQuantConfig, TurboQuantConfig
from .caches.dense import DenseCache
from .caches.mixed import MixedCache
from .caches.mla import MLACache, SimpleMLACache
from .caches.paged import OutOfPagesError, PagedKVCache, PageTable
from .caches.persist import CacheFileError, load_cache
from .caches.polarquant import PolarQuantCache
from .caches.protocol import AttendConfig, CompressedKVCache, DecodeOutput, Dequantized, DequantResult, Fused
from .caches.spec import CACHE_NAMES, make_cache
from .caches.step import DecodeStep
from .caches.turboquant import TurboQuantCache
from .compressor import CompressedKV, CompressionMethod, KVCacheCompressor
from .ops.attention import decode_attention
from .ops.bitpack import pack_bits, unpack_bits
from .ops.blockquant import dequantize_blocks, quantize_blocks
from .ops.codebook import get_codebook
from .ops.hadamard import rotate32
from .ops.headquant import dequantize_head, quantize_head, rotate_head
from .ops.qjl import make_sketch, qjl_inner_product, qjl_quantize
from .threads import check_threading_layer

__all__ = [
    "AttendConfig", "CACHE_NAMES", "CompressedKV", "CompressedKVCache", "CompressionMethod", "DecodeOutput",
    "DenseCache", "Dequantized", "DequantResult", "Fused", "KVCacheCompressor", "MLACache", "OutOfPagesError",
    "PageTable", "PagedKVCache", "PolarQuantCache", "SimpleMLACache", "check_threading_layer",
    "TurboQuantCache", "decode_attention", "dequantize_blocks", "dequantize_head", "get_codebook", "make_cache",
    "make_sketch", "pack_bits", "qjl_inner_product", "qjl_quantize", "quantize_blocks", "quantize_head", "rotate32",
    "rotate_head", "unpack_bits",
]
__all__ += ["CacheFileError", "DecodeStep", "MixedCache", "PolarQuantConfig", "StepGraph", "TurboQuantConfig", "knobs",
            "launch_stream", "load_cache"]
