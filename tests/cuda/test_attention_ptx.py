"""The decode attention kernels are built for the GPU: their sm_90 PTX stages data in shared
memory and keeps per-thread local memory (spills, local arrays) under 256 bytes.

No GPU needed (``cuda.compile_ptx``)."""

import re

import pytest

from numba_kv._cuda_resources import kernel_ptx

KERNELS = ["decode_attention", "paged_decode_attention", "merge_partitions"]
LOCAL_LIMIT = 256


def barriers_before_merge(ptx: str) -> tuple[int, int]:
    """``(block barriers before the first global atomic, global atomics)``: the partition
    kernels' one atomic is the arrival count of the last-block merge
    (:func:`numba_kv.ops.attention.merge.merge_if_last`), which comes after the token loop;
    the barriers before it are the token loop's and the one that orders every thread's
    partials before the count."""
    atoms = [m.start() for m in re.finditer(r"\batom\.global\.", ptx)]
    first = atoms[0] if atoms else len(ptx)
    bars = [m.start() for m in re.finditer(r"\bbar\.sync\b|\bbarrier\.sync\b", ptx)]
    return sum(b < first for b in bars), len(atoms)


def local_bytes(ptx: str) -> int:
    """Bytes of ``.local`` memory the PTX declares per thread (the ``__local_depot`` arrays
    and any other ``.local`` variable)."""
    return sum(int(n) for n in re.findall(r"^\s*(?:\.\w+\s+)*\.local\s[^\[;]*\[(\d+)\]", ptx, flags=re.MULTILINE))


def test_barriers_before_merge_parser():
    ptx = "bar.sync 0;\n ld.shared.f32 %f1;\n barrier.sync 0;\n atom.global.add.u32 %r1;\n bar.sync 0;\n"
    assert barriers_before_merge(ptx) == (2, 1)
    assert barriers_before_merge("bar.sync 0;") == (1, 0)


def test_local_bytes_parser():
    ptx = (".local .align 16 .b8 \t__local_depot0[6144];\n\t.visible .local .align 4 .b8 x[8];\n"
           "\tld.local.f32 %f1, [%rd1];\n.visible .shared .b8 s[4];")
    assert local_bytes(ptx) == 6152


@pytest.mark.ptx
@pytest.mark.parametrize("name", KERNELS)
def test_attention_kernels_use_shared_memory_not_local(name):
    ptx = kernel_ptx(name, (9, 0))
    assert re.search(r"^\s*(?:\.\w+\s+)*\.shared\s", ptx, flags=re.MULTILINE), f"{name}: no shared memory declared"
    assert re.search(r"\b(?:ld|st)\.shared\.", ptx), f"{name}: no shared-memory access"
    assert re.search(r"\bbar\.sync\b|\bbarrier\.sync\b", ptx), f"{name}: no block barrier (cooperative kernel)"
    n = local_bytes(ptx)
    assert n <= LOCAL_LIMIT, f"{name}: {n} bytes of local memory per thread (limit {LOCAL_LIMIT})"


@pytest.mark.ptx
@pytest.mark.parametrize("name", ["decode_attention_warp", "decode_attention_warp_vq", "paged_decode_attention_warp"])
def test_warp_kernel_reduces_with_shuffles(name):
    """The warp-per-partition kernels sum scores and merge their token slots with warp
    shuffles (xor butterflies), hold their state in registers (no local memory) and have a
    single block barrier up to the end of the token loop, the one after the block's query
    rows are staged; one more orders the partials before the last-block merge's arrival
    count (the kernel's one global atomic), whose merge has its own barriers after it."""
    ptx = kernel_ptx(name, (9, 0))
    assert len(re.findall(r"\bshfl\.sync\.bfly\.b32\b", ptx)) >= 8
    assert local_bytes(ptx) == 0
    assert barriers_before_merge(ptx) == (2, 1)


@pytest.mark.ptx
def test_mma_kernel_runs_on_tensor_cores():
    """The tensor-core kernel's PTX: ``mma.sync`` m16n8k16 with binary16 operands and float32
    accumulators, transposed (8 per 16-token tile of keys, 8 of values at head_dim 128, for
    each of the 3 code widths; the first build's query-rows-as-A layout took 16 + 16), the
    weights moved into B fragments by two ``movmatrix`` a tile, the values' A registers
    regrouped by ``prmt``, its binary16 pairs from
    ``cvt.rn.f16x2.f32`` and scaled with ``mul.rn.f16x2``, its pair-table entries read by
    ``ld.shared.u32`` from 32-bit addresses (``lds_u32``: a lane's 32 key and 32 value pairs
    per 16-token tile, for each of the 3 widths) in the 16 KiB-aligned half of a 32 KiB array
    (the OR-ed addresses need the alignment, which no declaration reaches: ``aligned_table``
    realigns), its code words and scales read by byte address (``ldg_u32`` /
    ``ldg_u16``, whose template keeps its single spaces: 4 key-row reads of up to 4 words and
    a scale, 4 value-row reads of up to 2 words and a scale), no local memory (fragments,
    accumulators and prefetched words in registers), two block barriers before the merge's:
    the pair tables' (replica 0 packed before its copies: ``build_tables``) and the warp
    kernel's one.  All of it twice: the token loop of block scales, and that of one scale a
    token (``mma_tiles(..., tok=True)``), which multiplies no code (``mul.rn.f16x2`` only in
    the first: 32 key and 32 value pairs per tile and width) and reads its two value scales
    for the lane's score tokens, converted by ``cvt.f32.f16`` with the two key scales."""
    ptx = kernel_ptx("decode_attention_mma", (9, 0))
    loops = 2  # (block scales; one scale a token)
    n_mma = len(re.findall(r"\bmma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.f16\.f16\.f32\b", ptx))
    assert n_mma == loops * 3 * (8 + 8), n_mma
    assert len(re.findall(r"\bmovmatrix\.sync\.aligned\.m8n8\.trans\.b16\b", ptx)) == loops * 2
    # the values' A registers regrouped by prmt: 4 a product, 8 products a tile, 3 widths
    for sel in ("0x5410", "0x7632"):
        assert len(re.findall(r"\bprmt\.b32\s[^;]*" + sel + ";", ptx)) == loops * 3 * 8 * 2, sel
    assert re.search(r"\bcvt\.rn\.f16x2\.f32\b", ptx)
    assert len(re.findall(r"\bmul\.rn\.f16x2\b", ptx)) == 3 * (32 + 32)
    assert len(re.findall(r"\bcvt\.f32\.f16\b", ptx)) == 2 + 2
    assert len(re.findall(r"\bld\.shared\.u32\s+%r\d+, \[%r\d+\];", ptx)) == loops * 3 * (32 + 32)
    assert re.search(r"\.shared \.align \d+ \.b8 \w+\[32768\];", ptx)
    # (LLVM may hoist a first tile's key word that both loops read above the choice of loop)
    assert loops * (4 * 4 + 4 * 2) - 2 <= len(re.findall(r"\bld\.global\.u32 %r\d+, \[%rd\d+\];", ptx)) <= loops * 24
    assert len(re.findall(r"\bld\.global\.u16 %rs\d+, \[%rd\d+\];", ptx)) == (4 + 4) + (4 + 2)
    assert local_bytes(ptx) == 0
    assert barriers_before_merge(ptx) == (3, 1)


@pytest.mark.ptx
def test_mma_vq_build_reads_quads_by_two_words_and_norm_bytes():
    """The tensor-core VQ build's PTX (``decode_attention_mma_vq``, its 8-bit-norm signature):
    one token loop (one scale a token) whose tiles hold the 3 scalar widths' decoders and the
    quads' of each side, 8 ``mma.sync`` each a tile; a quad side reads its table entries as
    two words by one ``ld.shared.v2.u32`` (4 k-step pairs × 2 tokens for the keys, 4 quads ×
    4 tokens for the values, from 32-bit addresses); the norms are byte loads
    (``ld.global.u8``: the keys' two a tile and its first tile's two, the values' two); no
    local memory; the scalar build's barriers."""
    ptx = kernel_ptx("decode_attention_mma_vq", (9, 0), signature=2)
    n_mma = len(re.findall(r"\bmma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.f16\.f16\.f32\b", ptx))
    assert n_mma == 4 * (8 + 8), n_mma
    assert len(re.findall(r"\bld\.shared\.v2\.u32\s+\{%r\d+, %r\d+\}, \[%r\d+\];", ptx)) == 4 * 2 * 2 + 4 * 4
    assert len(re.findall(r"\bld\.shared\.u32\s+%r\d+, \[%r\d+\];", ptx)) == 3 * (32 + 32)
    assert len(re.findall(r"\bmul\.rn\.f16x2\b", ptx)) == 0  # (one scale a token: no code is scaled)
    assert len(re.findall(r"\bld\.global\.u8 %rs\d+, \[%rd\d+\];", ptx)) == 2 + 2 + 2
    assert local_bytes(ptx) == 0
    assert barriers_before_merge(ptx) == (3, 1)
