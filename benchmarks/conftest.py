"""Shared fixtures of the benchmark suites (pytest-benchmark)."""

import numpy as np
import pytest


@pytest.fixture(scope="session")
def vectors_1m():
    """1 048 576 Gaussian vectors, d=128, float32 (512 MiB)."""
    return np.random.default_rng(0).standard_normal((1 << 20, 128)).astype(np.float32)




def pytest_benchmark_update_machine_info(config, machine_info):
    """Record CPU model, LLVM host CPU, code-generation target, AVX-512 use, threads (BLAS
    threads counted where no variable sets them) and versions
    (:func:`numba_kv.toolkit.bench.bench_provenance`) in every benchmark JSON."""
    from numba_kv.toolkit.bench import bench_provenance

    machine_info["numba_kv_provenance"] = bench_provenance()
