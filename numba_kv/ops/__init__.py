"""Operations, each implemented twice (CPU twin + CUDA kernel) behind one dispatch.

Importing this package imports every op module so :data:`TWINS` is complete.
"""

from . import (attention, bitpack, blockquant, gather, hadamard, headquant, intquant, lowrank, memory,  # noqa: F401
               paged_attention, qjl, vq)  # importing registers the twins
from ._registry import TWINS, Twin

__all__ = ["TWINS", "Twin"]
