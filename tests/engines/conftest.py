"""Fixtures the sglang test files share."""

import pytest

from spec_schema.engines import sglang as adapter
from spec_schema.testing import example_config

from . import sglang_env as env


@pytest.fixture(scope="module")
def sg():
    """sglang 0.5.23 imported on the CPU (heavy modules faked while it imports), once per test module."""
    with env.loaded() as mods:
        yield mods


@pytest.fixture
def wrapped(sg):
    """sglang with `install()`'s checks in place against an EAGLE config, removed after the test."""
    assert adapter.install(example_config("EAGLE"))
    yield sg
    adapter.uninstall()
