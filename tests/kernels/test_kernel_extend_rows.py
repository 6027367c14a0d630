"""triton_extend_rows against extend.extend_rows (the fixed-stride draft-extend's row bookkeeping):
exact outputs, every element written by the launch (no fill before it)."""

import pytest
import torch
from kernel_helpers import DEVICE, assert_same

from spec_kernels.extend_rows import triton_extend_rows
from spec_runtime.extend import extend_rows


@pytest.mark.parametrize("bs,stride,lead,dtype", [(1, 4, 0, torch.int32), (4, 4, 1, torch.int64), (3, 5, 0, torch.int32),
                                                  (2, 1, 1, torch.int64)])
def test_extend_rows_match_reference(poisoned_empty, program_order, bs: int, stride: int, lead: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(bs * 10 + stride)
    counts = torch.randint(1, stride + 1, (bs,), generator=gen).to(dtype)
    counts[0] = stride  # a full request and (with a stride above 1) partial ones
    seq_lens = (counts + torch.randint(0, 50, (bs,), generator=gen)).to(dtype)
    out_slots = torch.randperm(200, generator=gen)[: bs * stride].long()
    want = extend_rows(counts, seq_lens, out_slots, stride, lead)
    got = triton_extend_rows(counts.to(DEVICE), seq_lens.to(DEVICE), out_slots.to(DEVICE), stride, lead)
    assert_same(got, want)


def test_extend_rows_errors() -> None:
    counts = torch.ones(2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match=r"out_slots has shape \(3,\), expected \(4\)"):
        triton_extend_rows(counts, counts, torch.zeros(3, dtype=torch.int64, device=DEVICE), 2, 0)
    empty = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    got = triton_extend_rows(empty, empty, empty, 3, 0)
    assert [tuple(t.shape) for t in got] == [(0,), (0,), (0, 3)]
