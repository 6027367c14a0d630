"""Exploration kernel (H200): a GEMV whose weight stream starts before its PDL wait, deep, and
never restarts.

The runtime's Triton GEMV loads one weight tile before `griddepcontrol.wait`: the compiler's
software pipeline lives in registers and shared memory it allocates itself, so more tiles ahead of
the wait meant more registers (session 3: 2, 4, 8 tiles ahead ran the step 4.28 -> 4.32, 5.03,
7.08 ms, spilling), and it restarts at every row block. Here (Gluon, explicit mbarriers):

- one program per multiprocessor (`programs`), each owning a contiguous, balanced range of
  `ROWS`-row blocks of `w` (so every multiprocessor streams the same bytes, whatever N is);
- the program's (row block, K tile) sequence is one flat stream of `(ROWS, BK)` TMA boxes into a
  ring of `NBUF` shared-memory buffers, `PRE` of them issued before the PDL wait, refilled as
  each is consumed, across row-block boundaries;
- `x` (at most 2 rows) is staged in shared memory after the wait; each box is multiplied and
  added into a float32 `(ROWS, BK)` accumulator per row, summed and stored at the end of its row
  block.

No epilogues, no K split: a measurement of the streaming, not a runtime kernel. With a ring of
~200 KB a program fills its multiprocessor's shared memory, so the next GEMV's programs can only
land as this one's leave: they stream into its tail.
"""

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

BK = 256
"""K elements per TMA box (512 bytes of bf16, unswizzled: a warp reads one box row)."""


@gluon.jit
def _gdc_wait():
    gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _gdc_launch_dependents():
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _issue(w_desc, w_smem, bars, t, T, rb0, NK: gl.constexpr, NBUF: gl.constexpr, ROWS: gl.constexpr,
           BKC: gl.constexpr):
    """TMA box `t` of this program's stream into ring slot `t % NBUF` (nothing past `T`)."""
    s = t % NBUF
    ok = t < T
    mbarrier.expect(bars.index(s), w_desc.block_type.nbytes, pred=ok)
    tma.async_copy_global_to_shared(w_desc, [(rb0 + t // NK) * ROWS, (t % NK) * BKC], bars.index(s),
                                    w_smem.index(s), pred=ok)


@gluon.jit
def _stream_gemv_kernel(w_desc, x_ptr, out_ptr, N, s_xm, s_om,
                        K: gl.constexpr, M: gl.constexpr, NBUF: gl.constexpr, PRE: gl.constexpr,
                        PDL: gl.constexpr, EARLY_TRIGGER: gl.constexpr):
    ROWS: gl.constexpr = w_desc.block_type.shape[0]
    BKC: gl.constexpr = w_desc.block_type.shape[1]
    NK: gl.constexpr = K // BKC
    num_warps: gl.constexpr = gl.num_warps()
    wl: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
    pid = gl.program_id(0)
    P = gl.num_programs(0)
    nrb = (N + ROWS - 1) // ROWS
    rb0 = pid * nrb // P
    rb1 = (pid + 1) * nrb // P
    T = (rb1 - rb0) * NK  # boxes this program streams

    w_smem = gl.allocate_shared_memory(w_desc.dtype, [NBUF, ROWS, BKC], w_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NBUF):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()
    for i in gl.static_range(PRE):  # weights are never written: stream them before the wait
        _issue(w_desc, w_smem, bars, i, T, rb0, NK, NBUF, ROWS, BKC)
    if PDL:
        if EARLY_TRIGGER:
            _gdc_launch_dependents()
        _gdc_wait()
        if not EARLY_TRIGGER:
            _gdc_launch_dependents()
    for i in gl.static_range(PRE, NBUF):
        _issue(w_desc, w_smem, bars, i, T, rb0, NK, NBUF, ROWS, BKC)

    # x (M rows of K) into shared memory, one (NKP, BKC) slab per row
    xl: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
    x_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    NKP: gl.constexpr = triton.next_power_of_2(NK)  # arange wants a power of two: rows past NK stay unused
    x_smem = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [M * NKP, BKC], x_sl)
    xr = gl.arange(0, NKP, layout=gl.SliceLayout(1, xl))
    xc = gl.arange(0, BKC, layout=gl.SliceLayout(0, xl))
    for m in gl.static_range(M):
        x_smem.slice(m * NKP, NKP).store(
            gl.load(x_ptr + m * s_xm + xr[:, None] * BKC + xc[None, :], mask=(xr < NK)[:, None], other=0.0))
    gl.thread_barrier()
    x_rows = x_smem._reinterpret(x_ptr.dtype.element_ty, [M * NKP, 1, BKC], x_sl)  # (1, BKC) views

    rn = gl.arange(0, ROWS, layout=gl.SliceLayout(1, wl))
    acc0 = gl.zeros([ROWS, BKC], gl.float32, wl)
    acc1 = gl.zeros([ROWS, BKC], gl.float32, wl)
    for t in range(T):
        s = t % NBUF
        kt = t % NK
        mbarrier.wait(bars.index(s), (t // NBUF) & 1)
        w = w_smem.index(s).load(wl).to(gl.float32)
        acc0 += w * x_rows.index(kt).load(wl).to(gl.float32)
        if M > 1:
            acc1 += w * x_rows.index(NKP + kt).load(wl).to(gl.float32)
        gl.thread_barrier()  # every warp has read slot s: refill it
        fence_async_shared()
        _issue(w_desc, w_smem, bars, t + NBUF, T, rb0, NK, NBUF, ROWS, BKC)
        if kt == NK - 1:  # the end of a row block: its sums out, the accumulators cleared
            rows = (rb0 + t // NK) * ROWS + rn
            ok = rows < N
            gl.store(out_ptr + rows, gl.sum(acc0, axis=1).to(out_ptr.dtype.element_ty), mask=ok)
            acc0 = gl.zeros([ROWS, BKC], gl.float32, wl)
            if M > 1:
                gl.store(out_ptr + s_om + rows, gl.sum(acc1, axis=1).to(out_ptr.dtype.element_ty), mask=ok)
                acc1 = gl.zeros([ROWS, BKC], gl.float32, wl)
    for i in gl.static_range(NBUF):
        mbarrier.invalidate(bars.index(i))


def weight_descriptor(w: torch.Tensor, rows: int) -> TensorDescriptor:
    """The TMA descriptor of an `(N, K)` bf16 weight in unswizzled `(rows, 256)` boxes."""
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
    return TensorDescriptor(w, list(w.shape), list(w.stride()), [rows, BK], layout)


def smem_bytes(m: int, k: int, rows: int, nbuf: int) -> int:
    return nbuf * rows * BK * 2 + m * triton.next_power_of_2(k // BK) * BK * 2 + nbuf * 8


def ring_depth(m: int, k: int, rows: int, budget: int = 200 * 1024) -> int:
    """The deepest ring that fits `budget` bytes of shared memory beside the staged x."""
    return max(2, (budget - smem_bytes(m, k, rows, 0)) // (rows * BK * 2 + 8))


def stream_linear(x: torch.Tensor, desc: TensorDescriptor, out: torch.Tensor, *, nbuf: int, pre: int,
                  programs: int, pdl: bool = True, early_trigger: bool = False, num_warps: int = 4) -> torch.Tensor:
    """`out = x @ w.T` for `x (M <= 2, K)`, `w` behind `desc` (`weight_descriptor`), `programs` programs."""
    m, k = x.shape
    n = desc.shape[0]
    assert m <= 2 and k % BK == 0 and 0 < pre <= nbuf, (m, k, pre, nbuf)
    kw = {"launch_pdl": True} if pdl else {}
    _stream_gemv_kernel[(programs,)](
        desc, x, out, n, x.stride(0), out.stride(0), K=k, M=m, NBUF=nbuf, PRE=pre, PDL=pdl,
        EARLY_TRIGGER=early_trigger, num_warps=num_warps, **kw)
    return out
