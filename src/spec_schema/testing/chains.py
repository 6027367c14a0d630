"""Hypothesis strategies for the ragged chain form (`ChainVerifyInput`, `ChainVerifyOutput`).

- `chain_configs()`: chain `SpecConfig`s (topk 1, num_draft_tokens = num_steps + 1).
- `chain_fields()`: valid constructor arguments (every check of strict level 2 passes): ragged
  counts in [0, num_steps] (0-draft requests and idle batches included), the logits layout of the
  chain form, ascending hidden rows with prompt chunks between requests, -1 padded outputs.
- `corrupted_chain_fields()`: `(field, kind, kwargs)` with one field broken (width, dtype, rank,
  batch, presence); `check` rejects every one naming `field` at strict level 1. With an engine's
  `IndexPolicy` the wrong dtype is one the policy refuses. Rename the keys (a `ClassMap`) to build
  an engine's own object.
"""

from typing import Any, Optional, Union

import torch
from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy
from torch import Tensor

from ..chains import ChainVerifyInput, ChainVerifyOutput, max_spec_len
from ..config import SpecConfig
from ..policy import IndexPolicy
from .strategies import example_config

_VOCABS = st.integers(8, 64)
_BATCHES = st.integers(0, 4)
_LIVE = st.integers(1, 4)

__all__ = ["chain_configs", "chain_counts", "chain_fields", "corrupted_chain_fields", "greedy_chain_reference"]


@st.composite
def chain_configs(draw: Any, vocab: Union[int, SearchStrategy] = _VOCABS) -> SpecConfig:
    """Chain configs: topk 1, num_steps 1-5, num_draft_tokens = num_steps + 1, a small vocabulary."""
    steps = draw(st.integers(1, 5))
    v = draw(vocab) if isinstance(vocab, SearchStrategy) else vocab
    alg = draw(st.sampled_from(["EAGLE", "EAGLE3", "STANDALONE"]))
    return example_config(alg, vocab=v, num_steps=steps, topk=1, num_draft_tokens=steps + 1)


def chain_counts(config: SpecConfig, bs: Union[int, SearchStrategy] = _BATCHES) -> SearchStrategy:
    """Per-request draft counts in [0, num_steps] (a list of bs ints)."""
    size = bs if isinstance(bs, SearchStrategy) else st.just(bs)
    return size.flatmap(lambda n: st.lists(st.integers(0, config.num_steps), min_size=n, max_size=n))


def _t(values: list[int]) -> Tensor:
    return torch.tensor(values, dtype=torch.int64)


def input_from(drafts: list[list[int]], prompt_gaps: list[int]) -> dict[str, Any]:
    """The chain input of these drafts; request r's scored rows follow `prompt_gaps[r]` other rows."""
    n = [len(d) for d in drafts]
    cu, cu_sampled, target, rows = [], [], [], []
    total, sampled, row = 0, 0, 0
    for k, gap in zip(n, prompt_gaps):
        row += gap
        target += [sampled + j for j in range(k)]
        rows += [row + j for j in range(k + 1)]
        row += k + 1
        total, sampled = total + k, sampled + k + 1
        cu.append(total)
        cu_sampled.append(sampled)
    return {
        "draft_token": _t([t for d in drafts for t in d]), "num_drafts_cpu": n, "cu_num_drafts": _t(cu),
        "cu_num_sampled": _t(cu_sampled), "target_logits_index": _t(target),
        "bonus_logits_index": _t([c - 1 for c in cu_sampled]), "logits_index": _t(rows),
    }


def greedy_chain_reference(drafts: list[list[int]], argmax: list[list[int]], bonus: list[int]) -> Tensor:
    """Greedy chain verification by the rule: accept drafts while each equals the target's argmax at
    its row; emit the argmax at the first mismatch, or the bonus after a fully accepted chain."""
    width = max_spec_len([len(d) for d in drafts]) + 1
    out = torch.full((len(drafts), width), -1, dtype=torch.int64)
    for b, (d, a) in enumerate(zip(drafts, argmax)):
        row = []
        for tok, best in zip(d, a):
            row.append(best)
            if tok != best:
                break
        else:
            row.append(bonus[b])
        out[b, : len(row)] = _t(row)
    return out


@st.composite
def chain_fields(draw: Any, cls: type, config: Union[SpecConfig, SearchStrategy],
                 bs: Union[int, SearchStrategy] = _BATCHES) -> dict[str, Any]:
    """Valid constructor arguments of `ChainVerifyInput` or `ChainVerifyOutput` under `config`."""
    config = draw(config) if isinstance(config, SearchStrategy) else config
    counts = draw(chain_counts(config, bs))
    tok = st.integers(0, config.vocab - 1)
    if cls is ChainVerifyInput:
        drafts = [draw(st.lists(tok, min_size=k, max_size=k)) for k in counts]
        gaps = draw(st.lists(st.integers(0, 5), min_size=len(counts), max_size=len(counts)))
        return input_from(drafts, gaps)
    if cls is ChainVerifyOutput:
        width = max_spec_len(counts) + 1
        out = torch.full((len(counts), width), -1, dtype=torch.int64)
        for b, k in enumerate(counts):
            m = draw(st.integers(1, k + 1))
            out[b, :m] = _t(draw(st.lists(tok, min_size=m, max_size=m)))
        return {"output_tokens": out, "num_drafts_cpu": counts}
    raise TypeError(f"no chain strategy for {cls.__name__}; expected ChainVerifyInput or ChainVerifyOutput")


_WIDTH = {ChainVerifyInput: ("target_logits_index", "logits_index"), ChainVerifyOutput: ("output_tokens",)}
_BATCH = {ChainVerifyInput: ("cu_num_sampled", "bonus_logits_index", "num_drafts_cpu"),
          ChainVerifyOutput: ("num_drafts_cpu",)}


def _wrong_dtype(cls: type, name: str, policy: Optional[IndexPolicy]) -> torch.dtype:
    plans = policy.plans(cls) if policy is not None else {}
    allowed = plans[name].dtypes if name in plans else frozenset({torch.int64})
    return next(d for d in (torch.int64, torch.int32, torch.int16, torch.float32) if d not in allowed)


def _resize(value: Any, size: int) -> Any:
    if isinstance(value, (list, tuple)):
        return (list(value) + [0] * size)[:size]
    dim = value.dim() - 1
    if size <= value.shape[dim]:
        return value.narrow(dim, 0, size).clone()
    pad = list(value.shape)
    pad[dim] = size - value.shape[dim]
    return torch.cat([value, torch.full(pad, -1, dtype=value.dtype)], dim)


@st.composite
def corrupted_chain_fields(draw: Any, cls: type, config: Union[SpecConfig, SearchStrategy],
                           bs: Union[int, SearchStrategy] = _LIVE,
                           policy: Optional[IndexPolicy] = None, fields: Optional[dict[str, Any]] = None
                           ) -> tuple[str, str, dict[str, Any]]:
    """`(field, kind, kwargs)`: valid arguments (drawn, or `fields` given) with one field broken.

    width: a later binder of num_draft_total / num_logits / chain_width resized; batch: a later binder
    of bs (or the host counts) resized; dtype: one the contract (or `policy`) refuses; rank: an axis
    added; presence: a required field None. Counts and dtypes of `fields` are kept as given.
    """
    kw = dict(fields) if fields is not None else draw(chain_fields(cls, config, bs))
    tensors = [k for k, v in kw.items() if isinstance(v, Tensor)]
    required = [k for k in kw if k != "num_drafts_cpu" or cls is ChainVerifyInput]
    if cls is ChainVerifyOutput and kw.get("num_drafts_cpu") is None:
        rows, width = kw["output_tokens"].shape  # counts that fit the width, so width/batch can be blamed
        kw["num_drafts_cpu"] = [width - 1] * rows
    kind = draw(st.sampled_from(["width", "batch", "dtype", "rank", "presence"]))
    if kind in ("width", "batch"):
        name = draw(st.sampled_from((_WIDTH if kind == "width" else _BATCH)[cls]))
        old = len(kw[name]) if isinstance(kw[name], (list, tuple)) else kw[name].shape[-1]
        new = draw(st.integers(0, old + 3).filter(lambda s: s != old))
        kw[name] = _resize(kw[name], new)
    elif kind == "dtype":
        name = draw(st.sampled_from(tensors))
        kw[name] = kw[name].to(_wrong_dtype(cls, name, policy))
    elif kind == "rank":
        name = draw(st.sampled_from(tensors))
        kw[name] = kw[name].unsqueeze(-1)
    else:
        name = draw(st.sampled_from(required))
        kw[name] = None
    return name, kind, kw
