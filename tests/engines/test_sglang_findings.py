"""What sglang 0.5.23 does with bad or mixed objects, and what the contract says instead.

Each test is a minimal reproducer marked `engine_bug`: it asserts sglang's own behaviour (a crash, or
a silent shape or dtype drift) AND that `spec_schema.engines.sglang` rejects the same objects with
an error naming the field. If sglang fixes one, its test fails and the README row goes.
"""

import pytest
import torch

from spec_schema import SpecContractError
from spec_schema.engines import sglang as adapter
from spec_schema.testing import example_config

from . import sglang_env as env

pytestmark = pytest.mark.engine_bug
EAGLE = example_config("EAGLE")


def test_idle_verify_result_has_another_rank(sg):
    """eagle_sample on an idle batch returns accept_index of shape (0,); live ones are (bs, num_steps + 1)."""
    gen = torch.Generator().manual_seed(0)
    sb = env.batch([5])
    live = env.greedy_verify(sg, EAGLE, sb, env.verify_input(sg, EAGLE, sb, torch.tensor([1], dtype=torch.int32),
                                                             gen), gen)
    assert live.accept_index.shape == (1, EAGLE.num_steps + 1)
    idle_in = sg.eagle_info.EagleVerifyInput.create_idle_input(EAGLE.topk, EAGLE.num_steps, 6, "cpu")
    predict, accept_lens, accept_index = sg.eagle_utils.eagle_sample(idle_in, env.batch([], idle=True), None)
    assert accept_index.shape == (0,)  # sglang: rank 1 on the idle path
    idle = sg.utils.GenerationBatchResult(next_token_ids=predict, accept_lens=accept_lens, accept_index=accept_index)
    with pytest.raises(SpecContractError, match=r"accept_index -> VerifyOutput\.accept_indices: rank 1, expected 2"):
        adapter.check(idle, EAGLE)


def test_merge_promotes_mixed_bonus_dtypes(sg):
    """A request fresh from prefill (bonus from the target's greedy argmax: int64) merged into a decode
    batch (bonus from verify: int32): torch.cat promotes silently and the batch's dtype changes."""
    gen = torch.Generator().manual_seed(1)
    decode = env.draft_input(sg, EAGLE, 2, gen, torch.int32)
    prefill = env.draft_input(sg, EAGLE, 1, gen, torch.int64)
    with pytest.raises(SpecContractError, match=r"bonus_tokens is torch\.int32 on the left and torch\.int64"):
        adapter.check_merge_inputs(decode, prefill)
    decode.merge_batch(prefill)
    assert decode.bonus_tokens.dtype == torch.int64  # sglang: the decode batch's int32 became int64


def test_merge_keeps_one_sides_hidden_states(sg):
    """merge_batch concatenates hidden_states only when both sides have them; otherwise it keeps the
    left side's, so the merged batch has fewer hidden rows than requests (no error)."""
    gen = torch.Generator().manual_seed(2)
    left = env.draft_input(sg, EAGLE, 2, gen, torch.int32)
    right = env.draft_input(sg, EAGLE, 1, gen, torch.int32)
    right.hidden_states = None  # a producer that dropped them (as STANDALONE's would)
    left.merge_batch(right)
    assert left.topk_p.shape[0] == 3 and left.hidden_states.shape[0] == 2  # sglang: silent row drift
    with pytest.raises(SpecContractError, match=r"hidden_states -> DraftInput\.hidden_states: axis bs"):
        adapter.check(left, EAGLE)


def test_merge_of_other_widths_crashes_in_torch_cat(sg):
    """The historical STANDALONE/idle-width bug: inputs of two hidden widths crash merge_batch inside
    torch.cat; the contract names the field and the width the rule expects, before the merge."""
    gen = torch.Generator().manual_seed(3)
    eagle3 = example_config("EAGLE3")  # draft hidden 32, target hidden 64
    draft = env.draft_input(sg, eagle3, 1, gen, torch.int32)
    target_wide = env.draft_input(sg, example_config("EAGLE3", draft_hidden=64), 1, gen, torch.int32)
    with pytest.raises(SpecContractError, match=r"axis hidden_draft \(dim 1\) expected 32 \(EAGLE3: draft hidden"):
        adapter.check(target_wide, eagle3)
    with pytest.raises(RuntimeError, match="Sizes of tensors must match except in dimension 0"):
        draft.merge_batch(target_wide)


def test_zero_step_verify_input_has_int32_draft_tokens(sg):
    """With speculative_num_steps == 0 the worker's trivial verify input takes the bonus tokens (int32)
    as draft_token, where the tree path's draft_token is int64: the adapter's zero-step index policy
    declares it, the tree path's does not."""
    gen = torch.Generator().manual_seed(4)
    sb = env.batch([5, 9])
    sb.spec_info = env.draft_input(sg, EAGLE, 2, gen, torch.int32)
    worker = type("W", (), {"topk": 1, "device": "cpu"})()
    worker._target_worker = type("T", (), {})()
    worker._target_worker.model_runner = type("R", (), {})()
    worker._target_worker.model_runner.attn_backend = type("B", (), {"verify_mask": None, "max_context_len": 64})()
    trivial = sg.eagle_worker_v2.EAGLEWorkerV2._build_trivial_verify_input(worker, sb)
    tree = env.verify_input(sg, EAGLE, sb, sb.spec_info.bonus_tokens, gen)
    assert (trivial.draft_token.dtype, tree.draft_token.dtype) == (torch.int32, torch.int64)
    adapter.check(trivial, None, sb)  # the zero-step path's own index policy (a working server must not raise)
    tree.draft_token = tree.draft_token.int()  # the tree path keeps int64
    with pytest.raises(SpecContractError, match=r"draft_token -> VerifyInput\.draft_token: dtype torch\.int32"):
        adapter.check(tree, EAGLE, sb)


def test_accepted_path_compaction_crashes_on_small_trees(sg):
    """Found by test_sglang_fuzz: with topk > 1 and num_draft_tokens < num_steps + 1 (a tree smaller than
    its depth, which sglang's server arguments accept), the accepted-path compaction of run_eagle_verify
    (`_compact_accept_to_front`) writes num_steps + 1 columns into blocks of num_draft_tokens and
    crashes. The objects are valid: the contract has nothing to reject here (its row says so)."""
    config = example_config("EAGLE", num_steps=3, topk=2, num_draft_tokens=3)
    gen = torch.Generator().manual_seed(5)
    sb = env.batch([5])
    vin = env.verify_input(sg, config, sb, torch.tensor([1], dtype=torch.int32), gen)
    result = env.greedy_verify(sg, config, sb, vin, gen)
    adapter.check(vin, config, sb, values=True)
    adapter.check(result, config, sb)
    with pytest.raises(RuntimeError, match="must match the existing size"):
        sg.eagle_worker_common._compact_accept_to_front(result.next_token_ids, result.accept_index, 1,
                                                        num_draft_tokens=3)
