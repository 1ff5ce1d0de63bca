#!/usr/bin/env bash
# Every GPU check in one go, for a machine with an NVIDIA GPU where numba, numba-cuda, CuPy,
# pytest (+ pytest-xdist, pytest-timeout, pytest-benchmark), hypothesis and tqdm are already
# installed -- no network and no virtual environment needed (`make test-gpu` is the same tests
# from the project's venv):
#
#   bash benchmarks/gpu_check.sh [OUTDIR]        # PYTHON=python3, JOBS=8 by default
#
# Stages, each under its own time limit, each log in OUTDIR:
#   1. bench_cuda.{txt,json}: `numba-kv bench attention --device cuda` (T 4K..128K, batch 1/8/32, 3/4 bits)
#   2. attention_ab.log:     benchmarks/gpu_attention_ab.py (block vs warp kernel, launch bounds, copy bandwidth)
#   3. tests_gpu.log:         the gpu_only and cuda tests on the real GPU (CuPy and Numba device arrays)
#   4. pytest_bench.json:     the pytest-benchmark group attention-cuda at T = 4096
set -u
out=${1:-benchmarks/results/gpu}
py=${PYTHON:-python3}
jobs=${JOBS:-8}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export NUMBA_CACHE_DIR="${NUMBA_CACHE_DIR:-/tmp/numba_kv_gpu_cache}"
status=0
# pytest-xdist / pytest-timeout when installed (the GPU image has both; the venv may not)
xdist=$("$py" -c "import xdist" 2>/dev/null && echo "-n $jobs")
ptimeout=$("$py" -c "import pytest_timeout" 2>/dev/null && echo "--timeout 150")

stage() {  # stage NAME LIMIT_S LOG CMD...
    local name=$1 limit=$2 log=$3 t0 rc
    shift 3
    echo "== $name (limit ${limit}s): $*"
    t0=$(date +%s)
    timeout "$limit" "$@" > "$log" 2>&1
    rc=$?
    echo "== $name: rc=$rc after $(( $(date +%s) - t0 ))s"
    tail -n "${TAIL:-30}" "$log"
    [ "$rc" -eq 0 ] || status=1
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv
"$py" -c "import sys, numpy, numba, numba_cuda, cupy; print(sys.version.split()[0], 'numpy', numpy.__version__, \
'numba', numba.__version__, 'numba-cuda', numba_cuda.__version__, 'cupy', cupy.__version__)"

stage "bench attention --device cuda" "${BENCH_LIMIT:-200}" "$out/bench_cuda.txt" \
    "$py" -m numba_kv.toolkit.cli bench attention --device cuda --no-progress --json "$out/bench_cuda.json"
"$py" -c "import json, sys; from numba_kv.toolkit import bench_cuda as b; \
rows = [b.CudaAttentionRow(**r) for r in json.load(open(sys.argv[1]))['rows']]; print(b.render(rows))" \
    "$out/bench_cuda.json" >> "$out/bench_cuda.txt" 2>&1 && tail -n 40 "$out/bench_cuda.txt"
stage "kernel A/B" "${AB_LIMIT:-90}" "$out/attention_ab.log" \
    "$py" benchmarks/gpu_attention_ab.py
stage "gpu tests" "${TEST_LIMIT:-200}" "$out/tests_gpu.log" \
    "$py" -m pytest -q -p no:cacheprovider $xdist $ptimeout -m "cuda or gpu_only" \
    tests/gpu tests/cuda tests/caches/test_lifecycle.py tests/caches/test_sliding.py tests/toolkit/test_bench_cuda.py
stage "pytest-benchmark attention-cuda" "${PB_LIMIT:-60}" "$out/pytest_bench.log" \
    "$py" -m pytest -q -p no:cacheprovider benchmarks/bench_attention_cuda.py -k "4096" --benchmark-only \
    --benchmark-json="$out/pytest_bench.json"
exit $status
