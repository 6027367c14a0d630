"""pad_tree_rows (the launched draft's trees -> the verify buffers, padded requests padded, one
launch) against reference_pad_tree_rows, for every live count of a bucket."""

import pytest
import torch
from kernel_helpers import DEVICE

from spec_kernels.tree_rows import TREE_FIELDS, pad_tree_rows, reference_pad_tree_rows


def _tensors(gen: torch.Generator, bucket: int, n: int) -> list[torch.Tensor]:
    out = []
    for name in TREE_FIELDS:
        shape = (bucket, n, n) if name == "tree_mask" else (bucket,) if name in TREE_FIELDS[6:] else (bucket, n)
        t = torch.randint(0, 2, shape, generator=gen).bool() if name == "tree_mask" else \
            torch.randint(-1, 90, shape, generator=gen)
        out.append(t.to(DEVICE))
    return out


@pytest.mark.parametrize("bucket,n", [(4, 5), (3, 4), (2, 1)])
def test_pad_tree_rows_matches_reference(program_order, bucket: int, n: int) -> None:
    gen = torch.Generator().manual_seed(bucket * 10 + n)
    for nlive in range(bucket + 1):
        src, before = _tensors(gen, bucket, n), _tensors(gen, bucket, n)
        want, got = [t.clone() for t in before], [t.clone() for t in before]
        live = torch.tensor(nlive, device=DEVICE)
        reference_pad_tree_rows(src, want, live, 7)
        pad_tree_rows(src, got, live, 7)
        for name, g, w in zip(TREE_FIELDS, got, want):
            assert torch.equal(g, w), f"nlive={nlive} {name}:\n{g}\nexpected\n{w}"
        if 0 < nlive < bucket:  # the reference pads what it should (the kernel matched it)
            assert got[7][nlive:].eq(7).all() and got[4][nlive:].eq(-1).all()
            assert torch.equal(got[3][nlive:], before[3][nlive:]) and torch.equal(got[0][:nlive], src[0][:nlive])


def test_pad_tree_rows_errors() -> None:
    src = _tensors(torch.Generator().manual_seed(0), 2, 3)
    with pytest.raises(ValueError, match=r"the buffer's positions has dtype torch.int32"):
        pad_tree_rows(src, [*src[:1], src[1].int(), *src[2:]], torch.tensor(1, device=DEVICE), 0)
    with pytest.raises(ValueError, match="takes 8 sources"):
        pad_tree_rows(src[:7], src, torch.tensor(1, device=DEVICE), 0)
