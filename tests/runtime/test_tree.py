"""Tests for spec_runtime.tree: draft expansion, tree layout, greedy and sampling verification."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spec_runtime.sampling import sample_from_probs
from spec_runtime.tree import (
    build_tree,
    gather_branches,
    organize,
    select_frontier,
    verify_chain_rejection,
    verify_greedy,
    verify_tree_sampling,
)

I64 = torch.int64

# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


def _t(rows, dtype=I64):
    return torch.tensor(rows, dtype=dtype)


def run_expansion(step_probs, step_tokens):
    """Drive select_frontier over all steps; returns (records, parent_branches)."""
    records, branches, scores = [], [], None
    for step, (p, tok) in enumerate(zip(step_probs, step_tokens)):
        scores, _, branch, record = select_frontier(step, scores, p, tok)
        records.append(record)
        branches.append(branch)
    return records, branches


def random_expansion(gen, bs, topk, num_steps, vocab=50, quantum=4):
    """Random step inputs; probabilities quantized to multiples of 1/quantum to force ties."""
    probs, tokens = [], []
    for step in range(num_steps):
        shape = (bs, topk) if step == 0 else (bs, topk, topk)
        probs.append(torch.randint(0, quantum + 1, shape, generator=gen).float() / quantum)
        tokens.append(torch.randint(0, vocab, shape, generator=gen))
    return probs, tokens


def random_tree(gen, bs, topk, num_steps, num_draft, vocab=50):
    probs, tokens = random_expansion(gen, bs, topk, num_steps, vocab)
    records, _ = run_expansion(probs, tokens)
    parent_list, selected, draft_tokens = organize(records, num_draft)
    bonus = torch.randint(0, vocab, (bs,), generator=gen)
    seq_lens = torch.randint(0, 100, (bs,), generator=gen)
    return build_tree(parent_list, selected, draft_tokens, bonus, seq_lens, topk, num_steps, num_draft)


def parents_from_mask(mask):
    """Parent of each node = its deepest proper ancestor (python lists)."""
    n = mask.shape[0]
    depth = [int(mask[i].sum()) - 1 for i in range(n)]
    parents = [-1]
    for i in range(1, n):
        ancestors = [j for j in range(n) if mask[i, j] and j != i]
        parents.append(max(ancestors, key=lambda j: depth[j]))
    return parents, depth


def children_lists(next_token, next_sibling):
    out = []
    for i in range(len(next_token)):
        kids, c = [], int(next_token[i])
        while c != -1:
            kids.append(c)
            c = int(next_sibling[c])
        out.append(kids)
    return out


def assert_valid_tree(tree, seq_lens, num_steps):
    mask, positions, retrieve_index, next_token, next_sibling, _ = tree
    bs, n, _ = mask.shape
    assert retrieve_index.tolist() == [[b * n + i for i in range(n)] for b in range(bs)]
    for b in range(bs):
        parents, depth = parents_from_mask(mask[b])
        assert bool(mask[b, :, 0].all()) and bool(mask[b].diagonal().all())
        assert not bool(mask[b].triu(1).any()), "a parent must precede its children"
        for i in range(1, n):
            p = parents[i]
            assert mask[b, i].tolist() == [j == i or bool(mask[b, p, j]) for j in range(n)]
            assert depth[i] == depth[p] + 1 <= num_steps
        assert positions[b].tolist() == [int(seq_lens[b]) + d for d in depth]
        kids = children_lists(next_token[b].tolist(), next_sibling[b].tolist())
        for i in range(n):
            assert kids[i] == [j for j in range(n) if parents[j] == i]  # ascending, complete


def chi2_pvalue(counts_and_probs):
    """Pooled Pearson chi-square p-value over several (observed counts, expected probs) pairs.

    Categories with expected count < 5 are lumped together; an observation where the expected
    probability is 0 gives p = 0.
    """
    stat, dof = 0.0, 0
    for observed, probs in counts_and_probs:
        observed = observed.double()
        expected = probs.double() * observed.sum()
        if bool(((probs == 0) & (observed > 0)).any()):
            return 0.0
        big = expected >= 5
        obs = torch.cat([observed[big], observed[~big].sum()[None]])
        exp = torch.cat([expected[big], expected[~big].sum()[None]])
        keep = exp > 0
        stat += float((((obs - exp) ** 2)[keep] / exp[keep]).sum())
        dof += int(keep.sum()) - 1
    if dof <= 0:
        return 1.0
    return float(
        torch.special.gammaincc(
            torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)
        )
    )


# ----------------------------------------------------------------------------------------------
# Expansion and organize
# ----------------------------------------------------------------------------------------------

# Hand example, topk=2, num_steps=3 (dyadic probabilities, so every product is exact):
#   step 0: root children  flat 0 (tok 10, .75), flat 1 (tok 11, .125)        frontier [0, 1]
#   step 1: children of 0: flat 2 (tok 20, .375), flat 3 (tok 21, .1875)
#           children of 1: flat 4 (tok 22, .0625), flat 5 (tok 23, .0625)      frontier [2, 3]
#   step 2: children of 2: flat 6 (tok 30, .1875), flat 7 (tok 31, .09375)
#           children of 3: flat 8 (tok 32, .1875 = .1875 * 1.0), flat 9 (tok 33, 0)
HAND_PROBS = [
    _t([[0.75, 0.125]], torch.float32),
    _t([[[0.5, 0.25], [0.5, 0.5]]], torch.float32),
    _t([[[0.5, 0.25], [1.0, 0.0]]], torch.float32),
]
HAND_TOKENS = [_t([[10, 11]]), _t([[[20, 21], [22, 23]]]), _t([[[30, 31], [32, 33]]])]


def test_select_frontier_hand_example():
    scores, tokens, branch, record = select_frontier(0, None, HAND_PROBS[0], HAND_TOKENS[0])
    assert scores.tolist() == [[0.75, 0.125]] and tokens.tolist() == [[10, 11]]
    assert branch.tolist() == [[0, 0]] and record[2].tolist() == [[0, 1]]
    scores, tokens, branch, record = select_frontier(1, scores, HAND_PROBS[1], HAND_TOKENS[1])
    assert scores.tolist() == [[0.375, 0.1875]] and tokens.tolist() == [[20, 21]]
    assert branch.tolist() == [[0, 0]]  # both new frontier nodes extend branch 0
    assert record[0].tolist() == [[0.375, 0.1875, 0.0625, 0.0625]] and record[2].tolist() == [[2, 3]]
    scores, tokens, branch, record = select_frontier(2, scores, HAND_PROBS[2], HAND_TOKENS[2])
    assert scores.tolist() == [[0.1875, 0.1875]] and tokens.tolist() == [[30, 32]]
    assert branch.tolist() == [[0, 1]] and record[2].tolist() == [[6, 8]]


def test_organize_hand_example_and_tie_break():
    records, _ = run_expansion(HAND_PROBS, HAND_TOKENS)
    parent_list, selected, tokens = organize(records, 6)
    assert parent_list.tolist() == [[-1, 0, 1, 2, 3]]
    # scores .75(0) .375(2) then a three-way tie at .1875: flats 3, 6, 8 (8 is 3's child).
    assert selected.tolist() == [[0, 2, 3, 6, 8]] and tokens.tolist() == [[10, 20, 21, 30, 32]]
    # One slot fewer: the tie must keep the parent (flat 3) and drop its equal-score child (flat 8).
    assert organize(records, 5)[1].tolist() == [[0, 2, 3, 6]]
    assert organize(records, 1)[1].shape == (1, 0)


def test_gather_branches_reorders_state():
    state = torch.arange(2 * 3 * 2).reshape(2, 3, 2)
    out = gather_branches(state, _t([[2, 2, 0], [1, 0, 1]]))
    assert out.tolist() == [[[4, 5], [4, 5], [0, 1]], [[8, 9], [6, 7], [8, 9]]]
    root = torch.tensor([[[1.0, 2.0]]])  # (bs, 1, H) repeated by the all-zero step-0 branch
    assert gather_branches(root, torch.zeros(1, 3, dtype=I64)).shape == (1, 3, 2)


def test_organize_validation():
    records, _ = run_expansion(HAND_PROBS, HAND_TOKENS)
    with pytest.raises(ValueError, match=r"num_draft must be in \[1, 11\]"):
        organize(records, 12)
    with pytest.raises(ValueError, match="at least one record"):
        organize([], 3)


def test_nan_scores_rank_last():
    p0 = _t([[float("nan"), 0.5]], torch.float32)
    records, _ = run_expansion(
        [p0, _t([[[0.5, 0.5], [0.5, 0.25]]], torch.float32)], [_t([[1, 2]]), _t([[[3, 4], [5, 6]]])]
    )
    parent_list, selected, tokens = organize(records, 4)
    assert selected.tolist() == [[1, 4, 5]]  # flat 1 and its two children; NaN branch last
    build_tree(parent_list, selected, tokens, _t([0]), _t([0]), 2, 2, 4)


# ----------------------------------------------------------------------------------------------
# build_tree
# ----------------------------------------------------------------------------------------------


def test_build_tree_hand_examples():
    # Request 0: the hand expansion. Nodes: 0 root, 1 flat0, 2 flat2, 3 flat3, 4 flat6, 5 flat8.
    #   flat2 // 2 = 1 -> parent_list[1] = 0 = flat of node 1; flat6 // 2 = 3 -> parent_list[3] = 2
    #   (node 2); flat8 // 2 = 4 -> parent_list[4] = 3 (node 3). Tree 0 -> 1 -> {2, 3}, 2 -> 4, 3 -> 5.
    # Request 1: selected [0, 1, 2, 4, 5], parent_list [-1, 0, 1, 2, 4]: flats 0, 1 are root
    #   children (nodes 1, 2); flat2 // 2 = 1 -> flat 0 (node 1); flat4, flat5 // 2 = 2 -> flat 1
    #   (node 2). Tree 0 -> {1, 2}, 1 -> 3, 2 -> {4, 5}.
    parent_list = _t([[-1, 0, 1, 2, 3], [-1, 0, 1, 2, 4]])
    selected = _t([[0, 2, 3, 6, 8], [0, 1, 2, 4, 5]])
    tokens = _t([[10, 20, 21, 30, 32], [1, 2, 3, 4, 5]])
    tree = build_tree(parent_list, selected, tokens, _t([7, 8]), _t([100, 5], torch.int32), 2, 3, 6)
    mask, positions, retrieve_index, next_token, next_sibling, draft_token = tree
    ancestors = [
        [[0], [0, 1], [0, 1, 2], [0, 1, 3], [0, 1, 2, 4], [0, 1, 3, 5]],
        [[0], [0, 1], [0, 2], [0, 1, 3], [0, 2, 4], [0, 2, 5]],
    ]
    expected_mask = torch.zeros(2, 6, 6, dtype=torch.bool)
    for b, rows in enumerate(ancestors):
        for i, row in enumerate(rows):
            expected_mask[b, i, row] = True
    assert torch.equal(mask, expected_mask)
    assert positions.tolist() == [[100, 101, 102, 102, 103, 103], [5, 6, 6, 7, 7, 7]]
    assert retrieve_index.tolist() == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]
    assert next_token.tolist() == [[1, 2, 4, 5, -1, -1], [1, 3, 4, -1, -1, -1]]
    assert next_sibling.tolist() == [[-1, -1, 3, -1, -1, -1], [-1, 2, -1, -1, 5, -1]]
    assert draft_token.tolist() == [[7, 10, 20, 21, 30, 32], [8, 1, 2, 3, 4, 5]]
    assert {t.dtype for t in tree[1:]} == {I64} and mask.dtype == torch.bool


def test_build_tree_from_organize_matches_hand_example():
    records, _ = run_expansion(HAND_PROBS, HAND_TOKENS)
    tree = build_tree(*organize(records, 6), _t([7]), _t([100]), 2, 3, 6)
    assert tree[3].tolist() == [[1, 2, 4, 5, -1, -1]] and tree[4].tolist() == [[-1, -1, 3, -1, -1, -1]]


def test_topk_one_is_a_chain():
    gen = torch.Generator().manual_seed(0)
    num_steps = 4
    probs, tokens = random_expansion(gen, 2, 1, num_steps)
    records, branches = run_expansion(probs, tokens)
    assert all(b.tolist() == [[0], [0]] for b in branches)
    parent_list, selected, draft_tokens = organize(records, num_steps + 1)
    assert parent_list.tolist() == [[-1, 0, 1, 2]] * 2 and selected.tolist() == [[0, 1, 2, 3]] * 2
    tree = build_tree(
        parent_list, selected, draft_tokens, _t([5, 6]), _t([10, 0]), 1, num_steps, num_steps + 1
    )
    mask, positions, _, next_token, next_sibling, draft_token = tree
    assert torch.equal(mask, torch.ones(5, 5, dtype=torch.bool).tril().expand(2, 5, 5))
    assert positions.tolist() == [[10, 11, 12, 13, 14], [0, 1, 2, 3, 4]]
    assert next_token.tolist() == [[1, 2, 3, 4, -1]] * 2 and (next_sibling == -1).all()
    assert draft_token[:, 1:].tolist() == torch.cat([t.reshape(2, 1) for t in tokens], 1).tolist()


def test_single_step_and_root_only():
    records, _ = run_expansion(HAND_PROBS[:1], HAND_TOKENS[:1])
    tree = build_tree(*organize(records, 3), _t([7]), _t([4]), 2, 1, 3)
    assert (
        tree[1].tolist() == [[4, 5, 5]]
        and tree[3].tolist() == [[1, -1, -1]]
        and tree[4].tolist() == [[-1, 2, -1]]
    )
    root = build_tree(*organize(records, 1), _t([7]), _t([4]), 2, 1, 1)
    assert root[0].tolist() == [[[True]]] and root[3].tolist() == [[-1]] and root[5].tolist() == [[7]]


def test_bs_zero_everywhere():
    records, _ = run_expansion(
        [torch.zeros(0, 2), torch.zeros(0, 2, 2)],
        [torch.zeros(0, 2, dtype=I64), torch.zeros(0, 2, 2, dtype=I64)],
    )
    parent_list, selected, tokens = organize(records, 4)
    assert parent_list.shape == (0, 3) and selected.shape == (0, 3) and tokens.dtype == I64
    tree = build_tree(
        parent_list, selected, tokens, torch.zeros(0, dtype=I64), torch.zeros(0, dtype=I64), 2, 2, 4
    )
    assert [tuple(t.shape) for t in tree] == [(0, 4, 4)] + [(0, 4)] * 5
    candidates, ri, nt, ns = tree[5], tree[2], tree[3], tree[4]
    predicts, accept_index, num_correct = verify_greedy(
        candidates, ri, nt, ns, torch.zeros(0, 4, dtype=I64), 2
    )
    assert predicts.shape == (0,) and accept_index.shape == (0, 3) and num_correct.dtype == torch.int32
    out = verify_tree_sampling(
        candidates, ri, nt, ns, torch.zeros(0, 4, 5), torch.zeros(0, 4), torch.zeros(0), 2
    )
    assert [tuple(t.shape) for t in out] == [(0,), (0, 3), (0,)]
    assert [t.dtype for t in out] == [I64, I64, torch.int32]
    tokens, num_correct = verify_chain_rejection(
        torch.zeros(0, 3, dtype=I64),
        torch.zeros(0, 3, 5),
        torch.zeros(0, 4, 5),
        torch.zeros(0, 3),
        torch.zeros(0),
    )
    assert (
        tokens.shape == (0, 4)
        and tokens.dtype == I64
        and num_correct.shape == (0,)
        and num_correct.dtype == torch.int32
    )


def test_build_tree_rejects_orphans_and_bad_shapes():
    with pytest.raises(ValueError, match="parent is not selected"):
        build_tree(_t([[-1, 0, 1]]), _t([[1, 2]]), _t([[5, 6]]), _t([0]), _t([0]), 2, 2, 3)
    with pytest.raises(ValueError, match="strictly ascending"):
        build_tree(_t([[-1, 0, 1]]), _t([[2, 0]]), _t([[5, 6]]), _t([0]), _t([0]), 2, 2, 3)
    with pytest.raises(
        ValueError, match=r"parent_list must be \(bs, topk\*\(num_steps-1\)\+1\) = \(1, 3\), got \(1, 2\)"
    ):
        build_tree(_t([[-1, 0]]), _t([[0, 2]]), _t([[5, 6]]), _t([0]), _t([0]), 2, 2, 3)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    bs=st.integers(1, 3),
    topk=st.integers(1, 3),
    num_steps=st.integers(1, 4),
    fraction=st.floats(0.0, 1.0),
)
def test_organize_build_tree_always_valid(seed, bs, topk, num_steps, fraction):
    gen = torch.Generator().manual_seed(seed)
    num_candidates = topk + (num_steps - 1) * topk * topk
    num_draft = 1 + round(fraction * num_candidates)
    probs, tokens = random_expansion(gen, bs, topk, num_steps)
    records, _ = run_expansion(probs, tokens)
    parent_list, selected, draft_tokens = organize(records, num_draft)
    seq_lens = torch.randint(0, 50, (bs,), generator=gen)
    tree = build_tree(
        parent_list, selected, draft_tokens, torch.zeros(bs, dtype=I64), seq_lens, topk, num_steps, num_draft
    )
    assert_valid_tree(tree, seq_lens, num_steps)
    flat_tokens = torch.cat([r[1] for r in records], 1)
    assert torch.equal(tree[5][:, 1:], flat_tokens.gather(1, selected))


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


# ----------------------------------------------------------------------------------------------
# verify_chain_rejection
# ----------------------------------------------------------------------------------------------


def test_chain_rejection_hand():
    p = _t([[[0.5, 0.5, 0.0], [0.0, 1.0, 0.0]]], torch.float32)
    q = _t([[[0.25, 0.75, 0.0], [0.0, 0.5, 0.5], [1.0, 0.0, 0.0]]], torch.float32)
    drafts = _t([[1, 1]])
    # draft 0: q >= p, accepted; draft 1: q/p = 0.5, u = 0.4 accepts; bonus from q[2] -> token 0
    out = verify_chain_rejection(drafts, p, q, _t([[0.9, 0.4]], torch.float32), _t([0.3], torch.float32))
    assert out[0].tolist() == [[1, 1, 0]] and out[1].tolist() == [2]
    # u = 0.6 rejects draft 1: residual max(q - p, 0) = [0, 0, 0.5] -> token 2
    out = verify_chain_rejection(drafts, p, q, _t([[0.9, 0.6]], torch.float32), _t([0.0], torch.float32))
    assert out[0].tolist() == [[1, 2, -1]] and out[1].tolist() == [1] and out[1].dtype == torch.int32


def test_chain_rejection_empty_residual_falls_back_to_q():
    # p == q and the draft token has no target mass: rejected, max(q - p, 0) == 0, fall back to q.
    p = _t([[[0.5, 0.5, 0.0]]], torch.float32)
    out = verify_chain_rejection(
        _t([[2]]), p, torch.cat([p, p], 1), _t([[0.0]], torch.float32), _t([0.7], torch.float32)
    )
    assert out[0].tolist() == [[1, -1]] and out[1].tolist() == [0]


def chain_batch(seed, bs, k, vocab):
    """Markov draft p and target q: each row's distribution depends on the previous token."""
    gen = torch.Generator().manual_seed(seed)

    def table(rows):
        t = (torch.rand(rows, vocab, vocab, generator=gen) + 0.05) * (
            torch.rand(rows, vocab, vocab, generator=gen) > 0.2
        )
        t[..., 1] += 0.05
        return t / t.sum(-1, keepdim=True)

    p_table, q_table = table(k), table(k + 1)
    start = torch.zeros(bs, dtype=I64)
    prev, drafts, p_rows, q_rows = start, [], [], []
    for j in range(k):
        p_rows.append(p_table[j, prev])
        q_rows.append(q_table[j, prev])
        prev = torch.multinomial(p_rows[-1], 1, generator=gen).squeeze(1)
        drafts.append(prev)
    q_rows.append(q_table[k, prev])
    uniform, uniform_final = torch.rand(bs, k, generator=gen), torch.rand(bs, generator=gen)
    return (
        torch.stack(drafts, 1),
        torch.stack(p_rows, 1),
        torch.stack(q_rows, 1),
        uniform,
        uniform_final,
        q_table,
    )


def run_chain_statistics(verify=verify_chain_rejection):
    bs, k, vocab = 20000, 3, 6
    drafts, p, q, uniform, uniform_final, q_table = chain_batch(3, bs, k, vocab)
    tokens, num_correct = verify(drafts, p, q, uniform, uniform_final)
    first = [(torch.bincount(tokens[:, 0], minlength=vocab), q_table[0, 0])]
    second = []
    for tok in range(vocab):
        sel = (num_correct >= 1) & (tokens[:, 0] == tok)
        if sel.any():
            second.append((torch.bincount(tokens[sel, 1], minlength=vocab), q_table[1, tok]))
    return chi2_pvalue(first), chi2_pvalue(second)


def test_chain_rejection_is_lossless():
    first, second = run_chain_statistics()
    assert first > 1e-3 and second > 1e-3


def accept_all_drafts(drafts, p, q, uniform, uniform_final):
    """Deliberately wrong: every draft accepted (the first token then follows p, not q)."""
    return verify_chain_rejection(
        drafts, p, p.new_ones(p.shape[0], p.shape[1] + 1, p.shape[2]), uniform, uniform_final
    )


def correction_from_q(drafts, p, q, uniform, uniform_final):
    """Deliberately wrong: after a rejection the token comes from q instead of max(q - p, 0)."""
    tokens, num_correct = verify_chain_rejection(drafts, p, q, uniform, uniform_final)
    rows = torch.arange(len(num_correct))
    wrong = sample_from_probs(q[rows, num_correct.long()], uniform_final)
    rejected = num_correct < drafts.shape[1]
    tokens = tokens.clone()
    tokens[rows, num_correct.long()] = torch.where(rejected, wrong, tokens[rows, num_correct.long()])
    return tokens, num_correct


@pytest.mark.parametrize("wrong", [accept_all_drafts, correction_from_q])
def test_chain_statistics_have_power(wrong):
    assert run_chain_statistics(wrong)[0] < 1e-6


def test_chain_rejection_shape_errors():
    with pytest.raises(
        ValueError, match=r"target_probs must be \(bs, k\+1, vocab\) = \(1, 3, 4\), got \(1, 2, 4\)"
    ):
        verify_chain_rejection(
            torch.zeros(1, 2, dtype=I64),
            torch.zeros(1, 2, 4),
            torch.zeros(1, 2, 4),
            torch.zeros(1, 2),
            torch.zeros(1),
        )


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
