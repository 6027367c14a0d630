"""Pass 1 of `spec_kernels.attention`: one program per (row block, KV head, split) writes an unnormalized
partial; under the fused merge the last program of a (row block, KV head) merges them itself. The
layout, the PDL order and the tail prefetch are described in `spec_kernels.attention`, whose
`triton_attention` launches this kernel.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from spec_kernels._attention_merge import _merge_rows, _request_of_row, _splits_used


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
