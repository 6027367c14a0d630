"""Tests for spec_runtime.tree.verify_chain_rejection, rejection sampling of a draft chain: hand
cases, the empty-residual fallback, losslessness statistics and their power, shape errors."""

import pytest
import torch
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
