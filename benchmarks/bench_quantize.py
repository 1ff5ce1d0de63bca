"""Quantize / dequantize throughput: numba_kv vs the NumPy oracle vs FAISS ``HR,SQtqmse``.

d = 128, 2^20 vectors, NumPy float32 in -> packed codes out, on the threads Numba has
(``make bench`` sets NUMBA_NUM_THREADS=2, and runs the suite twice: native code generation
and AVX2-only code generation).  Ours — the block quantizer (``quantize_blocks``) and the
whole-head quantizer (``quantize_head``) — and FAISS sit in the same group of the same run,
so ratios are measured, not assembled.  The NumPy reference is slow and runs on the first
:data:`REFERENCE_VECTORS` vectors only, so it has a group of its own (pytest-benchmark's
ratios compare times, which would compare 8× less work); its ``M_vectors_per_s`` compares.
Every test records ``M_vectors_per_s`` and ``n_vectors`` in ``extra_info``; the machine and
code-generation target are in the JSON's ``machine_info`` (``numba_kv_provenance``).
"""

import pytest

from numba_kv import reference
from numba_kv.ops.blockquant import dequantize_blocks, quantize_blocks
from numba_kv.ops.codebook import get_codebook
from numba_kv.ops.headquant import dequantize_head, quantize_head
from numba_kv.ops.headvq import dequantize_headvq, quantize_headvq

from ._util import env_info, rate

BITS = [2, 3, 4]
#: vectors the NumPy reference encodes / decodes (the oracle is slow)
REFERENCE_VECTORS = 1 << 17


def group(op, bits, n, full):
    """Group of an entry timed on ``n`` of the suite's ``full`` vectors: one group per
    operation and width, and a separate one for fewer vectors (times of different amounts of
    work must not stand side by side as ratios)."""
    return f"{op}-d128-b{bits}" + ("" if n == full else f"-{n}-vectors")


@pytest.mark.parametrize("bits", BITS)
def test_quantize_numba_kv(benchmark, vectors_1m, bits):
    benchmark.group = f"quantize-d128-b{bits}"
    quantize_blocks(vectors_1m[:256], bits)  # compile outside the timed region
    env_info(benchmark, len(vectors_1m))
    codes, scales = benchmark.pedantic(quantize_blocks, args=(vectors_1m, bits), rounds=5, warmup_rounds=1)
    assert codes.shape == (len(vectors_1m), 16 * bits)
    rate(benchmark, len(vectors_1m))


@pytest.mark.parametrize("bits", BITS)
def test_dequantize_numba_kv(benchmark, vectors_1m, bits):
    benchmark.group = f"dequantize-d128-b{bits}"
    codes, scales = quantize_blocks(vectors_1m, bits)
    env_info(benchmark, len(vectors_1m))
    out = benchmark.pedantic(dequantize_blocks, args=(codes, scales, bits), rounds=5, warmup_rounds=1)
    assert out.shape == vectors_1m.shape
    rate(benchmark, len(vectors_1m))


@pytest.mark.parametrize("bits", BITS)
def test_quantize_head_numba_kv(benchmark, vectors_1m, bits):
    """Whole-head rotation quantizer (one 128-point rotation and one norm per vector)."""
    benchmark.group = f"quantize-d128-b{bits}"
    quantize_head(vectors_1m[:256], bits)
    env_info(benchmark, len(vectors_1m))
    codes, _ = benchmark.pedantic(quantize_head, args=(vectors_1m, bits), rounds=5, warmup_rounds=1)
    assert codes.shape == (len(vectors_1m), 16 * bits)
    rate(benchmark, len(vectors_1m))


@pytest.mark.parametrize("bits", BITS)
def test_dequantize_head_numba_kv(benchmark, vectors_1m, bits):
    benchmark.group = f"dequantize-d128-b{bits}"
    codes, norms = quantize_head(vectors_1m, bits)
    env_info(benchmark, len(vectors_1m))
    out = benchmark.pedantic(dequantize_head, args=(codes, norms, bits), rounds=5, warmup_rounds=1)
    assert out.shape == vectors_1m.shape
    rate(benchmark, len(vectors_1m))


@pytest.mark.parametrize("bits", [2, 4])
def test_quantize_headvq_numba_kv(benchmark, vectors_1m, bits):
    """Head VQ code (pairs at 4 bits, quads at 2: a nearest-point search over 256 points per
    group), in the group of the scalar head code at the same bytes."""
    benchmark.group = f"quantize-d128-b{bits}"
    quantize_headvq(vectors_1m[:256], bits)
    env_info(benchmark, len(vectors_1m))
    codes, _ = benchmark.pedantic(quantize_headvq, args=(vectors_1m, bits), rounds=5, warmup_rounds=1)
    assert codes.shape == (len(vectors_1m), 16 * bits)
    rate(benchmark, len(vectors_1m))


@pytest.mark.parametrize("bits", [2, 4])
def test_dequantize_headvq_numba_kv(benchmark, vectors_1m, bits):
    benchmark.group = f"dequantize-d128-b{bits}"
    codes, norms = quantize_headvq(vectors_1m, bits)
    env_info(benchmark, len(vectors_1m))
    out = benchmark.pedantic(dequantize_headvq, args=(codes, norms, bits), rounds=5, warmup_rounds=1)
    assert out.shape == vectors_1m.shape
    rate(benchmark, len(vectors_1m))


@pytest.mark.parametrize("bits", [3])
def test_quantize_numpy_reference(benchmark, vectors_1m, bits):
    cb = get_codebook(bits, "maxnorm")
    x = vectors_1m[:REFERENCE_VECTORS]  # the oracle is slow: rate per vector
    benchmark.group = group("quantize", bits, len(x), len(vectors_1m))
    env_info(benchmark, len(x), "numpy")
    benchmark.pedantic(reference.quantize, args=(x, cb.centroids, cb.boundaries, bits, "maxnorm", cb.ref, True),
                       rounds=1, iterations=1)
    rate(benchmark, len(x))


@pytest.mark.parametrize("bits", [3])
def test_dequantize_numpy_reference(benchmark, vectors_1m, bits):
    cb = get_codebook(bits, "maxnorm")
    x = vectors_1m[:REFERENCE_VECTORS]
    benchmark.group = group("dequantize", bits, len(x), len(vectors_1m))
    codes, scales = quantize_blocks(x, bits)
    env_info(benchmark, len(x), "numpy")
    benchmark.pedantic(reference.dequantize, args=(codes, scales, cb.centroids, bits), rounds=1, iterations=1)
    rate(benchmark, len(x))


def _faiss_index(bits, x):
    faiss = pytest.importorskip("faiss")
    idx = faiss.index_factory(x.shape[1], f"HR,SQtqmse{bits}")
    idx.train(x[:16384])
    return faiss, idx


@pytest.mark.parametrize("bits", BITS)
def test_quantize_faiss_hr_sqtqmse(benchmark, vectors_1m, bits):
    """C++ anchor: FAISS Hadamard rotation + TurboQuant-MSE scalar quantizer (OpenMP)."""
    benchmark.group = f"quantize-d128-b{bits}"
    faiss, idx = _faiss_index(bits, vectors_1m)
    env_info(benchmark, len(vectors_1m), "faiss")
    benchmark.extra_info["faiss_threads"] = faiss.omp_get_max_threads()
    benchmark.pedantic(idx.sa_encode, args=(vectors_1m,), rounds=3, warmup_rounds=0)
    rate(benchmark, len(vectors_1m))


@pytest.mark.parametrize("bits", BITS)
def test_dequantize_faiss_hr_sqtqmse(benchmark, vectors_1m, bits):
    benchmark.group = f"dequantize-d128-b{bits}"
    faiss, idx = _faiss_index(bits, vectors_1m)
    codes = idx.sa_encode(vectors_1m)
    env_info(benchmark, len(vectors_1m), "faiss")
    benchmark.pedantic(idx.sa_decode, args=(codes,), rounds=3, warmup_rounds=0)
    rate(benchmark, len(vectors_1m))
