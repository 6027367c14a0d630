"""The launch-ahead protocol's records (`executors.ahead.LaunchAhead`): what a launch was prepared
and launched with, the verify rows its graphs keep, and the host copy of a verify's tokens."""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import torch

from ..core_types import DraftCoreOut, ExtendCoreOut, VerifyCoreOut
from ..verify import stacked_rows

__all__ = ["HostRows", "Launched", "LiveRows", "Prepared", "Shrunk", "VerifiedRows", "ahead_allowed"]


def ahead_allowed(finished: Sequence[bool], counts: Sequence[int], room: Optional[Sequence[int]]) -> bool:
    """Whether a verify's read allows the launched rest of the iteration: every request goes on and
    stays inside its context next iteration (`room[b]` tokens)."""
    return room is not None and not any(finished) and all(c <= r for c, r in zip(counts, room))


@dataclass
class Launched:
    """Launched results waiting for their phase call: `expect` names the phase that takes them next
    and `key` the object it must be called with (identity)."""

    bs: int
    expect: str
    key: Any
    extend: ExtendCoreOut
    draft: DraftCoreOut
    slots: torch.Tensor  # (bs, num_draft) target slots of the launched verify
    verify: VerifyCoreOut  # kept views (`GraphRunner.kept`), filled by the next ahead graph or `_save_verify`
    verify_slots: torch.Tensor  # (bs, num_draft) `slots` as kept views, filled alike (the verify phase's)
    sim: bool
    rows: "HostRows"  # the launched verify's tokens and counts, copied to the host as it finishes


class HostRows:
    """`cat(accept_tokens, num_correct)` of a verify, copied to the host right behind it.

    The copy (into pinned memory, with an event, on CUDA) is queued before the host bookkeeping's
    own kernels, so the host's read waits for the verify only, not for everything queued after it."""

    def __init__(self, accept_tokens: torch.Tensor, num_correct: torch.Tensor, pinned: Optional[torch.Tensor],
                 stacked: Optional[torch.Tensor] = None) -> None:
        # `stacked`: the rows already stacked on the device (inside the verify graph), else stacked here
        both = stacked if stacked is not None else stacked_rows(accept_tokens, num_correct)
        self.event = None
        if pinned is None or not both.is_cuda:
            self.host = both.cpu() if both.is_cuda else both.clone()  # (`stacked` is overwritten by the next verify)
            return
        self.host = pinned[: both.numel()].view(both.shape)
        self.host.copy_(both, non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record()

    def tolist(self) -> list:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


class VerifiedRows(NamedTuple):
    """What the last verify read, kept by its graph for the launched draft-extend (`GraphRunner._verified`)."""

    seq_lens: torch.Tensor  # (max_bs,) lengths before the verify
    req_pool_indices: torch.Tensor  # (max_bs,) request rows
    slots: torch.Tensor  # (max_bs, num_draft) target slots of the tree nodes


class Prepared(NamedTuple):
    """What `prepare_ahead` allocated and staged for one launch."""

    bs: int
    sim: bool
    ext_slots: torch.Tensor  # (bs, num_steps + 1) draft slots of the launched draft-extend
    slots: torch.Tensor  # (bs, num_draft) target slots of the launched verify
    sim_state: Optional[torch.Tensor]  # the simulated-acceptance generator before its draw
    staged: bool  # the slots were allocated here (torch bookkeeping); else the ahead graph allocates them


class LiveRows(NamedTuple):
    """The verify input's fields a launched draft-extend's rows need, for the requests that go on."""

    seq_lens: torch.Tensor  # (m,) lengths before the verify
    req_pool_indices: torch.Tensor  # (m,) request rows


class Shrunk(NamedTuple):
    """What verify's output needs when some requests finished and the launch went on for the others
    (`executors.ahead_shrink`): the live requests' rows of the verify (compacted, as the launched
    draft-extend read them) and the whole batch's accepted nodes and host read."""

    live: LiveRows
    out: Optional[VerifyCoreOut]  # (m, ...) the live requests' verify outputs (torch bookkeeping; else None)
    slots: Optional[torch.Tensor]  # (m, num_draft) their tree slots (torch bookkeeping; else None)
    accept_index: torch.Tensor  # (bs, num_steps + 1) the whole batch's, before the stops' cut
    counts: list[int]  # (bs,) tokens each request emits
    finished: list[bool]  # (bs,)
    rows: list[list[int]]  # (bs,) the host token rows of the read
    values: torch.Tensor  # `verify.output_values` of the read, on the device (copied before the launch)
