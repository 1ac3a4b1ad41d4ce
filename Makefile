# Two commands do all the set-up on a fresh machine:
#   make run    creates .venv, installs kopt, and runs an optimization of kernels/silu_and_mul
#   make test   creates .venv if needed and runs the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
ROUNDS ?= 5

.PHONY: run test test-fast venv clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch: tests and the default run need no CUDA build of it.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

venv: $(VENV)/.installed

run: $(VENV)/.installed
	$(VENV)/bin/kopt optimize kernels/silu_and_mul --target cpu --rounds $(ROUNDS) --report-dir kopt-report

test: $(VENV)/.installed
	$(PY) -m pytest -q --durations=12

# The inner loop: everything not marked slow (no full optimization runs).
test-fast: $(VENV)/.installed
	$(PY) -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) kopt-report
