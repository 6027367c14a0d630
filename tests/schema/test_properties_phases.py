"""Property tests of the contract on phase objects: idle/live agreement, merge and filter,
corruptions named by check and at construction, value invariants, the host copy of accept counts.

Run with SPEC_STRICT=1 (the project's test command sets it). Assertions that hold at any strict level
go through `spec_schema.check`; those about construction-time checks need SPEC_STRICT and skip
themselves (only them) when it is unset. Example counts come from the hypothesis profile of
`spec_schema.testing.plugin` (`ci`, `dev`, `thorough`).
"""

import dataclasses
import types

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tests.schema._property_cases import (
    _DTYPES,
    LIVE,
    OPTIONAL_EXTRAS,
    STRICT,
    _one_torch_thread,  # noqa: F401 - an autouse fixture: importing it applies it here
    assert_names,
    by_algorithm,
    by_batched_class,
    by_class,
    design_width,
    extras,
    fields_of,
    idle_like,
    needs_strict,
    requests,
    same_layout,
    same_requests,
    signature,
)

import spec_schema
from spec_schema import (
    DraftExtendInput,
    DraftInput,
    SpecAlgorithm,
    SpecContractError,
    VerifyOutput,
    check,
)
from spec_schema.testing import (
    corrupted_inputs,
    example_config,
    phase_inputs,
    spec_configs,
    value_corrupted_inputs,
)

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
