"""Attention batch description and the pure-torch reference attention.

One `AttnBatch` covers prefill, decode, tree verify and the draft's branch steps. Query row `t` of
request `r` stores its K/V at `out_slots[t]` (the model does that before attention) and attends
every committed slot `req_to_token[req_pool_indices[r], :prefix_lens[r]]` plus the slots
`extra_kv[t]` (its own slot included; -1 = none).
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from spec_runtime.kv_cache import KVCache

__all__ = ["AttentionFn", "AttnBatch", "const_arange", "const_causal", "torch_attention"]

_CONSTANTS: dict[tuple, torch.Tensor] = {}
"""Index tensors that depend only on sizes, by (what, sizes, device): `const_arange`, `const_causal`."""


def _constant(key: tuple, device: torch.device, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """`make()` on `device`, made once and kept (read-only), so that a CUDA graph that uses it reads it
    instead of computing it at every replay. Never kept when first asked for while a graph is being
    captured (it would live in the graph's memory pool, which other graphs' replays may overwrite):
    the captures' warm-up runs ask first."""
    key = (*key, str(device))
    t = _CONSTANTS.get(key)
    if t is None:
        with torch.inference_mode(False), torch.no_grad():  # a normal tensor, usable outside inference mode too
            t = make()
        if not _capturing(device):
            _CONSTANTS[key] = t
    return t


def _capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on `device`'s current stream."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def const_arange(n: int, step: int, device: torch.device) -> torch.Tensor:
    """`torch.arange(n, dtype=torch.int64) * step` on `device`, kept (`_constant`): two kernels fewer
    at every replay of a graph that needs it (batch offsets, `qo_indptr`). Read-only."""
    return _constant(("arange", n, step), torch.device(device),
                     lambda: torch.arange(n, dtype=torch.int64, device=device) * step)


def const_causal(n: int, device: torch.device) -> torch.Tensor:
    """`(n, n)` bool, `[j, i]` = i <= j (row j sees columns 0..j), kept (`_constant`). Read-only."""
    return _constant(("causal", n), torch.device(device),
                     lambda: torch.arange(n, device=device)[None, :] <= torch.arange(n, device=device)[:, None])


def ragged_rows(counts: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows laid out request-major, `counts[r]` for request r, `total` (host-known) in all:
    `(request of each row, its index within the request)`, both `(total,)` int64, without a sync."""
    counts = counts.long()
    req = torch.repeat_interleave(torch.arange(counts.shape[0], device=counts.device), counts, output_size=total)
    start = torch.cumsum(counts, 0) - counts
    return req, torch.arange(total, device=counts.device) - start[req]


@dataclass(frozen=True)
class AttnBatch:
    """Who attends what, for one forward pass.

    Attributes:
        req_pool_indices: `(bs,)` int64, request rows of `req_to_token`.
        prefix_lens: `(bs,)` int64, committed tokens each request attends.
        qo_indptr: `(bs+1,)` int64, query rows `qo_indptr[r]:qo_indptr[r+1]` belong to request r.
        out_slots: `(T,)` int64, where each query row stores its K/V.
        extra_kv: `(T, E)` int64, extra (uncommitted) slots each row attends; -1 = none.
    """

    req_pool_indices: torch.Tensor
    prefix_lens: torch.Tensor
    qo_indptr: torch.Tensor
    out_slots: torch.Tensor
    extra_kv: torch.Tensor

    def __post_init__(self) -> None:
        bs, t = self.req_pool_indices.shape[0], self.out_slots.shape[0]
        expect = {"prefix_lens": (bs,), "qo_indptr": (bs + 1,), "out_slots": (t,)}
        for name, shape in expect.items():
            actual = tuple(getattr(self, name).shape)
            if actual != shape:
                raise ValueError(f"AttnBatch.{name} has shape {actual}, expected {shape}")
        if self.extra_kv.dim() != 2 or self.extra_kv.shape[0] != t:
            raise ValueError(f"AttnBatch.extra_kv has shape {tuple(self.extra_kv.shape)}, expected ({t}, E)")

    @property
    def batch_size(self) -> int:
        """Requests in the batch (`bs`)."""
        return self.req_pool_indices.shape[0]

    @property
    def num_tokens(self) -> int:
        """Query rows (`T`)."""
        return self.out_slots.shape[0]

    @classmethod
    def extend(cls, req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor, extend_lens: torch.Tensor,
               out_slots: torch.Tensor) -> "AttnBatch":
        """Causal extend (prefill, decode, draft-extend): new row i of request r sees the committed
        prefix and the new rows 0..i of r. `out_slots` `(sum(extend_lens),)` is request-major."""
        extend_lens = extend_lens.to(torch.int64)
        qo_indptr = torch.cat([extend_lens.new_zeros(1), torch.cumsum(extend_lens, 0)])
        t = out_slots.shape[0]
        if int(extend_lens.sum()) != t:
            raise ValueError(f"out_slots has {t} rows, expected sum(extend_lens) = {int(extend_lens.sum())}")
        width = int(extend_lens.max()) if extend_lens.numel() else 0
        _, local = ragged_rows(extend_lens, t)
        start = torch.arange(t, device=out_slots.device) - local  # first row of each row's request
        col = torch.arange(width, device=out_slots.device)
        src = (start[:, None] + col[None, :]).clamp(max=max(t - 1, 0))
        visible = col[None, :] <= local[:, None]
        extra = torch.where(visible, out_slots[src], -1)
        return cls(req_pool_indices, prefix_lens.to(torch.int64), qo_indptr, out_slots, extra)

    @classmethod
    def tree(cls, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, out_slots: torch.Tensor,
             tree_mask: torch.Tensor) -> "AttnBatch":
        """Tree verify: node i of request b (`out_slots (bs, N)`) sees the prefix plus
        `out_slots[b, j]` where `tree_mask[b, i, j]` (`(bs, N, N)` bool, self and ancestors)."""
        bs, n = out_slots.shape
        if tuple(tree_mask.shape) != (bs, n, n):
            raise ValueError(f"tree_mask has shape {tuple(tree_mask.shape)}, expected {(bs, n, n)}")
        extra = torch.where(tree_mask, out_slots[:, None, :].expand(bs, n, n), -1)
        qo_indptr = const_arange(bs + 1, n, out_slots.device)
        return cls(req_pool_indices, seq_lens.to(torch.int64), qo_indptr,
                   out_slots.reshape(bs * n), extra.reshape(bs * n, n))

    @classmethod
    def branches(cls, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                 branch_slots: torch.Tensor) -> "AttnBatch":
        """Draft multi-step loop: row (b, k) (row = b*topk + k) sees the prefix plus
        `branch_slots[b, k, :]` (`(bs, topk, s+1)`: ancestors' slots, then its own slot last,
        which is also where it stores its K/V; -1 entries are ignored)."""
        bs, topk, width = branch_slots.shape
        qo_indptr = const_arange(bs + 1, topk, branch_slots.device)
        extra = branch_slots.reshape(bs * topk, width)
        return cls(req_pool_indices, seq_lens.to(torch.int64), qo_indptr, extra[:, -1].clone(), extra)


AttentionFn = Callable[[torch.Tensor, KVCache, int, AttnBatch, float], torch.Tensor]
"""`(q (T, Hq, D), cache, layer, attn, scale) -> (T, Hq, D)`: the pluggable attention contract."""


def _request_keys(cache: KVCache, attn: AttnBatch, r: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots request `r`'s rows may attend (its prefix, then the distinct extra slots) and the
    `(hi-lo, num_keys)` bool mask of which row sees which."""
    p = int(attn.prefix_lens[r])
    prefix = cache.req_to_token[attn.req_pool_indices[r], :p]
    extra = attn.extra_kv[lo:hi]
    valid = extra >= 0
    uniq, inverse = torch.unique(extra[valid], return_inverse=True)
    mask = torch.zeros(hi - lo, p + uniq.numel(), dtype=torch.bool, device=extra.device)
    mask[:, :p] = True
    rows = torch.arange(hi - lo, device=extra.device)[:, None].expand_as(extra)[valid]
    mask[rows, p + inverse] = True
    return torch.cat([prefix, uniq]), mask


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """`q (n, Hq, D)`, `k, v (L, Hkv, D)` float32, `mask (n, L)` -> float32 `(n, Hq, D)`."""
    n, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.float().reshape(n, hkv, hq // hkv, d)
    scores = torch.einsum("nhgd,lhd->nhgl", qg, k) * scale
    scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row that sees no key gives zeros
    return torch.einsum("nhgl,lhd->nhgd", probs, v).reshape(n, hq, d)


# Query rows per chunk are capped so that the float32 score block stays near this many elements.
_SCORE_BUDGET = 1 << 25


def torch_attention(q: torch.Tensor, cache: KVCache, layer: int, attn: AttnBatch,
                    scale: float) -> torch.Tensor:
    """Reference attention over the KV cache (GQA), softmax in float32, output in q's dtype.

    Per request, the keys are its committed prefix plus the distinct extra slots its rows list; each
    row is masked to what it sees. Memory is bounded by chunking query rows.

    Args:
        q: `(T, Hq, D)` queries (RoPE applied); `Hq` a multiple of the cache's KV heads.
        cache: the KV cache; the new K/V of every row is already stored at `attn.out_slots`.
        layer: cache layer to read.
        attn: the batch description.
        scale: softmax scale (usually `D ** -0.5`).
    """
    t, hq, d = q.shape
    out = q.new_zeros((t, hq, d))
    if t == 0:
        return out
    if hq % cache.k.shape[2]:
        raise ValueError(f"query heads {hq} are not a multiple of KV heads {cache.k.shape[2]}")
    indptr = attn.qo_indptr.tolist()
    for r in range(attn.batch_size):
        lo, hi = indptr[r], indptr[r + 1]
        if hi == lo:
            continue
        keys, mask = _request_keys(cache, attn, r, lo, hi)
        k, v = cache.k[layer, keys].float(), cache.v[layer, keys].float()
        step = max(1, _SCORE_BUDGET // max(1, hq * keys.numel()))
        for c in range(lo, hi, step):
            e = min(c + step, hi)
            out[c:e] = _attend(q[c:e], k, v, mask[c - lo:e - lo], scale).to(q.dtype)
    return out
