"""The paths sglang runs by default, under `install()`: the overlap scheduler's relay (FutureMap), the
prefill draft-extend input, the CUDA-graph runners' copy-in, padding, accepted-path compaction,
the verify input's tree-mask mode and the verify preparation. Each valid object passes; each
corruption is refused naming the field, before sglang uses it."""

import copy
from types import SimpleNamespace

import pytest
import torch

from spec_schema import SpecContractError, _strict
from spec_schema.engines import sglang as adapter
from spec_schema.engines._sglang_runtime import MASK_MODE
from spec_schema.testing import example_config

from . import sglang_env as env

CONFIG = example_config("EAGLE")
EAGLE3 = example_config("EAGLE3")

pytestmark = pytest.mark.skipif(not _strict.LEVEL, reason="install() wraps only under SPEC_STRICT")


def _future_map(monkeypatch):
    """sglang's FutureMap on the CPU, relaying hidden states (an EAGLE server's)."""
    from sglang.srt.managers.overlap_utils import FutureMap
    from sglang.srt.speculative import spec_utils
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    monkeypatch.setattr(spec_utils, "spec_need_hidden_states", lambda: True)
    pool = SimpleNamespace(req_to_token=torch.zeros(8, 16, dtype=torch.int32))
    return FutureMap(torch.device("cpu"), SpeculativeAlgorithm.EAGLE, pool)


def _relay(sg, monkeypatch, draft_input, idx):
    """Stash `draft_input` as the scheduler does after a forward; the handle it keeps, on a batch."""
    from sglang.srt.managers.overlap_utils import RelayPayload

    fm = _future_map(monkeypatch)
    fm.stash(idx, RelayPayload.from_draft_input(draft_input))
    sb = env.batch([5, 9])
    sb.spec_info = sg.eagle_info.EagleDraftInput(future_indices=idx)
    return fm, sb


def test_the_overlap_input_is_checked_once_filled(wrapped, monkeypatch):
    sg, gen, idx = wrapped, torch.Generator().manual_seed(11), torch.tensor([3, 5])
    live = env.draft_input(sg, CONFIG, 2, gen, torch.int32)
    fm, sb = _relay(sg, monkeypatch, live, idx)
    handle = sb.spec_info
    assert adapter.check(handle, CONFIG, sb) is None  # a handle: stale or no tensors until resolved
    fm._resolve_spec_extras(sb)  # wrapped: fills it, then checks it
    view = adapter.check(handle, CONFIG, sb)
    assert view is not None and view.hidden_states.shape == (2, CONFIG.draft.hidden_size)
    wide = copy.copy(live)  # a draft input twice the draft width, relayed and resolved
    wide.hidden_states = torch.cat([live.hidden_states, live.hidden_states], -1)
    fm, sb = _relay(sg, monkeypatch, wide, idx)
    fm._resolve_spec_extras(sb)  # the relay leaves the check to its consumer, the worker's entry, which names it
    with pytest.raises(SpecContractError, match=r"hidden_states -> DraftInput\.hidden_states.*hidden_draft") as err:
        sg.eagle_worker_v2.EagleDraftWorker.draft(None, sb)
    assert (err.value.producer, err.value.consumer) == (_RELAY, "EagleDraftWorker.draft")
    fm, sb = _relay(sg, monkeypatch, wide, idx)
    fm._resolve_spec_extras(sb)  # at zero draft steps the trivial verify input's build takes it instead
    with pytest.raises(SpecContractError, match=r"hidden_states -> DraftInput\.hidden_states.*hidden_draft") as err:
        sg.eagle_worker_v2.EAGLEWorkerV2._build_trivial_verify_input(None, sb)
    assert str(err.value).endswith(f"[producer: {_RELAY}; consumer: EAGLEWorkerV2._build_trivial_verify_input]")


_RELAY = "FutureMap._resolve_spec_extras"


@pytest.mark.parametrize("consumer", ["EagleDraftWorker.draft", "EAGLEWorkerV2._build_trivial_verify_input"])
def test_the_relay_checks_its_input_itself_when_a_consumer_is_not_wrapped(sg, monkeypatch, consumer):
    """An sglang where draft (or, at zero steps, the trivial build) could not be wrapped: resolve raises."""
    cls, name = consumer.split(".")

    def renamed(self, other_batch):  # the batch parameter renamed: probe() refuses it
        return None

    monkeypatch.setattr(getattr(sg.eagle_worker_v2, cls), name, renamed)
    try:
        with pytest.warns(UserWarning, match=name):
            adapter.install(CONFIG)
        live = env.draft_input(sg, CONFIG, 2, torch.Generator().manual_seed(17), torch.int32)
        wide = copy.copy(live)
        wide.hidden_states = torch.cat([live.hidden_states, live.hidden_states], -1)
        fm, sb = _relay(sg, monkeypatch, wide, torch.tensor([3, 5]))
        with pytest.raises(SpecContractError, match=r"hidden_states -> DraftInput\.hidden_states.*hidden_draft") as e:
            fm._resolve_spec_extras(sb)
        assert (e.value.producer, e.value.consumer) == (_RELAY, None)
    finally:
        adapter.uninstall()  # before monkeypatch puts sglang's method back


def test_a_stash_into_a_buffer_of_another_dtype_is_refused(wrapped, monkeypatch):
    from sglang.srt.managers.overlap_utils import RelayPayload

    sg, gen, idx = wrapped, torch.Generator().manual_seed(12), torch.tensor([1, 2])
    live = env.draft_input(sg, CONFIG, 2, gen, torch.int32)
    fm, _ = _relay(sg, monkeypatch, live, idx)
    fm.stash(idx, RelayPayload.from_draft_input(env.draft_input(sg, CONFIG, 2, gen, torch.int64)))  # widens: fine
    bad = copy.copy(live)
    bad.hidden_states = live.hidden_states.float()
    with pytest.raises(SpecContractError, match=r"FutureMap\.stash: hidden_states is torch\.float32: the relay buffer "
                                                r"FutureMap\.hidden_states_buf is torch\.bfloat16"):
        fm.stash(idx, RelayPayload.from_draft_input(bad))
    bad = copy.copy(live)
    bad.topk_p = live.topk_p.half()
    with pytest.raises(SpecContractError, match=r"topk_p is torch\.float16"):
        fm.stash(idx, RelayPayload.from_draft_input(bad))
    bad = copy.copy(live)
    bad.hidden_states = live.hidden_states[:, :-1]  # its dtype, another width
    with pytest.raises(SpecContractError, match=r"hidden_states is \(2, \d+\): the relay buffer FutureMap\."
                                                r"hidden_states_buf holds rows of"):
        fm.stash(idx, RelayPayload.from_draft_input(bad))


def test_the_prefill_draft_extend_input_is_checked_before_the_draft_runs(sg):
    assert adapter.install(EAGLE3)
    try:
        gen = torch.Generator().manual_seed(13)
        obj, sb = env.prefill_extend(sg, EAGLE3, [4, 3], gen)
        ids = torch.zeros(2, dtype=torch.int64)
        narrow = obj.hidden_states[:, : EAGLE3.target.hidden_size]  # the target's width without its 3 aux layers
        with pytest.raises(SpecContractError, match=r"hidden_states -> DraftExtendInput\.hidden_states.*hidden_extend"):
            sg.eagle_worker_v2.EagleDraftWorker._draft_extend_for_prefill(None, sb, narrow, ids)
        with pytest.raises(AttributeError):  # the right width passes the check; sglang's body then needs a worker
            sg.eagle_worker_v2.EagleDraftWorker._draft_extend_for_prefill(None, sb, obj.hidden_states, ids)
    finally:
        adapter.uninstall()


def test_cuda_graph_copy_in_has_the_buffers_dtype_and_width(wrapped):
    sg, gen = wrapped, torch.Generator().manual_seed(14)
    live = env.draft_input(sg, CONFIG, 2, gen, torch.int32)
    width, dtype = CONFIG.draft.hidden_size, CONFIG.draft.torch_dtype
    buffers = SimpleNamespace(topk_p=torch.zeros(8, 2), topk_index=torch.zeros(8, 2, dtype=torch.int64),
                              hidden_states=torch.zeros(8, width, dtype=dtype), draft_probs=None)
    runner = SimpleNamespace(buffers=buffers)
    from sglang.srt.speculative.eagle_draft_cuda_graph_runner import EAGLEDraftCudaGraphRunner as draft_runner
    from sglang.srt.speculative.eagle_draft_extend_cuda_graph_runner import EAGLEDraftExtendCudaGraphRunner

    with pytest.raises(AttributeError):  # matching buffers: the check passes, the fake batch stops sglang
        draft_runner.execute(runner, SimpleNamespace(spec_info=live))
    bad = copy.copy(live)
    bad.hidden_states = live.hidden_states.float()
    with pytest.raises(SpecContractError, match=r"execute: hidden_states is torch\.float32: the CUDA-graph buffer is "
                                                r"torch\.bfloat16"):
        draft_runner.execute(runner, SimpleNamespace(spec_info=bad))
    target_width = CONFIG.target.hidden_size
    extend = sg.eagle_info.EagleDraftExtendInput(hidden_states=torch.zeros(12, target_width // 2), num_tokens_per_req=6)
    small = SimpleNamespace(buffers=SimpleNamespace(hidden_states=torch.zeros(48, target_width // 2)))
    with pytest.raises(SpecContractError, match=r"CUDA-graph buffer has width 32, expected 64"):
        EAGLEDraftExtendCudaGraphRunner.execute(small, SimpleNamespace(spec_info=extend))


def test_padding_keeps_each_fields_dtype(wrapped):
    sg = wrapped
    extend = sg.eagle_info.EagleDraftExtendInput(num_correct_drafts=torch.zeros(2, dtype=torch.int32),
                                                 num_accept_tokens=torch.ones(2, dtype=torch.int32))
    extend.pad_batch(lambda t, n: torch.cat([t, t.new_zeros(n - t.shape[0])]), 4)
    assert extend.num_accept_tokens.shape == (4,)
    with pytest.raises(SpecContractError, match=r"pad_batch: num_correct_drafts is \(6,\) torch\.int64 after padding, "
                                                r"expected 6 rows of its torch\.int32"):
        extend.pad_batch(lambda t, n: torch.zeros(n, dtype=torch.int64), 6)


def test_compaction_refuses_a_path_wider_than_its_block(wrapped):
    sg, gen = wrapped, torch.Generator().manual_seed(5)
    small = example_config("EAGLE", num_steps=3, topk=2, num_draft_tokens=3)  # sglang accepts these arguments
    adapter.install(small)
    sb = env.batch([5])
    vin = env.verify_input(sg, small, sb, torch.tensor([1], dtype=torch.int32), gen)
    result = env.greedy_verify(sg, small, sb, vin, gen)
    compact = sg.eagle_worker_common._compact_accept_to_front
    with pytest.raises(SpecContractError, match=r"accept_index \(1, 4\) over 3 rows: expected \(bs, num_steps \+ 1\) "
                                                r"= \(1, <= num_draft_tokens 3\)"):
        compact(result.next_token_ids, result.accept_index, 1, num_draft_tokens=3)  # sglang: a RuntimeError
    six = torch.zeros(6, dtype=torch.int32)
    assert compact(six, torch.tensor([[0, 1], [3, -1]]), 2, num_draft_tokens=3).shape == (6,)


def test_the_tree_mask_mode_comes_from_the_build(wrapped):
    sg, gen = wrapped, torch.Generator().manual_seed(15)
    sb = env.batch([5, 9])
    vin = env.verify_input(sg, CONFIG, sb, torch.tensor([1, 2], dtype=torch.int32), gen)
    assert vin.__dict__[MASK_MODE] == sg.spec_tree.TreeMaskMode.QLEN_ONLY
    n = CONFIG.num_draft_tokens
    vin.custom_mask = torch.cat([vin.custom_mask, torch.ones(n * n, dtype=torch.bool)])  # a preallocated buffer
    logits = SimpleNamespace(next_token_logits=torch.zeros(2 * n, CONFIG.vocab), hidden_states=None)
    sg.eagle_utils.eagle_sample(vin, sb, logits)  # read as QLEN_ONLY, as built: passes
    with pytest.raises(SpecContractError, match="FULL_MASK length"):
        adapter.check(vin, CONFIG, sb)  # without the mode, a longer mask reads as FULL_MASK


def test_the_verify_preparation_checks_its_input(wrapped):
    sg, gen = wrapped, torch.Generator().manual_seed(16)
    sb = env.batch([5, 9])
    vin = env.verify_input(sg, CONFIG, sb, torch.tensor([1, 2], dtype=torch.int32), gen)
    vin.positions = vin.positions[:-1]
    with pytest.raises(SpecContractError, match=r"positions -> VerifyInput\.positions: flat length 11") as err:
        sg.eagle_utils.eagle_prepare_for_verify(vin, None, sb, None)
    assert err.value.consumer == "eagle_utils.eagle_prepare_for_verify"


class _Reached(Exception):
    """Raised by a stand-in worker method: the wrapper's entry check let the call through."""


@pytest.mark.parametrize("hook", ["draft", "verify"])
@pytest.mark.parametrize("mode", ["IDLE", "DECODE", "a mode with is_idle() only"])
def test_a_worker_method_compares_its_input_with_a_live_batch_only(wrapped, hook, mode):
    """The worker methods' wrappers tell an idle batch (data-parallel attention's empty rank) by identity with
    sglang's `ForwardMode.IDLE`, and by `is_idle()` for a mode of another type: its input is checked alone.
    On a DECODE batch the idle input's 0 rows are compared with the batch's 2 and refused."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from spec_schema.engines._sglang_boundaries import Bound
    from spec_schema.engines._sglang_hooks import HOOKS

    def method(self, batch):
        raise _Reached

    sb = env.batch([5, 9], idle=mode != "DECODE")
    if mode != "a mode with is_idle() only":
        sb.forward_mode = getattr(ForwardMode, mode)
    sb.spec_info = env.idle_draft_input(wrapped, CONFIG) if hook == "draft" else \
        wrapped.eagle_info.EagleVerifyInput.create_idle_input(CONFIG.topk, CONFIG.num_steps, CONFIG.num_draft_tokens,
                                                              "cpu")
    wrapper = HOOKS[hook](method, Bound(method, ("self", "batch")), f"Worker.{hook}")
    with pytest.raises(SpecContractError if mode == "DECODE" else _Reached):
        wrapper(None, sb)


@pytest.mark.parametrize("while_", ["torch.compile compiles", "a CUDA graph is captured"])
def test_the_hot_wrappers_stand_aside(wrapped, monkeypatch, while_):
    """The hot wrappers read `standing_aside()`'s flags inline: while torch.compile compiles or a CUDA graph is
    captured, a worker method's input and a compaction too wide for its block pass unchecked; refused after."""
    from spec_schema.engines import _sglang_copyin, _sglang_hooks
    from spec_schema.engines._sglang_boundaries import Bound
    from spec_schema.engines._sglang_hooks import HOOKS

    def method(self, batch):
        raise _Reached

    def compact(x, accept_index, bs, num_draft_tokens):
        return x

    sb = env.batch([5, 9])
    sb.forward_mode = SimpleNamespace(is_idle=lambda: False)
    sb.spec_info = env.idle_draft_input(wrapped, CONFIG)  # 0 rows against the batch's 2
    draft = HOOKS["draft"](method, Bound(method, ("self", "batch")), "Worker.draft")
    squeeze = HOOKS["compact"](compact, Bound(compact, ("x", "accept_index", "bs", "num_draft_tokens")), "compact")
    calls = (lambda: draft(None, sb), lambda: squeeze(torch.zeros(6), torch.zeros(2, 4, dtype=torch.int64), 2,
                                                      num_draft_tokens=3))
    if while_ == "torch.compile compiles":
        monkeypatch.setattr(torch.compiler, "_is_compiling_flag", True)
    else:
        for module in (_sglang_hooks, _sglang_copyin):
            monkeypatch.setattr(module, "_HAS_CUDA", True)
            monkeypatch.setattr(module, "_capturing", lambda: True)
    with pytest.raises(_Reached):
        calls[0]()
    calls[1]()
    monkeypatch.undo()
    for call in calls:
        with pytest.raises(SpecContractError):
            call()
