"""The split-K GEMV against torch.nn.functional.linear."""

import pytest
import torch
from kernel_helpers import DEVICE, gpu, needs_cuda

from spec_runtime.kernels.gemv import GemvConfig, linear, reference_linear, triton_linear

# (M, N, K): ragged N and K (tails), M from 1 to 16.
SHAPES = [(1, 40, 96), (5, 33, 64), (16, 64, 128), (3, 17, 48)]


def _close(got, ref, dtype):
    tol = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(got.float(), ref.float(), atol=tol * ref.abs().max().item(), rtol=tol)


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize(
    "config",
    [None, GemvConfig(16, 16, 1), GemvConfig(32, 32, 3), GemvConfig(16, 16, 1, swap=True), GemvConfig(32, 32, 2, swap=True)],
)
def test_matches_linear(m, n, k, config):
    torch.manual_seed(m * n)
    dtype = torch.float32 if (m + n) % 2 else torch.float16
    x, w, b = torch.randn(m, k, device=DEVICE).to(dtype), torch.randn(n, k, device=DEVICE).to(dtype), None
    if config is not None and config.split_k > 1:
        b = torch.randn(n, device=DEVICE).to(dtype)  # bias through the split-K reduce
    elif config is not None:
        b = torch.randn(n, device=DEVICE).to(dtype)  # bias in the single pass
    got = triton_linear(x, w, b, config=config)
    assert got.dtype == dtype and got.shape == (m, n)
    _close(got, reference_linear(x.float(), w.float(), None if b is None else b.float()), dtype)


def test_bfloat16_and_leading_dims():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 64, device=DEVICE).bfloat16()
    w = torch.randn(48, 64, device=DEVICE).bfloat16()
    got = linear(x, w)
    assert got.shape == (2, 3, 48) and got.dtype == torch.bfloat16
    _close(got, reference_linear(x.float(), w.float()), torch.bfloat16)


def test_large_m_falls_back_and_errors():
    x = torch.randn(17, 32, device=DEVICE)
    w = torch.randn(8, 32, device=DEVICE)
    torch.testing.assert_close(linear(x, w), reference_linear(x, w))
    with pytest.raises(ValueError, match="triton_linear handles M <= 16 rows, got M=17"):
        triton_linear(x, w)
    with pytest.raises(ValueError, match=r"w has shape \(8, 31\), expected \(N, 32\)"):
        triton_linear(x[:2], w[:, :31])
    with pytest.raises(ValueError, match="block_n must be a power of two >= 16, got 24"):
        GemvConfig(24, 32, 1)


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize("n", [6144, 4096, 28672, 128256])
def test_gpu_llama_shapes(m, n, monkeypatch):
    """Llama-3.1-8B projections (K = 4096) in bfloat16: the heuristic config (tuning is the bench's
    job: it compiles dozens of configs), a split-K one and a single-pass one."""
    monkeypatch.setenv("SPEC_GEMV_TUNE", "0")
    torch.manual_seed(n + m)
    x = torch.randn(m, 4096, device="cuda").bfloat16()
    w = (torch.randn(n, 4096, device="cuda") * 0.02).bfloat16()
    ref = reference_linear(x.float(), w.float())
    for cfg in (None, GemvConfig(64, 256, 4), GemvConfig(32, 128, 1, num_stages=4),
                GemvConfig(64, 256, 1, num_stages=4, swap=True), GemvConfig(128, 128, 2, swap=True)):
        _close(triton_linear(x, w, config=cfg), ref, torch.bfloat16)


@gpu
@needs_cuda
def test_gpu_split_k_is_deterministic():
    """Split-K partials are summed in a fixed order: no atomics, bitwise-equal reruns."""
    x = torch.randn(8, 4096, device="cuda").bfloat16()
    w = torch.randn(4096, 4096, device="cuda").bfloat16()
    for cfg in (GemvConfig(32, 128, 8), GemvConfig(64, 128, 4, swap=True)):
        a = triton_linear(x, w, config=cfg)
        b = triton_linear(x, w, config=cfg)
        assert torch.equal(a, b)
