"""Valid phase objects of `spec_schema.testing.strategies` (the public module, which documents them):
`phase_fields`, `phase_inputs`, `unchecked`, and the tensor building blocks the corruptions reuse.
"""

import dataclasses
from collections.abc import Mapping
from typing import Any, Optional

import torch
from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy
from torch import Tensor

from .. import DraftExtendInput, DraftInput, SpecConfig, VerifyInput, VerifyOutput
from .._plan import plan_for
from ..widths import Width, hidden_width
from ._configs import (
    _MAX_SEQ,
    BATCH_SIZES,
    SMALL_VOCAB,
    ConfigLike,
    IntLike,
    tree_arrays,
    tree_parents,
)

# ---------------------------------------------------------------------------------------------
# building blocks


def _resolve(draw: Any, value: Any) -> Any:
    return draw(value) if isinstance(value, SearchStrategy) else value


def _ints(draw: Any, shape: tuple[int, ...], lo: int, hi: int, dtype: torch.dtype = torch.int64) -> Tensor:
    count = 1
    for s in shape:
        count *= s
    values = draw(st.lists(st.integers(lo, hi), min_size=count, max_size=count))
    return torch.tensor(values, dtype=dtype).reshape(shape)


def _distinct(draw: Any, n: int, hi: int = 255) -> Tensor:
    return torch.tensor(
        draw(st.lists(st.integers(0, hi), min_size=n, max_size=n, unique=True)), dtype=torch.int64
    )


def _generator(draw: Any) -> torch.Generator:
    return torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))


def _hidden(draw: Any, rows: int, width: Width) -> Optional[Tensor]:
    """Hidden states of the width rule's width and dtype (values from a drawn seed: they can be large)."""
    if width.size is None:
        return None
    return torch.randn((rows, width.size), generator=_generator(draw)).to(width.dtype)


def _probs(draw: Any, bs: int, topk: int) -> Tensor:
    """Top-k probabilities per row: descending, summing to at most 1."""
    w = _floats(draw, (bs, topk), 0.0, 1.0) + 1e-3
    slack = _floats(draw, (bs, 1), 0.0, 1.0)
    return (w / (w.sum(1, keepdim=True) + slack)).sort(1, descending=True).values.clamp(0, 1)


def _floats(draw: Any, shape: tuple[int, ...], lo: float, hi: float) -> Tensor:
    count = 1
    for s in shape:
        count *= s
    values = draw(st.lists(st.floats(lo, hi, width=32), min_size=count, max_size=count))
    return torch.tensor(values, dtype=torch.float32).reshape(shape)


def unchecked(cls: type, fields: Mapping[str, Any]) -> Any:
    """An instance of a phase class built without running its construction check.

    For handing a consumer or `check` an object that a buggy producer might have built (the phase
    classes check themselves when built under SPEC_STRICT, so such objects cannot be made otherwise).
    """
    obj = object.__new__(cls)
    for name, value in fields.items():
        object.__setattr__(obj, name, value)
    return obj


# ---------------------------------------------------------------------------------------------
# valid field dicts per phase class


def _draft_input(draw: Any, config: SpecConfig, bs: int) -> dict[str, Any]:
    k, vocab = config.topk, config.vocab
    index = [
        draw(st.lists(st.integers(0, vocab - 1), min_size=k, max_size=k, unique=True)) for _ in range(bs)
    ]
    return {
        "topk_p": _probs(draw, bs, k),
        "topk_index": torch.tensor(index, dtype=torch.int64).reshape(bs, k),
        "hidden_states": _hidden(draw, bs, hidden_width(config, "draft")),
        "bonus_tokens": _ints(draw, (bs,), 0, vocab - 1),
        "seq_lens": _ints(draw, (bs,), 1, _MAX_SEQ),
        "req_pool_indices": _distinct(draw, bs),
        "draft_probs": _draft_probs(draw, config, (bs,)),
    }


def _draft_probs(draw: Any, config: SpecConfig, lead: tuple[int, ...]) -> Optional[Tensor]:
    """Sampled-chain distributions over the target vocab (topk 1 only; None when the vocab is large)."""
    if config.topk != 1 or config.vocab > SMALL_VOCAB or not draw(st.booleans()):
        return None
    return torch.softmax(torch.randn((*lead, config.vocab), generator=_generator(draw)), -1)


def _verify_input(draw: Any, config: SpecConfig, bs: int) -> dict[str, Any]:
    n, vocab = config.num_draft_tokens, config.vocab
    seq_lens = _ints(draw, (bs,), 1, _MAX_SEQ)
    trees = [tree_arrays(draw(tree_parents(n, config.num_steps, config.topk))) for _ in range(bs)]

    def stack(key: str, dtype: torch.dtype, shape: tuple[int, ...]) -> Tensor:
        return torch.tensor([t[key] for t in trees], dtype=dtype).reshape(shape)

    depth = stack("depth", torch.int64, (bs, n))
    draft_probs = _draft_probs(draw, config, (bs, n))
    return {
        "draft_token": _ints(draw, (bs, n), 0, vocab - 1),
        "positions": seq_lens[:, None] + depth,
        "tree_mask": stack("mask", torch.bool, (bs, n, n)),
        "retrieve_index": torch.arange(bs * n, dtype=torch.int64).reshape(bs, n),
        "retrieve_next_token": stack("next_token", torch.int64, (bs, n)),
        "retrieve_next_sibling": stack("next_sibling", torch.int64, (bs, n)),
        "seq_lens": seq_lens,
        "req_pool_indices": _distinct(draw, bs),
        "draft_probs": draft_probs,
    }


def _max_correct(config: SpecConfig) -> int:
    """Most drafts one request can accept: the tree's depth is at most num_steps and num_draft - 1."""
    return min(config.num_steps, config.num_draft_tokens - 1)


def _extend_from(draw: Any, config: SpecConfig, tokens: list[list[int]]) -> dict[str, Any]:
    """A DraftExtendInput whose request r runs over `tokens[r]` (its accepted drafts, then the bonus)."""
    a = torch.tensor([len(t) for t in tokens], dtype=torch.int32)
    seq_lens = torch.tensor([draw(st.integers(len(t), _MAX_SEQ)) for t in tokens], dtype=torch.int64)
    rows = int(a.sum())
    lead = config.traits.draft_kv_lead  # a draft reading its own sequence sits one position on
    positions = [s - len(t) + lead + j for s, t in zip(seq_lens.tolist(), tokens) for j in range(len(t))]
    return {
        "hidden_states": _hidden(draw, rows, hidden_width(config, "extend")),
        "input_ids": torch.tensor([x for t in tokens for x in t], dtype=torch.int64),
        "positions": torch.tensor(positions, dtype=torch.int64),
        "num_correct_drafts": a - 1,
        "num_accept_tokens": a,
        "seq_lens": seq_lens,
        "bonus_tokens": torch.tensor([t[-1] for t in tokens], dtype=torch.int64),
        "req_pool_indices": _distinct(draw, len(tokens)),
        "num_accept_tokens_cpu": tuple(len(t) for t in tokens) if draw(st.booleans()) else None,
    }


def _token_rows(draw: Any, config: SpecConfig, bs: int) -> list[list[int]]:
    lens = [draw(st.integers(1, _max_correct(config) + 1)) for _ in range(bs)]
    return [draw(st.lists(st.integers(0, config.vocab - 1), min_size=n, max_size=n)) for n in lens]


def _draft_extend_input(draw: Any, config: SpecConfig, bs: int) -> dict[str, Any]:
    return _extend_from(draw, config, _token_rows(draw, config, bs))


def _verify_output(draw: Any, config: SpecConfig, bs: int) -> dict[str, Any]:
    n, width = config.num_draft_tokens, config.num_steps + 1
    accept_tokens = torch.full((bs, width), -1, dtype=torch.int64)
    accept_indices = torch.full((bs, width), -1, dtype=torch.int64)
    tokens: list[list[int]] = []
    for b in range(bs):
        parents = draw(tree_parents(n, config.num_steps, config.topk))
        path = [draw(st.integers(0, n - 1))]  # the last accepted node; its ancestors are accepted too
        while parents[path[-1]] != -1:
            path.append(parents[path[-1]])
        path.reverse()
        row = draw(st.lists(st.integers(0, config.vocab - 1), min_size=len(path), max_size=len(path)))
        accept_indices[b, : len(path)] = torch.tensor(path) + b * n
        accept_tokens[b, : len(path)] = torch.tensor(row)
        tokens.append(row)
    finished = torch.tensor(draw(st.lists(st.booleans(), min_size=bs, max_size=bs)), dtype=torch.bool)
    a = torch.tensor([len(t) for t in tokens], dtype=torch.int32)
    live = [t for t, done in zip(tokens, finished.tolist()) if not done]
    extend = DraftExtendInput(**_known(DraftExtendInput, _extend_from(draw, config, live)))
    return {
        "accept_tokens": accept_tokens,
        "accept_indices": accept_indices,
        "num_correct_drafts": a - 1,
        "num_accept_tokens": a,
        "finished": finished,
        "draft_extend_input": extend,
    }


_BUILDERS = {
    DraftInput: _draft_input,
    VerifyInput: _verify_input,
    DraftExtendInput: _draft_extend_input,
    VerifyOutput: _verify_output,
}


def _builder(cls: type) -> Any:
    for base in cls.__mro__:
        if base in _BUILDERS:
            return _BUILDERS[base]
    raise TypeError(f"no strategy for {cls.__name__}; expected a phase class of spec_schema")


def _scramble(draw: Any, cls: type, fields: dict[str, Any]) -> dict[str, Any]:
    """Same shapes and dtypes, values drawn with no regard to the value invariants."""
    g = _generator(draw)
    out = {}
    for name, value in fields.items():
        if isinstance(value, Tensor) and value.dtype == torch.bool:
            value = torch.randint(0, 2, value.shape, generator=g).bool()
        elif isinstance(value, Tensor) and not value.is_floating_point():
            value = torch.randint(-2, 2 * _MAX_SEQ, value.shape, generator=g).to(value.dtype)
        elif isinstance(value, Tensor):
            value = (torch.rand(value.shape, generator=g) * 3 - 1).to(value.dtype)
        elif dataclasses.is_dataclass(value):
            inner = {f.name: getattr(value, f.name) for f in dataclasses.fields(value) if f.init}
            value = unchecked(type(value), _scramble(draw, type(value), inner))
        out[name] = value
    return out


@st.composite
def phase_fields(
    draw: Any,
    cls: type,
    config: ConfigLike,
    bs: IntLike = BATCH_SIZES,
    valid: bool = True,
) -> dict[str, Any]:
    """The constructor arguments of a phase object of `cls` for `config`, as a dict.

    `bs` (an int or a strategy) is the number of requests; 0 gives an idle batch with the same
    dtypes, ranks and widths. `valid=True`: every check of strict level 2 passes under `config`
    (trees from random parent lists, counts, -1 padding, positions, rows per request);
    `valid=False`: shapes, dtypes and widths are right (level 1 passes) but values are arbitrary.
    Rename the keys to build an engine's own class.
    """
    config = _resolve(draw, config)
    fields = _known(cls, _builder(cls)(draw, config, int(_resolve(draw, bs))))
    return fields if valid else _scramble(draw, cls, fields)


def _known(cls: type, built: Mapping[str, Any]) -> dict[str, Any]:
    """The constructor arguments of `cls` in its field order; fields this module does not build
    must be optional (they are left None)."""
    fields = {}
    for f in plan_for(cls).fields:
        if f.name not in built and not f.optional:
            raise TypeError(f"phase_fields: no strategy for the required field {cls.__name__}.{f.name}")
        fields[f.name] = built.get(f.name)
    return fields


@st.composite
def phase_inputs(
    draw: Any,
    cls: type,
    config: ConfigLike,
    bs: IntLike = BATCH_SIZES,
    valid: bool = True,
) -> Any:
    """Phase objects of `cls` (live for bs >= 1, idle for bs = 0) consistent with `config`.

    `valid=True` objects are built by the class's constructor (checked under SPEC_STRICT) and pass
    `spec_schema.check(obj, cls, config, values=True)`. `valid=False` objects have the right
    shapes, dtypes and widths but arbitrary values; they are built with `unchecked` (their
    construction would fail at SPEC_STRICT=2), for testing that a consumer rejects them.
    """
    fields = draw(phase_fields(cls, config, bs=bs, valid=valid))
    return cls(**fields) if valid else unchecked(cls, fields)
