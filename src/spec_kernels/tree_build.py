"""Tree layout on the GPU: `tree.build_tree`'s signature and outputs, one program per request.

Node `i >= 1` is the candidate `selected_index[i-1]`; its parent is the node whose candidate is
`parent_list[selected_index[i-1] // topk]` (the root when that is -1). From the parent vector the
program derives the ancestor mask (`num_steps` hops), depths, first children and next siblings with
`(num_draft, num_draft)` register compares: no scratch memory, no host sync.

Invalid input (index out of range, unsorted `selected_index`, orphan, too deep) is recorded as
per-request error bits; `validate=True` reads them (one sync) and raises the reference's
`ValueError`. With `validate=False` (the default, graph-capturable) invalid trees give unspecified
but in-bounds output.
"""

import torch
import triton
import triton.language as tl

from spec_kernels._common import INDEX_DTYPES, check_tensor, next_pow2, require
from spec_kernels.inputs import check_build_tree_args

__all__ = ["triton_build_tree"]

_ERR_RANGE, _ERR_ORDER, _ERR_ORPHAN, _ERR_DEPTH = 1, 2, 4, 8


@triton.jit
def _build_tree_kernel(
    parent_list_ptr,  # (bs, W) int flat index of each frontier node, -1 = root
    selected_ptr,  # (bs, N-1) int flat indices of the selected candidates, ascending
    draft_ptr,  # (bs, N-1) int their tokens
    bonus_ptr,  # (bs,) int root tokens
    seq_lens_ptr,  # (bs,) int committed lengths
    mask_ptr,  # (bs, N, N) uint8 view of the bool tree mask (output)
    positions_ptr,  # (bs, N) int64 (output)
    retrieve_index_ptr,  # (bs, N) int64 (output)
    next_token_ptr,  # (bs, N) int64 (output)
    next_sibling_ptr,  # (bs, N) int64 (output)
    draft_token_ptr,  # (bs, N) int64 (output)
    error_ptr,  # (bs,) int32 error bits (output)
    N, W, topk, num_steps, s_pl, s_sel, s_dr,
    NP: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, NP)  # node index along rows
    is_node = i < N
    is_draft = (i >= 1) & is_node
    sel = tl.load(selected_ptr + b * s_sel + (i - 1), mask=is_draft, other=-1).to(tl.int64)
    prev = tl.load(selected_ptr + b * s_sel + (i - 2), mask=is_draft & (i >= 2), other=-1).to(tl.int64)
    slot = sel // topk
    in_range = (sel >= 0) & (slot < W)
    pf = tl.load(parent_list_ptr + b * s_pl + slot, mask=is_draft & in_range, other=-1).to(tl.int64)
    # match[i, j]: node j holds the candidate that is node i's parent.
    match = (pf[:, None] == sel[None, :]) & is_draft[None, :] & (pf >= 0)[:, None]
    first = tl.min(tl.where(match, i[None, :], NP), 1)
    orphan = is_draft & in_range & (pf >= 0) & (first == NP)
    parent = tl.where(is_draft, tl.where(pf < 0, 0, tl.where(first < NP, first, -1)), -1)

    # Ancestor mask: self, then num_steps hops up the parent vector (a gather by compare).
    anc = (i[:, None] == i[None, :]) & is_node[:, None]
    cur = parent
    for _ in range(num_steps):
        anc = anc | ((i[None, :] == cur[:, None]) & (cur >= 0)[:, None])
        cur = tl.sum(tl.where(i[None, :] == cur[:, None], parent[None, :], 0), 1) + tl.where(cur < 0, -1, 0)
    too_deep = is_node & (cur >= 0)

    err = tl.max(tl.where(is_draft & ~in_range, 1, 0), 0)
    err |= tl.max(tl.where(is_draft & (i >= 2) & (sel <= prev), 2, 0), 0)
    err |= tl.max(tl.where(orphan, 4, 0), 0)
    err |= tl.max(tl.where(too_deep, 8, 0), 0)
    tl.store(error_ptr + b, err.to(tl.int32))

    nn = b * N * N
    cell = is_node[:, None] & is_node[None, :]
    tl.store(mask_ptr + nn + i[:, None] * N + i[None, :], anc.to(tl.uint8), mask=cell)
    row = b * N + i
    depth = tl.sum(anc.to(tl.int64), 1) - 1
    tl.store(positions_ptr + row, tl.load(seq_lens_ptr + b).to(tl.int64) + depth, mask=is_node)
    tl.store(retrieve_index_ptr + row, row, mask=is_node)
    child = (parent[None, :] == i[:, None]) & is_node[None, :]
    first_child = tl.min(tl.where(child, i[None, :], NP), 1)
    tl.store(next_token_ptr + row, tl.where(first_child < NP, first_child, -1).to(tl.int64), mask=is_node)
    sibling = (parent[None, :] == parent[:, None]) & (i[None, :] > i[:, None]) & (parent >= 0)[:, None]
    sibling = sibling & is_node[None, :]
    next_sib = tl.min(tl.where(sibling, i[None, :], NP), 1)
    tl.store(next_sibling_ptr + row, tl.where(next_sib < NP, next_sib, -1).to(tl.int64), mask=is_node)
    tok = tl.load(draft_ptr + b * s_dr + (i - 1), mask=is_draft, other=0).to(tl.int64)
    tok = tl.where(i == 0, tl.load(bonus_ptr + b).to(tl.int64), tok)
    tl.store(draft_token_ptr + row, tok, mask=is_node)


def _check_shapes(parent_list, selected_index, draft_tokens, bonus_tokens, seq_lens, topk, num_steps, num_draft):
    """The reference's checks and messages, plus dtype and device."""
    check_build_tree_args(parent_list, selected_index, draft_tokens, bonus_tokens, seq_lens, topk, num_steps,
                          num_draft)
    dev = selected_index.device
    for name, t in (("parent_list", parent_list), ("selected_index", selected_index),
                    ("draft_tokens", draft_tokens), ("bonus_tokens", bonus_tokens), ("seq_lens", seq_lens)):
        check_tensor(name, t, INDEX_DTYPES, tuple(t.shape), dev)


def _raise_errors(err: torch.Tensor, topk: int, num_steps: int) -> None:
    """Raise the reference's ValueError for the first failing check (reads err: one sync)."""
    width = topk * (num_steps - 1) + 1
    bits = err.tolist()
    bad = lambda bit: [b for b, e in enumerate(bits) if e & bit]  # noqa: E731
    require(
        not bad(_ERR_RANGE),
        f"selected_index values must be in [0, {topk + (width - 1) * topk}) for parent_list width {width}",
    )
    require(not bad(_ERR_ORDER), "selected_index must be strictly ascending per request")
    require(
        not bad(_ERR_ORPHAN),
        f"invalid tree: a selected candidate's parent is not selected (requests {bad(_ERR_ORPHAN)}); "
        "scores must be products of probabilities <= 1 and free of NaN",
    )
    require(not bad(_ERR_DEPTH), f"tree deeper than num_steps={num_steps}")


def triton_build_tree(
    parent_list: torch.Tensor,
    selected_index: torch.Tensor,
    draft_tokens: torch.Tensor,
    bonus_tokens: torch.Tensor,
    seq_lens: torch.Tensor,
    topk: int,
    num_steps: int,
    num_draft: int,
    *,
    validate: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`tree.build_tree` on the GPU: same arguments, same outputs
    `(tree_mask, positions, retrieve_index, retrieve_next_token, retrieve_next_sibling, draft_token)`.

    `validate=True` checks the tree (one host sync) and raises the reference's `ValueError`; without
    it an invalid tree gives unspecified output.
    """
    _check_shapes(parent_list, selected_index, draft_tokens, bonus_tokens, seq_lens, topk, num_steps, num_draft)
    bs, n, dev = selected_index.shape[0], num_draft, selected_index.device
    mask = torch.empty((bs, n, n), dtype=torch.bool, device=dev)  # every cell written: no fill launch
    outs = [torch.empty((bs, n), dtype=torch.int64, device=dev) for _ in range(5)]
    if bs == 0:
        return (mask, *outs)
    err = torch.empty((bs,), dtype=torch.int32, device=dev)
    parent_list, bonus_tokens, seq_lens = parent_list.contiguous(), bonus_tokens.contiguous(), seq_lens.contiguous()
    if n == 1:  # no drafts: pass 1-column dummies rather than empty tensors (never read)
        selected_index = draft_tokens = torch.zeros((bs, 1), dtype=torch.int64, device=dev)
    selected_index, draft_tokens = selected_index.contiguous(), draft_tokens.contiguous()
    positions, retrieve_index, next_token, next_sibling, draft_token = outs
    _build_tree_kernel[(bs,)](
        parent_list, selected_index, draft_tokens, bonus_tokens, seq_lens,
        mask.view(torch.uint8), positions, retrieve_index, next_token, next_sibling, draft_token, err,
        n, parent_list.shape[1], topk, num_steps,
        parent_list.stride(0), selected_index.stride(0), draft_tokens.stride(0),
        NP=max(2, next_pow2(n)), num_warps=1 if n <= 16 else 4,
    )
    if validate:
        _raise_errors(err, topk, num_steps)
    return mask, positions, retrieve_index, next_token, next_sibling, draft_token
