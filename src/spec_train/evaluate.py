"""Acceptance of a trained draft with the runtime: mean tokens per iteration on held-out prompts."""

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

__all__ = ["Acceptance", "measure_acceptance"]


@dataclass(frozen=True)
class Acceptance:
    """Tokens emitted per decode iteration over all requests (bonus included; 1.0 = nothing accepted)."""

    tokens_per_iteration: float
    tokens: int
    iterations: int
    per_request: tuple[float, ...]
    per_kind: Optional[dict[str, "Acceptance"]] = None
    """The same statistics over each kind's requests (when the prompts' kinds were given)."""

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        out = {"tokens_per_iteration": round(self.tokens_per_iteration, 4), "tokens": self.tokens,
               "iterations": self.iterations, "per_request": [round(x, 3) for x in self.per_request]}
        if self.per_kind is not None:
            out["per_kind"] = {k: a.as_dict() for k, a in self.per_kind.items()}
        return out

    @classmethod
    def of(cls, accept_lengths: Sequence[Sequence[int]], per_request: Sequence[float]) -> "Acceptance":
        """The statistics of requests' accept lengths (one list per request) and their means."""
        lengths = [n for req in accept_lengths for n in req]
        return cls(sum(lengths) / max(1, len(lengths)), sum(lengths), len(lengths), tuple(per_request))


def measure_acceptance(target: Any, draft: Path | str, algorithm: str, prompts: Sequence[Sequence[int]], *,
                       num_steps: int, topk: int, num_draft_tokens: int, max_new_tokens: int = 128,
                       dtype: torch.dtype = torch.float32, device: str = "cpu", batch_size: int = 8,
                       executor: str = "eager", ignore_eos: bool = False,
                       kinds: Optional[Sequence[str]] = None) -> Acceptance:
    """Greedy speculative decoding of `prompts` with the runtime; the decode iterations' accept lengths.

    `target` is a directory or an already loaded `LlamaForCausal` (then `draft` loads against it).
    `kinds` (one label per prompt, e.g. the `PromptRow.kind`s) adds the statistics per kind."""
    if kinds is not None and len(kinds) != len(prompts):
        raise ValueError(f"kinds: {len(kinds)} labels for {len(prompts)} prompts")
    from spec_runtime.engine import SpecEngine
    from spec_runtime.models.loading import DRAFT_LOADERS, load_target
    from spec_runtime.runtime import Runtime
    from spec_schema import SpecAlgorithm

    alg = SpecAlgorithm(algorithm)
    t = load_target(target, dtype, device) if isinstance(target, (str, Path)) else target
    d = DRAFT_LOADERS[alg](draft, t, dtype, device)
    max_prompt = max(len(p) for p in prompts)
    rt = Runtime.create(t, d, alg, num_steps=num_steps, topk=topk, num_draft_tokens=num_draft_tokens,
                        max_batch_size=batch_size, max_context=max_prompt + max_new_tokens + num_draft_tokens + 8,
                        executor=executor, buckets=(1, 2, 4, 8) if executor != "eager" else None)
    eos = t.hf_config.get("eos_token_id")
    engine = SpecEngine(rt, eos_token_ids=[eos] if isinstance(eos, int) else (eos or []))
    reqs = []
    for start in range(0, len(prompts), batch_size):
        rids = [engine.add_request(list(p), max_new_tokens, ignore_eos=ignore_eos)
                for p in prompts[start:start + batch_size]]
        engine.run()
        reqs += [engine.requests[r] for r in rids]
    total = Acceptance.of([r.accept_lengths for r in reqs], [r.mean_accept_length for r in reqs])
    if kinds is None:
        return total
    per_kind = {k: Acceptance.of([r.accept_lengths for r, rk in zip(reqs, kinds) if rk == k],
                                 [r.mean_accept_length for r, rk in zip(reqs, kinds) if rk == k])
                for k in dict.fromkeys(kinds)}
    return Acceptance(total.tokens_per_iteration, total.tokens, total.iterations, total.per_request, per_kind)
