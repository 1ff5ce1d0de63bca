"""``numba_kv.StepGraph`` on the GPU path (``numba_kv/_graph.py``), without a GPU: Numba's
dispatcher and ``cuda.core``'s launch are the stand-ins of ``tests/test_launch.py``, and the
graph builder a recorder of what it captures.

Checked: which steps go through Numba, are launched one by one from prepared entries, are
captured or replayed; that what a graph holds is the step's launches in order; that other
device work inside a step (``_backend.barrier``: an allocation, a host read) launches what
is held first; that a changed argument is never replayed; and the fallbacks.  The simulator
version with real caches: ``tests/cuda/test_sim_step_graph.py``; the real capture:
``tests/gpu/test_device_step_graph.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

import numba_kv
from numba_kv import StepGraph, _backend, _graph, _launch

from .test_launch import FakeArray, FakeDispatcher, core  # noqa: F401 - the fixture


class FakeGraph:
    """A captured graph: the entries' parameters as captured; launches recorded."""

    def __init__(self, captured: list, log: list) -> None:
        self.captured = captured
        self.log = log
        self.closed = False

    def launch(self, stream):
        self.log.append(("graph", stream, self))

    def close(self):
        self.closed = True


@pytest.fixture()
def graphs(monkeypatch, core):  # noqa: F811 - the fixture of tests/test_launch.py
    """``_graph._capture`` replaced: each capture records its entries' launch parameters."""
    made: list = []

    def capture(entries):
        g = FakeGraph([(e.kernel, e.params) for e in entries], core)
        made.append(g)
        return g

    monkeypatch.setattr(_graph, "_capture", capture)
    return made


def _kernels():
    return FakeDispatcher(2), FakeDispatcher(1)


def _step(kernels, a, b, out):
    """A step of two launches (what a cache's decode does, in miniature)."""
    _launch.launch(kernels[0], 4, 128, (a, np.int32(3)))
    _launch.launch(kernels[1], 2, 64, (b,))
    return out


def test_steps_go_through_numba_then_one_by_one_then_a_graph(core, graphs):  # noqa: F811
    kernels = _kernels()
    a, b = FakeArray(1000, (8,)), FakeArray(2000, (4,))
    graph = StepGraph()
    assert graph.run(_step, kernels, a, b, "out") == "out"
    assert graph.stats()["eager"] == 1 and len(kernels[0].numba) == len(kernels[1].numba) == 1
    graph.run(_step, kernels, a, b, None)  # held back, then launched one by one from the entries
    assert graph.stats()["launched"] == 1 and [c[3] for c in core] == [(1000, 8, np.int32(3)), (2000, 4)]
    graph.run(_step, kernels, a, b, None)  # the same entries again: captured, the graph launched
    assert graph.stats()["captured"] == 1 and len(graphs) == 1
    assert graphs[0].captured == [(kernels[0].kernel.kernel, (1000, 8, np.int32(3))),
                                  (kernels[1].kernel.kernel, (2000, 4))]
    for _ in range(3):
        graph.run(_step, kernels, a, b, None)
    assert graph.stats()["replayed"] == 3 and len(graphs) == 1
    assert [c[0] for c in core[2:]] == ["graph"] * 4 and all(c[2] is graphs[0] for c in core[2:])
    assert len(kernels[0].numba) == 1  # Numba launched each kernel once


def test_a_changed_argument_is_launched_not_replayed(core, graphs):  # noqa: F811
    kernels = _kernels()
    a, b = FakeArray(1000, (8,)), FakeArray(2000, (4,))
    graph = StepGraph()
    for _ in range(4):
        graph.run(_step, kernels, a, b, None)
    assert graph.stats()["replayed"] == 1
    other = FakeArray(3000, (4,))  # another array: its launch goes through Numba, in order
    graph.run(_step, kernels, a, other, None)
    assert graph.stats()["eager"] == 2 and core[-1][3] == (1000, 8, np.int32(3))  # held, then flushed
    assert kernels[1].numba[-1] == (other,)
    graph.run(_step, kernels, a, b, None)  # back to the captured arrays: the graph again
    assert graph.stats()["replayed"] == 2 and core[-1][2] is graphs[0]


def test_other_device_work_launches_what_is_held_first(core, graphs, monkeypatch):  # noqa: F811
    kernels = _kernels()
    a, b = FakeArray(1000, (8,)), FakeArray(2000, (4,))
    order: list = []

    def step_with_a_read(kernels, a, b):
        _launch.launch(kernels[0], 4, 128, (a, np.int32(3)))
        order.append(len(core))  # nothing launched yet: held
        _backend.barrier()  # e.g. _backend.to_host / empty: the held launch goes first
        order.append(len(core))
        _launch.launch(kernels[1], 2, 64, (b,))  # the rest of the step as launched
        order.append(len(core))

    graph = StepGraph()
    for _ in range(2):
        graph.run(_step, kernels, a, b, None)
    core.clear()
    graph.run(step_with_a_read, kernels, a, b)
    assert order == [0, 1, 2] and graph.stats()["eager"] == 2
    assert [c[3] for c in core] == [(1000, 8, np.int32(3)), (2000, 4)]


def test_a_failing_step_launches_what_it_held(core, graphs):  # noqa: F811
    kernels = _kernels()
    a, b = FakeArray(1000, (8,)), FakeArray(2000, (4,))
    graph = StepGraph()
    graph.run(_step, kernels, a, b, None)
    core.clear()

    def fail():
        _step(kernels, a, b, None)
        raise ValueError("after two launches")

    with pytest.raises(ValueError, match="after two"):
        graph.run(fail)
    assert len(core) == 2 and _backend.step_recorder() is None and graph.stats()["failed"] == 1


def test_a_capture_that_fails_leaves_launches_one_by_one(core, monkeypatch):  # noqa: F811
    def no_graphs(entries):
        raise RuntimeError("graphs unsupported")

    monkeypatch.setattr(_graph, "_capture", no_graphs)
    kernels = _kernels()
    a, b = FakeArray(1000, (8,)), FakeArray(2000, (4,))
    graph = StepGraph()
    for _ in range(5):
        graph.run(_step, kernels, a, b, None)
    assert graph.error == "RuntimeError: graphs unsupported"
    assert graph.stats()["launched"] == 4 and len(core) == 8


def test_prepared_launches_off_means_every_step_through_numba(core, graphs):  # noqa: F811
    kernels = _kernels()
    a, b = FakeArray(1000, (8,)), FakeArray(2000, (4,))
    graph = StepGraph()
    with numba_kv.knobs(cuda_prepared_launch=0):
        for _ in range(3):
            graph.run(_step, kernels, a, b, None)
    assert graph.stats()["eager"] == 3 and not graphs and len(kernels[0].numba) == 3


def test_reset_closes_the_graph_and_steps_capture_again(core, graphs):  # noqa: F811
    kernels = _kernels()
    a, b = FakeArray(1000, (8,)), FakeArray(2000, (4,))
    graph = StepGraph()
    for _ in range(3):
        graph.run(_step, kernels, a, b, None)
    graph.reset()
    assert graphs[0].closed
    for _ in range(2):
        graph.run(_step, kernels, a, b, None)
    assert graph.stats()["captured"] == 2 and len(graphs) == 2


def test_capture_off_launches_one_by_one(core, graphs):  # noqa: F811
    kernels = _kernels()
    a, b = FakeArray(1000, (8,)), FakeArray(2000, (4,))
    graph = StepGraph(capture=False)
    for _ in range(4):
        graph.run(_step, kernels, a, b, None)
    assert graph.stats()["launched"] == 3 and not graphs and len(core) == 6


def test_numpy_steps_just_run():
    cache = numba_kv.make_cache("pqo3", num_layers=1, num_kv_heads=2, head_dim=64)
    rng = np.random.default_rng(49)
    graph = StepGraph()
    for _ in range(2):
        k, v = (rng.standard_normal((1, 2, 1, 64)).astype(np.float32) for _ in range(2))
        q = rng.standard_normal((1, 4, 1, 64)).astype(np.float32)
        graph.run(cache.decode, 0, k, v, q, numba_kv.AttendConfig(0.125, n_kv_groups=2))
    assert graph.stats()["host"] == 2 and graph.stats()["steps"] == 2
