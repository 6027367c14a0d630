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
from ._sglang_check import _CLASS_OF

_BATCH_ATTRS = ("seq_lens", "req_pool_indices", "input_ids", "seq_lens_cpu", "seq_lens_sum", "extend_num_tokens")
_BATCH_SHAPES = ("seq_lens", "req_pool_indices", "input_ids", "extend_num_tokens")
_SCALARS = ("draft_token_num", "seq_lens_sum", "num_tokens_per_req", "seq_lens_cpu", "future_indices", "spec_steps")
_READ_NAMES = {m.engine_cls: tuple(sorted(
    {a for f in m.fields for on_batch, a in adapter._parts_of(f.engine) if not on_batch}
    | {a for a in _SCALARS if a in adapter._REQUIRED_ATTRS[m.engine_cls]})) for m in adapter.CLASS_MAPS}
_READ = {name: operator.attrgetter(*names) for name, names in _READ_NAMES.items()}


_TENSOR, _PLAIN = torch.Tensor, (int, str, bool)


def _sig(value: Any) -> Any:
    """A value's part of a signature: a tensor's (dtype, shape, device); a list as a tuple; ints, strings,
    bools and None as they are; anything else by its type."""
    if isinstance(value, _TENSOR):
        return value.dtype, value.shape, value.device
    if value is None or isinstance(value, _PLAIN):
        return value
    return tuple(value) if isinstance(value, list) else type(value)


def _lengths(value: Any) -> Any:
    """Host lengths (`seq_lens_cpu`) by value: a FULL_MASK's length check may sum them (verify only)."""
    return tuple(value.tolist()) if isinstance(value, _TENSOR) else _sig(value)


_HOST = {name: names.index("seq_lens_cpu") if "seq_lens_cpu" in names else None for name, names in _READ_NAMES.items()}
_BATCH_HOST = _BATCH_ATTRS.index("seq_lens_cpu")
_READ_BATCH = {True: operator.attrgetter(*_BATCH_ATTRS), False: operator.attrgetter(*_BATCH_SHAPES)}


def signature(name: str, obj: Any, batch: Any) -> tuple[Any, ...]:
    """What a strict-level-1 check of `obj` depends on: each tensor's dtype, shape and device, the host
    lengths and counts, and the sizes held as ints (on the object and the batch). Two objects with one
    signature get one verdict, so `install` checks a signature once."""
    sig = [name, type(obj), *map(_sig, _READ[name](obj))]
    host = _HOST[name]
    if host is not None:
        sig[2 + host] = _lengths(obj.seq_lens_cpu)
    if batch is None:
        return tuple(sig)
    verify = name == "EagleVerifyInput"  # only a mask reads host lengths
    try:
        part = list(map(_sig, _READ_BATCH[verify](batch)))
    except AttributeError:  # a batch lacking some attribute: read as None, as the check does
        part = [_sig(getattr(batch, a, None)) for a in (_BATCH_ATTRS if verify else _BATCH_SHAPES)]
    if verify:
        part[_BATCH_HOST] = _lengths(getattr(batch, "seq_lens_cpu", None))
    return (*sig, *part)


_SAVED: list[tuple[Any, str, Any]] = []  # (holder, attribute, original), in wrapping order
_STATE = SimpleNamespace(config=None, provider=None, mask_mode=None, draft_config=True)


def configure(config: Any, tree_mask_mode: Any, draft_config: bool) -> None:
    """What the wrappers check against (`install()`'s arguments); a callable config is called at each check."""
    _STATE.config, _STATE.mask_mode, _STATE.draft_config = config, tree_mask_mode, draft_config
    _STATE.provider = config if callable(config) and not isinstance(config, SpecConfig) else None


def installed() -> bool:
    """Whether the wrappers are in place."""
    return bool(_SAVED)


def _config() -> Optional[SpecConfig]:
    provider = _STATE.provider  # (no isinstance here: pydantic's ABC instance check is slow on every call)
    return _STATE.config if provider is None else provider()


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
_SEEN: dict[tuple[Any, ...], Any] = {}  # (config id, mask mode, signature) -> the config it passed under
_SEEN_SIZE = 256


def _remember(table: dict, key: Any, value: Any) -> None:
    if len(table) >= _SEEN_SIZE:  # a memo, not a history: start again (one check per signature after)
        table.clear()
    table[key] = value


def _check(obj: Any, batch: Any = None, *, producer: str = "", consumer: str = "") -> None:
    """Check `obj` unless an object of the same signature passed under this config.

    At SPEC_STRICT=1 a check reads each tensor's dtype, shape and device and a few host ints
    (`signature`), so one verdict holds for every object with the same signature: each
    iteration's new objects of an unchanged batch are not checked again, and each call reads the
    signature afresh (nothing is trusted by identity). Level 2 reads values: every boundary checks.
    """
    name = _CLASS_OF.get(type(obj)) or adapter._engine_class(obj)
    config = _config() if _STATE.draft_config or name != "EagleDraftInput" else None
    if _strict.LEVEL >= 2:
        _full_check(obj, batch, config, producer, consumer)
        return
    mode = _mask_mode(obj) if name == "EagleVerifyInput" else None
    key = (id(config), mode, *signature(name, obj, batch))
    if _SEEN.get(key, _SEEN) is not config:  # (a config of None is remembered too)
        if _full_check(obj, batch, config, producer, consumer, mode) is None:
            return  # an unresolved overlap handle: nothing checked, nothing remembered
        _remember(_SEEN, key, config)


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
    return _LOCAL.depth == 0 and _active()  # inside a wrapped producer: nothing more is read


