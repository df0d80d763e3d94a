# The two front-door commands (see README): `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The repo's operator/ folder would shadow the standard library's `operator` module when
# `python -m` puts the working directory first on sys.path.
export PYTHONSAFEPATH := 1

.PHONY: demo test lint venv

$(STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
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
