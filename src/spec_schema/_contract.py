"""Strict checking: the phase-class decorator, the boundary decorator and `check()`.

With SPEC_STRICT unset, `phase_class` returns a plain frozen dataclass and `boundary` returns the
function itself: nothing wraps anything. With SPEC_STRICT=1 a phase object is checked when it is
built (internal consistency) and at every decorated boundary (config-known sizes too). Checks read
only shapes, dtypes and devices, and stand aside during CUDA-graph capture and torch.compile tracing.
SPEC_STRICT=2 adds value invariants (these read tensor values and may sync).

The checks run from plans compiled from the jaxtyping annotations (`_plan.py`); when a plan check
fails, the jaxtyping + beartype checker of the same annotations runs on the object and its verdict
becomes the error's `__cause__` (a test shows the two accept and reject the same objects).
"""

import collections
import dataclasses
import functools
import inspect
import threading
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, Optional, TypeVar

import torch

from . import _strict
from ._plan import Bound, Context, check_fields, plan_for
from .config import SpecConfig
from .errors import SpecContractError
from .policy import IndexPolicy

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

_HAS_CUDA = torch.cuda.is_available()

BOUNDARY_CALLS: "collections.Counter[str]" = collections.Counter()
"""How many times each decorated boundary ran its checks (strict mode only; for tests and stats)."""


_FAST_ASIDE = hasattr(torch.compiler, "_is_compiling_flag") and hasattr(torch.compiler, "is_dynamo_compiling")
_COMPILER: Any = torch.compiler if _FAST_ASIDE else types.SimpleNamespace(_is_compiling_flag=False)
_dynamo_compiling = torch.compiler.is_dynamo_compiling if _FAST_ASIDE else torch.compiler.is_compiling
_FLAG_COVERS_DYNAMO = _FAST_ASIDE and hasattr(torch.compiler, "_compile_session_context")
"""This torch holds `_is_compiling_flag` for the whole of each Dynamo compile session (convert_frame enters
`_compile_session_context`), so while Dynamo traces the flag alone says so."""


def standing_aside() -> bool:
    """True while torch.compile traces or a CUDA graph is being captured: checks do nothing then.

    `torch.compiler.is_compiling()` without its calls (this runs on every wrapped call of an engine's
    serving loop): its flag, set for a compile session and by torch.export; on a torch whose Dynamo does
    not hold that flag while it compiles, also `is_dynamo_compiling()`, which Dynamo folds to True while
    it traces."""
    if _COMPILER._is_compiling_flag or not _FLAG_COVERS_DYNAMO and _dynamo_compiling():
        return True
    return _HAS_CUDA and torch.cuda.is_current_stream_capturing()


class _Active(threading.local):
    """The boundary running on this thread: its config and name (objects built inside it use them)."""

    config: Optional[SpecConfig] = None
    name: Optional[str] = None


_ACTIVE = _Active()


def _post_init(self: Any) -> None:
    if standing_aside():
        return
    config = _ACTIVE.config
    _check(self, type(self), config, Context(type(self).__name__, _ACTIVE.name), getattr, _strict.LEVEL >= 2)
    if config is not None:
        object.__setattr__(self, "_spec_checked", config)


def phase_class(cls: type[T]) -> type[T]:
    """Make a frozen phase dataclass; under SPEC_STRICT its construction is checked.

    The check lives in `__post_init__`, which the dataclass machinery also calls from the `__init__`
    of any subclass (an engine's tag subclass for an MTP variant, say), so subclasses are checked too.
    """
    if _strict.LEVEL:
        cls.__post_init__ = _post_init  # type: ignore[attr-defined]
    return dataclasses.dataclass(frozen=True, eq=False)(cls)


def _check(
    obj: Any,
    cls: type,
    config: Optional[SpecConfig],
    ctx: Context,
    getter: Callable[[Any, str], Any],
    values: bool,
    policy: Optional[IndexPolicy] = None,
) -> None:
    plan = plan_for(cls)
    bound: Bound = {}
    expect: Mapping[str, tuple[Any, str]] = {}
    if config is not None:
        axes, expect = _config_facts(cls, config)
        bound = dict(axes)
    try:
        nested = check_fields(obj, plan, ctx, bound, getter, expect, policy.plans(cls) if policy else None)
    except SpecContractError as err:
        raise err from _reference_verdict(obj, cls, getter)
    host = getattr(cls, "_host_problem", None)
    problem = host(obj if getter is getattr else _MappedView(obj, getter, plan)) if host else None
    if problem is not None:
        raise ctx.fail(problem[0], problem[1])
    for f, value in nested:
        if config is not None and getattr(value, "_spec_checked", None) is config:
            continue
        _check(value, f.phase_cls, config, Context(f"{ctx.cls_name}.{f.name}", ctx.producer, ctx.consumer),
               getattr, values, policy.nested(f.name) if policy else None)
    if values:
        _check_values(obj, cls, config, ctx, getter)


_FACTS: dict[tuple[type, int], tuple[SpecConfig, Mapping[str, tuple[int, str]], Mapping[str, Any]]] = {}


def _config_facts(cls: type, config: SpecConfig) -> tuple[Mapping[str, tuple[int, str]], Mapping[str, Any]]:
    """The config-known axes and field expectations of a class, computed once per (class, config)."""
    key = (cls, id(config))
    hit = _FACTS.get(key)
    if hit is None or hit[0] is not config:
        if len(_FACTS) > 256:
            _FACTS.clear()
        hit = _FACTS[key] = (config, cls._config_axes(config), cls._config_expect(config))  # type: ignore[attr-defined]
    return hit[1], hit[2]


def _check_values(obj: Any, cls: type, config: Optional[SpecConfig], ctx: Context, getter: Any) -> None:
    view = obj if getter is getattr else _MappedView(obj, getter, plan_for(cls))
    problem = cls._value_problem(view, config)  # type: ignore[attr-defined]
    if problem is not None:
        field, text = problem
        raise ctx.fail(field, f"value invariant broken: {text}")


class _MappedView:
    """Presents a foreign object under our field names (for value invariants of `check`)."""

    def __init__(self, obj: Any, getter: Callable[[Any, str], Any], plan: Any) -> None:
        for f in plan.fields:
            setattr(self, f.name, getter(obj, f.name))


_REFERENCE: dict[type, Callable[..., Any]] = {}


def reference_checker(cls: type) -> Callable[..., Any]:
    """A jaxtyping + beartype checked function with the class's fields as annotated parameters."""
    fn = _REFERENCE.get(cls)
    if fn is None:
        from beartype import beartype
        from jaxtyping import jaxtyped

        hints = typing.get_type_hints(cls)
        fields = [f for f in dataclasses.fields(cls) if f.init]
        names = [f.name for f in fields]
        params = [
            inspect.Parameter(f.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=hints[f.name],
                              default=f.default if f.default is not dataclasses.MISSING else inspect.Parameter.empty)
            for f in fields
        ]

        def reference(*args: Any, **kwargs: Any) -> None:
            return None

        reference.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        reference.__annotations__ = {n: hints[n] for n in names}
        reference.__qualname__ = reference.__name__ = f"{cls.__name__}_reference"
        fn = _REFERENCE[cls] = jaxtyped(typechecker=beartype)(reference)
    return fn


def _reference_verdict(obj: Any, cls: type, getter: Callable[[Any, str], Any]) -> Optional[BaseException]:
    """Run the jaxtyping + beartype reference on a failing object; its error explains the failure."""
    try:
        reference_checker(cls)(**{f.name: getter(obj, f.name) for f in plan_for(cls).fields})
    except Exception as err:  # noqa: BLE001 - any checker error is the explanation we want
        return err
    return None


def check(
    obj: Any,
    cls: type,
    config: Optional[SpecConfig] = None,
    *,
    mapping: Optional[Mapping[str, str]] = None,
    values: Optional[bool] = None,
    producer: Optional[str] = None,
    consumer: Optional[str] = None,
    index_dtypes: Optional[IndexPolicy] = None,
) -> None:
    """Check any object with the fields of phase class `cls` against the contract.

    `obj` may be a foreign engine's own class: its attributes are read by our field names, or through
    `mapping` (our field name -> its attribute name). With `config`, the config-known sizes (hidden
    widths, vocab, topk, num_draft ...) and the width rule's dtypes and None-ness are checked too.
    `values` adds the value invariants (default: only at SPEC_STRICT=2). `index_dtypes` is an
    engine's declared `IndexPolicy`: the index dtypes its layout uses where the contract's own
    layout has int64 (or int32) (no other check changes). Runs whatever SPEC_STRICT says; raises
    `SpecContractError`.
    """
    if index_dtypes is not None and index_dtypes.cls is not cls:
        raise TypeError(f"index_dtypes is a policy for {index_dtypes.cls.__name__}, not {cls.__name__}")
    if mapping:
        _known_fields(cls, mapping)
    getter = getattr if isinstance(obj, cls) else _foreign_getter(cls, mapping or {})
    ctx = Context(cls.__name__, producer, consumer)
    _check(obj, cls, config, ctx, getter, _strict.LEVEL >= 2 if values is None else values, index_dtypes)


def check_merge(left: Any, right: Any, cls: type, *, mapping: Optional[Mapping[str, str]] = None) -> None:
    """Refuse a merge of two batches whose tensor fields differ in dtype (one dtype per field).

    `torch.cat` promotes mixed index dtypes (int32 with int64) silently; an engine's `merge_batch`
    calls this first. A field absent or None on either side is skipped (presence is the field
    check's business). Runs whatever SPEC_STRICT says; raises `SpecContractError`.
    """
    if mapping:
        _known_fields(cls, mapping)
    lget = getattr if isinstance(left, cls) else _foreign_getter(cls, mapping or {})
    rget = getattr if isinstance(right, cls) else _foreign_getter(cls, mapping or {})
    for f in plan_for(cls).fields:
        if f.kind != "tensor":
            continue
        a, b = lget(left, f.name), rget(right, f.name)
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype != b.dtype:
            raise SpecContractError(
                f"{cls.__name__}.merge_batch: {f.name} is {a.dtype} on the left and {b.dtype} on the right; "
                "one dtype per field across a merge (torch.cat would promote silently)",
                cls_name=cls.__name__, field=f.name,
            )


def _known_fields(cls: type, mapping: Mapping[str, str]) -> None:
    """A mapping names fields of `cls` only (a misspelt key would silently leave its field unmapped)."""
    unknown = sorted(set(mapping) - {f.name for f in plan_for(cls).fields})
    if unknown:
        raise ValueError(f"mapping: {cls.__name__} has no field {', '.join(map(repr, unknown))}; its fields: "
                         f"{', '.join(f.name for f in plan_for(cls).fields)}")


def view_of(cls: type[T], fields: Mapping[str, Any]) -> T:
    """An instance of phase class `cls` holding `fields` as they are, without the construction check.

    For adapters presenting an engine's tensors as the contract's fields (views, never copies):
    `check` the view first, with the engine's `IndexPolicy`, then hand it on.
    """
    obj = object.__new__(cls)
    for f in plan_for(cls).fields:
        object.__setattr__(obj, f.name, fields.get(f.name))
    return obj


def _foreign_getter(cls: type, mapping: Mapping[str, str]) -> Callable[[Any, str], Any]:
    """Read a foreign object's attributes under our field names; absent optional fields are None."""
    missing = object()
    defaults = {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}

    def getter(o: Any, name: str) -> Any:
        attr = mapping.get(name, name)
        value = getattr(o, attr, missing)
        if value is not missing:
            return value
        if name in defaults:
            return defaults[name]
        raise SpecContractError(
            f"{cls.__name__}.{name}: the object has no attribute {attr!r}", cls_name=cls.__name__, field=name
        )

    return getter


def _phase_params(fn: Callable[..., Any]) -> tuple[list[tuple[int, str, type]], Optional[type], Callable[..., Any]]:
    sig = inspect.signature(fn)
    hints = typing.get_type_hints(fn)
    consumed = []
    for i, (name, _) in enumerate(sig.parameters.items()):
        hint = hints.get(name)
        if isinstance(hint, type) and hasattr(hint, "_config_axes"):
            consumed.append((i, name, hint))
    ret = hints.get("return")
    produced = ret if isinstance(ret, type) and hasattr(ret, "_config_axes") else None
    return consumed, produced, _config_finder(fn, sig)


def _config_finder(fn: Callable[..., Any], sig: inspect.Signature) -> Callable[..., Any]:
    names = list(sig.parameters)
    if "config" in names:
        idx = names.index("config")
        return lambda args, kwargs: kwargs["config"] if "config" in kwargs else args[idx]
    if names:
        first = names[0]
        return lambda args, kwargs: (kwargs[first] if first in kwargs else args[0]).spec_config
    raise TypeError(f"{fn.__qualname__}: a boundary needs a `config` parameter or a first parameter "
                    "with a `spec_config` attribute (a runtime context or `self`)")


def boundary(fn: F) -> F:
    """Mark a producer/consumer function of phase objects.

    Parameters annotated with a phase class are checked on entry (consumer side), a phase-class
    return value on exit (producer side), both against the `SpecConfig` found in the `config`
    parameter or in `self.spec_config`. With SPEC_STRICT unset this returns `fn` itself.
    """
    if not _strict.LEVEL:
        return fn
    consumed, produced, find_config = _phase_params(fn)
    name = f"{fn.__module__}.{fn.__qualname__}"
    values = _strict.LEVEL >= 2

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if standing_aside():
            return fn(*args, **kwargs)
        config = find_config(args, kwargs)
        BOUNDARY_CALLS[name] += 1
        for idx, pname, cls in consumed:
            obj = kwargs[pname] if pname in kwargs else args[idx]
            if getattr(obj, "_spec_checked", None) is not config:  # each object is checked once
                ctx = Context(type(obj).__name__, getattr(obj, "_spec_producer", None), name)
                _check(obj, cls, config, ctx, getattr, values)
        saved = _ACTIVE.config, _ACTIVE.name
        _ACTIVE.config, _ACTIVE.name = config, name
        try:
            out = fn(*args, **kwargs)
        finally:
            _ACTIVE.config, _ACTIVE.name = saved
        if produced is not None:
            if getattr(out, "_spec_checked", None) is not config:
                _check(out, produced, config, Context(type(out).__name__, name), getattr, values)
            object.__setattr__(out, "_spec_producer", name)
        return out

    wrapper.__spec_boundary__ = True  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]
