"""Per-algorithm draft models under training: how each is built from the target, what its loss is,
and how it is written in its public layout."""

from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn
from torch.profiler import record_function

from spec_runtime.models.base import CheckpointError
from spec_runtime.models.loading import TOKEN_MAP_FILE
from spec_schema import ModelDims, SpecAlgorithm, extend_width
from spec_schema import default_aux_layer_ids as schema_default_aux_layer_ids
from spec_train import checkpoint as ckpt
from spec_train.config import TrainConfig, TrainError
from spec_train.data import Sequences
from spec_train.heads import TrainHead
from spec_train.losses import (
    distill_loss,
    feature_loss,
    head_step_loss,
    restrict_to_draft_vocab,
    step_mask,
    target_distribution,
    vocab_map,
)
from spec_train.token_map import hot_token_ids

__all__ = ["DraftBuilder", "default_aux_layer_ids"]


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """The EAGLE-3 default of the schema (`spec_schema.default_aux_layer_ids`), as a list."""
    return list(schema_default_aux_layer_ids(num_layers))


def _theta(cfg: dict[str, Any]) -> float:
    return float(cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta") or 10000.0)


class DraftBuilder(nn.Module):
    """The trainable draft of one algorithm and its loss against the frozen target `model`."""

    def __init__(self, cfg: TrainConfig, target_cfg: dict[str, Any], model: Any, seqs: Sequences,
                 device: torch.device) -> None:
        super().__init__()
        self.cfg, self.target_cfg = cfg, target_cfg
        object.__setattr__(self, "target", model)  # frozen; not a submodule (not saved, not optimised)
        self.algorithm = cfg.algorithm
        self.traits = SpecAlgorithm(cfg.algorithm).traits
        if not self.traits.draft_reads_hidden:  # an ordinary LM (STANDALONE), not a head
            self.draft = self._build_standalone(model)
        else:
            self.draft = self._build_head(model, seqs)
        if cfg.init_from is not None:
            self._load_initial(cfg.init_from)
        self.draft.to(device)
        self.hot_token_ids = None if cfg.token_map_size is None else hot_token_ids(
            seqs.continuation_tokens(), target_cfg["vocab_size"], cfg.token_map_size)

    def _load_initial(self, directory: Path) -> None:
        """Start from the weights of a saved draft (its public layout); a draft of another algorithm
        or shape is a one-line `TrainError` naming the file. An EAGLE-3 head takes the draft vocabulary
        counted on this run's data (`_remap_draft_vocab`) unless `keep_draft_vocab`."""
        path = Path(directory) / "model.safetensors"
        if not path.is_file():
            raise TrainError(f"--init-from {directory}: no model.safetensors")
        try:
            saved = ckpt.load_draft_tensors(path)
        except CheckpointError as err:  # truncated or garbage: the runtime reader's one line
            raise TrainError(f"--init-from: {err}") from None
        mine = self.draft.state_dict()
        remap = self.traits.draft_vocab_map == "d2t" and not self.cfg.keep_draft_vocab
        per_token = {"lm_head.weight", "d2t"} if remap else set()  # one row per draft token: any count
        missing = sorted(set(mine) - set(saved) - ({"lm_head.weight"} if self.algorithm == "STANDALONE" else set()))
        extra = sorted(set(saved) - set(mine))
        wrong = sorted(k for k in set(saved) & set(mine)
                       if saved[k].shape[k in per_token:] != mine[k].shape[k in per_token:])
        if missing or extra or wrong:
            raise TrainError(f"--init-from {path} is not a {self.algorithm} draft of this shape "
                             f"(missing {missing[:3]}, unexpected {extra[:3]}, other shapes {wrong[:3]})")
        if remap:
            saved = _remap_draft_vocab(saved, self.draft, self.target.get_output_embeddings().weight, path)
        self.draft.load_state_dict(saved, strict=False)
        if self.algorithm == "STANDALONE":
            self.draft.tie_weights()

    # ---- construction ----------------------------------------------------------------------

    def _fc_in(self) -> int:
        """The EAGLE-3 fc input width: the schema's width rule for the target and these aux layers."""
        t = self.target_cfg
        target = ModelDims(hidden_size=t["hidden_size"], vocab_size=t["vocab_size"])
        head = ModelDims(hidden_size=t["hidden_size"], vocab_size=t["vocab_size"], aux_layer_ids=tuple(self.aux_layer_ids))
        return int(extend_width(self.algorithm, target, head).size or 0)

    def _build_head(self, model: Any, seqs: Sequences) -> TrainHead:
        t, cfg = self.target_cfg, self.cfg
        heads = t["num_attention_heads"]
        head_dim = t.get("head_dim") or t["hidden_size"] // heads
        eagle3 = self.traits.has_aux_layers  # the EAGLE-3 layout
        embed = model.get_input_embeddings().weight.float()
        self.aux_layer_ids = list(cfg.aux_layer_ids or default_aux_layer_ids(t["num_hidden_layers"]))
        dv = cfg.draft_vocab_size
        head = TrainHead(
            eagle3, t["hidden_size"], cfg.head_intermediate_size or t["intermediate_size"], heads,
            t.get("num_key_value_heads") or heads, head_dim, t.get("rms_norm_eps", 1e-6), _theta(t), embed,
            lm_head=model.get_output_embeddings().weight.float() if self.traits.shares_lm_head else None,
            fc_in=self._fc_in() if eagle3 else None, draft_vocab=dv,
        )
        if self.traits.draft_vocab_map == "d2t":
            d2t, t2d = vocab_map(seqs.continuation_tokens(), t["vocab_size"], dv)
            with torch.no_grad():
                head.d2t.copy_(d2t)
                head.t2d.copy_(t2d)
                # Start from the target's own read-out: its final norm and its output rows of the
                # draft vocabulary (the head's output plays the target's last residual stream).
                head.lm_head.weight.copy_(model.get_output_embeddings().weight.float().cpu()[t2d])
                norm = getattr(getattr(model, "model", None), "norm", None)
                if norm is not None:
                    head.norm.weight.copy_(norm.weight.float().cpu())
        return head

    def _build_standalone(self, model: Any) -> nn.Module:
        from transformers import LlamaConfig, LlamaForCausalLM

        t, cfg = self.target_cfg, self.cfg
        if cfg.draft_hidden_size % cfg.draft_heads or cfg.draft_heads % cfg.draft_kv_heads:
            raise TrainError(f"--draft-hidden-size {cfg.draft_hidden_size} must be a multiple of --draft-heads "
                             f"{cfg.draft_heads}, itself a multiple of --draft-kv-heads {cfg.draft_kv_heads}")
        config = LlamaConfig(
            hidden_size=cfg.draft_hidden_size, intermediate_size=cfg.draft_intermediate_size,
            num_hidden_layers=cfg.draft_layers, num_attention_heads=cfg.draft_heads,
            num_key_value_heads=cfg.draft_kv_heads, head_dim=cfg.draft_hidden_size // cfg.draft_heads,
            vocab_size=t["vocab_size"], rms_norm_eps=t.get("rms_norm_eps", 1e-6), rope_theta=_theta(t),
            max_position_embeddings=t.get("max_position_embeddings", 2048), tie_word_embeddings=True,
            bos_token_id=t.get("bos_token_id"), eos_token_id=t.get("eos_token_id"),
            pad_token_id=t.get("pad_token_id"), initializer_range=0.02,
        )
        torch.manual_seed(self.cfg.seed)
        student = LlamaForCausalLM(config)
        with torch.no_grad():
            student.get_input_embeddings().weight.copy_(_projected_embedding(
                model.get_input_embeddings().weight.float().cpu(), cfg.draft_hidden_size))
        return student

    # ---- training --------------------------------------------------------------------------

    def target_pass(self, ids: torch.Tensor, logits: bool = True
                    ) -> tuple[Optional[torch.Tensor], torch.Tensor, Optional[torch.Tensor]]:
        """The frozen target on right-padded `(B, L)` ids: (what the draft reads: EAGLE-3 the aux layers'
        hidden states concatenated, EAGLE-1 the final one, STANDALONE None; the final post-norm hidden
        state; the logits, `lm_head` over the final hidden state, or None when `logits` is false).

        Every row's real tokens come first, so under causal attention no real position sees a pad and
        the target runs without an attention mask (the outputs of real positions are the masked run's,
        bit for bit on CPU in float32; transformers then skips its mask build, whose padding test reads
        the mask on the host, and SDPA may take its causal kernel)."""
        # use_cache stays on: without a mask and without a cache, transformers reads the positions on the host
        # to look for packed sequences (a sync); its empty cache only holds references to each layer's K/V
        out = self.target(input_ids=ids, output_hidden_states=True, **({} if logits else {"logits_to_keep": 1}))
        hs = out.hidden_states
        final = hs[-1]
        feat = None
        if self.traits.draft_reads_hidden:
            feat = torch.cat([hs[i] for i in self.aux_layer_ids], dim=-1) if self.traits.target_capture == "aux" else final
        return feat, final, out.logits if logits else None

    def loss(self, ids: torch.Tensor, lens: torch.Tensor, prompt_lens: torch.Tensor,
             cached: Optional[tuple[Optional[torch.Tensor], torch.Tensor]] = None
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The batch loss (a scalar) and per-step statistics (`loss`, `acc_<step>`) as 0-d tensors: reading
        them is the caller's one host sync per step (`trainer._Pending`), none happens in here.

        `cached`: the batch's (feature, final hidden) rows from a `TargetCache`, instead of running the
        target (its logits are then `lm_head` over the final hidden state, as the target computes them).
        The draft runs without an attention mask, as the target does (`target_pass`)."""
        length = ids.shape[1]
        pad = torch.arange(length, device=ids.device)[None] < lens[:, None]
        with torch.no_grad(), record_function("target"):
            if cached is None:
                feat, final, logits = self.target_pass(ids)
            else:
                (feat, final), logits = cached, self.target.get_output_embeddings()(cached[1])
            if feat is not None and self.traits.draft_vocab_map == "d2t":  # EAGLE-3: its vocabulary's share only
                logp, in_vocab = restrict_to_draft_vocab(logits, self.draft.t2d, self._draft_ids())
            else:
                logp, in_vocab = torch.log_softmax(logits.float(), dim=-1), None
            del logits  # the full-vocabulary logits: not kept alive through the draft's forward and backward
        with record_function("draft_loss"):
            if feat is None:
                student = self.draft(input_ids=ids).logits  # use_cache on: see target_pass
                total, n, correct = distill_loss(student, logp, pad)
                loss = total / n.clamp(min=1)
                return loss, {"loss": loss.detach(), "acc_0": correct / n.clamp(min=1)}
            return self._head_loss(ids, lens, prompt_lens, feat, final, logp, in_vocab)

    def _draft_ids(self) -> torch.Tensor:
        """The target ids of the EAGLE-3 draft vocabulary (where `t2d` is true, ascending), found once per
        content of `t2d` (its version counter moves on every in-place write, a state-dict load included)."""
        t2d = self.draft.t2d
        key = (t2d.data_ptr(), t2d._version)
        if getattr(self, "_draft_ids_key", None) != key:
            self._draft_ids_cache = t2d.nonzero().flatten()  # the run's one host sync for it
            self._draft_ids_key = key
        return self._draft_ids_cache

    def _head_loss(self, ids: torch.Tensor, lens: torch.Tensor, prompt_lens: torch.Tensor, feat: torch.Tensor,
                   final: torch.Tensor, logp: torch.Tensor, in_vocab: Optional[torch.Tensor]
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """`logp`: the target's log-probabilities over the draft's vocabulary; `in_vocab`: EAGLE-3's rows
        whose target argmax the draft vocabulary holds (`restrict_to_draft_vocab`), else None."""
        shifted = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=0)  # row j reads t_{j+1}
        outs = self.draft.unroll(shifted, feat, self.cfg.ttt_steps)
        prob, top = target_distribution(logp)
        del logp
        loss = ids.new_zeros((), dtype=torch.float32)
        accs: dict[str, torch.Tensor] = {}
        for i, h in enumerate(outs):
            mask = step_mask(lens, prompt_lens, ids.shape[1], i)
            if in_vocab is not None:
                mask = mask & torch.nn.functional.pad(in_vocab[:, i + 1:], (0, min(i + 1, ids.shape[1])), value=False)
            total, n, correct = head_step_loss(self.draft.logits(h), prob, top, mask, i)
            step_loss = total / n.clamp(min=1)
            if self.traits.target_capture == "final" and self.cfg.feature_loss:  # EAGLE-1: features fed back
                step_loss = step_loss + self.cfg.feature_loss * feature_loss(h, final, mask, i) / n.clamp(min=1)
            loss = loss + self.cfg.ttt_decay ** i * step_loss
            accs[f"acc_{i}"] = correct / n.clamp(min=1)
        return loss, {**accs, "loss": loss.detach()}

    # ---- output ----------------------------------------------------------------------------

    def public_tensors(self) -> dict[str, torch.Tensor]:
        """The checkpoint tensors in the public key names."""
        sd = self.draft.state_dict()
        if not self.traits.draft_reads_hidden:
            sd.pop("lm_head.weight", None)  # tied to model.embed_tokens.weight
        return dict(sd)

    def public_config(self) -> dict[str, Any]:
        """The checkpoint's config.json."""
        t, cfg = self.target_cfg, self.cfg
        if not self.traits.draft_reads_hidden:
            out = self.draft.config.to_dict()
            out["architectures"] = ["LlamaForCausalLM"]
            return out
        heads = t["num_attention_heads"]
        return ckpt.eagle_config(
            self.traits.has_aux_layers, t, t["hidden_size"], cfg.head_intermediate_size or t["intermediate_size"],
            heads, t.get("num_key_value_heads") or heads, t.get("head_dim") or t["hidden_size"] // heads,
            draft_vocab=cfg.draft_vocab_size, aux_layer_ids=getattr(self, "aux_layer_ids", None),
        )

    def save_public(self, directory: Path) -> None:
        """Write config.json + model.safetensors in the algorithm's public layout (and an EAGLE head's
        `token_map.pt` when `token_map_size` is set)."""
        dtype = torch.bfloat16 if self.cfg.save_dtype == "bfloat16" else torch.float32
        ckpt.save_draft(directory, self.public_config(), self.public_tensors(), dtype)
        if self.hot_token_ids is not None:
            ids = self.hot_token_ids
            ckpt.atomic_write(directory / TOKEN_MAP_FILE, lambda p: torch.save(ids, p))


def _remap_draft_vocab(saved: dict[str, torch.Tensor], head: TrainHead, target_rows: torch.Tensor,
                       path: Path) -> dict[str, torch.Tensor]:
    """`saved` (an EAGLE-3 head's tensors) moved onto `head`'s draft vocabulary (`d2t`/`t2d`, counted on
    this run's data; the saved one may have another size): the `lm_head` row of a token in both
    vocabularies is the saved row, moved to the token's new draft index. A token new to the vocabulary
    starts from the target's output row (`target_rows`, what a fresh run starts from) carried through
    the saved head's drift: the linear map that best takes the target's rows of the saved vocabulary
    to the saved rows (least squares). Unmapped target rows outscore the trained ones: with the shipped
    SmolLM2 head on a 40-prompt cut of the mix (3775 of 8192 tokens new) they took the top-1 agreement
    with the target before any step from 0.85 (saved vocabulary) to 0.10; mapped rows give 0.84."""
    rows, d2t = saved["lm_head.weight"], saved["d2t"].long()
    vocab = head.t2d.numel()
    old_ids = torch.arange(d2t.numel()) + d2t
    if rows.shape[0] != d2t.numel() or old_ids.min() < 0 or old_ids.max() >= vocab or old_ids.unique().numel() != d2t.numel():
        raise TrainError(f"--init-from {path}: d2t ({d2t.numel()} offsets, lm_head {rows.shape[0]} rows) does not "
                         f"map each row to its own id of the target's {vocab} tokens")
    old_index = torch.full((vocab,), -1, dtype=torch.int64)
    old_index[old_ids] = torch.arange(d2t.numel())
    new_ids = torch.arange(head.d2t.numel()) + head.d2t.cpu()
    source = old_index[new_ids]
    kept = source >= 0
    out = torch.empty(new_ids.numel(), rows.shape[1], dtype=torch.float32)
    out[kept] = rows[source[kept]].float()
    if not kept.all():
        target_rows = target_rows.detach().cpu().double()
        drift = torch.linalg.lstsq(target_rows[old_ids], rows.double()).solution
        out[~kept] = (target_rows[new_ids[~kept]] @ drift).float()
    return {**saved, "lm_head.weight": out, "d2t": head.d2t.cpu().clone(), "t2d": head.t2d.cpu().clone()}


def _projected_embedding(embed: torch.Tensor, width: int) -> torch.Tensor:
    """The target embedding projected on its `width` leading principal directions, rescaled to the
    0.02-std scale a fresh Llama expects: a STANDALONE draft starts with the target's token geometry."""
    if width >= embed.shape[1]:
        out = torch.zeros(embed.shape[0], width)
        out[:, :embed.shape[1]] = embed
    else:
        centered = embed - embed.mean(0, keepdim=True)
        _, _, v = torch.linalg.svd(centered[:: max(1, embed.shape[0] // 8192)], full_matrices=False)
        out = centered @ v[:width].T
    return out * (0.02 / out.std().clamp(min=1e-8))
