"""Operations, each implemented twice (CPU twin + CUDA kernel) behind one dispatch.

Importing this package imports every op module so :data:`TWINS` is complete.
"""

from . import (  # noqa: F401
               absmax8,
               attention,  # importing registers the twins
               bitpack,
               blockquant,
               gather,
               hadamard,
               headpair,
               headquant,
               headvq,
               intquant,
               keymean,
               lowrank,
               memory,
               norm8,
               positions,
               qjl,
               vq,
               window8,
)
from ._registry import TWINS, Twin

__all__ = ["TWINS", "Twin"]
