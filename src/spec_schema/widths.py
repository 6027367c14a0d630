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

from .config import ModelDims, SpecConfig

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
    return _extend_width(config)


def _extend_width(config: SpecConfig) -> Width:
    alg, dtype = config.algorithm.value, config.target.torch_dtype
    if not config.traits.has_aux_layers:
        size = config.target.spec_hidden_size
        return Width(size, dtype, f"{alg}: target hidden size {_spec(config.target)}")
    base = config.draft.target_hidden_size or config.target.hidden_size
    which = "head's target_hidden_size" if config.draft.target_hidden_size else "target hidden"
    if not config.use_aux:
        size = config.target.spec_hidden_size  # equals base: SpecConfig checks target_hidden_size
        return Width(size, dtype, f"{alg} (aux off): {which} {_spec(config.target)}")
    n = config.num_aux
    return Width(base * n, dtype, f"{alg}: {which} {base} x {n} aux layers = {base * n}")


def _spec(dims: ModelDims) -> str:
    h, m = dims.hidden_size, dims.hc_mult
    return f"{h}" if m == 1 else f"{h} x hc_mult {m} = {h * m}"
