#!/usr/bin/env bash
# Creates .venv (if missing) and installs the project with the given extras (`engines`: also sglang and
# vLLM at the versions tests/engines checks, without their dependencies).
# On a machine without CUDA it pins the CPU torch wheel (constraints-cpu.txt), so no CUDA wheels download.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-runtime,test}"
py="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$py" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
cons=()
if ! command -v nvidia-smi >/dev/null 2>&1; then
  cons=(-c constraints-cpu.txt)
  .venv/bin/python -m pip install -q "${cons[@]}" torch==2.13.0
fi
.venv/bin/python -m pip install -q "${cons[@]}" -e ".[${extras}]"
# The engines of tests/engines, without their dependencies (those would pull a CUDA torch); the
# `engines` extra above installed the light modules their imports need. pip's cache keeps the wheels.
if [[ ",${extras}," == *",engines,"* ]]; then
  .venv/bin/python -m pip install -q --no-deps sglang==0.5.23 vllm==0.33.0
fi
