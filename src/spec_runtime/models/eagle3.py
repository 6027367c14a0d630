"""EAGLE-3 draft head: one "midlayer" over `cat(input_layernorm(embed), hidden_norm(h))`, own norm and
lm_head over a smaller draft vocabulary mapped to target ids by `d2t` offsets.

Checkpoint keys: `fc.weight` `[H, target_hidden * num_aux]`, `midlayer.{hidden_norm,input_layernorm,
post_attention_layernorm}.weight`, `midlayer.self_attn.{q,k,v}_proj.weight` `[*, 2H]`, `o_proj`,
`midlayer.mlp.*`, `norm.weight`, `lm_head.weight` `[draft_vocab, H]`, `d2t` int64 `[draft_vocab]`,
`t2d` bool `[target_vocab]` (shape-checked only), optional `embed_tokens.weight`.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import ValidationError
from torch import nn

from spec_runtime.attention import AttentionFn, AttnBatch, torch_attention
from spec_runtime.kv_cache import KVCache
from spec_runtime.models.base import CheckpointError, load_checked
from spec_runtime.models.eagle import EagleHeadBase
from spec_runtime.models.llama import MLP, LlamaArch, LlamaForCausal, RMSNorm, SelfAttention
from spec_runtime.models.ops import TORCH_OPS, Rope, TorchOps
from spec_schema import ModelDims, SpecAlgorithm, aux_layer_width, default_aux_layer_ids, extend_width

__all__ = ["Eagle3Head", "Eagle3Settings", "Eagle3Midlayer"]


@dataclass(frozen=True)
class Eagle3Settings:
    """EAGLE-3 config keys resolved against the target, by the schema's parser
    (`spec_schema.ModelDims.from_hf_config`), its aux-layer default and its width rule.

    `aux_layer_ids` is None when `use_aux_hidden_state` is false: then the capture is the target's
    post-norm final hidden (`num_aux` 1). `fc_input_width` is the rule's `hidden_extend`.
    """

    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...] | None
    fc_input_width: int

    @property
    def num_aux(self) -> int:
        """Captured target hidden states concatenated into `fc`'s input."""
        return 1 if self.aux_layer_ids is None else len(self.aux_layer_ids)

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], target: LlamaForCausal) -> "Eagle3Settings":
        """Read the head's config (`draft_vocab_size`, `target_hidden_size`, `eagle_config`, ...)
        as the schema does; aux layers the config does not name are the schema's default."""
        n = target.num_layers
        try:
            head = ModelDims.from_hf_config(cfg, dtype=torch.float32)  # dtype: the loader's, not the config's
            ids = (head.aux_layer_ids or default_aux_layer_ids(n)) if head.use_aux_hidden_state else None
            head = ModelDims.model_validate({**head.model_dump(), "aux_layer_ids": ids})
        except (KeyError, ValueError) as err:
            raise CheckpointError(f"EAGLE-3 head config: {_reason(err)}") from None
        if head.aux_layer_ids is not None and any(not 0 <= i < n for i in head.aux_layer_ids):
            raise CheckpointError(f"EAGLE-3 aux layer ids {list(head.aux_layer_ids)} out of range for a {n}-layer target")
        dims = ModelDims(hidden_size=target.hidden_size, vocab_size=target.vocab_size, num_hidden_layers=n)
        return cls(
            draft_vocab_size=head.draft_vocab_size or head.vocab_size,
            target_hidden_size=aux_layer_width(dims, head),
            aux_layer_ids=head.aux_layer_ids,
            fc_input_width=int(extend_width(SpecAlgorithm.EAGLE3, dims, head).size or 0),
        )


def _reason(err: Exception) -> str:
    """One line for a config the schema's parser refuses."""
    if isinstance(err, KeyError):
        return f"missing key {err.args[0]!r}"
    if isinstance(err, ValidationError):
        first = err.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        return f"{where + ': ' if where else ''}{first['msg']}"
    return str(err)


class Eagle3Midlayer(nn.Module):
    """The EAGLE-3 decoder layer: attention over `2H` inputs, residual `h`."""

    def __init__(self, arch: LlamaArch, dtype: torch.dtype) -> None:
        super().__init__()
        h, eps = arch.hidden_size, arch.rms_norm_eps
        self.hidden_norm = RMSNorm(h, eps, dtype)
        self.input_layernorm = RMSNorm(h, eps, dtype)
        self.self_attn = SelfAttention(arch, 2 * h, dtype)
        self.post_attention_layernorm = RMSNorm(h, eps, dtype)
        self.mlp = MLP(arch, dtype)

    def forward(self, x: torch.Tensor, h: torch.Tensor, rope: Rope, attn: AttnBatch, cache: KVCache,
                attention_fn: AttentionFn, ops: TorchOps = TORCH_OPS) -> torch.Tensor:
        """`(T, 2H)` input (the normed embeddings beside the normed hidden, `Eagle3Head.forward`) and
        `(T, H)` hidden (the residual) -> `(T, H)` pre-norm output."""
        a = self.self_attn(x, rope, attn, cache, 0, attention_fn, ops, defer=True)
        h, normed = ops.add_norm(h, a, self.post_attention_layernorm)
        return ops.add(h, self.mlp(normed, ops, defer=True))


class Eagle3Head(EagleHeadBase):
    """EAGLE-3 head (a `DraftModel`) over a draft vocabulary.

    Args:
        arch: the head's config (hidden `H`, heads, MLP; `vocab_size` is the target's).
        settings: draft vocab, target hidden size, aux layers.
        target: the target; its embedding is used unless `own_embed`.
    """

    def __init__(
        self,
        arch: LlamaArch,
        settings: Eagle3Settings,
        target: LlamaForCausal,
        own_embed: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        attention_fn: AttentionFn = torch_attention,
    ) -> None:
        super().__init__(arch, target, dtype, attention_fn)
        h = arch.hidden_size
        if not own_embed and h != target.hidden_size:
            raise CheckpointError(
                f"EAGLE-3 head has no embed_tokens.weight and its hidden size {h} differs from the "
                f"target hidden size {target.hidden_size}, so the target embedding cannot be shared"
            )
        self.settings = settings
        with torch.device("meta"):
            self.fc = nn.Linear(settings.fc_input_width, h, bias=False, dtype=dtype)
            self.midlayer = Eagle3Midlayer(arch, dtype)
            self.norm = RMSNorm(h, arch.rms_norm_eps, dtype)
            self.lm_head = nn.Linear(h, settings.draft_vocab_size, bias=False, dtype=dtype)
            self.embed_tokens = nn.Embedding(target.vocab_size, h, dtype=dtype) if own_embed else None
            self.register_buffer("d2t", torch.zeros(settings.draft_vocab_size, dtype=torch.int64))
            self.register_buffer("t2d", torch.zeros(target.vocab_size, dtype=torch.bool))
        self.to_empty(device=torch.device(device)).requires_grad_(False)
        self.hidden_size, self.vocab_size, self.target_vocab_size = h, settings.draft_vocab_size, target.vocab_size

    @property
    def aux_layer_ids(self) -> tuple[int, ...] | None:
        """Target layers whose input the target must capture (None: its post-norm final hidden)."""
        return self.settings.aux_layer_ids

    @property
    def fc_input_width(self) -> int:
        """The width of the target capture `forward` expects (the width rule's `hidden_extend`)."""
        return self.settings.fc_input_width

    def load_state_dict_checked(self, state_dict: Mapping[str, torch.Tensor], source: str) -> None:
        """Load EAGLE-3 keys; a checkpoint without `d2t`/`t2d` is accepted only when the draft
        vocab equals the target's (identity map)."""
        sd = dict(state_dict)
        self._check_fc(sd, source)
        if self.vocab_size == self.target_vocab_size:
            sd.setdefault("d2t", torch.zeros(self.vocab_size, dtype=torch.int64))
            sd.setdefault("t2d", torch.ones(self.target_vocab_size, dtype=torch.bool))
        load_checked(self, sd, source)
        self._check_d2t(source)

    def _check_fc(self, sd: Mapping[str, torch.Tensor], source: str) -> None:
        fc = sd.get("fc.weight")
        s = self.settings
        if fc is not None and fc.dim() == 2 and fc.shape[1] != self.fc_input_width:
            raise CheckpointError(
                f"fc.weight in {source} has input width {fc.shape[1]}, expected target hidden "
                f"{s.target_hidden_size} x {s.num_aux} aux layers = {self.fc_input_width}"
            )

    def _check_d2t(self, source: str) -> None:
        target_ids = self.to_target_ids(torch.arange(self.vocab_size, device=self.d2t.device))
        if self.vocab_size and not bool(((target_ids >= 0) & (target_ids < self.target_vocab_size)).all()):
            raise CheckpointError(f"d2t in {source} maps draft ids outside the target vocab [0, {self.target_vocab_size})")

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden_in: torch.Tensor,
        positions: torch.Tensor,
        attn: AttnBatch,
        cache: KVCache,
        from_target: bool,
        ops: TorchOps = TORCH_OPS,
    ) -> torch.Tensor:
        """`(T,)` ids with `(T, target_hidden * num_aux)` target captures (`from_target`) or
        `(T, H)` own outputs -> `(T, H)` pre-norm output."""
        expected = self.fc_input_width if from_target else self.hidden_size
        if hidden_in.shape[-1] != expected:
            source = "target capture" if from_target else "draft hidden"
            raise ValueError(f"EAGLE-3 hidden_in ({source}) has width {hidden_in.shape[-1]}, expected {expected}")
        h = hidden_in.to(self.dtype)
        if from_target:
            h = ops.linear(self.fc, h)
        rope = ops.rope(self.rotary, positions, h.dtype)
        mid = self.midlayer
        x = ops.embed_norm_cat(input_ids, self.embed_table, mid.input_layernorm, h, mid.hidden_norm, self.dtype)
        return mid(x, h, rope, attn, cache, self.attention_fn, ops)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """`(draft_vocab, H)` output projection."""
        return self.lm_head.weight

    def compute_logits(self, h: torch.Tensor, ops: TorchOps = TORCH_OPS) -> torch.Tensor:
        """float32 `(T, draft_vocab)`: `lm_head(norm(h))`."""
        return self.logits(h, ops).float()

    def logits(self, h: torch.Tensor, ops: TorchOps = TORCH_OPS) -> torch.Tensor:
        """`compute_logits` in the head's dtype."""
        return ops.lm_head(self, ops.norm(h, self.norm))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """`target_id = draft_id + d2t[draft_id]` (any shape)."""
        return draft_ids + self.d2t[draft_ids]
