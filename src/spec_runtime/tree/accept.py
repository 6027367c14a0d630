"""Tree acceptance: which drafted nodes the target accepts. Greedy walks, lossless tree sampling,
rejection sampling of sampled chains, and the benchmarks' simulated acceptance."""

import torch

from spec_kernels.inputs import check_greedy_target, check_sampling_targets, check_verify_shapes
from spec_kernels.inputs import require_shape as _require_shape
from spec_runtime import faults
from spec_runtime.sampling import sample_from_probs

__all__ = ["check_verify_shapes", "simulated_accept", "verify_chain_rejection", "verify_greedy",
           "verify_tree_sampling"]


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
    check_greedy_target(candidates, target_predict)
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
    check_sampling_targets(candidates, target_probs, uniform, uniform_final)
    bs = candidates.shape[0]
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
    _require_shape("draft_probs", draft_probs, "(bs, k, vocab)", (bs, k, vocab))
    _require_shape("target_probs", target_probs, "(bs, k+1, vocab)", (bs, k + 1, vocab))
    _require_shape("uniform", uniform, "(bs, k)", (bs, k))
    _require_shape("uniform_final", uniform_final, "(bs,)", (bs,))
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


def simulated_accept(sim_accept: torch.Tensor, retrieve_index: torch.Tensor, draft_token: torch.Tensor,
                     predict: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Benchmark override (labelled "simulated"): request b accepts nodes 0 .. a_b - 1
    (`a = sim_accept`, 1 <= a_b <= width) as if they formed its path (whatever the tree), emitting
    their draft tokens then the target's argmax `predict (bs, n)` at the last one, as sglang's
    SGLANG_SIMULATE_ACC_LEN does. Timing only: the tokens are meaningless. Returns
    `(accept_index (bs, width) int64, accept_tokens (bs, width) int64, num_correct (bs,) int32)`
    (`kernels.accept.triton_simulated_accept`: the same in one launch)."""
    bs, n = draft_token.shape
    a = sim_accept.long()
    cols = torch.arange(width, device=predict.device)[None, :]
    index = torch.where(cols < a[:, None], retrieve_index[:, :1] + cols, -1)
    nxt = draft_token.gather(1, (cols + 1).clamp(max=n - 1).expand(bs, width))
    bonus = predict.gather(1, (a - 1)[:, None])
    tokens = torch.where(cols < (a - 1)[:, None], nxt, torch.where(cols == (a - 1)[:, None], bonus, -1))
    return index, tokens, (a - 1).to(torch.int32)
