"""Scatter the new K/V rows of a forward pass into the token-slot pool (one program per row block)."""

import torch
import triton
import triton.language as tl

from spec_kernels._common import FLOAT_DTYPES, INDEX_DTYPES, check_tensor, next_pow2, require
from spec_kernels.inputs import KVPool

__all__ = ["reference_store_kv", "store_kv"]


def reference_store_kv(cache: KVPool, layer: int, out_slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """What the model does before attention: `cache.k[layer, out_slots] = k` (cast to the cache
    dtype), same for v; rows whose slot is negative (padding) are skipped."""
    keep = out_slots >= 0
    cache.k[layer, out_slots[keep]] = k[keep].to(cache.dtype)
    cache.v[layer, out_slots[keep]] = v[keep].to(cache.dtype)


@triton.jit
def _store_kv_kernel(
    k_ptr,  # (T, Hkv, D) new keys
    v_ptr,  # (T, Hkv, D) new values
    slot_ptr,  # (T,) int destination slots, < 0 = skip
    k_cache_ptr,  # (num_slots, Hkv, D) this layer's keys (output)
    v_cache_ptr,  # (num_slots, Hkv, D) this layer's values (output)
    T, HD,
    s_kt, s_vt, s_ct,
    BLOCK_T: tl.constexpr, BLOCK_HD: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_HD + tl.arange(0, BLOCK_HD)
    slot = tl.load(slot_ptr + rows, mask=rows < T, other=-1).to(tl.int64)
    ok = (slot >= 0)[:, None] & (cols < HD)[None, :]
    src = rows.to(tl.int64)[:, None]
    dst = slot[:, None] * s_ct + cols[None, :]
    k = tl.load(k_ptr + src * s_kt + cols[None, :], mask=ok)
    v = tl.load(v_ptr + src * s_vt + cols[None, :], mask=ok)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=ok)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=ok)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """`(T, Hkv, D)` as `(T, Hkv*D)` without a copy when the heads are packed."""
    t, h, d = x.shape
    if x.stride(2) == 1 and x.stride(1) == d:
        return x.as_strided((t, h * d), (x.stride(0), 1))
    return x.reshape(t, h * d).contiguous()


def store_kv(cache: KVPool, layer: int, out_slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write `k`, `v` `(T, Hkv, D)` at `cache.k[layer, out_slots]`, `cache.v[layer, out_slots]`.

    Casts to the cache dtype; a negative slot (padding) skips its row. Slots must be distinct.
    """
    _, _, hkv, d = cache.k.shape
    dev = cache.k.device
    require(out_slots.dim() == 1, f"out_slots must be (T,), got shape {tuple(out_slots.shape)}")
    t = out_slots.shape[0]
    check_tensor("out_slots", out_slots, INDEX_DTYPES, (t,), dev)
    check_tensor("k", k, FLOAT_DTYPES, (t, hkv, d), dev)
    check_tensor("v", v, FLOAT_DTYPES, (t, hkv, d), dev)
    require(0 <= layer < cache.k.shape[0], f"layer {layer} out of range [0, {cache.k.shape[0]})")
    kc, vc = cache.k[layer], cache.v[layer]
    require(kc.is_contiguous() and vc.is_contiguous(), "cache.k and cache.v layers must be contiguous")
    if t == 0:
        return
    k2, v2 = _rows(k), _rows(v)
    hd = hkv * d
    block_hd = min(next_pow2(hd), 1024)
    block_t = max(1, min(16, 4096 // block_hd))
    grid = (triton.cdiv(t, block_t), triton.cdiv(hd, block_hd))
    _store_kv_kernel[grid](
        k2, v2, out_slots.contiguous(), kc, vc, t, hd, k2.stride(0), v2.stride(0), kc.stride(0),
        BLOCK_T=block_t, BLOCK_HD=block_hd, num_warps=4,
    )
