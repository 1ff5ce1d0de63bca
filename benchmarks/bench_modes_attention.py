"""Fused decode step of every cache family at T = 32K (batch 1, 8 KV heads, 32 query heads,
d = 128, no window): what the QJL correction, the whole-head rotation and mixed block
widths cost inside the kernel, against PQO3 and dense NumPy attention, in one group; plus
``cache.decode`` of the best <= 4-bit configuration (:data:`numba_kv.toolkit.bench.BEST_LE4_SPEC`).

Two dense entries: ``dense`` is :class:`numba_kv.DenseCache` as a caller uses it (its
``decode`` returns a copy of the whole history, then the caller's attention), and
``dense-numpy`` the strongest dense step on a CPU (the token stored into a preallocated
float32 buffer, BLAS attention over a view of it: no copy of the history).  Both with the
environment's BLAS threads (``blas_threads`` in ``extra_info``)."""

from collections.abc import Callable

import numpy as np
import pytest

from numba_kv import AttendConfig
from numba_kv.info import blas_threads
from numba_kv.toolkit.bench import BEST_LE4_SPEC
from numba_kv.toolkit.specs import parse_cache_specs

from ._util import env_info

T, HKV, HQ, D = 32768, 8, 32, 128
MODES = ["dense", "pqo3", "pqo3-head", "pqo3-eden", "pqo2.5", "pqo3.5", "tq3", "pqo-k4v3", BEST_LE4_SPEC]
#: timed and untimed calls of one entry at most (pytest-benchmark's 5 rounds + 1 warm-up + ours)
MAX_STEPS = 16
_DATA = {}


def data():
    if not _DATA:
        rng = np.random.default_rng(0)
        k = rng.standard_normal((1, HKV, T, D)).astype(np.float32)
        k[..., [3, 17, 64]] *= 6.0
        v = rng.standard_normal((1, HKV, T, D)).astype(np.float32)
        _DATA.update(k=k, v=v, q=rng.standard_normal((1, HQ, 1, D)).astype(np.float32),
                     k1=rng.standard_normal((1, HKV, 1, D)).astype(np.float32))
    return _DATA


def sdpa(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """The caller's float32 attention per GQA group: ``q`` ``[HKV, G, D]``, ``k``/``v``
    ``[HKV, T, D]`` (views allowed) -> ``[HKV, G, D]``."""
    s = np.matmul(q, k.transpose(0, 2, 1)) * np.float32(scale)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.matmul(p / p.sum(-1, keepdims=True), v)


def numpy_dense_step(k: np.ndarray, v: np.ndarray, k1: np.ndarray, v1: np.ndarray, q: np.ndarray,
                     softmax_scale: float, max_steps: int = MAX_STEPS) -> Callable[[], np.ndarray]:
    """One dense decode step as cheap as NumPy makes it: ``k1``/``v1`` (``[1, HKV, 1, D]``)
    stored into buffers preallocated for ``max_steps`` more tokens after the prefilled ``k``/
    ``v`` (``[1, HKV, T, D]``), then :func:`sdpa` over views of the live tokens.  ``q``:
    ``[1, HQ, 1, D]``.  Returns the step; each call appends one token (``RuntimeError``
    past ``max_steps``) and returns ``[HKV, HQ/HKV, D]``."""
    hkv, t0, d = k.shape[1:]
    kbuf = np.empty((hkv, t0 + max_steps, d), np.float32)
    vbuf = np.empty_like(kbuf)
    kbuf[:, :t0], vbuf[:, :t0] = k[0], v[0]
    qg = np.ascontiguousarray(q[0, :, 0].reshape(hkv, -1, d))
    n = [t0]

    def step() -> np.ndarray:
        t = n[0]
        if t == kbuf.shape[1]:
            raise RuntimeError(f"numpy_dense_step: more than {max_steps} steps")
        kbuf[:, t], vbuf[:, t] = k1[0, :, 0], v1[0, :, 0]
        n[0] = t + 1
        return sdpa(qg, kbuf[:, :t + 1], vbuf[:, :t + 1], softmax_scale)
    return step


def _record(benchmark, step, mode, kv_bytes):
    step()  # compile / warm up outside the timed region
    benchmark.group = f"decode-step-T{T}"
    env_info(benchmark, T)
    benchmark.extra_info.update(mode=mode, kv_bytes=kv_bytes, blas_threads=blas_threads())
    benchmark.pedantic(step, rounds=5, warmup_rounds=1)


@pytest.mark.parametrize("mode", MODES)
def test_decode_step(benchmark, mode):
    d = data()
    spec = mode if mode == "dense" else f"{mode}{',' if ':' in mode else ':'}residual_length=0,sink_tokens=0"
    cache = parse_cache_specs(spec, arg="mode")[0].make(num_layers=1, num_kv_heads=HKV, head_dim=D)
    cache.prefill(0, d["k"], d["v"])
    cfg = AttendConfig(D ** -0.5, HQ // HKV)

    def step():
        out = cache.decode(0, d["k1"], d["k1"], d["q"], cfg)
        if mode != "dense":
            return out.out
        # dense: the caller's own float32 SDPA over the returned history, per GQA group
        q = d["q"][0, :, 0].reshape(HKV, HQ // HKV, D)
        return sdpa(q, out.result.k[0], out.result.v[0], cfg.softmax_scale)

    _record(benchmark, step, mode, cache.memory_usage())


def test_decode_step_dense_numpy(benchmark):
    """The strongest dense step: store into a preallocated buffer, attend over a view."""
    d = data()
    step = numpy_dense_step(d["k"], d["v"], d["k1"], d["k1"], d["q"], D ** -0.5)
    _record(benchmark, step, "dense-numpy", 2 * HKV * (T + 1) * D * 4)
