"""Verify phase: VerifyInput -> VerifyOutput.

The target scores every tree node in one forward with the tree attention mask, then a path is
accepted: greedily (the first child equal to the target's argmax, level by level), or by lossless
sampling (tree drafts: children tried in order against the target distribution, the bonus from the
residual; sampled STANDALONE chains: standard rejection sampling). Accepted nodes' KV slots are
committed to the request's slot table; the others are freed. Requests that hit a stop token or their
length budget are cut after that token and leave the batch; the rest go on to draft-extend with the
target hidden states captured at their accepted rows.

Split like the draft phase: `_prepare` (host: slots, pre-drawn coins), `verify_core` (the target
forward and the acceptance walk, no host reads: what a CUDA graph captures), then the host-side
stops, KV commit and the draft-extend input.
"""

from dataclasses import dataclass
from typing import Optional

import torch

from spec_schema import DraftExtendInput, VerifyInput, VerifyOutput, boundary

from . import faults
from .attention import AttnBatch
from .runtime import BatchSampling, CoreOps, Runtime
from .tree import verify_chain_rejection, verify_greedy, verify_tree_sampling


@dataclass(frozen=True)
class StopBatch:
    """When each request of the batch must stop, in batch order (host-side facts)."""

    budget: list[int]  # tokens each request may still emit (>= 1)
    stop_ids: list[frozenset[int]]  # tokens that end each request (EOS and stop token ids)


@dataclass
class VerifyCoreIn:
    """The verify core's tensors: a VerifyInput's, plus what the host prepared.

    `slots` `(bs, num_draft)`: the target KV slot of every node. `greedy` (host flag) picks greedy
    acceptance; otherwise `uniforms` `(bs, num_draft)` (a chain uses the first num_draft - 1) and
    `uniform_final` `(bs,)` are the pre-drawn coins and `temperature`, `top_k`, `top_p` the requests'
    parameters. `sim_accept` `(bs,)` (benchmarks): tokens to accept per request, whatever the target
    says. `hidden_states` `(bs * num_draft, hidden_extend)`: scratch the captured target rows land in.
    `pad_slot` `(1,)`: the dummy KV slot padded rows write to (static path only)."""

    draft_token: torch.Tensor
    positions: torch.Tensor
    tree_mask: torch.Tensor
    retrieve_index: torch.Tensor
    retrieve_next_token: torch.Tensor
    retrieve_next_sibling: torch.Tensor
    seq_lens: torch.Tensor
    req_pool_indices: torch.Tensor
    slots: torch.Tensor
    greedy: bool = True
    draft_probs: Optional[torch.Tensor] = None
    uniforms: Optional[torch.Tensor] = None
    uniform_final: Optional[torch.Tensor] = None
    temperature: Optional[torch.Tensor] = None
    top_k: Optional[torch.Tensor] = None
    top_p: Optional[torch.Tensor] = None
    sim_accept: Optional[torch.Tensor] = None
    hidden_states: Optional[torch.Tensor] = None
    pad_slot: Optional[torch.Tensor] = None


@dataclass
class VerifyCoreOut:
    """Acceptance before stops: accept_index / accept_tokens `(bs, num_steps + 1)` (-1 padded),
    num_correct `(bs,)` int32, and the captured target rows `(bs * num_draft, hidden_extend)` or None."""

    accept_index: torch.Tensor
    accept_tokens: torch.Tensor
    num_correct: torch.Tensor
    captured: Optional[torch.Tensor]


@boundary
def verify(rt: Runtime, inp: VerifyInput, sampling: BatchSampling, stops: StopBatch) -> VerifyOutput:
    """Score the trees with the target, accept a path per request, commit its KV, cut at stops."""
    config = rt.spec_config
    bs = len(inp)
    if bs == 0:
        return VerifyOutput.create_idle(config, rt.device)
    core_in = _prepare(rt, inp, sampling)
    out = rt.runner.verify(core_in) if rt.static else verify_core(rt.core_ops(), core_in)
    rt.counters.target_forwards += 1
    captured = out.captured
    rt.counters.add_hidden(captured)
    num_accept, finished, host_counts = _apply_stops(out.accept_tokens, out.num_correct, stops)
    accept_index = _cut(out.accept_index, num_accept)
    accept_tokens = _cut(out.accept_tokens, num_accept)
    _commit_kv(rt, inp, core_in.slots.reshape(-1), accept_index, num_accept)
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


def _prepare(rt: Runtime, inp: VerifyInput, sampling: BatchSampling) -> VerifyCoreIn:
    """Host side: a slot per node, coins, simulated accepts (the static path's dummy slot is reserved)."""
    config = rt.spec_config
    bs, n = len(inp), config.num_draft_tokens
    slots = rt.target_cache.alloc_slots(bs * n)
    uniforms = uniform_final = sim = None
    if not sampling.all_greedy:
        uniforms = rt.uniform(bs, n - 1 if inp.draft_probs is not None else n)
        uniform_final = rt.uniform(bs)
    if rt.simulate_accept is not None:
        sim = rt.simulate_accept.counts(bs, min(n, config.num_steps + 1), rt.device)
    return VerifyCoreIn(
        draft_token=inp.draft_token,
        positions=inp.positions,
        tree_mask=inp.tree_mask,
        retrieve_index=inp.retrieve_index,
        retrieve_next_token=inp.retrieve_next_token,
        retrieve_next_sibling=inp.retrieve_next_sibling,
        seq_lens=inp.seq_lens,
        req_pool_indices=inp.req_pool_indices,
        slots=slots.view(bs, n),
        greedy=sampling.all_greedy,
        draft_probs=inp.draft_probs,
        uniforms=uniforms,
        uniform_final=uniform_final,
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        sim_accept=sim,
        pad_slot=rt.reserved_slots["target"][:1] if rt.static else None,
    )


def verify_core(ops: CoreOps, c: VerifyCoreIn) -> VerifyCoreOut:
    """The target's tree forward and the acceptance walk: tensors in, tensors out."""
    bs, n = c.draft_token.shape
    attn = AttnBatch.tree(c.req_pool_indices, c.seq_lens, c.slots, c.tree_mask)
    hidden, aux = ops.target.forward(
        c.draft_token.reshape(-1), c.positions.reshape(-1), attn, ops.target_cache, ops.aux_layer_ids
    )
    captured = ops.capture(hidden, aux)
    if captured is not None and c.hidden_states is not None:
        c.hidden_states.copy_(captured)
        captured = c.hidden_states
    logits = ops.target.compute_logits(hidden).view(bs, n, -1)
    accept_index, accept_tokens, num_correct = _accept(ops, c, logits)
    if c.sim_accept is not None:
        accept_index, accept_tokens, num_correct = _simulated(c, logits, accept_index.shape[1])
    return VerifyCoreOut(accept_index, accept_tokens, num_correct, captured)


def _accept(ops: CoreOps, c: VerifyCoreIn, logits: torch.Tensor):
    """Accept a path per request. Returns (accept_index, accept_tokens, num_correct_drafts)."""
    steps = ops.config.num_steps
    trees = (c.draft_token, c.retrieve_index, c.retrieve_next_token, c.retrieve_next_sibling)
    bs, n, _ = logits.shape
    if c.greedy:
        greedy = ops.verify_greedy or verify_greedy
        predicts, accept_index, num_correct = greedy(*trees, logits.argmax(-1), steps)
        return accept_index, _tokens_at(predicts, accept_index), num_correct
    probs = ops.probs(logits, c.temperature, c.top_k, c.top_p)
    if c.draft_probs is not None:
        tokens, num_correct = verify_chain_rejection(
            c.draft_token[:, 1:], c.draft_probs[:, : n - 1], probs, c.uniforms[:, : n - 1], c.uniform_final
        )
        # A chain's accepted nodes are its first num_correct + 1 rows.
        cols = torch.arange(n, device=logits.device)
        index = torch.where(cols <= num_correct[:, None].long(), c.retrieve_index, -1)
        return index, tokens, num_correct
    tree_sampling = ops.verify_tree_sampling or verify_tree_sampling
    predicts, accept_index, num_correct = tree_sampling(*trees, probs, c.uniforms, c.uniform_final, steps)
    return accept_index, _tokens_at(predicts, accept_index), num_correct


def _simulated(c: VerifyCoreIn, logits: torch.Tensor, width: int):
    """Benchmark override (labelled "simulated"): request b accepts nodes 0 .. a_b - 1 as if they
    formed its path (whatever the tree), emitting their draft tokens then the target's argmax at the
    last one, as sglang's SGLANG_SIMULATE_ACC_LEN does. Timing only: the tokens are meaningless."""
    bs, n = c.draft_token.shape
    a = c.sim_accept.long()
    cols = torch.arange(width, device=logits.device)[None, :]
    index = torch.where(cols < a[:, None], c.retrieve_index[:, :1] + cols, -1)
    nxt = c.draft_token.gather(1, (cols + 1).clamp(max=n - 1).expand(bs, width))
    bonus = logits.argmax(-1).gather(1, (a - 1)[:, None])
    tokens = torch.where(cols < (a - 1)[:, None], nxt, torch.where(cols == (a - 1)[:, None], bonus, -1))
    return index, tokens, (a - 1).to(torch.int32)


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
