"""The bug zoo as tests: every fault of `spec_runtime.faults.FAULTS` is caught under SPEC_STRICT=1 at
the expected field, and does what the zoo table says without strict checking.

- `test_strict_catches`: the fault's scenario (tests/bug_zoo/scenario.py) in this process, which runs
  with SPEC_STRICT=1 (the suite's setting; without it the strict runs go to a SPEC_STRICT=1
  subprocess instead), must raise `SpecContractError` whose `.field` and message name the field.
- `test_without_strict`: the same scenarios in ONE subprocess with SPEC_STRICT unset (started when the
  module starts, so it runs while the strict tests do), whose outcome class per fault is asserted:
  a crash, an error from the schema's always-on merge/filter checks, silent corruption or no visible
  effect. If behaviour changes, this fails and docs/bug-zoo.md must be regenerated
  (`python -m tests.bug_zoo.zoo --out docs/bug-zoo.md`).
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import spec_schema
from spec_runtime import faults
from spec_schema import SpecContractError
from tests.bug_zoo import scenario, zoo

REPO = zoo.REPO
STATIC_FAULTS = sorted(n for n, c in scenario.FAULT_CASES.items() if c.executor == "static")


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="session")
def zoo_models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return scenario.build_models(tmp_path_factory.mktemp("bug_zoo_models"))


@pytest.fixture(scope="session")
def zoo_models(zoo_models_dir: Path) -> scenario.Models:
    return scenario.Models(zoo_models_dir)


@pytest.fixture(scope="module", autouse=True)
def _loose_process(zoo_models_dir: Path) -> Iterator[dict[str, Any]]:
    """The SPEC_STRICT-unset subprocess, started before the first test of the module."""
    state: dict[str, Any] = {"proc": zoo.start(zoo_models_dir, None)}
    if not spec_schema.STRICT_LEVEL:
        state["strict_proc"] = zoo.start(zoo_models_dir, "1")
    yield state
    for key in ("proc", "strict_proc"):
        proc = state.get(key)
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.communicate()


def _collect(state: dict[str, Any], key: str) -> dict[str, dict[str, Any]]:
    if key + "_out" not in state:
        try:
            state[key + "_out"] = zoo.collect(state[key], timeout=240)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the bug-zoo subprocess ({key}) did not finish in 240 s")
    return state[key + "_out"]


@pytest.fixture
def loose_outcomes(_loose_process: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return _collect(_loose_process, "proc")


# ---- bookkeeping -----------------------------------------------------------------------------------


def test_every_fault_has_a_zoo_case() -> None:
    assert set(scenario.FAULT_CASES) == set(faults.FAULTS), "add a FaultCase for each new fault (and back)"
    for name, case in scenario.FAULT_CASES.items():
        assert case.pair in scenario.MODEL_SETS, name
        assert scenario.ALGORITHM_OF[case.pair] == case.algorithm, name


@pytest.mark.parametrize("fault", sorted(faults.FAULTS))
def test_fault_has_a_site_in_the_runtime(fault: str) -> None:
    src = REPO / "src" / "spec_runtime"
    pattern = re.compile(r"""faults\.active\(\s*["']""" + re.escape(fault) + r"""["']\s*\)""")
    sites = [p for p in src.rglob("*.py") if pattern.search(p.read_text())]
    assert sites, f"no faults.active({fault!r}) site under src/spec_runtime"


@pytest.mark.parametrize("executor", ["eager", "static"])
@pytest.mark.parametrize("pair", scenario.MODEL_SETS)
def test_fault_free_scenario_runs_clean(zoo_models: scenario.Models, pair: str, executor: str) -> None:
    """Control: without a fault, every pair runs the scenario (strict in this suite) and ends whole;
    the static executor gives the eager executor's tokens."""
    case = scenario.FaultCase(pair, scenario.ALGORITHM_OF[pair], "", (), "",
                              executor=None if executor == "eager" else executor)
    result = scenario.run_scenario(zoo_models, case, None)
    assert result.kv_whole
    assert [len(o) for o in result.outputs] == [7, 4, 6]
    assert result.reasons == ["length"] * 3
    assert (result.hidden_allocs == 0) == (pair == "standalone")
    if case.executor:
        eager = scenario.run_scenario(zoo_models, scenario.FaultCase(pair, case.algorithm, "", (), ""), None)
        assert (result.outputs, result.accept_lengths) == (eager.outputs, eager.accept_lengths)


# ---- SPEC_STRICT=1 ---------------------------------------------------------------------------------


def _strict_outcome(fault: str, pair: str | None, zoo_models: scenario.Models,
                    state: dict[str, Any]) -> dict[str, Any]:
    if spec_schema.STRICT_LEVEL:
        return scenario.run_outcome(zoo_models, fault, pair)
    assert pair is None, "extra configurations are checked in-process under SPEC_STRICT=1 only"
    return _collect(state, "strict_proc")[fault]


def _assert_caught(outcome: dict[str, Any], case: scenario.FaultCase) -> None:
    assert outcome["outcome"] == "contract", f"not caught by strict checking: {outcome}"
    assert outcome["type"] == "SpecContractError", outcome
    assert outcome.get("field") == case.strict_field, outcome
    message = outcome["message"]
    assert case.strict_field in message, message
    for word in case.strict_words:
        assert word in message, f"{word!r} not in {message!r}"


@pytest.mark.parametrize("fault", sorted(faults.FAULTS))
def test_strict_catches(fault: str, zoo_models: scenario.Models, _loose_process: dict[str, Any]) -> None:
    case = scenario.FAULT_CASES[fault]
    if spec_schema.STRICT_LEVEL:
        # The exception itself, raised in this process.
        with pytest.raises(SpecContractError) as info:
            scenario.run_scenario(zoo_models, case, fault)
        assert info.value.field == case.strict_field, str(info.value)
        assert case.strict_field in str(info.value)
    _assert_caught(_strict_outcome(fault, None, zoo_models, _loose_process), case)


ALSO = [(f, p) for f, pairs in scenario.ALSO_BITES.items() for p in pairs]


@pytest.mark.skipif(not spec_schema.STRICT_LEVEL, reason="in-process strict checks need SPEC_STRICT=1")
@pytest.mark.parametrize(("fault", "pair"), ALSO, ids=[f"{f}-{p}" for f, p in ALSO])
def test_strict_catches_other_configs(fault: str, pair: str, zoo_models: scenario.Models) -> None:
    """The same faults on other model pairs where they bite: caught at the same field."""
    case = scenario.FAULT_CASES[fault]
    with pytest.raises(SpecContractError) as info:
        scenario.run_scenario(zoo_models, case, fault, pair)
    assert info.value.field == case.strict_field, str(info.value)
    assert case.strict_field in str(info.value)


# ---- SPEC_STRICT unset -----------------------------------------------------------------------------


@pytest.mark.parametrize("fault", sorted(faults.FAULTS))
def test_without_strict(fault: str, loose_outcomes: dict[str, dict[str, Any]]) -> None:
    """What the fault does without the contract (the zoo table's last column), asserted by class."""
    case = scenario.FAULT_CASES[fault]
    outcome = loose_outcomes[fault]
    assert outcome["strict"] == 0, "the subprocess must run with SPEC_STRICT unset"
    assert outcome["outcome"] == case.loose, (
        f"{fault} without strict: expected {case.loose}, got {outcome} "
        "(if the runtime changed, update FAULT_CASES and regenerate docs/bug-zoo.md)")
    text = f"{outcome.get('message', '')} {outcome.get('where', '')}"
    for word in case.loose_words:
        assert word in text, f"{word!r} not in {text!r}"
    if case.loose == "no-effect" and fault == "standalone_captures_hidden":
        # Outputs are identical, but the capture costs memory the draft never reads.
        assert outcome["hidden_allocs"] > 0 == outcome["ref_hidden_allocs"]


def test_zoo_table_lists_every_fault(loose_outcomes: dict[str, dict[str, Any]], zoo_models: scenario.Models,
                                     _loose_process: dict[str, Any]) -> None:
    strict = {f: _strict_outcome(f, None, zoo_models, _loose_process) for f in faults.FAULTS}
    text = zoo.table(strict, loose_outcomes)
    for name in faults.FAULTS:
        assert f"| `{name}`" in text
    n = len(faults.FAULTS)
    assert f"caught {n}/{n}" == text.splitlines()[-1]


def test_docs_table_is_current() -> None:
    """docs/bug-zoo.md has a row per fault and says every fault that ran was caught."""
    doc = REPO / "docs" / "bug-zoo.md"
    assert doc.exists(), "docs/bug-zoo.md is missing: python -m tests.bug_zoo.zoo --out docs/bug-zoo.md"
    text = doc.read_text()
    for name in faults.FAULTS:
        assert f"| `{name}`" in text, f"docs/bug-zoo.md lacks {name}: regenerate it"
    last = [line for line in text.splitlines() if line.startswith("caught ")][-1]
    n, total = map(int, re.match(r"caught (\d+)/(\d+)", last).groups())
    assert n == total
    assert total == len(faults.FAULTS), "a fault is missing from docs/bug-zoo.md: regenerate it"
