"""Wrappers where sglang copies a phase object's tensors into buffers of its own: the overlap
scheduler's relay (`FutureMap.stash` writes them, `_resolve_spec_extras` gathers them back into the
next iteration's `EagleDraftInput`) and the CUDA-graph runners' copy-in. Both copy with a cast
(`buffer[idx] = src.to(buffer.dtype)`, `torch._foreach_copy_`), so a source of another dtype would
pass silently; and the draft-extend runner skips the hidden-state copy when the widths differ.
Here a source whose dtype (or width) differs from its buffer's is an error naming the field."""

import functools
from typing import Any, Optional

import torch

from .._contract import _COMPILER, _HAS_CUDA, _dynamo_compiling, standing_aside
from ..errors import SpecContractError
from ..phases import DraftExtendInput, DraftInput
from . import _sglang_check as adapter
from ._sglang_boundaries import Bound
from ._sglang_check import _CLASS_OF
from ._sglang_memo import generated
from ._sglang_runtime import (
    _CHECK_OF,
    _DEFER,
    _OLD_DYNAMO,
    _SAVED,
    _STATE,
    _active,
    _capturing,
    _checker,
    _config,
)

# (payload field, FutureMap buffer): the relay of the overlap scheduler
RELAY = (("bonus_tokens", "output_tokens_buf"), ("topk_p", "topk_p_buf"), ("topk_index", "topk_index_buf"),
         ("hidden_states", "hidden_states_buf"), ("draft_probs", "draft_probs_buf"))
# bonus tokens are int32 from verify and int64 from prefill (the EagleDraftInput policy): both widen losslessly
_WIDENS = {("bonus_tokens", torch.int32, torch.int64)}

# spec_info field -> the phase class and field whose width the graph buffer must have
GRAPH_FIELDS = {
    "graph_draft": (("topk_p", DraftInput), ("topk_index", DraftInput), ("hidden_states", DraftInput),
                    ("draft_probs", DraftInput)),
    "graph_extend": (("hidden_states", DraftExtendInput),),
}


def _error(label: str, field: str, text: str, cls: type) -> SpecContractError:
    return SpecContractError(f"sglang {label}: {field} {text} [consumer: {label}]", cls_name=cls.__name__,
                             field=field, consumer=label)


def _resolve(fn: Any, get: Bound, label: str) -> Any:
    at = get.position("batch")

    @functools.wraps(fn)
    def _resolve_spec_extras(*args: Any, **kwargs: Any) -> None:
        fn(*args, **kwargs)
        batch = args[at] if len(args) > at else get(args, kwargs)[1]
        try:  # plain attribute reads (the hot path; getattr with a default looks through the class each time)
            spec = batch.spec_info
            indices = spec.future_indices
        except AttributeError:
            return  # nothing relayed, or another algorithm's input: not the contract's
        if indices is None or (_CLASS_OF.get(type(spec)) != "EagleDraftInput" and not _eagle_draft_input(spec)):
            return  # nothing relayed, or another algorithm's input (ngram, DFLASH): not the contract's
        spec._spec_schema_resolved = indices  # adapter.mark_resolved(spec), inline (a hot path): RESOLVED
        if label in _DEFER:  # draft's entry (or the trivial build's, at zero steps) checks it, naming us
            spec._spec_schema_producer = label  # (PRODUCER, a plain store)
        elif _SAVED and not standing_aside() and indices.shape[0]:  # _active(), inline
            (_CHECK_OF.get(type(spec)) or _checker(spec))(spec, None, label, "")  # the batch's own fields
            # are compared at draft's entry
    return _resolve_spec_extras


def _eagle_draft_input(obj: Any) -> bool:
    try:
        return adapter._engine_class(obj) == "EagleDraftInput"
    except TypeError:
        return False


def _stash(fn: Any, get: Bound, label: str) -> Any:
    at = (get.position("self"), get.position("payload"))
    reach = max(at) + 1

    @functools.wraps(fn)
    def stash(*args: Any, **kwargs: Any) -> None:
        if _SAVED and not (_COMPILER._is_compiling_flag or _OLD_DYNAMO and _dynamo_compiling()
                or _HAS_CUDA and _capturing()):  # _active(), inline (standing_aside() too): a hot path
            relay, payload = (args[at[0]], args[at[1]]) if len(args) >= reach else get(args, kwargs)
            if not _relay_fits(relay, payload):  # the common verdict in one generated pass; else each field
                _check_relay(relay, payload, label)  # in turn, naming the one that differs
        return fn(*args, **kwargs)
    return stash


def _relay_fits_source() -> str:
    """`_relay_fits(relay, payload)`: True when every RELAY pair is an exact tensor pair of one dtype (or a
    widening of `_WIDENS`) and one row shape, or has a None side; False for anything else (then
    `_check_relay` looks field by field: a tensor subclass, a missing attribute, a real difference)."""
    lines = ["def fits(relay, payload):", "    try:"]
    lines += [f"        s{k}, b{k} = payload.{f}, relay.{b}" for k, (f, b) in enumerate(RELAY)]
    lines += ["    except AttributeError:", "        return False"]
    for k, (field, _) in enumerate(RELAY):
        widen = " and ".join(f"not (s{k}.dtype is _dt[{a!r}] and b{k}.dtype is _dt[{b!r}])"
                             for f, a, b in ((f, str(a), str(b)) for f, a, b in _WIDENS) if f == field)
        dtype = f"s{k}.dtype is not b{k}.dtype" + (f" and {widen}" if widen else "")
        lines += [f"    if type(s{k}) is _T and type(b{k}) is _T:",
                  f"        if {dtype} or s{k}.ndim > 1 and s{k}.shape[1:] != b{k}.shape[1:]:",
                  "            return False",
                  f"    elif s{k} is not None and b{k} is not None:",
                  "        return False"]
    return "\n".join([*lines, "    return True"]) + "\n"


_relay_fits = generated(_relay_fits_source(), "fits", "relay check", {
    "_dt": {str(d): d for _, a, b in _WIDENS for d in (a, b)}})


def _check_relay(relay: Any, payload: Any, label: str) -> None:
    for field, buf_name in RELAY:
        src, buf = getattr(payload, field, None), getattr(relay, buf_name, None)
        if not isinstance(src, torch.Tensor) or not isinstance(buf, torch.Tensor):
            continue
        if src.dtype != buf.dtype and (field, src.dtype, buf.dtype) not in _WIDENS:
            raise _error(label, field, f"is {src.dtype}: the relay buffer FutureMap.{buf_name} is {buf.dtype}, and "
                         "stash would cast it silently", DraftInput)
        if src.dim() > 1 and src.shape[1:] != buf.shape[1:]:
            raise _error(label, field, f"is {tuple(src.shape)}: the relay buffer FutureMap.{buf_name} holds rows of "
                         f"{tuple(buf.shape[1:])}", DraftInput)


def _graph(kind: str) -> Any:
    def make(fn: Any, get: Bound, label: str) -> Any:
        @functools.wraps(fn)
        def copy_in(*args: Any, **kwargs: Any) -> Any:
            if _active():
                runner, forward_batch = get(args, kwargs)
                _check_copy_in(kind, runner.buffers, forward_batch.spec_info, label)
            return fn(*args, **kwargs)
        return copy_in
    return make


def _check_copy_in(kind: str, buffers: Any, spec: Any, label: str) -> None:
    config = _config() if _STATE.draft_config else None  # multi-layer / frozen-KV drafts: no width rule
    for field, cls in GRAPH_FIELDS[kind]:
        src, buf = getattr(spec, field, None), getattr(buffers, field, None)
        if not isinstance(src, torch.Tensor) or not isinstance(buf, torch.Tensor):
            continue
        if src.dtype != buf.dtype:
            raise _error(label, field, f"is {src.dtype}: the CUDA-graph buffer is {buf.dtype}, and the copy-in would "
                         "cast it silently", cls)
        if src.dim() > 1 and src.shape[-1] != buf.shape[-1]:
            raise _error(label, field, f"has width {src.shape[-1]}: the CUDA-graph buffer's is {buf.shape[-1]}", cls)
        if field == "hidden_states" and config is not None:
            want = _width(cls, config)
            if want is not None and buf.shape[-1] != want:
                raise _error(label, field, f"CUDA-graph buffer has width {buf.shape[-1]}, expected {want} "
                             f"({cls.__name__}.hidden_size_for the config)", cls)


def _width(cls: type, config: Any) -> Optional[int]:
    return cls.hidden_size_for(config)


HOOKS = {"resolve": _resolve, "stash": _stash, "graph_draft": _graph("graph_draft"),
         "graph_extend": _graph("graph_extend")}
"""Hook name -> wrapper factory, for the relay and the CUDA-graph copy-in rows of the boundary table."""
