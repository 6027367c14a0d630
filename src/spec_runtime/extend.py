"""Draft-extend phase: DraftExtendInput -> DraftInput, and prefill, which produces a DraftExtendInput.

The draft runs over the accepted tokens of each request (or the prompt after prefill), fed the
target hidden states captured at those rows (EAGLE: the final hidden, `hidden_extend` = target
width; EAGLE-3: the concatenated aux layers), commits their KV to its own slot table, and from each
request's last row proposes the root's children of the next tree.
"""

import torch

from spec_schema import DraftExtendInput, DraftInput, boundary

from .attention import AttnBatch
from .draft import _propose
from .runtime import BatchSampling, Runtime
from .sampling import probs_from_logits_batched, sample_from_probs


@boundary
def draft_extend(rt: Runtime, inp: DraftExtendInput, sampling: BatchSampling) -> DraftInput:
    """Run the draft over the accepted rows and produce the next iteration's DraftInput."""
    config = rt.spec_config
    if len(inp) == 0:
        return rt.idle_draft_input()
    counts = inp.num_accept_tokens.long()
    slots = rt.draft_cache.alloc_slots(inp.input_ids.shape[0])
    attn = AttnBatch.extend(inp.req_pool_indices, inp.seq_lens - counts, counts, slots)
    hidden_in = inp.hidden_states
    h = rt.draft.forward(inp.input_ids, hidden_in, inp.positions, attn, rt.draft_cache, from_target=True)
    rt.counters.draft_forwards += 1
    rows = inp.req_pool_indices.repeat_interleave(counts, output_size=inp.input_ids.shape[0])
    rt.draft_cache.req_to_token[rows, inp.positions] = slots
    last = h[torch.cumsum(counts, 0) - 1]
    # Sampled chains carry the draft distribution for every request (greedy ones get a one-hot), so
    # batches always merge.
    topk_p, topk_index, full = _propose(rt, rt.draft.compute_logits(last), sampling, config.topk, rt.sampled_chain)
    keep_hidden = config.traits.draft_reads_hidden
    return DraftInput(
        topk_p=topk_p,
        topk_index=topk_index,
        hidden_states=last if keep_hidden else None,
        bonus_tokens=inp.bonus_tokens,
        seq_lens=inp.seq_lens,
        req_pool_indices=inp.req_pool_indices,
        draft_probs=full,
    )


@boundary
def prefill(rt: Runtime, rows: torch.Tensor, prompts: list[torch.Tensor], sampling: BatchSampling) -> DraftExtendInput:
    """Target extend over new prompts; the first token of each request becomes its bonus token.

    `rows` are the requests' slot-table rows. Returns the draft-extend input of the prompts: the
    draft reads token t_{j+1} with the target hidden state of position j (DESIGN: the shift).
    """
    lens = torch.tensor([len(p) for p in prompts], dtype=torch.int64, device=rt.device)
    ids = torch.cat(prompts).to(rt.device)
    positions = torch.cat([torch.arange(len(p), device=rt.device) for p in prompts])
    slots = rt.target_cache.alloc_slots(ids.shape[0])
    attn = AttnBatch.extend(rows, torch.zeros_like(lens), lens, slots)
    hidden, aux = rt.target.forward(ids, positions, attn, rt.target_cache, rt.aux_layer_ids)
    rt.counters.target_forwards += 1
    rt.target_cache.req_to_token[rows.repeat_interleave(lens), positions] = slots
    last = torch.cumsum(lens, 0) - 1
    first = _first_tokens(rt, rt.target.compute_logits(hidden[last]), sampling)
    shifted = torch.roll(ids, -1)
    shifted[last] = first
    captured = rt.capture(hidden, aux)
    rt.counters.add_hidden(captured)
    return DraftExtendInput(
        hidden_states=captured,
        input_ids=shifted,
        positions=positions,
        num_correct_drafts=(lens - 1).to(torch.int32),
        num_accept_tokens=lens.to(torch.int32),
        seq_lens=lens,
        bonus_tokens=first,
        req_pool_indices=rows,
        num_accept_tokens_cpu=tuple(len(p) for p in prompts),
    )


def _first_tokens(rt: Runtime, logits: torch.Tensor, sampling: BatchSampling) -> torch.Tensor:
    if sampling.all_greedy:
        return logits.argmax(-1)
    probs = probs_from_logits_batched(logits, sampling.temperature, sampling.top_k, sampling.top_p)
    return sample_from_probs(probs, rt.uniform(logits.shape[0]))
