"""The launched draft's trees -> the verify buffers with padding, in one launch
(`executors.ahead.LaunchAhead._ahead_draft_fn` for a bucket that may hold padded requests): the rows
of requests at or past the live count get what `buffers.copy_in` pads with (token 0, position 0, the
node-itself tree mask, no child or sibling, length 0, the padding slot-table row; `retrieve_index`
keeps the buffer's own). With torch ops that is a mask and a `where` per field (ten kernels)."""

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from spec_kernels._common import check_tensor, next_pow2, require

__all__ = ["TREE_FIELDS", "pad_tree_rows", "reference_pad_tree_rows"]

TREE_FIELDS = ("draft_token", "positions", "tree_mask", "retrieve_index", "retrieve_next_token",
               "retrieve_next_sibling", "seq_lens", "req_pool_indices")
"""The order of `pad_tree_rows`' sources and destinations."""


@triton.jit
def _pad_tree_rows_kernel(
    tok_ptr, pos_ptr, mask_ptr, ri_ptr, nt_ptr, ns_ptr, seq_ptr, req_ptr,  # sources: (bucket, N) int64,
    # (bucket, N, N) uint8 view of the bool mask, (bucket,) int lengths and request rows
    d_tok_ptr, d_pos_ptr, d_mask_ptr, d_ri_ptr, d_nt_ptr, d_ns_ptr, d_seq_ptr, d_req_ptr,  # same (output)
    nlive_ptr,  # () int64 live requests
    pad_row, N,
    NP: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    live = b < tl.load(nlive_ptr)
    j = tl.arange(0, NP)
    jm = j < N
    row = b * N + j
    tl.store(d_tok_ptr + row, tl.where(live, tl.load(tok_ptr + row, mask=jm), 0), mask=jm)
    tl.store(d_pos_ptr + row, tl.where(live, tl.load(pos_ptr + row, mask=jm), 0), mask=jm)
    tl.store(d_ri_ptr + row, tl.load(ri_ptr + row, mask=jm), mask=jm & live)
    tl.store(d_nt_ptr + row, tl.where(live, tl.load(nt_ptr + row, mask=jm), -1), mask=jm)
    tl.store(d_ns_ptr + row, tl.where(live, tl.load(ns_ptr + row, mask=jm), -1), mask=jm)
    r = j[:, None]
    c = j[None, :]
    cell = (r < N) & (c < N)
    at = b * N * N + r * N + c
    m = tl.load(mask_ptr + at, mask=cell, other=0)
    tl.store(d_mask_ptr + at, tl.where(live, m, (r == c).to(tl.uint8)), mask=cell)
    tl.store(d_seq_ptr + b, tl.where(live, tl.load(seq_ptr + b), 0))
    tl.store(d_req_ptr + b, tl.where(live, tl.load(req_ptr + b), pad_row))


def pad_tree_rows(src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor], nlive: torch.Tensor,
                  pad_row: int) -> None:
    """`reference_pad_tree_rows` in one launch: `src` and `dst` in `TREE_FIELDS` order, the first six
    `(bucket, N)` int64 (the mask `(bucket, N, N)` bool), the last two `(bucket,)` int64; the
    destinations contiguous (a source that is not is copied first)."""
    require(len(src) == len(dst) == len(TREE_FIELDS), f"pad_tree_rows takes {len(TREE_FIELDS)} sources and "
            f"destinations ({', '.join(TREE_FIELDS)}), got {len(src)} and {len(dst)}")
    bucket, n = src[0].shape
    dev = src[0].device
    for name, s, d in zip(TREE_FIELDS, src, dst):
        shape = (bucket, n, n) if name == "tree_mask" else (bucket,) if name in TREE_FIELDS[6:] else (bucket, n)
        dtype = torch.bool if name == "tree_mask" else torch.int64
        check_tensor(name, s, (dtype,), shape, dev)
        check_tensor(f"the buffer's {name}", d, (dtype,), shape, dev)
        require(d.is_contiguous(), f"the buffer's {name} must be contiguous")
    check_tensor("nlive", nlive, (torch.int64,), (), dev)
    if bucket:
        views = [t.view(torch.uint8) if t.dtype == torch.bool else t
                 for t in (*(s.contiguous() for s in src), *dst)]
        _pad_tree_rows_kernel[(bucket,)](*views, nlive, pad_row, n, NP=max(2, next_pow2(n)), num_warps=1)


def reference_pad_tree_rows(src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor], nlive: torch.Tensor,
                            pad_row: int) -> None:
    """Copy each source into its destination, requests `>= nlive` padded: token and position 0, the
    mask's diagonal, `retrieve_index` left as the destination holds it, next token and sibling -1,
    length 0, request row `pad_row`."""
    bucket, n = src[0].shape
    live = torch.arange(bucket, device=nlive.device) < nlive
    eye = torch.eye(n, dtype=torch.bool, device=nlive.device)
    pads = (0, 0, eye, None, -1, -1, 0, pad_row)
    for s, d, pad in zip(src, dst, pads):
        keep = live.view(-1, *([1] * (s.dim() - 1)))
        d.copy_(torch.where(keep, s, d if pad is None else pad))
