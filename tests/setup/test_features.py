"""tests/features.py: a missing optional package skips a test outside CI and fails it under CI."""

import pytest
from tests.features import in_ci, require


@pytest.mark.parametrize(("ci", "outcome"), [("", pytest.skip.Exception), ("0", pytest.skip.Exception),
                                             ("true", pytest.fail.Exception), ("1", pytest.fail.Exception)])
def test_a_missing_package_skips_only_outside_ci(monkeypatch, ci, outcome):
    monkeypatch.setenv("CI", ci)
    assert in_ci() == (outcome is pytest.fail.Exception)
    with pytest.raises(outcome, match="no_such_package_xyz is not importable on this machine"):
        require("no_such_package_xyz")


def test_the_failure_names_the_extra(monkeypatch):
    monkeypatch.setenv("CI", "true")
    monkeypatch.setattr("tests.features.EXTRA_OF", {"no_such_package_xyz": "real"})
    with pytest.raises(pytest.fail.Exception, match=r"CI=true: a missing package fails; install the 'real' extra"):
        require("no_such_package_xyz.sub")


def test_a_present_package_is_returned():
    assert require("json").dumps([1]) == "[1]"
