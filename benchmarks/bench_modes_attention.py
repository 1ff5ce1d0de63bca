"""Fused decode step of every cache family at T = 32K (batch 1, 8 KV heads, 32 query heads,
d = 128, no window): what the QJL correction, the whole-head rotation and mixed block
widths cost inside the kernel, against PQO3 and dense NumPy attention, in one group; plus
``cache.decode`` of the best <= 4-bit configuration (:data:`numba_kv.toolkit.bench.BEST_LE4_SPEC`)."""

import numpy as np
import pytest

from numba_kv import AttendConfig
from numba_kv.toolkit.bench import BEST_LE4_SPEC
from numba_kv.toolkit.specs import parse_cache_specs

from ._util import env_info

T, HKV, HQ, D = 32768, 8, 32, 128
MODES = ["dense", "pqo3", "pqo3-head", "pqo3-eden", "pqo2.5", "pqo3.5", "tq3", "pqo-k4v3", BEST_LE4_SPEC]
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
        k, v = out.result.k[0], out.result.v[0]  # [HKV, T, D]
        q = d["q"][0, :, 0].reshape(HKV, HQ // HKV, D)
        s = np.matmul(q, k.transpose(0, 2, 1)) * np.float32(cfg.softmax_scale)
        p = np.exp(s - s.max(-1, keepdims=True))
        return np.matmul(p / p.sum(-1, keepdims=True), v)

    step()  # compile / warm up outside the timed region
    benchmark.group = f"decode-step-T{T}"
    env_info(benchmark, T)
    benchmark.extra_info.update(mode=mode, kv_bytes=cache.memory_usage())
    benchmark.pedantic(step, rounds=5, warmup_rounds=1)
