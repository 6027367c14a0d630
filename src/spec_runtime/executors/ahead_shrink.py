"""Launch-ahead across finishing requests (docs/runtime-internals.md, "Finishing requests").

When a greedy verify's read finds that some requests finished and the others go on (each inside its
context), the rest of the iteration is still launched ahead, for the requests that go on: their rows
of the verify just read are moved to the front of their (possibly smaller) bucket, on the device,
where the launched draft-extend reads them, and the finished requests' tree slots go back to the
pool (nothing of theirs is committed: the engine frees their rows right after). The next iteration
then starts from launched graphs as a steady one does, where the host path ran the filtered
draft-extend, the next draft and verify eagerly (about 170 eager ops at a batch of four).

`AheadShrink` is a part of `executors.ahead.LaunchAhead` (itself a part of `GraphRunner`), using the
runner's buffers, graphs and the state `GraphRunner.setup` creates.
"""

from collections.abc import Callable, Sequence
from typing import Optional

import torch

from spec_schema import VerifyInput, VerifyOutput

from ..core_types import VerifyCoreOut
from ..verify import output_values
from .ahead_state import LiveRows, Shrunk
from .graphs import copy_all, head_rows

__all__ = ["AheadShrink"]


class AheadShrink:
    """Launch-ahead for the requests that go on when others finish (see the module docstring)."""

    def may_shrink(self, finished: Sequence[bool], counts: Sequence[int], room: Optional[Sequence[int]]) -> bool:
        """After the read, for a launch prepared (not launched) before it: some requests finished, at
        least one goes on, and every one that goes on stays inside its context next iteration."""
        return (self._prepared is not None and room is not None and any(finished) and not all(finished)
                and all(c <= r for c, r, done in zip(counts, room, finished) if not done))

    def launch_shrunk(self, inp: VerifyInput, counts: list[int], finished: list[bool], rows: list[list[int]],
                      room: Sequence[int], sim: bool,
                      build: Callable[..., VerifyOutput]) -> VerifyOutput:
        """Launch the rest of the iteration for the requests that go on (`may_shrink`): the prepared
        launch (for the whole batch) is cancelled, a launch prepared for them, their rows compacted
        (`_compact`) and the launch queued (`launch_ahead`); then the finished requests' tree slots are
        freed. The VerifyOutput is `build(ext_slots, live counts, rows, Shrunk)`."""
        bs = len(finished)
        live = [b for b, done in enumerate(finished) if not done]
        done = [b for b, fin in enumerate(finished) if fin]
        m = len(live)
        old, new = self.bucket_for(bs), self.bucket_for(m)
        n = self.rt.spec_config.num_draft_tokens
        # the bucket's rows past the live ones are padding (`_nlive`): any row fills them
        perm = live + [live[0]] * (new - m)
        # the compaction's rows and the output's values in one copy, before the launch: the stream is
        # idle after the read (a copy from pageable memory behind the launch would wait for it)
        values = output_values(rows, counts, finished, self.rt.spec_config.num_steps + 1)
        index = torch.tensor(perm + [(p - i) * n for i, p in enumerate(perm)] + done + values, dtype=torch.int64)
        index = index.to(self.rt.device)
        perm_d, shift_d = index[:new], index[new: 2 * new]
        done_d, values_d = index[2 * new: 2 * new + len(done)], index[2 * new + len(done):]
        vo = self._vout_full[(old, True, sim)]
        accept_index = vo.accept_index[:bs].clone()  # the whole batch's, for the output
        done_slots = self._verified.slots.index_select(0, done_d)  # (the compaction overwrites them)
        self.cancel_ahead()
        if not self.prepare_ahead(True, [room[b] for b in live], m, sim):  # (fewer rows than the prepared launch)
            raise RuntimeError("launch-ahead: a launch prepared for the whole batch cannot be prepared for part of it")
        self._compact(vo, old, new, perm_d, shift_d, sim)
        ext_slots = self.launch_ahead()
        self.ahead_stats["shrunk"] += 1
        live_d = perm_d[:m]
        live_rows = LiveRows(inp.seq_lens.index_select(0, live_d), inp.req_pool_indices.index_select(0, live_d))
        live_counts = [counts[b] for b in live]
        out = slots = built = None
        if self.backend.bookkeeping == "triton":  # the launched graph built the live rows' output
            built = self.ahead_rows(m, sum(live_counts))
        else:  # the live rows as the launched graph kept them (compacted)
            out = head_rows(self.kept.keep("verify", self._vout_full[(new, True, sim)], new, copy=False), new, m)
            slots = self.kept.keep_tensor("verify_slots", self._verified.slots[:new], new, copy=False)[:m]
        # the finished requests' tree slots go back behind the launch (which none of them reaches; after
        # the host counted the launched graph's own slot work): the device idles until the launch, so
        # the host does before it only what the launch reads
        self.rt.target_cache.free_slots(done_slots, check=False)
        return build(ext_slots, live_counts, built,
                     Shrunk(live_rows, out, slots, accept_index, counts, finished, rows, values_d))

    def _compact(self, vo: VerifyCoreOut, old: int, new: int, perm: torch.Tensor, shift: torch.Tensor,
                 sim: bool) -> None:
        """Row i of the `new` bucket's verify outputs and of `_verified` <- row `perm[i]` of the `old`
        bucket's (the verify just read): what the launched draft-extend and the `ahead` graph's output
        read. Accepted nodes are global tree rows (`b * num_draft + node`): moved by `shift` (`(perm[i]
        - i) * num_draft`); the captured hidden states move with their requests' trees."""
        v, n = self._verified, self.rt.spec_config.num_draft_tokens
        accept_index = vo.accept_index.index_select(0, perm)
        moved = VerifyCoreOut(torch.where(accept_index >= 0, accept_index - shift[:, None], accept_index),
                              vo.accept_tokens.index_select(0, perm), vo.num_correct.index_select(0, perm), None)
        pairs = [(dst[:new], src[:old].index_select(0, perm)) for dst, src in
                 ((v.seq_lens, v.seq_lens), (v.req_pool_indices, v.req_pool_indices), (v.slots, v.slots))]
        captured = None
        if vo.captured is not None:  # the verify buffer's rows (every bucket's view starts at row 0)
            captured = vo.captured.view(old, n, -1).index_select(0, perm).view(new * n, -1)
        graph = self.graphs.graphs.get(self._key("verify", new, True, sim))
        if graph is None:  # the cores run eagerly ("static"): the moved rows are the bucket's outputs
            if captured is not None:
                pairs.append((vo.captured[: new * n], captured))
            dst = VerifyCoreOut(moved.accept_index, moved.accept_tokens, moved.num_correct,
                                None if captured is None else vo.captured[: new * n])
        else:  # a captured `ahead` graph reads the bucket's verify graph's own outputs
            dst = graph.out
            pairs += [(dst.accept_index, moved.accept_index), (dst.accept_tokens, moved.accept_tokens),
                      (dst.num_correct, moved.num_correct)]
            if captured is not None:
                pairs.append((dst.captured, captured))
        self._vout_full[(new, True, sim)] = dst
        copy_all(pairs)
