"""Operations, each implemented twice (CPU twin + CUDA kernel) behind one dispatch.

Importing this package imports every op module so :data:`TWINS` is complete.
"""

from . import bitpack, blockquant, hadamard, memory  # noqa: F401  (registers the twins)
from ._registry import TWINS, Twin

__all__ = ["TWINS", "Twin"]
