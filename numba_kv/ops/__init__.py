"""Operations, each implemented twice (CPU twin + CUDA kernel) behind one dispatch.

Importing this package imports every op module so :data:`TWINS` is complete.
"""

from . import (  # noqa: F401
               absmax8,
               attention,
               bitpack,
               blockquant,
               gather,
               hadamard,
               headquant,
               intquant,
               lowrank,
               memory,
               paged_attention,  # importing registers the twins
               positions,
               qjl,
               vq,
)
from ._registry import TWINS, Twin

__all__ = ["TWINS", "Twin"]
