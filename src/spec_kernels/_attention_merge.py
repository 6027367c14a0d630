"""Pass 2 of `spec_kernels.attention`: merge the split kernel's partials of every (row, head), adding
the splits in a fixed order so that this kernel and the split kernel's fused merge give the same bits
(`attention.FUSED_MERGE_ROWS`, `attention.MERGE_UNROLL`). The launcher is `attention.triton_attention`.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _request_of_row(indptr_ptr, bs, row, SEARCH_ITERS: tl.constexpr):
    """Largest r in [0, bs] with qo_indptr[r] <= row: the request owning `row` (binary search)."""
    lo = tl.zeros([], dtype=tl.int64)
    hi = lo + bs
    for _ in tl.static_range(SEARCH_ITERS):
        active = lo < hi
        mid = (lo + hi + 1) // 2
        ok = tl.load(indptr_ptr + mid) <= row
        lo = tl.where(active & ok, mid, lo)
        hi = tl.where(active & ~ok, mid - 1, hi)
    return lo


@triton.jit
def _splits_used(indptr_ptr, prefix_ptr, bs, row, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr,
                 SEARCH_ITERS: tl.constexpr, SKIP_EMPTY: tl.constexpr):
    """Per row: how many prefix splits hold keys of its request (all `NUM_SPLITS` unless
    `SKIP_EMPTY`); the split kernel's chunking."""
    if SKIP_EMPTY:
        r = tl.minimum(_request_of_row(indptr_ptr, bs, row, SEARCH_ITERS), bs - 1)
        p_len = tl.load(prefix_ptr + r).to(tl.int64)
        chunk = tl.cdiv(tl.cdiv(p_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
        return tl.where(p_len > 0, tl.cdiv(p_len, tl.maximum(chunk, 1)), 0).to(tl.int32)
    else:
        return tl.zeros_like(row).to(tl.int32) + NUM_SPLITS


@triton.jit
def _add_partial(mid_o_ptr, mid_m_ptr, mid_l_ptr, at, ok, m_safe, total, acc, D: tl.constexpr):
    """One partial (index `at` per pair, where `ok`) added to the merge's sum and accumulator."""
    d = tl.arange(0, D)
    w = tl.exp2(tl.load(mid_m_ptr + at, mask=ok, other=float("-inf"), cache_modifier=".cg") - m_safe)
    total += w * tl.load(mid_l_ptr + at, mask=ok, other=0.0, cache_modifier=".cg")  # no key: weight 0
    o = tl.load(mid_o_ptr + at[:, None] * D + d[None, :], mask=ok[:, None], other=0.0, cache_modifier=".cg")
    return total, acc + w[:, None] * o


@triton.jit
def _live_split(sp, used, NS, NUM_SPLITS: tl.constexpr):
    """Whether split `sp` holds a partial the merge adds: a prefix split below `used` (at most
    `NUM_SPLITS`) or an extra split (`NUM_SPLITS .. NS - 1`)."""
    return (sp < used) | ((sp >= NUM_SPLITS) & (sp < NS))


@triton.jit
def _add_splits(mid_o_ptr, mid_m_ptr, mid_l_ptr, idx, ok, used, c0, NS, m_safe, total, acc, D: tl.constexpr,
                NUM_SPLITS: tl.constexpr, UNROLL: tl.constexpr):
    """Splits `c0 .. c0 + UNROLL - 1` of each pair added in order, those that are live
    (`_live_split`); the others add exact zeros (masked loads: weight 0, partial 0)."""
    for j in tl.static_range(UNROLL):
        sp = c0 + j
        live = ok & _live_split(sp, used, NS, NUM_SPLITS)
        total, acc = _add_partial(mid_o_ptr, mid_m_ptr, mid_l_ptr, idx + sp, live, m_safe, total, acc, D)
    return total, acc


@triton.jit
def _merge_rows(mid_o_ptr, mid_m_ptr, mid_l_ptr, out_ptr, row, head, ok, Hq, NS, s_ot, s_oh, s_od, used,
                D: tl.constexpr, NSP: tl.constexpr, NUM_SPLITS: tl.constexpr, UNROLL: tl.constexpr):
    """Merge the partials of each (row, head) pair (vectors) into `out`, adding the splits in
    order: prefix splits `0 .. used - 1` (`used` per pair: the splits that hold keys of its
    request; the others are empty, maybe never written) and the extra splits `NUM_SPLITS .. NS - 1`.
    Loads bypass L1 (`.cg`): in the fused merge other programs wrote them."""
    d = tl.arange(0, D)
    s = tl.arange(0, NSP)
    idx = (row.to(tl.int64) * Hq + head) * NS
    live = _live_split(s[None, :], used[:, None], NS, NUM_SPLITS)
    m = tl.load(mid_m_ptr + idx[:, None] + s[None, :], mask=ok[:, None] & live, other=float("-inf"),
                cache_modifier=".cg")
    m_max = tl.max(m, 1)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    total = tl.zeros_like(m_safe)
    acc = tl.zeros([m.shape[0], D], tl.float32)
    # Fixed order (both merges give the same bits), `UNROLL` splits per trip, unrolled so that
    # their loads are in flight together.
    if NSP == UNROLL:
        total, acc = _add_splits(mid_o_ptr, mid_m_ptr, mid_l_ptr, idx, ok, used, 0, NS, m_safe, total, acc, D,
                                 NUM_SPLITS, UNROLL)
    else:
        for c0 in range(0, NSP, UNROLL):
            total, acc = _add_splits(mid_o_ptr, mid_m_ptr, mid_l_ptr, idx, ok, used, c0, NS, m_safe, total, acc, D,
                                     NUM_SPLITS, UNROLL)
    res = tl.where(total[:, None] > 0, acc / tl.where(total > 0, total, 1.0)[:, None], 0.0)  # no key: zeros
    tl.store(out_ptr + row.to(tl.int64)[:, None] * s_ot + head[:, None] * s_oh + d[None, :] * s_od,
             res.to(out_ptr.dtype.element_ty), mask=ok[:, None])


@triton.jit
def _attn_merge_kernel(
    mid_o_ptr,  # (T, Hq, NS, D) float32 partial accumulators
    mid_m_ptr,  # (T, Hq, NS) float32 partial running max (log2 units)
    mid_l_ptr,  # (T, Hq, NS) float32 partial sums
    out_ptr,  # (T, Hq, D) attention output in q's dtype (output)
    Hq, NS, s_ot, s_oh, s_od,
    indptr_ptr, prefix_ptr, bs,  # the batch's row ranges and prefix lengths (SKIP_EMPTY)
    D: tl.constexpr, NSP: tl.constexpr, HB: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr,
    SEARCH_ITERS: tl.constexpr, MERGE_UNROLL: tl.constexpr, SKIP_EMPTY: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    h = tl.program_id(1) * HB + tl.arange(0, HB)
    t = tl.zeros_like(h) + tl.program_id(0)
    used = _splits_used(indptr_ptr, prefix_ptr, bs, t, NUM_SPLITS, BLOCK_N, SEARCH_ITERS, SKIP_EMPTY)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    _merge_rows(mid_o_ptr, mid_m_ptr, mid_l_ptr, out_ptr, t, h, h < Hq, Hq, NS, s_ot, s_oh, s_od, used, D, NSP,
                NUM_SPLITS, MERGE_UNROLL)
