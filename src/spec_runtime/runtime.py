"""The runtime context the phases run in: models, KV caches, the spec config, counters, randomness."""

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from spec_schema import DraftExtendInput, DraftInput, ModelDims, SpecAlgorithm, SpecConfig, hidden_width

from . import faults
from .kv_cache import KVCache, RequestTable
from .models.base import DraftModel
from .models.llama import LlamaForCausal


@dataclass
class Counters:
    """What the runtime did, for tests and stats (STANDALONE must keep the hidden-state ones at 0)."""

    hidden_captured_bytes: int = 0  # target hidden states captured for the draft (prefill + verify)
    hidden_copied_bytes: int = 0  # hidden states gathered/copied between phases
    hidden_allocs: int = 0  # hidden-state tensors allocated for the draft
    iterations: int = 0
    target_forwards: int = 0
    draft_forwards: int = 0

    def add_hidden(self, t: Optional[torch.Tensor], copied: bool = False) -> None:
        """Count a hidden-state tensor produced for the draft (None counts nothing)."""
        if t is None:
            return
        self.hidden_allocs += 1
        nbytes = t.numel() * t.element_size()
        if copied:
            self.hidden_copied_bytes += nbytes
        else:
            self.hidden_captured_bytes += nbytes


@dataclass
class BatchSampling:
    """Per-request sampling parameters of the live batch, in batch order."""

    temperature: torch.Tensor  # (bs,) float32, 0 = greedy
    top_k: torch.Tensor  # (bs,) int64, <= 0 = off
    top_p: torch.Tensor  # (bs,) float32
    all_greedy: bool

    @classmethod
    def greedy(cls, bs: int, device: Any) -> "BatchSampling":
        """Every request greedy."""
        return cls(
            torch.zeros(bs, device=device),
            torch.zeros(bs, dtype=torch.int64, device=device),
            torch.ones(bs, device=device),
            True,
        )

    @classmethod
    def from_params(cls, params: list[Any], device: Any) -> "BatchSampling":
        """From a list of `SamplingParams` (one per request)."""
        temp = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
        top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
        return cls(temp, top_k, top_p, all(p.temperature == 0 for p in params))


def build_spec_config(
    algorithm: SpecAlgorithm | str,
    target: LlamaForCausal,
    draft: DraftModel,
    num_steps: int,
    topk: int,
    num_draft_tokens: int,
) -> SpecConfig:
    """The `SpecConfig` of a loaded target and draft: dims from their configs, dtypes as loaded."""
    t_dims = ModelDims.from_hf_config(target.hf_config, dtype=target.dtype)
    d_dims = ModelDims.from_hf_config(draft.hf_config, dtype=draft.dtype)
    if SpecAlgorithm(algorithm) == SpecAlgorithm.EAGLE3:
        # The head's own config names the target width it reads; the target's layer count places
        # the default aux layers.
        ids = getattr(draft, "aux_layer_ids", None)
        d_dims = d_dims.model_copy(update={"aux_layer_ids": tuple(ids) if ids else d_dims.aux_layer_ids})
    else:
        d_dims = d_dims.model_copy(update={"draft_vocab_size": None, "aux_layer_ids": None,
                                           "num_aux_hidden_states": None, "target_hidden_size": None})
    return SpecConfig(
        algorithm=algorithm,
        target=t_dims,
        draft=d_dims,
        num_steps=num_steps,
        topk=topk,
        num_draft_tokens=num_draft_tokens,
    )


def _faulty_idle_draft(rt: "Runtime", idle: DraftInput) -> DraftInput:
    """Bug-zoo versions of the idle DraftInput (never used in normal runs)."""
    width = None
    if faults.active("idle_verify_target_width"):
        width = rt.spec_config.target.hidden_size
    if faults.active("draft_idle_extend_width"):
        width = hidden_width(rt.spec_config, "extend").size or rt.spec_config.target.hidden_size
    if width is not None:
        idle = dataclasses.replace(idle, hidden_states=torch.zeros(0, width, dtype=rt.draft.dtype, device=rt.device))
    if faults.active("idle_dtype_rank"):
        idle = dataclasses.replace(idle, topk_index=torch.zeros(0, dtype=torch.int32, device=rt.device))
    return idle


@dataclass
class Runtime:
    """Everything a phase function needs; `spec_config` is what the boundary checks read."""

    target: LlamaForCausal
    draft: DraftModel
    spec_config: SpecConfig
    target_cache: KVCache
    draft_cache: KVCache
    requests: RequestTable
    generator: torch.Generator
    sample_drafts: bool = True  # STANDALONE chains at temperature > 0 sample drafts from the draft
    counters: Counters = field(default_factory=Counters)

    @property
    def device(self) -> torch.device:
        """Where the models and caches live."""
        return self.target_cache.device

    @property
    def aux_layer_ids(self) -> Optional[tuple[int, ...]]:
        """Target layers captured for an EAGLE-3 head with aux on, else None."""
        if self.spec_config.target_capture != "aux":
            return None
        if faults.active("aux_count_3"):  # bug zoo: the aux count hard-coded to 3
            n = self.target.num_layers
            return (2, n // 2, n - 3)
        return self.spec_config.aux_layer_ids()

    @property
    def sampled_chain(self) -> bool:
        """Whether drafts are sampled from the draft's distribution (STANDALONE, topk 1)."""
        cfg = self.spec_config
        return self.sample_drafts and cfg.algorithm == SpecAlgorithm.STANDALONE and cfg.topk == 1

    def idle_draft_input(self) -> DraftInput:
        """The zero-row DraftInput of this runtime (with `draft_probs` when chains are sampled)."""
        idle = DraftInput.create_idle(self.spec_config, self.device, sampled_chain=self.sampled_chain)
        return _faulty_idle_draft(self, idle) if faults._ACTIVE else idle

    def idle_extend_input(self) -> DraftExtendInput:
        """The zero-row DraftExtendInput (verify's output when every request finished)."""
        idle = DraftExtendInput.create_idle(self.spec_config, self.device)
        if faults.active("eagle3_aux_hidden_x3"):  # bug zoo: hidden_size * 3
            width = self.spec_config.draft.hidden_size * 3
            idle = dataclasses.replace(idle, hidden_states=torch.zeros(0, width, dtype=self.target.dtype))
        return idle

    def capture(self, hidden: torch.Tensor, aux: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The target rows the draft-extend phase reads (by the traits table), or None."""
        kind = self.spec_config.target_capture
        if kind == "none":
            return hidden if faults.active("standalone_captures_hidden") else None
        return aux if kind == "aux" else hidden

    def uniform(self, *shape: int) -> torch.Tensor:
        """Uniform [0, 1) draws from the runtime's generator."""
        return torch.rand(shape, generator=self.generator, device=self.device)

    @classmethod
    def create(
        cls,
        target: LlamaForCausal,
        draft: DraftModel,
        algorithm: SpecAlgorithm | str,
        *,
        num_steps: int,
        topk: int,
        num_draft_tokens: int,
        max_batch_size: int = 8,
        max_context: int = 512,
        seed: int = 0,
    ) -> "Runtime":
        """Size both KV caches for `max_batch_size` requests of `max_context` tokens plus drafts."""
        config = build_spec_config(algorithm, target, draft, num_steps, topk, num_draft_tokens)
        device = next(target.parameters()).device
        t_slots = max_batch_size * (max_context + num_draft_tokens)
        d_slots = max_batch_size * (max_context + topk * num_steps)
        target_cache = KVCache(target.num_layers, target.num_kv_heads, target.head_dim, t_slots,
                               max_batch_size, max_context, target.dtype, device)
        draft_cache = KVCache(draft.num_layers, draft.num_kv_heads, draft.head_dim, d_slots,
                              max_batch_size, max_context, draft.dtype, device)
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        return cls(target, draft, config, target_cache, draft_cache, RequestTable(max_batch_size), gen)
