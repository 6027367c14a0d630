"""Sync-free versions of the reference tree and sampling functions, for the static (CUDA-graph) path.

Each computes exactly what its reference computes (`tree.build_tree`,
`sampling.probs_from_logits_batched`) with the same torch operations, minus the checks that read
tensor values on the host (those would sync the GPU and cannot be captured). The eager path keeps
the validating references; `tests/runtime/test_static_executor.py` checks both give the same tokens.
"""

import math

import torch

from spec_runtime.sampling import _top_k_top_p
from spec_runtime.tree import tree_layout

__all__ = ["build_tree_nosync", "probs_nosync"]


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
    return tree_layout(parent_list, selected_index, draft_tokens, bonus_tokens, seq_lens, topk, num_steps,
                       num_draft, validate=False)


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
