"""The application toolkit around the library: a NumPy LLM with a GGUF loader and tokenizer
(:mod:`numba_kv.toolkit.models`), the real-model evaluation and loss analysis
(:mod:`numba_kv.toolkit.evaluation`), the synthetic demo, benchmarks and the compression-mode
recommendation table, and the ``numba-kv`` command line (:mod:`numba_kv.toolkit.cli`).

The toolkit imports the library; the library never imports the toolkit (``ARCHITECTURE.md``,
enforced by ``tests/test_conventions.py``).  Its third-party dependencies (tqdm, rich,
matplotlib, gguf, tokenizers, ...) come with the ``tools`` extra: ``pip install -e ".[tools]"``.
"""
