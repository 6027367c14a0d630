"""EAGLE-2 dynamic draft trees: multi-step expansion, tree layout, and tree verification.

Pure-torch reference, vectorized over the batch; Python loops run only over the draft depth
(``num_steps``) or the tree size (``num_draft``). Axis names follow DESIGN.md.

Flat score index (one number per draft candidate, per request)
----------------------------------------------------------------
Step 0 offers ``topk`` candidates (children of the root) with flat indices ``0 .. topk-1``.
Step ``i >= 1`` offers ``topk * topk`` candidates (``topk`` children of each of the ``topk``
frontier nodes chosen at step ``i-1``) with flat indices ``topk + (i-1)*topk**2 + j``, where
``j = branch * topk + c`` for child rank ``c`` of frontier branch ``branch``. So
``flat // topk - 1 - (i-1)*topk == branch`` and ``flat // topk == 0`` exactly for the root's children.

``parent_list`` (bs, topk*(num_steps-1)+1): entry 0 is -1 (the root); entries
``1 + (i-1)*topk + branch`` (``i >= 1``) hold the flat index of frontier node ``branch`` of step
``i-1``. The parent of candidate ``f`` is therefore ``parent_list[f // topk]`` (-1 = root).

Tree layout (DESIGN.md): node 0 is the root (the bonus token); node ``i >= 1`` is the candidate
``selected_index[i-1]``; ``selected_index`` is sorted ascending, so a parent precedes its children.
"""

import torch

from spec_runtime import faults
from spec_runtime.sampling import sample_from_probs

__all__ = [
    "select_frontier",
    "gather_branches",
    "organize",
    "build_tree",
    "verify_greedy",
    "verify_tree_sampling",
    "verify_chain_rejection",
]


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _sort_key(scores: torch.Tensor) -> torch.Tensor:
    """Scores for ranking: NaN ranks last (as -inf)."""
    return torch.where(torch.isnan(scores), float("-inf"), scores)


def _best_first(scores: torch.Tensor, count: int) -> torch.Tensor:
    """Column indices of the ``count`` best scores per row; equal scores: lower index first."""
    return torch.sort(_sort_key(scores), dim=-1, descending=True, stable=True).indices[:, :count]


# ----------------------------------------------------------------------------------------------
# Multi-step expansion
# ----------------------------------------------------------------------------------------------


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
    _require(
        topk_p.dim() == 3 and topk_p.shape[1] == topk_p.shape[2],
        f"step {step} topk_p must be (bs, topk, topk), got {tuple(topk_p.shape)}",
    )
    _require(scores is not None, f"step {step} needs the frontier scores (bs, topk)")
    return _expand_frontier(step, scores.float(), topk_p.float(), topk_index)


def _select_root_children(topk_p, topk_index):
    bs, topk = topk_p.shape
    zeros = torch.zeros((bs, topk), dtype=torch.int64, device=topk_p.device)
    flat = torch.arange(topk, device=topk_p.device).expand(bs, topk).contiguous()
    return topk_p, topk_index, zeros, (topk_p, topk_index, flat)


def _expand_frontier(step, scores, topk_p, topk_index):
    bs, topk, _ = topk_p.shape
    _require(
        tuple(scores.shape) == (bs, topk),
        f"scores must be (bs, topk) = {(bs, topk)}, got {tuple(scores.shape)}",
    )
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
    _require(
        num_candidates == topk + (len(records) - 1) * topk * topk,
        f"records hold {num_candidates} candidates, expected topk + (num_steps-1)*topk^2 = "
        f"{topk + (len(records) - 1) * topk * topk} for topk={topk}, num_steps={len(records)}",
    )
    _require(
        1 <= num_draft <= num_candidates + 1,
        f"num_draft must be in [1, {num_candidates + 1}] (1 + number of candidates), got {num_draft}",
    )
    root = torch.full((bs, 1), -1, dtype=torch.int64, device=scores.device)
    parent_list = torch.cat([root] + [r[2] for r in records[:-1]], dim=1)
    selected = torch.sort(_best_first(scores, num_draft - 1), dim=1).values
    return parent_list, selected, tokens.gather(1, selected).long()


# ----------------------------------------------------------------------------------------------
# Tree layout
# ----------------------------------------------------------------------------------------------


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
        _require(
            bool(((selected_index >= 0) & (slot < width)).all()),
            f"selected_index values must be in [0, {topk + (width - 1) * topk}) for parent_list width {width}",
        )
        _require(
            bool((selected_index[:, 1:] > selected_index[:, :-1]).all()),
            "selected_index must be strictly ascending per request",
        )
    parent_flat = parent_list.gather(1, slot)
    match = parent_flat[:, :, None] == selected_index[:, None, :]
    if validate:
        orphan = (parent_flat >= 0) & ~match.any(-1)
        _require(
            not bool(orphan.any()),
            f"invalid tree: a selected candidate's parent is not selected (rows {orphan.nonzero().tolist()} "
            "as [request, node-1]); scores must be products of probabilities <= 1 and free of NaN",
        )
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


def check_build_tree_args(parent_list, selected_index, draft_tokens, bonus_tokens, seq_lens, topk, num_steps,
                          num_draft) -> None:
    """`build_tree`'s argument checks (shapes and tree parameters; no tensor values read).

    Raises:
        ValueError: naming the argument and its expected shape.
    """
    bs = selected_index.shape[0]
    width = topk * (num_steps - 1) + 1
    _require(num_steps >= 1 and topk >= 1 and num_draft >= 1, "topk, num_steps and num_draft must be >= 1")
    _require(
        tuple(parent_list.shape) == (bs, width),
        f"parent_list must be (bs, topk*(num_steps-1)+1) = {(bs, width)}, got {tuple(parent_list.shape)}",
    )
    for name, t in (("selected_index", selected_index), ("draft_tokens", draft_tokens)):
        _require(
            tuple(t.shape) == (bs, num_draft - 1),
            f"{name} must be (bs, num_draft-1) = {(bs, num_draft - 1)}, got {tuple(t.shape)}",
        )
    for name, t in (("bonus_tokens", bonus_tokens), ("seq_lens", seq_lens)):
        _require(tuple(t.shape) == (bs,), f"{name} must be (bs,) = ({bs},), got {tuple(t.shape)}")


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


# ----------------------------------------------------------------------------------------------
# Verification
# ----------------------------------------------------------------------------------------------


def _tree_links(next_token, next_sibling):
    """From the retrieve arrays: parent (bs, N) (-1 = none) and rank among siblings (bs, N)."""
    bs, n = next_token.shape
    parent = torch.full((bs, n + 1), -1, dtype=torch.int64, device=next_token.device)
    rank = torch.full((bs, n + 1), n, dtype=torch.int64, device=next_token.device)
    owner = torch.arange(n, device=next_token.device).expand(bs, n)
    child = next_token
    for r in range(n - 1):
        dump = torch.where(child >= 0, child, n)
        parent.scatter_(1, dump, owner)
        rank.scatter_(1, dump, torch.full_like(dump, r))
        child = torch.where(child >= 0, next_sibling.gather(1, child.clamp(min=0)), -1)
    return parent[:, :n], rank[:, :n]


def check_verify_shapes(candidates, retrieve_index, next_token, next_sibling, num_steps) -> None:
    """The verify functions' shape checks (no tensor values read); raises ValueError."""
    shape = tuple(candidates.shape)
    _require(len(shape) == 2 and shape[1] >= 1, f"candidates must be (bs, num_draft), got {shape}")
    for name, t in (
        ("retrieve_index", retrieve_index),
        ("retrieve_next_token", next_token),
        ("retrieve_next_sibling", next_sibling),
    ):
        _require(tuple(t.shape) == shape, f"{name} must be (bs, num_draft) = {shape}, got {tuple(t.shape)}")
    _require(num_steps >= 0, f"num_steps must be >= 0, got {num_steps}")


def _empty_outputs(bs, num_draft, num_steps, device):
    predicts = torch.zeros(bs * num_draft + 1, dtype=torch.int64, device=device)  # last slot: dump
    accept_index = torch.full((bs, num_steps + 1), -1, dtype=torch.int64, device=device)
    return predicts, accept_index


def _take(t, node):
    """t[b, node[b]] for (bs, N) t and (bs,) node."""
    return t.gather(1, node[:, None]).squeeze(1)


def _accept_walk(candidates, retrieve_index, next_token, next_sibling, num_steps, choose):
    """Shared tree walk; ``choose(level, cur, active, is_child, rank) -> (found (bs,), child (bs,))``.

    Returns (predicts with a trailing dump slot, accept_index, num_correct, last node, still active,
    parent node of every node).
    """
    bs, n = candidates.shape
    parent, rank = _tree_links(next_token.long(), next_sibling.long())
    predicts, accept_index = _empty_outputs(bs, n, num_steps, candidates.device)
    cur = torch.zeros(bs, dtype=torch.int64, device=candidates.device)
    active = torch.ones(bs, dtype=torch.bool, device=candidates.device)
    accept_index[:, 0] = retrieve_index[:, 0]
    dump = bs * n
    for level in range(num_steps):
        is_child = (parent == cur[:, None]) & active[:, None]
        found, child = choose(level, cur, active, is_child, rank)
        rows = torch.where(found, _take(retrieve_index, cur), dump)
        predicts.scatter_(0, rows, _take(candidates, child))
        accept_index[:, level + 1] = torch.where(found, _take(retrieve_index, child), -1)
        cur = torch.where(found, child, cur)
        active = active & found
    return predicts, accept_index, (accept_index[:, 1:] >= 0).sum(1).int(), cur, active, parent


def _first_by_rank(ok, rank):
    """(found, node) of the lowest-rank True entry of ok (bs, N)."""
    n = ok.shape[1]
    return ok.any(-1), torch.where(ok, rank, n).argmin(-1)


def verify_greedy(
    candidates: torch.Tensor,
    retrieve_index: torch.Tensor,
    retrieve_next_token: torch.Tensor,
    retrieve_next_sibling: torch.Tensor,
    target_predict: torch.Tensor,
    num_steps: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy tree verification (the ``verify_tree_greedy`` semantics).

    Walks from the root; at each level takes the first child (``next_token``, then the sibling
    chain) whose candidate token equals ``target_predict`` at the current node; stops when none
    matches or after ``num_steps`` levels.

    Args:
        candidates: ``(bs, num_draft)`` int64 tree tokens (node 0 = root).
        retrieve_index, retrieve_next_token, retrieve_next_sibling: ``(bs, num_draft)`` int64 from
            ``build_tree`` (-1 = none).
        target_predict: ``(bs, num_draft)`` int64 target argmax at every node.
        num_steps: maximum number of accepted drafts (draft depth).

    Returns:
        ``(predicts, accept_index, num_correct_drafts)``:

        - ``predicts`` ``(bs*num_draft,)`` int64, by global row: at each accepted path node, the next
          emitted token (the accepted child's token; the bonus ``target_predict`` at the last node).
          Rows off the path stay 0.
        - ``accept_index`` ``(bs, num_steps+1)`` int64: root row then the accepted rows, -1 padded.
        - ``num_correct_drafts`` ``(bs,)`` int32: accepted drafts (bonus excluded). The emitted
          tokens are ``predicts[accept_index[b, :num_correct_drafts[b] + 1]]``.
    """
    check_verify_shapes(candidates, retrieve_index, retrieve_next_token, retrieve_next_sibling, num_steps)
    _require(
        tuple(target_predict.shape) == tuple(candidates.shape),
        f"target_predict must be {tuple(candidates.shape)}, got {tuple(target_predict.shape)}",
    )
    candidates, target_predict = candidates.long(), target_predict.long()

    def choose(level, cur, active, is_child, rank):
        wanted = _take(target_predict, cur)
        return _first_by_rank(is_child & (candidates == wanted[:, None]), rank)

    predicts, accept_index, num_correct, cur, _, _ = _accept_walk(
        candidates, retrieve_index.long(), retrieve_next_token, retrieve_next_sibling, num_steps, choose
    )
    predicts.scatter_(0, _take(retrieve_index.long(), cur), _take(target_predict, cur))
    return predicts[:-1], accept_index, num_correct


def verify_tree_sampling(
    candidates: torch.Tensor,
    retrieve_index: torch.Tensor,
    retrieve_next_token: torch.Tensor,
    retrieve_next_sibling: torch.Tensor,
    target_probs: torch.Tensor,
    uniform: torch.Tensor,
    uniform_final: torch.Tensor,
    num_steps: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lossless tree verification for a deterministic (top-k) draft.

    At the current node ``cur`` with coin ``u = uniform[b, cur]``, the children are tried in order
    (``next_token`` then the sibling chain) with ``prob_acc += q[cur][token]``; the first child with
    ``u <= prob_acc`` is accepted. If none is, the walk stops and the bonus token is drawn from
    ``q[cur]`` with every child token zeroed, renormalized (inverse CDF with ``uniform_final``). If
    the walk stops at depth ``num_steps`` or at a leaf, the bonus is drawn from ``q[cur]`` unchanged.

    Why this is exact: let the children carry distinct tokens x_1..x_m and q = q[cur]. Child j is
    accepted iff sum_{i<j} q(x_i) < u <= sum_{i<=j} q(x_i), with probability q(x_j). Nothing is
    accepted with probability R = 1 - sum_i q(x_i), and then y (not a child token) is drawn with
    probability q(y) / R, so P(emit y) = q(y). Every token is emitted with probability q, and after
    accepting x_j the walk continues at that child, whose q is the target conditioned on the path.

    Conventions: a token repeated among siblings counts once (the later duplicates add no mass and
    can never be accepted), and it is zeroed once in the residual. A child with zero mass is never
    accepted (even at ``u == 0``). If the children hold all of ``q``'s mass (empty residual),
    ``u`` is capped at that mass so rounding cannot reject them all.

    Args:
        candidates, retrieve_index, retrieve_next_token, retrieve_next_sibling: as in ``verify_greedy``.
        target_probs: ``(bs, num_draft, vocab)`` float32, the target distribution at every node.
        uniform: ``(bs, num_draft)`` float32 in [0, 1), the coin of each node.
        uniform_final: ``(bs,)`` float32 in [0, 1), the draw for the bonus token.
        num_steps: maximum number of accepted drafts.

    Returns:
        ``(predicts, accept_index, num_correct_drafts)`` as in ``verify_greedy``.
    """
    check_verify_shapes(candidates, retrieve_index, retrieve_next_token, retrieve_next_sibling, num_steps)
    bs, n = candidates.shape
    _require(
        target_probs.dim() == 3 and tuple(target_probs.shape[:2]) == (bs, n),
        f"target_probs must be (bs, num_draft, vocab) with (bs, num_draft) = {(bs, n)}, got {tuple(target_probs.shape)}",
    )
    _require(
        tuple(uniform.shape) == (bs, n),
        f"uniform must be (bs, num_draft) = {(bs, n)}, got {tuple(uniform.shape)}",
    )
    _require(
        tuple(uniform_final.shape) == (bs,),
        f"uniform_final must be (bs,) = ({bs},), got {tuple(uniform_final.shape)}",
    )
    candidates, probs = candidates.long(), target_probs.float()
    rows = torch.arange(bs, device=probs.device)

    duplicate = _repeated_sibling_tokens(candidates, retrieve_next_token.long(), retrieve_next_sibling.long())

    def choose(level, cur, active, is_child, rank):
        return _accept_child(
            probs[rows, cur], candidates, is_child & ~duplicate, rank, _take(uniform.float(), cur)
        )

    predicts, accept_index, num_correct, cur, active, parent = _accept_walk(
        candidates, retrieve_index.long(), retrieve_next_token, retrieve_next_sibling, num_steps, choose
    )
    # A walk that stopped early was rejected at cur (or cur is a leaf, with no children to zero):
    # the bonus comes from q[cur] without the tried children. At the depth cap it is q[cur] itself.
    tried = (parent == cur[:, None]) & ~active[:, None]
    bonus = sample_from_probs(_without_tokens(probs[rows, cur], candidates, tried), uniform_final)
    predicts.scatter_(0, _take(retrieve_index.long(), cur), bonus)
    return predicts[:-1], accept_index, num_correct


def _without_tokens(q, tokens, which):
    """q (bs, vocab) with the tokens[b, j] where which[b, j] set to 0."""
    vocab = q.shape[1]
    hit = torch.zeros((q.shape[0], vocab + 1), dtype=torch.bool, device=q.device)
    hit.scatter_(1, torch.where(which, tokens, vocab), True)
    return q.masked_fill(hit[:, :vocab], 0.0)


def _repeated_sibling_tokens(candidates, next_token, next_sibling):
    """(bs, N) bool: node j repeats the token of an earlier sibling (it adds no mass, never wins)."""
    parent, rank = _tree_links(next_token, next_sibling)
    same_parent = (parent[:, None, :] == parent[:, :, None]) & (parent[:, :, None] >= 0)
    earlier = same_parent & (rank[:, None, :] < rank[:, :, None])  # [b, j, k]: k tried before j
    return (earlier & (candidates[:, None, :] == candidates[:, :, None])).any(-1)


def _accept_child(q_cur, candidates, is_child, rank, u):
    """One level of tree sampling over the children with distinct tokens: (found (bs,), child (bs,))."""
    n, vocab = candidates.shape[1], q_cur.shape[1]
    mass = torch.where(is_child, q_cur.gather(1, candidates.clamp(0, vocab - 1)), 0.0)
    if faults.active("accept_ratio_1_3x"):  # bug zoo: each child accepted with 1.3 x its target mass
        mass = mass * 1.3
    # prob_acc in try order; a sequential cumsum of non-negatives is monotone even when rounded.
    order = torch.sort(torch.where(is_child, rank, n), dim=1, stable=True).indices
    running = torch.cumsum(mass.gather(1, order), dim=1)
    prob_acc = torch.empty_like(running).scatter_(1, order, running)
    # Empty residual (every token of positive mass is a child): cap u so rounding cannot reject all.
    residual_empty = (q_cur > 0).sum(-1) <= (mass > 0).sum(-1)
    u = torch.where(residual_empty, torch.minimum(u, running[:, -1]), u)
    return _first_by_rank(is_child & (mass > 0) & (u[:, None] <= prob_acc), rank)


def verify_chain_rejection(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    uniform: torch.Tensor,
    uniform_final: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling (Leviathan et al.) for a chain of ``k`` drafts sampled from ``p``.

    Args:
        draft_tokens: ``(bs, k)`` int64, draft ``j`` sampled from ``draft_probs[:, j]``.
        draft_probs: ``(bs, k, vocab)`` float32, the draft distribution ``p`` at each draft.
        target_probs: ``(bs, k+1, vocab)`` float32, the target ``q`` at each draft and after the last.
        uniform: ``(bs, k)`` float32 in [0, 1), one coin per draft.
        uniform_final: ``(bs,)`` float32 in [0, 1), the draw for the correction / bonus token.

    Returns:
        ``(tokens, num_correct_drafts)``: ``tokens`` ``(bs, k+1)`` int64 = the accepted drafts, then the
        correction (first rejection) or bonus (all accepted) token, then -1 padding;
        ``num_correct_drafts`` ``(bs,)`` int32.
    """
    bs, k = draft_tokens.shape
    vocab = target_probs.shape[-1]
    _require(
        tuple(draft_probs.shape) == (bs, k, vocab),
        f"draft_probs must be (bs, k, vocab) = {(bs, k, vocab)}, got {tuple(draft_probs.shape)}",
    )
    _require(
        tuple(target_probs.shape) == (bs, k + 1, vocab),
        f"target_probs must be (bs, k+1, vocab) = {(bs, k + 1, vocab)}, got {tuple(target_probs.shape)}",
    )
    _require(
        tuple(uniform.shape) == (bs, k), f"uniform must be (bs, k) = {(bs, k)}, got {tuple(uniform.shape)}"
    )
    _require(
        tuple(uniform_final.shape) == (bs,),
        f"uniform_final must be (bs,) = ({bs},), got {tuple(uniform_final.shape)}",
    )
    tokens, p, q = draft_tokens.long(), draft_probs.float(), target_probs.float()
    p_x = p.gather(2, tokens[:, :, None]).squeeze(2)
    q_x = q[:, :k].gather(2, tokens[:, :, None]).squeeze(2)
    if faults.active("accept_ratio_1_3x"):  # bug zoo: accept with min(1, 1.3 q/p)
        q_x = q_x * 1.3
    # q >= p: always accept draft token; q < p: accept with probability q/p (u * p < q).
    # A token the target gives no mass is never accepted.
    accept = (q_x > 0) & ((q_x >= p_x) | (uniform.float() * p_x < q_x))
    num_correct = accept.long().cumprod(1).sum(1)
    bonus = sample_from_probs(_correction_dist(p, q, num_correct), uniform_final)
    slot = torch.arange(k + 1, device=tokens.device)[None, :]
    padded = torch.cat([tokens, torch.full((bs, 1), -1, dtype=torch.int64, device=tokens.device)], 1)
    out = torch.where(slot < num_correct[:, None], padded, -1)
    out = torch.where(slot == num_correct[:, None], bonus[:, None], out)
    return out, num_correct.int()


def _correction_dist(p, q, num_correct):
    """norm(max(q - p, 0)) at the first rejection (q if that is empty); q[k] if all accepted."""
    bs, k, vocab = p.shape
    rows = torch.arange(bs, device=p.device)
    q_n = q[rows, num_correct]
    p_n = torch.cat([p, torch.zeros((bs, 1, vocab), device=p.device)], 1)[rows, num_correct]
    residual = (q_n - p_n).clamp(min=0.0)
    return torch.where(residual.sum(-1, keepdim=True) > 0, residual, q_n)
