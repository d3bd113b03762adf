# Two entry points on a fresh machine: `make up` (the fleet) and `make test`.
# Both create the venv on first use; torch is pinned first so pip takes the local CPU wheel.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROMPT ?= def parse_args(argv):

.PHONY: install demo up test lint pytest clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

up: install
	$(VENV)/bin/specfleet up $(UP_ARGS)

demo: install
	$(VENV)/bin/specfleet generate "$(PROMPT)" --max-tokens 128

lint: install
	$(VENV)/bin/ruff check gateway workers shared tests
	$(VENV)/bin/mypy gateway workers shared

pytest: install
	$(PY) -m pytest -q

test: lint pytest

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
