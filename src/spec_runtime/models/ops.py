"""The operations a model's forward is made of, and their torch reference implementation.

Every model class (`llama.LlamaForCausal`, `eagle.Eagle1Head`, `eagle3.Eagle3Head`,
`llama.StandaloneDraft`) has one forward, written in these steps; it takes an `ops` object and calls
each step through it. `TorchOps` (the default, `TORCH_OPS`) runs each step as the model's own torch
modules do. The static / CUDA-graph executors pass the fast path's ops instead
(`spec_runtime.gpu.fast_ops.FastOps`: fused weights, a RoPE table, Triton kernels, cuBLAS or the
Triton GEMV per shape), which compute the same function from the same weights.

Steps and what they return:

- `rope(rotary, positions, dtype)`: a `Rope` for the forward's rows;
- `embed_norm(ids, embedding, norm)`: `(x, norm(x))` of the embedded ids (norm None: `(x, x)`);
- `embed_norm_cat(ids, table, norm_e, h, norm_h, dtype)`: `cat([norm_e(table[ids]), norm_h(h)], -1)`
  (EAGLE-3's layer input; the embedded rows in `dtype`);
- `norm(x, norm)`, `add_norm(x, delta, norm, between_gemvs)`: RMSNorm, or `(x + delta, norm(x + delta))`;
- `add(x, delta)`: `x + delta` (a residual add with no norm after it);
- `qkv_rope_store(attn_module, x, rope, attn, cache, layer)`: rotated q `(T, Hq, D)`, k/v stored
  (`qkv` then `rope_store`, unless the fast ops run RoPE and the store in the QKV GEMV's epilogue);
- `attention(attn_module, q, cache, layer, attn, attention_fn)`: `(T, Hq, D)`;
- `linear(module, x, defer)`: `module(x)`; `defer` lets the fast ops hand back a GEMV's unreduced
  split-K partials, which only `add_norm` and `add` accept as their delta;
- `gate_up_silu(mlp, x)`: `silu(gate(x)) * up(x)`;
- `lm_head(model, h)`, `argmax(logits)`: `F.linear(h, model.lm_head_weight)`, the last-axis argmax.
"""

from typing import Any, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from spec_runtime.attention import AttentionFn, AttnBatch
from spec_runtime.kv_cache import KVCache

__all__ = ["TORCH_OPS", "Rope", "TorchOps", "apply_rotary"]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `(T, heads, D)` by `(T, D)` tables (the rotate-half convention of HF Llama)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class Rope(NamedTuple):
    """RoPE for one forward's rows: `positions` `(T,)`, and either `cos`/`sin` `(T, D)` in the model
    dtype (the reference computes them once per forward) or a `table` (the fast ops' precomputed
    `gpu.fast_ops.RopeTable`, indexed by position where used)."""

    positions: torch.Tensor
    cos: Optional[torch.Tensor] = None
    sin: Optional[torch.Tensor] = None
    table: Any = None


def _dense(delta: Any) -> torch.Tensor:
    """An added delta as a tensor: a deferred `linear`'s unreduced partials summed (`SplitKParts.sum`)."""
    return delta if isinstance(delta, torch.Tensor) else delta.sum()


class TorchOps:
    """The reference implementation of every step: the model's own torch modules and functions."""

    def rope(self, rotary: Any, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """cos/sin of `positions` from the model's `RotaryEmbedding`."""
        cos, sin = rotary(positions, dtype)
        return Rope(positions, cos, sin)

    def norm(self, x: torch.Tensor, norm: Optional[nn.Module]) -> torch.Tensor:
        """`norm(x)` (None: identity)."""
        return x if norm is None else norm(x)

    def embed_norm(self, ids: torch.Tensor, embedding: nn.Embedding,
                   norm: Optional[nn.Module]) -> tuple[torch.Tensor, torch.Tensor]:
        """`(embedding(ids), norm(embedding(ids)))`."""
        x = embedding(ids)
        return x, self.norm(x, norm)

    def embed_norm_cat(self, ids: torch.Tensor, table: torch.Tensor, norm_e: nn.Module, h: torch.Tensor,
                       norm_h: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        """`cat([norm_e(table[ids].to(dtype)), norm_h(h)], -1)`."""
        return torch.cat([self.norm(F.embedding(ids, table).to(dtype), norm_e), self.norm(h, norm_h)], dim=-1)

    def add_norm(self, x: torch.Tensor, delta: Any, norm: Optional[nn.Module],
                 between_gemvs: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """`(x + delta, norm(x + delta))`; delta None: no add. `between_gemvs` is the caller's
        promise for the fast ops' kernel (`spec_kernels.elementwise.add_rmsnorm`); no meaning here."""
        if delta is not None:
            x = x + _dense(delta)
        return x, self.norm(x, norm)

    def add(self, x: torch.Tensor, delta: Any) -> torch.Tensor:
        """`x + delta`, where `delta` may be a deferred `linear`'s unreduced partials (summed first)."""
        return x + _dense(delta)

    def linear(self, module: nn.Linear, x: torch.Tensor, defer: bool = False) -> torch.Tensor:
        """`module(x)`."""
        return module(x)

    def qkv(self, sa: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The q, k, v projections of `x`, each `(T, heads * D)`."""
        return sa.q_proj(x), sa.k_proj(x), sa.v_proj(x)

    def rope_store(self, sa: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: Rope,
                   cache: KVCache, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """RoPE on q and k, k and v stored at `slots`; returns the rotated q `(T, Hq, D)`."""
        t, hd = q.shape[0], sa.head_dim
        qr = apply_rotary(q.view(t, sa.num_heads, hd), rope.cos, rope.sin)
        kr = apply_rotary(k.view(t, sa.num_kv_heads, hd), rope.cos, rope.sin)
        cache.k[layer, slots] = kr.to(cache.dtype)
        cache.v[layer, slots] = v.view(t, sa.num_kv_heads, hd).to(cache.dtype)
        return qr

    def qkv_rope_store(self, sa: Any, x: torch.Tensor, rope: Rope, attn: AttnBatch, cache: KVCache,
                       layer: int) -> torch.Tensor:
        """`qkv` then `rope_store` at `attn.out_slots`: the rotated q `(T, Hq, D)`."""
        q, k, v = self.qkv(sa, x)
        return self.rope_store(sa, q, k, v, rope, cache, layer, attn.out_slots)

    def attention(self, sa: Any, q: torch.Tensor, cache: KVCache, layer: int, attn: AttnBatch,
                  attention_fn: AttentionFn) -> torch.Tensor:
        """The model's `attention_fn` over the cache."""
        return attention_fn(q, cache, layer, attn, sa.head_dim ** -0.5)

    def gate_up_silu(self, mlp: Any, x: torch.Tensor) -> torch.Tensor:
        """`silu(gate_proj(x)) * up_proj(x)`."""
        return F.silu(mlp.gate_proj(x)) * mlp.up_proj(x)

    def lm_head(self, model: Any, h: torch.Tensor) -> torch.Tensor:
        """`F.linear(h, model.lm_head_weight)` in the weight's dtype."""
        weight = model.lm_head_weight
        return F.linear(h.to(weight.dtype), weight)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits.argmax(-1)`."""
        return logits.argmax(-1)


TORCH_OPS = TorchOps()
"""The default ops of every model's forward."""
