"""`spec_schema.engines.sglang.install()`: sglang's own functions, called with valid and corrupted objects.

After `install(config)` (SPEC_STRICT=1), sglang's create_idle_input, merge_batch, filter_batch, tree
build, verify-input assembly, greedy verify and the worker methods around them check what they take
and what they make; nothing is wrapped with SPEC_STRICT unset; install is idempotent and uninstall
restores sglang's originals.
"""

import copy
from types import SimpleNamespace

import pytest
import torch

from spec_schema import BOUNDARY_CALLS, SpecContractError, _strict
from spec_schema.engines import sglang as adapter
from spec_schema.testing import example_config

from . import sglang_env as env

CONFIG = example_config("EAGLE")

pytestmark = pytest.mark.skipif(not _strict.LEVEL, reason="install() wraps only under SPEC_STRICT")
MEMO = _strict.LEVEL == 1  # level 1 remembers a verdict per signature; level 2 reads values at every boundary


def _originals(sg):
    info, utils, common, v2 = sg.eagle_info, sg.eagle_utils, sg.eagle_worker_common, sg.eagle_worker_v2
    return [info.EagleDraftInput.__dict__["merge_batch"], info.EagleDraftInput.__dict__["filter_batch"],
            info.EagleVerifyInput.__dict__["__post_init__"], info.EagleDraftInput.__dict__["create_idle_input"],
            utils.build_tree_kernel_efficient, common.build_tree_kernel_efficient, utils.eagle_sample,
            common.eagle_sample, common.build_eagle_verify_input, v2.EagleDraftWorker.__dict__["draft"],
            v2.EAGLEWorkerV2.__dict__["verify"]]


def test_nothing_is_wrapped_without_spec_strict(sg, monkeypatch):
    before = _originals(sg)
    monkeypatch.setattr(_strict, "LEVEL", 0)
    assert adapter.install(CONFIG) is False and not adapter.installed()
    assert all(a is b for a, b in zip(_originals(sg), before))


def test_install_is_idempotent_and_uninstall_restores(sg):
    before = _originals(sg)
    assert adapter.install(CONFIG) and adapter.install(lambda: CONFIG)
    during = _originals(sg)
    assert all(a is not b for a, b in zip(during, before))
    assert adapter.install(CONFIG) and all(a is b for a, b in zip(_originals(sg), during))
    adapter.uninstall()
    assert not adapter.installed() and all(a is b for a, b in zip(_originals(sg), before))
    with pytest.raises(TypeError, match="SpecConfig or a callable"):
        adapter.install("EAGLE")


def test_a_valid_iteration_passes_every_wrapped_boundary(wrapped):
    sg, gen = wrapped, torch.Generator().manual_seed(1)
    BOUNDARY_CALLS.clear()
    idle = env.idle_draft_input(sg, CONFIG)
    idle.merge_batch(env.draft_input(sg, CONFIG, 3, gen, torch.int32))
    idle.filter_batch(torch.tensor([2, 0]))
    sb = env.batch([5, 9])
    vin = env.verify_input(sg, CONFIG, sb, idle.bonus_tokens, gen)
    result = env.greedy_verify(sg, CONFIG, sb, vin, gen)
    window = env.draft_extend_window(sg, CONFIG, env.batch([5, 9]), result, env.extend_hidden(CONFIG, 12, gen))
    adapter.check(window, CONFIG, None)
    sg.eagle_info.EagleVerifyInput.create_idle_input(2, 3, 6, "cpu")
    calls = {k.removeprefix("sglang "): v for k, v in BOUNDARY_CALLS.items() if k.startswith("sglang ")}
    for name in ("EagleDraftInput.create_idle_input", "EagleDraftInput.merge_batch", "EagleDraftInput.filter_batch",
                 "eagle_worker_common.build_eagle_verify_input", "eagle_utils.eagle_sample",
                 "EagleVerifyInput.create_idle_input"):
        assert calls.get(name) == 1 if MEMO else calls.get(name) >= 1, (name, calls)
    # built inside a checked producer: checked once, at its exit (not by the tree build or the constructor)
    assert "EagleVerifyInput.__init__" not in calls and "eagle_utils.build_tree_kernel_efficient" not in calls
    fields = {k: getattr(vin, k) for k in ("draft_token", "custom_mask", "positions", "retrieve_index",
                                           "retrieve_next_token", "retrieve_next_sibling", "retrieve_cum_len",
                                           "spec_steps", "topk", "draft_token_num", "capture_hidden_mode",
                                           "seq_lens_sum", "seq_lens_cpu")}
    sg.eagle_info.EagleVerifyInput(**fields)  # built outside any producer: its constructor checks it
    assert BOUNDARY_CALLS["sglang EagleVerifyInput.__init__"] == 1
    sg.eagle_info.EagleVerifyInput(**fields)  # the same signature (dtypes, shapes, devices, sizes): known
    assert BOUNDARY_CALLS["sglang EagleVerifyInput.__init__"] == (1 if MEMO else 2)
    fields["retrieve_index"] = vin.retrieve_index[:, :-1]  # another signature (and broken): checked
    with pytest.raises(SpecContractError, match=r"retrieve_index -> VerifyInput\.retrieve_index: axis num_draft"):
        sg.eagle_info.EagleVerifyInput(**fields)
    assert BOUNDARY_CALLS["sglang EagleVerifyInput.__init__"] == (2 if MEMO else 3)


def test_corrupted_objects_are_rejected_by_sglangs_own_functions(wrapped):
    sg, gen = wrapped, torch.Generator().manual_seed(2)
    info = sg.eagle_info
    with pytest.raises(SpecContractError, match=r"EagleDraftInput\.hidden_states -> DraftInput\.hidden_states"):
        info.EagleDraftInput.create_idle_input(device="cpu", hidden_size=CONFIG.draft.hidden_size // 2,
                                               dtype=torch.bfloat16, topk=2,
                                               capture_hidden_mode=None)  # another model's width
    live = env.draft_input(sg, CONFIG, 2, gen, torch.int32)
    live.topk_index = live.topk_index[:, :1]
    with pytest.raises(SpecContractError, match=r"topk_index -> DraftInput\.topk_index: axis topk"):
        live.filter_batch(torch.tensor([1, 0]))
    sb = env.batch([5, 9])
    vin = env.verify_input(sg, CONFIG, sb, torch.tensor([1, 2], dtype=torch.int32), gen)
    bad = copy.copy(vin)
    bad.draft_token = vin.draft_token[:-1]
    with pytest.raises(SpecContractError, match=r"draft_token -> VerifyInput\.draft_token: flat length 11") as err:
        sg.eagle_utils.eagle_sample(bad, sb, SimpleNamespace(next_token_logits=torch.zeros(12, CONFIG.vocab)))
    assert err.value.consumer == "eagle_utils.eagle_sample"
    vin.custom_mask = vin.custom_mask[:-1]  # the same object, checked before: a replaced field is checked again
    with pytest.raises(SpecContractError, match=r"custom_mask -> VerifyInput\.tree_mask"):
        sg.eagle_utils.eagle_sample(vin, sb, SimpleNamespace(next_token_logits=torch.zeros(12, CONFIG.vocab)))
    with pytest.raises(SpecContractError, match="draft_token_num 5, expected num_draft = 6"):
        env.verify_input(sg, example_config("EAGLE", num_draft_tokens=5), sb, torch.tensor([1, 2]), gen)
    with pytest.raises(SpecContractError, match=r"positions -> VerifyInput\.positions: rank 2"):
        info.EagleVerifyInput(draft_token=vin.draft_token, custom_mask=vin.custom_mask,
                              positions=vin.positions.view(2, 6), retrieve_index=vin.retrieve_index,
                              retrieve_next_token=vin.retrieve_next_token,
                              retrieve_next_sibling=vin.retrieve_next_sibling, retrieve_cum_len=None, spec_steps=3,
                              topk=2, draft_token_num=6, capture_hidden_mode=None, seq_lens_sum=None,
                              seq_lens_cpu=None)


def test_worker_methods_check_their_inputs_before_sglang_runs(wrapped):
    sg, gen = wrapped, torch.Generator().manual_seed(3)
    sb = env.batch([5, 9])
    spec_info = env.draft_input(sg, CONFIG, 2, gen, torch.int32)
    spec_info.hidden_states = spec_info.hidden_states.float()  # the draft's width, the target's dtype
    sb.spec_info = spec_info
    with pytest.raises(SpecContractError, match=r"hidden_states.*draft dtype") as err:
        sg.eagle_worker_v2.EagleDraftWorker.draft(None, sb)
    assert err.value.consumer == "EagleDraftWorker.draft"
    vin = env.verify_input(sg, CONFIG, sb, torch.tensor([1, 2], dtype=torch.int32), gen)
    bad = copy.copy(vin)
    bad.retrieve_index = vin.retrieve_index.int()
    sb.spec_info = bad
    with pytest.raises(SpecContractError, match=r"retrieve_index -> VerifyInput\.retrieve_index: dtype torch\.int32"):
        sg.eagle_worker_v2.EAGLEWorkerV2.verify(None, sb)
    result = env.greedy_verify(sg, CONFIG, sb, vin, gen)
    result.accept_index = result.accept_index[:, :-1]
    with pytest.raises(SpecContractError, match=r"accept_index -> VerifyOutput\.accept_indices: axis accept_width"):
        sg.eagle_worker_v2.EagleDraftWorker._draft_extend_for_decode(None, sb, result)
    window = sg.eagle_info.EagleDraftExtendInput(
        hidden_states=env.extend_hidden(CONFIG, 11, gen), num_correct_drafts=torch.zeros(2, dtype=torch.int32),
        num_accept_tokens=torch.ones(2, dtype=torch.int32), num_tokens_per_req=6)
    with pytest.raises(SpecContractError, match=r"hidden_states -> DraftExtendInput\.hidden_states: 11 rows"):
        sg.eagle_worker_common.prepare_for_draft_extend(window, sb, torch.zeros(12, dtype=torch.int64), 6, None,
                                                        None, return_hidden_states_before_norm=False)
    window.hidden_states = env.extend_hidden(CONFIG, 12, gen)  # the window's rows; the predict ids one short
    with pytest.raises(SpecContractError, match=r"input_ids -> DraftExtendInput\.input_ids: 11 rows"):
        sg.eagle_worker_common.prepare_for_draft_extend(window, sb, torch.zeros(11, dtype=torch.int64), 6, None,
                                                        None, return_hidden_states_before_norm=False)


def test_a_prefilled_request_joining_a_decoding_batch_merges(wrapped):
    """sglang's path for every request that joins mid-flight: its bonus tokens are int64 (prefill), the
    running batch's int32 (verify). Under install the merge passes (both are the policy's; torch.cat
    widens losslessly), the merged object is checked; a dtype outside the policy is still refused."""
    sg, gen = wrapped, torch.Generator().manual_seed(21)
    running = env.draft_input(sg, CONFIG, 2, gen, torch.int32)
    running.merge_batch(env.draft_input(sg, CONFIG, 1, gen, torch.int64))
    assert running.bonus_tokens.dtype == torch.int64 and running.topk_p.shape[0] == 3
    with pytest.raises(SpecContractError, match=r"bonus_tokens is torch\.int32 on the left and torch\.int64"):
        adapter.check_merge_inputs(env.draft_input(sg, CONFIG, 1, gen, torch.int32),
                                   env.draft_input(sg, CONFIG, 1, gen, torch.int64))  # the finding, by hand
    floats = env.draft_input(sg, CONFIG, 1, gen, torch.int32)
    floats.bonus_tokens = floats.bonus_tokens.float()
    with pytest.raises(SpecContractError, match=r"bonus_tokens"):
        env.draft_input(sg, CONFIG, 2, gen, torch.int64).merge_batch(floats)
    other = env.draft_input(sg, CONFIG, 1, gen, torch.int32)
    other.topk_index = other.topk_index.int()
    with pytest.raises(SpecContractError, match=r"topk_index is torch\.int64 on the left and torch\.int32"):
        env.draft_input(sg, CONFIG, 2, gen, torch.int32).merge_batch(other)


def test_the_memo_never_lets_a_changed_object_pass(wrapped):
    """At SPEC_STRICT=1 one verdict holds per signature, read afresh at every check: the same object with
    a tensor resized in place, or a batch whose field the check reads changed, is checked again."""
    from spec_schema.engines import _sglang_install

    sg, gen = wrapped, torch.Generator().manual_seed(4)
    sb = env.batch([5, 9])
    live = env.draft_input(sg, CONFIG, 2, gen, torch.int32)
    BOUNDARY_CALLS.clear()
    for _ in range(2):
        _sglang_install._check(live, sb, consumer="memo")
    assert BOUNDARY_CALLS["sglang memo"] == (1 if MEMO else 2)  # the second call: a known signature
    live.topk_index.resize_(2, 1)  # the same tensor object, another shape
    with pytest.raises(SpecContractError, match=r"topk_index -> DraftInput\.topk_index: axis topk"):
        _sglang_install._check(live, sb, consumer="memo")
    live = env.draft_input(sg, CONFIG, 2, gen, torch.int32)
    _sglang_install._check(live, sb, consumer="memo")
    sb.req_pool_indices.resize_(3)  # a batch field the draft input's check reads
    with pytest.raises(SpecContractError, match=r"req_pool_indices"):
        _sglang_install._check(live, sb, consumer="memo")


def test_the_generated_key_reads_what_the_signature_reads(sg):
    """`install()`'s memo key comes from one generated reader per sglang class; it must read every
    attribute `signature` (plain Python) reads, the same way, on every kind of object and batch."""
    from spec_schema.engines._sglang_check import _engine_class
    from spec_schema.engines._sglang_memo import KEYS, signature

    objects = env.all_objects(sg, CONFIG, seed=5)
    odd = env.draft_input(sg, CONFIG, 2, torch.Generator().manual_seed(6), torch.int32)
    odd.topk_p = torch.nn.Parameter(odd.topk_p, requires_grad=False)  # a tensor subclass: read through _sig
    odd.draft_probs = [1, 2]  # neither a tensor, None nor an int
    for label, obj, batch in [*objects, ("subclass and list", odd, env.batch([5, 9], extend_num_tokens=3))]:
        name = _engine_class(obj)
        for b in (batch, None):
            assert KEYS[name](obj, b, "head") == ("head", *signature(name, obj, b)), label


def test_the_memo_checks_a_swapped_field_and_a_config_change_again(wrapped):
    """The memo's fast path on the same object: a field swapped between two calls for a tensor of another
    dtype (same shape) or another width is checked again and refused; a config change between two calls
    (adaptive speculation) is a new verdict, and an object valid under one config is refused under another."""
    from spec_schema.engines import _sglang_install

    sg, gen = wrapped, torch.Generator().manual_seed(7)
    sb = env.batch([5, 9])
    live = env.draft_input(sg, CONFIG, 2, gen, torch.int32)
    BOUNDARY_CALLS.clear()
    _sglang_install._check(live, sb, consumer="swap")
    good = live.topk_p
    live.topk_p = good.double()  # the same shape, another dtype
    with pytest.raises(SpecContractError, match=r"topk_p -> DraftInput\.topk_p: dtype torch\.float64"):
        _sglang_install._check(live, sb, consumer="swap")
    live.topk_p = good.to("meta")  # the same dtype and shape on another device (CPU and meta: both index -1)
    with pytest.raises(SpecContractError, match=r"topk_index: is on cpu, expected the device of topk_p"):
        _sglang_install._check(live, sb, consumer="device")
    live.topk_p = good
    _sglang_install._check(live, sb, consumer="swap")  # known again
    live.hidden_states = live.hidden_states[:, :-1]  # another width
    with pytest.raises(SpecContractError, match=r"hidden_states -> DraftInput\.hidden_states"):
        _sglang_install._check(live, sb, consumer="swap")
    assert BOUNDARY_CALLS["sglang swap"] == (3 if MEMO else 4)
    current = {"config": CONFIG}
    adapter.install(lambda: current["config"])  # a config that follows the worker, as the plugin's does
    live = env.draft_input(sg, CONFIG, 2, gen, torch.int32)
    _sglang_install._check(live, sb, consumer="config")
    _sglang_install._check(live, sb, consumer="config")
    current["config"] = example_config("EAGLE", topk=CONFIG.topk + 1)
    with pytest.raises(SpecContractError, match=r"topk_p -> DraftInput\.topk_p: axis topk"):
        _sglang_install._check(live, sb, consumer="config")
    assert BOUNDARY_CALLS["sglang config"] == (2 if MEMO else 3)


class _Reads:
    """`target` with every attribute read recorded in `seen`."""

    def __init__(self, target):
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "seen", set())

    def __getattribute__(self, name):
        if name in ("_target", "seen"):
            return object.__getattribute__(self, name)
        if not name.startswith("__"):
            object.__getattribute__(self, "seen").add(name)
        return getattr(object.__getattribute__(self, "_target"), name)


def _recording_copy(obj, seen):
    """`obj` as an instance of a subclass of its sglang class (same name) that records attribute reads."""
    def __getattribute__(self, name):
        if not name.startswith("__"):
            seen.add(name)
        return super(sub, self).__getattribute__(name)
    sub = type(type(obj).__name__, (type(obj),), {"__getattribute__": __getattribute__})
    copy_ = object.__new__(sub)
    copy_.__dict__.update(obj.__dict__)
    return copy_


def test_the_memo_key_holds_every_attribute_a_check_reads(sg):
    """A level-1 verdict is remembered under the key `_sglang_memo` reads; an attribute the check reads
    outside the key would let a changed object pass. Every read of a full check, on the object and on its
    batch, is recorded on every kind of object: each is in the key (`READ_NAMES`, `BATCH_READS`)."""
    from spec_schema.engines._sglang_check import _engine_class
    from spec_schema.engines._sglang_memo import BATCH_READS, READ_NAMES

    for label, obj, batch in env.all_objects(sg, CONFIG, seed=8):
        own = set()
        copy_ = _recording_copy(obj, own)
        name = _engine_class(copy_)  # registers the subclass (reads every required attribute once)
        own.clear()
        reads = _Reads(batch) if batch is not None else None
        adapter.check(copy_, CONFIG, reads)
        assert own <= set(READ_NAMES[name]), (label, own - set(READ_NAMES[name]))
        if reads is not None:
            assert reads.seen <= set(BATCH_READS[name]), (label, reads.seen - set(BATCH_READS[name]))


def test_a_producer_running_on_another_thread_leaves_this_threads_checks_on(wrapped):
    """Objects built inside a wrapped producer are left to its exit only on the producer's own thread: while
    another thread is inside one, a verify input this thread builds is still checked when it is built."""
    import threading

    from spec_schema.engines import _sglang_runtime

    sg, gen = wrapped, torch.Generator().manual_seed(9)
    sb, bonus = env.batch([5, 9]), torch.tensor([3, 4], dtype=torch.int32)
    inside, release = threading.Event(), threading.Event()
    producer = threading.Thread(target=_sglang_runtime._inside, args=(lambda: (inside.set(), release.wait(10)),))
    producer.start()
    try:
        assert inside.wait(10)
        with pytest.raises(SpecContractError, match="draft_token_num 4, expected num_draft = 6"):
            env.verify_input(sg, example_config("EAGLE", num_steps=2, num_draft_tokens=4), sb, bonus, gen)
    finally:
        release.set()
        producer.join()
    assert not _sglang_runtime._DEPTH  # every producer's entry is gone once it returned


def test_the_wrappers_stand_aside_while_torch_compiles_or_a_cuda_graph_is_captured(wrapped, monkeypatch):
    """The wrappers stand aside (`standing_aside()`) while torch.compile compiles (torch.compiler's flag) and
    while a CUDA graph is captured: a verify input built for another tree shape passes unchecked then, and is
    refused again after."""
    from spec_schema import _contract

    sg, gen = wrapped, torch.Generator().manual_seed(10)
    sb, bonus = env.batch([5, 9]), torch.tensor([3, 4], dtype=torch.int32)
    other = example_config("EAGLE", num_steps=2, num_draft_tokens=4)
    with pytest.raises(SpecContractError, match="draft_token_num 4, expected num_draft = 6"):
        env.verify_input(sg, other, sb, bonus, gen)
    monkeypatch.setattr(torch.compiler, "_is_compiling_flag", True)
    env.verify_input(sg, other, sb, bonus, gen)
    monkeypatch.setattr(torch.compiler, "_is_compiling_flag", False)
    monkeypatch.setattr(_contract, "_HAS_CUDA", True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    env.verify_input(sg, other, sb, bonus, gen)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    with pytest.raises(SpecContractError, match="draft_token_num 4, expected num_draft = 6"):
        env.verify_input(sg, other, sb, bonus, gen)
