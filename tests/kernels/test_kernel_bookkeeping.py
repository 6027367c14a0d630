"""commit_accepted and extend_after_decode against their torch references (the verify phase's own
bookkeeping)."""

import pytest
import torch
from kernel_helpers import DEVICE, assert_same, gpu, needs_cuda

from spec_runtime.kernels.bookkeeping import (
    commit_accepted,
    extend_after_decode,
    reference_commit_accepted,
    reference_extend_after_decode,
)


def _accepted(gen, bs, n, steps):
    """Random accept_index: root row, then up to `steps` distinct later rows of the request, -1 padded."""
    acc = torch.full((bs, steps + 1), -1, dtype=torch.int64)
    counts = torch.randint(1, steps + 2, (bs,), generator=gen)
    for b in range(bs):
        nodes = [0] + sorted(torch.randperm(n - 1, generator=gen)[: counts[b] - 1].add(1).tolist())
        acc[b, : len(nodes)] = torch.tensor(nodes) + b * n
    return acc, (acc >= 0).sum(1)


@pytest.mark.parametrize("bs,n,steps", [(3, 4, 3), (1, 1, 0), (4, 8, 5)])
def test_commit_accepted(bs, n, steps):
    gen = torch.Generator().manual_seed(bs + n)
    steps = min(steps, n - 1)
    acc, _ = _accepted(gen, bs, n, steps)
    rows = torch.randperm(6, generator=gen)[:bs]
    seq_lens = torch.randint(0, 10, (bs,), generator=gen)
    slots = torch.randperm(100, generator=gen)[: bs * n]
    table = torch.full((6, 20), -1, dtype=torch.int64)
    ref_table, got_table = table.clone(), table.to(DEVICE)
    ref = reference_commit_accepted(ref_table, rows, seq_lens, slots, acc)
    got = commit_accepted(got_table, *[t.to(DEVICE) for t in (rows, seq_lens, slots, acc)])
    assert_same((got_table, got), (ref_table, ref))


def test_commit_empty_batch():
    table = torch.full((2, 4), -1, dtype=torch.int64, device=DEVICE)
    e = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    free = commit_accepted(table, e, e, e, torch.zeros((0, 3), dtype=torch.int64, device=DEVICE))
    assert free.shape == (0,) and bool((table == -1).all())


@pytest.mark.parametrize("bs,steps", [(3, 3), (1, 0), (5, 6)])
def test_extend_after_decode(bs, steps):
    gen = torch.Generator().manual_seed(bs)
    num_accept = torch.randint(1, steps + 2, (bs,), generator=gen)
    cols = torch.arange(steps + 1)
    tokens = torch.where(cols < num_accept[:, None], torch.randint(0, 50, (bs, steps + 1), generator=gen), -1)
    seq_lens = torch.randint(0, 30, (bs,), generator=gen)
    t = int(num_accept.sum())
    ref = reference_extend_after_decode(tokens, num_accept, seq_lens, t)
    got = extend_after_decode(tokens.to(DEVICE), num_accept.to(DEVICE, torch.int32), seq_lens.to(DEVICE), t)
    assert_same(got, ref)


def test_extend_after_decode_empty_batch():
    e = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    ids, pos, bonus = extend_after_decode(torch.zeros((0, 4), dtype=torch.int64, device=DEVICE), e, e, 0)
    assert ids.shape == pos.shape == bonus.shape == (0,)


@gpu
@needs_cuda
def test_gpu_large_batch():
    gen = torch.Generator().manual_seed(0)
    bs, n, steps = 1500, 8, 5  # more requests than one block of the offset sum
    acc, counts = _accepted(gen, bs, n, steps)
    rows = torch.randperm(bs, generator=gen)
    seq_lens = torch.randint(0, 1000, (bs,), generator=gen)
    slots = torch.randperm(100000, generator=gen)[: bs * n]
    ref_table = torch.full((bs, 1100), -1, dtype=torch.int64)
    got_table = ref_table.cuda()
    ref = reference_commit_accepted(ref_table, rows, seq_lens, slots, acc)
    got = commit_accepted(got_table, *[t.cuda() for t in (rows, seq_lens, slots, acc)])
    assert_same((got_table, got), (ref_table, ref))
    tokens = torch.where(acc >= 0, torch.randint(0, 128256, acc.shape, generator=gen), -1)
    ref = reference_extend_after_decode(tokens, counts, seq_lens, int(counts.sum()))
    assert_same(extend_after_decode(tokens.cuda(), counts.cuda(), seq_lens.cuda(), int(counts.sum())), ref)
