"""JSON Schema (draft 2020-12) of the phase classes and of `SpecConfig`, generated, never hand-written.

    python -m spec_schema.export [--out schemas/] [--check]

One file per phase class (`DraftInput.schema.json`, ...) and `SpecConfig.schema.json`. Tensor fields
come from the jaxtyping annotations through pydantic's `TypeAdapter(...).json_schema` with a generator
that turns a jaxtyping array type into a "Tensor" object schema: `{"dtype", "shape", "data"}` with
`x-dtypes` and `x-shape` (axis names). Field descriptions come from each field's `metadata["doc"]`.
Top-level extension keys:

- `x-axes`: every axis name of the contract and its meaning.
- `x-none-for`: per Optional field (dotted path for nested phases), the algorithms that always carry
  None there, those that carry it under a condition, and the condition.
- `x-width-rule`: per hidden-state field, the width rule as data: per algorithm, the width expression
  and where the dtype comes from, derived by evaluating `hidden_width` on probe configs.

`to_document` / `from_document` convert phase objects to and from JSON-able documents in which a
tensor is `{"dtype": "int64", "shape": [2, 4], "data": [[...]]}`; non-finite floats are written as
the strings "nan", "inf", "-inf". `--check` regenerates in memory and exits 1 if `schemas/` drifted.
"""

import argparse
import contextlib
import dataclasses
import difflib
import functools
import itertools
import json
import math
import re
import sys
import typing
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Optional

import torch
from jaxtyping import AbstractArray
from pydantic import ConfigDict, TypeAdapter
from pydantic.json_schema import GenerateJsonSchema

from . import CHAIN_CLASSES, PHASE_CLASSES
from ._plan import FieldPlan, plan_for
from .config import ModelDims, SpecAlgorithm, SpecConfig, traits
from .errors import SpecContractError
from .widths import hidden_width

__all__ = [
    "SCHEMA_DIALECT",
    "AXES",
    "SpecGenerateJsonSchema",
    "phase_schema",
    "config_schema",
    "generate",
    "write",
    "drift",
    "to_document",
    "from_document",
    "tensor_to_document",
    "tensor_from_document",
    "main",
]

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

_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


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


# --- documents -----------------------------------------------------------------------------------


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


def write(out: Path) -> list[Path]:
    """Write every schema file into `out`; remove stale `*.schema.json` files there. Returns the paths."""
    out.mkdir(parents=True, exist_ok=True)
    files = generate()
    for stale in sorted(set(p.name for p in out.glob("*.schema.json")) - set(files)):
        (out / stale).unlink()
    paths = []
    for name, text in files.items():
        (out / name).write_text(text, encoding="utf-8")
        paths.append(out / name)
    return paths


def drift(out: Path, context_lines: int = 20) -> list[str]:
    """Differences between the files in `out` and a fresh generation; empty when up to date."""
    files = generate()
    problems = []
    for name, text in files.items():
        path = out / name
        if not path.exists():
            problems.append(f"{path}: missing")
            continue
        old = path.read_text(encoding="utf-8")
        if old != text:
            diff = list(difflib.unified_diff(old.splitlines(), text.splitlines(), f"{path} (committed)",
                                             f"{path} (generated)", lineterm="", n=1))
            changed = sum(1 for d in diff if d[:1] in "+-" and d[:3] not in ("+++", "---"))
            shown = "\n".join(diff[:context_lines]) + ("\n..." if len(diff) > context_lines else "")
            problems.append(f"{path}: differs ({changed} lines changed)\n{shown}")
    for stale in sorted(set(p.name for p in out.glob("*.schema.json")) - set(files)):
        problems.append(f"{out / stale}: not generated by spec_schema.export (stale)")
    return problems


def tensor_to_document(t: torch.Tensor) -> dict[str, Any]:
    """A tensor as `{"dtype", "shape", "data"}` (nested lists; non-finite floats as strings)."""
    data = t.detach().cpu().tolist()
    if t.is_floating_point():
        data = _map_leaves(data, _encode_float)
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "data": data}


def _encode_float(x: float) -> Any:
    if math.isnan(x):
        return "nan"
    return x if math.isfinite(x) else ("inf" if x > 0 else "-inf")


def _map_leaves(data: Any, fn: Callable[[Any], Any]) -> Any:
    return [_map_leaves(d, fn) for d in data] if isinstance(data, list) else fn(data)


def tensor_from_document(doc: Mapping[str, Any], device: Any = "cpu") -> torch.Tensor:
    """The tensor of a `{"dtype", "shape", "data"}` document; raises ValueError when it is malformed."""
    dtype = getattr(torch, str(doc.get("dtype")), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"tensor document: unknown dtype {doc.get('dtype')!r}")
    shape = tuple(doc["shape"])
    data = _map_leaves(doc["data"], lambda x: _NON_FINITE.get(x, x) if isinstance(x, str) else x)
    t = torch.tensor(data, dtype=dtype)
    if tuple(t.shape) != shape:
        if t.numel() != 0 or math.prod(shape) != 0:
            raise ValueError(f"tensor document: data has shape {tuple(t.shape)} but shape says {shape}")
        t = t.reshape(shape)
    return t.to(device)


@functools.cache
def _adapter(cls: type, name: str) -> TypeAdapter:
    """pydantic's adapter for a plain (non-tensor, non-phase) field, e.g. a host tuple of ints."""
    return TypeAdapter(typing.get_type_hints(cls)[name])


def to_document(obj: Any) -> dict[str, Any]:
    """A phase object as a JSON-able dict: tensors as `{"dtype", "shape", "data"}`, nested phases inline,
    other fields as pydantic dumps them in JSON mode (a tuple becomes a list)."""
    out = {}
    for f in dataclasses.fields(obj):
        if f.init:
            out[f.name] = _encode(type(obj), f.name, getattr(obj, f.name))
    return out


def _encode(cls: type, name: str, value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return tensor_to_document(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return to_document(value)
    return _adapter(cls, name).dump_python(value, mode="json")


def from_document(cls: type, doc: Mapping[str, Any], device: Any = "cpu") -> Any:
    """Build a phase object of class `cls` from a document made by `to_document` (or another engine).

    Unknown fields are refused and fields without a default are required (ValueError); each
    tensor's dtype and rank are checked against the annotations (`SpecContractError`), the rest is
    checked by the constructor under SPEC_STRICT.
    """
    plan = plan_for(cls)
    names = [f.name for f in plan.fields]
    defaulted = {f.name for f in dataclasses.fields(cls)
                 if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING}
    extra = sorted(set(doc) - set(names))
    missing = [n for n in names if n not in doc and n not in defaulted]
    if extra or missing:
        raise ValueError(f"{cls.__name__} document: unknown fields {extra}, missing fields {missing}")
    return cls(**{f.name: _decode(cls, f, doc[f.name], device) for f in plan.fields if f.name in doc})


def _decode(cls: type, f: FieldPlan, value: Any, device: Any) -> Any:
    if value is None:
        return None
    if f.kind == "phase":
        return from_document(f.phase_cls, value, device)  # type: ignore[arg-type]
    if f.kind != "tensor":
        return _adapter(cls, f.name).validate_python(value)
    t = tensor_from_document(value, device)
    if t.dtype not in f.dtypes or t.dim() != len(f.axes):
        raise SpecContractError(
            f"{cls.__name__}.{f.name}: document tensor has dtype {t.dtype} rank {t.dim()}, expected "
            f"{f.dtype_text} [{' '.join(f.axes)}]",
            cls_name=cls.__name__,
            field=f.name,
        )
    return t


# --- command line --------------------------------------------------------------------------------


def main(argv: Optional[list[str]] = None) -> int:
    """`python -m spec_schema.export [--out DIR] [--check]`: write the schemas, or check for drift."""
    parser = argparse.ArgumentParser(prog="python -m spec_schema.export", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("schemas"), help="schema directory (default: schemas/)")
    parser.add_argument("--check", action="store_true", help="exit 1 if --out differs from a fresh export")
    args = parser.parse_args(argv)
    if args.check:
        problems = drift(args.out)
        for problem in problems:
            print(problem, file=sys.stderr)
        if problems:
            print(f"schema drift: {len(problems)} file(s); run `python -m spec_schema.export --out {args.out}`",
                  file=sys.stderr)
            return 1
        print(f"{args.out}: schema files up to date")
        return 0
    for path in write(args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
