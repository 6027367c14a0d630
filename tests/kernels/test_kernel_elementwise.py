"""`gpu.elementwise.embed_rmsnorm` (a forward's embedding gather and first RMSNorm in one kernel)
against the torch reference and the plain RMSNorm kernel. The other elementwise kernels are checked
under the interpreter in `tests/runtime/test_static_executor.py` and on the GPU through the engine."""

import pytest
import torch
from kernel_helpers import DEVICE, ON_GPU

from spec_runtime.gpu import elementwise as ew

# (rows, hidden): tiny on the interpreter; on the GPU the 8B and 1B widths
SHAPES = [(37, 4096), (1, 4096), (8, 2048)] if ON_GPU else [(5, 48), (1, 32)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden", SHAPES)
def test_embed_rmsnorm_is_gather_then_rmsnorm(rows, hidden, dtype):
    """The gathered rows exactly (repeated ids included), the norm bit for bit the plain RMSNorm
    kernel's on them, and close to `reference_embed_rmsnorm`."""
    gen = torch.Generator().manual_seed(rows)
    vocab = 1000 if ON_GPU else 9
    table = torch.randn(vocab, hidden, generator=gen).to(dtype).to(DEVICE)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype).to(DEVICE)
    ids = torch.randint(0, vocab, (rows,), generator=gen)
    ids[-1] = ids[0]
    ids = ids.to(DEVICE)
    emb, normed = ew.embed_rmsnorm(ids, table, weight, 1e-5)
    assert torch.equal(emb, table[ids])
    assert torch.equal(normed, ew.rmsnorm(table[ids], weight, 1e-5))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for got, want in zip((emb, normed), ew.reference_embed_rmsnorm(ids, table, weight, 1e-5)):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_embed_rmsnorm_bad_ids_and_shapes():
    """An id outside the table reads a zero row (no sync to check it); wrong shapes are refused
    with the shapes named."""
    table = torch.randn(9, 32).to(DEVICE)
    weight = torch.ones(32, device=DEVICE)
    emb, normed = ew.embed_rmsnorm(torch.tensor([1, 9, -1], device=DEVICE), table, weight, 1e-6)
    assert torch.equal(emb[0], table[1]) and not emb[1:].any() and not normed[1:].any()
    with pytest.raises(ValueError, match=r"ids must be \(T,\), table \(V, H\) and weight \(H,\), got \(3, 1\), "
                                         r"\(9, 32\) and \(32,\)"):
        ew.embed_rmsnorm(torch.zeros(3, 1, dtype=torch.int64, device=DEVICE), table, weight, 1e-6)
    with pytest.raises(ValueError, match="the table's rows must be contiguous"):
        ew.embed_rmsnorm(torch.zeros(3, dtype=torch.int64, device=DEVICE), table.t(), torch.ones(9, device=DEVICE), 1e-6)
    e, n = ew.embed_rmsnorm(torch.zeros(0, dtype=torch.int64, device=DEVICE), table, weight, 1e-6)
    assert e.shape == n.shape == (0, 32)
    ids = torch.tensor([[4, 0], [2, 0], [7, 0]], device=DEVICE)[:, 0]  # a strided view
    assert torch.equal(ew.embed_rmsnorm(ids, table, weight, 1e-6)[0], table[ids])
