"""A launched-ahead iteration's slot bookkeeping and verify output, as two nodes of the launched
`ahead` graph (`executors.ahead.LaunchAhead._ahead_fn`), so that a steady iteration starts no kernel
outside its two graphs.

`ahead_output`: when the rest of the iteration was launched ahead (every request goes on), the verify
phase's `VerifyOutput` and the `DraftExtendInput` inside it come from device counts: the accepted rows
cut at each count, the counts as int32, the new lengths and bonus tokens, the draft-extend's ragged
rows (tokens, positions, the captured hidden rows, gathered by the launch's other programs), and the
target slots of the rejected nodes go back to their pool. The torch path (`reference_ahead_output`,
the verify phase's own code) is about thirty-five small launches and a gather. Slots go back onto
the free stack in the order `KVCache.free_slots` pushes them (the freed list, in flat order,
reversed).

`stage_slots`: the launch's allocations, after those frees: the next verify's target slots and the
draft-extend's draft slots (one per accepted token, packed request by request) into the staging rows.

Both read only device values that change between iterations (live requests `nlive`, both pools' free
counts `tops`, the verify's counts), never host ones, write no value they read (a graph's function
runs again at its capture's warm-up), and write outputs of the graph's bucket size; the host takes
views of the live rows, and counts what they did once its read allows the launch
(`executors.ahead.LaunchAhead.ahead_rows`).
"""

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from spec_kernels._common import INDEX_DTYPES, check_tensor, next_pow2, require

__all__ = ["AheadOutput", "ahead_output", "ahead_output_buffers", "reference_ahead_output", "reference_frees",
           "reference_stage_slots", "stage_slots"]


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


def reference_frees(slots: torch.Tensor, out: AheadOutput) -> torch.Tensor:
    """The target slots `ahead_output` returns, in the order to pass them to `free_slots`: those of the
    tree rows no request accepted, in flat order."""
    used = torch.zeros(slots.shape[0], dtype=torch.bool, device=slots.device)
    used.index_fill_(0, out.accept_index.clamp(min=0).reshape(-1).long(), True)
    return slots[~used]


@triton.jit
def _ahead_output_kernel(
    acc_ptr,  # (>= bs, W) int accepted global rows (verify core), -1 padded
    tok_ptr,  # (>= bs, W) int accepted tokens
    nc_ptr,  # (>= bs,) int accepted drafts
    seq_ptr,  # (>= bs,) int committed lengths before this verify
    slots_ptr,  # (>= bs*N,) int64 target slot of every tree node
    nlive_ptr,  # () int64 live requests bs
    tops_ptr,  # (2, 2) int64 pools' free counts: [0] read, [1] once these frees and the launch's allocations are done (output)
    o_acc_ptr, o_tok_ptr,  # (bucket, W) cut rows (output)
    o_na_ptr, o_nc_ptr,  # (bucket,) int32 counts (output)
    o_seq_ptr, o_bonus_ptr, o_fin_ptr,  # (bucket,) new lengths, bonus tokens, finished uint8 (output)
    o_ids_ptr, o_pos_ptr, o_rows_ptr,  # (bucket*W,) draft-extend rows, the first sum(counts) (output)
    t_stack_ptr, t_used_ptr,  # target pool: free stack, in_use uint8 (output)
    cap_ptr, o_hid_ptr,  # (rows, H) captured hidden states, (bucket*W, H) the accepted rows' (output; GATHER)
    W, N, lead, H, cap_stride,
    BB: tl.constexpr, BW: tl.constexpr, BN: tl.constexpr, GATHER: tl.constexpr, BR: tl.constexpr,
    BH: tl.constexpr,
):
    """Program 0: the rows, counts and frees. Programs 1...: the hidden gather, a tile of BR packed
    rows by BH columns each (GATHER; tiles past the accepted rows store nothing)."""
    bs = tl.load(nlive_ptr)
    if tl.program_id(0) == 0:
        _ahead_rows(acc_ptr, tok_ptr, nc_ptr, seq_ptr, slots_ptr, tops_ptr, o_acc_ptr, o_tok_ptr, o_na_ptr,
                    o_nc_ptr, o_seq_ptr, o_bonus_ptr, o_fin_ptr, o_ids_ptr, o_pos_ptr, o_rows_ptr, t_stack_ptr,
                    t_used_ptr, bs, W, N, lead, BB, BW, BN)
    elif GATHER:
        _gather_hidden(acc_ptr, nc_ptr, cap_ptr, o_hid_ptr, bs, W, H, cap_stride, tl.program_id(0) - 1, BB, BR, BH)


@triton.jit
def _gather_hidden(acc_ptr, nc_ptr, cap_ptr, o_hid_ptr, bs, W, H, cap_stride, tile,
                   BB: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr):
    """Tile `tile` of the accepted rows' hidden states: packed row r (request-major, as the
    draft-extend's rows) is request b's accepted node j, r = start(b) + j."""
    nh = tl.cdiv(H, BH)
    r = (tile // nh) * BR + tl.arange(0, BR)
    h = (tile % nh) * BH + tl.arange(0, BH)
    b = tl.arange(0, BB)
    na, start = _counts_starts(nc_ptr, bs, BB)
    total = tl.sum(na, axis=0)
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
def _ahead_rows(acc_ptr, tok_ptr, nc_ptr, seq_ptr, slots_ptr, tops_ptr, o_acc_ptr, o_tok_ptr, o_na_ptr, o_nc_ptr,
                o_seq_ptr, o_bonus_ptr, o_fin_ptr, o_ids_ptr, o_pos_ptr, o_rows_ptr, t_stack_ptr, t_used_ptr,
                bs, W, N, lead, BB: tl.constexpr, BW: tl.constexpr, BN: tl.constexpr):
    """Program 0's work: the cut rows, counts, lengths, bonus tokens, draft-extend rows, the target
    frees and the free counts they leave."""
    b = tl.arange(0, BB)
    w = tl.arange(0, BW)
    mb = b < bs
    cell = mb[:, None] & (w[None, :] < W)
    na, start = _counts_starts(nc_ptr, bs, BB)
    total = tl.sum(na, axis=0)
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
    # target slots of the nodes no request accepted (global row b * N + k), pushed in flat order, reversed
    t_top = tl.load(tops_ptr)
    t_n = bs * N - total
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
    # each pool keeps the accepted tokens' slots of this launch's allocations (`stage_slots`)
    tl.store(tops_ptr + 2, t_top - total)
    tl.store(tops_ptr + 3, tl.load(tops_ptr + 1) - total)


def ahead_output(accept_index: torch.Tensor, accept_tokens: torch.Tensor, num_correct: torch.Tensor,
                 seq_lens: torch.Tensor, slots: torch.Tensor, nlive: torch.Tensor, tops: torch.Tensor, lead: int,
                 target_pool: tuple[torch.Tensor, torch.Tensor], out: AheadOutput,
                 captured: Optional[torch.Tensor] = None) -> None:
    """`reference_ahead_output` into `out` for the first `nlive` requests, and the target frees of
    `reference_frees`, in one launch (the hidden gather in it).

    Args:
        accept_index, accept_tokens: `(bucket, W)` int, the verify core's accepted rows and tokens.
        num_correct: `(bucket,)` int accepted drafts; seq_lens: `(bucket,)` int lengths before the verify.
        slots: `(bucket*n,)` int64 target slots of the tree nodes.
        nlive: `()` int64 live requests (rows past it are padding, read as nothing).
        tops: `(2, 2)` int64 the pools' (target, draft) free counts: row 0 now (read), row 1 written:
            row 0 less the accepted tokens (what is left once `stage_slots` has allocated).
        lead: the draft's KV lead. target_pool: `(free stack, in_use)` of the target pool.
        out: `AheadOutput` of `(bucket, W)`, `(bucket,)` and `(bucket*W,)` (`hidden` `(bucket*W, H)`)
            tensors the launch writes: the live requests' rows, the first sum(counts) ragged rows.
        captured: `(rows, H)` the verify's captured hidden states (rows indexed by `accept_index`), whose
            accepted rows are gathered into `out.hidden` by the same launch; None: no hidden output.
    """
    require(accept_index.dim() == 2, f"accept_index must be (bucket, W), got shape {tuple(accept_index.shape)}")
    bucket, width = accept_index.shape
    dev = accept_index.device
    require(bucket > 0 and slots.dim() == 1 and slots.shape[0] % bucket == 0,
            f"slots must be (bucket*n,) for bucket={bucket}, got shape {tuple(slots.shape)}")
    n = slots.shape[0] // bucket
    check_tensor("accept_tokens", accept_tokens, INDEX_DTYPES, (bucket, width), dev)
    check_tensor("num_correct", num_correct, INDEX_DTYPES, (bucket,), dev)
    check_tensor("seq_lens", seq_lens, INDEX_DTYPES, (bucket,), dev)
    check_tensor("slots", slots, (torch.int64,), (bucket * n,), dev)
    check_tensor("nlive", nlive, (torch.int64,), (), dev)
    check_tensor("tops", tops, (torch.int64,), (2, 2), dev)
    for name, t, shape in (("accept_index", out.accept_index, (bucket, width)), ("input_ids", out.input_ids,
                                                                                  (bucket * width,)),
                           ("num_accept", out.num_accept, (bucket,)), ("seq_lens", out.seq_lens, (bucket,))):
        require(tuple(t.shape) == shape and t.is_contiguous(), f"out.{name} must be contiguous {shape}, "
                f"got {tuple(t.shape)}")
    h = 0 if captured is None else captured.shape[1]
    if captured is not None:
        require(captured.dim() == 2 and captured.stride(1) == 1 and captured.device == dev,
                f"captured must be (rows, H) with unit column stride on {dev}, got shape {tuple(captured.shape)}")
        require(out.hidden is not None and tuple(out.hidden.shape) == (bucket * width, h),
                f"out.hidden must be ({bucket * width}, {h}) for captured rows")
    br, bh = 8, min(256, next_pow2(max(h, 1)))
    tiles = 0 if captured is None else triton.cdiv(bucket * width, br) * triton.cdiv(h, bh)
    t_stack, t_used = target_pool
    _ahead_output_kernel[(1 + tiles,)](
        accept_index, accept_tokens, num_correct, seq_lens, slots, nlive, tops, out.accept_index,
        out.accept_tokens, out.num_accept, out.num_correct, out.seq_lens, out.bonus, out.finished.view(torch.uint8),
        out.input_ids, out.positions, out.hidden_rows, t_stack, t_used.view(torch.uint8),
        out.hidden_rows if captured is None else captured, out.hidden_rows if captured is None else out.hidden,
        width, n, lead, h, 0 if captured is None else captured.stride(0),
        BB=next_pow2(bucket), BW=next_pow2(width), BN=next_pow2(n), GATHER=captured is not None, BR=br, BH=bh,
        num_warps=4,
    )


def ahead_output_buffers(accept_index: torch.Tensor, accept_tokens: torch.Tensor, seq_lens: torch.Tensor,
                         captured: Optional[torch.Tensor], rows: int) -> AheadOutput:
    """Empty `ahead_output` outputs for `rows` requests of `accept_index.shape[1]` accepted tokens each,
    in the dtypes the torch path gives (allocate once, outside any graph capture)."""
    width, dev = accept_index.shape[1], accept_index.device
    e, seq = torch.empty, torch.promote_types(seq_lens.dtype, torch.int64)
    return AheadOutput(e(rows, width, dtype=accept_index.dtype, device=dev),
                       e(rows, width, dtype=accept_tokens.dtype, device=dev),
                       e(rows, dtype=torch.int32, device=dev), e(rows, dtype=torch.int32, device=dev),
                       e(rows, dtype=seq, device=dev), e(rows, dtype=accept_tokens.dtype, device=dev),
                       e(rows * width, dtype=accept_tokens.dtype, device=dev), e(rows * width, dtype=seq, device=dev),
                       e(rows * width, dtype=torch.int64, device=dev), e(rows, dtype=torch.bool, device=dev),
                       None if captured is None else e(rows * width, captured.shape[1], dtype=captured.dtype,
                                                       device=dev))


# ---- the next launch's slots, staged by the launched graph itself -------------------------------


@triton.jit
def _take_slots(stack_ptr, used_ptr, stage_ptr, base, count, rows, pad, BLOCK: tl.constexpr):
    """As KVCache.alloc_slots: the top `count` entries of a pool's free stack (from `base`), top first,
    marked in use, into the staging rows, then `pad` up to `rows`."""
    i = tl.arange(0, BLOCK)
    live = i < count
    s = tl.load(stack_ptr + base + count - 1 - i, mask=live, other=0)
    tl.store(used_ptr + s, tl.full([BLOCK], 1, tl.uint8), mask=live)
    tl.store(stage_ptr + i, tl.where(live, s, pad), mask=i < rows)


@triton.jit
def _stage_slots_kernel(
    t_stack_ptr, t_used_ptr,  # target pool: free stack, in_use uint8 (output)
    d_stack_ptr, d_used_ptr,  # draft pool: free stack, in_use uint8 (output)
    tops_ptr,  # (2, 2) int64 pools' free counts: [0] before the iteration, [1] after it (`ahead_output`'s)
    nlive_ptr,  # () int64 live requests bs
    nc_ptr,  # (>= bs,) int accepted drafts of the verify before
    t_stage_ptr,  # (bucket*N,) int64 the next verify's target slots, padding rows `pad_t` (output)
    d_stage_ptr,  # (bucket, W) int64 the draft-extend's draft slots, the first count of each row (output)
    bucket, N, W, pad_t, pad_d,
    BT: tl.constexpr, BB: tl.constexpr, BW: tl.constexpr,
):
    bs = tl.load(nlive_ptr)
    # the target's: bs * N from the top `ahead_output`'s frees left (`tops[1]` counts them already)
    _take_slots(t_stack_ptr, t_used_ptr, t_stage_ptr, tl.load(tops_ptr + 2), bs * N, bucket * N, pad_t, BT)
    # the draft's: one per accepted token, top first in the draft-extend's packed row order
    b = tl.arange(0, BB)
    w = tl.arange(0, BW)
    na, start = _counts_starts(nc_ptr, bs, BB)
    live = (b[:, None] < bs) & (w[None, :] < na[:, None])
    s = tl.load(d_stack_ptr + tl.load(tops_ptr + 1) - 1 - (start[:, None] + w[None, :]), mask=live, other=0)
    tl.store(d_used_ptr + s, tl.full([BB, BW], 1, tl.uint8), mask=live)
    cell = (b[:, None] < bucket) & (w[None, :] < W)
    tl.store(d_stage_ptr + b[:, None] * W + w[None, :], tl.where(live, s, pad_d), mask=cell)


def stage_slots(target_pool: tuple[torch.Tensor, torch.Tensor], draft_pool: tuple[torch.Tensor, torch.Tensor],
                tops: torch.Tensor, nlive: torch.Tensor, num_correct: torch.Tensor, bucket: int, n: int, width: int,
                t_stage: torch.Tensor, d_stage: torch.Tensor, pads: tuple[int, int]) -> None:
    """`reference_stage_slots` in one launch, after `ahead_output` (whose free counts `tops[1]` it
    reads): allocate the next verify's `(nlive, n)` target slots from the target pool's `(free stack,
    in_use)` into the staging rows `t_stage` `(>= bucket, n)` (rows up to `bucket` padded with
    `pads[0]`), and the draft-extend's draft slots, one per accepted token of the verify before
    (`num_correct + 1` of each live request, packed request by request, as `alloc_slots(total)` hands
    them out from `tops[0]`'s draft count), into `d_stage` `(>= bucket, width)`: request b's first
    count columns, the others `pads[1]`."""
    dev = t_stage.device
    require(0 < bucket <= min(t_stage.shape[0], d_stage.shape[0], num_correct.shape[0]),
            f"stage_slots: bucket={bucket}, staging rows {t_stage.shape[0]} / {d_stage.shape[0]}, "
            f"num_correct rows {num_correct.shape[0]}")
    check_tensor("t_stage", t_stage, (torch.int64,), (None, n), dev)
    check_tensor("d_stage", d_stage, (torch.int64,), (None, width), dev)
    check_tensor("tops", tops, (torch.int64,), (2, 2), dev)
    check_tensor("nlive", nlive, (torch.int64,), (), dev)
    check_tensor("num_correct", num_correct, INDEX_DTYPES, (None,), dev)
    require(t_stage.is_contiguous() and d_stage.is_contiguous() and tops.is_contiguous(),
            "stage_slots: staging buffers and tops must be contiguous")
    (t_stack, t_used), (d_stack, d_used) = target_pool, draft_pool
    _stage_slots_kernel[(1,)](
        t_stack, t_used.view(torch.uint8), d_stack, d_used.view(torch.uint8), tops, nlive, num_correct,
        t_stage, d_stage, bucket, n, width, pads[0], pads[1],
        BT=next_pow2(bucket * n), BB=next_pow2(bucket), BW=next_pow2(width), num_warps=4,
    )


def reference_stage_slots(target_cache, draft_cache, num_accept: torch.Tensor, bucket: int, n: int,  # noqa: ANN001
                          t_stage: torch.Tensor, d_stage: torch.Tensor, pads: tuple[int, int]) -> None:
    """Torch reference of `stage_slots` through the pools' own `alloc_slots` (`num_accept` `(bs,)`: each
    live request's accepted tokens)."""
    bs = num_accept.shape[0]
    counts = num_accept.tolist()
    slots = target_cache.alloc_slots(bs * n).view(bs, n)
    ext = draft_cache.alloc_slots(sum(counts))
    t_stage[:bs].copy_(slots)
    t_stage[bs:bucket].fill_(pads[0])
    d_stage[:bucket].fill_(pads[1])
    start = 0
    for b, c in enumerate(counts):
        d_stage[b, :c] = ext[start:start + c]
        start += c
