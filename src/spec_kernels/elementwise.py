"""Triton kernels for the fast path's elementwise steps, each above its launcher, with torch references.

At decode a layer is a handful of weight-streaming GEMVs and a swarm of tiny elementwise ops; in a
CUDA graph each tiny op still costs a few microseconds, so these fuse them:

- `rmsnorm` / `add_rmsnorm` / `embed_rmsnorm`: (residual add or embedding gather +) RMSNorm,
  float32 statistics, `weight * normed.to(dtype)` (the rounding steps of `models.llama.RMSNorm`),
  one program per row; the added delta may be a GEMV's unreduced split-K partials
  (`spec_kernels.gemv.SplitKParts`), summed here instead; `add`: the residual add alone, the same way;
- `rope_store`: RoPE on q and k from a float32 cos/sin table indexed by position, k and v stored
  into the KV cache at their slots, one program per (row, head);
- `silu_mul`: `silu(gate) * up` of a fused gate/up output.

Every launcher reads shapes and strides only (no values): capturable.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from spec_kernels._common import pdl_options
from spec_kernels.gemv import SplitKParts, reference_rope_store  # noqa: F401 (re-exported)

__all__ = [
    "add",
    "add_rmsnorm",
    "embed_rmsnorm",
    "reference_add_rmsnorm",
    "reference_embed_rmsnorm",
    "reference_rmsnorm",
    "reference_rope_store",
    "reference_silu_mul",
    "rmsnorm",
    "rope_store",
    "silu_mul",
]


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def _rows(x: torch.Tensor) -> torch.Tensor:
    """2-D with a unit last stride (a copy only when needed)."""
    return x if x.stride(-1) == 1 else x.contiguous()


# ---- RMSNorm -------------------------------------------------------------------------------------


def reference_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`models.llama.RMSNorm.forward`."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def reference_add_rmsnorm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                          eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`(x + delta, rmsnorm(x + delta))`."""
    s = x + delta
    return s, reference_rmsnorm(s, weight, eps)


@triton.jit
def _rmsnorm_kernel(
    x_ptr,  # (T, H) input rows
    d_ptr,  # (T, H) residual delta (read when HAS_DELTA)
    w_ptr,  # (H,) norm weight
    sum_ptr,  # (T, H) x + delta (output, when HAS_DELTA)
    out_ptr,  # (T, H) normed rows (output)
    H, s_x, s_d, s_s, s_o, eps,
    s_part,  # stride between the delta's split-K partials (NPARTS > 0)
    ids_ptr,  # (T,) token ids (GATHER: x is the embedding table, row `ids[row]` is read)
    V,  # the embedding table's rows (GATHER)
    HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr, NPARTS: tl.constexpr = 0, PDL: tl.constexpr = False,
    GATHER: tl.constexpr = False, X_READY: tl.constexpr = False, TRIGGER_FIRST: tl.constexpr = False,
    NORM: tl.constexpr = True,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    # The weight is never written during a forward: loaded before the PDL wait, off the critical
    # path. X_READY: the caller vouches that x is complete once the kernel ahead of this one has
    # started its programs (see `add_rmsnorm`), so it is loaded here too.
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    if X_READY and not GATHER:
        x = tl.load(x_ptr + row * s_x + cols, mask=mask, other=0.0)
    if PDL:  # programmatic dependent launch: wait for the previous kernel before any other access
        if TRIGGER_FIRST:  # the next kernel's programs may start now (see `add_rmsnorm`)
            gdc_launch_dependents()
        gdc_wait()
        if not TRIGGER_FIRST:
            gdc_launch_dependents()
    if GATHER:  # the embedding row of the token, stored as the residual stream
        tok = tl.load(ids_ptr + row).to(tl.int64)
        ok = (tok >= 0) & (tok < V)  # callers check ids; a bad one reads nothing (zeros)
        x = tl.load(x_ptr + tok * s_x + cols, mask=mask & ok, other=0.0)
        tl.store(sum_ptr + row * s_s + cols, x, mask=mask)
    elif not X_READY:
        x = tl.load(x_ptr + row * s_x + cols, mask=mask, other=0.0)
    if HAS_DELTA:
        if NPARTS > 0:  # float32 split-K partials of a GEMV: summed in split order, rounded as its reduce
            acc = tl.zeros([BLOCK], tl.float32)
            for p in tl.static_range(NPARTS):
                acc += tl.load(d_ptr + p * s_part + row * s_d + cols, mask=mask, other=0.0)
            d = acc.to(x_ptr.dtype.element_ty)
        else:
            d = tl.load(d_ptr + row * s_d + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(sum_ptr.dtype.element_ty)  # rounded like torch's add
        tl.store(sum_ptr + row * s_s + cols, x, mask=mask)
    if not NORM:  # the add alone (`add`)
        return
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / H + eps)
    normed = (xf * rstd).to(x_ptr.dtype.element_ty)
    y = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * s_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


TRIGGER_FIRST_ROWS = 1
"""An add + RMSNorm between two GEMVs (`add_rmsnorm(between_gemvs=True)`) of at most this many
rows lets the next kernel's programs start before its own PDL wait. On the H200 (8B shape) the
plain bs=1 decode step ran 3.829-3.832 -> 3.761-3.774 ms with the trigger on (in one process,
alternating), but triggering
first at 2 rows (the STANDALONE draft) and 8 rows (the verify) was slower: draft graph 2.670 ->
2.746 ms, verify 4.197 -> 4.40 (`explore-archive:bench/results/explore/session23.json`)."""


def trigger_first(rows: int) -> bool:
    """Whether an add + RMSNorm between two GEMVs of `rows` rows triggers before its wait."""
    return rows <= TRIGGER_FIRST_ROWS


def _out(out: "torch.Tensor | None", t: int, h: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The normed rows' tensor: `out` when given (a `(t, h)` view with unit column stride, e.g. one
    half of a wider buffer; rows at any stride), else a new one."""
    if out is None:
        return torch.empty((t, h), dtype=dtype, device=device)
    if tuple(out.shape) != (t, h) or out.dtype != dtype or out.device != device or out.stride(1) != 1:
        raise ValueError(f"rmsnorm: out must be ({t}, {h}) {dtype} on {device} with unit column stride, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}, strides {out.stride()}")
    return out


def _norm_launch(x: torch.Tensor, delta, weight: "torch.Tensor | None", eps: float, between_gemvs: bool = False,
                 out: "torch.Tensor | None" = None):
    """`(x + delta, rmsnorm(x + delta))`; `weight` None: the add alone, `(x + delta, None)`."""
    if x.dim() != 2 or (weight is not None and weight.shape != (x.shape[1],)):
        raise ValueError(f"rmsnorm: x must be (T, H) and weight (H,), got {tuple(x.shape)} and "
                         f"{None if weight is None else tuple(weight.shape)}")
    t, h = x.shape
    x = _rows(x)
    norm = weight is not None
    out = _out(out, t, h, torch.promote_types(weight.dtype, x.dtype), x.device) if norm else x
    weight = weight if norm else x
    nparts, s_part = 0, 0
    if isinstance(delta, SplitKParts):
        if delta.dtype != x.dtype or delta.parts.stride(-1) != 1:
            delta = delta.sum()
        else:
            nparts, s_part, delta = delta.parts.shape[0], delta.parts.stride(0), delta
    if nparts:
        if tuple(delta.shape) != tuple(x.shape):
            raise ValueError(f"add_rmsnorm: delta has shape {tuple(delta.shape)}, expected {tuple(x.shape)}")
        total = torch.empty((t, h), dtype=x.dtype, device=x.device)
        delta = delta.parts[0]  # the first partial; the kernel steps s_part to the others
    elif delta is not None:
        if delta.shape != x.shape:
            raise ValueError(f"add_rmsnorm: delta has shape {tuple(delta.shape)}, expected {tuple(x.shape)}")
        delta = _rows(delta)
        total = torch.empty((t, h), dtype=torch.promote_types(x.dtype, delta.dtype), device=x.device)
    else:
        delta, total = x, x
    if not norm and total is x:  # nothing to add
        return x, None
    if t:
        block = _pow2(h)
        _rmsnorm_kernel[(t,)](
            x, delta, weight, total, out, h, x.stride(0), delta.stride(0), total.stride(0), out.stride(0), eps,
            s_part, x, 0, HAS_DELTA=total is not x, BLOCK=block, NPARTS=nparts, X_READY=between_gemvs,
            TRIGGER_FIRST=between_gemvs and trigger_first(t), NORM=norm,
            num_warps=_norm_warps(block, total is not x), **pdl_options(x.device),
        )
    return total, out if norm else None


def _norm_warps(block: int, adds: bool) -> int:
    """Warps of `_rmsnorm_kernel` for rows of `block` columns. The row sum's order follows the
    warps, so every launch without an add (the plain and the embedding-gather norms) must use the
    same count to give the same bits, and so must every add.

    The residual add reads one or more rows per output row (several float32 split-K partials):
    16 warps keep more loads in flight. On the H200 the 1B down projection's add + RMSNorm of
    4 partials went 14.9 -> 13.1 µs in the setup's chain and the STANDALONE verify and
    draft-extend graphs 0.07-0.1 ms faster each (explore-archive:bench/results/explore/norm_parts_warps_ab.json,
    16 warps for partials only). Every add uses the same count, so summing the partials here
    stays bit for bit the reduce kernel then the add."""
    return 16 if adds and block >= 1024 else (8 if block >= 4096 else 4)


def reference_embed_rmsnorm(ids: torch.Tensor, table: torch.Tensor, weight: torch.Tensor,
                            eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`(table[ids], rmsnorm(table[ids]))`."""
    x = F.embedding(ids, table)
    return x, reference_rmsnorm(x, weight, eps)


def embed_rmsnorm(ids: torch.Tensor, table: torch.Tensor, weight: torch.Tensor,
                  eps: float, out: "torch.Tensor | None" = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`(table[ids], rmsnorm(table[ids]))` in one kernel (`reference_embed_rmsnorm`): a forward's
    embedding gather and its first RMSNorm, so the gather is not a launch of its own (torch's
    gather also launches without programmatic dependent launch). The ids are not checked here
    (no sync; `SpecEngine` checks prompts against the vocabulary): an id outside the table reads a
    zero row. `out`: where the normed rows go (as `rmsnorm`'s)."""
    if ids.dim() != 1 or table.dim() != 2 or weight.shape != (table.shape[1],):
        raise ValueError(f"embed_rmsnorm: ids must be (T,), table (V, H) and weight (H,), got "
                         f"{tuple(ids.shape)}, {tuple(table.shape)} and {tuple(weight.shape)}")
    if table.stride(1) != 1:
        raise ValueError("embed_rmsnorm: the table's rows must be contiguous")
    ids = ids if ids.stride(0) == 1 else ids.contiguous()  # the kernel reads ids[row] at unit stride
    t, (v, h) = ids.shape[0], table.shape
    x = torch.empty((t, h), dtype=table.dtype, device=table.device)
    out = _out(out, t, h, torch.promote_types(weight.dtype, table.dtype), table.device)
    if t:
        block = _pow2(h)
        _rmsnorm_kernel[(t,)](
            table, table, weight, x, out, h, table.stride(0), 0, x.stride(0), out.stride(0), eps, 0, ids, v,
            HAS_DELTA=False, BLOCK=block, GATHER=True, num_warps=_norm_warps(block, False),
            **pdl_options(table.device),
        )
    return x, out


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: "torch.Tensor | None" = None) -> torch.Tensor:
    """RMSNorm of `(T, H)` rows (`reference_rmsnorm`), into `out` when given: a `(T, H)` view with unit
    column stride, such as one half of a wider buffer (EAGLE-3's layer input, no concatenation)."""
    return _norm_launch(x, None, weight, eps, out=out)[1]


def add_rmsnorm(x: torch.Tensor, delta: "torch.Tensor | SplitKParts", weight: torch.Tensor,
                eps: float, *, between_gemvs: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`(x + delta, rmsnorm(x + delta))` in one pass (`reference_add_rmsnorm`). `delta` may be a
    GEMV's unreduced `SplitKParts` (of x's dtype): summed here as the GEMV's reduce would, which
    saves that kernel.

    `between_gemvs` (the fast forward's norms inside its layers, but the first) is the caller's promise, under
    programmatic dependent launch, that (1) `x` was written by a norm at least three launches back,
    each launch in between a kernel that cannot finish before the one ahead of it (its programs
    wait on it: the layer's GEMVs and attention), so `x` is complete once the kernel ahead of this
    one has started its programs, and is loaded before the wait; and (2) the next launch is a GEMV
    whose programs read nothing before their own wait but weights and inputs written before the
    forward began, so at `TRIGGER_FIRST_ROWS` rows (`trigger_first`) this kernel lets them start
    before its wait: their first weight tiles stream while the GEMV ahead of this norm finishes.
    Same bits either way."""
    return _norm_launch(x, delta, weight, eps, between_gemvs)


def add(x: torch.Tensor, delta: "torch.Tensor | SplitKParts") -> torch.Tensor:
    """`x + delta` rounded as torch's add, one launch; `delta` may be a GEMV's unreduced `SplitKParts`
    (summed in split order and rounded first, as the GEMV's reduce would): the residual add of a layer
    with no norm after it (the EAGLE heads')."""
    return _norm_launch(x, delta, None, 0.0)[0]


# ---- SiLU and multiply ---------------------------------------------------------------------------


def reference_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` of a `(T, 2I)` tensor whose halves are gate and up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@triton.jit
def _silu_mul_kernel(
    gu_ptr,  # (T, 2I) gate then up
    out_ptr,  # (T, I) result (output)
    inter, s_in, s_out,
    BLOCK: tl.constexpr, PDL: tl.constexpr = False,
):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(gu_ptr + row * s_in + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * s_in + inter + cols, mask=mask, other=0.0)
    act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty)  # F.silu rounds to the dtype
    y = act.to(tl.float32) * u.to(tl.float32)
    tl.store(out_ptr + row * s_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` of a fused `(T, 2I)` gate/up output -> `(T, I)` (`reference_silu_mul`)."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"silu_mul: gate_up must be (T, 2I), got {tuple(gate_up.shape)}")
    gate_up = _rows(gate_up)
    t, i = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((t, i), dtype=gate_up.dtype, device=gate_up.device)
    if t:
        block = min(_pow2(i), 2048)
        _silu_mul_kernel[(t, triton.cdiv(i, block))](gate_up, out, i, gate_up.stride(0), out.stride(0),
                                                     BLOCK=block, num_warps=4, **pdl_options(out.device))
    return out


# ---- RoPE + KV store -----------------------------------------------------------------------------


@triton.jit
def _rope_store_kernel(
    q_ptr,  # (T, Hq*D) queries, unit last stride
    k_ptr,  # (T, Hkv*D) keys
    v_ptr,  # (T, Hkv*D) values
    cos_ptr,  # (P, D) float32 table
    sin_ptr,  # (P, D) float32 table
    pos_ptr,  # (T,) int positions
    slot_ptr,  # (T,) int KV slots
    kc_ptr,  # (num_slots, Hkv, D) this layer's keys (output)
    vc_ptr,  # (num_slots, Hkv, D) this layer's values (output)
    qo_ptr,  # (T, Hq, D) rotated queries (output)
    NH, s_q, s_k, s_v, s_tab, s_cs, s_ch, s_ot, s_oh,
    HD: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False,
):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    half = HD // 2
    d = tl.arange(0, BLOCK)
    mask = d < HD
    rot = tl.where(d < half, d + half, d - half)
    sign = tl.where(d < half, -1.0, 1.0)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    c = tl.load(cos_ptr + pos * s_tab + d, mask=mask, other=0.0)
    s = tl.load(sin_ptr + pos * s_tab + d, mask=mask, other=0.0)
    if h < NH:
        base = q_ptr + t * s_q + h * HD
        x = tl.load(base + d, mask=mask, other=0.0).to(tl.float32)
        xr = tl.load(base + rot, mask=mask, other=0.0).to(tl.float32)
        y = tl.fma(x, c, sign * xr * s)  # explicit: the GEMV's RoPE epilogue rounds the same way
        tl.store(qo_ptr + t * s_ot + h * s_oh + d, y.to(qo_ptr.dtype.element_ty), mask=mask)
    else:
        kh = h - NH
        slot = tl.load(slot_ptr + t).to(tl.int64)
        base = k_ptr + t * s_k + kh * HD
        x = tl.load(base + d, mask=mask, other=0.0).to(tl.float32)
        xr = tl.load(base + rot, mask=mask, other=0.0).to(tl.float32)
        y = tl.fma(x, c, sign * xr * s)  # explicit: the GEMV's RoPE epilogue rounds the same way
        dst = slot * s_cs + kh * s_ch + d
        tl.store(kc_ptr + dst, y.to(kc_ptr.dtype.element_ty), mask=mask)
        vv = tl.load(v_ptr + t * s_v + kh * HD + d, mask=mask, other=0.0)
        tl.store(vc_ptr + dst, vv.to(vc_ptr.dtype.element_ty), mask=mask)


def rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
               num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """RoPE on q and k plus the KV store, one launch (`reference_rope_store`'s contract).

    `q`, `k`, `v` may be column slices of one fused QKV output (unit last stride, any row stride);
    `cos`, `sin` float32 `(P, D)`; the cache layers `(num_slots, Hkv, D)` contiguous per head."""
    t = q.shape[0]
    d = head_dim
    for name, x, heads in (("q", q, num_heads), ("k", k, num_kv_heads), ("v", v, num_kv_heads)):
        if x.dim() != 2 or x.shape != (t, heads * d):
            raise ValueError(f"rope_store: {name} must be (T, {heads * d}), got {tuple(x.shape)}")
    if k_cache.shape[1:] != (num_kv_heads, d) or k_cache.stride(2) != 1 or v_cache.stride() != k_cache.stride():
        raise ValueError(f"rope_store: cache layers must be (num_slots, {num_kv_heads}, {d}) with unit last stride")
    if cos.dtype != torch.float32 or cos.shape[1] != d or cos.stride(1) != 1 or sin.stride() != cos.stride():
        raise ValueError("rope_store: cos/sin must be float32 (P, head_dim) tables with the same strides")
    q, k, v = _rows(q), _rows(k), _rows(v)
    positions, slots = positions.contiguous(), slots.contiguous()  # read with unit stride
    out = torch.empty((t, num_heads, d), dtype=q.dtype, device=q.device)
    if t:
        _rope_store_kernel[(t, num_heads + num_kv_heads)](
            q, k, v, cos, sin, positions, slots, k_cache, v_cache, out,
            num_heads, q.stride(0), k.stride(0), v.stride(0), cos.stride(0), k_cache.stride(0), k_cache.stride(1),
            out.stride(0), out.stride(1), HD=d, BLOCK=_pow2(d), num_warps=1 if d <= 64 else 2,
            **pdl_options(q.device),
        )
    return out
