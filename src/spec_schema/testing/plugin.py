"""Opt-in pytest plugin for contract tests: `pytest -p spec_schema.testing.plugin`.

Or in a conftest.py: `pytest_plugins = ["spec_schema.testing.plugin"]`. It is not registered as a
`pytest11` entry point, so installing spec_schema never loads hypothesis or changes anyone's tests.

Hypothesis profiles (all with `deadline=None`: torch's first calls are slow):

| profile    | examples | notes                                              |
|------------|----------|----------------------------------------------------|
| `ci`       | 10       | derandomized, no example database, prints the blob |
| `dev`      | 50       | random, with the local example database            |
| `thorough` | 1000     | random, for nightly runs                           |

The profile comes from `--spec-profile`, else `--hypothesis-profile` (left to hypothesis), else the
environment variable `SPEC_HYPOTHESIS_PROFILE`, else `dev`. CI jobs name theirs (`SPEC_HYPOTHESIS_PROFILE=ci`
or `--spec-profile ci`); the plugin does not guess from `CI`.

Fixture `spec_config`: a small `SpecConfig` with mismatched target/draft widths and dtypes,
parametrized over the three algorithms (test ids `EAGLE`, `EAGLE3`, `STANDALONE`).
"""

import os
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.errors import InvalidArgument

from .. import SpecAlgorithm, SpecConfig
from .strategies import example_config

PROFILES = ("ci", "dev", "thorough")
ENV_VAR = "SPEC_HYPOTHESIS_PROFILE"

_COMMON: dict[str, Any] = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}
settings.register_profile("ci", max_examples=10, derandomize=True, database=None, print_blob=True, **_COMMON)
settings.register_profile("dev", max_examples=50, **_COMMON)
settings.register_profile("thorough", max_examples=1000, **_COMMON)


def default_profile() -> str:
    """The profile used without `--spec-profile`: $SPEC_HYPOTHESIS_PROFILE, else `dev`."""
    return os.environ.get(ENV_VAR, "").strip() or "dev"


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("spec_schema", "spec_schema contract tests")
    group.addoption(
        "--spec-profile",
        choices=PROFILES,
        default=None,
        help=f"hypothesis profile for contract tests (default: ${ENV_VAR}, else 'dev')",
    )


def pytest_configure(config: Any) -> None:
    name = config.getoption("--spec-profile", default=None)
    if name is None and config.getoption("--hypothesis-profile", default=None):
        return  # hypothesis's own plugin loads the profile that was asked for
    name = name or default_profile()
    try:
        settings.load_profile(name)
    except InvalidArgument:
        raise pytest.UsageError(
            f"{ENV_VAR}={name!r} is not a hypothesis profile; use one of {', '.join(PROFILES)}"
        ) from None


def pytest_report_header(config: Any) -> str:
    return f"spec_schema: hypothesis profile {settings.get_current_profile_name()!r}"


@pytest.fixture(params=list(SpecAlgorithm), ids=lambda a: a.value)
def spec_config(request: Any) -> SpecConfig:
    """A small config per algorithm: target 64 wide in float32, draft 32 wide in bfloat16, vocab 128,
    num_steps 3, topk 2, num_draft_tokens 6; EAGLE-3 heads read 3 aux layers and score 64 tokens."""
    return example_config(request.param)
