"""JSON Schema generation for `spec_schema.export` (which documents the output and is the public
module): the tensor schema of a jaxtyping annotation, the pydantic generator, and the extension keys
`x-axes`, `x-none-for` and `x-width-rule` (the width rule probed from `hidden_width`).
"""

import contextlib
import dataclasses
import itertools
import json
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Optional

import torch
from jaxtyping import AbstractArray
from pydantic import ConfigDict, TypeAdapter
from pydantic.json_schema import GenerateJsonSchema

from . import CHAIN_CLASSES, PHASE_CLASSES
from ._documents import _NON_FINITE
from ._plan import FieldPlan, plan_for
from .config import ModelDims, SpecAlgorithm, SpecConfig, traits
from .widths import hidden_width

SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"
ID_PREFIX = "urn:spec-schema:schemas:"

AXES: Mapping[str, str] = {
    "bs": "live requests in the batch",
    "topk": "branching factor of the draft tree (SpecConfig.topk)",
    "num_steps": "draft depth: forward passes of the draft per iteration (SpecConfig.num_steps)",
    "num_draft": "tree size per request including the root (SpecConfig.num_draft_tokens)",
    "num_accepted": "total accepted tokens of unfinished requests, bonus included",
    "accept_width": "num_steps + 1: the root (or bonus) plus at most num_steps accepted drafts",
    "hidden_draft": "width of DraftInput.hidden_states (decode phase; see x-width-rule)",
    "hidden_extend": "width of DraftExtendInput.hidden_states and of captured target hidden states "
    "(extend phase; see x-width-rule)",
    "vocab": "target vocabulary size",
    "draft_vocab": "draft vocabulary size (EAGLE-3 heads may score a smaller one)",
    "num_draft_total": "chain form: draft tokens of the whole batch (the sum of the per-request counts)",
    "num_logits": "chain form: logits rows the target scores, num_draft_total + bs",
    "chain_width": "chain form: max_spec_len + 1, the longest chain of the batch plus the bonus",
}
"""Every axis name of the contract (DESIGN.md) and its meaning."""


# --- tensors in schemas ------------------------------------------------------------------------


def _torch_dtype_names(names: Any) -> list[str]:
    """jaxtyping dtype names that are torch dtypes (drops numpy-only spellings such as `bool_`)."""
    return [n for n in names if isinstance(getattr(torch, n, None), torch.dtype)]


def _element_schema(dtype_name: str) -> dict[str, Any]:
    dtype = getattr(torch, dtype_name)
    if dtype == torch.bool:
        return {"type": "boolean"}
    if dtype.is_floating_point:
        return {"anyOf": [{"type": "number"}, {"enum": sorted(_NON_FINITE)}]}
    return {"type": "integer"}


def _data_schema(rank: int, dtypes: list[str]) -> dict[str, Any]:
    elements = []
    for name in dtypes:
        element = _element_schema(name)
        if element not in elements:
            elements.append(element)
    schema = elements[0] if len(elements) == 1 else {"anyOf": elements}
    for _ in range(rank):
        schema = {"type": "array", "items": schema}
    return schema


def _axes(array_cls: type) -> list[str]:
    axes = array_cls.dim_str.split()
    odd = [a for a in axes if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*|[0-9]+", a)]
    if odd:
        raise NotImplementedError(f"{array_cls}: export supports named and fixed axes only, not {odd}")
    return axes


def tensor_schema(array_cls: type) -> dict[str, Any]:
    """The "Tensor" object schema of a jaxtyping array type: dtype enum, shape of fixed rank, data."""
    dtypes = _torch_dtype_names(array_cls.dtypes)
    axes = _axes(array_cls)
    rank = len(axes)
    return {
        "type": "object",
        "title": "Tensor",
        "x-dtypes": dtypes,
        "x-dtype-family": array_cls.dtype.__name__,
        "x-shape": axes,
        "properties": {
            "dtype": {"type": "string", "enum": dtypes},
            "shape": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0},
                "minItems": rank,
                "maxItems": rank,
            },
            "data": _data_schema(rank, dtypes),
        },
        "required": ["data", "dtype", "shape"],
        "additionalProperties": False,
    }


class SpecGenerateJsonSchema(GenerateJsonSchema):
    """pydantic's generator, taught jaxtyping array types and dataclass field docs."""

    def is_instance_schema(self, schema: Any) -> Any:
        """A jaxtyping array type becomes a "Tensor" object schema; anything else as pydantic does."""
        cls = schema["cls"]
        if isinstance(cls, type) and issubclass(cls, AbstractArray):
            return tensor_schema(cls)
        return super().is_instance_schema(schema)

    def dataclass_schema(self, schema: Any) -> Any:
        """pydantic's dataclass schema, with each property described by its field's `metadata["doc"]`."""
        out = super().dataclass_schema(schema)
        props = out.get("properties", {})
        for f in dataclasses.fields(schema["cls"]):
            if "doc" in f.metadata and f.name in props:
                props[f.name] = {**props[f.name], "description": f.metadata["doc"]}
        return out


@contextlib.contextmanager
def _pydantic_config(classes: tuple[type, ...]) -> Iterator[None]:
    """Let pydantic see tensor fields (`arbitrary_types_allowed`) while exporting; restore afterwards."""
    missing = object()
    saved = {cls: cls.__dict__.get("__pydantic_config__", missing) for cls in classes}
    try:
        for cls in classes:
            cls.__pydantic_config__ = ConfigDict(arbitrary_types_allowed=True, extra="forbid")
        yield
    finally:
        for cls, old in saved.items():
            if old is missing:
                if "__pydantic_config__" in cls.__dict__:
                    delattr(cls, "__pydantic_config__")
            else:
                cls.__pydantic_config__ = old


# --- probes of the width rule --------------------------------------------------------------------

_WIDTH_TERMS = {
    "num_aux": "aux layers of the EAGLE-3 head: len(draft.aux_layer_ids), else draft.num_aux_hidden_states, "
    "else 3",
    "draft.target_hidden_size or target.hidden_size": "an EAGLE-3 head's target_hidden_size when set, "
    "else the target's hidden_size",
    "hc_mult": "mHC hidden multiplier (DeepSeek-V4): a model's boundary stream is hidden_size x hc_mult "
    "wide; 1 elsewhere",
}

_WIDTH_CANDIDATES: tuple[tuple[Optional[str], Callable[[SpecConfig], Optional[int]]], ...] = (
    (None, lambda c: None),
    ("draft.hidden_size", lambda c: c.draft.hidden_size),
    ("target.hidden_size", lambda c: c.target.hidden_size),
    ("draft.hidden_size * draft.hc_mult", lambda c: c.draft.hidden_size * c.draft.hc_mult),
    ("target.hidden_size * target.hc_mult", lambda c: c.target.hidden_size * c.target.hc_mult),
    (
        "draft.target_hidden_size or target.hidden_size",
        lambda c: c.draft.target_hidden_size or c.target.hidden_size,
    ),
    ("target.hidden_size * num_aux", lambda c: c.target.hidden_size * c.draft.num_aux),
    (
        "(draft.target_hidden_size or target.hidden_size) * num_aux",
        lambda c: (c.draft.target_hidden_size or c.target.hidden_size) * c.draft.num_aux,
    ),
)


def _width_candidates(phase: str) -> Any:
    """Candidates in order of preference: where SpecConfig makes the two models' widths equal (EAGLE,
    EAGLE-3 aux off), the phase's own producer names the width: the draft's in the decode phase,
    the target's in the extend phase."""
    if phase == "draft":
        return _WIDTH_CANDIDATES
    return tuple(sorted(_WIDTH_CANDIDATES, key=lambda tc: (tc[0] or "").startswith("draft.hidden")))


_DTYPE_CANDIDATES: tuple[tuple[Optional[str], Callable[[SpecConfig], Optional[torch.dtype]]], ...] = (
    (None, lambda c: None),
    ("draft.dtype", lambda c: c.draft.torch_dtype),
    ("target.dtype", lambda c: c.target.torch_dtype),
)


def _rule_rows() -> list[tuple[SpecAlgorithm, Optional[bool]]]:
    """One row per algorithm; algorithms with aux layers get an aux-on and an aux-off row."""
    rows: list[tuple[SpecAlgorithm, Optional[bool]]] = []
    for alg in SpecAlgorithm:
        rows += [(alg, True), (alg, False)] if traits(alg).has_aux_layers else [(alg, None)]
    return rows


def _probes(alg: SpecAlgorithm, aux: Optional[bool]) -> list[SpecConfig]:
    """Configs of one row that tell the candidate expressions apart (distinct widths and dtypes).

    Where SpecConfig requires the draft's boundary width to equal the target's (EAGLE, EAGLE-3 aux
    off), the hidden sizes still differ: the two streams are widened by different hc_mult."""
    configs = []
    auxes = (True, False) if aux is None else (aux,)
    dtypes = (("float32", "bfloat16"), ("bfloat16", "float16"))
    aux_sources: tuple[dict[str, Any], ...] = ({}, {"num_aux_hidden_states": 5}, {"aux_layer_ids": (1, 3, 5, 6)})
    equal = traits(alg).draft_reads_hidden and not (aux and traits(alg).has_aux_layers)
    t_hidden, t_mult, d_hidden = (384, 4, 768) if equal else (640, 1, 384)
    # A head's target_hidden_size, when set, must equal the target's hidden size (SpecConfig checks it).
    heads = (None, t_hidden) if equal or not traits(alg).has_aux_layers else (t_hidden,)
    grid = itertools.product(auxes, heads, dtypes, aux_sources)
    for use_aux, head_target, (t_dtype, d_dtype), source in grid:
        target = ModelDims(hidden_size=t_hidden, vocab_size=1000, dtype=t_dtype, num_hidden_layers=8,
                           hc_mult=t_mult)
        draft = ModelDims(hidden_size=d_hidden, vocab_size=1000, dtype=d_dtype, target_hidden_size=head_target,
                          use_aux_hidden_state=use_aux, hc_mult=2, **source)
        configs.append(
            SpecConfig(algorithm=alg, target=target, draft=draft, num_steps=3, topk=2, num_draft_tokens=6)
        )
    return configs


def _solve(candidates: Any, probes: list[SpecConfig], actual: Callable[[SpecConfig], Any], what: str) -> Any:
    """The first candidate expression that agrees with the width rule on every probe."""
    for text, fn in candidates:
        if all(fn(c) == actual(c) for c in probes):
            return text
    raise RuntimeError(f"the width rule changed: no candidate expression matches {what}; update export.py")


def _width_rule(phase: str) -> dict[str, Any]:
    """The width rule of one phase as data, each row checked against `hidden_width` on probes."""
    rows = []
    for alg, aux in _rule_rows():
        probes = _probes(alg, aux)
        label = f"{alg.value} {phase} phase" + ("" if aux is None else f" (aux {'on' if aux else 'off'})")
        row: dict[str, Any] = {
            "algorithm": alg.value,
            "width": _solve(_width_candidates(phase), probes, lambda c: hidden_width(c, phase).size, label + " width"),
            "dtype": _solve(_DTYPE_CANDIDATES, probes, lambda c: hidden_width(c, phase).dtype, label + " dtype"),
        }
        if aux is not None:
            row["use_aux_hidden_state"] = aux
        rows.append(row)
    return {
        "phase": phase,
        "axis": f"hidden_{phase}",
        "rule": f"spec_schema.hidden_width(config, {phase!r})",
        "terms": dict(_WIDTH_TERMS),
        "rows": rows,
    }


# --- per-field extension keys --------------------------------------------------------------------


def _walk(cls: type, prefix: str = "") -> Iterator[tuple[str, type, FieldPlan]]:
    """(dotted path, owning class, field plan) of every field, nested phase fields included."""
    for f in plan_for(cls).fields:
        yield prefix + f.name, cls, f
        if f.kind == "phase" and f.phase_cls is not None:
            yield from _walk(f.phase_cls, f"{prefix}{f.name}.")


def _field_doc(cls: type, name: str) -> str:
    return next(f.metadata.get("doc", "") for f in dataclasses.fields(cls) if f.name == name)


def _hidden_phase(f: FieldPlan) -> Optional[str]:
    """"draft" or "extend" for a hidden-state field (its last axis is `hidden_<phase>`), else None."""
    if f.kind == "tensor" and f.axes and f.axes[-1] in ("hidden_draft", "hidden_extend"):
        return f.axes[-1].removeprefix("hidden_")
    return None


def _none_by_width(owner: type, phase: str) -> dict[str, Any]:
    always = []
    for alg, aux in _rule_rows():
        probes = _probes(alg, aux)
        sizes = {owner.hidden_size_for(c) for c in probes}  # type: ignore[attr-defined]
        if sizes != {hidden_width(c, phase).size for c in probes}:
            raise RuntimeError(
                f"{owner.__name__}.hidden_size_for disagrees with hidden_width(config, {phase!r})"
            )
        if sizes == {None} and alg.value not in always:
            always.append(alg.value)
    condition = f"spec_schema.hidden_width(config, {phase!r}).size is None"
    return {"algorithms": always, "conditional": [], "condition": condition}


def _none_by_doc(owner: type, name: str) -> dict[str, Any]:
    """From the field doc: algorithms it names carry a value under its condition, the others always
    None; a doc that names no algorithm makes the field conditional for every algorithm."""
    doc = _field_doc(owner, name)
    named = [a.value for a in SpecAlgorithm if re.search(rf"\b{a.value}\b", doc)]
    if not named:
        return {"algorithms": [], "conditional": [a.value for a in SpecAlgorithm], "condition": doc}
    always = [a.value for a in SpecAlgorithm if a.value not in named]
    return {"algorithms": always, "conditional": named, "condition": doc}


def none_for(cls: type) -> dict[str, Any]:
    """`x-none-for`: per Optional field, the algorithms that carry None there and the condition."""
    out = {}
    for path, owner, f in _walk(cls):
        if f.optional:
            phase = _hidden_phase(f)
            out[path] = _none_by_width(owner, phase) if phase else _none_by_doc(owner, f.name)
    return out


def width_rules(cls: type) -> dict[str, Any]:
    """`x-width-rule`: the width rule (per algorithm) of every hidden-state field of `cls`."""
    return {path: _width_rule(phase) for path, _, f in _walk(cls) if (phase := _hidden_phase(f))}


# --- schema documents ----------------------------------------------------------------------------


def _header(name: str) -> dict[str, Any]:
    return {"$schema": SCHEMA_DIALECT, "$id": f"{ID_PREFIX}{name}.schema.json"}


def phase_schema(cls: type) -> dict[str, Any]:
    """The JSON Schema of one phase class, with `x-axes`, `x-none-for` and `x-width-rule`."""
    with _pydantic_config(tuple(PHASE_CLASSES) + tuple(CHAIN_CLASSES)):
        body = TypeAdapter(cls).json_schema(schema_generator=SpecGenerateJsonSchema)
    return {**_header(cls.__name__), **body, "x-axes": dict(AXES), "x-none-for": none_for(cls),
            "x-width-rule": width_rules(cls)}


def config_schema() -> dict[str, Any]:
    """The JSON Schema of `SpecConfig` (and `ModelDims`)."""
    body = TypeAdapter(SpecConfig).json_schema(schema_generator=SpecGenerateJsonSchema)
    return {**_header("SpecConfig"), **body}


def _dump(doc: Mapping[str, Any]) -> str:
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


def generate() -> dict[str, str]:
    """File name -> JSON text of every schema file (deterministic)."""
    docs = {f"{cls.__name__}.schema.json": phase_schema(cls) for cls in (*PHASE_CLASSES, *CHAIN_CLASSES)}
    docs["SpecConfig.schema.json"] = config_schema()
    return {name: _dump(doc) for name, doc in docs.items()}
