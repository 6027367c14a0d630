"""Hypothesis strategies for the spec_schema contract: configs, valid phase objects, corrupted ones.

Engines use these to test their own producers, consumers and phase classes against the contract
(see docs/testing-for-engines.md). Only this subpackage imports hypothesis.

- `spec_configs()`: `SpecConfig`s whose target and draft hidden sizes differ (the historical pairs
  4096/2048 and 4480/2048 and small random ones), EAGLE-3 heads with 2-4 aux layers and a smaller
  draft vocabulary, independent dtypes per model.
- `phase_fields()` / `phase_inputs()`: live (bs >= 1) and idle (bs = 0) field dicts / objects of a
  phase class that satisfy every check of strict level 2 under the config.
- `corrupted_inputs()`: a valid field dict with exactly one tensor field broken in one way (width,
  dtype, rank, batch or presence), returned as `(field, kind, kwargs)`.
- `value_corrupted_inputs()`: a field dict that passes strict level 1 but breaks one value
  invariant of level 2, returned as `(field, what, kwargs)`.

Only the `draft_probs` fields (DraftInput, VerifyInput; sampled chains) have a vocabulary-sized axis;
they are generated only for topk 1 and a vocabulary of at most `SMALL_VOCAB` (else None), so configs
may use real vocabulary sizes.
"""

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Optional, Union

import torch
from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy
from torch import Tensor

from .. import DraftExtendInput, DraftInput, ModelDims, SpecAlgorithm, SpecConfig, VerifyInput, VerifyOutput
from .._plan import FieldPlan, plan_for
from ..config import max_tree_nodes
from ..widths import Width, hidden_width

__all__ = [
    "HISTORICAL_HIDDEN_PAIRS",
    "REAL_VOCAB_SIZES",
    "SMALL_VOCAB",
    "DTYPE_NAMES",
    "BATCH_SIZES",
    "CORRUPTION_KINDS",
    "example_config",
    "spec_configs",
    "tree_parents",
    "tree_arrays",
    "phase_fields",
    "phase_inputs",
    "corrupted_inputs",
    "value_corrupted_inputs",
    "unchecked",
]

HISTORICAL_HIDDEN_PAIRS: Mapping[str, tuple[int, int]] = {
    "target 4096 / draft 2048": (4096, 2048),
    "target 4480 / draft 2048": (4480, 2048),
}
"""(target, draft) hidden sizes of the historical width bugs; `spec_configs(mismatched=True)` draws
one of them about half the time (the other half: small random pairs)."""

REAL_VOCAB_SIZES: tuple[int, ...] = (32000, 128256, 151936)
SMALL_VOCAB = 512
"""`draft_probs` (the only vocab-sized tensors) are generated only up to this vocabulary."""

DTYPE_NAMES: tuple[str, ...] = ("float32", "bfloat16", "float16")
CORRUPTION_KINDS: tuple[str, ...] = ("width", "dtype", "rank", "batch", "presence")
"""Kinds of `corrupted_inputs`: a config-known axis resized, a wrong dtype, an axis added or dropped,
the batch axis (bs / num_accepted) of one field resized, a hidden state None that the width rule
requires or a tensor where it requires None (STANDALONE)."""

_BATCH_AXES = frozenset({"bs", "num_accepted"})
_MAX_SEQ = 4096

ConfigLike = Union[SpecConfig, SearchStrategy]
IntLike = Union[int, SearchStrategy]

BATCH_SIZES = st.integers(0, 4)
"""Default `bs` of `phase_fields`/`phase_inputs`: idle (0) and live batches."""
_CORRUPT_SIZES = st.integers(0, 3)
_LIVE_SIZES = st.integers(1, 3)


# ---------------------------------------------------------------------------------------------
# configs


def example_config(
    algorithm: Union[SpecAlgorithm, str] = SpecAlgorithm.EAGLE,
    *,
    target_hidden: int = 64,
    draft_hidden: Optional[int] = None,
    vocab: int = 128,
    num_steps: int = 3,
    topk: int = 2,
    num_draft_tokens: int = 6,
    target_dtype: str = "float32",
    draft_dtype: str = "bfloat16",
    num_aux: Optional[int] = 3,
    draft_vocab: Optional[int] = None,
) -> SpecConfig:
    """A small deterministic config with mismatched widths and dtypes (target 64 f32, draft 32 bf16).

    `draft_hidden` None: 32, except for EAGLE, whose head must be as wide as its target (SpecConfig
    rejects anything else, as the engines would). EAGLE-3 heads get `target_hidden_size`,
    `num_aux_hidden_states = num_aux` (None: the default of 3) and a draft vocabulary of
    `draft_vocab` (default: half the vocabulary).
    """
    algorithm = SpecAlgorithm(algorithm)
    if draft_hidden is None:
        draft_hidden = target_hidden if algorithm is SpecAlgorithm.EAGLE else 32
    head: dict[str, Any] = {}
    if algorithm is SpecAlgorithm.EAGLE3:
        head = {"draft_vocab_size": draft_vocab or max(1, vocab // 2), "num_aux_hidden_states": num_aux,
                "target_hidden_size": target_hidden}
    return SpecConfig(
        algorithm=algorithm,
        target=ModelDims(
            hidden_size=target_hidden, vocab_size=vocab, dtype=target_dtype, num_hidden_layers=8
        ),
        draft=ModelDims(
            hidden_size=draft_hidden, vocab_size=vocab, dtype=draft_dtype, num_hidden_layers=1, **head
        ),
        num_steps=num_steps,
        topk=topk,
        num_draft_tokens=num_draft_tokens,
    )


def _hidden_pairs(mismatched: bool) -> SearchStrategy:
    small = st.integers(2, 12).map(lambda k: 8 * k)
    if not mismatched:
        named = st.sampled_from(sorted({t for t, _ in HISTORICAL_HIDDEN_PAIRS.values()}))
        return st.one_of(named, small).map(lambda h: (h, h))
    pairs = st.tuples(small, small).filter(lambda p: p[0] != p[1])
    return st.one_of(st.sampled_from(list(HISTORICAL_HIDDEN_PAIRS.values())), pairs)


@st.composite
def spec_configs(
    draw: Any,
    algorithms: Iterable[Union[SpecAlgorithm, str]] = tuple(SpecAlgorithm),
    mismatched: bool = True,
) -> SpecConfig:
    """Valid `SpecConfig`s of the given algorithms.

    `mismatched=True`: target and draft hidden sizes differ (4096/2048, 4480/2048, or small
    multiples of 8 in 16..96) wherever the engines allow it: an EAGLE head, and an EAGLE-3 head with
    aux capture off, read the target's stream as their own width, so theirs are equal (see
    `SpecConfig`); `False`: they are equal. EAGLE-3 heads read 2-4 aux layers (given as
    `aux_layer_ids`, `num_aux_hidden_states`, both, or neither: the default 3), carry
    `target_hidden_size` when their width differs (sometimes when it does not), always have a draft
    vocabulary smaller than the target's, and have aux capture on or off. num_steps 1-5, topk 1-4, num_draft_tokens valid for both; each model's dtype
    is drawn on its own from float32/bfloat16/float16.
    """
    algorithm = SpecAlgorithm(draw(st.sampled_from([SpecAlgorithm(a) for a in algorithms])))
    target_h, draft_h = draw(_hidden_pairs(mismatched))
    vocab = draw(st.one_of(st.integers(16, 256), st.sampled_from(REAL_VOCAB_SIZES)))
    num_steps, topk = draw(st.integers(1, 5)), draw(st.integers(1, 4))
    if topk == 1:
        num_draft = num_steps + 1
    else:
        num_draft = draw(st.integers(2, min(max_tree_nodes(num_steps, topk), 16)))
    layers = draw(st.none() | st.integers(4, 48))
    head: dict[str, Any] = {}
    if algorithm is SpecAlgorithm.EAGLE3:
        num_aux = draw(st.integers(2, 4))
        given = draw(st.sampled_from(["ids", "count", "both", "default"]))
        if given == "default":
            num_aux = 3
        if given in ("ids", "both"):
            layers = (
                layers if layers is not None and layers >= num_aux else draw(st.integers(max(4, num_aux), 48))
            )
            ids = draw(st.lists(st.integers(0, layers - 1), min_size=num_aux, max_size=num_aux, unique=True))
            head["aux_layer_ids"] = tuple(sorted(ids))
        if given in ("count", "both"):
            head["num_aux_hidden_states"] = num_aux
        head["use_aux_hidden_state"] = draw(st.booleans())
        head["draft_vocab_size"] = draw(st.integers(1, vocab - 1))
        if target_h != draft_h or draw(st.booleans()):
            head["target_hidden_size"] = target_h
    if algorithm is SpecAlgorithm.EAGLE or head.get("use_aux_hidden_state") is False:
        draft_h = target_h
    return SpecConfig(
        algorithm=algorithm,
        target=ModelDims(
            hidden_size=target_h,
            vocab_size=vocab,
            dtype=draw(st.sampled_from(DTYPE_NAMES)),
            num_hidden_layers=layers,
        ),
        draft=ModelDims(
            hidden_size=draft_h,
            vocab_size=vocab,
            dtype=draw(st.sampled_from(DTYPE_NAMES)),
            num_hidden_layers=draw(st.none() | st.integers(1, 2)),
            **head,
        ),
        num_steps=num_steps,
        topk=topk,
        num_draft_tokens=num_draft,
    )


# ---------------------------------------------------------------------------------------------
# trees


@st.composite
def tree_parents(draw: Any, num_draft: int, num_steps: int, topk: int) -> list[int]:
    """A random draft tree as a parent list: node 0 is the root (parent -1), node i's parent is < i,
    no node is deeper than `num_steps` and none has more than `topk` children."""
    parents, depth, children = [-1], [0], [0]
    for i in range(1, num_draft):
        free = [p for p in range(i) if depth[p] < num_steps and children[p] < topk]
        p = draw(st.sampled_from(free))
        parents.append(p)
        depth.append(depth[p] + 1)
        children.append(0)
        children[p] += 1
    return parents


def tree_arrays(parents: Sequence[int]) -> dict[str, list[Any]]:
    """The layout of DESIGN.md for one request's tree: `depth`, `mask` (node i attends j: j is i or an
    ancestor), `next_token` (first child or -1) and `next_sibling` (next child of the parent or -1)."""
    n = len(parents)
    depth = [0] * n
    mask = [[False] * n for _ in range(n)]
    next_token, next_sibling = [-1] * n, [-1] * n
    for i in range(n):
        j = i
        while j != -1:
            mask[i][j] = True
            j = parents[j]
        if i:
            p = parents[i]
            depth[i] = depth[p] + 1
            if next_token[p] == -1:
                next_token[p] = i
            else:
                c = next_token[p]
                while next_sibling[c] != -1:
                    c = next_sibling[c]
                next_sibling[c] = i
    return {"depth": depth, "mask": mask, "next_token": next_token, "next_sibling": next_sibling}


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
