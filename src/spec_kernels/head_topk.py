"""A draft head and the top-k of its softmax in one pass: `softmax(h @ w.T).topk(k)` for at most
`MAX_M` rows, without the logits ever leaving the registers.

The unfused draft step runs the head's GEMV (`spec_kernels.gemv`: the logits `(M, V)` written in the
head's dtype), then `spec_kernels.topk.softmax_topk`: a partial kernel that reads the logits back,
block by block, and a merge. Here `_head_topk_kernel` takes the partial kernel's place: one program
per block of `BLOCK_V` vocabulary rows computes the logits of its block for all `M` rows (the
GEMV's tiles: `tl.dot` over `BLOCK_K` slices of K, float32 accumulation), then the block's softmax
partials (max, `sum(exp(x - max))`) and its own top-k, written exactly where `_topk_part_kernel`
writes them; `topk._topk_merge_kernel` (with its `d2t` mapping) finishes. Two launches per head
call instead of three, and no `(M, V)` round trip through memory.

Numerics: each logit is the float32 sum rounded to the head's dtype, as the GEMV writes it, then
read back as float32, as the top-k reads it; so the ids and probabilities are the unfused path's
wherever the two float32 sums round alike. What differs is the order of the float32 additions
along K (the GEMV's tile and split-K order, or cuBLAS's), which can move a logit by one unit of
the head's dtype and so swap two candidates that were within that of each other. Ties and NaN as
`spec_kernels.topk`: values descending, equal values in ascending index order, NaN ranks as +inf.
"""

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from spec_kernels._common import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    cdiv,
    check_tensor,
    interpreting,
    next_pow2,
    pdl_options,
    require,
    sm_count,
)
from spec_kernels._gemv_kernels import _tile_product
from spec_kernels.topk import _BIG, _MAX_INDEX, Partials

__all__ = ["MAX_M", "HeadTopkConfig", "head_topk", "head_topk_config", "reference_head_topk"]

MAX_M = 32
"""Rows per launch: a draft step's `bs * topk` up to 32 (as `spec_kernels.gemv.MAX_M`)."""
MAX_K = 64
"""Largest top-k (as `spec_kernels.topk`)."""


@dataclass(frozen=True)
class HeadTopkConfig:
    """One launch configuration: `block_v` vocabulary rows per program, `block_k` columns per tile."""

    block_v: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_v", "block_k"):
            value = getattr(self, name)
            require(value >= 16 and value & (value - 1) == 0,
                    f"HeadTopkConfig.{name} must be a power of two >= 16, got {value}")


def head_topk_config(m: int, v: int, k: int, dtype: torch.dtype, device: torch.device) -> HeadTopkConfig:
    """The default configuration (measured end to end only: `bench/results/real_smollm2_hotmap/`). The
    smallest `block_v` from 32 (at most 256) that keeps the programs within three per multiprocessor:
    on an H200 (132 SMs) 256 programs of 32 rows at V = 8192, 384 of 128 at 49152, so every
    multiprocessor streams weight rows while the merge reads at most `3 * SMs * KP` candidates per
    row. `block_k` 64 (32 in float32), eight warps from 64 rows up: built for sm90 (ptxas) none of
    these spills at 16 or 32 rows (bf16 16 x 128 x 64: 185 registers; at four warps 255, and 72
    bytes spilled at 32 rows; float32 32 x 128 x 32: 192)."""
    block_v = 32
    while cdiv(v, block_v) > 3 * sm_count(device) and block_v < 256:
        block_v *= 2
    block_k = min(32 if dtype == torch.float32 else 64, max(16, next_pow2(k)))
    if interpreting():
        return HeadTopkConfig(block_v, block_k, num_warps=4, num_stages=1)
    return HeadTopkConfig(block_v, block_k, num_warps=4 if block_v == 32 else 8)


def reference_head_topk(h: torch.Tensor, w: torch.Tensor, k: int,
                        d2t: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: the logits `F.linear(h, w)` in the head's dtype, then the `k` largest of their
    float32 softmax, values descending, ties in index order, NaN ranking as +inf (a stable sort);
    ids mapped `i + d2t[i]` when `d2t` is given. `(M, k)` float32 and int64."""
    logits = F.linear(h.to(w.dtype), w).float()
    probs = torch.softmax(logits, dim=-1)
    order = torch.sort(torch.nan_to_num(logits, nan=float("inf")), dim=-1, descending=True, stable=True).indices
    ids = order[..., :k]
    out = ids if d2t is None else ids + d2t[ids].long()
    return probs.gather(-1, ids), out


@triton.jit
def _head_topk_kernel(
    x_ptr,  # (M, K) rows of the head's input, unit last stride
    w_ptr,  # (V, K) head weight, unit last stride
    pm_ptr,  # (M, C) float32 block maxima (output)
    ps_ptr,  # (M, C) float32 block sums of exp(x - block max) (output)
    pv_ptr,  # (M, C, KP) float32 block top-k logits (output)
    pi_ptr,  # (M, C, KP) int32 their indices (output; _BIG past the valid entries)
    M, V, K, s_x, s_w, C,
    TOPK: tl.constexpr, KP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr = False,
):
    c = tl.program_id(0)
    rm = tl.arange(0, BLOCK_M)
    idx = c * BLOCK_V + tl.arange(0, BLOCK_V)  # this block's vocabulary rows
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    v_ok = idx < V
    x_rows = x_ptr + rm[:, None].to(tl.int64) * s_x
    w_rows = w_ptr + idx[:, None].to(tl.int64) * s_w
    acc = tl.zeros([BLOCK_M, BLOCK_V], tl.float32)
    # the first tiles: the weight's before the wait (weights are never written), as the GEMV does
    w = tl.load(w_rows + rk[None, :], mask=v_ok[:, None] & (rk < K)[None, :], other=0.0)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    x = tl.load(x_rows + rk[None, :], mask=m_ok[:, None] & (rk < K)[None, :], other=0.0)
    acc = _tile_product(acc, x, w, DOT_F32, False, False)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        ks = k0 + rk
        if EVEN_K:
            w = tl.load(w_rows + ks[None, :], mask=v_ok[:, None], other=0.0)
            x = tl.load(x_rows + ks[None, :], mask=m_ok[:, None], other=0.0)
        else:
            w = tl.load(w_rows + ks[None, :], mask=v_ok[:, None] & (ks < K)[None, :], other=0.0)
            x = tl.load(x_rows + ks[None, :], mask=m_ok[:, None] & (ks < K)[None, :], other=0.0)
        acc = _tile_product(acc, x, w, DOT_F32, False, False)
    # the logit as the GEMV writes it (the head's dtype) and the top-k reads it (float32)
    x = acc.to(w_ptr.dtype.element_ty).to(tl.float32)
    ok = v_ok[None, :]
    x = tl.where(ok, x, float("-inf"))
    x = tl.where(x != x, float("inf"), x)  # NaN ranks first, as in torch.argmax
    base = rm * C + c
    bm = tl.max(x, axis=1)
    e = tl.where(ok & (x > float("-inf")), tl.exp(x - bm[:, None]), 0.0)
    tl.store(pm_ptr + base, bm, mask=m_ok)
    tl.store(ps_ptr + base, tl.sum(e, axis=1), mask=m_ok)
    kk = tl.arange(0, KP)
    vals = tl.full([BLOCK_M, KP], float("-inf"), tl.float32)
    ids = tl.full([BLOCK_M, KP], _BIG, tl.int32)
    alive = ok & m_ok[:, None]
    for j in tl.static_range(TOPK):  # k rounds: the maximum, then the lowest index holding it
        v = tl.max(tl.where(alive, x, float("-inf")), axis=1)
        i = tl.min(tl.where(alive & (x == v[:, None]), idx[None, :], _BIG), axis=1)
        vals = tl.where(kk[None, :] == j, v[:, None], vals)
        ids = tl.where(kk[None, :] == j, i[:, None], ids)
        alive = alive & (idx[None, :] != i[:, None])
    at = base[:, None] * KP + kk[None, :]
    tl.store(pv_ptr + at, vals, mask=m_ok[:, None])
    tl.store(pi_ptr + at, ids, mask=m_ok[:, None])


def _check(h: torch.Tensor, w: torch.Tensor, k: int, d2t: Optional[torch.Tensor]) -> torch.Tensor:
    """Validate `head_topk`'s arguments (shapes, dtypes, devices only); h with a unit last stride."""
    require(h.dim() == 2, f"h must be (M, K), got shape {tuple(h.shape)}")
    require(w.dim() == 2 and w.shape[1] == h.shape[1],
            f"w has shape {tuple(w.shape)}, expected (V, {h.shape[1]}) to match h {tuple(h.shape)}")
    require(h.dtype in FLOAT_DTYPES and w.dtype in FLOAT_DTYPES, f"h, w dtypes {h.dtype}, {w.dtype} not in {FLOAT_DTYPES}")
    require(h.device == w.device, f"h is on {h.device}, w on {w.device}")
    require(h.shape[0] <= MAX_M, f"head_topk handles M <= {MAX_M} rows, got M={h.shape[0]}")
    require(w.stride(1) == 1, "w must be contiguous along K (a row-major (V, K) weight)")
    v = w.shape[0]
    require(1 <= k <= min(v, MAX_K), f"k must be in [1, min(V, {MAX_K})] = [1, {min(v, MAX_K)}], got {k}")
    require(v < _MAX_INDEX, f"a head of {v} rows does not fit int32 indices")
    if d2t is not None:
        check_tensor("d2t", d2t, INDEX_DTYPES, (v,), h.device)
        require(d2t.is_contiguous(), "d2t must be contiguous")
    return h if h.stride(1) == 1 else h.contiguous()


def head_topk(h: torch.Tensor, w: torch.Tensor, k: int, *, d2t: Optional[torch.Tensor] = None,
              config: Optional[HeadTopkConfig] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`(probs, ids)` `(M, k)` float32 and int64: the `k` largest entries of
    `softmax(F.linear(h, w).float())`, values descending, ties in index order (`reference_head_topk`),
    for `h` `(M, K)` (`M <= MAX_M`, cast to w's dtype) and a head weight `w` `(V, K)`. `d2t` `(V,)`:
    each id `i` comes back as `i + d2t[i]`. Reads shapes only: capturable in a CUDA graph.
    `config`: the launch configuration (default `head_topk_config`)."""
    h = _check(h, w, k, d2t).to(w.dtype)
    m, kdim = h.shape
    v = w.shape[0]
    probs = torch.empty((m, k), dtype=torch.float32, device=h.device)
    ids = torch.empty((m, k), dtype=torch.int64, device=h.device)
    if m == 0:
        return probs, ids
    cfg = config or head_topk_config(m, v, kdim, w.dtype, h.device)
    parts = Partials.empty(m, cdiv(v, cfg.block_v), k, h.device)
    _head_topk_kernel[(parts.blocks,)](
        h, w, *parts.tensors, m, v, kdim, h.stride(0), w.stride(0), parts.blocks,
        TOPK=k, KP=parts.kp, BLOCK_M=max(16, next_pow2(m)), BLOCK_V=cfg.block_v, BLOCK_K=cfg.block_k,
        EVEN_K=kdim % cfg.block_k == 0, DOT_F32=interpreting() or w.dtype == torch.float32,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_options(h.device),
    )
    parts.merge(probs, ids, d2t, softmax=True)
    return probs, ids
