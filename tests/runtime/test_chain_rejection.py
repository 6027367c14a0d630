"""Tests for spec_runtime.tree.verify_chain_rejection, rejection sampling of a draft chain: hand
cases, the empty-residual fallback, losslessness statistics and their power, shape errors, and two
exact references: a plain-python one compared coin for coin (with coins just either side of each
acceptance boundary), and the exact law of a two-draft chain over a vocabulary of 3 (every
outcome's probability as a fraction, against the law lossless speculative sampling must have)."""

import itertools
import random
from collections import Counter
from fractions import Fraction as F

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.runtime._chain_reference import reference_chain_rejection
from tests.runtime._tree_cases import I64, _t, chi2_pvalue

from spec_runtime.sampling import sample_from_probs
from spec_runtime.tree import verify_chain_rejection

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


# ----------------------------------------------------------------------------------------------
# the exact reference: coin for coin, and the exact law of a tiny chain
# ----------------------------------------------------------------------------------------------


def near_boundary_coins(gen, drafts, p, q):
    """Coins (bs, k): uniform, except where the target/draft ratio r = q/p of the draft is in (0, 1):
    there, in half the cases, r * (1 +- 1%), just either side of the acceptance boundary."""
    u = torch.rand(drafts.shape, generator=gen)
    ratio = q[:, :-1].gather(2, drafts[..., None]).squeeze(2) / p.gather(2, drafts[..., None]).squeeze(2)
    side = torch.where(torch.rand(drafts.shape, generator=gen) < 0.5, 0.99, 1.01)
    near = (ratio > 0) & (ratio < 0.98) & (torch.rand(drafts.shape, generator=gen) < 0.5)
    return torch.where(near, ratio * side, u)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), k=st.integers(1, 4), vocab=st.integers(2, 5))
def test_chain_rejection_matches_reference(seed, k, vocab):
    """Coin for coin against the plain-python reference, with coins on both sides of each boundary."""
    gen = torch.Generator().manual_seed(seed)
    bs = 16

    def dists(rows):
        d = torch.rand(bs, rows, vocab, generator=gen) * (torch.rand(bs, rows, vocab, generator=gen) > 0.3)
        d[..., 0] += 1e-3
        return d / d.sum(-1, keepdim=True)

    p, q = dists(k), dists(k + 1)
    drafts = torch.multinomial(p.view(-1, vocab), 1, generator=gen).view(bs, k)
    u, uf = near_boundary_coins(gen, drafts, p, q), torch.rand(bs, generator=gen)
    tokens, num_correct = verify_chain_rejection(drafts, p, q, u, uf)
    for b in range(bs):
        emitted, count = reference_chain_rejection(
            drafts[b].tolist(), p[b].tolist(), q[b].tolist(), u[b].tolist(), float(uf[b])
        )
        assert (tokens[b, : count + 1].tolist(), int(num_correct[b])) == (emitted, count), f"row {b}"
        assert tokens[b, count + 1 :].tolist() == [-1] * (k - count)


# The exact law of a two-draft chain over a vocabulary of 3. Draft probabilities are 1/2, 1/4 or 0 and
# target probabilities multiples of 1/16, with every max(q - p, 0) summing to a power of two (in
# sixteenths): every acceptance ratio q/p is then a multiple of 1/8 and every cumulative probability
# of a draw (correction or bonus) a multiple of 1/16, so the midpoints of a grid of 64 coins per draft
# and 16 final coins split each coin's range exactly where the correct rule does, and counting the
# outcomes over the grid gives the law as exact fractions. A rule with other boundaries (a ratio
# scaled by 1.02 moves the boundary r past a midpoint for r > 25/64) or other coins shows.
V, COINS, FINAL = 3, 64, 16
DRAFT_ROWS = sorted(set(itertools.permutations((F(1, 2), F(1, 4), F(1, 4))))
                    | set(itertools.permutations((F(1, 2), F(1, 2), F(0)))))
TARGET_ROWS = [tuple(F(c, 16) for c in (a, b, 16 - a - b)) for a in range(17) for b in range(17 - a)]


def dyadic_pair(rng):
    """A draft row p and a target row q whose residual max(q - p, 0) sums to 0, 1/16, 1/8, 1/4 or 1/2."""
    p = rng.choice(DRAFT_ROWS)
    fits = [q for q in TARGET_ROWS if sum(max(a - b, 0) for a, b in zip(q, p)) in (0, F(1, 16), F(1, 8), F(1, 4), F(1, 2))]
    return p, rng.choice(fits)


def chain_design(seed):
    """Tables of a 2-draft chain: p1, q1; p2[x1], q2[x1]; q3[x1][x2] (q3 only needs 1/16 steps).

    Drawn until the design can show both kinds of error: a depth-1 ratio in [1/2, 1) (moved past a
    coin midpoint when scaled by 1.02) and a draft pair whose ratios are both < 1 (one coin for both
    accepts them with probability min(r1, r2), not r1 * r2)."""
    rng = random.Random(seed)
    while True:
        p1, q1 = dyadic_pair(rng)
        second = [dyadic_pair(rng) for _ in range(V)]
        p2, q2 = [s[0] for s in second], [s[1] for s in second]
        ratios = [(q1[a] / p1[a], q2[a][b] / p2[a][b]) for a in range(V) for b in range(V) if p1[a] and p2[a][b]]
        if any(F(1, 2) <= r1 < 1 for r1, _ in ratios) and any(0 < r1 < 1 and 0 < r2 < 1 for r1, r2 in ratios):
            return p1, q1, p2, q2, [[rng.choice(TARGET_ROWS) for _ in range(V)] for _ in range(V)]


def implementation_law(design, verify=verify_chain_rejection):
    """{(num_correct, emitted tokens): exact probability} of `verify` over the draft tokens (weighted by
    p) and the coin grids."""
    p1, q1, p2, q2, q3 = design
    grid = torch.meshgrid((torch.arange(COINS) + 0.5) / COINS, (torch.arange(COINS) + 0.5) / COINS,
                          (torch.arange(FINAL) + 0.5) / FINAL, indexing="ij")
    u, uf = torch.stack(grid[:2], -1).reshape(-1, 2), grid[2].reshape(-1)
    rows, law = len(uf), Counter()
    for x1, x2 in itertools.product(range(V), repeat=2):
        weight = p1[x1] * p2[x1][x2]
        if weight == 0:
            continue
        p = torch.tensor([[float(v) for v in p1], [float(v) for v in p2[x1]]]).expand(rows, 2, V)
        q = torch.tensor([[float(v) for v in r] for r in (q1, q2[x1], q3[x1][x2])]).expand(rows, 3, V)
        tokens, num_correct = verify(torch.tensor([[x1, x2]]).expand(rows, 2), p, q, u, uf)
        # one code per outcome: num_correct, then the three token slots (-1 padded), in base V + 1
        code = num_correct.long()
        for slot in range(3):
            code = code * (V + 1) + tokens[:, slot] + 1
        for c in code.unique().tolist():
            count, slots = int((code == c).sum()), []
            for _ in range(3):
                c, digit = divmod(c, V + 1)
                slots.insert(0, digit - 1)
            law[(c, tuple(slots[: c + 1]))] += weight * F(count, rows)
    return law


def lossless_law(design):
    """The law lossless speculative sampling must have: the first token follows q1; a first draft a is
    accepted with probability min(p1, q1)(a) and the token after it follows q2[a]; a second draft b
    is accepted with probability min(p2[a], q2[a])(b) and the bonus follows q3[a][b]."""
    p1, q1, p2, q2, q3 = design
    law = Counter()
    for a in range(V):
        acc1 = min(p1[a], q1[a])
        law[(0, (a,))] += q1[a] - acc1
        for b in range(V):
            acc2 = min(p2[a][b], q2[a][b])
            law[(1, (a, b))] += acc1 * (q2[a][b] - acc2)
            for c in range(V):
                law[(2, (a, b, c))] += acc1 * acc2 * q3[a][b][c]
    return +law  # without zero entries


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_chain_rejection_exact_law(seed):
    design = chain_design(seed)
    got, want = implementation_law(design), lossless_law(design)
    assert sum(got.values()) == 1 and sum(want.values()) == 1
    assert got == want, {key: (got[key], want[key]) for key in set(got) | set(want) if got[key] != want[key]}
