"""Warp-level PTX that Numba does not expose, as ``@intrinsic``\\ s (GPU) with simulator twins.

Each primitive exists twice, chosen once at import (``NUMBA_ENABLE_CUDASIM``):

* on a GPU, a Numba ``@intrinsic`` whose code generation calls an llvmlite ``ir.InlineAsm`` of
  one PTX instruction (``mma.sync``, ``movmatrix.sync``, ``cvt.rn.f16x2.f32``,
  ``mul.rn.f16x2``, ``cvt.f32.f16``, ``prmt.b32``, ``ex2.approx.ftz.f32``, ``ld.shared.u32`` / ``.v2.u32``,
  ``ld.global.u32`` / ``.u16`` / ``.u8``, ``cvta.to.global``), or Numba's own ``shfl.sync`` (and :func:`shared_base32`,
  an address cast in LLVM IR);
* under Numba's CUDA simulator, a plain Python function with the same arguments and results
  bit for bit (binary16 through NumPy; the warp-collective ones exchange their lanes'
  operands through a per-block table between two block barriers, so in that build every
  lane of the block must reach them together — the simulator launches the kernels that use
  them with one warp per block).

Binary16 pairs travel as ``uint32`` (``.f16x2``: element 0 in the low half, as PTX lays out
the fragments of ``mma.sync``).  The fragment layouts of ``m16n8k16`` (PTX ISA, "Matrix
Fragments for mma.m16n8k16"), for lane ``ℓ`` with ``gid = ℓ >> 2`` and ``tig = ℓ & 3``:

* ``A`` (16×16, row-major): ``a0 = (A[gid, 2tig], A[gid, 2tig+1])``, ``a1`` the same at row
  ``gid + 8``, ``a2``/``a3`` the same at columns ``+ 8``;
* ``B`` (16×8, column-major): ``b0 = (B[2tig, gid], B[2tig+1, gid])``, ``b1`` at rows ``+ 8``;
* ``C``/``D`` (16×8, float32): ``c0, c1 = C[gid, 2tig], C[gid, 2tig+1]``, ``c2, c3`` at row
  ``gid + 8``.

``movmatrix.sync.aligned.m8n8.trans.b16`` (PTX ISA 7.8, sm_75 and later) transposes an 8×8
matrix of 16-bit elements held in that same layout (lane ``ℓ``: row ``gid``, columns ``2tig,
2tig+1``): it turns a product's accumulators, packed to ``.f16x2``, into the B fragment of
the next product with its two dimensions swapped.
"""

from __future__ import annotations

import threading

import numpy as np
from llvmlite import ir
from numba import cuda, int32, uint32
from numba.cuda import cgutils, types
from numba.cuda.extending import intrinsic

from ... import _backend

__all__ = ["SIMULATED", "SIM_SHARED_BASE", "exp2_ftz", "global_address", "half2_bits", "half_f32", "hmul2",
           "lds_u32", "lds_u32x2", "ldg_u8", "ldg_u16", "ldg_u32",
           "low_halves", "high_halves", "mma_16816", "movmatrix_trans", "pack_half2",
           "shared_base32", "static_itemsize", "shfl_idx_f32", "shfl_xor_f32", "shfl_xor_u32", "unpack_half2"]

#: the simulator build (Python twins of every primitive)
SIMULATED = _backend.simulator_enabled()
_FULL = 0xFFFFFFFF
#: the simulator's stand-in shared-window address of every array: as on sm_80 and sm_90, where
#: a CTA's user shared arrays start 0x400 bytes into its window (and sm_90 puts the CTA's rank
#: in the cluster above bit 23), it is not aligned past 1 KiB, so that code which assumes a
#: more aligned array (ORs an offset into its address without realigning it first) reads the
#: wrong word or raises, as on the GPU
SIM_SHARED_BASE = 0x1C400


# --- Python twins (the simulator build; also the tests' oracle of the bit layout) ----------
def half2_bits(lo: float, hi: float) -> int:
    """``(lo, hi)`` rounded to binary16 (round to nearest even) as one ``.f16x2`` word."""
    with np.errstate(over="ignore"):  # past 65504 rounds to inf, as cvt.rn.f16x2.f32 does
        pair = np.array([lo, hi], dtype=np.float32).astype(np.float16).view(np.uint16)
    return int(pair[0]) | (int(pair[1]) << 16)


def unpack_half2(w: int) -> tuple[float, float]:
    """The two binary16 halves of ``w`` as float32 ``(low, high)``."""
    h = np.array([int(w) & 0xFFFF, (int(w) >> 16) & 0xFFFF], dtype=np.uint16).view(np.float16)
    return float(h[0]), float(h[1])


def _sim_pack_half2(lo, hi):
    return np.uint32(half2_bits(lo, hi))


def _sim_hmul2(x, y):
    xl, xh = unpack_half2(x)
    yl, yh = unpack_half2(y)
    # a binary16 product rounded once: exact in float64, then to binary16
    return np.uint32(half2_bits(np.float64(xl) * yl, np.float64(xh) * yh))


def _sim_half_f32(x):
    return np.float32(np.array([int(x) & 0xFFFF], dtype=np.uint16).view(np.float16)[0])


def _sim_shared_base32(arr):
    return np.uint32(SIM_SHARED_BASE)


def _sim_lds_u32(arr, addr):
    off = int(addr) - SIM_SHARED_BASE
    if off < 0 or off & 3 or off >= 4 * len(arr):
        raise IndexError(f"shared address {int(addr):#x}: not a word of the array at "
                         f"{SIM_SHARED_BASE:#x} ({len(arr)} words)")
    return np.uint32(arr[off >> 2])


def _sim_lds_u32x2(arr, addr):
    if (int(addr) - SIM_SHARED_BASE) & 7:
        raise IndexError(f"shared address {int(addr):#x}: not 8-byte aligned (ld.shared.v2.u32)")
    return _sim_lds_u32(arr, addr), _sim_lds_u32(arr, np.uint32(int(addr) + 4))


def _sim_itemsize(arr):
    return int(np.dtype(arr.dtype).itemsize)


def _sim_root(arr):
    """The simulated device array's NumPy view and the allocation it lies in."""
    a = getattr(arr, "_ary", arr)
    root = a
    while isinstance(root.base, np.ndarray):
        root = root.base
    return a, root


def _sim_global_address(arr):
    return np.uint64(_sim_root(arr)[0].__array_interface__["data"][0])


def _sim_load(arr, addr, dtype):
    """The ``dtype`` element at byte address ``addr`` of the allocation ``arr`` lies in (the
    GPU reads outside it, or misaligned, only through a wrong address: raised here)."""
    _, root = _sim_root(arr)
    size = np.dtype(dtype).itemsize
    off = int(addr) - root.__array_interface__["data"][0]
    if off < 0 or off > root.nbytes - size or off % size:
        raise IndexError(f"address {int(addr):#x}: not a {np.dtype(dtype)} of the array's allocation")
    return np.uint32(root.reshape(-1).view(np.uint8)[off:off + size].view(dtype)[0])


def _sim_ldg_u32(arr, addr):
    return _sim_load(arr, addr, np.uint32)


def _sim_ldg_u16(arr, addr):
    return _sim_load(arr, addr, np.uint16)


def _sim_ldg_u8(arr, addr):
    return _sim_load(arr, addr, np.uint8)


def _exchange(value):
    """Every lane's ``value`` of this lane's warp (a list of 32), through a table of the
    simulated block: two slot lists used in turn, one block barrier per exchange (a lane can
    only overwrite a list again after the next exchange's barrier, which every lane reaches
    after reading it)."""
    me = threading.current_thread()
    # the simulator's block manager of this thread (a private attribute of Numba's simulator)
    table = me._manager.__dict__.setdefault("_numba_kv_lanes", {})  # noqa: SLF001
    tid = me.thread_id
    k = getattr(me, "_numba_kv_exchanges", 0)
    me._numba_kv_exchanges = k + 1  # noqa: SLF001 - our counter on the simulator's thread object
    slots = table.setdefault((tuple(me.blockIdx), tid >> 5, k & 1), [None] * 32)
    slots[tid & 31] = value
    me.syncthreads()  # (the simulator's block barrier of this thread)
    return list(slots)


def _sim_shfl_xor(x, mask):
    lanes = _exchange(x)
    return lanes[(threading.current_thread().thread_id & 31) ^ mask]


def _sim_exp2_ftz(x):
    with np.errstate(over="ignore", under="ignore"):
        y = np.float32(np.exp2(np.float64(x)))
    return np.float32(0.0) if y < np.float32(2.0 ** -126) else y  # (results below float32's normals flush)


def _sim_low_halves(a, b):
    return np.uint32((int(a) & 0xFFFF) | ((int(b) & 0xFFFF) << 16))


def _sim_high_halves(a, b):
    return np.uint32(((int(a) >> 16) & 0xFFFF) | (int(b) & 0xFFFF0000))


def _sim_shfl_idx(x, src):
    return _exchange(x)[int(src) & 31]


def _sim_movmatrix(w):
    lanes = np.array(_exchange(w), dtype=np.uint32).view(np.uint16).reshape(8, 8)  # [row, column]
    ln = threading.current_thread().thread_id & 31
    gid, tig = ln >> 2, ln & 3
    # element (r, c) of the result is (c, r) of the source
    return np.uint32(int(lanes[2 * tig, gid]) | (int(lanes[2 * tig + 1, gid]) << 16))


# where each lane's fragment halves land: A[16, 16] (a0..a3 low/high) and B[16, 8] (b0, b1)
_LANE = np.arange(32)
_GID, _TIG = _LANE >> 2, _LANE & 3
_A_ROW = np.stack([_GID, _GID, _GID + 8, _GID + 8, _GID, _GID, _GID + 8, _GID + 8], axis=1)
_A_COL = np.stack([2 * _TIG, 2 * _TIG + 1] * 2 + [2 * _TIG + 8, 2 * _TIG + 9] * 2, axis=1)
_B_ROW = np.stack([2 * _TIG, 2 * _TIG + 1, 2 * _TIG + 8, 2 * _TIG + 9], axis=1)
_B_COL = np.stack([_GID] * 4, axis=1)


def _sim_mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    regs = np.array(_exchange((a0, a1, a2, a3, b0, b1)), dtype=np.uint32)  # [32 lanes, 6]
    halves = regs.view(np.float16).astype(np.float64).reshape(32, 12)  # low half first
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    A[_A_ROW, _A_COL] = halves[:, :8]
    B[_B_ROW, _B_COL] = halves[:, 8:]
    ln = threading.current_thread().thread_id & 31
    gid, tig = ln >> 2, ln & 3
    # binary16 products are exact in float64, and so are their sums over 16 terms to far
    # below float32's rounding: the hardware's float32 accumulation agrees to round-off
    d = A[[gid, gid + 8]] @ B[:, [2 * tig, 2 * tig + 1]]
    return (np.float32(c0 + d[0, 0]), np.float32(c1 + d[0, 1]), np.float32(c2 + d[1, 0]), np.float32(c3 + d[1, 1]))


# --- GPU intrinsics -------------------------------------------------------------------------
def _asm_intrinsic(template: str, result: str, operands: tuple[str, ...]):
    """An ``@intrinsic`` of one PTX instruction ``template`` (``$0`` the result, ``$1``, ``$2``
    the operands) over 32-bit scalars: ``result`` and each of the one or two ``operands``
    ``"u32"`` (a register ``r``) or ``"f32"`` (``f``)."""
    kinds = {"u32": (types.uint32, ir.IntType(32), "r"), "f32": (types.float32, ir.FloatType(), "f")}
    ret_t, ret_ir, ret_c = kinds[result]
    arg_ts = [kinds[o][0] for o in operands]
    fnty = ir.FunctionType(ret_ir, [kinds[o][1] for o in operands])
    constraints = ",".join(["=" + ret_c, *(kinds[o][2] for o in operands)])

    def codegen(context, builder, signature, values):
        xs = [context.cast(builder, v, t, s) for v, t, s in zip(values, signature.args, arg_ts)]
        return builder.call(ir.InlineAsm(fnty, template, constraints), xs)

    # (a typing function with one named parameter per operand: Numba folds ``*args`` into a tuple)
    if len(operands) == 1:
        def typer(typingctx, x0):
            return ret_t(*arg_ts), codegen
    else:
        def typer(typingctx, x0, x1):
            return ret_t(*arg_ts), codegen
    return intrinsic(typer)


def _gpu_loads():
    """The shared and global loads by address and the addresses they start from."""
    i32 = ir.IntType(32)
    i64 = ir.IntType(64)

    @intrinsic
    def shared_base(typingctx, arr):
        def codegen(context, builder, signature, args):
            data = cgutils.create_struct_proxy(signature.args[0])(context, builder, value=args[0]).data
            # the generic pointer back in the shared state space (LLVM folds the two casts
            # into the array's symbol), as a 32-bit shared-window address
            shared = builder.addrspacecast(data, ir.PointerType(data.type.pointee, addrspace=3))
            return builder.ptrtoint(shared, i32)

        return types.uint32(arr), codegen

    @intrinsic
    def lds(typingctx, arr, addr):
        def codegen(context, builder, signature, args):
            a = context.cast(builder, args[1], signature.args[1], types.uint32)
            # side_effect: LLVM does not see that the asm reads the array, so it must not move
            # the load above the barrier that publishes the array's words
            asm = ir.InlineAsm(ir.FunctionType(i32, [i32]), "ld.shared.u32 $0, [$1];", "=r,r", side_effect=True)
            return builder.call(asm, [a])

        return types.uint32(arr, types.uint32), codegen

    @intrinsic
    def lds2(typingctx, arr, addr):
        def codegen(context, builder, signature, args):
            a = context.cast(builder, args[1], signature.args[1], types.uint32)
            # (side_effect: as lds)
            asm = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([i32, i32]), [i32]),
                               "ld.shared.v2.u32 {$0, $1}, [$2];", "=r,=r,r", side_effect=True)
            res = builder.call(asm, [a])
            return context.make_tuple(builder, signature.return_type, [builder.extract_value(res, i) for i in (0, 1)])

        return types.UniTuple(types.uint32, 2)(arr, types.uint32), codegen

    @intrinsic
    def global_addr(typingctx, arr):
        def codegen(context, builder, signature, args):
            data = cgutils.create_struct_proxy(signature.args[0])(context, builder, value=args[0]).data
            asm = ir.InlineAsm(ir.FunctionType(i64, [i64]), "cvta.to.global.u64 $0, $1;", "=l,l")
            return builder.call(asm, [builder.ptrtoint(data, i64)])

        return types.uint64(arr), codegen

    def ldg(width):
        ty = ir.IntType(max(width, 16))

        def typer(typingctx, arr, addr):
            def codegen(context, builder, signature, args):
                a = context.cast(builder, args[1], signature.args[1], types.uint64)
                # (no side effect: the kernels read arrays that nothing writes while they run)
                asm = ir.InlineAsm(ir.FunctionType(ty, [i64]), f"ld.global.u{width} $0, [$1];",
                                   "=r,l" if width == 32 else "=h,l")  # (u8: into 16 bits)
                value = builder.call(asm, [a])
                return value if width == 32 else builder.zext(value, i32)

            return types.uint32(arr, types.uint64), codegen
        return intrinsic(typer)

    @intrinsic
    def itemsize(typingctx, arr):
        size = arr.dtype.bitwidth // 8

        def codegen(context, builder, signature, args):
            return context.get_constant(types.intp, size)

        return types.intp(arr), codegen

    return shared_base, lds, lds2, global_addr, ldg(32), ldg(16), ldg(8), itemsize


def _gpu_primitives():
    f32 = ir.FloatType()
    i32 = ir.IntType(32)

    @intrinsic
    def mma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        sig = types.UniTuple(types.float32, 4)(types.uint32, types.uint32, types.uint32, types.uint32,
                                               types.uint32, types.uint32, types.float32, types.float32,
                                               types.float32, types.float32)

        def codegen(context, builder, signature, args):
            args = [context.cast(builder, v, t, s) for v, t, s in zip(args, signature.args, sig.args)]
            fnty = ir.FunctionType(ir.LiteralStructType([f32] * 4), [i32] * 6 + [f32] * 4)
            asm = ir.InlineAsm(
                fnty,
                "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, "
                "{$8, $9}, {$10, $11, $12, $13};",
                "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
            res = builder.call(asm, args)
            return context.make_tuple(builder, signature.return_type,
                                      [builder.extract_value(res, i) for i in range(4)])

        return sig, codegen

    @intrinsic
    def half_f32(typingctx, x):
        def codegen(context, builder, signature, args):
            h = builder.trunc(context.cast(builder, args[0], signature.args[0], types.uint32), ir.IntType(16))
            return builder.call(ir.InlineAsm(ir.FunctionType(f32, [ir.IntType(16)]), "cvt.f32.f16 $0, $1;", "=f,h"),
                                [h])

        return types.float32(types.uint32), codegen

    # the first source of cvt.rn.f16x2.f32 goes to the upper half: (lo, hi) is "$0, $2, $1"
    pack = _asm_intrinsic("cvt.rn.f16x2.f32 $0, $2, $1;", "u32", ("f32", "f32"))
    mul2 = _asm_intrinsic("mul.rn.f16x2 $0, $1, $2;", "u32", ("u32", "u32"))
    movmatrix = _asm_intrinsic("movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;", "u32", ("u32",))
    ex2 = _asm_intrinsic("ex2.approx.ftz.f32 $0, $1;", "f32", ("f32",))
    # bytes 0-3 of the first source, 4-7 of the second: (a.lo, b.lo) and (a.hi, b.hi)
    low = _asm_intrinsic("prmt.b32 $0, $1, $2, 0x5410;", "u32", ("u32", "u32"))
    high = _asm_intrinsic("prmt.b32 $0, $1, $2, 0x7632;", "u32", ("u32", "u32"))

    def shfl_idx(x, src):
        return cuda.shfl_sync(_FULL, x, src)

    def shfl_u32(x, mask):
        # (shfl_xor_sync types signed 32-bit words only)
        return uint32(cuda.shfl_xor_sync(_FULL, int32(x), mask))

    def shfl_f32(x, mask):
        return cuda.shfl_xor_sync(_FULL, x, mask)

    dev = cuda.jit(device=True, inline="always")
    return (mma, pack, mul2, half_f32, movmatrix, low, high, ex2, dev(shfl_u32), dev(shfl_f32), dev(shfl_idx),
            *_gpu_loads())


if SIMULATED:
    mma_16816, pack_half2, hmul2, movmatrix_trans = _sim_mma, _sim_pack_half2, _sim_hmul2, _sim_movmatrix
    half_f32 = _sim_half_f32
    low_halves, high_halves, exp2_ftz = _sim_low_halves, _sim_high_halves, _sim_exp2_ftz
    shfl_xor_u32 = shfl_xor_f32 = _sim_shfl_xor
    shfl_idx_f32 = _sim_shfl_idx
    shared_base32, lds_u32, lds_u32x2 = _sim_shared_base32, _sim_lds_u32, _sim_lds_u32x2
    global_address, ldg_u32, ldg_u16, ldg_u8 = _sim_global_address, _sim_ldg_u32, _sim_ldg_u16, _sim_ldg_u8
    static_itemsize = _sim_itemsize
else:
    (mma_16816, pack_half2, hmul2, half_f32, movmatrix_trans, low_halves, high_halves, exp2_ftz, shfl_xor_u32,
     shfl_xor_f32, shfl_idx_f32, shared_base32, lds_u32, lds_u32x2, global_address, ldg_u32, ldg_u16,
     ldg_u8, static_itemsize) = _gpu_primitives()

mma_16816.__doc__ = """``D = A·B + C`` of one warp (``mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32``):
``a0…a3`` and ``b0, b1`` this lane's ``.f16x2`` fragments of A and B, ``c0…c3`` its float32
accumulators; returns its four float32 results (layouts in the module docstring).  Every lane
of the warp calls it with the same control flow."""
movmatrix_trans.__doc__ = """The transpose of the warp's 8×8 binary16 matrix
(``movmatrix.sync.aligned.m8n8.trans.b16``): lane ``ℓ`` passes ``(M[gid, 2tig], M[gid,
2tig+1])`` and gets ``(M[2tig, gid], M[2tig+1, gid])`` (``.f16x2`` words).
Every lane of the warp calls it with the same control flow."""
half_f32.__doc__ = """The binary16 in the low 16 bits of a ``uint32`` as float32 (``cvt.f32.f16``:
exact, subnormals, infinities and NaNs included; one instruction where the kernels' scale
table takes a load).

Parameters
----------
x : uint32
    Binary16 bits in bits 0-15 (the upper half is ignored).

Returns
-------
float32
"""
shfl_idx_f32.__doc__ = """Lane ``src``'s float32 ``x`` (``shfl.sync.idx``, whole warp)."""
low_halves.__doc__ = """``(a.lo, b.lo)``: the low binary16 halves of two ``.f16x2`` words in one
(``prmt.b32`` selector 0x5410: one instruction where the shifts and masks take two)."""
high_halves.__doc__ = """``(a.hi, b.hi)``: the high binary16 halves of two ``.f16x2`` words in one
(``prmt.b32`` selector 0x7632)."""
exp2_ftz.__doc__ = """``2**x`` in float32 (``ex2.approx.ftz.f32``: relative error about ``2**-22``,
``2**-inf = 0``, results below ``2**-126`` flushed to 0) in one instruction, where
``math.exp2`` adds three for subnormal results; for softmax weights, which the kernels round to
binary16 anyway."""
shared_base32.__doc__ = """The 32-bit shared-window address of a shared array's word 0, for :func:`lds_u32`.

Not aligned past 1 KiB whatever alignment the array is declared with: sm_80 and sm_90 place a
CTA's user shared arrays 0x400 bytes into its window (the first KiB is reserved), and sm_90
puts the CTA's rank in its cluster above bit 23.  A caller that ORs byte offsets into the
address realigns it first (the tensor-core kernel: :func:`~numba_kv.ops.attention.pairtab.aligned_table`).

Parameters
----------
arr : uint32 shared array (``cuda.shared.array``), any shape

Returns
-------
uint32
    The address (the simulator's stand-in: :data:`SIM_SHARED_BASE`).
"""
lds_u32.__doc__ = """The word at a shared-window address (``ld.shared.u32``).

The caller makes ``addr`` in one instruction together with the rest of its index (the
tensor-core kernel's table reads: a funnel shift, a mask-and-or, the load).

Parameters
----------
arr : uint32 shared array
    The array ``addr`` lies in; its words must be written before the last block barrier (the
    simulator reads through it and raises outside it).
addr : uint32
    :func:`shared_base32` of ``arr`` plus a multiple-of-4 byte offset inside it (made by an OR
    only from a base realigned past the offset's bits).

Returns
-------
uint32
"""
lds_u32x2.__doc__ = """The two words at a shared-window address (``ld.shared.v2.u32``: one
instruction where two ``ld.shared.u32`` take two; the tensor-core kernel's VQ quad tables,
whose entries are two ``.f16x2`` words).

Parameters
----------
arr : uint32 shared array
    As :func:`lds_u32`.
addr : uint32
    As :func:`lds_u32`, a multiple of 8 bytes into the array.

Returns
-------
tuple of two uint32
    The word at ``addr`` and the next one.
"""
global_address.__doc__ = """The global-space byte address of a device array's element 0
(``cvta.to.global.u64`` of its data pointer), for :func:`ldg_u32` / :func:`ldg_u16`.

Parameters
----------
arr : device array, any shape and dtype

Returns
-------
uint64
"""
ldg_u32.__doc__ = """The ``uint32`` at a global byte address (``ld.global.u32``).

A caller that makes ``addr`` as one ``u32 × u32 + u64`` multiply-add, with the constant
offsets of the words it reads next folded into the loads' immediates, spends one instruction
per address where Numba's indexing of ``arr`` spends a multiply-add, a shift-and-add pair and
an add.

Parameters
----------
arr : uint32 device array
    The array ``addr`` lies in (the simulator reads through it and raises outside its
    allocation or at a misaligned address); nothing may write it while the kernel runs.
addr : uint64
    :func:`global_address` of ``arr`` plus a multiple-of-4 byte offset inside it.

Returns
-------
uint32
"""
ldg_u16.__doc__ = """The ``uint16`` at a global byte address, zero-extended (``ld.global.u16``).

Parameters
----------
arr : uint16 device array
    As :func:`ldg_u32`.
addr : uint64
    :func:`global_address` of ``arr`` plus a multiple-of-2 byte offset inside it.

Returns
-------
uint32
"""
ldg_u8.__doc__ = """The ``uint8`` at a global byte address, zero-extended (``ld.global.u8`` into a
16-bit register: PTX has no 8-bit ones; the tensor-core kernel's 8-bit norms).

Parameters
----------
arr : uint8 device array
    As :func:`ldg_u32`.
addr : uint64
    :func:`global_address` of ``arr`` plus a byte offset inside it.

Returns
-------
uint32
"""
static_itemsize.__doc__ = """An array's element size in bytes as a compile-time constant (from its type:
``arr.itemsize`` reads the array's descriptor at run time, a load the compiler cannot fold), so
that a branch on it costs nothing.

Parameters
----------
arr : device array, any shape and dtype

Returns
-------
int
"""
