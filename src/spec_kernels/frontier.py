"""The draft's expansion bookkeeping on the GPU: one launch per draft step, one for the rerank.

The torch path of `draft.draft_core` spends about twenty small kernels per draft step between two
draft forwards: `tree.select_frontier` (score products, NaN keys, a stable sort, gathers), the
branch-slot concatenation and gather, the positions and the attention rows. Here one program per
request does all of it for one step (`frontier_step`), writing the step's candidates straight into
the tree's records (no concatenation at the end), and one program per request picks the tree's
nodes from the records (`organize_records`, `tree.organize`'s selection).

The values are `tree.select_frontier` / `tree.gather_branches` / `tree.organize`'s: scores are the
same float32 products; NaN ranks last (as -inf); equal scores keep the lower flat index first, as the
stable sort does. One difference in kind: the selection compares values, so `-0.0` and `0.0` tie
(the sort orders them by bit pattern); probabilities are never negative, so drafts never meet it.
"""

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from spec_kernels._common import INDEX_DTYPES, check_tensor, next_pow2, require

__all__ = ["DraftRecords", "Frontier", "chain_probs", "frontier_step", "onehot_rows", "organize_records"]


@dataclass
class DraftRecords:
    """Every candidate of one draft, written step by step.

    Attributes:
        scores: `(bs, C)` float32 cumulative scores, `C = topk + (num_steps - 1) * topk**2`, in flat
            (record) order: the root's children, then each step's `topk**2` candidates.
        tokens: `(bs, C)` int64 their target-vocabulary tokens.
        parent_list: `(bs, 1 + topk * (num_steps - 1))` int64 `[-1, frontier_0, ..., frontier_{S-2}]`.
    """

    scores: torch.Tensor
    tokens: torch.Tensor
    parent_list: torch.Tensor

    @classmethod
    def empty(cls, bs: int, topk: int, num_steps: int, device: torch.device) -> "DraftRecords":
        c = topk + (num_steps - 1) * topk * topk
        return cls(torch.empty((bs, c), dtype=torch.float32, device=device),
                   torch.empty((bs, c), dtype=torch.int64, device=device),
                   torch.empty((bs, 1 + topk * (num_steps - 1)), dtype=torch.int64, device=device))


@dataclass
class Frontier:
    """One step's outputs: the new frontier, best first (`scores`, `tokens`, `parent` `(bs, topk)`),
    and the next draft forward's inputs: `branch_slots` `(bs, topk, step + 1)` (each branch's
    ancestors' draft slots, then its own), `out_slots` `(bs * topk,)` (its own), `positions`
    `(bs * topk,)` (`seq_lens + step`), `hidden` `(bs, topk, H)` (each branch's parent's hidden state,
    when the step was given the forward's). The last step has only its records: every field is None."""

    scores: Optional[torch.Tensor] = None
    tokens: Optional[torch.Tensor] = None
    parent: Optional[torch.Tensor] = None
    branch_slots: Optional[torch.Tensor] = None
    out_slots: Optional[torch.Tensor] = None
    positions: Optional[torch.Tensor] = None
    hidden: Optional[torch.Tensor] = None


@triton.jit
def _frontier_kernel(
    scores_ptr,  # (bs, K) float32 frontier scores (ignored at step 0)
    p_ptr,  # (bs, NC) float32 candidate probabilities: (bs, K) at step 0, (bs, K*K) later
    ids_ptr,  # (bs, NC) int candidate ids (draft vocabulary when HAS_D2T)
    d2t_ptr,  # (V_draft,) int64 target_id - draft_id (ignored unless HAS_D2T)
    slots_in_ptr,  # (bs, K, STEP) int64 branch slots of this step's forward (ignored at step 0)
    temp_ptr,  # (bs, K, S) int64 each branch's draft slot per step
    seq_ptr,  # (bs,) int committed lengths
    rec_scores_ptr, rec_tokens_ptr, plist_ptr,  # DraftRecords (outputs)
    new_scores_ptr, new_tokens_ptr, parent_ptr,  # (bs, K) the new frontier (outputs, HAS_NEXT)
    slots_out_ptr,  # (bs, K, STEP + 1) int64 (output, HAS_NEXT)
    out_slots_ptr, positions_ptr,  # (bs * K,) (outputs, HAS_NEXT)
    h_in_ptr,  # (bs * K, H) this step's forward's hidden states (HIDDEN)
    h_out_ptr,  # (bs * K, H) each new branch's parent's (output, HAS_NEXT and HIDDEN)
    C, W, S, H,
    K: tl.constexpr, NC: tl.constexpr, NCP: tl.constexpr, STEP: tl.constexpr, SP: tl.constexpr,
    HAS_D2T: tl.constexpr, HAS_NEXT: tl.constexpr, HIDDEN: tl.constexpr = False, BLOCK_H: tl.constexpr = 256,
):
    b = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, NCP)
    valid = c < NC
    p = tl.load(p_ptr + b * NC + c, mask=valid, other=0.0)
    if STEP == 0:
        e = p
        base = 0
    else:
        e = tl.load(scores_ptr + b * K + c // K, mask=valid, other=0.0) * p
        base = K + (STEP - 1) * K * K
    tok = tl.load(ids_ptr + b * NC + c, mask=valid, other=0).to(tl.int64)
    if HAS_D2T:
        tok = tok + tl.load(d2t_ptr + tok, mask=valid, other=0)
    tl.store(rec_scores_ptr + b * C + base + c, e, mask=valid)
    tl.store(rec_tokens_ptr + b * C + base + c, tok, mask=valid)
    if STEP == 0:
        tl.store(plist_ptr + b * W, -1)
    if HAS_NEXT:
        key = tl.where(e != e, float("-inf"), e)  # NaN ranks last
        taken = c >= NC
        cols = tl.arange(0, SP)
        seq = tl.load(seq_ptr + b)
        for j in range(K):
            if STEP == 0:  # the root's children keep their order
                idx = j
                parent = j * 0
            else:  # the best remaining score, the lowest flat index among equals
                kv = tl.where(taken, float("-inf"), key)
                best = tl.max(kv, 0)
                idx = tl.min(tl.where((~taken) & (kv == best), c, NCP), 0)
                taken = taken | (c == idx)
                parent = idx // K
            hit = c == idx
            tl.store(new_scores_ptr + b * K + j, tl.sum(tl.where(hit, e, 0.0), 0))
            tl.store(new_tokens_ptr + b * K + j, tl.sum(tl.where(hit, tok, 0), 0))
            tl.store(parent_ptr + b * K + j, parent)
            tl.store(plist_ptr + b * W + 1 + STEP * K + j, base + idx)
            own = tl.load(temp_ptr + (b * K + j) * S + STEP)
            hist = tl.load(slots_in_ptr + (b * K + parent) * STEP + cols, mask=cols < STEP, other=0)
            tl.store(slots_out_ptr + (b * K + j) * (STEP + 1) + cols, tl.where(cols == STEP, own, hist),
                     mask=cols <= STEP)
            tl.store(out_slots_ptr + b * K + j, own)
            tl.store(positions_ptr + b * K + j, seq + STEP)
            if HIDDEN:  # `gather_branches(h, parent)`: the next forward's hidden input
                for h0 in range(0, H, BLOCK_H):
                    hc = h0 + tl.arange(0, BLOCK_H)
                    row = tl.load(h_in_ptr + (b * K + parent) * H + hc, mask=hc < H)
                    tl.store(h_out_ptr + (b * K + j) * H + hc, row, mask=hc < H)


def frontier_step(
    step: int,
    num_steps: int,
    records: DraftRecords,
    probs: torch.Tensor,
    ids: torch.Tensor,
    temp_slots: torch.Tensor,
    seq_lens: torch.Tensor,
    scores: Optional[torch.Tensor] = None,
    branch_slots: Optional[torch.Tensor] = None,
    d2t: Optional[torch.Tensor] = None,
    hidden: Optional[torch.Tensor] = None,
) -> Frontier:
    """One expansion step of the draft (`tree.select_frontier` and what the draft loop derives from
    it) in one launch.

    Args:
        step: 0-based step `i`; step 0 takes the root's children as they come.
        num_steps: the draft's steps `S`; the last step (`S - 1`) only writes its records.
        records: the draft's `DraftRecords` (written at this step's offset).
        probs: step 0 `(bs, topk)`; later `(bs * topk, topk)` or `(bs, topk, topk)`: the draft's top-k
            probabilities after each frontier node, float32.
        ids: their ids, same shape (draft vocabulary if `d2t` is given, else target).
        temp_slots: `(bs, topk, S)` int64 each branch's draft slot per step.
        seq_lens: `(bs,)` committed lengths (the next positions are `seq_lens + step`).
        scores: `(bs, topk)` float32 frontier scores (steps > 0).
        branch_slots: `(bs, topk, step)` int64 the slots this step's forward attended (steps > 0).
        d2t: `(V_draft,)` int64 `target_id - draft_id` (EAGLE-3), or None.
        hidden: `(bs * topk, H)` the step's forward's hidden states (steps > 0), reordered into
            `Frontier.hidden` by parent branch (`tree.gather_branches`) in the same launch; or None.
    """
    bs, k = records.parent_list.shape[0], temp_slots.shape[1]
    dev = temp_slots.device
    nc = k if step == 0 else k * k
    require(0 <= step < num_steps, f"step must be in [0, {num_steps}), got {step}")
    check_tensor("probs", probs, (torch.float32,), (None,) * probs.dim(), dev)
    require(probs.numel() == bs * nc and ids.numel() == bs * nc,
            f"step {step} probs/ids need {bs} x {nc} entries, got {tuple(probs.shape)} / {tuple(ids.shape)}")
    check_tensor("ids", ids, INDEX_DTYPES, tuple(ids.shape), dev)
    check_tensor("temp_slots", temp_slots, (torch.int64,), (bs, k, num_steps), dev)
    check_tensor("seq_lens", seq_lens, INDEX_DTYPES, (bs,), dev)
    if step > 0:
        require(scores is not None and branch_slots is not None, f"step {step} needs the frontier scores and slots")
        check_tensor("scores", scores, (torch.float32,), (bs, k), dev)
        check_tensor("branch_slots", branch_slots, (torch.int64,), (bs, k, step), dev)
    nxt = step < num_steps - 1
    i64 = dict(dtype=torch.int64, device=dev)
    out = Frontier()
    if hidden is not None:
        require(step > 0 and hidden.dim() == 2 and hidden.shape[0] == bs * k and hidden.is_contiguous()
                and hidden.device == dev, f"hidden must be a contiguous (bs * topk, H) = ({bs * k}, H) tensor of "
                f"a step > 0 on {dev}, got {tuple(hidden.shape)} at step {step}")
    if nxt:
        h_out = None if hidden is None else torch.empty((bs, k, hidden.shape[1]), dtype=hidden.dtype, device=dev)
        out = Frontier(torch.empty((bs, k), dtype=torch.float32, device=dev), torch.empty((bs, k), **i64),
                       torch.empty((bs, k), **i64), torch.empty((bs, k, step + 1), **i64),
                       torch.empty((bs * k,), **i64), torch.empty((bs * k,), dtype=seq_lens.dtype, device=dev), h_out)
    if bs == 0:
        return out
    dummy = records.tokens
    _frontier_kernel[(bs,)](
        scores if step > 0 else dummy, probs.contiguous(), ids.contiguous(), d2t if d2t is not None else dummy,
        branch_slots.contiguous() if step > 0 else dummy, temp_slots.contiguous(), seq_lens.contiguous(),
        records.scores, records.tokens, records.parent_list,
        *(t if t is not None else dummy for t in (out.scores, out.tokens, out.parent, out.branch_slots,
                                                   out.out_slots, out.positions)),
        dummy if hidden is None else hidden, dummy if out.hidden is None else out.hidden,
        records.scores.shape[1], records.parent_list.shape[1], num_steps, 0 if hidden is None else hidden.shape[1],
        K=k, NC=nc, NCP=max(2, next_pow2(nc)), STEP=step, SP=max(2, next_pow2(step + 1)),
        HAS_D2T=d2t is not None, HAS_NEXT=nxt, HIDDEN=out.hidden is not None,
        BLOCK_H=min(1024, next_pow2(hidden.shape[1])) if hidden is not None else 16, num_warps=1 if nc <= 256 else 4,
    )
    return out


@triton.jit
def _organize_kernel(
    scores_ptr,  # (bs, C) float32 record scores
    tokens_ptr,  # (bs, C) int64 record tokens
    selected_ptr,  # (bs, NSEL) int64 (output): chosen flat indices, ascending
    draft_ptr,  # (bs, NSEL) int64 (output): their tokens
    C, NSEL,
    CP: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CP)
    valid = c < C
    e = tl.load(scores_ptr + b * C + c, mask=valid, other=0.0)
    key = tl.where(e != e, float("-inf"), e)
    taken = c >= C
    chosen = c < 0
    for _ in range(NSEL):
        kv = tl.where(taken, float("-inf"), key)
        best = tl.max(kv, 0)
        idx = tl.min(tl.where((~taken) & (kv == best), c, CP), 0)
        taken = taken | (c == idx)
        chosen = chosen | (c == idx)
    rank = tl.cumsum(chosen.to(tl.int32), 0) - 1
    tok = tl.load(tokens_ptr + b * C + c, mask=valid, other=0)
    tl.store(selected_ptr + b * NSEL + rank, c.to(tl.int64), mask=chosen)
    tl.store(draft_ptr + b * NSEL + rank, tok, mask=chosen)


def organize_records(records: DraftRecords, num_draft: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`tree.organize` over `DraftRecords`: `(parent_list, selected_index, draft_tokens)`, the
    `num_draft - 1` best candidates (ascending flat indices) and their tokens."""
    bs, c = records.scores.shape
    require(1 <= num_draft <= c + 1, f"num_draft must be in [1, {c + 1}] (1 + number of candidates), got {num_draft}")
    nsel = num_draft - 1
    dev = records.scores.device
    selected = torch.empty((bs, nsel), dtype=torch.int64, device=dev)
    tokens = torch.empty((bs, nsel), dtype=torch.int64, device=dev)
    if bs and nsel:
        _organize_kernel[(bs,)](records.scores, records.tokens, selected, tokens, c, nsel,
                                CP=max(2, next_pow2(c)), num_warps=1 if c <= 256 else 4)
    return records.parent_list, selected, tokens


@triton.jit
def _chain_probs_kernel(
    root_ptr,  # (bs, V) float32 the root's distribution (row 0)
    tok_ptr,  # (bs, N) int the chain's tokens (node i + 1 drawn at row i)
    out_ptr,  # (bs, N, V) float32 (output)
    N, V,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < V
    hot = tl.load(tok_ptr + b * N + i + 1, mask=(i >= 1) & (i < N - 1), other=-1)
    value = tl.where(cols == hot, 1.0, 0.0)
    value = tl.where(i == 0, tl.load(root_ptr + b * V + cols, mask=ok & (i == 0), other=0.0), value)
    tl.store(out_ptr + (b * N + i) * V + cols, value, mask=ok)


def chain_probs(root_probs: torch.Tensor, draft_token: torch.Tensor) -> torch.Tensor:
    """A greedy chain's `draft_probs` `(bs, N, V)` float32 in one launch: row 0 the root's distribution
    `root_probs` `(bs, V)` (node 1's), row i (1 <= i < N - 1) the one-hot of node i + 1's token (the
    argmax it was proposed as), the last row zeros: what the torch path stacks from the steps'
    one-hot distributions (`draft._propose` of a greedy batch)."""
    bs, n = draft_token.shape
    dev = draft_token.device
    check_tensor("draft_token", draft_token, INDEX_DTYPES, (bs, n), dev)
    check_tensor("root_probs", root_probs, (torch.float32,), (bs, None), dev)
    v = root_probs.shape[1]
    out = torch.empty((bs, n, v), dtype=torch.float32, device=dev)
    if bs and n:
        block = min(4096, next_pow2(v))
        _chain_probs_kernel[(bs, n, -(-v // block))](root_probs.contiguous(), draft_token.contiguous(), out, n, v,
                                                     BLOCK=block, num_warps=4)
    return out


@triton.jit
def _onehot_kernel(
    ids_ptr,  # (R,) int the chosen ids
    ones_ptr,  # (R,) float32 1.0 each (output)
    out_ptr,  # (R, V) float32 the one-hot rows (output)
    V,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    cols = c * BLOCK + tl.arange(0, BLOCK)
    hot = tl.load(ids_ptr + r)
    tl.store(out_ptr + r * V + cols, tl.where(cols == hot, 1.0, 0.0), mask=cols < V)
    if c == 0:
        tl.store(ones_ptr + r, 1.0)


def onehot_rows(ids: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(ones (R, 1), one-hot (R, vocab))` float32 of `ids` `(R, 1)` in one launch: a greedy chain's
    proposal probability and distribution (`draft._propose`: a zeros, a scatter and a ones)."""
    require(ids.dim() == 2 and ids.shape[1] == 1, f"ids must be (rows, 1), got {tuple(ids.shape)}")
    check_tensor("ids", ids, INDEX_DTYPES, tuple(ids.shape), ids.device)
    rows = ids.shape[0]
    ones = torch.empty((rows, 1), dtype=torch.float32, device=ids.device)
    full = torch.empty((rows, vocab), dtype=torch.float32, device=ids.device)
    if rows and vocab:
        block = min(4096, next_pow2(vocab))
        _onehot_kernel[(rows, -(-vocab // block))](ids.contiguous(), ones, full, vocab, BLOCK=block, num_warps=4)
    return ones, full
