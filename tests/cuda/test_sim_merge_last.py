"""The merge of the split-K partitions by the partition kernel's last block (issue 27, item 3).

Every CUDA partition kernel (block, warp, tensor-core; flat and paged) merges in its last
block to finish (``merge_if_last`` in :mod:`numba_kv.ops.attention.merge`): an arrival
counter per (KV row, row chunk) in the plan's workspace, reset by the merging block.  Here,
under ``NUMBA_ENABLE_CUDASIM=1`` (or on a GPU): many partitions, several KV rows and row
chunks, steps of changing lengths one after another (the counters must be left at zero by
each launch, or the next step merges early or never), against the separate
``merge_partitions`` launch (the ``cuda_merge_last_block`` knob off: the same bits) and the
CPU twin.  The simulator runs a grid's blocks one after another, so it checks the counting,
the reset and the merge's rows, not the memory ordering between concurrent blocks (the
fences are reasoned in ``merge_if_last``'s docstring).
"""

import numpy as np
import pytest
from numba import cuda, float32

from numba_kv import PagedKVCache, knobs
from numba_kv._backend import simulator_enabled, to_host
from numba_kv._config import MAX_HEAD_DIM
from numba_kv.ops.attention import decode_attention, kernels, merge, plan
from numba_kv.ops.attention.mma import MMA_THREADS
from numba_kv.ops.attention.plan import cuda_block_threads
from numba_kv.ops.blockquant import quantize_blocks

from ..conftest import spy_launches, to_device

TOL = dict(rtol=2e-5, atol=2e-6)
#: tensor cores: binary16 operands (tests/cuda/test_sim_mma.py)
MMA_RTOL = 4e-3

#: variant -> (the twin that must run, head_dim, GQA group, q_len, knobs): more query rows
#: than one block holds (two row chunks: 33 rows of the block kernel at d = 64, 32 + 1; 8 of the
#: warp ones, 4 + 4).  The block kernel's last block merges its chunk's rows one after another
#: (with their barriers), so each row above the 32 of the first chunk is simulator time: one
#: is enough for a second chunk (and a second counter slot per KV row).
VARIANTS = {"block": ("DECODE_ATTENTION", 64, 3, 11, {"cuda_warp_attention": 0}),
            "warp": ("DECODE_ATTENTION_WARP", 64, 4, 2, {"cuda_mma_attention": 0}),  # (64: a tensor-core build too)
            "mma": ("DECODE_ATTENTION_MMA", 128, 4, 2, {})}


def _n_steps(variant: str) -> int:
    """Steps of :func:`_steps` a variant decodes: all three, but under the simulator only the
    first for the tensor-core kernel (its simulated warp products make each of its blocks
    several times a warp kernel's; it was the costliest test of the simulator stage).  What
    the later steps add is the reuse of the counters after a launch (falling, then rising
    block counts): ``merge_if_last``'s counting, the same device function for every kernel,
    run over all three steps by the block and warp kernels and the paged test here.  The
    first step still checks the tensor-core kernel's own part: its merge rows bit-equal to
    the merge launch, two row chunks, several blocks each, its counters left at zero.  On a
    GPU (``make test-gpu``) it decodes all three."""
    return 1 if variant == "mma" and simulator_enabled() else 3


def _counters_are_zero() -> bool:
    """Every last-block counter of this thread's cached plans is back at zero."""
    counters = [getattr(p._ws, "counter", None) for p in plan._PLANS.values()]  # noqa: SLF001
    return all(not np.any(to_host(c)) for c in counters if c is not None)


def _rel(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(np.asarray(b, np.float64)))


def _partitions_per_block(variant: str) -> int:
    """Partitions one block of the variant's kernel holds (``AttentionPlan.grid``): one for the
    block kernel, one per warp for the warp and tensor-core ones (one warp per block under the
    simulator, ``cuda_threads`` / 32 and ``MMA_THREADS`` / 32 on a GPU)."""
    if variant == "block":
        return 1
    threads = MMA_THREADS if variant == "mma" else cuda_block_threads()
    return 1 if simulator_enabled() else threads // 32


def _steps(rng, d, G, ql, merged, per_block=1, n_steps=3):
    """Three decode attentions of 2 KV heads, GQA ``G`` × causal ``q_len``, lengths 13, 5, 21
    in partitions of 8 tokens (2, 1, 3 compressed ones, the last one ragged) and 9 exact tokens
    (2 exact ones, 8 + 1); yields (CPU twin, last-block merge, separate merge).
    ``merged``: the spied merge launches (none may come with the last-block merge).

    Under the simulator (one partition per block): 4, 3, then 5 blocks of partitions per row
    chunk, so every step takes the counted merge (not the single-block one), and the count
    first falls, then rises: a counter left non-zero makes the next step merge never, then
    early.  ``per_block`` partitions to a block (a warp kernel on a GPU) add ``per_block − 1``
    compressed partitions to each step, so a chunk still has at least two blocks (at 4:
    37, 29, 45 tokens, 7, 6, 8 partitions).  (It was 37, 27, 45 compressed and 13 exact tokens
    everywhere: under the simulator 7, 6, 8 blocks per chunk, the same paths at 1.75 times the
    blocks; every simulated thread is an OS thread.)"""
    b, hkv = 1, 2
    for T in (13 + 8 * (per_block - 1), 5 + 8 * (per_block - 1), 21 + 8 * (per_block - 1))[:n_steps]:
        k = rng.standard_normal((b, hkv, T, d)).astype(np.float32)
        v = rng.standard_normal((b, hkv, T, d)).astype(np.float32)
        kc, ks = quantize_blocks(k, 3)
        vc, vs = quantize_blocks(v, 3)
        q = rng.standard_normal((b, hkv * G, ql, d)).astype(np.float32)
        kw = dict(k_bits=3, v_bits=3, partition_size=8,
                  k_exact=rng.standard_normal((b, hkv, 9, d)).astype(np.float32),
                  v_exact=rng.standard_normal((b, hkv, 9, d)).astype(np.float32))
        dkw = {n: (to_device(a) if isinstance(a, np.ndarray) else a) for n, a in kw.items()}
        dev = tuple(to_device(a) for a in (q, kc, ks, vc, vs))
        before = len(merged)
        fused = to_host(decode_attention(*dev, **dkw))
        assert len(merged) == before, "a merge_partitions launch besides the last block's merge"
        assert _counters_are_zero(), "a launch left its arrival counter non-zero"
        with knobs(cuda_merge_last_block=0):
            separate = to_host(decode_attention(*dev, **dkw))
        assert len(merged) == before + 1
        yield decode_attention(q, kc, ks, vc, vs, **kw), fused, separate


@pytest.mark.cuda
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_last_block_merge_matches_the_merge_launch_and_cpu_twin(variant, monkeypatch):
    twin, d, G, ql, opts = VARIANTS[variant]
    ran = spy_launches(monkeypatch, (kernels, twin))
    merged = spy_launches(monkeypatch, (merge, "MERGE_PARTITIONS"))
    with knobs(**opts):
        for cpu, fused, separate in _steps(np.random.default_rng(31), d, G, ql, merged, _partitions_per_block(variant),
                                           _n_steps(variant)):
            assert np.array_equal(fused, separate), "the last block's merge is not the merge kernel's"
            if variant == "mma":
                assert _rel(fused, cpu) < MMA_RTOL
            else:
                np.testing.assert_allclose(fused, cpu, **TOL)
    grids = [g for g in ran if g is not None]  # (the CPU twin's launches have none)
    assert len(grids) == 2 * _n_steps(variant), f"the {variant} kernel did not run every step"
    # several blocks of partitions per row chunk, two row chunks
    assert all(g[0][1] > 1 and g[0][2] == 2 for g in grids), grids


@pytest.mark.cuda
def test_paged_last_block_merge_matches_the_merge_launch_and_cpu_twin(monkeypatch):
    """Paged pools (warp kernel, head_dim 64; ragged sequences in pages of 8, partitions of 8:
    3, 11, 19 tokens, then 4, 11, 25, then 4, 17, 26: sequences of 1 … 4 partitions, the short
    one's extra partitions empty, the longest and then the middle one taking one more),
    decoded three times as the sequences grow.  Under the simulator (one partition per block)
    3, 4, 4 blocks per row chunk; on a GPU the longest sequence is longer by a block's
    partitions less one, so that it still takes two blocks.  One KV head: the three sequences
    are the KV rows (the counters' slots); two heads of a pool, merged by the last block, are
    in tests/cuda/test_sim_attention.py (paged_ragged) and the golden values.  (It was two
    heads and 5, 23, 41 tokens growing to 6, 26, 44, 6 partitions per sequence at every step:
    three to four times the simulator's blocks and pool rows to move.)"""
    ran = spy_launches(monkeypatch, (kernels, "PAGED_DECODE_ATTENTION_WARP"))
    longer = 8 * (_partitions_per_block("warp") - 1)
    rng = np.random.default_rng(33)
    with knobs(cuda_merge_last_block=1):
        caches = [PagedKVCache(num_pages=24, num_layers=1, num_kv_heads=1, head_dim=64, page_size=8, storage="pqo3")
                  for _ in range(2)]
        seqs = [[c.allocate_sequence() for _ in range(3)] for c in caches]
        for step, grow in enumerate(((3, 11, 19 + longer), (1, 0, 6), (0, 6, 1))):
            for i, n in enumerate(grow):
                if n:
                    k, v = (rng.standard_normal((1, n, 64)).astype(np.float32) for _ in range(2))
                    caches[0].append(0, seqs[0][i], k, v)
                    caches[1].append(0, seqs[1][i], to_device(k), to_device(v))
            q = rng.standard_normal((3, 4, 1, 64)).astype(np.float32)
            cpu = caches[0].decode_attention(0, q, partition_size=8)
            fused = to_host(caches[1].decode_attention(0, to_device(q), partition_size=8))
            assert _counters_are_zero(), f"step {step}: a launch left its arrival counter non-zero"
            with knobs(cuda_merge_last_block=0):
                separate = to_host(caches[1].decode_attention(0, to_device(q), partition_size=8))
            assert np.array_equal(fused, separate)
            np.testing.assert_allclose(fused, cpu, **TOL)
    grids = [g for g in ran if g is not None]
    assert len(grids) == 6 and all(g[0][1] > 1 for g in grids), grids  # the counted merge, every step


def _merge_kernel(rng):
    """The MERGE_PARTITIONS kernel itself (launched by the host only with the
    ``cuda_merge_last_block`` knob off) against the CPU twin: 32-block and whole-head inverse
    rotations, no compressed partition, an empty partition."""
    parts = [rng.standard_normal(s).astype(np.float32) for s in ((3, 5, 2), (3, 5, 2), (3, 5, 2, 64))]
    parts[1] = np.abs(parts[1]) + 0.5
    parts[0][1, 2, 1] = -np.inf  # an empty partition
    signs = np.where(rng.random(64) < 0.5, -1.0, 1.0).astype(np.float32)
    for n_rot, head_rot in ((3, False), (5, True), (0, False)):
        args = (*parts, n_rot, np.ones(32, np.float32), head_rot, signs)
        want = np.empty((3, 2, 64), np.float32)
        merge.MERGE_PARTITIONS.launch("cpu", 6, *args, want)
        got = to_device(np.zeros((3, 2, 64), np.float32))
        merge.MERGE_PARTITIONS.launch("cuda", 6, *(to_device(a) if isinstance(a, np.ndarray) else a for a in args),
                                      got, grid=((3, 2), 32))
        np.testing.assert_allclose(to_host(got), want, **TOL)


#: the merge kernel is launched only with the knob off now: its own runner
RUNNERS = {"merge_partitions": _merge_kernel}


@pytest.mark.cuda
def test_merge_kernel_matches_cpu_twin():
    _merge_kernel(np.random.default_rng(35))


def test_counters_are_per_row_chunk():
    """The plan's counters cover every (KV row, row chunk) of its largest grid."""
    p = plan.AttentionPlan(np.zeros(1, np.float32), paged=False, n_g=3, rows=9, d=64, klayout=None, vlayout=None,
                           v_width=0)
    assert to_host(p.merge_counter(np.zeros(1, np.float32))).shape == (3 * 9,)


@pytest.mark.cuda
@pytest.mark.parametrize("threads", [8, 64])
def test_merge_of_many_partitions_matches_cpu_twin_and_formula(threads):
    """300 partitions a row (two chunks of the shared weights, a last lane group of four,
    empty partitions): the block's reductions (the maximum over strided shares, the
    denominator's 32 lanes -- fewer threads than lanes, and more -- the columns' 8 lanes)
    against the CPU twin, and, without compressed partitions (no rotation), against the
    log-sum-exp formula in float64."""
    rng = np.random.default_rng(36)
    n_g, n_parts, rows, d = 2, 300, 2, 64
    m = rng.standard_normal((n_g, n_parts, rows)).astype(np.float32) * 4
    m[0, 7, 1] = m[1, 299, 0] = m[1, 256, 1] = -np.inf  # empty partitions, one in each chunk
    lsum = (np.abs(rng.standard_normal(m.shape)) + 0.5).astype(np.float32)
    acc = rng.standard_normal((n_g, n_parts, rows, d)).astype(np.float32)
    acc[np.isneginf(m)] = 0.0
    signs = np.where(rng.random(d) < 0.5, -1.0, 1.0).astype(np.float32)
    for n_comp, head_rot in ((290, False), (0, False)):
        args = (m, lsum, acc, n_comp, np.ones(32, np.float32), head_rot, signs)
        want = np.empty((n_g, rows, d), np.float32)
        merge.MERGE_PARTITIONS.launch("cpu", n_g * rows, *args, want)
        got = to_device(np.zeros((n_g, rows, d), np.float32))
        merge.MERGE_PARTITIONS.launch("cuda", n_g * rows, *(to_device(a) if isinstance(a, np.ndarray) else a
                                                             for a in args), got, grid=((n_g, rows), threads))
        np.testing.assert_allclose(to_host(got), want, rtol=1e-6, atol=1e-7)
        if n_comp == 0:
            w = np.exp(m.astype(np.float64) - m.max(axis=1, keepdims=True))
            formula = np.einsum("gpr,gprd->grd", w, acc) / np.einsum("gpr,gpr->gr", w, lsum)[..., None]
            np.testing.assert_allclose(want, formula, rtol=2e-5, atol=2e-6)


def _rows_kernel():
    """A kernel around ``merge_rows_dev`` with the block's shared scratch, as ``merge_if_last``
    calls it: block ``g`` merges every query row of KV row ``g`` (groups of
    ``MERGE_ROWS`` rows side by side)."""
    @cuda.jit
    def rows_kernel(part_m, part_l, part_acc, n_comp, signs, head_rot, hsigns, out):
        scratch = cuda.shared.array(merge.MERGE_SCRATCH, dtype=float32)
        merge.merge_rows_dev(part_m, part_l, part_acc, cuda.blockIdx.x, 0, out.shape[1], n_comp, signs, head_rot,
                             hsigns, out, scratch[:MAX_HEAD_DIM], scratch[MAX_HEAD_DIM:merge.MERGE_SCRATCH - 1],
                             cuda.threadIdx.x, cuda.blockDim.x)

    return rows_kernel


@pytest.mark.cuda
@pytest.mark.parametrize(("rows", "d", "threads"), [(7, 64, 32), (4, 128, 16)])
def test_rows_side_by_side_match_one_row_a_block(rows, d, threads):
    """The rows of a last block's merge side by side (``MERGE_ROWS`` at a time, then the other
    three, whose threads the 32 of the block do not divide: two only meet the barriers;
    several column groups a thread; 72 partitions: two weight chunks of the compressed
    partitions) write the bits of the merge kernel's one row a block, and the CPU twin's
    values (their ``exp`` may differ in the last bit), with empty partitions and a row
    without a visible token (output 0)."""
    rng = np.random.default_rng(37)
    n_g, n_parts = 2, 72
    m = rng.standard_normal((n_g, n_parts, rows)).astype(np.float32) * 4
    m[0, 7, 1] = m[1, 71, 0] = m[1, 64, rows - 1] = -np.inf
    m[1, :, 1] = -np.inf  # no visible token in row (1, 1)
    lsum = (np.abs(rng.standard_normal(m.shape)) + 0.5).astype(np.float32)
    acc = rng.standard_normal((n_g, n_parts, rows, d)).astype(np.float32)
    acc[np.isneginf(m)] = 0.0
    hsigns = np.where(rng.random(d) < 0.5, -1.0, 1.0).astype(np.float32)
    signs = np.where(rng.random(32) < 0.5, -1.0, 1.0).astype(np.float32)
    kernel = _rows_kernel()
    for n_comp, head_rot in ((66, False), (34, True)):
        args = (m, lsum, acc, n_comp, signs, head_rot, hsigns)
        want = np.empty((n_g, rows, d), np.float32)
        merge.MERGE_PARTITIONS.launch("cpu", n_g * rows, *args, want)
        dargs = tuple(to_device(a) if isinstance(a, np.ndarray) else a for a in args)
        one = to_device(np.zeros((n_g, rows, d), np.float32))
        merge.MERGE_PARTITIONS.launch("cuda", n_g * rows, *dargs, one, grid=((n_g, rows), threads))
        side = to_device(np.full((n_g, rows, d), np.nan, np.float32))
        kernel[n_g, threads](*dargs, side)
        assert np.array_equal(to_host(side), to_host(one))
        np.testing.assert_allclose(to_host(side), want, rtol=1e-6, atol=1e-7)
        assert not np.any(to_host(side)[1, 1])
