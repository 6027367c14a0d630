"""Fuzz sglang 0.5.23 with the contract's strategies: configs from `spec_schema.testing.spec_configs`
drive sglang's own merge_batch / filter_batch, tree build (Triton, interpreted), greedy verify and
accepted-path compaction, with a check (value invariants included) at every boundary.

Mixed bonus-token dtypes (prefill's int64 with decode's int32) are a known sglang drift
(test_sglang_findings); here the contract must refuse that merge, and every other object must pass.
"""

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from spec_schema import SpecContractError
from spec_schema.engines import sglang as adapter
from spec_schema.testing import spec_configs

from . import sglang_env as env

DTYPES = (torch.int32, torch.int64)


def _side(sg, config, bs, dtype, gen):
    return env.idle_draft_input(sg, config) if bs == 0 else env.draft_input(sg, config, bs, gen, dtype)


@settings(max_examples=12)
@given(data=st.data())
def test_sglang_pipeline_holds_the_contract(sg, data):
    config = data.draw(spec_configs(), label="config")
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    bs_a, bs_b = data.draw(st.tuples(st.integers(0, 2), st.integers(0, 2)), label="bs")
    dt_a = data.draw(st.sampled_from(DTYPES), label="bonus dtype")
    mixed = data.draw(st.sampled_from([False, False, False, True]), label="mixed dtypes")
    dt_b = [d for d in DTYPES if d != dt_a][0] if mixed else dt_a
    left, right = _side(sg, config, bs_a, dt_a, gen), _side(sg, config, bs_b, dt_b, gen)
    for side, bs in ((left, bs_a), (right, bs_b)):
        adapter.check(side, config, env.batch([7] * bs), values=True)
    if bs_a and bs_b and dt_a != dt_b:
        with pytest.raises(SpecContractError, match="bonus_tokens"):
            adapter.check_merge_inputs(left, right)
        event("mixed bonus dtypes refused")
        return
    adapter.check_merge_inputs(left, right)
    left.merge_batch(right)  # sglang's own merge
    bs = bs_a + bs_b
    adapter.check(left, config, env.batch([7] * bs), values=True)
    keep = data.draw(st.permutations(range(bs)).flatmap(
        lambda p: st.integers(min(1, len(p)), len(p)).map(lambda n: p[:n])), label="keep")
    left.filter_batch(torch.tensor(keep, dtype=torch.int64))
    bs = len(keep)
    seq = data.draw(st.lists(st.integers(1, 40), min_size=bs, max_size=bs), label="seq_lens")
    sb = env.batch(seq)
    adapter.check(left, config, sb, values=True)
    if not bs:
        return
    event(f"tree built and verified (topk {config.topk})")
    modes = sg.spec_tree.TreeMaskMode
    mode = data.draw(st.sampled_from([modes.QLEN_ONLY, modes.FULL_MASK]), label="mask mode")
    vin = env.verify_input(sg, config, sb, left.bonus_tokens, gen, mode)
    view = adapter.check(vin, config, sb, values=True)  # sglang's tree = the contract's layout
    result = env.greedy_verify(sg, config, sb, vin, gen, match=data.draw(st.floats(0, 1), label="match"))
    out = adapter.check(result, config, sb, values=False)
    accepted = (out.accept_indices >= 0).sum(1)
    assert torch.equal(accepted, out.num_accept_tokens.long())  # root + accepted drafts = emitted tokens
    rows = out.accept_indices.long()
    for b in range(bs):  # each accepted path walks the tree from the root, parents first
        path = rows[b, : int(accepted[b])] - b * config.num_draft_tokens
        assert int(path[0]) == 0 and bool((path[1:] > path[:-1]).all())
        if view.tree_mask is not None:
            assert bool(view.tree_mask[b, path[-1], path].all())
    wb, hidden = env.batch(seq), env.extend_hidden(config, bs * config.num_draft_tokens, gen)
    if config.topk > 1 and config.num_draft_tokens < config.num_steps + 1:  # test_sglang_findings: a crash
        with pytest.raises(RuntimeError, match="must match the existing size"):
            env.draft_extend_window(sg, config, wb, result, hidden)
        return
    window = env.draft_extend_window(sg, config, wb, result, hidden)
    adapter.check(window, config, wb, values=True)
