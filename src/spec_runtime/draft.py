"""Draft phase: DraftInput -> VerifyInput.

The draft grows an EAGLE-2 dynamic tree: the root's topk children come with the DraftInput; each of
the `num_steps - 1` draft forwards expands the topk frontier nodes into topk^2 candidates scored by
cumulative probability and keeps the best topk as the next frontier. The best `num_draft - 1`
candidates of all steps, with the root, form the tree (DESIGN.md layout). Each branch attends its
own ancestors: their KV lives in temporary draft slots that are freed when the tree is built.
"""

from typing import Optional

import torch

from spec_schema import DraftInput, VerifyInput, boundary

from .attention import AttnBatch
from .runtime import BatchSampling, Runtime
from .sampling import probs_from_logits_batched, sample_from_probs
from .tree import build_tree, gather_branches, organize, select_frontier


@boundary
def draft(rt: Runtime, inp: DraftInput, sampling: BatchSampling) -> VerifyInput:
    """Run the draft's multi-step expansion over the batch and lay out the tree for verification."""
    config = rt.spec_config
    bs, k, steps = len(inp), config.topk, config.num_steps
    if bs == 0:
        return VerifyInput.create_idle(config, rt.device)
    scores, tokens, parent, record = select_frontier(0, None, inp.topk_p, inp.topk_index)
    records = [record]
    hidden = _branch_hidden(inp.hidden_states, parent)
    probs = [] if inp.draft_probs is None else [inp.draft_probs]
    temp = rt.draft_cache.alloc_slots(bs * k * (steps - 1))
    history = temp.new_empty((bs, k, 0))
    try:
        for step in range(1, steps):
            own = temp[(step - 1) * bs * k : step * bs * k].view(bs, k, 1)
            branch_slots = torch.cat([history, own], dim=2)
            h = _draft_forward(rt, inp, tokens, hidden, branch_slots, step)
            p, ids, full = _propose(rt, rt.draft.compute_logits(h), sampling, k, inp.draft_probs is not None)
            scores, tokens, parent, record = select_frontier(step, scores, p.view(bs, k, k), ids.view(bs, k, k))
            records.append(record)
            probs += [] if full is None else [full]
            hidden = None if hidden is None else gather_branches(h.view(bs, k, -1), parent)
            history = gather_branches(branch_slots, parent)
    finally:
        rt.draft_cache.free_slots(temp)
    return _verify_input(rt, inp, records, probs)


def _branch_hidden(hidden: Optional[torch.Tensor], parent: torch.Tensor) -> Optional[torch.Tensor]:
    """The root's hidden state repeated for each of its topk children (None stays None)."""
    return None if hidden is None else gather_branches(hidden[:, None], parent)


def _draft_forward(rt: Runtime, inp: DraftInput, tokens: torch.Tensor, hidden: Optional[torch.Tensor],
                   branch_slots: torch.Tensor, step: int) -> torch.Tensor:
    """One draft forward over the frontier (bs * topk rows) at depth `step` (position seq_len + step - 1)."""
    bs, k = tokens.shape
    attn = AttnBatch.branches(inp.req_pool_indices, inp.seq_lens, branch_slots)
    positions = (inp.seq_lens + (step - 1)).repeat_interleave(k)
    hidden_in = None if hidden is None else hidden.reshape(bs * k, -1)
    rt.counters.draft_forwards += 1
    return rt.draft.forward(tokens.reshape(-1), hidden_in, positions, attn, rt.draft_cache, from_target=False)


def _propose(rt: Runtime, logits: torch.Tensor, sampling: BatchSampling, k: int, sampled: bool):
    """The draft's candidates after each row: top-k of its distribution (tree drafts), or, for
    sampled chains, one token drawn from its distribution with the request's sampling parameters.

    Returns (probs (rows, k) float32, target ids (rows, k) int64, full distribution or None).
    """
    if sampled:
        full = probs_from_logits_batched(logits, sampling.temperature, sampling.top_k, sampling.top_p)
        ids = sample_from_probs(full, rt.uniform(logits.shape[0]))[:, None]
        return full.gather(1, ids), ids, full
    top = torch.softmax(logits.float(), dim=-1).topk(k, dim=-1)
    return top.values, rt.draft.to_target_ids(top.indices), None


def _verify_input(rt: Runtime, inp: DraftInput, records: list, probs: list) -> VerifyInput:
    config = rt.spec_config
    n = config.num_draft_tokens
    parent_list, selected, draft_tokens = organize(records, n)
    mask, positions, r_index, r_next, r_sibling, draft_token = build_tree(
        parent_list, selected, draft_tokens, inp.bonus_tokens, inp.seq_lens, config.topk, config.num_steps, n
    )
    draft_probs = None
    if probs:
        # Sampled chains: row i is the distribution node i + 1 was drawn from; the last node has none.
        draft_probs = torch.stack(probs + [torch.zeros_like(probs[0])], dim=1)
    return VerifyInput(
        draft_token=draft_token,
        positions=positions,
        tree_mask=mask,
        retrieve_index=r_index,
        retrieve_next_token=r_next,
        retrieve_next_sibling=r_sibling,
        seq_lens=inp.seq_lens,
        req_pool_indices=inp.req_pool_indices,
        draft_probs=draft_probs,
    )
