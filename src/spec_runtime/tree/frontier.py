"""The draft's multi-step expansion (EAGLE-2): pick each step's frontier, follow the branches, and
choose the tree's nodes from every step's candidates (the flat score index: `spec_runtime.tree`)."""

import torch

from spec_kernels.inputs import require as _require
from spec_kernels.inputs import require_shape as _require_shape

__all__ = ["select_frontier", "gather_branches", "organize"]


def _sort_key(scores: torch.Tensor) -> torch.Tensor:
    """Scores for ranking: NaN ranks last (as -inf)."""
    return torch.where(torch.isnan(scores), float("-inf"), scores)


def _best_first(scores: torch.Tensor, count: int) -> torch.Tensor:
    """Column indices of the ``count`` best scores per row; equal scores: lower index first."""
    return torch.sort(_sort_key(scores), dim=-1, descending=True, stable=True).indices[:, :count]


# ---- multi-step expansion ---------------------------------------------------------------------


def select_frontier(
    step: int, scores: torch.Tensor | None, topk_p: torch.Tensor, topk_index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """One step of the EAGLE-2 expansion: score the candidates, pick the new frontier.

    Args:
        step: 0-based draft step ``i``.
        scores: ``(bs, topk)`` float32 cumulative scores of the current frontier; ignored (may be
            None) at step 0.
        topk_p: step 0: ``(bs, topk)`` float32 probabilities of the root's children.
            Step i>0: ``(bs, topk, topk)``: row ``[b, branch]`` holds the draft's top-k
            probabilities after frontier node ``branch``.
        topk_index: int64 tokens, same shape as ``topk_p``.

    Returns:
        ``(new_scores, new_tokens, parent_branch, record)``:

        - ``new_scores`` ``(bs, topk)`` float32: cumulative scores (products of probabilities) of the
          new frontier, best first (equal scores: lower flat index first).
        - ``new_tokens`` ``(bs, topk)`` int64: their tokens (the draft's next input ids).
        - ``parent_branch`` ``(bs, topk)`` int64: for each new frontier node, the index of the frontier
          branch it extends. Reorder per-branch state with ``gather_branches(state, parent_branch)``
          (hidden states, and the per-branch draft KV history so each branch sees its own
          ancestors). At step 0 it is all zeros: every child extends the root, so gathering a
          ``(bs, 1, ...)`` root state repeats it ``topk`` times.
        - ``record`` ``(scores_i, tokens_i, frontier_i)``: ``scores_i``/``tokens_i`` are all
          candidates of this step in flat order, ``(bs, topk)`` at step 0 and ``(bs, topk*topk)``
          later; ``frontier_i`` ``(bs, topk)`` int64 are the flat indices of the new frontier (the
          ``parent_list`` entries for the next step's children). Pass the list of records to
          ``organize``.
    """
    topk_index = topk_index.long()
    if step == 0:
        _require(topk_p.dim() == 2, f"step 0 topk_p must be (bs, topk), got {tuple(topk_p.shape)}")
        return _select_root_children(topk_p.float(), topk_index)
    _require(topk_p.dim() == 3 and topk_p.shape[1] == topk_p.shape[2],
             f"step {step} topk_p must be (bs, topk, topk), got {tuple(topk_p.shape)}")
    _require(scores is not None, f"step {step} needs the frontier scores (bs, topk)")
    return _expand_frontier(step, scores.float(), topk_p.float(), topk_index)


def _select_root_children(topk_p, topk_index):
    bs, topk = topk_p.shape
    zeros = torch.zeros((bs, topk), dtype=torch.int64, device=topk_p.device)
    flat = torch.arange(topk, device=topk_p.device).expand(bs, topk).contiguous()
    return topk_p, topk_index, zeros, (topk_p, topk_index, flat)


def _expand_frontier(step, scores, topk_p, topk_index):
    bs, topk, _ = topk_p.shape
    _require_shape("scores", scores, "(bs, topk)", (bs, topk))
    expanded = (scores[:, :, None] * topk_p).reshape(bs, topk * topk)
    tokens = topk_index.reshape(bs, topk * topk)
    chosen = _best_first(expanded, topk)
    flat = chosen + topk + (step - 1) * topk * topk
    record = (expanded, tokens, flat)
    return expanded.gather(1, chosen), tokens.gather(1, chosen), chosen // topk, record


def gather_branches(state: torch.Tensor, parent_branch: torch.Tensor) -> torch.Tensor:
    """Reorder per-branch state by parent branch: ``out[b, j] = state[b, parent_branch[b, j]]``.

    Args:
        state: ``(bs, n_branch, ...)`` (``n_branch`` = 1 for the root state at step 0, else topk).
        parent_branch: ``(bs, topk)`` int64 from ``select_frontier``.

    Returns:
        ``(bs, topk, ...)``, same dtype as ``state``.
    """
    bs, topk = parent_branch.shape
    index = parent_branch.reshape(bs, topk, *([1] * (state.dim() - 2)))
    return state.gather(1, index.expand(bs, topk, *state.shape[2:]))


def organize(
    records: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], num_draft: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pick the ``num_draft - 1`` best candidates of all steps (the EAGLE-2 rerank).

    Args:
        records: the ``num_steps`` records of ``select_frontier``, in step order.
        num_draft: tree size including the root, ``1 <= num_draft <= 1 + topk + (num_steps-1)*topk**2``.

    Returns:
        ``(parent_list, selected_index, draft_tokens)``:

        - ``parent_list`` ``(bs, topk*(num_steps-1)+1)`` int64: ``[-1, frontier_0, ..., frontier_{S-2}]``
          (see the module docstring).
        - ``selected_index`` ``(bs, num_draft-1)`` int64: flat indices of the chosen candidates,
          sorted ascending.
        - ``draft_tokens`` ``(bs, num_draft-1)`` int64: their tokens.

    Candidates are ranked by score; equal scores prefer the lower flat index. A child's score is its
    parent's score times a probability <= 1, and the parent has the lower flat index, so a chosen
    node's parent is always chosen (NaN scores rank last, as -inf, which keeps this true).
    """
    _require(len(records) >= 1, "organize needs at least one record (num_steps >= 1)")
    scores = torch.cat([r[0] for r in records], dim=1)
    tokens = torch.cat([r[1] for r in records], dim=1)
    bs, topk = records[0][2].shape
    num_candidates = scores.shape[1]
    _require(num_candidates == topk + (len(records) - 1) * topk * topk,
             f"records hold {num_candidates} candidates, expected topk + (num_steps-1)*topk^2 = "
             f"{topk + (len(records) - 1) * topk * topk} for topk={topk}, num_steps={len(records)}")
    _require(1 <= num_draft <= num_candidates + 1,
             f"num_draft must be in [1, {num_candidates + 1}] (1 + number of candidates), got {num_draft}")
    root = torch.full((bs, 1), -1, dtype=torch.int64, device=scores.device)
    parent_list = torch.cat([root] + [r[2] for r in records[:-1]], dim=1)
    selected = torch.sort(_best_first(scores, num_draft - 1), dim=1).values
    return parent_list, selected, tokens.gather(1, selected).long()
