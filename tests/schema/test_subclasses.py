"""Subclasses of phase classes (an engine's tag subclass for an MTP variant, say) are checked too."""

import dataclasses
from typing import Optional

import pytest
import torch

import spec_schema
from spec_schema import DraftInput, ModelDims, SpecConfig, SpecContractError, boundary, check

pytestmark = pytest.mark.skipif(spec_schema.STRICT_LEVEL == 0, reason="needs SPEC_STRICT=1 or 2")

CONFIG = SpecConfig(
    algorithm="EAGLE",
    target=ModelDims(hidden_size=64, vocab_size=32, dtype="float32"),
    draft=ModelDims(hidden_size=64, vocab_size=32, dtype="float32"),
    num_steps=2, topk=2, num_draft_tokens=4,
)


@dataclasses.dataclass(frozen=True, eq=False)
class MtpDraftInput(DraftInput):
    """Re-dataclassed tag subclass with an extra field (its own generated __init__)."""

    mtp_layer: Optional[int] = None


class TagDraftInput(DraftInput):
    """A plain tag subclass (inherits the generated __init__)."""


def _fields(bs: int = 2, width: int = 64, index_dtype: torch.dtype = torch.int64) -> dict:
    return dict(
        topk_p=torch.rand(bs, 2),
        topk_index=torch.zeros(bs, 2, dtype=index_dtype),
        hidden_states=torch.zeros(bs, width),
        bonus_tokens=torch.zeros(bs, dtype=torch.int64),
        seq_lens=torch.ones(bs, dtype=torch.int64),
        req_pool_indices=torch.arange(bs),
    )


@pytest.mark.parametrize("cls", [MtpDraftInput, TagDraftInput])
def test_subclass_construction_is_checked(cls):
    cls(**_fields())
    with pytest.raises(SpecContractError, match=rf"{cls.__name__}\.topk_index: dtype torch.int32") as info:
        cls(**_fields(index_dtype=torch.int32))
    assert info.value.field == "topk_index" and info.value.cls_name == cls.__name__


@pytest.mark.parametrize("cls", [MtpDraftInput, TagDraftInput])
def test_subclass_config_widths_are_checked_at_boundaries(cls):
    class Ctx:
        spec_config = CONFIG

    @boundary
    def consume(ctx: Ctx, inp: DraftInput) -> None:
        return None

    consume(Ctx(), cls(**_fields()))
    with pytest.raises(SpecContractError, match=r"hidden_states: axis hidden_draft \(dim 1\) expected 64") as info:
        consume(Ctx(), cls(**_fields(width=48)))
    assert info.value.consumer and info.value.consumer.endswith("consume")
    with pytest.raises(SpecContractError, match="hidden_draft"):
        check(cls(**_fields(width=48)), DraftInput, CONFIG)


def test_subclass_merge_and_filter_keep_the_subclass():
    a, b = MtpDraftInput(**_fields(2)), MtpDraftInput(**_fields(3))
    merged = a.merge_batch(b)
    assert type(merged) is MtpDraftInput and len(merged) == 5
    assert type(merged.filter_batch(torch.tensor([0, 4]))) is MtpDraftInput


def test_subclass_non_tensor_fields_must_agree_to_merge():
    one = MtpDraftInput(**_fields(2), mtp_layer=1)
    assert one.merge_batch(MtpDraftInput(**_fields(1), mtp_layer=1)).mtp_layer == 1
    with pytest.raises(SpecContractError, match=r"mtp_layer differs between the batches \(1 vs 2\)"):
        one.merge_batch(MtpDraftInput(**_fields(1), mtp_layer=2))
