"""Skinny GEMM / split-K GEMV for linear layers at small batch: `y = x @ w.T (+ bias)`, `M <= 16`.

At decode the projections read the whole weight for a handful of rows, so the op is bound by
memory: one pass over `w` at full bandwidth is the goal. Each program streams a `(BLOCK_N, K /
SPLIT_K)` slab of `w` in `(BLOCK_N, BLOCK_K)` tiles (16-byte loads along K, software-pipelined)
and multiplies it with the `M` rows of `x` (padded to 16 for `tl.dot`), accumulating in float32.
With `SPLIT_K > 1` the programs write float32 partials that a second pass sums in a fixed order
(deterministic, no atomics) and casts. Block sizes and `SPLIT_K` are tuned per
`(M bucket, N, K, dtype)` on first use by timing the whole op (both passes) on the device;
`SPEC_GEMV_TUNE=0`, a CUDA-graph capture, or the interpreter use a heuristic config instead.

Two prologues fold the elementwise step before a projection into the product's input loads, so a
decoder layer launches three kernels fewer (each launch boundary costs microseconds at bs=1):
`norm_linear` (residual add + RMSNorm before QKV and gate/up) and `silu_linear` (SiLU-and-multiply
before down).
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

__all__ = [
    "GemvConfig",
    "MAX_M",
    "linear",
    "norm_linear",
    "reference_linear",
    "reference_norm_linear",
    "reference_silu_linear",
    "silu_linear",
    "triton_linear",
]

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

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            value = getattr(self, name)
            require(value >= 16 and value & (value - 1) == 0, f"GemvConfig.{name} must be a power of two >= 16, got {value}")
        require(self.split_k >= 1, f"GemvConfig.split_k must be >= 1, got {self.split_k}")


@triton.jit
def _x_tile(
    x_ptr, d_ptr, nw_ptr, sum_ptr, rm, ks, m_ok, k_ok, K, s_xm, s_dm, s_sm, write_sum,
    PROLOGUE: tl.constexpr, HAS_DELTA: tl.constexpr,
):
    """One `(BLOCK_M, BLOCK_K)` tile of the GEMV's input after its prologue, and the tile the
    sum of squares is taken over (the summed rows for PROLOGUE 1, else the input itself)."""
    mask = m_ok[:, None] & k_ok[None, :]
    rows = rm[:, None].to(tl.int64)
    x = tl.load(x_ptr + rows * s_xm + ks[None, :], mask=mask, other=0.0)
    if PROLOGUE == 1:  # (residual add +) RMSNorm weight; the 1 / rms scale is applied to the result
        if HAS_DELTA:
            d = tl.load(d_ptr + rows * s_dm + ks[None, :], mask=mask, other=0.0)
            x = (x.to(tl.float32) + d.to(tl.float32)).to(x.dtype)  # rounded like torch's add
            tl.store(sum_ptr + rows * s_sm + ks[None, :], x, mask=mask & write_sum)
        nw = tl.load(nw_ptr + ks, mask=k_ok, other=0.0)
        return (nw.to(tl.float32)[None, :] * x.to(tl.float32)).to(x.dtype), x
    if PROLOGUE == 2:  # silu(gate) * up, gate = x[:, :K], up = x[:, K:2K]
        u = tl.load(x_ptr + rows * s_xm + K + ks[None, :], mask=mask, other=0.0)
        g = x.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(x.dtype)  # F.silu rounds to the dtype
        y = (act.to(tl.float32) * u.to(tl.float32)).to(x.dtype)
        return y, y
    return x, x


@triton.jit
def _gemv_kernel(
    x_ptr,  # (M, K) activations ((M, 2K) gate/up for PROLOGUE 2)
    w_ptr,  # (N, K) weight, K contiguous
    bias_ptr,  # (N,) bias (ignored unless HAS_BIAS)
    out_ptr,  # (M, N) result in x's dtype (output, SPLIT_K == 1)
    part_ptr,  # (SPLIT_K, M, N) float32 partial sums (output, SPLIT_K > 1)
    d_ptr,  # (M, K) residual delta (PROLOGUE 1 with HAS_DELTA)
    nw_ptr,  # (K,) RMSNorm weight (PROLOGUE 1)
    sum_ptr,  # (M, K) x + delta (output, PROLOGUE 1 with HAS_DELTA; written by the first column of programs)
    ssq_ptr,  # (SPLIT_K, M) float32 partial sums of squares (output, PROLOGUE 1 with SPLIT_K > 1)
    M, N, K, s_xm, s_wn, s_om, s_dm, s_sm, eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_F32: tl.constexpr,
    PROLOGUE: tl.constexpr = 0, HAS_DELTA: tl.constexpr = False, PDL: tl.constexpr = False,
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
    w_rows = w_ptr + rn[:, None].to(tl.int64) * s_wn
    write_sum = pid_n == 0
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    ssq = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)  # elementwise; reduced once after the loop
    first = k0
    if PDL:
        # Programmatic dependent launch: fetch the first weight tile (weights are never written)
        # while the previous kernel finishes, wait for it (x is its output), then let the next
        # kernel's programs start. Triggering only after the wait keeps at most one kernel waiting
        # ahead; triggering first would let the whole chain launch and hold multiprocessors idle.
        ks = k0 + rk
        k_ok = ks < k1
        if EVEN_K:
            w = tl.load(w_rows + ks[None, :], mask=n_ok[:, None], other=0.0)
        else:
            w = tl.load(w_rows + ks[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        gdc_wait()
        gdc_launch_dependents()
        x, s = _x_tile(x_ptr, d_ptr, nw_ptr, sum_ptr, rm, ks, m_ok, k_ok, K, s_xm, s_dm, s_sm, write_sum,
                       PROLOGUE, HAS_DELTA)
        if PROLOGUE == 1:
            ssq += s.to(tl.float32) * s.to(tl.float32)
        if DOT_F32:
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x.to(w.dtype), tl.trans(w))
        first = k0 + BLOCK_K
    for kk in range(first, k1, BLOCK_K):
        ks = kk + rk
        k_ok = ks < k1
        if EVEN_K:
            w = tl.load(w_rows + ks[None, :], mask=n_ok[:, None], other=0.0)
        else:
            w = tl.load(w_rows + ks[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x, s = _x_tile(x_ptr, d_ptr, nw_ptr, sum_ptr, rm, ks, m_ok, k_ok, K, s_xm, s_dm, s_sm, write_sum,
                       PROLOGUE, HAS_DELTA)
        if PROLOGUE == 1:
            ssq += s.to(tl.float32) * s.to(tl.float32)
        if DOT_F32:
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x.to(w.dtype), tl.trans(w))
    ok = m_ok[:, None] & n_ok[None, :]
    row_ssq = tl.sum(ssq, axis=1)
    if SPLIT_K == 1:
        if PROLOGUE == 1:
            acc = acc * tl.rsqrt(row_ssq / K + eps)[:, None]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rm[:, None].to(tl.int64) * s_om + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        part = part_ptr + (pid_k * M + rm[:, None]).to(tl.int64) * N + rn[None, :]
        tl.store(part, acc, mask=ok)
        if PROLOGUE == 1:
            tl.store(ssq_ptr + pid_k * M + rm, row_ssq, mask=m_ok & write_sum)


@triton.jit
def _split_k_reduce_kernel(
    part_ptr,  # (SPLIT_K, M, N) float32 partial sums
    bias_ptr,  # (N,) bias (ignored unless HAS_BIAS)
    out_ptr,  # (M, N) result in x's dtype (output)
    ssq_ptr,  # (SPLIT_K, M) float32 partial sums of squares (NORM)
    M, N, K, s_om, eps,
    SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr = False,
    PDL: tl.constexpr = False,
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
    if NORM:
        ssq = 0.0
        for s in tl.static_range(SPLIT_K):
            ssq += tl.load(ssq_ptr + s * M + m)
        acc = acc * tl.rsqrt(ssq / K + eps)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + m.to(tl.int64) * s_om + rn, acc.to(out_ptr.dtype.element_ty), mask=ok)


@dataclass(frozen=True)
class _Prologue:
    """What the GEMV computes from its input before the product (None: the input as is).

    `kind` "norm": `rmsnorm(x + delta) * weight` (delta optional; `total` receives x + delta);
    "silu": `silu(gate) * up` of a `(M, 2K)` gate/up input."""

    kind: str
    delta: torch.Tensor | None = None
    weight: torch.Tensor | None = None
    total: torch.Tensor | None = None
    eps: float = 0.0


def _launch(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, cfg: GemvConfig,
            pro: _Prologue | None = None) -> None:
    m = x.shape[0]
    n, k = w.shape
    split = max(1, min(cfg.split_k, cdiv(k, cfg.block_k)))
    part = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    b = bias if bias is not None else out
    dot_f32 = interpreting() or x.dtype == torch.float32 or w.dtype == torch.float32
    pdl = pdl_options(x.device)
    kind = 0 if pro is None else (1 if pro.kind == "norm" else 2)
    norm = kind == 1
    delta = pro.delta if norm and pro.delta is not None else x
    total = pro.total if norm and pro.delta is not None else x
    nw = pro.weight if norm else x
    ssq = torch.empty((split, m), dtype=torch.float32, device=x.device) if norm and split > 1 else part
    eps = float(pro.eps) if norm else 0.0
    _gemv_kernel[(cdiv(n, cfg.block_n), split)](
        x, w, b, out, part, delta, nw, total, ssq, m, n, k, x.stride(0), w.stride(0), out.stride(0),
        delta.stride(0), total.stride(0), eps,
        BLOCK_M=max(16, next_pow2(m)), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=split,
        EVEN_K=k % (cfg.block_k * split) == 0, HAS_BIAS=bias is not None, DOT_F32=dot_f32,
        PROLOGUE=kind, HAS_DELTA=delta is not x, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl,
    )
    if split > 1:
        block = min(1024, next_pow2(n))
        _split_k_reduce_kernel[(cdiv(n, block), m)](
            part, b, out, ssq, m, n, k, out.stride(0), eps, SPLIT_K=split, BLOCK=block, HAS_BIAS=bias is not None,
            NORM=norm, num_warps=4, **pdl,
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


def _candidates(n: int, k: int, device: torch.device) -> list[GemvConfig]:
    """About 20 configs: tile shapes that stream `w` in 16-byte rows, times K splits around the count
    that fills the device (none, half, full, double)."""
    out = []
    for block_n, block_k, stages in ((32, 256, 4), (64, 128, 4), (64, 256, 3), (128, 128, 3), (16, 512, 3)):
        fill = cdiv(2 * sm_count(device), cdiv(n, block_n))
        for split in sorted({1, max(1, fill // 2), fill, 2 * fill}):
            split = next_pow2(split)
            if split == 1 or k // split >= block_k:
                out.append(GemvConfig(block_n, block_k, split, 4, stages))
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


def _known_config(m: int, w: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> GemvConfig:
    """The config tuned (or registered at setup) for this plain shape, else the heuristic one: the
    prologue variants stream the same weight, so they launch like the plain product."""
    n, k = w.shape
    key = (next_pow2(m), n, k, dtype, w.dtype, bias is not None, w.device)
    return _TUNED.get(key) or heuristic_config(m, n, k, w.device)


def _check_product(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, k: int) -> None:
    require(x.dim() == 2, f"x must be (M, K), got shape {tuple(x.shape)}")
    require(w.dim() == 2, f"w must be (N, K), got shape {tuple(w.shape)}")
    require(w.shape[1] == k, f"w has shape {tuple(w.shape)}, expected (N, {k}) to match x {tuple(x.shape)}")
    require(x.shape[0] <= MAX_M, f"the Triton GEMV handles M <= {MAX_M} rows, got M={x.shape[0]}; use linear() for any M")
    require(x.dtype in FLOAT_DTYPES and w.dtype in FLOAT_DTYPES, f"x, w dtypes {x.dtype}, {w.dtype} not in {FLOAT_DTYPES}")
    require(x.device == w.device, f"x is on {x.device}, w on {w.device}")
    require(w.stride(1) == 1, "w must be contiguous along K (a row-major (N, K) weight)")
    if bias is not None:
        require(tuple(bias.shape) == (w.shape[0],), f"bias has shape {tuple(bias.shape)}, expected ({w.shape[0]},)")
        require(bias.device == x.device, f"bias is on {bias.device}, x on {x.device}")


def reference_norm_linear(x: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                          w: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`(linear(rmsnorm(x + delta)), x + delta)` with `models.llama.RMSNorm`'s rounding steps."""
    total = x if delta is None else x + delta
    xf = total.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(total.dtype)
    return F.linear(norm_weight * normed, w, bias), total


def reference_silu_linear(gate_up: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`linear(silu(gate) * up)` of a `(M, 2K)` gate/up input."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w, bias)


def norm_linear(
    x: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, w: torch.Tensor,
    bias: torch.Tensor | None = None, *, config: GemvConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(rmsnorm(x + delta) @ w.T (+ bias), x + delta)` in one launch (`M <= 16`): the residual add
    and the RMSNorm weight are applied to each input tile as it is loaded, the sum of squares is
    accumulated along, and the result rows are scaled by `1 / rms` at the end (the RMSNorm of
    `reference_norm_linear` with the scale applied after the product instead of before it: the same
    function, rounded once less in low precision). `delta` None: no add, the second output is `x`.
    The programs of the first output column write `x + delta`."""
    m, k = x.shape if x.dim() == 2 else (0, -1)
    _check_product(x, w, bias, k)
    require(x.dtype == w.dtype, f"norm_linear: x is {x.dtype}, w is {w.dtype}; they must match")
    require(tuple(norm_weight.shape) == (k,) and norm_weight.dtype == x.dtype,
            f"norm_linear: norm weight must be ({k},) {x.dtype}, got {tuple(norm_weight.shape)} {norm_weight.dtype}")
    x = x if x.stride(1) == 1 else x.contiguous()
    total = x
    if delta is not None:
        require(delta.shape == x.shape and delta.dtype == x.dtype,
                f"norm_linear: delta must be {tuple(x.shape)} {x.dtype}, got {tuple(delta.shape)} {delta.dtype}")
        delta = delta if delta.stride(1) == 1 else delta.contiguous()
        total = torch.empty_like(x)
    out = torch.empty((m, w.shape[0]), dtype=x.dtype, device=x.device)
    if m == 0:
        return out, total
    pro = _Prologue("norm", delta, norm_weight.contiguous(), total, eps)
    _launch(x, w, bias, out, config or _known_config(m, w, bias, x.dtype), pro)
    return out, total


def silu_linear(gate_up: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
                config: GemvConfig | None = None) -> torch.Tensor:
    """`(silu(gate) * up) @ w.T (+ bias)` of a fused `(M, 2K)` gate/up input in one launch (`M <= 16`);
    the activation is computed on each input tile as it is loaded, rounded as `reference_silu_linear`."""
    require(gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0, f"gate_up must be (M, 2K), got {tuple(gate_up.shape)}")
    m, k = gate_up.shape[0], gate_up.shape[1] // 2
    _check_product(gate_up, w, bias, k)
    gate_up = gate_up if gate_up.stride(1) == 1 else gate_up.contiguous()
    out = torch.empty((m, w.shape[0]), dtype=gate_up.dtype, device=gate_up.device)
    if m == 0:
        return out
    _launch(gate_up, w, bias, out, config or _known_config(m, w, bias, gate_up.dtype), _Prologue("silu"))
    return out


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
