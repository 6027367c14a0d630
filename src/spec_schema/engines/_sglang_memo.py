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
_ONLY_WHEN_NONE = {"extend_num_tokens": "num_accept_tokens"}
"""Batch attribute -> the object attribute that must be None for the check to read it: a draft-extend input's
rows come from `extend_num_tokens` on the prefill path only (no accept counts); on the decode window the
batch's value is the last prefill's, which the check never reads (in the key it made a new verdict of every
(batch size, last prompt length) pair)."""
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
    always = [(y, a) for y, a in zip(ys, shared) if a not in _ONLY_WHEN_NONE]
    lines += ["    if b is not None:", "        try:"]
    lines += [f"            {y} = b.{a}" for y, a in always] or ["            pass"]
    lines += ["        except AttributeError:"]
    lines += [f"            {y} = getattr(b, {a!r}, None)" for y, a in always] or ["            pass"]
    for y, a in zip(ys, shared):
        if a in _ONLY_WHEN_NONE:  # read only on the path whose check reads it
            lines += [f"        if {xs[own.index(_ONLY_WHEN_NONE[a])]} is None:", f"            {y} = getattr(b, {a!r}, None)",
                      *["        " + line for line in _part(y, a)], "        else:", "            k.append(None)"]
        else:
            lines += ["    " + line for line in _part(y, a)]
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

    def read(attr: str) -> Any:
        when = _ONLY_WHEN_NONE.get(attr)
        return None if when is not None and getattr(obj, when) is not None else getattr(batch, attr, None)

    own = [e for a, v in zip(READ_NAMES[name], _READ[name](obj)) for e in flat(a, v)]
    if batch is None:
        return (type(obj), *own)
    return (type(obj), *own, *(e for a in BATCH_READS[name] for e in flat(a, read(a))))


# --- one verdict per shape class: a new batch size (or prefill length) where the check is parametric in it ---

class _Symbol:
    """A key element standing for every value of one size (`BS`, `ROWS`): unique, compared by identity."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


BS, ROWS = _Symbol("<bs>"), _Symbol("<rows>")
_PARAMETRIC_VIEWS = tuple(adapter.VIEWS[v] for v in (adapter.AS_IS, adapter.RANK2_ONLY, adapter.WINDOW_ROWS))


def _axes_of(m: Any) -> tuple[dict[str, tuple[str, ...]], dict[str, tuple[str, ...]]]:
    """(object attribute -> contract axes, batch attribute -> contract axes) of the fields whose view is the
    tensor as it is; the batch's `seq_lens` (where bs is read) is `bs` even when the class has no such field."""
    plans = {f.name: f.axes for f in adapter.plan_for(m.contract_cls).fields}
    own: dict[str, tuple[str, ...]] = {}
    shared: dict[str, tuple[str, ...]] = {"seq_lens": ("bs",)}
    for f in m.fields:
        if adapter._layout_fn(f) in _PARAMETRIC_VIEWS:  # the tensor as it is (rank 2 only: else no view)
            for on_batch, attr in adapter._parts_of(f.engine):
                (shared if on_batch else own)[attr] = plans[f.contract]
    return own, shared


AXES = {m.engine_cls: _axes_of(m) for m in adapter.CLASS_MAPS}
PARAMETRIC = ("EagleDraftInput", "GenerationBatchResult", "EagleDraftExtendInput")
"""The sglang classes whose level-1 check uses the batch size only as the `bs` axis, bound from the batch's
`seq_lens`, and a draft-extend's rows only as the `num_accepted` axis: on the prefill path bound from the
batch's `extend_num_tokens`, on the decode window required to be bs*num_tokens_per_req (with
num_tokens_per_req equal to the config's num_draft). Not EagleVerifyInput: its mask's mode and length are
told from bs*num_draft^2 and the host lengths."""


def _segments(key: tuple[Any, ...], start: int) -> list[tuple[int, int]]:
    """(first, end) of each attribute's elements in a flat key from `start`: an exact tensor's dtype, dims and
    device string; anything else one element (`_flat`)."""
    out, i = [], start
    while i < len(key):
        j = i + 1
        if isinstance(key[i], torch.dtype):
            while not isinstance(key[j], str):
                j += 1
            j += 1
        out.append((i, j))
        i = j
    return out


_SYMBOLS = {"bs": BS, "num_accepted": ROWS}
_LAYOUTS: dict[tuple[Any, ...], Any] = {}  # (class, start, element types of a key) -> `_layout` (False: none)


def _layout(name: str, key: tuple[Any, ...], start: int) -> Any:
    """Where a key of this element-type sequence holds its sizes (the element types fix its segments):
    (index of bs, of num_tokens_per_req or None, of extend_num_tokens or None, whether the rows are the decode
    window's, ((index, axis), ...) of the dims of a bs or num_accepted axis), or False where the check is not
    parametric in them."""
    own_names, shared_names = READ_NAMES[name], BATCH_READS[name]
    segs = _segments(key, start)
    if len(segs) != len(own_names) + len(shared_names):
        return False  # no batch: bs is bound from the first field
    named = [(a, False, s) for a, s in zip(own_names, segs)]
    named += [(a, True, s) for a, s in zip(shared_names, segs[len(own_names):])]
    where = {(a, on_batch): s for a, on_batch, s in named}
    first, end = where[("seq_lens", True)]
    if not isinstance(key[first], torch.dtype) or end - first < 3:
        return False  # not an exact tensor of rank >= 1: no bs to read
    per_req = rows = None
    window = False
    if name == "EagleDraftExtendInput":
        per_req, counts = where[("num_tokens_per_req", False)][0], where[("num_accept_tokens", False)][0]
        if type(key[per_req]) is not int:
            return False  # the check compares it with ints: left concrete, and so is the class
        window = key[counts] is not None  # accept counts: the decode window (`_extend_path`)
        rows = None if window else where[("extend_num_tokens", True)][0]
        rows = rows if rows is not None and type(key[rows]) is int else None
    dims = []
    for attr, on_batch, (i, j) in named:
        axes = AXES[name][on_batch].get(attr)
        if axes is not None and j - i == len(axes) + 2 and isinstance(key[i], torch.dtype):  # exact, contract rank
            dims += [(d, axis) for d, axis in enumerate(axes, i + 1) if axis in _SYMBOLS]
    return first + 1, per_req, rows, window, tuple(dims)


def shape_class(name: str, key: tuple[Any, ...], start: int = 3) -> Any:
    """The key of `key`'s shape class, or None: each dim whose contract axis is `bs` and equals the batch's
    bs (its `seq_lens` rows) becomes `BS`, and a draft-extend's `num_accepted` dims equal to its rows become
    `ROWS` (prefill: the batch's `extend_num_tokens`, which becomes `ROWS` too; decode window:
    bs*num_tokens_per_req). `key`: a generated check's key (object and batch; `start` its first attribute's
    index).

    Sound where the check is parametric in those sizes (`PARAMETRIC`): it seeds `bs` from the batch (and
    `num_accepted` from the rows) and compares each dim of that axis with it; no other comparison reads them,
    and every other element stays as it is (num_tokens_per_req too: the window's rows are bs times it, and it
    must equal the config's num_draft). So two keys of one class, all of whose such dims equal their batch's size, get
    one verdict: a dim of that axis that differs from it stays concrete (another class), and a dim of another
    axis (topk, a width) is never replaced, even where it equals bs."""
    if name not in PARAMETRIC:
        return None
    types = (name, start, *map(type, key))
    layout = _LAYOUTS.get(types)
    if layout is None:
        if len(_LAYOUTS) >= 256:
            _LAYOUTS.clear()
        layout = _LAYOUTS[types] = _layout(name, key, start)
    if layout is False:
        return None
    bs_at, per_req, rows_at, window, dims = layout
    bs = key[bs_at]
    if bs < 1 or per_req is not None and key[per_req] < 0:
        return None  # no rows, or an idle draft-extend
    sizes = {"bs": bs}
    out = list(key)
    if window:  # its rows: bs*num_tokens_per_req (a num_tokens_per_req that is not num_draft is refused)
        sizes["num_accepted"] = bs * key[per_req]
    elif rows_at is not None and key[rows_at] >= 1:
        sizes["num_accepted"] = key[rows_at]
        out[rows_at] = ROWS
    for d, axis in dims:
        if key[d] == sizes.get(axis):
            out[d] = _SYMBOLS[axis]
    return tuple(out)
