# Two commands on a fresh clone: `make demo` (the main job) and `make test`.
VENV ?= $(if $(SGL_ATOM_VENV),$(SGL_ATOM_VENV),$(CURDIR)/.venv)
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup demo test test-unit test-e2e lint tiny

setup:
	@bash scripts/setup.sh

tiny: setup
	@$(PY) -m sgl_atom.testing.tiny --out .cache/tiny/llama --kind llama

demo: setup
	@$(PY) -m sgl_atom.demo

# unit tests on two workers (they are CPU-bound and independent); the e2e tests share servers
# across a module, so they run in one process
test: setup
	@$(PY) -m pytest tests/unit -q -rs -n 2 --durations=15 $(PYTEST_ARGS)
	@$(PY) -m pytest tests/e2e -q -rs --durations=30 $(PYTEST_ARGS)

test-unit: setup
	@$(PY) -m pytest tests/unit -q -n 2 $(PYTEST_ARGS)

test-e2e: setup
	@$(PY) -m pytest tests/e2e -q -rs $(PYTEST_ARGS)

lint: setup
	@$(PY) -m ruff check sgl_atom kernels tests benchmarks tools
