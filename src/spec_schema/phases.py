"""The phase dataclasses: one frozen class per phase input/output of a speculative iteration.

```
prefill (target extend, then draft extend)            -> DraftInput
loop:
  draft        DraftInput        -> VerifyInput
  verify       VerifyInput       -> VerifyOutput   (.draft_extend_input: unfinished requests only)
  draft-extend DraftExtendInput  -> DraftInput
```
Axis names: bs, topk, num_steps, num_draft, num_accepted, hidden_draft, hidden_extend, vocab,
draft_vocab; `accept_width` is num_steps + 1. Token ids, positions and indices are int64; per-request
counts are int32. Hidden states are Optional: None exactly when the algorithm's draft reads none
(STANDALONE). Idle inputs are detected by their length (`len(obj) == 0`), never by None.
"""

import dataclasses
from dataclasses import field
from typing import Any, Optional

import torch
from jaxtyping import AbstractDtype, Bool, Float32, Int32, Int64
from torch import Tensor

from ._contract import phase_class
from .config import SpecConfig
from .errors import SpecContractError
from .widths import Width, hidden_width

__all__ = ["DraftInput", "VerifyInput", "VerifyOutput", "DraftExtendInput", "HiddenFloat"]


class HiddenFloat(AbstractDtype):
    """The dtypes a hidden state may have: bfloat16, float16 or float32 (not fp8)."""

    dtypes = ["bfloat16", "float16", "float32"]


def _doc(text: str) -> Any:
    return field(metadata={"doc": text})


def _document(cls: type) -> type:
    lines = [f"    {f.name}: {f.metadata['doc']}" for f in dataclasses.fields(cls) if "doc" in f.metadata]
    cls.__doc__ = (cls.__doc__ or "").rstrip() + "\n\n    Attributes:\n" + "\n".join(
        "    " + line for line in lines
    )
    return cls


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: Any) -> Tensor:
    return torch.zeros(shape, dtype=dtype, device=device)


def _idle_hidden(width: Width, device: Any) -> Optional[Tensor]:
    if width.size is None:
        return None
    return _zeros((0, width.size), width.dtype, device)


class _Batched:
    """filter_batch / merge_batch / len for phase classes whose tensors are batch-major."""

    def __len__(self) -> int:
        return int(self.seq_lens.shape[0])  # type: ignore[attr-defined]

    def _fields(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self) if f.init]  # type: ignore[arg-type]

    def _replace(self, values: dict[str, Any]) -> Any:
        return type(self)(**values)

    def merge_batch(self, other: Any) -> Any:
        """Concatenate two batches (either may be idle). Widths and dtypes must agree; None stays None."""
        if not isinstance(other, type(self)) and not isinstance(self, type(other)):
            raise SpecContractError(
                f"{type(self).__name__}.merge_batch: cannot merge a {type(other).__name__}",
                cls_name=type(self).__name__,
            )
        merged = {name: _cat(type(self).__name__, name, getattr(self, name), getattr(other, name))
                  for name in self._fields()}
        return self._replace(merged)


def _cat(cls_name: str, name: str, a: Any, b: Any) -> Any:
    if isinstance(a, tuple) or isinstance(b, tuple):
        # host-side copies: kept only when both sides have one
        return a + b if isinstance(a, tuple) and isinstance(b, tuple) else None
    if a is None and b is None:
        return None
    if not isinstance(a, Tensor) and not isinstance(b, Tensor):
        # a subclass's own non-tensor field (a tag, a layer index): it must agree to merge
        if a != b:
            raise SpecContractError(
                f"{cls_name}.merge_batch: {name} differs between the batches ({a!r} vs {b!r})",
                cls_name=cls_name, field=name,
            )
        return a
    if a is None or b is None:
        raise SpecContractError(
            f"{cls_name}.merge_batch: {name} is None on one side only "
            f"({'left' if a is None else 'right'} is None); both sides must come from the same algorithm",
            cls_name=cls_name,
            field=name,
        )
    if a.shape[1:] != b.shape[1:] or a.dtype != b.dtype:
        raise SpecContractError(
            f"{cls_name}.merge_batch: {name} differs between the batches: shape {tuple(a.shape)} "
            f"dtype {a.dtype} vs shape {tuple(b.shape)} dtype {b.dtype}",
            cls_name=cls_name,
            field=name,
        )
    return torch.cat([a, b], dim=0)


def _keep_index(cls_name: str, keep: Tensor, bs: int) -> Tensor:
    """A keep mask (bool, length bs) or index list (int) as an int64 index tensor."""
    if not isinstance(keep, Tensor):
        # an empty Python list would become float32: it selects nothing
        keep = torch.as_tensor(keep) if len(keep) else torch.zeros(0, dtype=torch.int64)
    if keep.dtype == torch.bool:
        if keep.shape != (bs,):
            raise SpecContractError(
                f"{cls_name}.filter_batch: keep mask has shape {tuple(keep.shape)}, expected ({bs},): "
                f"one entry per request of the batch (bs = {bs})",
                cls_name=cls_name,
                field="keep",
                axis="bs",
            )
        return keep.nonzero().squeeze(1)
    if keep.dim() != 1 or keep.dtype not in (torch.int64, torch.int32):
        raise SpecContractError(
            f"{cls_name}.filter_batch: keep must be a bool mask of length bs or a 1-D int index, "
            f"got shape {tuple(keep.shape)} dtype {keep.dtype}",
            cls_name=cls_name,
            field="keep",
        )
    return keep.long()


@_document
@phase_class
class DraftInput(_Batched):
    """Decode-phase draft state: what the draft needs to grow this iteration's tree.

    Produced by prefill and by draft-extend; consumed by the draft phase. `hidden_states` has the
    draft's own width (`hidden_draft`) and dtype; None for STANDALONE.
    """

    topk_p: Float32[Tensor, "bs topk"] = _doc("probabilities of the root's topk children (float32)")
    topk_index: Int64[Tensor, "bs topk"] = _doc("token ids (target vocabulary) of the root's topk children")
    hidden_states: Optional[HiddenFloat[Tensor, "bs hidden_draft"]] = _doc(
        "the draft's last hidden state per request (draft dtype); None when the draft reads none"
    )
    bonus_tokens: Int64[Tensor, " bs"] = _doc("the newest emitted token per request: the tree root")
    seq_lens: Int64[Tensor, " bs"] = _doc("tokens with committed target KV per request (the root's position)")
    req_pool_indices: Int64[Tensor, " bs"] = _doc("row of each request in the KV slot tables")
    draft_probs: Optional[Float32[Tensor, "bs vocab"]] = field(
        default=None,
        metadata={"doc": "for sampled chains (STANDALONE, topk 1): the draft distribution the root's child "
                  "was sampled from; None otherwise"},
    )

    @staticmethod
    def hidden_size_for(config: SpecConfig) -> Optional[int]:
        """Width of `hidden_states` under `config` (the width rule, decode phase)."""
        return hidden_width(config, "draft").size

    @staticmethod
    def dtype_for(config: SpecConfig) -> Optional[torch.dtype]:
        """Dtype of `hidden_states` under `config` (the width rule, decode phase)."""
        return hidden_width(config, "draft").dtype

    @classmethod
    def create_idle(cls, config: SpecConfig, device: Any = "cpu", sampled_chain: bool = False) -> "DraftInput":
        """A zero-row input with the live path's dtypes, ranks and widths.

        `sampled_chain`: the runtime samples chain drafts, so live inputs carry `draft_probs`."""
        k = config.topk
        return cls(
            topk_p=_zeros((0, k), torch.float32, device),
            topk_index=_zeros((0, k), torch.int64, device),
            hidden_states=_idle_hidden(hidden_width(config, "draft"), device),
            bonus_tokens=_zeros((0,), torch.int64, device),
            seq_lens=_zeros((0,), torch.int64, device),
            req_pool_indices=_zeros((0,), torch.int64, device),
            draft_probs=_zeros((0, config.vocab), torch.float32, device) if sampled_chain else None,
        )

    def filter_batch(self, keep: Tensor) -> "DraftInput":
        """Keep the requests selected by a bool mask (length bs) or an index list, in that order."""
        idx = _keep_index(type(self).__name__, keep, len(self))
        return self._replace({n: None if (v := getattr(self, n)) is None else v[idx] for n in self._fields()})

    @classmethod
    def _config_axes(cls, config: SpecConfig) -> dict[str, tuple[int, str]]:
        w = hidden_width(config, "draft")
        axes = {
            "topk": (config.topk, f"SpecConfig.topk = {config.topk}"),
            "vocab": (config.vocab, f"target vocab_size = {config.vocab}"),
        }
        if w.size is not None:
            axes["hidden_draft"] = (w.size, w.origin)
        return axes

    @classmethod
    def _config_expect(cls, config: SpecConfig) -> dict[str, tuple[Any, str]]:
        w = hidden_width(config, "draft")
        return {"hidden_states": (w.dtype, w.origin if w.size is None else f"{w.origin}, draft dtype")}

    @classmethod
    def _value_problem(cls, obj: Any, config: Optional[SpecConfig]) -> Optional[tuple[str, str]]:
        p = obj.topk_p
        if p.numel() and not bool(((p >= 0) & (p <= 1)).all()):
            return "topk_p", "probabilities outside [0, 1] (or NaN)"
        if config is not None:
            for name in ("topk_index", "bonus_tokens"):
                t = getattr(obj, name)
                if t.numel() and not bool(((t >= 0) & (t < config.vocab)).all()):
                    return name, f"token ids outside [0, vocab = {config.vocab})"
        if obj.seq_lens.numel() and bool((obj.seq_lens < 0).any()):
            return "seq_lens", "negative lengths"
        return None


@_document
@phase_class
class VerifyInput:
    """The draft tree of every request, to be scored by the target in one forward.

    Produced by the draft phase; consumed by the target's tree forward and by verification. Node 0
    of each request is the root (the bonus token); nodes 1..num_draft-1 are the selected drafts in
    ascending expansion order, so a parent precedes its children.
    """

    draft_token: Int64[Tensor, "bs num_draft"] = _doc("token of every tree node (node 0: the root)")
    positions: Int64[Tensor, "bs num_draft"] = _doc("position of every node: seq_len + depth")
    tree_mask: Bool[Tensor, "bs num_draft num_draft"] = _doc(
        "tree_mask[b, i, j]: node i attends node j (j is i or an ancestor); every node sees the prefix"
    )
    retrieve_index: Int64[Tensor, "bs num_draft"] = _doc("global row of node i: b * num_draft + i")
    retrieve_next_token: Int64[Tensor, "bs num_draft"] = _doc("first child of node i (lowest index) or -1")
    retrieve_next_sibling: Int64[Tensor, "bs num_draft"] = _doc("next child of node i's parent or -1")
    seq_lens: Int64[Tensor, " bs"] = _doc("tokens with committed target KV per request")
    req_pool_indices: Int64[Tensor, " bs"] = _doc("row of each request in the KV slot tables")
    draft_probs: Optional[Float32[Tensor, "bs num_draft vocab"]] = field(
        default=None,
        metadata={"doc": "for sampled chains (STANDALONE, topk 1): the draft distribution at node i from "
                  "which node i+1 was sampled; None otherwise (tree drafts are deterministic)"},
    )

    def __len__(self) -> int:
        return int(self.seq_lens.shape[0])

    @classmethod
    def create_idle(cls, config: SpecConfig, device: Any = "cpu") -> "VerifyInput":
        """A zero-row input with the live path's dtypes, ranks and widths."""
        n = config.num_draft_tokens
        ids = _zeros((0, n), torch.int64, device)
        return cls(
            draft_token=ids,
            positions=ids.clone(),
            tree_mask=_zeros((0, n, n), torch.bool, device),
            retrieve_index=ids.clone(),
            retrieve_next_token=ids.clone(),
            retrieve_next_sibling=ids.clone(),
            seq_lens=_zeros((0,), torch.int64, device),
            req_pool_indices=_zeros((0,), torch.int64, device),
            draft_probs=None,
        )

    @classmethod
    def _config_axes(cls, config: SpecConfig) -> dict[str, tuple[int, str]]:
        n = config.num_draft_tokens
        return {
            "num_draft": (n, f"SpecConfig.num_draft_tokens = {n}"),
            "vocab": (config.vocab, f"target vocab_size = {config.vocab}"),
        }

    @classmethod
    def _config_expect(cls, config: SpecConfig) -> dict[str, tuple[Any, str]]:
        return {}

    @classmethod
    def _value_problem(cls, obj: Any, config: Optional[SpecConfig]) -> Optional[tuple[str, str]]:
        bs, n = obj.draft_token.shape
        node = torch.arange(n, device=obj.draft_token.device)
        rows = torch.arange(bs, device=node.device)[:, None] * n + node
        if not torch.equal(obj.retrieve_index, rows):
            return "retrieve_index", "retrieve_index[b, i] must be b * num_draft + i"
        for name in ("retrieve_next_token", "retrieve_next_sibling"):
            t = getattr(obj, name)
            if bool(((t != -1) & ((t <= node) | (t >= n))).any()):
                return name, "links must be -1 or point to a later node (< num_draft)"
        if bs and not bool(obj.tree_mask[:, :, 0].all() and obj.tree_mask.diagonal(dim1=1, dim2=2).all()):
            return "tree_mask", "every node must attend the root and itself"
        if bs and not torch.equal(obj.positions[:, 0], obj.seq_lens):
            return "positions", "the root's position must equal seq_lens"
        if config is not None and bs and not bool(((obj.draft_token >= 0) & (obj.draft_token < config.vocab)).all()):
            return "draft_token", f"token ids outside [0, vocab = {config.vocab})"
        return None


@_document
@phase_class
class DraftExtendInput(_Batched):
    """What the draft runs over after verification (or after prefill): the accepted tokens.

    Rows are ragged: request r owns `num_accept_tokens[r]` consecutive rows. `hidden_states` are the
    target's captured states at those rows, of width `hidden_extend` and the target's dtype; None for
    STANDALONE. `input_ids` are the accepted drafts, then the bonus (after prefill: the prompt from its
    second token, then the first generated token). An EAGLE head reads each one position early, paired
    with the target's hidden state there; a STANDALONE draft (traits `draft_sequence` "own") reads them
    at their own positions (its KV lead of 1) and, after prefill, from the prompt's first token.
    """

    hidden_states: Optional[HiddenFloat[Tensor, "num_accepted hidden_extend"]] = _doc(
        "target hidden states captured at the accepted rows (target dtype); None when the draft reads none"
    )
    input_ids: Int64[Tensor, " num_accepted"] = _doc("draft input token per row: the next accepted token")
    positions: Int64[Tensor, " num_accepted"] = _doc(
        "position of each row: seq_lens - num_accept_tokens + lead + j (lead: the draft's KV lead, 0 or 1)"
    )
    num_correct_drafts: Int32[Tensor, " bs"] = _doc("accepted draft tokens per request (bonus excluded)")
    num_accept_tokens: Int32[Tensor, " bs"] = _doc("rows per request: num_correct_drafts + 1 (bonus included)")
    seq_lens: Int64[Tensor, " bs"] = _doc("tokens with committed target KV per request, after acceptance")
    bonus_tokens: Int64[Tensor, " bs"] = _doc("the new bonus token per request (its last input id)")
    req_pool_indices: Int64[Tensor, " bs"] = _doc("row of each request in the KV slot tables")
    num_accept_tokens_cpu: Optional[tuple[int, ...]] = field(
        default=None,
        metadata={"doc": "host copy of num_accept_tokens (readable without a device sync); when present, "
                  "strict level 1 checks it has bs entries that sum to num_accepted"},
    )

    @staticmethod
    def hidden_size_for(config: SpecConfig) -> Optional[int]:
        """Width of `hidden_states` under `config` (the width rule, extend phase)."""
        return hidden_width(config, "extend").size

    @staticmethod
    def dtype_for(config: SpecConfig) -> Optional[torch.dtype]:
        """Dtype of `hidden_states` under `config` (the width rule, extend phase)."""
        return hidden_width(config, "extend").dtype

    @classmethod
    def create_idle(cls, config: SpecConfig, device: Any = "cpu") -> "DraftExtendInput":
        """A zero-row input with the live path's dtypes, ranks and widths."""
        i64, i32 = _zeros((0,), torch.int64, device), _zeros((0,), torch.int32, device)
        return cls(
            hidden_states=_idle_hidden(hidden_width(config, "extend"), device),
            input_ids=i64,
            positions=i64.clone(),
            num_correct_drafts=i32,
            num_accept_tokens=i32.clone(),
            seq_lens=i64.clone(),
            bonus_tokens=i64.clone(),
            req_pool_indices=i64.clone(),
            num_accept_tokens_cpu=(),
        )

    def filter_batch(self, keep: Tensor) -> "DraftExtendInput":
        """Keep the requests selected by a bool mask (length bs) or an index list, with their rows."""
        idx = _keep_index(type(self).__name__, keep, len(self))
        counts = self.num_accept_tokens.long()
        starts = torch.cumsum(counts, 0) - counts
        kept = counts[idx]
        total = int(kept.sum()) if kept.numel() else 0
        first = torch.repeat_interleave(starts[idx], kept, output_size=total)
        offset = torch.arange(total, device=counts.device) - torch.repeat_interleave(
            torch.cumsum(kept, 0) - kept, kept, output_size=total
        )
        rows = first + offset
        values = {}
        for name in self._fields():
            v = getattr(self, name)
            per_row = name in ("hidden_states", "input_ids", "positions")
            values[name] = None if v is None else v[rows if per_row else idx] if isinstance(v, Tensor) else v
        if self.num_accept_tokens_cpu is not None:
            values["num_accept_tokens_cpu"] = tuple(self.num_accept_tokens_cpu[i] for i in idx.tolist())
        return self._replace(values)

    @classmethod
    def _host_problem(cls, obj: Any) -> Optional[tuple[str, str]]:
        host = obj.num_accept_tokens_cpu
        if host is None:
            return None
        bs, rows = obj.num_accept_tokens.shape[0], obj.input_ids.shape[0]
        if len(host) != bs:
            return "num_accept_tokens", f"host copy has {len(host)} entries for bs = {bs} requests"
        if sum(host) != rows:
            return "num_accept_tokens", (
                f"host copy sums to {sum(host)} but there are num_accepted = {rows} rows "
                "(are drafts-only counts used where bonus-included ones belong?)"
            )
        return None

    @classmethod
    def _config_axes(cls, config: SpecConfig) -> dict[str, tuple[int, str]]:
        w = hidden_width(config, "extend")
        return {} if w.size is None else {"hidden_extend": (w.size, w.origin)}

    @classmethod
    def _config_expect(cls, config: SpecConfig) -> dict[str, tuple[Any, str]]:
        w = hidden_width(config, "extend")
        return {"hidden_states": (w.dtype, w.origin if w.size is None else f"{w.origin}, target dtype")}

    @classmethod
    def _value_problem(cls, obj: Any, config: Optional[SpecConfig]) -> Optional[tuple[str, str]]:
        a = obj.num_accept_tokens.long()
        if a.numel() and bool((a < 1).any()):
            return "num_accept_tokens", "every request owns at least one row (the bonus)"
        if int(a.sum()) != obj.input_ids.shape[0]:
            return "num_accept_tokens", f"sums to {int(a.sum())} but there are {obj.input_ids.shape[0]} rows"
        if not torch.equal(a, obj.num_correct_drafts.long() + 1):
            return "num_accept_tokens", "must equal num_correct_drafts + 1"
        if a.numel():
            last = torch.cumsum(a, 0) - 1
            if not torch.equal(obj.input_ids[last], obj.bonus_tokens):
                return "bonus_tokens", "must equal each request's last input id"
            start = torch.repeat_interleave(obj.seq_lens - a, a)
            offset = torch.arange(a.sum(), device=a.device) - torch.repeat_interleave(torch.cumsum(a, 0) - a, a)
            # the draft's KV lead (traits): 0 for shifted pairs, 1 when the draft reads its own sequence
            leads = (config.traits.draft_kv_lead,) if config is not None else (0, 1)
            if not any(torch.equal(obj.positions, start + offset + lead) for lead in leads):
                return "positions", (f"must be seq_lens - num_accept_tokens + {' or '.join(map(str, leads))} + j "
                                     "for row j of a request (the draft's KV lead)")
        return None


@_document
@phase_class
class VerifyOutput:
    """The result of verification for every request of the verified batch.

    Row b lists the root then the accepted nodes (`accept_indices`, global rows into the verify
    batch) and the emitted tokens (`accept_tokens`: the accepted drafts then the bonus), each padded
    with -1 to `accept_width` = num_steps + 1. A request that finished this iteration (stop token,
    length) has its lists cut after the finishing token and is absent from `draft_extend_input`.
    """

    accept_tokens: Int64[Tensor, "bs accept_width"] = _doc("emitted tokens per request, -1 padded")
    accept_indices: Int64[Tensor, "bs accept_width"] = _doc(
        "global verify rows of the root and the accepted nodes, -1 padded"
    )
    num_correct_drafts: Int32[Tensor, " bs"] = _doc("accepted draft tokens per request (bonus excluded)")
    num_accept_tokens: Int32[Tensor, " bs"] = _doc("emitted tokens per request: num_correct_drafts + 1")
    finished: Bool[Tensor, " bs"] = _doc("the request finished this iteration")
    draft_extend_input: DraftExtendInput = _doc("draft-extend input of the unfinished requests (maybe idle)")

    def __len__(self) -> int:
        return int(self.finished.shape[0])

    @classmethod
    def create_idle(cls, config: SpecConfig, device: Any = "cpu") -> "VerifyOutput":
        """A zero-row output with the live path's dtypes, ranks and widths."""
        w = config.num_steps + 1
        ids = _zeros((0, w), torch.int64, device)
        i32 = _zeros((0,), torch.int32, device)
        return cls(
            accept_tokens=ids,
            accept_indices=ids.clone(),
            num_correct_drafts=i32,
            num_accept_tokens=i32.clone(),
            finished=_zeros((0,), torch.bool, device),
            draft_extend_input=DraftExtendInput.create_idle(config, device),
        )

    @classmethod
    def _config_axes(cls, config: SpecConfig) -> dict[str, tuple[int, str]]:
        w = config.num_steps + 1
        return {"accept_width": (w, f"num_steps {config.num_steps} + 1")}

    @classmethod
    def _config_expect(cls, config: SpecConfig) -> dict[str, tuple[Any, str]]:
        return {}

    @classmethod
    def _value_problem(cls, obj: Any, config: Optional[SpecConfig]) -> Optional[tuple[str, str]]:
        c, a = obj.num_correct_drafts.long(), obj.num_accept_tokens.long()
        if not torch.equal(a, c + 1):
            return "num_accept_tokens", "must equal num_correct_drafts + 1"
        if c.numel() and bool(((c < 0) | (c > obj.accept_tokens.shape[1] - 1)).any()):
            return "num_correct_drafts", f"outside [0, num_steps = {obj.accept_tokens.shape[1] - 1}]"
        if not torch.equal((obj.accept_tokens >= 0).sum(1), a):
            return "accept_tokens", "the number of tokens (>= 0) per row must equal num_accept_tokens"
        if not torch.equal((obj.accept_indices >= 0).sum(1), a):
            return "accept_indices", "root + accepted nodes per row must equal num_accept_tokens"
        if int((~obj.finished).sum()) != len(obj.draft_extend_input):
            return "draft_extend_input", "must hold exactly the unfinished requests"
        return None
