"""Check plans compiled once per phase class from its jaxtyping annotations.

jaxtyping annotations are the single source of axes and dtypes. A plan reads them once (axis names,
allowed dtypes, Optional-ness) so that a check is a few comparisons per tensor; the jaxtyping +
beartype checker of the same annotations runs as the reference when a plan check fails (its verdict
becomes the error's `__cause__`) and at strict level 2.
"""

import dataclasses
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .errors import SpecContractError

Bound = dict[str, tuple[int, str]]  # axis -> (size, where the size came from)


@dataclass(frozen=True)
class FieldPlan:
    """What one field must be: a tensor with axes and dtypes, a nested phase object, or anything."""

    name: str
    optional: bool
    kind: str  # "tensor" | "phase" | "other"
    axes: tuple[str, ...] = ()
    dtypes: frozenset = frozenset()
    dtype_text: str = ""
    phase_cls: Optional[type] = None


@dataclass(frozen=True)
class ClassPlan:
    """The field plans of one phase class, in declaration order."""

    cls: type
    fields: tuple[FieldPlan, ...]


_PLANS: dict[type, ClassPlan] = {}


def plan_for(cls: type) -> ClassPlan:
    """The (cached) plan of a phase class or subclass."""
    plan = _PLANS.get(cls)
    if plan is None:
        plan = _PLANS[cls] = _compile(cls)
    return plan


def _compile(cls: type) -> ClassPlan:
    hints = typing.get_type_hints(cls)
    fields = tuple(_field_plan(f.name, hints[f.name]) for f in dataclasses.fields(cls) if f.init)
    return ClassPlan(cls, fields)


def _field_plan(name: str, hint: Any) -> FieldPlan:
    optional = False
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, getattr(__import__("types"), "UnionType", ())):
        inner = [a for a in args if a is not type(None)]
        optional = len(inner) < len(args)
        hint = inner[0] if len(inner) == 1 else hint
    dim_str = getattr(hint, "dim_str", None)
    if dim_str is not None:
        names = tuple(getattr(hint, "dtypes", ()))
        torch_dtypes = frozenset(getattr(torch, n) for n in names if hasattr(torch, n))
        return FieldPlan(name, optional, "tensor", tuple(dim_str.split()), torch_dtypes, "/".join(names))
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return FieldPlan(name, optional, "phase", phase_cls=hint)
    return FieldPlan(name, optional, "other")


def describe(value: Any) -> str:
    """Shape and dtype of a tensor (never its values: no device sync), or the type of anything else."""
    if isinstance(value, torch.Tensor):
        return f"shape {tuple(value.shape)} dtype {value.dtype}"
    return f"a {type(value).__name__}"


@dataclass
class Context:
    """Who made and who takes the object being checked, for error messages."""

    cls_name: str
    producer: Optional[str] = None
    consumer: Optional[str] = None

    def fail(self, field: str, text: str, value: Any = None, axis: Optional[str] = None) -> SpecContractError:
        who = [f"producer: {self.producer}"] if self.producer else []
        who += [f"consumer: {self.consumer}"] if self.consumer else []
        got = f"; got {describe(value)}" if value is not None else ""
        tail = f" [{'; '.join(who)}]" if who else ""
        return SpecContractError(
            f"{self.cls_name}.{field}: {text}{got}{tail}",
            cls_name=self.cls_name,
            field=field,
            axis=axis,
            producer=self.producer,
            consumer=self.consumer,
        )


def check_fields(
    obj: Any,
    plan: ClassPlan,
    ctx: Context,
    bound: Bound,
    getter: Callable[[Any, str], Any],
    expect: Mapping[str, tuple[Any, str]],
    index_dtypes: Optional[Mapping[str, FieldPlan]] = None,
) -> list[tuple[FieldPlan, Any]]:
    """Check every field's type, rank, dtype, device and axes; return the nested phase objects.

    `bound` starts with the config-known axes and collects the rest; `expect` maps a field to a
    required (dtype or None, origin) from the config (the width rule's dtype, or None for
    algorithms that never carry the field); `index_dtypes` replaces the plans of index fields
    whose dtype an engine's policy declares (`IndexPolicy.plans`). Hot path: a few comparisons per
    tensor, no value reads.
    """
    device = None
    nested = []
    for f in plan.fields:
        if index_dtypes:
            f = index_dtypes.get(f.name, f)
        value = getter(obj, f.name)
        want = expect.get(f.name) if expect else None
        if value is None:
            if want is not None and want[0] is not None:
                raise ctx.fail(f.name, f"is None, but {want[1]} requires a {want[0]} tensor [{' '.join(f.axes)}]")
            if not f.optional:
                raise ctx.fail(f.name, f"is None, expected {_expected(f)}")
            continue
        if want is not None and want[0] is None:
            raise ctx.fail(f.name, f"must be None ({want[1]})", value)
        if f.kind == "tensor":
            _check_tensor(f, value, ctx, bound, want)
            dev = value.get_device()  # an accelerator's index (the hot path: an int) ...
            if dev < 0:  # ... or, off accelerators, the device type: meta and CPU both report -1
                dev = value.device.type
            if device is None:
                device = (dev, f.name)
            elif dev != device[0]:
                raise ctx.fail(f.name, f"is on {value.device}, expected the device of {device[1]}", value)
        elif f.kind == "phase":
            if not isinstance(value, f.phase_cls):
                raise ctx.fail(f.name, f"expected a {f.phase_cls.__name__}", value)
            nested.append((f, value))
    return nested


def _expected(f: FieldPlan) -> str:
    if f.kind != "tensor":
        return f"a {f.phase_cls.__name__}" if f.phase_cls is not None else "a value"
    return f"a {f.dtype_text} tensor [{' '.join(f.axes)}]"


def _check_tensor(f: FieldPlan, value: Any, ctx: Context, bound: Bound, want: Any) -> None:
    if not isinstance(value, torch.Tensor):
        raise ctx.fail(f.name, f"expected {_expected(f)}", value)
    dtype = value.dtype
    if dtype not in f.dtypes:
        raise ctx.fail(f.name, f"dtype {dtype} is not {f.dtype_text}", value)
    if want is not None and dtype is not want[0]:
        raise ctx.fail(f.name, f"dtype {dtype}, expected {want[0]} ({want[1]})", value)
    shape = value.shape
    if len(shape) != len(f.axes):
        raise ctx.fail(f.name, f"rank {len(shape)}, expected {len(f.axes)} axes [{' '.join(f.axes)}]", value)
    for i, (axis, size) in enumerate(zip(f.axes, shape)):
        known = bound.get(axis)
        if known is None:
            bound[axis] = (size, f.name)
        elif known[0] != size:
            # config-seeded origins are sentences; axes bound here by a field carry its bare name
            origin = known[1] if " " in known[1] else f"as in {ctx.cls_name}.{known[1]}"
            raise ctx.fail(f.name, f"axis {axis} (dim {i}) expected {known[0]} ({origin})", value, axis)

