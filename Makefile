# The two commands: `make run` and `make test`; `make lint` checks style and types. Each installs into .venv first if needed.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: install run test lint sim clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	# torch first, pinned to the CPU build on this machine's disk; nothing may pull a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/kvrelay serve

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/ruff format --check src tests bench
	$(VENV)/bin/mypy

sim: $(STAMP)
	$(VENV)/bin/kvrelay sim --trace data/traces/mooncake_synthetic_trace.jsonl --workers 8 --policy all

clean:
	rm -rf $(VENV) build src/*.egg-info
