"""Row-wise top-k over a vocabulary, with the softmax probabilities of the winners: the draft's
`softmax(logits).topk(k)` and the verify's `logits.argmax(-1)` in two small launches.

torch runs these as a softmax kernel plus four to seven radix-select and sort kernels per call
(about 40 µs per draft step at bs=1 on an H200), or one reduction over the whole vocabulary in a
few programs (27 µs for an argmax over 128K). Here:

1. `_topk_part_kernel`, one program per (row, block of `BLOCK` vocabulary entries): the block's
   maximum and `sum(exp(x - max))` (softmax only), and its own top-k (k rounds of max, then the
   lowest index holding it).
2. `_topk_merge_kernel`, one program per row: the row's maximum and normalizer from the block
   partials, and the top-k of the blocks' candidates; probabilities `exp(v - max) / sum`.

Order and ties: values descending; equal values in ascending index order (so k = 1 is torch's
argmax: the first maximum). NaN ranks as +inf (torch's argmax returns a NaN's index too). The
softmax is torch's function with a different summation order, so probabilities can differ from
`torch.softmax` in the last float32 bits (`spec_runtime.sampling.softmax_topk` is the torch reference).
"""

from typing import Optional

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from spec_kernels._common import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    cdiv,
    check_tensor,
    next_pow2,
    pdl_options,
    require,
)

__all__ = ["reference_argmax", "row_argmax", "softmax_topk"]

_MAX_INDEX = 2 ** 31 - 1
_BIG = tl.constexpr(_MAX_INDEX)  # "no index": past every valid one
_BLOCK = 2048


def reference_argmax(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(-1)`."""
    return logits.argmax(-1)


@triton.jit
def _topk_part_kernel(
    x_ptr,  # (R, V) rows, unit last stride
    pm_ptr,  # (R, C) float32 block maxima (output, SOFTMAX)
    ps_ptr,  # (R, C) float32 block sums of exp(x - block max) (output, SOFTMAX)
    pv_ptr,  # (R, C, KP) float32 block top-k values (output)
    pi_ptr,  # (R, C, KP) int32 their indices (output; _BIG past the valid entries)
    V, s_x, C,
    K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr, SOFTMAX: tl.constexpr, PDL: tl.constexpr = False,
):
    r = tl.program_id(0)
    c = tl.program_id(1)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    idx = c * BLOCK + tl.arange(0, BLOCK)
    ok = idx < V
    x = tl.load(x_ptr + r.to(tl.int64) * s_x + idx, mask=ok, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)  # NaN ranks first, as in torch.argmax
    base = r * C + c
    if SOFTMAX:
        m = tl.max(x, axis=0)
        e = tl.where(ok & (x > float("-inf")), tl.exp(x - m), 0.0)
        tl.store(pm_ptr + base, m)
        tl.store(ps_ptr + base, tl.sum(e, axis=0))
    kk = tl.arange(0, KP)
    vals = tl.full([KP], float("-inf"), tl.float32)
    ids = tl.full([KP], _BIG, tl.int32)
    alive = ok
    for j in tl.static_range(K):
        v = tl.max(tl.where(alive, x, float("-inf")), axis=0)
        i = tl.min(tl.where(alive & (x == v), idx, _BIG), axis=0)
        vals = tl.where(kk == j, v, vals)
        ids = tl.where(kk == j, i, ids)
        alive = alive & (idx != i)
    tl.store(pv_ptr + base * KP + kk, vals)
    tl.store(pi_ptr + base * KP + kk, ids)


@triton.jit
def _topk_merge_kernel(
    pm_ptr, ps_ptr, pv_ptr, pi_ptr,  # the partials of _topk_part_kernel
    val_ptr,  # (R, K) float32 probabilities (output, SOFTMAX)
    idx_ptr,  # (R, K) int64 indices (output), mapped by d2t (D2T)
    d2t_ptr,  # (V,) int the map's offsets: index i is written as i + d2t[i] (D2T)
    C, s_v, s_i,
    K: tl.constexpr, KP: tl.constexpr, CP: tl.constexpr, SOFTMAX: tl.constexpr, D2T: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    r = tl.program_id(0)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    cc = tl.arange(0, CP)
    c_ok = cc < C
    kk = tl.arange(0, KP)
    flat = (r * C + cc)[:, None] * KP + kk[None, :]
    cand_v = tl.reshape(tl.load(pv_ptr + flat, mask=c_ok[:, None], other=float("-inf")), [CP * KP])
    cand_i = tl.reshape(tl.load(pi_ptr + flat, mask=c_ok[:, None], other=_BIG), [CP * KP])
    if SOFTMAX:
        m = tl.load(pm_ptr + r * C + cc, mask=c_ok, other=float("-inf"))
        s = tl.load(ps_ptr + r * C + cc, mask=c_ok, other=0.0)
        big_m = tl.max(m, axis=0)
        total = tl.sum(tl.where(m > float("-inf"), s * tl.exp(m - big_m), 0.0), axis=0)
    for j in tl.static_range(K):
        live = cand_i < _BIG
        v = tl.max(tl.where(live, cand_v, float("-inf")), axis=0)
        i = tl.min(tl.where(live & (cand_v == v), cand_i, _BIG), axis=0)
        out = i.to(tl.int64)
        if D2T:  # a draft vocabulary's ids as the target's (`to_target_ids`)
            out += tl.load(d2t_ptr + i).to(tl.int64)
        tl.store(idx_ptr + r.to(tl.int64) * s_i + j, out)
        if SOFTMAX:
            tl.store(val_ptr + r.to(tl.int64) * s_v + j, tl.exp(v - big_m) / total)
        cand_i = tl.where(cand_i == i, _BIG, cand_i)


def _launch(x: torch.Tensor, k: int, softmax: bool,
            d2t: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    require(x.dtype in FLOAT_DTYPES, f"logits dtype {x.dtype} not in {FLOAT_DTYPES}")
    require(x.dim() >= 1 and x.shape[-1] >= 1, f"logits must have a vocabulary axis, got shape {tuple(x.shape)}")
    v = x.shape[-1]
    require(1 <= k <= min(v, 64), f"k must be in [1, min(vocab, 64)] = [1, {min(v, 64)}], got {k}")
    require(v < _MAX_INDEX, f"vocabulary of {v} entries does not fit int32 indices")
    if d2t is not None:
        check_tensor("d2t", d2t, INDEX_DTYPES, (v,), x.device)
        require(d2t.is_contiguous(), "d2t must be contiguous")
    lead = x.shape[:-1]
    rows = x.reshape(-1, v)
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    r = rows.shape[0]
    vals = torch.empty((r, k), dtype=torch.float32, device=x.device)
    ids = torch.empty((r, k), dtype=torch.int64, device=x.device)
    if r:
        block = min(_BLOCK, next_pow2(v))
        parts = Partials.empty(r, cdiv(v, block), k, x.device)
        pm, ps, pv, pi = parts.tensors
        _topk_part_kernel[(r, parts.blocks)](rows, pm, ps, pv, pi, v, rows.stride(0), parts.blocks, K=k, KP=parts.kp,
                                             BLOCK=block, SOFTMAX=softmax, num_warps=4, **pdl_options(x.device))
        parts.merge(vals, ids, d2t, softmax)
    return vals.reshape(*lead, k), ids.reshape(*lead, k)


class Partials:
    """The per-block partials of a row-wise top-k over `blocks` vocabulary blocks (what `_topk_part_kernel`,
    or a kernel fusing the logits into it, writes): each block's maximum and `sum(exp(x - max))`
    `(rows, blocks)` and its own top-k values and indices `(rows, blocks, kp)` (kp: k to a power of two)."""

    def __init__(self, tensors: tuple[torch.Tensor, ...], k: int, kp: int) -> None:
        self.tensors, self.k, self.kp = tensors, k, kp
        self.blocks = tensors[0].shape[1]

    @classmethod
    def empty(cls, rows: int, blocks: int, k: int, device: torch.device) -> "Partials":
        kp = next_pow2(max(k, 2))
        f32 = dict(dtype=torch.float32, device=device)
        tensors = (torch.empty((rows, blocks), **f32), torch.empty((rows, blocks), **f32),
                   torch.empty((rows, blocks, kp), **f32), torch.empty((rows, blocks, kp), dtype=torch.int32, device=device))
        return cls(tensors, k, kp)

    def merge(self, vals: torch.Tensor, ids: torch.Tensor, d2t: Optional[torch.Tensor], softmax: bool) -> None:
        """`_topk_merge_kernel` over the partials into `vals`, `ids` `(rows, k)` (ids through `d2t`)."""
        pm, ps, pv, pi = self.tensors
        _topk_merge_kernel[(pm.shape[0],)](pm, ps, pv, pi, vals, ids, ids if d2t is None else d2t, self.blocks,
                                           vals.stride(0), ids.stride(0), K=self.k, KP=self.kp,
                                           CP=next_pow2(self.blocks), SOFTMAX=softmax, D2T=d2t is not None,
                                           num_warps=4, **pdl_options(vals.device))


def softmax_topk(logits: torch.Tensor, k: int, *,
                 d2t: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`(probs, indices)` of the `k` largest entries of `softmax(logits.float(), -1)` along the last
    axis (`spec_runtime.sampling.softmax_topk`), values descending, ties in index order; `(..., k)` float32 and
    int64. Reads shapes only: capturable in a CUDA graph. `d2t` `(vocab,)`: each index `i` is returned
    as `i + d2t[i]` (a draft vocabulary's `to_target_ids`, in the same launch)."""
    return _launch(logits, k, softmax=True, d2t=d2t)


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(-1)` (the first maximum; NaN counts as the maximum), int64 `(...)`."""
    return _launch(logits, 1, softmax=False)[1][..., 0]
