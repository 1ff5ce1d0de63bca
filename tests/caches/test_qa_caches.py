"""Adversarial checks of the layered caches (dense, PQ/PQO, TurboQuant): what the docs promise
at the edges — finite outputs for every accepted input, and a call racing another on the same
layer refused cleanly instead of storing past the buffers."""

import threading
import time

import numpy as np
import pytest

from numba_kv import AttendConfig, DenseCache, make_cache

F16_MAX = 65504.0


def _near_f16_max(tokens: int, d: int) -> np.ndarray:
    """float16 ``[1, 1, tokens, d]`` with two channels at ±65504 (the largest binary16): a
    quantized reconstruction of such a vector overshoots 65504 by a few per cent."""
    x = np.zeros((1, 1, tokens, d), np.float16)
    x[..., 0], x[..., 1] = F16_MAX, -F16_MAX
    return x


@pytest.mark.parametrize("name", ["pqo3-r0-s0", "pqo4-r2-s1", "tq3-r0-s0", "pqo2-eden-r0-s0"])
def test_float16_input_near_its_max_never_returns_inf(name):
    """Accepted float16 input (|x| <= 65504) comes back finite in float16: the chunked
    prefill's history, the dequantized decode's history and the fused output saturate at
    ±65504 where the reconstruction overshoots, they do not overflow to ±inf (they did)."""
    d = 64
    x = _near_f16_max(8, d)
    q = np.zeros((1, 1, 1, d), np.float16)  # equal weights: the output is the values' mean
    cfg = AttendConfig(d ** -0.5)
    for out in ("fused", "dequantized"):
        cache = make_cache(name, num_layers=1, num_kv_heads=1, head_dim=d, decode_output=out)
        cache.prefill(0, x, x.copy())
        hist = cache.prefill(0, x, x.copy())  # chunked: the full dequantized history
        res = cache.decode(0, x[:, :, :1], x[:, :, :1].copy(), q, cfg)
        # (TurboQuant's key history is its (b-1)-bit base, far coarser: checked for finiteness only)
        arrays = [(hist.k, "tq" not in name), (hist.v, True)]
        arrays += [(res.out, True)] if out == "fused" else [(res.result.k, "tq" not in name), (res.result.v, True)]
        for a, close in arrays:
            assert a.dtype == np.float16
            assert np.isfinite(a).all(), f"{name} {out}: a finite float16 input came back as inf"
            if close:  # within a quantization error of the input (channels 0 and 1 hold ±65504)
                assert np.abs(a[..., 0].astype(np.float64) - F16_MAX).max() < 0.05 * F16_MAX
                assert np.abs(a[..., 1].astype(np.float64) + F16_MAX).max() < 0.05 * F16_MAX


class _SpyLock:
    """A layer lock that says when a thread starts waiting for it."""

    def __init__(self) -> None:
        self.inner = threading.Lock()
        self.waiting = threading.Event()

    def __enter__(self) -> "_SpyLock":
        self.waiting.set()
        self.inner.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.inner.release()


@pytest.mark.parametrize("name", ["dense", "pqo3", "pqo3-r0-s0", "tq3-r0-s0", "kv4"])
@pytest.mark.parametrize("op", ["prefill", "decode"])
def test_same_layer_race_with_another_batch_size_is_refused(name, op):
    """Two threads store into one empty layer with different batch sizes.  Each call's
    arguments are checked against the layer before it takes the layer's lock; the call that
    comes second must check the batch again under the lock and raise ``ValueError`` naming
    ``k`` with the layer unchanged.  Before, it stored 2 sequences into 1-sequence buffers
    (NumPy's broadcast error from the middle of a store, or a segmentation fault of the
    compressing kernel without a window)."""
    h, d = 2, 64
    cache = make_cache(name, num_layers=1, num_kv_heads=h, head_dim=d)
    st = cache._layers[0]  # noqa: SLF001 - the race needs a hook inside the lock
    spy = st.lock = _SpyLock()
    rng = np.random.default_rng(0)
    k1 = rng.standard_normal((1, h, 5, d)).astype(np.float32)
    k2 = rng.standard_normal((2, h, 1, d)).astype(np.float32)
    cfg = AttendConfig(d ** -0.5)
    got: dict[str, object] = {}

    def second() -> None:
        try:
            if op == "prefill":
                got["res"] = cache.prefill(0, k2, k2.copy())
            else:
                got["res"] = cache.decode(0, k2, k2.copy(), np.ones((2, h, 1, d), np.float32), cfg)
        except Exception as e:  # noqa: BLE001 - the test inspects what was raised
            got["res"] = e

    spy.inner.acquire()  # the first call is inside its store
    t = threading.Thread(target=second)
    t.start()
    assert spy.waiting.wait(60)
    time.sleep(0.05)  # (the second call has validated and waits for the lock)
    cache._prefill_checked(st, "cpu", k1, k1.copy(), None)  # noqa: SLF001 - the first call's store
    spy.inner.release()
    t.join(60)
    err = got["res"]
    assert isinstance(err, ValueError), f"expected ValueError, got {err!r}"
    assert "k:" in str(err) and "batch" in str(err) and "(2, 2, 1, 64)" in str(err)
    twin = make_cache(name, num_layers=1, num_kv_heads=h, head_dim=d)  # the first call alone
    twin.prefill(0, k1, k1.copy())
    before, after = twin.state_dict(), cache.state_dict()
    assert after.state == before.state and sorted(after.tensors) == sorted(before.tensors)
    for key, t_before in before.tensors.items():
        assert np.array_equal(after.tensors[key].view(np.uint8), t_before.view(np.uint8)), key
    assert cache.seq_len(0) == 5


@pytest.mark.parametrize(("args", "exc", "names"), [
    ((64, 4, 0), ValueError, "num_kv_heads"),  # was ZeroDivisionError
    ((0, 4, 2), ValueError, "head_dim"),  # was ZeroDivisionError
    ((-4, 4, 2), ValueError, "head_dim"),  # was a TypeError about a complex softmax_scale
    ((64, 0, 2), ValueError, "num_heads"),  # was an error naming n_kv_groups
    (("64", 4, 2), TypeError, "head_dim"),  # was str ** float
    ((64, 4.0, 2), TypeError, "num_heads"),
])
def test_attend_config_for_shapes_names_a_bad_argument(args, exc, names):
    with pytest.raises(exc, match=f"^{names}: "):
        AttendConfig.for_shapes(*args)


def test_attend_config_for_shapes_still_builds_the_standard_config():
    cfg = AttendConfig.for_shapes(np.int64(64), 12, 3)
    assert cfg == AttendConfig(0.125, n_kv_groups=4)


def test_dense_dtype_numpy_cannot_parse_is_named():
    """``dtype="bfloat16"`` raised NumPy's "data type 'bfloat16' not understood"."""
    with pytest.raises(TypeError, match="^dtype: expected None, float16, float32 or float64, got 'bfloat16'"):
        make_cache("dense", num_layers=1, num_kv_heads=1, head_dim=32, dtype="bfloat16")
    # a NumPy dtype that is not a float: a TypeError too (it was a ValueError)
    with pytest.raises(TypeError, match="^dtype: expected None, float16, float32 or float64, got int8$"):
        DenseCache(1, 1, 64, dtype=np.int8)


def _small_cache():
    cache = make_cache("pqo3-r2-s1", num_layers=1, num_kv_heads=1, head_dim=32)
    x = np.random.default_rng(0).standard_normal((1, 1, 6, 32)).astype(np.float32)
    cache.prefill(0, x, x[:, :, ::-1].copy())
    return cache


def test_save_and_load_take_a_bytes_path(tmp_path):
    """A bytes path is an ``os.fspath`` path like any other; ``save`` built its temporary file
    name as ``"b'...'.tmp-..."`` from it and failed with safetensors' I/O error."""
    pytest.importorskip("safetensors")
    from numba_kv import load_cache  # noqa: PLC0415 - needs the io extra

    cache = _small_cache()
    path = bytes(tmp_path / "c.safetensors")
    cache.save(path)
    loaded = load_cache(path)
    a, b = cache.state_dict(), loaded.state_dict()
    assert a.state == b.state and all(np.array_equal(a.tensors[k], b.tensors[k]) for k in a.tensors)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.safetensors"]  # no stray temporary file


def test_save_names_a_bad_path(tmp_path):
    pytest.importorskip("safetensors")
    cache = _small_cache()
    with pytest.raises(TypeError, match="^path: expected a str, bytes or os.PathLike, got NoneType"):
        cache.save(None)
    with pytest.raises(FileNotFoundError, match="^path: the directory .* does not exist"):
        cache.save(tmp_path / "missing" / "c.safetensors")  # was a SafetensorError
    with pytest.raises(IsADirectoryError, match="^path: .* is a directory"):
        cache.save(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_loaded_outlier_permutation_must_hold_every_channel_once():
    """A cache file whose outlier-channel order repeats a channel (or names one outside the
    head) is refused at load, as a state the configuration cannot produce; the saved one loads
    and decodes as the original (bit for bit)."""
    from numba_kv.caches.state import CacheFileError, CacheState

    rng = np.random.default_rng(5)
    cache = make_cache("pqo3:outlier_channels=32", num_layers=1, num_kv_heads=2, head_dim=64)
    k = rng.standard_normal((1, 2, 40, 64)).astype(np.float32)
    k[..., 7] *= 30.0  # an outlier channel, so that the order is not the identity
    cache.prefill(0, k, k)
    state = cache.state_dict()
    perm = state.tensors["layers.0.k_perm"]
    assert sorted(perm[0, 0].tolist()) == list(range(64)) and perm[0, 0].tolist() != list(range(64))
    q = rng.standard_normal((1, 2, 1, 64)).astype(np.float32)
    att = AttendConfig(0.125)
    want = cache.decode(0, k[:, :, :1], k[:, :, :1], q, att).out
    got = type(cache).from_state_dict(state).decode(0, k[:, :, :1], k[:, :, :1], q, att).out
    np.testing.assert_array_equal(got, want)
    for bad in (0, 64):  # a repeated channel; a channel outside the head
        tensors = dict(state.tensors)
        p = perm.copy()
        p[1, 0, 3] = p[1, 0, 0] if bad == 0 else bad
        tensors["layers.0.k_perm"] = p
        with pytest.raises(CacheFileError, match=r"layers\.0\.k_perm: every row must be a permutation of 0\.\.63"):
            type(cache).from_state_dict(CacheState(state.config, state.state, tensors))


@pytest.mark.parametrize("name", ["dense", "pqo3", "kv4", "tq3"])
def test_a_state_dict_is_a_snapshot_that_later_steps_leave_alone(name):
    """``state_dict()`` copies the live buffers: decoding on afterwards changes none of its
    tensors (a full window buffer was returned as the cache's own array, so the state changed
    under its counters and a cache rebuilt from it decoded wrongly), and the rebuilt cache
    decodes exactly as the original did at that point."""
    rng = np.random.default_rng(8)
    cache = make_cache(name, num_layers=1, num_kv_heads=2, head_dim=64)
    k = rng.standard_normal((1, 2, 80, 64)).astype(np.float32)  # past sinks + window: buffers full
    cache.prefill(0, k, k)
    twin = cache.fork()
    state = cache.state_dict()
    before = {n: t.copy() for n, t in state.tensors.items()}
    att = AttendConfig(0.125)
    for t in range(3):
        step = k[:, :, t:t + 1] * 2.0
        cache.decode(0, step, step, rng.standard_normal((1, 2, 1, 64)).astype(np.float32), att)
    changed = [n for n in before if not np.array_equal(before[n], state.tensors[n])]
    assert changed == []
    q = rng.standard_normal((1, 2, 1, 64)).astype(np.float32)
    step = k[:, :, :1]
    want = _decoded(twin.decode(0, step, step, q, att))
    got = _decoded(type(cache).from_state_dict(state).decode(0, step, step, q, att))
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def _decoded(res) -> tuple:
    """The arrays of a decode output: the fused output, or the dequantized history."""
    return (res.out,) if hasattr(res, "out") else (res.result.k, res.result.v)


@pytest.mark.parametrize("name, cls", [("pqo3", "PolarQuantCache"), ("tq3", "TurboQuantCache"),
                                       ("kv4", "PolarQuantCache")])
def test_an_unknown_option_is_named_with_the_options_the_cache_takes(name, cls):
    """An unknown option gave the dataclass's ``PolarQuantConfig.__init__() got an unexpected
    keyword argument``: neither the cache nor the options it takes."""
    with pytest.raises(TypeError, match=rf"bogus: not an option of {cls}; expected one of \[.*'residual_length'"):
        make_cache(name, num_layers=1, num_kv_heads=1, head_dim=64, bogus=1)
