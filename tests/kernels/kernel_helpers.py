"""Shared helpers of the kernel tests (imported by basename: pytest puts this folder on sys.path)."""

import pytest
import torch

from spec_runtime.tree import build_tree, organize, select_frontier

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")

gpu = pytest.mark.gpu
"""Mark a test as GPU-only; use together with `needs_cuda`."""
needs_cuda = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")


def random_tree(gen: torch.Generator, bs: int, topk: int, num_steps: int, num_draft: int, vocab: int,
                quantum: int = 4):
    """A random EAGLE-2 tree through the reference expansion (`select_frontier` + `organize`).

    Probabilities are quantized to multiples of 1/quantum (ties), tokens drawn from a small vocab
    (duplicate sibling tokens). Returns `(organize outputs, bonus, seq_lens, build_tree outputs)`.
    """
    scores, records = None, []
    for step in range(num_steps):
        shape = (bs, topk) if step == 0 else (bs, topk, topk)
        p = torch.randint(0, quantum + 1, shape, generator=gen).float() / quantum
        tok = torch.randint(0, vocab, shape, generator=gen)
        scores, _, _, record = select_frontier(step, scores, p, tok)
        records.append(record)
    parent_list, selected, draft_tokens = organize(records, num_draft)
    bonus = torch.randint(0, vocab, (bs,), generator=gen)
    seq_lens = torch.randint(0, 100, (bs,), generator=gen)
    tree = build_tree(parent_list, selected, draft_tokens, bonus, seq_lens, topk, num_steps, num_draft)
    return (parent_list, selected, draft_tokens), bonus, seq_lens, tree


def assert_same(got, ref) -> None:
    """Tuples of tensors equal exactly, dtypes included."""
    assert len(got) == len(ref)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert a.dtype == b.dtype, f"output {i}: dtype {a.dtype}, expected {b.dtype}"
        assert a.shape == b.shape, f"output {i}: shape {tuple(a.shape)}, expected {tuple(b.shape)}"
        assert torch.equal(a.cpu(), b.cpu()), f"output {i} differs:\n{a}\nexpected\n{b}"
