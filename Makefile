# One command to set up and run the demo, one to set up and run the tests.
# Both create .venv on first use; torch is pinned to 2.13.0 (README: which build pip takes).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=

.PHONY: setup demo test lint bench clean redis-server

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

demo: setup
	$(VENV)/bin/prefixserve demo $(ARGS)

test: setup redis-server
	$(PY) -m pytest -q $(ARGS)

# ruff and mypy as configured in pyproject.toml ([tool.ruff], [tool.mypy])
lint: setup
	$(VENV)/bin/ruff check prefixserve tests scripts
	$(VENV)/bin/mypy

redis-server:
	bash scripts/install_redis_server.sh

bench: setup
	$(VENV)/bin/prefixserve bench $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
