# Common tasks. CI runs `install`, `lint`, `test` and `test-slow` (see .ci/run).
PYTHON ?= python

.PHONY: install test test-slow lint fix gpu-test bench-kernels bench-e2e

install:            ## the README's install command (CPU build of torch)
	pip install torch==2.13.0 -e ".[dev]"

test:               ## the fast CPU suite (GPU-marked tests skip without a device)
	$(PYTHON) -m pytest -q -m "not slow"

test-slow:          ## the tests marked slow (seconds each on a 2-core CPU); CI runs them after `test`
	$(PYTHON) -m pytest -q -m slow

lint:               ## lint and import order (configured in pyproject.toml)
	ruff check .

fix:                ## apply ruff's safe fixes (import order and the like)
	ruff check --fix .

gpu-test:           ## on a CUDA machine, from the source tree: the GPU-marked tests, in parallel
	PYTHONPATH=. $(PYTHON) -m pytest -q -m gpu -n 8 -p no:cacheprovider

bench-kernels:      ## decode-attention kernels against SDPA (CUDA machine)
	PYTHONPATH=. $(PYTHON) benchmarks/kernels/bench_decode_attention.py

bench-e2e:          ## end-to-end decode of the Mixtral-8x7B shape (CUDA machine)
	PYTHONPATH=. $(PYTHON) benchmarks/e2e/bench_decode.py
