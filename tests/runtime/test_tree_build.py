"""Tests for spec_runtime.tree draft expansion and tree layout: select_frontier, organize,
gather_branches and build_tree (hand examples, edge cases, shape errors, random trees always valid)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.runtime._tree_cases import I64, _t, children_lists, random_expansion, run_expansion

from spec_runtime.tree import (
    build_tree,
    gather_branches,
    organize,
    select_frontier,
    verify_chain_rejection,
    verify_greedy,
    verify_tree_sampling,
)

# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


def parents_from_mask(mask):
    """Parent of each node = its deepest proper ancestor (python lists)."""
    n = mask.shape[0]
    depth = [int(mask[i].sum()) - 1 for i in range(n)]
    parents = [-1]
    for i in range(1, n):
        ancestors = [j for j in range(n) if mask[i, j] and j != i]
        parents.append(max(ancestors, key=lambda j: depth[j]))
    return parents, depth


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
