"""Shared pytest configuration: the contract-test plugin (hypothesis profiles, `spec_config`)."""

import os

import pytest

pytest_plugins = ["spec_schema.testing.plugin"]

# FastOptions.tuning_cache off: a test's setup decisions are its own timings or files, never an earlier
# run's on the machine (tests/runtime/test_fast_path.py turns the cache on where it tests it)
os.environ["SPEC_TUNING_CACHE"] = "0"


@pytest.fixture(autouse=True)
def _device_auto_is_the_cpu(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """`generate` and `train` take a visible GPU by default (`--device auto`); the CLI tests outside
    tests/gpu compare with float32 references on the CPU, so there auto means the CPU on a GPU machine
    too (tests/runtime/test_cli.py tests the rule itself)."""
    if "gpu" in request.keywords:
        return
    try:
        from spec_runtime import defaults
    except ImportError:  # a suite without the runtime installed
        return
    monkeypatch.setattr(defaults, "cuda_visible", lambda: False)
