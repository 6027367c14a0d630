"""Tests for spec_runtime.tree verification of a draft tree: verify_greedy and verify_tree_sampling
(hand cases, plain-python references, losslessness statistics and their power, one-hot = greedy)."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.runtime._tree_cases import I64, _t, chi2_pvalue, children_lists, random_tree

from spec_runtime.sampling import sample_from_probs
from spec_runtime.tree import build_tree, verify_greedy, verify_tree_sampling

# ----------------------------------------------------------------------------------------------
# verify_greedy
# ----------------------------------------------------------------------------------------------


def reference_greedy(candidates, next_token, next_sibling, target_predict, num_steps):
    """Plain-python walk; returns (emitted tokens, accepted local nodes)."""
    cur, nodes, emitted = 0, [0], []
    for _ in range(num_steps):
        child = next_token[cur]
        while child != -1 and candidates[child] != target_predict[cur]:
            child = next_sibling[child]
        if child == -1:
            break
        emitted.append(candidates[child])
        nodes.append(child)
        cur = child
    return emitted + [target_predict[cur]], nodes


def emitted_tokens(predicts, accept_index, num_correct):
    return [
        [int(predicts[r]) for r in accept_index[b, : int(num_correct[b]) + 1]]
        for b in range(len(num_correct))
    ]


def hand_tree():
    """Request-1 tree of the hand example: 0 -> {1, 2}, 1 -> 3, 2 -> {4, 5}; tokens below."""
    parent_list, selected = _t([[-1, 0, 1, 2, 4]]), _t([[0, 1, 2, 4, 5]])
    return build_tree(parent_list, selected, _t([[11, 12, 13, 14, 15]]), _t([10]), _t([0]), 2, 3, 6)


@pytest.mark.parametrize(
    "target, num_steps, path, emitted",
    [
        ([12, 13, 15, 0, 0, 0], 3, [0, 2, 5], [12, 15, 0]),  # sibling accepted at both levels
        ([11, 13, 0, 9, 0, 0], 3, [0, 1, 3], [11, 13, 9]),  # full accept to a leaf, bonus at the leaf
        ([12, 0, 14, 0, 8, 0], 3, [0, 2, 4], [12, 14, 8]),
        ([12, 0, 99, 0, 0, 0], 3, [0, 2], [12, 99]),  # partial: no child of node 2 matches
        ([99, 0, 0, 0, 0, 0], 3, [0], [99]),  # nothing accepted
        ([12, 0, 14, 0, 8, 0], 1, [0, 2], [12, 14]),  # num_steps caps the walk
        ([12, 0, 14, 0, 8, 0], 0, [0], [12]),
    ],
)
def test_verify_greedy_hand(target, num_steps, path, emitted):
    _, _, ri, nt, ns, candidates = hand_tree()
    predicts, accept_index, num_correct = verify_greedy(candidates, ri, nt, ns, _t([target]), num_steps)
    assert accept_index.tolist() == [path + [-1] * (num_steps + 1 - len(path))]
    assert num_correct.tolist() == [len(path) - 1] and num_correct.dtype == torch.int32
    assert emitted_tokens(predicts, accept_index, num_correct) == [emitted]
    off_path = [r for r in range(6) if r not in path]
    assert (predicts[off_path] == 0).all() and predicts.dtype == I64


def test_verify_greedy_first_matching_sibling_wins():
    # Root children 1 and 2 carry the same token; the walk must take node 1 (first in order).
    tree = build_tree(_t([[-1, 0, 1]]), _t([[0, 1, 2]]), _t([[5, 5, 6]]), _t([0]), _t([0]), 2, 2, 4)
    _, _, ri, nt, ns, candidates = tree
    _, accept_index, _ = verify_greedy(candidates, ri, nt, ns, _t([[5, 6, 0, 0]]), 2)
    assert accept_index.tolist() == [[0, 1, 3]]


def test_verify_greedy_batch_rows_are_global():
    _, _, ri, nt, ns, candidates = hand_tree()
    nt, ns, candidates = (torch.cat([t, t]) for t in (nt, ns, candidates))
    ri = torch.arange(12).reshape(2, 6)
    target = _t([[12, 0, 14, 0, 8, 0], [99, 0, 0, 0, 0, 0]])
    predicts, accept_index, num_correct = verify_greedy(candidates, ri, nt, ns, target, 3)
    assert accept_index.tolist() == [[0, 2, 4, -1], [6, -1, -1, -1]]
    assert emitted_tokens(predicts, accept_index, num_correct) == [[12, 14, 8], [99]]


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    bs=st.integers(1, 4),
    topk=st.integers(1, 3),
    num_steps=st.integers(1, 4),
    fraction=st.floats(0.0, 1.0),
)
def test_verify_greedy_matches_reference(seed, bs, topk, num_steps, fraction):
    gen = torch.Generator().manual_seed(seed)
    num_draft = 1 + round(fraction * (topk + (num_steps - 1) * topk * topk))
    vocab = 3  # small vocabulary: many matches and duplicate sibling tokens
    mask, _, ri, nt, ns, candidates = random_tree(gen, bs, topk, num_steps, num_draft, vocab)
    target = torch.randint(0, vocab, (bs, num_draft), generator=gen)
    predicts, accept_index, num_correct = verify_greedy(candidates, ri, nt, ns, target, num_steps)
    emitted = emitted_tokens(predicts, accept_index, num_correct)
    for b in range(bs):
        ref_emitted, ref_nodes = reference_greedy(
            candidates[b].tolist(), nt[b].tolist(), ns[b].tolist(), target[b].tolist(), num_steps
        )
        assert emitted[b] == ref_emitted
        assert accept_index[b].tolist() == [b * num_draft + i for i in ref_nodes] + [-1] * (
            num_steps + 1 - len(ref_nodes)
        )
        nodes = [int(r) - b * num_draft for r in accept_index[b, : int(num_correct[b]) + 1]]
        for parent, child in zip(nodes, nodes[1:]):  # a root-to-node path; each token = target at parent
            assert (
                bool(mask[b, child, parent]) and int(mask[b, child].sum()) == int(mask[b, parent].sum()) + 1
            )
            assert candidates[b, child] == target[b, parent]
        last = nodes[-1]
        kids = children_lists(nt[b].tolist(), ns[b].tolist())[last]
        assert len(nodes) - 1 == num_steps or all(
            candidates[b, k] != target[b, last] for k in kids
        )  # maximal
        assert predicts[b * num_draft + last] == target[b, last]


# ----------------------------------------------------------------------------------------------
# verify_tree_sampling
# ----------------------------------------------------------------------------------------------


def star_tree(child_tokens, root_token=0):
    """Root with children carrying child_tokens (num_steps 1)."""
    n = len(child_tokens)
    return build_tree(
        _t([[-1]]), _t([list(range(n))]), _t([child_tokens]), _t([root_token]), _t([0]), n, 1, n + 1
    )


def sample_star(child_tokens, q_root, u, uf):
    _, _, ri, nt, ns, candidates = star_tree(child_tokens)
    n, vocab = len(child_tokens) + 1, len(q_root)
    probs = torch.full((1, n, vocab), 1.0 / vocab)
    probs[0, 0] = torch.tensor(q_root)
    out = verify_tree_sampling(candidates, ri, nt, ns, probs, torch.full((1, n), u), torch.tensor([uf]), 1)
    return emitted_tokens(*out)[0], int(out[2][0])


@pytest.mark.parametrize(
    "u, uf, emitted",
    [
        (0.25, 0.5, [2, 2]),  # prob_acc 0.3 after token 2; bonus from the child's uniform q
        (0.45, 0.5, [1, 2]),  # 0.3 < u <= 0.5: second child
        (0.6, 0.1, [0]),  # rejected: residual [.1, 0, 0, .4]; 0.1 * 0.5 = 0.05 -> token 0
        (0.6, 0.5, [3]),  # 0.5 * 0.5 = 0.25 -> token 3
    ],
)
def test_tree_sampling_hand(u, uf, emitted):
    assert sample_star([2, 1], [0.1, 0.2, 0.3, 0.4], u, uf) == (emitted, len(emitted) - 1)


def test_tree_sampling_duplicate_children_count_once():
    # Children tokens [2, 2, 1]: prob_acc 0.3, 0.3 (duplicate adds nothing), 0.5. u = 0.55 rejects
    # all; the residual zeroes tokens 1 and 2 once: [.1, 0, 0, .4].
    got, n = sample_star([2, 2, 1], [0.1, 0.2, 0.3, 0.4], 0.55, 0.1)
    assert (got, n) == ([0], 0)
    got, n = sample_star([2, 2, 1], [0.1, 0.2, 0.3, 0.4], 0.35, 0.1)
    assert (got[0], n) == (1, 1)  # accepted the third child (token 1), never the duplicate


def test_tree_sampling_zero_mass_child_never_accepted():
    got, n = sample_star([1, 2], [0.5, 0.0, 0.5], 0.0, 0.0)
    assert (got[0], n) == (2, 1)


def test_tree_sampling_children_cover_all_mass():
    # q sums to 1 - 2^-23 (rounding); u = 1 - 2^-24 exceeds prob_acc but the residual is empty,
    # so u is capped and the last child is accepted rather than emitting a child token as bonus.
    q = [0.5, 0.5 - 2.0**-23]
    got, n = sample_star([0, 1], q, 1.0 - 2.0**-24, 0.0)
    assert (got[0], n) == (1, 1)


def test_tree_sampling_leaf_and_depth_cap_sample_from_q():
    _, _, ri, nt, ns, candidates = hand_tree()  # 0 -> {1, 2}, 1 -> 3, 2 -> {4, 5}; tokens 10..15
    vocab = 16
    probs = torch.zeros(1, 6, vocab)
    probs[0, 0, 11] = 1.0  # root: accept node 1 (token 11)
    probs[0, 1, 13] = 1.0  # node 1: accept node 3 (token 13)
    probs[0, 3, 13] = 1.0  # node 3 is a leaf: bonus from q[3] unchanged, token 13
    out = verify_tree_sampling(candidates, ri, nt, ns, probs, torch.full((1, 6), 0.5), torch.tensor([0.5]), 3)
    assert out[1].tolist() == [[0, 1, 3, -1]] and emitted_tokens(*out) == [[11, 13, 13]]
    out = verify_tree_sampling(candidates, ri, nt, ns, probs, torch.full((1, 6), 0.5), torch.tensor([0.5]), 1)
    assert out[1].tolist() == [[0, 1]] and emitted_tokens(*out) == [[11, 13]]  # cap: q[1] unzeroed


def reference_tree_sampling(candidates, next_token, next_sibling, q, u, uf, num_steps):
    """Plain-python tree sampling in float32; returns (emitted tokens, accepted nodes)."""
    cur, nodes, emitted = 0, [0], []
    for _ in range(num_steps):
        kids = children_lists(next_token, next_sibling)[cur]
        if not kids:
            break
        seen, acc, accepted, masses = set(), np.float32(0), None, []
        for child in kids:
            tok = candidates[child]
            mass = np.float32(0) if tok in seen else np.float32(q[cur][tok])
            seen.add(tok)
            acc = np.float32(acc + mass)
            masses.append((child, mass, acc))
        residual = [0.0 if t in seen else q[cur][t] for t in range(len(q[cur]))]
        coin = np.float32(u[cur]) if sum(residual) > 0 else min(np.float32(u[cur]), acc)
        accepted = next((c for c, m, a in masses if m > 0 and coin <= a), None)
        if accepted is None:
            return emitted + [inverse_cdf(residual, uf)], nodes
        emitted.append(candidates[accepted])
        nodes.append(accepted)
        cur = accepted
    return emitted + [inverse_cdf(q[cur], uf)], nodes


def inverse_cdf(weights, u):
    cdf = np.cumsum(np.asarray(weights, dtype=np.float32), dtype=np.float32)
    x = np.float32(u) * cdf[-1]
    idx = int(np.searchsorted(cdf, x, side="right"))
    return min(idx, max(i for i, w in enumerate(weights) if w > 0))


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    topk=st.integers(1, 3),
    num_steps=st.integers(1, 3),
    fraction=st.floats(0.0, 1.0),
)
def test_tree_sampling_matches_reference(seed, topk, num_steps, fraction):
    gen = torch.Generator().manual_seed(seed)
    bs, vocab = 4, 4
    num_draft = 1 + round(fraction * (topk + (num_steps - 1) * topk * topk))
    _, _, ri, nt, ns, candidates = random_tree(gen, bs, topk, num_steps, num_draft, vocab)
    q = torch.rand(bs, num_draft, vocab, generator=gen) * (
        torch.rand(bs, num_draft, vocab, generator=gen) > 0.3
    )
    q[..., 0] += 1e-3
    q = q / q.sum(-1, keepdim=True)
    u, uf = torch.rand(bs, num_draft, generator=gen), torch.rand(bs, generator=gen)
    predicts, accept_index, num_correct = verify_tree_sampling(candidates, ri, nt, ns, q, u, uf, num_steps)
    emitted = emitted_tokens(predicts, accept_index, num_correct)
    for b in range(bs):
        ref, nodes = reference_tree_sampling(
            candidates[b].tolist(),
            nt[b].tolist(),
            ns[b].tolist(),
            q[b].tolist(),
            u[b].tolist(),
            float(uf[b]),
            num_steps,
        )
        assert emitted[b] == ref
        assert accept_index[b, : len(nodes)].tolist() == [b * num_draft + i for i in nodes]


def tree_batch(seed, n_trees, reps, topk, num_steps, num_draft, vocab):
    """n_trees random trees (random tokens, duplicates allowed), each repeated reps times, with a
    random target distribution per node (a fifth of the entries zeroed)."""
    gen = torch.Generator().manual_seed(seed)
    tree = random_tree(gen, n_trees, topk, num_steps, num_draft, vocab)
    q = torch.rand(n_trees, num_draft, vocab, generator=gen) + 0.05
    q = q * (torch.rand(n_trees, num_draft, vocab, generator=gen) > 0.2)
    q[..., 0] += 0.05
    q = q / q.sum(-1, keepdim=True)
    bs = n_trees * reps
    nt, ns, candidates = (t.repeat_interleave(reps, 0) for t in tree[3:6])
    ri = torch.arange(bs * num_draft).reshape(bs, num_draft)
    uniform, uniform_final = torch.rand(bs, num_draft, generator=gen), torch.rand(bs, generator=gen)
    return candidates, ri, nt, ns, q, uniform, uniform_final


def first_and_second_tokens(predicts, accept_index, num_correct):
    first = predicts[accept_index[:, 0]]
    second = torch.where(num_correct >= 1, predicts[accept_index[:, 1].clamp(min=0)], -1)
    return first, second


def first_token_groups(first, q, candidates, n_trees, reps, vocab):
    rows = torch.arange(n_trees * reps).reshape(n_trees, reps)
    return [(torch.bincount(first[rows[t]], minlength=vocab), q[t, 0]) for t in range(n_trees)]


def second_token_groups(first, second, q, candidates, nt, ns, n_trees, reps, vocab):
    """Given first token x (a root child's token), the second token must follow q at the first
    child carrying x."""
    groups = []
    for t in range(n_trees):
        rows = torch.arange(t * reps, (t + 1) * reps)
        seen = set()
        for child in children_lists(nt[t * reps].tolist(), ns[t * reps].tolist())[0]:
            tok = int(candidates[t * reps, child])
            if tok in seen or q[t, 0, tok] == 0:
                continue
            seen.add(tok)
            sel = rows[first[rows] == tok]
            groups.append((torch.bincount(second[sel], minlength=vocab), q[t, child]))
    return groups


N_TREES, REPS, VOCAB = 4, 5000, 6


def run_tree_statistics(verify=verify_tree_sampling):
    topk, num_steps, num_draft = 3, 3, 8
    candidates, ri, nt, ns, q, uniform, uniform_final = tree_batch(
        7, N_TREES, REPS, topk, num_steps, num_draft, VOCAB
    )
    probs = q.repeat_interleave(REPS, 0)
    out = verify(candidates, ri, nt, ns, probs, uniform, uniform_final, num_steps)
    first, second = first_and_second_tokens(*out)
    return first, second, q, candidates, nt, ns


def test_tree_sampling_is_lossless():
    first, second, q, candidates, nt, ns = run_tree_statistics()
    assert chi2_pvalue(first_token_groups(first, q, candidates, N_TREES, REPS, VOCAB)) > 1e-3
    groups = second_token_groups(first, second, q, candidates, nt, ns, N_TREES, REPS, VOCAB)
    assert len(groups) >= N_TREES and chi2_pvalue(groups) > 1e-3


def accept_first_child(candidates, ri, nt, ns, probs, uniform, uniform_final, num_steps):
    """Deliberately wrong: coin 0 accepts the first positive-mass child every time."""
    return verify_tree_sampling(
        candidates, ri, nt, ns, probs, torch.zeros_like(uniform), uniform_final, num_steps
    )


def residual_not_zeroed(candidates, ri, nt, ns, probs, uniform, uniform_final, num_steps):
    """Deliberately wrong: on rejection at the root the bonus comes from q unchanged."""
    predicts, accept_index, num_correct = verify_tree_sampling(
        candidates, ri, nt, ns, probs, uniform, uniform_final, num_steps
    )
    wrong = sample_from_probs(probs[:, 0], uniform_final)
    predicts = predicts.clone()
    predicts[accept_index[:, 0]] = torch.where(num_correct == 0, wrong, predicts[accept_index[:, 0]])
    return predicts, accept_index, num_correct


@pytest.mark.parametrize("wrong", [accept_first_child, residual_not_zeroed])
def test_tree_statistics_have_power(wrong):
    first, _, q, candidates, _, _ = run_tree_statistics(wrong)
    assert chi2_pvalue(first_token_groups(first, q, candidates, N_TREES, REPS, VOCAB)) < 1e-6


def test_tree_sampling_with_one_hot_target_equals_greedy():
    gen = torch.Generator().manual_seed(11)
    bs, topk, num_steps, num_draft, vocab = 64, 3, 4, 12, 3
    _, _, ri, nt, ns, candidates = random_tree(gen, bs, topk, num_steps, num_draft, vocab)
    target = torch.randint(0, vocab, (bs, num_draft), generator=gen)
    probs = torch.nn.functional.one_hot(target, vocab).float()
    uniform, uniform_final = torch.rand(bs, num_draft, generator=gen), torch.rand(bs, generator=gen)
    sampled = verify_tree_sampling(candidates, ri, nt, ns, probs, uniform, uniform_final, num_steps)
    greedy = verify_greedy(candidates, ri, nt, ns, target, num_steps)
    for a, b in zip(sampled, greedy):
        assert torch.equal(a, b)
