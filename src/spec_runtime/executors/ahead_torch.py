"""The launch-ahead draft-extend graph's bookkeeping as torch ops: the references of
`kernels.bookkeeping.ahead_extend_in` / `ahead_extend_out` (`FastOptions(bookkeeping="torch")` and the
interpreter run these), and the padding helpers the launched graphs use."""

from typing import Any, Optional

import torch

from .graphs import copy_all

__all__ = ["ahead_extend_in_torch", "ahead_extend_out_torch", "live_mask", "live_or_pad"]


def live_or_pad(live: Optional[torch.Tensor], value: torch.Tensor, pad: Any) -> torch.Tensor:
    """`value` for the live requests (`live (bucket,)` bool, broadcast along value's trailing axes),
    `pad` for the others; `live` None (no padding possible): `value` as it is."""
    if live is None:
        return value
    return torch.where(live.view(-1, *([1] * (value.dim() - 1))), value, pad)


def live_mask(nlive: Optional[torch.Tensor], bucket: int, device: torch.device) -> Optional[torch.Tensor]:
    """`(bucket,)` bool: requests below `nlive` (None: every one, no mask)."""
    return None if nlive is None else torch.arange(bucket, device=device) < nlive


def ahead_extend_in_torch(vo, vb, eb, ext_slots: torch.Tensor, nlive: Optional[torch.Tensor],
                          target_rt: torch.Tensor, pad_row: int, pad_t, pad_d, lead: int = 0) -> tuple:
    """The launch-ahead draft-extend graph's steps before its forward, as torch ops (the reference
    of `kernels.bookkeeping.ahead_extend_in`): verify outputs -> the target's slot table (accepted
    nodes at `seq_len + j`) and the draft-extend buffers; requests `>= nlive` (when given) and rows
    past a request's accepted count get the padding; the draft's rows sit at `seq_len + j + lead`
    (the draft's KV lead, traits). Returns what `ahead_extend_out_torch` reuses."""
    bucket, width = vo.num_correct.shape[0], eb.stride
    dev = vo.num_correct.device
    alive = live_mask(nlive, bucket, dev)
    counts = vo.num_correct.long() + 1
    cols = torch.arange(width, device=dev)
    keep = cols[None, :] < counts[:, None]
    if alive is not None:
        keep = keep & alive[:, None]
    seq, req = vb.seq_lens[:bucket], vb.req_pool_indices[:bucket]
    acc = vo.accept_index.clamp(min=0)
    rows = torch.where(keep, req[:, None], pad_row).reshape(-1)
    at = torch.where(keep, seq[:, None] + cols, 0).reshape(-1)
    node_slots = torch.where(keep, vb.slots[:bucket].reshape(-1)[acc], pad_t)
    target_rt.index_put_((rows, at), node_slots.reshape(-1))
    n_rows = bucket * width
    ext = torch.where(keep, ext_slots[:bucket], pad_d).reshape(-1)
    at_draft = torch.where(keep, seq[:, None] + cols + lead, 0).reshape(-1) if lead else at
    copies = [
        (eb.input_ids[:n_rows], torch.where(keep, vo.accept_tokens, 0).reshape(-1)),
        (eb.positions[:n_rows], at_draft),
        (eb.out_slots[:n_rows], ext),
        (eb.num_accept_tokens[:bucket], live_or_pad(alive, counts, 1)),
        (eb.seq_lens[:bucket], live_or_pad(alive, seq + counts, 1)),
        (eb.req_pool_indices[:bucket], live_or_pad(alive, req, pad_row)),
    ]
    if eb.hidden_states is not None:
        copies.append((eb.hidden_states[:n_rows], vo.captured[acc.reshape(-1)]))
    copy_all(copies)
    return rows, at_draft, ext, counts, alive


def ahead_extend_out_torch(vo, vb, db, out, nlive: Optional[torch.Tensor], draft_rt: torch.Tensor,
                           scratch: torch.Tensor, pad_row: int, pad_d, prev: tuple) -> None:
    """The steps after the forward, as torch ops (the reference of
    `kernels.bookkeeping.ahead_extend_out`): the draft's slot table, and the draft buffers of the
    next draft; `prev`: what `ahead_extend_in_torch` returned."""
    rows, at, ext, counts, alive = prev
    bucket = vo.num_correct.shape[0]
    seq, req = vb.seq_lens[:bucket], vb.req_pool_indices[:bucket]
    draft_rt.index_put_((rows, at), ext)
    bonus = vo.accept_tokens.gather(1, (counts - 1)[:, None]).squeeze(1)
    copies = [
        (db.topk_p[:bucket], live_or_pad(alive, out.topk_p, 0.0)),
        (db.topk_index[:bucket], live_or_pad(alive, out.topk_index, 0)),
        (db.bonus_tokens[:bucket], live_or_pad(alive, bonus, 0)),
        (db.seq_lens[:bucket], live_or_pad(alive, seq + counts, 0)),
        (db.req_pool_indices[:bucket], live_or_pad(alive, req, pad_row)),
        (db.temp_slots[:bucket], live_or_pad(alive, scratch[:bucket], pad_d)),
    ]
    if db.hidden_states is not None:
        copies.append((db.hidden_states[:bucket], live_or_pad(alive, out.hidden_states, 0.0)))
    copy_all(copies)
