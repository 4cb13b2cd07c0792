#!/usr/bin/env bash
# Install the peer routers that bench/real_routers.py puts in front of the engines, each into a venv of its own
# under DIR (default .venv-routers): SGLang Model Gateway (PyPI smg 1.13.0), vLLM's router (vllm-router 0.1.17)
# and sgl-router (sglang-router 0.3.2). Each is a Rust binary in a wheel (no torch); separate venvs keep their
# Python shims and console scripts from overwriting each other.
set -euo pipefail
dir=${1:-.venv-routers}
install() {  # NAME PACKAGE==VERSION
    local venv="$dir/$1"
    test -x "$venv/bin/python" || python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -q "$2"
}
install smg smg==1.13.0
install vllm-router vllm-router==0.1.17
install sglang-router sglang-router==0.3.2
ls "$dir"/*/bin | grep -E -i 'smg|router' || true
