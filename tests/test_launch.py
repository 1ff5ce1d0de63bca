"""Prepared CUDA launches (``numba_kv/_launch.py``): which launches repeat from converted
parameters and which go through Numba.

Numba's dispatcher is replaced by a stand-in with the same protocol (``dispatcher[grid,
block]`` gives a configuration with ``pre_launch_callbacks``, ``stream``, ``griddim``,
``blockdim``, ``sharedmem``; calling it launches and hands the compiled kernel to the
callbacks; the kernel converts arguments with ``_prepare_args``), and ``cuda.core``'s launch
by a recorder, so these run without a GPU.  The real thing: ``tests/gpu/test_device_launch.py``
(a GPU) and the simulator stage, where every launch goes through Numba.
"""

from __future__ import annotations

import ctypes
import gc
import threading
import weakref

import numpy as np
import pytest

import numba_kv
from numba_kv import _backend, _launch, knobs


class FakeArray:
    """A device array: a pointer, a shape (settable in place, as CuPy's), weakly referable."""

    def __init__(self, ptr: int, shape: tuple) -> None:
        self.ptr = ptr
        self.shape = shape


class Slotted:
    """An argument that cannot be weakly referenced."""

    __slots__ = ("ptr", "shape")

    def __init__(self) -> None:
        self.ptr, self.shape = 7, (1,)


class FakeKernel:
    debug = False
    cooperative = False

    def __init__(self, n_args: int, write_back: bool = False, fail: bool = False) -> None:
        self.argument_types = ("arg",) * n_args
        self.write_back = write_back
        self.fail = fail
        self._codelibrary = self
        self.kernel = object()

    def get_cufunc(self):
        return self

    def _prepare_args(self, ty, val, stream, retr, params):
        if self.fail:
            raise AttributeError("a changed internal API")
        if self.write_back:
            retr.append(lambda: None)
        if isinstance(val, (FakeArray, Slotted)):
            params.extend([val.ptr, *val.shape])
        else:
            params.append(val)


class FakeConfig:
    def __init__(self, dispatcher, grid, block, stream="default stream") -> None:
        self.dispatcher = dispatcher
        self.pre_launch_callbacks = []
        self.stream = stream
        self.griddim, self.blockdim, self.sharedmem = grid, block, 0

    def __call__(self, *args):
        d = self.dispatcher
        d.numba.append(args)
        d.streams.append(self.stream)
        for cb in self.pre_launch_callbacks:
            cb(d.kernel, self)


class FakeDispatcher:
    def __init__(self, n_args: int, **kernel) -> None:
        self.kernel = FakeKernel(n_args, **kernel)
        self.numba: list = []
        self.streams: list = []
        self.stream: object = "default stream"  # what its launch configurations hold

    def __getitem__(self, gb):
        return FakeConfig(self, *gb) if len(gb) == 3 else FakeConfig(self, *gb, stream=self.stream)


class LaunchConfig:
    def __init__(self, **kw) -> None:
        self.kw = kw


@pytest.fixture()
def core(monkeypatch):
    """``cuda.core``'s launch replaced by a recorder; a clean cache; not the simulator."""
    calls: list = []
    lock = threading.Lock()

    def core_launch(stream, config, kernel, *params):
        with lock:
            calls.append((stream, config, kernel, params))

    monkeypatch.setattr(_launch, "_core", lambda: (core_launch, LaunchConfig, True))
    monkeypatch.setattr(_backend, "simulator_enabled", lambda: False)
    _launch.clear()
    yield calls
    _launch.clear()


def test_a_repeat_launches_the_parameters_numba_converted_once(core):
    d = FakeDispatcher(3)
    a, b = FakeArray(1000, (4, 8)), FakeArray(2000, (16,))
    _launch.launch(d, 5, 128, (a, b, np.int64(9)))
    assert len(d.numba) == 1 and core == []
    for _ in range(3):
        _launch.launch(d, 5, 128, (a, b, np.int64(9)))
    assert len(d.numba) == 1 and len(core) == 3
    stream, config, kernel, params = core[-1]
    assert stream == "default stream" and kernel is d.kernel.kernel
    assert params == (1000, 4, 8, 2000, 16, np.int64(9))
    assert config.kw == {"grid": 5, "block": 128, "shmem_size": 0, "is_cooperative": False}


@pytest.mark.parametrize("change", ["scalar value", "scalar type", "other array", "shape in place", "grid",
                                    "other kernel"])
def test_anything_that_changes_the_parameters_goes_through_numba(core, change):
    d = FakeDispatcher(2)
    a = FakeArray(1000, (4, 8))
    _launch.launch(d, 5, 128, (a, 3))
    args, grid, disp = (a, 3), 5, d
    if change == "scalar value":
        args = (a, 4)
    elif change == "scalar type":
        args = (a, 3.0)  # 3 == 3.0, but another kernel signature
    elif change == "other array":
        args = (FakeArray(1000, (4, 8)), 3)
    elif change == "shape in place":
        a.shape = (8, 4)
    elif change == "grid":
        grid = 6
    else:
        disp = FakeDispatcher(2)
    _launch.launch(disp, grid, 128, args)
    assert core == []
    assert len(d.numba) + (len(disp.numba) if disp is not d else 0) == 2


def test_a_freed_array_never_matches_again():
    """An entry holds its arrays weakly: once one is freed, no argument (whatever its id) is it."""
    a = FakeArray(1000, (4,))
    entry = _launch._Entry((weakref.ref(a), None), None, None, None, ())
    assert entry.holds((a, 1))
    del a
    gc.collect()
    assert not entry.holds((FakeArray(1000, (4,)), 1))


@pytest.mark.parametrize("case", ["knob off", "simulator", "not weakly referable", "written back", "internal API"])
def test_launches_stay_with_numba_when_a_repeat_is_not_safe(core, monkeypatch, case):
    kernel = {"write_back": case == "written back", "fail": case == "internal API"}
    d = FakeDispatcher(1, **kernel)
    arg = Slotted() if case == "not weakly referable" else FakeArray(5, (2,))
    if case == "simulator":
        monkeypatch.setattr(_backend, "simulator_enabled", lambda: True)
    with knobs(cuda_prepared_launch=0 if case == "knob off" else 1):
        for _ in range(3):
            _launch.launch(d, 1, 32, (arg,))
    assert len(d.numba) == 3 and core == []
    assert _launch.stats()["entries"] == 0


def test_the_oldest_entries_go_first(core, monkeypatch):
    monkeypatch.setattr(_launch, "MAX_ENTRIES", 3)
    d = FakeDispatcher(1)
    arrays = [FakeArray(i, (1,)) for i in range(4)]
    for a in arrays:
        _launch.launch(d, 1, 32, (a,))
    assert _launch.stats()["entries"] == 3
    _launch.launch(d, 1, 32, (arrays[0],))  # evicted: through Numba again
    _launch.launch(d, 1, 32, (arrays[3],))  # kept: a repeat
    assert len(d.numba) == 5 and len(core) == 1


def test_concurrent_launches_from_threads_keep_their_own_parameters(core):
    """Eight threads launch four kernels with their own arrays at once, repeatedly: every launch
    happens exactly once, through Numba or from the entry of its own kernel and arrays."""
    disps = [FakeDispatcher(2) for _ in range(4)]
    arrays = [FakeArray(100 * (i + 1), (i + 1,)) for i in range(4)]
    n, errors = 200, []

    def work(t: int) -> None:
        try:
            for k in range(n):
                i = (t + k) % 4
                _launch.launch(disps[i], 1, 32, (arrays[i], i))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert sum(len(d.numba) for d in disps) + len(core) == 8 * n
    for _, _, kernel, params in core:
        i = next(j for j, d in enumerate(disps) if d.kernel.kernel is kernel)
        assert params == (100 * (i + 1), i + 1, i)


class Handle:
    """A ``cuda.core`` handle object: an address behind ``int()``."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __int__(self) -> int:
        return self.value


class CoreKernel:
    """``cuda.core``'s ``Kernel``: its ``CUkernel`` handle."""

    handle = Handle(0xABC)


class CoreStream:
    """``cuda.core``'s ``Stream`` (what Numba's launch configuration holds)."""

    handle = Handle(0x77)


@pytest.fixture()
def driver(core, monkeypatch):
    """The driver's ``cuLaunchKernel`` replaced by a recorder (``result``: the ``CUresult`` it
    returns), with ``cuda.core``'s real ``ParamHolder`` counted; ``core``'s recorder as well."""
    from cuda.core._kernel_arg_handler import ParamHolder

    rec = {"calls": [], "packed": 0, "result": 0, "core": core}

    def launch_kernel(*args):
        rec["calls"].append(args)
        return (rec["result"],)

    def holder(params):
        rec["packed"] += 1
        return ParamHolder(params)

    monkeypatch.setattr(_launch, "_driver", lambda: (launch_kernel, holder, lambda h: ("CUfunction", h),
                                                     lambda h: ("CUstream", h)))
    return rec


def _driver_dispatcher(n_args: int, cooperative: bool = False) -> FakeDispatcher:
    d = FakeDispatcher(n_args)
    d.kernel.kernel = CoreKernel()
    d.kernel.cooperative = cooperative
    d.stream = CoreStream()
    return d


def _unpacked(ptr: int, kinds: str) -> list:
    """The values behind a ``void**`` parameter buffer: ``q`` int64, ``f`` float32 each."""
    slots = (ctypes.c_void_p * len(kinds)).from_address(ptr)
    return [(ctypes.c_int64 if k == "q" else ctypes.c_float).from_address(a).value for k, a in zip(kinds, slots)]


def test_a_repeat_calls_the_driver_with_the_parameters_packed_once(driver):
    """The driver gets the kernel's handle, the geometry as three ints each, the stream's handle
    and one buffer, packed once, that holds the very parameters Numba converted."""
    d = _driver_dispatcher(3)
    a, b = FakeArray(1000, (4, 8)), FakeArray(2000, (16,))
    args = (a, b, np.float32(0.5))
    d.kernel._prepare_args = lambda ty, val, stream, retr, params: params.extend(
        [val.ptr, *val.shape] if isinstance(val, FakeArray) else [ctypes.c_float(val)])
    _launch.launch(d, (5, 2), 128, args)
    assert driver["calls"] == [] and driver["packed"] == 1 and len(d.numba) == 1
    before = _launch.stats()["direct"]
    for _ in range(3):
        _launch.launch(d, (5, 2), 128, args)
    assert driver["packed"] == 1 and driver["core"] == [] and len(d.numba) == 1
    assert len(driver["calls"]) == 3 and len(set(driver["calls"])) == 1
    fn, gx, gy, gz, bx, by, bz, shmem, stream, ptr, extra = driver["calls"][0]
    assert fn == ("CUfunction", 0xABC) and stream == ("CUstream", 0x77)
    assert (gx, gy, gz, bx, by, bz, shmem, extra) == (5, 2, 1, 128, 1, 1, 0, 0)
    assert _unpacked(ptr, "qqqqqf") == [1000, 4, 8, 2000, 16, 0.5]
    assert _launch.stats()["direct"] - before == 3


@pytest.mark.parametrize("case", ["knob off", "cooperative", "no stream handle"])
def test_repeats_go_through_cuda_core_where_the_driver_launch_does_not_apply(driver, case):
    d = _driver_dispatcher(1, cooperative=case == "cooperative")
    if case == "no stream handle":
        d.stream = "a stream without a handle"
    a = FakeArray(5, (2,))
    with knobs(cuda_direct_launch=0 if case == "knob off" else 1):
        for _ in range(3):
            _launch.launch(d, 1, 32, (a,))
    assert driver["calls"] == [] and len(driver["core"]) == 2
    assert driver["packed"] == (1 if case == "knob off" else 0)
    assert driver["core"][-1][3] == (5, 2)


def test_a_failed_driver_launch_falls_back_to_cuda_core_for_good(driver):
    d = _driver_dispatcher(1)
    a = FakeArray(5, (2,))
    _launch.launch(d, 1, 32, (a,))
    driver["result"] = 1  # CUDA_ERROR_INVALID_VALUE
    _launch.launch(d, 1, 32, (a,))
    assert len(driver["calls"]) == 1 and len(driver["core"]) == 1
    driver["result"] = 0
    _launch.launch(d, 1, 32, (a,))  # the entry launches through cuda.core from now on
    assert len(driver["calls"]) == 1 and len(driver["core"]) == 2


@pytest.mark.parametrize(("dim", "expected"), [(7, (7, 1, 1)), (np.int64(3), (3, 1, 1)), ((4, 2), (4, 2, 1)),
                                               ((1, 2, 3), (1, 2, 3))])
def test_launch_dimensions_as_three_ints(dim, expected):
    assert _launch._dim3(dim) == expected


def test_a_launch_dimension_of_four_ints_is_refused():
    with pytest.raises(ValueError, match="1 to 3 ints"):
        _launch._dim3((1, 2, 3, 4))


class FakeNumbaStream:
    def __init__(self, handle: int) -> None:
        self.handle = handle


class FakeCupyStream:
    """A CuPy stream: ``ptr``, and a context manager making it CuPy's current stream."""

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr
        self.entered = 0

    def __enter__(self):
        self.entered += 1
        return self

    def __exit__(self, *exc):
        self.entered -= 1


class FakeTorchStream:
    def __init__(self, handle: int) -> None:
        self.cuda_stream = handle


def test_launch_stream_sends_this_threads_launches_to_the_stream(core, monkeypatch):
    monkeypatch.setattr(_launch.cuda, "external_stream", lambda h: ("external", h))
    d = FakeDispatcher(1)
    a = FakeArray(1, (2,))
    cupy_stream = FakeCupyStream(0xC0)
    seen_elsewhere = []
    with numba_kv.launch_stream(cupy_stream) as s:
        assert s == ("external", 0xC0) and cupy_stream.entered == 1
        _launch.launch(d, 1, 32, (a,))
        _launch.launch(d, 1, 32, (a,))  # a repeat on the same stream
        t = threading.Thread(target=lambda: seen_elsewhere.append(_launch.current_stream()))
        t.start()
        t.join()
        with numba_kv.launch_stream(FakeTorchStream(0x70)):
            _launch.launch(d, 1, 32, (a,))  # another stream: its own entry, through Numba
        assert _launch.current_stream() == (("external", 0xC0), 0xC0)
    assert cupy_stream.entered == 0 and _launch.current_stream() == (None, 0)
    _launch.launch(d, 1, 32, (a,))  # the default stream: through Numba again
    assert seen_elsewhere == [(None, 0)]
    assert d.streams == [("external", 0xC0), ("external", 0x70), "default stream"]
    assert [c[0] for c in core] == [("external", 0xC0)]
    with numba_kv.launch_stream(FakeNumbaStream(0x5)) as s:
        assert isinstance(s, FakeNumbaStream) and _launch.current_stream()[1] == 5
    with numba_kv.launch_stream(0) as s:
        assert s is None


@pytest.mark.parametrize("bad", ["stream", 1.5, None, True])
def test_launch_stream_refuses_what_is_not_a_stream(bad):
    with pytest.raises(TypeError, match="stream: expected"):
        with numba_kv.launch_stream(bad):
            pass
    assert _launch.current_stream() == (None, 0)


def test_host_copies_wait_for_the_launch_stream(monkeypatch):
    """Inside ``launch_stream`` a copy to the host first synchronizes the launch stream: the copy
    runs on the default stream, which a non-blocking stream does not wait for."""
    events = []

    class Stream:
        handle = 9

        def synchronize(self):
            events.append("synchronize")

    class DeviceArray:
        def copy_to_host(self):
            events.append("copy")
            return np.zeros(1)

    _backend.to_host(DeviceArray())
    with numba_kv.launch_stream(Stream()):
        _backend.to_host(DeviceArray())
    assert events == ["copy", "synchronize", "copy"]
