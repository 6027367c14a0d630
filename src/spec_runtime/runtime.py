"""The runtime context the phases run in: models, KV caches, the spec config, counters, randomness."""

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from spec_schema import DraftExtendInput, DraftInput, ModelDims, SpecAlgorithm, SpecConfig, hidden_width

from . import faults
from .kv_cache import KVCache, RequestTable
from .models.base import DraftModel
from .models.llama import LlamaForCausal
from .sampling import probs_from_logits_batched
from .tree import build_tree

EXECUTORS = ("eager", "static", "cuda_graph")
"""`eager`: the reference path on live tensors. `static`: the static-buffer path (bucketed, padded)
with eager calls, runnable on CPU. `cuda_graph`: the same path replayed from captured CUDA graphs."""


class SetupError(ValueError):
    """A setting does not fit the loaded models; `field` names the setting (e.g. "topk")."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


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


@dataclass(frozen=True)
class CoreOps:
    """What the sync-free phase cores (`draft_core`, `verify_core`, `draft_extend_core`) call.

    The eager path passes the reference models and the validating reference functions; the static
    path (`graphs.GraphRunner`) passes the fast models and sync-free functions. Both compute the same
    values, so a phase gives the same tokens on either path.
    """

    config: SpecConfig
    target: Any  # forward(ids, positions, attn, cache, aux_layer_ids) -> (hidden, aux); compute_logits
    draft: Any  # the DraftModel protocol
    target_cache: KVCache
    draft_cache: KVCache
    aux_layer_ids: Optional[tuple[int, ...]]
    capture: Callable[[torch.Tensor, Optional[torch.Tensor]], Optional[torch.Tensor]]
    build_tree: Callable[..., tuple]
    probs: Callable[..., torch.Tensor]  # (logits, temperature, top_k, top_p) -> probabilities
    verify_greedy: Optional[Callable[..., tuple]] = None  # None: verify.py's (tree.verify_greedy)
    verify_tree_sampling: Optional[Callable[..., tuple]] = None  # None: verify.py's
    softmax_topk: Optional[Callable[..., tuple]] = None  # (logits, k) -> (probs, indices); None: torch's
    argmax: Optional[Callable[..., torch.Tensor]] = None  # (logits) -> last-axis argmax; None: torch's
    frontier: Any = None  # kernels.frontier (the draft's expansion bookkeeping); None: tree.py's torch path
    simulated_accept: Optional[Callable[..., tuple]] = None  # the simulated override; None: verify.py's


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
        gen = self._gens.get(device)
        if gen is None:
            gen = self._gens[device] = torch.Generator(device=device).manual_seed(self.seed)
        return gen

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
    if SpecAlgorithm(algorithm).traits.has_aux_layers:
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


def _cache_with_reserve(num_layers: int, num_kv_heads: int, head_dim: int, num_slots: int, rows: int,
                        max_context: int, dtype: torch.dtype, device: Any, reserve: int) -> tuple[KVCache, torch.Tensor]:
    """A KV cache whose pool holds `num_slots` slots, plus `reserve` slots after them that the pool
    never hands out (the static path's dummy and scratch slots): `num_slots`, `is_whole()` and the
    free list describe the pool only. Returns the cache and the reserved slot ids."""
    cache = KVCache(num_layers, num_kv_heads, head_dim, num_slots + reserve, rows, max_context, dtype, device)
    if reserve:
        total = num_slots + reserve
        stack = getattr(cache, "_free_stack", None)
        # a fresh pool's free list is total-1 .. 0 with the top at the end: drop the first `reserve`
        expected = torch.arange(total - 1, num_slots - 1, -1, device=cache.device)
        if stack is None or cache.num_free_slots != total or not torch.equal(stack[:reserve], expected):
            raise RuntimeError("KVCache internals changed: cannot reserve slots for the static path")
        cache._free_stack = stack[reserve:].clone()
        cache._num_free = num_slots
        cache.num_slots = num_slots
        if not cache.is_whole():
            raise RuntimeError("KVCache internals changed: the pool is not whole after reserving slots")
    return cache, torch.arange(num_slots, num_slots + reserve, device=cache.device)


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
    executor: str = "eager"  # one of EXECUTORS
    runner: Optional[Any] = None  # graphs.GraphRunner when executor != "eager"
    reserved_slots: dict[str, torch.Tensor] = field(default_factory=dict)  # static path: outside the pools
    simulate_accept: Optional[SimulatedAccept] = None  # benchmarks only

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
        executor: str = "eager",
        buckets: Optional[tuple[int, ...]] = None,
        fast: Optional[dict[str, Any]] = None,
        simulate_accept_len: Optional[float] = None,
        launch_ahead: bool = True,
        launch_before_read: int = 1,
    ) -> "Runtime":
        """Size both KV caches for `max_batch_size` requests of `max_context` tokens plus drafts.

        `executor` "static" or "cuda_graph" runs the phases on static buffers (`graphs.GraphRunner`)
        padded to the batch-size `buckets` (default 1, 2, 4, 8, 16, 24, 32, ... up to
        `max_batch_size`); the caches then get one extra request row and a few slots outside their pools,
        reserved for padding and the draft's branch scratch (`reserved_slots`). `fast`
        passes options to the fast model path (`gpu.models.FastOptions`). `simulate_accept_len`
        (benchmarks only) forces the accept length of every verify. `launch_ahead` (static path,
        greedy): when every request of a verify goes on, queue the rest of the iteration and the
        next verify before the host bookkeeping (`GraphRunner.launch_ahead`); for batches of at most
        `launch_before_read` requests, queue it before the host reads the verify, whenever no budget
        or context can stop a request this iteration (a stop token then costs the batch one
        discarded iteration; 0: after the read only)."""
        if executor not in EXECUTORS:
            raise ValueError(f"executor must be one of {', '.join(EXECUTORS)}, got {executor!r}")
        config = build_spec_config(algorithm, target, draft, num_steps, topk, num_draft_tokens)
        if config.topk > config.draft_vocab:  # each tree node keeps the topk best of the draft's scores
            raise SetupError("topk", f"topk {config.topk} exceeds the draft vocabulary of {config.draft_vocab} "
                                     f"tokens: a draft node has at most {config.draft_vocab} candidates")
        device = next(target.parameters()).device
        t_slots = max_batch_size * (max_context + num_draft_tokens)
        d_slots = max_batch_size * (max_context + topk * num_steps)
        static = executor != "eager"
        rows = max_batch_size + static  # the static path's padding row is the last
        # the static path's reserved slots: a dummy slot per cache, and the draft's branch scratch
        t_reserve = int(static)
        d_reserve = int(static) * (1 + max_batch_size * topk * (num_steps - 1))
        target_cache, t_reserved = _cache_with_reserve(target.num_layers, target.num_kv_heads, target.head_dim,
                                                       t_slots, rows, max_context, target.dtype, device, t_reserve)
        # a draft reading its own sequence also holds the root: its KV runs `lead` tokens ahead
        lead = config.traits.draft_kv_lead
        d_slots += max_batch_size * lead
        draft_cache, d_reserved = _cache_with_reserve(draft.num_layers, draft.num_kv_heads, draft.head_dim,
                                                      d_slots, rows, max_context + lead, draft.dtype, device,
                                                      d_reserve)
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        sim = None if simulate_accept_len is None else SimulatedAccept(simulate_accept_len, seed)
        rt = cls(target, draft, config, target_cache, draft_cache, RequestTable(max_batch_size), gen,
                 executor=executor, simulate_accept=sim)
        if static:
            rt.reserved_slots = {"target": t_reserved, "draft": d_reserved}
            # padded requests of the static path attend `lead` draft tokens of the padding row (their
            # prefix is the draft's KV lead): point them at the dummy slot
            draft_cache.req_to_token[rows - 1, :lead] = d_reserved[0]
        if executor != "eager":
            from .graphs import GraphRunner  # lazy: graphs imports the phase modules, which import this one

            rt.runner = GraphRunner(rt, executor, buckets=buckets, fast=fast, ahead=launch_ahead,
                                    before_read_bs=launch_before_read)
        return rt
