"""Environment report: ``python -m numba_kv.info``.

Prints versions, the Numba threading layer, the CPU and the code Numba generates for it
(LLVM host CPU, code-generation target, the SIMD features that matter), and the CUDA /
simulator / NVVM status.  :func:`provenance` is what every benchmark records next to its
numbers.

AVX2 code generation on any x86-64 host: ``NUMBA_CPU_NAME=haswell`` alone is not enough,
because Numba takes the *features* from the host unless ``NUMBA_CPU_FEATURES`` is set (on
an AVX-512 host the "haswell" code would still use AVX-512).  ``python -m numba_kv.info
--avx2-env`` prints the variables that give true AVX2 code (:data:`AVX2_FEATURES`), plus
``OPENBLAS_CORETYPE=Haswell`` so NumPy's BLAS runs its AVX2 kernels too, and
``NPY_DISABLE_CPU_FEATURES`` naming NumPy's dispatch targets above AVX2 (on NumPy 2.4
``X86_V4,AVX512_ICL,AVX512_SPR``: :func:`numpy_avx512_targets`) so that NumPy's own SIMD
loops (ufuncs such as ``np.exp``, sorting: the dense baselines' softmax) run their AVX2
kernels as well.  :func:`provenance` records the targets NumPy dispatches to
(``numpy_simd``).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import sys
import time
from importlib.metadata import version

import llvmlite.binding as ll
import numba
import numpy as np
from numba import cuda, njit
from numba.cuda.cudadrv import nvvm

from . import __version__
from ._backend import simulator_enabled
from .threads import threading_layer

try:  # NumPy 2.x's SIMD dispatch tables (a private module: absent in another layout)
    from numpy._core import _multiarray_umath as _NPY_CPU
except ImportError:  # pragma: no cover
    _NPY_CPU = None

# The feature set of Intel Haswell (AVX2 + FMA + BMI2, no AVX-512): what most laptops and
# many cloud machines run.  Used with NUMBA_CPU_NAME=haswell.
AVX2_FEATURES = ("+64bit,+avx,+avx2,+bmi,+bmi2,+cmov,+cx16,+cx8,+f16c,+fma,+fsgsbase,+fxsr,"
                 "+invpcid,+lzcnt,+mmx,+movbe,+pclmul,+popcnt,+rdrnd,+sahf,+sse,+sse2,+sse3,"
                 "+sse4.1,+sse4.2,+ssse3,+xsave,+xsaveopt")
_FEATURES = ("avx2", "fma", "bmi2", "avx512f", "avx512bw", "avx512vl")


def _version(mod: str) -> str:
    try:
        return version(mod)
    except Exception:  # noqa: BLE001 - report, never fail
        return "not installed"


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, ``platform.processor()`` elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _probe(t, b, out):  # a conditional byte store: vectorizes only with AVX-512BW masks
    for m in range(out.size):
        if t[m] > b:
            out[m] += np.uint8(1)


def codegen() -> dict[str, str]:
    """What Numba generates code for in this process.

    Returns
    -------
    dict of str
        ``llvm_host_cpu`` (what LLVM detects), ``codegen_target`` (``NUMBA_CPU_NAME`` or
        ``host``), ``codegen_features`` (``NUMBA_CPU_FEATURES`` or ``host``), the host's
        ``avx2 / fma / bmi2 / avx512f / avx512bw / avx512vl`` flags as ``yes``/``no``, and
        ``avx512_in_codegen``: whether a probe function compiled here (with Numba's current
        target) contains AVX-512 registers — the ground truth, independent of the names.
    """
    feats = ll.get_host_cpu_features()
    out = {
        "cpu_model": cpu_model(),
        "llvm_host_cpu": ll.get_host_cpu_name(),
        "codegen_target": os.environ.get("NUMBA_CPU_NAME", "host"),
        "codegen_features": "avx2 (AVX2_FEATURES)" if os.environ.get("NUMBA_CPU_FEATURES") == AVX2_FEATURES
        else os.environ.get("NUMBA_CPU_FEATURES", "host"),
    }
    for f in _FEATURES:
        out[f"host_{f}"] = "yes" if feats.get(f, False) else "no"
    try:
        fn = njit(cache=False)(_probe)
        fn(np.zeros(64, np.float32), np.float32(0), np.zeros(64, np.uint8))
        asm = "".join(fn.inspect_asm().values())
        out["avx512_in_codegen"] = "yes" if re.search(r"%zmm|\{%k[1-7]\}", asm) else "no"
    except Exception as e:  # noqa: BLE001 - report, never fail
        out["avx512_in_codegen"] = f"unknown ({type(e).__name__})"
    return out


def blas_threads() -> str:
    """BLAS thread count as the environment sets it (``OPENBLAS_NUM_THREADS`` / ``OMP_NUM_THREADS``)."""
    for var in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "OMP_NUM_THREADS"):
        if var in os.environ:
            return f"{os.environ[var]} ({var})"
    return "default"


def stream_copy_gbs(n_bytes: int = 1 << 28, repeats: int = 5) -> float:
    """Memory bandwidth of this machine, STREAM-copy style, in GB/s (best of ``repeats``).

    Copies a ``n_bytes`` float32 array (256 MiB by default, far beyond the caches) with
    :func:`numpy.copyto` and counts read + write bytes (``2 * n_bytes`` per copy), as
    STREAM's "Copy" does.  Single-threaded NumPy: this is what one core streams, which is
    the relevant bound for a decode step on a 2-core machine too (the memory controller
    is shared).
    """
    a = np.ones(n_bytes // 4, np.float32)
    b = np.empty_like(a)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t0)
    return 2 * n_bytes / best / 1e9


def _numpy_dispatch() -> tuple[list[str], dict[str, bool]]:
    """NumPy's SIMD dispatch targets and the CPU features it found (NumPy 2.x's module; empty
    where it is not there)."""
    if _NPY_CPU is None:  # pragma: no cover - another NumPy layout
        return [], {}
    return list(_NPY_CPU.__cpu_dispatch__), dict(_NPY_CPU.__cpu_features__)


def numpy_avx512_targets() -> list[str]:
    """NumPy's dispatch targets above AVX2 (``X86_V4`` and the ``AVX512*`` ones): what
    ``NPY_DISABLE_CPU_FEATURES`` must name for AVX2 loops."""
    return [t for t in _numpy_dispatch()[0] if t == "X86_V4" or t.startswith("AVX512")]


def numpy_simd() -> str:
    """The dispatch targets NumPy's SIMD loops use in this process (comma-separated;
    ``baseline`` when none above NumPy's compiled baseline is enabled)."""
    dispatch, features = _numpy_dispatch()
    return ",".join(t for t in dispatch if features.get(t)) or "baseline"


def provenance() -> dict[str, str]:
    """Everything a benchmark number must be labelled with.

    CPU model, LLVM host CPU, code-generation target and features, whether AVX-512 is in
    the generated code, Numba threads and threading layer, BLAS threads, and the versions
    of Python, NumPy, Numba and llvmlite.  Every benchmark JSON and every ``numba-kv
    bench`` table records it.
    """
    info = codegen()
    info.update({
        "numba_threads": str(numba.get_num_threads()),
        "threading_layer": threading_layer(),
        "blas_threads": blas_threads(),
        "openblas_coretype": os.environ.get("OPENBLAS_CORETYPE", "host"),
        "numpy_simd": numpy_simd(),
        # the package's knobs set from the environment (``NUMBA_KV_<NAME>``): which kernels ran
        "knobs_env": ",".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("NUMBA_KV_"))
        or "defaults",
        "numba_kv": __version__,
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "numba": numba.__version__,
        "llvmlite": _version("llvmlite"),
    })
    return info


def provenance_line(info: dict[str, str] | None = None) -> str:
    """One-line label for a table: CPU, LLVM host, codegen target, AVX-512 use, threads."""
    p = info or provenance()
    return (f"{p['cpu_model']} (LLVM host {p['llvm_host_cpu']}), codegen {p['codegen_target']}"
            f" [AVX-512 in code: {p['avx512_in_codegen']}], Numba threads {p['numba_threads']}"
            f" ({p['threading_layer']}), BLAS threads {p['blas_threads']} (OpenBLAS core"
            f" {p.get('openblas_coretype', 'host')}), numba {p['numba']}")


def collect() -> dict[str, str]:
    """Environment facts as a dict of strings."""
    info = {
        "numba_kv": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        **codegen(),
        "numpy": _version("numpy"),
        "numba": numba.__version__,
        "llvmlite": _version("llvmlite"),
        "numba-cuda": _version("numba-cuda"),
        "cupy": _version("cupy-cuda13x"),
        "threads": str(numba.get_num_threads()),
        "threading_layer": threading_layer(),
        # NumPy's BLAS runs the dense baselines: its threads and kernels (``--avx2-env`` sets Haswell)
        "blas_threads": blas_threads(),
        "openblas_coretype": os.environ.get("OPENBLAS_CORETYPE", "host"),
        "numpy_simd": numpy_simd(),
        "cuda_simulator": "enabled" if simulator_enabled() else "disabled",
    }
    try:
        info["cuda_implementation"] = str(getattr(cuda, "implementation", "unknown"))
        avail = bool(cuda.is_available())
        info["cuda_available"] = str(avail)
        if avail and not simulator_enabled():
            dev = cuda.get_current_device()
            name = dev.name.decode() if isinstance(dev.name, bytes) else dev.name
            info["cuda_device"] = f"{name} cc={dev.compute_capability}"
        if not simulator_enabled():
            try:
                info["nvvm"] = "available" if nvvm.is_available() else "missing"
                if nvvm.is_available():
                    info["nvvm_version"] = ".".join(map(str, nvvm.NVVM().get_version()))
            except Exception as e:  # noqa: BLE001
                # cuda.pathfinder's message lists the folders it searched: the first line says it
                first = (str(e).strip().splitlines() or [""])[0]
                info["nvvm"] = f'missing ({first}): pip install "numba-kv[cuda]"'
    except Exception as e:  # noqa: BLE001
        info["cuda"] = f"error: {e}"
    info["NUMBA_CACHE_DIR"] = os.environ.get("NUMBA_CACHE_DIR", "(default)")
    return info


def main(argv: list[str] | None = None) -> None:
    """Print :func:`collect` as aligned ``key: value`` lines.

    ``--avx2-env`` prints instead the environment assignments that make Numba generate, and
    OpenBLAS and NumPy's SIMD loops run, AVX2 code only (``OPENBLAS_CORETYPE=Haswell
    NUMBA_CPU_NAME=haswell NUMBA_CPU_FEATURES=... NPY_DISABLE_CPU_FEATURES=...``), for
    ``env $(...) command``.
    """
    parser = argparse.ArgumentParser(
        prog="python -m numba_kv.info",
        description="Print what numba_kv runs with on this machine (CPU and code generation target, threads, "
                    "versions) as 'key : value' lines.")
    parser.add_argument("--avx2-env", action="store_true",
                        help="print the environment that makes Numba generate, and OpenBLAS and NumPy's "
                             "SIMD loops run, AVX2 code only, for `env $(python -m numba_kv.info --avx2-env) "
                             "command`")
    args = parser.parse_args(argv)  # (unknown arguments were ignored silently, --help included)
    if args.avx2_env:
        # OpenBLAS picks its kernels at run time from the host: without OPENBLAS_CORETYPE the
        # NumPy baselines (and any np.dot inside a kernel) would still run AVX-512 code
        # (and NumPy's ufunc loops theirs, by the dispatch targets above AVX2)
        above = numpy_avx512_targets()
        npy = f" NPY_DISABLE_CPU_FEATURES={','.join(above)}" if above else ""
        sys.stdout.write(f"OPENBLAS_CORETYPE=Haswell NUMBA_CPU_NAME=haswell NUMBA_CPU_FEATURES={AVX2_FEATURES}{npy}\n")
        return
    info = collect()
    width = max(map(len, info))
    for k, v in info.items():
        sys.stdout.write(f"{k:<{width}} : {v}\n")


if __name__ == "__main__":
    main()
