"""Shared helpers of the contract property tests (test_properties_phases, test_properties_config):
parametrizations, the one-thread fixture, and helpers written from DESIGN.md without using the
library's own rule (the width table, layouts, per-request views, error naming)."""

import dataclasses

import pytest
import torch
from hypothesis import strategies as st

import spec_schema
from spec_schema import (
    PHASE_CLASSES,
    DraftExtendInput,
    DraftInput,
    SpecAlgorithm,
    SpecConfig,
    SpecContractError,
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
