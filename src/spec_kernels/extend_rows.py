"""The fixed-stride draft-extend's row bookkeeping in one launch (`spec_runtime.extend.extend_rows`,
the torch reference: about nine small kernels in every draft-extend graph): each request's draft KV
prefix, its last row, and the extra slots each row attends (its own request's rows up to itself,
none past the request's count)."""

import torch
import triton
import triton.language as tl

from spec_kernels._common import INDEX_DTYPES, check_tensor, next_pow2, require

__all__ = ["triton_extend_rows"]


@triton.jit
def _extend_rows_kernel(
    counts_ptr,  # (bs,) int rows of each request (accepted tokens)
    seq_ptr,  # (bs,) int sequence lengths after them
    slots_ptr,  # (bs * S,) int64 each row's draft KV slot
    prefix_ptr,  # (bs,) int64 draft KV before the rows (output)
    last_ptr,  # (bs,) int64 global row of each request's last row (output)
    extra_ptr,  # (bs * S, S) int64 extra slots each row attends, -1 = none (output)
    lead, S,
    SP: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    count = tl.load(counts_ptr + r).to(tl.int64)
    tl.store(prefix_ptr + r, tl.load(seq_ptr + r).to(tl.int64) - count + lead)
    tl.store(last_ptr + r, r * S + count - 1)
    j = tl.arange(0, SP)[:, None]  # the row
    i = tl.arange(0, SP)[None, :]  # the column: row i of the same request
    slot = tl.load(slots_ptr + r * S + i, mask=i < S, other=-1).to(tl.int64)
    visible = (i <= j) & (j < count)
    tl.store(extra_ptr + (r * S + j) * S + i, tl.where(visible, slot, -1), mask=(j < S) & (i < S))


def triton_extend_rows(counts: torch.Tensor, seq_lens: torch.Tensor, out_slots: torch.Tensor, stride: int,
                       lead: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`spec_runtime.extend.extend_rows` in one launch: same arguments, same
    `(prefix_lens (bs,), last_rows (bs,), extra_kv (bs * stride, stride))`, all int64."""
    bs = counts.shape[0]
    dev = counts.device
    require(stride >= 1, f"stride must be >= 1, got {stride}")
    check_tensor("counts", counts, INDEX_DTYPES, (bs,), dev)
    check_tensor("seq_lens", seq_lens, INDEX_DTYPES, (bs,), dev)
    check_tensor("out_slots", out_slots, (torch.int64,), (bs * stride,), dev)
    require(out_slots.is_contiguous(), "out_slots must be contiguous")
    prefix = torch.empty(bs, dtype=torch.int64, device=dev)
    last = torch.empty(bs, dtype=torch.int64, device=dev)
    extra = torch.empty(bs * stride, stride, dtype=torch.int64, device=dev)
    if bs:
        _extend_rows_kernel[(bs,)](counts, seq_lens, out_slots, prefix, last, extra, lead, stride,
                                   SP=next_pow2(stride), num_warps=1)
    return prefix, last, extra
