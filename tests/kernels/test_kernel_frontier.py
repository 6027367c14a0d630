"""kernels.frontier against the torch expansion (`select_frontier`, `gather_branches`, `organize`):
every output exactly, NaN scores, tied scores, the d2t vocabulary map, one-step drafts."""

import pytest
import torch
from kernel_helpers import DEVICE, gpu, needs_cuda

from spec_kernels.frontier import DraftRecords, chain_probs, frontier_step, onehot_rows, organize_records
from spec_runtime.tree import gather_branches, organize, select_frontier

VOCAB = 50


def _probs(gen: torch.Generator, rows: int, k: int, nan: bool, ties: bool) -> torch.Tensor:
    p = torch.rand(rows, k, generator=gen)
    if ties:
        p = (p * 4).floor() / 4  # many equal products, zeros included
    if nan:
        p[torch.rand(rows, k, generator=gen) < 0.2] = float("nan")
    return p


def _expand(bs: int, k: int, steps: int, num_draft: int, seed: int, nan: bool, ties: bool, d2t: bool,
            device: torch.device) -> None:
    """Run a whole draft's expansion both ways and compare every step's outputs and the rerank."""
    gen = torch.Generator().manual_seed(seed)
    table = None
    if d2t:
        offsets = torch.randint(-3, 4, (VOCAB,), generator=gen)
        table = torch.where(torch.arange(VOCAB) + offsets < 0, 0, offsets)
    temp = torch.randint(0, 1000, (bs, k, steps), generator=gen)
    seq = torch.randint(5, 50, (bs,), generator=gen)
    on = lambda t: None if t is None else t.to(device)  # noqa: E731
    records = DraftRecords.empty(bs, k, steps, device)
    p, ids = _probs(gen, bs, k, nan, ties), torch.randint(0, VOCAB, (bs, k), generator=gen)
    got = frontier_step(0, steps, records, on(p), on(ids), on(temp), on(seq))
    scores, tokens, parent, record = select_frontier(0, None, p, ids)
    history, recs, hidden = temp[:, :, :0], [record], None
    for step in range(1, steps + 1):
        branch = torch.cat([history, temp[:, :, step - 1:step]], dim=2)
        if step < steps:  # the frontier the next forward runs on
            torch.testing.assert_close(got.scores.cpu(), scores, rtol=0, atol=0, equal_nan=True)
            assert torch.equal(got.tokens.cpu(), tokens)
            assert torch.equal(got.parent.cpu(), parent)
            assert torch.equal(got.branch_slots.cpu(), branch)
            assert torch.equal(got.out_slots.cpu(), branch[:, :, -1].reshape(-1))
            assert torch.equal(got.positions.cpu(), (seq + step - 1)[:, None].expand(bs, k).reshape(-1))
            if hidden is not None:  # the step's forward's rows, reordered by parent branch
                assert torch.equal(got.hidden.cpu(), gather_branches(hidden.view(bs, k, -1), parent))
        else:
            assert got.scores is None and got.branch_slots is None  # the last step: records only
            break
        p, ids = _probs(gen, bs * k, k, nan, ties), torch.randint(0, VOCAB, (bs * k, k), generator=gen)
        target_ids = ids if table is None else ids + table[ids]
        hidden = torch.randn(bs * k, 1100 if step == 2 else 3 + 40 * step, generator=gen)  # (1100: two blocks)
        got = frontier_step(step, steps, records, on(p), on(ids), on(temp), on(seq), got.scores,
                            got.branch_slots, on(table), on(hidden))
        scores, tokens, parent, record = select_frontier(step, scores, p.view(bs, k, k), target_ids.view(bs, k, k))
        recs.append(record)
        history = gather_branches(branch, parent)
    torch.testing.assert_close(records.scores.cpu(), torch.cat([r[0] for r in recs], 1), rtol=0, atol=0,
                               equal_nan=True)
    assert torch.equal(records.tokens.cpu(), torch.cat([r[1] for r in recs], 1))
    want = organize(recs, num_draft)
    for a, b in zip(organize_records(records, num_draft), want):
        assert a.dtype == b.dtype and torch.equal(a.cpu(), b)


@pytest.mark.parametrize("bs,k,steps,num_draft", [(1, 4, 5, 8), (3, 2, 4, 7), (2, 3, 3, 9), (2, 2, 1, 3)])
@pytest.mark.parametrize("nan,ties", [(False, False), (True, False), (False, True), (True, True)])
def test_matches_torch_expansion(bs, k, steps, num_draft, nan, ties):
    _expand(bs, k, steps, num_draft, seed=bs * 31 + k * 7 + steps, nan=nan, ties=ties, d2t=k != 2, device=DEVICE)


def test_whole_candidate_set_and_empty_batch(poisoned_empty, program_order):
    """num_draft = every candidate + 1 (the rerank keeps all), and a batch of zero requests."""
    _expand(2, 2, 3, 2 + 2 * 4 + 1, seed=5, nan=True, ties=True, d2t=False, device=DEVICE)
    records = DraftRecords.empty(0, 2, 3, DEVICE)
    temp = torch.zeros((0, 2, 3), dtype=torch.int64, device=DEVICE)
    out = frontier_step(0, 3, records, torch.zeros((0, 2), device=DEVICE), torch.zeros((0, 2), dtype=torch.int64,
                        device=DEVICE), temp, torch.zeros(0, dtype=torch.int64, device=DEVICE))
    assert out.branch_slots.shape == (0, 2, 1)
    assert [t.shape for t in organize_records(records, 4)] == [(0, 5), (0, 3), (0, 3)]


def test_bad_arguments_raise():
    records = DraftRecords.empty(1, 2, 3, DEVICE)
    temp = torch.zeros((1, 2, 3), dtype=torch.int64, device=DEVICE)
    seq = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="step 1 probs/ids need 1 x 4 entries"):
        frontier_step(1, 3, records, torch.zeros((1, 2), device=DEVICE), torch.zeros((1, 2), dtype=torch.int64,
                      device=DEVICE), temp, seq)
    with pytest.raises(ValueError, match="probs has dtype torch.float16"):
        frontier_step(0, 3, records, torch.zeros((1, 2), dtype=torch.float16, device=DEVICE),
                      torch.zeros((1, 2), dtype=torch.int64, device=DEVICE), temp, seq)
    with pytest.raises(ValueError, match="step 1 needs the frontier scores"):
        frontier_step(1, 3, records, torch.zeros((2, 2), device=DEVICE), torch.zeros((2, 2), dtype=torch.int64,
                      device=DEVICE), temp, seq)
    with pytest.raises(ValueError, match=r"num_draft must be in \[1, 11\]"):
        organize_records(records, 12)


@gpu
@needs_cuda
@pytest.mark.parametrize("bs,k,steps,num_draft", [(1, 4, 5, 8), (32, 4, 5, 8), (8, 8, 6, 64), (4, 16, 3, 60)])
def test_gpu_matches_torch_expansion(bs, k, steps, num_draft):
    _expand(bs, k, steps, num_draft, seed=bs + k, nan=True, ties=True, d2t=True, device=DEVICE)


@pytest.mark.parametrize("bs,n,vocab", [(2, 4, 100), (1, 2, 5000), (3, 3, 7)])
def test_chain_probs_rows(poisoned_empty, program_order, bs: int, n: int, vocab: int) -> None:
    """A greedy chain's distributions: row 0 the root's, then the one-hot of each next node's token,
    the last row zeros (the torch loop's stack of `_propose`'s one-hots)."""
    gen = torch.Generator().manual_seed(bs * n)
    root = torch.rand(bs, vocab, generator=gen)
    tokens = torch.randint(0, vocab, (bs, n), generator=gen)
    rows = [root] + [torch.zeros(bs, vocab).scatter_(1, tokens[:, i + 1 : i + 2], 1.0) for i in range(1, n - 1)]
    want = torch.stack(rows + [torch.zeros(bs, vocab)], dim=1)
    got = chain_probs(root.to(DEVICE), tokens.to(DEVICE))
    assert torch.equal(got.cpu(), want)


def test_onehot_rows(poisoned_empty, program_order) -> None:
    """A greedy chain's proposal: ones and the one-hot rows of the ids (zeros, scatter and ones in torch)."""
    ids = torch.tensor([[3], [0], [4999]], device=DEVICE)
    ones, full = onehot_rows(ids, 5000)
    assert torch.equal(ones.cpu(), torch.ones(3, 1))
    assert torch.equal(full.cpu(), torch.zeros(3, 5000).scatter_(1, ids.cpu(), 1.0))
