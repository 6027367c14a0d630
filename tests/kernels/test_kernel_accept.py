"""triton_verify_greedy / triton_verify_tree_sampling against tree.verify_*: exact outputs.

Trees come from the reference expansion with tiny vocabularies, so sibling tokens repeat. Target
distributions mix three kinds of node: all mass on the children's tokens (empty residual: the
coin cap), children plus other tokens with zeros (a real residual), and plain random rows; coins
include exact 0 and values near 1.
"""

import pytest
import torch
from kernel_helpers import DEVICE, assert_same, gpu, needs_cuda, random_tree

from spec_kernels.accept import triton_verify_greedy, triton_verify_greedy_rows, triton_verify_tree_sampling
from spec_runtime.tree import verify_greedy, verify_tree_sampling
from spec_runtime.verify import _tokens_at, stacked_rows

CASES = [(3, 1, 3, 4), (2, 2, 3, 6), (2, 4, 3, 12), (2, 4, 4, 9), (1, 2, 1, 1), (2, 2, 2, 3)]


def _tree(seed, bs, topk, num_steps, num_draft, vocab):
    gen = torch.Generator().manual_seed(seed)
    _, _, _, (mask, positions, ri, nt, ns, cand) = random_tree(gen, bs, topk, num_steps, num_draft, vocab)
    return gen, (cand, ri, nt, ns)


@pytest.mark.parametrize("bs,topk,num_steps,num_draft", CASES)
def test_greedy_matches_reference(bs, topk, num_steps, num_draft):
    for seed in range(2):
        gen, tree = _tree(seed, bs, topk, num_steps, num_draft, vocab=4)
        cand = tree[0]
        # Mostly the next node's token (long accepted paths), sometimes a random one.
        predict = torch.where(torch.rand(cand.shape, generator=gen) < 0.8, cand.roll(-1, 1),
                              torch.randint(0, 4, cand.shape, generator=gen))
        ref = verify_greedy(*tree, predict, num_steps)
        got = triton_verify_greedy(*[t.to(DEVICE) for t in tree], predict.to(DEVICE), num_steps)
        assert_same(got, ref)


@pytest.mark.parametrize("bs,topk,num_steps,num_draft", CASES)
def test_greedy_rows_match_reference(poisoned_empty, program_order, bs, topk, num_steps, num_draft):
    """The verify core's greedy acceptance in one launch: accept_index, the tokens the torch path
    gathers from `verify_greedy`'s predictions, the count, and the stacked host rows, every element
    written by the kernel (no fill before it)."""
    for seed in range(2):
        gen, tree = _tree(seed, bs, topk, num_steps, num_draft, vocab=4)
        cand = tree[0]
        predict = torch.where(torch.rand(cand.shape, generator=gen) < 0.8, cand.roll(-1, 1),
                              torch.randint(0, 4, cand.shape, generator=gen))
        predicts, index, count = verify_greedy(*tree, predict, num_steps)
        tokens = _tokens_at(predicts, index)
        stacked = torch.empty(bs, num_steps + 2, dtype=torch.int64, device=DEVICE)
        got = triton_verify_greedy_rows(*[t.to(DEVICE) for t in tree], predict.to(DEVICE), num_steps, stacked)
        assert_same(got, (index, tokens, count))
        assert_same((stacked,), (stacked_rows(tokens, count),))
        assert_same(triton_verify_greedy_rows(*[t.to(DEVICE) for t in tree], predict.to(DEVICE), num_steps),
                    (index, tokens, count))


def _children_tokens(cand, nt, ns):
    """Per node, the tokens of its children (python lists)."""
    bs, n = cand.shape
    out = []
    for b in range(bs):
        rows = []
        for i in range(n):
            kids, c = [], int(nt[b, i])
            while c >= 0:
                kids.append(int(cand[b, c]))
                c = int(ns[b, c])
            rows.append(kids)
        out.append(rows)
    return out


def _target_probs(gen, cand, nt, ns, vocab):
    bs, n = cand.shape
    probs = torch.rand(bs, n, vocab, generator=gen) ** 3
    probs = torch.where(torch.rand(bs, n, vocab, generator=gen) < 0.3, 0.0, probs)
    kids = _children_tokens(cand, nt, ns)
    for b in range(bs):
        for i in range(n):
            kind = int(torch.randint(0, 3, (1,), generator=gen))
            if kind == 2 or not kids[b][i]:
                continue
            on_kids = torch.zeros(vocab)
            on_kids[kids[b][i]] = torch.rand(len(kids[b][i]), generator=gen) + 0.05
            probs[b, i] = on_kids if kind == 0 else probs[b, i] + 4 * on_kids
    return probs / probs.sum(-1, keepdim=True).clamp(min=1e-30)


@pytest.mark.parametrize("bs,topk,num_steps,num_draft", CASES)
@pytest.mark.parametrize("vocab", [5, 300])  # 300: two vocabulary blocks under the interpreter, ragged
def test_sampling_matches_reference(bs, topk, num_steps, num_draft, vocab):
    for seed in range(2):
        gen, tree = _tree(seed, bs, topk, num_steps, num_draft, vocab=min(vocab, 6))
        probs = _target_probs(gen, *tree[0:1], tree[2], tree[3], vocab)
        uniform = torch.rand(bs, num_draft, generator=gen)
        uniform[0, 0] = 0.0
        uniform_final = torch.rand(bs, generator=gen)
        uniform_final[-1] = 1.0 - 2**-24
        ref = verify_tree_sampling(*tree, probs, uniform, uniform_final, num_steps)
        got = triton_verify_tree_sampling(*[t.to(DEVICE) for t in tree], probs.to(DEVICE), uniform.to(DEVICE),
                                          uniform_final.to(DEVICE), num_steps)
        assert_same(got, ref)


def test_bonus_draws_match_sample_from_probs():
    """Root-only trees (num_steps 0): the bonus is `sample_from_probs(q[root], u)`; 24 draws over a
    vocabulary of 1000 (several blocks, ragged end) with zeros, a row without mass and edge coins."""
    gen = torch.Generator().manual_seed(11)
    bs, vocab = 24, 1000
    probs = torch.rand(bs, 1, vocab, generator=gen) ** 4
    probs = torch.where(torch.rand(bs, 1, vocab, generator=gen) < 0.5, 0.0, probs)
    probs[1, 0, 700:] = 0.0  # last positive index inside a block
    probs[2, 0] = 0.0  # no mass at all: token 0
    tree = (torch.randint(0, vocab, (bs, 1), generator=gen), torch.arange(bs)[:, None],
            torch.full((bs, 1), -1), torch.full((bs, 1), -1))
    uniform_final = torch.rand(bs, generator=gen)
    uniform_final[:4] = torch.tensor([0.0, 1.0 - 2**-24, 0.5, 0.999])
    _both(*tree, probs, torch.rand(bs, 1, generator=gen), uniform_final, 0)


def _both(*args):
    ref = verify_tree_sampling(*args)
    got = triton_verify_tree_sampling(*[a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args])
    assert_same(got, ref)
    return ref


@pytest.mark.parametrize("root_q,accepted_node", [
    ({1: 0.5, 2: 0.5}, None),
    ({1: 0.3, 2: 0.3}, 3),  # unnormalized, empty residual: u = 0.9 is capped at 0.6, node 3 reaches it
    ({2: 0.5, 1: 1e-9}, 1),  # the cap is reached by node 1 already (0.5 + 1e-9 rounds to 0.5)
    ({1: 0.3, 2: 0.3, 3: 0.1}, -1),  # a real residual: rejected, the bonus comes from {3}
])
def test_sampling_duplicates_zero_mass_and_coin_cap(root_q, accepted_node):
    """Hand-made tree: the root's children hold tokens [2, 2, 1] (node 2 repeats node 1's token)."""
    cand = torch.tensor([[0, 2, 2, 1]])
    ri = torch.tensor([[0, 1, 2, 3]])
    nt = torch.tensor([[1, -1, -1, -1]])
    ns = torch.tensor([[-1, 2, 3, -1]])
    probs = torch.zeros(1, 4, 5)
    for tok, p in root_q.items():
        probs[0, 0, tok] = p
    probs[0, 1:, 4] = 1.0
    for u0 in (0.0, 0.3, 0.5, 0.7, 0.9):
        for uf in (0.0, 0.99):
            ref = _both(cand, ri, nt, ns, probs, torch.tensor([[u0, 0.5, 0.5, 0.5]]), torch.tensor([uf]), 1)
            if u0 == 0.9 and accepted_node is not None:
                assert int(ref[1][0, 1]) == accepted_node
    zero = torch.zeros(1, 4, 5)
    zero[0, :, 0] = 1.0  # every child token has zero mass: never accepted, even at u = 0
    ref = _both(cand, ri, nt, ns, zero, torch.zeros(1, 4), torch.tensor([0.5]), 1)
    assert int(ref[2][0]) == 0


def test_empty_batch_and_shape_errors():
    e = torch.zeros(0, 4, dtype=torch.int64, device=DEVICE)
    got = triton_verify_greedy(e, e, e, e, e, 3)
    assert_same(got, verify_greedy(*[t.cpu() for t in (e, e, e, e, e)], 3))
    got = triton_verify_tree_sampling(e, e, e, e, torch.zeros(0, 4, 7, device=DEVICE), torch.zeros(0, 4, device=DEVICE),
                                      torch.zeros(0, device=DEVICE), 3)
    assert got[1].shape == (0, 4)
    t = torch.zeros(2, 4, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match=r"target_predict must be \(2, 4\), got \(2, 3\)"):
        triton_verify_greedy(t, t, t, t, t[:, :3], 3)
    with pytest.raises(ValueError, match=r"uniform must be \(bs, num_draft\) = \(2, 4\)"):
        triton_verify_tree_sampling(t, t, t, t, torch.zeros(2, 4, 5, device=DEVICE), torch.zeros(2, 3, device=DEVICE),
                                    torch.zeros(2, device=DEVICE), 3)


@gpu
@needs_cuda
@pytest.mark.parametrize("bs,topk,num_steps,num_draft", [(8, 4, 5, 8), (32, 8, 6, 64)])
def test_gpu_llama_vocab(bs, topk, num_steps, num_draft):
    """Llama-3 vocabulary (128256): GPU kernels against the CPU references (float64 cumsums)."""
    vocab = 128256
    gen, tree = _tree(bs, bs, topk, num_steps, num_draft, vocab=50)
    cand = tree[0]
    predict = torch.where(torch.rand(cand.shape, generator=gen) < 0.8, cand.roll(-1, 1), 7)
    assert_same(triton_verify_greedy(*[t.cuda() for t in tree], predict.cuda(), num_steps),
                verify_greedy(*tree, predict, num_steps))
    probs = torch.softmax(3 * torch.randn(bs, num_draft, vocab, generator=gen), -1)
    hot = torch.zeros(bs, num_draft, vocab)
    hot[:, :, :50] = torch.rand(bs, num_draft, 50, generator=gen) * 20
    probs = (probs + hot) / (probs + hot).sum(-1, keepdim=True)
    uniform, uniform_final = torch.rand(bs, num_draft, generator=gen), torch.rand(bs, generator=gen)
    ref = verify_tree_sampling(*tree, probs, uniform, uniform_final, num_steps)
    got = triton_verify_tree_sampling(*[t.cuda() for t in tree], probs.cuda(), uniform.cuda(), uniform_final.cuda(),
                                      num_steps)
    assert_same(got, ref)


@pytest.mark.parametrize("bs,n,width", [(1, 7, 5), (3, 8, 6), (4, 5, 5)])
def test_simulated_accept_matches_reference(bs, n, width):
    """The benchmark's simulated override in one launch: the torch version's accept_index, tokens and
    counts, dtypes included, for every accept count 1 .. width."""
    from spec_kernels.accept import triton_simulated_accept
    from spec_runtime.tree import simulated_accept as reference_simulated_accept

    gen = torch.Generator().manual_seed(bs * 100 + n)
    for a_max in range(1, width + 1):
        a = torch.randint(1, a_max + 1, (bs,), generator=gen).to(DEVICE)
        ri = (torch.arange(bs)[:, None] * n + torch.arange(n)).to(DEVICE)
        draft = torch.randint(0, 1000, (bs, n), generator=gen).to(DEVICE)
        pred = torch.randint(0, 1000, (bs, n), generator=gen).to(DEVICE)
        assert_same(triton_simulated_accept(a, ri, draft, pred, width), reference_simulated_accept(a, ri, draft, pred, width))


def test_simulated_accept_builds_for_hopper():
    """The kernel compiles for sm90, ptxas included (the interpreter type-checks less); what it
    computes is checked against the reference above."""
    from kernel_helpers import hopper_build

    types = {n: "*i64" for n in ("a_ptr", "ri_ptr", "dt_ptr", "pred_ptr", "index_ptr", "tokens_ptr")}
    types["nc_ptr"] = "*i32"
    (ptx,) = hopper_build("spec_kernels.accept", "_simulated_kernel", types, [dict(WP=8)], ptx=True)
    assert ptx.strip()  # compiled; nothing is asserted about one Triton version's PTX
