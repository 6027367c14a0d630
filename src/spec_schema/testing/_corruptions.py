"""Corrupted phase objects of `spec_schema.testing.strategies` (the public module, which documents
them): `corrupted_inputs` (what strict level 1 must catch) and `value_corrupted_inputs` (what only the
value invariants catch).
"""

from collections.abc import Mapping
from typing import Any

import torch
from hypothesis import strategies as st
from torch import Tensor

from .. import DraftExtendInput, DraftInput, SpecConfig, VerifyInput, VerifyOutput
from .._plan import FieldPlan, plan_for
from ._configs import (
    _BATCH_AXES,
    _CORRUPT_SIZES,
    _LIVE_SIZES,
    CORRUPTION_KINDS,
    ConfigLike,
    IntLike,
)
from ._phases import _resolve, phase_fields

# ---------------------------------------------------------------------------------------------
# corruptions that strict level 1 must catch


_NATURAL_WRONG_DTYPES = {
    torch.int64: (torch.int32,),
    torch.int32: (torch.int64,),
    torch.bool: (torch.uint8, torch.int64),
    torch.float32: (torch.float64, torch.bfloat16),
}


def _resize(t: Tensor, dim: int, size: int) -> Tensor:
    old = t.shape[dim]
    if size <= old:
        return t.narrow(dim, 0, size).clone()
    pad = list(t.shape)
    pad[dim] = size - old
    return torch.cat([t, torch.zeros(pad, dtype=t.dtype)], dim)


def _occurrences(plan: Any, fields: Mapping[str, Any]) -> dict[str, list[tuple[str, int]]]:
    """For each axis, the (field, dim) pairs that carry it, in the order a check binds them."""
    seen: dict[str, list[tuple[str, int]]] = {}
    for f in plan.fields:
        if f.kind == "tensor" and fields.get(f.name) is not None:
            for i, axis in enumerate(f.axes):
                seen.setdefault(axis, []).append((f.name, i))
    return seen


def _wrong_widths(config: SpecConfig, cls: type, axis: str, size: int) -> list[int]:
    """The widths of the historical confusions (the other model's width, hidden_size x 3, ...)."""
    if axis not in ("hidden_draft", "hidden_extend"):
        return []
    t, d = config.target.hidden_size, config.draft.hidden_size
    head = config.draft.target_hidden_size or t
    options = {t, d, 3 * t, 3 * d, head * config.draft.num_aux, t * config.draft.num_aux}
    return sorted(w for w in options if w != size)


def _options(cls: type, config: SpecConfig, fields: Mapping[str, Any]) -> list[tuple[str, str, Any]]:
    """Every (field, kind, detail) corruption that is an error naming that field.

    Resizing an axis is only offered where a check blames the resized field: when an earlier field
    (or an earlier dim of the same field) binds the axis, or when the axis is config-known and no
    other field carries it. (Resizing the first binder of a shared axis makes a check without
    config blame the *next* field that carries it.)
    """
    plan = plan_for(cls)
    seen = _occurrences(plan, fields)
    known = set(cls._config_axes(config))  # type: ignore[attr-defined]
    out: list[tuple[str, str, Any]] = []
    for f in plan.fields:
        value = fields.get(f.name)
        if f.name == "hidden_states" and hasattr(cls, "hidden_size_for"):
            out.append((f.name, "presence", None))
        if f.kind != "tensor" or value is None:
            continue
        for i, axis in enumerate(f.axes):
            where = seen[axis]
            earlier = where.index((f.name, i)) > 0
            alone = axis in known and len(where) == 1
            if earlier or alone:
                out.append((f.name, "batch" if axis in _BATCH_AXES else "width", (i, axis)))
        out.append((f.name, "dtype", None))
        out.append((f.name, "rank", None))
    return out


def _rows_of(cls: type, fields: Mapping[str, Any]) -> int:
    """Rows of the hidden states: bs for the decode phase, num_accepted for the extend phase."""
    return int(fields["input_ids"].shape[0] if "input_ids" in fields else fields["seq_lens"].shape[0])


def _corrupt(
    draw: Any, cls: type, config: SpecConfig, fields: Mapping[str, Any], option: tuple[str, str, Any]
) -> Any:
    name, kind, detail = option
    value = fields[name]
    f: FieldPlan = next(p for p in plan_for(cls).fields if p.name == name)
    if kind == "presence":
        if value is not None:
            return None
        width = draw(st.sampled_from([config.target.hidden_size, config.draft.hidden_size]))
        return torch.zeros((_rows_of(cls, fields), width), dtype=config.target.torch_dtype)
    if kind == "dtype":
        wrong = list(_NATURAL_WRONG_DTYPES.get(value.dtype, ()))
        if len(f.dtypes) > 1:  # a hidden state: any float the annotation allows but the width rule does not
            wrong = [torch.float64] + [d for d in sorted(f.dtypes, key=str) if d != value.dtype]
        return value.to(draw(st.sampled_from(wrong)))
    if kind == "rank":
        if draw(st.booleans()):
            return value.unsqueeze(-1)
        if value.shape[-1]:
            return value.narrow(-1, 0, 1).squeeze(-1).clone()
        return value.new_zeros(value.shape[:-1])
    dim, axis = detail
    size = value.shape[dim]
    deltas = st.integers(-min(size, 8), 8).filter(lambda d: d != 0)
    resized = deltas.map(lambda d: size + d)
    wrong_models = _wrong_widths(config, cls, axis, size)
    new = draw(st.one_of(st.sampled_from(wrong_models), resized) if wrong_models else resized)
    return _resize(value, dim, new)


@st.composite
def corrupted_inputs(
    draw: Any, cls: type, config: ConfigLike, bs: IntLike = _CORRUPT_SIZES
) -> tuple[str, str, dict[str, Any]]:
    """`(field, kind, kwargs)`: valid constructor arguments with exactly one tensor field broken.

    `kind` is one of `CORRUPTION_KINDS`. Every corruption is an error that names `field`:
    constructing `cls(**kwargs)` under SPEC_STRICT raises a `SpecContractError` for it, or (widths,
    dtypes and presence that only the config knows) `spec_schema.check(obj, cls, config)` does.
    `check(types.SimpleNamespace(**kwargs), cls, config)` raises for every kind at any strict level.
    """
    config = _resolve(draw, config)
    fields = draw(phase_fields(cls, config, bs=bs))
    options = _options(cls, config, fields)
    kind = draw(st.sampled_from([k for k in CORRUPTION_KINDS if any(o[1] == k for o in options)]))
    option = draw(st.sampled_from([o for o in options if o[1] == kind]))
    broken = dict(fields)
    broken[option[0]] = _corrupt(draw, cls, config, fields, option)
    return option[0], option[1], broken


# ---------------------------------------------------------------------------------------------
# corruptions that only the value invariants (strict level 2, or check(values=True)) catch


def _set(t: Tensor, index: Any, value: Any) -> Tensor:
    t = t.clone()
    t[index] = value
    return t


def _value_corruptions(
    draw: Any, cls: type, config: SpecConfig, kw: dict[str, Any]
) -> list[tuple[str, str, dict]]:
    """(named field, what is broken, changed fields) for a live (bs >= 1) field dict."""
    bs = len(kw["seq_lens"]) if "seq_lens" in kw else len(kw["finished"])
    b = draw(st.integers(0, bs - 1))
    if issubclass(cls, DraftInput):
        return [
            (
                "topk_p",
                "a probability outside [0, 1]",
                {"topk_p": _set(kw["topk_p"], (b, 0), draw(st.sampled_from([1.5, -0.25, float("nan")])))},
            ),
            (
                "topk_index",
                "a token id >= vocab",
                {"topk_index": _set(kw["topk_index"], (b, 0), config.vocab)},
            ),
            ("bonus_tokens", "a negative token id", {"bonus_tokens": _set(kw["bonus_tokens"], b, -1)}),
            ("seq_lens", "a negative length", {"seq_lens": _set(kw["seq_lens"], b, -1)}),
        ]
    if issubclass(cls, VerifyInput):
        n = config.num_draft_tokens
        i = draw(st.integers(0, n - 1))
        return [
            (
                "retrieve_index",
                "a wrong global row",
                {"retrieve_index": _set(kw["retrieve_index"], (b, i), kw["retrieve_index"][b, i] + 1)},
            ),
            (
                "retrieve_next_token",
                "a link to the node itself",
                {"retrieve_next_token": _set(kw["retrieve_next_token"], (b, i), i)},
            ),
            (
                "retrieve_next_sibling",
                "a link past the tree",
                {"retrieve_next_sibling": _set(kw["retrieve_next_sibling"], (b, i), n)},
            ),
            (
                "tree_mask",
                "a node that does not attend itself",
                {"tree_mask": _set(kw["tree_mask"], (b, i, i), False)},
            ),
            (
                "positions",
                "a root position != seq_lens",
                {"positions": _set(kw["positions"], (b, 0), kw["positions"][b, 0] + 1)},
            ),
            (
                "draft_token",
                "a token id >= vocab",
                {"draft_token": _set(kw["draft_token"], (b, i), config.vocab)},
            ),
        ]
    if issubclass(cls, DraftExtendInput):
        a = kw["num_accept_tokens"]
        last = int(torch.cumsum(a.long(), 0)[b]) - 1
        row = draw(st.integers(0, len(kw["positions"]) - 1))
        return [
            (
                "num_accept_tokens",
                "num_accept_tokens = num_correct_drafts",
                {"num_accept_tokens": kw["num_correct_drafts"].clone()},
            ),
            (
                "bonus_tokens",
                "a bonus token != the last input id",
                {"bonus_tokens": _set(kw["bonus_tokens"], b, kw["input_ids"][last] + 1)},
            ),
            (
                "positions",
                "a shifted row position",
                {"positions": _set(kw["positions"], row, kw["positions"][row] + 1)},
            ),
        ]
    if issubclass(cls, VerifyOutput):
        c, a = kw["num_correct_drafts"], kw["num_accept_tokens"]
        bad_c = config.num_steps + 1
        out = [
            ("num_accept_tokens", "num_accept_tokens = num_correct_drafts", {"num_accept_tokens": c.clone()}),
            (
                "num_correct_drafts",
                "more accepted drafts than num_steps",
                {"num_correct_drafts": _set(c, b, bad_c), "num_accept_tokens": _set(a, b, bad_c + 1)},
            ),
            (
                "accept_tokens",
                "a token replaced by the -1 padding",
                {"accept_tokens": _set(kw["accept_tokens"], (b, 0), -1)},
            ),
            (
                "accept_indices",
                "the root replaced by the -1 padding",
                {"accept_indices": _set(kw["accept_indices"], (b, 0), -1)},
            ),
        ]
        if len(kw["draft_extend_input"]):
            idle = DraftExtendInput.create_idle(config)
            out.append(
                ("draft_extend_input", "the unfinished requests dropped", {"draft_extend_input": idle})
            )
        return out
    raise TypeError(f"no value corruptions for {cls.__name__}")


@st.composite
def value_corrupted_inputs(
    draw: Any, cls: type, config: ConfigLike, bs: IntLike = _LIVE_SIZES
) -> tuple[str, str, dict[str, Any]]:
    """`(field, what, kwargs)`: live constructor arguments that pass strict level 1 but break one
    value invariant, which `spec_schema.check(obj, cls, config, values=True)` reports on `field`.

    Build the object with `types.SimpleNamespace(**kwargs)` or `unchecked(cls, kwargs)`: at
    SPEC_STRICT=2 the constructor itself raises (except for token-id ranges, which need the config).
    """
    config = _resolve(draw, config)
    size = _resolve(draw, bs)
    if size < 1:
        raise ValueError("value corruptions need a live batch (bs >= 1)")
    fields = draw(phase_fields(cls, config, bs=size))
    name, what, changes = draw(st.sampled_from(_value_corruptions(draw, cls, config, fields)))
    return name, what, {**fields, **changes}
