"""Borrowed array views for CPU kernels: no reference counting per call or per view.

Numba keeps arrays alive by reference counting (NRT): a compiled function increfs each array
argument on entry and decrefs it on exit, and every view it makes (``a[g]``, ``t[o:o+n]``)
takes a reference of its own — an atomic add each, through a call to ``NRT_incref`` /
``NRT_decref``.  Numba's pruning pass removes such pairs only in simple control flow.  In the
small serial kernels of a decode step (a tile loop calling its helpers ~60 times per tile; a
64-point head rotation making ~190 slice views) these atomics cost a fifth to a third of the
kernel's time.  A :func:`borrowed` view has a null meminfo, so every one of them becomes a
null-pointer test.

Rule of use (CPU kernels only; the CUDA target has no reference counting): a kernel borrows
its arguments (which outlive the call) and the scratch it allocates, passes the borrowed
views to its helpers, and calls :func:`keep_alive` on each allocated owner after the last use
of its views.  A borrowed view is never returned or stored where it could outlive its owner.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core.extending import intrinsic

__all__ = ["borrowed", "keep_alive"]


@intrinsic
def borrowed(typingctx, a):
    """``a`` itself (same data, shape, strides and type) without a reference to its memory:
    the view's NRT meminfo and parent are null, so passing it to a compiled call costs no
    reference counting.

    Numba increfs an array argument on entry to a compiled function and decrefs it on exit
    (an atomic add each, through ``NRT_incref``/``NRT_decref``; its pruning pass removes the
    pairs only in simple control flow), and every view it makes (``a[g]``) takes a reference
    too.  Per tile of the decode kernel that was ~60 atomic operations — a fifth of a small
    step's kernel time.  A borrowed view makes them null-pointer tests.

    The caller keeps the owner alive while the view is in use: a kernel's own arguments
    live for the whole call; arrays it allocates are passed to :func:`keep_alive` after the
    last use of their views.  Never return a borrowed view or store it where it outlives
    its owner.
    """
    if not isinstance(a, types.Array):
        return None

    def codegen(context, builder, signature, args):
        src = context.make_array(signature.args[0])(context, builder, args[0])
        out = context.make_array(signature.return_type)(context, builder)
        for name in ("nitems", "itemsize", "data", "shape", "strides"):
            setattr(out, name, getattr(src, name))
        out.meminfo = ir.Constant(out.meminfo.type, None)
        out.parent = ir.Constant(out.parent.type, None)
        return out._getvalue()  # noqa: SLF001 - the struct proxy API of Numba's code generation

    return a(a), codegen


@intrinsic
def keep_alive(typingctx, a):
    """Nothing, but a use of ``a`` (an array or a tuple of arrays): Numba releases an array
    after its last use, so an array whose :func:`borrowed` views are still read must be used
    after them."""
    arrays = list(a) if isinstance(a, types.BaseTuple) else [a]
    if not arrays or not all(isinstance(x, types.Array) for x in arrays):
        return None

    def codegen(context, builder, signature, args):
        return context.get_dummy_value()

    return types.void(a), codegen
