"""Pure-NumPy oracles written straight from the math in the module docstrings.

They import NumPy only — never ``numba_kv.ops`` or ``numba_kv.caches`` — so an oracle
cannot inherit the bug it is meant to catch (a meta-test checks the imports).  Slow,
simple, float64 where it helps.
"""

from .headvq import head_sign_vector, headvq_dequantize, headvq_quantize, headvq_table
from .norm8 import norm8_base16, norm8_decode, norm8_encode
from .pairs import pair_table
from .polarquant import (
                         SIGN_MASK,
                         attention,
                         dequantize,
                         hadamard,
                         hadamard32,
                         pack_bits,
                         quantize,
                         rotate_forward,
                         rotate_head_forward,
                         rotate_inverse,
                         sign_vector,
                         unpack_bits,
)

__all__ = ["SIGN_MASK", "attention", "dequantize", "hadamard", "hadamard32", "head_sign_vector", "headvq_dequantize",
           "headvq_quantize", "headvq_table", "norm8_base16", "norm8_decode", "norm8_encode", "pack_bits", "pair_table",
           "quantize", "rotate_forward", "rotate_head_forward", "rotate_inverse", "sign_vector", "unpack_bits"]
