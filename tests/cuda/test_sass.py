"""The SASS of the CUDA kernels (nvJitLink → cubin → nvdisasm, no GPU): the loop finder on a
hand-written listing, and a budget of static instructions per token per KV head for the hot
loop of each decode attention kernel at sm_90.

The budget tests compile (``ptx`` marker: skipped under the simulator, where
``compile_ptx`` is a stub) and need ``nvdisasm`` (PyPI ``nvidia-cuda-nvdisasm``, in the
``test`` and ``cuda`` extras); without it they skip and say so.
"""

import pytest

from numba_kv import _sass
from numba_kv._sass import (
    CLASSES,
    NVDISASM_PACKAGE,
    TOKENS_PER_ITERATION,
    class_counts,
    classify,
    entry_function,
    find_loops,
    kernel_sass,
    nvdisasm_path,
    parse_sass,
    tile_loop,
)
from numba_kv.ops import TWINS

#: Static SASS instructions of the hot loop per token per KV head at sm_90 (nvJitLink 13.5's
#: ptxas, first signature), set ~10 % above the figures of then.  Measured (2026-11-30):
#: decode_attention 1516 (6063 instructions a warp pass / 4 tokens; 1389 when its budget was
#: set), decode_attention_warp 96.3 (3082 / 32; 93.41), decode_attention_mma 73.1 (1170 / 16,
#: the sm_90 build; 78.0: the decoders of all three code widths of K and of V
#: are in the loop; a pass runs one of each — 3-bit K and V alone: 546 / 16 = 34.1; with
#: Numba's array indexing for the code words 81.0 and 617 / 16 = 38.6, before the OR-ed
#: pair-table addresses 92.31 and 679 / 16 = 42.4, the first build's 1048 / 16 = 65.5),
#: paged_decode_attention_mma 82.56 (1321 / 16: plus a page-table read per tile, a token's slot
#: in its page by a shift; 3-bit alone 42.0; a read per token: 88.0 and 49.8 with the sm_90
#: launch bounds, 90.31 and 43.8 before them; before the byte-address loads 96.06, before the
#: OR-ed addresses 107.5 and 54.1, the first build 182.56).
#: an instruction class the token loop of a kernel must contain (its arithmetic's own)
_HALLMARK = {"decode_attention_mma": "mma", "paged_decode_attention_mma": "mma", "decode_attention_warp": "shfl",
             "decode_attention_warp_vq": "shfl", "decode_attention_mma_vq": "mma", "decode_attention_mma_d64": "mma",
             "decode_attention_mma_vq_d64": "mma", "paged_decode_attention_mma_d64": "mma"}
#: decode_attention_warp_vq (2026-12-02): 129.19 (4134 / 32: the head VQ decoders of K and V,
#: pairs and quads, next to the scalar ones a cache with one VQ side needs), against the block
#: kernel's 1516 that head VQ layouts ran before.  decode_attention_mma_vq (2026-12-02): 74.25
#: (1188 / 16: the quad and the three scalar decoders of each side, one scale a token; kv3's
#: pair: 462 / 16 = 28.9 a token, benchmarks/sass_one_width.py --quads v).  The head_dim 64
#: builds (2026-12-02): decode_attention_mma_d64 46.94 (751 / 16; 3-bit K and V alone 351 / 16
#: = 21.9), decode_attention_mma_vq_d64 55.81 (893 / 16; kv3's pair 284 / 16 = 17.8),
#: paged_decode_attention_mma_d64 61.5 (984 / 16; 3-bit alone 463 / 16 = 28.9)
SASS_BUDGET = {"decode_attention": 1530.0, "decode_attention_warp": 103.0, "decode_attention_warp_vq": 142.0,
               "decode_attention_mma": 86.0, "paged_decode_attention_mma": 91.0, "decode_attention_mma_vq": 82.0,
               "decode_attention_mma_d64": 52.0, "decode_attention_mma_vq_d64": 62.0,
               "paged_decode_attention_mma_d64": 68.0}

# A kernel with a loop nest, a second loop, a divergent-warp slow path that branches back into
# the loop (not a loop), a called helper, and an unreachable self-branch after EXIT.
LISTING = """\
\t.target\tsm_90
//--------------------- .text.helper --------------------------
\t.section\t.text.helper,"ax",@progbits
        .type           helper,@function
helper:
.text.helper:
        /*0000*/                   IADD3 R4, R4, 0x1, RZ ;
        /*0010*/                   RET.ABS.NODEC R20 0x0 ;
.L_x_9:
        /*0020*/                   BRA `(.L_x_9);
//--------------------- .text.kern --------------------------
\t.section\t.text.kern,"ax",@progbits
        .global         kern
        .type           kern,@function
        .other          kern,@"STO_CUDA_ENTRY STV_DEFAULT"
kern:
.text.kern:
        /*0000*/                   S2R R0, SR_TID.X ;
        /*0010*/                   MOV R2, RZ ;
.L_x_0:
        /*0020*/                   LDG.E R3, desc[UR4][R4.64] ;
        /*0030*/                   IMAD.MOV.U32 R6, RZ, RZ, RZ ;
.L_x_1:
        /*0040*/                   LDS R7, [R6] ;
        /*0050*/                   FFMA R2, R3, R7, R2 ;
        /*0060*/                   IADD3 R6, R6, 0x4, RZ ;
        /*0070*/                   ISETP.GE.AND P0, PT, R6, 0x80, PT ;
        /*0080*/              @!P0 BRA `(.L_x_1) ;
        /*0090*/                   BRA.DIV UR4, `(.L_x_3) ;
.L_x_4:
        /*00a0*/                   SHFL.BFLY PT, R8, R2, 0x1, 0x1f ;
        /*00b0*/                   FADD R2, R2, R8 ;
        /*00c0*/                   I2F R9, R0 ;
        /*00d0*/                   CALL.ABS.NOINC `(helper) ;
        /*00e0*/               @P3 EXIT ;
        /*00f0*/                   ISETP.GE.AND P1, PT, R4, 0x10, PT ;
        /*0100*/              @!P1 BRA `(.L_x_0) ;
.L_x_6:
        /*0110*/                   STG.E desc[UR4][R10.64], R2 ;
        /*0120*/                   IADD3 R10, R10, 0x4, RZ ;
        /*0130*/                   ISETP.GE.AND P2, PT, R10, R11, PT ;
        /*0140*/              @!P2 BRA `(.L_x_6) ;
        /*0150*/                   EXIT ;
.L_x_3:
        /*0160*/                   WARPSYNC.ALL ;
        /*0170*/                   SHFL.BFLY PT, R8, R2, 0x1, 0x1f ;
        /*0180*/                   BRA `(.L_x_4) ;
.L_x_5:
        /*0190*/                   BRA `(.L_x_5);
        /*01a0*/                   NOP;
"""


def test_parse_listing():
    funcs = parse_sass(LISTING)
    assert list(funcs) == ["helper", "kern"]
    assert not funcs["helper"].entry and funcs["kern"].entry
    kern = entry_function(funcs)
    assert kern.name == "kern" and len(kern.instructions) == 27  # 0x000 … 0x1a0
    assert kern.labels[".L_x_1"] == 0x40 and kern.labels[".L_x_3"] == 0x160
    bra = kern.instructions[8]
    assert (bra.address, bra.opcode, bra.guard, bra.target) == (0x80, "BRA", "@!P0", ".L_x_1")
    assert (kern.instructions[10].opcode, kern.instructions[10].operands) == ("SHFL.BFLY", "PT, R8, R2, 0x1, 0x1f")


def test_loops_of_the_listing():
    loops = find_loops(entry_function(parse_sass(LISTING)))
    # the slow path at 0x160 jumps back into the outer loop but is entered only by BRA.DIV;
    # the self-branch at 0x190 follows EXIT: neither is a loop
    assert [(lp.header, lp.size, lp.depth, lp.parent) for lp in loops] == [
        (0x20, 15, 0, None),  # outer: 0x20 … 0x100, the inner loop included
        (0x40, 5, 1, 0),      # inner: 0x40 … 0x80
        (0x110, 4, 0, None),  # the store loop after it
    ]
    assert tile_loop(loops) == 0 and tile_loop([]) is None
    # loops from an address on (a kernel's merge epilogue, after its first global atomic) are
    # not candidates
    assert tile_loop(loops, before=0x110) == 0 and tile_loop(loops, before=0x20) is None
    assert tile_loop(loops, before=0x40) == 0  # (a loop is placed by its header)
    # by hand: LDG | IMAD.MOV | LDS | FFMA, FADD | IADD3, ISETP, ISETP | BRA, BRA.DIV, CALL, @P3 EXIT,
    # BRA | SHFL | I2F
    expected = dict.fromkeys(CLASSES, 0) | {"load.global": 1, "move": 1, "load.shared": 1, "fp32": 2, "int": 3,
                                            "branch": 5, "shfl": 1, "convert": 1}
    assert loops[0].counts() == expected
    assert loops[1].counts() == dict.fromkeys(CLASSES, 0) | {"load.shared": 1, "fp32": 1, "int": 2, "branch": 1}


def test_entry_function_wants_one_kernel():
    funcs = parse_sass(LISTING)
    with pytest.raises(ValueError, match="exactly one kernel"):
        entry_function({"helper": funcs["helper"]})


def test_classify():
    assert [classify(op) for op in ("LDG.E.64.CONSTANT", "LDS.128", "ULDC.64", "LDL", "STS", "FFMA.FTZ", "MUFU.EX2",
                                    "HMMA.16816.F32", "HFMA2.MMA", "IMAD.WIDE.U32", "IMAD.MOV.U32", "UIADD3",
                                    "R2UR", "SHFL.BFLY", "F2FP.F16.F32.PACK_AB", "BSYNC", "BAR.SYNC.DEFER_BLOCKING",
                                    "NOP")] == [
        "load.global", "load.shared", "load.const", "load.local", "store", "fp32", "mufu", "mma", "fp16", "int", "move",
        "int", "move", "shfl", "convert", "branch", "sync", "other"]
    assert sum(class_counts([]).values()) == 0 and tuple(class_counts([])) == CLASSES


def test_missing_nvdisasm_names_the_package(monkeypatch):
    def no_files(name):
        raise _sass.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(_sass.importlib.metadata, "files", no_files)
    monkeypatch.setattr(_sass.shutil, "which", lambda name: None)
    with pytest.raises(FileNotFoundError, match=f"nvdisasm not found: pip install {NVDISASM_PACKAGE}"):
        nvdisasm_path()
    with pytest.raises(FileNotFoundError, match=NVDISASM_PACKAGE):
        kernel_sass.__wrapped__("decode_attention_warp", (9, 0))


def test_budgets_name_registered_kernels_with_stated_tokens():
    for name in SASS_BUDGET:
        assert name in TWINS and name in TOKENS_PER_ITERATION, name


def need_nvdisasm():
    try:
        nvdisasm_path()
    except FileNotFoundError as e:
        pytest.skip(f"{e} (the SASS budget needs it)")


@pytest.mark.ptx
@pytest.mark.parametrize("name", sorted(SASS_BUDGET))
def test_hot_loop_stays_within_its_sass_budget(name):
    """The decode kernel's token-tile loop at sm_90: no spills, and at most its budget of
    static SASS instructions per token per KV head (rules in ``numba_kv._sass``)."""
    need_nvdisasm()
    k = kernel_sass(name, (9, 0))
    r = k.resources
    assert (r.spill_stores, r.spill_loads, r.local) == (0, 0, 0), r
    hot = k.loops[k.hot]
    counts = hot.counts()
    # the loop that walks the tokens: it loads, multiplies and adds (the tensor-core kernels'
    # on tensor cores, the warp kernel's with warp shuffles), before the last-block merge
    assert counts["fp32"] > 0 and counts["load.global"] > 0 and hot.depth == 0, counts
    assert counts[_HALLMARK.get(name, "fp32")] > 0, counts
    start = _sass.epilogue_start(k.function)
    assert start is not None and hot.header < start, "expected the merge's arrival count after the token loop"
    breakdown = ", ".join(f"{c} {n / k.tokens_per_iteration:.1f}" for c, n in counts.items() if n)
    assert k.per_token <= SASS_BUDGET[name], (
        f"{name}: {k.per_token:.1f} SASS instructions per token per KV head in its hot loop (budget "
        f"{SASS_BUDGET[name]}; {hot.size} a pass / {k.tokens_per_iteration} tokens): {breakdown}")


@pytest.mark.ptx
def test_token_scale_loop_multiplies_no_code():
    """The flat tensor-core kernel has a second token loop for caches with one scale a token
    (``mma.mma_tiles(..., tok=True)``: the whole-head codes of the ``kv4``/``kv5`` presets):
    the token's scale multiplies its float32 scores and weights, so the loop has no binary16
    multiply (``HMUL2``) of a decoded code, where the block-scale loop has one a table read
    (64 a pass of one width pair; 3 × 64 for the loop's three K and three V decoders), and is
    that much shorter (less the 16 multiplies a pass it adds), within its own budget (65.5
    SASS per token per KV head when set, 2026-11-30; 3-bit K and V alone 486 a pass, 30.4
    per token, against 547 for the block loop)."""
    need_nvdisasm()
    k = kernel_sass("decode_attention_mma", (9, 0))
    tiles = [lp for lp in k.loops if lp.depth == 0 and any(i.opcode.startswith("HMMA") for i in lp.instructions)]
    assert len(tiles) == 2, [lp.size for lp in tiles]
    hmul = {lp.header: sum(i.opcode.startswith("HMUL2") for i in lp.instructions) for lp in tiles}
    block = k.loops[k.hot]
    (tok,) = [lp for lp in tiles if lp.header != block.header]
    assert hmul[block.header] >= 6 * 32 and hmul[tok.header] == 0, hmul
    assert tok.size <= block.size - 6 * 32 + 3 * 16, (tok.size, block.size)
    assert tok.size / TOKENS_PER_ITERATION["decode_attention_mma"] <= 72.0, tok.size


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_one_width_script_pins_the_tile_dispatch(bits):
    """``benchmarks/sass_one_width.py`` makes exactly the K and V width tests of the tiles'
    dispatchers constant: the chosen width's branch ``True``, the others ``False`` (``if`` and
    ``elif`` alike)."""
    from pathlib import Path

    from benchmarks.sass_one_width import pinned_source

    src = (Path(__file__).resolve().parents[2] / "numba_kv" / "ops" / "attention" / "mma.py").read_text()
    out = pinned_source(src, bits)
    assert "kb ==" not in out and "vb ==" not in out
    # the K and the V dispatcher's branch of 3 or 4 bits (2 bits: their fall-through, all False)
    assert out.count("if True:") - src.count("if True:") == (0 if bits == 2 else 2)
    assert out.count("if False:") - src.count("if False:") == (4 if bits == 2 else 2)
    with pytest.raises(SystemExit, match="width tests"):
        pinned_source("def f(kb):\n    return kb == 3\n", bits)
    # V's width apart from K's, and the flat kernel's tile loop
    mixed = pinned_source(src, bits, 2 if bits != 2 else 3, "token")
    assert mixed.count("if True:") - src.count("if True:") == 2
    choice = "if (int32(1) << sshift) >= HEAD_DIM // 32:"
    assert choice in src and choice not in mixed
    assert pinned_source(src, bits, None, "block").count("if False:") == out.count("if False:") + 1
    # the VQ build's quad tests: only when asked, True for the sides named
    assert src.count("VQ_BUILD and kq") == src.count("VQ_BUILD and vq") == 1 and "VQ_BUILD and" in out
    tok = pinned_source(src, bits, None, "token")
    vq = pinned_source(src, bits, None, "token", "v")
    assert "VQ_BUILD and" not in vq
    assert vq.count("if True:") == tok.count("if True:") + 1 and vq.count("if False:") == tok.count("if False:") + 1
    assert pinned_source(src, bits, None, "token", "none").count("if False:") == tok.count("if False:") + 2


@pytest.mark.ptx
@pytest.mark.parametrize("name", ["decode_attention_mma", "paged_decode_attention_mma"])
def test_pair_table_build_costs_few_instructions_a_word(name):
    """The prologue of the tensor-core kernels builds the K and V pair tables: the loops before
    the token loop that pack a binary16 pair (``F2FP``) and store it to shared memory
    (``STS``), one a table (``pairtab.build_pair_table``: replica 0 of each entry), and those that
    copy it to the other replicas (``pairtab.replicate_pair_table``: a shared load, ``LDS``, and
    store a word, no packing).  At sm_90 a packed word costs at most 45 SASS instructions (the
    entry is a shift of its index, where Numba's int64 floor division by the run-time replica
    count took about 95) and a copied word at most 12 (packing every word took 37: about
    1,200 instructions a warp at 3 bits, two token tiles' worth at batch 1)."""
    need_nvdisasm()
    k = kernel_sass(name, (9, 0))
    hot = k.loops[k.hot]
    packed, copied = [], []
    for lp in k.loops:
        ops = [ins.opcode.split(".")[0] for ins in lp.instructions]
        if lp.header >= hot.header or "STS" not in ops:
            continue
        if "F2FP" in ops:
            packed.append(lp.size / ops.count("STS"))
        elif ops.count("LDS") == ops.count("STS") == 1 and "LDG" not in ops:  # a shared copy loop
            copied.append(lp.size)
    assert len(packed) >= 2 and len(copied) >= 2, (packed, copied)  # (K and V; a split loop makes more)
    assert max(packed) <= 45, packed
    assert max(copied) <= 12, copied
