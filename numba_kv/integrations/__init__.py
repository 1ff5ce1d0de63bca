"""Adapters that plug numba_kv caches into other inference engines.

Each adapter lives in its own submodule and needs its engine's optional extra; nothing here is
imported by ``import numba_kv``, so the core install never pulls in torch or transformers:

* :mod:`numba_kv.integrations.transformers` — a Hugging Face transformers 5.x ``Cache``
  (extra ``hf``: ``pip install numba-kv[hf]``).

The integrations are library code, not toolkit: they wrap the library's caches for another
engine's API and use only public library names; they never import :mod:`numba_kv.toolkit`
(its NumPy model, GGUF loader and command line are not needed to run a model in transformers).
"""
