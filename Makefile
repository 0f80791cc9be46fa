# `make demo` and `make test` each create the environment from nothing (.venv) and run.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test bench clean

$(VENV)/.installed: pyproject.toml requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements-dev.txt
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(PY) -m distshard demo

test: setup
	$(PY) -m pytest

bench: setup
	$(PY) benchmarks/bench_overhead.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis pipes/*.egg-info
