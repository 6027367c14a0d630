"""Draft phase: DraftInput -> VerifyInput.

The draft grows an EAGLE-2 dynamic tree: the root's topk children come with the DraftInput; each of
the `num_steps - 1` draft forwards expands the topk frontier nodes into topk^2 candidates scored by
cumulative probability and keeps the best topk as the next frontier. The best `num_draft - 1`
candidates of all steps, with the root, form the tree (DESIGN.md layout). Each branch attends its
own ancestors: their KV lives in temporary draft slots that are freed when the tree is built.

The phase is split in three: `_prepare` (host: allocate the temporary slots, draw the uniforms of
sampled chains), `draft_core` (tensors in, tensors out, no host reads: the part a CUDA graph
captures) and `_verify_input` (host: the VerifyInput). The eager executor runs the core on the live
tensors with the reference models; the static executors run it on padded static buffers
(`executors.static.GraphRunner`). The phase reaches either through `rt.runner` (`executor.Executor`).
"""

from typing import Any, Optional

import torch

from spec_schema import DraftInput, VerifyInput, boundary

from .attention import AttnBatch, const_arange
from .core_types import CoreOps, DraftCoreIn, DraftCoreOut, fields_of
from .sampling import sample_from_probs, softmax_topk
from .state import BatchSampling, RuntimeState
from .tree import gather_branches, organize, select_frontier


@boundary
def draft(rt: RuntimeState, inp: DraftInput, sampling: BatchSampling) -> VerifyInput:
    """Run the draft's multi-step expansion over the batch and lay out the tree for verification."""
    config = rt.spec_config
    bs = len(inp)
    if bs == 0:
        return VerifyInput.create_idle(config, rt.device)
    launched = rt.runner.take_draft(inp) if sampling.all_greedy else None
    if launched is not None:  # run by verify's launch-ahead on this very DraftInput
        vin = _verify_input(inp, launched)
        rt.runner.note_output(vin)
        return vin
    rt.runner.discard_ahead()
    core_in, temp = _prepare(rt, inp, sampling)
    try:
        out = rt.runner.draft(core_in)
    finally:
        if temp is not None:
            rt.draft_cache.free_slots(temp)
    return _verify_input(inp, out)


def _prepare(rt: RuntimeState, inp: DraftInput, sampling: BatchSampling) -> tuple[DraftCoreIn, Optional[torch.Tensor]]:
    """Host side: temporary branch slots and sampled-chain coins. The executor gives the branch slots
    (`Executor.draft_scratch`): the eager one from the pool (returned, to be freed), the static one
    its reserved scratch slots and dummy slot (no pool traffic, so no host sync)."""
    bs, k, steps = len(inp), rt.spec_config.topk, rt.spec_config.num_steps
    temp_slots, pad, temp = rt.runner.draft_scratch(bs)
    uniforms = None
    if inp.draft_probs is not None and steps > 1 and not sampling.all_greedy:
        # drawn in the order the steps use them (one `uniform(rows)` per step); a greedy batch
        # proposes its argmax and draws none (as its launch-ahead does not)
        uniforms = torch.stack([rt.uniform(bs * k) for _ in range(steps - 1)])
    return DraftCoreIn(**fields_of(inp, DraftCoreIn), **fields_of(sampling, DraftCoreIn),
                       temp_slots=temp_slots, uniforms=uniforms, pad_slot=pad, greedy=sampling.all_greedy), temp


def draft_core(ops: CoreOps, c: DraftCoreIn) -> DraftCoreOut:
    """The multi-step expansion and the tree layout: tensors in, tensors out, no host reads (when
    `ops` are the sync-free ones)."""
    if ops.frontier is not None and c.draft_probs is None:
        return _draft_core_kernels(ops, c)
    if ops.frontier is not None and _greedy_chain(ops, c):  # a greedy chain: its argmax proposals and
        # their one-hot distributions, which `_propose` gives it, from the same kernels as a tree's
        out = _draft_core_kernels(ops, c)
        out.draft_probs = ops.frontier.chain_probs(c.draft_probs, out.draft_token)
        return out
    bs, k = c.topk_p.shape
    steps = ops.config.num_steps
    sampled = c.draft_probs is not None
    scores, tokens, parent, record = select_frontier(0, None, c.topk_p, c.topk_index)
    records = [record]
    hidden = _branch_hidden(c.hidden_states, parent)
    probs = [] if c.draft_probs is None else [c.draft_probs]
    history = c.temp_slots.new_empty((bs, k, 0))
    for step in range(1, steps):
        branch_slots = torch.cat([history, c.temp_slots[:, :, step - 1 : step]], dim=2)
        h = _draft_forward(ops, c, tokens, hidden, branch_slots, step)
        uniform = None if c.uniforms is None else c.uniforms[step - 1]
        p, ids, full = propose(ops, h, c.draft_logits, k, sampled, c, uniform)
        scores, tokens, parent, record = select_frontier(step, scores, p.view(bs, k, k), ids.view(bs, k, k))
        records.append(record)
        probs += [] if full is None else [full]
        hidden = None if hidden is None else gather_branches(h.view(bs, k, -1), parent)
        history = gather_branches(branch_slots, parent)
    return _layout(ops, c, *organize(records, ops.config.num_draft_tokens), probs)


def _greedy_chain(ops: CoreOps, c: DraftCoreIn) -> bool:
    """A sampled chain's batch whose every request is greedy (one branch, one node per step): each step
    proposes the draft's argmax, the top-1 of the Triton top-k (ties to the lowest id in both)."""
    config = ops.config
    return (c.draft_probs is not None and c.greedy and config.topk == 1
            and config.num_draft_tokens == config.num_steps + 1 and ops.softmax_topk is not None)


def _draft_core_kernels(ops: CoreOps, c: DraftCoreIn) -> DraftCoreOut:
    """`draft_core` for trees with the expansion bookkeeping in `ops.frontier` (`kernels.frontier`):
    one launch per step writes the step's candidates into the records, picks the next frontier and
    lays out the next forward's slots and positions; one launch picks the tree from the records.
    Same values as the torch path (`select_frontier`, `gather_branches`, `organize`)."""
    f = ops.frontier
    bs, k = c.topk_p.shape
    steps = ops.config.num_steps
    dev = c.topk_p.device
    records = f.DraftRecords.empty(bs, k, steps, dev)
    draft_lens = _draft_lens(ops, c)
    front = f.frontier_step(0, steps, records, c.topk_p, c.topk_index, c.temp_slots, draft_lens)
    hidden = None if c.hidden_states is None else c.hidden_states[:, None].expand(bs, k, -1)
    prefix = draft_lens.to(torch.int64)
    qo_indptr = const_arange(bs + 1, k, dev)
    d2t = ops.draft.d2t  # the fast drafts' to_target_ids as a table (None: the same vocabulary)
    for step in range(1, steps):
        attn = AttnBatch(c.req_pool_indices, prefix, qo_indptr, front.out_slots, front.branch_slots.view(bs * k, step))
        hidden_in = None if hidden is None else hidden.reshape(bs * k, -1)
        h = ops.draft.forward(front.tokens.reshape(-1), hidden_in, front.positions, attn, ops.draft_cache,
                              from_target=False)
        p, ids = draft_topk(ops, h, k, c.draft_logits, c.greedy)
        front = f.frontier_step(step, steps, records, p, ids, c.temp_slots, draft_lens, front.scores,
                                front.branch_slots, d2t, None if hidden is None else h.reshape(bs * k, -1).contiguous())
        hidden = front.hidden  # (reordered by parent branch in the step's launch; None after the last)
    return _layout(ops, c, *f.organize_records(records, ops.config.num_draft_tokens), [])


def draft_topk(ops: CoreOps, h: torch.Tensor, k: int, out: Optional[torch.Tensor],
               greedy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`softmax_topk` of the draft's logits at `h`, draft ids. Where the backend fuses the head into the
    top-k (`ops.softmax_topk.of_head`, `FastOptions.head_topk`), one kernel instead of the logits and the
    top-k's first pass."""
    fused = getattr(ops.softmax_topk, "of_head", None)
    if fused is not None:
        return fused(ops.draft, h, k)
    logits = draft_logits(ops, h, out, raw_logits(ops, False, greedy))
    return (ops.softmax_topk or softmax_topk)(logits, k)


def propose(ops: CoreOps, h: torch.Tensor, out: Optional[torch.Tensor], k: int, sampled: bool, params: Any,
            uniform: Optional[torch.Tensor]):
    """`_propose` on the draft's logits at `h` (landed in `out` where they need float32); a tree's top-k
    with the head fused into it where the backend does that (`draft_topk`), its ids mapped to the target's."""
    fused = None if sampled else getattr(ops.softmax_topk, "of_head", None)
    if fused is not None:
        d2t = getattr(ops.draft, "d2t", None)
        p, ids = fused(ops.draft, h, k, d2t=d2t)
        return p, ids if d2t is not None else ops.draft.to_target_ids(ids), None
    logits = draft_logits(ops, h, out, raw_logits(ops, sampled, params.greedy))
    return _propose(ops, logits, k, sampled, params, uniform)


def raw_logits(ops: CoreOps, sampled: bool, greedy: bool) -> bool:
    """Whether the draft's logits may stay in the model's dtype: the Triton top-k (`ops.softmax_topk`)
    reads any float dtype and computes in float32, and an argmax (a greedy sampled chain's proposal)
    picks the same index, as each float32 logit is its bf16/fp16 value exactly; a sampled batch's
    distributions and the torch top-k take float32."""
    return (sampled and greedy) or (not sampled and ops.softmax_topk is not None)


def draft_logits(ops: CoreOps, h: torch.Tensor, out: Optional[torch.Tensor], raw: bool) -> torch.Tensor:
    """The draft's logits at `h`: in the model's dtype when `raw` (no float32 copy, no scratch copy:
    two kernels fewer per draft step on the GPU), else float32 landed in `out` (`logits_into`)."""
    return ops.draft.logits(h) if raw else logits_into(ops.draft.compute_logits(h), out)


def logits_into(logits: torch.Tensor, out: Optional[torch.Tensor]) -> torch.Tensor:
    """Land `logits` in the scratch buffer `out` (a static buffer's rows), or keep them as they are."""
    if out is None:
        return logits
    out.copy_(logits)
    return out


def _branch_hidden(hidden: Optional[torch.Tensor], parent: torch.Tensor) -> Optional[torch.Tensor]:
    """The root's hidden state repeated for each of its topk children (None stays None)."""
    return None if hidden is None else gather_branches(hidden[:, None], parent)


def _draft_lens(ops: CoreOps, c: DraftCoreIn) -> torch.Tensor:
    """`(bs,)` tokens in each request's draft KV: seq_lens plus the draft's KV lead (traits), 1 for a
    draft that has read the root (its own sequence), 0 for EAGLE heads (their KV ends before it)."""
    lead = ops.config.traits.draft_kv_lead
    return c.seq_lens + lead if lead else c.seq_lens


def _draft_forward(ops: CoreOps, c: DraftCoreIn, tokens: torch.Tensor, hidden: Optional[torch.Tensor],
                   branch_slots: torch.Tensor, step: int) -> torch.Tensor:
    """One draft forward over the frontier (bs * topk rows) at depth `step` (draft position
    `_draft_lens + step - 1`: the target's position seq_len + step for a draft reading its own sequence)."""
    bs, k = tokens.shape
    lens = _draft_lens(ops, c)
    attn = AttnBatch.branches(c.req_pool_indices, lens, branch_slots)
    positions = (lens + (step - 1))[:, None].expand(bs, k).reshape(-1)  # repeat_interleave(k), no sync
    hidden_in = None if hidden is None else hidden.reshape(bs * k, -1)
    return ops.draft.forward(tokens.reshape(-1), hidden_in, positions, attn, ops.draft_cache, from_target=False)


def _propose(ops: CoreOps, logits: torch.Tensor, k: int, sampled: bool, params: Any,
             uniform: Optional[torch.Tensor]):
    """The draft's candidates after each row: top-k of its distribution (tree drafts), or, for
    sampled chains, one token drawn from its distribution with the request's sampling parameters
    (`params.temperature`, `.top_k`, `.top_p`) and the pre-drawn coins `uniform` (rows,); when
    `params.greedy` (every request greedy), the argmax and its one-hot distribution.

    Returns (probs (rows, k) float32, target ids (rows, k) int64, full distribution or None).
    """
    if sampled and params.greedy:  # every request greedy: what `ops.probs` gives at temperature 0 (the
        # one-hot at the argmax, ties to the lowest id) without its sort and softmax over the vocabulary
        ids = logits.argmax(-1, keepdim=True)
        if ops.frontier is not None:  # the ones and the one-hot in one launch
            ones, full = ops.frontier.onehot_rows(ids, logits.shape[-1])
            return ones, ids, full
        full = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device).scatter_(1, ids, 1.0)
        return torch.ones(ids.shape, dtype=torch.float32, device=ids.device), ids, full
    if sampled:
        full = ops.probs(logits, params.temperature, params.top_k, params.top_p)
        ids = sample_from_probs(full, uniform)[:, None]
        return full.gather(1, ids), ids, full
    d2t = getattr(ops.draft, "d2t", None) if ops.softmax_topk is not None else None
    if d2t is not None:  # the Triton top-k maps the ids in its own launch
        return (*ops.softmax_topk(logits, k, d2t=d2t), None)
    values, indices = (ops.softmax_topk or softmax_topk)(logits, k)
    return values, ops.draft.to_target_ids(indices), None


def _layout(ops: CoreOps, c: DraftCoreIn, parent_list: torch.Tensor, selected: torch.Tensor,
            draft_tokens: torch.Tensor, probs: list) -> DraftCoreOut:
    config = ops.config
    n = config.num_draft_tokens
    mask, positions, r_index, r_next, r_sibling, draft_token = ops.build_tree(
        parent_list, selected, draft_tokens, c.bonus_tokens, c.seq_lens, config.topk, config.num_steps, n
    )
    draft_probs = None
    if probs:
        # Sampled chains: row i is the distribution node i + 1 was drawn from; the last node has none.
        draft_probs = torch.stack(probs + [torch.zeros_like(probs[0])], dim=1)
    return DraftCoreOut(draft_token, positions, mask, r_index, r_next, r_sibling, draft_probs)


def _verify_input(inp: DraftInput, out: DraftCoreOut) -> VerifyInput:
    """The tree as the core laid it out, for the requests of `inp`."""
    return VerifyInput(**fields_of(out, VerifyInput), seq_lens=inp.seq_lens,
                       req_pool_indices=inp.req_pool_indices)
