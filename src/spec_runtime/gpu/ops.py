"""Sync-free versions of the reference tree and sampling functions, for the static (CUDA-graph) path.

Each computes exactly what its reference computes (`tree.build_tree`,
`sampling.probs_from_logits_batched`) with the same torch operations, minus the checks that read
tensor values on the host (those would sync the GPU and cannot be captured). The eager path keeps
the validating references; `tests/runtime/test_static_executor.py` checks both give the same tokens.
"""

import math

import torch

from spec_runtime.sampling import _top_k_top_p
from spec_runtime.tree import _first_true

__all__ = ["build_tree_nosync", "probs_nosync"]


def _node_parents(parent_list: torch.Tensor, selected_index: torch.Tensor, topk: int) -> torch.Tensor:
    """Parent node (bs, num_draft) of every node, -1 for the root (`tree._node_parents` unchecked)."""
    bs = selected_index.shape[0]
    parent_flat = parent_list.gather(1, selected_index // topk)
    match = parent_flat[:, :, None] == selected_index[:, None, :]
    parents = torch.where(parent_flat < 0, 0, _first_true(match) + 1)
    root = torch.full((bs, 1), -1, dtype=torch.int64, device=selected_index.device)
    return torch.cat([root, parents], dim=1)


def _ancestor_mask(parents: torch.Tensor, num_steps: int) -> torch.Tensor:
    """mask[b, i, j] = j is i or an ancestor of i (`tree._ancestor_mask` without its depth check)."""
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
    return mask[:, :, :n]


def build_tree_nosync(
    parent_list: torch.Tensor,
    selected_index: torch.Tensor,
    draft_tokens: torch.Tensor,
    bonus_tokens: torch.Tensor,
    seq_lens: torch.Tensor,
    topk: int,
    num_steps: int,
    num_draft: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`tree.build_tree` without host reads (same arguments, same outputs on valid trees).

    Invalid trees (a parent not selected, NaN scores) are not detected here; the eager path's
    `build_tree` raises on them."""
    bs = selected_index.shape[0]
    parents = _node_parents(parent_list.long(), selected_index.long(), topk)
    mask = _ancestor_mask(parents, num_steps)
    positions = seq_lens.long()[:, None] + mask.sum(-1) - 1
    node = torch.arange(num_draft, device=parents.device)
    next_token = _first_true(parents[:, None, :] == node[None, :, None])
    later = node[None, :] > node[:, None]
    same_parent = (parents[:, :, None] == parents[:, None, :]) & later & (parents[:, :, None] >= 0)
    next_sibling = _first_true(same_parent)
    retrieve_index = (torch.arange(bs, device=parents.device)[:, None] * num_draft + node).contiguous()
    draft_token = torch.cat([bonus_tokens.long()[:, None], draft_tokens.long()], dim=1)
    return mask, positions, retrieve_index, next_token, next_sibling, draft_token


def probs_nosync(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """`sampling.probs_from_logits_batched` without its value checks (the parameters were validated
    when the requests were admitted)."""
    bs, vocab = logits.shape[0], logits.shape[-1]
    n = math.prod(logits.shape[1:-1])
    def per_row(t: torch.Tensor) -> torch.Tensor:  # repeat_interleave(n) as an expand (no sync)
        return t[:, None].expand(bs, n).reshape(bs * n)

    temp = per_row(temperature.float())
    flat = logits.reshape(bs * n, vocab).float()
    greedy = temp == 0
    probs = torch.softmax(flat / torch.where(greedy, 1.0, temp)[:, None], dim=-1)
    probs = _top_k_top_p(probs, per_row(top_k.long()), per_row(top_p.float()))
    # a scatter, not F.one_hot: the same values without one_hot's range checks
    one_hot = torch.zeros_like(flat).scatter_(1, flat.argmax(-1, keepdim=True), 1.0)
    probs = torch.where(greedy[:, None], one_hot, probs)
    return probs.reshape(logits.shape)
