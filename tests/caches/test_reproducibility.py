"""The decode guide's reproducibility rule: stored state is independent of the Numba thread
count; fused outputs past one CPU partition (512 tokens per KV row) differ only in their
last bits, and not at all within one partition."""

import numba
import numpy as np
import pytest

from numba_kv import AttendConfig, make_cache


@pytest.mark.parametrize("name", ["pqo3", "kv4", "tq3"])
def test_thread_count_changes_only_the_last_bits_of_fused_outputs(name):
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs 2 Numba threads")
    rng = np.random.default_rng(7)
    h, d = 2, 64
    k, v = (rng.standard_normal((1, h, 1500, d)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((1, 2 * h, 1, d)).astype(np.float32)
    cfg = AttendConfig(d ** -0.5, n_kv_groups=2)
    before = numba.get_num_threads()
    outs, states = {}, {}
    try:
        for threads in (1, 2):
            numba.set_num_threads(threads)
            for n in (400, 1500):  # within one partition, and past it
                cache = make_cache(name, num_layers=1, num_kv_heads=h, head_dim=d, residual_length=0, sink_tokens=0)
                cache.prefill(0, k[:, :, :n - 1], v[:, :, :n - 1])
                outs[threads, n] = cache.decode(0, k[:, :, n - 1:n], v[:, :, n - 1:n], q, cfg).out
                states[threads, n] = cache.state_dict()
    finally:
        numba.set_num_threads(before)
    for n in (400, 1500):
        a, b = states[1, n], states[2, n]
        assert a.config == b.config and a.state == b.state and a.tensors.keys() == b.tensors.keys()
        for key in a.tensors:
            assert np.array_equal(a.tensors[key], b.tensors[key]), key
    assert np.array_equal(outs[1, 400], outs[2, 400])
    diff = np.abs(outs[1, 1500] - outs[2, 1500]).max() / np.abs(outs[2, 1500]).max()
    print(f"{name}: max |1 thread - 2 threads| / max |out| = {diff:.2e}")
    assert diff <= 1e-6
