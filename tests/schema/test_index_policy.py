"""Index dtype policies: an engine's int32 ids pass by declaration, nothing else is loosened."""

import pytest
import torch

import spec_schema as ss
from spec_schema.testing import example_config


def _draft_fields(config: ss.SpecConfig, bs: int = 2) -> dict:
    k, w = config.topk, ss.DraftInput.hidden_size_for(config)
    return {
        "topk_p": torch.full((bs, k), 1.0 / k),
        "topk_index": torch.zeros((bs, k), dtype=torch.int64),
        "hidden_states": None if w is None else torch.zeros((bs, w), dtype=ss.DraftInput.dtype_for(config)),
        "bonus_tokens": torch.zeros((bs,), dtype=torch.int32),
        "seq_lens": torch.full((bs,), 5, dtype=torch.int64),
        "req_pool_indices": torch.arange(bs, dtype=torch.int32),
    }


POLICY = ss.IndexPolicy(ss.DraftInput, {"bonus_tokens": torch.int32, "req_pool_indices": torch.int32})


def test_int32_fields_pass_only_when_declared():
    config = example_config("EAGLE")
    view = ss.view_of(ss.DraftInput, _draft_fields(config))
    with pytest.raises(ss.SpecContractError, match=r"DraftInput.bonus_tokens: dtype torch.int32 is not int64"):
        ss.check(view, ss.DraftInput, config)
    ss.check(view, ss.DraftInput, config, index_dtypes=POLICY)


def test_a_policy_is_exact_not_a_widening():
    config = example_config("EAGLE")
    fields = _draft_fields(config)
    fields["bonus_tokens"] = fields["bonus_tokens"].long()  # int64 where the policy declares int32
    with pytest.raises(ss.SpecContractError, match=r"bonus_tokens: dtype torch.int64 is not int32"):
        ss.check(ss.view_of(ss.DraftInput, fields), ss.DraftInput, config, index_dtypes=POLICY)
    both = ss.IndexPolicy(ss.DraftInput, {"bonus_tokens": (torch.int32, torch.int64),
                                          "req_pool_indices": torch.int32})
    ss.check(ss.view_of(ss.DraftInput, fields), ss.DraftInput, config, index_dtypes=both)


def test_other_checks_still_apply_under_a_policy():
    config = example_config("EAGLE")
    fields = _draft_fields(config)
    fields["bonus_tokens"] = torch.zeros((3,), dtype=torch.int32)  # wrong batch
    with pytest.raises(ss.SpecContractError, match=r"bonus_tokens: axis bs \(dim 0\) expected 2"):
        ss.check(ss.view_of(ss.DraftInput, fields), ss.DraftInput, config, index_dtypes=POLICY)


@pytest.mark.parametrize(
    ("dtypes", "message"),
    [
        ({"topk_p": torch.int32}, "not an index field"),
        ({"hidden_states": torch.int64}, "not an index field"),
        ({"nope": torch.int32}, "has no field 'nope'"),
        ({"bonus_tokens": torch.int16}, "only torch.int32 / torch.int64"),
        ({"bonus_tokens.x": torch.int32}, "not a nested phase object"),
    ],
)
def test_a_policy_names_only_index_fields(dtypes, message):
    with pytest.raises(ValueError, match=message):
        ss.IndexPolicy(ss.DraftInput, dtypes)


def test_nested_policy_reaches_the_nested_object():
    config = example_config("STANDALONE")
    out = ss.VerifyOutput.create_idle(config)
    ext = out.draft_extend_input
    ext_fields = {f: getattr(ext, f) for f in ("hidden_states", "input_ids", "positions", "num_correct_drafts",
                                               "num_accept_tokens", "seq_lens", "bonus_tokens",
                                               "req_pool_indices", "num_accept_tokens_cpu")}
    ext_fields["input_ids"] = ext_fields["input_ids"].int()
    fields = {f: getattr(out, f) for f in ("accept_tokens", "accept_indices", "num_correct_drafts",
                                           "num_accept_tokens", "finished")}
    fields["draft_extend_input"] = ss.view_of(ss.DraftExtendInput, ext_fields)
    view = ss.view_of(ss.VerifyOutput, fields)
    with pytest.raises(ss.SpecContractError, match=r"draft_extend_input.input_ids: dtype torch.int32"):
        ss.check(view, ss.VerifyOutput, config)
    policy = ss.IndexPolicy(ss.VerifyOutput, {"draft_extend_input.input_ids": torch.int32})
    ss.check(view, ss.VerifyOutput, config, index_dtypes=policy)
    assert policy.dtypes() == {"draft_extend_input.input_ids": ("int32",)}
    with pytest.raises(TypeError, match="policy for VerifyOutput, not DraftInput"):
        ss.check(view, ss.DraftInput, config, index_dtypes=policy)


def test_check_merge_refuses_mixed_index_dtypes():
    config = example_config("EAGLE")
    left = ss.view_of(ss.DraftInput, _draft_fields(config))
    right_fields = _draft_fields(config)
    ss.check_merge(left, ss.view_of(ss.DraftInput, right_fields), ss.DraftInput)
    right_fields["bonus_tokens"] = right_fields["bonus_tokens"].long()
    with pytest.raises(ss.SpecContractError, match="bonus_tokens is torch.int32 on the left and torch.int64"):
        ss.check_merge(left, ss.view_of(ss.DraftInput, right_fields), ss.DraftInput)


def test_view_of_holds_the_tensors_themselves():
    config = example_config("EAGLE")
    fields = _draft_fields(config)
    view = ss.view_of(ss.DraftInput, fields)
    assert all(getattr(view, k) is v for k, v in fields.items())
    assert view.draft_probs is None
