"""Every registered CUDA kernel compiles to PTX for cc 8.0 and 9.0 without a GPU (every
signature for 9.0, the first for 8.0).

Catches the typing errors the simulator cannot see.  Float32 kernels must not contain
``.f64`` instructions (a stray Python float literal would promote).

Bit-identical results: a kernel not listed in :data:`NOT_BIT_EXACT` holds no FMA, approximate
or flush-to-zero instruction, and no add of a plain product ptxas could still fuse (see
:func:`inexact_ops`), so on a GPU it rounds every operation as its CPU twin does.

Static performance checks on the sm_90 PTX (no GPU needed):

* local memory: at most :data:`LOCAL_BYTES_MAX` bytes per thread (``__local_depot``
  declarations).  A per-thread scratch array that does not fit registers lands in local
  memory, which is off-chip: a thread-per-row kernel with a ``d``-float row (2 KB at
  ``d = 512``) runs at a fraction of the bandwidth a block-cooperative one reaches;
* cooperation: the kernels in :data:`COOPERATIVE` share work inside a block or warp
  (``.shared`` memory or ``shfl.sync``).
"""

import re

import pytest

from numba_kv._cuda_resources import kernel_ptx
from numba_kv.ops import TWINS

CCS = [(8, 0), (9, 0)]
# every signature on sm_90 (where the static performance checks run); on sm_80 the first
# signature only: what the checks below read (.f64 and inexact instructions) does not depend on
# the architecture, and sm_80 itself is compiled here and linked by ptxas in tests/cuda/
# test_resources.py for every kernel; a second signature on sm_80 would be one more 5-20 s
# NVVM compile checking nothing new
CASES = [(name, i, cc) for name, t in sorted(TWINS.items()) for i in range(len(t.signatures)) for cc in CCS
         if i == 0 or cc == (9, 0)]

#: largest local memory (bytes per thread) a kernel may use
LOCAL_BYTES_MAX = 256
#: kernels allowed above LOCAL_BYTES_MAX, with the reason
LOCAL_EXCEPTIONS: dict[str, str] = {}
#: kernels whose CUDA results may differ from the CPU twin's in the last bits, with the reason;
#: every other kernel must give bit-identical results on a GPU, so its PTX may hold no FMA
#: (``s + a·b`` rounded once: see ``ops/_exact.py``) and no approximate or flush-to-zero op
NOT_BIT_EXACT: dict[str, str] = {
    "decode_attention": "float output compared within tolerance; fast exp, reassociated sums on the CPU",
    "decode_attention_warp": "as decode_attention",
    "decode_attention_warp_vq": "as decode_attention",
    "decode_attention_mma": "binary16 tensor-core products (mma.sync), compared within tolerance",
    "decode_attention_mma_vq": "as decode_attention_mma",
    "paged_decode_attention_mma": "as decode_attention_mma",
    "decode_attention_mma_d64": "as decode_attention_mma",
    "decode_attention_mma_vq_d64": "as decode_attention_mma",
    "paged_decode_attention_mma_d64": "as decode_attention_mma",
    "paged_decode_attention_warp": "as decode_attention",
    "paged_decode_attention": "as decode_attention",
    "merge_partitions": "as decode_attention",
    "lowrank_gram": "float statistics compared within tolerance",
    "lowrank_project": "float coefficients compared within tolerance",
    "lowrank_reconstruct": "float output compared within tolerance",
    "qjl_scores": "products by ±1 are exact, so FMA or not gives the same sums",
}
_INEXACT_OP = re.compile(r"^\s*(?:@%p\d+\s+)?(fma\.\S+|\w+(?:\.\w+)*\.(?:approx|ftz)\b\S*)", re.MULTILINE)


_INSTR = re.compile(r"^\s*(?:@!?%p\d+\s+)?([a-z][\w.]*)\s+([^;]*);", re.MULTILINE)


def _exact_factor(operand: str) -> bool:
    """An immediate float32 power of two >= 1 (``0f46000000`` = 8192): a product by it is exact."""
    if not re.fullmatch(r"0f[0-9A-Fa-f]{8}", operand):
        return False
    bits = int(operand[2:], 16)
    return bits & 0x807FFFFF == 0 and 127 <= (bits >> 23) < 255


def inexact_ops(ptx: str) -> list[str]:
    """Instructions of ``ptx`` that may round differently from the CPU twin: fused
    multiply-adds, approximate and flush-to-zero float ops, and adds of a plain ``mul.f32``
    (no rounding modifier) result, which ptxas may still contract into an FMA (PTX ISA,
    ``add``: "mul/add sequences with no rounding modifiers may be optimized to use
    fused-multiply-add").  A product by an immediate power of two >= 1 is exact and allowed;
    ``mul.rn.f32`` (``ops/_exact.py``'s ``mul_rn``) is never contracted."""
    found = [m.group(1) for m in _INEXACT_OP.finditer(ptx)]
    products: dict[str, list[str]] = {}
    for m in _INSTR.finditer(ptx):
        op, args = m.group(1), [a.strip() for a in m.group(2).split(",")]
        if op == "mul.f32":
            products[args[0]] = args[1:]
        elif op in ("add.f32", "sub.f32"):
            for a in args[1:]:
                if a in products and not any(_exact_factor(f) for f in products[a]):
                    found.append(f"{op} of mul.f32 {a}")
    return found


#: kernels that must work block- or warp-cooperatively
COOPERATIVE = ("rotate_head", "quantize_head", "quantize_head_pair", "dequantize_head", "quantize_headvq",
               "dequantize_headvq", "decode_attention",
               "decode_attention_warp", "decode_attention_warp_vq", "decode_attention_mma",
               "decode_attention_mma_vq", "paged_decode_attention_mma", "decode_attention_mma_d64",
               "decode_attention_mma_vq_d64", "paged_decode_attention_mma_d64",
               "paged_decode_attention", "paged_decode_attention_warp", "merge_partitions")
#: cooperative kernels not there yet, with the reason
COOPERATIVE_EXCEPTIONS: dict[str, str] = {}

_LOCAL_DECL = re.compile(r"\.local\s+(?:\.align\s+\d+\s+)?\.b8\s+(\w+)\[(\d+)\]")


def local_bytes(ptx: str) -> int:
    """Local memory per thread declared in ``ptx`` (sum of ``.local .b8 name[N]`` arrays,
    the ``__local_depot`` frames of the kernel and its non-inlined callees)."""
    return sum(int(m.group(2)) for m in _LOCAL_DECL.finditer(ptx))


def assert_cooperative(name: str, ptx: str) -> None:
    """Fail unless kernel ``name``'s PTX uses shared memory or warp shuffles."""
    uses_shared = re.search(r"\.shared\b", ptx) is not None
    uses_shfl = "shfl.sync" in ptx
    assert uses_shared or uses_shfl, f"{name}: neither .shared memory nor shfl.sync in its PTX"


def test_local_bytes_parser():
    ptx = (".local .align 16 .b8 \t__local_depot0[2048];\n.reg .b64 %SP;\n"
           ".local .align 4 .b8 __local_depot1[12];\n")
    assert local_bytes(ptx) == 2060
    assert local_bytes(".reg .b32 %r<5>;\nld.local.f32 %f1, [%rd1];") == 0
    assert_cooperative("k", ".shared .align 4 .b8 _cudapy_smem_1[2048];")
    assert_cooperative("k", "shfl.sync.bfly.b32 %r2, %r1, 1, 31, -1;")
    with pytest.raises(AssertionError, match="neither"):
        assert_cooperative("k", "ld.global.f32 %f1, [%rd1];")


def test_inexact_ops_parser():
    ptx = ("\tfma.rn.f32 \t%f3, %f1, %f2, %f3;\n\tmul.rn.f32 %f4, %f1, %f2;\n\tadd.f32 %f5, %f4, %f3;\n"
           "\tex2.approx.ftz.f32 %f6, %f5;\n\t@%p1 fma.rn.ftz.f32 %f7, %f1, %f2, %f3;\n"
           "\tsqrt.rn.f32 %f8, %f7;\n\tdiv.rn.f32 %f9, %f8, %f1;\n\t// fma.rn.f32 in a comment\n")
    assert inexact_ops(ptx) == ["fma.rn.f32", "ex2.approx.ftz.f32", "fma.rn.ftz.f32"]
    ptx = ("\tmul.f32 %f3, %f1, %f2;\n\tmul.f32 %f4, %f1, 0f46000000;\n\tmul.rn.f32 %f5, %f1, %f2;\n"
           "\tmul.f32 %f6, %f1, 0f3F000000;\n\tadd.f32 %f7, %f4, %f5;\n\tsub.f32 %f8, %f9, %f3;\n"
           "\t@%p2 add.f32 %f10, %f6, %f1;\n\tmul.f32 %f11, %f3, %f3;\n")
    # 8192 is an exact factor, mul.rn is never fused, 0.5 can underflow, %f11 feeds no add
    assert inexact_ops(ptx) == ["sub.f32 of mul.f32 %f3", "add.f32 of mul.f32 %f6"]


def test_exception_lists_name_registered_kernels():
    for name in (*LOCAL_EXCEPTIONS, *COOPERATIVE, *COOPERATIVE_EXCEPTIONS, *NOT_BIT_EXACT):
        assert name in TWINS, f"{name}: listed in tests/cuda/test_ptx.py but not registered"


@pytest.mark.ptx
def test_numba_cuda_is_the_nvidia_target():
    from numba import cuda

    assert getattr(cuda, "implementation", None) == "NVIDIA"


@pytest.mark.ptx
@pytest.mark.parametrize("name, sig, cc", CASES, ids=[f"{n}-{i}-sm{c[0]}{c[1]}" for n, i, c in CASES])
def test_compiles_to_ptx(name, sig, cc):
    twin = TWINS[name]
    ptx = kernel_ptx(name, cc, sig)
    assert f".target sm_{cc[0]}{cc[1]}" in ptx
    if twin.float32_only:
        f64 = [line for line in ptx.splitlines() if re.search(r"\.f64\b", line)]
        assert not f64, f"{name}: float64 instructions in a float32 kernel: {f64[:3]}"
    inexact = inexact_ops(ptx)
    if name in NOT_BIT_EXACT:
        if not inexact:
            pytest.fail(f"{name}: no inexact instruction left: remove it from NOT_BIT_EXACT")
    else:
        assert not inexact, (f"{name}: {len(inexact)} instructions that round unlike the CPU twin, e.g. "
                             f"{sorted(set(inexact))[:3]}; use ops/_exact.py's mul_rn for products that feed sums")
    if cc != (9, 0):
        return
    # the static performance checks on the sm_90 compilation (the one compile serves all checks)
    nbytes = local_bytes(ptx)
    if name in LOCAL_EXCEPTIONS:
        if nbytes <= LOCAL_BYTES_MAX:
            pytest.fail(f"{name}: uses {nbytes} B of local memory now: remove it from LOCAL_EXCEPTIONS")
    else:
        assert nbytes <= LOCAL_BYTES_MAX, (f"{name}: {nbytes} B of local memory per thread "
                                           f"(limit {LOCAL_BYTES_MAX}); keep rows in shared memory/registers")
    if name in COOPERATIVE and name not in COOPERATIVE_EXCEPTIONS:
        assert_cooperative(name, ptx)


@pytest.mark.ptx
def test_kernel_ptx_compiles_each_case_once_however_spelled():
    """``kernel_ptx(n, (9, 0))`` (the attention PTX tests) and ``kernel_ptx(n, (9, 0), 0)``
    (the cases above, :func:`kernel_resources`) are one compile, not two (10-30 s each for
    the attention kernels)."""
    name = CASES[0][0]
    assert kernel_ptx(name, (9, 0)) is kernel_ptx(name, [9, 0], 0) is kernel_ptx(name, cc=(9, 0), signature=0)
