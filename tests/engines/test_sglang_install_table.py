"""The boundary table (`_sglang_boundaries`) is what install() wraps and what docs/engines.md shows;
what an installed sglang supports is found by probing, not by its version."""

import sys
import warnings
from pathlib import Path

import pytest

from spec_schema import _strict
from spec_schema.engines import sglang as adapter
from spec_schema.engines._sglang_boundaries import BOUNDARIES, NOT_WRAPPED, boundary_table, probe, resolve
from spec_schema.engines._sglang_install import wrapped
from spec_schema.testing import example_config

DOC = Path(__file__).resolve().parents[2] / "docs" / "engines.md"
CONFIG = example_config("EAGLE")
strict = pytest.mark.skipif(not _strict.LEVEL, reason="install() wraps only under SPEC_STRICT")


def test_the_docs_table_is_the_generated_one():
    doc = DOC.read_text(encoding="utf-8")
    inside = doc.split("<!-- sglang-boundaries:start -->\n")[1].split("\n<!-- sglang-boundaries:end -->")[0]
    assert inside.strip() == boundary_table().strip(), (
        "docs/engines.md's sglang boundary table drifted from _sglang_boundaries: regenerate it with boundary_table()")
    assert len({b.target for b in BOUNDARIES} | {t for t, _ in NOT_WRAPPED}) == len(BOUNDARIES) + len(NOT_WRAPPED)


@strict
def test_on_0_5_23_every_boundary_probes_and_is_wrapped(sg):
    assert [probe(b) for b in BOUNDARIES] == [None] * len(BOUNDARIES)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning: nothing is missing
        adapter.install(CONFIG)
    try:
        unwrapped = [b.short for b in BOUNDARIES if not wrapped(b)]
        assert not unwrapped, f"listed as covered but not wrapped: {unwrapped}"
    finally:
        adapter.uninstall()
    assert not any(wrapped(b) for b in BOUNDARIES)


@strict
@pytest.mark.parametrize("change", ["function gone", "parameter renamed"])
def test_what_this_sglang_lacks_is_named_once_and_the_rest_is_wrapped(sg, monkeypatch, change):
    if change == "function gone":
        monkeypatch.delattr(sg.eagle_utils, "eagle_prepare_for_verify")
        name = "speculative.eagle_utils.eagle_prepare_for_verify (not found"
    else:
        def merge_batch(self, other):  # an sglang that renamed spec_info
            return None

        monkeypatch.setattr(sg.eagle_info.EagleDraftInput, "merge_batch", merge_batch)
        name = "speculative.eagle_info.EagleDraftInput.merge_batch (no parameter spec_info)"
    with pytest.warns(UserWarning) as record:
        adapter.install(CONFIG)
    try:
        ours = [str(w.message) for w in record if "spec_schema" in str(w.message)]
        assert len(ours) == 1 and name in ours[0], ours
        lacking = [b for b in BOUNDARIES if name.split(" (")[0] == b.short]
        assert len(lacking) == 1 and not wrapped(lacking[0])
        assert all(wrapped(b) for b in BOUNDARIES if b not in lacking)
    finally:
        adapter.uninstall()


@strict
def test_install_without_sglang_is_one_line(monkeypatch):
    for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "sglang", None)
    with pytest.raises(ImportError, match=r"^spec_schema\.engines\.sglang\.install: sglang is not importable") as err:
        adapter.install(CONFIG)
    assert "\n" not in str(err.value) and err.value.__cause__ is None and err.value.__suppress_context__
    assert not adapter.installed()


def test_every_target_resolves_to_its_own_definition(sg):
    for b in BOUNDARIES:
        holder, attr, fn = resolve(b.target)
        assert callable(fn) and fn.__name__ == attr, b.short


def test_every_boundary_left_unwrapped_exists_in_0_5_23(sg):
    """The rows the table gives a reason for are real: each is a module or a function of sglang 0.5.23."""
    import importlib.util

    for target, why in NOT_WRAPPED:
        try:
            found = resolve(target)[2]  # a function, a method, or a module already imported
        except (ImportError, AttributeError, KeyError):
            try:
                found = importlib.util.find_spec(target)  # a module (found, not run: some need CUDA to import)
            except ImportError:
                found = None
        assert found is not None, target
        assert why, target
