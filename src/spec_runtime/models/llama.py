"""Llama-family decoder (Llama, Qwen2, Mistral) over the token-slot KV cache.

Module and parameter names follow the Hugging Face checkpoints (`model.layers.{i}.self_attn.q_proj`,
...), so a checkpoint's state dict loads without renaming. Modules are built on the meta device and
materialised uninitialised (`to_empty`): every weight comes from a checkpoint (`load_checked`).
"""

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from spec_runtime.attention import AttentionFn, AttnBatch, torch_attention
from spec_runtime.kv_cache import KVCache
from spec_runtime.models.base import CheckpointError, load_checked
from spec_runtime.models.ops import TORCH_OPS, Rope, TorchOps, apply_rotary

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "DecoderLayer",
    "LlamaArch",
    "LlamaForCausal",
    "MLP",
    "RMSNorm",
    "RotaryEmbedding",
    "SelfAttention",
    "StandaloneDraft",
    "apply_rotary",
    "config_to_dict",
]

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


def config_to_dict(config: Any) -> dict[str, Any]:
    """A Hugging Face config (dict or `PretrainedConfig`) as a plain dict."""
    if isinstance(config, Mapping):
        return dict(config)
    if hasattr(config, "to_dict"):
        return config.to_dict()
    raise TypeError(f"expected a config dict or a transformers PretrainedConfig, got {type(config).__name__}")


def _rope_params(cfg: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from transformers 4 (`rope_theta`, `rope_scaling`) or
    transformers 5 (`rope_parameters`) style configs."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or None
    if scaling is None and params:
        scaling = params
    theta = cfg.get("rope_theta") or params.get("rope_theta") or 10000.0
    if scaling is not None:
        scaling = dict(scaling)
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type == "default":
            scaling = None
        elif rope_type != "llama3":
            raise CheckpointError(f"unsupported rope type {rope_type!r}: only default and 'llama3' are implemented")
        else:
            scaling["rope_type"] = "llama3"
    return float(theta), scaling


def _sliding_window(cfg: Mapping[str, Any], model_type: str) -> int | None:
    if model_type == "mistral":
        return cfg.get("sliding_window")
    if model_type == "qwen2" and cfg.get("use_sliding_window"):
        return cfg.get("sliding_window")
    return None


@dataclass(frozen=True)
class LlamaArch:
    """Architecture numbers of a Llama-family decoder, read from a Hugging Face config.

    `attention_bias` is the q/k/v bias (Qwen2: always on); `o_bias` the o_proj bias (Llama's
    `attention_bias` sets both). `rope_scaling` is None (plain RoPE) or a llama3 dict.
    """

    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False, compare=True)
    attention_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise CheckpointError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @classmethod
    def from_hf_config(cls, config: Any) -> "LlamaArch":
        """Parse a config dict or `PretrainedConfig`; unknown model types and rope types raise."""
        cfg = config_to_dict(config)
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise CheckpointError(
                f"unsupported architecture: model_type {model_type!r} "
                f"(architectures {cfg.get('architectures')}); supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise CheckpointError(f"unsupported hidden_act {act!r}: only 'silu' is implemented")
        heads = cfg["num_attention_heads"]
        theta, scaling = _rope_params(cfg)
        bias = bool(cfg.get("attention_bias") or False)
        return cls(
            model_type=model_type,
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            vocab_size=cfg["vocab_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            attention_bias={"qwen2": True, "mistral": False}.get(model_type, bias),
            o_bias=bias if model_type == "llama" else False,
            mlp_bias=bool(cfg.get("mlp_bias") or False),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            sliding_window=_sliding_window(cfg, model_type),
        )

    def check_max_context(self, max_context: int) -> None:
        """Sliding-window attention is not implemented: allow it only when it never slides."""
        if self.sliding_window is not None and max_context > self.sliding_window:
            raise ValueError(
                f"{self.model_type} sliding window {self.sliding_window} is smaller than max context "
                f"{max_context}; sliding-window attention is not implemented"
            )


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 like Hugging Face's."""

    def __init__(self, width: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`(..., width)` -> same shape and dtype."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: Mapping[str, Any]) -> torch.Tensor:
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding:
    """RoPE tables from explicit positions (plain or llama3-scaled), float32 inverse frequencies."""

    def __init__(self, head_dim: int, theta: float, scaling: Mapping[str, Any] | None) -> None:
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
        inv_freq = 1.0 / (theta ** exponents)
        self.inv_freq = _llama3_inv_freq(inv_freq, scaling) if scaling else inv_freq
        self._by_device: dict[torch.device, torch.Tensor] = {}

    def _inv_freq_on(self, device: torch.device) -> torch.Tensor:
        if device not in self._by_device:
            self._by_device[device] = self.inv_freq.to(device)
        return self._by_device[device]

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`(T,)` positions -> `(cos, sin)`, each `(T, head_dim)` in `dtype`."""
        freqs = positions.float()[:, None] * self._inv_freq_on(positions.device)[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


class SelfAttention(nn.Module):
    """q/k/v/o projections, RoPE, K/V store into the cache, then the pluggable attention."""

    def __init__(self, arch: LlamaArch, input_width: int, dtype: torch.dtype) -> None:
        super().__init__()
        hd = arch.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_attention_heads, arch.num_key_value_heads, hd
        self.q_proj = nn.Linear(input_width, self.num_heads * hd, bias=arch.attention_bias, dtype=dtype)
        self.k_proj = nn.Linear(input_width, self.num_kv_heads * hd, bias=arch.attention_bias, dtype=dtype)
        self.v_proj = nn.Linear(input_width, self.num_kv_heads * hd, bias=arch.attention_bias, dtype=dtype)
        self.o_proj = nn.Linear(self.num_heads * hd, arch.hidden_size, bias=arch.o_bias, dtype=dtype)

    def forward(self, x: torch.Tensor, rope: Rope, attn: AttnBatch, cache: KVCache, layer: int,
                attention_fn: AttentionFn, ops: TorchOps = TORCH_OPS, defer: bool = False) -> Any:
        """`(T, input_width)` -> `(T, hidden)`; stores this layer's K/V at `attn.out_slots`.
        `defer`: the o projection as `ops.linear(defer=True)` gives it (for an `ops.add_norm`)."""
        t = x.shape[0]
        q = ops.qkv_rope_store(self, x, rope, attn, cache, layer)
        out = ops.attention(self, q, cache, layer, attn, attention_fn)
        return ops.linear(self.o_proj, out.reshape(t, self.num_heads * self.head_dim), defer)


class MLP(nn.Module):
    """SwiGLU feed-forward: `down(silu(gate(x)) * up(x))`."""

    def __init__(self, arch: LlamaArch, dtype: torch.dtype) -> None:
        super().__init__()
        h, i, b = arch.hidden_size, arch.intermediate_size, arch.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=b, dtype=dtype)
        self.up_proj = nn.Linear(h, i, bias=b, dtype=dtype)
        self.down_proj = nn.Linear(i, h, bias=b, dtype=dtype)

    def forward(self, x: torch.Tensor, ops: TorchOps = TORCH_OPS, defer: bool = False) -> Any:
        """`(T, hidden)` -> `(T, hidden)` (`defer`: as `SelfAttention.forward`'s)."""
        return ops.linear(self.down_proj, ops.gate_up_silu(self, x), defer)


class DecoderLayer(nn.Module):
    """Pre-norm Llama decoder layer.

    Args:
        arch: the architecture.
        dtype: parameter dtype.
        attn_input_width: width entering q/k/v (default the hidden size; EAGLE-3 uses 2H).
        input_norm: False for EAGLE-1's layer 0, which has no `input_layernorm`.
    """

    def __init__(
        self, arch: LlamaArch, dtype: torch.dtype, attn_input_width: int | None = None, input_norm: bool = True
    ) -> None:
        super().__init__()
        h = arch.hidden_size
        self.input_layernorm = RMSNorm(h, arch.rms_norm_eps, dtype) if input_norm else None
        self.self_attn = SelfAttention(arch, attn_input_width or h, dtype)
        self.post_attention_layernorm = RMSNorm(h, arch.rms_norm_eps, dtype)
        self.mlp = MLP(arch, dtype)

    def forward(self, x: torch.Tensor, normed: torch.Tensor, rope: Rope, attn: AttnBatch, cache: KVCache,
                layer: int, attention_fn: AttentionFn, ops: TorchOps = TORCH_OPS,
                chained: bool = False) -> tuple[torch.Tensor, Any]:
        """`(x, delta)` for the residual stream `x` `(T, H)` entering the layer and its input norm
        `normed`: the layer's output is `x + delta`, left to the caller's add (with the next norm).

        `delta` may be the down projection's unreduced partials (`ops.linear(defer=True)`): the
        caller adds it through `ops.add_norm` or `ops.add`. `chained`: the layer sits in a stack
        whose residual stream comes out of `ops.add_norm` and whose delta goes into the next one
        (`LlamaForCausal.forward`): the post-attention norm makes the `between_gemvs` promise."""
        a = self.self_attn(normed, rope, attn, cache, layer, attention_fn, ops, defer=True)
        x, normed = ops.add_norm(x, a, self.post_attention_layernorm, between_gemvs=chained)
        return x, self.mlp(normed, ops, defer=True)


class _Body(nn.Module):
    def __init__(self, arch: LlamaArch, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(arch, dtype) for _ in range(arch.num_hidden_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)


class LlamaForCausal(nn.Module):
    """Llama/Qwen2/Mistral causal LM over the token-slot KV cache.

    Weights are uninitialised until `load_state_dict_checked` (the loaders in `loading.py` do it).
    `attention_fn` is the pluggable attention (default the torch reference). `hidden_size` (H),
    `vocab_size`, `num_layers` (decoder and KV-cache layers), `num_kv_heads` and `head_dim` are `arch`'s.
    """

    def __init__(
        self,
        arch: LlamaArch,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        attention_fn: AttentionFn = torch_attention,
    ) -> None:
        super().__init__()
        self.arch, self.dtype, self.attention_fn = arch, dtype, attention_fn
        self.hf_config: dict[str, Any] = {}
        with torch.device("meta"):
            self.model = _Body(arch, dtype)
            self.lm_head = None if arch.tie_word_embeddings else nn.Linear(
                arch.hidden_size, arch.vocab_size, bias=False, dtype=dtype)
        self.to_empty(device=torch.device(device)).requires_grad_(False)
        self.rotary = RotaryEmbedding(arch.head_dim, arch.rope_theta, arch.rope_scaling)
        self.hidden_size, self.vocab_size, self.head_dim = arch.hidden_size, arch.vocab_size, arch.head_dim
        self.num_layers, self.num_kv_heads = arch.num_hidden_layers, arch.num_key_value_heads

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """`(vocab, H)` output projection (the embedding when tied)."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def load_state_dict_checked(self, state_dict: Mapping[str, torch.Tensor], source: str) -> None:
        """Load HF-named weights; a tied checkpoint's `lm_head.weight` is ignored."""
        ignore = ("lm_head.weight",) if self.lm_head is None else ()
        load_checked(self, state_dict, source, ignore=ignore)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """`(T,)` ids -> `(T, H)` embeddings."""
        return self.model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttnBatch,
        cache: KVCache,
        aux_layer_ids: Sequence[int] | None = None,
        ops: TorchOps = TORCH_OPS,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the decoder, storing K/V at `attn.out_slots`; each step through `ops`.

        Returns:
            `hidden` `(T, H)` after the final norm, and `aux` `(T, H * len(aux_layer_ids))`: the
            residual stream entering each listed layer (HF's `hidden_states[i]`), or None.
        """
        self.arch.check_max_context(cache.req_to_token.shape[1])
        wanted = self._check_aux_ids(aux_layer_ids)
        rope = ops.rope(self.rotary, positions, self.dtype)
        layers = self.model.layers
        # the embedding gather and the first norm in one step (one launch on the fast path)
        x, normed = ops.embed_norm(input_ids, self.model.embed_tokens, layers[0].input_layernorm if layers else None)
        captured: dict[int, torch.Tensor] = {}
        delta: Any = None
        for i, layer in enumerate(layers):
            if i:  # after the down projection, before the QKV one (see `spec_kernels.elementwise.add_rmsnorm`)
                x, normed = ops.add_norm(x, delta, layer.input_layernorm, between_gemvs=True)
            if i in wanted:
                captured[i] = x
            x, delta = layer(x, normed, rope, attn, cache, i, self.attention_fn, ops, chained=True)
        x, hidden = ops.add_norm(x, delta, self.model.norm)
        if aux_layer_ids is None:
            return hidden, None
        if not aux_layer_ids:
            return hidden, x.new_zeros((x.shape[0], 0))
        return hidden, torch.cat([captured[i] for i in aux_layer_ids], dim=-1)

    def _check_aux_ids(self, aux_layer_ids: Sequence[int] | None) -> set[int]:
        ids = set(aux_layer_ids or ())
        bad = sorted(i for i in ids if not 0 <= i < self.num_layers)
        if bad:
            raise ValueError(f"aux layer ids {bad} out of range [0, {self.num_layers})")
        return ids

    def compute_logits(self, hidden: torch.Tensor, ops: TorchOps = TORCH_OPS) -> torch.Tensor:
        """`(T, H)` post-norm hidden -> float32 `(T, vocab)` logits."""
        return self.logits(hidden, ops).float()

    def logits(self, hidden: torch.Tensor, ops: TorchOps = TORCH_OPS) -> torch.Tensor:
        """`compute_logits` in the lm_head's dtype."""
        return ops.lm_head(self, hidden)

    def greedy_tokens(self, hidden: torch.Tensor, ops: TorchOps = TORCH_OPS) -> torch.Tensor:
        """`compute_logits(hidden).argmax(-1)` without the float32 copy of the logits: the argmax
        of the model-dtype logits is the same index (each float32 value is its bf16/fp16 value
        exactly; ties go to the first index either way), one launch fewer."""
        return ops.argmax(self.logits(hidden, ops))


class StandaloneDraft(nn.Module):
    """A small causal LM used as the draft (STANDALONE): ignores `hidden_in`, identity vocab map."""

    def __init__(self, model: LlamaForCausal) -> None:
        super().__init__()
        self.model = model
        self.hf_config = model.hf_config
        self.hidden_size, self.vocab_size = model.hidden_size, model.vocab_size
        self.num_layers, self.num_kv_heads = model.num_layers, model.num_kv_heads
        self.head_dim, self.dtype = model.head_dim, model.dtype

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden_in: torch.Tensor | None,
        positions: torch.Tensor,
        attn: AttnBatch,
        cache: KVCache,
        from_target: bool = False,
        ops: TorchOps = TORCH_OPS,
    ) -> torch.Tensor:
        """`(T,)` ids -> `(T, H)` post-norm hidden (the draft's own KV cache)."""
        return self.model(input_ids, positions, attn, cache, ops=ops)[0]

    def compute_logits(self, h: torch.Tensor, ops: TorchOps = TORCH_OPS) -> torch.Tensor:
        """float32 `(T, vocab)` logits."""
        return self.model.compute_logits(h, ops)

    def logits(self, h: torch.Tensor, ops: TorchOps = TORCH_OPS) -> torch.Tensor:
        """`compute_logits` in the model's dtype."""
        return self.model.logits(h, ops)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Identity: the vocabularies are the same."""
        return draft_ids
