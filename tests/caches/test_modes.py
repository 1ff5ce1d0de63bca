"""PolarQuantCache modes: channel splits (pqo2.5 / pqo3.5), whole-head rotation, the
unbiased (EDEN-style) rescale — bits, outlier-channel selection, fused == dequantized."""

import numpy as np
import pytest

from numba_kv import AttendConfig, PolarQuantCache, make_cache, reference

H, D = 2, 128


def kv(rng, s, d=D):
    k = rng.standard_normal((1, H, s, d)).astype(np.float32)
    v = rng.standard_normal((1, H, s, d)).astype(np.float32)
    return k, v


@pytest.mark.parametrize("name, k_bpv, v_bpv", [
    ("pqo2.5", 3.0, 3.0), ("pqo3.5", 4.0, 4.0), ("pqo3-head", 3.125, 3.125), ("pqo2-head", 2.125, 2.125),
    ("pqo3-eden", 3.5, 3.5), ("pqo-k4v3-head", 4.125, 3.125),
])
def test_bits_per_value_exact(name, k_bpv, v_bpv):
    c = make_cache(name, num_layers=1, num_kv_heads=1, head_dim=D)
    assert (c.k_bits_per_value, c.v_bits_per_value) == (k_bpv, v_bpv)


def test_paper_split_arithmetic():
    # TurboQuant §4.3's example split, 32 channels at 3 bits + 96 at 2 bits, is 2.25 index bits
    c = PolarQuantCache(1, 1, 128, bits=2, outlier_channels=32, outlier_bits=3)
    assert c.k_bits_per_value == (32 * 3 + 96 * 2) / 128 + 0.5
    assert c.layouts["k"].bits.tolist() == [3, 2, 2, 2] and c.layouts["k"].width == 4 * 9


def test_outlier_channels_follow_first_prefill_rms_and_are_frozen(rng):
    c = make_cache("pqo2.5", num_layers=2, num_kv_heads=H, head_dim=D, residual_length=0, sink_tokens=0)
    k, v = kv(rng, 40)
    hot = {0: np.arange(0, 128, 2), 1: np.arange(64, 128)}  # per KV head: the loud channels
    for h, ch in hot.items():
        k[0, h, :, ch] *= 10.0
    c.prefill(1, k, v)
    perm = c._layers[1].buffers["k_perm"][:, 0, :].astype(int)
    for h, ch in hot.items():
        assert sorted(perm[h, :64]) == sorted(ch.tolist())  # outlier half first
        assert sorted(perm[h]) == list(range(D))
    k2, v2 = kv(rng, 10)
    k2[..., :64] *= 50.0  # different statistics later: the choice stays frozen
    c.prefill(1, k2, v2)
    assert np.array_equal(c._layers[1].buffers["k_perm"][:, 0, :], perm)
    assert c._layers[0].buffers == {}  # per layer: layer 0 untouched


def test_split_helps_outlier_channels_and_history_is_in_original_order(rng):
    k, v = kv(rng, 300)
    k[..., 7] += 8.0
    k[..., 90] *= 6.0
    errs = {}
    for name in ("pqo2", "pqo2.5", "pqo3"):
        c = make_cache(name, num_layers=1, num_kv_heads=H, head_dim=D, residual_length=0, sink_tokens=0)
        c.prefill(0, k[:, :, :1], v[:, :, :1])
        r = c.prefill(0, k[:, :, 1:], v[:, :, 1:])
        errs[name] = np.sum((r.k - k) ** 2) / np.sum(k ** 2)
    assert errs["pqo3"] < errs["pqo2.5"] < errs["pqo2"]
    assert errs["pqo2.5"] < 0.06  # a mis-ordered history would be O(1)


@pytest.mark.parametrize("name", ["pqo2.5", "pqo3.5", "pqo3-head", "pqo3-eden", "pqo3-head-eden", "pqo-k4v2-eden",
                                  "pq3-l2-eden"])
@pytest.mark.parametrize("window", [False, True])
def test_fused_equals_dequantized(name, window, rng):
    opts = dict(residual_length=8, sink_tokens=2) if window else dict(residual_length=0, sink_tokens=0)
    fused = make_cache(name, num_layers=1, num_kv_heads=H, head_dim=D, key_center=True, **opts)
    deq = make_cache(name, num_layers=1, num_kv_heads=H, head_dim=D, key_center=True, decode_output="dequantized",
                     **opts)
    k, v = kv(rng, 100)
    k[..., 3] += 5.0
    for c in (fused, deq):
        c.prefill(0, k, v)
    cfg = AttendConfig(0.1, 2)
    k1, v1 = kv(rng, 1)
    q = rng.standard_normal((1, 2 * H, 1, D)).astype(np.float32)
    out = fused.decode(0, k1, v1, q, cfg).out
    r = deq.decode(0, k1, v1, q, cfg).result
    np.testing.assert_allclose(out, reference.attention(q, r.k, r.v, 0.1), rtol=2e-5, atol=2e-6)


def _slope(name, rng, n=4000):
    c = make_cache(name, num_layers=1, num_kv_heads=1, head_dim=D, residual_length=0, sink_tokens=0)
    x = rng.standard_normal((1, 1, n, D)).astype(np.float32)
    x /= np.linalg.norm(x, axis=-1, keepdims=True)
    c.prefill(0, x[:, :, :1], x[:, :, :1])
    xh = c.prefill(0, x[:, :, 1:], x[:, :, 1:]).k[0, 0, 1:].astype(np.float64)
    x = x[0, 0, 1:].astype(np.float64)
    y = rng.standard_normal((n - 1, D))
    y /= np.linalg.norm(y, axis=-1, keepdims=True)
    est, true = np.sum(y * xh, 1), np.sum(y * x, 1)
    return (est * true).sum() / (true * true).sum(), np.mean(np.sum((xh - x) ** 2, 1))


@pytest.mark.parametrize("base", ["pqo2-l2", "pqo2", "pqo2-head", "pqo3-l2"])
def test_eden_rescale_makes_the_inner_product_unbiased(base, rng):
    plain, mse_plain = _slope(base, rng)
    eden, mse_eden = _slope(base + "-eden", rng)
    assert abs(eden - 1) < 0.02 and abs(eden - 1) < abs(plain - 1)
    assert mse_eden < 1.2 * mse_plain
    if base in ("pqo2-l2", "pqo2-head"):
        assert plain < 0.93  # the MSE-optimal scale shrinks inner products (§3.4: 0.892)


@pytest.mark.parametrize("kwargs, word", [
    (dict(outlier_channels=48), "outlier_channels"), (dict(outlier_channels=128), "outlier_channels"),
    (dict(outlier_channels=-32), "outlier_channels"), (dict(outlier_channels=32, outlier_bits=3), "outlier_bits"),
    (dict(outlier_channels=32, k_bits=4), "outlier_bits"), (dict(outlier_bits=4), "outlier_bits"),
    (dict(outlier_channels=32, rotation="head"), "outlier_channels"), (dict(rotation="full"), "rotation"),
    (dict(rotation="head", norm_mode="maxnorm"), "norm_mode"), (dict(unbiased="yes"), "unbiased"),
])
def test_bad_configs(kwargs, word):
    with pytest.raises((ValueError, TypeError), match=word):
        PolarQuantCache(1, 1, 128, bits=3, **kwargs)


def test_head_rotation_needs_a_power_of_two():
    with pytest.raises(ValueError, match="head_dim"):
        PolarQuantCache(1, 1, 96, rotation="head")
    with pytest.raises(ValueError, match="head_dim"):
        make_cache("pqo2.5", num_layers=1, num_kv_heads=1, head_dim=96)


def test_int8_window_is_within_half_a_step_and_counts_its_bytes(rng):
    c = make_cache("pqo3", num_layers=1, num_kv_heads=H, head_dim=D, residual_length=6, sink_tokens=2,
                   window_dtype="int8", window_rotation=False, decode_output="dequantized")
    k, v = kv(rng, 30)
    c.prefill(0, k, v)
    k1, v1 = kv(rng, 1)
    r = c.decode(0, k1, v1, rng.standard_normal((1, 2 * H, 1, D)).astype(np.float32), AttendConfig(0.1, 2)).result
    kk = np.concatenate([k, k1], 2)  # unrotated: half a step of the vector's own absmax
    exact = np.r_[0:2, 25:31]  # 2 sinks + the newest 6
    step = np.abs(kk[:, :, exact]).max(-1, keepdims=True) / 127
    assert np.all(np.abs(r.k[:, :, exact] - kk[:, :, exact]) <= 0.5 * step * (1 + 2 ** -10) + 1e-7)
    n_comp = 31 - 8
    per_comp = 2 * (D * 3 // 8 + 2 * (D // 32))
    assert c.memory_usage() == H * (n_comp * per_comp + 8 * 2 * (D + 2))
    assert c.memory_usage() == sum(a.nbytes for a in c.live_arrays(0))


@pytest.mark.parametrize("name", ["pqo3", "pqo-k4v3-head-eden"])
def test_rotated_int8_window_holds_the_largest_admitted_vectors(name, rng):
    """The largest inputs a cache admits (doubled until refused) sit in a rotated int8 window
    finite and within int8 accuracy: the rotated absmax scale (at most the vector norm over
    127) stays far inside binary16 wherever the compressed store's own scales do."""
    opts = dict(num_layers=1, num_kv_heads=H, head_dim=D, residual_length=8, sink_tokens=0, window_dtype="int8")
    x = rng.standard_normal((1, H, 2, D)).astype(np.float32)
    x[..., 7] += 30.0  # one large channel: the rotation moves it into every entry
    x /= np.linalg.norm(x, axis=-1, keepdims=True).max()
    scale, refused = 1.0, False
    while not refused:
        c = make_cache(name, decode_output="dequantized", **opts)
        try:
            c.prefill(0, x * np.float32(2 * scale), x * np.float32(2 * scale))
            scale *= 2
        except ValueError:
            refused = True
            assert c.seq_len(0) == 0
    assert scale >= 2.0 ** 14  # admitted norms reach 16,384 and more
    c = make_cache(name, decode_output="dequantized", **opts)
    xs = x * np.float32(scale)
    c.prefill(0, xs, xs)
    got = c.prefill(0, xs[:, :, :1] * 0, xs[:, :, :1] * 0).k[:, :, :2]  # the two, read from the window
    assert np.isfinite(got).all()
    assert np.linalg.norm(got - xs) <= 0.01 * np.linalg.norm(xs)


@pytest.mark.parametrize("dtype, rotate", [("int8", True), ("int8", False), ("float16", True)])
@pytest.mark.parametrize("name", ["pqo3", "tq3", "pqo2.5", "pqo-k4v3-head-eden"])
def test_window_fused_equals_dequantized(name, dtype, rotate, rng):
    """The fused kernel reads the int8 (rotated or not) and binary16 windows in place; the
    dequantized path decodes them with NumPy: the same attention."""
    opts = dict(residual_length=5, sink_tokens=2, window_dtype=dtype, window_rotation=rotate)
    fused = make_cache(name, num_layers=1, num_kv_heads=H, head_dim=D, **opts)
    deq = make_cache(name, num_layers=1, num_kv_heads=H, head_dim=D, decode_output="dequantized", **opts)
    k, v = kv(rng, 12)
    for c in (fused, deq):
        c.prefill(0, k, v)
    cfg = AttendConfig(0.1, 2)
    for _ in range(8):  # tokens slide through the int8 window into the codes
        k1, v1 = kv(rng, 1)
        q = rng.standard_normal((1, 2 * H, 1, D)).astype(np.float32)
        out = fused.decode(0, k1, v1, q, cfg).out
        r = deq.decode(0, k1, v1, q, cfg).result
        ref = reference.attention(q, r.k, r.v, 0.1, r.logit_bias)
        np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-6)
