"""What packing a CUDA launch's parameters costs on the host, timed without a GPU.

``cuda.core``'s ``launch`` packs its arguments into a new ``ParamHolder`` (the ``void*`` array
the driver reads) on every call; a prepared entry of ``numba_kv._launch`` packs them once and
hands the driver that buffer on every repeat.  This builds the parameters of each registered
decode-attention kernel from its Numba signature the way Numba's ``_Kernel._prepare_args``
converts them (an array is ``meminfo, parent, size, itemsize, data, *shape, *strides``:
``5 + 2·ndim`` Python ints; an integer a ``ctypes`` integer of its width, a float32 a
``ctypes.c_float``, a boolean a ``bool``) and times ``ParamHolder`` over them: best of 5
rounds of 2,000::

    python benchmarks/launch_params.py
"""

from __future__ import annotations

import ctypes
import time

from numba import types
from numba.core import sigutils

from numba_kv.info import provenance_line
from numba_kv.ops import TWINS

KERNELS = ("decode_attention", "decode_attention_warp", "decode_attention_mma", "paged_decode_attention_mma")


def parameters(signature: str) -> list:
    """A launch's parameters for ``signature`` as Numba converts them (values arbitrary)."""
    args, _ = sigutils.normalize_signature(signature)
    params: list = []
    for ty in args:
        if isinstance(ty, types.Array):
            shape = (8,) * ty.ndim
            strides = tuple(ty.dtype.bitwidth // 8 * 8 ** (ty.ndim - 1 - i) for i in range(ty.ndim))
            params += [0, 0, 8 ** ty.ndim, ty.dtype.bitwidth // 8, 0x7F0000000000, *shape, *strides]
        elif ty == types.boolean:
            params.append(True)
        elif isinstance(ty, types.Integer):
            params.append(getattr(ctypes, f"c_{ty}")(1))
        elif ty == types.float32:
            params.append(ctypes.c_float(0.5))
        else:
            raise TypeError(f"an argument type this script does not convert: {ty}")
    return params


def pack_us(params: list, rounds: int = 5, n: int = 2000) -> float:
    """Best µs per ``ParamHolder(params)``."""
    from cuda.core._kernel_arg_handler import ParamHolder  # noqa: PLC0415 - numba-cuda's dependency

    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(n):
            ParamHolder(params)
        best = min(best, (time.perf_counter() - t) / n)
    return best * 1e6


def main() -> None:
    print(provenance_line())
    print("| kernel | parameters | µs to pack them (cuda.core ParamHolder) |")
    print("| --- | --- | --- |")
    for name in KERNELS:
        params = parameters(TWINS[name].signatures[0])
        print(f"| `{name}` | {len(params)} | {pack_us(params):.1f} |")


if __name__ == "__main__":
    main()
