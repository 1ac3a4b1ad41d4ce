# Two commands do all the set-up on a fresh machine:
#   make run    creates .venv, installs kopt, and runs an optimization of kernels/silu_and_mul
#   make test   creates .venv if needed and runs the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
ROUNDS ?= 5

.PHONY: run test test-fast test-local-model venv clean

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

TEST_WORKERS ?= 3

# Two phases: every test not marked `serial` spread over TEST_WORKERS processes (pytest-xdist; most of
# them wait on servers, timers and child processes, so 3 keep 2 cores busy), then the `serial` ones
# (A/A and cheat verdicts, machine-wide process checks) alone. Both phases run; either failing fails.
define two_phases
	status=0; \
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal -m "not serial and not local_model$(1)" --durations=12 \
		|| status=$$?; \
	$(PY) -m pytest -q -m "serial and not local_model$(1)" --durations=5 || status=$$?; \
	exit $$status
endef

test: $(VENV)/.installed
	$(call two_phases,)

# The inner loop: everything not marked slow (no full optimization runs).
test-fast: $(VENV)/.installed
	$(call two_phases, and not slow)

# Opt-in, outside `make test`: kopt's agents against llama.cpp's server with SmolLM2-135M (builds
# llama-cpp-python[server] from PyPI into its own venv on first use, ~10 min on 2 cores).
test-local-model: $(VENV)/.installed
	bash bench/local_model_smoke.sh

clean:
	rm -rf $(VENV) kopt-report
