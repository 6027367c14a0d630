"""`spec_schema.engines.sglang.install()`: sglang's own producers and consumers wrapped with checks.

Under SPEC_STRICT=1 or 2, `install(config)` replaces these sglang 0.5.23 functions (in every loaded
sglang module that holds them, since sglang imports them by name) with wrappers that call
`spec_schema.engines.sglang.check` on what goes in and what comes out:

| sglang function | checked |
|---|---|
| `EagleDraftInput/EagleVerifyInput/EagleDraftExtendInput.create_idle_input` | the idle object |
| `EagleVerifyInput.__post_init__` (its constructor) | the object (sglang builds it complete) |
| `EagleDraftInput.merge_batch` | one index dtype per field across the merge, then the merged object |
| `EagleDraftInput.filter_batch` | the filtered object |
| `eagle_utils.build_tree_kernel_efficient` | its outputs, as the `EagleVerifyInput` sglang assembles from them |
| `eagle_worker_common.build_eagle_verify_input` | the `EagleVerifyInput` against the batch |
| `eagle_utils.eagle_sample` | the verify input (consumer) and the verify result (producer) |
| `eagle_worker_common.prepare_for_draft_extend` | the draft-extend input with the batch and its input ids |
| `EagleDraftWorker.draft` | `batch.spec_info` (consumer), the verify input (producer) |
| `EagleDraftWorker._draft_extend_for_prefill` | the next `EagleDraftInput` |
| `EagleDraftWorker._draft_extend_for_decode` | the verify result, then the next `EagleDraftInput` |
| `EAGLEWorkerV2.verify` | `batch.spec_info` (consumer), the verify result (producer) |

`EagleDraftInput` and `EagleDraftExtendInput` constructors are not wrapped: sglang builds them
partially and fills them in later (`EagleDraftInput(bonus_tokens=...)` in verify, its top-k in
draft-extend), so they are checked where they are complete, at the boundaries above. With
SPEC_STRICT unset nothing is wrapped. Checks stand aside while a CUDA graph is captured or
torch.compile traces, like every spec_schema boundary.
"""

import functools
import importlib
import operator
import sys
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
        return value.dtype, value.shape, value.get_device()
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
_STATE = SimpleNamespace(config=None, mask_mode=None)


def installed() -> bool:
    """Whether the wrappers are in place."""
    return bool(_SAVED)


def _config() -> Optional[SpecConfig]:
    c = _STATE.config
    return c() if callable(c) and not isinstance(c, SpecConfig) else c


def install(config: Any, tree_mask_mode: Any = None) -> bool:
    """Wrap sglang's producers and consumers (see the module docstring) so every boundary is checked;
    False, wrapping nothing, with SPEC_STRICT unset. Idempotent.

    `config`: the `SpecConfig` the wrappers check against, or a callable returning it (sglang's own
    server config bag exists only inside a server; build the SpecConfig from the target's and the
    draft's HF configs with `ModelDims.from_hf_config` and the server's num_steps / topk /
    num_draft_tokens). `tree_mask_mode`: the attention backend's mask mode, when its preallocated
    QLEN_ONLY buffer may be longer than a batch needs (see `check`)."""
    if not _strict.LEVEL:
        return False
    if not (isinstance(config, SpecConfig) or callable(config)):
        raise TypeError(f"install(config): a SpecConfig or a callable returning one, got {type(config).__name__}")
    _STATE.config, _STATE.mask_mode = config, tree_mask_mode
    if _SAVED:
        return True
    mods = {k: importlib.import_module(f"sglang.srt.speculative.{k}")
            for k in ("eagle_info", "eagle_utils", "eagle_worker_common", "eagle_worker_v2")}
    info, utils, common, v2 = (mods[k] for k in ("eagle_info", "eagle_utils", "eagle_worker_common",
                                                 "eagle_worker_v2"))
    for cls in (info.EagleDraftInput, info.EagleVerifyInput, info.EagleDraftExtendInput):
        _wrap_classmethod(cls, "create_idle_input", _idle(cls.__name__))
    _wrap_attr(info.EagleVerifyInput, "__post_init__", _verify_post_init)
    _wrap_attr(info.EagleDraftInput, "merge_batch", _merge)
    _wrap_attr(info.EagleDraftInput, "filter_batch", _filter)
    _wrap_everywhere(utils.build_tree_kernel_efficient, _tree(info.EagleVerifyInput))
    _wrap_everywhere(common.build_eagle_verify_input, _build_verify)
    _wrap_everywhere(utils.eagle_sample, _sample)
    _wrap_everywhere(common.prepare_for_draft_extend, _prepare_extend)
    _wrap_attr(v2.EagleDraftWorker, "draft", _draft)
    _wrap_attr(v2.EagleDraftWorker, "_draft_extend_for_prefill", _extend_prefill)
    _wrap_attr(v2.EagleDraftWorker, "_draft_extend_for_decode", _extend_decode)
    _wrap_attr(v2.EAGLEWorkerV2, "verify", _verify)
    return True


def uninstall() -> None:
    """Put every original back (last wrapped first)."""
    while _SAVED:
        holder, name, original = _SAVED.pop()
        setattr(holder, name, original)


# --- wrapping machinery -----------------------------------------------------------------------------


def _wrap_attr(holder: Any, name: str, make: Callable[[Any], Any]) -> None:
    original = holder.__dict__[name]
    _SAVED.append((holder, name, original))
    setattr(holder, name, make(original))


def _wrap_classmethod(cls: type, name: str, make: Callable[[Any], Any]) -> None:
    original = cls.__dict__[name]
    _SAVED.append((cls, name, original))
    setattr(cls, name, classmethod(make(original.__func__)))


def _wrap_everywhere(fn: Callable[..., Any], make: Callable[[Any], Any]) -> None:
    """Replace `fn` in every loaded sglang module holding it (sglang imports functions by name)."""
    wrapped = make(fn)
    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("sglang.") and any(v is fn for v in vars(mod).values()):
            for attr, value in list(vars(mod).items()):
                if value is fn:
                    _SAVED.append((mod, attr, fn))
                    setattr(mod, attr, wrapped)


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
    config = _config()
    if _strict.LEVEL >= 2:
        _full_check(obj, batch, config, producer, consumer)
        return
    name = adapter._engine_class(obj)
    values = read_values(name, obj, batch)
    same = (id(config), id(obj), id(batch))
    known = _SAME.get(same)
    if known is not None and known[0] is config and all(map(operator.is_, known[1], values)):
        return
    key = (id(config), _STATE.mask_mode, signature(name, obj, batch))
    if _SEEN.get(key) is not config:
        _full_check(obj, batch, config, producer, consumer)
        _remember(_SEEN, key, config)
    _remember(_SAME, same, (config, values, obj, batch))


def _full_check(obj: Any, batch: Any, config: Any, producer: str, consumer: str) -> None:
    BOUNDARY_CALLS["sglang " + (producer or consumer)] += 1
    adapter.check(obj, config, batch, producer=producer or None, consumer=consumer or None,
                  tree_mask_mode=_STATE.mask_mode)


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


# --- the wrappers -------------------------------------------------------------------------------------


def _idle(cls_name: str) -> Callable[[Any], Any]:
    def make(fn: Any) -> Any:
        @functools.wraps(fn)
        def create_idle_input(cls: type, *args: Any, **kwargs: Any) -> Any:
            out = _inside(fn, cls, *args, **kwargs)
            if _active():
                _check(out, producer=f"{cls_name}.create_idle_input")
            return out
        return create_idle_input
    return make


def _verify_post_init(fn: Any) -> Any:
    @functools.wraps(fn)
    def __post_init__(self: Any) -> None:
        fn(self)
        if _outermost():  # inside build_eagle_verify_input / draft the producer's exit checks it
            _check(self, producer="EagleVerifyInput.__init__")
    return __post_init__


def _merge(fn: Any) -> Any:
    @functools.wraps(fn)
    def merge_batch(self: Any, spec_info: Any) -> None:
        if _active() and self.future_indices is None:
            adapter.check_merge_inputs(self, spec_info)
        fn(self, spec_info)
        if _active():
            _check(self, producer="EagleDraftInput.merge_batch")
    return merge_batch


def _filter(fn: Any) -> Any:
    @functools.wraps(fn)
    def filter_batch(self: Any, *args: Any, **kwargs: Any) -> None:
        fn(self, *args, **kwargs)
        if _active():
            _check(self, producer="EagleDraftInput.filter_batch")
    return filter_batch


def _tree(verify_cls: type) -> Callable[[Any], Any]:
    def make(fn: Any) -> Any:
        @functools.wraps(fn)
        def build_tree_kernel_efficient(bonus_tokens: Any, parent_list: Any, top_scores_index: Any,
                                        draft_tokens: Any, seq_lens: Any, seq_lens_sum: int, topk: int,
                                        spec_steps: int, num_verify_tokens: int, *args: Any, **kwargs: Any) -> Any:
            out = fn(bonus_tokens, parent_list, top_scores_index, draft_tokens, seq_lens, seq_lens_sum, topk,
                     spec_steps, num_verify_tokens, *args, **kwargs)
            if _outermost():  # the outputs as the EagleVerifyInput sglang assembles from them
                tree_mask, positions, r_index, r_next, r_sibling, tokens = out
                view = object.__new__(verify_cls)
                view.__dict__.update(draft_token=tokens, custom_mask=tree_mask, positions=positions,
                                     retrieve_index=r_index, retrieve_next_token=r_next,
                                     retrieve_next_sibling=r_sibling, draft_token_num=num_verify_tokens,
                                     seq_lens_cpu=None, seq_lens_sum=seq_lens_sum, draft_probs=None)
                batch = SimpleNamespace(seq_lens=seq_lens, req_pool_indices=None, seq_lens_sum=seq_lens_sum)
                adapter.check(view, _config(), _NoPool(batch), producer="eagle_utils.build_tree_kernel_efficient")
            return out
        return build_tree_kernel_efficient
    return make


class _NoPool:
    """A batch whose req_pool_indices the function did not receive: the seq_lens' shape stands in."""

    def __init__(self, batch: Any) -> None:
        self.__dict__.update(vars(batch))
        self.req_pool_indices = batch.seq_lens.new_zeros(batch.seq_lens.shape, dtype=__import__("torch").int64)


def _build_verify(fn: Any) -> Any:
    @functools.wraps(fn)
    def build_eagle_verify_input(batch: Any, *args: Any, **kwargs: Any) -> Any:
        out = _inside(fn, batch, *args, **kwargs)
        if _outermost():  # inside EagleDraftWorker.draft, draft's exit checks it
            _check(out, None if batch.forward_mode.is_idle() else batch,
                   producer="eagle_worker_common.build_eagle_verify_input")
        return out
    return build_eagle_verify_input


def _sample(fn: Any) -> Any:
    @functools.wraps(fn)
    def eagle_sample(verify_input: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        idle = batch.forward_mode.is_idle()
        if _outermost():  # inside EAGLEWorkerV2.verify, verify's entry checked it
            _check(verify_input, None if idle else batch, consumer="eagle_utils.eagle_sample")
        out = fn(verify_input, batch, *args, **kwargs)
        if _outermost():  # inside EAGLEWorkerV2.verify its result is checked at verify's exit
            from sglang.srt.managers.utils import GenerationBatchResult

            predict, accept_lens, accept_index = out
            result = GenerationBatchResult(next_token_ids=predict, accept_lens=accept_lens, accept_index=accept_index)
            _check(result, None if idle else batch, producer="eagle_utils.eagle_sample")
        return out
    return eagle_sample


class _WithInputIds:
    """The batch as prepare_for_draft_extend will leave it: its input ids are the predict window."""

    def __init__(self, batch: Any, input_ids: Any) -> None:
        self._batch, self.input_ids = batch, input_ids

    def __getattr__(self, name: str) -> Any:
        return getattr(self._batch, name)


def _prepare_extend(fn: Any) -> Any:
    @functools.wraps(fn)
    def prepare_for_draft_extend(draft_extend_input: Any, batch: Any, predict: Any, *args: Any, **kwargs: Any) -> Any:
        if _active() and not batch.forward_mode.is_idle():
            _check(draft_extend_input, _WithInputIds(batch, predict),
                   consumer="eagle_worker_common.prepare_for_draft_extend")
        return fn(draft_extend_input, batch, predict, *args, **kwargs)
    return prepare_for_draft_extend


def _takes_and_makes(name: str, made: Callable[[Any], Any] = lambda out: out) -> Callable[[Any], Any]:
    """A worker method that consumes `batch.spec_info` and produces the next phase's object (`made(out)`)."""

    def wrap(fn: Any) -> Any:
        @functools.wraps(fn)
        def method(self: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
            live = None if batch.forward_mode.is_idle() else batch
            if _active():
                _check(batch.spec_info, live, consumer=name)
            out = _inside(fn, self, batch, *args, **kwargs)
            if _active():
                _check(made(out), live, producer=name)
            return out
        return method
    return wrap


_draft = _takes_and_makes("EagleDraftWorker.draft", lambda out: out[0] if isinstance(out, tuple) else out)
_verify = _takes_and_makes("EAGLEWorkerV2.verify")


def _extend_prefill(fn: Any) -> Any:
    @functools.wraps(fn)
    def _draft_extend_for_prefill(self: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        out = fn(self, batch, *args, **kwargs)
        if _active():
            _check(out, None if batch.forward_mode.is_idle() else batch,
                   producer="EagleDraftWorker._draft_extend_for_prefill")
        return out
    return _draft_extend_for_prefill


def _extend_decode(fn: Any) -> Any:
    @functools.wraps(fn)
    def _draft_extend_for_decode(self: Any, batch: Any, batch_result: Any, *args: Any, **kwargs: Any) -> Any:
        live = None if batch.forward_mode.is_idle() else batch
        if _active():
            _check(batch_result, live, consumer="EagleDraftWorker._draft_extend_for_decode")
        out = fn(self, batch, batch_result, *args, **kwargs)
        if _active():
            _check(batch_result.next_draft_input, live, producer="EagleDraftWorker._draft_extend_for_decode")
        return out
    return _draft_extend_for_decode


