"""The eager executor: the phase cores on the live tensors, with the reference models and the
validating torch functions (`RuntimeState.core_ops`). The CPU default and the reference every other
executor is compared with; nothing is launched ahead, so the `take_*` calls find nothing."""

from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch

from spec_schema import DraftExtendInput, DraftInput, VerifyInput, VerifyOutput

from ..core_types import (
    BranchSlots,
    CoreOps,
    DraftCoreIn,
    DraftCoreOut,
    ExtendCoreIn,
    ExtendCoreOut,
    VerifyCoreIn,
    VerifyCoreOut,
)
from ..draft import draft_core
from ..executor import HostRows, StopRead
from ..extend import draft_extend_core
from ..state import RuntimeState
from ..verify import verify_core

__all__ = ["EagerExecutor"]


class EagerExecutor:
    """`executor.Executor` on live tensors. The ops are built per call: a fault injected after the
    runtime was created (the bug zoo) still reaches them."""

    def __init__(self, rt: RuntimeState) -> None:
        self.rt = rt

    def draft_scratch(self, bs: int) -> BranchSlots:
        """Branch slots from the draft pool (`pool_slots`, freed by the phase once the tree is built),
        laid out by step; the spare last column is -1."""
        config = self.rt.spec_config
        k, steps = config.topk, config.num_steps
        temp = self.rt.draft_cache.alloc_slots(bs * k * (steps - 1))
        by_step = temp.view(steps - 1, bs, k).permute(1, 2, 0)
        return BranchSlots(torch.cat([by_step, temp.new_full((bs, k, 1), -1)], dim=2), None, temp)

    def draft(self, live: DraftCoreIn) -> DraftCoreOut:
        """`draft_core` with the reference ops."""
        return draft_core(self.rt.core_ops(), live)

    def verify(self, live: VerifyCoreIn) -> VerifyCoreOut:
        """`verify_core` with the reference ops."""
        return verify_core(self.rt.core_ops(), live)

    def fits_extend(self, inp: DraftExtendInput) -> bool:
        """Every input fits: ragged rows run as they are."""
        return True

    def draft_extend(self, live: ExtendCoreIn) -> ExtendCoreOut:
        """`draft_extend_core` with the reference ops."""
        return draft_extend_core(self.rt.core_ops(), live)

    def eager_ops(self) -> CoreOps:
        """The reference ops."""
        return self.rt.core_ops()

    def read_verify(self, inp: VerifyInput, out: VerifyCoreOut, slots: torch.Tensor, host_rows: Optional[HostRows],
                    greedy: bool, sim: bool, budget: Sequence[int], room: Optional[Sequence[int]],
                    read: Callable[[Optional[HostRows]], StopRead],
                    build: Callable[..., VerifyOutput], shrink: bool = False,
                    stop_tokens: bool = True) -> tuple[StopRead, Optional[VerifyOutput]]:
        """The read only: nothing is launched ahead."""
        return read(host_rows), None

    def take_draft(self, inp: DraftInput) -> Optional[DraftCoreOut]:
        """Nothing launched."""
        return None

    def take_verify(self, inp: VerifyInput, greedy: bool,
                    sim: bool) -> Optional[tuple[torch.Tensor, VerifyCoreOut, HostRows]]:
        """Nothing launched."""
        return None

    def take_extend(self, inp: DraftExtendInput) -> Optional[ExtendCoreOut]:
        """Nothing launched."""
        return None

    def note_output(self, obj: Any) -> None:
        """Nothing launched: nothing to match."""

    def discard_ahead(self) -> None:
        """Nothing launched: nothing to drop."""
