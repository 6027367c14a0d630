"""Property tests of the contract's configuration: the width rule (the hidden widths a config
implies, against DESIGN.md's table and the historical configs and width pairs), SpecConfig validation
and ModelDims.from_hf_config.
"""

import re
import types

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError
from tests.schema._property_cases import (
    LIVE,
    OPTIONAL_EXTRAS,
    _one_torch_thread,  # noqa: F401 - an autouse fixture: importing it applies it here
    by_algorithm,
    by_batched_class,
    design_width,
    idle_like,
    same_layout,
    signature,
)

from spec_schema import (
    DraftExtendInput,
    DraftInput,
    ModelDims,
    SpecAlgorithm,
    SpecConfig,
    check,
    hidden_width,
)
from spec_schema.testing import HISTORICAL_HIDDEN_PAIRS, example_config, phase_inputs, spec_configs

# ---------------------------------------------------------------------------------------------
# the width rule


@by_algorithm
@given(data=st.data())
def test_width_rule_matches_the_design_table(algorithm, data):
    mismatched = data.draw(st.booleans(), label="mismatched")
    config = data.draw(spec_configs(algorithms=[algorithm], mismatched=mismatched), label="config")
    draft, extend = design_width(config, "draft"), design_width(config, "extend")
    assert (DraftInput.hidden_size_for(config), DraftInput.dtype_for(config)) == draft
    assert (DraftExtendInput.hidden_size_for(config), DraftExtendInput.dtype_for(config)) == extend
    assert (hidden_width(config, "draft").size, hidden_width(config, "extend").size) == (draft[0], extend[0])


def _eagle3(target: int, draft: int, **head) -> SpecConfig:
    return SpecConfig(
        algorithm="EAGLE3",
        target=ModelDims(hidden_size=target, vocab_size=128256, dtype="bfloat16", num_hidden_layers=32),
        draft=ModelDims(
            hidden_size=draft, vocab_size=128256, dtype="float16", draft_vocab_size=32000, **head
        ),
        num_steps=3,
        topk=2,
        num_draft_tokens=6,
    )


@pytest.mark.parametrize(
    ("config", "draft", "extend"),
    [
        (example_config("STANDALONE", target_hidden=4096, draft_hidden=2048), None, None),
        (example_config("EAGLE", target_hidden=4096), 4096, 4096),
        (example_config("EAGLE", target_hidden=4480), 4480, 4480),
        (_eagle3(4096, 2048, target_hidden_size=4096), 2048, 4096 * 3),  # aux count defaults to 3
        (_eagle3(4096, 2048, target_hidden_size=4096, num_aux_hidden_states=4), 2048, 4096 * 4),
        (_eagle3(4096, 2048, target_hidden_size=4096, aux_layer_ids=(1, 30)), 2048, 4096 * 2),
        (_eagle3(4480, 2048, target_hidden_size=4480, aux_layer_ids=(2, 16, 29)), 2048, 4480 * 3),
        (_eagle3(4096, 4096, use_aux_hidden_state=False), 4096, 4096),
    ],
    ids=[
        "standalone",
        "eagle-4096",
        "eagle-4480",
        "eagle3-default-aux",
        "eagle3-4-aux",
        "eagle3-ids",
        "eagle3-head-target-size",
        "eagle3-aux-off",
    ],
)
def test_width_rule_on_the_historical_configs(config, draft, extend):
    assert DraftInput.hidden_size_for(config) == draft
    assert DraftExtendInput.hidden_size_for(config) == extend
    for cls, size in ((DraftInput, draft), (DraftExtendInput, extend)):
        h = cls.create_idle(config).hidden_states
        assert (h is None) if size is None else h.shape == (0, size)


@pytest.mark.parametrize("pair", list(HISTORICAL_HIDDEN_PAIRS.values()), ids=list(HISTORICAL_HIDDEN_PAIRS))
@by_batched_class
@by_algorithm
@given(data=st.data())
def test_historical_pairs_merge_idle_with_live(algorithm, cls, pair, data):
    # An EAGLE head is as wide as its target (SpecConfig rejects the pair, as the engines would).
    eagle = SpecAlgorithm(algorithm) is SpecAlgorithm.EAGLE
    config = example_config(algorithm, target_hidden=pair[0], draft_hidden=None if eagle else pair[1])
    live = data.draw(phase_inputs(cls, config, bs=LIVE), label="live")
    idle = idle_like(cls, config, live)
    for merged in (idle.merge_batch(live), live.merge_batch(idle)):
        same_layout(signature(merged, cls), signature(idle, cls), OPTIONAL_EXTRAS)
        check(merged, cls, config, values=True)
    size, _ = design_width(config, "draft" if cls is DraftInput else "extend")
    assert (idle.hidden_states is None) if size is None else idle.hidden_states.shape[1] == size


# ---------------------------------------------------------------------------------------------
# SpecConfig validation and ModelDims.from_hf_config


def _config(algorithm="EAGLE", target=None, draft=None, **tree) -> SpecConfig:
    tree = {"num_steps": 2, "topk": 2, "num_draft_tokens": 4, **tree}
    return SpecConfig(
        algorithm=algorithm,
        target=target or ModelDims(hidden_size=64, vocab_size=128),
        draft=draft or ModelDims(hidden_size=64, vocab_size=128),
        **tree,
    )


@given(num_steps=st.integers(1, 6), topk=st.integers(2, 5), extra=st.integers(1, 20))
def test_config_rejects_trees_larger_than_the_largest(num_steps, topk, extra):
    limit = 1 + topk + (num_steps - 1) * topk * topk
    _config(num_steps=num_steps, topk=topk, num_draft_tokens=limit)
    message = (
        f"num_draft_tokens {limit + extra} exceeds the largest tree for num_steps {num_steps} and topk {topk}: "
        f"1 + topk + (num_steps - 1) * topk^2 = {limit}"
    )
    with pytest.raises(ValidationError, match=re.escape(message)):
        _config(num_steps=num_steps, topk=topk, num_draft_tokens=limit + extra)


@given(num_steps=st.integers(1, 6), n=st.integers(2, 12))
def test_config_topk_1_is_a_chain_of_num_steps_plus_1(num_steps, n):
    if n == num_steps + 1:
        _config(num_steps=num_steps, topk=1, num_draft_tokens=n)
        return
    message = f"topk 1 means a chain of num_steps + 1 = {num_steps + 1} tokens, but num_draft_tokens is {n}"
    with pytest.raises(ValidationError, match=re.escape(message)):
        _config(num_steps=num_steps, topk=1, num_draft_tokens=n)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_draft_tokens": 1}, "num_draft_tokens must be >= 2 (the root and one draft), got 1"),
        (
            {"draft": ModelDims(hidden_size=32, vocab_size=100)},
            "EAGLE: draft vocab_size 100 differs from the target's 128",
        ),
        (
            {"algorithm": "STANDALONE", "draft": ModelDims(hidden_size=32, vocab_size=151936)},
            "STANDALONE: draft vocab_size 151936 differs from the target's 128",
        ),
        (
            {"target": ModelDims(hidden_size=64, vocab_size=128, draft_vocab_size=64)},
            "draft_vocab_size belongs to the draft (an EAGLE-3 head), not the target",
        ),
        (
            {"algorithm": "STANDALONE", "draft": ModelDims(hidden_size=32, vocab_size=128, draft_vocab_size=64)},
            "STANDALONE drafts score the target vocabulary; draft_vocab_size 64 is only valid for EAGLE3 (d2t) "
            "and EAGLE (a hot-token map)",
        ),
        (
            {
                "algorithm": "EAGLE3",
                "target": ModelDims(hidden_size=64, vocab_size=128, num_hidden_layers=8),
                "draft": ModelDims(hidden_size=32, vocab_size=128, aux_layer_ids=(1, 8)),
            },
            "aux_layer_ids [8] are outside the target's 8 layers",
        ),
        (
            {"draft": ModelDims(hidden_size=32, vocab_size=128)},
            "EAGLE: the draft reads the target's hidden states of width 64 as its own width 32",
        ),
        (
            {
                "algorithm": "EAGLE3",
                "draft": ModelDims(hidden_size=32, vocab_size=128, use_aux_hidden_state=False,
                                   target_hidden_size=64),
            },
            "EAGLE3 (aux off): the draft reads the target's hidden states of width 64 as its own width 32",
        ),
        (
            {"algorithm": "EAGLE3", "draft": ModelDims(hidden_size=32, vocab_size=128, num_aux_hidden_states=2)},
            "EAGLE3: the head (hidden size 32) has no target_hidden_size, so sglang and vLLM size its fc "
            "input as 32 x 2 aux layers, but the target captures 64 x 2; set target_hidden_size=64",
        ),
    ],
    ids=[
        "tiny-tree",
        "draft-vocab",
        "standalone-vocab",
        "target-draft-vocab",
        "eagle-draft-vocab",
        "aux-range",
        "eagle-narrow-head",
        "eagle3-aux-off-narrow-head",
        "eagle3-no-target-hidden-size",
    ],
)
def test_config_messages(kwargs, message):
    with pytest.raises(ValidationError, match=re.escape(message)):
        _config(**kwargs)


TINY_HEAD = ModelDims(hidden_size=32, vocab_size=128, draft_vocab_size=4, target_hidden_size=64)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"algorithm": "EAGLE3", "draft": TINY_HEAD, "num_steps": 1, "topk": 8, "num_draft_tokens": 9},
            "topk 8 exceeds the draft vocabulary of 4 tokens (the draft's draft_vocab_size): "
            "a draft node has at most 4 candidates",
        ),
        (
            {
                "target": ModelDims(hidden_size=64, vocab_size=4),
                "draft": ModelDims(hidden_size=64, vocab_size=4),
                "num_steps": 1, "topk": 5, "num_draft_tokens": 6,
            },
            "topk 5 exceeds the draft vocabulary of 4 tokens (the draft's vocab_size)",
        ),
    ],
    ids=["eagle3-draft-vocab", "eagle-vocab"],
)
def test_config_rejects_topk_over_the_draft_vocab(kwargs, message):
    """Each draft node keeps the topk best of the draft's scores: the config refuses a topk wider than
    the vocabulary the draft scores, before any model is loaded."""
    with pytest.raises(ValidationError, match=re.escape(message)):
        _config(**kwargs)
    _config(**{**kwargs, "topk": 4, "num_draft_tokens": 5})  # the widest topk that fits


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"draft_vocab_size": 200}, "draft_vocab_size 200 exceeds vocab_size 128"),
        (
            {"aux_layer_ids": (1, 2), "num_aux_hidden_states": 3},
            "aux_layer_ids [1, 2] has 2 entries but num_aux_hidden_states is 3",
        ),
        ({"aux_layer_ids": ()}, "aux_layer_ids must not be empty"),
        ({"dtype": "float64"}, "dtype"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"head_dim": 64}, "head_dim"),  # extra keys are forbidden
    ],
    ids=["draft-vocab", "aux-count", "aux-empty", "dtype", "hidden-size", "extra-key"],
)
def test_model_dims_messages(kwargs, message):
    with pytest.raises(ValidationError, match=re.escape(message)):
        ModelDims(**{"hidden_size": 32, "vocab_size": 128, **kwargs})


LLAMA_JSON = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "vocab_size": 128256,
    "torch_dtype": "bfloat16",
}
EAGLE3_JSON = {  # an EAGLE-3 head's config.json: its own width, the target's, a draft vocab, aux layer ids
    "architectures": ["LlamaForCausalLMEagle3"],
    "hidden_size": 2048,
    "num_hidden_layers": 1,
    "vocab_size": 128256,
    "draft_vocab_size": 32000,
    "target_hidden_size": 4096,
    "torch_dtype": "float16",
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 29], "use_aux_hidden_state": True},
}


@pytest.mark.parametrize(
    "wrap",
    [dict, lambda d: types.SimpleNamespace(to_dict=lambda: dict(d)), lambda d: types.SimpleNamespace(**d)],
    ids=["dict", "to_dict", "attributes"],
)
def test_from_hf_config_reads_dicts_and_config_objects(wrap):
    dims = ModelDims.from_hf_config(wrap(LLAMA_JSON))
    assert (dims.hidden_size, dims.vocab_size, dims.num_hidden_layers, dims.dtype) == (
        4096,
        128256,
        32,
        "bfloat16",
    )
    assert dims.torch_dtype is torch.bfloat16
    assert (dims.target_hidden_size, dims.draft_vocab_size, dims.aux_layer_ids) == (None, None, None)
    assert ModelDims.from_hf_config(wrap(LLAMA_JSON), dtype=torch.float16).dtype == "float16"
    assert ModelDims.from_hf_config(wrap({**LLAMA_JSON, "torch_dtype": "float"})).dtype == "float32"


def test_from_hf_config_reads_an_eagle3_head():
    head = ModelDims.from_hf_config(types.SimpleNamespace(to_dict=lambda: dict(EAGLE3_JSON)))
    assert head == ModelDims.from_hf_config(EAGLE3_JSON)
    assert (head.hidden_size, head.target_hidden_size, head.draft_vocab_size) == (2048, 4096, 32000)
    assert head.aux_layer_ids == (1, 15, 29) and head.num_aux == 3 and head.use_aux_hidden_state
    assert head.dtype == "float16"
    config = SpecConfig(
        algorithm="EAGLE3",
        target=ModelDims.from_hf_config(LLAMA_JSON),
        draft=head,
        num_steps=3,
        topk=4,
        num_draft_tokens=16,
    )
    assert config.draft_vocab == 32000 and config.vocab == 128256
    assert DraftInput.hidden_size_for(config) == 2048 and DraftInput.dtype_for(config) is torch.float16
    assert DraftExtendInput.hidden_size_for(config) == 4096 * 3
    assert DraftExtendInput.dtype_for(config) is torch.bfloat16

    two = ModelDims.from_hf_config(
        {**EAGLE3_JSON, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 20]}}
    )
    assert two.num_aux == 2
    off = ModelDims.from_hf_config({**EAGLE3_JSON, "eagle_config": {"use_aux_hidden_state": False}})
    assert not off.use_aux_hidden_state and off.aux_layer_ids is None
    config_off = config.model_copy(update={"draft": off})
    assert DraftExtendInput.hidden_size_for(config_off) == 4096
    counted = ModelDims.from_hf_config({**EAGLE3_JSON, "eagle_config": None, "num_aux_hidden_states": 4})
    assert counted.num_aux == 4



def test_eagle3_head_target_width_must_match_the_target():
    with pytest.raises(ValueError, match="reads a target of hidden size 2048 .* the target's hidden size is 4096"):
        SpecConfig(
            algorithm="EAGLE3",
            target=ModelDims(hidden_size=4096, vocab_size=1000),
            draft=ModelDims(hidden_size=2048, vocab_size=1000, target_hidden_size=2048),
            num_steps=2, topk=2, num_draft_tokens=4,
        )
