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
_HANDLE = "future_indices"  # read as `is None`: the check reads only that and whether it holds the resolve
# mark (an unresolved handle is unchecked, so never remembered); no contract field is this tensor

_TENSOR, _PLAIN = torch.Tensor, (int, str, bool)


def _sig(value: Any) -> Any:
    """A value's part of a signature, when it is not an exact tensor (`_flat` lays those out): a tensor
    subclass's (dtype, shape, device); a list as a tuple; ints, strings, bools and None as they are;
    anything else by its type."""
    if isinstance(value, _TENSOR):
        return value.dtype, value.shape, value.device
    if value is None or isinstance(value, _PLAIN):
        return value
    return tuple(value) if isinstance(value, list) else type(value)


def _lengths(value: Any) -> Any:
    """Host lengths (`seq_lens_cpu`) by value."""
    return tuple(value.tolist()) if isinstance(value, _TENSOR) else _sig(value)


_ACCELERATOR = tuple(f"device {i}" for i in range(64))  # interned: keys compare them by identity


def _device(t: Any) -> str:
    """A tensor's device as the contract compares it (`_plan.check_fields`: an accelerator's index, else the
    device type), as a string: 'cpu' for the common case, never an int (a key's dims are its only ints)."""
    index = t.get_device()
    if index < 0:
        return "cpu" if t.is_cpu else t.device.type
    return _ACCELERATOR[index] if index < len(_ACCELERATOR) else f"device {index}"


def _flat(value: Any) -> list[Any]:
    """A value's signature elements (plain Python, as the generated lines append them): an exact tensor's
    dtype, then its dims, then its device string (the dims are told from the rest: ints between a dtype and a
    string); anything else one element (`_sig`). Flat keys of small ints, dtypes and interned strings compare
    element by element by identity, touching no old object."""
    if type(value) is _TENSOR:
        return [value.dtype, *value.shape, "cpu" if value.is_cpu else _device(value)]
    return [value if value is None or type(value) is int else _sig(value)]


def _part(var: str, attr: str) -> list[str]:
    """Generated lines (one level of indent) appending one attribute's signature elements to `k` (`_flat`
    inline for an exact tensor, None and an int: no call; `type(x)` is a specialised builtin call,
    `x.__class__` a lookup through the class), host lengths by value (`_lengths`)."""
    if attr == _HOST:
        return [f"    k.append({var} if {var} is None else _lengths({var}))"]
    if attr == _HANDLE:
        return [f"    k.append({var} is None)"]
    return [f"    if type({var}) is _T:", f"        k.append({var}.dtype)", f"        k.extend({var}.shape)",
            f"        k.append('cpu' if {var}.is_cpu else _device({var}))",
            "    else:", f"        k.append({var} if {var} is None or type({var}) is int else _sig({var}))"]


def key_lines(name: str, head: str = "head") -> list[str]:
    """Source lines (one level of indent) that set `key` from `o` (an object of sglang class `name`), `b`
    (its batch, or None) and `head` (expressions): one flat tuple of `head`, the object's type, the
    signature elements of each attribute in `READ_NAMES[name]`, then (when `b` is not None) of each batch
    attribute its check reads; a batch lacking one reads None, as the check does. One pass: no per-field
    calls on an exact tensor."""
    own, shared = READ_NAMES[name], BATCH_READS[name]
    xs = [f"x{k}" for k in range(len(own))]
    ys = [f"y{k}" for k in range(len(shared))]
    lines = [f"    {x} = o.{a}" for x, a in zip(xs, own)] + [f"    k = [{head}, type(o)]"]
    lines += [line for x, a in zip(xs, own) for line in _part(x, a)]
    lines += ["    if b is not None:", "        try:"]
    lines += [f"            {y} = b.{a}" for y, a in zip(ys, shared)] or ["            pass"]
    lines += ["        except AttributeError:"]
    lines += [f"            {y} = getattr(b, {a!r}, None)" for y, a in zip(ys, shared)] or ["            pass"]
    lines += ["    " + line for y, a in zip(ys, shared) for line in _part(y, a)]
    return lines + ["    key = tuple(k)"]


NAMESPACE = {"_T": _TENSOR, "_sig": _sig, "_lengths": _lengths, "_device": _device}
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
    lengths by value, and the sizes held as ints, on the object and on the batch (flat: `_flat`)."""
    def flat(attr: str, value: Any) -> list[Any]:
        if attr == _HANDLE:
            return [value is None]
        return [_lengths(value)] if attr == _HOST and value is not None else _flat(value)

    own = [e for a, v in zip(READ_NAMES[name], _READ[name](obj)) for e in flat(a, v)]
    if batch is None:
        return (type(obj), *own)
    return (type(obj), *own, *(e for a in BATCH_READS[name] for e in flat(a, getattr(batch, a, None))))
