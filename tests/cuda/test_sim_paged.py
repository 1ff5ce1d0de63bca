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


@pytest.mark.cuda
@pytest.mark.parametrize("change", ["crop", "crop_to_page", "free_other", "fork", "select_batch", "reset"])
def test_paged_device_table_is_dropped_when_pages_change_hands(change):
    """Attend (the layer's page table is kept on the device), change the sequences, append a
    token that fits the last page (the kept table would be grown in place), attend again:
    equal to the CPU twin, so the change dropped the kept table."""
    if not simulator_enabled():
        pytest.skip("device arrays")
    rng = np.random.default_rng(9)
    h, g, d, ps = 1, 2, 32, 4
    dev, cpu = (PagedKVCache(16, 1, h, d, page_size=ps, storage="pqo3") for _ in range(2))

    def both(name, *args):
        a, b = getattr(dev, name)(*args), getattr(cpu, name)(*args)
        assert a == b
        return a

    def append(sid, n):
        k = rng.standard_normal((h, n, d)).astype(np.float32)
        dev.append(0, sid, to_device(k), to_device(k))
        cpu.append(0, sid, k, k)

    def attend(ids):
        q = rng.standard_normal((len(ids), h * g, 1, d)).astype(np.float32)
        np.testing.assert_allclose(to_host(dev.decode_attention(0, to_device(q), ids)), cpu.decode_attention(0, q, ids),
                                   rtol=2e-5, atol=2e-6)

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
