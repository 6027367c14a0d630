"""Skinny GEMM / split-K GEMV for linear layers at small batch: `y = x @ w.T (+ bias)`, `M <= 16`.

At decode the projections read the whole weight for a handful of rows, so the op is bound by
memory: one pass over `w` at full bandwidth is the goal. Each program streams a `(BLOCK_N, K /
SPLIT_K)` slab of `w` in `(BLOCK_N, BLOCK_K)` tiles (16-byte loads along K, software-pipelined)
and multiplies it with the `M` rows of `x` (padded to 16 for `tl.dot`), accumulating in float32.
With `SPLIT_K > 1` the programs write float32 partials that a second pass sums in a fixed order
(deterministic, no atomics) and casts. Block sizes and `SPLIT_K` are tuned per
`(M bucket, N, K, dtype)` on first use by timing the whole op (both passes) on the device;
`SPEC_GEMV_TUNE=0`, a CUDA-graph capture, or the interpreter use a heuristic config instead.
"""

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from spec_runtime.kernels._common import (
    FLOAT_DTYPES,
    cdiv,
    interpreting,
    next_pow2,
    pdl_options,
    require,
    sm_count,
)

__all__ = ["GemvConfig", "MAX_M", "linear", "reference_linear", "triton_linear"]

MAX_M = 16
"""Rows handled by the Triton kernel; `linear` sends larger inputs to `torch.nn.functional.linear`."""


def reference_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: `torch.nn.functional.linear`."""
    return F.linear(x, w, bias)


@dataclass(frozen=True)
class GemvConfig:
    """One launch configuration of the split-K GEMV."""

    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 3
    swap: bool = False
    """Multiply `w_tile @ x.T` (the weight tile as the dot's left operand: warp-group MMA on Hopper,
    fed from shared memory) instead of `x @ w_tile.T`."""

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            value = getattr(self, name)
            require(value >= 16 and value & (value - 1) == 0, f"GemvConfig.{name} must be a power of two >= 16, got {value}")
        require(self.split_k >= 1, f"GemvConfig.split_k must be >= 1, got {self.split_k}")


@triton.jit
def _tile_product(acc, x, w, DOT_F32: tl.constexpr, SWAP: tl.constexpr):
    """`acc + x @ w.T` (`(BLOCK_M, BLOCK_N)`), or with SWAP its transpose `acc + w @ x.T`."""
    if DOT_F32:
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
def _gemv_kernel(
    x_ptr,  # (M, K) activations
    w_ptr,  # (N, K) weight, K contiguous
    bias_ptr,  # (N,) bias (ignored unless HAS_BIAS)
    out_ptr,  # (M, N) result in x's dtype (output, SPLIT_K == 1)
    part_ptr,  # (SPLIT_K, M, N) float32 partial sums (output, SPLIT_K > 1)
    M, N, K, s_xm, s_wn, s_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_F32: tl.constexpr, SWAP: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    k_len = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k0 = pid_k * k_len
    k1 = tl.minimum(k0 + k_len, K)
    x_rows = x_ptr + rm[:, None].to(tl.int64) * s_xm
    w_rows = w_ptr + rn[:, None].to(tl.int64) * s_wn
    if SWAP:  # acc.T: the weight tile is the dot's left operand
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    first = k0
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
        x = tl.load(x_rows + ks[None, :], mask=m_ok[:, None] & (ks < k1)[None, :], other=0.0)
        acc = _tile_product(acc, x, w, DOT_F32, SWAP)
        first = k0 + BLOCK_K
    for kk in range(first, k1, BLOCK_K):
        ks = kk + rk
        if EVEN_K:
            x = tl.load(x_rows + ks[None, :], mask=m_ok[:, None], other=0.0)
            w = tl.load(w_rows + ks[None, :], mask=n_ok[:, None], other=0.0)
        else:
            k_ok = ks < k1
            x = tl.load(x_rows + ks[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_rows + ks[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc = _tile_product(acc, x, w, DOT_F32, SWAP)
    if SWAP:
        acc = tl.trans(acc)
    ok = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
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
    SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr = False,
):
    m = tl.program_id(1)
    rn = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rn < N
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT_K):  # fixed order: deterministic
        acc += tl.load(part_ptr + (s * M + m).to(tl.int64) * N + rn, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + m.to(tl.int64) * s_om + rn, acc.to(out_ptr.dtype.element_ty), mask=ok)


def _launch(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, cfg: GemvConfig) -> None:
    m, k = x.shape
    n = w.shape[0]
    split = max(1, min(cfg.split_k, cdiv(k, cfg.block_k)))
    part = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    b = bias if bias is not None else out
    dot_f32 = interpreting() or x.dtype == torch.float32 or w.dtype == torch.float32
    pdl = pdl_options(x.device)
    _gemv_kernel[(cdiv(n, cfg.block_n), split)](
        x, w, b, out, part, m, n, k, x.stride(0), w.stride(0), out.stride(0),
        BLOCK_M=max(16, next_pow2(m)), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=split,
        EVEN_K=k % (cfg.block_k * split) == 0, HAS_BIAS=bias is not None, DOT_F32=dot_f32, SWAP=cfg.swap,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl,
    )
    if split > 1:
        block = min(1024, next_pow2(n))
        _split_k_reduce_kernel[(cdiv(n, block), m)](
            part, b, out, m, n, out.stride(0), SPLIT_K=split, BLOCK=block, HAS_BIAS=bias is not None, num_warps=4,
            **pdl,
        )


def heuristic_config(m: int, n: int, k: int, device: torch.device) -> GemvConfig:
    """The configs the tuner picked on an H200 for K = 4096 (no K split from N = 4096 up: one
    program per `BLOCK_N` rows of `w` already fills the device); K splits only when the row tiles
    cannot cover half of the multiprocessors."""
    if interpreting():
        return GemvConfig(block_n=16, block_k=32, split_k=2 if k >= 64 else 1, num_warps=4, num_stages=1)
    block_n = 32 if n <= 8192 else 64
    block_k = 128 if n > 65536 else 256
    tiles, sms = cdiv(n, block_n), sm_count(device)
    split = 1 if 2 * tiles >= sms else min(next_pow2(cdiv(sms, tiles)), max(1, k // (4 * block_k)))
    return GemvConfig(block_n, block_k, split, num_warps=4, num_stages=4 if block_n == 32 or block_k == 128 else 3)


_TILES = ((32, 256, 4, False), (64, 128, 4, False), (64, 256, 3, False), (128, 128, 3, False), (16, 512, 3, False),
          (64, 256, 4, True), (64, 128, 5, True), (128, 128, 3, True))
"""(block_n, block_k, num_stages, swap) the tuner tries. The swapped tiles won 2-6 % on the 8B
shapes in CUDA-graph chains on the H200 (`bench/results/explore/tma_sweep.json`)."""


def _candidates(n: int, k: int, device: torch.device) -> list[GemvConfig]:
    """About 35 configs: tile shapes that stream `w` in 16-byte rows, times K splits around the count
    that fills the device (none, half, full, double)."""
    out = []
    for block_n, block_k, stages, swap in _TILES:
        fill = cdiv(2 * sm_count(device), cdiv(n, block_n))
        for split in sorted({1, max(1, fill // 2), fill, 2 * fill}):
            split = next_pow2(split)
            if split == 1 or k // split >= block_k:
                out.append(GemvConfig(block_n, block_k, split, 4, stages, swap))
    return list(dict.fromkeys(out))


_TUNED: dict[tuple, GemvConfig] = {}


def _tuned_config(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> GemvConfig:
    m, k = x.shape
    n = w.shape[0]
    key = (next_pow2(m), n, k, x.dtype, w.dtype, bias is not None, x.device)
    if key in _TUNED:
        return _TUNED[key]
    tune = os.environ.get("SPEC_GEMV_TUNE", "1") != "0"
    if interpreting() or not tune or x.device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return heuristic_config(m, n, k, x.device)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    best, best_ms = None, float("inf")
    for cfg in _candidates(n, k, x.device):
        try:
            ms = triton.testing.do_bench(lambda cfg=cfg: _launch(x, w, bias, out, cfg), warmup=5, rep=20)
        except Exception:  # a config the compiler rejects (resources): skip it  # noqa: BLE001
            continue
        if ms < best_ms:
            best, best_ms = cfg, ms
    _TUNED[key] = best or heuristic_config(m, n, k, x.device)
    return _TUNED[key]


def triton_linear(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *, config: GemvConfig | None = None
) -> torch.Tensor:
    """`x (M, K) @ w (N, K).T (+ bias (N,))` -> `(M, N)` in x's dtype, float32 accumulation, `M <= 16`.

    `config` fixes the launch configuration (default: tuned on first use per shape).
    """
    require(x.dim() == 2, f"x must be (M, K), got shape {tuple(x.shape)}")
    require(w.dim() == 2, f"w must be (N, K), got shape {tuple(w.shape)}")
    m, k = x.shape
    n = w.shape[0]
    require(w.shape[1] == k, f"w has shape {tuple(w.shape)}, expected (N, {k}) to match x {tuple(x.shape)}")
    require(m <= MAX_M, f"triton_linear handles M <= {MAX_M} rows, got M={m}; use linear() for any M")
    require(x.dtype in FLOAT_DTYPES and w.dtype in FLOAT_DTYPES, f"x, w dtypes {x.dtype}, {w.dtype} not in {FLOAT_DTYPES}")
    require(x.device == w.device, f"x is on {x.device}, w on {w.device}")
    require(w.stride(1) == 1, "w must be contiguous along K (a row-major (N, K) weight)")
    if bias is not None:
        require(tuple(bias.shape) == (n,), f"bias has shape {tuple(bias.shape)}, expected ({n},)")
        require(bias.device == x.device, f"bias is on {bias.device}, x on {x.device}")
        bias = bias.contiguous()
    x = x if x.stride(1) == 1 else x.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(m, n))
    _launch(x, w, bias, out, config or _tuned_config(x, w, bias))
    return out


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Drop-in for `F.linear` on `(..., K)` inputs: the Triton GEMV for at most `MAX_M` rows on a
    CUDA device (or under the interpreter), `torch.nn.functional.linear` otherwise."""
    rows = x.numel() // max(x.shape[-1], 1)
    if rows > MAX_M or not (x.is_cuda or interpreting()):
        return F.linear(x, w, bias)
    y = triton_linear(x.reshape(rows, x.shape[-1]), w, bias)
    return y.reshape(*x.shape[:-1], w.shape[0])
