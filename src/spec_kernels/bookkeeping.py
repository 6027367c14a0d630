"""Slot-table bookkeeping after verify, on the GPU without host syncs.

- `commit_accepted`: point positions `seq_len .. seq_len + a - 1` of each request at the slots of
  its accepted nodes (a slot-table write, no K/V copy) and mark every other tree slot to free.
- `extend_after_decode`: the draft-extend rows of the accepted tokens (sglang's
  `create_extend_after_decode_spec_info`): request-major tokens, positions `seq_len_old + j`, and
  the bonus token (the last accepted one) of each request.
- `ahead_extend_in` / `ahead_extend_out`: the launch-ahead draft-extend graph's bookkeeping before
  and after its forward (`executors.ahead.LaunchAhead._ahead_extend_fn`), one launch each where the torch
  path (`executors.ahead_torch.ahead_extend_in_torch` / `_out_torch`, the references) captures about forty small
  kernels.
- `decode_advance`: the end of a plain decode step (`executors.decode.DecodeRunner`): the step's tokens into
  the next inputs and the history, the step's slots into the slot table, lengths and positions one
  on, the next step's slots from the plan, in one launch inside the step's graph.
"""

from typing import Optional

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from spec_kernels._common import INDEX_DTYPES, check_tensor, next_pow2, pdl_options, require

__all__ = [
    "ahead_extend_in",
    "ahead_extend_out",
    "commit_accepted",
    "decode_advance",
    "extend_after_decode",
    "reference_commit_accepted",
    "reference_decode_advance",
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


@triton.jit(do_not_specialize=["T"])  # the accepted tokens' count changes every iteration
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


# ------------------------------------------------------------------------------------------------
# The launch-ahead draft-extend graph's bookkeeping (`executors.ahead.LaunchAhead._ahead_extend_fn`)
# ------------------------------------------------------------------------------------------------


@triton.jit
def _request_state(b, num_correct_ptr, nlive_ptr, W, WP: tl.constexpr, HAS_NLIVE: tl.constexpr):
    """Request b's accepted count (bonus included), whether it is live, and which of its `W` rows
    keep an accepted token."""
    j = tl.arange(0, WP)
    cnt = tl.load(num_correct_ptr + b).to(tl.int64) + 1
    if HAS_NLIVE:
        alive = b < tl.load(nlive_ptr)
    else:
        alive = b >= 0
    keep = (j < cnt) & alive & (j < W)
    return j, cnt, alive, keep


@triton.jit
def _ahead_in_kernel(
    num_correct_ptr, nlive_ptr, acc_idx_ptr, acc_tok_ptr, seq_ptr, req_ptr, tree_slots_ptr, ext_src_ptr, cap_ptr,
    rt_ptr, ids_ptr, pos_ptr, out_slots_ptr, n_acc_ptr, e_seq_ptr, e_req_ptr, e_hid_ptr,
    pad_row, pad_t, pad_d, W, H, s_ai, s_at, s_ext, s_rt, s_cap, s_eh,
    WP: tl.constexpr, HAS_NLIVE: tl.constexpr, BLOCK_H: tl.constexpr, LEAD: tl.constexpr,
):
    b = tl.program_id(0)
    c = tl.program_id(1)
    j, cnt, alive, keep = _request_state(b, num_correct_ptr, nlive_ptr, W, WP, HAS_NLIVE)
    jm = j < W
    if c == 0:
        acc = tl.maximum(tl.load(acc_idx_ptr + b * s_ai + j, mask=jm, other=0).to(tl.int64), 0)
        seq = tl.load(seq_ptr + b).to(tl.int64)
        req = tl.load(req_ptr + b).to(tl.int64)
        rows = tl.where(keep, req, pad_row)
        at = tl.where(keep, seq + j, 0)
        node = tl.load(tree_slots_ptr + acc, mask=keep, other=pad_t)
        node = tl.where(keep, node, pad_t)
        tl.store(rt_ptr + rows * s_rt + at, node.to(rt_ptr.dtype.element_ty), mask=jm)
        tok = tl.load(acc_tok_ptr + b * s_at + j, mask=jm, other=0)
        row0 = b.to(tl.int64) * W
        tl.store(ids_ptr + row0 + j, tl.where(keep, tok, 0).to(ids_ptr.dtype.element_ty), mask=jm)
        tl.store(pos_ptr + row0 + j, tl.where(keep, at + LEAD, 0).to(pos_ptr.dtype.element_ty), mask=jm)
        ext = tl.where(keep, tl.load(ext_src_ptr + b * s_ext + j, mask=jm, other=0), pad_d)
        tl.store(out_slots_ptr + row0 + j, ext.to(out_slots_ptr.dtype.element_ty), mask=jm)
        tl.store(n_acc_ptr + b, tl.where(alive, cnt, 1).to(n_acc_ptr.dtype.element_ty))
        tl.store(e_seq_ptr + b, tl.where(alive, seq + cnt, 1).to(e_seq_ptr.dtype.element_ty))
        tl.store(e_req_ptr + b, tl.where(alive, req, pad_row).to(e_req_ptr.dtype.element_ty))
    else:  # one BLOCK_H chunk of the captured hidden rows of every one of b's W rows
        h = (c - 1) * BLOCK_H + tl.arange(0, BLOCK_H)
        hm = h < H
        for jj in range(W):
            a = tl.maximum(tl.load(acc_idx_ptr + b * s_ai + jj).to(tl.int64), 0)
            v = tl.load(cap_ptr + a * s_cap + h, mask=hm, other=0.0)
            tl.store(e_hid_ptr + (b.to(tl.int64) * W + jj) * s_eh + h, v, mask=hm)


@triton.jit
def _ahead_out_kernel(
    num_correct_ptr, nlive_ptr, acc_tok_ptr, seq_ptr, req_ptr, ext_src_ptr, topk_p_ptr, topk_i_ptr, scratch_ptr,
    hid_ptr, rt_ptr, d_topk_p_ptr, d_topk_i_ptr, d_bonus_ptr, d_seq_ptr, d_req_ptr, d_temp_ptr, d_hid_ptr,
    pad_row, pad_d, W, K, KS, H, s_at, s_ext, s_rt, s_tp, s_ti, s_dp, s_di, s_sc, s_dt, s_h, s_dh,
    WP: tl.constexpr, KP: tl.constexpr, KSP: tl.constexpr, HAS_NLIVE: tl.constexpr, BLOCK_H: tl.constexpr,
    LEAD: tl.constexpr,
):
    b = tl.program_id(0)
    c = tl.program_id(1)
    j, cnt, alive, keep = _request_state(b, num_correct_ptr, nlive_ptr, W, WP, HAS_NLIVE)
    jm = j < W
    if c == 0:
        seq = tl.load(seq_ptr + b).to(tl.int64)
        req = tl.load(req_ptr + b).to(tl.int64)
        rows = tl.where(keep, req, pad_row)
        at = tl.where(keep, seq + j + LEAD, 0)  # the draft's own positions (its KV lead)
        ext = tl.where(keep, tl.load(ext_src_ptr + b * s_ext + j, mask=jm, other=0), pad_d)
        tl.store(rt_ptr + rows * s_rt + at, ext.to(rt_ptr.dtype.element_ty), mask=jm)
        bonus = tl.load(acc_tok_ptr + b * s_at + cnt - 1, mask=alive & (cnt >= 1) & (cnt <= W), other=0)
        tl.store(d_bonus_ptr + b, tl.where(alive, bonus, 0).to(d_bonus_ptr.dtype.element_ty))
        tl.store(d_seq_ptr + b, tl.where(alive, seq + cnt, 0).to(d_seq_ptr.dtype.element_ty))
        tl.store(d_req_ptr + b, tl.where(alive, req, pad_row).to(d_req_ptr.dtype.element_ty))
        k = tl.arange(0, KP)
        km = k < K
        p = tl.load(topk_p_ptr + b * s_tp + k, mask=km & alive, other=0.0)
        tl.store(d_topk_p_ptr + b * s_dp + k, tl.where(alive, p, 0.0).to(d_topk_p_ptr.dtype.element_ty), mask=km)
        i = tl.load(topk_i_ptr + b * s_ti + k, mask=km & alive, other=0)
        tl.store(d_topk_i_ptr + b * s_di + k, tl.where(alive, i, 0).to(d_topk_i_ptr.dtype.element_ty), mask=km)
        t = tl.arange(0, KSP)
        tm = t < KS
        tmp = tl.load(scratch_ptr + b * s_sc + t, mask=tm & alive, other=0)
        tl.store(d_temp_ptr + b * s_dt + t, tl.where(alive, tmp, pad_d).to(d_temp_ptr.dtype.element_ty), mask=tm)
    else:  # one BLOCK_H chunk of b's draft hidden state
        h = (c - 1) * BLOCK_H + tl.arange(0, BLOCK_H)
        hm = h < H
        v = tl.load(hid_ptr + b * s_h + h, mask=hm & alive, other=0.0)
        tl.store(d_hid_ptr + b * s_dh + h, tl.where(alive, v, 0.0).to(d_hid_ptr.dtype.element_ty), mask=hm)


_HIDDEN_BLOCK = 1024


def _rowwise(t: torch.Tensor, name: str) -> None:
    require(t.dim() >= 1 and (t.dim() == 1 or t.stride(-1) == 1), f"{name} must have a unit last stride")


def ahead_extend_in(vo, vb, eb, ext_slots: torch.Tensor, nlive: Optional[torch.Tensor], target_rt: torch.Tensor,
                    pad_row: int, pad_t, pad_d, lead: int = 0) -> None:
    """The draft-extend graph's inputs from a verify's outputs, in one launch: for request b of the
    bucket (live: `b < nlive`, or every one when `nlive` is None) and column j < `eb.stride`, where
    j < num_correct[b] + 1 and b is live, point the target's slot `seq_len + j` at the accepted
    node's tree slot and fill the extend rows (token, position `seq_len + j + lead` with the draft's
    KV lead from the traits, draft slot from `ext_slots`);
    elsewhere write the padding (`pad_row`/`pad_t`/`pad_d`, token 0), and copy every row's
    captured hidden state (EAGLE) into `eb.hidden_states` (`executors.ahead_torch.ahead_extend_in_torch`, the
    reference, bit for bit). `pad_t`, `pad_d`: host ints."""
    bucket, width = vo.num_correct.shape[0], eb.stride
    for name, t in (("accept_index", vo.accept_index), ("accept_tokens", vo.accept_tokens), ("ext_slots", ext_slots),
                    ("req_to_token", target_rt)):
        _rowwise(t, name)
    require(vo.accept_index.shape[1] == width and vo.accept_tokens.shape[1] == width,
            f"accept rows must be {width} wide, got {vo.accept_index.shape[1]} and {vo.accept_tokens.shape[1]}")
    hidden = eb.hidden_states is not None
    h = eb.hidden_states.shape[1] if hidden else 0
    if hidden:
        require(vo.captured is not None and vo.captured.shape[1] == h and vo.captured.stride(1) == 1,
                f"captured rows must be {h} wide and contiguous along it")
    slots = vb.slots[:bucket].reshape(-1)
    cap = vo.captured if hidden else slots
    e_hid = eb.hidden_states if hidden else slots
    _ahead_in_kernel[(bucket, 1 + (triton.cdiv(h, _HIDDEN_BLOCK) if hidden else 0))](
        vo.num_correct, nlive if nlive is not None else vo.num_correct, vo.accept_index, vo.accept_tokens,
        vb.seq_lens, vb.req_pool_indices, slots, ext_slots, cap,
        target_rt, eb.input_ids, eb.positions, eb.out_slots, eb.num_accept_tokens, eb.seq_lens, eb.req_pool_indices,
        e_hid, int(pad_row), int(pad_t), int(pad_d), width, h, vo.accept_index.stride(0), vo.accept_tokens.stride(0),
        ext_slots.stride(0), target_rt.stride(0), cap.stride(0), e_hid.stride(0),
        WP=next_pow2(width), HAS_NLIVE=nlive is not None, BLOCK_H=_HIDDEN_BLOCK, LEAD=int(lead), num_warps=4,
    )


def ahead_extend_out(vo, vb, db, out, nlive: Optional[torch.Tensor], draft_rt: torch.Tensor, ext_slots: torch.Tensor,
                     scratch: torch.Tensor, pad_row: int, pad_d, width: int, lead: int = 0) -> None:
    """After the draft-extend forward, in one launch: point the draft's slots `seq_len + j + lead` of the
    kept rows at their draft slots (padding elsewhere), and fill the draft graph's inputs: top-k,
    bonus token (the last accepted), sequence length, request row, scratch slots and hidden state
    for the live requests, the padding (0, `pad_row`, `pad_d`) for the others
    (`executors.ahead_torch.ahead_extend_out_torch`, bit for bit)."""
    bucket = vo.num_correct.shape[0]
    for name, t in (("accept_tokens", vo.accept_tokens), ("topk_p", out.topk_p), ("topk_index", out.topk_index),
                    ("req_to_token", draft_rt), ("ext_slots", ext_slots)):
        _rowwise(t, name)
    k = out.topk_p.shape[1]
    ks = scratch.shape[1] * scratch.shape[2]
    require(scratch.stride(2) == 1 and scratch.stride(1) == scratch.shape[2], "scratch must be contiguous in its last two dims")
    require(db.temp_slots.stride(2) == 1 and db.temp_slots.stride(1) == db.temp_slots.shape[2],
            "draft temp_slots must be contiguous in its last two dims")
    hidden = db.hidden_states is not None
    h = db.hidden_states.shape[1] if hidden else 0
    if hidden:
        require(out.hidden_states is not None and out.hidden_states.stride(1) == 1 and db.hidden_states.stride(1) == 1,
                "hidden states must be contiguous along the hidden axis")
    src_h = out.hidden_states if hidden else out.topk_p
    dst_h = db.hidden_states if hidden else db.topk_p
    _ahead_out_kernel[(bucket, 1 + (triton.cdiv(h, _HIDDEN_BLOCK) if hidden else 0))](
        vo.num_correct, nlive if nlive is not None else vo.num_correct, vo.accept_tokens, vb.seq_lens,
        vb.req_pool_indices, ext_slots, out.topk_p, out.topk_index, scratch, src_h,
        draft_rt, db.topk_p, db.topk_index, db.bonus_tokens, db.seq_lens, db.req_pool_indices, db.temp_slots, dst_h,
        int(pad_row), int(pad_d), width, k, ks, h, vo.accept_tokens.stride(0), ext_slots.stride(0), draft_rt.stride(0),
        out.topk_p.stride(0), out.topk_index.stride(0), db.topk_p.stride(0), db.topk_index.stride(0),
        scratch.stride(0), db.temp_slots.stride(0), src_h.stride(0), dst_h.stride(0),
        WP=next_pow2(width), KP=next_pow2(k), KSP=next_pow2(ks), HAS_NLIVE=nlive is not None, BLOCK_H=_HIDDEN_BLOCK,
        LEAD=int(lead), num_warps=4,
    )


# ---- the plain decode step's bookkeeping (executors.decode.DecodeRunner) ------------------------------------


def reference_decode_advance(tokens: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                             seq_lens: torch.Tensor, req_pool_indices: torch.Tensor, out_slots: torch.Tensor,
                             req_to_token: torch.Tensor, history: torch.Tensor, plan: torch.Tensor,
                             step: torch.Tensor, nlive: torch.Tensor) -> None:
    """Torch reference of `decode_advance` (the same writes, as tensor ops without a host read)."""
    bucket = tokens.shape[0]
    r = torch.arange(bucket, device=tokens.device)
    live = r < nlive
    st = step.reshape(())
    width = req_to_token.shape[1]
    # a row at the table's end, or past the history, writes nothing (the caller checks lengths up front)
    at = seq_lens[:bucket]
    ok = live & (at < width) & (st < history.shape[1])
    rows, cols = req_pool_indices[:bucket][ok], at[ok]
    req_to_token[rows, cols] = out_slots[:bucket][ok].to(req_to_token.dtype)
    history[r[ok], st.expand(bucket)[ok]] = tokens[ok].to(history.dtype)
    input_ids[:bucket] = torch.where(live, tokens.to(input_ids.dtype), input_ids[:bucket])
    one = ok.to(seq_lens.dtype)
    seq_lens[:bucket] += one
    positions[:bucket] += one.to(positions.dtype)
    nxt = (st + 1) * nlive.reshape(()) + r
    take = ok & (nxt < plan.shape[0])
    out_slots[:bucket] = torch.where(take, plan[nxt.clamp(max=plan.shape[0] - 1)].to(out_slots.dtype),
                                     out_slots[:bucket])
    step += 1


@triton.jit
def _decode_advance_kernel(
    tok_ptr,  # (bucket,) int the step's tokens
    ids_ptr, pos_ptr, seq_ptr, req_ptr, slot_ptr,  # (>= bucket,) the step's inputs (updated in place)
    rt_ptr,  # (max_reqs, width) int slot table (output)
    hist_ptr,  # (>= bucket, hist_cols) int token history (output)
    plan_ptr,  # (plan_len,) int slots, step-major: step s, live row r at s * nlive + r
    step_ptr, nlive_ptr,  # (1,) int: the step's index, the live rows (a prefix of the bucket)
    bucket, width, hist_cols, plan_len, s_rt, s_h,
    BLOCK: tl.constexpr, PDL: tl.constexpr = False,
):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    r = tl.arange(0, BLOCK)
    st = tl.load(step_ptr).to(tl.int64)
    nlive = tl.load(nlive_ptr).to(tl.int64)
    live = (r < bucket) & (r < nlive)
    tok = tl.load(tok_ptr + r, mask=live, other=0)
    at = tl.load(seq_ptr + r, mask=live, other=0).to(tl.int64)
    ok = live & (at < width) & (st < hist_cols)
    req = tl.load(req_ptr + r, mask=ok, other=0).to(tl.int64)
    slot = tl.load(slot_ptr + r, mask=ok, other=0)
    tl.store(rt_ptr + req * s_rt + at, slot.to(rt_ptr.dtype.element_ty), mask=ok)
    tl.store(hist_ptr + r.to(tl.int64) * s_h + st, tok.to(hist_ptr.dtype.element_ty), mask=ok)
    tl.store(ids_ptr + r, tok.to(ids_ptr.dtype.element_ty), mask=live)
    tl.store(seq_ptr + r, (at + 1).to(seq_ptr.dtype.element_ty), mask=ok)
    pos = tl.load(pos_ptr + r, mask=ok, other=0)
    tl.store(pos_ptr + r, pos + 1, mask=ok)
    nxt = (st + 1) * nlive + r
    take = ok & (nxt < plan_len)
    tl.store(slot_ptr + r, tl.load(plan_ptr + nxt, mask=take, other=0).to(slot_ptr.dtype.element_ty), mask=take)
    tl.store(step_ptr, (st + 1).to(step_ptr.dtype.element_ty))


def decode_advance(tokens: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor,
                   req_pool_indices: torch.Tensor, out_slots: torch.Tensor, req_to_token: torch.Tensor,
                   history: torch.Tensor, plan: torch.Tensor, step: torch.Tensor, nlive: torch.Tensor) -> None:
    """The end of a plain decode step over a bucket of `tokens.shape[0]` rows, of which the first
    `nlive` (a device scalar) are live, in one launch and without a host read: for each live row r,
    with `s = step`, `history[r, s] = tokens[r]`, `req_to_token[req_pool_indices[r], seq_lens[r]] =
    out_slots[r]`, `input_ids[r] = tokens[r]`, `seq_lens[r]` and `positions[r]` one on, and
    `out_slots[r] = plan[(s + 1) * nlive + r]` (the next step's slot, where the plan holds one);
    then `step` one on. Padding rows are left as they are. A live row whose length has reached the
    table's width, or a step past the history's columns, writes nothing (no write out of bounds;
    `DecodeRunner.generate` checks the lengths before it starts). `reference_decode_advance` is the
    torch version, bit for bit."""
    bucket = tokens.shape[0]
    for name, t in (("input_ids", input_ids), ("positions", positions), ("seq_lens", seq_lens),
                    ("req_pool_indices", req_pool_indices), ("out_slots", out_slots)):
        check_tensor(name, t, INDEX_DTYPES, (None,), tokens.device)
        require(t.shape[0] >= bucket and t.stride(0) == 1, f"{name} must be contiguous with >= {bucket} entries")
    for name, t, shape in (("tokens", tokens, (bucket,)), ("plan", plan, (None,)), ("step", step, (1,)),
                           ("nlive", nlive, (1,))):
        check_tensor(name, t, INDEX_DTYPES, shape, tokens.device)
        require(t.stride(0) == 1 or t.shape[0] <= 1, f"{name} must be contiguous")
    for name, t in (("req_to_token", req_to_token), ("history", history)):
        check_tensor(name, t, INDEX_DTYPES, (None, None), tokens.device)
        _rowwise(t, name)
    require(history.shape[0] >= bucket, f"history must have >= {bucket} rows, got {history.shape[0]}")
    if bucket == 0:
        step += 1
        return
    _decode_advance_kernel[(1,)](
        tokens, input_ids, positions, seq_lens, req_pool_indices, out_slots, req_to_token, history, plan, step, nlive,
        bucket, req_to_token.shape[1], history.shape[1], plan.shape[0], req_to_token.stride(0), history.stride(0),
        BLOCK=next_pow2(max(bucket, 2)), num_warps=1, **pdl_options(tokens.device),
    )
