"""store_kv against the model's own scatter (reference_store_kv)."""

import pytest
import torch
from kernel_helpers import DEVICE, ON_GPU, gpu, needs_cuda

from spec_kernels.kv_store import reference_store_kv, store_kv
from spec_runtime.kv_cache import KVCache


def _pair(hkv, d, dtype, slots=40, device=DEVICE):
    caches = [KVCache(3, hkv, d, slots, 2, 8, dtype=dtype, device=device) for _ in range(2)]
    return caches


@pytest.mark.parametrize("src_dtype,cache_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                                   (torch.float16, torch.float16)])
def test_scatter_matches_reference(src_dtype, cache_dtype):
    torch.manual_seed(0)
    ref, got = _pair(3, 16, cache_dtype)
    slots = torch.tensor([7, 0, 39, 12, -1, 5], device=DEVICE)  # -1: a padding row, skipped
    k = torch.randn(6, 3, 16, device=DEVICE).to(src_dtype)
    v = torch.randn(6, 3, 16, device=DEVICE).to(src_dtype)
    reference_store_kv(ref, 1, slots, k, v)
    store_kv(got, 1, slots, k, v)
    if ON_GPU or src_dtype == cache_dtype:
        assert torch.equal(got.k, ref.k) and torch.equal(got.v, ref.v)
    else:  # the interpreter's float32 -> bfloat16 cast is not round-to-nearest-even: 1 ulp
        torch.testing.assert_close(got.k, ref.k, atol=0, rtol=2**-7)
        torch.testing.assert_close(got.v, ref.v, atol=0, rtol=2**-7)


def test_strided_heads_from_a_fused_projection():
    """k and v as column slices of one fused (T, 2*Hkv*D) projection output: strided rows."""
    ref, got = _pair(2, 16, torch.float32)
    kv = torch.randn(5, 2 * 2 * 16, device=DEVICE)
    k, v = kv[:, :32].view(5, 2, 16), kv[:, 32:].view(5, 2, 16)
    slots = torch.tensor([3, 1, 4, 15, 9], device=DEVICE)
    reference_store_kv(ref, 2, slots, k, v)
    store_kv(got, 2, slots, k, v)
    assert torch.equal(got.k, ref.k) and torch.equal(got.v, ref.v)


def test_empty_and_errors():
    _, cache = _pair(2, 16, torch.float32)
    store_kv(cache, 0, torch.zeros(0, dtype=torch.int64, device=DEVICE),
             torch.zeros(0, 2, 16, device=DEVICE), torch.zeros(0, 2, 16, device=DEVICE))
    assert not cache.k.any()
    with pytest.raises(ValueError, match=r"k has shape \(2, 3, 16\), expected \(2, 2, 16\)"):
        store_kv(cache, 0, torch.tensor([0, 1], device=DEVICE), torch.zeros(2, 3, 16, device=DEVICE),
                 torch.zeros(2, 2, 16, device=DEVICE))
    with pytest.raises(ValueError, match="out_slots has dtype torch.float32"):
        store_kv(cache, 0, torch.zeros(2, device=DEVICE), torch.zeros(2, 2, 16, device=DEVICE),
                 torch.zeros(2, 2, 16, device=DEVICE))


@gpu
@needs_cuda
def test_gpu_llama_rows():
    ref, got = _pair(8, 128, torch.bfloat16, slots=8192, device="cuda")
    slots = torch.randperm(8192, device="cuda")[:1000]
    k, v = torch.randn(2, 1000, 8, 128, device="cuda").bfloat16()
    reference_store_kv(ref, 2, slots, k, v)
    store_kv(got, 2, slots, k, v)
    assert torch.equal(got.k, ref.k) and torch.equal(got.v, ref.v)
