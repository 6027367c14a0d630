#!/usr/bin/env bash
# Builds the two distributions and runs the schema tests against spec-schema installed ALONE:
#   bash scripts/check_dists.sh OUT
# 1. copies the files git knows (tracked, or new and not ignored: no stale egg-info or build/) under
#    pyproject.toml, MANIFEST.in, README.md, schema/, src/ and tests/ (which no sdist may ship) to OUT/tree;
# 2. `python -m build` makes each sdist, then each wheel FROM its sdist, into OUT/dist;
# 3. a clean venv OUT/venv gets the spec-schema wheel with its `test` extra and nothing of this tree
#    (a CPU torch without CUDA, chosen as scripts/setup_env.sh chooses it: never a CUDA download);
# 4. tests/schema run in that venv from OUT/run, which holds tests/schema, tests/conftest.py, schemas/
#    and pyproject.toml, no src/; OUT/where records the spec_schema module those tests imported (in
#    the venv's site-packages, or the script fails).
# $PYTHON (default .venv/bin/python) needs `build` (spec-runtime's `test` extra).
# tests/setup/test_distributions.py runs this and reads OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:?check_dists.sh: needs a directory OUT for the builds, the clean venv and the test run}"
py="${PYTHON:-.venv/bin/python}"
source scripts/torch_choice.sh
mkdir -p "$out"
out="$(cd "$out" && pwd)"
tmp="$(mktemp -d)"
# pip byte-compiles what it installs (torch: thousands of modules); the few the tests import compile
# when imported. Also for the builds' isolated environments.
export PIP_NO_COMPILE=1
trap 'rm -rf "$tmp"' EXIT

if ! "$py" -c "import build" 2>/dev/null; then
  echo "check_dists.sh: $py cannot import build (pip install build, or the 'test' extra)" >&2
  exit 2
fi
if ! git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  echo "check_dists.sh: $(pwd) is not a git work tree (the sources are the files git knows)" >&2
  exit 2
fi

step() { echo "== $1 ($SECONDS s)"; }

step "sources"
rm -rf "$out/tree" "$out/dist" "$out/venv" "$out/run"
mkdir -p "$out/tree"
git ls-files -z -co --exclude-standard -- pyproject.toml MANIFEST.in README.md schema src tests \
  | tar -c --null -T - | tar -x -C "$out/tree"

step "build: sdist, then wheel from the sdist"
"$py" -m build -o "$out/dist" "$out/tree/schema"
"$py" -m build -o "$out/dist" "$out/tree"
ls "$out/dist"
version="$("$py" -c "import ast, sys; print(next(n.value.value for n in ast.parse(open(sys.argv[1]).read()).body
  if isinstance(n, ast.Assign) and getattr(n.targets[0], 'id', '') == '__version__'))" src/spec_schema/__init__.py)"
wheel="$out/dist/spec_schema-$version-py3-none-any.whl"

step "clean venv: spec-schema[test] alone"
unset PYTHONPATH PYTHONHOME  # nothing of this tree (or of the caller's path) reaches the clean venv
"$py" -m venv "$out/venv"
pip=("$out/venv/bin/python" -m pip)
index=()
args=("$wheel[test]")
if [ "$(torch_device)" = cpu ]; then
  cpu_torch_index
  args+=(-c constraints-cpu.txt)
fi
"${pip[@]}" install -q "${index[@]}" "${args[@]}"

step "tests/schema against the installed wheel"
mkdir -p "$out/run"
# pyproject.toml for the pytest configuration (markers, --strict-markers) only.
git ls-files -z -co --exclude-standard -- pyproject.toml tests/__init__.py tests/conftest.py tests/schema schemas \
  | tar -c --null -T - | tar -x -C "$out/run"
cd "$out/run"
# pytest runs in this process, so the module it leaves in sys.modules is the one the tests imported.
SPEC_STRICT="${SPEC_STRICT:-1}" SPEC_HYPOTHESIS_PROFILE="${SPEC_HYPOTHESIS_PROFILE:-ci}" \
OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" "$out/venv/bin/python" - "$out/where" <<'PY'
import importlib.util
import sys
import sysconfig
from pathlib import Path

import pytest

rc = pytest.main(["-q", "-p", "no:cacheprovider", "tests/schema"])
module = sys.modules["spec_schema"].__file__
Path(sys.argv[1]).write_text(module + "\n")
site = sysconfig.get_paths()["purelib"]
if not module.startswith(site):
    sys.exit(f"check_dists.sh: the schema tests imported spec_schema from {module}, not from {site}")
if importlib.util.find_spec("spec_runtime") is not None:
    sys.exit("check_dists.sh: spec_runtime is importable in the clean venv: spec-schema was not installed alone")
print(f"spec_schema from {module}")
sys.exit(int(rc))
PY
step "done"
