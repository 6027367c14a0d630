"""The ragged chain form of verification: flat draft chains with per-request counts.

Engines that draft chains (topk 1) of per-request length keep verification's input flat instead of
as a `(bs, num_draft)` tree: request r owns `num_drafts_cpu[r]` consecutive draft tokens (0 allowed,
at most `num_steps`), and the target scores `num_drafts_cpu[r] + 1` consecutive logits rows (one per
draft, then the bonus row). vLLM's `SpecDecodeMetadata` and its rejection sampler's output are this
form (`spec_schema.engines.vllm` views them as these classes).

```
ChainVerifyInput  -- target forward + rejection sampling -->  ChainVerifyOutput
```
Axis names (besides `bs`): `num_draft_total` = sum of the per-request draft counts (the flat draft
axis), `num_logits` = num_draft_total + bs (rows the target's lm_head scores), `chain_width` =
max_spec_len + 1, where max_spec_len is the batch's longest chain (max of the counts, 0 for an idle
batch). Ids and indices are int64 in the contract (`IndexPolicy` lets an engine declare int32);
the counts are a host sequence (read without a device sync).
"""

from collections.abc import Sequence
from dataclasses import field
from typing import Any, Optional

import torch
from jaxtyping import Int64
from torch import Tensor

from ._contract import phase_class
from .config import SpecConfig
from .phases import _doc, _document

__all__ = ["ChainVerifyInput", "ChainVerifyOutput", "CHAIN_CLASSES", "max_spec_len"]


def max_spec_len(counts: Sequence[int]) -> int:
    """The longest chain of a batch (0 for an idle batch): `chain_width` is this + 1."""
    return max(counts, default=0)


def _host_counts(obj: Any, field: str, bs: int) -> Optional[tuple[str, str]]:
    counts = getattr(obj, field)
    if not isinstance(counts, (list, tuple)):
        return field, f"must be a host list or tuple of ints, got a {type(counts).__name__}"
    if len(counts) != bs:
        return field, f"has {len(counts)} entries for bs = {bs} requests"
    if any(not isinstance(c, int) or c < 0 for c in counts):
        return field, "counts must be non-negative ints"
    return None


class _NoConfigAxes:
    """The chain classes' axes are all per batch: a config fixes none of them (the value checks that
    need one, chain length <= num_steps and token ids < vocab, read it at strict level 2)."""

    @classmethod
    def _config_axes(cls, config: SpecConfig) -> dict[str, tuple[int, str]]:
        return {}

    @classmethod
    def _config_expect(cls, config: SpecConfig) -> dict[str, tuple[Any, str]]:
        return {}


@_document
@phase_class
class ChainVerifyInput(_NoConfigAxes):
    """Flat ragged draft chains of every request, to be scored by the target and verified.

    Request r's drafts are `draft_token[cu_num_drafts[r] - num_drafts_cpu[r] : cu_num_drafts[r]]`;
    its logits rows are `cu_num_sampled[r] - num_drafts_cpu[r] - 1 .. cu_num_sampled[r] - 1`: row
    j scores draft j (the target's prediction one position before it), the last row the bonus.
    """

    draft_token: Int64[Tensor, " num_draft_total"] = _doc(
        "every request's draft tokens, concatenated (-1: a placeholder draft, always rejected)"
    )
    num_drafts_cpu: Sequence[int] = _doc("host list: draft tokens per request (0 allowed)")
    cu_num_drafts: Int64[Tensor, " bs"] = _doc("inclusive cumulative sum of num_drafts_cpu")
    cu_num_sampled: Int64[Tensor, " bs"] = _doc("inclusive cumulative sum of num_drafts_cpu + 1")
    target_logits_index: Int64[Tensor, " num_draft_total"] = _doc(
        "logits row that scores each draft token"
    )
    bonus_logits_index: Int64[Tensor, " bs"] = _doc("logits row of each request's bonus token")
    logits_index: Int64[Tensor, " num_logits"] = _doc(
        "rows of the target's hidden states its lm_head scores: num_drafts_cpu[r] + 1 per request, "
        "ascending"
    )

    def __len__(self) -> int:
        return int(self.cu_num_drafts.shape[0])

    @classmethod
    def create_idle(cls, config: SpecConfig, device: Any = "cpu") -> "ChainVerifyInput":
        """A zero-row input with the live path's dtypes and ranks."""
        empty = torch.zeros((0,), dtype=torch.int64, device=device)
        return cls(
            draft_token=empty, num_drafts_cpu=(), cu_num_drafts=empty.clone(), cu_num_sampled=empty.clone(),
            target_logits_index=empty.clone(), bonus_logits_index=empty.clone(), logits_index=empty.clone(),
        )

    @classmethod
    def _host_problem(cls, obj: Any) -> Optional[tuple[str, str]]:
        bs, total = obj.cu_num_drafts.shape[0], obj.draft_token.shape[0]
        problem = _host_counts(obj, "num_drafts_cpu", bs)
        if problem is not None:
            return problem
        if sum(obj.num_drafts_cpu) != total:
            return "num_drafts_cpu", f"sums to {sum(obj.num_drafts_cpu)} but there are num_draft_total = {total} drafts"
        rows = obj.logits_index.shape[0]
        if rows != total + bs:
            return "logits_index", (
                f"axis num_logits (dim 0) expected num_draft_total + bs = {total} + {bs} = {total + bs}, got {rows}"
            )
        return None

    @classmethod
    def _value_problem(cls, obj: Any, config: Optional[SpecConfig]) -> Optional[tuple[str, str]]:
        n = torch.tensor(list(obj.num_drafts_cpu), dtype=torch.int64, device=obj.draft_token.device)
        if config is not None and max_spec_len(obj.num_drafts_cpu) > config.num_steps:
            return "num_drafts_cpu", f"a chain longer than num_steps = {config.num_steps}"
        cu = torch.cumsum(n, 0)
        if not torch.equal(obj.cu_num_drafts.long(), cu):
            return "cu_num_drafts", "must be the inclusive cumulative sum of num_drafts_cpu"
        cu_sampled = torch.cumsum(n + 1, 0)
        if not torch.equal(obj.cu_num_sampled.long(), cu_sampled):
            return "cu_num_sampled", "must be the inclusive cumulative sum of num_drafts_cpu + 1"
        if not torch.equal(obj.bonus_logits_index.long(), cu_sampled - 1):
            return "bonus_logits_index", "must be each request's last logits row (cu_num_sampled - 1)"
        first = torch.repeat_interleave(cu_sampled - n - 1 - (cu - n), n)  # row of draft 0 minus its flat index
        want = first + torch.arange(int(cu[-1]) if n.numel() else 0, device=n.device)
        if not torch.equal(obj.target_logits_index.long(), want):
            return "target_logits_index", "draft j of request r must be scored by row cu_num_sampled[r] - num_drafts_cpu[r] - 1 + j"
        rows = obj.logits_index.long()
        if rows.numel() and (bool((rows < 0).any()) or bool((rows[1:] <= rows[:-1]).any())):
            return "logits_index", "rows must be non-negative and ascending"
        lo, hi = -1, (config.vocab if config is not None else None)
        t = obj.draft_token
        if t.numel() and (bool((t < lo).any()) or (hi is not None and bool((t >= hi).any()))):
            return "draft_token", f"token ids outside [-1, vocab{'' if hi is None else f' = {hi}'})"
        return None


@_document
@phase_class
class ChainVerifyOutput(_NoConfigAxes):
    """The tokens verification emits per request of a chain batch, -1 padded to `chain_width`.

    Row b holds the accepted drafts, then one token the target chose (the correction at the first
    rejected draft, or the bonus when every draft was accepted): between 1 and num_drafts + 1
    tokens, then -1 padding.
    """

    output_tokens: Int64[Tensor, "bs chain_width"] = _doc("emitted tokens per request, then -1 padding")
    num_drafts_cpu: Optional[Sequence[int]] = field(
        default=None,
        metadata={"doc": "host list of the verified input's draft counts per request, when known: then "
                  "chain_width must be max(num_drafts_cpu) + 1 and row b may hold at most "
                  "num_drafts_cpu[b] + 1 tokens"},
    )

    def __len__(self) -> int:
        return int(self.output_tokens.shape[0])

    @classmethod
    def create_idle(cls, config: SpecConfig, device: Any = "cpu") -> "ChainVerifyOutput":
        """A zero-row output (chain_width 1: the longest chain of an idle batch is 0)."""
        return cls(output_tokens=torch.zeros((0, 1), dtype=torch.int64, device=device), num_drafts_cpu=())

    @classmethod
    def _host_problem(cls, obj: Any) -> Optional[tuple[str, str]]:
        if obj.num_drafts_cpu is None:
            return None
        bs, width = obj.output_tokens.shape
        problem = _host_counts(obj, "num_drafts_cpu", bs)
        if problem is not None:
            return problem
        want = max_spec_len(obj.num_drafts_cpu) + 1
        if width != want:
            return "output_tokens", (
                f"axis chain_width (dim 1) expected max_spec_len + 1 = {want} (from num_drafts_cpu), got {width}"
            )
        return None

    @classmethod
    def _value_problem(cls, obj: Any, config: Optional[SpecConfig]) -> Optional[tuple[str, str]]:
        t = obj.output_tokens
        if config is not None and t.shape[1] > config.num_steps + 1:
            return "output_tokens", f"chain_width {t.shape[1]} > num_steps + 1 = {config.num_steps + 1}"
        if not t.shape[0]:
            return None
        emitted = t >= 0
        k = emitted.sum(1)
        if bool((emitted[:, 1:] & ~emitted[:, :-1]).any()) or bool((t[~emitted] != -1).any()):
            return "output_tokens", "each row must be its tokens, then -1 padding (no gap, no other negative)"
        if bool((k < 1).any()):
            return "output_tokens", "every row emits at least one token (the correction or the bonus)"
        if obj.num_drafts_cpu is not None:
            n = torch.tensor(list(obj.num_drafts_cpu), dtype=torch.int64, device=t.device)
            if bool((k > n + 1).any()):
                return "output_tokens", "a row emits more than num_drafts_cpu + 1 tokens"
        if config is not None and bool((t >= config.vocab).any()):
            return "output_tokens", f"token ids outside [0, vocab = {config.vocab})"
        return None


CHAIN_CLASSES = (ChainVerifyInput, ChainVerifyOutput)
"""The phase classes of the ragged chain form."""
