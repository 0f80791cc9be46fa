# `make demo` and `make test` each create the environment from nothing (.venv) and run.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo check test bench clean

# pip byte-compiles every module it installs (13,000 files, ~40 s): keep it. With --no-compile and
# PYTHONDONTWRITEBYTECODE=1 (set on this machine) no .pyc is ever written, and every interpreter the
# suite starts (spawned workers, ranks, CLI runs) compiled torch again: `import torch, distshard` 2.5 s -> 5.4 s
$(VENV)/.installed: pyproject.toml requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements-dev.txt
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(PY) -m distshard demo

# lint, format and types (seconds); `make test` runs them before the suite
check: setup
	$(VENV)/bin/ruff check pipes tests benchmarks
	$(VENV)/bin/ruff format --check pipes tests
	$(VENV)/bin/mypy

# the suite on every usable core (pytest-xdist; tests/conftest.py counts them): on CI's 2 cores, two workers;
# worksteal: a worker that runs out takes queued tests from the other (a few tests take a minute)
test: setup check
	$(PY) -m pytest -n auto --dist worksteal

bench: setup
	$(PY) benchmarks/bench_overhead.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .mypy_cache .ruff_cache pipes/*.egg-info
