"""The engine-import helper: a missing engine skips the test, except under CI, where it fails it."""

import pytest

from .engine_import import engine_missing, import_sglang
from .sglang_env import FAKE_MODULES


@pytest.mark.parametrize(("ci", "outcome"), [("", pytest.skip.Exception), ("false", pytest.skip.Exception),
                                             ("true", pytest.fail.Exception), ("1", pytest.fail.Exception)])
def test_missing_engine_skips_only_outside_ci(monkeypatch, ci, outcome):
    monkeypatch.setenv("CI", ci)
    with pytest.raises(outcome, match="no_such_engine is not importable"):
        engine_missing("no_such_engine", "ModuleNotFoundError")


def test_import_failure_goes_through_the_helper(monkeypatch):
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="sglang is not importable.*'sglang.no_such_module'"):
        import_sglang("sglang.no_such_module")


def test_fakes_are_gone_after_the_import():
    import sys

    import_sglang("sglang.srt.speculative.spec_info")
    assert not [m for m in FAKE_MODULES if type(sys.modules.get(m)).__name__ == "_FakeModule"]
