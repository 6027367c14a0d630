"""The tree layout (DESIGN.md): attention mask, positions and retrieve arrays from the selected nodes."""

import torch

from spec_kernels.inputs import check_build_tree_args
from spec_kernels.inputs import require as _require

__all__ = ["build_tree", "check_build_tree_args", "tree_layout"]


def _first_true(mat: torch.Tensor) -> torch.Tensor:
    """Index of the first True along the last dim, or -1."""
    if mat.shape[-1] == 0:
        return torch.full(mat.shape[:-1], -1, dtype=torch.int64, device=mat.device)
    return torch.where(mat.any(-1), mat.to(torch.int8).argmax(-1), -1)


def _node_parents(parent_list, selected_index, topk, validate=True):
    """Parent node (bs, num_draft) of every node; -1 for the root. `validate` reads values (syncs)."""
    bs, n_sel = selected_index.shape
    width = parent_list.shape[1]
    slot = selected_index // topk
    if validate:
        _require(bool(((selected_index >= 0) & (slot < width)).all()),
                 f"selected_index values must be in [0, {topk + (width - 1) * topk}) "
                 f"for parent_list width {width}")
        _require(bool((selected_index[:, 1:] > selected_index[:, :-1]).all()),
                 "selected_index must be strictly ascending per request")
    parent_flat = parent_list.gather(1, slot)
    match = parent_flat[:, :, None] == selected_index[:, None, :]
    if validate:
        orphan = (parent_flat >= 0) & ~match.any(-1)
        _require(not bool(orphan.any()),
                 "invalid tree: a selected candidate's parent is not selected "
                 f"(rows {orphan.nonzero().tolist()} as [request, node-1]); "
                 "scores must be products of probabilities <= 1 and free of NaN")
    parents = torch.where(parent_flat < 0, 0, _first_true(match) + 1)
    root = torch.full((bs, 1), -1, dtype=torch.int64, device=selected_index.device)
    return torch.cat([root, parents], dim=1)


def _ancestor_mask(parents, num_steps, validate=True):
    """mask[b, i, j] = j is i or an ancestor of i. Pointer jumping, one step per tree level."""
    bs, n = parents.shape
    sentinel = n
    hop = torch.cat(
        [torch.where(parents < 0, sentinel, parents), torch.full((bs, 1), sentinel, device=parents.device)], 1
    )
    mask = torch.zeros((bs, n, n + 1), dtype=torch.bool, device=parents.device)
    node = torch.arange(n, device=parents.device).expand(bs, n)
    for _ in range(num_steps + 1):
        mask.scatter_(2, node[:, :, None], True)
        node = hop.gather(1, node)
    if validate:
        _require(bool((node == sentinel).all()), f"tree deeper than num_steps={num_steps}")
    return mask[:, :, :n]


def build_tree(
    parent_list: torch.Tensor,
    selected_index: torch.Tensor,
    draft_tokens: torch.Tensor,
    bonus_tokens: torch.Tensor,
    seq_lens: torch.Tensor,
    topk: int,
    num_steps: int,
    num_draft: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lay out the draft tree of each request (the ``build_tree_kernel_efficient`` semantics).

    Args:
        parent_list: ``(bs, topk*(num_steps-1)+1)`` int64 from ``organize``.
        selected_index: ``(bs, num_draft-1)`` int64, strictly ascending flat indices.
        draft_tokens: ``(bs, num_draft-1)`` int64 tokens of the selected candidates.
        bonus_tokens: ``(bs,)`` int the root token (last verified token, KV not yet computed).
        seq_lens: ``(bs,)`` int committed lengths; the root sits at position ``seq_len``.
        topk, num_steps, num_draft: tree parameters.

    Returns:
        ``(tree_mask, positions, retrieve_index, retrieve_next_token, retrieve_next_sibling, draft_token)``:

        - ``tree_mask`` ``(bs, num_draft, num_draft)`` bool: ``[b, i, j]`` iff node j is node i or an
          ancestor of it (the root is everyone's ancestor); the committed prefix is not included.
        - ``positions`` ``(bs, num_draft)`` int64: ``seq_len + depth`` (root depth 0).
        - ``retrieve_index`` ``(bs, num_draft)`` int64: ``b * num_draft + i``, the global row.
        - ``retrieve_next_token`` ``(bs, num_draft)`` int64: first child (lowest node index) or -1.
        - ``retrieve_next_sibling`` ``(bs, num_draft)`` int64: next child of the same parent (next
          higher node index) or -1.
        - ``draft_token`` ``(bs, num_draft)`` int64: ``[bonus, draft_tokens...]`` (the candidates).

    Raises:
        ValueError: on wrong shapes, unsorted ``selected_index``, or a node whose parent is not selected.
    """
    check_build_tree_args(parent_list, selected_index, draft_tokens, bonus_tokens, seq_lens, topk, num_steps,
                          num_draft)
    return tree_layout(parent_list, selected_index, draft_tokens, bonus_tokens, seq_lens, topk, num_steps,
                       num_draft)


def tree_layout(parent_list, selected_index, draft_tokens, bonus_tokens, seq_lens, topk, num_steps, num_draft,
                validate=True):
    """`build_tree`'s outputs without its argument checks; `validate=False` reads no tensor values
    (no host sync: the CUDA-graph path), and an invalid tree then gives unspecified output."""
    bs = selected_index.shape[0]
    parents = _node_parents(parent_list.long(), selected_index.long(), topk, validate)
    mask = _ancestor_mask(parents, num_steps, validate)
    positions = seq_lens.long()[:, None] + mask.sum(-1) - 1
    node = torch.arange(num_draft, device=parents.device)
    next_token = _first_true(parents[:, None, :] == node[None, :, None])
    later = node[None, :] > node[:, None]
    same_parent = (parents[:, :, None] == parents[:, None, :]) & later & (parents[:, :, None] >= 0)
    next_sibling = _first_true(same_parent)
    retrieve_index = (torch.arange(bs, device=parents.device)[:, None] * num_draft + node).contiguous()
    draft_token = torch.cat([bonus_tokens.long()[:, None], draft_tokens.long()], dim=1)
    return mask, positions, retrieve_index, next_token, next_sibling, draft_token

