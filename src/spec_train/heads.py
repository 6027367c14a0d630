"""Trainable EAGLE-1 and EAGLE-3 heads, batched, with the training-time-test attention.

Parameter names are the checkpoint keys the loaders read (`fc.weight`, `layers.0.*` for EAGLE-1,
`midlayer.*`, `norm.weight`, `lm_head.weight` for EAGLE-3), so `state_dict()` is the checkpoint.
The target's embedding (and EAGLE-1's lm_head) are frozen tensors held outside the parameters.

Training-time test (EAGLE-3, SpecForge): the head is unrolled `k` steps over a whole sequence at
once. Row j of step 0 reads (token t_{j+1}, target hidden h_j) at position j, as the runtime's
draft-extend does. Row j of step i >= 1 reads (token t_{j+1+i}, the head's own step i-1 output of
row j) at position j + i, as the i-th draft step after an extend ending at row j does; it attends the
step-0 keys of rows 0..j (the extended prefix) and the step 1..i keys of row j itself (its ancestors
in the tree).
"""

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from spec_runtime.models.llama import MLP, LlamaArch, RMSNorm

__all__ = ["TrainHead", "head_from_checkpoint", "rope_tables", "ttt_mask"]


class _Attention(nn.Module):
    def __init__(self, in_width: int, hidden: int, heads: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(in_width, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(in_width, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(in_width, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: list[tuple],
                mask: torch.Tensor) -> torch.Tensor:
        """`(B, L, in)` -> `(B, L, hidden)`; appends this step's K/V to `cache` (one entry per step)."""
        b, n, _ = x.shape
        q = _rotate(self.q_proj(x).view(b, n, self.heads, self.head_dim), rope).transpose(1, 2)
        k = _rotate(self.k_proj(x).view(b, n, self.kv_heads, self.head_dim), rope).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        cache.append((k, v))
        keys = torch.cat([c[0] for c in cache], dim=2)
        values = torch.cat([c[1] for c in cache], dim=2)
        group = self.heads // self.kv_heads
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, self.heads * self.head_dim))


def _rotate(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    cos, sin = rope  # (B, L, D)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """`(B, L)` positions -> `(cos, sin)` `(B, L, head_dim)` (plain RoPE, rotate-half)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim))
    freqs = positions.float()[..., None] * inv
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def ttt_mask(length: int, step: int, device: torch.device) -> torch.Tensor:
    """Boolean `(L, L * (step + 1))`: query row j sees step-0 keys 0..j and the keys of row j of
    steps 1..step (True = attend)."""
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    diag = torch.eye(length, dtype=torch.bool, device=device)
    return torch.cat([causal] + [diag] * step, dim=1)


class _Layer(nn.Module):
    """EAGLE-1's layer 0 (no input norm) or EAGLE-3's midlayer (norms over embed and hidden, 2H attn)."""

    def __init__(self, eagle3: bool, hidden: int, inter: int, heads: int, kv_heads: int, head_dim: int,
                 eps: float) -> None:
        super().__init__()
        self.eagle3 = eagle3
        if eagle3:
            self.hidden_norm = RMSNorm(hidden, eps)
            self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = _Attention(2 * hidden if eagle3 else hidden, hidden, heads, kv_heads, head_dim)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        # the runtime's own norm and MLP (the same parameters, the torch ops); only the attention
        # differs, being the training-time test over whole sequences
        arch = LlamaArch("llama", hidden, inter, 1, heads, kv_heads, head_dim, vocab_size=1, rms_norm_eps=eps)
        self.mlp = MLP(arch, torch.float32)

    def forward(self, emb: torch.Tensor, h: torch.Tensor, rope: tuple, cache: list, mask: torch.Tensor
                ) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(h)], dim=-1) if self.eagle3 else h
        h = h + self.self_attn(x, rope, cache, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class TrainHead(nn.Module):
    """A trainable EAGLE-1 (`eagle3=False`) or EAGLE-3 head.

    Args:
        eagle3: EAGLE-3 layout (fc over `fc_in` aux width, midlayer, norm, own lm_head over
            `draft_vocab` ids) or EAGLE-1 (fc over `2 * hidden` with bias, layers.0, target lm_head).
        hidden, inter, heads, kv_heads, head_dim, eps, rope_theta: the head's architecture.
        embed: the target's frozen `(vocab, hidden)` embedding. lm_head: the target's `(vocab, hidden)`
            output matrix (EAGLE-1 only). fc_in: EAGLE-3 fc input width (target hidden x aux layers).
        draft_vocab: EAGLE-3 draft vocabulary size.
    """

    def __init__(self, eagle3: bool, hidden: int, inter: int, heads: int, kv_heads: int, head_dim: int,
                 eps: float, rope_theta: float, embed: torch.Tensor, lm_head: Optional[torch.Tensor] = None,
                 fc_in: Optional[int] = None, draft_vocab: Optional[int] = None) -> None:
        super().__init__()
        self.eagle3, self.head_dim, self.rope_theta = eagle3, head_dim, rope_theta
        self.register_buffer("frozen_embed", embed.detach().clone(), persistent=False)
        layer = _Layer(eagle3, hidden, inter, heads, kv_heads, head_dim, eps)
        if eagle3:
            self.fc = nn.Linear(fc_in, hidden, bias=False)
            self.midlayer = layer
            self.norm = RMSNorm(hidden, eps)
            self.lm_head = nn.Linear(hidden, draft_vocab, bias=False)
            self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.int64))
            self.register_buffer("t2d", torch.zeros(embed.shape[0], dtype=torch.bool))
        else:
            self.fc = nn.Linear(2 * hidden, hidden, bias=True)
            self.layers = nn.ModuleList([layer])
            self.register_buffer("frozen_lm_head", lm_head.detach().clone(), persistent=False)
        self._init_weights()

    def _init_weights(self) -> None:
        gen = torch.Generator().manual_seed(0)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                continue
            with torch.no_grad():
                std = 0.02 if "proj" in name or "lm_head" in name else 1.0 / math.sqrt(p.shape[-1])
                p.copy_(torch.randn(p.shape, generator=gen) * std if p.dim() == 2 else torch.zeros(p.shape))

    @property
    def layer(self) -> _Layer:
        """The one decoder layer."""
        return self.midlayer if self.eagle3 else self.layers[0]

    def step(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, cache: list,
             mask: torch.Tensor, from_target: bool) -> torch.Tensor:
        """One unrolled step: `(B, L)` ids, `(B, L, width)` hidden, `(B, L)` positions -> `(B, L, H)`."""
        emb = F.embedding(ids, self.frozen_embed).to(hidden.dtype)
        if self.eagle3:
            h = self.fc(hidden) if from_target else hidden
            emb_in = emb
        else:
            h = self.fc(torch.cat([emb, hidden], dim=-1))
            emb_in = None
        rope = rope_tables(positions, self.head_dim, self.rope_theta, h.dtype)
        return self.layer(emb_in, h, rope, cache, mask)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Draft logits (EAGLE-3: draft vocabulary, after `norm`; EAGLE-1: target lm_head, no norm)."""
        if self.eagle3:
            return self.lm_head(self.norm(h))
        return F.linear(h, self.frozen_lm_head.to(h.dtype))

    def unroll(self, ids: torch.Tensor, target_hidden: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Training-time test over `(B, L)` shifted ids (`ids[:, j] = t_{j+1}`) and `(B, L, width)`
        target hidden states: the `(B, L, H)` output of each of `steps` steps (see the module doc)."""
        b, n = ids.shape
        base = torch.arange(n, device=ids.device)[None].expand(b, n)
        cache: list = []
        outs: list[torch.Tensor] = []
        hidden, from_target = target_hidden, True
        for i in range(steps):
            step_ids = F.pad(ids[:, i:], (0, min(i, n)), value=0)  # row j reads t_{j+1+i}; tail rows are masked out
            mask = ttt_mask(n, i, ids.device)
            hidden = self.step(step_ids, hidden, base + i, cache, mask, from_target)
            outs.append(hidden)
            from_target = False
        return outs


def head_from_checkpoint(directory, target, algorithm: str) -> TrainHead:
    """A `TrainHead` holding the `algorithm` (EAGLE or EAGLE3) checkpoint in `directory` (config.json
    + model.safetensors), for the `transformers` target `target` (its embedding and lm_head).

    Used to check the runtime's drafts against the training-time computation, and to go on training."""
    from pathlib import Path

    from spec_schema import ModelDims, extend_width, traits
    from spec_schema.model_dirs import read_config
    from spec_train.checkpoint import load_draft_tensors

    d = Path(directory)
    cfg = read_config(d)
    eagle3 = traits(algorithm).has_aux_layers  # the EAGLE-3 layout: fc over the aux layers, midlayer, own lm_head
    heads = cfg["num_attention_heads"]
    # the fc input width by the schema's parser and width rule (aux layers named or defaulted)
    fc_in = extend_width(algorithm, ModelDims.from_hf_config(target.config, dtype=torch.float32),
                         ModelDims.from_hf_config(cfg, dtype=torch.float32)).size if eagle3 else None
    head = TrainHead(
        eagle3, cfg["hidden_size"], cfg["intermediate_size"], heads, cfg.get("num_key_value_heads") or heads,
        cfg.get("head_dim") or cfg["hidden_size"] // heads, cfg.get("rms_norm_eps", 1e-6),
        float(cfg.get("rope_theta") or 10000.0), target.get_input_embeddings().weight.float(),
        lm_head=None if eagle3 else target.get_output_embeddings().weight.float(),
        fc_in=fc_in,
        draft_vocab=cfg.get("draft_vocab_size"),
    )
    sd = load_draft_tensors(d / "model.safetensors")
    head.load_state_dict(sd, strict=True)
    return head.eval()
