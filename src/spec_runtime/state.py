"""The state the phases run in: models, KV caches, the spec config, counters, randomness, the executor.

`runtime.Runtime` adds the construction (`Runtime.create`); the phase modules and the executors
import this module only, so that the executors can import the phases and `runtime` both.
"""

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from spec_schema import DraftExtendInput, DraftInput, SpecAlgorithm, SpecConfig, hidden_width

from . import faults
from .core_types import CoreOps
from .executor import Executor
from .kv_cache import KVCache, RequestTable
from .models.base import DraftModel
from .models.llama import LlamaForCausal
from .sampling import probs_from_logits_batched
from .tree import build_tree

__all__ = ["BatchSampling", "Counters", "RuntimeState", "SimulatedAccept", "VerifyEmit"]


@dataclass
class Counters:
    """What the runtime did, for tests and stats (STANDALONE must keep the hidden-state ones at 0)."""

    hidden_captured_bytes: int = 0  # target hidden states captured for the draft (prefill + verify)
    hidden_copied_bytes: int = 0  # hidden states gathered/copied between phases
    hidden_allocs: int = 0  # hidden-state tensors allocated for the draft
    iterations: int = 0

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
        return cls(torch.zeros(bs, device=device), torch.zeros(bs, dtype=torch.int64, device=device),
                   torch.ones(bs, device=device), True)

    @classmethod
    def from_params(cls, params: list[Any], device: Any) -> "BatchSampling":
        """From a list of `SamplingParams` (one per request).

        The tensors are read-only, so batches with the same parameters share them: a repeated
        batch makes no host-to-device copy (each such copy waits for the GPU to drain)."""
        key = (tuple((p.temperature, p.top_k, p.top_p) for p in params), str(device))
        hit = _SAMPLING_CACHE.get(key)
        if hit is not None:
            return hit
        temp = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
        top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
        out = cls(temp, top_k, top_p, all(p.temperature == 0 for p in params))
        if len(_SAMPLING_CACHE) >= 256:
            _SAMPLING_CACHE.clear()
        _SAMPLING_CACHE[key] = out
        return out


_SAMPLING_CACHE: dict[tuple, BatchSampling] = {}


@dataclass
class SimulatedAccept:
    """Benchmark-only acceptance override: every verify accepts `length` tokens per request (bonus
    included) regardless of the target, so real draft and verify passes run at a chosen accept length.
    A fractional length draws each request's count per iteration as floor or ceil, averaging `length`."""

    length: float
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.length >= 1.0:
            raise ValueError(f"simulated accept length must be >= 1 (the bonus token), got {self.length}")
        self._gens: dict[torch.device, torch.Generator] = {}

    def _gen(self, device: Any) -> torch.Generator:
        device = torch.device(device)
        if device not in self._gens:
            self._gens[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._gens[device]

    def get_state(self, device: Any) -> torch.Tensor:
        """The generator state on `device` (a host tensor; restoring it replays the same draws)."""
        return self._gen(device).get_state()

    def set_state(self, device: Any, state: torch.Tensor) -> None:
        self._gen(device).set_state(state)

    def counts(self, bs: int, max_tokens: int, device: Any = "cpu") -> torch.Tensor:
        """(bs,) int64 tokens to accept per request this iteration, within [1, max_tokens], drawn on
        `device` (no host-to-device copy, so no sync)."""
        gen = self._gen(device)
        base = int(self.length)
        extra = (torch.rand(bs, generator=gen, device=device) < (self.length - base)).long()
        return (base + extra).clamp(1, max_tokens)


@dataclass(frozen=True)
class VerifyEmit:
    """Host copies of what a verify emits, per request: the tokens, their count after the stops, and
    whether the request finished. The same values as the `VerifyOutput`'s tensors, read in verify's
    one host read, so the engine needs no second read of the device. `output` is the VerifyOutput
    they belong to (the engine matches it by identity)."""

    output: Any
    tokens: list[list[int]]
    counts: list[int]
    finished: list[bool]


def _faulty_idle_draft(rt: "RuntimeState", idle: DraftInput) -> DraftInput:
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
class RuntimeState:
    """Everything a phase function needs; `spec_config` is what the boundary checks read.

    `runtime.Runtime` is this state plus its construction (`Runtime.create`: cache sizes, the
    executor); the phases and the executors read the state only."""

    target: LlamaForCausal
    draft: DraftModel
    spec_config: SpecConfig
    target_cache: KVCache
    draft_cache: KVCache
    requests: RequestTable
    generator: torch.Generator
    sample_drafts: bool = True  # STANDALONE chains at temperature > 0 sample drafts from the draft
    counters: Counters = field(default_factory=Counters)
    executor: str = "eager"  # one of runtime.EXECUTORS
    runner: Optional[Executor] = None  # set by Runtime.create: the executor the phases run their cores on
    reserved_slots: dict[str, torch.Tensor] = field(default_factory=dict)  # static path: outside the pools
    simulate_accept: Optional[SimulatedAccept] = None  # benchmarks only
    last_emit: Optional["VerifyEmit"] = None  # the last verify's host copies (`VerifyEmit`)
    _idle: dict = field(default_factory=dict, repr=False)  # idle inputs, built once (zero-row tensors)

    @property
    def static(self) -> bool:
        """Whether the phases run on the static-buffer path (executor "static" or "cuda_graph")."""
        return self.executor != "eager"

    def core_ops(self) -> CoreOps:
        """The eager path's ops: reference models and validating functions."""
        return CoreOps(self.spec_config, self.target, self.draft, self.target_cache, self.draft_cache,
                       self.aux_layer_ids, self.capture, build_tree, probs_from_logits_batched)

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
        """The zero-row DraftInput of this runtime (with `draft_probs` when chains are sampled); built
        once (the last step of every run hands it on: a dozen allocations fewer)."""
        if faults._ACTIVE:
            idle = DraftInput.create_idle(self.spec_config, self.device, sampled_chain=self.sampled_chain)
            return _faulty_idle_draft(self, idle)
        key = ("draft", self.sampled_chain)
        if key not in self._idle:
            self._idle[key] = DraftInput.create_idle(self.spec_config, self.device, sampled_chain=self.sampled_chain)
        return self._idle[key]

    def idle_extend_input(self) -> DraftExtendInput:
        """The zero-row DraftExtendInput (verify's output when every request finished); built once."""
        if faults.active("eagle3_aux_hidden_x3"):  # bug zoo: hidden_size * 3
            width = self.spec_config.draft.hidden_size * 3
            idle = DraftExtendInput.create_idle(self.spec_config, self.device)
            return dataclasses.replace(idle, hidden_states=torch.zeros(0, width, dtype=self.target.dtype))
        if "extend" not in self._idle:
            self._idle["extend"] = DraftExtendInput.create_idle(self.spec_config, self.device)
        return self._idle["extend"]

    def capture(self, hidden: torch.Tensor, aux: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The target rows the draft-extend phase reads (by the traits table), or None."""
        kind = self.spec_config.target_capture
        if kind == "none":
            return hidden if faults.active("standalone_captures_hidden") else None
        return aux if kind == "aux" else hidden

    def uniform(self, *shape: int) -> torch.Tensor:
        """Uniform [0, 1) draws from the runtime's generator."""
        return torch.rand(shape, generator=self.generator, device=self.device)
