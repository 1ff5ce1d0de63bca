"""Shared fixtures of the benchmark suites (pytest-benchmark)."""

import numba
import numpy as np
import pytest


@pytest.fixture(scope="session")
def vectors_1m():
    """1 048 576 Gaussian vectors, d=128, float32 (512 MiB)."""
    return np.random.default_rng(0).standard_normal((1 << 20, 128)).astype(np.float32)


