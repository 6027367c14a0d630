"""softmax_topk / row_argmax against torch's softmax + topk and argmax."""

import pytest
import torch
from kernel_helpers import DEVICE, gpu, needs_cuda

from spec_kernels.topk import reference_argmax, row_argmax, softmax_topk
from spec_runtime.sampling import softmax_topk as reference_softmax_topk


@pytest.mark.parametrize("rows,vocab,k", [(3, 100, 4), (4, 5000, 4), (2, 7, 7), (5, 4097, 1), (1, 64, 2), (2, 2048, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_softmax_topk_and_argmax(rows, vocab, k, dtype):
    """Several vocabulary blocks (2048 each) with ragged tails; distinct values, so the order is
    unique and the indices must be torch's exactly."""
    gen = torch.Generator().manual_seed(rows * vocab + k)
    x = (torch.randperm(rows * vocab, generator=gen).float().view(rows, vocab) / (rows * vocab) * 20 - 10)
    x = x.to(dtype).to(DEVICE)
    if dtype == torch.bfloat16:  # bf16 rounding makes ties: keep the rows' top values distinct
        top = min(2 * k, vocab)
        x[:, :top] = torch.linspace(12, 20, top, device=DEVICE).to(dtype)
    probs, ids = softmax_topk(x, k)
    ref_p, ref_i = reference_softmax_topk(x, k)
    assert probs.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (rows, k)
    assert torch.equal(ids, ref_i)
    # The kernel sums exp() per 2048-wide block, then merges the blocks; torch sums in its own order.
    # Float32 sums of a few thousand terms in two orders differ by up to ~sqrt(n) ulps: 2.05e-6 was
    # seen on an AMD EPYC machine (numpy's exp under the interpreter), so 1e-5 (~80 ulps), not 2e-6.
    torch.testing.assert_close(probs, ref_p, rtol=1e-5, atol=1e-9)
    assert torch.equal(row_argmax(x), reference_argmax(x))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_draft_ids_mapped_in_the_merge(program_order, dtype):
    """`d2t`: the ids come back as `i + d2t[i]` (an EAGLE-3 head's `to_target_ids`), probabilities unchanged."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(3, 3000, generator=gen).to(DEVICE)
    d2t = torch.randint(0, 500, (3000,), generator=gen).to(dtype).to(DEVICE)
    probs, ids = softmax_topk(x, 4)
    mp, mi = softmax_topk(x, 4, d2t=d2t)
    assert torch.equal(mp, probs) and mi.dtype == torch.int64
    assert torch.equal(mi, ids + d2t[ids].long())
    with pytest.raises(ValueError, match=r"d2t has shape \(2999,\), expected \(3000\)"):
        softmax_topk(x, 4, d2t=d2t[:-1])


def test_ties_leading_dims_and_masked_entries():
    x = torch.zeros(2, 3, 3000, device=DEVICE)
    x[0, 1, [2500, 5, 7]] = 1.0  # tied maxima in two blocks: index order
    x[1, 2] = float("-inf")
    x[1, 2, [9, 3]] = 0.5  # only two finite entries: then the first -inf indices
    probs, ids = softmax_topk(x, 4)
    assert ids.shape == (2, 3, 4)
    assert ids[0, 1].tolist() == [5, 7, 2500, 0]
    assert ids[1, 2].tolist() == [3, 9, 0, 1]
    assert probs[1, 2].tolist() == [0.5, 0.5, 0.0, 0.0]
    torch.testing.assert_close(probs[0, 1, :3], torch.full((3,), torch.e / (torch.e * 3 + 2997), device=DEVICE))
    assert torch.equal(row_argmax(x), x.argmax(-1))
    nan = torch.tensor([[1.0, float("nan"), 3.0, float("nan")]], device=DEVICE)
    assert row_argmax(nan).tolist() == nan.argmax(-1).tolist() == [1]


def test_bad_input_names_the_problem():
    with pytest.raises(ValueError, match=r"k must be in \[1, min\(vocab, 64\)\] = \[1, 5\], got 6"):
        softmax_topk(torch.randn(2, 5, device=DEVICE), 6)
    with pytest.raises(ValueError, match="logits dtype torch.int64"):
        row_argmax(torch.zeros(2, 5, dtype=torch.int64, device=DEVICE))
    assert softmax_topk(torch.randn(0, 9, device=DEVICE), 3)[1].shape == (0, 3)


@gpu
@needs_cuda
@pytest.mark.parametrize("rows,vocab,k", [(4, 32000, 4), (64, 32000, 4), (2, 128256, 2), (9, 128256, 1)])
def test_gpu_draft_and_verify_shapes(rows, vocab, k):
    """The draft's vocabularies (EAGLE-3's 32000, the 1B's 128256) and the verify's argmax rows."""
    torch.manual_seed(vocab + rows)
    logits = torch.randn(rows, vocab, device="cuda") * 4
    probs, ids = softmax_topk(logits, k)
    ref_p, ref_i = reference_softmax_topk(logits, k)
    assert torch.equal(ids, ref_i)
    torch.testing.assert_close(probs, ref_p, rtol=2e-6, atol=1e-9)
    assert torch.equal(row_argmax(logits), logits.argmax(-1))
    bf = logits.bfloat16().view(rows, 1, vocab)
    assert torch.equal(row_argmax(bf), bf.argmax(-1))  # bf16 ties: the first maximum, as torch
