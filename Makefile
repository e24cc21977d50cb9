# Two entry points for a fresh machine: `make run` (the embedded demo) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test lint bench-engine clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/bouncer serve

test: $(STAMP)
	$(VENV)/bin/ruff check src tests scripts
	$(PY) -m pytest

bench-engine: $(STAMP)
	$(VENV)/bin/bouncer bench engine

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
