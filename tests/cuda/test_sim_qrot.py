"""The query rotation in the partition kernels' prologue (issue 27, item 3).

On a GPU a decode step hands the partition kernel its raw queries and the kernel rotates
the rows of each rotated-domain partition itself (``rotate_q``;
:mod:`numba_kv.ops.attention.qrot`): no rotation launch, no rotated copy.  Here, under
``NUMBA_ENABLE_CUDASIM=1`` (or on a GPU), for every CUDA variant (block, warp, tensor-core),
both rotations (32-block, whole head) and exact tokens attended raw or in the rotated
domain: the step's output is bit for bit the one of the rotation launch before the kernel
(the ``cuda_fused_query_rotation`` knob off), no rotation kernel runs, and the CPU twin given
``rotate_q`` writes the partials it writes for the queries rotated by the rotation op.
"""

import numpy as np
import pytest

from numba_kv import knobs
from numba_kv._backend import to_host
from numba_kv.ops import hadamard, headquant
from numba_kv.ops._registry import Twin
from numba_kv.ops.attention import decode_attention, kernels, plan
from numba_kv.ops.attention.step_cpu import ROTATE_BLOCK, ROTATE_HEAD
from numba_kv.ops.blockquant import quantize_blocks
from numba_kv.ops.headquant import quantize_head

from ..conftest import spy_launches, to_device

#: variant -> (the twin that must run, head_dim, GQA group, q_len, knobs)
VARIANTS = {"block": ("DECODE_ATTENTION", 64, 4, 2, {"cuda_warp_attention": 0}),
            "warp": ("DECODE_ATTENTION_WARP", 64, 4, 2, {"cuda_mma_attention": 0}),  # (64: a tensor-core build too)
            "mma": ("DECODE_ATTENTION_MMA", 128, 2, 2, {})}


def _captured(monkeypatch, rng, d, G, ql, rotation):
    """A host ``decode_attention`` (2 KV heads, 29 codes, 11 exact tokens, partitions of 8)
    and the arguments its plan's ``run_flat`` got, with the raw queries ``[n_g, rows, d]``."""
    hkv, T, E = 2, 29, 11
    quant = (lambda x: quantize_head(x, 3)) if rotation == "head" else (lambda x: quantize_blocks(x, 3))
    kc, ks = quant(rng.standard_normal((1, hkv, T, d)).astype(np.float32))
    vc, vs = quant(rng.standard_normal((1, hkv, T, d)).astype(np.float32))
    q = rng.standard_normal((1, hkv * G, ql, d)).astype(np.float32)
    kw = dict(bits=3, partition_size=8, rotation=rotation,
              k_exact=rng.standard_normal((1, hkv, E, d)).astype(np.float32),
              v_exact=rng.standard_normal((1, hkv, E, d)).astype(np.float32))
    seen = []
    real = plan.AttentionPlan.run_flat

    def spy(self, *args):
        seen.append(args)
        return real(self, *args)

    monkeypatch.setattr(plan.AttentionPlan, "run_flat", spy)
    decode_attention(q, kc, ks, vc, vs, **kw)
    monkeypatch.setattr(plan.AttentionPlan, "run_flat", real)
    (args,) = seen
    return args, q.reshape(hkv, G * ql, d)


def _step(args, q3, klayout, vlayout, exact_rotated, device):
    """One :meth:`FlatStep.run` of the captured arguments with its ``rotate`` (the raw queries)."""
    (_, _, kc, ks, vc, vs, n_comp, comp_pos0, ke, ve, n_exact, epos, scale, _, q_pos0, q_len, causal, part, hs, _, _,
     _) = args
    put = to_device if device else (lambda a: a)
    n_g, rows, d = q3.shape
    dq = put(q3)
    p = plan.attention_plan(dq, paged=False, n_g=n_g, rows=rows, d=d, klayout=klayout, vlayout=vlayout,
                            v_width=int(vc.shape[2]))
    step = p.bind_flat(*(put(a) for a in (kc, ks, vc, vs)), comp_pos0, put(ke), put(ve), put(epos),
                       None if hs is None else put(np.asarray(to_host(hs))), exact_rotated)
    signs = hadamard.SIGNS32 if hs is None else headquant.head_signs(d)
    rotate = (ROTATE_BLOCK if hs is None else ROTATE_HEAD, dq.reshape(n_g * rows, d), put(np.array(signs)))
    qr = put(np.zeros_like(q3))
    out = step.run(qr, qr if exact_rotated else dq, n_comp, n_exact, q_pos0, q_len, scale, part_size=part,
                   causal=causal, rotate=rotate)
    return p, to_host(out)


def _spy_names(monkeypatch, names):
    """The names of the launches of the twins ``names`` from now on (wraps ``Twin.launch``)."""
    seen = []
    real = Twin.launch

    def launch(self, *args, **kw):
        if self.name in names:
            seen.append(self.name)
        return real(self, *args, **kw)

    monkeypatch.setattr(Twin, "launch", launch)
    return seen


def _layouts(monkeypatch, rng, d, G, ql, rotation):
    """The captured arguments, the raw queries and the plan's layouts of that decode."""
    made = []
    real = plan.attention_plan

    def spy(*a, **kw):
        made.append((kw["klayout"], kw["vlayout"]))
        return real(*a, **kw)

    monkeypatch.setattr(plan, "attention_plan", spy)
    monkeypatch.setattr("numba_kv.ops.attention.flat.attention_plan", spy)
    args, q3 = _captured(monkeypatch, rng, d, G, ql, rotation)
    monkeypatch.setattr(plan, "attention_plan", real)
    return args, q3, made[-1]


@pytest.mark.cuda
@pytest.mark.parametrize("exact_rotated", [False, True])
@pytest.mark.parametrize("rotation", ["block", "head"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_prologue_rotation_matches_the_rotation_launch(variant, rotation, exact_rotated, monkeypatch):
    twin, d, G, ql, opts = VARIANTS[variant]
    args, q3, (klay, vlay) = _layouts(monkeypatch, np.random.default_rng(41), d, G, ql, rotation)
    ran = spy_launches(monkeypatch, (kernels, twin))
    rotations = _spy_names(monkeypatch, ("rotate32", "rotate_head"))
    with knobs(**opts):
        p, fused = _step(args, q3, klay, vlay, exact_rotated, True)
        assert p.rotate_q and not rotations, "a rotation launch besides the kernel's prologue"
        with knobs(cuda_fused_query_rotation=0):
            p_off, separate = _step(args, q3, klay, vlay, exact_rotated, True)
        assert not p_off.rotate_q and len(rotations) == 1
    assert len([g for g in ran if g is not None]) == 2, f"the {variant} kernel did not run"
    assert np.array_equal(fused, separate), "the prologue's rotation is not the rotation op's"
    _, cpu = _step(args, q3, klay, vlay, exact_rotated, False)
    rtol = 4e-3 if variant == "mma" else 2e-5
    assert float(np.linalg.norm(fused - cpu) / np.linalg.norm(cpu)) < rtol


@pytest.mark.cuda
@pytest.mark.parametrize("exact_rotated", [False, True])
@pytest.mark.parametrize("rotation", ["block", "head"])
def test_cpu_twin_rotates_like_the_rotation_op(rotation, exact_rotated, monkeypatch):
    """The CPU twin's ``rotate_q`` (never asked for by the host, which rotates once per step)
    writes the partials of the queries rotated by the op, bit for bit."""
    args, q3, (klay, vlay) = _layouts(monkeypatch, np.random.default_rng(43), 64, 4, 2, rotation)
    launched = []
    real = Twin.launch

    def spy(self, *a, **kw):
        if self.name == "decode_attention":
            launched.append(a)
        return real(self, *a, **kw)

    monkeypatch.setattr(Twin, "launch", spy)
    if True:  # (run_flat: op by op, the partition kernel's launch is seen)
        step_args = list(args)
        p = plan.attention_plan(q3, paged=False, n_g=q3.shape[0], rows=q3.shape[1], d=64, klayout=klay, vlayout=vlay,
                                v_width=int(args[4].shape[2]))
        qr = (headquant.rotate_head_rows(q3.reshape(-1, 64)) if rotation == "head" else
              hadamard.rotate32_rows(q3.reshape(-1, 64))).reshape(q3.shape)
        step_args[0], step_args[1], step_args[20] = qr, qr if exact_rotated else q3, exact_rotated
        p.run_flat(*step_args)
    (a,) = launched
    a = list(a)
    want = [np.array(x) for x in a[-11:-8]]
    a[2], a[3], a[-1] = q3, q3, True  # (a[0], a[1]: the device and the item count)
    a[-11:-8] = [np.full_like(x, np.nan) for x in want]
    kernels.DECODE_ATTENTION.cpu.serial(*a[2:])
    for got, ref in zip(a[-11:-8], want):
        assert np.array_equal(got, ref, equal_nan=True)


class _Warp:
    """A stand-in for ``numba.cuda`` inside :func:`~numba_kv.ops.attention.qrot.warp_stage_rotated`'s
    Python source: one warp of 32 threads, ``shfl_xor_sync`` through a shared slot per lane
    between two barriers (the simulator has no warp shuffles)."""

    def __init__(self):
        import threading
        from types import SimpleNamespace

        self.blockDim = SimpleNamespace(x=32)
        self._slots = [None] * 32
        self._barrier = threading.Barrier(32)
        self._lane = threading.local()

    def shfl_xor_sync(self, mask, x, h):
        lane = self._lane.id
        self._slots[lane] = x
        self._barrier.wait()
        y = self._slots[lane ^ h]
        self._barrier.wait()
        return y


def _python(fn, glb):
    """The Python source of device function ``fn`` with the globals ``glb`` overriding its own."""
    import types

    py = getattr(fn, "py_func", None) or getattr(fn, "fn", None) or fn
    return types.FunctionType(py.__code__, {**py.__globals__, **glb}, py.__name__, py.__defaults__)


@pytest.mark.parametrize("rotation", ["block", "head"])
@pytest.mark.parametrize("d", [32, 64, 128])
def test_warp_shuffle_rotation_is_the_rotation_op(d, rotation):
    """The GPU build's shuffle rotation (no simulator path runs it), its Python source run by
    32 threads in float32 with emulated shuffles: every staged slot holds the rotation op's
    row bit for bit (slots of both halves: 2 of 4 rows here, from row chunk ``r0`` = 1)."""
    import threading

    from numba_kv.ops import _headquant_lanes
    from numba_kv.ops.attention import qrot

    warp = _Warp()
    glb = {"cuda": warp, "float32": np.float32, "head_scale_dev": _headquant_lanes.head_scale,
           "mul_rn_dev": lambda a, b: np.float32(a) * np.float32(b)}
    glb["_bfly"] = _python(qrot._bfly, glb)
    stage = _python(qrot.warp_stage_rotated, glb)
    rng = np.random.default_rng(47)
    rows, r0, stride = 3, 1, 4
    src = rng.standard_normal((2, rows, d)).astype(np.float32)
    hs = headquant.head_signs(d)
    qs = np.full(2 * stride * d, np.nan, np.float32)
    errors = []

    def lane(t):
        warp._lane.id = t
        try:
            stage(qs, src, 1, r0, rows, d, 0, 2 * stride, stride, rotation == "head", hs, hadamard.SIGNS32, t)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            warp._barrier.abort()

    threads = [threading.Thread(target=lane, args=(t,)) for t in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    rot = headquant.rotate_head_rows if rotation == "head" else hadamard.rotate32_rows
    want = rot(np.ascontiguousarray(src[1]))
    for s in range(2 * stride):
        assert np.array_equal(qs[s * d:(s + 1) * d], want[min(r0 + s % stride, rows - 1)]), s


@pytest.mark.parametrize("rotate_q, both", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("d, threads", [(32, 32), (64, 128), (128, 128), (128, 96)])
def test_gpu_staging_copies_each_slot_from_its_row(d, threads, rotate_q, both):
    """The GPU build's query staging (``warp._stage_queries``; the simulator runs its own
    build), its Python source run thread by thread with the rotation stubbed out: each slot
    of the halves it copies (the rotated half from ``qr`` without ``rotate_q``, the raw half
    from ``q`` unless ``both`` rotates it too) holds its row's value, rows past the last
    repeating it, and no other slot is written.  The slot's half, row and column come from
    shifts of its index (``d`` a power of two)."""
    from types import SimpleNamespace

    from numba_kv.ops.attention import warp

    calls = []
    cuda_stub = SimpleNamespace(blockDim=SimpleNamespace(x=threads), syncthreads=lambda: None)
    stage = _python(warp._stage_queries, {"cuda": cuda_stub, "warp_stage_rotated": lambda *a: calls.append(a[6:8])})
    rng = np.random.default_rng(d + threads)
    rows, r0, g = 3, 1, 1
    q = rng.standard_normal((2, rows, d)).astype(np.float32)
    qr = rng.standard_normal((2, rows, d)).astype(np.float32)
    qs = np.full(2 * warp.WARP_ROWS * d, np.nan, np.float32)
    for tid in range(threads):
        stage(qs, qr, q, g, r0, rows, d, tid, rotate_q, both, False, None, None)
    n_rot = (2 if both else 1) * warp.WARP_ROWS if rotate_q else 0
    want = np.full_like(qs, np.nan)
    for half, src in enumerate((q if rotate_q else qr, q)):
        for r in range(warp.WARP_ROWS):
            s = half * warp.WARP_ROWS + r
            if s >= n_rot:
                want[s * d:(s + 1) * d] = src[g, min(r0 + r, rows - 1)]
    assert np.array_equal(qs, want, equal_nan=True)
    assert calls == ([(0, n_rot)] * threads if n_rot else [])
