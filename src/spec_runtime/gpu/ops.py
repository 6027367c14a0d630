"""Sync-free versions of the reference tree and sampling functions, for the static (CUDA-graph) path.

Each computes exactly what its reference computes (`tree.build_tree`,
`sampling.probs_from_logits_batched`, `attention.torch_attention`) with the same torch operations, minus the checks that read
tensor values on the host (those would sync the GPU and cannot be captured). The eager path keeps
the validating references; `tests/runtime/test_static_executor.py` checks both give the same tokens.
"""

import math
from typing import Any

import torch

from spec_runtime.attention import AttnBatch, torch_attention
from spec_runtime.kv_cache import KVCache
from spec_runtime.sampling import _top_k_top_p
from spec_runtime.tree import tree_layout

__all__ = ["build_tree_nosync", "dense_attention", "probs_nosync"]


def build_tree_nosync(*args: Any) -> tuple[torch.Tensor, ...]:
    """`tree.build_tree` without host reads: `tree_layout(*args, validate=False)` (the same positional
    arguments, the same outputs on valid trees). Invalid trees (a parent not selected, NaN scores) are
    not detected here; the eager path's `build_tree` raises on them."""
    return tree_layout(*args, validate=False)


def probs_nosync(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """`sampling.probs_from_logits_batched` without its value checks (the parameters were validated
    when the requests were admitted)."""
    bs, vocab = logits.shape[0], logits.shape[-1]
    n = math.prod(logits.shape[1:-1])
    def per_row(t: torch.Tensor) -> torch.Tensor:  # repeat_interleave(n) as an expand (no sync)
        return t[:, None].expand(bs, n).reshape(bs * n)

    temp = per_row(temperature.float())
    flat = logits.reshape(bs * n, vocab).float()
    greedy = temp == 0
    probs = torch.softmax(flat / torch.where(greedy, 1.0, temp)[:, None], dim=-1)
    probs = _top_k_top_p(probs, per_row(top_k.long()), per_row(top_p.float()))
    # a scatter, not F.one_hot: the same values without one_hot's range checks
    one_hot = torch.zeros_like(flat).scatter_(1, flat.argmax(-1, keepdim=True), 1.0)
    probs = torch.where(greedy[:, None], one_hot, probs)
    return probs.reshape(logits.shape)


def dense_attention(q: torch.Tensor, cache: KVCache, layer: int, attn: AttnBatch, scale: float) -> torch.Tensor:
    """Sync-free torch attention for batches with the same number of rows per request (`T = bs * r`,
    request-major): `torch_attention`'s contract, computed over the whole slot-table row (masked to
    the prefix) plus each row's extra slots. Ragged batches go to the reference (it reads values)."""
    t, hq, d = q.shape
    bs = attn.batch_size
    if bs == 0 or t == 0 or t % bs:
        return torch_attention(q, cache, layer, attn, scale)
    r = t // bs
    hkv = cache.k.shape[2]
    g = hq // hkv
    width = cache.req_to_token.shape[1]
    table = cache.req_to_token[attn.req_pool_indices]  # (bs, L)
    valid = torch.arange(width, device=q.device)[None, :] < attn.prefix_lens[:, None]
    slots = torch.where(valid, table, 0)
    kc, vc = cache.k[layer], cache.v[layer]
    kp, vp = kc[slots].float(), vc[slots].float()  # (bs, L, hkv, d)
    extra = attn.extra_kv.view(bs, r, -1)
    seen = extra >= 0
    ke, ve = kc[extra.clamp(min=0)].float(), vc[extra.clamp(min=0)].float()  # (bs, r, E, hkv, d)
    qg = q.float().view(bs, r, hkv, g, d)
    sp = torch.einsum("brhgd,blhd->brhgl", qg, kp) * scale
    sp = sp.masked_fill(~valid[:, None, None, None, :], float("-inf"))
    se = torch.einsum("brhgd,brehd->brhge", qg, ke) * scale
    se = se.masked_fill(~seen[:, :, None, None, :], float("-inf"))
    probs = torch.softmax(torch.cat([sp, se], dim=-1), dim=-1).nan_to_num(0.0)  # no key: zeros
    out = torch.einsum("brhgl,blhd->brhgd", probs[..., :width], vp)
    out = out + torch.einsum("brhge,brehd->brhgd", probs[..., width:], ve)
    return out.reshape(t, hq, d).to(q.dtype)
