"""Property tests of the contract: idle/live agreement, merge and filter, corruptions, the width rule,
value invariants, SpecConfig validation and ModelDims.from_hf_config.

Run with SPEC_STRICT=1 (the project's test command sets it). Assertions that hold at any strict level
go through `spec_schema.check`; those about construction-time checks need SPEC_STRICT and skip
themselves (only them) when it is unset. Example counts come from the hypothesis profile of
`spec_schema.testing.plugin` (`ci`, `dev`, `thorough`).
"""

import dataclasses
import re
import types

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

import spec_schema
from spec_schema import (
    PHASE_CLASSES,
    DraftExtendInput,
    DraftInput,
    ModelDims,
    SpecAlgorithm,
    SpecConfig,
    SpecContractError,
    VerifyOutput,
    check,
    hidden_width,
)
from spec_schema.testing import (
    HISTORICAL_HIDDEN_PAIRS,
    corrupted_inputs,
    example_config,
    phase_inputs,
    spec_configs,
    value_corrupted_inputs,
)

ALGORITHMS = list(SpecAlgorithm)
BATCHED = [cls for cls in PHASE_CLASSES if hasattr(cls, "merge_batch") and hasattr(cls, "filter_batch")]
STRICT = spec_schema.STRICT_LEVEL
LIVE = st.integers(1, 4)
PER_ROW = {"hidden_states", "input_ids", "positions"}  # DraftExtendInput fields indexed by row, not request
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

by_algorithm = pytest.mark.parametrize("algorithm", ALGORITHMS, ids=lambda a: a.value)
by_class = pytest.mark.parametrize("cls", PHASE_CLASSES, ids=lambda c: c.__name__)
by_batched_class = pytest.mark.parametrize("cls", BATCHED, ids=lambda c: c.__name__)


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """On small CPU boxes torch's intra-op pool makes tiny ops (repeat_interleave: ~8 ms with 2
    threads, 0.05 ms with 1) dominate; these tests only move a few hundred elements."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def needs_strict() -> None:
    if not STRICT:
        pytest.skip("construction-time checks need SPEC_STRICT=1 or 2 (the project's test command sets it)")


# ---------------------------------------------------------------------------------------------
# helpers, written from DESIGN.md without using the library's own rule


def design_width(config: SpecConfig, phase: str) -> tuple:
    """The width table of DESIGN.md: (size, dtype) of the hidden states of `phase` ("draft"/"extend")."""
    if config.algorithm is SpecAlgorithm.STANDALONE:
        return None, None
    if phase == "draft":
        return config.draft.hidden_size, _DTYPES[config.draft.dtype]
    dtype = _DTYPES[config.target.dtype]
    if config.algorithm is SpecAlgorithm.EAGLE:
        return config.target.hidden_size, dtype
    base = config.draft.target_hidden_size or config.target.hidden_size
    if not config.draft.use_aux_hidden_state:
        return base, dtype
    ids = config.draft.aux_layer_ids
    num_aux = len(ids) if ids is not None else (config.draft.num_aux_hidden_states or 3)
    return base * num_aux, dtype


def field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.init]


def signature(obj: object, cls: type) -> dict:
    """Per field: None, (dtype, shape without the leading axis), a nested signature, or a type name."""
    out = {}
    for name in field_names(cls):
        value = getattr(obj, name)
        if isinstance(value, torch.Tensor):
            out[name] = (value.dtype, tuple(value.shape[1:]))
        elif value is None:
            out[name] = None
        elif dataclasses.is_dataclass(value):
            out[name] = signature(value, type(value))
        else:
            out[name] = type(value).__name__
    return out


def same_layout(a: dict, b: dict, optional: frozenset = frozenset()) -> None:
    for name in a:
        if isinstance(a[name], dict) and isinstance(b[name], dict):
            same_layout(a[name], b[name], optional)
        elif not (name in optional and (a[name] is None or b[name] is None)):
            assert a[name] == b[name], f"{name}: {a[name]} vs {b[name]}"


# Optional fields that the width rule does not decide: sampled-chain distributions (the runtime's
# choice) and host copies of counts (kept by merge only when both sides have one).
OPTIONAL_EXTRAS = frozenset({"draft_probs", "num_accept_tokens_cpu"})
RUNTIME_CHOICES = ("draft_probs",)


def extras(obj: object) -> tuple:
    """Which runtime-chosen optional fields (draft_probs) an object carries."""
    return tuple(getattr(obj, name, None) is not None for name in RUNTIME_CHOICES)


def idle_like(cls: type, config: SpecConfig, live: object) -> object:
    """The idle input a runtime that built `live` makes: with draft_probs when it samples chains."""
    if cls is DraftInput and live.draft_probs is not None:
        return cls.create_idle(config, sampled_chain=True)
    return cls.create_idle(config)


def requests(obj: object, cls: type) -> list[dict]:
    """The batch as a list of per-request field dicts (DraftExtendInput: with that request's rows)."""
    bs = len(obj)
    if issubclass(cls, DraftExtendInput):
        counts = obj.num_accept_tokens.tolist()
        starts = [sum(counts[:r]) for r in range(bs)]
    out = []
    for r in range(bs):
        item = {}
        for name in field_names(cls):
            value = getattr(obj, name)
            if value is None:
                item[name] = None
            elif not isinstance(value, torch.Tensor):  # a host copy: one entry per request
                item[name] = value[r]
            elif issubclass(cls, DraftExtendInput) and name in PER_ROW:
                item[name] = value[starts[r] : starts[r] + counts[r]]
            else:
                item[name] = value[r]
        out.append(item)
    return out


def same_requests(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        for name in g:
            if g[name] is None or w[name] is None:
                assert name in OPTIONAL_EXTRAS or (g[name] is None and w[name] is None), name
            elif not isinstance(g[name], torch.Tensor):
                assert g[name] == w[name], name
            else:
                assert g[name].dtype == w[name].dtype and torch.equal(g[name], w[name]), name


def assert_names(err: SpecContractError, cls: type, field: str) -> None:
    assert err.field == field, f"error names {err.field!r}, expected {field!r}: {err}"
    assert field in str(err), str(err)


def fields_of(obj: object, cls: type) -> dict:
    return {name: getattr(obj, name) for name in field_names(cls)}


# ---------------------------------------------------------------------------------------------
# generated objects, idle and live


@by_class
@by_algorithm
@given(data=st.data())
def test_generated_objects_hold_the_contract_and_match_idle(cls, algorithm, data):
    config = data.draw(spec_configs(algorithms=[algorithm]), label="config")
    obj = data.draw(phase_inputs(cls, config), label="obj")
    check(obj, cls, config, values=True)
    idle = cls.create_idle(config)
    assert len(idle) == 0
    check(idle, cls, config, values=True)
    same_layout(signature(obj, cls), signature(idle, cls), OPTIONAL_EXTRAS)
    for phase, h in hidden_states_of(obj) + hidden_states_of(idle):
        size, dtype = design_width(config, phase)
        assert h is None if size is None else (h.shape[1], h.dtype) == (size, dtype)


def hidden_states_of(obj: object) -> list:
    """(phase, hidden_states) of an object and of the phase objects it holds."""
    if isinstance(obj, DraftInput):
        return [("draft", obj.hidden_states)]
    if isinstance(obj, DraftExtendInput):
        return [("extend", obj.hidden_states)]
    if isinstance(obj, VerifyOutput):
        return hidden_states_of(obj.draft_extend_input)
    return []


# ---------------------------------------------------------------------------------------------
# merge and filter


@by_batched_class
@by_algorithm
@given(data=st.data())
def test_merge_idle_and_live_keeps_the_layout(cls, algorithm, data):
    config = data.draw(spec_configs(algorithms=[algorithm]), label="config")
    live_a = data.draw(phase_inputs(cls, config, bs=LIVE), label="live_a")
    # whether drafts carry draft_probs is the runtime's choice (sampled chains), the same for every batch
    live_b = data.draw(
        phase_inputs(cls, config, bs=LIVE).filter(lambda b: extras(b) == extras(live_a)), label="live_b"
    )
    idle = idle_like(cls, config, live_a)
    layout = signature(live_a, cls)
    for left, right in ((idle, live_a), (live_a, idle), (live_a, live_b), (idle, idle)):
        merged = left.merge_batch(right)
        assert type(merged) is cls and len(merged) == len(left) + len(right)
        same_layout(signature(merged, cls), layout, OPTIONAL_EXTRAS)
        if config.algorithm is SpecAlgorithm.STANDALONE:
            assert merged.hidden_states is None
        check(merged, cls, config, values=True)
        same_requests(requests(merged, cls), requests(left, cls) + requests(right, cls))


@by_batched_class
@by_algorithm
@given(data=st.data())
def test_filter_by_mask_and_index_keeps_the_layout(cls, algorithm, data):
    config = data.draw(spec_configs(algorithms=[algorithm]), label="config")
    obj = data.draw(phase_inputs(cls, config), label="obj")
    bs = len(obj)
    mask = data.draw(st.lists(st.booleans(), min_size=bs, max_size=bs), label="mask")
    order = data.draw(st.permutations(range(bs)), label="order")
    index = order[: data.draw(st.integers(0, bs), label="kept")]
    index_dtype = data.draw(st.sampled_from([torch.int64, torch.int32]), label="index dtype")
    keeps = [
        (torch.tensor(mask, dtype=torch.bool), [i for i, m in enumerate(mask) if m]),
        (torch.zeros(bs, dtype=torch.bool), []),  # to empty by mask
        (torch.tensor(index, dtype=index_dtype), index),
        (torch.zeros(0, dtype=torch.int64), []),  # to empty by index
    ]
    if bs:  # (an empty Python list is test_filter_by_empty_python_list)
        keeps.append((mask, [i for i, m in enumerate(mask) if m]))  # a Python bool list
    if index:
        keeps.append((list(index), index))  # a Python index list
    before = requests(obj, cls)
    for keep, kept in keeps:
        out = obj.filter_batch(keep)
        assert type(out) is cls and len(out) == len(kept)
        same_layout(signature(out, cls), signature(obj, cls))
        if config.algorithm is SpecAlgorithm.STANDALONE:
            assert out.hidden_states is None
        check(out, cls, config, values=True)
        same_requests(requests(out, cls), [before[i] for i in kept])


@by_batched_class
def test_filter_by_empty_python_list(cls):
    obj = cls.create_idle(example_config("EAGLE"))
    assert len(obj.filter_batch([])) == 0


@by_batched_class
@by_algorithm
@given(data=st.data())
def test_filter_with_a_wrong_mask_names_keep(cls, algorithm, data):
    config = data.draw(spec_configs(algorithms=[algorithm]), label="config")
    obj = data.draw(phase_inputs(cls, config), label="obj")
    bs = len(obj)
    length = data.draw(st.integers(0, bs + 3).filter(lambda n: n != bs), label="mask length")
    with pytest.raises(SpecContractError, match=r"\bkeep\b") as info:
        obj.filter_batch(torch.ones(length, dtype=torch.bool))
    assert_names(info.value, cls, "keep")
    assert info.value.axis == "bs"
    with pytest.raises(SpecContractError, match=r"\bkeep\b") as info:
        obj.filter_batch(torch.zeros((1, bs), dtype=torch.int64))  # an index must be 1-D
    assert_names(info.value, cls, "keep")


@by_batched_class
@given(data=st.data())
def test_merge_of_other_widths_dtypes_or_algorithms_names_hidden_states(cls, data):
    config = data.draw(spec_configs(algorithms=["EAGLE", "EAGLE3"]), label="config")
    phase = "draft" if cls is DraftInput else "extend"
    change = data.draw(st.sampled_from(["width", "dtype", "standalone"]), label="change")
    if change == "width":  # the historical merge bug: one side sized from the other model
        other = config.model_copy(
            update={
                "target": config.target.model_copy(update={"hidden_size": config.target.hidden_size + 8}),
                "draft": config.draft.model_copy(
                    update={"hidden_size": config.draft.hidden_size + 8, "target_hidden_size": None}
                ),
            }
        )
    elif change == "dtype":
        model = "draft" if phase == "draft" else "target"
        dims = getattr(config, model)
        new = data.draw(st.sampled_from([d for d in _DTYPES if d != dims.dtype]), label="dtype")
        other = config.model_copy(update={model: dims.model_copy(update={"dtype": new})})
    else:
        other = config.model_copy(update={"algorithm": SpecAlgorithm.STANDALONE})
    a = data.draw(phase_inputs(cls, config), label="a")
    b = data.draw(phase_inputs(cls, other), label="b")
    for left, right in ((a, b), (b, a)):
        with pytest.raises(SpecContractError, match="hidden_states") as info:
            left.merge_batch(right)
        assert_names(info.value, cls, "hidden_states")


# ---------------------------------------------------------------------------------------------
# corruptions: strict level 1 must reject each one, naming the field


@by_class
@by_algorithm
@given(data=st.data())
def test_corruption_is_named_by_check(cls, algorithm, data):
    config = data.draw(spec_configs(algorithms=[algorithm]), label="config")
    field, kind, kwargs = data.draw(corrupted_inputs(cls, config), label="corruption")
    obj = types.SimpleNamespace(**kwargs)
    with pytest.raises(SpecContractError) as info:
        check(obj, cls, config)
    assert_names(info.value, cls, field)
    if kind in ("rank", "batch"):  # errors without any config
        with pytest.raises(SpecContractError) as info:
            check(obj, cls)
        assert_names(info.value, cls, field)


@by_class
@by_algorithm
@given(data=st.data())
def test_corruption_is_named_at_construction_or_by_check(cls, algorithm, data):
    needs_strict()
    config = data.draw(spec_configs(algorithms=[algorithm]), label="config")
    field, kind, kwargs = data.draw(corrupted_inputs(cls, config), label="corruption")
    try:
        obj = cls(**kwargs)
    except SpecContractError as err:
        assert_names(err, cls, field)
        return
    # construction knows no config: only config-known widths, dtypes and None-ness pass it
    assert kind in ("width", "dtype", "presence"), f"{kind} corruption of {field} was built"
    with pytest.raises(SpecContractError) as info:
        check(obj, cls, config)
    assert_names(info.value, cls, field)


@by_class
@by_algorithm
@given(data=st.data())
def test_plan_checker_agrees_with_the_jaxtyping_reference(cls, algorithm, data):
    """Without a config, the fast plan-based check and the jaxtyping + beartype reference of the same
    annotations accept and reject the same objects."""
    config = data.draw(spec_configs(algorithms=[algorithm]), label="config")
    reference = spec_schema.reference_checker(cls)
    reference(**fields_of(data.draw(phase_inputs(cls, config), label="valid"), cls))
    field, kind, kwargs = data.draw(corrupted_inputs(cls, config), label="corruption")
    try:
        check(types.SimpleNamespace(**kwargs), cls)
    except SpecContractError:
        with pytest.raises(Exception):  # noqa: B017 - jaxtyping's TypeCheckError or beartype's violation
            reference(**kwargs)
    else:
        reference(**kwargs)


@by_class
@by_algorithm
@given(data=st.data())
def test_value_corruption_is_named_by_value_checks_only(cls, algorithm, data):
    config = data.draw(spec_configs(algorithms=[algorithm]), label="config")
    field, what, kwargs = data.draw(value_corrupted_inputs(cls, config), label="corruption")
    obj = types.SimpleNamespace(**kwargs)
    check(obj, cls, config, values=False)  # level 1 reads no values
    with pytest.raises(SpecContractError, match="value invariant") as info:
        check(obj, cls, config, values=True)
    assert_names(info.value, cls, field)
    if STRICT == 1:
        cls(**kwargs)  # construction at level 1 reads no values either
    elif STRICT == 2:
        try:
            cls(**kwargs)
        except SpecContractError as err:
            assert_names(err, cls, field)
        else:  # only what needs the config (token-id ranges) passes a construction without one
            assert "vocab" in str(info.value), what


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
            {"draft": ModelDims(hidden_size=32, vocab_size=128, draft_vocab_size=64)},
            "EAGLE drafts score the target vocabulary; draft_vocab_size 64 is only valid for EAGLE3",
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


@by_algorithm
@given(data=st.data())
def test_host_copy_of_accept_counts_is_checked_at_level_1(algorithm, data):
    config = data.draw(spec_configs(algorithms=[algorithm]), label="config")
    obj = data.draw(phase_inputs(DraftExtendInput, config, bs=LIVE), label="obj")
    counts = tuple(obj.num_accept_tokens.tolist())
    check(dataclasses.replace(obj, num_accept_tokens_cpu=counts), DraftExtendInput, config)
    drafts_only = tuple(c - 1 for c in counts)  # the bug the check names: drafts-only counts
    for wrong in (drafts_only, counts[:-1], counts + (1,)):
        kwargs = {**fields_of(obj, DraftExtendInput), "num_accept_tokens_cpu": wrong}
        with pytest.raises(SpecContractError) as info:
            check(types.SimpleNamespace(**kwargs), DraftExtendInput, config, values=False)
        assert_names(info.value, DraftExtendInput, "num_accept_tokens")


def test_eagle3_head_target_width_must_match_the_target():
    with pytest.raises(ValueError, match="reads a target of hidden size 2048 .* the target's hidden size is 4096"):
        SpecConfig(
            algorithm="EAGLE3",
            target=ModelDims(hidden_size=4096, vocab_size=1000),
            draft=ModelDims(hidden_size=2048, vocab_size=1000, target_hidden_size=2048),
            num_steps=2, topk=2, num_draft_tokens=4,
        )
