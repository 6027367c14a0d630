"""The static buffers, one typed dataclass per phase, and their allocation (see `spec_runtime.buffers`)."""

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import torch
from jaxtyping import Bool, Float32, Int32, Int64
from torch import Tensor

import spec_schema
from spec_schema import SpecConfig, hidden_width
from spec_schema.phases import HiddenFloat

from .. import faults

__all__ = ["PAD_UNIFORM", "DraftBuffers", "ExtendBuffers", "VerifyBuffers", "allocate_draft", "allocate_extend",
           "allocate_verify", "buffer_nbytes"]

PAD_UNIFORM = 0.5  # coins of padded rows (any value in [0, 1) would do)


def _hidden_axis(config: SpecConfig, phase: str) -> dict[str, tuple[int, str]]:
    w = hidden_width(config, phase)  # type: ignore[arg-type]
    return {} if w.size is None else {f"hidden_{phase}": (w.size, w.origin)}


def _rows_problem(name: str, rows: int, bs: int, per_request: int, what: str) -> Optional[tuple[str, str]]:
    if rows != bs * per_request:
        return name, f"has {rows} rows, expected max_bs {bs} x {what} {per_request} = {bs * per_request}"
    return None


class _PhaseBuffers:
    """What the buffer classes share: `max_bs` and the hidden-state dtype their contract expects."""

    _PHASE = "extend"  # hidden_width phase of `hidden_states`: "draft" (draft dtype) or "extend" (target)

    @property
    def max_bs(self) -> int:
        """Requests the buffers hold."""
        return self.seq_lens.shape[0]  # type: ignore[attr-defined]

    @classmethod
    def _config_expect(cls, config: SpecConfig) -> dict[str, tuple[Any, str]]:
        w = hidden_width(config, cls._PHASE)  # type: ignore[arg-type]
        which = "draft" if cls._PHASE == "draft" else "target"
        return {"hidden_states": (w.dtype, w.origin if w.size is None else f"{w.origin}, {which} dtype")}


@dataclass(frozen=True, eq=False)
class DraftBuffers(_PhaseBuffers):
    """Static inputs and scratch of the draft phase (the multi-step loop and the tree build).

    Attributes:
        topk_p, topk_index: `(max_bs, topk)` the root's children.
        hidden_states: `(max_bs, hidden_draft)` draft dtype; None when the draft reads none (STANDALONE).
        bonus_tokens, seq_lens, req_pool_indices: `(max_bs,)`.
        temp_slots: `(max_bs, topk, num_steps)` draft KV slot of branch (b, k) at step s in column
            s - 1 (steps 1 .. num_steps - 1; the last column is spare).
        draft_logits: `(max_rows, draft_vocab)` float32, max_rows = max_bs * topk: the draft's logits
            at each step (EAGLE-3 heads score their own, smaller vocabulary).
        draft_probs: `(max_bs, vocab)` sampled chains only (else None), like `DraftInput.draft_probs`.
        uniforms: `(num_steps, max_rows)` sampled chains' coins, row s - 1 for step s (else None).
        temperature, top_k, top_p: `(max_bs,)` sampled chains' parameters (else None).
    """

    topk_p: Float32[Tensor, "max_bs topk"]
    topk_index: Int64[Tensor, "max_bs topk"]
    hidden_states: Optional[HiddenFloat[Tensor, "max_bs hidden_draft"]]
    bonus_tokens: Int64[Tensor, " max_bs"]
    seq_lens: Int64[Tensor, " max_bs"]
    req_pool_indices: Int64[Tensor, " max_bs"]
    temp_slots: Int64[Tensor, "max_bs topk num_steps"]
    draft_logits: Float32[Tensor, "max_rows draft_vocab"]
    draft_probs: Optional[Float32[Tensor, "max_bs vocab"]] = None
    uniforms: Optional[Float32[Tensor, "num_steps max_rows"]] = None
    temperature: Optional[Float32[Tensor, " max_bs"]] = None
    top_k: Optional[Int64[Tensor, " max_bs"]] = None
    top_p: Optional[Float32[Tensor, " max_bs"]] = None

    _PHASE = "draft"

    @classmethod
    def _config_axes(cls, config: SpecConfig) -> dict[str, tuple[int, str]]:
        return {
            "topk": (config.topk, f"SpecConfig.topk = {config.topk}"),
            "num_steps": (config.num_steps, f"SpecConfig.num_steps = {config.num_steps}"),
            "vocab": (config.vocab, f"target vocab_size = {config.vocab}"),
            "draft_vocab": (config.draft_vocab, f"{config.algorithm.value}: draft vocab {config.draft_vocab}"),
            **_hidden_axis(config, "draft"),
        }

    @classmethod
    def _value_problem(cls, obj: Any, config: Optional[SpecConfig]) -> Optional[tuple[str, str]]:
        bs, k = obj.topk_p.shape
        problem = _rows_problem("draft_logits", obj.draft_logits.shape[0], bs, k, "topk")
        if problem is None and obj.uniforms is not None:
            problem = _rows_problem("uniforms", obj.uniforms.shape[1], bs, k, "topk")
        return problem


@dataclass(frozen=True, eq=False)
class VerifyBuffers(_PhaseBuffers):
    """Static inputs and scratch of the verify phase (the target's tree forward and acceptance).

    Attributes:
        draft_token, positions, retrieve_index, retrieve_next_token, retrieve_next_sibling, slots:
            `(max_bs, num_draft)`; `slots` is the target KV slot of every node.
        tree_mask: `(max_bs, num_draft, num_draft)`.
        seq_lens, req_pool_indices: `(max_bs,)`.
        hidden_states: `(max_rows, hidden_extend)` target dtype, max_rows = max_bs * num_draft: the
            captured target rows; None when the draft reads none (STANDALONE captures nothing).
        uniforms: `(max_bs, num_draft)`, uniform_final `(max_bs,)`: pre-drawn coins of sampling
            verification (a chain uses the first num_draft - 1 columns).
        temperature, top_k, top_p: `(max_bs,)` the requests' sampling parameters.
        draft_probs: `(max_bs, num_draft, vocab)` sampled chains only (else None).
        sim_accept: `(max_bs,)` benchmarks' simulated accept counts (read only by the simulated flavor).
    """

    draft_token: Int64[Tensor, "max_bs num_draft"]
    positions: Int64[Tensor, "max_bs num_draft"]
    tree_mask: Bool[Tensor, "max_bs num_draft num_draft"]
    retrieve_index: Int64[Tensor, "max_bs num_draft"]
    retrieve_next_token: Int64[Tensor, "max_bs num_draft"]
    retrieve_next_sibling: Int64[Tensor, "max_bs num_draft"]
    seq_lens: Int64[Tensor, " max_bs"]
    req_pool_indices: Int64[Tensor, " max_bs"]
    slots: Int64[Tensor, "max_bs num_draft"]
    hidden_states: Optional[HiddenFloat[Tensor, "max_rows hidden_extend"]]
    uniforms: Float32[Tensor, "max_bs num_draft"]
    uniform_final: Float32[Tensor, " max_bs"]
    temperature: Float32[Tensor, " max_bs"]
    top_k: Int64[Tensor, " max_bs"]
    top_p: Float32[Tensor, " max_bs"]
    draft_probs: Optional[Float32[Tensor, "max_bs num_draft vocab"]] = None
    sim_accept: Optional[Int64[Tensor, " max_bs"]] = None

    @classmethod
    def _config_axes(cls, config: SpecConfig) -> dict[str, tuple[int, str]]:
        n = config.num_draft_tokens
        return {
            "num_draft": (n, f"SpecConfig.num_draft_tokens = {n}"),
            "vocab": (config.vocab, f"target vocab_size = {config.vocab}"),
            **_hidden_axis(config, "extend"),
        }

    @classmethod
    def _value_problem(cls, obj: Any, config: Optional[SpecConfig]) -> Optional[tuple[str, str]]:
        if obj.hidden_states is None:
            return None
        bs, n = obj.draft_token.shape
        return _rows_problem("hidden_states", obj.hidden_states.shape[0], bs, n, "num_draft")


@dataclass(frozen=True, eq=False)
class ExtendBuffers(_PhaseBuffers):
    """Static inputs and scratch of the draft-extend phase, rows laid out `stride` = num_steps + 1
    per request (request r owns rows r * stride .. r * stride + count - 1; the rest are padding).

    Attributes:
        input_ids, positions, out_slots: `(max_rows,)`, max_rows = max_bs * stride.
        hidden_states: `(max_rows, hidden_extend)` target dtype; None when the draft reads none.
        num_accept_tokens: `(max_bs,)` int32 rows per request (the counts).
        seq_lens, req_pool_indices: `(max_bs,)`.
        draft_logits: `(max_bs, draft_vocab)` float32: the draft's logits at each request's last row.
        uniform, temperature, top_k, top_p: `(max_bs,)` sampled chains only (else None).
        stride: rows per request, num_steps + 1.
    """

    input_ids: Int64[Tensor, " max_rows"]
    positions: Int64[Tensor, " max_rows"]
    out_slots: Int64[Tensor, " max_rows"]
    hidden_states: Optional[HiddenFloat[Tensor, "max_rows hidden_extend"]]
    num_accept_tokens: Int32[Tensor, " max_bs"]
    seq_lens: Int64[Tensor, " max_bs"]
    req_pool_indices: Int64[Tensor, " max_bs"]
    draft_logits: Float32[Tensor, "max_bs draft_vocab"]
    stride: int
    uniform: Optional[Float32[Tensor, " max_bs"]] = None
    temperature: Optional[Float32[Tensor, " max_bs"]] = None
    top_k: Optional[Int64[Tensor, " max_bs"]] = None
    top_p: Optional[Float32[Tensor, " max_bs"]] = None

    @classmethod
    def _config_axes(cls, config: SpecConfig) -> dict[str, tuple[int, str]]:
        return {
            "draft_vocab": (config.draft_vocab, f"{config.algorithm.value}: draft vocab {config.draft_vocab}"),
            **_hidden_axis(config, "extend"),
        }

    @classmethod
    def _value_problem(cls, obj: Any, config: Optional[SpecConfig]) -> Optional[tuple[str, str]]:
        if config is not None and obj.stride != config.num_steps + 1:
            return "stride", f"is {obj.stride}, expected num_steps {config.num_steps} + 1"
        return _rows_problem("input_ids", obj.input_ids.shape[0], obj.num_accept_tokens.shape[0],
                             obj.stride, "stride")


# ---- allocation ----------------------------------------------------------------------------------


def _checked(config: SpecConfig, buf: Any) -> Any:
    if spec_schema.STRICT_LEVEL >= 1:
        spec_schema.check(buf, type(buf), config, values=True,
                          producer=f"spec_runtime.buffers.allocate ({type(buf).__name__})")
    return buf


def _sampling(max_bs: int, device: Any) -> dict[str, Tensor]:
    return {
        "temperature": torch.zeros(max_bs, device=device),
        "top_k": torch.zeros(max_bs, dtype=torch.int64, device=device),
        "top_p": torch.ones(max_bs, device=device),
    }


def allocate_draft(config: SpecConfig, max_bs: int, device: Any, sampled_chain: bool = False) -> DraftBuffers:
    """Draft buffers for `max_bs` requests; `sampled_chain` adds the sampled chains' fields."""
    k, s = config.topk, config.num_steps
    w = hidden_width(config, "draft")
    width = w.size
    if width is not None and faults.active("graph_buffer_wrong_model"):  # bug zoo: the other model's width
        width = config.target.hidden_size
    cols = config.vocab if faults.active("draft_logits_target_vocab") else config.draft_vocab  # bug zoo
    i64 = dict(dtype=torch.int64, device=device)
    return _checked(config, DraftBuffers(
        topk_p=torch.zeros(max_bs, k, device=device),
        topk_index=torch.zeros(max_bs, k, **i64),
        hidden_states=None if width is None else torch.zeros(max_bs, width, dtype=w.dtype, device=device),
        bonus_tokens=torch.zeros(max_bs, **i64),
        seq_lens=torch.zeros(max_bs, **i64),
        req_pool_indices=torch.zeros(max_bs, **i64),
        temp_slots=torch.zeros(max_bs, k, s, **i64),
        draft_logits=torch.zeros(max_bs * k, cols, device=device),
        draft_probs=torch.zeros(max_bs, config.vocab, device=device) if sampled_chain else None,
        uniforms=torch.full((s, max_bs * k), PAD_UNIFORM, device=device) if sampled_chain else None,
        **(_sampling(max_bs, device) if sampled_chain else {}),
    ))


def allocate_verify(config: SpecConfig, max_bs: int, device: Any, sampled_chain: bool = False,
                    simulate: bool = True) -> VerifyBuffers:
    """Verify buffers for `max_bs` requests (`simulate`: room for the benchmarks' simulated accept counts)."""
    n = config.num_draft_tokens
    w = hidden_width(config, "extend")
    i64 = dict(dtype=torch.int64, device=device)
    node = torch.arange(n, device=device)
    return _checked(config, VerifyBuffers(
        draft_token=torch.zeros(max_bs, n, **i64),
        positions=torch.zeros(max_bs, n, **i64),
        tree_mask=torch.eye(n, dtype=torch.bool, device=device).repeat(max_bs, 1, 1),
        retrieve_index=torch.arange(max_bs, device=device)[:, None] * n + node,
        retrieve_next_token=torch.full((max_bs, n), -1, **i64),
        retrieve_next_sibling=torch.full((max_bs, n), -1, **i64),
        seq_lens=torch.zeros(max_bs, **i64),
        req_pool_indices=torch.zeros(max_bs, **i64),
        slots=torch.zeros(max_bs, n, **i64),
        hidden_states=None if w.size is None else torch.zeros(max_bs * n, w.size, dtype=w.dtype, device=device),
        uniforms=torch.full((max_bs, n), PAD_UNIFORM, device=device),
        uniform_final=torch.full((max_bs,), PAD_UNIFORM, device=device),
        draft_probs=torch.zeros(max_bs, n, config.vocab, device=device) if sampled_chain else None,
        sim_accept=torch.ones(max_bs, **i64) if simulate else None,
        **_sampling(max_bs, device),
    ))


def allocate_extend(config: SpecConfig, max_bs: int, device: Any, sampled_chain: bool = False) -> ExtendBuffers:
    """Draft-extend buffers for `max_bs` requests of num_steps + 1 rows each."""
    stride = config.num_steps + 1
    rows = max_bs * stride
    w = hidden_width(config, "extend")
    i64 = dict(dtype=torch.int64, device=device)
    return _checked(config, ExtendBuffers(
        input_ids=torch.zeros(rows, **i64),
        positions=torch.zeros(rows, **i64),
        out_slots=torch.zeros(rows, **i64),
        hidden_states=None if w.size is None else torch.zeros(rows, w.size, dtype=w.dtype, device=device),
        num_accept_tokens=torch.ones(max_bs, dtype=torch.int32, device=device),
        seq_lens=torch.ones(max_bs, **i64),
        req_pool_indices=torch.zeros(max_bs, **i64),
        draft_logits=torch.zeros(max_bs, config.draft_vocab, device=device),
        stride=stride,
        uniform=torch.full((max_bs,), PAD_UNIFORM, device=device) if sampled_chain else None,
        **(_sampling(max_bs, device) if sampled_chain else {}),
    ))


def buffer_nbytes(buf: Any) -> int:
    """Bytes a buffer holds (for reports)."""
    tensors = (getattr(buf, f.name) for f in dataclasses.fields(buf))
    return sum(v.numel() * v.element_size() for v in tensors if isinstance(v, Tensor))
