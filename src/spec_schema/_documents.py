"""Phase objects as JSON-able documents and back, for `spec_schema.export` (the public module): a
tensor is `{"dtype", "shape", "data"}` with non-finite floats as the strings "nan", "inf", "-inf".
"""

import dataclasses
import functools
import math
import typing
from collections.abc import Callable, Mapping
from typing import Any

import torch
from pydantic import TypeAdapter

from ._plan import FieldPlan, plan_for
from .errors import SpecContractError

_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


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
