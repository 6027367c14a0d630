"""What the wrappers `install()` puts into sglang share: the config they check against, the memo of
verdicts (a level-1 verdict depends only on dtypes, shapes and a few host ints: `signature`), and
the rule that objects built inside a wrapped producer are checked once, at its exit."""

import operator
import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, Optional

import torch

from .. import _strict
from .._contract import BOUNDARY_CALLS, standing_aside
from ..config import SpecConfig
from . import _sglang_check as adapter

_BATCH_ATTRS = ("seq_lens", "req_pool_indices", "input_ids", "seq_lens_cpu", "seq_lens_sum", "extend_num_tokens")
_BATCH_SHAPES = ("seq_lens", "req_pool_indices", "input_ids", "extend_num_tokens")
_SCALARS = ("draft_token_num", "seq_lens_sum", "num_tokens_per_req", "seq_lens_cpu", "future_indices")
_READ = {m.engine_cls: operator.attrgetter(*sorted(
    {a for f in m.fields for on_batch, a in adapter._parts_of(f.engine) if not on_batch}
    | {a for a in _SCALARS if a in adapter._REQUIRED_ATTRS[m.engine_cls]})) for m in adapter.CLASS_MAPS}


_READ_NAMES = {m.engine_cls: tuple(sorted(
    {a for f in m.fields for on_batch, a in adapter._parts_of(f.engine) if not on_batch}
    | {a for a in _SCALARS if a in adapter._REQUIRED_ATTRS[m.engine_cls]})) for m in adapter.CLASS_MAPS}


def _sig(attr: str, value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        if attr == "seq_lens_cpu":  # host lengths: a FULL_MASK's length check may sum them (verify only)
            return tuple(value.tolist())
        dev = value.get_device()  # as the field check compares devices: index, or type off accelerators
        return value.dtype, value.shape, dev if dev >= 0 else value.device.type
    if isinstance(value, list):
        return tuple(value)
    return value if value is None or isinstance(value, (int, str, bool)) else type(value)


def read_values(name: str, obj: Any, batch: Any) -> tuple[Any, ...]:
    """The values a check of `obj` reads (the object's attributes, the batch's), for identity memos."""
    own = _READ[name](obj)
    return own if batch is None else own + tuple(getattr(batch, a, None) for a in _BATCH_ATTRS)


def signature(name: str, obj: Any, batch: Any) -> tuple[Any, ...]:
    """What a strict-level-1 check of `obj` depends on: each tensor's dtype, shape and device, the host
    lengths and counts, and the sizes held as ints (on the object and the batch). Two objects with one
    signature get one verdict, so `install` checks a signature once."""
    own = _READ[name](obj)
    sig = tuple(_sig(a, v) for a, v in zip(_READ_NAMES[name], own))
    if batch is None:
        return (name, type(obj)) + sig
    attrs = _BATCH_ATTRS if name == "EagleVerifyInput" else _BATCH_SHAPES  # only a mask reads host lengths
    return (name, type(obj), *sig, *(_sig(a, getattr(batch, a, None)) for a in attrs))



_SAVED: list[tuple[Any, str, Any]] = []  # (holder, attribute, original), in wrapping order
_STATE = SimpleNamespace(config=None, mask_mode=None, draft_config=True)


def installed() -> bool:
    """Whether the wrappers are in place."""
    return bool(_SAVED)


def _config() -> Optional[SpecConfig]:
    c = _STATE.config
    return c() if callable(c) and not isinstance(c, SpecConfig) else c


MASK_MODE = "_spec_schema_tree_mask_mode"
"""The attribute under which the verify-input build records the tree-mask mode it built with."""


def _mask_mode(obj: Any) -> Any:
    """The tree-mask mode of `obj`: recorded at its build, else install()'s, else None (inferred)."""
    mode = getattr(obj, "__dict__", {}).get(MASK_MODE)
    if mode is not None:
        return mode
    mode = _STATE.mask_mode
    return mode() if callable(mode) else mode


class _Local(threading.local):
    depth = 0  # wrapped producers running on this thread (objects built inside them are checked at their exit)


_LOCAL = _Local()
_SEEN: dict[tuple[Any, ...], Any] = {}  # signature -> the config it passed under
_SAME: dict[tuple[int, int, int], tuple[Any, ...]] = {}  # (config, object, batch) ids -> the values that passed
_SEEN_SIZE = 64


def _remember(table: dict, key: Any, value: Any) -> None:
    if len(table) >= _SEEN_SIZE:
        del table[next(iter(table))]
    table[key] = value


def _check(obj: Any, batch: Any = None, *, producer: str = "", consumer: str = "") -> None:
    """Check `obj` unless it, or an object of the same signature, passed under this config.

    At SPEC_STRICT=1 a check reads each tensor's dtype, shape and device and a few host ints
    (`signature`), so one verdict holds for every object with the same signature: each
    iteration's new objects of an unchanged batch are not checked again. An object crossing its next
    boundary with the very same values is recognised first, by identity (the memo holds those values,
    so their ids are not reused while remembered). Level 2 reads values: every boundary checks.
    """
    name = adapter._engine_class(obj)
    config = _config() if _STATE.draft_config or name != "EagleDraftInput" else None
    if _strict.LEVEL >= 2:
        _full_check(obj, batch, config, producer, consumer)
        return
    values = read_values(name, obj, batch)
    same = (id(config), id(obj), id(batch))
    known = _SAME.get(same)
    if known is not None and known[0] is config and all(map(operator.is_, known[1], values)):
        return
    mode = _mask_mode(obj) if name == "EagleVerifyInput" else None
    key = (id(config), mode, signature(name, obj, batch))
    if _SEEN.get(key, _SEEN) is not config:  # (a config of None is remembered too)
        if _full_check(obj, batch, config, producer, consumer, mode) is None:
            return  # an unresolved overlap handle: nothing checked, nothing remembered
        _remember(_SEEN, key, config)
    _remember(_SAME, same, (config, values, obj, batch))


def _full_check(obj: Any, batch: Any, config: Any, producer: str, consumer: str, mode: Any = None) -> Any:
    BOUNDARY_CALLS["sglang " + (producer or consumer)] += 1
    return adapter.check(obj, config, batch, producer=producer or None, consumer=consumer or None,
                         tree_mask_mode=mode if mode is not None else _mask_mode(obj))


def _active() -> bool:
    return bool(_SAVED) and not standing_aside()


def _inside(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run a wrapped producer; objects it builds are checked once, when it returns them."""
    _LOCAL.depth += 1
    try:
        return fn(*args, **kwargs)
    finally:
        _LOCAL.depth -= 1


def _outermost() -> bool:
    return _active() and _LOCAL.depth == 0


