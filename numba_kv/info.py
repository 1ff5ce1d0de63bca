"""Environment report: ``python -m numba_kv.info``.

Prints versions, the Numba threading layer, and the CUDA / simulator / NVVM status.
"""

from __future__ import annotations

import os
import platform
import sys
from typing import Dict


def _version(mod: str) -> str:
    try:
        from importlib.metadata import version  # noqa: PLC0415

        return version(mod)
    except Exception:  # noqa: BLE001 - report, never fail
        return "not installed"


def threading_layer() -> str:
    """Name of Numba's threading layer (runs a tiny parallel function to initialize it)."""
    import numba  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    from .ops.bitpack import pack_bits  # noqa: PLC0415

    pack_bits(np.zeros((2, 8), np.uint8), 3)  # initializes the parallel runtime
    try:
        return numba.threading_layer()
    except ValueError:
        return "uninitialized"


def check_threading_layer() -> str:
    """Return the threading layer; ``RuntimeError`` if it is ``workqueue``.

    ``workqueue`` aborts the process when two Python threads enter a ``parallel=True``
    region at once, which concurrent per-layer cache calls do.  Install ``tbb`` or use an
    OpenMP build, or set ``NUMBA_THREADING_LAYER=omp``.
    """
    layer = threading_layer()
    if layer == "workqueue":
        raise RuntimeError("Numba threading layer is 'workqueue', which is not thread-safe: concurrent "
                           "cache calls from several threads would abort. Set NUMBA_THREADING_LAYER=omp "
                           "(or install tbb).")
    return layer


def collect() -> Dict[str, str]:
    """Environment facts as a dict of strings."""
    import numba  # noqa: PLC0415

    from . import __version__  # noqa: PLC0415
    from ._backend import simulator_enabled  # noqa: PLC0415

    info = {
        "numba_kv": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "numpy": _version("numpy"),
        "numba": numba.__version__,
        "llvmlite": _version("llvmlite"),
        "numba-cuda": _version("numba-cuda"),
        "cupy": _version("cupy-cuda13x"),
        "threads": str(numba.get_num_threads()),
        "threading_layer": threading_layer(),
        "cuda_simulator": "enabled" if simulator_enabled() else "disabled",
    }
    try:
        from numba import cuda  # noqa: PLC0415

        info["cuda_implementation"] = str(getattr(cuda, "implementation", "unknown"))
        avail = bool(cuda.is_available())
        info["cuda_available"] = str(avail)
        if avail and not simulator_enabled():
            dev = cuda.get_current_device()
            info["cuda_device"] = f"{dev.name.decode() if isinstance(dev.name, bytes) else dev.name} cc={dev.compute_capability}"
        if not simulator_enabled():
            try:
                from numba.cuda.cudadrv import nvvm  # noqa: PLC0415

                info["nvvm"] = "available" if nvvm.is_available() else "missing"
                if nvvm.is_available():
                    info["nvvm_version"] = ".".join(map(str, nvvm.NVVM().get_version()))
            except Exception as e:  # noqa: BLE001
                info["nvvm"] = f"error: {e}"
    except Exception as e:  # noqa: BLE001
        info["cuda"] = f"error: {e}"
    info["NUMBA_CACHE_DIR"] = os.environ.get("NUMBA_CACHE_DIR", "(default)")
    return info


def main() -> None:
    """Print :func:`collect` as aligned ``key: value`` lines."""
    info = collect()
    width = max(map(len, info))
    for k, v in info.items():
        sys.stdout.write(f"{k:<{width}} : {v}\n")


if __name__ == "__main__":
    main()
