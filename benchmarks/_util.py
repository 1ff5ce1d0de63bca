import numba


def env_info(benchmark, n_vectors, backend="cpu"):
    benchmark.extra_info.update({
        "backend": backend,
        "threads": numba.get_num_threads(),
        "threading_layer": numba.threading_layer() if backend == "cpu" else "n/a",
        "n_vectors": n_vectors,
    })


def rate(benchmark, n):
    """Record vectors/s from the benchmark's minimum time (nothing when benchmarks are disabled)."""
    if benchmark.stats is None:
        return
    benchmark.extra_info["M_vectors_per_s"] = round(n / benchmark.stats.stats.min / 1e6, 4)
