"""The bug zoo: every fault of `spec_runtime.faults.FAULTS`, with and without strict checking.

    python -m tests.bug_zoo.zoo [--models DIR] [--out docs/bug-zoo.md]

Runs `tests.bug_zoo.run_fault` twice, concurrently: once with SPEC_STRICT=1 and once with SPEC_STRICT
unset (the strict level is read at import, so each mode needs its own process), and prints a
markdown table: fault | what it re-injects | SPEC_STRICT=1 | without strict, then `caught N/N`.
`--out` also writes the table, with a short preamble, to a file.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

from tests.bug_zoo import scenario

REPO = Path(__file__).resolve().parents[2]


def subprocess_env(strict: Optional[str]) -> dict[str, str]:
    """The environment of a run_fault process: SPEC_STRICT as given (None: unset), one thread."""
    env = {k: v for k, v in os.environ.items() if k != "SPEC_STRICT"}
    if strict is not None:
        env["SPEC_STRICT"] = strict
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def start(models: Path, strict: Optional[str], faults: Optional[list[str]] = None) -> subprocess.Popen:
    """Start `python -m tests.bug_zoo.run_fault` (returns the process; see `collect`)."""
    cmd = [sys.executable, "-m", "tests.bug_zoo.run_fault", "--models", str(models), *(faults or [])]
    return subprocess.Popen(cmd, cwd=REPO, env=subprocess_env(strict), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def collect(proc: subprocess.Popen, timeout: float = 300) -> dict[str, dict[str, Any]]:
    """Wait for a run_fault process; its outcomes by fault name. Raises with its stderr on failure."""
    out, err = proc.communicate(timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"run_fault exited with {proc.returncode}:\n{err[-4000:]}")
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {r["fault"]: r for r in rows}


def _code(text: str) -> str:
    return "`" + str(text).replace("`", "'").replace("|", "\\|") + "`"


def _short(name: Optional[str]) -> str:
    return (name or "?").rsplit(".", 1)[-1]


def strict_cell(o: dict[str, Any]) -> str:
    if o["outcome"] != "contract":
        return f"**MISSED** ({o['outcome']}): {_code(o.get('message', ''))}"
    at = []
    if o.get("producer"):
        at.append(f"producer `{_short(o['producer'])}`")
    if o.get("consumer"):
        at.append(f"consumer `{_short(o['consumer'])}`")
    if not at:
        at.append(f"`{o['where']}`")
    return (f"**caught** at step {o['step']}, {' / '.join(at)}: field `{o.get('field')}`"
            f"{' (axis `' + o['axis'] + '`)' if o.get('axis') else ''}: {_code(o['message'])}")


def loose_cell(o: dict[str, Any], strict: Optional[dict[str, Any]] = None) -> str:
    kind = o["outcome"]
    if kind in ("crash", "contract"):
        late, d = "", None
        if strict is not None and strict.get("step") is not None:
            d = o["step"] - strict["step"]
            late = f", {d} step{'s' if d != 1 else ''} later than strict" if d > 0 else ", same step as strict"
        if kind == "crash":
            label = "crash"
        else:
            label = ("late error" if d else "error") + " from an always-on schema check"
        return f"**{label}** (step {o['step']}{late}): `{o['type']}` at `{o['where']}`: {_code(o['message'])}"
    if kind == "corrupt":
        return f"**silent corruption**: {o['message']}"
    if kind == "drafts-changed":
        return ("**silent draft corruption**: outputs identical to the fault-free run (verification is "
                "lossless) but the accept lengths differ")
    cost = ""
    if o.get("hidden_allocs") != o.get("ref_hidden_allocs"):
        cost = (f"; it allocated {o['hidden_allocs']} hidden-state tensors "
                f"(fault-free: {o['ref_hidden_allocs']})")
    return f"**silent, no visible effect**: outputs identical to the fault-free run{cost}"


def table(strict: dict[str, dict[str, Any]], loose: dict[str, dict[str, Any]]) -> str:
    """The markdown table and the final `caught N/N` line."""
    faults = scenario.fault_descriptions()
    lines = ["| fault | what it re-injects | SPEC_STRICT=1 | without strict |", "|---|---|---|---|"]
    caught = 0
    for name, what in faults.items():
        s, lo = strict.get(name, {"outcome": "missing", "message": "no result"}), loose.get(name)
        caught += s["outcome"] == "contract"
        case = scenario.FAULT_CASES.get(name)
        config = ""
        if case:
            config = f" ({case.pair}, {case.algorithm}{', executor ' + case.executor if case.executor else ''})"
            if case.with_faults:
                config += " with " + ", ".join(f"`{f}`" for f in case.with_faults)
        lines.append(f"| `{name}`{config} | {what} | {strict_cell(s)} | "
                     f"{loose_cell(lo, s) if lo else 'no result'} |")
    tail = f"caught {caught}/{len(faults)}"
    return "\n".join(lines + ["", tail])


PREAMBLE = """# Bug zoo

Every historical bug class of DESIGN.md ("History this design exists to prevent") is re-injectable
with `spec_runtime.faults.inject(name)`. For each, `python -m tests.bug_zoo.zoo` runs one scenario
on tiny random models whose target and draft widths differ (target 64 wide, 4 layers, vocab 128;
STANDALONE draft 32 wide; EAGLE-3 heads 48 wide with a 96-token draft vocab and 2 or 4 aux layers;
EAGLE-1 heads are target-wide by construction; tree: num_steps 3, topk 2, num_draft_tokens 5;
the three static-buffer faults run with `executor="static"`, the CPU path of the CUDA-graph code):
two requests with staggered finishes, an iteration in which every request finishes (idle inputs),
an idle step, then a new request joining the idle state. Each fault runs once with
`SPEC_STRICT=1` and once with `SPEC_STRICT` unset; "step" counts `engine.step()` calls completed
before the error. `tests/bug_zoo/test_zoo.py` asserts every cell's outcome class, so this table
stays honest when behaviour changes (regenerate it with `--out docs/bug-zoo.md`).

"""


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", help="directory of the tiny checkpoints (default: a temporary one)")
    parser.add_argument("--out", help="also write the table to this markdown file")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bug_zoo_") as tmp:
        models = scenario.build_models(Path(args.models or tmp))
        procs = start(models, "1"), start(models, None)
        strict, loose = collect(procs[0]), collect(procs[1])
    text = table(strict, loose)
    print(text)
    if args.out:
        Path(args.out).write_text(PREAMBLE + text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
