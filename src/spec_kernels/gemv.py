"""Skinny GEMM / split-K GEMV for linear layers at small batch: `y = x @ w.T (+ bias)`, `M <= 32`.

At decode the projections read the whole weight for a handful of rows, so the op is bound by
memory: one pass over `w` at full bandwidth is the goal. Each program streams a `(BLOCK_N, K /
SPLIT_K)` slab of `w` in `(BLOCK_N, BLOCK_K)` tiles (16-byte loads along K, software-pipelined)
and multiplies it with the `M` rows of `x` (padded to 16 rows for `tl.dot`, to 32 for 17-32 rows:
one `tl.dot` tile of all rows, so each weight tile is read once whatever the row count),
accumulating in float32.
For at most `MULRED_MAX_M` rows a configuration may instead multiply and reduce (`mulred`: no
padding, no `tl.dot`, row tiles down to 2 weight rows), which streams the small projections faster
at 1-2 rows; at one row its accumulator is 2-D, in the weight tile's own layout (no shared-memory
conversion per tile), and its 4 x 2048 tile streams the 8B projections close to the read ceiling.
With `SPLIT_K > 1` the programs write float32 partials that a second pass sums in a fixed order
(deterministic, no atomics) and casts. Block sizes and `SPLIT_K` are tuned per
`(M bucket, N, K, dtype)` on first use by timing the whole op (both passes) on the device, unless
the caller says `tune=False` (the fast path's setup decides them: `FastOptions.gemv_tune`); then,
in a CUDA-graph capture, or under the interpreter, a heuristic config is used.

Epilogues fold the decode step after a projection into it (`EPI_*`): `triton_linear_silu_mul`
(gate/up then SiLU-and-multiply), `triton_linear_rope_store` (QKV then RoPE and the KV store), and
`triton_linear_parts`, which leaves the split-K partials for `spec_kernels.elementwise.add_rmsnorm` to sum.
Each gives bit for bit what the GEMV followed by the separate kernel gives, at every row count.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton

from spec_kernels._common import (
    FLOAT_DTYPES,
    cdiv,
    interpreting,
    next_pow2,
    pdl_options,
    require,
    sm_count,
)
from spec_kernels._gemv_kernels import (
    EPI_ROPE,
    EPI_SILU,
    _gemv_kernel,
    _split_k_reduce_kernel,
)

__all__ = [
    "GemvConfig",
    "MAX_M",
    "RopeStore",
    "SplitKParts",
    "linear",
    "reference_linear",
    "reference_linear_rope_store",
    "reference_rope_store",
    "reference_linear_silu_mul",
    "triton_linear",
    "triton_linear_parts",
    "triton_linear_rope_store",
    "triton_linear_silu_mul",
]

MAX_M = 32
"""Rows handled by the Triton kernel; `linear` sends larger inputs to `torch.nn.functional.linear`.
32: a batch of 4 verifying trees of 8 tokens (or drafting 8 branches each) is 32 rows."""
MULRED_MAX_M = 4
"""Rows a `GemvConfig(mulred=True)` launch handles."""


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
    mulred: bool = False
    """Multiply and reduce instead of `tl.dot`: `x` is not padded to 16 or 32 rows, each program keeps a
    float32 `(M, BLOCK_N, BLOCK_K)` accumulator and sums it over K at the end. For at most
    `MULRED_MAX_M` rows; `block_n` may then be as small as 2."""

    def __post_init__(self) -> None:
        low = {"block_n": 2 if self.mulred else 16, "block_k": 16}
        for name, least in low.items():
            value = getattr(self, name)
            require(value >= least and value & (value - 1) == 0,
                    f"GemvConfig.{name} must be a power of two >= {least}, got {value}")
        require(self.split_k >= 1, f"GemvConfig.split_k must be >= 1, got {self.split_k}")
        require(not (self.mulred and self.swap), "GemvConfig: mulred and swap exclude each other")

    def splits(self, k: int) -> int:
        """The K splits a launch over `k` uses (`split_k`, at most one per `block_k` slab)."""
        return max(1, min(self.split_k, cdiv(k, self.block_k)))


@dataclass(frozen=True)
class RopeStore:
    """What the QKV GEMV's RoPE epilogue needs (`triton_linear_rope_store`): float32 cos/sin tables
    `(P, D)` indexed by `positions` `(M,)`, and this layer's K and V cache `(num_slots, Hkv, D)`
    into which row `i`'s k and v go at `slots[i]`."""

    cos: torch.Tensor
    sin: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class SplitKParts:
    """A split-K GEMV's float32 partial sums `(S, M, N)`, left for the consumer to add (in split
    order) and round to `dtype`: `spec_kernels.elementwise.add_rmsnorm` does it in its own pass, which saves
    the reduce kernel."""

    parts: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.parts.shape[1:]

    def sum(self) -> torch.Tensor:
        """The `(M, N)` result the reduce kernel would have written."""
        acc = self.parts[0].clone()
        for s in range(1, self.parts.shape[0]):
            acc += self.parts[s]
        return acc.to(self.dtype)


def block_rows(m: int, cfg: GemvConfig) -> int:
    """Rows of `x` each program multiplies (`_gemv_kernel`'s BLOCK_M): `m` rounded up to a power of
    two, at least 16 for `tl.dot` (its smallest tile), so 32 for 17-32 rows. One tile of all rows
    rather than two 16-row passes (which would hold the same two accumulator halves): built for
    sm90 (ptxas), a 32-row tile of the same `(BLOCK_N, BLOCK_K)` takes about the 16-row one's
    registers (32x256, 4 stages: 184 -> 190; 64x128: 203 -> 168) and, without an epilogue, spills
    nothing (8 bytes on the swapped 128x128), and each weight tile feeds one dot: on a swapped tile
    one warp-group MMA over all 32 rows (m64n32)."""
    return next_pow2(m) if cfg.mulred else max(16, next_pow2(m))


def _launch(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, cfg: GemvConfig,
            epi: int = 0, rope: RopeStore | None = None, reduce: bool = True) -> torch.Tensor | None:
    """Launch the GEMV (and the split-K reduce). `epi`: `EPI_*` (bias must be None with one);
    `reduce=False`: return the float32 partials instead of reducing them (None without a K split)."""
    m, k = x.shape
    n = w.shape[0]
    require(not cfg.mulred or m <= MULRED_MAX_M, f"a mulred GemvConfig handles at most {MULRED_MAX_M} rows, got {m}")
    split = cfg.splits(k)
    part = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    b = bias if bias is not None else out
    dot_f32 = interpreting() or x.dtype == torch.float32 or w.dtype == torch.float32
    pdl = pdl_options(x.device)
    if rope is not None:
        r = rope
        rope_args = (r.positions, r.slots, r.cos, r.sin, r.k_cache, r.v_cache, r.num_heads, r.num_kv_heads,
                     r.cos.stride(0), r.k_cache.stride(0), r.k_cache.stride(1), r.head_dim)  # out: (M, Hq * D)
        hd2 = r.head_dim // 2
    else:
        rope_args, hd2 = (out, out, out, out, out, out, 0, 0, 0, 0, 0, 0), 1
    _gemv_kernel[(cdiv(n, cfg.block_n), split)](
        x, w, b, out, part, m, n, k, x.stride(0), w.stride(0), out.stride(0), *rope_args,
        BLOCK_M=block_rows(m, cfg), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=split,
        EVEN_K=k % (cfg.block_k * split) == 0, HAS_BIAS=bias is not None, DOT_F32=dot_f32, SWAP=cfg.swap,
        EPI=epi, HD2=hd2, MULRED=cfg.mulred, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **pdl,
    )
    if split == 1:
        return None
    if not reduce:
        return part
    block = min(1024, max(16, next_pow2(n)))
    _split_k_reduce_kernel[(cdiv(n, block), m)](
        part, b, out, m, n, out.stride(0), *rope_args, SPLIT_K=split, BLOCK=block, HAS_BIAS=bias is not None,
        EPI=epi, HD2=hd2, num_warps=4, **pdl,
    )
    return None


def heuristic_config(m: int, n: int, k: int, device: torch.device) -> GemvConfig:
    """The configs the tuner picked on an H200 for K = 4096 (no K split from N = 4096 up: one
    program per `BLOCK_N` rows of `w` already fills the device); K splits only when the row tiles
    cannot cover half of the multiprocessors. The same at 17-32 rows: built for sm90, the 32-row
    32x256 tile takes 190 registers (252 with the RoPE epilogue), no spills, and in float32 192 KB
    of shared memory (of 227) and 255 registers, 4 bytes spilled."""
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
shapes in CUDA-graph chains on the H200 (`explore-archive:bench/results/explore/tma_sweep.json`)."""
_TILES_32 = ((32, 128, 4, False), (32, 128, 4, True))
"""Tiles tried for 17-32 rows besides `_TILES`: a 32-row `x` tile at `BLOCK_K` 128 holds as many
elements as a 16-row one at 256, the depth most 16-row winners use. Built for sm90 they take
116-166 registers (160-241 swapped) with and without an epilogue, no spills; with the RoPE
epilogue the `_TILES` from 64x128 up spill at 32 rows as they do at 16 (64x128 swapped: 28 and 32
bytes), which the setup's timing weighs."""
_OVER_SMEM_32 = frozenset({(64, 256, 4, True)})
"""`_TILES` that do not build for 17-32 rows on an H200: there the swapped 64x256 tile at 4 stages
asks 240 KB of shared memory (227 KB per block), so the tuner would only compile it to drop it."""
_TILES_SMALL_K = ((16, 128, 4, False), (32, 64, 4, False), (64, 64, 4, True))
"""Tiles tried besides `_TILES` when K is under `SMALL_K`: narrow row tiles and short K tiles that,
with the K splits `_candidates` adds there, give a 576- to 1728-wide projection 100-400 programs
instead of 9-60."""
SMALL_K = 2048
"""K under which `_candidates` also tries `_TILES_SMALL_K` and the K splits `_SMALL_K_SPLITS`."""
_SMALL_K_SPLITS = (2, 3, 4, 6)
_MULRED_TILES = ((8, 512, 4), (16, 256, 4), (16, 512, 8), (8, 256, 4), (4, 1024, 4), (4, 2048, 4))
"""(block_n, block_k, num_warps) of the multiply-and-reduce configs tried for at most 2 rows (the
first two for 3-4 rows): at one row they streamed the small 8B and 1B projections 10-50 % faster
than the `tl.dot` tiles in CUDA-graph chains (`explore-archive:bench/results/explore/gemv_sweep.json`). With the
one-row accumulator in the weight tile's layout, 4 x 2048 (16 KB tiles) streams the 8B o, gate/up
and down projections at one row faster than any other tile in the real decode step: 4.05-4.07 ->
3.91-3.93 ms per step (`explore-archive:bench/results/explore/mulred_row1_s16.json`)."""


def _candidates(n: int, k: int, device: torch.device, m: int = 16) -> list[GemvConfig]:
    """Tile shapes that stream `w` in 16-byte rows (`_TILES`, plus `_MULRED_TILES` for at most
    `MULRED_MAX_M` rows, `_TILES_32` for more than 16 and `_TILES_SMALL_K` for K under `SMALL_K`),
    times K splits around the count that fills the device (none, half, full, double; for K under
    `SMALL_K` also 2, 3, 4 and 6, which those rounded to powers of two skip: at K 576 they ask for
    more splits than K has 128-wide tiles): 25-45 configs on the 8B shapes on an H200 (6144 x 4096:
    37, 29, 25, 31 at 1, 4, 16, 32 rows)."""
    small_k = k < SMALL_K
    extra = (_TILES_32 if m > 16 else ()) + (_TILES_SMALL_K if small_k else ())
    tiles = [(bn, bk, 4, stages, swap, False) for bn, bk, stages, swap in dict.fromkeys(_TILES + extra)
             if m <= 16 or (bn, bk, stages, swap) not in _OVER_SMEM_32]
    if m <= MULRED_MAX_M:
        mulred = _MULRED_TILES if m <= 2 else _MULRED_TILES[:2]
        tiles += [(bn, bk, warps, 3, False, True) for bn, bk, warps in mulred]
    out = []
    for block_n, block_k, warps, stages, swap, mulred in tiles:
        fill = cdiv(2 * sm_count(device), cdiv(n, block_n))
        pow2 = {next_pow2(s) for s in (1, max(1, fill // 2), fill, 2 * fill)}
        for split in sorted(pow2 | (set(_SMALL_K_SPLITS) if small_k else set())):
            if split == 1 or k // split >= block_k:
                out.append(GemvConfig(block_n, block_k, split, warps, stages, swap, mulred))
    return list(dict.fromkeys(out))


_TUNED: dict[tuple, GemvConfig] = {}


def _tuned_config(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, tune: bool = True) -> GemvConfig:
    """The configuration registered for this shape and row bucket (by an earlier tuning or the
    fast path's setup), else, with `tune` on a CUDA device outside a capture, the fastest candidate
    timed now (and registered), else the heuristic one."""
    m, k = x.shape
    n = w.shape[0]
    key = (next_pow2(m), n, k, x.dtype, w.dtype, bias is not None, x.device)
    if key in _TUNED:
        return _TUNED[key]
    if interpreting() or not tune or x.device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return heuristic_config(m, n, k, x.device)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    best, best_ms = None, float("inf")
    for cfg in _candidates(n, k, x.device, m):
        try:
            ms = triton.testing.do_bench(lambda cfg=cfg: _launch(x, w, bias, out, cfg), warmup=5, rep=20)
        except Exception:  # a config the compiler rejects (resources): skip it  # noqa: BLE001
            continue
        if ms < best_ms:
            best, best_ms = cfg, ms
    _TUNED[key] = best or heuristic_config(m, n, k, x.device)
    return _TUNED[key]


def _check(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Validate `triton_linear`'s arguments; x with a unit last stride and a contiguous bias."""
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
    return (x if x.stride(1) == 1 else x.contiguous()), bias


def triton_linear(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *, config: GemvConfig | None = None,
    tune: bool = True,
) -> torch.Tensor:
    """`x (M, K) @ w (N, K).T (+ bias (N,))` -> `(M, N)` in x's dtype, float32 accumulation, `M <= MAX_M`.

    `config` fixes the launch configuration (default: the one registered for the shape, else tuned
    on first use when `tune`, else the heuristic one: `_tuned_config`).
    """
    x, bias = _check(x, w, bias)
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(m, n))
    _launch(x, w, bias, out, config or _tuned_config(x, w, bias, tune))
    return out


def triton_linear_parts(x: torch.Tensor, w: torch.Tensor, *, config: GemvConfig | None = None,
                        tune: bool = True) -> torch.Tensor | SplitKParts:
    """`triton_linear(x, w)` without the split-K reduce: `SplitKParts` when the configuration splits
    K, else the `(M, N)` result itself."""
    x, _ = _check(x, w, None)
    m, k = x.shape
    cfg = config or _tuned_config(x, w, None, tune)
    if m == 0 or k == 0 or cfg.splits(k) == 1:
        return triton_linear(x, w, config=cfg)
    out = torch.empty((m, w.shape[0]), dtype=x.dtype, device=x.device)
    return SplitKParts(_launch(x, w, None, out, cfg, reduce=False), x.dtype)


def reference_linear_silu_mul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` of `F.linear(x, w)`, whose first half of columns is gate, second up."""
    gate, up = F.linear(x, w).chunk(2, dim=-1)
    return F.silu(gate) * up


def triton_linear_silu_mul(x: torch.Tensor, w: torch.Tensor, *, config: GemvConfig | None = None,
                           tune: bool = True) -> torch.Tensor:
    """`reference_linear_silu_mul` in one GEMV (plus the split-K reduce, if any), the SiLU and the
    product in its epilogue: `(M, K)` @ a fused gate/up weight `(2I, K)` -> `(M, I)`."""
    x, _ = _check(x, w, None)
    m, k = x.shape
    n = w.shape[0]
    require(n % 2 == 0, f"the gate/up weight needs an even row count (gate rows, then up rows), got {n}")
    out = torch.empty((m, n // 2), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    _launch(x, w, None, out, config or _tuned_config(x, w, None, tune), epi=EPI_SILU.value)
    return out


def _check_rope(x: torch.Tensor, w: torch.Tensor, r: RopeStore) -> None:
    nh, nkv, d = r.num_heads, r.num_kv_heads, r.head_dim
    require(d % 2 == 0, f"RoPE needs an even head_dim, got {d}")
    require(w.shape[0] == (nh + 2 * nkv) * d,
            f"the QKV weight has {w.shape[0]} rows, expected ({nh} + 2 * {nkv}) * {d} = {(nh + 2 * nkv) * d}")
    m = x.shape[0]
    for name, t in (("positions", r.positions), ("slots", r.slots)):
        # is_contiguous: a one-element view counts whatever its stride (the kernel reads element 0 only)
        require(t.shape == (m,) and t.is_contiguous() and not t.dtype.is_floating_point,
                f"RopeStore.{name} must be contiguous integers of shape ({m},), got {t.dtype} {tuple(t.shape)}")
    require(r.k_cache.shape[1:] == (nkv, d) and r.k_cache.stride(2) == 1 and r.v_cache.shape == r.k_cache.shape
            and r.v_cache.stride() == r.k_cache.stride(),
            f"RopeStore caches must be (num_slots, {nkv}, {d}) with the same strides and a unit last stride")
    require(r.cos.dtype == torch.float32 and r.cos.dim() == 2 and r.cos.shape[1] == d and r.cos.stride(1) == 1
            and r.sin.shape == r.cos.shape and r.sin.stride() == r.cos.stride() and r.sin.dtype == torch.float32,
            f"RopeStore cos/sin must be float32 (P, {d}) tables with the same strides")
    for name, t in (("positions", r.positions), ("slots", r.slots), ("k_cache", r.k_cache), ("cos", r.cos)):
        require(t.device == x.device, f"RopeStore.{name} is on {t.device}, x on {x.device}")


def reference_rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slots: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """The reference of the RoPE + KV store (`spec_kernels.elementwise.rope_store`, the RoPE epilogue here):
    rotate q, k (`(T, H*D)`) by the table rows of `positions` (rotate-half, in float32), store
    k, v at `k_cache[slots]`, `v_cache[slots]` (`(num_slots, Hkv, D)`); returns q `(T, Hq, D)`."""
    t = q.shape[0]
    c, s = cos[positions].float(), sin[positions].float()

    def rotate(x: torch.Tensor, heads: int) -> torch.Tensor:
        x = x.reshape(t, heads, head_dim).float()
        half = head_dim // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * c[:, None, :] + rotated * s[:, None, :]

    k_cache[slots] = rotate(k, num_kv_heads).to(k_cache.dtype)
    v_cache[slots] = v.reshape(t, num_kv_heads, head_dim).to(v_cache.dtype)
    return rotate(q, num_heads).to(q.dtype)


def reference_linear_rope_store(x: torch.Tensor, w: torch.Tensor, r: RopeStore) -> torch.Tensor:
    """`F.linear(x, w)` split into q, k, v; RoPE on q and k (rotate-half, float32); k, v stored at
    `r.slots`; returns q `(M, Hq, D)` (`reference_rope_store` after the projection)."""
    nh, nkv, d = r.num_heads, r.num_kv_heads, r.head_dim
    q, k, v = F.linear(x, w).split([nh * d, nkv * d, nkv * d], dim=-1)
    return reference_rope_store(q, k, v, r.cos, r.sin, r.positions, r.k_cache, r.v_cache, r.slots, nh, nkv, d)


def triton_linear_rope_store(x: torch.Tensor, w: torch.Tensor, rope: RopeStore, *,
                             config: GemvConfig | None = None, tune: bool = True) -> torch.Tensor:
    """`reference_linear_rope_store` in one GEMV (plus the split-K reduce, if any): the QKV
    projection with RoPE and the KV store in its epilogue. Returns the rotated q `(M, Hq, D)`."""
    x, _ = _check(x, w, None)
    _check_rope(x, w, rope)
    m, k = x.shape
    out = torch.empty((m, rope.num_heads, rope.head_dim), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if k == 0:
        return reference_linear_rope_store(x, w, rope)
    _launch(x, w, None, out.view(m, -1), config or _tuned_config(x, w, None, tune), epi=EPI_ROPE.value, rope=rope)
    return out


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Drop-in for `F.linear` on `(..., K)` inputs: the Triton GEMV for at most `MAX_M` rows on a
    CUDA device (or under the interpreter), `torch.nn.functional.linear` otherwise."""
    rows = x.numel() // max(x.shape[-1], 1)
    if rows > MAX_M or not (x.is_cuda or interpreting()):
        return F.linear(x, w, bias)
    y = triton_linear(x.reshape(rows, x.shape[-1]), w, bias)
    return y.reshape(*x.shape[:-1], w.shape[0])
