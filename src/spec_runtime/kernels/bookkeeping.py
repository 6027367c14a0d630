"""Slot-table bookkeeping after verify, on the GPU without host syncs.

- `commit_accepted`: point positions `seq_len .. seq_len + a - 1` of each request at the slots of
  its accepted nodes (a slot-table write, no K/V copy) and mark every other tree slot to free.
- `extend_after_decode`: the draft-extend rows of the accepted tokens (sglang's
  `create_extend_after_decode_spec_info`): request-major tokens, positions `seq_len_old + j`, and
  the bonus token (the last accepted one) of each request.
"""

import torch
import triton
import triton.language as tl

from spec_runtime.kernels._common import INDEX_DTYPES, check_tensor, next_pow2, require

__all__ = [
    "commit_accepted",
    "extend_after_decode",
    "reference_commit_accepted",
    "reference_extend_after_decode",
]


def reference_commit_accepted(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    slots: torch.Tensor,
    accept_index: torch.Tensor,
) -> torch.Tensor:
    """Torch reference of `commit_accepted` (the verify phase's `_commit_kv`, without the free)."""
    kept = accept_index >= 0
    req = req_pool_indices.long()[:, None].expand_as(accept_index)[kept]
    cols = torch.arange(accept_index.shape[1], device=slots.device)
    pos = (seq_lens.long()[:, None] + cols)[kept]
    req_to_token[req, pos] = slots[accept_index[kept]].to(req_to_token.dtype)
    free = torch.ones(slots.shape[0], dtype=torch.bool, device=slots.device)
    free[accept_index[kept]] = False
    return free


@triton.jit
def _commit_kernel(
    rt_ptr,  # (max_reqs, max_context) int slot table (output)
    req_pool_ptr,  # (bs,) int request rows
    seq_lens_ptr,  # (bs,) int committed lengths before this verify
    slots_ptr,  # (bs*N,) int slot of every tree node, by global row
    accept_ptr,  # (bs, S1) int accepted global rows, -1 padded
    free_ptr,  # (bs*N,) uint8 view of the bool free mask, ones on entry (output)
    S1, s_rt,
    SP: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, SP)
    idx = tl.load(accept_ptr + b * S1 + j, mask=j < S1, other=-1).to(tl.int64)
    kept = idx >= 0
    slot = tl.load(slots_ptr + idx, mask=kept, other=0)
    req = tl.load(req_pool_ptr + b).to(tl.int64)
    pos = tl.load(seq_lens_ptr + b).to(tl.int64) + j
    tl.store(rt_ptr + req * s_rt + pos, slot.to(rt_ptr.dtype.element_ty), mask=kept)
    tl.store(free_ptr + idx, tl.zeros([SP], tl.uint8), mask=kept)


def commit_accepted(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    slots: torch.Tensor,
    accept_index: torch.Tensor,
) -> torch.Tensor:
    """Commit the accepted nodes' slots to the slot table; return the slots to free as a mask.

    Args:
        req_to_token: `(max_reqs, max_context)` int slot table, written in place.
        req_pool_indices: `(bs,)` int request rows.
        seq_lens: `(bs,)` int committed lengths before this verify (the root's position).
        slots: `(bs*num_draft,)` int slot of every tree node, by global row.
        accept_index: `(bs, num_steps+1)` int accepted global rows (root first), -1 padded.

    Returns:
        `(bs*num_draft,)` bool, True for slots of nodes that were not accepted (free them with
        `cache.free_slots(slots[mask])`, which syncs; the mask itself needs none).
    """
    dev = slots.device
    require(accept_index.dim() == 2, f"accept_index must be (bs, num_steps+1), got shape {tuple(accept_index.shape)}")
    bs, s1 = accept_index.shape
    require(slots.dim() == 1, f"slots must be (bs*num_draft,), got shape {tuple(slots.shape)}")
    check_tensor("accept_index", accept_index, INDEX_DTYPES, (bs, s1), dev)
    check_tensor("slots", slots, INDEX_DTYPES, (slots.shape[0],), dev)
    check_tensor("req_pool_indices", req_pool_indices, INDEX_DTYPES, (bs,), dev)
    check_tensor("seq_lens", seq_lens, INDEX_DTYPES, (bs,), dev)
    check_tensor("req_to_token", req_to_token, INDEX_DTYPES, (None, None), dev)
    require(req_to_token.stride(1) == 1, "req_to_token must be contiguous in its last dim")
    require(bs == 0 or slots.shape[0] % bs == 0, f"slots has {slots.shape[0]} rows, not a multiple of bs={bs}")
    free = torch.ones(slots.shape[0], dtype=torch.bool, device=dev)
    if bs == 0 or s1 == 0:
        return free
    _commit_kernel[(bs,)](
        req_to_token, req_pool_indices.contiguous(), seq_lens.contiguous(), slots.contiguous(),
        accept_index.contiguous(), free.view(torch.uint8), s1, req_to_token.stride(0),
        SP=next_pow2(s1), num_warps=1,
    )
    return free


def reference_extend_after_decode(
    accept_tokens: torch.Tensor, num_accept: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference of `extend_after_decode` (the verify phase's `_extend_input` rows)."""
    cols = torch.arange(accept_tokens.shape[1], device=accept_tokens.device)
    kept = cols[None, :] < num_accept.long()[:, None]
    input_ids = accept_tokens.long()[kept]
    require(input_ids.shape[0] == num_tokens, f"sum(num_accept) = {input_ids.shape[0]}, num_tokens = {num_tokens}")
    positions = (seq_lens.long()[:, None] + cols)[kept]
    last = (num_accept.long() - 1).clamp(min=0)[:, None]
    bonus = torch.where(num_accept > 0, accept_tokens.long().gather(1, last).squeeze(1), -1)
    return input_ids, positions, bonus


@triton.jit
def _extend_after_decode_kernel(
    tokens_ptr,  # (bs, S1) int accepted tokens, -1 padded
    num_accept_ptr,  # (bs,) int accepted tokens per request (bonus included)
    seq_lens_ptr,  # (bs,) int committed lengths before the accepted tokens
    input_ids_ptr,  # (T,) int64 request-major accepted tokens (output)
    positions_ptr,  # (T,) int64 their positions (output)
    bonus_ptr,  # (bs,) int64 last accepted token, -1 when none (output)
    S1, T,
    SP: tl.constexpr, BLOCK_B: tl.constexpr,
):
    b = tl.program_id(0)
    offset = tl.zeros([], tl.int64)  # rows of the requests before b
    for c0 in range(0, b, BLOCK_B):
        c = c0 + tl.arange(0, BLOCK_B)
        offset += tl.sum(tl.load(num_accept_ptr + c, mask=c < b, other=0).to(tl.int64), 0)
    n = tl.load(num_accept_ptr + b).to(tl.int64)
    j = tl.arange(0, SP)
    row = b.to(tl.int64) * S1
    ok = (j < n) & (j < S1) & (offset + j < T)
    tok = tl.load(tokens_ptr + row + j, mask=ok, other=0).to(tl.int64)
    tl.store(input_ids_ptr + offset + j, tok, mask=ok)
    tl.store(positions_ptr + offset + j, tl.load(seq_lens_ptr + b).to(tl.int64) + j, mask=ok)
    last = tl.load(tokens_ptr + row + n - 1, mask=(n > 0) & (n <= S1), other=-1).to(tl.int64)
    tl.store(bonus_ptr + b, last)


def extend_after_decode(
    accept_tokens: torch.Tensor, num_accept: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draft-extend rows after verify, without a host sync.

    Args:
        accept_tokens: `(bs, num_steps+1)` int emitted tokens per request, -1 padded.
        num_accept: `(bs,)` int accepted tokens per request (bonus included), >= 1.
        seq_lens: `(bs,)` int committed lengths *before* these tokens (`seq_len_old`).
        num_tokens: `T = sum(num_accept)`, known to the caller (no sync here).

    Returns:
        `(input_ids (T,), positions (T,), bonus (bs,))` int64: the accepted tokens request-major,
        positions `seq_len_old + j`, and each request's last accepted token (-1 if it has none).
    """
    dev = accept_tokens.device
    require(accept_tokens.dim() == 2, f"accept_tokens must be (bs, num_steps+1), got shape {tuple(accept_tokens.shape)}")
    bs, s1 = accept_tokens.shape
    check_tensor("accept_tokens", accept_tokens, INDEX_DTYPES, (bs, s1), dev)
    check_tensor("num_accept", num_accept, INDEX_DTYPES, (bs,), dev)
    check_tensor("seq_lens", seq_lens, INDEX_DTYPES, (bs,), dev)
    require(num_tokens >= 0, f"num_tokens must be >= 0, got {num_tokens}")
    input_ids = torch.empty(num_tokens, dtype=torch.int64, device=dev)
    positions = torch.empty(num_tokens, dtype=torch.int64, device=dev)
    bonus = torch.empty(bs, dtype=torch.int64, device=dev)
    if bs == 0:
        return input_ids, positions, bonus
    _extend_after_decode_kernel[(bs,)](
        accept_tokens.contiguous(), num_accept.contiguous(), seq_lens.contiguous(), input_ids, positions, bonus,
        s1, num_tokens, SP=next_pow2(s1), BLOCK_B=min(1024, next_pow2(bs)), num_warps=1,
    )
    return input_ids, positions, bonus
