#!/usr/bin/env bash
# Sets up .venv (CPU torch on machines without CUDA) and runs the demo on tiny models it builds itself.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh runtime
# The demo shows the contract at work: strict level 1 unless the caller chose one.
export SPEC_STRICT="${SPEC_STRICT:-1}"
exec .venv/bin/spec-runtime demo "$@"
