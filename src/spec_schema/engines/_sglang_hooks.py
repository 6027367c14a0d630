"""The wrappers `install()` puts around sglang's boundaries, one factory per kind (`HOOKS`; the boundary
table `_sglang_boundaries.BOUNDARIES` names one per row).

A factory takes the original function, a `Bound` that reads the parameters the row names (by name,
from the signature) and the boundary's label (`Class.method`, named as producer or consumer in
errors), and returns the wrapper. Wrappers check only while `_active()` (installed, no CUDA graph
capture, no torch.compile trace)."""

import functools
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from .._contract import _COMPILER, _HAS_CUDA, _dynamo_compiling, standing_aside
from ..errors import SpecContractError
from . import _sglang_check as adapter
from ._sglang_boundaries import Bound
from ._sglang_runtime import (
    _CHECK_OF,
    _DEFER,
    _DEPTH,
    _OLD_DYNAMO,
    _SAVED,
    MASK_MODE,
    PRODUCER,
    _active,
    _capturing,
    _check,
    _checker,
    _config,
    _inside,
    _outermost,
    _thread,
)

Hook = Callable[[Any, Bound, str], Any]


def _live(batch: Any) -> Any:
    """The batch, or None on an idle batch (whose objects have no rows to compare with it)."""
    return None if batch.forward_mode.is_idle() else batch


def _idle(fn: Any, get: Bound, label: str) -> Any:
    @functools.wraps(fn)
    def create_idle_input(*args: Any, **kwargs: Any) -> Any:
        out = _inside(fn, *args, **kwargs)
        if _active():
            _check(out, producer=label)
        return out
    return create_idle_input


def _post_init(fn: Any, get: Bound, label: str) -> Any:
    @functools.wraps(fn)
    def __post_init__(*args: Any, **kwargs: Any) -> None:
        fn(*args, **kwargs)
        # _outermost(), inline (a hot path); inside build_eagle_verify_input / draft the producer's exit checks it
        if _thread() not in _DEPTH and _SAVED and not standing_aside():
            (self,) = get(args, kwargs)
            _check(self, producer=label.replace("__post_init__", "__init__"))
    return __post_init__


def _merge(fn: Any, get: Bound, label: str) -> Any:
    @functools.wraps(fn)
    def merge_batch(*args: Any, **kwargs: Any) -> None:
        self, other = get(args, kwargs)
        handle = self.future_indices is not None  # the overlap scheduler merges future_indices only
        if _active() and not handle:
            adapter.check_merge_inputs(self, other, widen=True)  # a joining prefill request: int64 bonus
        fn(*args, **kwargs)
        if _active() and not handle:
            _check(self, producer=label)
    return merge_batch


def _filter(fn: Any, get: Bound, label: str) -> Any:
    @functools.wraps(fn)
    def filter_batch(*args: Any, **kwargs: Any) -> None:
        fn(*args, **kwargs)
        (self,) = get(args, kwargs)
        if _active() and self.future_indices is None:
            _check(self, producer=label)
    return filter_batch


_PADDED = ("draft_probs", "num_correct_drafts", "num_accept_tokens")


def _pad(fn: Any, get: Bound, label: str) -> Any:
    @functools.wraps(fn)
    def pad_batch(*args: Any, **kwargs: Any) -> None:
        self, size = get(args, kwargs)
        before = {f: getattr(self, f).dtype for f in _PADDED if isinstance(getattr(self, f, None), torch.Tensor)}
        fn(*args, **kwargs)
        if _active():
            for f, dtype in before.items():
                t = getattr(self, f)
                if t.dtype != dtype or t.shape[0] != size:
                    raise SpecContractError(
                        f"sglang {label}: {f} is {tuple(t.shape)} {t.dtype} after padding, expected {size} rows "
                        f"of its {dtype} [producer: {label}]", field=f, axis="bs", producer=label)
    return pad_batch


def _tree(fn: Any, get: Bound, label: str) -> Any:
    verify_cls = _verify_cls()

    @functools.wraps(fn)
    def build_tree_kernel_efficient(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        if _thread() not in _DEPTH and _SAVED and not standing_aside():  # the outputs as the EagleVerifyInput sglang
            # assembles from them (_outermost(), inline: inside EagleDraftWorker.draft this is the hot path)
            seq_lens, seq_lens_sum, n, mode = get(args, kwargs)
            tree_mask, positions, r_index, r_next, r_sibling, tokens = out
            view = object.__new__(verify_cls)
            view.__dict__.update(draft_token=tokens, custom_mask=tree_mask, positions=positions,
                                 retrieve_index=r_index, retrieve_next_token=r_next, retrieve_next_sibling=r_sibling,
                                 draft_token_num=n, seq_lens_cpu=None, seq_lens_sum=seq_lens_sum, draft_probs=None,
                                 spec_steps=None)
            view.__dict__[MASK_MODE] = mode
            batch = SimpleNamespace(seq_lens=seq_lens, seq_lens_sum=seq_lens_sum,
                                    req_pool_indices=seq_lens.new_zeros(seq_lens.shape, dtype=torch.int64))
            adapter.check(view, _config(), batch, producer=label, tree_mask_mode=mode)
        return out
    return build_tree_kernel_efficient


def _verify_cls() -> type:
    from sglang.srt.speculative.eagle_info import EagleVerifyInput

    return EagleVerifyInput


def _build_verify(fn: Any, get: Bound, label: str) -> Any:
    at_batch, at_mode, no_mode = get.position("batch"), get.position("tree_mask_mode"), get.default("tree_mask_mode")

    @functools.wraps(fn)
    def build_eagle_verify_input(*args: Any, **kwargs: Any) -> Any:
        me = _thread()
        inner = me in _DEPTH  # inside a wrapped producer (EagleDraftWorker.draft every iteration: the hot path),
        if inner:  # whose entry already tells the boundaries inside that their objects are checked later
            out = fn(*args, **kwargs)
        else:
            _DEPTH[me] = 1  # _inside(), inline
            try:
                out = fn(*args, **kwargs)
            finally:  # _leave(me), inline: the boundaries inside left the count at 1
                del _DEPTH[me]
        n = len(args)  # the mode its custom_mask was built in, for every later check (MASK_MODE, a plain store)
        out._spec_schema_tree_mask_mode = args[at_mode] if n > at_mode else kwargs.get("tree_mask_mode", no_mode)
        if not inner and _SAVED and not standing_aside():  # inside EagleDraftWorker.draft, draft's exit
            batch = args[at_batch] if n > at_batch else get(args, kwargs)[0]  # checks it
            _check(out, _live(batch), producer=label)
        return out
    return build_eagle_verify_input


def _consume_verify(fn: Any, get: Bound, label: str) -> Any:
    """eagle_prepare_for_verify: the verify input before the target runs on it."""
    @functools.wraps(fn)
    def consumer(*args: Any, **kwargs: Any) -> Any:
        if _thread() not in _DEPTH and _SAVED and not standing_aside():  # inside the wrapped verify methods (the hot
            # path: _outermost() inline), verify's entry checked it
            verify_input, batch = get(args, kwargs)
            _check(verify_input, _live(batch), consumer=label)
        return fn(*args, **kwargs)
    return consumer


def _sample(fn: Any, get: Bound, label: str) -> Any:
    @functools.wraps(fn)
    def eagle_sample(*args: Any, **kwargs: Any) -> Any:
        if _thread() in _DEPTH or not _SAVED or standing_aside():  # inside EAGLEWorkerV2.verify (the hot path:
            return fn(*args, **kwargs)  # not _outermost(), inline), verify's entry and exit check both objects
        verify_input, batch = get(args, kwargs)
        live = _live(batch)
        _check(verify_input, live, consumer=label)
        out = fn(*args, **kwargs)
        if _outermost():
            from sglang.srt.managers.utils import GenerationBatchResult

            predict, accept_lens, accept_index = out
            _check(GenerationBatchResult(next_token_ids=predict, accept_lens=accept_lens, accept_index=accept_index),
                   live, producer=label)
        return out
    return eagle_sample


def _compact(fn: Any, get: Bound, label: str) -> Any:
    px, pa, pb = (get.position(n) for n in ("x", "accept_index", "bs"))
    reach = max(px, pa, pb) + 1

    @functools.wraps(fn)
    def _compact_accept_to_front(*args: Any, **kwargs: Any) -> Any:
        if _SAVED and not (_COMPILER._is_compiling_flag or _OLD_DYNAMO and _dynamo_compiling()
                or _HAS_CUDA and _capturing()):  # _active(), inline (standing_aside() too): a hot path
            if len(args) >= reach and "num_draft_tokens" in kwargs:  # sglang's call: get() inline
                x, accept_index, bs, n = args[px], args[pa], args[pb], kwargs["num_draft_tokens"]
            else:
                x, accept_index, bs, n = get(args, kwargs)
            shape, rows = accept_index.shape, x.shape[0]
            if rows != bs * n or len(shape) != 2 or shape[0] != bs or shape[1] > n:
                raise SpecContractError(
                    f"sglang {label}: accept_index {tuple(shape)} over {rows} rows: expected "
                    f"(bs, num_steps + 1) = ({bs}, <= num_draft_tokens {n}) over bs*num_draft_tokens = {bs * n} rows "
                    f"(a request's accepted path must fit its block of num_draft_tokens) [consumer: {label}]",
                    cls_name="VerifyOutput", field="accept_indices", axis="accept_width", consumer=label)
        return fn(*args, **kwargs)
    return _compact_accept_to_front


class _WithInputIds(SimpleNamespace):
    """The batch as prepare_for_draft_extend will leave it: its input ids are the predict window. The
    attributes a check reads are copied in (read as plain attributes); any other comes from the batch."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self._batch, name)


def _prepare_extend(fn: Any, get: Bound, label: str) -> Any:
    at = (get.position("draft_extend_input"), get.position("batch"), get.position("predict"))
    reach, idle = max(at) + 1, _idle_mode()

    @functools.wraps(fn)
    def prepare_for_draft_extend(*args: Any, **kwargs: Any) -> Any:
        if _SAVED and not (_COMPILER._is_compiling_flag or _OLD_DYNAMO and _dynamo_compiling()
                or _HAS_CUDA and _capturing()):  # _active(), inline (standing_aside() too): a hot path
            if len(args) >= reach:
                extend_input, batch, predict = args[at[0]], args[at[1]], args[at[2]]
            else:
                extend_input, batch, predict = get(args, kwargs)
            mode = batch.forward_mode  # not _live(batch), inline (as in _takes_and_makes)
            if mode is not idle and (type(mode) is type(idle) or not mode.is_idle()):
                view = _WithInputIds(_batch=batch, input_ids=predict, seq_lens=batch.seq_lens,
                                     req_pool_indices=batch.req_pool_indices,
                                     extend_num_tokens=getattr(batch, "extend_num_tokens", None))
                (_CHECK_OF.get(type(extend_input)) or _checker(extend_input))(extend_input, view, "", label)
        return fn(*args, **kwargs)
    return prepare_for_draft_extend


def _takes_and_makes(first: bool) -> Hook:
    """A worker method that consumes `batch.spec_info` and produces the next phase's object: what it
    returns, or (`first`) the first item of the tuple it returns. That object is checked at the consumer's
    entry when install() deferred it (`_DEFER`), except a draft called with keywords (pipeline parallelism's
    tail draft, `with_topology=True`: its chain is relayed to other stages before any verify) and a verify
    of a worker at zero draft steps (sglang may stub its draft-extend, SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND): those
    are checked at the exit."""

    def make(fn: Any, get: Bound, label: str) -> Any:
        at, idle = get.position("batch"), _idle_mode()

        @functools.wraps(fn)
        def method(*args: Any, **kwargs: Any) -> Any:
            if not _SAVED or _COMPILER._is_compiling_flag or _OLD_DYNAMO and _dynamo_compiling() \
                    or _HAS_CUDA and _capturing():  # not _active(), inline (standing_aside() too): the hot path
                return fn(*args, **kwargs)
            batch = args[at] if len(args) > at else get(args, kwargs)[1]
            mode = batch.forward_mode  # _live(batch), inline: an sglang ForwardMode is IDLE when it is that member
            live = None if mode is idle or type(mode) is not type(idle) and mode.is_idle() else batch
            spec = batch.spec_info  # _check(spec, live, consumer=label), inline:
            (_CHECK_OF.get(type(spec)) or _checker(spec))(spec, live, "", label)
            me = _thread()  # _inside(), inline; nested in another wrapped producer, its entry serves (the
            if me in _DEPTH:  # boundaries inside ask only whether this thread has one)
                out = fn(*args, **kwargs)
            else:
                _DEPTH[me] = 1
                try:
                    out = fn(*args, **kwargs)
                finally:  # _leave(me), inline: the boundaries inside left the count at 1
                    del _DEPTH[me]
            made = out[0] if first and isinstance(out, tuple) else out
            if label not in _DEFER:
                defer = False
            elif first:
                defer = not kwargs
            else:  # whether the verifying worker drafts, read inline (a call here cost ~5 us on sglang's loop)
                try:
                    defer = args[0].speculative_num_steps
                except (AttributeError, IndexError):
                    defer = False
            if defer:  # the consumer's entry checks it, naming us (PRODUCER, a plain store)
                made._spec_schema_producer = label
            else:
                (_CHECK_OF.get(type(made)) or _checker(made))(made, live, label, "")
            return out
        return method
    return make


def _idle_mode() -> Any:
    """sglang's `ForwardMode.IDLE` (a wrapper compares a batch's mode with it by identity, and calls
    `is_idle()` on a mode of another type), or a placeholder that no mode is when sglang lacks it."""
    try:
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        return ForwardMode.IDLE
    except (ImportError, AttributeError):
        return _NO_MODE


class _NoMode:
    """No sglang ForwardMode to compare with: every batch's `is_idle()` is asked."""


_NO_MODE = _NoMode()


def _extend_prefill(fn: Any, get: Bound, label: str) -> Any:
    extend_cls = _extend_cls()

    @functools.wraps(fn)
    def _draft_extend_for_prefill(*args: Any, **kwargs: Any) -> Any:
        _, batch, hidden = get(args, kwargs)
        live = _live(batch)
        if _active() and live is not None:  # the EagleDraftExtendInput it builds, before the draft runs on it
            _check(extend_cls(hidden_states=hidden, num_tokens_per_req=1, num_tokens_for_logprob_per_req=1), live,
                   consumer=label)
        out = _inside(fn, *args, **kwargs)
        if _active():
            _check(out, live, producer=label)
        return out
    return _draft_extend_for_prefill


def _extend_cls() -> type:
    from sglang.srt.speculative.eagle_info import EagleDraftExtendInput

    return EagleDraftExtendInput


def _extend_decode(fn: Any, get: Bound, label: str) -> Any:
    at_batch, at_result, idle = get.position("batch"), get.position("batch_result"), _idle_mode()

    @functools.wraps(fn)
    def _draft_extend_for_decode(*args: Any, **kwargs: Any) -> Any:
        if not _SAVED or _COMPILER._is_compiling_flag or _OLD_DYNAMO and _dynamo_compiling() \
                or _HAS_CUDA and _capturing():  # not _active(), inline (standing_aside() too): the hot path
            return fn(*args, **kwargs)
        if len(args) > max(at_batch, at_result):
            batch, result = args[at_batch], args[at_result]
        else:
            _, batch, result = get(args, kwargs)
        mode = batch.forward_mode  # _live(batch), inline (as in _takes_and_makes)
        live = None if mode is idle or type(mode) is not type(idle) and mode.is_idle() else batch
        (_CHECK_OF.get(type(result)) or _checker(result))(result, live, "", label)  # _check, inline
        me = _thread()  # _inside(), inline; nested in another wrapped producer, its entry serves (the
        if me in _DEPTH:  # boundaries inside ask only whether this thread has one)
            out = fn(*args, **kwargs)
        else:
            _DEPTH[me] = 1
            try:
                out = fn(*args, **kwargs)
            finally:  # _leave(me), inline: the boundaries inside left the count at 1
                del _DEPTH[me]
        made = result.next_draft_input
        (_CHECK_OF.get(type(made)) or _checker(made))(made, live, label, "")
        return out
    return _draft_extend_for_decode


def _trivial(fn: Any, get: Bound, label: str) -> Any:
    @functools.wraps(fn)
    def _build_trivial_verify_input(*args: Any, **kwargs: Any) -> Any:
        _, batch = get(args, kwargs)
        spec = batch.spec_info  # the relay's EagleDraftInput, left to its consumer (draft, or this at zero steps)
        if getattr(spec, PRODUCER, None) is not None and _active() and not batch.forward_mode.is_idle():
            _check(spec, None, consumer=label)  # as the relay checked it (its rows; the batch is not compared)
        out = _inside(fn, *args, **kwargs)
        if _active():
            _check(out, _live(batch), producer=label)
        return out
    return _build_trivial_verify_input


HOOKS: dict[str, Hook] = {
    "idle": _idle, "post_init": _post_init, "merge": _merge, "filter": _filter, "pad": _pad, "tree": _tree,
    "build_verify": _build_verify, "prepare_verify": _consume_verify, "sample": _sample, "compact": _compact,
    "prepare_extend": _prepare_extend,
    "draft": _takes_and_makes(True), "verify": _takes_and_makes(False),
    "extend_prefill": _extend_prefill, "extend_decode": _extend_decode, "trivial": _trivial,
}
"""Hook name (the boundary table's `hook`) -> wrapper factory; the overlap and CUDA-graph ones are in
`_sglang_copyin.HOOKS`."""
