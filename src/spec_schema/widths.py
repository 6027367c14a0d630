"""The width rule: every hidden-state width and dtype in the project comes from here.

| algorithm       | hidden_draft (decode phase) | hidden_extend (extend phase)                  | dtype                           |
|-----------------|-----------------------------|-----------------------------------------------|---------------------------------|
| STANDALONE      | None                        | None                                          | None                            |
| EAGLE           | draft spec hidden size      | target spec hidden size                       | draft: draft's; extend: target's |
| EAGLE3, aux on  | draft spec hidden size      | target hidden size x number of aux layers     | same                            |
| EAGLE3, aux off | draft spec hidden size      | target spec hidden size                       | same                            |

"Spec hidden size" is `hidden_size x hc_mult` (DeepSeek-V4 mHC; 1 elsewhere). "Target hidden size"
for an EAGLE-3 head is its `target_hidden_size` when set. Widths come from configs, never from a
layer's `in_features`. docs/width-rule.md compares this rule with sglang's and vLLM's.
"""

from dataclasses import dataclass
from typing import Literal, Optional

import torch

from .config import ModelDims, SpecAlgorithm, SpecConfig, traits

Phase = Literal["draft", "extend"]


@dataclass(frozen=True)
class Width:
    """A hidden-state width and dtype, with where the number came from (for error messages)."""

    size: Optional[int]
    dtype: Optional[torch.dtype]
    origin: str


def hidden_width(config: SpecConfig, phase: Phase) -> Width:
    """The width rule, keyed by (algorithm, phase). `phase` is "draft" or "extend"."""
    alg = config.algorithm.value
    if not config.traits.draft_reads_hidden:
        return Width(None, None, f"{alg}: the draft reads no hidden states")
    if phase == "draft":
        size = config.draft.spec_hidden_size
        return Width(size, config.draft.torch_dtype, f"{alg}: draft hidden size {_spec(config.draft)}")
    if phase != "extend":
        raise ValueError(f"phase must be 'draft' or 'extend', got {phase!r}")
    return extend_width(config.algorithm, config.target, config.draft)


def extend_width(algorithm: SpecAlgorithm | str, target: ModelDims, draft: ModelDims) -> Width:
    """The rule's `hidden_extend` from the two models' dims alone: what the target captures for
    the draft-extend phase, and so the input width of an EAGLE-3 head's `fc` (`hidden_width(config,
    "extend")` is this for the config's models)."""
    alg, t = SpecAlgorithm(algorithm).value, traits(algorithm)
    dtype = target.torch_dtype
    if not t.draft_reads_hidden:
        return Width(None, None, f"{alg}: the draft reads no hidden states")
    if not t.has_aux_layers:
        size = target.spec_hidden_size
        return Width(size, dtype, f"{alg}: target hidden size {_spec(target)}")
    base = aux_layer_width(target, draft)
    which = "head's target_hidden_size" if draft.target_hidden_size else "target hidden"
    if not draft.use_aux_hidden_state:
        size = target.spec_hidden_size  # equals base: SpecConfig checks target_hidden_size
        return Width(size, dtype, f"{alg} (aux off): {which} {_spec(target)}")
    n = draft.num_aux
    return Width(base * n, dtype, f"{alg}: {which} {base} x {n} aux layers = {base * n}")


def aux_layer_width(target: ModelDims, draft: ModelDims) -> int:
    """The width of one aux layer an EAGLE-3 head reads: its `target_hidden_size` when set, else the
    target's hidden size (the extend width with aux on is this times the aux layers)."""
    return draft.target_hidden_size or target.hidden_size


def _spec(dims: ModelDims) -> str:
    h, m = dims.hidden_size, dims.hc_mult
    return f"{h}" if m == 1 else f"{h} x hc_mult {m} = {h * m}"
