"""Paged fused attention: CUDA kernel (simulator or GPU) vs the CPU twin."""

import numpy as np
import pytest

from numba_kv import PagedKVCache
from numba_kv._backend import simulator_enabled, to_host

from ..conftest import runner_params, to_device


def _paged(rng):
    for storage in ("pqo3", "pqo-k4v2", "float32"):
        caches = [PagedKVCache(num_pages=12, num_layers=1, num_kv_heads=2, head_dim=64, page_size=8,
                               storage=storage) for _ in range(2)]
        for n in (9, 20):
            k = rng.standard_normal((2, n, 64)).astype(np.float32)
            v = rng.standard_normal((2, n, 64)).astype(np.float32)
            caches[0].append(0, caches[0].allocate_sequence(), k, v)
            caches[1].append(0, caches[1].allocate_sequence(), to_device(k), to_device(v))
        q = rng.standard_normal((2, 4, 2, 64)).astype(np.float32)
        a = caches[0].decode_attention(0, q)
        b = to_host(caches[1].decode_attention(0, to_device(q)))
        np.testing.assert_allclose(b, a, rtol=2e-5, atol=2e-6)


RUNNERS = {"paged_decode_attention": _paged}


@pytest.mark.cuda
@pytest.mark.parametrize("runner", runner_params(RUNNERS))
def test_cuda_kernel_matches_cpu_twin(runner):
    runner(np.random.default_rng(5))


def _churn_machine():
    """Random appends, decode attention over random subsets, crops, forks and frees on a
    CUDA paged cache and its CPU twin (a hypothesis state machine).  The CUDA cache keeps
    device copies of its page tables and grows their last-page lengths in place; every
    attention output must equal the twin's, whatever came before."""
    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

    H, G, D, PS = 1, 2, 32, 4

    class Machine(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.rng = np.random.default_rng(0)
            self.dev, self.cpu = (PagedKVCache(24, 2, H, D, page_size=PS, storage="pqo3") for _ in range(2))

        def _both(self, name, *args):
            a = getattr(self.dev, name)(*args)
            b = getattr(self.cpu, name)(*args)
            assert a == b
            return a

        @rule()
        def allocate(self):
            self._both("allocate_sequence")

        def _append(self, layer, sid, n):
            if -(-(self.cpu.seq_len(layer, sid) + n) // PS) - self.cpu.num_seq_pages(layer, sid) > \
                    self.cpu.num_free_pages:
                return
            k = self.rng.standard_normal((H, n, D)).astype(np.float32)
            v = self.rng.standard_normal((H, n, D)).astype(np.float32)
            self.dev.append(layer, sid, to_device(k), to_device(v))
            self.cpu.append(layer, sid, k, v)

        def _attend(self, layer, ids):
            ids = [s for s in ids if self.cpu.seq_len(layer, s) > 0]
            if ids:
                q = self.rng.standard_normal((len(ids), H * G, 1, D)).astype(np.float32)
                a = to_host(self.dev.decode_attention(layer, to_device(q), ids))
                np.testing.assert_allclose(a, self.cpu.decode_attention(layer, q, ids), rtol=2e-5, atol=2e-6)

        @precondition(lambda self: self.cpu.sequences)
        @rule(data=st.data(), layer=st.integers(0, 1), n=st.sampled_from([1, 1, 1, 2, 5]), steps=st.integers(1, 4))
        def decode(self, data, layer, n, steps):
            """A few decode steps: one token (or ``n``) appended to each sequence of a batch,
            then attention over the batch (the pattern whose device table is reused)."""
            seqs = self.cpu.sequences
            ids = seqs if data.draw(st.booleans()) else data.draw(
                st.lists(st.sampled_from(seqs), min_size=1, max_size=3, unique=True))
            for i in range(steps):
                for sid in ids:
                    self._append(layer, sid, n if i == 0 else 1)
                self._attend(layer, ids)

        @precondition(lambda self: self.cpu.sequences)
        @rule(data=st.data(), layer=st.integers(0, 1))
        def attend(self, data, layer):
            self._attend(layer, data.draw(st.lists(st.sampled_from(self.cpu.sequences), min_size=1, max_size=3,
                                                   unique=True)))

        @precondition(lambda self: self.cpu.sequences)
        @rule(data=st.data())
        def crop(self, data):
            sid = data.draw(st.sampled_from(self.cpu.sequences))
            n = min(self.cpu.seq_len(layer, sid) for layer in range(2))
            self._both("crop", sid, data.draw(st.integers(0, n)))

        @precondition(lambda self: self.cpu.sequences)
        @rule(data=st.data())
        def fork_or_free(self, data):
            sid = data.draw(st.sampled_from(self.cpu.sequences))
            if data.draw(st.booleans()):
                need = sum(self.cpu.num_seq_pages(layer, sid) for layer in range(2))
                if need <= self.cpu.num_free_pages:
                    self._both("fork_sequence", sid)
            else:
                self._both("free_sequence", sid)

    return Machine


@pytest.mark.cuda
def test_paged_device_tables_follow_every_change():
    if not simulator_enabled():
        pytest.skip("simulator only: the same churn on a GPU is covered by the gpu_only paged tests")
    from hypothesis import HealthCheck, settings
    from hypothesis.stateful import run_state_machine_as_test

    run_state_machine_as_test(_churn_machine(), settings=settings(
        max_examples=5, stateful_step_count=12, deadline=None, suppress_health_check=list(HealthCheck)))


class _DeviceAndHost:
    """A paged cache on the device and its CPU twin given the same calls (one layer, ``h`` KV
    heads, groups of 2 queries, head_dim ``d``): ``run`` a method on both (equal results),
    ``append`` random tokens to both, ``attend`` and compare."""

    def __init__(self, rng, num_pages: int, h: int, d: int, page_size: int) -> None:
        self.rng, self.h, self.d = rng, h, d
        self.dev, self.cpu = (PagedKVCache(num_pages, 1, h, d, page_size=page_size, storage="pqo3") for _ in range(2))

    def run(self, name, *args):
        a, b = getattr(self.dev, name)(*args), getattr(self.cpu, name)(*args)
        assert a == b
        return a

    def append(self, sid, n):
        k = self.rng.standard_normal((self.h, n, self.d)).astype(np.float32)
        self.dev.append(0, sid, to_device(k), to_device(k))
        self.cpu.append(0, sid, k, k)

    def attend(self, ids):
        q = self.rng.standard_normal((len(ids), 2 * self.h, 1, self.d)).astype(np.float32)
        np.testing.assert_allclose(to_host(self.dev.decode_attention(0, to_device(q), ids)),
                                   self.cpu.decode_attention(0, q, ids), rtol=2e-5, atol=2e-6)


@pytest.mark.cuda
@pytest.mark.parametrize("change", ["crop", "crop_to_page", "free_other", "fork", "select_batch", "reset"])
def test_paged_device_table_is_dropped_when_pages_change_hands(change):
    """Attend (the layer's page table is kept on the device), change the sequences, append a
    token that fits the last page (the kept table would be grown in place), attend again:
    equal to the CPU twin, so the change dropped the kept table."""
    if not simulator_enabled():
        pytest.skip("device arrays")
    pair = _DeviceAndHost(np.random.default_rng(9), 16, 1, 32, 4)
    both, append, attend = pair.run, pair.append, pair.attend

    a, b, c = (both("allocate_sequence") for _ in range(3))
    for sid, n in ((a, 6), (b, 9), (c, 2)):
        append(sid, n)
    attend([a, b])
    if change == "crop":
        both("crop", a, 5)  # 6 -> 5 tokens, same pages
    elif change == "crop_to_page":
        both("crop", b, 3)  # 9 -> 3 tokens: two pages go back
    elif change == "free_other":
        both("free_sequence", c)
    elif change == "fork":
        both("fork_sequence", a)
    elif change == "select_batch":
        both("select_batch", [a, b])
    else:
        both("reset")
        a, b = both("allocate_sequence"), both("allocate_sequence")
        append(a, 2)
        append(b, 3)
    append(a, 1)
    attend([a, b])


class _EventLog:
    """Stand-in for ``_backend.stream_event``: events that log ``(what, event number, stream)``."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int, object]] = []
        self.made = 0

    def __call__(self):
        log, number = self.log, self.made
        self.made += 1
        log.append(("new", number, None))

        class Event:
            def record(self, stream=0):
                log.append(("record", number, stream))

            def wait(self, stream=0):
                log.append(("wait", number, stream))

        return Event()

    def take(self) -> list[tuple[str, int, object]]:
        out, self.log[:] = self.log[:], []
        return out


@pytest.mark.cuda
@pytest.mark.parametrize("release", ["free_sequence", "crop", "select_batch", "reset"])
def test_paged_page_reuse_on_another_launch_stream_waits_for_the_release(monkeypatch, release):
    """A page released on launch stream A (queued kernels may still read it) and taken by an
    append or a fork on stream B: B waits on an event recorded on A at the release (on the
    device, no host synchronization). Released and taken on one stream, or on the host: no
    event. Outputs stay the CPU twin's."""
    if not simulator_enabled():
        pytest.skip("simulator streams and a stand-in event")
    from numba import cuda

    import numba_kv

    events = _EventLog()
    monkeypatch.setattr("numba_kv._backend.stream_event", events)
    ps = 4
    pair = _DeviceAndHost(np.random.default_rng(3), 6, 1, 32, ps)
    run, append, attend = pair.run, pair.append, pair.attend
    sa, sb = cuda.stream(), cuda.stream()

    with numba_kv.launch_stream(sa):
        a, keep = run("allocate_sequence"), run("allocate_sequence")
        append(a, 2 * ps)  # two pages
        append(keep, 1)
        attend([a, keep])
        assert events.take() == []  # nothing released yet
        if release == "free_sequence":
            run("free_sequence", a)
        elif release == "crop":
            run("crop", a, 1)  # its second page goes back
        elif release == "select_batch":
            run("select_batch", [keep])
        else:
            run("reset")
            keep = run("allocate_sequence")
            append(keep, 1)
        released = events.take()
        assert released[0][0] == "new" and released[1:] and all(e[:3:2] == ("record", sa) for e in released[1:])
        # taken again on the same stream: ordered by the stream itself
        b = run("allocate_sequence")
        append(b, ps)
        assert events.take() == []
        run("free_sequence", b)
        assert [e[:2] for e in events.take()] == [("record", 0)]
    with numba_kv.launch_stream(sb):
        c = run("allocate_sequence")
        append(c, ps + 1)  # two pages, both released on stream A
        assert events.take() == [("wait", 0, sb)]
        append(c, 1)  # room in its last page: nothing taken
        attend([keep, c])
        fork = run("fork_sequence", c)  # pages never released: no wait
        assert events.take() == []
        run("free_sequence", fork)
        assert [e[:2] for e in events.take()] == [("new", 1), ("record", 1)]
    with numba_kv.launch_stream(sa):
        run("fork_sequence", c)  # takes the fork's pages, released on stream B
        assert events.take() == [("wait", 1, sa)]
        attend([keep, c])


def test_paged_pages_on_the_host_record_no_event(monkeypatch):
    """NumPy pools: the host runs in order, so releases and takes make no event."""
    events = _EventLog()
    monkeypatch.setattr("numba_kv._backend.stream_event", events)
    cache = PagedKVCache(4, 1, 1, 32, page_size=4, storage="pqo3")
    k = np.ones((1, 6, 32), np.float32)
    a = cache.allocate_sequence()
    cache.append(0, a, k, k)
    cache.free_sequence(a)
    cache.append(0, cache.allocate_sequence(), k, k)
    assert events.log == []


@pytest.mark.cuda
def test_paged_write_scratch_is_per_launch_stream(monkeypatch):
    """The reused device buffers of a small write (codes and scales quantized before their
    scatter; the pool rows of a key-only append) are the stream's own: a write queued on
    another stream cannot overwrite them between a write's launches. Reused on one stream
    (no allocation per step)."""
    if not simulator_enabled():
        pytest.skip("simulator streams")
    from numba import cuda

    import numba_kv
    import numba_kv.caches._paged_write as paged_write

    seen: list[tuple[str, int]] = []  # (buffer, id): the buffers are the cache's own, alive throughout
    pair, rows_into = paged_write.quantize_pair_into, paged_write.page_run_rows_into

    def spy_pair(xk, xv, ck, *args, **kw):
        seen.append(("codes", id(ck)))
        return pair(xk, xv, ck, *args, **kw)

    def spy_rows(rows, *args):
        seen.append(("rows", id(rows)))
        return rows_into(rows, *args)

    monkeypatch.setattr(paged_write, "quantize_pair_into", spy_pair)
    monkeypatch.setattr(paged_write, "page_run_rows_into", spy_rows)
    rng = np.random.default_rng(4)
    h, d, ps = 1, 32, 4
    kv = PagedKVCache(8, 1, h, d, page_size=ps, storage="pqo3")  # a run across pages: scratch + scatter
    keys = PagedKVCache(8, 1, h, d, page_size=ps, storage="pqo3", v_head_dim=0)  # one page: rows scratch
    new = {kv: [], keys: []}
    for cache in (kv, keys):
        for stream in (cuda.stream(), cuda.stream()):
            with numba_kv.launch_stream(stream):
                sid = cache.allocate_sequence()
                for n in (3, 2, 2):  # the 2-token writes after 3: across a page boundary, then within one
                    k = to_device(rng.standard_normal((h, n, d)).astype(np.float32))
                    seen.clear()
                    cache.append(0, sid, k, k if cache is kv else None)
                    new[cache].append(set(seen))
    # kv: the first 2-token write of each stream crosses a page: its codes go through scratch
    codes = [new[kv][1], new[kv][4]]
    assert all(codes) and not codes[0] & codes[1]
    # keys: the writes within one page (the 3 and the second 2) use the stream's rows scratch
    rows = [{i for what, i in new[keys][j] if what == "rows"} for j in range(6)]
    assert rows[0] and rows[0] == rows[2] and rows[3] == rows[5] and not rows[0] & rows[3]
