"""Draft-extend phase: DraftExtendInput -> DraftInput, and prefill, which produces a DraftExtendInput.

The draft runs over the accepted tokens of each request (or the prompt after prefill), fed the
target hidden states captured at those rows (EAGLE: the final hidden, `hidden_extend` = target
width; EAGLE-3: the concatenated aux layers), commits their KV to its own slot table, and from each
request's last row proposes the root's children of the next tree.

`draft_extend` is split like the other phases: `_prepare` (host: slots, coins), `draft_extend_core`
(no host reads when the rows have a fixed stride: what a CUDA graph captures), then the host-side
slot-table commit. Prefill stays eager (ragged prompts).
"""

from typing import Optional

import torch

from spec_schema import DraftExtendInput, DraftInput, boundary

from .attention import AttnBatch, const_arange, const_causal
from .core_types import CoreOps, ExtendCoreIn, ExtendCoreOut, fields_of
from .draft import propose
from .sampling import probs_from_logits_batched, sample_from_probs
from .state import BatchSampling, RuntimeState


@boundary
def draft_extend(rt: RuntimeState, inp: DraftExtendInput, sampling: BatchSampling) -> DraftInput:
    """Run the draft over the accepted rows and produce the next iteration's DraftInput."""
    if len(inp) == 0:
        return rt.idle_draft_input()
    launched = rt.runner.take_extend(inp)
    if launched is not None:  # run by verify's launch-ahead, slot tables committed on the device
        out = _draft_input(launched, inp)
        rt.runner.note_output(out)
        return out
    core_in = _prepare(rt, inp, sampling)
    if rt.runner.fits_extend(inp):
        out = rt.runner.draft_extend(core_in)
    else:  # a prefill's prompt rows (longer than the static stride): not captured
        out = draft_extend_core(rt.runner.eager_ops(), core_in)
    counts = inp.num_accept_tokens.long()
    rows = inp.req_pool_indices.repeat_interleave(counts, output_size=inp.input_ids.shape[0])
    rt.draft_cache.req_to_token[rows, inp.positions] = core_in.out_slots
    return _draft_input(out, inp)


def _draft_input(out: ExtendCoreOut, inp: DraftExtendInput) -> DraftInput:
    """The next DraftInput: the core's root proposals for the requests of `inp`."""
    return DraftInput(**fields_of(out, DraftInput), bonus_tokens=inp.bonus_tokens, seq_lens=inp.seq_lens,
                      req_pool_indices=inp.req_pool_indices)


def _prepare(rt: RuntimeState, inp: DraftExtendInput, sampling: BatchSampling) -> ExtendCoreIn:
    """Host side: a draft slot per row, sampled-chain coins (the static path's dummy slot is reserved)."""
    # Sampled chains carry the draft distribution for every request (greedy ones get a one-hot), so
    # batches always merge.
    sampled = rt.sampled_chain
    return ExtendCoreIn(**fields_of(inp, ExtendCoreIn), **fields_of(sampling, ExtendCoreIn),
                        out_slots=rt.draft_cache.alloc_slots(inp.input_ids.shape[0]), sampled=sampled,
                        uniform=rt.uniform(len(inp)) if sampled and not sampling.all_greedy else None,
                        greedy=sampling.all_greedy,
                        pad_slot=rt.reserved_slots["draft"][:1] if rt.static else None)


def draft_extend_core(ops: CoreOps, c: ExtendCoreIn) -> ExtendCoreOut:
    """The draft forward over the accepted rows and the next root's top-k: tensors in, tensors out
    (with a fixed `stride` no host reads; ragged rows build their batch with one sync)."""
    lead = ops.config.traits.draft_kv_lead
    if c.stride is None:
        counts = c.num_accept_tokens.long()
        prefix = c.seq_lens - counts + lead  # the draft KV before these rows
        attn = AttnBatch.extend(c.req_pool_indices, prefix, counts, c.out_slots)
        last_rows = torch.cumsum(counts, 0) - 1
    else:
        prefix, last_rows, extra = (ops.extend_rows or extend_rows)(c.num_accept_tokens, c.seq_lens, c.out_slots,
                                                                    c.stride, lead)
        qo_indptr = const_arange(prefix.shape[0] + 1, c.stride, prefix.device)
        attn = AttnBatch(c.req_pool_indices, prefix, qo_indptr, c.out_slots, extra)
    h = ops.draft.forward(c.input_ids, c.hidden_states, c.positions, attn, ops.draft_cache, from_target=True)
    last = h.index_select(0, last_rows)  # one kernel at any batch size (h[rows]: a gather and a copy at bs 4)
    topk_p, topk_index, full = propose(ops, last, c.draft_logits, ops.config.topk, c.sampled, c, c.uniform)
    keep_hidden = ops.config.traits.draft_reads_hidden
    return ExtendCoreOut(topk_p, topk_index, last if keep_hidden else None, full)


def extend_rows(counts: torch.Tensor, seq_lens: torch.Tensor, out_slots: torch.Tensor, stride: int,
                lead: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows laid out `stride` per request (`counts[r]` of them live, `seq_lens[r]` the length after
    them): `(prefix_lens, last_rows, extra_kv)` int64, the draft KV each request attends before its
    rows (`lead` further: the draft's KV lead), the global row of its last live row, and
    `extend_fixed_stride`'s extra slots. The reference of `spec_kernels.extend_rows` (one launch)."""
    counts = counts.long()
    prefix = seq_lens - counts + lead
    last_rows = const_arange(counts.shape[0], stride, counts.device) + (counts - 1)
    return prefix.long(), last_rows, _stride_extra(counts, out_slots, stride)


def extend_fixed_stride(req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor, counts: torch.Tensor,
                        out_slots: torch.Tensor, stride: int) -> AttnBatch:
    """`AttnBatch.extend` for rows laid out `stride` per request, without a host sync: row j of
    request r sees the prefix and rows 0..j of r when j < counts[r]; rows at or beyond the count see
    only the prefix (their outputs are ignored). `out_slots` `(bs * stride,)`."""
    bs = req_pool_indices.shape[0]
    extra = _stride_extra(counts, out_slots, stride)
    qo_indptr = const_arange(bs + 1, stride, out_slots.device)
    return AttnBatch(req_pool_indices, prefix_lens.to(torch.int64), qo_indptr, out_slots, extra)


def _stride_extra(counts: torch.Tensor, out_slots: torch.Tensor, stride: int) -> torch.Tensor:
    """`(bs * stride, stride)` extra slots of `extend_fixed_stride`'s rows (-1: none)."""
    bs = counts.shape[0]
    local = const_arange(stride, 1, out_slots.device)
    causal = const_causal(stride, out_slots.device)  # (stride, stride): [row j, column i] i <= j
    live = local[None, :] < counts[:, None]  # (bs, stride)
    visible = causal[None] & live[:, :, None]
    by_req = out_slots.view(bs, 1, stride).expand(bs, stride, stride)
    return torch.where(visible, by_req, -1).reshape(bs * stride, stride)


@boundary
def prefill(rt: RuntimeState, rows: torch.Tensor, prompts: list[torch.Tensor], sampling: BatchSampling) -> DraftExtendInput:
    """Target extend over new prompts; the first token of each request becomes its bonus token.

    `rows` are the requests' slot-table rows. Returns the draft-extend input of the prompts, by the
    traits' `draft_sequence`: "shifted" (EAGLE heads) reads token t_{j+1} with the target hidden
    state of position j, for j < len(prompt); "own" (STANDALONE) reads the prompt and the first token
    at their own positions 0 .. len(prompt), one row more (the draft's KV lead).
    """
    lens = torch.tensor([len(p) for p in prompts], dtype=torch.int64, device=rt.device)
    ids = torch.cat(prompts).to(rt.device)
    positions = torch.cat([torch.arange(len(p), device=rt.device) for p in prompts])
    slots = rt.target_cache.alloc_slots(ids.shape[0])
    attn = AttnBatch.extend(rows, torch.zeros_like(lens), lens, slots)
    target = rt.runner.eager_ops().target  # static: the fast model, uncaptured
    hidden, aux = target.forward(ids, positions, attn, rt.target_cache, rt.aux_layer_ids)
    rt.target_cache.req_to_token[rows.repeat_interleave(lens), positions] = slots
    last = torch.cumsum(lens, 0) - 1
    first = _first_tokens(rt, target.compute_logits(hidden[last]), sampling)
    captured = rt.capture(hidden, aux)
    rt.counters.add_hidden(captured)
    if rt.spec_config.traits.draft_sequence == "own":
        return _own_sequence(rt, prompts, first, lens, rows, captured)
    shifted = torch.roll(ids, -1)
    shifted[last] = first
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


def _own_sequence(rt: RuntimeState, prompts: list[torch.Tensor], first: torch.Tensor, lens: torch.Tensor,
                  rows: torch.Tensor, captured: Optional[torch.Tensor]) -> DraftExtendInput:
    """The prefill's draft-extend input for a draft that reads the target's own sequence: each
    prompt then its first token, at positions 0 .. len(prompt). `captured` is None (the traits
    capture nothing for such drafts) but for the bug zoo's planted capture, which the contract rejects."""
    parts = []
    for i, p in enumerate(prompts):
        parts += [p.to(rt.device), first[i : i + 1]]
    ids = torch.cat(parts)
    positions = torch.cat([torch.arange(len(p) + 1, device=rt.device) for p in prompts])
    counts = lens + 1
    if captured is not None:  # bug zoo only: one captured row per draft row (the root repeats the last)
        start = torch.repeat_interleave(torch.cumsum(lens, 0) - lens, counts)
        captured = captured[start + torch.minimum(positions, torch.repeat_interleave(lens - 1, counts))]
    return DraftExtendInput(
        hidden_states=captured,
        input_ids=ids,
        positions=positions,
        num_correct_drafts=lens.to(torch.int32),
        num_accept_tokens=counts.to(torch.int32),
        seq_lens=lens,
        bonus_tokens=first,
        req_pool_indices=rows,
        num_accept_tokens_cpu=tuple(len(p) + 1 for p in prompts),
    )


def _first_tokens(rt: RuntimeState, logits: torch.Tensor, sampling: BatchSampling) -> torch.Tensor:
    if sampling.all_greedy:
        return logits.argmax(-1)
    probs = probs_from_logits_batched(logits, sampling.temperature, sampling.top_k, sampling.top_p)
    return sample_from_probs(probs, rt.uniform(logits.shape[0]))
