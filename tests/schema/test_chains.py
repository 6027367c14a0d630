"""The chain form's contract on its own (no engine): valid objects pass level 2, single-field
corruptions are rejected naming the field, broken layouts fail the value invariants."""

import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import spec_schema
from spec_schema import ChainVerifyInput, ChainVerifyOutput, SpecContractError
from spec_schema.testing.chains import chain_configs, chain_fields, corrupted_chain_fields, input_from

CLASSES = [ChainVerifyInput, ChainVerifyOutput]


@settings(max_examples=40, deadline=None)
@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
@given(data=st.data())
def test_valid_chain_objects_pass_every_level(cls, data):
    config = data.draw(chain_configs())
    obj = cls(**data.draw(chain_fields(cls, config)))
    spec_schema.check(obj, cls, config, values=True)


@settings(max_examples=60, deadline=None)
@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
@given(data=st.data())
def test_single_field_corruptions_are_rejected_naming_the_field(cls, data):
    name, kind, kw = data.draw(corrupted_chain_fields(cls, chain_configs()))
    with pytest.raises(SpecContractError) as err:
        spec_schema.check(types.SimpleNamespace(**kw), cls, values=False)
    assert err.value.field == name, (kind, str(err.value))


def _input(**changes):
    kw = input_from([[5, 6, 7], [], [8, 9]], [0, 100, 99])
    return types.SimpleNamespace(**{**kw, **changes})


@pytest.mark.parametrize("field, value, text", [
    ("cu_num_sampled", torch.tensor([4, 5, 9]), "cumulative sum of num_drafts_cpu \\+ 1"),
    ("target_logits_index", torch.tensor([0, 1, 2, 6, 5]), "draft j of request r"),
    ("bonus_logits_index", torch.tensor([3, 4, 6]), "last logits row"),
    ("logits_index", torch.tensor([0, 1, 2, 3, 104, 104, 205, 206]), "ascending"),
    ("draft_token", torch.tensor([5, 6, 7, 8, -2]), "outside \\[-1"),
])
def test_broken_layouts_fail_the_value_invariants(field, value, text):
    ok = _input()
    spec_schema.check(ok, ChainVerifyInput, values=True)
    with pytest.raises(SpecContractError, match=f"ChainVerifyInput.{field}: value invariant broken: .*{text}"):
        spec_schema.check(_input(**{field: value}), ChainVerifyInput, values=True)


def test_output_rows_are_tokens_then_padding():
    good = torch.tensor([[1, 2, -1], [3, -1, -1]])
    spec_schema.check(ChainVerifyOutput(good, [2, 0]), ChainVerifyOutput, values=True)
    for bad, text in ((torch.tensor([[1, -1, 2], [3, -1, -1]]), "then -1 padding"),
                      (torch.tensor([[1, 2, -1], [-1, -1, -1]]), "at least one token"),
                      (torch.tensor([[1, 2, -1], [3, 4, -1]]), "more than num_drafts_cpu \\+ 1")):
        with pytest.raises(SpecContractError, match=text):
            spec_schema.check(types.SimpleNamespace(output_tokens=bad, num_drafts_cpu=[2, 0]), ChainVerifyOutput,
                              values=True)
    with pytest.raises(SpecContractError, match="chain_width \\(dim 1\\) expected max_spec_len \\+ 1 = 2"):
        spec_schema.check(types.SimpleNamespace(output_tokens=good, num_drafts_cpu=[1, 0]), ChainVerifyOutput)


def test_idle_chain_objects_have_the_live_ranks_and_dtypes():
    for cls in CLASSES:
        idle = cls.create_idle(None)
        assert len(idle) == 0
        spec_schema.check(idle, cls, values=True)
