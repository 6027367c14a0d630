"""The one interface through which the phases (`draft.py`, `verify.py`, `extend.py`) drive an executor.

A phase prepares its core's inputs on the host, hands them to `rt.runner` (an `Executor`), and
builds its schema object from what comes back. The executors (`executors/`) satisfy this protocol:

- `executors.eager.EagerExecutor` ("eager"): the cores on the live tensors with the reference models;
  nothing is ever launched ahead.
- `executors.static.GraphRunner` ("static", "cuda_graph"): the cores on bucketed static buffers, eagerly
  or replayed from CUDA graphs, with launch-ahead (`executors.ahead`): after a greedy verify the rest
  of the iteration and the next verify may be queued before the host has read the verify. The phases
  take such results only when called with the very object they belong to (`take_*`, `note_output`).

`EXECUTOR_METHODS` lists the protocol's methods; a CPU test checks that every executor has them and
that the phases call no other method of `rt.runner`.
"""

from collections.abc import Callable, Sequence
from typing import Any, Optional, Protocol, runtime_checkable

import torch

from spec_schema import DraftExtendInput, DraftInput, VerifyInput, VerifyOutput

from .core_types import (
    BranchSlots,
    CoreOps,
    DraftCoreIn,
    DraftCoreOut,
    ExtendCoreIn,
    ExtendCoreOut,
    VerifyCoreIn,
    VerifyCoreOut,
)

__all__ = ["EXECUTOR_METHODS", "Executor", "HostRows", "StopRead"]

StopRead = tuple[list[int], list[bool], list[list[int]]]
"""What verify's one host read gives, per request: tokens to emit, finished, and the host token rows."""


@runtime_checkable
class HostRows(Protocol):
    """A verify's tokens and counts copied to the host behind it (`executors.ahead.HostRows`)."""

    def tolist(self) -> list:
        """The rows as host lists (waits for the copy only)."""
        ...


@runtime_checkable
class Executor(Protocol):
    """What the phase functions call on `Runtime.runner` (and the engine: `discard_ahead`)."""

    # ---- running the cores ----------------------------------------------------------------------

    def draft_scratch(self, bs: int) -> BranchSlots:
        """The draft KV slots of the branches' temporary tokens for a batch of `bs` requests."""
        ...

    def draft(self, live: DraftCoreIn) -> DraftCoreOut:
        """The draft core (multi-step expansion, tree layout) over the live batch."""
        ...

    def verify(self, live: VerifyCoreIn) -> VerifyCoreOut:
        """The verify core (target tree forward, acceptance) over the live batch."""
        ...

    def fits_extend(self, inp: DraftExtendInput) -> bool:
        """Whether `draft_extend` can run this input's rows (else the phase runs the core uncaptured
        with `eager_ops()`: a prefill's prompts on the static path)."""
        ...

    def draft_extend(self, live: ExtendCoreIn) -> ExtendCoreOut:
        """The draft-extend core over the live batch."""
        ...

    def eager_ops(self) -> CoreOps:
        """The models and ops of uncaptured calls (prefill; a prefill's ragged draft-extend)."""
        ...

    # ---- reading a verify, and what was launched ahead ------------------------------------------

    def read_verify(self, inp: VerifyInput, out: VerifyCoreOut, slots: torch.Tensor, host_rows: Optional[HostRows],
                    greedy: bool, sim: bool, budget: Sequence[int], room: Optional[Sequence[int]],
                    read: Callable[[Optional[HostRows]], StopRead],
                    build: Callable[..., VerifyOutput], shrink: bool = False,
                    stop_tokens: bool = True) -> tuple[StopRead, Optional[VerifyOutput]]:
        """Read the verify `out` once on the host (`read`: the stops, the one sync) and return what it
        read, with the VerifyOutput `build(ext_slots, counts, rows)` gave when the rest of the iteration
        was launched ahead (None: the phase builds its output the host way); `rows`: the output's
        tensors as the launched graphs built them (`spec_kernels.verify_output.AheadOutput`), or None
        (the phase builds them from device counts). `shrink`: when some requests finish, the rest of the
        iteration may still be launched for the others (`build(..., shrunk)` then gives the whole
        batch's output, `executors.ahead_shrink`). `stop_tokens`: some request of the batch stops on a
        token (EOS or a stop id; only then can the read refuse a launch queued before it for any
        reason but a budget or the context)."""
        ...

    def take_draft(self, inp: DraftInput) -> Optional[DraftCoreOut]:
        """The launched draft's tree if `inp` is the object it belongs to (else discard what was launched)."""
        ...

    def take_verify(self, inp: VerifyInput, greedy: bool,
                    sim: bool) -> Optional[tuple[torch.Tensor, VerifyCoreOut, HostRows]]:
        """`(slots, outputs, host rows)` of the launched verify if `inp` is the tree it belongs to."""
        ...

    def take_extend(self, inp: DraftExtendInput) -> Optional[ExtendCoreOut]:
        """The launched draft-extend's outputs if `inp` is the input they belong to."""
        ...

    def note_output(self, obj: Any) -> None:
        """The phase object built from launched results: the next phase must be called with it."""
        ...

    def discard_ahead(self) -> None:
        """Drop launched results nobody asked for (the batch changed)."""
        ...


EXECUTOR_METHODS: tuple[str, ...] = tuple(
    name for name, value in vars(Executor).items() if callable(value) and not name.startswith("_")
)
"""The names of the protocol's methods."""
