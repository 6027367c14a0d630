"""The split-K GEMV against torch.nn.functional.linear."""

import pytest
import torch
from kernel_helpers import DEVICE, gpu, needs_cuda

from spec_runtime.kernels._common import interpreting
from spec_runtime.kernels.gemv import (
    GemvConfig,
    linear,
    norm_linear,
    reference_linear,
    reference_norm_linear,
    reference_silu_linear,
    silu_linear,
    triton_linear,
)

# (M, N, K): ragged N and K (tails), M from 1 to 16.
SHAPES = [(1, 40, 96), (5, 33, 64), (16, 64, 128), (3, 17, 48)]


def _close(got, ref, dtype):
    tol = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(got.float(), ref.float(), atol=tol * ref.abs().max().item(), rtol=tol)


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("config", [None, GemvConfig(16, 16, 1), GemvConfig(32, 32, 3)])
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


PROLOGUE_CONFIGS = [None, GemvConfig(16, 16, 1), GemvConfig(16, 32, 2), GemvConfig(32, 16, 4)]


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("config", PROLOGUE_CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_prologue_matches_add_rmsnorm_then_linear(m, n, k, config, dtype):
    """`norm_linear` == residual add, RMSNorm, then the product; the sum comes back (split-K too:
    each split writes its columns of the sum and its part of the sum of squares)."""
    torch.manual_seed(m + n + k)
    x, d = torch.randn(m, k, device=DEVICE).to(dtype), torch.randn(m, k, device=DEVICE).to(dtype)
    nw, w = (1 + 0.2 * torch.randn(k, device=DEVICE)).to(dtype), torch.randn(n, k, device=DEVICE).to(dtype)
    bias = torch.randn(n, device=DEVICE).to(dtype)
    for delta, b in ((d, None), (None, bias), (d, bias)):
        got, total = norm_linear(x, delta, nw, 1e-5, w, b, config=config)
        ref, ref_total = reference_norm_linear(*(None if t is None else t.float() for t in (x, delta, nw)), 1e-5,
                                               w.float(), None if b is None else b.float())
        assert got.shape == (m, n) and got.dtype == dtype and total.dtype == dtype
        if delta is None:
            assert total is x
        elif dtype == torch.float32 or not interpreting():
            assert torch.equal(total, x + delta)  # rounded like torch's add
        else:  # the interpreter's float32 -> bfloat16 cast is not round-to-nearest-even: 1 ulp
            torch.testing.assert_close(total, x + delta, atol=0, rtol=2 ** -7)
        _close(got, ref, dtype)


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("config", PROLOGUE_CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_prologue_matches_silu_mul_then_linear(m, n, k, config, dtype):
    torch.manual_seed(m * k + n)
    gate_up = torch.randn(m, 2 * k, device=DEVICE).to(dtype)
    w, b = torch.randn(n, k, device=DEVICE).to(dtype), torch.randn(n, device=DEVICE).to(dtype)
    got = silu_linear(gate_up, w, b if config is not None else None, config=config)
    ref = reference_silu_linear(gate_up.float(), w.float(), b.float() if config is not None else None)
    assert got.shape == (m, n) and got.dtype == dtype
    _close(got, ref, dtype)


def test_prologue_errors_name_the_input():
    x, w = torch.randn(2, 32, device=DEVICE), torch.randn(8, 32, device=DEVICE)
    with pytest.raises(ValueError, match=r"norm weight must be \(32,\) torch.float32, got \(31,\)"):
        norm_linear(x, None, torch.ones(31, device=DEVICE), 1e-5, w)
    with pytest.raises(ValueError, match=r"delta must be \(2, 32\) torch.float32, got \(2, 16\)"):
        norm_linear(x, x[:, :16], torch.ones(32, device=DEVICE), 1e-5, w)
    with pytest.raises(ValueError, match=r"gate_up must be \(M, 2K\), got \(2, 33\)"):
        silu_linear(torch.randn(2, 33, device=DEVICE), w)
    with pytest.raises(ValueError, match=r"w has shape \(8, 32\), expected \(N, 16\)"):
        silu_linear(x, w)
    with pytest.raises(ValueError, match="handles M <= 16 rows, got M=17"):
        silu_linear(torch.randn(17, 64, device=DEVICE), w)


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
    for cfg in (None, GemvConfig(64, 256, 4), GemvConfig(32, 128, 1, num_stages=4)):
        _close(triton_linear(x, w, config=cfg), ref, torch.bfloat16)


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 8])
def test_gpu_prologues_llama_shapes(m, monkeypatch):
    """The prologue GEMVs at Llama-3.1-8B shapes in bfloat16: add + RMSNorm before QKV and gate/up
    (the sum is exactly torch's), SiLU-and-multiply before down; heuristic, single-pass and split-K."""
    monkeypatch.setenv("SPEC_GEMV_TUNE", "0")
    torch.manual_seed(m)
    x, d = torch.randn(m, 4096, device="cuda").bfloat16(), torch.randn(m, 4096, device="cuda").bfloat16()
    nw = (1 + 0.1 * torch.randn(4096, device="cuda")).bfloat16()
    for n in (6144, 28672):
        w = (torch.randn(n, 4096, device="cuda") * 0.02).bfloat16()
        ref, _ = reference_norm_linear(x.float(), d.float(), nw.float(), 1e-5, w.float())
        for cfg in (None, GemvConfig(64, 256, 4), GemvConfig(32, 128, 1, num_stages=4)):
            got, total = norm_linear(x, d, nw, 1e-5, w, config=cfg)
            assert torch.equal(total, x + d)
            _close(got, ref, torch.bfloat16)
    gate_up = torch.randn(m, 2 * 14336, device="cuda").bfloat16()
    w = (torch.randn(4096, 14336, device="cuda") * 0.02).bfloat16()
    ref = reference_silu_linear(gate_up.float(), w.float())
    for cfg in (None, GemvConfig(64, 256, 4), GemvConfig(32, 256, 1, num_stages=4)):
        _close(silu_linear(gate_up, w, config=cfg), ref, torch.bfloat16)


@gpu
@needs_cuda
def test_gpu_split_k_is_deterministic():
    """Split-K partials are summed in a fixed order: no atomics, bitwise-equal reruns."""
    x = torch.randn(8, 4096, device="cuda").bfloat16()
    w = torch.randn(4096, 4096, device="cuda").bfloat16()
    cfg = GemvConfig(32, 128, 8)
    a = triton_linear(x, w, config=cfg)
    b = triton_linear(x, w, config=cfg)
    assert torch.equal(a, b)
