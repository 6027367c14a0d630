#!/usr/bin/env bash
# Sets up .venv (CPU torch on machines without CUDA) and runs the demo on tiny models it builds itself.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh runtime
exec .venv/bin/spec-runtime demo "$@"
