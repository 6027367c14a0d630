"""Static buffers of the static (CUDA-graph) path: one typed dataclass per phase.

Each buffer is allocated once for the largest batch (`max_bs` requests), sized by the width rule
(`spec_schema.hidden_width`) and the config, never by a model's layer. Before every call `copy_in`
writes the live rows into the bucket-sized prefix and fills the padding rows up to the bucket with
sentinels: padded requests point at the reserved request row (`pad_row`, prefix length 0, so they
read nothing) and at a dummy KV slot (`pad_slot`), so their writes land nowhere that matters. The
phase cores then run on bucket-sized views of the buffers (eagerly, or replayed from a CUDA graph).

Axis names are DESIGN.md's; `max_bs` is the bucketed batch axis and `max_rows` the bucketed row
axis (`max_bs * topk` draft rows, `max_bs * num_draft` verify rows, `max_bs * (num_steps + 1)`
draft-extend rows). Every class follows the spec_schema contract protocol (`_config_axes`,
`_config_expect`, `_value_problem`), so `spec_schema.check(buf, DraftBuffers, config, values=True)`
validates widths, dtypes, the vocabularies and the row relations. A hidden-state width that does not
fit its buffer at copy-in raises `SpecContractError` naming `hidden_states`; it is never skipped.
"""

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import torch
from jaxtyping import Bool, Float32, Int32, Int64
from torch import Tensor

import spec_schema
from spec_schema import SpecConfig, SpecContractError, hidden_width
from spec_schema.phases import HiddenFloat

from . import faults
from .attention import ragged_rows

__all__ = [
    "DraftBuffers",
    "VerifyBuffers",
    "ExtendBuffers",
    "allocate_draft",
    "allocate_verify",
    "allocate_extend",
    "copy_in",
]

PAD_UNIFORM = 0.5  # coins of padded rows (any value in [0, 1) would do)


def _hidden_axis(config: SpecConfig, phase: str, axis: str) -> dict[str, tuple[int, str]]:
    w = hidden_width(config, phase)  # type: ignore[arg-type]
    return {} if w.size is None else {axis: (w.size, w.origin)}


def _hidden_expect(config: SpecConfig, phase: str, which: str) -> dict[str, tuple[Any, str]]:
    w = hidden_width(config, phase)  # type: ignore[arg-type]
    return {"hidden_states": (w.dtype, w.origin if w.size is None else f"{w.origin}, {which} dtype")}


def _rows_problem(name: str, rows: int, bs: int, per_request: int, what: str) -> Optional[tuple[str, str]]:
    if rows != bs * per_request:
        return name, f"has {rows} rows, expected max_bs {bs} x {what} {per_request} = {bs * per_request}"
    return None


@dataclass(frozen=True, eq=False)
class DraftBuffers:
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

    @property
    def max_bs(self) -> int:
        """Requests the buffers hold."""
        return self.seq_lens.shape[0]

    @classmethod
    def _config_axes(cls, config: SpecConfig) -> dict[str, tuple[int, str]]:
        return {
            "topk": (config.topk, f"SpecConfig.topk = {config.topk}"),
            "num_steps": (config.num_steps, f"SpecConfig.num_steps = {config.num_steps}"),
            "vocab": (config.vocab, f"target vocab_size = {config.vocab}"),
            "draft_vocab": (config.draft_vocab, f"{config.algorithm.value}: draft vocab {config.draft_vocab}"),
            **_hidden_axis(config, "draft", "hidden_draft"),
        }

    @classmethod
    def _config_expect(cls, config: SpecConfig) -> dict[str, tuple[Any, str]]:
        return _hidden_expect(config, "draft", "draft")

    @classmethod
    def _value_problem(cls, obj: Any, config: Optional[SpecConfig]) -> Optional[tuple[str, str]]:
        bs, k = obj.topk_p.shape
        problem = _rows_problem("draft_logits", obj.draft_logits.shape[0], bs, k, "topk")
        if problem is None and obj.uniforms is not None:
            problem = _rows_problem("uniforms", obj.uniforms.shape[1], bs, k, "topk")
        return problem


@dataclass(frozen=True, eq=False)
class VerifyBuffers:
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

    @property
    def max_bs(self) -> int:
        """Requests the buffers hold."""
        return self.seq_lens.shape[0]

    @classmethod
    def _config_axes(cls, config: SpecConfig) -> dict[str, tuple[int, str]]:
        n = config.num_draft_tokens
        return {
            "num_draft": (n, f"SpecConfig.num_draft_tokens = {n}"),
            "vocab": (config.vocab, f"target vocab_size = {config.vocab}"),
            **_hidden_axis(config, "extend", "hidden_extend"),
        }

    @classmethod
    def _config_expect(cls, config: SpecConfig) -> dict[str, tuple[Any, str]]:
        return _hidden_expect(config, "extend", "target")

    @classmethod
    def _value_problem(cls, obj: Any, config: Optional[SpecConfig]) -> Optional[tuple[str, str]]:
        if obj.hidden_states is None:
            return None
        bs, n = obj.draft_token.shape
        return _rows_problem("hidden_states", obj.hidden_states.shape[0], bs, n, "num_draft")


@dataclass(frozen=True, eq=False)
class ExtendBuffers:
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

    @property
    def max_bs(self) -> int:
        """Requests the buffers hold."""
        return self.seq_lens.shape[0]

    @classmethod
    def _config_axes(cls, config: SpecConfig) -> dict[str, tuple[int, str]]:
        return {
            "draft_vocab": (config.draft_vocab, f"{config.algorithm.value}: draft vocab {config.draft_vocab}"),
            **_hidden_axis(config, "extend", "hidden_extend"),
        }

    @classmethod
    def _config_expect(cls, config: SpecConfig) -> dict[str, tuple[Any, str]]:
        return _hidden_expect(config, "extend", "target")

    @classmethod
    def _value_problem(cls, obj: Any, config: Optional[SpecConfig]) -> Optional[tuple[str, str]]:
        if config is not None and obj.stride != config.num_steps + 1:
            return "stride", f"is {obj.stride}, expected num_steps {config.num_steps} + 1"
        return _rows_problem("input_ids", obj.input_ids.shape[0], obj.num_accept_tokens.shape[0],
                             obj.stride, "stride")


# ---- allocation ----------------------------------------------------------------------------------


def _check_allocated(buf: Any, cls: type, config: SpecConfig) -> None:
    if spec_schema.STRICT_LEVEL >= 1:
        spec_schema.check(buf, cls, config, values=True, producer=f"spec_runtime.buffers.allocate ({cls.__name__})")


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
    buf = DraftBuffers(
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
    )
    _check_allocated(buf, DraftBuffers, config)
    return buf


def allocate_verify(config: SpecConfig, max_bs: int, device: Any, sampled_chain: bool = False,
                    simulate: bool = True) -> VerifyBuffers:
    """Verify buffers for `max_bs` requests (`simulate`: room for the benchmarks' simulated accept counts)."""
    n = config.num_draft_tokens
    w = hidden_width(config, "extend")
    i64 = dict(dtype=torch.int64, device=device)
    node = torch.arange(n, device=device)
    buf = VerifyBuffers(
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
    )
    _check_allocated(buf, VerifyBuffers, config)
    return buf


def allocate_extend(config: SpecConfig, max_bs: int, device: Any, sampled_chain: bool = False) -> ExtendBuffers:
    """Draft-extend buffers for `max_bs` requests of num_steps + 1 rows each."""
    stride = config.num_steps + 1
    rows = max_bs * stride
    w = hidden_width(config, "extend")
    i64 = dict(dtype=torch.int64, device=device)
    buf = ExtendBuffers(
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
    )
    _check_allocated(buf, ExtendBuffers, config)
    return buf


# ---- copy-in ---------------------------------------------------------------------------------------


def _put(dst: Optional[Tensor], src: Optional[Tensor], live: int, end: int, fill: Any) -> None:
    """`dst[:live] = src`, `dst[live:end] = fill` (a number or a 0-d tensor: no host read)."""
    if dst is None:
        return
    if src is not None:
        dst[:live].copy_(src)
    if end > live:
        dst[live:end].fill_(fill)


def _put_sampling(buf: Any, get: Any, live: int, end: int) -> None:
    """The requests' sampling parameters; padding rows are greedy (temperature 0, no top-k/top-p)."""
    _put(buf.temperature, get("temperature"), live, end, 0.0)
    _put(buf.top_k, get("top_k"), live, end, 0)
    _put(buf.top_p, get("top_p"), live, end, 1.0)


def _hidden_fits(cls_name: str, dst: Optional[Tensor], src: Optional[Tensor], source: str) -> bool:
    """Whether the live hidden states `src` may be copied into the buffer `dst`.

    A width or dtype that does not fit raises `SpecContractError` (the bug zoo's
    skip_hidden_copy_on_mismatch fault skips the copy silently instead, as the historical code did)."""
    if dst is None and src is None:
        return False
    if dst is None or src is None:
        have = "the buffer was allocated without hidden states" if dst is None else "the phase object has none"
        raise SpecContractError(
            f"{cls_name}.hidden_states: {have} ({source} is "
            f"{'None' if src is None else f'shape {tuple(src.shape)}'}; buffer "
            f"{'None' if dst is None else f'shape {tuple(dst.shape)}'})",
            cls_name=cls_name, field="hidden_states")
    if src.shape[1:] != dst.shape[1:] or src.dtype != dst.dtype:
        if faults.active("skip_hidden_copy_on_mismatch"):  # bug zoo: the historical silent skip
            return False
        axis = "hidden_draft" if cls_name == "DraftBuffers" else "hidden_extend"
        raise SpecContractError(
            f"{cls_name}.hidden_states: {source} has width {src.shape[-1]} dtype {src.dtype}, but the "
            f"static buffer has width {dst.shape[-1]} dtype {dst.dtype} (axis {axis}); a hidden-state copy "
            "is never skipped",
            cls_name=cls_name, field="hidden_states", axis=axis)
    return True


def _pad_of(get: "_Source") -> Tensor:
    """The dummy KV slot of padded rows, as a 0-d tensor (filled without a host read)."""
    value = get("pad_slot")
    if value is None:
        raise ValueError("copy_in needs `pad_slot` (the dummy KV slot of padded rows)")
    return value.reshape(())


def copy_in(buf: Any, src: Any, bucket: int, pad_row: int, **extras: Any) -> int:
    """Copy the live rows of `src` into `buf` and pad up to `bucket` requests; returns the live bs.

    `src` is a phase core input (`DraftCoreIn`, `VerifyCoreIn`, `ExtendCoreIn`) or any object with
    the buffer's field names (a phase object plus `extras`, which take precedence); `pad_row` is the
    reserved request row and `src.pad_slot` the dummy KV slot of padded requests.

    Raises:
        SpecContractError: the live hidden states do not fit the buffer (width, dtype, None-ness).
        ValueError: more live requests than the bucket holds.
    """
    get = _Source(src, extras)
    if isinstance(buf, DraftBuffers):
        return _copy_draft(buf, get, bucket, pad_row)
    if isinstance(buf, VerifyBuffers):
        return _copy_verify(buf, get, bucket, pad_row)
    if isinstance(buf, ExtendBuffers):
        return _copy_extend(buf, get, bucket, pad_row)
    raise TypeError(f"copy_in: not a static buffer: {type(buf).__name__}")


class _Source:
    def __init__(self, src: Any, extras: dict[str, Any]) -> None:
        self.src, self.extras = src, extras

    def __call__(self, name: str) -> Any:
        return self.extras[name] if name in self.extras else getattr(self.src, name, None)


def _check_bucket(cls_name: str, bs: int, bucket: int, max_bs: int) -> None:
    if not 0 <= bs <= bucket <= max_bs:
        raise ValueError(f"{cls_name}: {bs} live requests do not fit bucket {bucket} (max_bs {max_bs})")


def _copy_draft(buf: DraftBuffers, get: _Source, bucket: int, pad_row: int) -> int:
    bs, k = get("topk_p").shape
    _check_bucket("DraftBuffers", bs, bucket, buf.max_bs)
    pad = _pad_of(get)
    _put(buf.topk_p, get("topk_p"), bs, bucket, 0.0)
    _put(buf.topk_index, get("topk_index"), bs, bucket, 0)
    if _hidden_fits("DraftBuffers", buf.hidden_states, get("hidden_states"), "DraftInput.hidden_states"):
        _put(buf.hidden_states, get("hidden_states"), bs, bucket, 0.0)
    _put(buf.bonus_tokens, get("bonus_tokens"), bs, bucket, 0)
    _put(buf.seq_lens, get("seq_lens"), bs, bucket, 0)
    _put(buf.req_pool_indices, get("req_pool_indices"), bs, bucket, pad_row)
    _put(buf.temp_slots, get("temp_slots"), bs, bucket, pad)
    if buf.draft_probs is not None:
        _put(buf.draft_probs, get("draft_probs"), bs, bucket, 0.0)
        _put_sampling(buf, get, bs, bucket)
        uniforms = get("uniforms")
        if uniforms is not None:
            buf.uniforms[: uniforms.shape[0], : bs * k].copy_(uniforms)
        buf.uniforms[:, bs * k : bucket * k].fill_(PAD_UNIFORM)
    return bs


def _copy_verify(buf: VerifyBuffers, get: _Source, bucket: int, pad_row: int) -> int:
    bs, n = get("draft_token").shape
    _check_bucket("VerifyBuffers", bs, bucket, buf.max_bs)
    pad = _pad_of(get)
    for name in ("draft_token", "positions"):
        _put(getattr(buf, name), get(name), bs, bucket, 0)
    for name in ("retrieve_next_token", "retrieve_next_sibling"):
        _put(getattr(buf, name), get(name), bs, bucket, -1)
    # padded requests: a tree of unlinked nodes, each seeing itself; retrieve_index keeps b * n + i
    buf.tree_mask[:bs].copy_(get("tree_mask"))
    if bucket > bs:
        buf.tree_mask[bs:bucket].copy_(torch.eye(n, dtype=torch.bool, device=buf.tree_mask.device).expand(bucket - bs, n, n))
    buf.retrieve_index[:bs].copy_(get("retrieve_index"))
    _put(buf.seq_lens, get("seq_lens"), bs, bucket, 0)
    _put(buf.req_pool_indices, get("req_pool_indices"), bs, bucket, pad_row)
    _put(buf.slots, get("slots"), bs, bucket, pad)
    if not get("greedy"):
        uniforms = get("uniforms")
        buf.uniforms[:bs, : uniforms.shape[1]].copy_(uniforms)
        _put(buf.uniforms, None, bs, bucket, PAD_UNIFORM)
        _put(buf.uniform_final, get("uniform_final"), bs, bucket, PAD_UNIFORM)
        _put_sampling(buf, get, bs, bucket)
    if buf.draft_probs is not None:
        _put(buf.draft_probs, get("draft_probs"), bs, bucket, 0.0)
    if buf.sim_accept is not None and get("sim_accept") is not None:
        _put(buf.sim_accept, get("sim_accept"), bs, bucket, 1)
    return bs


def _copy_extend(buf: ExtendBuffers, get: _Source, bucket: int, pad_row: int) -> int:
    counts = get("num_accept_tokens")
    bs, stride = counts.shape[0], buf.stride
    _check_bucket("ExtendBuffers", bs, bucket, buf.max_bs)
    pad = _pad_of(get)
    ids = get("input_ids")
    rows = ids.shape[0]
    # ragged live rows -> row r * stride + j of the padded layout (no host read: output_size is known)
    req, j = ragged_rows(counts, rows)
    dest = req * stride + j
    end = bucket * stride
    hidden = get("hidden_states")
    fits = _hidden_fits("ExtendBuffers", buf.hidden_states, hidden, "DraftExtendInput.hidden_states")
    for dst, src, fill in ((buf.input_ids, ids, 0), (buf.positions, get("positions"), 0),
                           (buf.out_slots, get("out_slots"), pad),
                           (buf.hidden_states if fits else None, hidden, 0.0)):
        if dst is None:
            continue
        dst[:end].fill_(fill)
        dst[dest] = src
    _put(buf.num_accept_tokens, counts, bs, bucket, 1)
    # padded requests: one row, prefix 0 (seq_len 1 - count 1)
    _put(buf.seq_lens, get("seq_lens"), bs, bucket, 1)
    _put(buf.req_pool_indices, get("req_pool_indices"), bs, bucket, pad_row)
    if buf.uniform is not None:
        _put(buf.uniform, get("uniform"), bs, bucket, PAD_UNIFORM)
        _put_sampling(buf, get, bs, bucket)
    return bs


def buffer_nbytes(buf: Any) -> int:
    """Bytes a buffer holds (for reports)."""
    total = 0
    for f in dataclasses.fields(buf):
        v = getattr(buf, f.name)
        if isinstance(v, Tensor):
            total += v.numel() * v.element_size()
    return total
