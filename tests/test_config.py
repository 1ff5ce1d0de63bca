"""Knobs (``numba_kv._config``): bad values raise at ``set`` or when the environment
variable is read, naming the knob and the allowed range."""

import pytest

import numba_kv
from numba_kv import _config


@pytest.fixture(autouse=True)
def _restore():
    yield
    _config.reset()


def test_every_knob_has_a_range_and_its_default_is_in_it():
    assert set(_config.RANGES) == set(_config.DEFAULTS)
    for name, value in _config.DEFAULTS.items():
        assert _config._checked(name, value, name) == value


def test_set_and_get():
    _config.set("cuda_threads", 64)
    assert _config.get("cuda_threads") == 64
    _config.set("cuda_threads", "256")
    assert _config.get("cuda_threads") == 256
    _config.reset()
    assert _config.get("cuda_threads") == 128


@pytest.mark.parametrize("value, message", [
    (0, r"cuda_threads: expected 32 <= value <= 256 in steps of 32, got 0"),
    (48, r"in steps of 32, got 48"),
    (512, r"got 512"),
    (64.5, r"cuda_threads: expected int, got 64.5"),
    (True, r"expected int, got True"),
    ("many", r"expected int, got 'many'"),
])
def test_cuda_threads_rejects(value, message):
    with pytest.raises(ValueError, match=message):
        _config.set("cuda_threads", value)
    assert _config.get("cuda_threads") == 128


def test_other_knobs_reject_out_of_range():
    with pytest.raises(ValueError, match="growth_fraction: expected 0.0 <= value <= 16.0"):
        _config.set("growth_fraction", -0.5)
    with pytest.raises(ValueError, match="cuda_threads_sim: expected 1 <= value <= 256, got 0"):
        _config.set("cuda_threads_sim", 0)
    with pytest.raises(ValueError, match="cpu_parallel_min_work: expected int"):
        _config.set("cpu_parallel_min_work", 1.5)
    with pytest.raises(KeyError, match="unknown numba_kv config knob 'threads'"):
        _config.set("threads", 1)


def test_environment_variable_is_checked(monkeypatch):
    monkeypatch.setenv("NUMBA_KV_CUDA_THREADS", "96")
    assert _config.get("cuda_threads") == 96
    monkeypatch.setenv("NUMBA_KV_CUDA_THREADS", "1000")
    with pytest.raises(ValueError, match=r"NUMBA_KV_CUDA_THREADS: expected 32 <= value <= 256 in steps of 32"):
        _config.get("cuda_threads")
    monkeypatch.setenv("NUMBA_KV_GROWTH_FRACTION", "0.5")
    assert _config.get("growth_fraction") == 0.5


def test_knobs_context_manager():
    with numba_kv.knobs(cuda_threads=64, growth_fraction=0.5):
        assert (_config.get("cuda_threads"), _config.get("growth_fraction")) == (64, 0.5)
        with pytest.raises(ValueError, match="cuda_threads: expected 32 <= value <= 256"):
            with numba_kv.knobs(cuda_threads=1000):
                pass
        assert _config.get("cuda_threads") == 64  # a rejected override changes nothing
    assert _config.get("cuda_threads") == 128
    with pytest.raises(RuntimeError):
        with numba_kv.knobs(cuda_threads=96):
            raise RuntimeError
    assert _config.get("cuda_threads") == 128  # restored after an error too


def test_environment_is_read_live_on_every_get(monkeypatch):
    """``get`` caches the checked value per raw string, never the variable itself: a change
    at run time, a removal and a bad value after a good one all show at once."""
    monkeypatch.setenv("NUMBA_KV_CPU_PARALLEL_MIN_WORK", "1000")
    assert _config.get("cpu_parallel_min_work") == 1000
    assert _config.get("cpu_parallel_min_work") == 1000  # the cached parse
    monkeypatch.setenv("NUMBA_KV_CPU_PARALLEL_MIN_WORK", "0")
    assert _config.get("cpu_parallel_min_work") == 0
    monkeypatch.setenv("NUMBA_KV_CPU_PARALLEL_MIN_WORK", "-1")
    for _ in range(2):  # a bad value raises on every read
        with pytest.raises(ValueError, match="NUMBA_KV_CPU_PARALLEL_MIN_WORK: expected 0 <= value"):
            _config.get("cpu_parallel_min_work")
    monkeypatch.delenv("NUMBA_KV_CPU_PARALLEL_MIN_WORK")
    assert _config.get("cpu_parallel_min_work") == _config.DEFAULTS["cpu_parallel_min_work"]
    _config.set("cpu_parallel_min_work", 7)  # an override wins over the environment
    monkeypatch.setenv("NUMBA_KV_CPU_PARALLEL_MIN_WORK", "5")
    assert _config.get("cpu_parallel_min_work") == 7


def test_environment_read_through_a_replaced_mapping(monkeypatch):
    """An ``os.environ`` replaced by a plain mapping (no raw dict behind it) is read through
    its ``get``."""
    import os

    monkeypatch.setattr(os, "environ", {"NUMBA_KV_GROWTH_MIN_EXTRA": "64"})
    assert _config.get("growth_min_extra") == 64


def test_state_key_changes_with_every_override_and_variable(monkeypatch):
    """``state_key`` is what a step that skips its Python compares (numba_kv.DecodeStep): any
    change of a knob's value must change it."""
    monkeypatch.delenv("NUMBA_KV_CUDA_WARP_ATTENTION", raising=False)
    seen = [_config.state_key()]
    assert _config.state_key() == seen[0]  # nothing changed: the same key
    _config.set("cuda_warp_attention", 0)
    seen.append(_config.state_key())
    with _config.knobs(cuda_mma_attention=0):
        seen.append(_config.state_key())
    seen.append(_config.state_key())  # the override of the block is gone again
    _config.reset()
    seen.append(_config.state_key())
    monkeypatch.setenv("NUMBA_KV_CUDA_WARP_ATTENTION", "0")
    seen.append(_config.state_key())
    monkeypatch.setenv("NUMBA_KV_CUDA_WARP_ATTENTION", "1")
    seen.append(_config.state_key())
    assert len(set(seen)) == len(seen), seen


def test_knobs_blocks_of_two_threads_closing_out_of_order():
    """Thread A opens ``knobs(x=1)``, B opens ``knobs(x=2)``, A closes, then B: A's exit took
    B's override away while B was still inside, and B's exit put A's value back for good."""
    import threading

    name, default = "cpu_parallel_min_work", _config.DEFAULTS["cpu_parallel_min_work"]
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def a():
        with numba_kv.knobs(**{name: 1}):
            a_in.set()
            b_in.wait(10)
            seen["a, b open"] = _config.get(name)
        a_out.set()

    def b():
        a_in.wait(10)
        with numba_kv.knobs(**{name: 2}):
            b_in.set()
            a_out.wait(10)
            seen["b after a closed"] = _config.get(name)

    threads = [threading.Thread(target=f) for f in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert seen == {"a, b open": 2, "b after a closed": 2}
    assert _config.get(name) == default and name not in _config._overrides
    # nested in one thread, and around an override made with set(): as before
    _config.set(name, 7)
    try:
        with numba_kv.knobs(**{name: 1}):
            with numba_kv.knobs(**{name: 2}):
                assert _config.get(name) == 2
            assert _config.get(name) == 1
        assert _config.get(name) == 7
    finally:
        _config.reset()


def test_knobs_name_the_knob_and_refuse_bools_and_strings():
    """``knobs(foo=1)`` named an argument ``name`` that ``knobs`` does not have; a bool or a
    string (``"64"``, converted before) is a ``TypeError`` naming the knob; nothing changes."""
    before = _config.get("cuda_threads")
    with pytest.raises(KeyError, match="^.foo: unknown numba_kv config knob"):
        with _config.knobs(foo=1):
            pass
    for bad, shown in ((True, "bool True"), ("64", "str '64'")):
        with pytest.raises(TypeError, match=f"^cuda_threads: expected int, got {shown}$"):
            with _config.knobs(cuda_threads=bad):
                pass
    assert _config.get("cuda_threads") == before
