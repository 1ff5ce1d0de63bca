"""Fused attention kernels with the QJL correction, the whole-head rotation, the head VQ code
and mixed per-block widths (channel splits): CUDA (simulator or GPU) vs the CPU twin.

These caches need NumPy/CuPy arrays, so the codes are built on the host and the kernel
entry point :func:`fused_attention_rows` is called on host and on device copies."""

import numpy as np
import pytest

from numba_kv._backend import to_host
from numba_kv.caches.spec import make_cache
from numba_kv.ops.attention import fused_attention_rows

from ..conftest import runner_params, to_device


def _fused_modes(rng):
    int8 = {"window_dtype": "int8"}  # a rotated int8 window: attended in the rotated domain
    for name, opts in (("tq3", {}), ("pqo2.5", {}), ("pqo3-head", {}), ("tq2-head-eden", {}), ("pqo3", int8),
                       ("pqo-k4v3-head-eden", int8), ("pqo-k5v5-head-eden", int8),
                       ("pqo-k4v2-head-eden-vq", int8), ("pqo-k4v3-head-vq", {})):
        c = make_cache(name, num_layers=1, num_kv_heads=2, head_dim=64, residual_length=3, sink_tokens=1, **opts)
        k = rng.standard_normal((1, 2, 21, 64)).astype(np.float32)
        v = rng.standard_normal((1, 2, 21, 64)).astype(np.float32)
        c.prefill(0, k, v)
        st = c._layers[0]
        q3 = rng.standard_normal((2, 4, 64)).astype(np.float32)
        qr = c._rotate_queries(q3)
        rot = c._window.stored_rotated(st)
        assert rot == bool(opts)
        ke, n_exact = c._exact_f32(st, "k", rot)
        ve, _ = c._exact_f32(st, "v", rot)
        qx = qr if rot else q3
        pos = c._exact_positions(st, q3)
        qjl = c._qjl_args(st, q3)
        hs = c._head_signs
        bufs = [st.buffers[n] for n in ("k_codes", "k_scales", "v_codes", "v_scales")]
        n_comp = st.meta["n_comp"]
        bias = rng.standard_normal((2, 4, st.seq_len)).astype(np.float32)

        def run(f, qjl_dev, qx=qx, ke=ke, ve=ve, rot=rot):  # the loop variables of this iteration
            return fused_attention_rows(f(qr), f(qx), *(f(b) for b in bufs), n_comp, 1, f(ke), f(ve),  # noqa: B023
                                        n_exact, f(pos), c.layouts["k"], c.layouts["v"], 0.125,  # noqa: B023
                                        f(bias), st.seq_len - 2, 2, True, part_size=8,  # noqa: B023
                                        head_signs=None if hs is None else f(hs), qjl=qjl_dev,  # noqa: B023
                                        exact_rotated=rot)

        cpu = run(lambda a: a, qjl)
        dev = run(to_device, None if qjl is None else tuple(to_device(a) for a in qjl[:3]) + (qjl[3],))
        np.testing.assert_allclose(to_host(dev), cpu, rtol=2e-5, atol=2e-6, err_msg=name)
        if rot:  # the same window rotated back and attended with the raw query: the same output
            ke_u, _ = c._exact_f32(st, "k")
            ve_u, _ = c._exact_f32(st, "v")
            plain = run(lambda a: a, qjl, q3, ke_u, ve_u, False)
            np.testing.assert_allclose(cpu, plain, rtol=1e-4, atol=1e-5, err_msg=name)


def _public_modes(rng):
    """The public op with the whole-head rotation and the QJL correction, on device arrays."""
    from numba_kv import decode_attention, qjl_quantize, quantize_head
    from numba_kv.ops.headquant import dequantize_head

    k = rng.standard_normal((1, 2, 19, 64)).astype(np.float32)
    v = rng.standard_normal((1, 2, 19, 64)).astype(np.float32)
    q = rng.standard_normal((1, 4, 1, 64)).astype(np.float32)
    kc, kn = quantize_head(k, 2)
    vc, vn = quantize_head(v, 3)
    signs, norms = qjl_quantize(k - dequantize_head(kc, kn, 2))
    kw = dict(k_bits=2, v_bits=3, rotation="head", partition_size=8)
    cpu = decode_attention(q, kc, kn, vc, vn, k_qjl=(signs, norms, None), **kw)
    dev = decode_attention(*(to_device(a) for a in (q, kc, kn, vc, vn)),
                           k_qjl=(to_device(signs), to_device(norms), None), **kw)
    np.testing.assert_allclose(to_host(dev), cpu, rtol=2e-5, atol=2e-6)


def _vq_without_bias(rng):
    """A head VQ cache's fused step on device arrays without a logit bias: the plan picks the
    warp kernel's build that decodes the head VQ code (before: the block kernel), which
    matches the CPU twin (the tensor-core builds off: at head_dim 64 their VQ build would run,
    tests/cuda/test_sim_mma_dims.py)."""
    from numba_kv import AttendConfig, knobs
    from numba_kv.ops.attention.kernels import DECODE_ATTENTION_WARP_VQ

    opts = dict(num_layers=1, num_kv_heads=2, head_dim=64, residual_length=2, sink_tokens=1, window_dtype="float32")
    host = make_cache("pqo-k4v2-head-eden-vq", **opts)
    dev = make_cache("pqo-k4v2-head-eden-vq", **opts)
    k = rng.standard_normal((1, 2, 18, 64)).astype(np.float32)
    v = rng.standard_normal((1, 2, 18, 64)).astype(np.float32)
    host.prefill(0, k, v)
    dev.prefill(0, to_device(k), to_device(v))
    cfg = AttendConfig(0.125, 2)
    k1 = rng.standard_normal((1, 2, 1, 64)).astype(np.float32)
    v1 = rng.standard_normal((1, 2, 1, 64)).astype(np.float32)
    q = rng.standard_normal((1, 4, 1, 64)).astype(np.float32)
    want = host.decode(0, k1, v1, q, cfg).out
    with knobs(cuda_mma_attention=0):
        got = dev.decode(0, to_device(k1), to_device(v1), to_device(q), cfg).out
    plan = dev._layers[0].scratch["fused_step"].step.plan
    assert plan.variant == "warp" and plan.kernel is DECODE_ATTENTION_WARP_VQ
    np.testing.assert_allclose(to_host(got), want, rtol=2e-5, atol=2e-6)


def _all_modes(rng):
    _fused_modes(rng)
    _public_modes(rng)
    _vq_without_bias(rng)


RUNNERS = {"decode_attention": _all_modes, "merge_partitions": _all_modes}


@pytest.mark.cuda
@pytest.mark.parametrize("runner", runner_params(RUNNERS))
def test_cuda_kernel_matches_cpu_twin(runner):
    runner(np.random.default_rng(11))
