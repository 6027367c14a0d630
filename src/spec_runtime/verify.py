"""Verify phase: VerifyInput -> VerifyOutput.

The target scores every tree node in one forward with the tree attention mask, then a path is
accepted: greedily (the first child equal to the target's argmax, level by level), or by lossless
sampling (tree drafts: children tried in order against the target distribution, the bonus from the
residual; sampled STANDALONE chains: standard rejection sampling). Accepted nodes' KV slots are
committed to the request's slot table; the others are freed. Requests that hit a stop token or their
length budget are cut after that token and leave the batch; the rest go on to draft-extend with the
target hidden states captured at their accepted rows.
"""

from dataclasses import dataclass

import torch

from spec_schema import DraftExtendInput, VerifyInput, VerifyOutput, boundary

from . import faults
from .attention import AttnBatch
from .runtime import BatchSampling, Runtime
from .sampling import probs_from_logits_batched
from .tree import verify_chain_rejection, verify_greedy, verify_tree_sampling


@dataclass(frozen=True)
class StopBatch:
    """When each request of the batch must stop, in batch order (host-side facts)."""

    budget: list[int]  # tokens each request may still emit (>= 1)
    stop_ids: list[frozenset[int]]  # tokens that end each request (EOS and stop token ids)


@boundary
def verify(rt: Runtime, inp: VerifyInput, sampling: BatchSampling, stops: StopBatch) -> VerifyOutput:
    """Score the trees with the target, accept a path per request, commit its KV, cut at stops."""
    config = rt.spec_config
    bs, n = len(inp), config.num_draft_tokens
    if bs == 0:
        return VerifyOutput.create_idle(config, rt.device)
    slots = rt.target_cache.alloc_slots(bs * n)
    attn = AttnBatch.tree(inp.req_pool_indices, inp.seq_lens, slots.view(bs, n), inp.tree_mask)
    hidden, aux = rt.target.forward(
        inp.draft_token.reshape(-1), inp.positions.reshape(-1), attn, rt.target_cache, rt.aux_layer_ids
    )
    rt.counters.target_forwards += 1
    captured = rt.capture(hidden, aux)
    rt.counters.add_hidden(captured)
    logits = rt.target.compute_logits(hidden).view(bs, n, -1)
    accept_index, accept_tokens, num_correct = _accept(rt, inp, logits, sampling)
    num_accept, finished, host_counts = _apply_stops(accept_tokens, num_correct, stops)
    accept_index = _cut(accept_index, num_accept)
    accept_tokens = _cut(accept_tokens, num_accept)
    _commit_kv(rt, inp, slots, accept_index, num_accept)
    if host_counts:
        extend = _extend_input(rt, inp, captured, accept_index, accept_tokens, num_accept, finished, host_counts)
    else:  # every request finished: the idle input of the same phase, with the live widths
        extend = rt.idle_extend_input()
    return VerifyOutput(
        accept_tokens=accept_tokens,
        accept_indices=accept_index,
        num_correct_drafts=(num_accept - 1).to(torch.int32),
        num_accept_tokens=num_accept.to(torch.int32),
        finished=finished,
        draft_extend_input=extend,
    )


def _accept(rt: Runtime, inp: VerifyInput, logits: torch.Tensor, sampling: BatchSampling):
    """Accept a path per request. Returns (accept_index, accept_tokens, num_correct_drafts)."""
    steps = rt.spec_config.num_steps
    trees = (inp.draft_token, inp.retrieve_index, inp.retrieve_next_token, inp.retrieve_next_sibling)
    bs, n, _ = logits.shape
    if sampling.all_greedy:
        predicts, accept_index, num_correct = verify_greedy(*trees, logits.argmax(-1), steps)
        return accept_index, _tokens_at(predicts, accept_index), num_correct
    probs = probs_from_logits_batched(logits, sampling.temperature, sampling.top_k, sampling.top_p)
    if inp.draft_probs is not None:
        tokens, num_correct = verify_chain_rejection(
            inp.draft_token[:, 1:], inp.draft_probs[:, : n - 1], probs, rt.uniform(bs, n - 1), rt.uniform(bs)
        )
        # A chain's accepted nodes are its first num_correct + 1 rows.
        cols = torch.arange(n, device=logits.device)
        index = torch.where(cols <= num_correct[:, None].long(), inp.retrieve_index, -1)
        return index, tokens, num_correct
    predicts, accept_index, num_correct = verify_tree_sampling(
        *trees, probs, rt.uniform(bs, n), rt.uniform(bs), steps
    )
    return accept_index, _tokens_at(predicts, accept_index), num_correct


def _tokens_at(predicts: torch.Tensor, accept_index: torch.Tensor) -> torch.Tensor:
    """Emitted tokens: the target's prediction at the root and at each accepted node (-1 padded)."""
    return torch.where(accept_index >= 0, predicts[accept_index.clamp(min=0)], -1)


def _apply_stops(accept_tokens: torch.Tensor, num_correct: torch.Tensor, stops: StopBatch):
    """Cut each request after its first stop token or at its budget (host-side, one sync)."""
    tokens = accept_tokens.tolist()
    counts, finished = [], []
    for row, correct, budget, stop_ids in zip(tokens, num_correct.tolist(), stops.budget, stops.stop_ids):
        count = min(correct + 1, budget)
        for j in range(count):
            if row[j] in stop_ids:
                count = j + 1
                break
        counts.append(count)
        finished.append(count == budget or row[count - 1] in stop_ids)
    device = accept_tokens.device
    live_counts = tuple(c for c, done in zip(counts, finished) if not done)
    return torch.tensor(counts, device=device), torch.tensor(finished, device=device), live_counts


def _cut(t: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    cols = torch.arange(t.shape[1], device=t.device)
    return torch.where(cols < count[:, None], t, -1)


def _commit_kv(rt: Runtime, inp: VerifyInput, slots: torch.Tensor, accept_index: torch.Tensor,
               num_accept: torch.Tensor) -> None:
    """Point positions seq_len .. seq_len + a - 1 at the accepted nodes' slots; free the rest.

    The root and accepted drafts got their KV in the verify forward, so committing is a slot-table
    write, no copy."""
    kept = accept_index >= 0
    req = inp.req_pool_indices[:, None].expand_as(accept_index)[kept]
    pos = (inp.seq_lens[:, None] + torch.arange(accept_index.shape[1], device=slots.device))[kept]
    rt.target_cache.req_to_token[req, pos] = slots[accept_index[kept]]
    used = torch.zeros_like(slots, dtype=torch.bool)
    used[accept_index[kept]] = True
    rt.target_cache.free_slots(slots[~used])


def _extend_input(rt: Runtime, inp: VerifyInput, captured, accept_index, accept_tokens, num_accept,
                  finished, host_counts: tuple[int, ...]) -> DraftExtendInput:
    """Draft-extend rows of the unfinished requests: the emitted tokens at positions seq_len + j."""
    live = ~finished
    index, tokens, counts = accept_index[live], accept_tokens[live], num_accept[live]
    kept = index >= 0
    seq_lens = inp.seq_lens[live]
    positions = (seq_lens[:, None] + torch.arange(index.shape[1], device=index.device))[kept]
    hidden = None
    if captured is not None:
        hidden = captured[index[kept]]
        rt.counters.add_hidden(hidden, copied=True)
    field_counts = counts
    if faults.active("accept_counts_drafts_only"):  # bug zoo: drafts-only counts where a + 1 belongs
        field_counts, host_counts = counts - 1, tuple(c - 1 for c in host_counts)
    return DraftExtendInput(
        hidden_states=hidden,
        input_ids=tokens[kept],
        positions=positions,
        num_correct_drafts=(counts - 1).to(torch.int32),
        num_accept_tokens=field_counts.to(torch.int32),
        seq_lens=seq_lens + counts,
        bonus_tokens=tokens.gather(1, (counts - 1)[:, None]).squeeze(1),
        req_pool_indices=inp.req_pool_indices[live],
        num_accept_tokens_cpu=host_counts,
    )
