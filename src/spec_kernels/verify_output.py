"""A launched-ahead verify's output in one launch (`verify._ahead_output`'s device work).

When the rest of the iteration was launched ahead (every request goes on), the verify phase builds
its `VerifyOutput` and the `DraftExtendInput` inside it from device counts: the accepted rows cut at
each count, the counts as int32, the new lengths and bonus tokens, the draft-extend's ragged rows
(tokens, positions, the captured hidden rows to gather), and it returns the unused slots of both
pools (the target slots of rejected nodes, the draft-extend slots past each count). The torch path
(`reference_ahead_output`, the verify phase's own code) is about thirty-five small launches and a
gather of the accepted rows' captured hidden states; this is one launch with the gather in it.
Slots go back onto each pool's free stack in the order `KVCache.free_slots` pushes them (the freed
list, in flat order, reversed), so later allocations hand out the same slots on both paths.

`stage_slots` is the other half, before verify's read (`executors.ahead.LaunchAhead.prepare_ahead`):
both pools' allocations for the next launch and their staging rows, one launch instead of nine.
"""

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from spec_kernels._common import INDEX_DTYPES, check_tensor, next_pow2, require

__all__ = ["AheadOutput", "ahead_output", "reference_ahead_output", "reference_frees", "reference_stage_slots",
           "stage_slots"]


class AheadOutput(NamedTuple):
    """What `ahead_output` writes (device tensors); `hidden_rows` indexes the verify's captured rows."""

    accept_index: torch.Tensor  # (bs, W) accepted global rows, -1 past each count
    accept_tokens: torch.Tensor  # (bs, W) accepted tokens, -1 past each count
    num_accept: torch.Tensor  # (bs,) int32 tokens accepted (bonus included)
    num_correct: torch.Tensor  # (bs,) int32 drafts accepted
    seq_lens: torch.Tensor  # (bs,) new committed lengths
    bonus: torch.Tensor  # (bs,) last accepted token
    input_ids: torch.Tensor  # (total,) draft-extend tokens, request-major
    positions: torch.Tensor  # (total,) their draft positions (lead included)
    hidden_rows: torch.Tensor  # (total,) int64 captured rows of the accepted nodes
    finished: torch.Tensor  # (bs,) bool, all False
    hidden: Optional[torch.Tensor]  # (total, H) the captured hidden rows of the accepted nodes (None: none captured)


def _cut(t: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    cols = torch.arange(t.shape[1], device=t.device)
    return torch.where(cols < count[:, None], t, -1)


def reference_ahead_output(accept_index: torch.Tensor, accept_tokens: torch.Tensor, num_correct: torch.Tensor,
                           seq_lens: torch.Tensor, lead: int, total: int,
                           captured: Optional[torch.Tensor] = None) -> AheadOutput:
    """Torch reference of `ahead_output`'s outputs (the frees: `reference_frees`)."""
    bs, width = accept_index.shape
    device = accept_index.device
    num_accept = num_correct.long() + 1
    index = _cut(accept_index, num_accept)
    tokens = _cut(accept_tokens, num_accept)
    cols = torch.arange(width, device=device)
    kept = cols[None, :] < num_accept[:, None]
    req = torch.arange(bs, device=device)[:, None].expand(bs, width)[kept]
    j = cols[None, :].expand(bs, width)[kept]
    require(req.shape[0] == total, f"sum of the counts is {req.shape[0]}, not total={total}")
    rows = index[req, j].long()
    return AheadOutput(index, tokens, num_accept.to(torch.int32), (num_accept - 1).to(torch.int32),
                       seq_lens + num_accept, tokens.gather(1, (num_accept - 1)[:, None]).squeeze(1),
                       tokens[req, j], seq_lens[req] + j + lead, rows,
                       torch.zeros(bs, dtype=torch.bool, device=device),
                       None if captured is None else captured.index_select(0, rows))


def reference_frees(slots: torch.Tensor, ext_slots: torch.Tensor, out: AheadOutput) -> tuple[torch.Tensor, torch.Tensor]:
    """The slots `ahead_output` returns to each pool, in the order to pass them to `free_slots`: the
    target slots of tree rows no request accepted, then the draft-extend slots past each count, each
    in flat order."""
    used = torch.zeros(slots.shape[0], dtype=torch.bool, device=slots.device)
    used.index_fill_(0, out.accept_index.clamp(min=0).reshape(-1).long(), True)
    cols = torch.arange(ext_slots.shape[1], device=slots.device)
    dead = cols[None, :] >= out.num_accept.long()[:, None]
    return slots[~used], ext_slots[dead]


# The pools' stack tops and free counts and the accepted total change every iteration: specialized
# (Triton's == 1 and % 16 variants), each new combination would compile in the middle of decoding.
@triton.jit(do_not_specialize=["t_top", "t_n", "d_top", "d_n", "total"])
def _ahead_output_kernel(
    acc_ptr,  # (bs, W) int accepted global rows (verify core), -1 padded
    tok_ptr,  # (bs, W) int accepted tokens
    nc_ptr,  # (bs,) int accepted drafts
    seq_ptr,  # (bs,) int committed lengths before this verify
    slots_ptr,  # (bs*N,) int64 target slot of every tree node
    ext_ptr,  # (bs*W,) int64 draft-extend slots
    o_acc_ptr, o_tok_ptr,  # (bs, W) cut rows (output)
    o_na_ptr, o_nc_ptr,  # (bs,) int32 counts (output)
    o_seq_ptr, o_bonus_ptr, o_fin_ptr,  # (bs,) new lengths, bonus tokens, finished uint8 (output)
    o_ids_ptr, o_pos_ptr, o_rows_ptr,  # (total,) draft-extend rows (output)
    t_stack_ptr, t_used_ptr,  # target pool: free stack, in_use uint8 (output)
    d_stack_ptr, d_used_ptr,  # draft pool: free stack, in_use uint8 (output)
    cap_ptr, o_hid_ptr,  # (rows, H) captured hidden states, (total, H) the accepted rows' (output; GATHER)
    bs, W, N, lead, t_top, t_n, d_top, d_n, total, H, cap_stride,
    BB: tl.constexpr, BW: tl.constexpr, BN: tl.constexpr, GATHER: tl.constexpr, BR: tl.constexpr,
    BH: tl.constexpr,
):
    """Program 0: the rows, counts and frees. Programs 1...: the hidden gather, a tile of BR packed
    rows by BH columns each (GATHER)."""
    if tl.program_id(0) == 0:
        _ahead_rows(acc_ptr, tok_ptr, nc_ptr, seq_ptr, slots_ptr, ext_ptr, o_acc_ptr, o_tok_ptr, o_na_ptr,
                    o_nc_ptr, o_seq_ptr, o_bonus_ptr, o_fin_ptr, o_ids_ptr, o_pos_ptr, o_rows_ptr, t_stack_ptr,
                    t_used_ptr, d_stack_ptr, d_used_ptr, bs, W, N, lead, t_top, t_n, d_top, d_n, BB, BW, BN)
    elif GATHER:
        _gather_hidden(acc_ptr, nc_ptr, cap_ptr, o_hid_ptr, bs, W, total, H, cap_stride, tl.program_id(0) - 1,
                       BB, BR, BH)


@triton.jit
def _gather_hidden(acc_ptr, nc_ptr, cap_ptr, o_hid_ptr, bs, W, total, H, cap_stride, tile,
                   BB: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr):
    """Tile `tile` of the accepted rows' hidden states: packed row r (request-major, as the
    draft-extend's rows) is request b's accepted node j, r = start(b) + j."""
    nh = tl.cdiv(H, BH)
    r = (tile // nh) * BR + tl.arange(0, BR)
    h = (tile % nh) * BH + tl.arange(0, BH)
    b = tl.arange(0, BB)
    na, start = _counts_starts(nc_ptr, bs, BB)
    req = tl.sum(((start + na)[None, :] <= r[:, None]).to(tl.int64), axis=1)  # requests wholly before r
    first = tl.sum(tl.where(b[None, :] == req[:, None], start[None, :], 0), axis=1)
    mr = r < total
    src = tl.load(acc_ptr + req * W + (r - first), mask=mr, other=0).to(tl.int64)
    m = mr[:, None] & (h[None, :] < H)
    vals = tl.load(cap_ptr + src[:, None] * cap_stride + h[None, :], mask=m)
    tl.store(o_hid_ptr + r[:, None].to(tl.int64) * H + h[None, :], vals, mask=m)


@triton.jit
def _counts_starts(nc_ptr, bs, BB: tl.constexpr):
    """`(BB,)` int64 tokens accepted per request (bonus included; 0 past `bs`) and each request's first
    packed row (the sum of the counts before it): the draft-extend's ragged layout."""
    b = tl.arange(0, BB)
    na = tl.load(nc_ptr + b, mask=b < bs, other=-1).to(tl.int64) + 1
    return na, tl.cumsum(na, axis=0) - na


@triton.jit
def _ahead_rows(acc_ptr, tok_ptr, nc_ptr, seq_ptr, slots_ptr, ext_ptr, o_acc_ptr, o_tok_ptr, o_na_ptr, o_nc_ptr,
                o_seq_ptr, o_bonus_ptr, o_fin_ptr, o_ids_ptr, o_pos_ptr, o_rows_ptr, t_stack_ptr, t_used_ptr,
                d_stack_ptr, d_used_ptr, bs, W, N, lead, t_top, t_n, d_top, d_n,
                BB: tl.constexpr, BW: tl.constexpr, BN: tl.constexpr):
    """Program 0's work: the cut rows, counts, lengths, bonus tokens, draft-extend rows, both frees."""
    b = tl.arange(0, BB)
    w = tl.arange(0, BW)
    mb = b < bs
    cell = mb[:, None] & (w[None, :] < W)
    na, start = _counts_starts(nc_ptr, bs, BB)
    seq = tl.load(seq_ptr + b, mask=mb, other=0).to(tl.int64)
    kept = cell & (w[None, :] < na[:, None])
    off2 = b[:, None] * W + w[None, :]
    idx = tl.where(kept, tl.load(acc_ptr + off2, mask=cell, other=-1), -1)
    tok = tl.where(kept, tl.load(tok_ptr + off2, mask=cell, other=-1), -1)
    tl.store(o_acc_ptr + off2, idx.to(o_acc_ptr.dtype.element_ty), mask=cell)
    tl.store(o_tok_ptr + off2, tok.to(o_tok_ptr.dtype.element_ty), mask=cell)
    tl.store(o_na_ptr + b, na.to(tl.int32), mask=mb)
    tl.store(o_nc_ptr + b, (na - 1).to(tl.int32), mask=mb)
    tl.store(o_seq_ptr + b, (seq + na).to(o_seq_ptr.dtype.element_ty), mask=mb)
    bonus = tl.sum(tl.where(w[None, :] == na[:, None] - 1, tok, 0), axis=1)
    tl.store(o_bonus_ptr + b, bonus.to(o_bonus_ptr.dtype.element_ty), mask=mb)
    tl.store(o_fin_ptr + b, tl.zeros([BB], tl.uint8), mask=mb)
    # the draft-extend's ragged rows: request b's start is the sum of the counts before it
    dst = start[:, None] + w[None, :]
    tl.store(o_ids_ptr + dst, tok.to(o_ids_ptr.dtype.element_ty), mask=kept)
    tl.store(o_pos_ptr + dst, (seq[:, None] + w[None, :] + lead).to(o_pos_ptr.dtype.element_ty), mask=kept)
    tl.store(o_rows_ptr + dst, idx.to(tl.int64), mask=kept)
    # draft-extend slots past each count: pushed in flat order, reversed
    dead = cell & (w[None, :] >= na[:, None])
    d_cnt = tl.sum(dead.to(tl.int64), axis=1)
    d_pos = (tl.cumsum(d_cnt, axis=0) - d_cnt)[:, None] + tl.cumsum(dead.to(tl.int64), axis=1) - dead.to(tl.int64)
    ext = tl.load(ext_ptr + off2, mask=dead, other=0)
    tl.store(d_stack_ptr + d_top + d_n - 1 - d_pos, ext, mask=dead)
    tl.store(d_used_ptr + ext, tl.zeros([BB, BW], tl.uint8), mask=dead)
    # target slots of the nodes no request accepted (global row b * N + k)
    k = tl.arange(0, BN)
    node = cell[:, :, None] & (k[None, None, :] < N)
    row = (b[:, None] * N)[:, :, None] + k[None, None, :]
    hit = tl.max(((idx[:, :, None] == row) & node).to(tl.int32), axis=1)  # (BB, BN)
    free = mb[:, None] & (k[None, :] < N) & (hit == 0)
    f_cnt = tl.sum(free.to(tl.int64), axis=1)
    f_pos = (tl.cumsum(f_cnt, axis=0) - f_cnt)[:, None] + tl.cumsum(free.to(tl.int64), axis=1) - free.to(tl.int64)
    slot = tl.load(slots_ptr + b[:, None] * N + k[None, :], mask=free, other=0)
    tl.store(t_stack_ptr + t_top + t_n - 1 - f_pos, slot, mask=free)
    tl.store(t_used_ptr + slot, tl.zeros([BB, BN], tl.uint8), mask=free)


def ahead_output(accept_index: torch.Tensor, accept_tokens: torch.Tensor, num_correct: torch.Tensor,
                 seq_lens: torch.Tensor, slots: torch.Tensor, ext_slots: torch.Tensor, lead: int, total: int,
                 target_pool: tuple[torch.Tensor, torch.Tensor, int], draft_pool: tuple[torch.Tensor, torch.Tensor, int],
                 captured: Optional[torch.Tensor] = None) -> AheadOutput:
    """`reference_ahead_output` and the two frees in one launch.

    Args:
        accept_index, accept_tokens: `(bs, W)` int, the verify core's accepted rows and tokens.
        num_correct: `(bs,)` int accepted drafts; seq_lens: `(bs,)` int lengths before this verify.
        slots: `(bs*n,)` int64 target slots of the tree nodes; ext_slots: `(bs, W)` int64 draft-extend slots.
        lead: the draft's KV lead; total: the host's sum of the counts (`sum(num_correct + 1)`).
        target_pool, draft_pool: `(free stack, in_use, top)` of each pool (`KVCache.free_on_device`,
            called with `bs*n - total` and `bs*W - total` slots).
        captured: `(rows, H)` the verify's captured hidden states (rows indexed by `accept_index`), whose
            accepted rows are gathered into `hidden` by the same launch; None: no hidden output.
    """
    require(accept_index.dim() == 2, f"accept_index must be (bs, W), got shape {tuple(accept_index.shape)}")
    bs, width = accept_index.shape
    dev = accept_index.device
    require(bs > 0 and slots.dim() == 1 and slots.shape[0] % bs == 0,
            f"slots must be (bs*n,) for bs={bs}, got shape {tuple(slots.shape)}")
    n = slots.shape[0] // bs
    check_tensor("accept_tokens", accept_tokens, INDEX_DTYPES, (bs, width), dev)
    check_tensor("num_correct", num_correct, INDEX_DTYPES, (bs,), dev)
    check_tensor("seq_lens", seq_lens, INDEX_DTYPES, (bs,), dev)
    check_tensor("ext_slots", ext_slots, (torch.int64,), (bs, width), dev)
    check_tensor("slots", slots, (torch.int64,), (bs * n,), dev)
    require(bs <= total <= bs * width, f"total={total} accepted tokens for {bs} requests of at most {width}")
    e = torch.empty
    out = AheadOutput(e(bs, width, dtype=accept_index.dtype, device=dev), e(bs, width, dtype=accept_tokens.dtype,
                                                                              device=dev),
                      e(bs, dtype=torch.int32, device=dev), e(bs, dtype=torch.int32, device=dev),
                      e(bs, dtype=torch.promote_types(seq_lens.dtype, torch.int64), device=dev),
                      e(bs, dtype=accept_tokens.dtype, device=dev), e(total, dtype=accept_tokens.dtype, device=dev),
                      e(total, dtype=torch.promote_types(seq_lens.dtype, torch.int64), device=dev),
                      e(total, dtype=torch.int64, device=dev), e(bs, dtype=torch.bool, device=dev),
                      None if captured is None else e(total, captured.shape[1], dtype=captured.dtype, device=dev))
    (t_stack, t_used, t_top), (d_stack, d_used, d_top) = target_pool, draft_pool
    h = 0 if captured is None else captured.shape[1]
    if captured is not None:
        require(captured.dim() == 2 and captured.stride(1) == 1 and captured.device == dev,
                f"captured must be (rows, H) with unit column stride on {dev}, got shape {tuple(captured.shape)}")
    br, bh = 8, min(256, next_pow2(max(h, 1)))
    tiles = 0 if captured is None else triton.cdiv(total, br) * triton.cdiv(h, bh)
    _ahead_output_kernel[(1 + tiles,)](
        accept_index.contiguous(), accept_tokens.contiguous(), num_correct.contiguous(), seq_lens.contiguous(),
        slots.contiguous(), ext_slots.contiguous(), out.accept_index, out.accept_tokens, out.num_accept,
        out.num_correct, out.seq_lens, out.bonus, out.finished.view(torch.uint8), out.input_ids, out.positions,
        out.hidden_rows, t_stack, t_used.view(torch.uint8), d_stack, d_used.view(torch.uint8),
        out.hidden_rows if captured is None else captured, out.hidden_rows if captured is None else out.hidden,
        bs, width, n, lead, t_top, bs * n - total, d_top, bs * width - total, total, h,
        0 if captured is None else captured.stride(0),
        BB=next_pow2(bs), BW=next_pow2(width), BN=next_pow2(n), GATHER=captured is not None, BR=br, BH=bh,
        num_warps=4,
    )
    return out


# ---- the next launch's slots, staged before the read --------------------------------------------


@triton.jit
def _take_slots(stack_ptr, used_ptr, out_ptr, stage_ptr, base, count, rows, pad, BLOCK: tl.constexpr):
    """As KVCache.alloc_slots: the top `count` entries of a pool's free stack (from `base`), top first,
    into `out` and marked in use; the staging rows get them, then `pad` up to `rows`."""
    i = tl.arange(0, BLOCK)
    live = i < count
    s = tl.load(stack_ptr + base + count - 1 - i, mask=live, other=0)
    tl.store(out_ptr + i, s, mask=live)
    tl.store(used_ptr + s, tl.full([BLOCK], 1, tl.uint8), mask=live)
    tl.store(stage_ptr + i, tl.where(live, s, pad), mask=i < rows)


@triton.jit(do_not_specialize=["t_base", "d_base"])  # the pools' stack tops (as `_ahead_output_kernel`'s)
def _stage_slots_kernel(
    t_stack_ptr, t_used_ptr,  # target pool: free stack, in_use uint8 (output)
    d_stack_ptr, d_used_ptr,  # draft pool: free stack, in_use uint8 (output)
    slots_ptr,  # (bs*N,) int64 the next verify's target slots (output)
    ext_ptr,  # (bs*W,) int64 the draft-extend's draft slots (output)
    t_stage_ptr,  # (bucket*N,) int64 their staging rows, padding rows `pad_t` (output)
    d_stage_ptr,  # (bucket*W,) int64 likewise, padding `pad_d` (output)
    nlive_ptr,  # () int64 live requests (output)
    t_base, d_base, bs, bucket, N, W, pad_t, pad_d,
    BT: tl.constexpr, BD: tl.constexpr,
):
    _take_slots(t_stack_ptr, t_used_ptr, slots_ptr, t_stage_ptr, t_base, bs * N, bucket * N, pad_t, BT)
    _take_slots(d_stack_ptr, d_used_ptr, ext_ptr, d_stage_ptr, d_base, bs * W, bucket * W, pad_d, BD)
    tl.store(nlive_ptr + tl.arange(0, 1), tl.full([1], 0, tl.int64) + bs)  # (bs may be a constant 1)


def stage_slots(target_pool: tuple[torch.Tensor, torch.Tensor, int], draft_pool: tuple[torch.Tensor, torch.Tensor, int],
                bs: int, bucket: int, n: int, width: int, t_stage: torch.Tensor, d_stage: torch.Tensor,
                nlive: torch.Tensor, pads: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference_stage_slots` in one launch: allocate the next verify's `(bs, n)` target slots and the
    draft-extend's `(bs, width)` draft slots (from each pool's `KVCache.alloc_on_device`), write them into
    the staging buffers' first `bs` rows (`t_stage` `(>= bucket, n)`, `d_stage` `(>= bucket, width)`),
    the padding rows up to `bucket` with `pads`, and `bs` into `nlive`. Returns `(slots, ext_slots)`."""
    require(0 < bs <= bucket <= min(t_stage.shape[0], d_stage.shape[0]),
            f"stage_slots: bs={bs}, bucket={bucket}, staging rows {t_stage.shape[0]} / {d_stage.shape[0]}")
    dev = t_stage.device
    check_tensor("t_stage", t_stage, (torch.int64,), (None, n), dev)
    check_tensor("d_stage", d_stage, (torch.int64,), (None, width), dev)
    check_tensor("nlive", nlive, (torch.int64,), (), dev)
    require(t_stage.is_contiguous() and d_stage.is_contiguous(), "stage_slots: staging buffers must be contiguous")
    slots = torch.empty(bs, n, dtype=torch.int64, device=dev)
    ext = torch.empty(bs, width, dtype=torch.int64, device=dev)
    (t_stack, t_used, t_base), (d_stack, d_used, d_base) = target_pool, draft_pool
    _stage_slots_kernel[(1,)](
        t_stack, t_used.view(torch.uint8), d_stack, d_used.view(torch.uint8), slots, ext, t_stage, d_stage, nlive,
        t_base, d_base, bs, bucket, n, width, pads[0], pads[1],
        BT=next_pow2(bucket * n), BD=next_pow2(bucket * width), num_warps=4,
    )
    return slots, ext


def reference_stage_slots(target_cache, draft_cache, bs: int, bucket: int, n: int, width: int,  # noqa: ANN001
                          t_stage: torch.Tensor, d_stage: torch.Tensor, nlive: torch.Tensor,
                          pads: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of `stage_slots` through the pools' own `alloc_slots` (launch-ahead's
    `prepare_ahead` on the torch path)."""
    ext = draft_cache.alloc_slots(bs * width).view(bs, width)
    slots = target_cache.alloc_slots(bs * n).view(bs, n)
    for stage, src, pad in ((d_stage, ext, pads[1]), (t_stage, slots, pads[0])):
        stage[:bs].copy_(src)
        stage[bs:bucket].fill_(pad)
    nlive.fill_(bs)
    return slots, ext
