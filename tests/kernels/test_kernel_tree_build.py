"""triton_build_tree against tree.build_tree: every output, exactly, plus the reference's errors."""

import pytest
import torch
from kernel_helpers import DEVICE, assert_same, gpu, needs_cuda, random_tree

from spec_kernels.tree_build import triton_build_tree
from spec_runtime.tree import build_tree


def _on(device, *ts):
    return [t.to(device) for t in ts]


@pytest.mark.parametrize("bs,topk,num_steps,num_draft", [
    (3, 1, 3, 4), (2, 2, 3, 6), (2, 4, 3, 12), (1, 4, 4, 21), (2, 2, 1, 1), (2, 3, 2, 2),
])
def test_matches_reference(poisoned_empty, program_order, bs, topk, num_steps, num_draft):
    """(Outputs allocated empty: the kernel writes every element, the mask's zeros too.)"""
    gen = torch.Generator().manual_seed(bs * 100 + topk * 10 + num_draft)
    (parent_list, selected, tokens), bonus, seq_lens, ref = random_tree(gen, bs, topk, num_steps, num_draft, 8)
    args = _on(DEVICE, parent_list, selected, tokens, bonus, seq_lens)
    got = triton_build_tree(*args, topk, num_steps, num_draft, validate=True)
    assert_same(got, ref)


def test_int32_inputs_and_empty_batch():
    gen = torch.Generator().manual_seed(7)
    (parent_list, selected, tokens), bonus, seq_lens, ref = random_tree(gen, 2, 2, 3, 5, 8)
    args = [t.to(DEVICE, torch.int32) for t in (parent_list, selected, tokens, bonus, seq_lens)]
    assert_same(triton_build_tree(*args, 2, 3, 5), ref)
    empty = [t[:0] for t in args]
    assert_same(triton_build_tree(*empty, 2, 3, 5), build_tree(*[t.cpu() for t in empty], 2, 3, 5))


def test_invalid_trees_raise_like_the_reference():
    pl = torch.tensor([[-1, 0, 1]], device=DEVICE)  # topk 2, num_steps 2
    cases = [
        (torch.tensor([[0, 7]]), "selected_index values must be in"),
        (torch.tensor([[1, 0]]), "strictly ascending"),
        (torch.tensor([[0, 4]]), "parent is not selected"),  # 4 // 2 = 2 -> parent flat 1, not selected
    ]
    for selected, message in cases:
        selected = selected.to(DEVICE)
        args = (pl, selected, torch.zeros_like(selected), torch.zeros(1, dtype=torch.int64, device=DEVICE),
                torch.zeros(1, dtype=torch.int64, device=DEVICE), 2, 2, 3)
        with pytest.raises(ValueError, match=message):
            build_tree(*[a.cpu() if isinstance(a, torch.Tensor) else a for a in args])
        with pytest.raises(ValueError, match=message):
            triton_build_tree(*args, validate=True)
        triton_build_tree(*args)  # unchecked: runs, output unspecified
    with pytest.raises(ValueError, match=r"parent_list must be \(bs, topk\*\(num_steps-1\)\+1\)"):
        triton_build_tree(pl[:, :2], torch.tensor([[0, 1]], device=DEVICE), torch.zeros(1, 2, dtype=torch.int64),
                          torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), 2, 2, 3)


@gpu
@needs_cuda
@pytest.mark.parametrize("bs,topk,num_steps,num_draft", [(32, 4, 5, 8), (8, 8, 6, 64), (64, 1, 7, 8)])
def test_gpu_matches_reference(bs, topk, num_steps, num_draft):
    gen = torch.Generator().manual_seed(bs + num_draft)
    (parent_list, selected, tokens), bonus, seq_lens, ref = random_tree(gen, bs, topk, num_steps, num_draft, 1000)
    got = triton_build_tree(*_on("cuda", parent_list, selected, tokens, bonus, seq_lens), topk, num_steps,
                            num_draft, validate=True)
    assert_same(got, ref)
