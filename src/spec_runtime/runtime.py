"""The runtime of a target and draft pair: its state (`state.RuntimeState`) and its construction.

`Runtime.create` sizes both KV caches, builds the spec config and picks the executor the phases run
their cores on (`executors/`). The names the phases share live below it (`state`, `core_types`).
"""

from collections.abc import Mapping
from typing import Any, Optional

import torch

from spec_schema import ModelDims, SpecAlgorithm, SpecConfig

from .executors.eager import EagerExecutor
from .kv_cache import KVCache, RequestTable
from .models.base import DraftModel
from .models.llama import LlamaForCausal
from .options import FastOptions
from .state import RuntimeState, SimulatedAccept

__all__ = ["EXECUTORS", "Runtime", "SetupError", "SimulatedAccept", "build_spec_config"]

EXECUTORS = ("eager", "static", "cuda_graph")
"""`eager`: the reference path on live tensors. `static`: the static-buffer path (bucketed, padded)
with eager calls, runnable on CPU. `cuda_graph`: the same path replayed from captured CUDA graphs."""


class SetupError(ValueError):
    """A setting does not fit the loaded models; `field` names the setting (e.g. "topk")."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


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
    else:  # an EAGLE-1 head cut to a hot-token map scores fewer tokens than the target's
        hot = draft.vocab_size if draft.vocab_size != t_dims.vocab_size else None
        d_dims = d_dims.model_copy(update={"draft_vocab_size": hot, "aux_layer_ids": None,
                                           "num_aux_hidden_states": None, "target_hidden_size": None})
    return SpecConfig(algorithm=algorithm, target=t_dims, draft=d_dims, num_steps=num_steps, topk=topk,
                      num_draft_tokens=num_draft_tokens)


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


class Runtime(RuntimeState):
    """The runtime of a target and draft pair: its state (`state.RuntimeState`) and how it is built."""

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
        fast: Optional[FastOptions | Mapping[str, Any]] = None,
        simulate_accept_len: Optional[float] = None,
    ) -> "Runtime":
        """Size both KV caches for `max_batch_size` requests of `max_context` tokens plus drafts.

        `executor` "static" or "cuda_graph" runs the phases on static buffers (`executors.static.GraphRunner`)
        padded to the batch-size `buckets` (default 1, 2, 4, 8, 16, 24, 32, ... up to
        `max_batch_size`); the caches then get one extra request row and a few slots outside their pools,
        reserved for padding and the draft's branch scratch (`reserved_slots`). `fast`: the static
        path's options (`options.FastOptions`, or a dict of its fields: kernels, the launch-ahead).
        `simulate_accept_len` (benchmarks only) forces the accept length of every verify."""
        if executor not in EXECUTORS:
            raise ValueError(f"executor must be one of {', '.join(EXECUTORS)}, got {executor!r}")
        config = build_spec_config(algorithm, target, draft, num_steps, topk, num_draft_tokens)
        fast = FastOptions.of(fast)  # refused here, whatever the executor
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
        if executor == "eager":
            rt.runner = EagerExecutor(rt)
        else:
            from .executors.static import GraphRunner  # lazy: the fast models' modules load on demand

            rt.runner = GraphRunner(rt, executor, buckets=buckets, fast=fast)
        return rt
