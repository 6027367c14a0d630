"""Triton paged attention over the token-slot KV cache: decode, extend, tree verify, draft branches.

Same contract as `spec_runtime.attention.torch_attention` (the reference): query row `t` of request
`r` attends the committed prefix `req_to_token[req_pool_indices[r], :prefix_lens[r]]` plus the
slots `extra_kv[t]` (-1 = none), GQA, softmax in float32, rows that see no key give zeros.

Layout (flash-decoding): pass 1 runs one program per (row block, KV head, split). A row block is up
to `BLOCK_M` consecutive query rows (about the rows of one request); with the `G` query heads of
the KV head they are the `BLOCK_M * G` rows (padded to 16) of every `tl.dot`, so the rows of a tree
or an extend read their shared prefix once and GQA reads each KV head once. Splits `0 .. S-1` each
take a `1/S` share of the committed prefix (a block that spans requests walks each of them); the
remaining splits take chunks of the per-row extra slots: a tile flattens `BLOCK_E` slots of each of
the `BLOCK_M` rows and a block-diagonal mask lets every row see only its own. Each split writes an
unnormalized partial (running max in log2 units, sum, accumulator); pass 2 merges the partials of
every (row, head). The grid comes from host-known sizes only (`T`, `bs`, `E`, `max_context`): no
sync, graph-capturable. Under programmatic dependent launch the split kernel reads the batch
description (row ranges, prefixes, request rows, the first slot tile) before it waits for the
kernel before it, which writes only q and the new K/V: the fast path writes the batch description
earlier in the forward, and every PDL kernel waits before it lets the next one start, so those
writes are complete. Calls of at most two query rows (plain decode, a top-2 draft step) also load
each program's first K/V tile of the committed prefix there (`EARLY_KV_ROWS`): new K/V only
ever go to extra slots (`AttnBatch.out_slots`), so the prefix's were written by an earlier forward.
Those calls also skip pass 2: the last program of each (row block, KV head) to finish (an
arrival counter, acquire-release, reset by that program) merges the block's partials itself. Both merges add the
splits in the same order, so they give the same bits (`FUSED_MERGE_ROWS`). Calls of more rows
skip the prefix splits that hold no keys (`SKIP_EMPTY_MIN_ROWS`). One-row calls given the next
GEMV's weight add programs that only ask L2 for that weight's last rows while HBM would idle (the
tail prefetch, `TAIL_MB`); the results do not change. Each of these choices is a function of the
call's row count only, measured on the H200 (the constants' notes); none is read from anywhere at
launch.

Precondition (every `AttnBatch` builder meets it): the extra slots of one row are distinct. The
reference de-duplicates them; this kernel would count a repeated slot twice.

Long extends (prefill) are correct but not tuned: every row gathers its own extra slots, so a
causal extend of `n` rows reads `O(n^2)` K/V rows (mostly from L2).
"""

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from spec_runtime.attention import AttnBatch, torch_attention
from spec_runtime.kernels._common import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    cdiv,
    check_head_dim,
    check_tensor,
    interpreting,
    next_pow2,
    pdl_options,
    require,
    sm_count,
)
from spec_runtime.kv_cache import KVCache

__all__ = ["reference_attention", "triton_attention"]

reference_attention = torch_attention
"""The pure-torch reference (`spec_runtime.attention.torch_attention`)."""

_LOG2E = 1.4426950408889634
_MAX_SPLITS = 32  # prefix splits per row block
_MAX_ROWS = 64  # BLOCK_M * padded group: rows of one tl.dot
_KEYS_PER_TILE = 64  # extra slots of one tile, over all rows of the block
# Launch parameters on the GPU (measured on an H200, bench/kernels_bench.py).
_GPU = dict(block_n=128, num_warps=4, num_stages=3, programs_per_sm=2)
FUSED_MERGE_ROWS = (2,)
"""The row counts whose calls merge fused: the split kernel's last program per (row block, KV
head) merges the partials (no second kernel); other calls launch the merge kernel. On the H200
(`explore-archive:bench/results/explore/attn_merge_ab.json`) the fused merge ran the STANDALONE draft graph (2
rows per step) 2.84 -> 2.80 ms, but the 8-row tree verify
4.42 -> 4.47 ms: there one program merges 32 (row, head) pairs on the critical path, while the merge
kernel's launch overlaps the split kernel's tail. Plain decode (1 row) gained 0.01 ms per step then;
since its o projection became a one-row multiply-and-reduce GEMV (16 KB weight tiles), the merge
kernel runs it 3.906-3.927 -> 3.887-3.902 ms per step (`explore-archive:bench/results/explore/mulred_row1_s16.json`)."""

# Under PDL the split kernel reads its batch description before it waits for the kernel before it
# (on the H200: plain decode 4.247 -> 4.210 ms/step, STANDALONE 8.24 -> 8.14 ms/iter,
# `explore-archive:bench/results/explore/attn_early_ab.json`).
EARLY_KV_ROWS = 2
"""Calls of at most this many query rows also load the first K/V tile of each program's share of
the committed prefix before the PDL wait. On the H200 the early K/V tile ran plain decode (1 row)
4.09 -> 4.01-4.03 ms/step and the STANDALONE draft graph (2 rows) 2.72-2.74 -> 2.69 ms, but when
every call used it, the 8-row tree verify graph 4.25 -> 4.29 ms
(`explore-archive:bench/results/explore/attn_early_kv_ab.json`)."""
EARLY_KV_TILE_BYTES = 32768
"""The early tile is skipped when one K tile is larger (float32 or head_dim 256 at 128 keys): held
across the wait beside the pipelined loop's buffers, it overflowed the H200's shared memory."""

MERGE_UNROLL = 8
"""Partials the merge (kernel or fused) adds per trip of its loop, unrolled so that their loads
are in flight together instead of one L2 round trip per partial; the order, and so the bits, is
the rolled loop's. On the H200 (`explore-archive:bench/results/explore/session22.json`) it ran plain decode
3.896-3.908 -> 3.838-3.840 ms/step, STANDALONE 8.003-8.016 -> 7.965-7.974 ms/iter and EAGLE-3
5.583-5.591 -> 5.559-5.579, in one process: the one-row merge kernel had cost about 1.9 µs per
layer (leaving it out ran 3.837-3.844), nearly all of it the five partials loaded one after the
other."""

SKIP_EMPTY_MIN_ROWS = 1
"""Calls of more rows skip empty prefix splits: a prefix split program whose block is one request
with no keys in its share (the prefix ends before the split's chunk) leaves before its PDL wait,
and the merge adds only the splits that hold keys (`_splits_used`, from the prefix lengths);
other calls run every split, each storing a partial, empty or not. Bit for bit the same output
either way (an empty partial adds zeros).
The decode graphs size their splits for the longest context, so early in a request most splits
are empty. On the H200 (`explore-archive:bench/results/explore/session21.json`, sections `skip_empty_*`) it ran
the STANDALONE verify graph (8 rows) 4.269-4.270 -> 4.256-4.259 ms and its draft-extend 0.992 ->
0.980-0.982 ms (8.037-8.050 -> 8.016-8.022 ms per iteration), but on for one-row calls too the
plain decode step 3.846-3.853 -> 3.855-3.861 ms (not understood). Never with the fused merge
(it counts every program's arrival)."""

TAIL_MB = 12.0
"""The budget of the tail prefetch, in MiB. Calls of `TAIL_ROWS` query rows (plain decode) that
are given the next projection's weight add about `TAIL_PROGRAMS` programs to the split kernel.
After the PDL wait (the QKV GEMV is done, so HBM idles until the o projection streams) they ask
L2 for the last `min(TAIL_MB, half the weight)` of
it (`cp.async.bulk.prefetch.L2`): the rows the o GEMV's later programs read, when the first
ones have long started. On the H200 (8B, o weight 33.5 MB) 12 MB over 32 programs ran plain decode
3.885-3.896 -> 3.878-3.881 ms/step on slower machines, 3.845-3.846 -> 3.823-3.833 on a faster one;
64 programs, 2 per KV head, 16 or 20 MB, and 8-row calls (tree verify) were slower
(`explore-archive:bench/results/explore/tail_prefetch_s20.json`). Off under the interpreter (inline PTX) and
with the fused merge (its arrival count)."""
TAIL_ROWS = (1,)
TAIL_PROGRAMS = 32


def tail_prefetch_plan(w: torch.Tensor | None, t: int, fused: bool, blocks: int, hkv: int,
                       threads: int) -> tuple[int, dict]:
    """The tail prefetch of a call with `t` query rows before a GEMV over `w`: (programs per (row
    block, KV head), the split kernel's arguments), or `(0, {})` when off. Each of the
    `blocks * hkv * programs * threads` threads asks for one run of `per` elements (a multiple of
    a 128-byte line); the runs end at the weight's end."""
    if w is None or t not in TAIL_ROWS or fused or interpreting() or not w.is_contiguous():
        return 0, {}
    progs = cdiv(TAIL_PROGRAMS, blocks * hkv)
    n = blocks * hkv * progs * threads
    line = 128 // w.element_size()
    per = min(int(TAIL_MB * (1 << 20)), w.numel() * w.element_size() // 2) // w.element_size() // n // line * line
    if per == 0:
        return 0, {}
    return progs, dict(pf_ptr=w, pf_start=w.numel() - per * n, PF_PROGS=progs, PF_ELEMS=per, PF_THREADS=threads,
                       PF_BYTES=per * w.element_size())


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
def _load_q(q_ptrs, rvalid, DOT_F32: tl.constexpr):
    """The block's query rows (after the PDL wait: the kernel before writes them)."""
    q = tl.load(q_ptrs, mask=rvalid[:, None], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    return q


@triton.jit
def _store_partial(mid_o_ptr, mid_m_ptr, mid_l_ptr, row, head, split, Hq, NS, m_i, l_i, acc, mask,
                   D: tl.constexpr):
    """Write partial (row, head, split) of the `(T, Hq, NS[, D])` float32 buffers."""
    d = tl.arange(0, D)
    idx = (row.to(tl.int64) * Hq + head) * NS + split
    tl.store(mid_m_ptr + idx, m_i, mask=mask)
    tl.store(mid_l_ptr + idx, l_i, mask=mask)
    tl.store(mid_o_ptr + idx[:, None] * D + d[None, :], acc, mask=mask[:, None])


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
def _attend_tile(
    q, k_ptr, v_ptr, slot, key_ok, visible, m_i, l_i, acc, qk_scale,
    s_ks, s_kh, s_kd, s_vs, s_vh, s_vd, kvh,
    D: tl.constexpr, DOT_F32: tl.constexpr,
):
    """One online-softmax step of the rows `q (R, D)` over the key tile `slot (J,)`.

    `key_ok (J,)`: keys to load; `visible (R, J)`: which row sees which key. A row that has seen
    no key yet keeps max -inf, sum 0 and a zero accumulator.
    """
    kt, vt = _load_kv(k_ptr, v_ptr, slot, key_ok, kvh, s_ks, s_kh, s_kd, s_vs, s_vh, s_vd, D)
    return _attend_kv(q, kt, vt, visible, m_i, l_i, acc, qk_scale, DOT_F32)


@triton.jit
def _load_kv(k_ptr, v_ptr, slot, key_ok, kvh, s_ks, s_kh, s_kd, s_vs, s_vh, s_vd, D: tl.constexpr):
    """The `(J, D)` K and V tiles of KV head `kvh` at `slot (J,)` (zeros where not `key_ok`)."""
    d = tl.arange(0, D)
    kt = tl.load(k_ptr + slot[:, None] * s_ks + kvh * s_kh + d[None, :] * s_kd, mask=key_ok[:, None], other=0.0)
    vt = tl.load(v_ptr + slot[:, None] * s_vs + kvh * s_vh + d[None, :] * s_vd, mask=key_ok[:, None], other=0.0)
    return kt, vt


@triton.jit
def _attend_kv(q, kt, vt, visible, m_i, l_i, acc, qk_scale, DOT_F32: tl.constexpr):
    """`_attend_tile` on K/V tiles already loaded."""
    if DOT_F32:
        s = tl.dot(q, tl.trans(kt.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(kt))
    s = tl.where(visible, s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if DOT_F32:
        pv = tl.dot(p, vt.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(vt.dtype), vt)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _attn_split_kernel(
    q_ptr,  # (T, Hq, D) queries
    k_ptr,  # (num_slots, Hkv, D) this layer's keys
    v_ptr,  # (num_slots, Hkv, D) this layer's values
    rt_ptr,  # (max_reqs, max_context) int slot table, last dim contiguous
    req_pool_ptr,  # (bs,) int request rows
    prefix_ptr,  # (bs,) int committed lengths
    indptr_ptr,  # (bs+1,) int query row ranges
    extra_ptr,  # (T, E) int extra slots, -1 = none
    mid_o_ptr,  # (T, Hq, NS, D) float32 partial accumulators (output)
    mid_m_ptr,  # (T, Hq, NS) float32 partial running max, log2 units (output)
    mid_l_ptr,  # (T, Hq, NS) float32 partial sums (output)
    out_ptr,  # (T, Hq, D) attention output in q's dtype (output, FUSED_MERGE)
    count_ptr,  # (blocks * Hkv,) int32 arrival counters, zero between launches (FUSED_MERGE)
    T, bs, Hq, NS, e_len, e_chunk, qk_scale,
    s_qt, s_qh, s_qd, s_rt, s_et, s_ee, s_ks, s_kh, s_kd, s_vs, s_vh, s_vd, s_ot, s_oh, s_od,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_J: tl.constexpr, NUM_SPLITS: tl.constexpr,
    SEARCH_ITERS: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr = False,
    FUSED_MERGE: tl.constexpr = False, NSP: tl.constexpr = 1, MERGE_UNROLL: tl.constexpr = 1,
    EARLY_KV: tl.constexpr = False, SKIP_EMPTY: tl.constexpr = False,
    # the tail prefetch (TAIL_MB): programs NS .. NS + PF_PROGS - 1 of axis 2 ask L2 for a weight's end
    pf_ptr=None, pf_start=0, PF_PROGS: tl.constexpr = 0, PF_ELEMS: tl.constexpr = 0,
    PF_THREADS: tl.constexpr = 128, PF_BYTES: tl.constexpr = 0,
):
    # Under PDL these programs may start while the kernel before this one (the layer's RoPE and K/V
    # store) still runs. The batch description (row ranges, prefixes, request rows, slot table,
    # extra slots) is written earlier in the forward, so its loads, which the K/V gathers depend
    # on, go before the wait; q and the K/V cache, which that kernel writes, after it.
    row0 = tl.program_id(0) * BLOCK_M
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    # Rows of the block, row-major over (query row, head of the group), padded to BLOCK_R >= 16.
    i = tl.arange(0, BLOCK_R)
    m_of_i = i // GP
    row = row0 + m_of_i
    g = i % GP
    head = kvh * G + g
    rvalid = (i < BLOCK_M * GP) & (g < G) & (row < T)
    d = tl.arange(0, D)
    q_ptrs = q_ptr + row[:, None].to(tl.int64) * s_qt + head[:, None] * s_qh + d[None, :] * s_qd
    if PF_PROGS > 0:
        if split >= NS:  # a tail-prefetch program (see TAIL_MB), one run of PF_ELEMS per thread
            if PDL:
                gdc_wait()
                gdc_launch_dependents()
            p = (tl.program_id(0) * tl.num_programs(1) + kvh) * PF_PROGS + (split - NS)
            th = tl.arange(0, PF_THREADS)
            at = pf_ptr + pf_start + (p * PF_THREADS + th).to(tl.int64) * PF_ELEMS
            nbytes = tl.full([PF_THREADS], PF_BYTES, tl.int32)
            tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;", "=r,l,r",
                                      [at, nbytes], dtype=tl.int32, is_pure=False, pack=1)
    if split < NUM_SPLITS:
        # Share `split` of each request's prefix, shared by all its rows in the block. The first
        # request's sizes and first slot tile are loaded before the wait (`*_0`).
        r_first = _request_of_row(indptr_ptr, bs, row0, SEARCH_ITERS)
        r_last = _request_of_row(indptr_ptr, bs, tl.minimum(row0 + BLOCK_M, T) - 1, SEARCH_ITERS)
        p_len_0 = tl.load(prefix_ptr + r_first).to(tl.int64)
        req_0 = tl.load(req_pool_ptr + r_first).to(tl.int64)
        lo_0 = tl.load(indptr_ptr + r_first)
        hi_0 = tl.load(indptr_ptr + r_first + 1)
        chunk_0 = tl.cdiv(tl.cdiv(p_len_0, NUM_SPLITS), BLOCK_N) * BLOCK_N
        if SKIP_EMPTY:  # (never with the fused merge: it counts every program's arrival)
            # a block of one request whose share is empty (its prefix ends before this split)
            # leaves at once, before the wait; the merge skips the split (`_splits_used`)
            live = (r_first != r_last) | (split * chunk_0 < p_len_0)
        else:
            live = split >= 0
        if live:
            cols_0 = split * chunk_0 + tl.arange(0, BLOCK_N)
            ok_0 = cols_0 < tl.minimum(split * chunk_0 + chunk_0, p_len_0)
            slot_p0 = tl.load(rt_ptr + req_0 * s_rt + cols_0, mask=ok_0, other=0).to(tl.int64)
            if EARLY_KV:  # the first tile of this share of the committed prefix (see the module)
                kt0, vt0 = _load_kv(k_ptr, v_ptr, slot_p0, ok_0, kvh, s_ks, s_kh, s_kd, s_vs, s_vh, s_vd, D)
            if PDL:  # programmatic dependent launch: the previous kernel's writes are visible from here
                gdc_wait()
                gdc_launch_dependents()
            q = _load_q(q_ptrs, rvalid, DOT_F32)
            for r in range(r_first, r_last + 1):
                later = r != r_first  # (a block across requests; the first one's values are in hand)
                p_len = tl.where(later, tl.load(prefix_ptr + r, mask=later, other=0).to(tl.int64), p_len_0)
                req = tl.where(later, tl.load(req_pool_ptr + r, mask=later, other=0).to(tl.int64), req_0)
                chunk = tl.cdiv(tl.cdiv(p_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
                c0 = split * chunk
                c1 = tl.minimum(c0 + chunk, p_len)
                m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
                l_i = tl.zeros([BLOCK_R], tl.float32)
                acc = tl.zeros([BLOCK_R, D], tl.float32)
                for start in range(c0, c1, BLOCK_N):
                    cols = start + tl.arange(0, BLOCK_N)
                    cmask = cols < c1
                    loaded = later | (start != c0)
                    slot = tl.load(rt_ptr + req * s_rt + cols, mask=cmask & loaded, other=0).to(tl.int64)
                    slot = tl.where(loaded, slot, slot_p0)
                    if EARLY_KV:
                        if loaded:
                            m_i, l_i, acc = _attend_tile(
                                q, k_ptr, v_ptr, slot, cmask, cmask[None, :], m_i, l_i, acc, qk_scale,
                                s_ks, s_kh, s_kd, s_vs, s_vh, s_vd, kvh, D, DOT_F32,
                            )
                        else:  # the tile loaded before the wait
                            m_i, l_i, acc = _attend_kv(q, kt0, vt0, cmask[None, :], m_i, l_i, acc, qk_scale, DOT_F32)
                    else:
                        m_i, l_i, acc = _attend_tile(
                            q, k_ptr, v_ptr, slot, cmask, cmask[None, :], m_i, l_i, acc, qk_scale,
                            s_ks, s_kh, s_kd, s_vs, s_vh, s_vd, kvh, D, DOT_F32,
                        )
                lo = tl.where(later, tl.load(indptr_ptr + r, mask=later, other=0), lo_0)
                hi = tl.where(later, tl.load(indptr_ptr + r + 1, mask=later, other=0), hi_0)
                in_r = rvalid & (row >= lo) & (row < hi)
                _store_partial(mid_o_ptr, mid_m_ptr, mid_l_ptr, row, head, split, Hq, NS, m_i, l_i, acc, in_r, D)
    elif split < NS:
        # Chunk `split - NUM_SPLITS` of the extra slots: a tile holds BLOCK_E slots of each of the
        # BLOCK_M rows (flattened), and row i sees only the slots of its own query row. The first
        # tile's slots are loaded before the wait.
        e_lo = (split - NUM_SPLITS) * e_chunk
        e_hi = tl.minimum(e_lo + e_chunk, e_len)
        j = tl.arange(0, BLOCK_J)
        m_of_j = j // BLOCK_E
        j_row = row0 + m_of_j
        j_ok = (j < BLOCK_M * BLOCK_E) & (j_row < T)
        e_ptrs = extra_ptr + j_row.to(tl.int64) * s_et
        e_col_0 = e_lo + j % BLOCK_E
        slot_e0 = tl.load(e_ptrs + e_col_0 * s_ee, mask=j_ok & (e_col_0 < e_hi), other=-1).to(tl.int64)
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        q = _load_q(q_ptrs, rvalid, DOT_F32)
        m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, D], tl.float32)
        for e0 in range(e_lo, e_hi, BLOCK_E):
            e_col = e0 + j % BLOCK_E
            loaded = e0 != e_lo
            slot = tl.load(e_ptrs + e_col * s_ee, mask=j_ok & (e_col < e_hi) & loaded, other=-1).to(tl.int64)
            slot = tl.where(loaded, slot, slot_e0)
            key_ok = slot >= 0
            visible = (m_of_i[:, None] == m_of_j[None, :]) & key_ok[None, :]
            m_i, l_i, acc = _attend_tile(
                q, k_ptr, v_ptr, slot, key_ok, visible, m_i, l_i, acc, qk_scale,
                s_ks, s_kh, s_kd, s_vs, s_vh, s_vd, kvh, D, DOT_F32,
            )
        _store_partial(mid_o_ptr, mid_m_ptr, mid_l_ptr, row, head, split, Hq, NS, m_i, l_i, acc, rvalid, D)
    if FUSED_MERGE:  # (never with tail-prefetch programs)
        # Every thread's partial stores come before the counter's release (the barrier, then an
        # acquire-release add at GPU scope); the last arrival merges the block and resets it.
        tl.debug_barrier()
        counter = count_ptr + tl.program_id(0) * tl.num_programs(1) + kvh
        arrived = tl.atomic_add(counter, 1, sem="acq_rel")
        if arrived == NS - 1:
            used = _splits_used(indptr_ptr, prefix_ptr, bs, row, NUM_SPLITS, BLOCK_N, SEARCH_ITERS, False)  # all ran
            _merge_rows(mid_o_ptr, mid_m_ptr, mid_l_ptr, out_ptr, row, head, rvalid, Hq, NS, s_ot, s_oh, s_od, used,
                        D, NSP, NUM_SPLITS, MERGE_UNROLL)
            tl.atomic_xchg(counter, 0)


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


def _check_inputs(q: torch.Tensor, cache: KVCache, layer: int, attn: AttnBatch) -> None:
    require(q.dim() == 3, f"q must be (T, Hq, D), got shape {tuple(q.shape)}")
    t, hq, d = q.shape
    _, _, hkv, dk = cache.k.shape
    dev = q.device
    require(q.dtype in FLOAT_DTYPES, f"q has dtype {q.dtype}, expected one of {FLOAT_DTYPES}")
    require(cache.k.dtype in FLOAT_DTYPES, f"cache dtype {cache.k.dtype}, expected one of {FLOAT_DTYPES}")
    require(d == dk, f"q head_dim {d} does not match the cache head_dim {dk}")
    check_head_dim(d)
    require(hq % hkv == 0, f"query heads {hq} are not a multiple of KV heads {hkv}")
    require(0 <= layer < cache.k.shape[0], f"layer {layer} out of range [0, {cache.k.shape[0]})")
    require(cache.k.device == dev, f"cache is on {cache.k.device}, q on {dev}")
    bs = attn.batch_size
    check_tensor("attn.req_pool_indices", attn.req_pool_indices, INDEX_DTYPES, (bs,), dev)
    check_tensor("attn.prefix_lens", attn.prefix_lens, INDEX_DTYPES, (bs,), dev)
    check_tensor("attn.qo_indptr", attn.qo_indptr, INDEX_DTYPES, (bs + 1,), dev)
    check_tensor("attn.extra_kv", attn.extra_kv, INDEX_DTYPES, (t, None), dev)
    check_tensor("cache.req_to_token", cache.req_to_token, INDEX_DTYPES, (None, None), dev)
    require(cache.req_to_token.stride(1) == 1, "cache.req_to_token must be contiguous in its last dim")
    for name, x in (("req_pool_indices", attn.req_pool_indices), ("prefix_lens", attn.prefix_lens),
                    ("qo_indptr", attn.qo_indptr)):
        require(x.is_contiguous(), f"attn.{name} must be contiguous")


def _plan(t: int, bs: int, hkv: int, g: int, e: int, max_context: int, device: torch.device,
          num_splits: int | None) -> dict:
    """Block sizes and split counts from host-known sizes only (no sync)."""
    gp = next_pow2(g)
    block_m = max(1, min(next_pow2(cdiv(t, max(bs, 1))), _MAX_ROWS // gp))  # rows per request, about
    block_n = 16 if interpreting() else _GPU["block_n"]
    blocks = cdiv(t, block_m)
    target = _GPU["programs_per_sm"] * sm_count(device)
    if num_splits is None:
        num_splits = min(cdiv(target, blocks * hkv), _MAX_SPLITS, max(1, cdiv(max_context, block_n)))
    require(num_splits >= 1, f"num_splits must be >= 1, got {num_splits}")
    block_e = max(1, min(_KEYS_PER_TILE // block_m, next_pow2(e)))  # extra slots per row per tile
    extra_splits = 0 if e == 0 else min(max(1, cdiv(target, blocks * hkv)), cdiv(e, _KEYS_PER_TILE))
    e_chunk = cdiv(cdiv(e, extra_splits), block_e) * block_e if e else 0
    return dict(
        GP=gp, BLOCK_M=block_m, BLOCK_R=max(16, block_m * gp), BLOCK_N=block_n, BLOCK_E=block_e,
        BLOCK_J=max(16, block_m * block_e), NUM_SPLITS=num_splits, blocks=blocks, extra_splits=extra_splits,
        e_chunk=e_chunk,
    )


def merge_mode(rows: int) -> str:
    """How the partials of a call with `rows` query rows are merged: "fused" at `FUSED_MERGE_ROWS`
    rows, else "kernel" (a second kernel)."""
    return "fused" if rows in FUSED_MERGE_ROWS else "kernel"


def skip_empty_mode(rows: int) -> bool:
    """Whether a call with `rows` query rows skips empty prefix splits: more than
    `SKIP_EMPTY_MIN_ROWS` rows (never with the fused merge)."""
    return rows > SKIP_EMPTY_MIN_ROWS


def early_kv_mode(rows: int) -> bool:
    """Whether a call with `rows` query rows loads its first committed K/V tile before the PDL wait:
    at most `EARLY_KV_ROWS` rows."""
    return rows <= EARLY_KV_ROWS


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """The device's arrival counters for the fused merge: int32 zeros, at least `n` (every launch
    leaves them zero). Launches that use them must not overlap: the fast path runs its attention
    in stream order on one stream. Grown before a capture needs more (a capture cannot allocate
    outside its pool safely), so the first call per size should run eagerly."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        require(not capturing, f"the fused attention merge needs {n} arrival counters; make one such call "
                               "outside the CUDA-graph capture first")
        buf = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


def triton_attention(
    q: torch.Tensor, cache: KVCache, layer: int, attn: AttnBatch, scale: float, *, num_splits: int | None = None,
    next_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention over the KV cache (GQA, ragged prefixes, extra slots), `torch_attention`'s contract.

    Args:
        q: `(T, Hq, D)` queries (RoPE applied), float16/bfloat16/float32; `D` a power of two >= 16.
        cache: the KV cache (any float dtype); every row's K/V is already stored at `attn.out_slots`.
        layer: cache layer to read.
        attn: the batch description; the extra slots of a row must be distinct.
        scale: softmax scale.
        num_splits: prefix splits per row block (default: enough programs for two waves).
        next_weight: the `(N, K)` weight the next GEMV streams, for the tail prefetch (`TAIL_MB`).

    Returns:
        `(T, Hq, D)` in q's dtype; rows that see no key are zeros.
    """
    _check_inputs(q, cache, layer, attn)
    t, hq, d = q.shape
    hkv = cache.k.shape[2]
    bs, e = attn.batch_size, attn.extra_kv.shape[1]
    if t == 0 or bs == 0:
        return q.new_zeros((t, hq, d))
    out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    plan = _plan(t, bs, hkv, hq // hkv, e, cache.req_to_token.shape[1], q.device, num_splits)
    ns = plan["NUM_SPLITS"] + plan["extra_splits"]
    mid_o = torch.empty((t, hq, ns, d), dtype=torch.float32, device=q.device)
    mid_m = torch.empty((t, hq, ns), dtype=torch.float32, device=q.device)
    mid_l = torch.empty((t, hq, ns), dtype=torch.float32, device=q.device)
    k, v, rt, extra = cache.k[layer], cache.v[layer], cache.req_to_token, attn.extra_kv
    dot_f32 = interpreting() or q.dtype == torch.float32 or q.dtype != cache.k.dtype
    fused = merge_mode(t) == "fused"
    counts = _counters(q.device, plan["blocks"] * hkv) if fused else mid_m
    early_kv = early_kv_mode(t) and plan["BLOCK_N"] * d * k.element_size() <= EARLY_KV_TILE_BYTES
    skip = skip_empty_mode(t) and not fused  # the fused merge counts every program's arrival
    unroll = min(next_pow2(ns), MERGE_UNROLL)
    pf_progs, pf_args = tail_prefetch_plan(next_weight, t, fused, plan["blocks"], hkv, 32 * _GPU["num_warps"])
    _attn_split_kernel[(plan["blocks"], hkv, ns + pf_progs)](
        q, k, v, rt, attn.req_pool_indices, attn.prefix_lens, attn.qo_indptr, extra,
        mid_o, mid_m, mid_l, out, counts,
        t, bs, hq, ns, e, plan["e_chunk"], scale * _LOG2E,
        q.stride(0), q.stride(1), q.stride(2), rt.stride(0), extra.stride(0), extra.stride(1),
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        G=hq // hkv, GP=plan["GP"], D=d, BLOCK_M=plan["BLOCK_M"], BLOCK_R=plan["BLOCK_R"],
        BLOCK_N=plan["BLOCK_N"], BLOCK_E=plan["BLOCK_E"], BLOCK_J=plan["BLOCK_J"],
        NUM_SPLITS=plan["NUM_SPLITS"], SEARCH_ITERS=max(1, (bs + 1).bit_length()), DOT_F32=dot_f32,
        FUSED_MERGE=fused, NSP=next_pow2(ns), MERGE_UNROLL=unroll, EARLY_KV=early_kv, SKIP_EMPTY=skip, **pf_args,
        num_warps=_GPU["num_warps"], num_stages=_GPU["num_stages"], **pdl_options(q.device),
    )
    if fused:
        return out
    hb = next_pow2(hq) if interpreting() else plan["GP"]  # GPU: one program per (row, KV head)
    _attn_merge_kernel[(t, cdiv(hq, hb))](
        mid_o, mid_m, mid_l, out, hq, ns, out.stride(0), out.stride(1), out.stride(2),
        attn.qo_indptr, attn.prefix_lens, bs, D=d, NSP=next_pow2(ns), HB=hb, NUM_SPLITS=plan["NUM_SPLITS"],
        BLOCK_N=plan["BLOCK_N"], SEARCH_ITERS=max(1, (bs + 1).bit_length()), MERGE_UNROLL=unroll, SKIP_EMPTY=skip,
        num_warps=4 if d >= 128 else 2, **pdl_options(q.device),
    )
    return out
