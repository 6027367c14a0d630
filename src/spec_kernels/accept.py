"""Tree acceptance on the GPU: greedy and lossless sampling, one program per request.

Same signatures and outputs as `tree.verify_greedy` and `tree.verify_tree_sampling` (the
references). The walk is sequential per request: at the current node the children are visited in
chain order (`retrieve_next_token`, then `retrieve_next_sibling`, at most `num_draft - 1` hops, as
the reference's `_tree_links`).

Exactness of the sampling kernel against the reference (on CPU, where the reference's
`torch.cumsum` of float32 accumulates in float64 and rounds each partial sum to float32):

- `prob_acc` of the children is accumulated in float64 in try order and rounded to float32 before
  `u <= prob_acc`, as the reference does.
- A token repeated among siblings adds no mass and is never accepted; it is zeroed once in the
  residual.
- Empty residual (every positive token of `q[cur]` is a child): `u` is capped at the children's
  mass; the kernel counts the positive tokens only when that cap can matter (`u` above the mass).
- The bonus token is drawn by inverse CDF over the vocabulary in blocks: float64 sums rounded to
  float32 (the reference's cdf), `target = u * cdf[-1]` in float32, the first index with
  `cdf > target`, capped at the last positive index. One pipelined pass keeps each block's total;
  the block holding the draw is found from the block ends and only it is scanned.

The only possible difference is a float64 summation-order effect (block scan against a sequential
sum) that flips a float32 rounding exactly at a coin: about 1e-9 per draw.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from spec_kernels._common import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_tensor,
    interpreting,
    next_pow2,
    require,
)
from spec_kernels.inputs import check_greedy_target, check_sampling_targets, check_verify_shapes

__all__ = ["triton_simulated_accept", "triton_verify_greedy",
           "triton_verify_greedy_rows", "triton_verify_tree_sampling"]


def _check_tree(candidates, retrieve_index, next_token, next_sibling, num_steps):
    """The reference's shape checks (same messages) plus dtype and device."""
    check_verify_shapes(candidates, retrieve_index, next_token, next_sibling, num_steps)
    shape = tuple(candidates.shape)
    for name, t in (("candidates", candidates), ("retrieve_index", retrieve_index),
                    ("retrieve_next_token", next_token), ("retrieve_next_sibling", next_sibling)):
        check_tensor(name, t, INDEX_DTYPES, shape, candidates.device)


def _outputs(bs: int, n: int, num_steps: int, device: torch.device):
    predicts = torch.zeros(bs * n, dtype=torch.int64, device=device)
    accept_index = torch.full((bs, num_steps + 1), -1, dtype=torch.int64, device=device)
    num_correct = torch.zeros(bs, dtype=torch.int32, device=device)
    return predicts, accept_index, num_correct


@triton.jit
def _verify_greedy_kernel(
    cand_ptr,  # (bs, N) int tree tokens
    ri_ptr,  # (bs, N) int global row of each node
    nt_ptr,  # (bs, N) int first child, -1 = none
    ns_ptr,  # (bs, N) int next sibling, -1 = none
    tp_ptr,  # (bs, N) int target argmax at each node
    predicts_ptr,  # (bs*N,) int64 next emitted token by global row (output, PREDICTS)
    accept_ptr,  # (bs, num_steps+1) int64 accepted rows, -1 past them (output)
    num_correct_ptr,  # (bs,) int32 accepted drafts (output)
    tokens_ptr,  # (bs, num_steps+1) int64 emitted tokens, -1 past them (output, TOKENS)
    stacked_ptr,  # (bs, num_steps+2) int64 the tokens then the count (output, STACKED)
    N, num_steps,
    WP: tl.constexpr, PREDICTS: tl.constexpr, TOKENS: tl.constexpr, STACKED: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    row = b * N
    W = num_steps + 1
    cur = tl.zeros([], tl.int64)
    tl.store(accept_ptr + b * W, tl.load(ri_ptr + row).to(tl.int64))
    level = tl.zeros([], tl.int32)
    active = tl.full([], 1, tl.int32)
    while (level < num_steps) & (active != 0):
        want = tl.load(tp_ptr + row + cur)
        child = tl.load(nt_ptr + row + cur).to(tl.int64)
        chosen = tl.full([], -1, tl.int64)
        for _ in range(N - 1):  # the chain: first match in try order
            ok = child >= 0
            hit = ok & (chosen < 0) & (tl.load(cand_ptr + row + child, mask=ok, other=0) == want)
            chosen = tl.where(hit, child, chosen)
            child = tl.load(ns_ptr + row + child, mask=ok & (chosen < 0), other=-1).to(tl.int64)
        found = chosen >= 0
        token = tl.load(cand_ptr + row + chosen, mask=found).to(tl.int64)
        if PREDICTS:
            tl.store(predicts_ptr + tl.load(ri_ptr + row + cur), token, mask=found)
        if TOKENS:  # the token emitted at this level: the matched child's (= the target's argmax)
            tl.store(tokens_ptr + b * W + level, token, mask=found)
        if STACKED:
            tl.store(stacked_ptr + b * (W + 1) + level, token, mask=found)
        tl.store(accept_ptr + b * W + 1 + level, tl.load(ri_ptr + row + chosen, mask=found).to(tl.int64), mask=found)
        cur = tl.where(found, chosen, cur)
        active = found.to(tl.int32)
        level += active
    bonus = tl.load(tp_ptr + row + cur).to(tl.int64)
    if PREDICTS:
        tl.store(predicts_ptr + tl.load(ri_ptr + row + cur), bonus)
    tl.store(num_correct_ptr + b, level)
    # what no level wrote: -1 (addresses disjoint from the walk's stores, so no ordering is needed)
    j = tl.arange(0, WP)
    tl.store(accept_ptr + b * W + j, tl.full([WP], -1, tl.int64), mask=(j > level) & (j < W))
    if TOKENS:
        tl.store(tokens_ptr + b * W + level, bonus)
        tl.store(tokens_ptr + b * W + j, tl.full([WP], -1, tl.int64), mask=(j > level) & (j < W))
    if STACKED:
        tl.store(stacked_ptr + b * (W + 1) + level, bonus)
        tl.store(stacked_ptr + b * (W + 1) + j, tl.where(j == W, level.to(tl.int64), -1),
                 mask=(j > level) & (j <= W))


def triton_verify_greedy(
    candidates: torch.Tensor,
    retrieve_index: torch.Tensor,
    retrieve_next_token: torch.Tensor,
    retrieve_next_sibling: torch.Tensor,
    target_predict: torch.Tensor,
    num_steps: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`tree.verify_greedy` on the GPU: same arguments, same
    `(predicts (bs*num_draft,), accept_index (bs, num_steps+1), num_correct_drafts (bs,) int32)`."""
    bs, n, c = _greedy_inputs(candidates, retrieve_index, retrieve_next_token, retrieve_next_sibling,
                              target_predict, num_steps)
    dev = candidates.device
    predicts = torch.zeros(bs * n, dtype=torch.int64, device=dev)  # (rows off the path: 0, as the reference)
    accept_index = torch.empty((bs, num_steps + 1), dtype=torch.int64, device=dev)
    num_correct = torch.empty(bs, dtype=torch.int32, device=dev)
    if bs:
        _verify_greedy_kernel[(bs,)](*c, predicts, accept_index, num_correct, accept_index, accept_index, n, num_steps,
                                     WP=next_pow2(num_steps + 2), PREDICTS=True, TOKENS=False, STACKED=False,
                                     num_warps=1)
    return predicts, accept_index, num_correct


def triton_verify_greedy_rows(
    candidates: torch.Tensor,
    retrieve_index: torch.Tensor,
    retrieve_next_token: torch.Tensor,
    retrieve_next_sibling: torch.Tensor,
    target_predict: torch.Tensor,
    num_steps: int,
    stacked: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The verify core's greedy acceptance in one launch and no fill: `(accept_index (bs, num_steps+1),
    accept_tokens (bs, num_steps+1) int64, num_correct_drafts (bs,) int32)`, the tokens being the target's
    prediction at the root and at each accepted node, -1 padded (`tree.verify_greedy`, then the
    verify core's gather of its predictions at `accept_index`); `stacked` `(bs, num_steps+2)` int64,
    when given, gets each request's tokens then its count (`verify.stacked_rows`: what verify's
    device-to-host copy reads). Reference: `spec_runtime.verify.greedy_rows` (the torch path)."""
    bs, n, c = _greedy_inputs(candidates, retrieve_index, retrieve_next_token, retrieve_next_sibling,
                              target_predict, num_steps)
    dev, w = candidates.device, num_steps + 1
    if stacked is not None:
        check_tensor("stacked", stacked, (torch.int64,), (bs, w + 1), dev)
        require(stacked.is_contiguous(), "stacked must be contiguous")
    accept_index = torch.empty((bs, w), dtype=torch.int64, device=dev)
    tokens = torch.empty((bs, w), dtype=torch.int64, device=dev)
    num_correct = torch.empty(bs, dtype=torch.int32, device=dev)
    if bs:
        _verify_greedy_kernel[(bs,)](*c, accept_index, accept_index, num_correct, tokens,
                                     tokens if stacked is None else stacked, n, num_steps, WP=next_pow2(w + 1),
                                     PREDICTS=False, TOKENS=True, STACKED=stacked is not None, num_warps=1)
    return accept_index, tokens, num_correct


def _greedy_inputs(candidates, retrieve_index, retrieve_next_token, retrieve_next_sibling, target_predict,
                   num_steps):
    """The checks of the greedy launchers; `(bs, num_draft, contiguous inputs)`."""
    _check_tree(candidates, retrieve_index, retrieve_next_token, retrieve_next_sibling, num_steps)
    check_greedy_target(candidates, target_predict)
    bs, n = candidates.shape
    check_tensor("target_predict", target_predict, INDEX_DTYPES, (bs, n), candidates.device)
    c = [x.contiguous() for x in (candidates, retrieve_index, retrieve_next_token, retrieve_next_sibling,
                                  target_predict)]
    return bs, n, c


@triton.jit
def _simulated_kernel(
    a_ptr,  # (bs,) int accepted count a_b (bonus included), 1 <= a_b <= W
    ri_ptr,  # (bs, N) int retrieve_index
    dt_ptr,  # (bs, N) int draft tokens
    pred_ptr,  # (bs, N) int the target's argmax per node
    index_ptr,  # (bs, W) int64 accept_index (output)
    tokens_ptr,  # (bs, W) int64 accept_tokens (output)
    nc_ptr,  # (bs,) int32 num_correct (output)
    N, W, s_ri, s_dt, s_pr,
    WP: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, WP)
    jm = j < W
    a = tl.load(a_ptr + b).to(tl.int64)
    root = tl.load(ri_ptr + b * s_ri).to(tl.int64)
    tl.store(index_ptr + b * W + j, tl.where(j < a, root + j, -1), mask=jm)
    nxt = tl.load(dt_ptr + b * s_dt + tl.minimum(j + 1, N - 1), mask=jm, other=0).to(tl.int64)
    bonus = tl.load(pred_ptr + b * s_pr + a - 1, mask=(a >= 1) & (a <= N), other=-1).to(tl.int64)
    tokens = tl.where(j < a - 1, nxt, tl.where(j == a - 1, bonus, -1))
    tl.store(tokens_ptr + b * W + j, tokens, mask=jm)
    tl.store(nc_ptr + b, (a - 1).to(tl.int32))


def triton_simulated_accept(sim_accept: torch.Tensor, retrieve_index: torch.Tensor, draft_token: torch.Tensor,
                            predict: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`spec_runtime.tree.simulated_accept` in one launch (the torch version captures about fifteen small
    kernels into every simulated verify graph): same arguments, same outputs and dtypes."""
    bs, n = draft_token.shape
    dev = draft_token.device
    check_tensor("sim_accept", sim_accept, INDEX_DTYPES, (bs,), dev)
    for name, t in (("retrieve_index", retrieve_index), ("draft_token", draft_token), ("predict", predict)):
        check_tensor(name, t, INDEX_DTYPES, (bs, n), dev)
        require(t.stride(1) == 1, f"{name} must have a unit last stride")
    require(width >= 1, f"width must be >= 1, got {width}")
    index = torch.empty((bs, width), dtype=torch.int64, device=dev)
    tokens = torch.empty((bs, width), dtype=torch.int64, device=dev)
    num_correct = torch.empty(bs, dtype=torch.int32, device=dev)
    if bs:
        _simulated_kernel[(bs,)](sim_accept, retrieve_index, draft_token, predict, index, tokens, num_correct,
                                 n, width, retrieve_index.stride(0), draft_token.stride(0), predict.stride(0),
                                 WP=next_pow2(width), num_warps=1)
    return index, tokens, num_correct


@triton.jit
def _masked_weights(q_row, v0, V, zero_tok, BLOCK_V: tl.constexpr):
    """Block `v0` of `q[cur]` as float32 with the tokens `zero_tok` (-1 = none) set to 0."""
    cols = v0 + tl.arange(0, BLOCK_V)
    w = tl.load(q_row + cols, mask=cols < V, other=0.0).to(tl.float32)
    hit = tl.max((cols[:, None] == zero_tok[None, :]).to(tl.int32), 1) > 0
    return cols, tl.where(hit, 0.0, w)


@triton.jit
def _sample_residual(q_row, V, zero_tok, u_final, BLOCK_V: tl.constexpr, NBP: tl.constexpr):
    """Inverse-CDF draw from `q[cur]` without `zero_tok`, as `sample_from_probs` does.

    Pass 1 (pipelined over the vocabulary) keeps each block's float64 total in registers; the
    block holding the draw is then the first whose cdf end exceeds it, and only that block is
    scanned."""
    blk = tl.arange(0, NBP)
    totals = tl.zeros([NBP], tl.float64)
    last_pos = tl.full([], -1, tl.int64)
    for v0 in range(0, V, BLOCK_V):
        cols, w = _masked_weights(q_row, v0, V, zero_tok, BLOCK_V)
        totals = tl.where(blk == v0 // BLOCK_V, tl.sum(w.to(tl.float64), 0), totals)
        last_pos = tl.maximum(last_pos, tl.max(tl.where(w > 0, cols, -1), 0).to(tl.int64))
    ends = tl.cumsum(totals, 0)  # cdf at each block's end, float64
    target = tl.minimum(tl.maximum(u_final, 0.0), 1.0) * tl.sum(totals, 0).to(tl.float32)
    k = tl.sum(((ends.to(tl.float32) <= target) & (blk * BLOCK_V < V)).to(tl.int32), 0)
    idx = tl.zeros([], tl.int64) + V
    if k * BLOCK_V < V:
        run = tl.sum(tl.where(blk < k, totals, 0.0), 0)
        cols, w = _masked_weights(q_row, k * BLOCK_V, V, zero_tok, BLOCK_V)
        cdf = (run + tl.cumsum(w.to(tl.float64), 0)).to(tl.float32)
        idx = k.to(tl.int64) * BLOCK_V + tl.sum(((cols < V) & (cdf <= target)).to(tl.int64), 0)
    return tl.minimum(idx, tl.maximum(last_pos, 0))


@triton.jit
def _count_positive(q_row, V, BLOCK_V: tl.constexpr):
    n = tl.zeros([], tl.int64)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        n += tl.sum((tl.load(q_row + cols, mask=cols < V, other=0.0) > 0).to(tl.int64), 0)
    return n


@triton.jit
def _verify_sampling_kernel(
    cand_ptr,  # (bs, N) int tree tokens
    ri_ptr,  # (bs, N) int global row of each node
    nt_ptr,  # (bs, N) int first child, -1 = none
    ns_ptr,  # (bs, N) int next sibling, -1 = none
    probs_ptr,  # (bs, N, V) float target distribution at each node, last dim contiguous
    uniform_ptr,  # (bs, N) float coin of each node
    uniform_final_ptr,  # (bs,) float draw of the bonus token
    predicts_ptr,  # (bs*N,) int64 next emitted token by global row (output)
    accept_ptr,  # (bs, num_steps+1) int64 accepted rows, -1 filled by the caller (output)
    num_correct_ptr,  # (bs,) int32 accepted drafts (output)
    N, V, num_steps, s_pb, s_pn,
    NP: tl.constexpr, BLOCK_V: tl.constexpr, NBP: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    row = b * N
    r_idx = tl.arange(0, NP)
    cur = tl.zeros([], tl.int64)
    tl.store(accept_ptr + b * (num_steps + 1), tl.load(ri_ptr + row).to(tl.int64))
    level = tl.zeros([], tl.int32)
    active = tl.full([], 1, tl.int32)
    toks = tl.full([NP], -1, tl.int64)  # tokens of the children of cur, in try order
    while (level < num_steps) & (active != 0):
        q_row = probs_ptr + b * s_pb + cur * s_pn
        u = tl.load(uniform_ptr + row + cur).to(tl.float32)
        child = tl.load(nt_ptr + row + cur).to(tl.int64)
        toks = tl.full([NP], -1, tl.int64)
        acc = tl.zeros([], tl.float64)  # prob_acc, float64 like the CPU reference's cumsum
        best = tl.full([], -1.0, tl.float32)
        chosen = tl.full([], -1, tl.int64)
        cap_child = tl.full([], -1, tl.int64)  # first positive child whose prob_acc is the total
        n_pos = tl.zeros([], tl.int64)
        for r in range(N - 1):
            ok = child >= 0
            tok = tl.load(cand_ptr + row + child, mask=ok, other=-1).to(tl.int64)
            dup = tl.max((toks == tok).to(tl.int32), 0) > 0
            toks = tl.where((r_idx == r) & ok, tok, toks)
            tok_c = tl.minimum(tl.maximum(tok, 0), V - 1)
            m = tl.load(q_row + tok_c, mask=ok & ~dup, other=0.0).to(tl.float32)
            acc += m.to(tl.float64)
            pa = acc.to(tl.float32)
            pos = ok & (m > 0)
            chosen = tl.where(pos & (chosen < 0) & (u <= pa), child, chosen)
            cap_child = tl.where(pos & (pa > best), child, cap_child)
            best = tl.where(pos & (pa > best), pa, best)
            n_pos += pos.to(tl.int64)
            child = tl.load(ns_ptr + row + child, mask=ok, other=-1).to(tl.int64)
        if (chosen < 0) & (n_pos > 0) & (u > acc.to(tl.float32)):
            # Empty residual: u is capped at the children's mass, so the first child reaching it wins.
            if _count_positive(q_row, V, BLOCK_V) <= n_pos:
                chosen = cap_child
        found = chosen >= 0
        tl.store(predicts_ptr + tl.load(ri_ptr + row + cur),
                 tl.load(cand_ptr + row + chosen, mask=found).to(tl.int64), mask=found)
        tl.store(accept_ptr + b * (num_steps + 1) + 1 + level,
                 tl.load(ri_ptr + row + chosen, mask=found).to(tl.int64), mask=found)
        cur = tl.where(found, chosen, cur)
        active = found.to(tl.int32)
        level += active
    # Rejected at cur: the residual is q[cur] without its children; at the depth cap, q[cur] itself.
    zero_tok = tl.where(active != 0, -1, toks)
    q_row = probs_ptr + b * s_pb + cur * s_pn
    bonus = _sample_residual(q_row, V, zero_tok, tl.load(uniform_final_ptr + b).to(tl.float32), BLOCK_V, NBP)
    tl.store(predicts_ptr + tl.load(ri_ptr + row + cur), bonus)
    tl.store(num_correct_ptr + b, level)


def triton_verify_tree_sampling(
    candidates: torch.Tensor,
    retrieve_index: torch.Tensor,
    retrieve_next_token: torch.Tensor,
    retrieve_next_sibling: torch.Tensor,
    target_probs: torch.Tensor,
    uniform: torch.Tensor,
    uniform_final: torch.Tensor,
    num_steps: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`tree.verify_tree_sampling` on the GPU: same arguments, same
    `(predicts (bs*num_draft,), accept_index (bs, num_steps+1), num_correct_drafts (bs,) int32)`."""
    _check_tree(candidates, retrieve_index, retrieve_next_token, retrieve_next_sibling, num_steps)
    bs, n = candidates.shape
    dev = candidates.device
    check_sampling_targets(candidates, target_probs, uniform, uniform_final)
    vocab = target_probs.shape[2]
    check_tensor("target_probs", target_probs, FLOAT_DTYPES, (bs, n, vocab), dev)
    check_tensor("uniform", uniform, FLOAT_DTYPES + (torch.float64,), (bs, n), dev)
    check_tensor("uniform_final", uniform_final, FLOAT_DTYPES + (torch.float64,), (bs,), dev)
    require(vocab >= 1, "target_probs needs a vocabulary of at least one token")
    predicts, accept_index, num_correct = _outputs(bs, n, num_steps, dev)
    if bs == 0:
        return predicts, accept_index, num_correct
    probs = target_probs if target_probs.stride(2) == 1 else target_probs.contiguous()
    c = [x.contiguous() for x in (candidates, retrieve_index, retrieve_next_token, retrieve_next_sibling)]
    np_ = max(2, next_pow2(n))
    # A vocabulary block is compared against every child token: keep (BLOCK_V, NP) near 16K elements.
    block_v = min(next_pow2(vocab), 256 if interpreting() else max(256, min(2048, 16384 // np_)))
    _verify_sampling_kernel[(bs,)](
        *c, probs, uniform.contiguous(), uniform_final.contiguous(), predicts, accept_index, num_correct,
        n, vocab, num_steps, probs.stride(0), probs.stride(1),
        NP=np_, BLOCK_V=block_v, NBP=max(2, next_pow2(triton.cdiv(vocab, block_v))),
        num_warps=4 if interpreting() else 8,
    )
    return predicts, accept_index, num_correct
