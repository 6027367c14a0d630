"""Copy-in: the live rows of a phase core's input into a buffer's bucket-sized prefix, the padding
rows up to the bucket filled with sentinels (see `spec_runtime.buffers`)."""

from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import Tensor

from spec_schema import SpecContractError

from .. import faults
from ..attention import ragged_rows
from .alloc import PAD_UNIFORM, DraftBuffers, ExtendBuffers, VerifyBuffers

__all__ = ["copy_in", "hidden_fits", "put_rows"]

_Get = Callable[[str], Any]  # a field of the copy's source by name (None where it has none)


def put_rows(dst: Optional[Tensor], src: Optional[Tensor], live: int, end: int, fill: Any) -> None:
    """`dst[:live] = src`, `dst[live:end] = fill` (a number or a 0-d tensor: no host read)."""
    if dst is None:
        return
    if src is not None:
        dst[:live].copy_(src)
    if end > live:
        dst[live:end].fill_(fill)


def _put_sampling(buf: Any, get: _Get, live: int, end: int) -> None:
    """The requests' sampling parameters; padding rows are greedy (temperature 0, no top-k/top-p)."""
    put_rows(buf.temperature, get("temperature"), live, end, 0.0)
    put_rows(buf.top_k, get("top_k"), live, end, 0)
    put_rows(buf.top_p, get("top_p"), live, end, 1.0)


def hidden_fits(cls_name: str, dst: Optional[Tensor], src: Optional[Tensor], source: str) -> bool:
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


def _pad_of(get: _Get) -> Tensor:
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
    def get(name: str) -> Any:
        return extras[name] if name in extras else getattr(src, name, None)

    if isinstance(buf, DraftBuffers):
        return _copy_draft(buf, get, bucket, pad_row)
    if isinstance(buf, VerifyBuffers):
        return _copy_verify(buf, get, bucket, pad_row)
    if isinstance(buf, ExtendBuffers):
        return _copy_extend(buf, get, bucket, pad_row)
    raise TypeError(f"copy_in: not a static buffer: {type(buf).__name__}")


def _check_bucket(cls_name: str, bs: int, bucket: int, max_bs: int) -> None:
    if not 0 <= bs <= bucket <= max_bs:
        raise ValueError(f"{cls_name}: {bs} live requests do not fit bucket {bucket} (max_bs {max_bs})")


def _copy_draft(buf: DraftBuffers, get: _Get, bucket: int, pad_row: int) -> int:
    bs, k = get("topk_p").shape
    _check_bucket("DraftBuffers", bs, bucket, buf.max_bs)
    pad = _pad_of(get)
    put_rows(buf.topk_p, get("topk_p"), bs, bucket, 0.0)
    put_rows(buf.topk_index, get("topk_index"), bs, bucket, 0)
    if hidden_fits("DraftBuffers", buf.hidden_states, get("hidden_states"), "DraftInput.hidden_states"):
        put_rows(buf.hidden_states, get("hidden_states"), bs, bucket, 0.0)
    put_rows(buf.bonus_tokens, get("bonus_tokens"), bs, bucket, 0)
    put_rows(buf.seq_lens, get("seq_lens"), bs, bucket, 0)
    put_rows(buf.req_pool_indices, get("req_pool_indices"), bs, bucket, pad_row)
    put_rows(buf.temp_slots, get("temp_slots"), bs, bucket, pad)
    if buf.draft_probs is not None:
        put_rows(buf.draft_probs, get("draft_probs"), bs, bucket, 0.0)
        _put_sampling(buf, get, bs, bucket)
        uniforms = get("uniforms")
        if uniforms is not None:
            buf.uniforms[: uniforms.shape[0], : bs * k].copy_(uniforms)
        buf.uniforms[:, bs * k : bucket * k].fill_(PAD_UNIFORM)
    return bs


def _copy_verify(buf: VerifyBuffers, get: _Get, bucket: int, pad_row: int) -> int:
    bs, n = get("draft_token").shape
    _check_bucket("VerifyBuffers", bs, bucket, buf.max_bs)
    pad = _pad_of(get)
    for name in ("draft_token", "positions"):
        put_rows(getattr(buf, name), get(name), bs, bucket, 0)
    for name in ("retrieve_next_token", "retrieve_next_sibling"):
        put_rows(getattr(buf, name), get(name), bs, bucket, -1)
    # padded requests: a tree of unlinked nodes, each seeing itself; retrieve_index keeps b * n + i
    buf.tree_mask[:bs].copy_(get("tree_mask"))
    if bucket > bs:
        buf.tree_mask[bs:bucket].copy_(torch.eye(n, dtype=torch.bool, device=buf.tree_mask.device).expand(bucket - bs, n, n))
    buf.retrieve_index[:bs].copy_(get("retrieve_index"))
    put_rows(buf.seq_lens, get("seq_lens"), bs, bucket, 0)
    put_rows(buf.req_pool_indices, get("req_pool_indices"), bs, bucket, pad_row)
    put_rows(buf.slots, get("slots"), bs, bucket, pad)
    if not get("greedy"):
        uniforms = get("uniforms")
        buf.uniforms[:bs, : uniforms.shape[1]].copy_(uniforms)
        put_rows(buf.uniforms, None, bs, bucket, PAD_UNIFORM)
        put_rows(buf.uniform_final, get("uniform_final"), bs, bucket, PAD_UNIFORM)
        _put_sampling(buf, get, bs, bucket)
    if buf.draft_probs is not None:
        put_rows(buf.draft_probs, get("draft_probs"), bs, bucket, 0.0)
    if buf.sim_accept is not None and get("sim_accept") is not None:
        put_rows(buf.sim_accept, get("sim_accept"), bs, bucket, 1)
    return bs


def _copy_extend(buf: ExtendBuffers, get: _Get, bucket: int, pad_row: int) -> int:
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
    fits = hidden_fits("ExtendBuffers", buf.hidden_states, hidden, "DraftExtendInput.hidden_states")
    for dst, src, fill in ((buf.input_ids, ids, 0), (buf.positions, get("positions"), 0),
                           (buf.out_slots, get("out_slots"), pad),
                           (buf.hidden_states if fits else None, hidden, 0.0)):
        if dst is None:
            continue
        dst[:end].fill_(fill)
        dst[dest] = src
    put_rows(buf.num_accept_tokens, counts, bs, bucket, 1)
    # padded requests: one row, prefix 0 (seq_len 1 - count 1)
    put_rows(buf.seq_lens, get("seq_lens"), bs, bucket, 1)
    put_rows(buf.req_pool_indices, get("req_pool_indices"), bs, bucket, pad_row)
    if buf.uniform is not None:
        put_rows(buf.uniform, get("uniform"), bs, bucket, PAD_UNIFORM)
        _put_sampling(buf, get, bs, bucket)
    return bs
