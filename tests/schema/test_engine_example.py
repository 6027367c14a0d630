"""The worked example of docs/testing-for-engines.md: an engine checks its own draft-input class.

`EngineDraftInput` stands in for an engine's class (sglang's `EagleDraftInput` is shaped like it): its
own field names (`verified_id` for `bonus_tokens`, `spec_hidden` for `hidden_states`), engine-only
state, and its own idle builder, merge and filter. `MAPPING` tells `spec_schema.check` which of its
attributes holds which contract field; errors still name the contract field.
"""

import dataclasses
from dataclasses import dataclass
from typing import Optional

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from spec_schema import DraftInput, SpecAlgorithm, SpecConfig, SpecContractError, check
from spec_schema.testing import corrupted_inputs, phase_fields, plugin, spec_configs

MAPPING = {
    "bonus_tokens": "verified_id",
    "hidden_states": "spec_hidden",
}  # contract field -> engine attribute


@dataclass
class EngineDraftInput:
    """An engine's decode-phase draft input, with its own names and extra state."""

    topk_p: Tensor
    topk_index: Tensor
    spec_hidden: Optional[Tensor]
    verified_id: Tensor
    seq_lens: Tensor
    req_pool_indices: Tensor
    capture_hidden_mode: str = "last"  # engine-only state: the contract ignores it

    @classmethod
    def create_idle_input(cls, config: SpecConfig) -> "EngineDraftInput":
        """Idle input with the width rule's width and dtype (never `config.target.hidden_size`)."""
        width, dtype = DraftInput.hidden_size_for(config), DraftInput.dtype_for(config)
        return cls(
            topk_p=torch.zeros((0, config.topk), dtype=torch.float32),
            topk_index=torch.zeros((0, config.topk), dtype=torch.int64),
            spec_hidden=None if width is None else torch.zeros((0, width), dtype=dtype),
            verified_id=torch.zeros((0,), dtype=torch.int64),
            seq_lens=torch.zeros((0,), dtype=torch.int64),
            req_pool_indices=torch.zeros((0,), dtype=torch.int64),
        )

    def merge_batch(self, other: "EngineDraftInput") -> "EngineDraftInput":
        def cat(a: Optional[Tensor], b: Optional[Tensor]) -> Optional[Tensor]:
            return None if a is None and b is None else torch.cat([a, b])

        return EngineDraftInput(**{name: cat(getattr(self, name), getattr(other, name)) for name in TENSORS})

    def filter_batch(self, keep: Tensor) -> "EngineDraftInput":
        return EngineDraftInput(
            **{name: None if (v := getattr(self, name)) is None else v[keep] for name in TENSORS}
        )


TENSORS = [f.name for f in dataclasses.fields(EngineDraftInput) if f.name != "capture_hidden_mode"]
REVERSE = {ours: contract for contract, ours in MAPPING.items()}
CONTRACT_FIELDS = {REVERSE.get(name, name) for name in TENSORS}  # the DraftInput fields the engine carries


def buggy_idle_input(config: SpecConfig) -> EngineDraftInput:
    """The historical bug: an idle placeholder sized (and typed) from the target model."""
    good = EngineDraftInput.create_idle_input(config)
    wrong = torch.zeros((0, config.target.hidden_size), dtype=config.target.torch_dtype)
    return dataclasses.replace(good, spec_hidden=wrong)


def to_engine(fields: dict) -> EngineDraftInput:
    """Build the engine's class from `phase_fields(DraftInput, ...)` (contract names -> engine names)."""
    return EngineDraftInput(**{MAPPING.get(k, k): v for k, v in fields.items() if k in CONTRACT_FIELDS})


def check_engine(obj: EngineDraftInput, config: SpecConfig, values: bool = True) -> None:
    check(obj, DraftInput, config, mapping=MAPPING, values=values)


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---------------------------------------------------------------------------------------------
# the example


@given(data=st.data())
def test_engine_inputs_hold_the_contract(data):
    config = data.draw(spec_configs(), label="config")
    live = to_engine(data.draw(phase_fields(DraftInput, config, bs=st.integers(1, 4)), label="live"))
    idle = EngineDraftInput.create_idle_input(config)
    for obj in (live, idle, idle.merge_batch(live), live.merge_batch(idle), live.merge_batch(live)):
        check_engine(obj, config)
    keep = torch.tensor(
        data.draw(st.lists(st.booleans(), min_size=len(live.seq_lens), max_size=len(live.seq_lens)))
    )
    check_engine(live.filter_batch(keep), config)
    check_engine(live.filter_batch(torch.zeros_like(keep)), config)


def test_idle_input_sized_from_the_wrong_model_is_caught(spec_config):
    check_engine(EngineDraftInput.create_idle_input(spec_config), spec_config)
    with pytest.raises(SpecContractError, match=r"DraftInput\.hidden_states") as info:
        check_engine(buggy_idle_input(spec_config), spec_config)
    assert info.value.field == "hidden_states"  # the contract's name, not `spec_hidden`
    if spec_config.algorithm is SpecAlgorithm.STANDALONE:
        assert "must be None" in str(info.value)
    else:  # the message says which width was expected and where it came from
        assert f"draft hidden size {spec_config.draft.hidden_size}" in str(info.value)


@given(data=st.data())
def test_engine_corruptions_are_named_by_contract_field(data):
    config = data.draw(spec_configs(), label="config")
    field, kind, kwargs = data.draw(
        corrupted_inputs(DraftInput, config).filter(lambda c: c[0] in CONTRACT_FIELDS), label="corruption"
    )
    with pytest.raises(SpecContractError) as info:
        check_engine(to_engine(kwargs), config, values=False)
    assert info.value.field == field, f"{kind} corruption of {field}: {info.value}"


def test_engine_value_invariants(spec_config):
    width, dtype = DraftInput.hidden_size_for(spec_config), DraftInput.dtype_for(spec_config)
    live = EngineDraftInput(
        topk_p=torch.full((1, spec_config.topk), 0.5),
        topk_index=torch.zeros((1, spec_config.topk), dtype=torch.int64),
        spec_hidden=None if width is None else torch.zeros((1, width), dtype=dtype),
        verified_id=torch.tensor([spec_config.vocab]),  # one past the vocabulary
        seq_lens=torch.tensor([7]),
        req_pool_indices=torch.tensor([0]),
    )
    check_engine(live, spec_config, values=False)  # shapes, dtypes, widths: fine
    with pytest.raises(SpecContractError, match="value invariant") as info:
        check_engine(live, spec_config, values=True)
    assert info.value.field == "bonus_tokens"


# ---------------------------------------------------------------------------------------------
# the plugin the example runs under


def test_profile_selection(monkeypatch, request):
    monkeypatch.delenv(plugin.ENV_VAR, raising=False)
    monkeypatch.setenv("CI", "true")  # CI jobs name their profile; the plugin does not guess from CI
    assert plugin.default_profile() == "dev"
    monkeypatch.setenv(plugin.ENV_VAR, "ci")
    assert plugin.default_profile() == "ci"
    monkeypatch.setenv(plugin.ENV_VAR, "thorough")
    assert plugin.default_profile() == "thorough"
    ci = settings.get_profile("ci")
    assert ci.derandomize and ci.database is None and ci.deadline is None and ci.max_examples <= 20
    assert settings.get_profile("dev").max_examples == 50
    assert settings.get_profile("thorough").max_examples == 1000
    if not request.config.getoption("--hypothesis-profile", default=None):
        assert settings.get_current_profile_name() in plugin.PROFILES


def test_spec_config_fixture_covers_every_algorithm(spec_config, request):
    assert spec_config.algorithm.value == request.node.callspec.id
    # An EAGLE head is as wide as its target (SpecConfig rejects anything else, as the engines would).
    same_width = spec_config.algorithm.value == "EAGLE"
    assert (spec_config.target.hidden_size == spec_config.draft.hidden_size) is same_width
    assert spec_config.target.dtype != spec_config.draft.dtype
