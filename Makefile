# Every target uses the project-local virtualenv at .venv (made by `make install`).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PYTHON := $(BIN)/python
STAMP := $(VENV)/.installed
VENV_XLA := .venv-xla
XLA_STAMP := $(VENV_XLA)/.installed
export OPTIMUM_NEURON_CACHE ?= $(CURDIR)/.cache/optimum-neuron
export TORCHINDUCTOR_CACHE_DIR ?= $(OPTIMUM_NEURON_CACHE)/inductor
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install install-xla demo test test-fast test-xla test-cuda lint docs-check export-fixtures smollm2 clean bench bench-quick

install: $(STAMP)

$(STAMP): pyproject.toml scripts/install.sh
	bash scripts/install.sh $(PY) $(VENV)
	touch $(STAMP)

# The xla backend's own environment (torch 2.9.0 + torch-xla 2.9.0, no vllm): docs/xla.md.
install-xla: $(XLA_STAMP)

$(XLA_STAMP): pyproject.toml scripts/install_xla.sh
	bash scripts/install_xla.sh $(PY) $(VENV_XLA)
	touch $(XLA_STAMP)

# The backend contract suite, the xla tests and docs/xla.md's runnable block on XLA:CPU, in .venv-xla (one pytest
# worker: XLA:CPU compiles on both cores, and two workers measured no faster on a quiet machine).
test-xla: install-xla
	PJRT_DEVICE=CPU $(VENV_XLA)/bin/python -m pytest -q -m xla tests/contract tests/xla
	$(VENV_XLA)/bin/python scripts/docs_check.py --venv $(VENV_XLA) docs/xla.md

# The GPU check (docs/cuda.md): .venv-cuda with CUDA torch, the contract suite and benchmarks on --device cuda.
# Skips (exit 0) where no NVIDIA GPU exists; CI never runs it.
test-cuda:
	bash scripts/test_cuda.sh $(PY) .venv-cuda

smollm2: install
	$(PYTHON) -m optimum.neuron.smollm2 $(OPTIMUM_NEURON_CACHE)/models/smollm2-135m-instruct

demo: install
	$(PYTHON) -m optimum.neuron.demo

test: install lint
	$(PYTHON) -m pytest -q -n 2 --dist loadgroup --durations=40 tests
	$(MAKE) docs-check

docs-check: install
	$(PYTHON) scripts/docs_check.py

test-fast: install
	$(PYTHON) -m pytest -q -n 2 --dist loadgroup -m "not slow" tests

lint: install
	$(BIN)/ruff check optimum tests benchmark scripts
	$(BIN)/ruff format --check optimum tests benchmark scripts
	$(BIN)/mypy -n 2 optimum  # two workers: 92 s cold on 2 cores against 130 s with one

# The serving benchmark (benchmark/README.md). `bench` adds the llama.cpp peer, built from source by pip.
bench: install
	$(PYTHON) -m pip install --quiet -e ".[bench]"
	$(PYTHON) -m benchmark.serve $(ARGS)

bench-quick: install
	$(PYTHON) -m benchmark.serve --quick $(ARGS)

export-fixtures: install
	$(PYTHON) tests/fixtures/llm/export_models.py $(ARGS)

clean:
	rm -rf $(VENV) $(VENV_XLA) .venv-cuda .cache build *.egg-info
