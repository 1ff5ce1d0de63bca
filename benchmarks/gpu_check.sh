#!/usr/bin/env bash
# Every GPU check in one go, for a machine with an NVIDIA GPU where numba, numba-cuda, CuPy,
# pytest (+ pytest-xdist, pytest-timeout, pytest-benchmark), hypothesis and tqdm are already
# installed -- no network and no virtual environment needed (`make test-gpu` is the same tests
# from the project's venv):
#
#   bash benchmarks/gpu_check.sh [OUTDIR]        # PYTHON=python3, JOBS=8 by default
#
# Stages, in the order they run (the correctness gate first, the figures the issues ask for next, so that a
# lease cut short keeps what matters), each under its own time limit (seconds, overridable), each log in
# OUTDIR; about 13 minutes in all by default (the limits add up to 25):
#   1. tests_gpu.log:          the gpu_only and cuda tests on the real GPU (CuPy and Numba device arrays,
#                              StepGraph capture and replay, the transformers cache on CUDA; TEST_LIMIT=200;
#                              verbose, so that a run cut at its limit still names the tests that failed)
#   2. decode_step.{txt,json}: `numba-kv bench decode-step --device cuda` (dense/pqo3/kv4 at T 4K..128K, batch 1,
#                              vs torch SDPA, the fused steps also through a numba_kv.StepGraph: the "graph"
#                              columns; DECODE_LIMIT=90); decode_step_kv3.*: kv3 at T 4K and 32K (its VQ codes
#                              run decode_attention_mma_vq, never timed before; one store launch, as kv4's),
#                              decode_step_kv3_warp.*: the same on the warp VQ build (the A/B);
#                              decode_step_d64.*: SmolLM2's shape (3 KV heads × 3, head_dim 64: the tensor-core
#                              *_d64 builds) at T 4K and 32K;
#                              decode_step_numba_launch.*: the same at T 4K with
#                              NUMBA_KV_CUDA_PREPARED_LAUNCH=0 (every launch through Numba's typing: the A/B)
#   3. step_kernels.log:       benchmarks/gpu_step_kernels.py (each launch of a batch-1 step timed alone, a
#                              DecodeStep's GPU and wall time per step, the tensor-core kernel at partitions of
#                              128 … 2048 tokens: the fit of mma.MERGE_PARTS_PER_SQRT_TOKEN; KERNELS_MODES=pqo3,
#                              KERNELS_LIMIT=90)
#   4. mma_check.log:          benchmarks/gpu_mma_check.py (tensor-core kernel: accuracy vs the CPU twin, A/B vs the
#                              warp kernel, launch bounds and the partition rule before the wave model, torch SDPA,
#                              GPU time of both; the head_dim 64 build vs the warp kernel and torch: --d64;
#                              MMA_LIMIT=300; OLD=REV[,REV] or a folder
#                              holding extracted numba_kv_ab* packages adds those builds' tensor-core kernels to the A/B)
#      bench_cuda_d64.*, bench_cuda_d64_warp.*: `numba-kv bench attention --device cuda --head-dim 64` (the
#                              tensor-core *_d64 builds vs torch SDPA) and the same on the warp kernel
#                              (NUMBA_KV_CUDA_MMA_ATTENTION=0: the A/B; D64_LIMIT=90 each)
#   5. profile_mma.log:        benchmarks/gpu_profile_mma.py --ncu auto (Nsight Compute's counters of the tensor-core
#                              kernel at T 128K batch 32 and T 32K batch 8: stall reasons, issue slots, occupancy;
#                              NCU_LIMIT=120; without ncu, the two shapes timed)
#   6. bench_cuda.{txt,json}:  `numba-kv bench attention --device cuda` at T 32K/128K, batch 1/8/32, 3/4 bits
#                              (fused vs torch SDPA vs CuPy fp16 vs dequantize-then-attend; BENCH_LIMIT=150;
#                              BENCH_TOKENS=4096,16384,32768,65536,131072 for the whole grid)
#   7. pytest_bench.json:      the pytest-benchmark groups attention-cuda(-torch)-T4096-b* and decode-step-cuda-T4096
#   8. attention_ab.log:       benchmarks/gpu_attention_ab.py (block vs warp kernel, launch bounds, copy bandwidth)
# torch (for the SDPA baseline) is optional: without it the torch columns stay empty.
#
# QUICK=1 runs a short subset instead (about 6 minutes; limits add up to 8), for a lease of 15
# minutes with time to rerun: the device tests and the tensor-core tests (tests/gpu,
# tests/cuda/test_sim_mma.py, test_sim_mma_vq.py, test_sim_mma_dims.py), decode-step at T 4K (kv3 too), the
# step's kernels at T 4K (pqo3), the tensor-core A/B at T 32K/128K, batch 8/32, 3 bits with GPU times (and kv3's
# codes on the tensor-core and warp VQ builds at 32K; the head_dim 64 build against the warp kernel and torch:
# --d64), and Nsight Compute at T 128K, batch 32.
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
"$py" -c "import torch; print('torch', torch.__version__, 'CUDA' if torch.cuda.is_available() else 'no CUDA')" \
    2>/dev/null || echo "torch: not installed (no torch SDPA baseline)"

if [ "${QUICK:-0}" = 1 ]; then
    stage "gpu tests (quick)" "${TEST_LIMIT:-130}" "$out/tests_gpu.log" \
        "$py" -m pytest -v -rfE -p no:cacheprovider $xdist $ptimeout -m "cuda or gpu_only" tests/gpu \
        tests/cuda/test_sim_mma.py tests/cuda/test_sim_mma_vq.py tests/cuda/test_sim_mma_dims.py
    stage "bench decode-step --device cuda (T 4K)" "${DECODE_LIMIT:-60}" "$out/decode_step.txt" \
        "$py" -m numba_kv.toolkit.cli bench decode-step --device cuda --tokens 4096 --modes dense,pqo3,kv4,kv3 \
        --no-progress --json "$out/decode_step.json"
    stage "a step's kernels (T 4K, pqo3)" "${KERNELS_LIMIT:-60}" "$out/step_kernels.log" \
        "$py" benchmarks/gpu_step_kernels.py --modes pqo3 --tokens 4096
    stage "tensor-core kernel: accuracy, A/B, torch (quick)" "${MMA_LIMIT:-160}" "$out/mma_check.log" \
        "$py" benchmarks/gpu_mma_check.py --tokens 32768,131072 --batch 8,32 --bits 3 --device-time --d64
    stage "ncu: the tensor-core kernel's counters (T 128K, batch 32)" "${NCU_LIMIT:-60}" "$out/profile_mma.log" \
        "$py" benchmarks/gpu_profile_mma.py --ncu auto --shapes 131072x32
    exit $status
fi
stage "gpu tests" "${TEST_LIMIT:-200}" "$out/tests_gpu.log" \
    "$py" -m pytest -v -rfE -p no:cacheprovider $xdist $ptimeout -m "cuda or gpu_only" \
    tests/gpu tests/cuda tests/caches/test_lifecycle.py tests/caches/test_sliding.py tests/toolkit/test_bench_cuda.py \
    tests/toolkit/test_bench_step.py
stage "bench decode-step --device cuda" "${DECODE_LIMIT:-90}" "$out/decode_step.txt" \
    "$py" -m numba_kv.toolkit.cli bench decode-step --device cuda --no-progress --json "$out/decode_step.json"
"$py" -c "import json, sys; from numba_kv.toolkit import bench_step as b; \
rows = [b.DecodeStepRow(**r) for r in json.load(open(sys.argv[1]))['rows']]; print(b.render(rows))" \
    "$out/decode_step.json" >> "$out/decode_step.txt" 2>&1 && tail -n 25 "$out/decode_step.txt"
stage "bench decode-step --device cuda, kv3 (T 4K, 32K)" "${DECODE_LIMIT:-90}" "$out/decode_step_kv3.txt" \
    "$py" -m numba_kv.toolkit.cli bench decode-step --device cuda --tokens 4096,32768 --modes kv3 --no-progress \
    --json "$out/decode_step_kv3.json"
stage "bench decode-step --device cuda, kv3 on the warp VQ build (A/B of the tensor-core VQ build)" \
    "${DECODE_LIMIT:-90}" "$out/decode_step_kv3_warp.txt" env NUMBA_KV_CUDA_MMA_ATTENTION=0 \
    "$py" -m numba_kv.toolkit.cli bench decode-step --device cuda --tokens 4096,32768 --modes kv3 --no-torch \
    --no-progress --json "$out/decode_step_kv3_warp.json"
stage "bench decode-step --device cuda, SmolLM2's shape (head_dim 64: the *_d64 builds)" "${DECODE_LIMIT:-90}" \
    "$out/decode_step_d64.txt" "$py" -m numba_kv.toolkit.cli bench decode-step --device cuda --tokens 4096,32768 \
    --head-dim 64 --kv-heads 3 --groups 3 --modes dense,pqo3,kv4,kv3 --no-progress --json "$out/decode_step_d64.json"
stage "bench decode-step --device cuda, every launch through Numba (A/B of prepared launches)" "${DECODE_LIMIT:-90}" \
    "$out/decode_step_numba_launch.txt" env NUMBA_KV_CUDA_PREPARED_LAUNCH=0 \
    "$py" -m numba_kv.toolkit.cli bench decode-step --device cuda --tokens 4096 --no-torch --no-progress \
    --json "$out/decode_step_numba_launch.json"
stage "a step's kernels, and the tensor-core partition length" "${KERNELS_LIMIT:-90}" "$out/step_kernels.log" \
    "$py" benchmarks/gpu_step_kernels.py --modes "${KERNELS_MODES:-pqo3}"
stage "tensor-core kernel: accuracy, A/B vs warp kernel, torch" "${MMA_LIMIT:-300}" "$out/mma_check.log" \
    "$py" benchmarks/gpu_mma_check.py --tokens 32768,131072 --batch 1,8,32 --bits 3,4 --device-time --d64 \
    ${OLD:+--old "$OLD"}
stage "head_dim 64: the tensor-core *_d64 builds vs torch" "${D64_LIMIT:-90}" "$out/bench_cuda_d64.txt" \
    "$py" -m numba_kv.toolkit.cli bench attention --device cuda --head-dim 64 --tokens 32768,131072 --batch 1,8,32 \
    --no-progress --json "$out/bench_cuda_d64.json"
stage "head_dim 64 on the warp kernel (A/B of the *_d64 builds)" "${D64_LIMIT:-90}" "$out/bench_cuda_d64_warp.txt" \
    env NUMBA_KV_CUDA_MMA_ATTENTION=0 "$py" -m numba_kv.toolkit.cli bench attention --device cuda --head-dim 64 \
    --tokens 32768,131072 --batch 1,8,32 --no-torch --no-progress --json "$out/bench_cuda_d64_warp.json"
stage "ncu: the tensor-core kernel's counters (stall reasons, issue, occupancy)" "${NCU_LIMIT:-120}" \
    "$out/profile_mma.log" "$py" benchmarks/gpu_profile_mma.py --ncu auto
stage "bench attention --device cuda" "${BENCH_LIMIT:-150}" "$out/bench_cuda.txt" \
    "$py" -m numba_kv.toolkit.cli bench attention --device cuda --tokens "${BENCH_TOKENS:-32768,131072}" \
    --batch 1,8,32 --no-progress --json "$out/bench_cuda.json"
"$py" -c "import json, sys; from numba_kv.toolkit import bench_cuda as b; \
rows = [b.CudaAttentionRow(**r) for r in json.load(open(sys.argv[1]))['rows']]; print(b.render(rows))" \
    "$out/bench_cuda.json" >> "$out/bench_cuda.txt" 2>&1 && tail -n 40 "$out/bench_cuda.txt"
stage "pytest-benchmark attention-cuda, decode-step-cuda" "${PB_LIMIT:-60}" "$out/pytest_bench.log" \
    "$py" -m pytest -q -p no:cacheprovider benchmarks/bench_attention_cuda.py benchmarks/bench_decode_step_cuda.py \
    -k "4096" --benchmark-only --benchmark-json="$out/pytest_bench.json"
stage "kernel A/B" "${AB_LIMIT:-90}" "$out/attention_ab.log" \
    "$py" benchmarks/gpu_attention_ab.py
exit $status
