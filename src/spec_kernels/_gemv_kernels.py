"""The Triton kernels of `spec_kernels.gemv`: the split-K GEMV (`_gemv_kernel`: `tl.dot` or
multiply-and-reduce tiles, optional epilogues `EPI_*`) and the fixed-order reduce of its float32
partials (`_split_k_reduce_kernel`). Their launcher and configurations are in `spec_kernels.gemv`.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _tile_product(acc, x, w, DOT_F32: tl.constexpr, SWAP: tl.constexpr, MULRED: tl.constexpr,
                  ROW1: tl.constexpr = False):
    """`acc + x @ w.T` (`(BLOCK_M, BLOCK_N)`), or with SWAP its transpose `acc + w @ x.T`, or with
    MULRED the products `x[m, k] * w[n, k]` added into `acc (BLOCK_M, BLOCK_N, BLOCK_K)`, or for
    one row (ROW1, a MULRED case) into `acc (BLOCK_N, BLOCK_K)` (see `_gemv_kernel`)."""
    if ROW1:
        acc = acc + w.to(tl.float32) * x.to(tl.float32)
    elif MULRED:
        acc = acc + x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    elif DOT_F32:
        x = x.to(tl.float32)
        w = w.to(tl.float32)
        if SWAP:
            acc = tl.dot(w, tl.trans(x), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
    else:
        x = x.to(w.dtype)
        if SWAP:
            acc = tl.dot(w, tl.trans(x), acc)
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    return acc


@triton.jit
def _load_x(x_ptr, x_rows, ks, m_ok, k_ok, MASK_K: tl.constexpr, ROW1: tl.constexpr):
    """The `(BLOCK_M, BLOCK_K)` input tile at columns `ks` (`k_ok` their mask, with MASK_K). One row
    (ROW1) loads as a vector expanded to `(1, BLOCK_K)`, so it takes the weight tile's layout
    without a shared-memory conversion in the K loop (a launch has at least one row)."""
    if ROW1:
        if MASK_K:
            return tl.load(x_ptr + ks, mask=k_ok, other=0.0)[None, :]
        return tl.load(x_ptr + ks)[None, :]
    if MASK_K:
        return tl.load(x_rows + ks[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
    return tl.load(x_rows + ks[None, :], mask=m_ok[:, None], other=0.0)


EPI_NONE: tl.constexpr = tl.constexpr(0)
EPI_SILU: tl.constexpr = tl.constexpr(1)
EPI_ROPE: tl.constexpr = tl.constexpr(2)
"""Epilogues of the GEMV (`_gemv_kernel`'s EPI). With one, output column `2p + h` is half `h` of
pair `p`, computed from weight row `_pair_row(p, h)`, and the epilogue turns each pair into its
outputs: SILU `out[:, p] = silu(gate_p) * up_p` (gate/up weight `(2I, K)`, gate rows first); ROPE
RoPE on the q and k heads of a fused QKV weight (pair p: element d and d + D/2 of one head), q
written to `out` `(M, Hq, D)`, k and v stored into the KV cache at the rows' slots."""


@triton.jit
def _pair_row(pair, half, NUM_PAIRS, EPI: tl.constexpr, HD2: tl.constexpr):
    """The weight row of half `half` of pair `pair`."""
    if EPI == EPI_SILU:
        return pair + half * NUM_PAIRS
    return (pair // HD2) * (2 * HD2) + pair % HD2 + half * HD2


@triton.jit
def _rope_inputs(rows, row_ok, pairs, pair_ok, pos_ptr, slot_ptr, cos_ptr, sin_ptr, s_tab, HD2: tl.constexpr):
    """What the RoPE epilogue reads for (rows x pairs): cos and sin of both halves at the rows'
    positions, and the rows' KV slots. Positions and slots are written before the forward, so the
    GEMV (and the split-K reduce) read them at its start, before its PDL wait and its K loop:
    loaded after the products, the position load and the table loads it feeds were two dependent
    round trips at the end of every QKV projection. On the H200 loading them up front ran plain
    decode 4.171 -> 4.156 ms/step, STANDALONE 8.11 -> 8.08 ms/iter and EAGLE-3 5.645 -> 5.62
    (`explore-archive:bench/results/explore/bookkeeping_rope_ab.json`). The slot load does not wait for the
    position's, the table loads do."""
    ok = row_ok & pair_ok
    d = pairs % HD2
    pos = tl.load(pos_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    c0 = tl.load(cos_ptr + pos * s_tab + d, mask=ok, other=0.0)
    s0 = tl.load(sin_ptr + pos * s_tab + d, mask=ok, other=0.0)
    c1 = tl.load(cos_ptr + pos * s_tab + d + HD2, mask=ok, other=0.0)
    s1 = tl.load(sin_ptr + pos * s_tab + d + HD2, mask=ok, other=0.0)
    slot = tl.load(slot_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    return c0, s0, c1, s1, slot


@triton.jit
def _pair_epilogue(a0, a1, rows, row_ok, pairs, pair_ok, out_ptr, s_om,
                   pos_ptr, slot_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, NQ, NKV, s_tab, s_cs, s_ch, s_oh,
                   EPI: tl.constexpr, HD2: tl.constexpr, pre=None):
    """Pairs' float32 sums `a0`, `a1` (rows x pairs) -> the epilogue's outputs. Each projection
    output is rounded to the output dtype first, exactly as the separate elementwise kernels
    (`spec_kernels/elementwise.py`) see it, and they do the same float32 arithmetic after. `pre`: the
    RoPE inputs (`_rope_inputs`), loaded at the kernel's start (None for SiLU)."""
    ok = row_ok & pair_ok
    x0 = a0.to(out_ptr.dtype.element_ty).to(tl.float32)
    x1 = a1.to(out_ptr.dtype.element_ty).to(tl.float32)
    if EPI == EPI_SILU:
        act = (x0 / (1.0 + tl.exp(-x0))).to(out_ptr.dtype.element_ty)  # F.silu rounds to the dtype
        y = act.to(tl.float32) * x1
        tl.store(out_ptr + rows.to(tl.int64) * s_om + pairs, y.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        head = pairs // HD2
        d = pairs % HD2
        c0, s0, c1, s1, slot = pre
        # rotate-half, as `_rope_store_kernel` writes it, the fused multiply-add explicit: left to the
        # compiler, which product it fuses depended on the code around it (early inputs, float32)
        y0 = tl.fma(x0, c0, (-1.0 * x1) * s0)
        y1 = tl.fma(x1, c1, (1.0 * x0) * s1)
        is_q = head < NQ
        is_k = (head >= NQ) & (head < NQ + NKV)
        is_v = head >= NQ + NKV
        q_at = out_ptr + rows.to(tl.int64) * s_om + head * s_oh + d
        tl.store(q_at, y0.to(out_ptr.dtype.element_ty), mask=ok & is_q)
        tl.store(q_at + HD2, y1.to(out_ptr.dtype.element_ty), mask=ok & is_q)
        kv_head = tl.where(is_v, head - NQ - NKV, head - NQ)
        at = slot * s_cs + kv_head * s_ch + d
        tl.store(kc_ptr + at, y0.to(kc_ptr.dtype.element_ty), mask=ok & is_k)
        tl.store(kc_ptr + at + HD2, y1.to(kc_ptr.dtype.element_ty), mask=ok & is_k)
        tl.store(vc_ptr + at, x0.to(vc_ptr.dtype.element_ty), mask=ok & is_v)
        tl.store(vc_ptr + at + HD2, x1.to(vc_ptr.dtype.element_ty), mask=ok & is_v)


@triton.jit
def _gemv_kernel(
    x_ptr,  # (M, K) activations
    w_ptr,  # (N, K) weight, K contiguous
    bias_ptr,  # (N,) bias (ignored unless HAS_BIAS)
    out_ptr,  # (M, N) result in x's dtype (output, SPLIT_K == 1)
    part_ptr,  # (SPLIT_K, M, N) float32 partial sums (output, SPLIT_K > 1)
    M, N, K, s_xm, s_wn, s_om,
    # the EPI_ROPE epilogue: positions, KV slots, float32 cos/sin tables, this layer's K and V cache,
    # q and KV head counts, table row stride, cache slot and head strides, q output head stride
    pos_ptr, slot_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, NQ, NKV, s_tab, s_cs, s_ch, s_oh,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_F32: tl.constexpr, SWAP: tl.constexpr = False,
    EPI: tl.constexpr = 0, HD2: tl.constexpr = 1, PDL: tl.constexpr = False, MULRED: tl.constexpr = False,
):
    ROW1: tl.constexpr = MULRED and BLOCK_M == 1  # one row: 2-D products in the weight tile's own layout
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # output (or partial) columns of this tile
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    if EPI == EPI_NONE:
        w_row = rn
    else:  # column 2p + h is pair p's half h: the weight rows the epilogue combines sit side by side
        pair = rn // 2
        w_row = _pair_row(pair, rn % 2, N // 2, EPI, HD2)
    n_ok = rn < N
    k_len = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k0 = pid_k * k_len
    k1 = tl.minimum(k0 + k_len, K)
    x_rows = x_ptr + rm[:, None].to(tl.int64) * s_xm
    w_rows = w_ptr + w_row[:, None].to(tl.int64) * s_wn
    if SWAP:  # acc.T: the weight tile is the dot's left operand
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    elif ROW1:
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    elif MULRED:  # products, summed over K after the loop
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    first = k0
    pairs = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    if EPI == EPI_ROPE and SPLIT_K == 1:  # the epilogue's inputs, before the wait and the loop
        pre = _rope_inputs(rm[:, None], m_ok[:, None], pairs[None, :], (pairs < N // 2)[None, :],
                           pos_ptr, slot_ptr, cos_ptr, sin_ptr, s_tab, HD2)
    else:
        pre = None
    if PDL:
        # Programmatic dependent launch: fetch the first weight tile (weights are never written)
        # while the previous kernel finishes, wait for it (x is its output), then let the next
        # kernel's programs start. Triggering only after the wait keeps at most one kernel waiting
        # ahead; triggering first would let the whole chain launch and hold multiprocessors idle.
        ks = k0 + rk
        if EVEN_K:
            w = tl.load(w_rows + ks[None, :], mask=n_ok[:, None], other=0.0)
        else:
            w = tl.load(w_rows + ks[None, :], mask=n_ok[:, None] & (ks < k1)[None, :], other=0.0)
        gdc_wait()
        gdc_launch_dependents()
        x = _load_x(x_ptr, x_rows, ks, m_ok, ks < k1, True, ROW1)
        acc = _tile_product(acc, x, w, DOT_F32, SWAP, MULRED, ROW1)
        first = k0 + BLOCK_K
    for kk in range(first, k1, BLOCK_K):
        ks = kk + rk
        if EVEN_K:
            x = _load_x(x_ptr, x_rows, ks, m_ok, ks, False, ROW1)
            w = tl.load(w_rows + ks[None, :], mask=n_ok[:, None], other=0.0)
        else:
            k_ok = ks < k1
            x = _load_x(x_ptr, x_rows, ks, m_ok, k_ok, True, ROW1)
            w = tl.load(w_rows + ks[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc = _tile_product(acc, x, w, DOT_F32, SWAP, MULRED, ROW1)
    if SWAP:
        acc = tl.trans(acc)
    elif ROW1:
        acc = tl.reshape(tl.sum(acc, 1), [1, BLOCK_N])
    elif MULRED:
        acc = tl.sum(acc, 2)
    ok = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K == 1 and EPI != EPI_NONE:
        a0, a1 = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N // 2, 2]))
        _pair_epilogue(a0, a1, rm[:, None], m_ok[:, None], pairs[None, :], (pairs < N // 2)[None, :], out_ptr, s_om,
                       pos_ptr, slot_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, NQ, NKV, s_tab, s_cs, s_ch, s_oh, EPI, HD2,
                       pre)
    elif SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rm[:, None].to(tl.int64) * s_om + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        part = part_ptr + (pid_k * M + rm[:, None]).to(tl.int64) * N + rn[None, :]
        tl.store(part, acc, mask=ok)


@triton.jit
def _split_k_reduce_kernel(
    part_ptr,  # (SPLIT_K, M, N) float32 partial sums
    bias_ptr,  # (N,) bias (ignored unless HAS_BIAS)
    out_ptr,  # (M, N) result in x's dtype (output)
    M, N, s_om,
    # the EPI_ROPE epilogue: positions, KV slots, float32 cos/sin tables, this layer's K and V cache,
    # q and KV head counts, table row stride, cache slot and head strides, q output head stride
    pos_ptr, slot_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, NQ, NKV, s_tab, s_cs, s_ch, s_oh,
    SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr, EPI: tl.constexpr = 0,
    HD2: tl.constexpr = 1, PDL: tl.constexpr = False,
):
    m = tl.program_id(1)
    rn = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rn < N
    pairs = tl.program_id(0) * (BLOCK // 2) + tl.arange(0, BLOCK // 2)
    if EPI == EPI_ROPE:  # the epilogue's inputs, before the wait
        pre = _rope_inputs(m, m < M, pairs, pairs < N // 2, pos_ptr, slot_ptr, cos_ptr, sin_ptr, s_tab, HD2)
    else:
        pre = None
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT_K):  # fixed order: deterministic
        acc += tl.load(part_ptr + (s * M + m).to(tl.int64) * N + rn, mask=ok, other=0.0)
    if EPI != EPI_NONE:
        a0, a1 = tl.split(tl.reshape(acc, [BLOCK // 2, 2]))
        _pair_epilogue(a0, a1, m, m < M, pairs, pairs < N // 2, out_ptr, s_om,
                       pos_ptr, slot_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, NQ, NKV, s_tab, s_cs, s_ch, s_oh, EPI, HD2,
                       pre)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + m.to(tl.int64) * s_om + rn, acc.to(out_ptr.dtype.element_ty), mask=ok)
