"""Shared helpers of the spec_runtime.tree tests (test_tree_build, test_tree_verify,
test_chain_rejection): tensor shorthand, random draft expansions and trees, and a pooled chi-square
p-value for the sampling statistics."""

import torch

from spec_runtime.tree import build_tree, organize, select_frontier

I64 = torch.int64


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


def children_lists(next_token, next_sibling):
    out = []
    for i in range(len(next_token)):
        kids, c = [], int(next_token[i])
        while c != -1:
            kids.append(c)
            c = int(next_sibling[c])
        out.append(kids)
    return out


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
