"""Run bug-zoo faults in this process and print one JSON line per fault (see scenario.py).

    python -m tests.bug_zoo.run_fault --models DIR [FAULT ...]     (default: every fault)

The strict level is whatever SPEC_STRICT says for this process: the zoo runs it once with
SPEC_STRICT=1 and once with SPEC_STRICT unset. `--models` is a directory of tiny checkpoints (built
there when missing). Use OMP_NUM_THREADS=1: the models are tiny.
"""

import argparse
import sys

from tests.bug_zoo import scenario


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", required=True, help="directory of the tiny checkpoints (built when missing)")
    parser.add_argument("faults", nargs="*", help="fault names (default: all)")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    names = args.faults or list(scenario.FAULT_CASES)
    unknown = [n for n in names if n not in scenario.FAULT_CASES]
    if unknown:
        parser.error(f"unknown faults {unknown}; known: {sorted(scenario.FAULT_CASES)}")
    models = scenario.Models(scenario.build_models(args.models))
    refs: dict = {}
    for name in names:
        case = scenario.FAULT_CASES[name]
        key = (case.pair, case.num_steps, case.topk, case.num_draft_tokens, case.executor)
        ref = None
        if key not in refs:
            refs[key] = scenario.run_scenario(models, case, None)
        ref = refs.get(key)
        print(scenario.dumps(scenario.run_outcome(models, name, reference=ref)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
