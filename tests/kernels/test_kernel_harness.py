"""The kernel tests' GPU stand-ins on the CPU do what they say: `program_order` runs an interpreted
launch's programs in the grid's order or reversed, `poisoned_empty` fills what `torch.empty` returns."""

import pytest
import torch
import triton
import triton.language as tl
from kernel_helpers import ON_GPU


@triton.jit
def _order_probe_kernel(count_ptr, seen_ptr):
    # each program records how many ran before it: a race on a GPU, the run order on the interpreter
    before = tl.load(count_ptr)
    tl.store(seen_ptr + tl.program_id(0), before)
    tl.store(count_ptr, before + 1)


@pytest.mark.skipif(ON_GPU, reason="the interpreter's program order (a GPU runs the programs concurrently)")
def test_program_order_runs_the_grid_both_ways(program_order: str) -> None:
    count, seen = torch.zeros(1, dtype=torch.int32), torch.full((5,), -1, dtype=torch.int32)
    _order_probe_kernel[(5,)](count, seen)
    want = [0, 1, 2, 3, 4] if program_order == "in order" else [4, 3, 2, 1, 0]
    assert seen.tolist() == want and count.item() == 5


def test_poisoned_empty_fills_every_dtype(poisoned_empty) -> None:
    assert torch.empty(3).isnan().all() and torch.empty(2, dtype=torch.bfloat16).isnan().all()
    assert torch.empty(2, dtype=torch.int64).eq(77).all() and torch.empty(2, dtype=torch.int32).eq(77).all()
    assert torch.empty(2, dtype=torch.bool).all() and torch.empty(2, dtype=torch.uint8).eq(0xAB).all()
