"""The level-1 memo of `install()`'s checks: what a verdict depends on (`signature`) and one generated
reader per sglang class that builds the memo key of an object and its batch in one pass (`key_reader`).

A strict-level-1 check reads each tensor's dtype, shape and device and a few host ints (sizes held as
ints, host lengths), never a tensor's values, so two objects with one signature get one verdict. The
key is read afresh at every check: nothing is trusted by identity (a tensor resized in place, a field
swapped for another tensor or a batch field changed gives another key)."""

import operator
from collections.abc import Callable
from typing import Any

import torch

from . import _sglang_check as adapter

_BATCH_EXTRA = {"EagleVerifyInput": ("seq_lens_cpu", "seq_lens_sum"),  # a FULL_MASK's length check sums them
                "EagleDraftExtendInput": ("extend_num_tokens",)}  # the prefill path's rows
BATCH_READS = {m.engine_cls: tuple(sorted(
    {"seq_lens"} | {a for f in m.fields for on_batch, a in adapter._parts_of(f.engine) if on_batch}
    | set(_BATCH_EXTRA.get(m.engine_cls, ())))) for m in adapter.CLASS_MAPS}
"""sglang class -> the batch attributes its check reads: the fields it keeps on the batch, `seq_lens` (bs),
and the host ints of the mask and the prefill rows (a test records every read of a check)."""
_SCALARS = ("draft_token_num", "seq_lens_sum", "num_tokens_per_req", "seq_lens_cpu", "future_indices", "spec_steps")
READ_NAMES = {m.engine_cls: tuple(sorted(
    {a for f in m.fields for on_batch, a in adapter._parts_of(f.engine) if not on_batch}
    | {a for a in _SCALARS if a in adapter._REQUIRED_ATTRS[m.engine_cls]})) for m in adapter.CLASS_MAPS}
"""sglang class -> the attributes of the object its check reads."""
_HOST = "seq_lens_cpu"  # read by value: a FULL_MASK's length check may sum the host lengths

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
    """Host lengths (`seq_lens_cpu`) by value."""
    return tuple(value.tolist()) if isinstance(value, _TENSOR) else _sig(value)


def _part(var: str, attr: str) -> str:
    """The generated expression of one attribute's signature part: an exact torch.Tensor, None and an int
    inline (the common cases: no call), anything else through `_sig` (`_lengths` for host lengths)."""
    if attr == _HOST:
        return f"({var} if {var} is None else _lengths({var}))"
    return (f"(({var}.dtype, {var}.shape, {var}.device) if {var}.__class__ is _T else {var} if {var} is None "
            f"or {var}.__class__ is int else _sig({var}))")


def key_lines(name: str) -> list[str]:
    """Source lines (one level of indent) that set `key` from `o` (an object of sglang class `name`), `b`
    (its batch, or None) and `head`: `head`, the object's type, the signature part of each attribute in
    `READ_NAMES[name]`, then (when `b` is not None) of each batch attribute its check reads; a batch
    lacking one reads None, as the check does. One pass, one tuple: no per-field calls on an exact tensor."""
    own, shared = READ_NAMES[name], BATCH_READS[name]
    xs = [f"x{k}" for k in range(len(own))]
    ys = [f"y{k}" for k in range(len(shared))]
    lines = [f"    {x} = o.{a}" for x, a in zip(xs, own)]
    obj_parts = ", ".join(_part(x, a) for x, a in zip(xs, own))
    lines += ["    if b is None:", f"        key = (head, o.__class__, {obj_parts})", "    else:", "        try:"]
    lines += [f"            {y} = b.{a}" for y, a in zip(ys, shared)] or ["            pass"]
    lines += ["        except AttributeError:"]
    lines += [f"            {y} = getattr(b, {a!r}, None)" for y, a in zip(ys, shared)] or ["            pass"]
    batch_parts = ", ".join(_part(y, a) for y, a in zip(ys, shared))
    return lines + [f"        key = (head, o.__class__, {obj_parts}, {batch_parts})"]


NAMESPACE = {"_T": _TENSOR, "_sig": _sig, "_lengths": _lengths}
"""What `key_lines` refers to."""


def generated(source: str, name: str, label: str, namespace: dict[str, Any]) -> Any:
    """The function `name` defined by `source` (built by this package from a class's attribute names,
    never from input), compiled once with `namespace` as its globals."""
    scope = {**NAMESPACE, **namespace}
    exec(compile(source, f"<spec_schema {label}>", "exec"), scope)  # noqa: S102
    return scope[name]


def key_reader(name: str) -> Callable[[Any, Any, Any], tuple[Any, ...]]:
    """`(obj, batch, head) -> key` for sglang class `name` (`key_lines` as a function; the generated
    checks of `_sglang_runtime` run the same lines inline)."""
    source = "\n".join(["def read(o, b, head):", *key_lines(name), "    return key"]) + "\n"
    return generated(source, "read", f"memo key of {name}", {})


KEYS = {name: key_reader(name) for name in READ_NAMES}
"""sglang class -> its generated key reader."""

_READ = {name: operator.attrgetter(*names) for name, names in READ_NAMES.items()}


def signature(name: str, obj: Any, batch: Any) -> tuple[Any, ...]:
    """What a strict-level-1 check of `obj` (sglang class `name`) against `batch` depends on, in plain
    Python (the generated `KEYS` read the same values): each tensor's dtype, shape and device, the host
    lengths by value, and the sizes held as ints, on the object and on the batch."""
    own = tuple(_lengths(v) if a == _HOST else _sig(v) for a, v in zip(READ_NAMES[name], _READ[name](obj)))
    if batch is None:
        return (type(obj), *own)
    shared = tuple(_lengths(getattr(batch, a, None)) if a == _HOST else _sig(getattr(batch, a, None))
                   for a in BATCH_READS[name])
    return (type(obj), *own, *shared)
