"""EAGLE-1 draft head: `fc(cat(embed(token), feature))` then one decoder layer without input norm.

Checkpoint keys: `fc.weight` `[H, 2H]` (+ `fc.bias` when the config's `bias` is true, the EAGLE
repo's default), `layers.0.self_attn.{q,k,v,o}_proj.weight`, `layers.0.mlp.{gate,up,down}_proj.weight`,
`layers.0.post_attention_layernorm.weight`, optional `embed_tokens.weight` and `lm_head.weight`
(else the target's). The feature is the target's post-final-norm hidden state; later draft steps feed
the head's own output back, so the head width must equal the target's. Logits are an lm_head applied
to the layer output with no norm.

A hot-token map (FR-Spec; sglang's `--speculative-token-map`: `hot_token_ids`, target ids) cuts the
lm_head to those rows once at load: the head then scores only them (`vocab_size` is their number) and
`d2t` maps its top-k ids back to target ids (`target = draft + d2t[draft]`, EAGLE-3's table, which the
Triton top-k and the frontier kernel apply in their own launch). The target verifies every token, so
the output is unchanged; a token outside the map can never be drafted.
"""

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from spec_runtime.attention import AttentionFn, AttnBatch, torch_attention
from spec_runtime.kv_cache import KVCache
from spec_runtime.models.base import load_checked
from spec_runtime.models.llama import DecoderLayer, LlamaArch, LlamaForCausal, RotaryEmbedding
from spec_runtime.models.ops import TORCH_OPS, TorchOps

__all__ = ["Eagle1Head", "EagleHeadBase"]


class EagleHeadBase(nn.Module):
    """What the EAGLE-1 and EAGLE-3 heads share: one decoder layer (`num_layers` 1) with its own
    RoPE and KV cache shape, and the target's embedding unless the head has its own `embed_tokens`."""

    def __init__(self, arch: LlamaArch, target: LlamaForCausal, dtype: torch.dtype,
                 attention_fn: AttentionFn) -> None:
        super().__init__()
        self.arch, self.dtype, self.attention_fn = arch, dtype, attention_fn
        self.hf_config: dict[str, Any] = {}
        # Not registered as a submodule: the target's weights stay out of this head's state dict.
        object.__setattr__(self, "_target", target)
        self.rotary = RotaryEmbedding(arch.head_dim, arch.rope_theta, arch.rope_scaling)
        self.num_layers, self.num_kv_heads, self.head_dim = 1, arch.num_key_value_heads, arch.head_dim

    @property
    def embed_table(self) -> torch.Tensor:
        """The embedding `embed` reads: the head's own, or the target's (in the target's dtype)."""
        return (self.embed_tokens if self.embed_tokens is not None else self._target.model.embed_tokens).weight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """`(T,)` target-vocabulary ids -> `(T, H)` in the head dtype (own embedding or the target's)."""
        if self.embed_tokens is not None:
            return self.embed_tokens(input_ids)
        return self._target.embed(input_ids).to(self.dtype)


class Eagle1Head(EagleHeadBase):
    """EAGLE-1 head (a `DraftModel`).

    Args:
        arch: the head's config (`num_hidden_layers` 1; only layer 0 is built).
        target: the target model; its embedding and lm_head are used unless the head has its own.
        bias: whether `fc` has a bias (config key `bias`, default True).
        own_embed, own_lm_head: whether the checkpoint carries `embed_tokens.weight` / `lm_head.weight`.

    `set_token_map` (after the weights are loaded) cuts the lm_head to a hot-token set.
    """

    def __init__(
        self,
        arch: LlamaArch,
        target: LlamaForCausal,
        bias: bool = True,
        own_embed: bool = False,
        own_lm_head: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        attention_fn: AttentionFn = torch_attention,
    ) -> None:
        super().__init__(arch, target, dtype, attention_fn)
        if arch.hidden_size != target.hidden_size:
            raise ValueError(
                f"EAGLE-1 head hidden size {arch.hidden_size} must equal the target hidden size "
                f"{target.hidden_size} (the head's output is fed back as the next feature)"
            )
        h = arch.hidden_size
        with torch.device("meta"):
            self.fc = nn.Linear(2 * h, h, bias=bias, dtype=dtype)
            self.layers = nn.ModuleList([DecoderLayer(arch, dtype, input_norm=False)])
            self.embed_tokens = nn.Embedding(target.vocab_size, h, dtype=dtype) if own_embed else None
            self.lm_head = nn.Linear(h, target.vocab_size, bias=False, dtype=dtype) if own_lm_head else None
        self.to_empty(device=torch.device(device)).requires_grad_(False)
        self.hidden_size, self.vocab_size = h, target.vocab_size
        # the hot-token map's lm_head rows and id offsets (`set_token_map`); not in the state dict
        self.register_buffer("hot_lm_head", None, persistent=False)
        self.register_buffer("d2t", None, persistent=False)

    def set_token_map(self, hot_token_ids: torch.Tensor) -> None:
        """Score only `hot_token_ids` (`(n,)` distinct target ids, checked by the loader): their rows of
        the lm_head (the head's own, which is then dropped, or the target's) are copied once, and
        `d2t` maps draft index i to `hot_token_ids[i]`."""
        if self.d2t is not None:
            raise RuntimeError("this EAGLE-1 head already has a hot-token map (set_token_map runs once, at load)")
        if self.__dict__.get("_spec_fast_models"):  # a runtime's fast copy read the full head already
            raise RuntimeError("this EAGLE-1 head is already in use by a runtime: set_token_map runs at load "
                               "(load_eagle1's token_map), before any runtime is built on the head")
        ids = hot_token_ids.to(device=self.fc.weight.device, dtype=torch.int64)
        self.hot_lm_head = self.lm_head_weight.detach()[ids].contiguous()
        self.lm_head = None  # an own full head is never read again
        self.d2t = ids - torch.arange(ids.numel(), device=ids.device)
        self.vocab_size = ids.numel()

    def load_state_dict_checked(self, state_dict: Mapping[str, torch.Tensor], source: str) -> None:
        """Load EAGLE-1 keys (names and shapes checked)."""
        load_checked(self, state_dict, source)

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden_in: torch.Tensor,
        positions: torch.Tensor,
        attn: AttnBatch,
        cache: KVCache,
        from_target: bool = False,
        ops: TorchOps = TORCH_OPS,
    ) -> torch.Tensor:
        """`(T,)` next tokens and `(T, H)` features (target post-norm hidden, or the head's own
        previous output; both are width H) -> `(T, H)` predicted features."""
        if hidden_in.shape[-1] != self.hidden_size:
            raise ValueError(f"EAGLE-1 hidden_in has width {hidden_in.shape[-1]}, expected {self.hidden_size}")
        h = ops.linear(self.fc, torch.cat([self.embed(input_ids), hidden_in.to(self.dtype)], dim=-1))
        rope = ops.rope(self.rotary, positions, h.dtype)
        # no input norm: the layer reads h itself
        x, delta = self.layers[0](h, h, rope, attn, cache, 0, self.attention_fn, ops)
        return ops.add(x, delta)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """`(vocab_size, H)` output projection: the hot-token rows, else the head's own or the target's."""
        if self.hot_lm_head is not None:
            return self.hot_lm_head
        return self.lm_head.weight if self.lm_head is not None else self._target.lm_head_weight

    def compute_logits(self, h: torch.Tensor, ops: TorchOps = TORCH_OPS) -> torch.Tensor:
        """float32 `(T, vocab_size)`: the lm_head (`lm_head_weight`) on the layer output, no norm."""
        return self.logits(h, ops).float()

    def logits(self, h: torch.Tensor, ops: TorchOps = TORCH_OPS) -> torch.Tensor:
        """`compute_logits` in the lm_head's dtype."""
        return ops.lm_head(self, h)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target ids of draft ids (any shape): `draft + d2t[draft]` under a hot-token map, else the ids."""
        return draft_ids if self.d2t is None else draft_ids + self.d2t[draft_ids]
