"""A window that grows with the history (``residual_fraction``) on the device: decode steps
that grow the exact buffers (device copies of the live tokens) and store through the one-launch
window store agree with the CPU cache."""

import numpy as np
import pytest

from numba_kv._backend import to_host

from ..conftest import to_device

# (device vs CPU twin at float32 round-off: the float32 kernels; the tensor-core ones: test_sim_mma*.py)
pytestmark = pytest.mark.usefixtures("float32_attention")


@pytest.mark.cuda
@pytest.mark.parametrize("opts", [{"bits": 3}, {"k_bits": 4, "v_bits": 3, "rotation": "head", "unbiased": True}],
                         ids=["pqo3", "pqo-k4v3-head-eden"])
def test_growing_window_on_device_matches_cpu(opts):
    from numba_kv import AttendConfig, PolarQuantCache

    rng = np.random.default_rng(2)
    # R(t) = max(4, floor(t/4)): 4 up to 19 tokens, then one more every 4 tokens (7 at 28)
    caches = [PolarQuantCache(1, 2, 64, residual_length=4, sink_tokens=2, residual_fraction=0.25,
                              window_dtype="float32", **opts) for _ in range(2)]  # Numba device arrays: float32
    cfg = AttendConfig(0.125, 2)
    for n in (18, 1, 2, 1, 1, 1, 3, 1):
        k = rng.standard_normal((1, 2, n, 64)).astype(np.float32)
        v = rng.standard_normal((1, 2, n, 64)).astype(np.float32)
        q = rng.standard_normal((1, 4, n, 64)).astype(np.float32)
        if n == 18:
            caches[0].prefill(0, k, v)
            caches[1].prefill(0, to_device(k), to_device(v))
            continue
        a = caches[0].decode(0, k, v, q, cfg).out
        b = caches[1].decode(0, to_device(k), to_device(v), to_device(q), cfg).out
        np.testing.assert_allclose(to_host(b), a, rtol=1e-4, atol=1e-5)
        assert caches[0]._layers[0].meta == caches[1]._layers[0].meta
    assert caches[1].seq_len(0) == 28 and caches[1]._layers[0].meta["n_win"] == 7
    assert caches[1]._layers[0].buffers["k_exact"].shape[1] == 2 + 5 + 128  # grown once, on the device
    assert caches[0].memory_usage() == caches[1].memory_usage()


@pytest.mark.cuda
def test_kv3_configuration_on_device_matches_cpu():
    """``kv3``'s combination — head VQ codes, 8-bit norms, a window that grows — on the
    device: each decode step's output and the layer counters (grid base included) agree with the
    CPU cache while the window grows past its first size."""
    from numba_kv import AttendConfig, make_cache

    rng = np.random.default_rng(5)
    # the preset's key centering and rotated int8 window too (on Numba device arrays: the key
    # mean, the centering and the int8 store by kernels), its window sized down to grow here
    geo = dict(num_layers=1, num_kv_heads=2, head_dim=64, residual_length=4, sink_tokens=2, residual_fraction=0.25)
    caches = [make_cache("kv3", **geo) for _ in range(2)]
    assert caches[0].config.key_center and caches[0].window_dtype == np.int8
    cfg = AttendConfig(0.125, 2)
    for n in (18, 1, 2, 1, 1, 3):
        k = rng.standard_normal((1, 2, n, 64)).astype(np.float32)
        v = rng.standard_normal((1, 2, n, 64)).astype(np.float32)
        q = rng.standard_normal((1, 4, n, 64)).astype(np.float32)
        if n == 18:
            caches[0].prefill(0, k, v)
            caches[1].prefill(0, to_device(k), to_device(v))
            continue
        a = caches[0].decode(0, k, v, q, cfg).out
        b = caches[1].decode(0, to_device(k), to_device(v), to_device(q), cfg).out
        np.testing.assert_allclose(to_host(b), a, rtol=1e-4, atol=1e-5)
        assert caches[0]._layers[0].meta == caches[1]._layers[0].meta
    assert caches[1]._layers[0].meta["n_win"] == 6 and "norm8_base" in caches[1]._layers[0].meta
    host, dev = caches[0]._layers[0].buffers, caches[1]._layers[0].buffers
    assert dev["k_exact"].dtype == np.int8 and dev.keys() == host.keys()
    for key in ("k_chmean", "k_exact", "k_exact_scale", "v_exact", "v_exact_scale", "k_codes", "v_codes"):
        n = None if key == "k_chmean" else 2 + 6 if "exact" in key else caches[0]._layers[0].meta["n_comp"]
        np.testing.assert_array_equal(to_host(dev[key])[:, :n], host[key][:, :n], err_msg=key)
