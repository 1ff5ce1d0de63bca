"""Golden outputs: every cache family and both attention kernels, bit for bit.

A refactor of the decode path (issue #26: one attention package, plans, state
dictionaries) must not change a single output bit nor a single byte of a cache file.  The
expected values were written by this module at commit 0864022, before that refactor
(``python -m tests.test_golden --write``), into ``tests/golden/``:

- ``cpu.npz``: decode outputs (fused and dequantized), paged and MLA attention, the public
  ops and the compressor's round trips, computed on the CPU twin;
- ``files.json``: a SHA-256 of each cache file ``cache.save`` writes (:func:`file_digest`);
- ``sim.npz``: the CUDA kernels (block, warp, tensor-core and paged variants) run in the
  simulator (``NUMBA_ENABLE_CUDASIM=1``), written by ``--write-sim``.

Every sequence is shorter than one CPU partition (512 tokens), so the CPU results do not
depend on the number of threads.  Float sums may round differently with another SIMD width,
so the CPU outputs are compared bit for bit only on the code-generation target that wrote
them (``files.json["_target"]``), and to 1e-5 elsewhere; the cache files (integer codes,
binary16 scales, float copies of the window) and the simulator's outputs are compared bit for
bit everywhere.  Regenerate only for an intended numerical change, and
say so in the commit.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

import numba_kv as nk
from numba_kv import (
    AttendConfig,
    Dequantized,
    Fused,
    KVCacheCompressor,
    PagedKVCache,
    decode_attention,
    make_cache,
    quantize_blocks,
)

HERE = Path(__file__).parent / "golden"
H, D, G = 2, 64, 2

#: (cache name, options); decoded through ``make_cache``
CACHES: list[tuple[str, dict]] = [(n, {}) for n in nk.CACHE_NAMES] + [
    ("dense", {"dtype": np.float16}),
    ("kv4", {}),
    ("kv5", {}),
    ("pqo3", {"residual_length": 5, "sink_tokens": 2, "window_dtype": "int8", "key_center": True}),
    ("pqo3", {"residual_length": 6, "window_dtype": "float16"}),
    ("pqo3", {"decode_output": "dequantized"}),
    ("pqo-k4v3-head-eden", {"residual_length": 7, "sink_tokens": 2}),
    ("pqo-k5v4-head-eden", {"residual_length": 7, "sink_tokens": 2}),  # 5-bit codes
    ("pqo-k4v2", {}),
    ("pq3-head", {}),
    ("pq3", {"residual_length": 0, "sink_tokens": 0, "key_center": True, "window_dtype": "float32"}),
    ("tq2-head-eden", {}),
    ("tq3", {"residual_length": 6, "sink_tokens": 2}),
    ("tq3", {"decode_output": "dequantized", "qjl_dim": 32, "qjl_seed": 7}),
    ("pqo3", {"layer_overrides": {1: {"bits": 4}}}),  # a MixedCache
]


def _key(name: str, opts: dict) -> str:
    return name + "".join(f"|{k}={getattr(v, '__name__', v)}" for k, v in sorted(opts.items()))


def _rand(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def _arrays(res: object) -> list[np.ndarray]:
    if isinstance(res, Fused):
        return [res.out]
    r = res.result if isinstance(res, Dequantized) else res
    return [np.asarray(a) for a in (r.k, r.v, r.logit_bias) if a is not None]


def _cache_case(name: str, opts: dict) -> tuple[dict[str, np.ndarray], str]:
    """Prefill 37 + 3 tokens (two layers), three decode steps; outputs and file digest."""
    rng = np.random.default_rng(zlib.crc32(_key(name, opts).encode()))
    cache = make_cache(name, num_layers=2, num_kv_heads=H, head_dim=D, **opts)
    att = AttendConfig(D ** -0.5, G)
    out: dict[str, np.ndarray] = {}
    k, v = _rand(rng, 2, H, 40, D), _rand(rng, 2, H, 40, D)
    for layer in range(2):
        cache.prefill(layer, k[:, :, :37], v[:, :, :37])
        cache.prefill(layer, k[:, :, 37:], v[:, :, 37:])
    for step in range(3):
        q, k1, v1 = _rand(rng, 2, H * G, 1, D), _rand(rng, 2, H, 1, D), _rand(rng, 2, H, 1, D)
        for layer in range(2):
            for i, a in enumerate(_arrays(cache.decode(layer, k1, v1, q, att))):
                out[f"{step}.{layer}.{i}"] = a
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "c.safetensors"
        cache.save(path)
        digest = file_digest(path.read_bytes())
    return out, digest


def file_digest(data: bytes) -> str:
    """SHA-256 of a cache file's content: the header as sorted JSON, then the tensor bytes.

    safetensors writes the ``__metadata__`` entries in hash-map order, which changes from
    one process to the next, so the raw bytes of two saves of one cache differ; what they
    say does not."""
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    meta = {k: json.loads(v) if v[:1] in "{[" else v for k, v in header.pop("__metadata__").items()}
    canon = json.dumps({"meta": meta, "tensors": header}, sort_keys=True).encode()
    return hashlib.sha256(canon + data[8 + n:]).hexdigest()


def _ops_cases() -> Iterator[tuple[str, np.ndarray]]:
    """The public op: 2/3/4-bit and mixed widths, exact window, causal q_len 3, bias."""
    rng = np.random.default_rng(11)
    for kb, vb, d in ((2, 2, 64), (3, 3, 64), (4, 4, 128), (4, 2, 64), (3, 3, 256)):
        b, hkv, T, E, ql = 2, 2, 70, 9, 3
        kc, ks = quantize_blocks(_rand(rng, b, hkv, T, d), kb)
        vc, vs = quantize_blocks(_rand(rng, b, hkv, T, d), vb)
        q = _rand(rng, b, 4 * hkv, ql, d)
        kx, vx = _rand(rng, b, hkv, E, d), _rand(rng, b, hkv, E, d)
        bias = _rand(rng, b, 4 * hkv, ql, T + E)
        yield f"op{kb}{vb}d{d}", decode_attention(q, kc, ks, vc, vs, k_bits=kb, v_bits=vb, k_exact=kx,
                                                  v_exact=vx, logit_bias=bias)
        yield f"op{kb}{vb}d{d}nc", decode_attention(q[:, :, :1], kc, ks, vc, vs, k_bits=kb, v_bits=vb,
                                                    causal=False, partition_size=32)


def _paged_cases() -> Iterator[tuple[str, np.ndarray]]:
    for storage in ("float32", "pqo2", "pqo3", "pqo4", "pqo-k4v3"):
        rng = np.random.default_rng(5)
        c = PagedKVCache(num_pages=40, num_layers=1, num_kv_heads=2, head_dim=64, page_size=16, storage=storage)
        seqs = [c.allocate_sequence() for _ in range(3)]
        for s, n in zip(seqs, (5, 40, 100)):
            for chunk in np.array_split(np.arange(n), 2):
                c.append(0, s, _rand(rng, 2, len(chunk), 64), _rand(rng, 2, len(chunk), 64))
        q = _rand(rng, 3, 6, 2, 64)
        yield f"paged-{storage}", c.decode_attention(0, q, seqs[::-1])
        yield f"paged-{storage}-p16", c.decode_attention(0, q[:, :, :1], seqs, partition_size=16)


def _mla_cases() -> Iterator[tuple[str, np.ndarray]]:
    from numba_kv.caches.mla import MLACache, SimpleMLACache

    rng = np.random.default_rng(7)
    h, r, rope, nope, dv = 4, 32, 32, 24, 20
    for storage in ("float32", "pqo3"):
        w_uk = (rng.standard_normal((1, h, r, nope)) / np.sqrt(r)).astype(np.float32)
        w_uv = (rng.standard_normal((1, h, r, dv)) / np.sqrt(r)).astype(np.float32)
        mla = MLACache(8, 1, h, r, rope, nope, dv, w_uk, w_uv, page_size=16, storage=storage)
        s = mla.allocate_sequence()
        mla.append_latent(0, s, _rand(rng, 21, r), _rand(rng, 21, rope))
        q = _rand(rng, h, 2, nope + rope)
        yield f"mla-{storage}", np.asarray(mla.attend(0, s, q, 0.1, causal=True))
    down = (rng.standard_normal((64, 16)) / 8).astype(np.float32)
    up = (rng.standard_normal((16, 64)) / 4).astype(np.float32)
    rk = (rng.standard_normal((16, 64)) / 4).astype(np.float32)
    simple = SimpleMLACache(8, 1, 2, 64, 16, down, up, rk, page_size=4)
    s = simple.allocate_sequence()
    simple.append(0, s, _rand(rng, 2, 9, 64), _rand(rng, 2, 9, 64))
    for i, a in enumerate(simple.get_kv(0, s)):
        yield f"simple-mla-{i}", np.asarray(a)


def _compressor_cases() -> Iterator[tuple[str, np.ndarray]]:
    from numba_kv.compressor import Hybrid, LowRank, VectorQuantization

    rng = np.random.default_rng(3)
    k, v = _rand(rng, 1, 2, 48, 64), _rand(rng, 1, 2, 48, 64)
    for label, method in (("lowrank", LowRank(16)), ("vq", VectorQuantization(64, 8)), ("hybrid", Hybrid(16))):
        comp = KVCacheCompressor(method)
        kk, vv = comp.decompress_kv(comp.compress_kv(k, v))
        yield f"comp-{label}-k", np.asarray(kk)
        yield f"comp-{label}-v", np.asarray(vv)


def cpu_results() -> tuple[dict[str, np.ndarray], dict[str, str]]:
    arrays: dict[str, np.ndarray] = {}
    files: dict[str, str] = {}
    for name, opts in CACHES:
        key = _key(name, opts)
        out, digest = _cache_case(name, opts)
        arrays.update({f"{key}/{k}": a for k, a in out.items()})
        files[key] = digest
    for gen in (_ops_cases, _paged_cases, _mla_cases, _compressor_cases):
        arrays.update(dict(gen()))
    return arrays, files


def sim_results() -> dict[str, np.ndarray]:
    """The CUDA kernels in the simulator: block (d = 256, bias), warp (d = 64, the
    tensor-core builds off: their values were written before head_dim 64 had one) and the
    tensor-core kernel (d = 128, one code width), flat and paged."""
    from numba_kv import knobs
    from numba_kv._backend import to_host
    from tests.conftest import to_device

    out: dict[str, np.ndarray] = {}
    rng = np.random.default_rng(17)
    for kb, vb, d, with_bias in ((3, 3, 128, False), (4, 2, 64, False), (2, 2, 256, True), (4, 4, 128, False)):
        b, hkv, T, E, ql = 1, 2, 80, 5, 1
        kc, ks = quantize_blocks(_rand(rng, b, hkv, T, d), kb)
        vc, vs = quantize_blocks(_rand(rng, b, hkv, T, d), vb)
        q = _rand(rng, b, 4 * hkv, ql, d)
        kx, vx = _rand(rng, b, hkv, E, d), _rand(rng, b, hkv, E, d)
        kw = dict(k_bits=kb, v_bits=vb, k_exact=to_device(kx), v_exact=to_device(vx), partition_size=32)
        if with_bias:
            kw["logit_bias"] = to_device(_rand(rng, b, 4 * hkv, ql, T + E))
        args = [to_device(a) for a in (q, kc, ks, vc, vs)]
        with knobs(cuda_mma_attention=int(d != 64)):
            out[f"sim-op{kb}{vb}d{d}"] = to_host(decode_attention(*args, **kw))
    for storage, d in (("pqo3", 128), ("pqo-k4v3", 64), ("float32", 64)):
        c = PagedKVCache(num_pages=24, num_layers=1, num_kv_heads=2, head_dim=d, page_size=16, storage=storage)
        for n in (20, 70):
            c.append(0, c.allocate_sequence(), to_device(_rand(rng, 2, n, d)), to_device(_rand(rng, 2, n, d)))
        q = _rand(rng, 2, 8, 1, d)
        with knobs(cuda_mma_attention=int(d != 64)):
            out[f"sim-paged-{storage}-d{d}"] = to_host(c.decode_attention(0, to_device(q), partition_size=32))
    return out


def codegen_target() -> str:
    """The CPU that Numba generates code for here, with its feature set (a short digest)."""
    import llvmlite.binding as ll

    name = os.environ.get("NUMBA_CPU_NAME") or ll.get_host_cpu_name()
    feats = os.environ.get("NUMBA_CPU_FEATURES") or ll.get_host_cpu_features().flatten()
    return f"{name}:{hashlib.sha256(feats.encode()).hexdigest()[:12]}"


def _compare(got: dict[str, np.ndarray], want_path: Path, exact: bool = True) -> None:
    with np.load(want_path) as want:
        assert sorted(got) == sorted(want.files)
        if not exact:
            for k in want.files:
                np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
            return
        bad = [k for k in want.files
               if got[k].dtype != want[k].dtype or got[k].shape != want[k].shape
               or got[k].tobytes() != want[k].tobytes()]
        detail = [(k, float(np.nanmax(np.abs(got[k].astype(np.float64) - want[k]))) if got[k].shape == want[k].shape
                   else "shape") for k in bad[:8]]
        assert not bad, f"{len(bad)} outputs differ from the golden values: {detail}"


@pytest.mark.skipif(os.environ.get("NUMBA_ENABLE_CUDASIM") == "1", reason="CPU stage")
def test_cpu_outputs_and_cache_files_are_golden() -> None:
    pytest.importorskip("safetensors")
    arrays, files = cpu_results()
    want = json.loads((HERE / "files.json").read_text())
    _compare(arrays, HERE / "cpu.npz", exact=want.pop("_target") == codegen_target())
    diff = {k: (files.get(k), want[k]) for k in want if files.get(k) != want[k]}
    assert files.keys() == want.keys() and not diff, f"cache files changed: {diff}"


@pytest.mark.cuda
def test_cuda_kernels_are_golden() -> None:
    if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
        pytest.skip("the golden CUDA values are the simulator's")
    _compare(sim_results(), HERE / "sim.npz")


def _write(what: str, make: Callable[[], object]) -> None:
    HERE.mkdir(exist_ok=True)
    if what == "cpu":
        arrays, files = make()
        np.savez_compressed(HERE / "cpu.npz", **arrays)
        files["_target"] = codegen_target()
        (HERE / "files.json").write_text(json.dumps(files, indent=1, sort_keys=True) + "\n")
    else:
        np.savez_compressed(HERE / "sim.npz", **make())


if __name__ == "__main__":
    if "--write" in sys.argv:
        _write("cpu", cpu_results)
    if "--write-sim" in sys.argv:
        _write("sim", sim_results)
