# The two commands: `make run` and `make test`; `make lint` checks style and types. Each installs into .venv first if needed.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# vLLM's CPU build, the runtime's peer and an engine kvrelay's workers can serve through, in a venv of its own.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-stamp
# The real peer routers bench/real_routers.py puts in front of the engines (SGLang Model Gateway, vllm-router,
# sglang-router), one venv each.
ROUTERS_VENV ?= .venv-routers
ROUTERS_STAMP := $(ROUTERS_VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: install vllm routers chromium run test lint sim clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	# torch first, pinned to the CPU build on this machine's disk; nothing may pull a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

$(VLLM_STAMP): scripts/install_vllm.sh scripts/vllm-requirements.txt
	bash scripts/install_vllm.sh $(VLLM_VENV)
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

$(ROUTERS_STAMP): scripts/install_routers.sh
	bash scripts/install_routers.sh $(ROUTERS_VENV)
	touch $(ROUTERS_STAMP)

routers: $(ROUTERS_STAMP)

# Debian's chromium for the status page's browser tests (apt-get, as root, when /usr/bin/chromium is missing).
chromium:
	bash scripts/install_chromium.sh

run: $(STAMP)
	$(VENV)/bin/kvrelay serve

test: $(STAMP) $(VLLM_STAMP) $(ROUTERS_STAMP) chromium
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/ruff format --check src tests bench
	$(VENV)/bin/mypy

sim: $(STAMP)
	$(VENV)/bin/kvrelay sim --trace data/traces/mooncake_synthetic_trace.jsonl --workers 8 --policy all

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(ROUTERS_VENV) build src/*.egg-info
